#!/usr/bin/python3
"""Slow HTTP clients against attnserve's HTTP port, one run.

Starts attnserve (build/bin/attnserve), opens --slow connections that each
send a request head one byte a second (slowloris), and meanwhile sends a
normal request (GET /v2/health/ready, and a small LayerNorm inference) on a
new connection every 100 ms; prints the normal requests' latency
percentiles, how many slow connections the server cut (408) once the head
timeout passed, and the server's resident memory.

    benchmarks/http_clients.py [--build build] [--slow 300] [--seconds 15]
"""

import argparse
import os
import re
import socket
import statistics
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 64


def start_server(build, header_timeout):
    proc = subprocess.Popen(
        [os.path.join(build, "bin", "attnserve"), "--host=127.0.0.1",
         "--port=0", "--metrics_port=-1", "--http_port=0",
         "--log_level=warning", f"--http_header_timeout_s={header_timeout}"],
        stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    match = re.search(r"http port (\d+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"attnserve did not start: {line!r}")
    return proc, int(match.group(1))


def normal_request(port, request):
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    if not data.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"normal request failed: {data[:100]!r}")
    return (time.perf_counter() - start) * 1e3


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--slow", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=15)
    args = parser.parse_args()
    header_timeout = int(args.seconds) + 5
    proc, port = start_server(args.build, header_timeout)
    body = (b'{"inputs": [{"name": "input", "datatype": "FP32", '
            b'"shape": [1, 4], "data": [1, 2, 3, 4]}]}')
    requests = [
        ("ready", b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n"
                  b"Connection: close\r\n\r\n"),
        ("infer", b"POST /v2/models/layer_norm/infer HTTP/1.1\r\nHost: x\r\n"
                  b"Connection: close\r\nContent-Length: " +
                  str(len(body)).encode() + b"\r\n\r\n" + body),
    ]
    try:
        idle = {name: [normal_request(port, r) for _ in range(20)]
                for name, r in requests}
        slow = []
        for _ in range(args.slow):
            s = socket.create_connection(("127.0.0.1", port))
            s.setblocking(False)
            slow.append(s)
        latencies = {name: [] for name, _ in requests}
        start = time.monotonic()
        byte = 0
        next_drip = start
        while time.monotonic() - start < args.seconds:
            if time.monotonic() >= next_drip:
                for s in slow:
                    s.send(HEAD[byte % len(HEAD):byte % len(HEAD) + 1])
                byte += 1
                next_drip += 1.0
            for name, request in requests:
                latencies[name].append(normal_request(port, request))
            time.sleep(0.1)
        rss = rss_mib(proc.pid)
        print(f"{args.slow} connections sending a head byte a second for "
              f"{args.seconds:.0f} s ({byte} bytes each); normal requests "
              "on new connections, ms:")
        print(f"{'request':8} {'idle p50':>9} {'p50':>7} {'p99':>7} "
              f"{'max':>7} {'n':>5}")
        for name, values in latencies.items():
            values.sort()
            p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
            print(f"{name:8} {statistics.median(idle[name]):9.2f} "
                  f"{statistics.median(values):7.2f} {p99:7.2f} "
                  f"{values[-1]:7.2f} {len(values):5}")
        # Past the head timeout, the server answers 408 and closes them.
        time.sleep(header_timeout - args.seconds + 1.5)
        cut = 0
        for s in slow:
            s.setblocking(True)
            s.settimeout(2)
            try:
                if s.recv(64).startswith(b"HTTP/1.1 408"):
                    cut += 1
            except OSError:
                pass
            s.close()
        print(f"slow connections answered 408 after the {header_timeout} s "
              f"head timeout: {cut} of {args.slow}; server resident memory "
              f"{rss:.1f} MiB")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
