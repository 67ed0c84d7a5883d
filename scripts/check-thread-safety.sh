#!/usr/bin/env bash
# Checks the lock annotations (ABSL_GUARDED_BY, ABSL_LOCKS_EXCLUDED, ...) of
# every translation unit of the tree with clang's -Wthread-safety, as errors.
# Only clang's front end runs (-fsyntax-only): the build folder, configured
# for clang++, builds nothing but the generated protobuf and gRPC headers.
# Usage: scripts/check-thread-safety.sh [build folder, default build-clang]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-clang}
mkdir -p "$build"
build=$(cd "$build" && pwd)

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
  -DATTNSERVE_BUILD_TESTS=ON -DATTNSERVE_BUILD_BENCHMARKS=ON \
  -DCMAKE_OPTIMIZE_DEPENDENCIES=ON >/dev/null
mapfile -t generated < <(ninja -C "$build" -t targets all |
  awk -F': ' '$2 == "CUSTOM_COMMAND" && $1 ~ /^[^\/].*\.pb\.(h|cc)$/ { print $1 }')
ninja -C "$build" "${generated[@]}" >/dev/null

python3 - "$root" "$build" "$(nproc)" <<'EOF'
import concurrent.futures
import json
import os
import shlex
import subprocess
import sys

root, build, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(os.path.join(build, "compile_commands.json")) as f:
    entries = json.load(f)

def ours(path):
    # Sources of the tree, not the protobuf and gRPC code generated into the
    # build folder.
    path = os.path.realpath(path)
    return path.startswith(root + os.sep) and not path.startswith(build + os.sep)

def check(entry):
    args = entry.get("arguments") or shlex.split(entry["command"])
    out = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "-o":
            skip = True
        elif arg != "-c":
            out.append(arg)
    out[1:1] = ["-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety"]
    run = subprocess.run(out, cwd=entry["directory"], capture_output=True,
                         text=True)
    return entry["file"], run.returncode, run.stdout + run.stderr

units = [e for e in entries if ours(e["file"])]
failed = 0
with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    for path, code, output in pool.map(check, units):
        if code != 0 or output:
            sys.stdout.write(output)
        if code != 0:
            failed += 1
print(f"thread-safety: {len(units)} translation units, {failed} failed")
sys.exit(1 if failed else 0)
EOF
