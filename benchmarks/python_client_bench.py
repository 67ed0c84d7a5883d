#!/usr/bin/python3
"""One call in flight from the Python client, as a user's code makes it.

Each call converts numpy inputs to request tensors (or copies them into a
shared-memory region), calls the server and turns the output into a numpy
array: the whole round trip a Python caller pays. Prints a JSON object with
the p50 end-to-end time and the server's compute time (the
`attnserve-compute-us` trailer), in milliseconds.

Takes attnctl bench's workload flags: an operation (attend, mha, layernorm)
and --batch --seq --kv_seq --dim --heads --model.
"""

import argparse
import json
import statistics
import time

import numpy as np

from attnserve_client import SharedMemoryRegion, connect, pb, to_numpy, to_tensor


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("op", choices=("attend", "mha", "layernorm"))
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--duration_s", type=float, default=3)
    parser.add_argument("--warmup_calls", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--kv_seq", type=int, default=0)
    parser.add_argument("--dim", type=int, default=0)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--model", default="")
    parser.add_argument("--shared_memory", action="store_true")
    return parser.parse_args()


def workload(args, stub):
    """(rpc method, numpy inputs by field, options, output and weights bytes)."""
    rng = np.random.default_rng(0)

    def uniform(*shape):
        return rng.uniform(-1, 1, shape).astype(np.float32)

    kv_seq = args.kv_seq or args.seq
    if args.op == "attend":
        dim = args.dim or 64
        lead = (args.batch, args.heads)
        inputs = {"query": uniform(*lead, args.seq, dim),
                  "key": uniform(*lead, kv_seq, dim),
                  "value": uniform(*lead, kv_seq, dim)}
        return (stub.Attend, pb.AttendRequest, inputs, {},
                args.batch * args.heads * args.seq * dim * 4)
    if args.op == "layernorm":
        dim = args.dim or 512
        shape = ((args.batch, dim) if args.seq == 0
                 else (args.batch, args.seq, dim))
        inputs = {"input": uniform(*shape)}
        return (stub.LayerNorm, pb.LayerNormRequest, inputs, {},
                inputs["input"].nbytes)
    if not args.model:
        raise SystemExit("mha: --model is required here")
    meta = stub.GetModelMetadata(pb.GetModelMetadataRequest(name=args.model))
    inputs = {"query": uniform(args.batch, args.seq, meta.query_dim)}
    return (stub.MultiHeadAttend, pb.MultiHeadAttendRequest, inputs,
            {"model": args.model},
            args.batch * args.seq * meta.output_dim * 4)


def main():
    args = parse_args()
    stub = connect(args.target)
    method, request_type, inputs, options, output_bytes = workload(args, stub)
    region = None
    if args.shared_memory:
        size = sum(x.nbytes + 64 for x in inputs.values()) + output_bytes + 64
        region = SharedMemoryRegion(stub, "python-client-bench", size)

    def call():
        if region is None:
            request = request_type(
                **{k: to_tensor(v) for k, v in inputs.items()}, **options)
        else:
            region.reset()
            request = request_type(
                **{k: region.tensor(v) for k, v in inputs.items()},
                result_regions=region.result_regions(output_bytes),
                **options)
        reply, rpc = method.with_call(request)
        output = (to_numpy(reply.output) if region is None
                  else region.to_numpy(reply.output))
        compute = dict(rpc.trailing_metadata())["attnserve-compute-us"]
        return output, int(compute) / 1e3

    try:
        for _ in range(args.warmup_calls):
            call()
        latencies, computes = [], []
        end = time.perf_counter() + args.duration_s
        while time.perf_counter() < end or len(latencies) < 3:
            start = time.perf_counter()
            _, compute = call()
            latencies.append((time.perf_counter() - start) * 1e3)
            computes.append(compute)
    finally:
        if region is not None:
            region.close()
    print(json.dumps({"calls": len(latencies),
                      "p50_ms": statistics.median(latencies),
                      "compute_p50_ms": statistics.median(computes)}))


if __name__ == "__main__":
    main()
