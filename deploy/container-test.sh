#!/usr/bin/env bash
# Builds the attnserve image from the top-level Dockerfile and checks it in a
# running container, with Debian's podman and runc (the default) or Debian's
# Docker engine (docker.io, --engine=docker), and no registry:
#
#   1. makes the base image debian:bookworm-slim locally (debootstrap minbase,
#      trimmed like the official slim variant) and imports it;
#   2. builds the image (apt inside the build uses Debian's mirror);
#   3. checks its size (<= MAX_IMAGE_MB, default 300 MB), user and health
#      check;
#   4. runs it read-only with --cpus=1 (podman: published on free loopback
#      ports; docker: in its own network namespace, which the host's tools
#      enter with nsenter, as the engine runs without a bridge), waits for
#      SERVING, checks the start-up line reports 1 compute thread,
#      that attnserve started without the entry point and without
#      OMP_NUM_THREADS reports 1 as well (it reads the cgroup quota, v2 or
#      v1, itself), and that the image's HEALTHCHECK reports healthy;
#   5. sends every golden vector through it with the host's attnctl and
#      checks each max |diff| (f32 <= 1e-4, bf16 <= 2e-2), calls the demo
#      model, reads /metrics;
#   6. stops it with SIGTERM and checks it drained and exited 0.
#
# Everything the engine stores lives in a temporary folder removed at exit:
# podman's storage, or a Docker daemon of the script's own (dockerd
# --storage-driver=vfs --iptables=false --bridge=none, with its data, its
# socket and its containerd under the folder; a Docker daemon already
# running is left alone). Needs root (apt-get, the engine's storage). Takes
# several minutes (the build compiles the project). Usage:
#
#   deploy/container-test.sh [--engine=podman|docker]
#
# The image is built from the committed tree (git archive HEAD), so edits in
# progress in the working tree do not leak into it; CONTAINER_TEST_SOURCE=
# worktree builds the working tree instead (.dockerignore applies).
#
# Environment: ATTNSERVE_GOLDENS_DIR (default tests/goldens), ATTNCTL (default build/bin/attnctl), MAX_IMAGE_MB (300),
# DEBIAN_MIRROR (http://deb.debian.org/debian), KEEP_TMP=1 keeps the
# temporary folder, DOCKER (/usr/bin/docker, Debian's client) and DOCKERD
# (/usr/sbin/dockerd) for --engine=docker.
set -euo pipefail

engine=podman
for arg in "$@"; do
  case $arg in
    --engine=podman | --engine=docker) engine=${arg#--engine=} ;;
    *)
      echo "usage: $0 [--engine=podman|docker]" >&2
      exit 2
      ;;
  esac
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
goldens=${ATTNSERVE_GOLDENS_DIR:-$root/tests/goldens}
attnctl=${ATTNCTL:-$root/build/bin/attnctl}
max_image_mb=${MAX_IMAGE_MB:-300}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
image=localhost/attnserve:container-test
name=attnserve-container-test-$$
python=/usr/bin/python3

log() { printf 'container-test (%s): %s\n' "$engine" "$*"; }
fail() {
  printf 'container-test (%s): FAIL: %s\n' "$engine" "$*" >&2
  exit 1
}

if [[ $(id -u) -ne 0 ]]; then
  fail "run as root (apt-get, debootstrap and the engine's storage need it)"
fi
[[ -x $attnctl ]] || fail "$attnctl not found: build the project first (scripts/build.sh)"
[[ -d $goldens ]] || fail "goldens folder $goldens not found (set ATTNSERVE_GOLDENS_DIR)"

export DEBIAN_FRONTEND=noninteractive
if [[ $engine == podman ]]; then
  log "installing podman, runc and debootstrap (apt-get)"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends \
    podman buildah debootstrap runc uidmap slirp4netns fuse-overlayfs \
    python3 ca-certificates git >/dev/null
else
  log "installing docker.io and debootstrap (apt-get)"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends \
    docker.io debootstrap python3 ca-certificates git util-linux >/dev/null
fi

tmp=$(mktemp -d /var/tmp/attnserve-container-test.XXXXXX)
dockerd_pid=
if [[ $engine == podman ]]; then
  engine_cmd=(podman --root "$tmp/storage" --runroot "$tmp/run" --tmpdir "$tmp/libpod"
    --runtime runc --cgroup-manager cgroupfs --events-backend file)
