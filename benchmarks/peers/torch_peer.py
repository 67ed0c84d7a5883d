#!/usr/bin/python3
"""attnserve's gRPC API served by PyTorch: a peer to benchmark against.

Implements Attend, MultiHeadAttend (inline weights or a model from a model
repository in attnserve's layout), LayerNorm, ListModels and
GetModelMetadata of attnserve.v1.AttentionService with attnserve's
semantics: masks keep nonzero positions, causal is top-left aligned, a
query with no key left gets zeros, softmax in float32, bfloat16 inputs
computed on bfloat16 matmuls with float32 softmax.

    PYTHONPATH=build/clients/python_gen /usr/bin/python3 \\
        benchmarks/peers/torch_peer.py --port=50052 \\
        --model_repository=build/models --threads=4 --torch_threads=2

OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE, which some machines set and which
halve OpenBLAS's speed, are removed before OpenBLAS loads (as
benchmarks/vs_pytorch.py does).
"""
import os
import sys

_SLOW_BLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
if any(v in os.environ for v in _SLOW_BLAS_VARS):
    env = {k: v for k, v in os.environ.items() if k not in _SLOW_BLAS_VARS}
    os.execve(sys.executable, [sys.executable] + sys.argv, env)

# noqa: E402 below: the imports come after the environment is settled.
import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import struct  # noqa: E402
import threading  # noqa: E402
import warnings  # noqa: E402
from concurrent import futures  # noqa: E402

import grpc  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from google.protobuf import text_format  # noqa: E402

from attnserve.v1 import attention_pb2 as pb  # noqa: E402
from attnserve.v1 import attention_pb2_grpc as pb_grpc  # noqa: E402

# Requests are decoded as views of the message's bytes, which nothing here
# writes to; PyTorch warns about read-only buffers once otherwise.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

_TORCH_DTYPES = {
    pb.DATA_TYPE_FLOAT32: torch.float32,
    pb.DATA_TYPE_BFLOAT16: torch.bfloat16,
    pb.DATA_TYPE_FLOAT16: torch.float16,
    pb.DATA_TYPE_BOOL: torch.bool,
    pb.DATA_TYPE_UINT8: torch.uint8,
}
_WIRE_DTYPES = {v: k for k, v in _TORCH_DTYPES.items()}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16,
                       "F16": torch.float16}
