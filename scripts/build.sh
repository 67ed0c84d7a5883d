#!/usr/bin/env bash
# Configures and builds attnserve into build/ (Release by default).
# Usage: scripts/build.sh [Release|Debug|RelWithDebInfo] [extra cmake args...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_type=${1:-Release}
shift || true
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE="$build_type" "$@" >/dev/null
cmake --build "$root/build" -j"$(nproc)"
