#!/usr/bin/python3
"""Calls attnserve's LayerNorm, Attend and MultiHeadAttend once each."""
import argparse

import numpy as np

from attnserve_client import connect, pb, to_numpy, to_tensor


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--model", default="demo")
    args = parser.parse_args()
    stub = connect(args.target)
    rng = np.random.default_rng(0)

    # LayerNorm over the last dim, checked against numpy.
    x = rng.standard_normal((4, 16), dtype=np.float32)
    reply = stub.LayerNorm(pb.LayerNormRequest(input=to_tensor(x), eps=1e-5))
    output = to_numpy(reply.output)
    expected = (x - x.mean(-1, keepdims=True)) / np.sqrt(
        x.var(-1, keepdims=True) + 1e-5)
    print(f"LayerNorm: output {output.shape}, "
          f"max |diff| vs numpy {np.abs(output - expected).max():.1e}")

    # Causal scaled dot-product attention: batch 2, 8 heads, 5 queries and
    # keys, dim 64.
    q, k, v = (rng.standard_normal((2, 8, 5, 64), dtype=np.float32)
               for _ in range(3))
    reply = stub.Attend(pb.AttendRequest(
        query=to_tensor(q), key=to_tensor(k), value=to_tensor(v),
        causal=True, return_weights=True))
    weights = to_numpy(reply.weights)
    print(f"Attend: output {to_numpy(reply.output).shape}, "
          f"last query's weights {np.round(weights[0, 0, -1], 2)}")

    # Multi-head attention with the server's model; the second sequence ends
    # in 3 padding positions (key_padding_mask: True keeps a key).
    meta = stub.GetModelMetadata(pb.GetModelMetadataRequest(name=args.model))
    x = rng.standard_normal((2, 10, meta.query_dim), dtype=np.float32)
    keep = np.ones((2, 10), dtype=bool)
    keep[1, 7:] = False
    reply = stub.MultiHeadAttend(pb.MultiHeadAttendRequest(
        model=args.model, query=to_tensor(x), key_padding_mask=to_tensor(keep),
        return_weights=True, average_weights=True))
    weights = to_numpy(reply.weights)
    print(f"MultiHeadAttend ({args.model}, {meta.num_heads} heads): output "
          f"{to_numpy(reply.output).shape}, weights {weights.shape}, "
          f"weight on padding {weights[1, :, 7:].sum():.1f}")


if __name__ == "__main__":
    main()
