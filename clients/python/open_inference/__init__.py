"""A client of the Open Inference Protocol (KServe v2) for attnserve.

Two transports with the same methods: GrpcClient (inference.
GRPCInferenceService, stubs generated from proto/inference and committed in
clients/python/inference) and HttpClient (the protocol's REST/JSON
endpoints, with urllib). Each has server_live, server_ready,
server_metadata, model_ready, model_metadata and infer; infer takes numpy
arrays (float32, float16, bool, uint8; torch.bfloat16 tensors for BF16) and
returns an InferResult, a dict of output name -> numpy array. Tensors in
shared memory registered with the server (attnserve_client's
SharedMemoryRegion) go by reference with Triton's parameters
(SharedMemoryInput, shared_memory_parameters()).
"""
from open_inference.grpc_client import GrpcClient
from open_inference.http_client import HttpClient
from open_inference.tensors import (WIRE_DTYPES, InferenceServerError,
                                    InferResult, SharedMemoryInput,
                                    shared_memory_parameters)

__all__ = ["GrpcClient", "HttpClient", "InferenceServerError",
           "InferResult", "SharedMemoryInput", "WIRE_DTYPES",
           "shared_memory_parameters"]
