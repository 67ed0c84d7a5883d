#!/usr/bin/env bash
# Installs what the benchmarks need, builds Release and runs attn_bench and
# the side-by-side comparison with PyTorch. Arguments go to attn_bench.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
  python3-torch libopenblas0-openmp >/dev/null
"$root/scripts/build.sh" Release -DATTNSERVE_BUILD_TESTS=OFF
"$root/build/bin/attn_bench" --benchmark_min_time=1 "$@"
/usr/bin/python3 "$root/benchmarks/vs_pytorch.py"
