# Starting and stopping an attnserve of a script's own, on free ports of
# 127.0.0.1. Sourced (not run) by the scripts that need one.
#
#   start_attnserve LOG BINARY [FLAG...]
#     starts BINARY --host=127.0.0.1 --port=0 FLAG... with its output in
#     LOG and waits up to 20 s for its banner ("attnserve listening on
#     127.0.0.1:PORT (..., metrics port M, http port H, isa I)"); sets
#     server_pid, server_banner, grpc_port, http_port and metrics_port (the
#     last two "off" when disabled). Prints LOG and exits 1 when the server
#     exits or does not start in time.
#   stop_attnserve
#     SIGTERM to the server started, and waits for it (nothing when none).

server_pid=""

start_attnserve() {
  local log=$1 binary=$2
  shift 2
  "$binary" --host=127.0.0.1 --port=0 "$@" >"$log" 2>&1 &
  server_pid=$!
  server_banner=""
  for _ in $(seq 200); do
    server_banner=$(grep -m1 '^attnserve listening on ' "$log" || true)
    [[ -n $server_banner ]] && break
    if ! kill -0 "$server_pid" 2>/dev/null; then
      server_pid=""
      break
    fi
    sleep 0.1
  done
  if [[ -z $server_banner ]]; then
    echo "attnserve did not start:" >&2
    cat "$log" >&2
    exit 1
  fi
  grpc_port=$(sed -E 's/.*listening on [^ ]*:([0-9]+) .*/\1/' <<<"$server_banner")
  http_port=$(sed -nE 's/.*http port ([0-9]+).*/\1/p' <<<"$server_banner")
  metrics_port=$(sed -nE 's/.*metrics port ([0-9]+).*/\1/p' <<<"$server_banner")
  http_port=${http_port:-off}
  metrics_port=${metrics_port:-off}
}

stop_attnserve() {
  if [[ -n "$server_pid" ]]; then
    kill -TERM "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=""
  fi
}
