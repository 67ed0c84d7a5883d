#!/usr/bin/env bash
# Configures and builds attnserve into build/ (Release by default), with
# Ninja, and ccache when it is installed (scripts/install-deps.sh installs
# it; CCACHE_BASEDIR defaults to the checkout, so that copies of it share
# the cache).
# Usage: scripts/build.sh [Release|Debug|RelWithDebInfo] [extra cmake args...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_type=${1:-Release}
shift || true
launcher=()
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root}
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
generator=()
# An existing tree keeps the generator it was made with.
if [[ ! -f "$root/build/CMakeCache.txt" ]]; then generator=(-G Ninja); fi
cmake -S "$root" -B "$root/build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE="$build_type" "${launcher[@]}" "$@" >/dev/null
cmake --build "$root/build" -j"$(nproc)"
