#!/usr/bin/python3
"""Decodes with a server-side key/value cache: one CreateSession, a prompt
in one SessionStep (prefill), then one token a step. Grouped-query attention
(8 query heads over 2 key/value heads) with rotary position embeddings;
every step is checked against attention over the whole history in float64
numpy."""
import argparse

import grpc
import numpy as np

from attnserve_client import connect, pb, to_numpy, to_tensor

HEADS, KV_HEADS, DIM = 8, 2, 64


def rotate(x, first):
    """Rotary embeddings, half-rotation layout, positions first, first+1, ...
    of x [heads, n, DIM], in float64."""
    half = DIM // 2
    inv_freq = 10000.0 ** (-np.arange(half) * 2.0 / DIM)
    angle = (first + np.arange(x.shape[1]))[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def reference(q, keys, values, first):
    """The new queries q [HEADS, n, DIM] at positions first.. attending to
    every cached key (causal), each key/value head serving its group."""
    group = HEADS // KV_HEADS
    k = np.repeat(rotate(keys.astype(np.float64), 0), group, axis=0)
    v = np.repeat(values.astype(np.float64), group, axis=0)
    logits = rotate(q.astype(np.float64), first) @ k.transpose(0, 2, 1)
    logits /= np.sqrt(DIM)
    n, total = q.shape[1], keys.shape[1]
    hidden = np.arange(total)[None, :] > first + np.arange(n)[:, None]
    logits[:, hidden] = -np.inf
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="127.0.0.1:50051")
    args = parser.parse_args()
    stub = connect(args.target)
    rng = np.random.default_rng(0)

    session = stub.CreateSession(pb.CreateSessionRequest(
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
        rotary_dims=DIM, max_length=64))
    keys = np.zeros((KV_HEADS, 0, DIM), np.float32)
    values = np.zeros((KV_HEADS, 0, DIM), np.float32)
    worst = 0.0
    for step, n in enumerate([12, 1, 1, 1, 1]):
        q = rng.standard_normal((HEADS, n, DIM), dtype=np.float32)
        k, v = (rng.standard_normal((KV_HEADS, n, DIM), dtype=np.float32)
                for _ in range(2))
        reply = stub.SessionStep(pb.SessionStepRequest(
            session_id=session.session_id, query=to_tensor(q),
            key=to_tensor(k), value=to_tensor(v)))
        first = keys.shape[1]
        keys = np.concatenate([keys, k], 1)
        values = np.concatenate([values, v], 1)
        output = to_numpy(reply.output)
        diff = np.abs(output - reference(q, keys, values, first)).max()
        if step == 0:
            print(f"prefill: {n} tokens, output {output.shape}, "
                  f"max |diff| vs numpy {diff:.1e}")
        worst = max(worst, diff)
    print(f"decode: 4 steps of 1 token, length {reply.length}, "
          f"max |diff| vs numpy {worst:.1e}")

    stub.DeleteSession(pb.DeleteSessionRequest(session_id=session.session_id))
    try:
        stub.SessionStep(pb.SessionStepRequest(
            session_id=session.session_id, query=to_tensor(q),
            key=to_tensor(k), value=to_tensor(v)))
    except grpc.RpcError as error:
        print(f"after DeleteSession: {error.code().name}")


if __name__ == "__main__":
    main()
