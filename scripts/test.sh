#!/usr/bin/env bash
# Installs what is missing, builds attnserve with its tests and runs them all.
# The golden vectors are read from ../shared/goldens (override with
# ATTNSERVE_GOLDENS_DIR=/path/to/goldens).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
extra=()
if [[ -n "${ATTNSERVE_GOLDENS_DIR:-}" ]]; then
  extra+=("-DATTNSERVE_GOLDENS_DIR=$ATTNSERVE_GOLDENS_DIR")
fi
"$root/scripts/build.sh" Release -DATTNSERVE_BUILD_TESTS=ON "${extra[@]}"
cd "$root/build"
ctest --output-on-failure -j"$(nproc)" --timeout 300
