#!/usr/bin/env python3
"""Checks the layering of the C++ tree from its #include lines.

A module is a header and its source (server/sequences.h and .cc), with
its private parts (core/row_ops_internal.h, core/row_ops_hwy.cc). Fails,
naming the files, when:
  - modules include each other in a cycle (through any number of others);
  - a folder includes one it must not: core/ includes only core/, engine/
    only core/ and engine/, and neither includes gRPC or protobuf headers
    (grpcpp/, google/protobuf/, generated *.pb.h);
  - a header other than core/primitives.h includes oneDNN's headers or
    core/primitives.h: oneDNN stays inside the .cc files that use it.

Usage: check-layering.py [ROOT]   (default: the repository of this script)
"""
import os
import re
import sys

FOLDERS = ("core", "engine", "proto", "server", "client", "fuzz", "tests",
           "benchmarks")
# What each folder's files may include of the project's folders.
ALLOWED = {
    "core": {"core"},
    "engine": {"core", "engine"},
}
WIRE = re.compile(r'^(grpcpp/|grpc/|google/protobuf/)|\.pb\.h$')
ONEDNN = re.compile(r'^(dnnl|oneapi/dnnl/)|^core/primitives\.h$')
ONEDNN_HEADER = "core/primitives.h"
INCLUDE = re.compile(r'^\s*#\s*include\s+[<"]([^>"]+)[>"]')


def sources(root):
    for folder in FOLDERS:
        for base, _, files in os.walk(os.path.join(root, folder)):
            for name in files:
                if name.endswith((".h", ".cc")):
                    path = os.path.relpath(os.path.join(base, name), root)
                    yield path.replace(os.sep, "/")


def module_of(path):
    return re.sub(r"_(internal|hwy)$", "", os.path.splitext(path)[0])


def includes(root, path):
    with open(os.path.join(root, path), encoding="utf-8") as f:
        for line in f:
            m = INCLUDE.match(line)
            if m:
                yield m.group(1)


def find_cycle(graph):
    """A cycle of modules as a list (first == last), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {node: WHITE for node in graph}
    stack = []

    def visit(node):
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if color.get(nxt, BLACK) == GREY:
                return stack[stack.index(nxt):] + [nxt]
            if color.get(nxt) == WHITE:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = BLACK
        return None

    for node in sorted(graph):
        if color[node] == WHITE:
            found = visit(node)
            if found:
                return found
    return None


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))
    files = sorted(sources(root))
    modules = {module_of(p) for p in files}
    graph = {m: set() for m in modules}
    errors = []
    for path in files:
        folder = path.split("/")[0]
        for included in includes(root, path):
            target = module_of(included)
            if (path.endswith(".h") and path != ONEDNN_HEADER and
                    ONEDNN.search(included)):
                errors.append(f"{path}: includes {included}; only .cc files "
                              f"may bring in oneDNN")
            if folder in ALLOWED:
                if WIRE.search(included):
                    errors.append(f"{path}: includes {included}, a wire "
                                  f"format header ({folder}/ knows none)")
                top = included.split("/")[0]
                if top in FOLDERS and top not in ALLOWED[folder]:
                    errors.append(f"{path}: includes {included} ({folder}/ "
                                  f"may include only "
                                  f"{', '.join(sorted(ALLOWED[folder]))})")
            if target in modules and target != module_of(path):
                graph[module_of(path)].add(target)
    cycle = find_cycle(graph)
    if cycle:
        errors.append("modules include each other in a cycle: " +
                      " -> ".join(cycle))
    for error in errors:
        print(error)
    if not errors:
        print(f"layering: {len(files)} files, {len(modules)} modules, "
              f"no cycle")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
