#!/usr/bin/env bash
# Runs the Python commands of the READMEs as a new user would: in a copy of
# the checkout's tracked files (nothing built, no generated files that are
# not committed), it starts the server with the quick start's
# scripts/run-server.sh (which installs, builds Release without tests and
# serves the demo model), then runs every command of the ```sh blocks in
# README.md's "### Python" section and in clients/python/README.md, as
# written, from the copy's root, and compares what each prints with the
# "# ..." lines under it.
#
# Only the port differs: the commands' 127.0.0.1:50051 becomes the free port
# the server was started on. In the comparison, numbers in scientific
# notation (max |diff| figures, which vary by CPU) and the process id in a
# shared-memory region's name are masked. HOME is a temporary folder, so
# that the commands' ~/attnserve-venv is made afresh.
#
# Usage: scripts/readme-python-check.sh   (the copy and its build go to
# build-readme-check/, removed at the end unless KEEP_TMP=1)
# Takes as long as a Release build of the project.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$root/build-readme-check
src=$work/src
python=/usr/bin/python3

log() { printf 'readme-python-check: %s\n' "$*"; }
fail() {
  printf 'readme-python-check: FAIL: %s\n' "$*" >&2
  exit 1
}

rm -rf "$work"
mkdir -p "$src" "$work/home"
# The tracked files as they are in the working tree (a deleted one is left
# out): what a clone of this state would hold.
(cd "$root" && git ls-files -z | while IFS= read -r -d '' file; do
  [[ -e $file || -L $file ]] && printf '%s\0' "$file"
done | tar --null -T - -cf -) | tar -xf - -C "$src"

server_pid=
cleanup() {
  local status=$?
  set +e
  if [[ -n $server_pid ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid"
    wait "$server_pid"
  fi
  if ((status)) && [[ -f $work/server.log ]]; then
    tail -30 "$work/server.log" >&2
  fi
  if [[ ${KEEP_TMP:-0} == 1 ]]; then
    log "kept $work"
  else
    rm -rf "$work"
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log "scripts/run-server.sh --port=$port --metrics_port=0 --http_port=0 in $src (installs, builds Release, starts)"
start=$(date +%s)
"$src/scripts/run-server.sh" --port="$port" --metrics_port=0 --http_port=0 \
  >"$work/server.log" 2>&1 &
server_pid=$!
until grep -q '^attnserve listening on ' "$work/server.log"; do
  kill -0 "$server_pid" 2>/dev/null || fail "scripts/run-server.sh exited before the server listened"
  sleep 1
done
log "$(grep -m1 '^attnserve listening on ' "$work/server.log") after $(($(date +%s) - start)) s"

HOME=$work/home "$python" - "$src" "$port" "$src/README.md" "$src/clients/python/README.md" <<'EOF'
import os
import re
import subprocess
import sys

src, port, readme, client_readme = sys.argv[1:]


def sh_blocks(text):
    return re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)


def python_section(text):
    start = text.index("\n### Python\n")
    end = re.search(r"\n##+ ", text[start + 1:]).start() + start + 1
    return text[start:end]


def commands(block):
    """(command, expected output lines) pairs; '\\' continues a line."""
    result, current = [], ""
    for line in block.splitlines():
        if current:
            current += "\n" + line
        elif line.startswith("#"):
            result[-1][1].append(line[2:] if line.startswith("# ") else line[1:])
            continue
        else:
            current = line
        if not current.endswith("\\"):
            result.append((current, []))
            current = ""
    return result


def masked(line):
    line = re.sub(r"\d+(\.\d+)?e[-+]\d+", "<num>", line)
    return re.sub(r"example-\d+", "example-<pid>", line)


with open(readme) as f:
    blocks = sh_blocks(python_section(f.read()))
with open(client_readme) as f:
    blocks += sh_blocks(f.read())
todo = [c for block in blocks for c in commands(block)]
if not todo:
    sys.exit("readme-python-check: FAIL: no commands found")
failures = 0
for command, expected in todo:
    run = command.replace("127.0.0.1:50051", f"127.0.0.1:{port}")
    print(f"$ {run}", flush=True)
    out = subprocess.run(["bash", "-c", run], cwd=src, capture_output=True,
                         text=True, timeout=600)
    sys.stdout.write(out.stdout)
    problem = None
    if out.returncode != 0:
        problem = f"exit code {out.returncode}: {out.stderr.strip()}"
    elif expected and ([masked(l) for l in out.stdout.splitlines()] !=
                       [masked(l) for l in expected]):
        problem = "output differs from the README's:\n" + "\n".join(
            "  " + l for l in expected)
    if problem:
        failures += 1
        print(f"readme-python-check: FAIL: {problem}", flush=True)
print(f"readme-python-check: {len(todo) - failures} of {len(todo)} commands "
      "ran and printed what the READMEs show")
sys.exit(1 if failures else 0)
EOF
log "PASS in $(($(date +%s) - start)) s"
