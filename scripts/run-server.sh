#!/usr/bin/env bash
# Installs what is missing, builds attnserve (Release) and starts it with the
# demo model (E=512, H=8, weights generated at build time in build/models).
# Arguments go to the server, e.g. scripts/run-server.sh --port=50052
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh" Release -DATTNSERVE_BUILD_TESTS=OFF -DATTNSERVE_BUILD_BENCHMARKS=OFF
exec "$root/build/bin/attnserve" --model_repository="$root/build/models" "$@"
