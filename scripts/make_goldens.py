#!/usr/bin/python3
"""Writes the golden test vectors of tests/goldens (see tests/goldens/README.md).

Regenerate them, after changing a case below:

    /usr/bin/python3 scripts/make_goldens.py tests/goldens

Check that a folder holds what this script writes (ctest GoldensUpToDate):

    /usr/bin/python3 scripts/make_goldens.py --check tests/goldens

Needs Debian's python3-torch and python3-numpy, nothing else: the safetensors
files are written with struct and json.

Inputs are float32 (or bfloat16) values drawn from a counter-based generator
(splitmix64) with integer arithmetic only, so they are the same bytes on every
machine and with every NumPy or PyTorch version. Expected results are computed
from them in float64 with PyTorch and rounded to float32. Running the script
twice writes byte-identical files. Another BLAS or another CPU may sum in
another order and move a float64 result by a few units in its last place,
which can flip the last bit of its float32 rounding; --check therefore
accepts expected values within 2 float32 units in the last place (and says
so) when the bytes differ, and requires every input byte to match.
"""

import argparse
import json
import math
import os
import struct
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment


def splitmix64(x):
    """splitmix64's finalizer over a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Rng:
    """Seeded draws; every call reads a stream of its own."""

    def __init__(self, seed):
        self.seed = seed
        self.stream = 0

    def _bits24(self, count):
        """`count` 24-bit integers (int64): splitmix64 of a counter that starts
        at a hashed (seed, stream), so that streams do not overlap."""
        self.stream += 1
        key = np.array([self.seed, self.stream], dtype=np.uint64)
        base = splitmix64(splitmix64(key[:1]) + key[1:])
        counter = np.arange(count, dtype=np.uint64) * np.uint64(GOLDEN_GAMMA) + base
        return (splitmix64(counter) >> np.uint64(40)).astype(np.int64)

    def uniform(self, shape, low, high):
        """float32 in [low, high): 24-bit fractions, exact until scaled."""
        unit = self._bits24(math.prod(shape)).astype(np.float64) / 2.0**24
        return (low + (high - low) * unit).astype(np.float32).reshape(shape)

    def normal(self, shape, std=1.0, mean=0.0):
        """float32, about normal: the sum of 12 uniforms minus 6 (exact)."""
        count = math.prod(shape)
        total = sum(self._bits24(count) for _ in range(12)) - 6 * 2**24
        unit = total.astype(np.float64) / 2.0**24
        return (mean + std * unit).astype(np.float32).reshape(shape)

    def bits(self, shape, keep_probability):
        """uint8 0/1 mask, 1 (keep) with the given probability."""
        unit = self._bits24(math.prod(shape)) / 2.0**24
        return (unit < keep_probability).astype(np.uint8).reshape(shape)

    def linear(self, out_features, in_features, bias=True):
        """nn.Linear's default initialization: U(-1/sqrt(in), 1/sqrt(in))."""
        bound = 1.0 / math.sqrt(in_features)
        weight = self.uniform((out_features, in_features), -bound, bound)
        return weight, (self.uniform((out_features,), -bound, bound) if bias else None)


# --- safetensors ------------------------------------------------------------


