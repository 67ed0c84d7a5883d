#!/usr/bin/python3
"""Serving-path benchmark: attnserve against its own baselines, one run.

Starts attnserve (demo model) and measures with `attnctl bench`:
  1. tiny LayerNorm [1, 64] against an empty unary RPC (gRPC health Check),
  2. MHA B1 L128 E512 (demo model) against the core's in-process throughput
     (attn_bench BM_MultiHeadServedShape, same cores, best thread count),
  3. MHA B1 L16 and L128 against a Python grpcio server wrapping PyTorch
     (benchmarks/peers/torch_peer.py) on the same cores,
  4. the load tool's own capacity (its CPU per request) against the highest
     QPS the server reaches on tiny requests,
  5. attnctl bench's QPS against h2load sending the same serialized request
     with as many calls in flight.
and prints every figure with its ratio and target.

By default the server (and the peer, and the in-process benchmark) run on
core 1 and the clients on core 0 (taskset), so that client and server do not
steal each other's cycles and the figures repeat; --no_pin lets both float
over all cores.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--duration_s", type=float, default=10)
    parser.add_argument("--warmup_s", type=float, default=2)
    parser.add_argument("--server_cpus", default="1")
    parser.add_argument("--client_cpus", default="0")
    parser.add_argument("--no_pin", action="store_true")
    parser.add_argument("--json", help="also write the figures here")
    return parser.parse_args()


class Bench:
    """Runs servers and clients for one benchmark session."""

    def __init__(self, args):
        self.args = args
        self.bin = os.path.join(args.build, "bin")
        self.models = os.path.join(args.build, "models")
        self.processes = []

    def pinned(self, cpus, command):
        if self.args.no_pin:
            return command
        return ["taskset", "-c", cpus] + command

    def start(self, command, ready_pattern, env=None):
        """Starts a server; returns (process, port) once it printed its line."""
        process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True,
                                   env=env)
        self.processes.append(process)
        deadline = time.time() + 60
        while time.time() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            match = re.search(ready_pattern, line)
            if match:
                return process, int(match.group(1))
        raise RuntimeError(f"{command[0]} did not start: {' '.join(command)}")

    def stop(self, process):
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        self.processes.remove(process)

    def stop_all(self):
        for process in list(self.processes):
            self.stop(process)

    def attnserve(self):
        return self.start(self.pinned(self.args.server_cpus, [
            os.path.join(self.bin, "attnserve"), "--host=127.0.0.1",
            "--port=0", "--metrics_port=-1", "--log_level=warning",
            f"--model_repository={self.models}"]),
            r"listening on 127\.0\.0\.1:(\d+)")

    def peer(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.path.join(self.args.build, "clients",
                                         "python_gen")
        threads = 1 if not self.args.no_pin else os.cpu_count()
        return self.start(self.pinned(self.args.server_cpus, [
            "/usr/bin/python3",
            os.path.join(ROOT, "benchmarks", "peers", "torch_peer.py"),
            "--port=0", f"--model_repository={self.models}", "--threads=8",
            f"--torch_threads={threads}"]),
            r"listening on 127\.0\.0\.1:(\d+)", env=env)

    def load(self, port, rpc, *flags):
        """One attnctl bench run; its JSON report."""
        command = self.pinned(self.args.client_cpus, [
            os.path.join(self.bin, "attnctl"), "bench",
            f"--target=127.0.0.1:{port}", f"--rpc={rpc}",
            f"--duration_s={self.args.duration_s}",
            f"--warmup_s={self.args.warmup_s}", "--format=json",
            *flags])
        out = subprocess.run(command, check=True, capture_output=True,
                             text=True).stdout
        report = json.loads(out)
        errors = sum(report["errors"].values())
        if errors:
            raise RuntimeError(f"{rpc}: {errors} failed calls: "
                               f"{report['error_messages']}")
        return report

    def in_process(self, seq):
        """Best calls/s of the core on the server's cores, any thread count."""
        out = subprocess.run(self.pinned(self.args.server_cpus, [
            os.path.join(self.bin, "attn_bench"),
            f"--benchmark_filter=BM_MultiHeadServedShape/L:{seq}/",
            "--benchmark_min_time=3", "--benchmark_format=json"]),
            check=True, capture_output=True, text=True).stdout
        runs = json.loads(out)["benchmarks"]
        best = max(runs, key=lambda run: run["calls_per_second"])
        return best["calls_per_second"], best["threads"]

    def h2load(self, port, body, method, clients, streams, requests):
        """h2load's req/s sending `body` as a gRPC call."""
        command = self.pinned(self.args.client_cpus, [
            "h2load", "-n", str(requests), "-c", str(clients), "-m",
            str(streams), "-d", body,
            "-H", "content-type: application/grpc", "-H", "te: trailers",
            f"http://127.0.0.1:{port}{method}"])
        out = subprocess.run(command, check=True, capture_output=True,
                             text=True).stdout
        qps = float(re.search(r"finished in [\d.]+m?s, ([\d.]+) req/s",
                              out).group(1))
        ok = int(re.search(r"status codes: (\d+) 2xx", out).group(1))
        if ok != requests:
            raise RuntimeError(f"h2load: {ok} of {requests} got 2xx:\n{out}")
        return qps


