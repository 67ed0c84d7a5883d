#!/usr/bin/python3
"""Tests of the Python client against a live attnserve, PyTorch as reference.

Usage: test_client.py [ATTNSERVE_BINARY] [unittest args], or the binary in
the environment variable ATTNSERVE_BIN. The attnserve.v1 stubs are the
committed ones next to this file.
"""
import os
import subprocess
import sys
import tempfile
import unittest

import grpc
import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from attnserve_client import (MESSAGE_SIZE_OPTIONS,  # noqa
                              ServerProcess, SharedMemoryRegion,
                              attention_weights, connect, load_safetensors,
                              pb, save_model, save_safetensors, to_numpy,
                              to_tensor, to_torch)
from attnserve_client import shared_memory  # noqa
import attnserve_client  # noqa

SERVER_BIN = os.environ.get("ATTNSERVE_BIN", "")
TOL = dict(rtol=1e-4, atol=1e-4)  # the README's float32 contract


def sdpa_reference(q, k, v, mask=None, causal=False, scale=None,
                   temperature=1.0):
    """Float64 attention with the server's semantics; (output, weights)."""
    q, k, v = (torch.as_tensor(t, dtype=torch.float64) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = q @ k.transpose(-1, -2) * scale / temperature
    lq, lk = logits.shape[-2:]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        keep = torch.ones(lq, lk).tril().bool()  # top-left aligned
    if mask is not None:
        mask = torch.as_tensor(mask)
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            logits = logits + mask.double()
    logits = logits.masked_fill(~keep, float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # empty rows
    return (weights @ v).numpy(), weights.numpy()


def torch_state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class ClientTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        torch.manual_seed(0)
        cls.rng = np.random.default_rng(0)
        cls.workdir = tempfile.TemporaryDirectory()
        repository = os.path.join(cls.workdir.name, "models")
        # batch_first: the server's layout is [B, L, E].
        cls.mha = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
        save_model(repository, "mha64", torch_state(cls.mha), num_heads=4,
                   description="test model, E=64, H=4")
        cls.server = ServerProcess(
            [SERVER_BIN, "--host=127.0.0.1", "--port=0", "--metrics_port=-1", "--http_port=-1",
             f"--model_repository={repository}", "--threads=2"],
            "attnserve listening on ", cls.workdir.name, "server")
        cls.stub = connect(cls.server.target)

    @classmethod
    def tearDownClass(cls):
        cls.stub.channel.close()
        cls.server.stop()
        cls.workdir.cleanup()

    def randn(self, *shape):
        return self.rng.standard_normal(shape, dtype=np.float32)

    def torch_mha(self, module, q, k, v, **kwargs):
        """The module in float64 on float32 inputs."""
        double = type(module)(module.embed_dim, module.num_heads,
                              kdim=module.kdim, vdim=module.vdim,
                              batch_first=True).double().eval()
        double.load_state_dict(module.state_dict())
        with torch.no_grad():
            out, weights = double(*(torch.from_numpy(t).double()
                                    for t in (q, k, v)), **kwargs)
        return out.numpy(), weights.numpy()

    def test_model_self_attention_with_padding(self):
        x = self.randn(2, 6, 64)
        padding = np.zeros((2, 6), dtype=bool)
        padding[1, 4:] = True
        # The server keeps nonzero positions; PyTorch masks True ones.
        reply = self.stub.MultiHeadAttend(pb.MultiHeadAttendRequest(
            model="mha64", query=to_tensor(x),
            key_padding_mask=to_tensor(~padding), return_weights=True))
        out, weights = self.torch_mha(
            self.mha, x, x, x, key_padding_mask=torch.from_numpy(padding),
            need_weights=True, average_attn_weights=False)
        self.assertEqual(reply.output.dtype, pb.DATA_TYPE_FLOAT32)
        np.testing.assert_allclose(to_numpy(reply.output), out, **TOL)
        self.assertEqual(list(reply.weights.shape), [2, 4, 6, 6])
        np.testing.assert_allclose(to_numpy(reply.weights), weights, **TOL)

    def test_model_cross_attention_with_mask_and_average(self):
        q, kv = self.randn(3, 5, 64), self.randn(3, 9, 64)
        keep = self.rng.random((5, 9)) > 0.3
        keep[:, 0] = True  # no query without keys: PyTorch would give NaN
        reply = self.stub.MultiHeadAttend(pb.MultiHeadAttendRequest(
            model="mha64", query=to_tensor(q), key=to_tensor(kv),
            attn_mask=to_tensor(keep), return_weights=True,
            average_weights=True))
        out, weights = self.torch_mha(
            self.mha, q, kv, kv, attn_mask=torch.from_numpy(~keep),
            need_weights=True, average_attn_weights=True)
        np.testing.assert_allclose(to_numpy(reply.output), out, **TOL)
        self.assertEqual(list(reply.weights.shape), [3, 5, 9])
        np.testing.assert_allclose(to_numpy(reply.weights), weights, **TOL)

    def test_model_causal_without_weights(self):
        x = self.randn(2, 7, 64)
        reply = self.stub.MultiHeadAttend(pb.MultiHeadAttendRequest(
            model="mha64", query=to_tensor(x), causal=True))
        causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
        out, _ = self.torch_mha(self.mha, x, x, x, attn_mask=causal)
        np.testing.assert_allclose(to_numpy(reply.output), out, **TOL)
        self.assertFalse(reply.HasField("weights"))

    def test_inline_fused_weights(self):
        x = self.randn(2, 6, 64)
        weights = attention_weights(torch_state(self.mha), num_heads=4)
        reply = self.stub.MultiHeadAttend(pb.MultiHeadAttendRequest(
            weights=weights, query=to_tensor(x), return_weights=True))
        out, probs = self.torch_mha(self.mha, x, x, x, need_weights=True,
                                    average_attn_weights=False)
        np.testing.assert_allclose(to_numpy(reply.output), out, **TOL)
        np.testing.assert_allclose(to_numpy(reply.weights), probs, **TOL)

    def test_inline_separate_projections(self):
        # kdim != vdim != E: the state_dict has q/k/v_proj_weight and a
        # fused in_proj_bias, which attention_weights() splits.
        module = torch.nn.MultiheadAttention(64, 4, kdim=32, vdim=48,
                                             batch_first=True).eval()
        with torch.no_grad():
            module.in_proj_bias.normal_()  # PyTorch initializes it to 0
        q, k, v = self.randn(2, 5, 64), self.randn(2, 8, 32), \
            self.randn(2, 8, 48)
        reply = self.stub.MultiHeadAttend(pb.MultiHeadAttendRequest(
            weights=attention_weights(torch_state(module), num_heads=4),
            query=to_tensor(q), key=to_tensor(k), value=to_tensor(v),
            return_weights=True))
        out, probs = self.torch_mha(module, q, k, v, need_weights=True,
                                    average_attn_weights=False)
        np.testing.assert_allclose(to_numpy(reply.output), out, **TOL)
        np.testing.assert_allclose(to_numpy(reply.weights), probs, **TOL)

    def attend(self, q, k, v, mask=None, **options):
        request = pb.AttendRequest(query=to_tensor(q), key=to_tensor(k),
                                   value=to_tensor(v), return_weights=True,
                                   **options)
        if mask is not None:
            request.attn_mask.CopyFrom(to_tensor(mask))
        reply = self.stub.Attend(request)
        return to_numpy(reply.output), to_numpy(reply.weights)

    def test_attend(self):
        q, k, v = self.randn(2, 3, 5, 16), self.randn(2, 3, 7, 16), \
            self.randn(2, 3, 7, 24)
        out, weights = self.attend(q, k, v)
        ref_out, ref_weights = sdpa_reference(q, k, v)
        self.assertEqual(out.shape, (2, 3, 5, 24))
        np.testing.assert_allclose(out, ref_out, **TOL)
        np.testing.assert_allclose(weights, ref_weights, **TOL)

    def test_attend_causal_scale_temperature(self):
        q, k, v = self.randn(1, 2, 6, 8), self.randn(1, 2, 4, 8), \
            self.randn(1, 2, 4, 8)
        out, weights = self.attend(q, k, v, causal=True, scale=0.5,
                                   temperature=2.0)
        ref_out, ref_weights = sdpa_reference(q, k, v, causal=True,
                                              scale=0.5, temperature=2.0)
        np.testing.assert_allclose(out, ref_out, **TOL)
        np.testing.assert_allclose(weights, ref_weights, **TOL)
        self.assertTrue((weights[..., 0, 1:] == 0).all())

    def test_attend_bool_mask_with_an_empty_row(self):
        q, k, v = self.randn(2, 4, 8), self.randn(2, 5, 8), \
            self.randn(2, 5, 8)
        keep = self.rng.random((4, 5)) > 0.4  # broadcast over the batch
        keep[2] = False  # a query with no key: zeros, not NaN
        out, weights = self.attend(q, k, v, keep)
        ref_out, ref_weights = sdpa_reference(q, k, v, mask=keep)
        np.testing.assert_allclose(out, ref_out, **TOL)
        np.testing.assert_allclose(weights, ref_weights, **TOL)
        self.assertTrue((out[:, 2] == 0).all())

    def test_attend_float_mask(self):
        q, k, v = self.randn(3, 4, 8), self.randn(3, 6, 8), \
            self.randn(3, 6, 8)
        mask = self.randn(3, 4, 6)
        mask[:, :, 1] = -np.inf
        out, weights = self.attend(q, k, v, mask)
        ref_out, ref_weights = sdpa_reference(q, k, v, mask=mask)
        np.testing.assert_allclose(out, ref_out, **TOL)
        np.testing.assert_allclose(weights, ref_weights, **TOL)

    def test_attend_bfloat16(self):
        q, k, v = (torch.randn(2, 5, 16).bfloat16() for _ in range(3))
        reply = self.stub.Attend(pb.AttendRequest(
            query=to_tensor(q), key=to_tensor(k), value=to_tensor(v)))
        self.assertEqual(reply.output.dtype, pb.DATA_TYPE_BFLOAT16)
        out = to_torch(reply.output)
        self.assertEqual(out.dtype, torch.bfloat16)
        ref_out, _ = sdpa_reference(q.float(), k.float(), v.float())
        np.testing.assert_allclose(out.float().numpy(), ref_out,
                                   rtol=2e-2, atol=2e-2)

    def test_layer_norm(self):
        x, gamma, beta = self.randn(3, 4, 10), self.randn(4, 10), \
            self.randn(4, 10)
        reply = self.stub.LayerNorm(pb.LayerNormRequest(
            input=to_tensor(x), gamma=to_tensor(gamma), beta=to_tensor(beta),
            eps=1e-6, normalized_ndim=2))
        expected = F.layer_norm(torch.from_numpy(x).double(), (4, 10),
                                torch.from_numpy(gamma).double(),
                                torch.from_numpy(beta).double(), eps=1e-6)
        np.testing.assert_allclose(to_numpy(reply.output), expected, **TOL)

        reply = self.stub.LayerNorm(pb.LayerNormRequest(input=to_tensor(x)))
        expected = F.layer_norm(torch.from_numpy(x).double(), (10,))
        np.testing.assert_allclose(to_numpy(reply.output), expected, **TOL)

    def test_bad_shape_is_invalid_argument(self):
        q, k = self.randn(2, 5, 16), self.randn(2, 5, 8)
        with self.assertRaises(grpc.RpcError) as caught:
            self.stub.Attend(pb.AttendRequest(
                query=to_tensor(q), key=to_tensor(k), value=to_tensor(k)))
        self.assertEqual(caught.exception.code(),
                         grpc.StatusCode.INVALID_ARGUMENT)
        self.assertTrue(caught.exception.details().startswith("key:"),
                        caught.exception.details())
        # The server keeps serving.
        self.stub.LayerNorm(pb.LayerNormRequest(input=to_tensor(q)))

    def test_decode_session_matches_torch(self):
        # Grouped-query attention, 8 query heads over 2 key/value heads:
        # the reference repeats keys and values with repeat_interleave.
        session = self.stub.CreateSession(pb.CreateSessionRequest(
            num_heads=8, num_kv_heads=2, head_dim=16, max_length=32))
        keys = torch.zeros(2, 0, 16, dtype=torch.float64)
        values = torch.zeros(2, 0, 16, dtype=torch.float64)
        for n in (7, 1, 1, 3, 1):
            q, k, v = self.randn(8, n, 16), self.randn(2, n, 16), \
                self.randn(2, n, 16)
            reply = self.stub.SessionStep(pb.SessionStepRequest(
                session_id=session.session_id, query=to_tensor(q),
                key=to_tensor(k), value=to_tensor(v)))
            first = keys.shape[1]
            keys = torch.cat([keys, torch.from_numpy(k).double()], 1)
            values = torch.cat([values, torch.from_numpy(v).double()], 1)
            keep = (torch.arange(first + n)[None, :] <=
                    first + torch.arange(n)[:, None])
            expected, _ = sdpa_reference(
                q, keys.repeat_interleave(4, dim=0),
                values.repeat_interleave(4, dim=0), mask=keep)
            self.assertEqual(reply.length, first + n)
            np.testing.assert_allclose(to_numpy(reply.output), expected,
                                       **TOL)
        self.stub.DeleteSession(
            pb.DeleteSessionRequest(session_id=session.session_id))
        with self.assertRaises(grpc.RpcError) as gone:
            self.stub.SessionStep(pb.SessionStepRequest(
                session_id=session.session_id, query=to_tensor(q),
                key=to_tensor(k), value=to_tensor(v)))
        self.assertEqual(gone.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIn("was deleted", gone.exception.details())

    def test_session_moves_through_export_and_import(self):
        # A session exported, deleted and imported again (the file sent in
        # two chunks) holds its tokens: its next step attends to all.
        session = self.stub.CreateSession(pb.CreateSessionRequest(
            num_heads=4, num_kv_heads=2, head_dim=16, max_length=64))
        k, v = self.randn(2, 9, 16), self.randn(2, 9, 16)
        self.stub.SessionStep(pb.SessionStepRequest(
            session_id=session.session_id, query=to_tensor(self.randn(4, 9, 16)),
            key=to_tensor(k), value=to_tensor(v)))
        chunks = list(self.stub.ExportSession(
            pb.ExportSessionRequest(session_id=session.session_id)))
        data = b"".join(chunk.data for chunk in chunks)
        self.assertEqual(chunks[0].offset, 0)
        self.assertEqual(chunks[-1].size, len(data))
        self.assertEqual(data[:8], b"ATTNSESS")
        self.assertEqual(
            attnserve_client.export_session(self.stub, session.session_id),
            data)
        self.stub.DeleteSession(
            pb.DeleteSessionRequest(session_id=session.session_id))
        # A stream that ends half way leaves the import under way (its
        # header has come); import_session, given the session's id,
        # resumes it from there.
        half = len(data) // 2
        partial = self.stub.ImportSession(iter([
            pb.ImportSessionChunk(offset=0, data=data[:half])]))
        self.assertEqual((partial.received, partial.size), (half, len(data)))
        with self.assertRaises(grpc.RpcError) as importing:
            self.stub.SessionStep(pb.SessionStepRequest(
                session_id=session.session_id,
                query=to_tensor(self.randn(4, 1, 16)),
                key=to_tensor(self.randn(2, 1, 16)),
                value=to_tensor(self.randn(2, 1, 16))))
        self.assertEqual(importing.exception.code(),
                         grpc.StatusCode.UNAVAILABLE)
        reply = attnserve_client.import_session(
            self.stub, data, session_id=session.session_id, chunk_bytes=64)
        self.assertEqual(reply.session_id, session.session_id)
        self.assertEqual(list(reply.lengths), [9])
        self.assertEqual(reply.received, len(data))
        q, k1, v1 = self.randn(4, 1, 16), self.randn(2, 1, 16), \
            self.randn(2, 1, 16)
        step = self.stub.SessionStep(pb.SessionStepRequest(
            session_id=session.session_id, query=to_tensor(q),
            key=to_tensor(k1), value=to_tensor(v1)))
        keys = torch.from_numpy(np.concatenate([k, k1], 1)).double()
        values = torch.from_numpy(np.concatenate([v, v1], 1)).double()
        expected, _ = sdpa_reference(q, keys.repeat_interleave(2, dim=0),
                                     values.repeat_interleave(2, dim=0))
        self.assertEqual(step.length, 10)
        np.testing.assert_allclose(to_numpy(step.output), expected, **TOL)
        self.stub.DeleteSession(
            pb.DeleteSessionRequest(session_id=session.session_id))

    def test_model_session_matches_torch_module(self):
        # Steps of hidden states through the served nn.MultiheadAttention
        # equal the module's causal self-attention over the whole sequence.
        x = self.randn(2, 9, 64)
        causal = torch.full((9, 9), float("-inf")).triu(1).double()
        expected, _ = self.torch_mha(self.mha, x, x, x, attn_mask=causal)
        session = self.stub.CreateSession(
            pb.CreateSessionRequest(model="mha64", batch=2))
        first = 0
        for n in (5, 1, 2, 1):
            reply = self.stub.SessionStep(pb.SessionStepRequest(
                session_id=session.session_id,
                input=to_tensor(np.ascontiguousarray(x[:, first:first + n]))))
            np.testing.assert_allclose(to_numpy(reply.output),
                                       expected[:, first:first + n], **TOL)
            first += n
        self.stub.DeleteSession(
            pb.DeleteSessionRequest(session_id=session.session_id))

    def test_example_decode_runs(self):
        env = dict(os.environ, PYTHONPATH=HERE)
        result = subprocess.run(
            [sys.executable, os.path.join(HERE, "example_decode.py"),
             f"--target={self.server.target}"],
            env=env, cwd=self.workdir.name, capture_output=True, text=True,
            timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("decode: 4 steps of 1 token, length 16", result.stdout)
        self.assertIn("after DeleteSession: NOT_FOUND", result.stdout)

    def test_example_runs(self):
        # As the README runs it: clients/python alone on the path, from a
        # directory other than the checkout.
        env = dict(os.environ, PYTHONPATH=HERE)
        result = subprocess.run(
            [sys.executable, os.path.join(HERE, "example.py"),
             f"--target={self.server.target}", "--model=mha64"],
            env=env, cwd=self.workdir.name, capture_output=True, text=True,
            timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("MultiHeadAttend (mha64, 4 heads): output (2, 10, 64)",
                      result.stdout)
        self.assertIn("weight on padding 0.0", result.stdout)


    def assert_same_results(self, region, by_reference, by_value):
        """Each result of `by_value` equals the one `by_reference` placed in
        `region` (bytes in the message: none)."""
        for field in by_value.DESCRIPTOR.fields_by_name:
            if not by_value.HasField(field):
                self.assertFalse(by_reference.HasField(field))
                continue
            tensor = getattr(by_reference, field)
            self.assertTrue(tensor.HasField("shared_memory"), field)
            self.assertEqual(tensor.raw_data, b"")
            self.assertEqual(tensor.shared_memory.region, region.name)
            np.testing.assert_array_equal(
                region.to_numpy(tensor), to_numpy(getattr(by_value, field)),
                err_msg=field)

    def test_shared_memory_attend(self):
        q, k, v = self.randn(2, 3, 5, 16), self.randn(2, 3, 7, 16), \
            self.randn(2, 3, 7, 24)
        keep = self.rng.random((5, 7)) > 0.3
        with SharedMemoryRegion(self.stub, "test-attend", 1 << 16) as region:
            reply = self.stub.Attend(pb.AttendRequest(
                query=region.tensor(q), key=region.tensor(k),
                value=region.tensor(v), attn_mask=region.tensor(keep),
                return_weights=True, result_regions=region.result_regions(
                    2 * 3 * 5 * 24 * 4, 2 * 3 * 5 * 7 * 4)))
            expected = self.stub.Attend(pb.AttendRequest(
                query=to_tensor(q), key=to_tensor(k), value=to_tensor(v),
                attn_mask=to_tensor(keep), return_weights=True))
            self.assert_same_results(region, reply, expected)
            self.assertEqual(reply.output.shared_memory.byte_size,
                             2 * 3 * 5 * 24 * 4)

    def test_shared_memory_multi_head_attend(self):
        q, kv = self.randn(2, 5, 64), self.randn(2, 9, 64)
        inline = attention_weights(torch_state(self.mha), num_heads=4)
        with SharedMemoryRegion(self.stub, "test-mha", 1 << 18) as region:
            for source in (dict(model="mha64"), dict(weights=inline)):
                region.reset()
                placed = dict(source)
                if "weights" in source:
                    # The inline weights' tensors in shared memory too.
                    placed["weights"] = pb.AttentionWeights(num_heads=4)
                    for field, tensor in inline.ListFields():
                        if field.name != "num_heads":
                            getattr(placed["weights"], field.name).CopyFrom(
                                region.tensor(to_numpy(tensor)))
                reply = self.stub.MultiHeadAttend(pb.MultiHeadAttendRequest(
                    query=region.tensor(q), key=region.tensor(kv),
                    return_weights=True, result_regions=region.result_regions(
                        2 * 5 * 64 * 4, 2 * 4 * 5 * 9 * 4), **placed))
                expected = self.stub.MultiHeadAttend(
                    pb.MultiHeadAttendRequest(
                        query=to_tensor(q), key=to_tensor(kv),
                        return_weights=True, **source))
                self.assert_same_results(region, reply, expected)

    def test_shared_memory_layer_norm(self):
        x, gamma = self.randn(3, 4, 10), self.randn(10)
        with SharedMemoryRegion(self.stub, "test-ln", 1 << 12) as region:
            reply = self.stub.LayerNorm(pb.LayerNormRequest(
                input=region.tensor(x), gamma=region.tensor(gamma),
                result_regions=region.result_regions(x.nbytes)))
            expected = self.stub.LayerNorm(pb.LayerNormRequest(
                input=to_tensor(x), gamma=to_tensor(gamma)))
            self.assert_same_results(region, reply, expected)
            # A result may also come back by value next to shared inputs.
            reply = self.stub.LayerNorm(pb.LayerNormRequest(
                input=region.tensor(x), gamma=region.tensor(gamma)))
            np.testing.assert_array_equal(region.to_numpy(reply.output),
                                          to_numpy(expected.output))

    def test_shared_memory_bad_references(self):
        x = self.randn(4, 8)
        with SharedMemoryRegion(self.stub, "test-bad", 1 << 12) as region:
            tensor = region.tensor(x)
            cases = [
                ("region", "no-such-region", grpc.StatusCode.NOT_FOUND),
                ("offset", region.byte_size, grpc.StatusCode.INVALID_ARGUMENT),
                ("offset", 2, grpc.StatusCode.INVALID_ARGUMENT),  # unaligned
                ("byte_size", x.nbytes - 4, grpc.StatusCode.INVALID_ARGUMENT),
            ]
            for field, value, code in cases:
                bad = pb.Tensor()
                bad.CopyFrom(tensor)
                setattr(bad.shared_memory, field, value)
                with self.assertRaises(grpc.RpcError, msg=field) as caught:
                    self.stub.LayerNorm(pb.LayerNormRequest(input=bad))
                self.assertEqual(caught.exception.code(), code,
                                 caught.exception.details())
                self.assertIn("input", caught.exception.details())
            with self.assertRaises(grpc.RpcError) as caught:
                self.stub.LayerNorm(pb.LayerNormRequest(
                    input=tensor, result_regions=region.result_regions(8)))
            self.assertEqual(caught.exception.code(),
                             grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("result_regions.output",
                          caught.exception.details())
            # A name in use: the second object is removed again.
            before = set(os.listdir("/dev/shm"))
            with self.assertRaises(grpc.RpcError) as caught:
                SharedMemoryRegion(self.stub, "test-bad", 1 << 12)
            self.assertEqual(caught.exception.code(),
                             grpc.StatusCode.ALREADY_EXISTS)
            self.assertEqual(set(os.listdir("/dev/shm")), before)

    def test_shared_memory_close(self):
        x = self.randn(3, 10)
        region = SharedMemoryRegion(self.stub, "test-close", 1 << 12)
        listed = self.stub.ListSharedMemory(
            pb.ListSharedMemoryRequest(name="test-close")).regions
        self.assertEqual([(r.key, r.byte_size) for r in listed],
                         [(region.key, 1 << 12)])
        self.assertTrue(os.path.exists("/dev/shm" + region.key))
        reply = self.stub.LayerNorm(pb.LayerNormRequest(
            input=region.tensor(x),
            result_regions=region.result_regions(x.nbytes)))
        view = region.to_numpy(reply.output)
        kept = view.copy()
        region.close()
        region.close()  # idempotent
        self.assertTrue(region.closed)
        self.assertEqual(
            list(self.stub.ListSharedMemory(
                pb.ListSharedMemoryRequest()).regions), [])
        self.assertFalse(os.path.exists("/dev/shm" + region.key))
        # A view outlives the region: still mapped, no longer registered.
        np.testing.assert_array_equal(view, kept)
        with self.assertRaisesRegex(ValueError, "closed"):
            region.tensor(x)

    def test_example_shared_memory_runs(self):
        env = dict(os.environ, PYTHONPATH=HERE)
        result = subprocess.run(
            [sys.executable, os.path.join(HERE, "example_shared_memory.py"),
             f"--target={self.server.target}"],
            env=env, cwd=self.workdir.name, capture_output=True, text=True,
            timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        lines = result.stdout.splitlines()
        self.assertEqual(len(lines), 3, result.stdout)
        self.assertIn("Attend weights: (2, 8, 128, 128) float32", lines[1])
        for line in lines:
            self.assertTrue(line.endswith("max |diff| vs by value 0.0e+00"),
                            line)

class HelpersTest(unittest.TestCase):
    """The conversions and the safetensors writer, without a server."""

    def test_stubs_are_the_committed_ones(self):
        # Nothing else on the path (a build folder's copy) stands in for
        # clients/python/attnserve/v1, which PythonStubsCurrent checks.
        committed = os.path.join(HERE, "attnserve", "v1")
        for module in (pb, attnserve_client.pb_grpc):
            self.assertEqual(os.path.dirname(os.path.abspath(module.__file__)),
                             committed)

    def test_dtypes_round_trip(self):
        for array in (np.arange(6, dtype=np.float32).reshape(2, 3),
                      np.array([1.5, -2], dtype=np.float16),
                      np.array([[True, False]]),
                      np.arange(4, dtype=np.uint8)):
            tensor = to_tensor(array)
            back = to_numpy(tensor)
            self.assertEqual(back.dtype, array.dtype)
            np.testing.assert_array_equal(back, array)
        # float64 travels as FLOAT32; big-endian data is swapped.
        self.assertEqual(to_tensor(np.zeros(2)).dtype, pb.DATA_TYPE_FLOAT32)
        big = np.array([1.0, 2.0], dtype=">f4")
        np.testing.assert_array_equal(to_numpy(to_tensor(big)), [1.0, 2.0])
        self.assertEqual(to_tensor(big).raw_data,
                         np.array([1, 2], "<f4").tobytes())

    def test_bfloat16_and_float_data(self):
        x = torch.tensor([1.0, -0.5, 3.0]).bfloat16()
        tensor = to_tensor(x)
        self.assertEqual(tensor.dtype, pb.DATA_TYPE_BFLOAT16)
        self.assertEqual(len(tensor.raw_data), 6)
        self.assertTrue(torch.equal(to_torch(tensor), x))
        np.testing.assert_array_equal(to_numpy(tensor), [1.0, -0.5, 3.0])
        hand = pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2],
                         float_data=[1, 2])
        np.testing.assert_array_equal(to_numpy(hand), [1, 2])

    def test_safetensors_round_trip(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t.safetensors")
            save_safetensors(path, {"a": np.ones((2, 3), np.float32),
                                    "m": np.array([True, False])},
                             metadata={"op": "attend"})
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
            self.assertEqual(header_len % 8, 0)
            tensors, metadata = load_safetensors(path)
        self.assertEqual(metadata, {"op": "attend"})
        np.testing.assert_array_equal(tensors["a"], np.ones((2, 3)))
        np.testing.assert_array_equal(tensors["m"], [True, False])

    def test_attention_weights_refuses_unknown_names(self):
        with self.assertRaisesRegex(ValueError, "bias_k"):
            attention_weights({"bias_k": torch.zeros(1, 1, 4)}, num_heads=1)


    def test_shared_memory_placement(self):
        """Tensors in a region: aligned, converted in the copy, read back."""
        class Stub:  # registration succeeds, as on a server
            RegisterSharedMemory = UnregisterSharedMemory = \
                staticmethod(lambda request, **kwargs: None)

        values = [np.arange(6, dtype=np.float32).reshape(2, 3),
                  np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2],
                  np.array([1.0, 2.0], dtype=">f4"),
                  np.array([[True, False]]),
                  np.array([1.5, -2], dtype=np.float16),
                  np.zeros((0, 3), dtype=np.float32)]
        with SharedMemoryRegion(Stub(), "helpers", 1024) as region:
            for value in values:
                tensor = region.tensor(value)
                ref = tensor.shared_memory
                self.assertEqual(ref.offset % shared_memory.ALIGNMENT, 0)
                self.assertEqual(ref.byte_size,
                                 value.size * value.dtype.itemsize
                                 if value.dtype != np.float64
                                 else value.size * 4)
                self.assertEqual(tensor.dtype, to_tensor(value).dtype)
                np.testing.assert_array_equal(region.to_numpy(tensor), value)
            x = torch.tensor([[1.0, -0.5], [3.0, 0.25]]).bfloat16().t()
            tensor = region.tensor(x)  # strided
            self.assertEqual(tensor.dtype, pb.DATA_TYPE_BFLOAT16)
            self.assertTrue(torch.equal(region.to_torch(tensor), x))
            np.testing.assert_array_equal(region.to_numpy(tensor),
                                          x.float().numpy())
            # Raw tensors go to the package's conversions.
            np.testing.assert_array_equal(
                region.to_numpy(to_tensor(values[0])), values[0])
            with self.assertRaisesRegex(ValueError, "larger region"):
                region.result(1024)
            region.reset()
            self.assertEqual(region.result(1024).offset, 0)
            other = pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[1],
                              shared_memory=pb.SharedMemoryRef(
                                  region="other", byte_size=4))
            with self.assertRaisesRegex(ValueError, "'other'"):
                region.to_numpy(other)
        with self.assertRaisesRegex(ValueError, "name"):
            SharedMemoryRegion(Stub(), "", 64)

    def test_large_buffers_are_kept(self):
        """After keep_large_buffers, a freed 64 MB block is reused memory
        of the heap instead of a fresh mapping (glibc's mallinfo2)."""
        script = """
import ctypes, sys
from attnserve_client import keep_large_buffers
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
        "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
def mapped_by(size):
    before = libc.mallinfo2().hblkhd
    block = bytearray(size)
    return libc.mallinfo2().hblkhd - before
size = 64 << 20
print(mapped_by(size) >= size, keep_large_buffers(), keep_large_buffers(),
      mapped_by(size) >= size)
"""
        env = dict(os.environ)
        env.pop("GLIBC_TUNABLES", None)
        out = subprocess.run([sys.executable, "-c", script], env=env,
                             check=True, capture_output=True, text=True)
        self.assertEqual(out.stdout.split(), ["True", "True", "True",
                                              "False"])
        env["GLIBC_TUNABLES"] = "glibc.malloc.mmap_threshold=65536"
        out = subprocess.run([sys.executable, "-c", script], env=env,
                             check=True, capture_output=True, text=True)
        self.assertEqual(out.stdout.split(), ["True", "False", "False",
                                              "True"])

    def test_channel_message_sizes(self):
        self.assertEqual(dict(MESSAGE_SIZE_OPTIONS),
                         {"grpc.max_receive_message_length": -1,
                          "grpc.max_send_message_length": -1})

if __name__ == "__main__":
    if len(sys.argv) > 1 and os.path.isfile(sys.argv[1]):
        SERVER_BIN = sys.argv.pop(1)
    if not SERVER_BIN:
        sys.exit("usage: test_client.py ATTNSERVE_BINARY (or ATTNSERVE_BIN)")
    unittest.main()
