#!/usr/bin/python3
"""Calls attnserve's Attend and LayerNorm through shared memory.

The inputs are copied into a shared-memory region registered with the
server, which writes the results there too; each result is compared with
the same call by value. The server must run on this host.
"""
import argparse
import os
import sys

import numpy as np

from attnserve_client import (SharedMemoryRegion, connect, pb, to_numpy,
                              to_tensor)


def compare(label, region, by_reference, by_value):
    """Prints one line about a result; False if it differs from by_value."""
    view = region.to_numpy(by_reference)
    diff = float(np.abs(view - to_numpy(by_value)).max()) if view.size else 0.
    ref = by_reference.shared_memory
    print(f"{label}: {view.shape} {view.dtype} at {ref.region}+{ref.offset} "
          f"({ref.byte_size} bytes), max |diff| vs by value {diff:.1e}")
    return diff <= 1e-6


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="127.0.0.1:50051")
    args = parser.parse_args()
    stub = connect(args.target)
    rng = np.random.default_rng(0)
    ok = True

    # A name of this process's own: several clients may share the server.
    with SharedMemoryRegion(stub, f"example-{os.getpid()}", 4 << 20) as region:
        # Attention: batch 2, 8 heads, 128 queries and keys, dim 64: 1.5 MiB
        # of inputs, 0.5 MiB of output, 1 MiB of weights.
        q, k, v = (rng.standard_normal((2, 8, 128, 64), dtype=np.float32)
                   for _ in range(3))
        request = pb.AttendRequest(
            query=region.tensor(q), key=region.tensor(k),
            value=region.tensor(v), return_weights=True,
            result_regions=region.result_regions(
                output_bytes=q.nbytes, weights_bytes=2 * 8 * 128 * 128 * 4))
        reply = stub.Attend(request)
        expected = stub.Attend(pb.AttendRequest(
            query=to_tensor(q), key=to_tensor(k), value=to_tensor(v),
            return_weights=True))
        ok &= compare("Attend output", region, reply.output, expected.output)
        ok &= compare("Attend weights", region, reply.weights,
                      expected.weights)

        # The space again for the next request: the views above now show
        # whatever it writes over them.
        region.reset()
        x = rng.standard_normal((4, 128, 512), dtype=np.float32)
        gamma, beta = rng.standard_normal((2, 512), dtype=np.float32)
        reply = stub.LayerNorm(pb.LayerNormRequest(
            input=region.tensor(x), gamma=region.tensor(gamma),
            beta=region.tensor(beta),
            result_regions=region.result_regions(output_bytes=x.nbytes)))
        expected = stub.LayerNorm(pb.LayerNormRequest(
            input=to_tensor(x), gamma=to_tensor(gamma), beta=to_tensor(beta)))
        ok &= compare("LayerNorm output", region, reply.output,
                      expected.output)
    stub.channel.close()
    if not ok:
        sys.exit("results through shared memory differ from those by value")


if __name__ == "__main__":
    main()
