#!/usr/bin/env bash
# Generates the Python messages and gRPC stubs of proto/attnserve/v1 into
# clients/python/attnserve/v1 (attention_pb2.py, attention_pb2_grpc.py), and
# those of the Open Inference Protocol (proto/inference/grpc_service.proto)
# into clients/python/inference (grpc_service_pb2.py,
# grpc_service_pb2_grpc.py), where they are committed so that the clients
# need no build step.
#
#   clients/python/generate_stubs.sh          # regenerate after a proto change
#   clients/python/generate_stubs.sh --check  # fail if the committed files differ
#
# Uses Debian bookworm's protoc (protobuf-compiler, 3.21) and
# grpc_python_plugin (protobuf-compiler-grpc, 1.51), the versions of
# python3-protobuf and python3-grpcio; PROTOC and GRPC_PYTHON_PLUGIN override
# them. --check (ctest PythonStubsCurrent) regenerates into a temporary
# folder and compares byte for byte.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
protoc=${PROTOC:-$(command -v protoc || true)}
plugin=${GRPC_PYTHON_PLUGIN:-$(command -v grpc_python_plugin || true)}
[[ -x $protoc ]] || { echo "generate_stubs: protoc not found (apt-get install protobuf-compiler)" >&2; exit 1; }
[[ -x $plugin ]] || { echo "generate_stubs: grpc_python_plugin not found (apt-get install protobuf-compiler-grpc)" >&2; exit 1; }

protos=(attnserve/v1/attention.proto inference/model_config.proto
  inference/grpc_service.proto)
generated=(attnserve/v1/attention_pb2.py attnserve/v1/attention_pb2_grpc.py
  inference/model_config_pb2.py inference/model_config_pb2_grpc.py
  inference/grpc_service_pb2.py inference/grpc_service_pb2_grpc.py)

generate() {
  "$protoc" --proto_path="$root/proto" --python_out="$1" --grpc_out="$1" \
    --plugin=protoc-gen-grpc="$plugin" "${protos[@]}"
}

case ${1:-} in
  "")
    generate "$here"
    echo "generate_stubs: wrote $here/attnserve/v1 and $here/inference" \
      "($("$protoc" --version))"
    ;;
  --check)
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    generate "$tmp"
    status=0
    for file in "${generated[@]}"; do
      if ! diff -u "$here/$file" "$tmp/$file"; then
        status=1
      fi
    done
    if ((status)); then
      echo "generate_stubs: the stubs in clients/python differ from proto/ as" \
        "$("$protoc" --version) generates it: run clients/python/generate_stubs.sh" \
        "and commit the result" >&2
      exit 1
    fi
    echo "generate_stubs: clients/python/attnserve/v1 and inference match" \
      "proto/ ($("$protoc" --version))"
    ;;
  *)
    echo "usage: $0 [--check]" >&2
    exit 2
    ;;
esac
