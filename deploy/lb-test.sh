#!/usr/bin/env bash
# Load balancing under failure, on loopback: three attnserve replicas, in
# front of them nginx running deploy/nginx/nginx.conf (the compose file's
# proxy), and gRPC client-side round_robin over the three addresses.
#
# For each path (nginx, round_robin) and each way of losing a replica
# (SIGKILL: a crash; SIGTERM: a graceful drain), a closed-loop load runs for
# LB_TEST_DURATION_S (20) seconds while one replica is stopped and started
# again on the same port. The clients carry a retry policy in their service
# config, nginx retries on the next upstream (grpc_next_upstream ...
# non_idempotent) while a request has not been sent (nginx streams gRPC
# request bodies, so a call a replica dropped midway comes back to the client
# as UNAVAILABLE and the client retries it).
#
# On SIGTERM attnserve reports NOT_SERVING for --lame_duck_seconds while
# still serving, then refuses new calls with UNAVAILABLE, and stops listening
# once they stop coming, or after 1 s; a call that arrives as it stops, not
# yet handed to a handler, ends CANCELLED (gRPC 1.51's server shutdown). So:
#  - the round_robin client checks health (healthCheckConfig) and leaves a
#    replica while it reports NOT_SERVING: it sends it nothing to refuse;
#  - the retry policy retries UNAVAILABLE (a replica died or refused the
#    call) and CANCELLED (the calls are idempotent; gRPC never retries a
#    client's own cancellation), with backoff from 0.5 s doubling to 2 s:
#    nginx, which checks no health, keeps passing calls to a draining
#    replica for its refusal second, and shorter backoff (0.05-0.5 s) let a
#    call spend all five attempts there when the machine was busy.
# Passes when no call failed and every replica served calls, the restarted
# one after its restart too (counted from each replica's /metrics before the
# kill and after the restart, since a restarted replica's counters start at
# 0). Each run's line names, for every failing code, the first failed call:
# when it ended against when the stop came, where it went, its message.
#
#   deploy/lb-test.sh
#
# The load is `attnctl bench` (closed loop, JSON report).
# Environment: ATTNSERVE, ATTNCTL (default build/bin/...), LB_TEST_DURATION_S,
# LB_TEST_CONCURRENCY (8), LB_TEST_KILL_AT_S (6), LB_TEST_RETRY_CODES
# (UNAVAILABLE,CANCELLED), LB_TEST_CPU_HOG (0): that many busy loops run
# beside the test at normal priority, as on a machine busy with other work.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
attnserve=${ATTNSERVE:-$root/build/bin/attnserve}
attnctl=${ATTNCTL:-$root/build/bin/attnctl}
duration=${LB_TEST_DURATION_S:-20}
concurrency=${LB_TEST_CONCURRENCY:-8}
kill_at=${LB_TEST_KILL_AT_S:-6}
retry_codes=${LB_TEST_RETRY_CODES:-UNAVAILABLE,CANCELLED}
cpu_hog=${LB_TEST_CPU_HOG:-0}
python=/usr/bin/python3
# The request: LayerNorm over [4, 16, 256] float32 (64 KiB, under gRPC's
# 256 KiB retry buffer, so every attempt can be retried).
load_args=(--rpc=layernorm --batch=4 --seq=16 --dim=256 --heads=1 --warmup_s=0)

log() { printf 'lb-test: %s\n' "$*"; }
fail() {
  printf 'lb-test: FAIL: %s\n' "$*" >&2
  exit 1
}

[[ -x $attnserve && -x $attnctl ]] || fail "build the project first (scripts/build.sh)"
# (--helpfull exits non-zero.)
attnctl_help=$("$attnctl" --helpfull 2>&1 || true)
[[ $attnctl_help == *--service_config* && $attnctl_help == *--duration_s* ]] ||
  fail "$attnctl has no bench command: rebuild it (scripts/build.sh)"

if [[ $(id -u) -eq 0 ]]; then
  sudo=()
else
  sudo=(sudo)
fi
log "installing nginx-light, curl, python3 (apt-get)"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get -o DPkg::Lock::Timeout=300 update -qq
"${sudo[@]}" apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
  nginx-light curl python3 >/dev/null
nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)

tmp=$(mktemp -d /tmp/attnserve-lb-test.XXXXXX)
declare -a replica_pid=(0 0 0 0)
nginx_pid=0
load_pid=0
hog_pids=()

cleanup() {
  local status=$?
  set +e
  local pid
  for pid in "${hog_pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  for pid in "$load_pid" "${replica_pid[@]}" "$nginx_pid"; do
    if ((pid > 0)) && kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null
    fi
  done
  for pid in "$load_pid" "${replica_pid[@]}" "$nginx_pid"; do
    if ((pid > 0)); then
      for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
      kill -KILL "$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
    fi
  done
  if [[ ${KEEP_TMP:-0} == 1 ]]; then log "kept $tmp"; else rm -rf "$tmp"; fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Seven distinct free loopback ports: three gRPC, three metrics, nginx.
read -r -a ports < <("$python" - <<'EOF'
import socket
sockets = [socket.socket() for _ in range(7)]
for s in sockets:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in sockets))
EOF
)
grpc_port=(0 "${ports[0]}" "${ports[1]}" "${ports[2]}")
metrics_port=(0 "${ports[3]}" "${ports[4]}" "${ports[5]}")
nginx_port=${ports[6]}

