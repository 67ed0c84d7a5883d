"""Tensors of the Open Inference Protocol: datatypes, raw bytes and JSON.

The protocol names element types by strings ("FP32", "BF16", ...). Raw
tensor data is the elements row-major and little-endian without padding;
JSON data is the elements as numbers (booleans for BOOL), flat row-major.
numpy has no bfloat16: BF16 inputs are torch.bfloat16 tensors, and BF16
results come back widened to float32 (every bfloat16 is a float32).
"""
import numpy as np

try:
    import torch
except ImportError:  # optional: only bfloat16 inputs need it
    torch = None

# The wire layout of each datatype this client sends and reads; BF16 as its
# bits, the upper half of a float32.
WIRE_DTYPES = {
    "FP32": np.dtype("<f4"),
    "FP16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
}

_NUMPY_DATATYPES = {
    np.dtype(np.float32): "FP32",
    np.dtype(np.float16): "FP16",
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "UINT8",
}


class SharedMemoryInput:
    """An input whose elements are in a shared-memory region registered
    with the server, named by the protocol's (Triton's) input parameters
    instead of being sent."""

    def __init__(self, datatype, shape, region, byte_size, offset=0):
        self.datatype = datatype
        self.shape = [int(d) for d in shape]
        self.parameters = shared_memory_parameters(region, byte_size, offset)


def shared_memory_parameters(region, byte_size, offset=0):
    """The parameters that place a tensor in shared memory, for
    SharedMemoryInput or a requested output's (name, parameters)."""
    return {"shared_memory_region": region,
            "shared_memory_byte_size": int(byte_size),
            "shared_memory_offset": int(offset)}


def in_shared_memory(parameters):
    return "shared_memory_region" in (parameters or {})


def input_array(value):
    """(datatype, array in the wire layout) of a numpy array or torch tensor.

    float32, float16, bool and uint8 arrays keep their type; a
    torch.bfloat16 tensor becomes BF16 (as uint16 bits). Other types are
    refused rather than converted: the datatype is part of the request.
    """
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous()
        if value.dtype == torch.bfloat16:
            return "BF16", value.view(torch.int16).numpy().view("<u2")
        value = value.numpy()
    array = np.asarray(value)
    native = array.dtype.newbyteorder("=")
    if native not in _NUMPY_DATATYPES:
        raise TypeError(f"no Open Inference datatype for {array.dtype}; "
                        "use float32, float16, bool, uint8 or "
                        "torch.bfloat16")
    datatype = _NUMPY_DATATYPES[native]
    return datatype, np.ascontiguousarray(
        array.astype(WIRE_DTYPES[datatype], copy=False))


def bf16_to_float32(bits):
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def _wire_dtype(datatype):
    if datatype not in WIRE_DTYPES:
        raise ValueError(f"datatype {datatype!r} is not one of "
                         f"{sorted(WIRE_DTYPES)}")
    return WIRE_DTYPES[datatype]


def from_raw(datatype, shape, data):
    """numpy array of raw tensor bytes (BF16 widened to float32)."""
    dtype = _wire_dtype(datatype)
    shape = tuple(int(d) for d in shape)
    count = int(np.prod(shape, dtype=np.int64))
    if len(data) != count * dtype.itemsize:
        raise ValueError(f"{len(data)} bytes for {datatype} {list(shape)}, "
                         f"expected {count * dtype.itemsize}")
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    if datatype == "BF16":
        return bf16_to_float32(array)
    return array.astype(dtype.newbyteorder("="))  # a writable copy


def to_json_data(datatype, array):
    """The flat list of a wire-layout array's elements as JSON values.

    BF16 bits are sent as the numbers they stand for (exact in a double).
    """
    if datatype == "BF16":
        array = bf16_to_float32(array)
    return array.ravel().tolist()


def from_json_data(datatype, shape, data):
    """numpy array of a JSON tensor's `data` (flat or nested)."""
    dtype = _wire_dtype(datatype)
    shape = tuple(int(d) for d in shape)
    flat = np.asarray(data, dtype=object).ravel()
    if datatype == "BOOL":
        if not all(isinstance(x, bool) for x in flat):
            raise ValueError("BOOL data must be JSON booleans")
        array = flat.astype(np.bool_)
    else:
        if any(isinstance(x, bool) or not isinstance(x, (int, float))
               for x in flat):
            raise ValueError(f"{datatype} data must be JSON numbers")
        # Through float64, where every value of these types is exact.
        array = flat.astype(np.float64)
        array = array.astype(np.float32 if datatype == "BF16"
                             else dtype.newbyteorder("="))
    if array.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"{array.size} elements for {datatype} "
                         f"{list(shape)}")
    return array.reshape(shape)


class InferResult(dict):
    """Output name -> numpy array (None for an output placed in shared
    memory), with the response's other fields.

    `datatypes` and `shapes` map output names to what the server declared;
    `response` is the response as received (protobuf message or JSON).
    """

    def __init__(self, outputs, model_name, model_version, request_id,
                 datatypes, shapes, parameters, response):
        super().__init__(outputs)
        self.model_name = model_name
        self.model_version = model_version
        self.id = request_id
        self.datatypes = datatypes
        self.shapes = shapes
        self.parameters = parameters
        self.response = response


class InferenceServerError(Exception):
    """An error answer: `grpc_code` (a grpc.StatusCode) over gRPC, or
    `http_status` and the decoded `body` over HTTP; `message` either way."""

    def __init__(self, message, grpc_code=None, http_status=None, body=None):
        where = grpc_code.name if grpc_code is not None else http_status
        super().__init__(f"{where}: {message}")
        self.message = message
        self.grpc_code = grpc_code
        self.http_status = http_status
        self.body = body
