#!/usr/bin/python3
"""Smoke test of the PyTorch peer: same requests, same answers as attnserve.

Starts attnserve (ATTNSERVE_BIN, or the first argument) and torch_peer.py
on one model repository written here, sends both the same requests and
compares the results. PYTHONPATH must hold the attnserve.v1 stubs and
clients/python.
"""
import os
import sys
import tempfile
import unittest

import grpc
import numpy as np
import torch

from attnserve_client import (ServerProcess, attention_weights, connect, pb,
                              save_model, to_numpy, to_tensor)

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER_BIN = os.environ.get("ATTNSERVE_BIN", "")
TOL = dict(rtol=1e-4, atol=1e-4)


class PeerSmokeTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        torch.manual_seed(0)
        cls.rng = np.random.default_rng(0)
        cls.workdir = tempfile.TemporaryDirectory()
        repository = os.path.join(cls.workdir.name, "models")
        cls.mha = torch.nn.MultiheadAttention(64, 4, batch_first=True)
        save_model(repository, "mha64", cls.mha.state_dict(), num_heads=4)
        save_model(repository, "mha64_bf16", cls.mha.state_dict(),
                   num_heads=4, compute_dtype=pb.DATA_TYPE_BFLOAT16)
        cls.servers = [
            ServerProcess([SERVER_BIN, "--host=127.0.0.1", "--port=0",
                     "--metrics_port=-1", "--http_port=-1", f"--model_repository={repository}"],
                    "attnserve listening on ", cls.workdir.name, "attnserve"),
            ServerProcess([sys.executable, os.path.join(HERE, "torch_peer.py"),
                     "--port=0", "--torch_threads=1",
                     f"--model_repository={repository}"],
                    "peer listening on ", cls.workdir.name, "peer"),
        ]
        cls.stubs = [connect(s.target) for s in cls.servers]

    @classmethod
    def tearDownClass(cls):
        for stub in cls.stubs:
            stub.channel.close()
        for server in cls.servers:
            server.stop()
        cls.workdir.cleanup()

    def randn(self, *shape):
        return self.rng.standard_normal(shape, dtype=np.float32)

    def both(self, rpc, request, fields=("output", "weights"), tol=TOL):
        """Sends `request` to both servers and compares `fields`."""
        ours, peer = (getattr(stub, rpc)(request) for stub in self.stubs)
        for field in fields:
            self.assertEqual(ours.HasField(field), peer.HasField(field),
                             field)
            if not ours.HasField(field):
                continue
            a, b = getattr(ours, field), getattr(peer, field)
            self.assertEqual(a.dtype, b.dtype, field)
            self.assertEqual(list(a.shape), list(b.shape), field)
            np.testing.assert_allclose(to_numpy(b), to_numpy(a), **tol,
                                       err_msg=field)
        return ours, peer

    def test_model_self_attention(self):
        keep = np.ones((2, 6), dtype=bool)
        keep[1, 4:] = False
        self.both("MultiHeadAttend", pb.MultiHeadAttendRequest(
            model="mha64", query=to_tensor(self.randn(2, 6, 64)),
            key_padding_mask=to_tensor(keep), return_weights=True))

    def test_model_cross_attention(self):
        keep = self.rng.random((3, 5, 7)) > 0.3
        keep[0, 1] = False  # a query without keys
        self.both("MultiHeadAttend", pb.MultiHeadAttendRequest(
            model="mha64", query=to_tensor(self.randn(3, 5, 64)),
            key=to_tensor(self.randn(3, 7, 64)), attn_mask=to_tensor(keep),
            causal=True, return_weights=True, average_weights=True))
        # Unbatched.
        self.both("MultiHeadAttend", pb.MultiHeadAttendRequest(
            model="mha64", query=to_tensor(self.randn(4, 64)),
            return_weights=True))

    def test_bfloat16(self):
        bf16 = dict(rtol=2e-2, atol=2e-2)
        x = self.randn(2, 6, 64)
        self.both("MultiHeadAttend", pb.MultiHeadAttendRequest(
            model="mha64_bf16", query=to_tensor(x), return_weights=True),
            tol=bf16)
        self.both("MultiHeadAttend", pb.MultiHeadAttendRequest(
            model="mha64_bf16",
            query=to_tensor(torch.from_numpy(x).bfloat16())), tol=bf16)
        weights = attention_weights(self.mha.state_dict(), num_heads=4)
        self.both("MultiHeadAttend", pb.MultiHeadAttendRequest(
            weights=weights, query=to_tensor(x), compute_bf16=True),
            tol=bf16)

    def test_inline_weights(self):
        module = torch.nn.MultiheadAttention(32, 2, kdim=16, vdim=24)
        weights = attention_weights(module.state_dict(), num_heads=2)
        self.both("MultiHeadAttend", pb.MultiHeadAttendRequest(
            weights=weights, query=to_tensor(self.randn(2, 3, 32)),
            key=to_tensor(self.randn(2, 5, 16)),
            value=to_tensor(self.randn(2, 5, 24)), scale=0.3,
            temperature=1.5, return_weights=True))

    def test_attend(self):
        q, k, v = self.randn(2, 3, 6, 16), self.randn(2, 3, 8, 16), \
            self.randn(2, 3, 8, 12)
        mask = self.randn(3, 6, 8)
        mask[:, 2] = -np.inf  # a query without keys
        for options in (dict(), dict(causal=True),
                        dict(attn_mask=to_tensor(mask)),
                        dict(attn_mask=to_tensor(mask[0] > 0), scale=0.2)):
            self.both("Attend", pb.AttendRequest(
                query=to_tensor(q), key=to_tensor(k), value=to_tensor(v),
                return_weights=True, **options))
        bf16 = [torch.from_numpy(t).bfloat16() for t in (q, k, v)]
        self.both("Attend", pb.AttendRequest(
            query=to_tensor(bf16[0]), key=to_tensor(bf16[1]),
            value=to_tensor(bf16[2])), tol=dict(rtol=2e-2, atol=2e-2))

    def test_layer_norm(self):
        self.both("LayerNorm", pb.LayerNormRequest(
            input=to_tensor(self.randn(3, 4, 10)),
            gamma=to_tensor(self.randn(4, 10)),
            beta=to_tensor(self.randn(4, 10)), eps=1e-6,
            normalized_ndim=2), fields=("output",))

    def test_models_and_errors(self):
        ours, peer = (stub.GetModelMetadata(
            pb.GetModelMetadataRequest(name="mha64")) for stub in self.stubs)
        for field in ("num_heads", "query_dim", "key_dim", "value_dim",
                      "head_key_dim", "head_value_dim", "output_dim",
                      "compute_dtype"):
            self.assertEqual(getattr(ours, field), getattr(peer, field))
        bad = pb.AttendRequest(query=to_tensor(self.randn(2, 5, 16)),
                               key=to_tensor(self.randn(2, 5, 8)),
                               value=to_tensor(self.randn(2, 5, 8)))
        unknown = pb.MultiHeadAttendRequest(
            model="nope", query=to_tensor(self.randn(1, 2, 64)))
        for stub in self.stubs:
            with self.assertRaises(grpc.RpcError) as caught:
                stub.Attend(bad)
            self.assertEqual(caught.exception.code(),
                             grpc.StatusCode.INVALID_ARGUMENT)
            self.assertTrue(caught.exception.details().startswith("key:"))
            with self.assertRaises(grpc.RpcError) as caught:
                stub.MultiHeadAttend(unknown)
            self.assertEqual(caught.exception.code(),
                             grpc.StatusCode.NOT_FOUND)


if __name__ == "__main__":
    if len(sys.argv) > 1 and os.path.isfile(sys.argv[1]):
        SERVER_BIN = sys.argv.pop(1)
    if not SERVER_BIN:
        sys.exit("usage: smoke_test.py ATTNSERVE_BINARY (or ATTNSERVE_BIN)")
    unittest.main()
