"""Multi-head attention weights: inline AttentionWeights and model folders.

A model repository holds DIR/NAME/config.pbtxt (a text-format ModelConfig)
and DIR/NAME/weights.safetensors, whose tensors may carry the names of a
PyTorch nn.MultiheadAttention state_dict as saved.
"""
import json
import os
import struct

import numpy as np
from google.protobuf import text_format

from attnserve.v1 import attention_pb2 as pb
from attnserve_client.tensors import _is_torch, to_tensor

try:
    import torch
except ImportError:
    torch = None

_SAFETENSORS_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "BF16": np.dtype("<u2"),  # the bits, as the wire carries them
}


def _encode(value):
    """(safetensors dtype, shape, bytes) of an array or tensor."""
    if _is_torch(value):
        value = value.detach().cpu().contiguous()
        if value.dtype == torch.bfloat16:
            return "BF16", tuple(value.shape), \
                value.view(torch.int16).numpy().tobytes()
        value = value.numpy()
    array = np.asarray(value)
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    native = array.dtype.newbyteorder("=")
    for code, dtype in _SAFETENSORS_DTYPES.items():
        if code != "BF16" and dtype.newbyteorder("=") == native:
            data = array.astype(dtype, copy=False).tobytes()
            return code, array.shape, data
    raise TypeError(f"no safetensors dtype for {array.dtype}")


def save_safetensors(path, tensors, metadata=None):
    """Writes `tensors` (name -> array or tensor) as a safetensors file.

    The format: 8 bytes little-endian header length, a JSON header naming
    each tensor's dtype, shape and byte range, then the raw data. float64
    is stored as F32.
    """
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        code, shape, data = _encode(value)
        header[name] = {"dtype": code, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keeps the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def load_safetensors(path):
    """Reads a safetensors file: (name -> numpy array, metadata dict).

    BF16 tensors come back as their uint16 bits.
    """
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + length])
    metadata = header.pop("__metadata__", {})
    base = 8 + length
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        tensors[name] = np.frombuffer(data, dtype=dtype, count=(end - begin)
                                      // dtype.itemsize, offset=base + begin
                                      ).reshape(info["shape"])
    return tensors, metadata


def _split_fused_bias(state_dict):
    """The state_dict without None entries, in_proj_bias split if needed.

    nn.MultiheadAttention with kdim or vdim != embed_dim saves separate
    q/k/v_proj_weight but still one in_proj_bias [3E]; attnserve takes a
    fused bias only with the fused weight.
    """
    tensors = {k: v for k, v in state_dict.items() if v is not None}
    if "in_proj_bias" in tensors and "in_proj_weight" not in tensors:
        bias = tensors.pop("in_proj_bias")
        third = bias.shape[0] // 3
        for i, name in enumerate(("q_proj_bias", "k_proj_bias",
                                  "v_proj_bias")):
            tensors[name] = bias[i * third:(i + 1) * third]
    return tensors


def attention_weights(state_dict, num_heads):
    """AttentionWeights from an nn.MultiheadAttention state_dict.

    Also takes the AttentionWeights field names (q_proj_weight, ...). None
    entries are skipped; bias_k and bias_v have no wire field.
    """
    weights = pb.AttentionWeights(num_heads=num_heads)
    fields = pb.AttentionWeights.DESCRIPTOR.fields_by_name
    for name, value in _split_fused_bias(state_dict).items():
        field = name.replace(".", "_")  # out_proj.weight -> out_proj_weight
        if field not in fields or field == "num_heads":
            raise ValueError(f"{name}: not an AttentionWeights tensor")
        getattr(weights, field).CopyFrom(to_tensor(value))
    return weights


def save_model(repository, name, state_dict, num_heads,
               compute_dtype=pb.DATA_TYPE_FLOAT32, description="",
               default_causal=False, default_scale=None):
    """Writes a model folder REPOSITORY/NAME for attnserve; returns its path.

    `state_dict` as for attention_weights(); its names are stored as given
    (but for a fused in_proj_bias next to separate weights, which is split).
    The server loads the folder at start-up or on SIGHUP.
    """
    folder = os.path.join(repository, name)
    os.makedirs(folder, exist_ok=True)
    config = pb.ModelConfig(num_heads=num_heads, compute_dtype=compute_dtype,
                            description=description,
                            default_causal=default_causal)
    if default_scale is not None:
        config.default_scale = default_scale
    save_safetensors(os.path.join(folder, "weights.safetensors"),
                     _split_fused_bias(state_dict))
    with open(os.path.join(folder, "config.pbtxt"), "w") as f:
        f.write(text_format.MessageToString(config))
    return folder
