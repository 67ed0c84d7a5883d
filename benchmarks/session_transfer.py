#!/usr/bin/python3
"""Moving a decode session between two servers with ExportSession and
ImportSession, one run.

Starts two attnserve processes (build/bin/attnserve), fills a session of
8 heads x 64 float32 with --tokens tokens on the first, then --rounds times
exports it (the stream read whole) and imports the file into the second
(in 1 MiB chunks), deleting it there after each round. Prints the median
milliseconds and GB/s of each, next to the same bytes sent through a plain
loopback TCP socket in the same run (the transport's floor), and checks
that the imported session's next step equals the original's bit for bit.

Then hand-overs between replicas sharing a --session_dir: two more servers
share a directory; a session of each size in --move_tokens steps one token
at a time, --rounds x 10 steps alternating between the replicas (each step
makes the replica asked take the session over from the other: the holder
saves it, the asker loads it), against the same steps on one replica.
Prints the median and 90th percentile of each, and checks that the moving
session's steps equal the staying one's bit for bit.

    benchmarks/session_transfer.py [--build build] [--tokens 4096]
        [--move_tokens 64,1024,4096]
"""

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
from attnserve_client import (ServerProcess, connect,  # noqa: E402
                              export_session, import_session, pb, to_tensor)

CHUNK = 1 << 20


def start_server(build, workdir, name, *flags):
    return ServerProcess(
        [os.path.join(build, "bin", "attnserve"), "--host=127.0.0.1",
         "--port=0", "--metrics_port=-1", "--http_port=-1",
         "--log_level=warning", "--max_message_mb=64", *flags],
        "attnserve listening on ", workdir, name)


def step(stub, session_id, n, rng):
    q, k, v = (rng.standard_normal((8, n, 64)) for _ in range(3))
    return stub.SessionStep(pb.SessionStepRequest(
        session_id=session_id, query=to_tensor(q), key=to_tensor(k),
        value=to_tensor(v)))


def loopback_seconds(data):
    """The time a plain loopback TCP socket takes to carry `data`."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    received = []

    def receive():
        conn, _ = server.accept()
        got = 0
        while got < len(data):
            block = conn.recv(CHUNK)
            if not block:
                break
            got += len(block)
        received.append(got)
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    start = time.perf_counter()
    client = socket.create_connection(server.getsockname())
    client.sendall(data)
    client.close()
    thread.join()
    elapsed = time.perf_counter() - start
    server.close()
    assert received == [len(data)]
    return elapsed


def percentiles(times):
    ordered = sorted(times)
    return (statistics.median(ordered) * 1e3,
            ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1e3)


def hand_overs(build, workdir, sizes, steps):
    """Steps alternating between two replicas sharing a directory, against
    the same steps on one replica (a second session), per session size."""
    directory = os.path.join(workdir, "sessions")
    servers = [start_server(build, workdir, f"replica{i}",
                            f"--session_dir={directory}") for i in range(2)]
    try:
        stubs = [connect(server.target) for server in servers]
        print(f"steps of one token alternating between two replicas sharing "
              f"--session_dir (a hand-over each), against one replica; "
              f"{steps} steps each")
        for tokens in sizes:
            ids = [stubs[0].CreateSession(pb.CreateSessionRequest(
                num_heads=8, head_dim=64,
                max_length=tokens + steps + 16)).session_id for _ in range(2)]
            for session_id in ids:
                rng = np.random.default_rng(tokens)
                for first in range(0, tokens, 512):
                    step(stubs[0], session_id, min(512, tokens - first), rng)
            times = {"moving": [], "staying": []}
            rngs = [np.random.default_rng(3) for _ in ids]
            for t in range(steps):
                outputs = []
                for name, session_id, stub, rng in (
                        ("moving", ids[0], stubs[t % 2], rngs[0]),
                        ("staying", ids[1], stubs[0], rngs[1])):
                    start = time.perf_counter()
                    outputs.append(step(stub, session_id, 1, rng))
                    times[name].append(time.perf_counter() - start)
                assert outputs[0].output.raw_data == \
                    outputs[1].output.raw_data, "steps differ"
            row = "  ".join(f"{name} p50 {p50:6.2f} ms p90 {p90:6.2f} ms"
                            for name, (p50, p90) in
                            ((n, percentiles(v)) for n, v in times.items()))
            print(f"  {tokens:5d} tokens ({tokens * 8 * 64 * 8 / 1e6:5.1f} "
                  f"MB): {row}; bitwise equal")
    finally:
        for server in servers:
            server.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--move_tokens", default="64,1024,4096",
                        help="session sizes of the hand-over part")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="attnserve-transfer-")
    source = start_server(args.build, workdir, "source")
    target = start_server(args.build, workdir, "target")
    try:
        src, dst = connect(source.target), connect(target.target)
        rng = np.random.default_rng(1)
        session = src.CreateSession(pb.CreateSessionRequest(
            num_heads=8, head_dim=64, max_length=args.tokens + 16))
        for _ in range(args.tokens // 512):
            step(src, session.session_id, 512, rng)
        exports, imports, loopbacks = [], [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            data = export_session(src, session.session_id)
            exports.append(time.perf_counter() - start)
            start = time.perf_counter()
            reply = import_session(dst, data, chunk_bytes=CHUNK)
            imports.append(time.perf_counter() - start)
            assert reply.received == len(data)
            loopbacks.append(loopback_seconds(data))
            if len(exports) < args.rounds:
                dst.DeleteSession(
                    pb.DeleteSessionRequest(session_id=session.session_id))
        same_rng = np.random.default_rng(7)
        want = step(src, session.session_id, 1, same_rng)
        same_rng = np.random.default_rng(7)
        got = step(dst, session.session_id, 1, same_rng)
        assert want.output.raw_data == got.output.raw_data, "steps differ"
        gb = len(data) / 1e9
        print(f"session file: {len(data)} bytes ({args.tokens} tokens, "
              f"8 heads x 64, float32); median of {args.rounds} rounds")
        for name, times in (("ExportSession", exports),
                            ("ImportSession", imports),
                            ("loopback TCP", loopbacks)):
            median = statistics.median(times)
            print(f"  {name:14s} {median * 1e3:8.1f} ms  {gb / median:6.2f} "
                  f"GB/s  ({median / statistics.median(loopbacks):.1f}x "
                  "loopback)")
        print("  imported session's next step: bitwise equal")
    finally:
        source.stop()
        target.stop()
    hand_overs(args.build, workdir,
               [int(t) for t in args.move_tokens.split(",")], 10 * args.rounds)


if __name__ == "__main__":
    main()