healthy() { "$attnctl" health --target="$1" --timeout_s=1 >/dev/null 2>&1; }
wait_healthy() {
  local target=$1
  for _ in $(seq 1 100); do
    healthy "$target" && return 0
    sleep 0.1
  done
  return 1
}

start_replica() {
  local i=$1
  "$attnserve" --host=127.0.0.1 --port="${grpc_port[$i]}" \
    --metrics_port="${metrics_port[$i]}" --http_port=-1 --threads=1 --drain_seconds=5 \
    --log_level=info \
    >>"$tmp/replica$i.out" 2>>"$tmp/replica$i.err" &
  replica_pid[i]=$!
  wait_healthy "127.0.0.1:${grpc_port[$i]}" || fail "replica $i did not start (see $tmp/replica$i.*)"
}

# Successful calls a replica counted since it started.
served() {
  curl -fsS --max-time 2 "http://127.0.0.1:${metrics_port[$1]}/metrics" |
    awk '/^attnserve_requests_total\{/ && /code="OK"/ { s += $NF } END { print s + 0 }'
}

for i in 1 2 3; do start_replica "$i"; done
log "replicas on 127.0.0.1:${grpc_port[1]}, :${grpc_port[2]}, :${grpc_port[3]} (metrics :${metrics_port[1]}, :${metrics_port[2]}, :${metrics_port[3]})"

# nginx: deploy/nginx/nginx.conf with the loopback replicas and port; logs,
# pid and temporary files in $tmp/nginx.
mkdir -p "$tmp/nginx/attnserve.d" "$tmp/nginx/temp"
sed -e "s|server attnserve-1:50051|server 127.0.0.1:${grpc_port[1]}|" \
  -e "s|server attnserve-2:50051|server 127.0.0.1:${grpc_port[2]}|" \
  -e "s|server attnserve-3:50051|server 127.0.0.1:${grpc_port[3]}|" \
  -e "s|listen 8080 |listen 127.0.0.1:$nginx_port |" \
  "$root/deploy/nginx/nginx.conf" >"$tmp/nginx/nginx.conf"
for i in 1 2 3; do
  grep -q "server 127.0.0.1:${grpc_port[$i]} " "$tmp/nginx/nginx.conf" ||
    fail "nginx.conf has no 'server attnserve-$i:50051' line to point at replica $i"
done
grep -q "listen 127.0.0.1:$nginx_port " "$tmp/nginx/nginx.conf" || fail "nginx.conf has no 'listen 8080' line"
cat >"$tmp/nginx/attnserve.d/local.conf" <<EOF
client_body_temp_path $tmp/nginx/temp/body;
proxy_temp_path $tmp/nginx/temp/proxy;
fastcgi_temp_path $tmp/nginx/temp/fastcgi;
uwsgi_temp_path $tmp/nginx/temp/uwsgi;
scgi_temp_path $tmp/nginx/temp/scgi;
EOF
"$nginx_bin" -p "$tmp/nginx/" -c "$tmp/nginx/nginx.conf" -e "$tmp/nginx/error.log" \
  -g "daemon off; pid $tmp/nginx/nginx.pid; error_log $tmp/nginx/error.log warn;" \
  >"$tmp/nginx/access.log" 2>"$tmp/nginx/stderr.log" &
nginx_pid=$!
wait_healthy "127.0.0.1:$nginx_port" || { cat "$tmp/nginx/stderr.log" "$tmp/nginx/error.log" >&2; fail "nginx did not start"; }
curl -fsS --http2-prior-knowledge "http://127.0.0.1:$nginx_port/nginx-health" >/dev/null ||
  fail "nginx /nginx-health did not answer"
log "nginx $("$nginx_bin" -v 2>&1 | sed 's|.*/||') on 127.0.0.1:$nginx_port"

# Service configs: the retry policy; for the client-side path round_robin
# over the replicas that report SERVING.
codes_json="\"${retry_codes//,/\", \"}\""
retry_policy='"methodConfig": [{
    "name": [{"service": "attnserve.v1.AttentionService"}],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.5s", "maxBackoff": "2s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ['"$codes_json"']}}]'
printf '{%s}\n' "$retry_policy" >"$tmp/proxy.json"
health_check='"healthCheckConfig": {"serviceName": "attnserve.v1.AttentionService"}'
printf '{"loadBalancingConfig": [{"round_robin": {}}], %s, %s}\n' "$health_check" "$retry_policy" >"$tmp/round_robin.json"

load_cmd=("$attnctl" bench)
for _ in $(seq 1 "$cpu_hog"); do
  bash -c 'while :; do :; done' &
  hog_pids+=($!)
done
((cpu_hog == 0)) || log "$cpu_hog busy loops running beside the test"
log "load: ${load_cmd[*]} ${load_args[*]} --concurrency=$concurrency, ${duration} s per run, retrying $retry_codes"