_MASK_DTYPES = (torch.bool, torch.uint8)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RequestError(Exception):
    """A bad request: the gRPC status code and a message naming the field."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


def invalid(message):
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def shape_str(shape):
    return "[" + ", ".join(str(d) for d in shape) + "]"


# --- Wire tensors ---------------------------------------------------------

def decode(tensor, field):
    """torch tensor viewing a wire Tensor's bytes (protobuf's copy only)."""
    if tensor.dtype not in _TORCH_DTYPES:
        raise invalid(f"{field}: dtype {tensor.dtype} is not supported")
    dtype = _TORCH_DTYPES[tensor.dtype]
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise invalid(f"{field}: negative dim in shape {shape_str(shape)}")
    count = math.prod(shape)
    if len(tensor.float_data):
        if dtype != torch.float32 or tensor.raw_data:
            raise invalid(f"{field}: float_data is for FLOAT32 tensors "
                          "without raw_data")
        if len(tensor.float_data) != count:
            raise invalid(f"{field}: float_data has {len(tensor.float_data)} "
                          f"values, expected {count}")
        return torch.tensor(list(tensor.float_data),
                            dtype=torch.float32).view(shape)
    raw = tensor.raw_data
    size = torch.empty((), dtype=dtype).element_size()
    if len(raw) != count * size:
        raise invalid(f"{field}: raw_data has {len(raw)} bytes, expected "
                      f"{count * size} (shape {shape_str(shape)})")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).view(shape)


def encode(tensor):
    """Wire Tensor of a torch tensor: one copy into bytes."""
    tensor = tensor.contiguous()
    data = tensor
    if tensor.dtype == torch.bfloat16:
        data = tensor.view(torch.int16)  # numpy has no bfloat16
    return pb.Tensor(dtype=_WIRE_DTYPES[tensor.dtype], shape=tensor.shape,
                     raw_data=data.numpy().tobytes())


def optional_tensor(message, field):
    return decode(getattr(message, field), field) \
        if message.HasField(field) else None


def required_tensor(message, field):
    if not message.HasField(field):
        raise invalid(f"{field}: missing")
    return decode(getattr(message, field), field)


# --- Attention --------------------------------------------------------------

_causal_masks = {}
_causal_lock = threading.Lock()


def causal_exclusion(lq, lk):
    """[Lq, Lk] bool, True where key j > query i (top-left aligned)."""
    key = (lq, lk)
    mask = _causal_masks.get(key)
    if mask is None:
        mask = torch.ones(lq, lk, dtype=torch.bool).triu(1)
        with _causal_lock:
            if len(_causal_masks) > 64:
                _causal_masks.clear()
            _causal_masks[key] = mask
    return mask


def check_float_mask(mask, field):
    if torch.isnan(mask).any() or torch.isposinf(mask).any():
        raise invalid(f"{field}: FLOAT32 mask values must be finite or -inf")


def attention(q, k, v, compute, scale, temperature, masks, causal):
    """softmax(q k^T * scale / temperature + masks) v over [..., L, d].

    `masks` are (tensor, field) pairs broadcastable to the logits: bool or
    uint8 keep nonzero positions, float ones are added. Returns (output in
    `compute`, float32 probabilities).
    """
    factor = scale / temperature
    if compute == torch.float32:
        # Scaling q costs Lq*dk multiplies instead of Lq*Lk (as PyTorch's
        # nn.MultiheadAttention does).
        logits = torch.matmul(q.float() * factor, k.float().transpose(-1, -2))
    else:
        # bfloat16 operands, the scale applied to the float32 logits.
        logits = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2))
        logits = logits.float().mul_(factor)
    masked = False
    for mask, field in masks:
        if mask.dtype in _MASK_DTYPES:
            logits.masked_fill_(mask == 0, float("-inf"))
            masked = True
        else:
            check_float_mask(mask, field)
            logits += mask.float()
            masked = True
    if causal:
        lq, lk = logits.shape[-2:]
        logits.masked_fill_(causal_exclusion(lq, lk), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if masked:
        # A row without any key is all -inf: NaN out of softmax, zeros here.
        probs.nan_to_num_(0.0)
    output = torch.matmul(probs.to(compute), v.to(compute))
    return output, probs


def broadcast_mask(mask, field, logits_shape):
    if mask.dim() > len(logits_shape):
        raise invalid(f"{field}: rank {mask.dim()} (shape "
                      f"{shape_str(mask.shape)}) exceeds the rank of the "
                      f"logits {shape_str(logits_shape)}")
    try:
        if torch.broadcast_shapes(mask.shape, logits_shape) != logits_shape:
            raise RuntimeError
    except RuntimeError:
        raise invalid(f"{field}: shape {shape_str(mask.shape)} does not "
                      f"broadcast to the logits {shape_str(logits_shape)}")
    return mask


def scale_and_temperature(request, dk, default_scale=None):
    scale = request.scale if request.HasField("scale") else default_scale
    if scale is None:
        scale = 1.0 / math.sqrt(dk)
    if not math.isfinite(scale):
        raise invalid(f"scale: must be finite, got {scale}")
    temperature = request.temperature \
        if request.HasField("temperature") else 1.0
    if not (math.isfinite(temperature) and temperature > 0):
        raise invalid(f"temperature: must be finite and > 0, got "
                      f"{temperature}")
    return scale, temperature


def compute_dtype(inputs, compute_bf16):
    """bfloat16 matmuls for bfloat16 inputs or when asked, else float32."""
    if compute_bf16 or any(t.dtype == torch.bfloat16 for t in inputs):
        return torch.bfloat16
    return torch.float32


# --- Multi-head layers ------------------------------------------------------

def _canonical(name):
    return name.replace(".", "_")  # out_proj.weight -> out_proj_weight


class Layer:
    """Projection weights of a multi-head attention layer, prepared once."""

    def __init__(self, tensors, num_heads, compute=torch.float32):
        """`tensors`: AttentionWeights field (or state_dict) name -> tensor."""
        t = {_canonical(k): v for k, v in tensors.items() if v is not None}
        for name in ("bias_k", "bias_v"):
            if name in t:
                raise invalid(f"{name}: not supported")
        if num_heads <= 0:
            raise invalid(f"num_heads: must be > 0, got {num_heads}")
        self.heads = num_heads
        self.compute = compute
        self.fused = None
        if "in_proj_weight" in t:
            w = t["in_proj_weight"]
            if w.dim() != 2 or w.shape[0] % 3:
                raise invalid(f"in_proj_weight: shape {shape_str(w.shape)}, "
                              "expected [3E, E]")
            e = w.shape[0] // 3
            weights = [(w[i * e:(i + 1) * e], "in_proj_weight")
                       for i in range(3)]
            b = t.get("in_proj_bias")
            if b is not None and b.shape != (3 * e,):
                raise invalid(f"in_proj_bias: shape {shape_str(b.shape)}, "
                              f"expected [{3 * e}]")
            biases = [None] * 3 if b is None else \
                [b[i * e:(i + 1) * e] for i in range(3)]
        else:
            weights, biases = [], []
            b = t.get("in_proj_bias")  # PyTorch's, next to kdim/vdim weights
            for i, p in enumerate("qkv"):
                name = f"{p}_proj_weight"
                if name not in t:
                    raise invalid(f"{name}: missing (or in_proj_weight)")
                weights.append((t[name], name))
                bias = t.get(f"{p}_proj_bias")
                if bias is None and b is not None:
                    third = b.shape[0] // 3
                    bias = b[i * third:(i + 1) * third]
                biases.append(bias)
        for (w, name), bias, p in zip(weights, biases, "qkv"):
            if w.dim() != 2 or w.shape[0] % num_heads:
                raise invalid(f"{name}: shape {shape_str(w.shape)}, expected "
                              f"[H*d, E] with H = {num_heads}")
            if bias is not None and bias.shape != (w.shape[0],):
                raise invalid(f"{p}_proj_bias: shape {shape_str(bias.shape)}"
                              f", expected [{w.shape[0]}]")
        (qw, self.q_name), (kw, self.k_name), (vw, self.v_name) = weights
        if qw.shape[0] != kw.shape[0]:
            raise invalid(f"{self.k_name}: {kw.shape[0]} rows != "
                          f"{self.q_name} rows {qw.shape[0]}")
        self.dk = qw.shape[0] // num_heads
        self.dv = vw.shape[0] // num_heads
        self.q_in, self.k_in, self.v_in = (w.shape[1] for w in (qw, kw, vw))

        def prepare(x):
            return None if x is None else x.to(compute).contiguous()

        self.q_w, self.k_w, self.v_w = map(prepare, (qw, kw, vw))
        self.q_b, self.k_b, self.v_b = map(prepare, biases)
        if "in_proj_weight" in t:
            # Self-attention projects once with the fused [3E, E] weight.
            self.fused = (prepare(t["in_proj_weight"]),
                          prepare(t.get("in_proj_bias")))
        self.o_w = prepare(t.get("out_proj_weight"))
        self.o_b = prepare(t.get("out_proj_bias"))
        heads_width = num_heads * self.dv
        if self.o_w is not None and (
                self.o_w.dim() != 2 or self.o_w.shape[1] != heads_width):
            raise invalid(f"out_proj_weight: shape {shape_str(self.o_w.shape)}"
                          f", expected [Eo, {num_heads * self.dv}]")
        if self.o_b is not None and (self.o_w is None or
                                     self.o_b.shape != (self.o_w.shape[0],)):
            raise invalid("out_proj_bias: needs out_proj_weight, shape [Eo]")
        self.out_dim = self.o_w.shape[0] if self.o_w is not None \
            else num_heads * self.dv

    def run(self, request, default_scale=None, default_causal=False):
        """(output, weights or None) for a MultiHeadAttendRequest."""
        query = required_tensor(request, "query")
        key = optional_tensor(request, "key")
        value = optional_tensor(request, "value")
        attn_mask = optional_tensor(request, "attn_mask")
        padding = optional_tensor(request, "key_padding_mask")
        for t, field in ((query, "query"), (key, "key"), (value, "value")):
            if t is not None and t.dtype not in _FLOAT_DTYPES:
                raise invalid(f"{field}: must be a float tensor")
        if query.dim() not in (2, 3):
            raise invalid(f"query: shape {shape_str(query.shape)}, expected "
                          "[B, Lq, Eq] or [Lq, Eq]")
        unbatched = query.dim() == 2
        self_attention = key is None and value is None
        key = query if key is None else key
        value = key if value is None else value
        for t, field, width in ((query, "query", self.q_in),
                                (key, "key", self.k_in),
                                (value, "value", self.v_in)):
            if t.dim() != query.dim():
                raise invalid(f"{field}: rank {t.dim()} != query rank "
                              f"{query.dim()}")
            if t.shape[-1] != width:
                raise invalid(f"{field}: last dim {t.shape[-1]} != "
                              f"projection input dim {width}")
        if padding is not None:
            expected = tuple(key.shape[:-1])  # [B, Lk], or [Lk] unbatched
            if tuple(padding.shape) != expected:
                raise invalid(f"key_padding_mask: shape "
                              f"{shape_str(padding.shape)}, expected "
                              f"{shape_str(expected)}")
        if unbatched:
            query, key, value = (t.unsqueeze(0) for t in (query, key, value))
            if padding is not None:
                padding = padding.unsqueeze(0)
        b, lq, lk = query.shape[0], query.shape[1], key.shape[1]
        if key.shape[:2] != value.shape[:2] or key.shape[0] != b:
            raise invalid(f"value: shape {shape_str(value.shape)} does not "
                          f"match key {shape_str(key.shape)} and query "
                          f"{shape_str(query.shape)}")
        h, c = self.heads, self.compute
        scale, temperature = scale_and_temperature(request, self.dk,
                                                   default_scale)

        x = query.to(c)
        if self_attention and self.fused is not None:
            q, k, v = F.linear(x, *self.fused).split(
                [h * self.dk, h * self.dk, h * self.dv], dim=-1)
        else:
            q = F.linear(x, self.q_w, self.q_b)
            k = F.linear(key.to(c), self.k_w, self.k_b)
            v = F.linear(value.to(c), self.v_w, self.v_b)
        q = q.view(b, lq, h, self.dk).transpose(1, 2)
        k = k.view(b, lk, h, self.dk).transpose(1, 2)
        v = v.view(b, lk, h, self.dv).transpose(1, 2)

        masks = []
        if attn_mask is not None:
            shapes = [(lq, lk), (b, lq, lk), (b, h, lq, lk)]
            if tuple(attn_mask.shape) not in shapes:
                raise invalid(f"attn_mask: shape {shape_str(attn_mask.shape)}"
                              ", expected " + ", ".join(
                                  shape_str(s) for s in shapes[:2]) +
                              f" or {shape_str(shapes[2])}")
            if attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(1)  # shared by the heads
            masks.append((attn_mask, "attn_mask"))
        if padding is not None:
            masks.append((padding.view(b, 1, 1, lk), "key_padding_mask"))
        causal = request.causal or default_causal
        heads, probs = attention(q, k, v, c, scale, temperature, masks,
                                 causal)
        out = heads.transpose(1, 2).reshape(b, lq, h * self.dv)
        if self.o_w is not None:
            out = F.linear(out, self.o_w, self.o_b)
        out = out.to(query.dtype)
        weights = None
        if request.return_weights:
            weights = probs.mean(dim=1) if request.average_weights else probs
        if unbatched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights


# --- Model repository -------------------------------------------------------

def load_safetensors(path):
    """name -> torch tensor of a safetensors file."""
    with open(path, "rb") as f:
        data = bytearray(f.read())  # writable: torch.frombuffer wants that
    (length,) = struct.unpack_from("<Q", data)
    header = json.loads(bytes(data[8:8 + length]))
    header.pop("__metadata__", None)
    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: {name}: dtype {info['dtype']} is not "
                             "supported")
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        size = torch.empty((), dtype=dtype).element_size()
        flat = torch.frombuffer(data, dtype=dtype, count=(end - begin) // size,
                                offset=8 + length + begin)
        tensors[name] = flat.view(info["shape"]).clone()
    return tensors


class Model:
    def __init__(self, name, folder):
        self.name = name
        with open(os.path.join(folder, "config.pbtxt")) as f:
            self.config = text_format.Parse(f.read(), pb.ModelConfig())
        compute = torch.bfloat16 \
            if self.config.compute_dtype == pb.DATA_TYPE_BFLOAT16 \
            else torch.float32
        tensors = load_safetensors(os.path.join(folder, "weights.safetensors"))
        try:
            self.layer = Layer(tensors, self.config.num_heads, compute)
        except RequestError as error:
            raise ValueError(f"{folder}: {error}") from error
        self.default_scale = self.config.default_scale \
            if self.config.HasField("default_scale") else None


def load_models(repository):
    models = {}
    for name in sorted(os.listdir(repository)):
        folder = os.path.join(repository, name)
        if os.path.isfile(os.path.join(folder, "config.pbtxt")):
            models[name] = Model(name, folder)
    return models


# --- Service ----------------------------------------------------------------

def handler(method):
    """Runs an RPC under inference mode; RequestError -> its gRPC status."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            with torch.inference_mode():
                return method(self, request)
        except RequestError as error:
            context.abort(error.code, str(error))
        except RuntimeError as error:  # shapes PyTorch found inconsistent
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request: {error}")
    return wrapper


