"""Python client helpers for attnserve's gRPC API (package attnserve.v1).

The message and stub modules are generated from proto/ at build time
(`attnserve.v1.attention_pb2`, `attnserve.v1.attention_pb2_grpc`); put the
folder holding them on PYTHONPATH, e.g. build/clients/python_gen.
"""
try:
    from attnserve.v1 import attention_pb2 as pb
    from attnserve.v1 import attention_pb2_grpc as pb_grpc
except ImportError as error:  # pragma: no cover - depends on the setup
    raise ImportError(
        "attnserve.v1 stubs not found: build the project (target "
        "attnserve_python_stubs) and add build/clients/python_gen to "
        "PYTHONPATH") from error

from attnserve_client.channel import MESSAGE_SIZE_OPTIONS, connect
from attnserve_client.memory import keep_large_buffers
from attnserve_client.models import (attention_weights, load_safetensors,
                                     save_model, save_safetensors)
from attnserve_client.process import ServerProcess
from attnserve_client.shared_memory import SharedMemoryRegion
from attnserve_client.tensors import to_numpy, to_tensor, to_torch

__all__ = [
    "MESSAGE_SIZE_OPTIONS", "attention_weights", "connect",
    "keep_large_buffers",
    "load_safetensors", "pb", "pb_grpc", "save_model", "save_safetensors",
    "ServerProcess", "SharedMemoryRegion", "to_numpy", "to_tensor",
    "to_torch",
]
