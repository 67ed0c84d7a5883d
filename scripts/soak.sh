#!/usr/bin/env bash
# Soak test with faults: starts build/bin/attnserve on 127.0.0.1 (a free
# port) with a copy of the demo model repository, runs scripts/soak.py
# against it for SECONDS (default 1800), then checks that the server is
# still healthy and stops cleanly on SIGTERM (exit code 0).
#
#   scripts/soak.sh [SECONDS]
#
# soak.py keeps a mixed load on the server (every RPC, tiny to a few MB,
# shared memory, calls cancelled midway, expiring deadlines, malformed
# requests) while it reloads the models with SIGHUP every few seconds, and
# judges the calls' status codes, the server's resident memory after the
# warm-up and the tiny calls' p99 latency (see its docstring). Needs a build
# with the Python stubs: scripts/build.sh Release -DATTNSERVE_BUILD_TESTS=ON
# (targets attnserve, attnctl, demo_model, attnserve_python_stubs).
# Environment: ATTNSERVE, ATTNCTL (default build/bin/...), SOAK_RELOAD_EVERY_S
# (3), KEEP_TMP=1 keeps the server's logs and the memory samples
# (memory.csv).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
duration=${1:-1800}
attnserve=${ATTNSERVE:-$root/build/bin/attnserve}
attnctl=${ATTNCTL:-$root/build/bin/attnctl}
stubs=$root/build/clients/python_gen
demo=$root/build/models/demo
python=/usr/bin/python3

log() { printf 'soak: %s\n' "$*"; }
fail() {
  printf 'soak: FAIL: %s\n' "$*" >&2
  exit 1
}

[[ $duration =~ ^[0-9]+$ && $duration -ge 20 ]] || fail "SECONDS must be a whole number >= 20, not '$duration'"
for path in "$attnserve" "$attnctl" "$stubs/attnserve/v1/attention_pb2.py" "$demo/config.pbtxt"; do
  [[ -e $path ]] || fail "$path is missing: build first (scripts/build.sh Release -DATTNSERVE_BUILD_TESTS=ON)"
done

tmp=$(mktemp -d /tmp/attnserve-soak.XXXXXX)
server_pid=0
cleanup() {
  local status=$?
  set +e
  if ((server_pid > 0)) && kill -0 "$server_pid" 2>/dev/null; then
    kill -KILL "$server_pid"
    wait "$server_pid" 2>/dev/null
  fi
  if [[ ${KEEP_TMP:-0} == 1 || $status -ne 0 ]]; then
    log "server logs kept in $tmp"
  else
    rm -rf "$tmp"
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The repository is a copy: the soak edits it before each reload.
mkdir -p "$tmp/models" "$tmp/scratch"
cp -r "$demo" "$tmp/models/demo"

# --log_level=warning: no access-log line per call (hundreds a second).
"$attnserve" --host=127.0.0.1 --port=0 --metrics_port=0 --http_port=-1 \
  --model_repository="$tmp/models" --log_level=warning \
  --max_session_memory_mb=4 --session_idle_timeout_s=5 \
  >"$tmp/server.out" 2>"$tmp/server.err" &
server_pid=$!
banner=""
for _ in $(seq 1 200); do
  banner=$(grep -m1 '^attnserve listening on ' "$tmp/server.out" || true)
  [[ -n $banner ]] && break
  kill -0 "$server_pid" 2>/dev/null || fail "attnserve exited at start-up: $(cat "$tmp/server.err")"
  sleep 0.1
done
[[ -n $banner ]] || fail "attnserve did not start within 20 s"
# "attnserve listening on 127.0.0.1:PORT (N compute threads, metrics port M, http port H, isa I)"
target=$(awk '{ print $4 }' <<<"$banner")
metrics_port=$(sed -n 's/.*metrics port \([0-9]*\),.*/\1/p' <<<"$banner")
log "$banner"

status=0
PYTHONPATH=$stubs:$root/clients/python "$python" "$root/scripts/soak.py" \
  --target="$target" --server_pid="$server_pid" --repository="$tmp/models" \
  --scratch="$tmp/scratch" --metrics_port="$metrics_port" \
  --duration_s="$duration" --reload_every_s="${SOAK_RELOAD_EVERY_S:-3}" \
  --samples="$tmp/memory.csv" ||
  status=$?

reloaded=$(grep -c '^attnserve: models reloaded' "$tmp/server.out" || true)
reload_failed=$(grep -c '^attnserve: reload failed' "$tmp/server.out" || true)
log "server: $reloaded reloads, $reload_failed failed"
if ((reload_failed > 0)); then
  grep -m3 '^attnserve: reload failed' "$tmp/server.out" >&2
  status=1
fi

if "$attnctl" health --target="$target" --timeout_s=5 >"$tmp/health.out" 2>&1; then
  log "health at the end: $(cat "$tmp/health.out")"
else
  log "health at the end failed: $(cat "$tmp/health.out")"
  status=1
fi

stop_start=$(date +%s.%N)
kill -TERM "$server_pid"
server_exit=0
wait "$server_pid" || server_exit=$?
server_pid=0
stop_s=$(awk -v a="$stop_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
if ((server_exit == 0)) && grep -q '^attnserve: stopped' "$tmp/server.out"; then
  log "SIGTERM: stopped in $stop_s s, exit code 0"
else
  log "SIGTERM: exit code $server_exit after $stop_s s; stderr:"
  tail -n 20 "$tmp/server.err" >&2
  status=1
fi

if ((status != 0)); then fail "see above"; fi
log "PASS"
