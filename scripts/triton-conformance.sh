#!/usr/bin/env bash
# Runs Triton's perf_analyzer, unmodified, against attnserve: gRPC (sync,
# --async, --streaming, --request-rate-range, --shared-memory system), HTTP
# (sync, --request-rate-range, --shared-memory system), the demo model, and
# sequence mode on its sequences model demo_session, each writing its -f
# CSV. Each run must exit 0 with a CSV of at least one measured row.
#
# perf_analyzer is not a Debian package: build it from Triton's sources and
# point PERF_ANALYZER at it, or put it on PATH. Without it the script says so
# and exits 77 (ctest counts that as skipped).
#
# Usage: scripts/triton-conformance.sh [BUILD_DIR]   (default: build)
# Environment: PERF_ANALYZER, KEEP_TMP=1 (keep the CSVs and logs).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
pa=${PERF_ANALYZER:-$(command -v perf_analyzer || true)}
if [[ -z "$pa" || ! -x "$pa" ]]; then
  echo "SKIPPED: perf_analyzer not found (set PERF_ANALYZER=/path/to/perf_analyzer or put it on PATH)"
  exit 77
fi

# shellcheck source=lib/server.sh
source "$root/scripts/lib/server.sh"
tmp=$(mktemp -d)
cleanup() {
  stop_attnserve
  if [[ "${KEEP_TMP:-}" == 1 ]]; then echo "kept $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT

start_attnserve "$tmp/server.log" "$build/bin/attnserve" --http_port=0 \
  --metrics_port=-1 --lame_duck_seconds=0 \
  --model_repository="$build/models"
echo "attnserve: gRPC 127.0.0.1:$grpc_port, HTTP 127.0.0.1:$http_port; $("$pa" --version 2>&1 | head -1)"

# Short windows; the stability bound is wide because these machines are
# shared: the runs check the protocol, not the speed.
common=(-p 500 -s 100 --max-trials 6)
attend=(-m attend --shape query:1,8,64,64 --shape key:1,8,64,64
  --shape value:1,8,64,64 --shape attn_mask:64,64)
demo=(-m demo --shape query:1,16,512 --shape key:1,16,512
  --shape value:1,16,512 --shape attn_mask:16,16 --shape key_padding_mask:1,16)
session=(-m demo_session --shape query:1,4,512 --sequence-length 4)
shm=(--shared-memory system --output-shared-memory-size 262144)
grpc=(-i grpc -u "127.0.0.1:$grpc_port")
http=(-i http -u "127.0.0.1:$http_port")

failed=0
passed=0
run() {
  local name=$1
  shift
  local csv="$tmp/$name.csv"
  if "$pa" "$@" "${common[@]}" -f "$csv" >"$tmp/$name.log" 2>&1 &&
    [[ $(wc -l <"$csv") -ge 2 ]]; then
    printf 'ok    %-28s %s infer/s\n' "$name" "$(awk -F, 'NR==2 {print $2}' "$csv")"
    passed=$((passed + 1))
  else
    printf 'FAIL  %s: perf_analyzer %s\n' "$name" "$*"
    tail -n 20 "$tmp/$name.log"
    failed=$((failed + 1))
  fi
}

run grpc_sync "${grpc[@]}" "${attend[@]}" --concurrency-range 1:2
run grpc_async "${grpc[@]}" "${attend[@]}" --async --concurrency-range 2
run grpc_streaming "${grpc[@]}" "${attend[@]}" --async --streaming
run grpc_request_rate "${grpc[@]}" "${attend[@]}" --request-rate-range 50
run grpc_shared_memory "${grpc[@]}" "${attend[@]}" "${shm[@]}"
run grpc_served_model "${grpc[@]}" "${demo[@]}"
run grpc_sequences "${grpc[@]}" "${session[@]}"
run grpc_sequences_streaming "${grpc[@]}" "${session[@]}" --streaming
run http_sync "${http[@]}" "${attend[@]}" --concurrency-range 1:2
run http_async "${http[@]}" "${attend[@]}" --async
run http_request_rate "${http[@]}" "${attend[@]}" --request-rate-range 50
run http_shared_memory "${http[@]}" "${attend[@]}" "${shm[@]}"
run http_served_model "${http[@]}" "${demo[@]}"
run http_sequences "${http[@]}" "${session[@]}"

echo "$passed passed, $failed failed"
((failed == 0))
