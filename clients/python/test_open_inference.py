#!/usr/bin/python3
"""Conformance of attnserve's Open Inference Protocol (KServe v2) endpoints.

Every protocol RPC over gRPC (inference.GRPCInferenceService) and HTTP/JSON
through the open_inference client, against a live server: each inference
result must equal, bit for bit, what the native RPC answers for the same
inputs, and agree with a float64 reference.

Usage: test_open_inference.py [ATTNSERVE_BINARY] [unittest args], or the
binary in the environment variable ATTNSERVE_BIN.
"""
import http.client
import json
import os
import re
import signal
import sys
import tempfile
import time
import unittest
import urllib.parse

import grpc
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from attnserve_client import (ServerProcess, SharedMemoryRegion,  # noqa
                              attention_weights, connect, pb, save_model,
                              to_numpy, to_tensor)
from inference import grpc_service_pb2 as oip_pb  # noqa
from inference import grpc_service_pb2_grpc as oip_pb_grpc  # noqa
from open_inference import (GrpcClient, HttpClient,  # noqa
                            InferenceServerError, SharedMemoryInput,
                            shared_memory_parameters)
from open_inference.grpc_client import (build_infer_request,  # noqa
                                        decode_infer_response)
from open_inference.http_client import (build_infer_body,  # noqa
                                        decode_infer_body)
from open_inference.tensors import (from_json_data, from_raw,  # noqa
                                    input_array, to_json_data)

SERVER_BIN = os.environ.get("ATTNSERVE_BIN", "")
REF_TOL = dict(rtol=1e-5, atol=1e-5)  # float32 results vs float64
FP16_TOL = dict(rtol=2e-3, atol=2e-3)  # one rounding to float16
BF16_TOL = dict(rtol=2e-2, atol=2e-2)  # and to bfloat16

# The contract's HTTP status for each gRPC code.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
NATIVE_DATATYPES = {
    pb.DATA_TYPE_FLOAT32: "FP32",
    pb.DATA_TYPE_BFLOAT16: "BF16",
    pb.DATA_TYPE_FLOAT16: "FP16",
    pb.DATA_TYPE_BOOL: "BOOL",
    pb.DATA_TYPE_UINT8: "UINT8",
}
WEIGHT_NAMES = ["q_proj_weight", "k_proj_weight", "v_proj_weight",
                "in_proj_weight", "q_proj_bias", "k_proj_bias",
                "v_proj_bias", "in_proj_bias", "out_proj_weight",
                "out_proj_bias"]
FLOATS = {"FP32", "BF16", "FP16"}
MASKS = {"BOOL", "UINT8", "FP32"}
REPOSITORY_MODEL = "mha64"
TOKEN = "conformance-token-1"


