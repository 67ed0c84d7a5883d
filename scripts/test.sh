#!/usr/bin/env bash
# Installs what is missing, builds attnserve with its tests and runs them
# all: a Release build (GCC); the README's Python commands against the
# quick start's server; with CI=true a one-minute soak and the rolling
# restart through nginx (deploy/session-handover-test.py); then one clang
# tree with AddressSanitizer, UndefinedBehaviorSanitizer, libFuzzer's
# coverage hooks and -Wthread-safety as errors, whose test suite runs and
# whose fuzz targets then run ATTNSERVE_CI_FUZZ_SECONDS (35) each with
# CI=true; the kernel suite cross-compiled for AArch64 and run under qemu
# (NEON, SVE, SVE2); and the concurrency tests built with ThreadSanitizer.
# --quick runs the Release build and tests and the lock-annotation check
# only.
# Every build uses Ninja and ccache (CCACHE_BASEDIR is the checkout, so the
# README check's copy of it hits the same cache). Each stage's minutes are
# printed at the end.
# The golden vectors are read from tests/goldens (override with
# ATTNSERVE_GOLDENS_DIR=/path/to/goldens), and from ../shared/goldens too when
# that folder is there.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
quick=0
if [[ "${1:-}" == "--quick" ]]; then quick=1; fi
"$root/scripts/install-deps.sh"
extra=()
if [[ -n "${ATTNSERVE_GOLDENS_DIR:-}" ]]; then
  extra+=("-DATTNSERVE_GOLDENS_DIR=$ATTNSERVE_GOLDENS_DIR")
fi
jobs=$(nproc)
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/attnserve-ccache}
export CCACHE_BASEDIR=$root
export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-10G}

# Stage timing: "== NAME" starts a stage; the summary prints at exit.
stage_names=()
stage_seconds=()
stage_started=$(date +%s)
run_started=$stage_started
stage() {
  local now
  now=$(date +%s)
  if ((${#stage_names[@]} > 0)); then
    stage_seconds+=($((now - stage_started)))
  fi
  stage_names+=("$1")
  stage_started=$now
  echo "== $1"
}
summary() {
  local status=$? now i
  now=$(date +%s)
  stage_seconds+=($((now - stage_started)))
  echo "== Stages (minutes)"
  for i in "${!stage_names[@]}"; do
    printf '%6.1f  %s\n' "$(bc -l <<<"${stage_seconds[$i]} / 60")" \
      "${stage_names[$i]}"
  done
  printf '%6.1f  total%s\n' "$(bc -l <<<"($now - $run_started) / 60")" \
    "$( ((status)) && echo " (failed, exit $status)")"
}
trap summary EXIT

stage "Release build and tests"
"$root/scripts/build.sh" Release -DATTNSERVE_BUILD_TESTS=ON "${extra[@]}"
(cd "$root/build" && ctest --output-on-failure -j"$jobs" --timeout 300)

if [[ $quick -eq 1 ]]; then
  stage "Thread-safety analysis (clang -Wthread-safety)"
  "$root/scripts/check-thread-safety.sh" "$root/build-clang"
  exit 0
fi

# The README's Python commands as a new user runs them: in a copy of the
# tracked files, after the quick start's scripts/run-server.sh (a Release
# build of its own, from the cache).
stage "README Python commands against the quick start's server"
"$root/scripts/readme-python-check.sh"

# Soak: a minute of mixed load with faults and model reloads against the
# Release server (scripts/soak.sh; 30 minutes when run by hand).
if [[ "${CI:-}" == "true" ]]; then
  stage "Soak test (60 s)"
  "$root/scripts/soak.sh" 60
fi

# Durability through a cluster: three replicas sharing a session directory
# behind nginx, each drained and restarted in turn, then one killed, while
# 16 clients step decode sessions (then Open Inference sequences); every
# step is checked bitwise against a replica that never stopped.
if [[ "${CI:-}" == "true" ]]; then
  stage "Rolling restart and SIGKILL through nginx (sessions, sequences)"
  for protocol in native open_inference; do
    /usr/bin/python3 "$root/deploy/session-handover-test.py" --sequences 16 \
      --kill --protocol=$protocol
  done
fi

# One clang tree for every instrumented check: ASan + UBSan, libFuzzer's
# coverage hooks (so the fuzz targets build here too) and the lock
# annotations as errors. -O1 with line tables: sanitizer reports keep their
# lines, and the tree builds in half the time of -O2 -g.
stage "Clang AddressSanitizer + UndefinedBehaviorSanitizer build (-Wthread-safety)"
sanitize=$root/build-sanitize
cmake -S "$root" -B "$sanitize" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only -DNDEBUG" \
  -DCMAKE_EXE_LINKER_FLAGS=-fuse-ld=lld \
  -DCMAKE_SHARED_LINKER_FLAGS=-fuse-ld=lld \
  -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
  -DATTNSERVE_FUZZ=ON -DATTNSERVE_BUILD_TESTS=ON \
  -DATTNSERVE_BUILD_BENCHMARKS=OFF "${extra[@]}" >/dev/null
cmake --build "$sanitize" -j"$jobs"
# The Go and Node clients' builds and suites, and the benchmarks (not built
# here), check those clients and the benchmarks (the Release pass runs
# them); the server's memory safety is what this pass is for, and the C++
# and Python suites drive every RPC and the HTTP front end.
stage "AddressSanitizer + UndefinedBehaviorSanitizer tests"
(cd "$sanitize" &&
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
  LSAN_OPTIONS=suppressions="$root/tests/lsan.supp" \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --output-on-failure -j"$jobs" --timeout 600 \
    -E '^(GoClientBuild|GoClientTest|NodeClientSetup|NodeClientTest)$')

if [[ "${CI:-}" == "true" ]]; then
  stage "Fuzzing (libFuzzer, ${ATTNSERVE_CI_FUZZ_SECONDS:-35} s per target, $jobs at once)"
  ATTNSERVE_FUZZ_BUILD=$sanitize \
    "$root/scripts/fuzz.sh" "${ATTNSERVE_CI_FUZZ_SECONDS:-35}"
fi

# The kernels on ARM: the core cross-compiled for AArch64, its kernel suite
# under qemu-user with SVE/SVE2 and with NEON alone.
stage "AArch64 cross build and kernel tests under qemu (NEON, SVE, SVE2)"
"$root/scripts/test-arm.sh"

# ThreadSanitizer sees only instrumented code. Debian's libgomp, gRPC and
# abseil are not instrumented, so their synchronization is invisible and
# shows up as races that are not there: the TSan suite drives the core, the
# engine and the server's runtime pieces from plain threads (no gRPC
# between), and runs with one OpenMP thread, with which libgomp starts no
# team threads.
stage "ThreadSanitizer build and concurrency tests"
cmake -S "$root" -B "$root/build-tsan" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
  -DATTNSERVE_TSAN=ON -DATTNSERVE_BUILD_TESTS=ON \
  -DATTNSERVE_BUILD_BENCHMARKS=OFF "${extra[@]}" >/dev/null
cmake --build "$root/build-tsan" -j"$jobs" \
  --target concurrency_test thread_budget_test engine_test
(cd "$root/build-tsan" &&
  OMP_NUM_THREADS=1 TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
  ctest --output-on-failure -j"$jobs" --timeout 600 \
    -R '^(ConcurrencyTest|ThreadBudgetTest|EngineTest)\.')
