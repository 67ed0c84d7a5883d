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

    benchmarks/session_transfer.py [--build build] [--tokens 4096]
"""

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time

import grpc
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
from attnserve.v1 import attention_pb2 as v1  # noqa: E402
from attnserve.v1 import attention_pb2_grpc as v1_grpc  # noqa: E402

CHUNK = 1 << 20


def start_server(build):
    proc = subprocess.Popen(
        [os.path.join(build, "bin", "attnserve"), "--host=127.0.0.1",
         "--port=0", "--metrics_port=-1", "--http_port=-1",
         "--log_level=warning", "--max_message_mb=64"],
        stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
    if not match:
        proc.kill()
        sys.exit(f"attnserve did not start: {line!r}")
    return proc, f"127.0.0.1:{match.group(1)}"


def stub_of(target):
    options = [("grpc.max_receive_message_length", 64 << 20),
               ("grpc.max_send_message_length", 64 << 20)]
    return v1_grpc.AttentionServiceStub(
        grpc.insecure_channel(target, options=options))


def tensor(array):
    return v1.Tensor(dtype=v1.DATA_TYPE_FLOAT32, shape=list(array.shape),
                     raw_data=array.astype(np.float32).tobytes())


def step(stub, session_id, n, rng):
    q, k, v = (rng.standard_normal((8, n, 64)) for _ in range(3))
    return stub.SessionStep(v1.SessionStepRequest(
        session_id=session_id, query=tensor(q), key=tensor(k),
        value=tensor(v)))


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    source, source_target = start_server(args.build)
    target, target_target = start_server(args.build)
    try:
        src, dst = stub_of(source_target), stub_of(target_target)
        rng = np.random.default_rng(1)
        session = src.CreateSession(v1.CreateSessionRequest(
            num_heads=8, head_dim=64, max_length=args.tokens + 16))
        for _ in range(args.tokens // 512):
            step(src, session.session_id, 512, rng)
        exports, imports, loopbacks = [], [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            data = b"".join(chunk.data for chunk in src.ExportSession(
                v1.ExportSessionRequest(session_id=session.session_id)))
            exports.append(time.perf_counter() - start)
            start = time.perf_counter()
            reply = dst.ImportSession(
                v1.ImportSessionChunk(offset=at, data=data[at:at + CHUNK])
                for at in range(0, len(data), CHUNK))
            imports.append(time.perf_counter() - start)
            assert reply.received == len(data)
            loopbacks.append(loopback_seconds(data))
            if len(exports) < args.rounds:
                dst.DeleteSession(
                    v1.DeleteSessionRequest(session_id=session.session_id))
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
        for proc in (source, target):
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
