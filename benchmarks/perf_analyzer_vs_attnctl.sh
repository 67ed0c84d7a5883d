#!/usr/bin/env bash
# attnctl bench and Triton's perf_analyzer on the same calls, side by side
# in one run: scaled dot-product attention [1, 8, 64, 64] with its weights
# (perf_analyzer asks for every output), the same tensors for both tools,
# closed loop at concurrency 1 and 2, each over gRPC. attnctl calls the
# native Attend RPC, perf_analyzer the protocol's ModelInfer; both read the
# server's statistics around each window. Prints each tool's CSV rows and
# the ratios attnctl / perf_analyzer of throughput and p50/p99 latency.
#
# Usage: benchmarks/perf_analyzer_vs_attnctl.sh [BUILD_DIR]
# Needs PERF_ANALYZER (or perf_analyzer on PATH), built from Triton's
# sources; exits 77 without it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
pa=${PERF_ANALYZER:-$(command -v perf_analyzer || true)}
if [[ -z "$pa" || ! -x "$pa" ]]; then
  echo "SKIPPED: perf_analyzer not found (set PERF_ANALYZER=/path/to/perf_analyzer)"
  exit 77
fi
# shellcheck source=../scripts/lib/server.sh
source "$root/scripts/lib/server.sh"
tmp=$(mktemp -d)
cleanup() {
  stop_attnserve
  rm -rf "$tmp"
}
trap cleanup EXIT

# The request: safetensors for attnctl, perf_analyzer's JSON for the other.
/usr/bin/python3 - "$tmp" <<'EOF'
import json, struct, sys
import numpy as np
out = sys.argv[1]
rng = np.random.default_rng(7)
tensors = {n: rng.standard_normal((1, 8, 64, 64), dtype=np.float32)
           for n in ("query", "key", "value")}
header, data, offset = {}, b"", 0
for name, array in tensors.items():
    raw = array.tobytes()
    header[name] = {"dtype": "F32", "shape": list(array.shape),
                    "data_offsets": [offset, offset + len(raw)]}
    data += raw
    offset += len(raw)
text = json.dumps(header).encode()
with open(f"{out}/attend.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + data)
with open(f"{out}/attend.json", "w") as f:
    json.dump({"data": [{n: {"content": a.ravel().tolist(),
                             "shape": list(a.shape)}
                         for n, a in tensors.items()}]}, f)
EOF

start_attnserve "$tmp/server.log" "$build/bin/attnserve" --http_port=-1 \
  --metrics_port=-1 --lame_duck_seconds=0
port=$grpc_port
echo "attnserve on 127.0.0.1:$port; $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"

for concurrency in 1 2; do
  "$build/bin/attnctl" bench --target="127.0.0.1:$port" --rpc=attend \
    --in="$tmp/attend.safetensors" --return_weights \
    --concurrency="$concurrency" --connections="$concurrency" \
    --duration_s=3 --warmup_s=1 --csv="$tmp/attnctl_$concurrency.csv" \
    >/dev/null
  "$pa" -m attend -i grpc -u "127.0.0.1:$port" \
    --input-data "$tmp/attend.json" --concurrency-range "$concurrency" \
    -p 3000 -s 25 -f "$tmp/pa_$concurrency.csv" >/dev/null 2>&1 ||
    echo "perf_analyzer did not settle at concurrency $concurrency"
done

/usr/bin/python3 - "$tmp" <<'EOF'
import csv, sys
out = sys.argv[1]
def row(path):
    try:
        with open(path) as f:
            return next(csv.DictReader(f))
    except (OSError, StopIteration):
        return None
cols = ["Inferences/Second", "Server Queue", "Server Compute Input",
        "Server Compute Infer", "Server Compute Output", "p50 latency",
        "p99 latency"]
print(f"{'tool':<14}{'conc':>5}" + "".join(f"{c:>22}" for c in cols))
for c in (1, 2):
    a, p = row(f"{out}/attnctl_{c}.csv"), row(f"{out}/pa_{c}.csv")
    for name, r in (("attnctl", a), ("perf_analyzer", p)):
        if r:
            print(f"{name:<14}{c:>5}" + "".join(f"{r[k]:>22}" for k in cols))
    if a and p:
        ratio = lambda k: float(a[k]) / max(float(p[k]), 1e-9)
        print(f"{'ratio a/pa':<14}{c:>5}" + "".join(
            f"{ratio(k):>22.2f}" for k in cols))
EOF
