#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ (clang, ASan + UBSan, in build-fuzz,
# or in the tree ATTNSERVE_FUZZ_BUILD names when it is already configured
# with ATTNSERVE_FUZZ=ON, as scripts/test.sh's sanitizer tree is) and runs
# each for SECONDS (default 60), as many at once as there are cores, each in
# a single process, on a copy of its checked-in corpus in a scratch folder:
# fuzz/corpus never grows. Prints each target's executions and any crash, hang or leak input;
# exits 1 if a target found one. An input it reports goes into
# fuzz/regressions/TARGET once fixed, where ctest replays it.
#
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]   (default: every target)
# Environment: ATTNSERVE_FUZZ_BUILD (build folder, default build-fuzz),
# ATTNSERVE_FUZZ_KEEP=1 keeps the scratch folder (grown corpora, logs).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-60}
shift || true
all_targets=(attend multi_head_attend layer_norm metadata_rpcs
  shared_memory_compute safetensors model_loader open_inference
  open_inference_json http_parser call_sequence session_file)
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then targets=("${all_targets[@]}"); fi
build=${ATTNSERVE_FUZZ_BUILD:-$root/build-fuzz}

# Inputs larger than a few KiB only slow the fuzzers down: the seeds are
# below 2 KiB and every path is reachable with small tensors, but for a
# journal's, whose records hold whole blocks of 512 tokens (24 KiB).
max_len() {
  case $1 in
    layer_norm | metadata_rpcs | shared_memory_compute) echo 1024 ;;
    session_file) echo 32768 ;;
    *) echo 4096 ;;
  esac
}

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
start=$(date +%s)
if ! grep -q '^ATTNSERVE_FUZZ:BOOL=ON' "$build/CMakeCache.txt" 2>/dev/null; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTNSERVE_FUZZ=ON \
    -DATTNSERVE_BUILD_TESTS=OFF -DATTNSERVE_BUILD_BENCHMARKS=OFF \
    "${launcher[@]}" >/dev/null
fi
if ! ninja -C "$build" "${targets[@]/#/fuzz_}" >"$build/fuzz-build.log" 2>&1; then
  echo "fuzz: the build failed ($build/fuzz-build.log):" >&2
  grep -E -A8 "error|FAILED" "$build/fuzz-build.log" | head -80 >&2
  exit 1
fi
echo "fuzz: built ${#targets[@]} targets in $(($(date +%s) - start)) s"

scratch=$(mktemp -d "${TMPDIR:-/tmp}/attnserve-fuzz.XXXXXX")
if [[ "${ATTNSERVE_FUZZ_KEEP:-0}" != 1 ]]; then
  trap 'rm -rf "$scratch"' EXIT
else
  echo "fuzz: scratch folder $scratch"
fi

# One OpenMP thread: the fuzzed calls are tiny, as the server would run
# them, and libFuzzer runs one input at a time.
export OMP_NUM_THREADS=1
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:symbolize=1
export LSAN_OPTIONS=suppressions=$root/tests/lsan.supp
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

# One target's run; its summary line goes to $scratch/TARGET.result.
fuzz_one() {
  local target=$1
  local corpus=$scratch/corpus/$target
  local artifacts=$scratch/artifacts/$target
  mkdir -p "$corpus" "$artifacts"
  cp "$root/fuzz/corpus/$target"/* "$corpus"/
  if compgen -G "$root/fuzz/regressions/$target/*" >/dev/null; then
    cp "$root/fuzz/regressions/$target"/* "$corpus"/
  fi
  local log=$scratch/$target.log
  local status=0
  "$build/bin/fuzz_$target" "$corpus" -max_total_time="$seconds" \
    -max_len="$(max_len "$target")" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$artifacts/" >"$log" 2>&1 ||
    status=$?
  # A crash prints the final stats twice; the last count wins.
  local runs rate
  runs=$(awk '/^stat::number_of_executed_units:/ { n = $2 } END { print n }' "$log")
  rate=$(awk '/^stat::average_exec_per_sec:/ { n = $2 } END { print n }' "$log")
  # Without final stats (a timeout), the last status line ("#1234 ...")
  # has the count so far.
  if [[ -z "$runs" ]]; then
    runs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
  fi
  echo "$status ${runs:-0} ${rate:--}" >"$scratch/$target.result"
}

# At most as many at once as there are cores: before starting one more,
# wait for the oldest still running. (nproc obeys OMP_NUM_THREADS, set to 1
# above for the fuzzers themselves.)
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
pids=()
for target in "${targets[@]}"; do
  if ((${#pids[@]} >= cores)); then
    wait "${pids[0]}" || true
    pids=("${pids[@]:1}")
  fi
  fuzz_one "$target" &
  pids+=($!)
done
wait

failed=()
total=0
printf '%-24s %12s %10s  %s\n' target executions exec/s result
for target in "${targets[@]}"; do
  read -r status runs rate <"$scratch/$target.result"
  total=$((total + runs))
  artifacts=$scratch/artifacts/$target
  log=$scratch/$target.log
  mapfile -t found < <(find "$artifacts" -type f | sort)
  if [[ $status -ne 0 || ${#found[@]} -gt 0 ]]; then
    printf '%-24s %12s %10s  %s\n' "$target" "$runs" "$rate" \
      "FAILED (exit $status)"
    failed+=("$target")
    grep -E '^(==[0-9]+==ERROR|SUMMARY|fuzz: )|runtime error' "$log" |
      head -20 | sed 's/^/    /' || true
    for file in "${found[@]}"; do
      mkdir -p "$root/build-fuzz-artifacts/$target"
      cp "$file" "$root/build-fuzz-artifacts/$target/"
      echo "    input: build-fuzz-artifacts/$target/$(basename "$file")"
    done
    echo "    log: $log"
  else
    printf '%-24s %12s %10s  %s\n' "$target" "$runs" "$rate" ok
  fi
done
echo "fuzz: $total executions in total, $(($(date +%s) - start)) s"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "fuzz: FAILED: ${failed[*]} (reproduce: $build/bin/fuzz_TARGET INPUT)"
  # The logs are the only record of what went wrong.
  trap - EXIT
  exit 1
fi
