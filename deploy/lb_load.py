#!/usr/bin/python3
"""Closed-loop gRPC load for deploy/lb-test.sh, where `attnctl bench` is not
built: the same flags and JSON report as `attnctl bench` for the LayerNorm
and Attend RPCs.

  lb_load.py --target=URI --rpc=layernorm --batch=B --seq=L --dim=E
             --concurrency=N --connections=M --duration_s=S --timeout_s=T
             [--service_config=FILE.json] --format=json

N threads each send calls back to back for S seconds over M channels
(thread i uses channel i mod M); the channel's service config (load
balancing, retry policy) comes from FILE.json. Prints
{"requests", "ok", "errors": {CODE: count}, "qps", "latency_us": {...}}.
Only Debian's python3-grpcio is needed: requests are encoded by hand.
"""

import argparse
import json
import random
import struct
import sys
import threading
import time

import grpc

SERVICE = "/attnserve.v1.AttentionService/"
FLOAT32 = 1  # attnserve.v1.DataType.DATA_TYPE_FLOAT32


def varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def field(number, wire_type, payload):
    key = varint((number << 3) | wire_type)
    if wire_type == 2:
        return key + varint(len(payload)) + payload
    return key + payload


def tensor(shape, rng):
    """attnserve.v1.Tensor: dtype, packed shape, raw little-endian floats."""
    count = 1
    for dim in shape:
        count *= dim
    values = struct.pack(f"<{count}f", *(rng.uniform(-1, 1) for _ in range(count)))
    packed_shape = b"".join(varint(d) for d in shape)
    return (field(1, 0, varint(FLOAT32)) + field(2, 2, packed_shape)
            + field(3, 2, values))


def request_bytes(args):
    rng = random.Random(1)
    if args.rpc == "layernorm":
        # LayerNormRequest{input = 1, gamma = 2, beta = 3}
        return "LayerNorm", (field(1, 2, tensor([args.batch, args.seq, args.dim], rng))
                             + field(2, 2, tensor([args.dim], rng))
                             + field(3, 2, tensor([args.dim], rng)))
    if args.rpc == "attend":
        # AttendRequest{query = 1, key = 2, value = 3}
        shape = [args.batch, args.heads, args.seq, args.dim // args.heads]
        return "Attend", b"".join(field(i, 2, tensor(shape, rng)) for i in (1, 2, 3))
    raise SystemExit(f"lb_load.py: --rpc={args.rpc} is not supported (layernorm, attend)")


def percentile(sorted_values, fraction):
    if not sorted_values:
        return 0
    index = min(len(sorted_values) - 1, int(fraction * len(sorted_values)))
    return sorted_values[index]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--rpc", default="layernorm")
    parser.add_argument("--model", default="")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--duration_s", type=float, default=10)
    # Every call counts here: no warm-up (accepted for attnctl bench's sake).
    parser.add_argument("--warmup_s", type=float, default=0)
    parser.add_argument("--timeout_s", type=float, default=10)
    parser.add_argument("--service_config", default="")
    parser.add_argument("--format", default="json", choices=["json"])
    args = parser.parse_args()

    method, payload = request_bytes(args)
    options = [("grpc.enable_retries", 1),
               # Reconnect soon to a replica that comes back.
               ("grpc.initial_reconnect_backoff_ms", 200),
               ("grpc.max_reconnect_backoff_ms", 1000)]
    if args.service_config:
        with open(args.service_config, encoding="utf-8") as f:
            options.append(("grpc.service_config", json.dumps(json.load(f))))
    channels = []
    calls = []
    for i in range(max(1, args.connections)):
        # A distinct channel argument keeps channels on separate connections.
        channel = grpc.insecure_channel(args.target, options=options + [("lb_load.channel", i)])
        channels.append(channel)
        calls.append(channel.unary_unary(SERVICE + method))

    lock = threading.Lock()
    latencies = []
    errors = {}
    messages = {}
    deadline = time.monotonic() + args.duration_s

    def worker(index):
        call = calls[index % len(calls)]
        mine = []
        my_errors = {}
        while time.monotonic() < deadline:
            start = time.monotonic()
            try:
                call(payload, timeout=args.timeout_s, wait_for_ready=False)
                mine.append((time.monotonic() - start) * 1e6)
            except grpc.RpcError as error:
                code = error.code().name
                my_errors[code] = my_errors.get(code, 0) + 1
                with lock:
                    messages.setdefault(code, error.details())
        with lock:
            latencies.extend(mine)
            for code, count in my_errors.items():
                errors[code] = errors.get(code, 0) + count

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    for channel in channels:
        channel.close()

    latencies.sort()
    ok = len(latencies)
    failed = sum(errors.values())
    report = {
        "target": args.target,
        "rpc": args.rpc,
        "requests": ok + failed,
        "ok": ok,
        "errors": errors,
        "error_messages": messages,
        "duration_s": round(elapsed, 3),
        "qps": round((ok + failed) / elapsed, 1) if elapsed > 0 else 0,
        "latency_us": {
            "p50": round(percentile(latencies, 0.50)),
            "p90": round(percentile(latencies, 0.90)),
            "p99": round(percentile(latencies, 0.99)),
            "max": round(latencies[-1]) if latencies else 0,
        },
    }
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
