#!/usr/bin/env bash
# Installs what is missing, checks the lock annotations with clang's
# -Wthread-safety, builds attnserve with its tests and runs them all: a
# Release build, then the same suite built with AddressSanitizer and
# UndefinedBehaviorSanitizer, then the concurrency tests built with
# ThreadSanitizer (skip the sanitizer builds with --quick). With CI=true it
# also runs the fuzz targets, ATTNSERVE_CI_FUZZ_SECONDS (35) each.
# The golden vectors are read from ../shared/goldens (override with
# ATTNSERVE_GOLDENS_DIR=/path/to/goldens).
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

# Front end only, so cheap enough for --quick as well.
echo "== Thread-safety analysis (clang -Wthread-safety)"
"$root/scripts/check-thread-safety.sh" "$root/build-clang"

echo "== Release build and tests"
"$root/scripts/build.sh" Release -DATTNSERVE_BUILD_TESTS=ON "${extra[@]}"
(cd "$root/build" && ctest --output-on-failure -j"$jobs" --timeout 300)

# The README's Python commands as a new user runs them: in a copy of the
# tracked files, after the quick start's scripts/run-server.sh (a Release
# build of its own).
if [[ $quick -eq 0 ]]; then
  echo "== README Python commands against the quick start's server"
  "$root/scripts/readme-python-check.sh"
fi

# Soak: a minute of mixed load with faults and model reloads against the
# Release server (scripts/soak.sh; 30 minutes when run by hand).
if [[ "${CI:-}" == "true" ]]; then
  echo "== Soak test (60 s)"
  "$root/scripts/soak.sh" 60
fi

if [[ $quick -eq 0 ]]; then
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer build and tests"
  cmake -S "$root" -B "$root/build-asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DATTNSERVE_ASAN=ON -DATTNSERVE_BUILD_TESTS=ON "${extra[@]}" >/dev/null
  cmake --build "$root/build-asan" -j"$jobs"
  (cd "$root/build-asan" &&
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
    LSAN_OPTIONS=suppressions="$root/tests/lsan.supp" \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --output-on-failure -j"$jobs" --timeout 600)

  # ThreadSanitizer sees only instrumented code. Debian's libgomp, gRPC and
  # abseil are not instrumented, so their synchronization is invisible and
  # shows up as races that are not there: the TSan suite drives the core and
  # the server's scheduling pieces from plain threads (no gRPC between), and
  # runs with one OpenMP thread, with which libgomp starts no team threads.
  echo "== ThreadSanitizer build and concurrency tests"
  cmake -S "$root" -B "$root/build-tsan" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DATTNSERVE_TSAN=ON -DATTNSERVE_BUILD_TESTS=ON \
    -DATTNSERVE_BUILD_BENCHMARKS=OFF "${extra[@]}" >/dev/null
  cmake --build "$root/build-tsan" -j"$jobs" \
    --target concurrency_test thread_budget_test
  (cd "$root/build-tsan" &&
    OMP_NUM_THREADS=1 TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
    ctest --output-on-failure -j"$jobs" --timeout 600 \
      -R '^(ConcurrencyTest|ThreadBudgetTest)\.')
fi

# About 8 minutes with the build: 9 targets of 35 s, one after the other
# (the 315 s that 7 targets of 45 s took).
if [[ "${CI:-}" == "true" ]]; then
  echo "== Fuzzing (libFuzzer with ASan + UBSan, ${ATTNSERVE_CI_FUZZ_SECONDS:-35} s per target)"
  "$root/scripts/fuzz.sh" "${ATTNSERVE_CI_FUZZ_SECONDS:-35}"
fi
