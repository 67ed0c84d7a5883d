#!/usr/bin/env bash
# Installs what the serving benchmark needs (h2load, grpcio and PyTorch for
# the peer server), builds Release and runs benchmarks/serving.py: a size
# sweep over gRPC and shared memory, then attnserve against an empty RPC,
# the core in process, a grpcio+PyTorch server and h2load. Arguments go to serving.py (e.g. --no_pin, --duration_s=20).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
  nghttp2-client util-linux python3-torch libopenblas0-openmp >/dev/null
"$root/scripts/build.sh" Release -DATTNSERVE_BUILD_TESTS=ON
cmake --build "$root/build" --target attnserve_python_stubs attn_bench
/usr/bin/python3 "$root/benchmarks/serving.py" --build="$root/build" "$@"