else
  docker_socket=$tmp/docker/docker.sock
  engine_cmd=("${DOCKER:-/usr/bin/docker}" --host "unix://$docker_socket")
fi

cleanup() {
  local status=$?
  set +e
  if [[ -d $tmp ]]; then
    if [[ $engine == podman ]]; then
      "${engine_cmd[@]}" rm --force --time 0 "$name" >/dev/null 2>&1
    elif [[ -n $dockerd_pid ]]; then
      "${engine_cmd[@]}" rm --force "$name" >/dev/null 2>&1
    fi
    if [[ ${KEEP_TMP:-0} == 1 ]]; then
      log "kept $tmp"
      if [[ -n $dockerd_pid ]]; then
        log "dockerd (pid $dockerd_pid) still runs: docker --host unix://$docker_socket ..."
      fi
    else
      if [[ $engine == podman ]]; then
        "${engine_cmd[@]}" system reset --force >/dev/null 2>&1
      elif [[ -n $dockerd_pid ]]; then
        # The script's own daemon: stopped, with its containerd.
        kill -TERM "$dockerd_pid" 2>/dev/null
        for _ in $(seq 1 30); do
          kill -0 "$dockerd_pid" 2>/dev/null || break
          sleep 0.5
        done
      fi
      # Anything the engine left mounted under the folder, deepest first.
      findmnt -rn -o TARGET | grep -F "$tmp/" | sort -r | xargs -r umount -l
      rm -rf "$tmp"
    fi
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Configuration of podman for this run only: no registry is ever searched or
# contacted (images are local, pulls are refused). The Docker daemon pulls
# nothing either: the base image is imported and the build names no other.
mkdir -p "$tmp/libpod" "$tmp/tmp"
cat >"$tmp/registries.conf" <<'EOF'
unqualified-search-registries = []
short-name-mode = "permissive"
EOF
cat >"$tmp/policy.json" <<'EOF'
{"default": [{"type": "insecureAcceptAnything"}]}
EOF
export CONTAINERS_REGISTRIES_CONF=$tmp/registries.conf
export TMPDIR=$tmp/tmp
ulimits=(--ulimit nofile=20000:20000 --ulimit nproc=32768:32768)

if [[ $engine == docker ]]; then
  # A daemon of this run's own, whatever else runs: the vfs storage driver
  # (no overlay mounts needed), no iptables rules and no bridge (builds use
  # the host's network, the test container none). Niced like podman's
  # build: the build's processes are the daemon's children.
  mkdir -p "$tmp/docker"
  log "starting dockerd --storage-driver=vfs --iptables=false --bridge=none (data in $tmp/docker)"
  nice -n 10 "${DOCKERD:-/usr/sbin/dockerd}" --storage-driver=vfs --iptables=false --bridge=none \
    --data-root "$tmp/docker/data" --exec-root "$tmp/docker/exec" \
    --pidfile "$tmp/docker/dockerd.pid" --host "unix://$docker_socket" \
    >"$tmp/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 1 120); do
    "${engine_cmd[@]}" version >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || { tail -20 "$tmp/dockerd.log" >&2; fail "dockerd exited"; }
    sleep 0.5
  done
  "${engine_cmd[@]}" version >/dev/null 2>&1 || { tail -20 "$tmp/dockerd.log" >&2; fail "dockerd did not answer within 60 s"; }
  log "$("${engine_cmd[@]}" version --format 'docker client {{.Client.Version}}, engine {{.Server.Version}}')"
fi

# 1. Base image.
log "making debian:bookworm-slim with debootstrap --variant=minbase"
rootfs=$tmp/rootfs
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$tmp/debootstrap.log" 2>&1 ||
  { tail -20 "$tmp/debootstrap.log" >&2; fail "debootstrap failed"; }
# Slim it the way the official image is: no package lists or caches, no
# documentation but copyright files, no man pages or locales, and a dpkg
# configuration that keeps them out of later installs.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
  "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/log/*.log
find "$rootfs/usr/share/doc" -mindepth 1 -not -type d -not -name copyright -delete
find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
for dir in man locale info groff lintian linda; do
  rm -rf "${rootfs:?}/usr/share/$dir"/*
done
cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
EOF
if [[ $engine == podman ]]; then
  tar -C "$rootfs" -c . | "${engine_cmd[@]}" import --quiet - debian:bookworm-slim >/dev/null
  "${engine_cmd[@]}" tag debian:bookworm-slim docker.io/library/debian:bookworm-slim
else
  tar -C "$rootfs" -c . | "${engine_cmd[@]}" import - debian:bookworm-slim >/dev/null
fi
rm -rf "$rootfs"
base_bytes=$("${engine_cmd[@]}" image inspect --format '{{.Size}}' debian:bookworm-slim)
log "base image: $((base_bytes / 1000000)) MB"

# 2. Build.
case ${CONTAINER_TEST_SOURCE:-head} in
  head)
    context=$tmp/context
    mkdir -p "$context"
    git -C "$root" archive --format=tar HEAD | tar -x -C "$context"
    source_desc="commit $(git -C "$root" rev-parse --short HEAD)"
    ;;
  worktree)
    context=$root
    source_desc="working tree $root"
    ;;
  *) fail "CONTAINER_TEST_SOURCE must be head or worktree" ;;
esac
log "building $image from $source_desc (compiles the project; several minutes)"
build_start=$(date +%s)
if [[ $engine == podman ]]; then
  build=(nice -n 10 "${engine_cmd[@]}" build --format docker --network host --pull=never
    --signature-policy "$tmp/policy.json")
else
  build=("${engine_cmd[@]}" build --network host)
fi
if ! "${build[@]}" "${ulimits[@]}" \
  --tag "$image" --file "$context/Dockerfile" "$context" >"$tmp/build.log" 2>&1; then
  tail -40 "$tmp/build.log" >&2
  fail "image build failed"
fi
build_seconds=$(($(date +%s) - build_start))
log "built in ${build_seconds} s"

# 3. The image itself.
image_bytes=$("${engine_cmd[@]}" image inspect --format '{{.Size}}' "$image")
image_mb=$(((image_bytes + 999999) / 1000000))
log "image size: $image_mb MB ($image_bytes bytes; limit $max_image_mb MB)"
((image_mb <= max_image_mb)) || fail "image is $image_mb MB, over $max_image_mb MB"
image_user=$("${engine_cmd[@]}" image inspect --format '{{.Config.User}}' "$image")
[[ $image_user == 10001* ]] || fail "image user is '$image_user', expected 10001"
if [[ $engine == podman ]]; then
  healthcheck=$("${engine_cmd[@]}" image inspect --format '{{json .HealthCheck}}' "$image")
else
  healthcheck=$("${engine_cmd[@]}" image inspect --format '{{json .Config.Healthcheck}}' "$image")
fi
[[ $healthcheck == *"attnctl"*"health"* ]] || fail "image has no attnctl health check: $healthcheck"
log "image user $image_user, health check $healthcheck"

# 4. Run it: read-only root, one CPU. podman publishes it on free loopback
# ports. The Docker daemon has no bridge to publish through (--bridge=none),
# so the container gets a network namespace of its own (--network none) and
# the host's attnctl and python run inside it (nsenter), where the image's
# own ports 50051 and 9090 answer, as its HEALTHCHECK expects.
free_port() {
  "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
if [[ $engine == podman ]]; then
  grpc_port=$(free_port)
  metrics_port=$(free_port)
  while [[ $metrics_port == "$grpc_port" ]]; do metrics_port=$(free_port); done
  network=(--network slirp4netns
    --publish "127.0.0.1:$grpc_port:50051" --publish "127.0.0.1:$metrics_port:9090")
  where="the host"
else
  grpc_port=50051
  metrics_port=9090
  network=(--network none)
  where="the container's network namespace"
fi
target=127.0.0.1:$grpc_port
log "starting $name on $target (metrics 127.0.0.1:$metrics_port) in $where, --cpus=1"
"${engine_cmd[@]}" run --detach --name "$name" --pull=never "${ulimits[@]}" \
  --cpus=1 --memory=2g --read-only "${network[@]}" \
  "$image" >/dev/null 2>>"$tmp/engine.log" ||
  { cat "$tmp/engine.log" >&2; fail "$engine run failed"; }
# (Without systemd, podman logs that it cannot schedule the health check's
# timer; `podman healthcheck run` below runs the check itself. The Docker
# daemon runs it on its own.)
in_net=()
if [[ $engine == docker ]]; then
  container_pid=$("${engine_cmd[@]}" inspect --format '{{.State.Pid}}' "$name")
  in_net=(nsenter "--net=/proc/$container_pid/ns/net")
fi

healthy=0
for _ in $(seq 1 120); do
  if "${in_net[@]}" "$attnctl" health --target="$target" --timeout_s=2 >/dev/null 2>&1; then
    healthy=1
    break
  fi
  state=$("${engine_cmd[@]}" inspect --format '{{.State.Status}}' "$name" 2>/dev/null || echo gone)
  [[ $state == running || $state == created || $state == configured ]] ||
    { "${engine_cmd[@]}" logs "$name" >&2 || true; fail "container is $state"; }
  sleep 0.5
done
((healthy)) || { "${engine_cmd[@]}" logs "$name" >&2 || true; fail "no SERVING within 60 s"; }
listening=$("${engine_cmd[@]}" logs "$name" 2>&1 | grep -m1 'attnserve listening on' || true)
log "server: $listening"
threads=$(sed -n 's/.*(\([0-9]*\) compute threads.*/\1/p' <<<"$listening")
[[ $threads == 1 ]] || fail "expected 1 compute thread under --cpus=1, the server reports '${threads:-?}'"

# The server sizes itself from the container's CPU quota (cgroup v2 cpu.max
# or v1 cpu.cfs_quota_us) with no help: the entry point sets no
# OMP_NUM_THREADS, and attnserve started directly, with OMP_NUM_THREADS
# unset, counts 1 compute thread under --cpus=1 too.
# shellcheck disable=SC2016 # expanded by the container's shell
server_env=$("${engine_cmd[@]}" exec "$name" /bin/sh -c 'tr "\0" "\n" </proc/1/environ' 2>&1) ||
  fail "podman exec (reading the server's environment): $server_env"
[[ $server_env != *OMP_NUM_THREADS=* ]] ||
  fail "the server runs with $(grep OMP_NUM_THREADS= <<<"$server_env"): the thread count is not its own reading"
# shellcheck disable=SC2016 # expanded by the container's shell
own_threads=$("${engine_cmd[@]}" run --rm --pull=never "${ulimits[@]}" --cpus=1 --network none \
  --entrypoint /bin/sh "$image" -c \
  'env -u OMP_NUM_THREADS /usr/local/bin/attnserve --host=127.0.0.1 --port=0 --metrics_port=-1 --http_port=-1 --lame_duck_seconds=0 & pid=$!; sleep 2; kill $pid; wait $pid' \
  2>/dev/null | sed -n 's/.*(\([0-9]*\) compute threads.*/\1/p' || true)
log "attnserve without the entry point or OMP_NUM_THREADS under --cpus=1: ${own_threads:-?} compute threads"
[[ $own_threads == 1 ]] ||
  fail "expected 1 compute thread from attnserve itself under --cpus=1, it reports '${own_threads:-?}'"

# The image's own HEALTHCHECK, run inside the container: by podman on
# request, by the Docker daemon every 10 s (after the first interval).
if [[ $engine == docker ]]; then
  health_status=starting
  for _ in $(seq 1 60); do
    health_status=$("${engine_cmd[@]}" inspect --format '{{.State.Health.Status}}' "$name")
    [[ $health_status == starting ]] || break
    sleep 1
  done
  health_log=$("${engine_cmd[@]}" inspect --format '{{range .State.Health.Log}}{{.ExitCode}}:{{.Output}} {{end}}' "$name")
  log "HEALTHCHECK (run by the daemon): status $health_status; ${health_log//$'\n'/ }"
  [[ $health_status == healthy ]] || fail "health status is '$health_status'"
elif health_out=$("${engine_cmd[@]}" healthcheck run "$name" 2>&1); then
  health_status=$("${engine_cmd[@]}" inspect --format '{{.State.Health.Status}}' "$name" 2>/dev/null ||
    "${engine_cmd[@]}" inspect --format '{{.State.Healthcheck.Status}}' "$name")
  log "HEALTHCHECK: ${health_out:-ok}, status $health_status"
  [[ $health_status == healthy ]] || fail "health status is '$health_status'"
else
  fail "podman healthcheck run: $health_out"
fi

# 5. Goldens through the container.
golden_info() {
  "$python" - "$1" <<'EOF'
import json, struct, sys
with open(sys.argv[1], "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    meta = json.loads(f.read(n)).get("__metadata__", {})
print(meta.get("op", ""), meta.get("dtype", "f32"))
EOF
}
passed=0
total=0
failures=()
summary=()
for file in "$goldens"/*.safetensors; do
  total=$((total + 1))
  golden=$(basename "$file" .safetensors)
  read -r op dtype < <(golden_info "$file")
  case $op in
    attend) command=attend ;;
    multi_head_attend) command=mha ;;
    layer_norm) command=layernorm ;;
    *) failures+=("$golden: unknown op '$op'"); continue ;;
  esac
  tolerance=1e-4
  [[ $dtype == bf16 ]] && tolerance=2e-2
  if ! out=$("${in_net[@]}" "$attnctl" "$command" --target="$target" --in="$file" --return_weights 2>&1); then
    failures+=("$golden: $out")
    continue
  fi
  # "output: ..., max |diff| vs expected_output = X" (and expected_weights).
  verdict=$(awk -v tol="$tolerance" '
    /max \|diff\| vs expected_/ {
      n++; d = $NF + 0; name = $0; sub(/.*vs /, "", name); sub(/ =.*/, "", name)
      line = line sprintf(" %s=%s", name, $NF)
      if (d > tol || $NF !~ /^[0-9.e+-]+$/) bad = 1
    }
    END { if (n == 0) bad = 1; printf "%s%s\n", (bad ? "FAIL" : "ok"), line }' <<<"$out")
  summary+=("$(printf '  %-52s %-9s %-4s tol %-5s %s' "$golden" "$command" "$dtype" "$tolerance" "$verdict")")
  if [[ $verdict == ok* ]]; then
    passed=$((passed + 1))
  else
    failures+=("$golden: $out")
  fi