class TorchAttentionService(pb_grpc.AttentionServiceServicer):

    def __init__(self, models):
        self.models = models

    @handler
    def Attend(self, request):
        q = required_tensor(request, "query")
        k = required_tensor(request, "key")
        v = required_tensor(request, "value")
        for t, field in ((q, "query"), (k, "key"), (v, "value")):
            if t.dtype not in _FLOAT_DTYPES:
                raise invalid(f"{field}: must be a float tensor")
            if t.dim() < 2:
                raise invalid(f"{field}: rank {t.dim()} (shape "
                              f"{shape_str(t.shape)}), expected rank >= 2")
        if k.shape[:-2] != q.shape[:-2] or v.shape[:-2] != q.shape[:-2]:
            raise invalid(f"key, value: leading dims {shape_str(k.shape)}, "
                          f"{shape_str(v.shape)} != query "
                          f"{shape_str(q.shape)}")
        if k.shape[-1] != q.shape[-1]:
            raise invalid(f"key: last dim {k.shape[-1]} != query last dim "
                          f"{q.shape[-1]}")
        if v.shape[-2] != k.shape[-2]:
            raise invalid(f"value: dim -2 {v.shape[-2]} != key dim -2 "
                          f"{k.shape[-2]}")
        masks = []
        mask = optional_tensor(request, "attn_mask")
        if mask is not None:
            logits_shape = q.shape[:-1] + (k.shape[-2],)
            masks.append((broadcast_mask(mask, "attn_mask", logits_shape),
                          "attn_mask"))
        scale, temperature = scale_and_temperature(request, q.shape[-1])
        compute = compute_dtype((q, k, v), request.compute_bf16)
        output, probs = attention(q, k, v, compute, scale, temperature, masks,
                                  request.causal)
        response = pb.AttendResponse(output=encode(output.to(q.dtype)))
        if request.return_weights:
            response.weights.CopyFrom(encode(probs))
        return response

    @handler
    def MultiHeadAttend(self, request):
        source = request.WhichOneof("weights_source")
        if source == "model":
            model = self.models.get(request.model)
            if model is None:
                raise RequestError(grpc.StatusCode.NOT_FOUND,
                                   f"model: '{request.model}' not found")
            output, weights = model.layer.run(
                request, model.default_scale, model.config.default_causal)
        elif source == "weights":
            w = request.weights
            tensors = {f.name: decode(getattr(w, f.name), f.name)
                       for f, _ in w.ListFields()
                       if f.message_type is not None}
            inputs = [request.query] if request.HasField("query") else []
            compute = torch.bfloat16 if request.compute_bf16 or any(
                t.dtype == pb.DATA_TYPE_BFLOAT16 for t in inputs) \
                else torch.float32
            layer = Layer(tensors, w.num_heads, compute)
            output, weights = layer.run(request)
        else:
            raise invalid("weights: missing, expected either `model` or "
                          "`weights`")
        response = pb.MultiHeadAttendResponse(output=encode(output))
        if weights is not None:
            response.weights.CopyFrom(encode(weights))
        return response

    @handler
    def LayerNorm(self, request):
        x = required_tensor(request, "input")
        if x.dtype not in _FLOAT_DTYPES:
            raise invalid("input: must be a float tensor")
        n = request.normalized_ndim or 1
        if not 1 <= n <= x.dim():
            raise invalid(f"normalized_ndim: {n} is not in [1, rank of input "
                          f"{x.dim()}] (input shape {shape_str(x.shape)})")
        eps = request.eps if request.HasField("eps") else 1e-5
        if not (math.isfinite(eps) and eps > 0):
            raise invalid(f"eps: must be finite and > 0, got {eps}")
        normalized = tuple(x.shape[-n:])
        affine = []
        for field in ("gamma", "beta"):
            t = optional_tensor(request, field)
            if t is not None and tuple(t.shape) != normalized:
                raise invalid(f"{field}: shape {shape_str(t.shape)}, "
                              f"expected {shape_str(normalized)}")
            affine.append(None if t is None else t.float())
        output = F.layer_norm(x.float(), normalized, *affine, eps=eps)
        return pb.LayerNormResponse(output=encode(output.to(x.dtype)))

    @handler
    def ListModels(self, request):
        return pb.ListModelsResponse(models=[
            pb.ListModelsResponse.Model(name=m.name, num_heads=m.layer.heads,
                                        embed_dim=m.layer.q_in)
            for m in self.models.values()])

    @handler
    def GetModelMetadata(self, request):
        model = self.models.get(request.name)
        if model is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND,
                               f"name: model '{request.name}' not found")
        layer = model.layer
        return pb.GetModelMetadataResponse(
            name=model.name, platform="torch_multi_head_attention",
            num_heads=layer.heads, query_dim=layer.q_in,
            key_dim=layer.k_in, value_dim=layer.v_in,
            head_key_dim=layer.dk, head_value_dim=layer.dv,
            output_dim=layer.out_dim,
            compute_dtype=_WIRE_DTYPES[layer.compute],
            description=model.config.description)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50052,
                        help="0 picks a free port (printed at start-up)")
    parser.add_argument("--threads", type=int, default=4,
                        help="gRPC worker threads: calls handled at once")
    parser.add_argument("--torch_threads", type=int, default=0,
                        help="PyTorch intra-op threads (0: all cores)")
    parser.add_argument("--model_repository", default=None,
                        help="folder of NAME/config.pbtxt + "
                             "NAME/weights.safetensors")
    parser.add_argument("--max_message_mb", type=int, default=256)
    args = parser.parse_args()

    torch.set_num_threads(args.torch_threads or os.cpu_count())
    models = load_models(args.model_repository) \
        if args.model_repository else {}
    limit = args.max_message_mb * 1024 * 1024
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=args.threads),
        options=[("grpc.max_receive_message_length", limit),
                 ("grpc.max_send_message_length", limit)])
    pb_grpc.add_AttentionServiceServicer_to_server(
        TorchAttentionService(models), server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        sys.exit(f"peer: cannot listen on {args.host}:{args.port}")
    server.start()
    print(f"peer listening on {args.host}:{port} ({torch.get_num_threads()} "
          f"torch threads, {args.threads} workers, models: "
          f"{', '.join(models) or 'none'})", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=5).wait()


if __name__ == "__main__":
    main()
