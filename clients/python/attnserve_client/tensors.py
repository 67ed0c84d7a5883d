"""Conversions between numpy arrays or torch tensors and attnserve.v1.Tensor.

The wire carries little-endian, row-major bytes in `raw_data`. numpy has no
bfloat16, so BFLOAT16 comes in and out as torch.bfloat16 tensors, or is
widened to float32 by to_numpy.
"""
import numpy as np

from attnserve.v1 import attention_pb2 as pb

try:
    import torch
except ImportError:  # optional: numpy covers every dtype but bfloat16
    torch = None

_NUMPY_TO_WIRE = {
    np.dtype(np.float32): pb.DATA_TYPE_FLOAT32,
    np.dtype(np.float16): pb.DATA_TYPE_FLOAT16,
    np.dtype(np.bool_): pb.DATA_TYPE_BOOL,
    np.dtype(np.uint8): pb.DATA_TYPE_UINT8,
}
_WIRE_TO_NUMPY = {
    pb.DATA_TYPE_FLOAT32: np.dtype("<f4"),
    pb.DATA_TYPE_FLOAT16: np.dtype("<f2"),
    pb.DATA_TYPE_BOOL: np.dtype(np.bool_),
    pb.DATA_TYPE_UINT8: np.dtype(np.uint8),
    pb.DATA_TYPE_BFLOAT16: np.dtype("<u2"),  # the bits; see to_numpy
}


def _is_torch(value):
    return torch is not None and isinstance(value, torch.Tensor)


def _wire_array(value):
    """(wire dtype, numpy array) of a numpy array, torch tensor or lists.

    The array is the values as they are, without a copy: possibly strided,
    big-endian or float64. The caller converts them to the wire layout,
    _WIRE_TO_NUMPY[dtype], in the one copy it makes. torch.bfloat16 comes as
    its uint16 bits.
    """
    if _is_torch(value):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            bits = value.view(torch.int16).numpy().view(np.uint16)
            return pb.DATA_TYPE_BFLOAT16, bits
        value = value.numpy()
    array = np.asarray(value)
    native = array.dtype.newbyteorder("=")
    if native == np.float64:
        return pb.DATA_TYPE_FLOAT32, array
    if native not in _NUMPY_TO_WIRE:
        raise TypeError(f"no wire dtype for {array.dtype}; use float32, "
                        "float16, bfloat16 (torch), bool or uint8")
    return _NUMPY_TO_WIRE[native], array


def to_tensor(value):
    """Wire Tensor from a numpy array, a torch tensor or nested lists.

    float64 is sent as FLOAT32 (the wire has no float64); torch.bfloat16 as
    BFLOAT16; float16, bool and uint8 as themselves.
    """
    dtype, array = _wire_array(value)
    # tobytes() writes row-major; astype converts only what differs from the
    # wire (float64, big-endian).
    array = array.astype(_WIRE_TO_NUMPY[dtype], copy=False)
    return pb.Tensor(dtype=dtype, shape=array.shape, raw_data=array.tobytes())


def _raw_array(tensor):
    shape = tuple(tensor.shape)
    if tensor.float_data and not tensor.raw_data:
        return np.asarray(tensor.float_data, dtype=np.float32).reshape(shape)
    if tensor.dtype not in _WIRE_TO_NUMPY:
        raise ValueError(f"unknown wire dtype {tensor.dtype}")
    dtype = _WIRE_TO_NUMPY[tensor.dtype]
    # A view of the message's bytes: no copy, read-only.
    return np.frombuffer(tensor.raw_data, dtype=dtype).reshape(shape)


def to_numpy(tensor, copy=False):
    """numpy array of a wire Tensor; BFLOAT16 is widened to float32.

    Without `copy` the array is a read-only view of the message's bytes
    where the dtype allows.
    """
    array = _raw_array(tensor)
    if tensor.dtype == pb.DATA_TYPE_BFLOAT16 and not tensor.float_data:
        # bfloat16 is the upper half of a float32.
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.copy() if copy else array


def to_torch(tensor):
    """torch tensor of a wire Tensor, keeping BFLOAT16 as torch.bfloat16."""
    if torch is None:
        raise ImportError("to_torch needs PyTorch")
    array = _raw_array(tensor)
    if tensor.dtype == pb.DATA_TYPE_BFLOAT16 and not tensor.float_data:
        bits = torch.from_numpy(array.view(np.int16).copy())
        return bits.view(torch.bfloat16)
    # torch.from_numpy wants a writable array; the message's bytes are not.
    return torch.from_numpy(array.copy())