def attention_reference(q, k, v, mask=None, causal=False, scale=None,
                        temperature=1.0):
    """Float64 scaled dot-product attention; (output, weights).

    Causal masking is top-left aligned; a nonzero BOOL/UINT8 mask element
    keeps its key, a float mask is added to the logits; a query without
    keys gets zeros.
    """
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = q @ np.swapaxes(k, -1, -2) * scale / temperature
    lq, lk = logits.shape[-2:]
    keep = np.ones((lq, lk), dtype=bool)
    if causal:
        keep = np.tril(keep)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype in (np.bool_, np.uint8):
            keep = keep & (mask != 0)
        else:
            logits = logits + mask.astype(np.float64)
    logits = np.where(keep, logits, -np.inf)
    peak = logits.max(axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    exp = np.exp(logits - peak)
    total = exp.sum(axis=-1, keepdims=True)
    weights = np.divide(exp, total, out=np.zeros_like(exp), where=total > 0)
    return weights @ v, weights


def layer_norm_reference(x, gamma=None, beta=None, eps=1e-5, ndim=1):
    x = np.asarray(x, dtype=np.float64)
    axes = tuple(range(x.ndim - ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if gamma is not None:
        y = y * gamma
    if beta is not None:
        y = y + beta
    return y


def torch_state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def weight_inputs(state_dict):
    """The multi_head_attend weight inputs of an nn.MultiheadAttention
    state_dict: the native AttentionWeights field names, float32 arrays
    (a fused in_proj_bias next to separate weights split, as the native
    client does)."""
    weights = attention_weights(state_dict, num_heads=1)
    return {field.name: to_numpy(tensor, copy=True)
            for field, tensor in weights.ListFields()
            if field.name != "num_heads"}


def torch_mha(module, q, k, v, **kwargs):
    """The module in float64 on float32 inputs; (output, weights)."""
    double = type(module)(module.embed_dim, module.num_heads,
                          kdim=module.kdim, vdim=module.vdim,
                          batch_first=True).double().eval()
    double.load_state_dict(module.state_dict())
    with torch.no_grad():
        out, weights = double(*(torch.from_numpy(t).double()
                                for t in (q, k, v)), **kwargs)
    return out.numpy(), None if weights is None else weights.numpy()


def http_port_of(server):
    with open(server.stdout) as f:
        for line in f:
            if line.startswith("attnserve listening on "):
                found = re.search(r"http port (\d+)", line)
                if found:
                    return int(found.group(1))
    raise AssertionError(f"no 'http port N' in the start-up line of "
                         f"{server.stdout}")


def post_early_answered(url, path, body, headers):
    """(status, JSON body) of a POST that the server may answer, and close,
    before reading all of `body` (as for a body over its limit): the
    answer is read even when sending the rest failed."""
    address = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port,
                                            timeout=30)
    try:
        try:
            connection.request("POST", path, body, headers)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = connection.getresponse()
        data = reply.read()
        try:
            return reply.status, json.loads(data)
        except ValueError:
            return reply.status, data
    finally:
        connection.close()


def start_server(workdir, name, *flags):
    server = ServerProcess(
        [SERVER_BIN, "--host=127.0.0.1", "--port=0", "--http_port=0",
         "--metrics_port=-1", "--threads=2", *flags],
        "attnserve listening on ", workdir, name)
    server.http_url = f"http://127.0.0.1:{http_port_of(server)}"
    return server


class ProtocolTestCase(unittest.TestCase):
    """Helpers shared by the server test classes."""

    @classmethod
    def transports(cls):
        return (("grpc", cls.grpc), ("http", cls.http))

    def randn(self, *shape):
        return self.rng.standard_normal(shape, dtype=np.float32)

    def assert_error(self, client, code, call, *args, **kwargs):
        """`call` fails with gRPC `code`, or its HTTP status with a JSON
        body {"error": message}; returns the message."""
        with self.assertRaises(InferenceServerError) as caught:
            call(*args, **kwargs)
        error = caught.exception
        if isinstance(client, GrpcClient):
            self.assertEqual(error.grpc_code, code, error.message)
        else:
            self.assertEqual(error.http_status, HTTP_STATUS.get(code, 500),
                             error.body)
            self.assertIsInstance(error.body, dict, error.body)
            self.assertIsInstance(error.body.get("error"), str, error.body)
        return error.message


class OpenInferenceTest(ProtocolTestCase):

    @classmethod
    def setUpClass(cls):
        torch.manual_seed(0)
        cls.rng = np.random.default_rng(0)
        cls.workdir = tempfile.TemporaryDirectory()
        repository = os.path.join(cls.workdir.name, "models")
        cls.mha = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
        with torch.no_grad():
            cls.mha.in_proj_bias.normal_()  # PyTorch initializes it to 0
        save_model(repository, REPOSITORY_MODEL, torch_state(cls.mha),
                   num_heads=4, description="E=64, H=4")
        cls.server = start_server(cls.workdir.name, "server",
                                  f"--model_repository={repository}")
        cls.native = connect(cls.server.target)
        cls.grpc = GrpcClient(cls.server.target)
        cls.http = HttpClient(cls.server.http_url)

    @classmethod
    def tearDownClass(cls):
        cls.grpc.close()
        cls.native.channel.close()
        cls.server.stop()
        cls.workdir.cleanup()

    # Native answers, as name -> (datatype, array).

    @staticmethod
    def native_outputs(reply):
        return {field.name: (NATIVE_DATATYPES[tensor.dtype],
                             to_numpy(tensor, copy=True))
                for field, tensor in reply.ListFields()}

    def native_attend(self, q, k, v, mask=None, **options):
        request = pb.AttendRequest(query=to_tensor(q), key=to_tensor(k),
                                   value=to_tensor(v), **options)
        if mask is not None:
            request.attn_mask.CopyFrom(to_tensor(mask))
        return self.native_outputs(self.native.Attend(request))

    def native_mha(self, tensors, **options):
        request = pb.MultiHeadAttendRequest(**options)
        for name, value in tensors.items():
            getattr(request, name).CopyFrom(to_tensor(value))
        return self.native_outputs(self.native.MultiHeadAttend(request))

    def native_layer_norm(self, tensors, **options):
        request = pb.LayerNormRequest(**options)
        for name, value in tensors.items():
            getattr(request, name).CopyFrom(to_tensor(value))
        return self.native_outputs(self.native.LayerNorm(request))

    def assert_matches(self, result, native, reference=None, tol=REF_TOL):
        """`result` has the native answer's outputs, datatypes and values
        exactly, and is within `tol` of the reference (name -> array)."""
        self.assertEqual(sorted(result), sorted(native))
        for name, (datatype, expected) in native.items():
            self.assertEqual(result.datatypes[name], datatype, name)
            self.assertEqual(result[name].shape, expected.shape, name)
            self.assertEqual(result.shapes[name], list(expected.shape), name)
            np.testing.assert_array_equal(result[name], expected,
                                          err_msg=name)
        for name, expected in (reference or {}).items():
            np.testing.assert_allclose(result[name], expected, err_msg=name,
                                       **tol)

    def check_infer(self, model, inputs, native, reference=None,
                    parameters=None, outputs=None, tol=REF_TOL):
        # A request that names no output gets every output of the model;
        # these compare with the native answer's outputs, named.
        if outputs is None:
            outputs = sorted(native)
        for transport, client in self.transports():
            with self.subTest(transport=transport):
                result = client.infer(model, inputs, parameters=parameters,
                                      outputs=outputs)
                self.assert_matches(result, native, reference, tol)
                self.assertEqual(result.model_name, model)

    # Health and metadata.

    def test_live_and_ready(self):
        for transport, client in self.transports():
            with self.subTest(transport=transport):
                self.assertIs(client.server_live(), True)
                self.assertIs(client.server_ready(), True)
        self.assertEqual(self.http.request("GET", "/v2/health/live"),
                         (200, {"live": True}))
        self.assertEqual(self.http.request("GET", "/v2/health/ready"),
                         (200, {"ready": True}))

    def test_server_metadata(self):
        answers = []
        for transport, client in self.transports():
            with self.subTest(transport=transport):
                metadata = client.server_metadata()
                self.assertEqual(metadata["name"], "attnserve")
                self.assertIsInstance(metadata["version"], str)
                self.assertNotEqual(metadata["version"], "")
                self.assertIsInstance(metadata["extensions"], list)
                for extension in metadata["extensions"]:
                    self.assertIsInstance(extension, str)
                answers.append({k: metadata[k] for k in
                                ("name", "version", "extensions")})
        self.assertEqual(answers[0], answers[1])

    def check_model_metadata(self, model, inputs, outputs):
        """Input name -> allowed datatypes, output name -> allowed ones."""
        answers = []
        for transport, client in self.transports():
            with self.subTest(transport=transport, model=model):
                metadata = client.model_metadata(model)
                self.assertEqual(metadata["name"], model)
                self.assertEqual(metadata["versions"], ["1"])
                self.assertIsInstance(metadata["platform"], str)
                for kind, expected in (("inputs", inputs),
                                       ("outputs", outputs)):
                    tensors = metadata[kind]
                    names = [t["name"] for t in tensors]
                    self.assertEqual(sorted(names), sorted(expected), kind)
                    for tensor in tensors:
                        self.assertIn(tensor["datatype"],
                                      expected[tensor["name"]],
                                      tensor["name"])
                        self.assertIsInstance(tensor["shape"], list)
                        for dim in tensor["shape"]:
                            self.assertIsInstance(dim, int)
                            self.assertGreaterEqual(dim, -1)
                # The same with the version in the request.
                self.assertEqual(client.model_metadata(model, version="1"),
                                 metadata)
                answers.append({k: metadata[k] for k in
                                ("name", "versions", "platform", "inputs",
                                 "outputs")})
        self.assertEqual(answers[0], answers[1])
        return answers[0]

    def test_model_metadata(self):
        attention_outputs = {"output": FLOATS, "weights": FLOATS}
        self.check_model_metadata(
            "attend", {"query": FLOATS, "key": FLOATS, "value": FLOATS,
                       "attn_mask": MASKS}, attention_outputs)
        self.check_model_metadata(
            "layer_norm", {"input": FLOATS, "gamma": FLOATS, "beta": FLOATS},
            {"output": FLOATS})
        mha_inputs = {"query": FLOATS, "key": FLOATS, "value": FLOATS,
                      "attn_mask": MASKS, "key_padding_mask": MASKS}
        self.check_model_metadata(
            "multi_head_attend",
            dict(mha_inputs, **{name: FLOATS for name in WEIGHT_NAMES}),
            attention_outputs)
        metadata = self.check_model_metadata(REPOSITORY_MODEL, mha_inputs,
                                             attention_outputs)
        query = [t for t in metadata["inputs"] if t["name"] == "query"][0]
        self.assertIn(query["shape"][-1], (64, -1), query)
        # The repository model is the one the native API lists.
        listed = self.native.ListModels(pb.ListModelsRequest()).models
        self.assertIn(REPOSITORY_MODEL, [m.name for m in listed])

    def test_model_metadata_unknown_model_or_version(self):
        for transport, client in self.transports():
            with self.subTest(transport=transport):
                message = self.assert_error(
                    client, grpc.StatusCode.NOT_FOUND, client.model_metadata,
                    "no_such_model")
                self.assertIn("no_such_model", message)
                self.assert_error(client, grpc.StatusCode.NOT_FOUND,
                                  client.model_metadata, "attend",
                                  version="2")

    def test_model_ready(self):
        for transport, client in self.transports():
            for model in ("attend", "layer_norm", "multi_head_attend",
                          REPOSITORY_MODEL):
                with self.subTest(transport=transport, model=model):
                    self.assertIs(client.model_ready(model), True)
                    self.assertIs(client.model_ready(model, version="1"),
                                  True)
            with self.subTest(transport=transport, model="unknown"):
                # Not served: not ready, an answer rather than an error.
                self.assertIs(client.model_ready("no_such_model"), False)
                self.assertIs(client.model_ready("attend", version="2"),
                              False)
        self.assertEqual(
            self.http.request("GET", "/v2/models/layer_norm/ready"),
            (200, {"name": "layer_norm", "ready": True}))

    # attend.

    def test_attend(self):
        q, k, v = self.randn(2, 3, 5, 16), self.randn(2, 3, 7, 16), \
            self.randn(2, 3, 7, 24)
        out, _ = attention_reference(q, k, v)
        self.check_infer("attend", dict(query=q, key=k, value=v),
                         self.native_attend(q, k, v), {"output": out})

    def test_attend_without_outputs_returns_every_output(self):
        q, k, v = self.randn(2, 3, 5, 16), self.randn(2, 3, 7, 16), \
            self.randn(2, 3, 7, 24)
        out, weights = attention_reference(q, k, v)
        native = self.native_attend(q, k, v, return_weights=True)
        for transport, client in self.transports():
            with self.subTest(transport=transport):
                result = client.infer("attend",
                                      dict(query=q, key=k, value=v))
                self.assert_matches(result, native,
                                    {"output": out, "weights": weights})

    def test_attend_causal_scale_temperature_weights(self):
        q, k, v = self.randn(1, 2, 6, 8), self.randn(1, 2, 4, 8), \
            self.randn(1, 2, 4, 8)
        native = self.native_attend(q, k, v, causal=True, scale=0.3,
                                    temperature=2.0, return_weights=True)
        out, weights = attention_reference(q, k, v, causal=True, scale=0.3,
                                           temperature=2.0)
        self.check_infer("attend", dict(query=q, key=k, value=v), native,
                         {"output": out, "weights": weights},
                         parameters=dict(causal=True, scale=0.3,
                                         temperature=2.0,
                                         return_weights=True))
        self.assertTrue((native["weights"][1][..., 0, 1:] == 0).all())

    def test_attend_integer_scale(self):
        # scale and temperature may be int64 parameters.
        q, k, v = self.randn(2, 4, 8), self.randn(2, 5, 8), \
            self.randn(2, 5, 8)
        native = self.native_attend(q, k, v, scale=1.0, temperature=2.0)
        out, _ = attention_reference(q, k, v, scale=1.0, temperature=2.0)
        self.check_infer("attend", dict(query=q, key=k, value=v), native,
                         {"output": out},
                         parameters=dict(scale=1, temperature=2))

    def test_attend_bool_mask_with_an_empty_row(self):
        q, k, v = self.randn(2, 4, 8), self.randn(2, 5, 8), \
            self.randn(2, 5, 8)
        keep = self.rng.random((4, 5)) > 0.4  # broadcast over the batch
        keep[2] = False  # a query without keys: zeros
        native = self.native_attend(q, k, v, keep, return_weights=True)
        out, weights = attention_reference(q, k, v, mask=keep)
        self.check_infer("attend", dict(query=q, key=k, value=v,
                                        attn_mask=keep),
                         native, {"output": out, "weights": weights},
                         parameters=dict(return_weights=True))
        self.assertTrue((native["output"][1][:, 2] == 0).all())

    def test_attend_uint8_mask(self):
        q, k, v = self.randn(3, 4, 8), self.randn(3, 6, 8), \
            self.randn(3, 6, 8)
        mask = self.rng.choice(np.array([0, 1, 7], dtype=np.uint8),
                               size=(3, 4, 6))
        mask[:, :, 0] = 200  # every query keeps a key
        native = self.native_attend(q, k, v, mask, return_weights=True)
        out, weights = attention_reference(q, k, v, mask=mask != 0)
        self.check_infer("attend", dict(query=q, key=k, value=v,
                                        attn_mask=mask),
                         native, {"output": out, "weights": weights},
                         parameters=dict(return_weights=True))

    def test_attend_float_mask(self):
        q, k, v = self.randn(3, 4, 8), self.randn(3, 6, 8), \
            self.randn(3, 6, 8)
        mask = self.randn(3, 4, 6)
        mask[:, :, 1] = -1e30  # finite: JSON has no infinities
        native = self.native_attend(q, k, v, mask)
        out, _ = attention_reference(q, k, v, mask=mask)
        self.check_infer("attend", dict(query=q, key=k, value=v,
                                        attn_mask=mask),
                         native, {"output": out})

    def test_attend_float16_inputs(self):
        q, k, v = (self.randn(2, 5, 16).astype(np.float16)
                   for _ in range(3))
        native = self.native_attend(q, k, v)
        out, _ = attention_reference(q, k, v)
        self.check_infer("attend", dict(query=q, key=k, value=v), native,
                         {"output": out}, tol=FP16_TOL)

    def test_attend_bfloat16_inputs(self):
        q, k, v = (torch.randn(2, 5, 16).bfloat16() for _ in range(3))
        inputs = dict(query=q, key=k, value=v)
        request = pb.AttendRequest(query=to_tensor(q), key=to_tensor(k),
                                   value=to_tensor(v), return_weights=True)
        try:
            native = self.native_outputs(self.native.Attend(request))
        except grpc.RpcError as error:
            # Where the native RPC cannot compute in bfloat16 (a CPU
            # without bfloat16 GEMMs), the protocol answers as it does.
            for transport, client in self.transports():
                with self.subTest(transport=transport):
                    message = self.assert_error(
                        client, error.code(), client.infer, "attend",
                        inputs, parameters=dict(return_weights=True))
                    self.assertEqual(message, error.details())
            self.skipTest("native Attend refuses these bfloat16 inputs: "
                          f"{error.code().name}: {error.details()}")
        self.assertEqual(native["output"][0], "BF16")
        out, weights = attention_reference(q.float(), k.float(), v.float())
        self.check_infer("attend", inputs, native,
                         {"output": out, "weights": weights},
                         parameters=dict(return_weights=True), tol=BF16_TOL)

    # layer_norm.

    def test_layer_norm(self):
        x, gamma, beta = self.randn(3, 4, 10), self.randn(4, 10), \
            self.randn(4, 10)
        native = self.native_layer_norm(dict(input=x, gamma=gamma, beta=beta),
                                        eps=1e-3, normalized_ndim=2)
        self.check_infer(
            "layer_norm", dict(input=x, gamma=gamma, beta=beta), native,
            {"output": layer_norm_reference(x, gamma, beta, 1e-3, 2)},
            parameters=dict(eps=1e-3, normalized_ndim=2))
        self.check_infer("layer_norm", dict(input=x),
                         self.native_layer_norm(dict(input=x)),
                         {"output": layer_norm_reference(x)})

    def test_layer_norm_gamma_only(self):
        x, gamma = self.randn(5, 12), self.randn(12)
        self.check_infer("layer_norm", dict(input=x, gamma=gamma),
                         self.native_layer_norm(dict(input=x, gamma=gamma)),
                         {"output": layer_norm_reference(x, gamma)})

    # multi_head_attend with inline weights.

    def test_multi_head_attend_fused_weights(self):
        x = self.randn(2, 6, 64)
        keep = np.ones((2, 6), dtype=bool)
        keep[1, 4:] = False
        state = torch_state(self.mha)
        native = self.native_mha(
            dict(query=x, key_padding_mask=keep), return_weights=True,
            weights=attention_weights(state, num_heads=4))
        out, weights = torch_mha(
            self.mha, x, x, x, key_padding_mask=torch.from_numpy(~keep),
            need_weights=True, average_attn_weights=False)
        inputs = dict(query=x, key_padding_mask=keep, **weight_inputs(state))
        self.assertIn("in_proj_weight", inputs)
        self.check_infer("multi_head_attend", inputs, native,
                         {"output": out, "weights": weights},
                         parameters=dict(num_heads=4, return_weights=True))

    def test_multi_head_attend_separate_projections(self):
        # kdim != vdim != E: q/k/v_proj_weight and their biases.
        module = torch.nn.MultiheadAttention(64, 4, kdim=32, vdim=48,
                                             batch_first=True).eval()
        with torch.no_grad():
            module.in_proj_bias.normal_()
        q, k, v = self.randn(2, 5, 64), self.randn(2, 8, 32), \
            self.randn(2, 8, 48)
        keep = self.rng.random((5, 8)) > 0.3
        keep[:, 0] = True  # PyTorch gives NaN for a query without keys
        state = torch_state(module)
        native = self.native_mha(
            dict(query=q, key=k, value=v, attn_mask=keep),
            return_weights=True, average_weights=True,
            weights=attention_weights(state, num_heads=4))
        out, weights = torch_mha(module, q, k, v,
                                 attn_mask=torch.from_numpy(~keep),
                                 need_weights=True, average_attn_weights=True)
        inputs = dict(query=q, key=k, value=v, attn_mask=keep,
                      **weight_inputs(state))
        self.assertIn("v_proj_bias", inputs)
        self.assertNotIn("in_proj_weight", inputs)
        self.check_infer("multi_head_attend", inputs, native,
                         {"output": out, "weights": weights},
                         parameters=dict(num_heads=4, return_weights=True,
                                         average_weights=True))

    def test_multi_head_attend_causal_without_out_proj(self):
        # Without an output projection the output is the heads side by side.
        state = torch_state(self.mha)
        inline = {k: v for k, v in state.items()
                  if not k.startswith("out_proj")}
        x = self.randn(1, 7, 64)
        native = self.native_mha(
            dict(query=x), causal=True,
            weights=attention_weights(inline, num_heads=8))
        self.assertEqual(native["output"][1].shape, (1, 7, 64))
        # Reference: the fused projection, 8 heads of 8, side by side.
        w = inline["in_proj_weight"].double().numpy()
        b = inline["in_proj_bias"].double().numpy()
        heads = [(x.astype(np.float64) @ w[i * 64:(i + 1) * 64].T
                  + b[i * 64:(i + 1) * 64]).reshape(1, 7, 8, 8)
                 .transpose(0, 2, 1, 3) for i in range(3)]
        out, _ = attention_reference(*heads, causal=True)
        out = out.transpose(0, 2, 1, 3).reshape(1, 7, 64)
        self.check_infer("multi_head_attend",
                         dict(query=x, **weight_inputs(inline)), native,
                         {"output": out},
                         parameters=dict(num_heads=8, causal=True))

    # A repository model.

    def test_repository_model_self_attention(self):
        x = self.randn(2, 6, 64)
        keep = np.ones((2, 6), dtype=np.uint8)
        keep[1, 4:] = 0
        native = self.native_mha(dict(query=x, key_padding_mask=keep),
                                 model=REPOSITORY_MODEL, return_weights=True)
        out, weights = torch_mha(
            self.mha, x, x, x, key_padding_mask=torch.from_numpy(keep == 0),
            need_weights=True, average_attn_weights=False)
        self.check_infer(REPOSITORY_MODEL,
                         dict(query=x, key_padding_mask=keep), native,
                         {"output": out, "weights": weights},
                         parameters=dict(return_weights=True))

    def test_repository_model_cross_attention(self):
        q, kv = self.randn(3, 5, 64), self.randn(3, 9, 64)
        keep = self.rng.random((5, 9)) > 0.3
        keep[:, 0] = True
        native = self.native_mha(
            dict(query=q, key=kv, value=kv, attn_mask=keep),
            model=REPOSITORY_MODEL, return_weights=True, average_weights=True)
        out, weights = torch_mha(self.mha, q, kv, kv,
                                 attn_mask=torch.from_numpy(~keep),
                                 need_weights=True, average_attn_weights=True)
        self.check_infer(REPOSITORY_MODEL,
                         dict(query=q, key=kv, value=kv, attn_mask=keep),
                         native, {"output": out, "weights": weights},
                         parameters=dict(return_weights=True,
                                         average_weights=True))

    def test_repository_model_causal(self):
        x = self.randn(2, 7, 64)
        native = self.native_mha(dict(query=x), model=REPOSITORY_MODEL,
                                 causal=True)
        future = torch.ones(7, 7, dtype=torch.bool).triu(1)
        out, _ = torch_mha(self.mha, x, x, x, attn_mask=future,
                           need_weights=False)
        self.check_infer(REPOSITORY_MODEL, dict(query=x), native,
                         {"output": out}, parameters=dict(causal=True))

    # Encodings, outputs, ids and versions.

    def test_typed_contents_equal_raw(self):
        q, k, v = self.randn(2, 4, 8), self.randn(2, 6, 8), \
            self.randn(2, 6, 8)
        x = self.randn(3, 10)
        cases = [
            ("attend", dict(query=q, key=k, value=v,
                            attn_mask=self.rng.random((4, 6)) > 0.2)),
            ("attend", dict(query=q, key=k, value=v,
                            attn_mask=self.rng.integers(
                                0, 3, (4, 6)).astype(np.uint8))),
            ("layer_norm", dict(input=x)),
        ]
        for i, (model, inputs) in enumerate(cases):
            with self.subTest(case=i):
                parameters = (dict(return_weights=True)
                              if model == "attend" else None)
                request = build_infer_request(model, inputs, use_raw=False)
                self.assertEqual(len(request.raw_input_contents), 0)
                raw = self.grpc.infer(model, inputs, parameters,
                                      use_raw=True)
                typed = self.grpc.infer(model, inputs, parameters,
                                        use_raw=False)
                self.assertEqual(sorted(raw), sorted(typed))
                for name in raw:
                    np.testing.assert_array_equal(raw[name], typed[name],
                                                  err_msg=name)
                    self.assertEqual(raw.datatypes[name],
                                     typed.datatypes[name])

    def test_shared_memory(self):
        q, k, v = self.randn(2, 4, 8), self.randn(2, 6, 8), \
            self.randn(2, 6, 8)
        native = self.native_attend(q, k, v, return_weights=True)
        output = native["output"][1]
        for transport, client in self.transports():
            with self.subTest(transport=transport), SharedMemoryRegion(
                    self.native, f"oip-{transport}", 1 << 16) as region:
                inputs = {}
                for name, value in dict(query=q, key=k, value=v).items():
                    ref = region.tensor(value).shared_memory
                    inputs[name] = SharedMemoryInput(
                        "FP32", value.shape, ref.region, ref.byte_size,
                        ref.offset)
                # Inputs by reference, results by value.
                result = client.infer("attend", inputs,
                                      parameters=dict(return_weights=True))
                self.assert_matches(result, native)
                # The output placed in the region, the weights by value.
                room = region.result(output.nbytes)
                result = client.infer("attend", inputs, outputs=[
                    ("output", shared_memory_parameters(
                        room.region, room.byte_size, room.offset)),
                    "weights"])
                self.assertEqual(sorted(result), ["output", "weights"])
                self.assertIsNone(result["output"])
                self.assertEqual(result.datatypes["output"], "FP32")
                self.assertEqual(result.shapes["output"], list(output.shape))
                np.testing.assert_array_equal(result["weights"],
                                              native["weights"][1])
                placed = region.to_numpy(pb.Tensor(
                    dtype=pb.DATA_TYPE_FLOAT32, shape=output.shape,
                    shared_memory=room))
                np.testing.assert_array_equal(placed, output)
                # An unknown region: NOT_FOUND, as natively.
                inputs["query"] = SharedMemoryInput(
                    "FP32", q.shape, "no-such-region", q.nbytes)
                self.assert_error(client, grpc.StatusCode.NOT_FOUND,
                                  client.infer, "attend", inputs)

    def test_outputs_in_raw_output_contents(self):
        x = self.randn(2, 8)
        result = self.grpc.infer("layer_norm", dict(input=x))
        self.assertEqual(len(result.response.raw_output_contents), 1)
        self.assertFalse(result.response.outputs[0].HasField("contents"))

    def test_requested_outputs(self):
        q, k, v = self.randn(2, 4, 8), self.randn(2, 6, 8), \
            self.randn(2, 6, 8)
        inputs = dict(query=q, key=k, value=v)
        both = self.native_attend(q, k, v, return_weights=True)
        out, weights = attention_reference(q, k, v)
        # Asking for the weights turns return_weights on.
        self.check_infer("attend", inputs, {"weights": both["weights"]},
                         {"weights": weights}, outputs=["weights"])
        self.check_infer("attend", inputs, both,
                         {"output": out, "weights": weights},
                         outputs=["output", "weights"])
        self.check_infer("attend", inputs, {"output": both["output"]},
                         {"output": out}, outputs=["output"],
                         parameters=dict(return_weights=True))

    def test_id_echo(self):
        x = self.randn(2, 8)
        for transport, client in self.transports():
            with self.subTest(transport=transport):
                result = client.infer("layer_norm", dict(input=x),
                                      request_id="request-17/b")
                self.assertEqual(result.id, "request-17/b")
                self.assertEqual(result.model_name, "layer_norm")
                result = client.infer("layer_norm", dict(input=x))
                self.assertEqual(result.id, "")
        # Over HTTP the response names the version.
        result = self.http.infer("layer_norm", dict(input=x))
        self.assertEqual(result.model_version, "1")

    def test_model_version(self):
        x = self.randn(2, 8)
        native = self.native_layer_norm(dict(input=x))
        for transport, client in self.transports():
            with self.subTest(transport=transport):
                result = client.infer("layer_norm", dict(input=x),
                                      version="1")
                self.assert_matches(result, native)
                self.assert_error(client, grpc.StatusCode.NOT_FOUND,
                                  client.infer, "layer_norm", dict(input=x),
                                  version="2")

    def test_http_response_layout(self):
        q, k, v = self.randn(1, 3, 4), self.randn(1, 5, 4), \
            self.randn(1, 5, 4)
        body = build_infer_body(dict(query=q, key=k, value=v),
                                parameters=dict(return_weights=True),
                                request_id="layout")
        status, reply = self.http.request("POST", "/v2/models/attend/infer",
                                          body)
        self.assertEqual(status, 200, reply)
        self.assertEqual(reply["model_name"], "attend")
        self.assertEqual(reply["model_version"], "1")
        self.assertEqual(reply["id"], "layout")
        shapes = {t["name"]: t["shape"] for t in reply["outputs"]}
        self.assertEqual(shapes, {"output": [1, 3, 4], "weights": [1, 3, 5]})
        for tensor in reply["outputs"]:
            self.assertEqual(tensor["datatype"], "FP32")
            self.assertEqual(len(tensor["data"]),
                             int(np.prod(tensor["shape"])))
            for value in tensor["data"]:  # flat: numbers, not lists
                self.assertIsInstance(value, (int, float))

    def test_http_nested_data(self):
        x = self.randn(3, 2, 5)
        flat = build_infer_body(dict(input=x))
        nested = build_infer_body(dict(input=x))
        nested["inputs"][0]["data"] = x.tolist()
        answers = []
        for body in (flat, nested):
            status, reply = self.http.request(
                "POST", "/v2/models/layer_norm/infer", body)
            self.assertEqual(status, 200, reply)
            answers.append(reply["outputs"])
        self.assertEqual(answers[0], answers[1])
        np.testing.assert_array_equal(
            from_json_data("FP32", [3, 2, 5], answers[0][0]["data"]),
            self.native_layer_norm(dict(input=x))["output"][1])

    def test_http_versioned_path(self):
        x = self.randn(2, 3)
        body = build_infer_body(dict(input=x))
        replies = [self.http.request("POST", path, body) for path in (
            "/v2/models/layer_norm/infer",
            "/v2/models/layer_norm/versions/1/infer")]
        self.assertEqual(replies[0][0], 200, replies[0])
        self.assertEqual(replies[0], replies[1])

    # Errors.

    def test_unknown_model(self):
        # Whatever the inputs: a model that does not exist has none.
        for transport, client in self.transports():
            for inputs in (dict(query=self.randn(1, 2, 64)),
                           dict(input=self.randn(2, 3))):
                with self.subTest(transport=transport, inputs=list(inputs)):
                    message = self.assert_error(
                        client, grpc.StatusCode.NOT_FOUND, client.infer,
                        "no_such_model", inputs)
                    self.assertIn("no_such_model", message)

    def test_unknown_input_name(self):
        q = self.randn(2, 4, 8)
        for transport, client in self.transports():
            with self.subTest(transport=transport):
                message = self.assert_error(
                    client, grpc.StatusCode.INVALID_ARGUMENT, client.infer,
                    "attend", dict(query=q, key=q, value=q, querry=q))
                self.assertIn("querry", message)
                message = self.assert_error(
                    client, grpc.StatusCode.INVALID_ARGUMENT, client.infer,
                    REPOSITORY_MODEL, dict(query=self.randn(1, 2, 64),
                                           in_proj_weight=self.randn(3, 3)))
                self.assertIn("in_proj_weight", message)

    def test_unknown_parameter(self):
        x = self.randn(2, 3)
        for transport, client in self.transports():
            with self.subTest(transport=transport):
                message = self.assert_error(
                    client, grpc.StatusCode.INVALID_ARGUMENT, client.infer,
                    "layer_norm", dict(input=x), parameters=dict(causel=True))
                self.assertIn("causel", message)

    def test_missing_num_heads(self):
        x = self.randn(1, 4, 64)
        inputs = dict(query=x, **weight_inputs(torch_state(self.mha)))
        for transport, client in self.transports():
            with self.subTest(transport=transport):
                message = self.assert_error(
                    client, grpc.StatusCode.INVALID_ARGUMENT, client.infer,
                    "multi_head_attend", inputs)
                self.assertIn("num_heads", message)

    def test_shape_mismatch_has_the_native_message(self):
        q, k = self.randn(2, 5, 16), self.randn(2, 5, 8)
        with self.assertRaises(grpc.RpcError) as caught:
            self.native.Attend(pb.AttendRequest(
                query=to_tensor(q), key=to_tensor(k), value=to_tensor(k)))
        attend_message = caught.exception.details()
        x = self.randn(2, 3, 32)
        with self.assertRaises(grpc.RpcError) as caught:
            self.native.MultiHeadAttend(pb.MultiHeadAttendRequest(
                model=REPOSITORY_MODEL, query=to_tensor(x)))
        mha_message = caught.exception.details()
        for transport, client in self.transports():
            with self.subTest(transport=transport):
                message = self.assert_error(
                    client, grpc.StatusCode.INVALID_ARGUMENT, client.infer,
                    "attend", dict(query=q, key=k, value=k))
                self.assertEqual(message, attend_message)
                message = self.assert_error(
                    client, grpc.StatusCode.INVALID_ARGUMENT, client.infer,
                    REPOSITORY_MODEL, dict(query=x))
                self.assertEqual(message, mha_message)
        # The server keeps serving.
        self.assertIs(self.grpc.model_ready("attend"), True)

    def test_wrong_datatype_string(self):
        x = self.randn(2, 3)
        request = build_infer_request("layer_norm", dict(input=x))
        request.inputs[0].datatype = "FLOAT32"
        message = self.assert_error(self.grpc,
                                    grpc.StatusCode.INVALID_ARGUMENT,
                                    self.grpc.call, "ModelInfer", request)
        self.assertRegex(message, "FLOAT32|datatype|input")
        body = build_infer_body(dict(input=x))
        body["inputs"][0]["datatype"] = "FLOAT32"
        status, reply = self.http.request(
            "POST", "/v2/models/layer_norm/infer", body)
        self.assertEqual(status, 400, reply)
        self.assertRegex(reply["error"], "FLOAT32|datatype|input")

    def test_data_size_mismatch(self):
        x = self.randn(2, 3)
        request = build_infer_request("layer_norm", dict(input=x))
        request.raw_input_contents[0] = request.raw_input_contents[0][:-4]
        message = self.assert_error(self.grpc,
                                    grpc.StatusCode.INVALID_ARGUMENT,
                                    self.grpc.call, "ModelInfer", request)
        self.assertIn("input", message)
        body = build_infer_body(dict(input=x))
        body["inputs"][0]["data"].pop()
        status, reply = self.http.request(
            "POST", "/v2/models/layer_norm/infer", body)
        self.assertEqual(status, 400, reply)
        self.assertIn("input", reply["error"])

    def test_raw_and_typed_contents_mixed(self):
        x, gamma = self.randn(2, 3), self.randn(3)
        request = build_infer_request("layer_norm", dict(input=x))
        tensor = request.inputs.add(name="gamma", datatype="FP32", shape=[3])
        tensor.contents.fp32_contents.extend(gamma.tolist())
        self.assert_error(self.grpc, grpc.StatusCode.INVALID_ARGUMENT,
                          self.grpc.call, "ModelInfer", request)

    def test_half_types_only_raw(self):
        x = self.randn(2, 3)
        with self.assertRaisesRegex(ValueError, "raw"):
            build_infer_request("layer_norm", dict(input=x.astype(
                np.float16)), use_raw=False)
        # FP16 elements in fp32_contents: refused by the server.
        request = build_infer_request("layer_norm", dict(input=x),
                                      use_raw=False)
        request.inputs[0].datatype = "FP16"
        self.assert_error(self.grpc, grpc.StatusCode.INVALID_ARGUMENT,
                          self.grpc.call, "ModelInfer", request)

    def test_malformed_json(self):
        for body in (b'{"inputs": [{"name": "input", ', b"\xff\xfe",
                     b"[1, 2]", b'{"inputs": 3}'):
            with self.subTest(body=body):
                status, reply = self.http.request(
                    "POST", "/v2/models/layer_norm/infer", body)
                self.assertEqual(status, 400, reply)
                self.assertIsInstance(reply, dict, reply)
                self.assertIsInstance(reply.get("error"), str, reply)
        self.assertIs(self.http.server_live(), True)

    def test_undecodable_grpc_request(self):
        call = self.grpc.channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer")  # bytes as they are
        with self.assertRaises(grpc.RpcError) as caught:
            call(b"\xff\xff\xff\xff\xff", timeout=30)
        self.assertEqual(caught.exception.code(),
                         grpc.StatusCode.INVALID_ARGUMENT,
                         caught.exception.details())
        # Worded as the native API words it.
        self.assertTrue(caught.exception.details().startswith(
            "request: could not parse 5 bytes as"),
            caught.exception.details())
        self.assertIs(self.grpc.server_live(), True)


class SecuredServerTest(ProtocolTestCase):
    """A server with bearer tokens and a 1 MiB message limit."""

    @classmethod
    def setUpClass(cls):
        cls.rng = np.random.default_rng(1)
        cls.workdir = tempfile.TemporaryDirectory()
        tokens = os.path.join(cls.workdir.name, "tokens")
        with open(tokens, "w") as f:
            f.write(TOKEN + "\n")
        cls.server = start_server(cls.workdir.name, "secured",
                                  f"--auth_token_file={tokens}",
                                  "--max_message_mb=1")
        cls.grpc = GrpcClient(cls.server.target, token=TOKEN)
        cls.http = HttpClient(cls.server.http_url, token=TOKEN)
        cls.anonymous = (GrpcClient(cls.server.target),
                         HttpClient(cls.server.http_url))
        cls.wrong_token = (GrpcClient(cls.server.target, token="wrong"),
                           HttpClient(cls.server.http_url, token="wrong"))

    @classmethod
    def tearDownClass(cls):
        for client in (cls.grpc, cls.anonymous[0], cls.wrong_token[0]):
            client.close()
        cls.server.stop()
        cls.workdir.cleanup()

    def test_health_needs_no_token(self):
        for client in self.anonymous:
            with self.subTest(transport=type(client).__name__):
                self.assertIs(client.server_live(), True)
                self.assertIs(client.server_ready(), True)

    def test_calls_need_a_token(self):
        x = self.randn(2, 3)
        for client in self.anonymous + self.wrong_token:
            with self.subTest(transport=type(client).__name__,
                              token=client in self.wrong_token):
                for call, args in ((client.server_metadata, ()),
                                   (client.model_metadata, ("attend",)),
                                   (client.model_ready, ("attend",)),
                                   (client.infer, ("layer_norm",
                                                   dict(input=x)))):
                    self.assert_error(client,
                                      grpc.StatusCode.UNAUTHENTICATED, call,
                                      *args)
        for transport, client in self.transports():
            with self.subTest(transport=transport):
                self.assertEqual(client.server_metadata()["name"],
                                 "attnserve")
                self.assertIs(client.model_ready("attend"), True)
                result = client.infer("layer_norm", dict(input=x))
                np.testing.assert_allclose(result["output"],
                                           layer_norm_reference(x),
                                           **REF_TOL)

    def test_message_limit(self):
        # 1 MiB: a 0.5 MiB tensor passes, a 1.25 MiB one does not.
        small = np.zeros((128, 1024), dtype=np.float32)
        big = np.zeros((320, 1024), dtype=np.float32)
        self.assertEqual(self.grpc.infer("layer_norm", dict(input=small))[
            "output"].shape, small.shape)
        self.assert_error(self.grpc, grpc.StatusCode.RESOURCE_EXHAUSTED,
                          self.grpc.infer, "layer_norm", dict(input=big))
        # JSON: "0.0, " per element.
        body = build_infer_body(dict(input=np.zeros(180_000, np.float32)))
        status, reply = self.http.request(
            "POST", "/v2/models/layer_norm/infer", body)
        self.assertEqual(status, 200, reply)
        body = build_infer_body(dict(input=np.zeros(300_000, np.float32)))
        status, reply = post_early_answered(
            self.server.http_url, "/v2/models/layer_norm/infer",
            json.dumps(body).encode(),
            {"Authorization": f"Bearer {TOKEN}",
             "Content-Type": "application/json"})
        self.assertEqual(status, 413, reply)
        self.assertIsInstance(reply, dict, reply)
        self.assertIsInstance(reply.get("error"), str, reply)
        self.assertIs(self.http.server_live(), True)


class DrainingServerTest(ProtocolTestCase):
    """Readiness turns false while the server drains; liveness stays."""

    def test_not_ready_while_draining(self):
        with tempfile.TemporaryDirectory() as workdir:
            server = start_server(workdir, "draining",
                                  "--lame_duck_seconds=4",
                                  "--drain_seconds=5")
            grpc_client = GrpcClient(server.target, timeout_s=5)
            http = HttpClient(server.http_url, timeout_s=5)
            try:
                self.assertIs(http.server_ready(), True)
                server.process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 3
                while http.server_ready() and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.assertEqual(http.request("GET", "/v2/health/ready"),
                                 (503, {"ready": False}))
                self.assertIs(grpc_client.server_ready(), False)
                self.assertIs(grpc_client.server_live(), True)
                self.assertIs(http.server_live(), True)
                self.assertEqual(server.process.wait(timeout=30), 0)
            finally:
                grpc_client.close()
                server.stop()


class ClientHelpersTest(unittest.TestCase):
    """The client's encodings, without a server."""

    def test_stubs_are_the_committed_ones(self):
        # generate_stubs.sh --check (ctest PythonStubsCurrent) keeps them
        # equal to proto/inference.
        committed = os.path.join(HERE, "inference")
        for module in (oip_pb, oip_pb_grpc):
            self.assertEqual(os.path.dirname(os.path.abspath(
                module.__file__)), committed)
        self.assertEqual(
            oip_pb.DESCRIPTOR.services_by_name[
                "GRPCInferenceService"].full_name,
            "inference.GRPCInferenceService")

    def test_raw_round_trip(self):
        for array in (np.arange(6, dtype=np.float32).reshape(2, 3),
                      np.array([1.5, -2], dtype=np.float16),
                      np.array([[True, False]]),
                      np.arange(4, dtype=np.uint8),
                      np.array([1.0, 2.0], dtype=">f4")):
            datatype, wire = input_array(array)
            back = from_raw(datatype, array.shape, wire.tobytes())
            np.testing.assert_array_equal(back, array)
            self.assertEqual(back.dtype, array.dtype.newbyteorder("="))
        self.assertEqual(input_array(np.array([1.0], ">f4"))[1].tobytes(),
                         np.array([1.0], "<f4").tobytes())
        x = torch.tensor([1.0, -0.5, 3.0]).bfloat16()
        datatype, wire = input_array(x)
        self.assertEqual((datatype, len(wire.tobytes())), ("BF16", 6))
        np.testing.assert_array_equal(from_raw("BF16", [3], wire.tobytes()),
                                      [1.0, -0.5, 3.0])
        with self.assertRaises(TypeError):
            input_array(np.zeros(2))  # float64 has no place in the request
        with self.assertRaisesRegex(ValueError, "bytes"):
            from_raw("FP32", [2], b"\0" * 4)

    def test_json_round_trip(self):
        x = np.random.default_rng(0).standard_normal(50).astype(np.float32)
        for array in (x, x.astype(np.float16), x > 0,
                      np.arange(5, dtype=np.uint8)):
            datatype, wire = input_array(array)
            data = to_json_data(datatype, wire)
            back = from_json_data(datatype, array.shape, data)
            np.testing.assert_array_equal(back, array)
        bf16 = torch.from_numpy(x).bfloat16()
        datatype, wire = input_array(bf16)
        np.testing.assert_array_equal(
            from_json_data("BF16", [50], to_json_data(datatype, wire)),
            bf16.float().numpy())
        np.testing.assert_array_equal(
            from_json_data("FP32", [2, 2], [[1, 2], [3, 4.5]]),
            [[1, 2], [3, 4.5]])
        with self.assertRaises(ValueError):
            from_json_data("BOOL", [2], [1, 0])
        with self.assertRaises(ValueError):
            from_json_data("FP32", [3], [1.0, 2.0])

    def test_request_encodings(self):
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        mask = np.array([[True, False, True]])
        request = build_infer_request(
            "attend", dict(query=x, attn_mask=mask),
            parameters=dict(causal=True, scale=2, temperature=0.5,
                            note="n"),
            outputs=["output", ("weights", {"binary_data": False})],
            request_id="r1", version="1")
        self.assertEqual((request.model_name, request.model_version,
                          request.id), ("attend", "1", "r1"))
        kinds = {k: p.WhichOneof("parameter_choice")
                 for k, p in request.parameters.items()}
        self.assertEqual(kinds, {"causal": "bool_param",
                                 "scale": "int64_param",
                                 "temperature": "double_param",
                                 "note": "string_param"})
        self.assertEqual([(t.name, t.datatype, list(t.shape))
                          for t in request.inputs],
                         [("query", "FP32", [2, 3]),
                          ("attn_mask", "BOOL", [1, 3])])
        self.assertEqual(list(request.raw_input_contents),
                         [x.tobytes(), b"\x01\x00\x01"])
        self.assertEqual([o.name for o in request.outputs],
                         ["output", "weights"])
        typed = build_infer_request("attend", dict(
            query=x, attn_mask=mask, m=np.array([3], np.uint8)),
            use_raw=False)
        self.assertEqual(list(typed.inputs[0].contents.fp32_contents),
                         x.ravel().tolist())
        self.assertEqual(list(typed.inputs[1].contents.bool_contents),
                         [True, False, True])
        self.assertEqual(list(typed.inputs[2].contents.uint_contents), [3])
        body = build_infer_body(dict(query=x), parameters=dict(
            causal=np.bool_(True), scale=np.float32(0.5)),
            outputs=["weights"], request_id="r2")
        self.assertEqual(body, {
            "id": "r2", "parameters": {"causal": True, "scale": 0.5},
            "inputs": [{"name": "query", "shape": [2, 3], "datatype": "FP32",
                        "data": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]}],
            "outputs": [{"name": "weights"}]})

    def test_shared_memory_encodings(self):
        x = np.ones(3, np.float32)
        inputs = dict(query=SharedMemoryInput("FP32", [2, 4], "r1", 32, 64),
                      key=x)
        request = build_infer_request("attend", inputs, outputs=[
            ("output", shared_memory_parameters("r1", 16, 128))])
        self.assertEqual(list(request.raw_input_contents), [x.tobytes()])
        query = request.inputs[0]
        self.assertEqual((query.datatype, list(query.shape)), ("FP32", [2, 4]))
        self.assertEqual(
            {k: (p.WhichOneof("parameter_choice"), getattr(
                p, p.WhichOneof("parameter_choice")))
             for k, p in query.parameters.items()},
            {"shared_memory_region": ("string_param", "r1"),
             "shared_memory_byte_size": ("int64_param", 32),
             "shared_memory_offset": ("int64_param", 64)})
        self.assertIn("shared_memory_region", request.outputs[0].parameters)
        body = build_infer_body(inputs)
        self.assertEqual(body["inputs"][0], {
            "name": "query", "shape": [2, 4], "datatype": "FP32",
            "parameters": {"shared_memory_region": "r1",
                           "shared_memory_byte_size": 32,
                           "shared_memory_offset": 64}})
        # A result in shared memory has no contents, with or without an
        # empty raw entry standing for it.
        response = oip_pb.ModelInferResponse()
        response.outputs.add(name="output", datatype="FP32", shape=[4])
        response.outputs.add(name="weights", datatype="FP32", shape=[1])
        weights = np.array([0.5], np.float32).tobytes()
        for raw in ([weights], [b"", weights]):
            del response.raw_output_contents[:]
            response.raw_output_contents.extend(raw)
            result = decode_infer_response(response, {"output"})
            self.assertIsNone(result["output"])
            np.testing.assert_array_equal(result["weights"], [0.5])
        json_result = decode_infer_body({"outputs": [
            {"name": "output", "datatype": "FP32", "shape": [4],
             "parameters": shared_memory_parameters("r1", 16)}]})
        self.assertEqual(dict(json_result), {"output": None})


if __name__ == "__main__":
    if len(sys.argv) > 1 and os.path.isfile(sys.argv[1]):
        SERVER_BIN = sys.argv.pop(1)
    if not SERVER_BIN:
        sys.exit("usage: test_open_inference.py ATTNSERVE_BINARY "
                 "(or ATTNSERVE_BIN)")
    unittest.main()