done
log "goldens: $passed/$total passed (max |diff| per golden):"
printf '%s\n' "${summary[@]}"

# The demo model baked into the image answers a call.
models=$("${in_net[@]}" "$attnctl" models --target="$target" --timeout_s=10)
[[ $models == *"demo heads=8 embed_dim=512"* ]] || failures+=("models: $models")
"$python" - "$tmp/demo_query.safetensors" <<'EOF'
import json, random, struct, sys
random.seed(1)
values = [random.uniform(-1, 1) for _ in range(2 * 8 * 512)]
header = json.dumps({"query": {"dtype": "F32", "shape": [2, 8, 512],
                               "data_offsets": [0, 4 * len(values)]}}).encode()
header += b" " * (-len(header) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + struct.pack(f"<{len(values)}f", *values))
EOF
if demo=$("${in_net[@]}" "$attnctl" mha --target="$target" --model=demo --in="$tmp/demo_query.safetensors" 2>&1) &&
  [[ $demo == *"output: FLOAT32 [2, 8, 512]"* ]]; then
  log "demo model: $demo"
else
  failures+=("demo model: $demo")
fi

metrics=$("${in_net[@]}" "$python" -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' \
  "http://127.0.0.1:$metrics_port/metrics")
ok_calls=$(awk '/^attnserve_requests_total\{.*code="OK"/ { s += $NF } END { print s + 0 }' <<<"$metrics")
log "metrics: attnserve_requests_total{code=\"OK\"} = $ok_calls"
((ok_calls >= total + 1)) || failures+=("metrics: $ok_calls OK calls counted, expected >= $((total + 1))")

# 6. Graceful stop: SIGTERM, drain, exit 0.
stop_start=$(date +%s.%N)
# (podman also tries to remove a systemd timer for the health check; without
# systemd it logs an error, kept in engine.log.)
"${engine_cmd[@]}" stop --time 30 "$name" >/dev/null 2>>"$tmp/engine.log"
stop_seconds=$(awk -v a="$stop_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
exit_code=$("${engine_cmd[@]}" inspect --format '{{.State.ExitCode}}' "$name")
stopped=$("${engine_cmd[@]}" logs "$name" 2>&1 | grep -c '^attnserve: stopped' || true)
log "stopped in ${stop_seconds} s, exit code $exit_code"
[[ $exit_code == 0 && $stopped == 1 ]] || failures+=("stop: exit code $exit_code, 'stopped' lines $stopped")

echo
log "engine:         $("${engine_cmd[@]}" --version)"
log "image size:     $image_mb MB (limit $max_image_mb MB; base $((base_bytes / 1000000)) MB)"
log "build time:     $build_seconds s"
log "compute threads under --cpus=1: $threads (attnserve without the entry point: $own_threads)"
log "goldens passed: $passed/$total"
if ((${#failures[@]})); then
  printf '  %s\n' "${failures[@]}" >&2
  fail "${#failures[@]} check(s) failed"
fi
log "PASS"
