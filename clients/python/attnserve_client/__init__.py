"""Python client helpers for attnserve's gRPC API (package attnserve.v1).

The message and stub modules (`attnserve.v1.attention_pb2`,
`attnserve.v1.attention_pb2_grpc`) are generated from proto/ and committed
next to this package (clients/python/attnserve/v1; generate_stubs.sh makes
them again), so putting clients/python on PYTHONPATH, or installing it with
pip, is all the setup there is.
"""
try:
    from attnserve.v1 import attention_pb2 as pb
    from attnserve.v1 import attention_pb2_grpc as pb_grpc
except ImportError as error:  # pragma: no cover - depends on the setup
    raise ImportError(
        f"{error}: attnserve_client needs grpcio and protobuf >= 3.20 (on "
        "Debian: apt-get install python3-grpcio python3-protobuf "
        "python3-numpy)") from error

from attnserve_client.channel import MESSAGE_SIZE_OPTIONS, connect
from attnserve_client.memory import keep_large_buffers
from attnserve_client.models import (attention_weights, load_safetensors,
                                     save_model, save_safetensors)
from attnserve_client.process import ServerProcess
from attnserve_client.shared_memory import SharedMemoryRegion
from attnserve_client.tensors import to_numpy, to_tensor, to_torch
from attnserve_client.transfer import (TransferError, export_session,
                                       import_session)

__all__ = [
    "MESSAGE_SIZE_OPTIONS", "attention_weights", "connect",
    "export_session", "import_session", "keep_large_buffers",
    "load_safetensors", "pb", "pb_grpc", "save_model", "save_safetensors",
    "ServerProcess", "SharedMemoryRegion", "to_numpy", "to_tensor",
    "to_torch", "TransferError",
]