def to_bf16(values):
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def from_bf16(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


DTYPES = {"F32": "<f4", "BF16": "<u2", "U8": "u1"}


def stored(array):
    """The safetensors dtype of an array as this script keeps it."""
    names = {np.float32: "F32", np.uint16: "BF16", np.uint8: "U8"}
    return names[array.dtype.type]


def encode(tensors, metadata):
    """safetensors bytes: header in insertion order, __metadata__ last, the
    JSON padded with spaces to a multiple of 8 bytes."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        dtype = stored(array)
        blob = np.ascontiguousarray(array, dtype=DTYPES[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def decode(data):
    """(tensors, metadata) of safetensors bytes; BF16 stays as uint16 bits."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    metadata = header.pop("__metadata__", {})
    body = data[8 + length :]
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        array = np.frombuffer(body[begin:end], dtype=DTYPES[entry["dtype"]])
        tensors[name] = array.reshape(entry["shape"])
    return tensors, metadata


# --- float64 reference -------------------------------------------------------


def f64(array):
    """float64 torch tensor of a stored input (bfloat16 widened exactly)."""
    if array.dtype == np.uint16:
        array = from_bf16(array)
    return torch.from_numpy(np.asarray(array, dtype=np.float64))


def attention(q, k, v, scale, temperature, causal, keep, bias):
    """softmax((q·kᵀ)·scale/temperature + bias) · v where `keep` and the
    causal rule allow; a row with nothing allowed gives zeros."""
    logits = q @ k.transpose(-1, -2) * scale / temperature
    if bias is not None:
        logits = logits + bias
    allowed = torch.ones_like(logits, dtype=torch.bool)
    if keep is not None:
        allowed = allowed & keep
    if causal:
        allowed = allowed & torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
    allowed = allowed & (logits != -math.inf)
    weights = torch.softmax(logits.masked_fill(~allowed, -math.inf), dim=-1)
    weights = torch.where(allowed.any(-1, keepdim=True), weights, torch.zeros_like(weights))
    return weights @ v, weights


def attention_options(metadata, head_dim):
    return dict(
        scale=float(metadata.get("scale", 1.0 / math.sqrt(head_dim))),
        temperature=float(metadata.get("temperature", 1.0)),
        causal=metadata.get("causal", "false") == "true",
    )


def split_mask(mask):
    """(keep, bias): a U8 mask keeps where nonzero, an F32 one is added."""
    if mask is None:
        return None, None
    if mask.dtype == np.uint8:
        return torch.from_numpy(mask != 0), None
    return None, f64(mask)


def attend(t, metadata):
    q, k, v = f64(t["query"]), f64(t["key"]), f64(t["value"])
    keep, bias = split_mask(t.get("attn_mask"))
    return attention(q, k, v, keep=keep, bias=bias, **attention_options(metadata, q.shape[-1]))


def heads(x, weight, bias, num_heads):
    """x·Wᵀ + b split into heads: [B, L, E] -> [B, H, L, d]."""
    y = x @ f64(weight).T
    if bias is not None:
        y = y + f64(bias)
    return y.reshape(y.shape[0], y.shape[1], num_heads, -1).transpose(1, 2)


def head_mask(mask):
    """attn_mask [Lq, Lk], [B, Lq, Lk] or [B, H, Lq, Lk] as [B|1, H|1, Lq, Lk]."""
    while mask is not None and mask.dim() < 4:
        mask = mask.unsqueeze(0 if mask.dim() == 2 else 1)
    return mask


def multi_head_attend(t, metadata):
    num_heads = int(metadata["num_heads"])
    query = f64(t["query"])
    key = f64(t["key"]) if "key" in t else query
    value = f64(t["value"]) if "value" in t else key
    q = heads(query, t["q_proj_weight"], t.get("q_proj_bias"), num_heads)
    k = heads(key, t["k_proj_weight"], t.get("k_proj_bias"), num_heads)
    v = heads(value, t["v_proj_weight"], t.get("v_proj_bias"), num_heads)
    keep, bias = split_mask(t.get("attn_mask"))
    keep, bias = head_mask(keep), head_mask(bias)
    if "key_padding_mask" in t:
        padding = torch.from_numpy(t["key_padding_mask"] != 0)[:, None, None, :]
        keep = padding if keep is None else keep & padding
    options = attention_options(metadata, q.shape[-1])
    out, weights = attention(q, k, v, keep=keep, bias=bias, **options)
    out = out.transpose(1, 2).reshape(query.shape[0], query.shape[1], -1)
    if "out_proj_weight" in t:
        out = out @ f64(t["out_proj_weight"]).T
        if "out_proj_bias" in t:
            out = out + f64(t["out_proj_bias"])
    return out, weights


def layer_norm(t, metadata):
    x = f64(t["input"])
    ndim = int(metadata.get("normalized_ndim", 1))
    gamma = f64(t["gamma"]) if "gamma" in t else None
    beta = f64(t["beta"]) if "beta" in t else None
    out = F.layer_norm(x, x.shape[-ndim:], gamma, beta, float(metadata.get("eps", 1e-5)))
    return out, None


def rms_norm(t, metadata):
    """torch.nn.RMSNorm: x / sqrt(mean(x^2) + eps) * gamma over the trailing
    dims, in float64 (written out: the Debian PyTorch predates RMSNorm)."""
    x = f64(t["input"])
    dims = tuple(range(-int(metadata.get("normalized_ndim", 1)), 0))
    eps = float(metadata["eps"])
    out = x / torch.sqrt(torch.mean(x * x, dim=dims, keepdim=True) + eps)
    if "gamma" in t:
        out = out * f64(t["gamma"])
    return out, None


OPS = {"attend": attend, "multi_head_attend": multi_head_attend, "layer_norm": layer_norm,
       "rms_norm": rms_norm}


def expected(tensors, metadata):
    """expected_output and expected_weights (float32) of a case's inputs."""
    out, weights = OPS[metadata["op"]](tensors, metadata)
    results = {"expected_output": out.numpy().astype(np.float32)}
    if weights is not None:
        results["expected_weights"] = weights.numpy().astype(np.float32)
    return results


def cross_check(tensors, metadata, results):
    """PyTorch's own multi-head attention must agree where its layout applies
    (self-attention, square projections, no mask of 3 or 4 dims), on the rows
    it gives a number for (it gives NaN where no key is left): a guard against
    a wrong weight layout or head split above."""
    if metadata["op"] != "multi_head_attend" or "key" in tensors:
        return
    embed = tensors["query"].shape[-1]
    square = (embed, embed)
    mask = tensors.get("attn_mask")
    if (tensors.get("out_proj_weight", np.empty(0)).shape != square
            or tensors["q_proj_weight"].shape != square
            or (mask is not None and (mask.ndim != 2 or mask.dtype != np.uint8))):
        return
    padding = tensors.get("key_padding_mask")
    biases = [tensors.get(f"{n}_proj_bias") for n in "qkv"]
    out_bias = tensors.get("out_proj_bias")
    x = f64(tensors["query"]).transpose(0, 1)
    out, weights = F.multi_head_attention_forward(
        x, x, x, embed, int(metadata["num_heads"]), None,
        None if any(b is None for b in biases) else torch.cat([f64(b) for b in biases]),
        None, None, False, 0.0, f64(tensors["out_proj_weight"]),
        None if out_bias is None else f64(out_bias), training=False,
        key_padding_mask=None if padding is None else torch.from_numpy(padding == 0),
        attn_mask=None if mask is None else torch.from_numpy(mask == 0),
        use_separate_proj_weight=True,
        q_proj_weight=f64(tensors["q_proj_weight"]),
        k_proj_weight=f64(tensors["k_proj_weight"]),
        v_proj_weight=f64(tensors["v_proj_weight"]), average_attn_weights=False)
    for theirs, ours in ((out.transpose(0, 1), results["expected_output"]),
                         (weights, results["expected_weights"])):
        theirs = theirs.numpy()
        rows = np.isfinite(theirs)
        assert rows.any() and np.allclose(theirs[rows], ours[rows], rtol=1e-6, atol=1e-7)


# --- the cases ---------------------------------------------------------------


def qkv(rng, q_shape, k_shape, v_shape):
    return {"query": rng.normal(q_shape), "key": rng.normal(k_shape), "value": rng.normal(v_shape)}


def attend_b_h_l_d(rng):
    return qkv(rng, (2, 3, 9, 16), (2, 3, 9, 16), (2, 3, 9, 16)), {"op": "attend"}


def attend_additive_mask_inf(rng):
    t = qkv(rng, (2, 4, 6, 8), (2, 4, 6, 8), (2, 4, 6, 8))
    mask = rng.normal((2, 4, 6, 6))
    mask[rng.bits((2, 4, 6, 6), 0.25) == 1] = -np.inf
    mask[0, 0, 2, :] = -np.inf  # a row with no key left: zeros
    t["attn_mask"] = mask
    return t, {"op": "attend"}


def attend_bf16(rng):
    t = qkv(rng, (1, 2, 17, 32), (1, 2, 17, 32), (1, 2, 17, 32))
    return {name: to_bf16(x) for name, x in t.items()}, {"op": "attend", "dtype": "bf16"}


def attend_cross_causal_scale(rng):
    t = qkv(rng, (3, 7, 16), (3, 11, 16), (3, 11, 24))
    return t, {"op": "attend", "causal": "true", "scale": "0.3"}


def attend_temperature_0_5(rng):
    t = qkv(rng, (2, 3, 9, 16), (2, 3, 9, 16), (2, 3, 9, 16))
    return t, {"op": "attend", "temperature": "0.5"}


def layer_norm_eps1e_6_affine(rng):
    t = {"input": rng.normal((2, 5, 64), std=10.0, mean=3.0),
         "gamma": rng.normal((64,), std=0.1, mean=1.0),
         "beta": rng.normal((64,), std=0.1)}
    return t, {"op": "layer_norm", "eps": "1e-06"}


def layer_norm_two_trailing_dims_no_affine(rng):
    t = {"input": rng.normal((4, 3, 5, 6))}
    return t, {"op": "layer_norm", "eps": "1e-05", "normalized_ndim": "2"}


def rms_norm_eps1e_6_affine(rng):
    t = {"input": rng.normal((2, 5, 64), std=10.0, mean=3.0),
         "gamma": rng.normal((64,), std=0.1, mean=1.0)}
    return t, {"op": "rms_norm", "eps": "1e-06"}


def rms_norm_two_trailing_dims_no_gamma(rng):
    t = {"input": rng.normal((4, 3, 5, 6))}
    return t, {"op": "rms_norm", "eps": "1e-05", "normalized_ndim": "2"}


def projections(rng, t, embed, inner, out_embed=None, qkv_bias=True, out_bias=True):
    """Adds q/k/v projections [inner, embed] (with biases when asked) and,
    unless out_embed is None, an output projection [out_embed, inner]."""
    weights = [rng.linear(inner, embed, qkv_bias) for _ in "qkv"]
    for name, (weight, _) in zip("qkv", weights):
        t[f"{name}_proj_weight"] = weight
    for name, (_, bias) in zip("qkv", weights):
        if bias is not None:
            t[f"{name}_proj_bias"] = bias
    if out_embed is not None:
        weight, bias = rng.linear(out_embed, inner, out_bias)
        t["out_proj_weight"] = weight
        if bias is not None:
            t["out_proj_bias"] = bias
    return t


def mha(num_heads):
    return {"op": "multi_head_attend", "num_heads": str(num_heads)}


def mha_12_heads_e768(rng):
    # Embedding 768 in and out, 12 heads of 4: the projections stay small.
    t = projections(rng, {"query": rng.normal((1, 5, 768))}, 768, 12 * 4, 768)
    return t, mha(12)


def mha_8_heads_e128(rng):
    t = projections(rng, {"query": rng.normal((3, 2, 128))}, 128, 128, 128)
    return t, mha(8)


def mha_8_heads_e64_no_qkv_bias(rng):
    t = projections(rng, {"query": rng.normal((2, 10, 64))}, 64, 64, 64, qkv_bias=False)
    return t, mha(8)


def mha_8_heads_random_mask_fully_masked_row(rng):
    mask = rng.bits((2, 5, 5), 0.5)
    mask[0, 1, :] = 0  # a query row with no key left: zeros
    t = {"query": rng.normal((2, 5, 32)), "attn_mask": mask}
    return projections(rng, t, 32, 32, 32), mha(8)


def mha_single_head_dk64_no_bias_no_out_proj(rng):
    lengths = np.array([8, 5])  # keys past each sequence's length excluded
    mask = np.broadcast_to(np.arange(8)[None, None, :] < lengths[:, None, None], (2, 8, 8))
    t = {"query": rng.normal((2, 8, 64)), "attn_mask": mask.astype(np.uint8)}
    return projections(rng, t, 64, 64, None, qkv_bias=False), mha(1)


def mha_single_head_e256_out_proj_only_bias(rng):
    t = projections(rng, {"query": rng.normal((2, 6, 256))}, 256, 8, 256, qkv_bias=False)
    return t, mha(1)


def mha_single_head_key_padding_mask(rng):
    padding = np.array([[1, 1, 1, 0], [1, 0, 0, 1], [0, 0, 0, 0]], dtype=np.uint8)
    t = {"query": rng.uniform((3, 4, 2), 0.0, 1.0), "key_padding_mask": padding}
    return projections(rng, t, 2, 2, 2), mha(1)


def mha_single_head_out_proj_mask_b_lq_lk(rng):
    mask = rng.bits((3, 4, 4), 0.6)
    mask[:, :, 0] = 1  # every row keeps a key
    t = {"query": rng.uniform((3, 4, 2), 0.0, 1.0), "attn_mask": mask}
    return projections(rng, t, 2, 2, 2), mha(1)


def mha_single_head_tiny_no_bias(rng):
    t = projections(rng, {"query": rng.uniform((3, 2, 4), 0.0, 1.0)}, 4, 4, None, qkv_bias=False)
    return t, mha(1)


# File name -> builder; each case draws from its own seed (its position), so
# adding a case at the end leaves the others' bytes alone.
CASES = [
    ("attend_b_h_l_d", attend_b_h_l_d),
    ("attend_additive_mask_inf", attend_additive_mask_inf),
    ("attend_bf16", attend_bf16),
    ("attend_cross_causal_scale", attend_cross_causal_scale),
    ("attend_temperature_0_5", attend_temperature_0_5),
    ("layer_norm_eps1e-6_affine", layer_norm_eps1e_6_affine),
    ("layer_norm_two_trailing_dims_no_affine", layer_norm_two_trailing_dims_no_affine),
    ("mha_12_heads_e768", mha_12_heads_e768),
    ("mha_8_heads_e128", mha_8_heads_e128),
    ("mha_8_heads_e64_no_qkv_bias", mha_8_heads_e64_no_qkv_bias),
    ("mha_8_heads_random_mask_fully_masked_row", mha_8_heads_random_mask_fully_masked_row),
    ("mha_single_head_dk64_no_bias_no_out_proj", mha_single_head_dk64_no_bias_no_out_proj),
    ("mha_single_head_e256_out_proj_only_bias", mha_single_head_e256_out_proj_only_bias),
    ("mha_single_head_key_padding_mask", mha_single_head_key_padding_mask),
    ("mha_single_head_out_proj_mask_b_lq_lk", mha_single_head_out_proj_mask_b_lq_lk),
    ("mha_single_head_tiny_no_bias", mha_single_head_tiny_no_bias),
    ("rms_norm_eps1e-6_affine", rms_norm_eps1e_6_affine),
    ("rms_norm_two_trailing_dims_no_gamma", rms_norm_two_trailing_dims_no_gamma),
]


def build(index, builder):
    """The bytes of one case's file."""
    tensors, metadata = builder(Rng(1000 + index))
    results = expected(tensors, metadata)
    cross_check(tensors, metadata, results)
    return encode({**tensors, **results}, metadata)


def write_all(folder):
    os.makedirs(folder, exist_ok=True)
    for index, (name, builder) in enumerate(CASES):
        data = build(index, builder)
        with open(os.path.join(folder, name + ".safetensors"), "wb") as f:
            f.write(data)


# --- --check -----------------------------------------------------------------


def ulps_apart(a, b):
    """Distance of float32 arrays in units in the last place."""
    ia = a.view(np.int32).astype(np.int64)
    ib = b.view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(2**31) - ia, ia)  # monotonic across zero
    ib = np.where(ib < 0, -(2**31) - ib, ib)
    return np.abs(ia - ib)