def main():
    args = parse_args()
    bench = Bench(args)
    rows = []
    figures = {}

    def row(case, ours, theirs, ratio, target, met):
        rows.append((case, ours, theirs, ratio, target,
                     "met" if met else "MISSED"))

    tiny = ["--concurrency=8", "--connections=2"]
    ln_shape = ["--batch=1", "--seq=0", "--dim=64"]
    try:
        server, port = bench.attnserve()
        # 1. Tiny LayerNorm against an empty unary call.
        health = bench.load(port, "health", *tiny)
        layer_norm = bench.load(port, "layernorm", *ln_shape, *tiny)
        ratio = layer_norm["qps"] / health["qps"]
        figures["tiny"] = {"health": health, "layernorm": layer_norm}
        row("LayerNorm [1,64] c8 vs health Check c8",
            f"{layer_norm['qps']:.0f}/s", f"{health['qps']:.0f}/s",
            f"{ratio:.2f}", ">= 0.70", ratio >= 0.70)

        # 4. The tool's capacity: client CPU per call on the cheapest call.
        cores = health["client_cores_available"]
        capacity = cores * 1e6 / health["client_cpu_us_per_request"]
        top = max(health["qps"], layer_norm["qps"])
        ratio = capacity / top
        figures["tool"] = {"capacity_qps": capacity, "server_top_qps": top}
        row(f"attnctl bench capacity ({cores} core(s), "
            f"{health['client_cpu_us_per_request']:.1f} us/call) vs top "
            "server QPS", f"{capacity:.0f}/s", f"{top:.0f}/s",
            f"{ratio:.2f}", ">= 2.0", ratio >= 2.0)

        # 5. h2load on the same requests and in-flight calls. The agreed
        # scenario keeps the server busy (MHA L16, 2 connections x 8
        # streams); tiny LayerNorm at 2 x 4 is printed for information.
        cases = [("MHA demo B1 L16", "MultiHeadAttend",
                  ["mha", "--model=demo", "--batch=1", "--seq=16"], 8, True),
                 ("LayerNorm [1,64]", "LayerNorm", ["layernorm", *ln_shape],
                  4, False)]
        for name, method, workload, streams, target in cases:
            body = os.path.join(args.build, f"{method}.grpc")
            bench.load(port, *workload, "--requests=10", "--warmup_s=0",
                       f"--save_request={body}")
            flags = [f"--concurrency={2 * streams}", "--connections=2"]
            ours = bench.load(port, *workload, *flags)["qps"]
            h2 = bench.h2load(port, body,
                              f"/attnserve.v1.AttentionService/{method}", 2,
                              streams, int(ours * args.duration_s))
            ratio = ours / h2
            figures[f"h2load_{method}"] = {"h2load_qps": h2,
                                           "attnctl_qps": ours}
            row(f"attnctl bench vs h2load, {name}, 2 conns x {streams}",
                f"{ours:.0f}/s", f"{h2:.0f}/s", f"{ratio:.2f}",
                "0.90-1.10" if target else "(info)",
                0.9 <= ratio <= 1.1 or not target)

        # 2. MHA on the demo model against the core in process.
        mha = {}
        for seq in (128, 16):
            mha[seq] = bench.load(port, "mha", "--model=demo", "--batch=1",
                                  f"--seq={seq}", "--concurrency=8",
                                  "--connections=2")
        bench.stop(server)
        core_qps, core_threads = bench.in_process(128)
        ratio = mha[128]["qps"] / core_qps
        figures["mha_vs_core"] = {"server": mha[128], "core_qps": core_qps,
                                  "core_threads": core_threads}
        row("MHA demo B1 L128 c8 vs core in process",
            f"{mha[128]['qps']:.0f}/s",
            f"{core_qps:.0f}/s ({core_threads} thr)", f"{ratio:.2f}",
            ">= 0.85", ratio >= 0.85)

        # 3. The PyTorch peer on the same cores and requests.
        peer, peer_port = bench.peer()
        for seq in (16, 128):
            theirs = bench.load(peer_port, "mha", "--model=demo",
                                "--batch=1", f"--seq={seq}",
                                "--concurrency=8", "--connections=2")
            ratio = mha[seq]["qps"] / theirs["qps"]
            figures[f"peer_L{seq}"] = {"attnserve": mha[seq],
                                       "peer": theirs}
            row(f"MHA demo B1 L{seq} c8 vs grpcio+PyTorch peer",
                f"{mha[seq]['qps']:.0f}/s", f"{theirs['qps']:.0f}/s",
                f"{ratio:.2f}", ">= 3.0", ratio >= 3.0)
        bench.stop(peer)
    finally:
        bench.stop_all()

    pin = ("unpinned" if args.no_pin else
           f"server on CPU {args.server_cpus}, clients on CPU "
           f"{args.client_cpus}")
    print(f"\nattnserve serving benchmark ({pin}, {args.duration_s:g} s per "
          f"run after {args.warmup_s:g} s warm-up)\n")
    header = ("case", "attnserve", "baseline", "ratio", "target", "")
    widths = [max(len(str(r[i])) for r in rows + [header])
              for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)
    return 0 if all(r[5] == "met" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
