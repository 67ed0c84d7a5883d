#!/usr/bin/env bash
# Cross-compiles the attention library and its kernel suite for AArch64
# (Debian's g++-aarch64-linux-gnu against the :arm64 packages) and runs the
# suite under qemu-user on emulated CPUs: with SVE and SVE2 (qemu's `max`
# CPU at vector lengths of 128, 256 and 512 bits) and with NEON alone
# (Cortex-A72). Each run tests every implementation the emulated CPU has
# (NEON, SVE, SVE2 and scalar), and the script checks that the expected
# ones were among them. Performance under emulation means nothing; results
# do.
#
#   scripts/test-arm.sh
#
# Environment: ATTNSERVE_ARM_BUILD (build folder, default build-arm).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${ATTNSERVE_ARM_BUILD:-$root/build-arm}
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive

log() { printf 'test-arm: %s\n' "$*"; }
fail() {
  printf 'test-arm: FAIL: %s\n' "$*" >&2
  exit 1
}

if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  $sudo dpkg --add-architecture arm64
fi
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends \
  g++-aarch64-linux-gnu qemu-user libabsl-dev:arm64 libhwy-dev:arm64 \
  libgtest-dev:arm64 libgmock-dev:arm64 libgomp1:arm64 >/dev/null
# oneDNN's development package is not co-installable with its x86-64 copy
# (their dnnl_config.h differ): it is unpacked into a folder of its own.
sysroot=$build/sysroot
if [[ ! -e $sysroot/usr/lib/aarch64-linux-gnu/cmake/dnnl/dnnl-config.cmake ]]; then
  mkdir -p "$build/debs" "$sysroot"
  (cd "$build/debs" && apt-get download -qq libdnnl-dev:arm64 libdnnl2:arm64 2>/dev/null)
  for deb in "$build"/debs/*.deb; do dpkg -x "$deb" "$sysroot"; done
fi

cmake -S "$root" -B "$build" -G Ninja \
  -DCMAKE_TOOLCHAIN_FILE="$root/cmake/aarch64-linux-gnu.cmake" \
  -DATTNSERVE_ARM_SYSROOT="$sysroot" -DATTNSERVE_CORE_ONLY=ON \
  -DATTNSERVE_BUILD_BENCHMARKS=OFF -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
cmake --build "$build" --target row_ops_test

# CPU (qemu -cpu) and the implementations it must have been tested on.
runs=(
  "max,sve-default-vector-length=16|sve2 sve neon scalar"
  "max,sve-default-vector-length=32|sve2 sve neon scalar"
  "max,sve-default-vector-length=64|sve2 sve neon scalar"
  "cortex-a72|neon scalar"
)
for run in "${runs[@]}"; do
  cpu=${run%%|*}
  expected=${run#*|}
  test=(qemu-aarch64 -L /usr/aarch64-linux-gnu -cpu "$cpu" "$build/bin/row_ops_test")
  listed=$("${test[@]}" --gtest_list_tests)
  for name in $expected; do
    grep -q "^  MatchesScalar/$name  #" <<<"$listed" ||
      fail "-cpu $cpu: row_ops_test lists no implementation '$name':
$listed"
  done
  log "-cpu $cpu: testing $expected"
  "${test[@]}" --gtest_brief=1 || fail "row_ops_test failed with -cpu $cpu"
done
log "PASS"