def compare(name, want, got):
    """None when the files agree (bytes, or expected values within 2 ulps
    and everything else byte for byte), else what differs."""
    if want == got:
        return None
    (want_t, want_m), (got_t, got_m) = decode(want), decode(got)
    if want_m != got_m or list(want_t) != list(got_t):
        return f"{name}: tensor names or metadata differ"
    for tensor, a in want_t.items():
        b = got_t[tensor]
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{name}: {tensor}: shape or dtype differs"
        if not tensor.startswith("expected_"):
            if a.tobytes() != b.tobytes():
                return f"{name}: input {tensor} differs"
        elif not (np.array_equal(np.isnan(a), np.isnan(b)) and
                  ulps_apart(np.nan_to_num(a), np.nan_to_num(b)).max(initial=0) <= 2):
            return f"{name}: {tensor} differs by more than 2 float32 ulps"
    print(f"{name}: not byte-identical; expected values within 2 float32 ulps")
    return None


def read(path):
    with open(path, "rb") as f:
        return f.read()


def check(folder):
    """0 when `folder` holds exactly the files this script writes."""
    with tempfile.TemporaryDirectory() as fresh:
        write_all(fresh)
        names = sorted(os.listdir(fresh))
        present = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        problems = [f"{name}: missing" for name in names if name not in present]
        problems += [f"{name}: not written by this script" for name in present
                     if name not in names]
        for name in names:
            if name not in present:
                continue
            problem = compare(name, read(os.path.join(folder, name)),
                              read(os.path.join(fresh, name)))
            if problem:
                problems.append(problem)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print("regenerate: /usr/bin/python3 scripts/make_goldens.py tests/goldens",
              file=sys.stderr)
        return 1
    print(f"{folder}: {len(names)} goldens up to date")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="where to write the goldens (tests/goldens)")
    parser.add_argument("--check", action="store_true",
                        help="compare the folder with a fresh copy instead of writing")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one summation order per machine
    if args.check:
        return check(args.folder)
    write_all(args.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