results=()
failed_runs=0
run=0
for path in nginx round_robin; do
  for signal in KILL TERM; do
    run=$((run + 1))
    victim=$(((run - 1) % 3 + 1))
    if [[ $path == nginx ]]; then
      target=127.0.0.1:$nginx_port
      config=$tmp/proxy.json
    else
      target=ipv4:127.0.0.1:${grpc_port[1]},127.0.0.1:${grpc_port[2]},127.0.0.1:${grpc_port[3]}
      config=$tmp/round_robin.json
    fi
    declare -a before=(0) count=(0)
    for i in 1 2 3; do before[i]=$(served "$i"); done
    nginx_lines_before=$(wc -l <"$tmp/nginx/access.log")
    victim_lines_before=$(wc -l <"$tmp/replica$victim.err")

    report=$tmp/run$run.json
    load_start=$(date +%s.%N)
    "${load_cmd[@]}" --target="$target" "${load_args[@]}" \
      --concurrency="$concurrency" --connections=2 --duration_s="$duration" \
      --timeout_s=10 --service_config="$config" --format=json >"$report" 2>"$tmp/run$run.err" &
    load_pid=$!

    sleep "$kill_at"
    pre_kill=$(served "$victim")
    kill_time=$(date +%s.%N)
    kill -"$signal" "${replica_pid[$victim]}"
    wait "${replica_pid[$victim]}" 2>/dev/null || true
    down_time=$(date +%s.%N)
    start_replica "$victim"
    up_time=$(date +%s.%N)
    wait "$load_pid" || fail "run $run: the load tool failed: $(cat "$tmp/run$run.err")"
    load_pid=0

    after_restart=$(served "$victim")
    for i in 1 2 3; do
      if ((i == victim)); then
        count[i]=$((pre_kill - before[i] + after_restart))
      else
        count[i]=$(($(served "$i") - before[i]))
      fi
    done
    read -r requests ok errors qps p50 p99 < <("$python" - "$report" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
errors = ",".join(f"{k}={v}" for k, v in sorted(r.get("errors", {}).items())) or "none"
lat = r.get("latency_us", {})
print(r["requests"], r["ok"], errors, round(r["qps"]), round(lat.get("p50", 0)),
      round(lat.get("p99", 0)))
EOF
)
    retried=""
    if [[ $path == nginx ]]; then
      # Calls nginx sent to more than one replica ("upstream=a, b").
      retried=" nginx_retried=$(tail -n +"$((nginx_lines_before + 1))" "$tmp/nginx/access.log" | grep -c 'upstream=[^ ]*, ' || true)"
    fi
    # Each failing code's first call: when it ended and when the stop came
    # (seconds from the start of the load), where it went, and its message.
    failures=$("$python" - "$report" "$load_start" "$kill_time" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
stop_s = float(sys.argv[3]) - r.get("start_unix_s", float(sys.argv[2]))
for code, n in sorted(r.get("errors", {}).items()):
    at = r.get("error_first_at_s", {}).get(code)
    when = f"first at {at:.2f} s (stop at {stop_s:.2f} s)" if at is not None else "first"
    peer = r.get("error_first_peer", {}).get(code) or "no peer"
    print(f"{code} x{n}, {when} from {peer}: {r.get('error_messages', {}).get(code, '')!r}")
EOF
)
    # Calls the stopped replica refused while draining (its access log).
    refused=$(tail -n +"$((victim_lines_before + 1))" "$tmp/replica$victim.err" | grep -c 'status=UNAVAILABLE' || true)
    drain=$(awk -v a="$kill_time" -v b="$down_time" 'BEGIN { printf "%.2f", b - a }')
    restart=$(awk -v a="$down_time" -v b="$up_time" 'BEGIN { printf "%.2f", b - a }')
    line=$(printf '%-11s SIG%-4s replica %d stopped in %ss (refused %s), back in %ss | requests=%s ok=%s failed=%s qps=%s p50=%sus p99=%sus | served r1=%s r2=%s r3=%s (r%d after restart: %s)%s' \
      "$path" "$signal" "$victim" "$drain" "$refused" "$restart" "$requests" "$ok" "$errors" "$qps" "$p50" "$p99" \
      "${count[1]}" "${count[2]}" "${count[3]}" "$victim" "$after_restart" "$retried")
    verdict=ok
    if [[ $errors != none || $ok != "$requests" || $requests == 0 ]]; then verdict=FAIL; fi
    for i in 1 2 3; do ((count[i] > 0)) || verdict=FAIL; done
    ((after_restart > 0)) || verdict=FAIL
    [[ $verdict == ok ]] || failed_runs=$((failed_runs + 1))
    if [[ -n $failures ]]; then line+=$'\n'$(sed 's/^/      failed: /' <<<"$failures"); fi
    results+=("$verdict $line")
    log "run $run: $verdict $line"
  done
done

echo
log "summary (${duration} s per run, concurrency $concurrency, LayerNorm [4, 16, 256], $cpu_hog busy loops beside):"
printf '  %s\n' "${results[@]}"
((failed_runs == 0)) || fail "$failed_runs of $run runs failed"
log "PASS"
