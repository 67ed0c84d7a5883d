#!/usr/bin/env bash
# Installs what is missing, builds attnserve (Release) and starts it.
# Arguments go to the server, e.g. scripts/run-server.sh --port=50052
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh" Release -DATTNSERVE_BUILD_TESTS=OFF -DATTNSERVE_BUILD_BENCHMARKS=OFF
exec "$root/build/bin/attnserve" "$@"
