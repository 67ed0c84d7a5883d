#!/usr/bin/env bash
# Builds the Go client offline from Debian's Go packages: generates the
# attnserve.v1 messages and stubs from proto/ with protoc-gen-go and
# protoc-gen-go-grpc, then builds the example (and with `test`, runs the
# tests against ATTNSERVE_BIN).
#
# Usage: clients/go/build.sh [test [go test flags...]]
# Environment:
#   ATTNSERVE_GO_BUILD  output folder (default: build/go in this checkout):
#                       gopath/ (sources), cache/ (GOCACHE), bin/
#   ATTNSERVE_BIN       the server the tests start (default: build/bin/attnserve)
#   PROTOC, GO, PROTOC_GEN_GO, PROTOC_GEN_GO_GRPC
#                       the tools (default: protoc, go and the plugins on the
#                       PATH)
#
# Debian ships Go libraries as sources under /usr/share/gocode/src for GOPATH
# mode, without a module cache: GOPATH is the output folder followed by
# /usr/share/gocode, modules are off, and nothing is downloaded.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${ATTNSERVE_GO_BUILD:-$root/build/go}
mkdir -p "$out"
out=$(cd "$out" && pwd)
protoc=${PROTOC:-protoc}
go=${GO:-go}

export GO111MODULE=off GOPROXY=off GOFLAGS=-trimpath
export GOPATH="$out/gopath:/usr/share/gocode"
export GOCACHE=${GOCACHE:-$out/cache}

# The import paths mirror the repository: attnserve/clients/go/attnserve is
# clients/go/attnserve (linked), attnservepb is generated from the proto,
# whose package mapping is given here so that the proto file needs no
# go_package option.
import_root=attnserve/clients/go
src="$out/gopath/src/$import_root"
rm -rf "$src"
mkdir -p "$src"
ln -s "$here/attnserve" "$src/attnserve"
ln -s "$here/example" "$src/example"
mapping="Mattnserve/v1/attention.proto=$import_root/attnservepb"
plugins=()
if [[ -n ${PROTOC_GEN_GO:-} ]]; then
  plugins+=("--plugin=protoc-gen-go=$PROTOC_GEN_GO")
fi
if [[ -n ${PROTOC_GEN_GO_GRPC:-} ]]; then
  plugins+=("--plugin=protoc-gen-go-grpc=$PROTOC_GEN_GO_GRPC")
fi
"$protoc" "${plugins[@]}" -I"$root/proto" \
  --go_out="$out/gopath/src" --go_opt="$mapping" \
  --go-grpc_out="$out/gopath/src" --go-grpc_opt="$mapping" \
  "$root/proto/attnserve/v1/attention.proto"

packages=("$import_root/attnservepb" "$import_root/attnserve" "$import_root/example")
"$go" vet "${packages[@]}"
"$go" build -o "$out/bin/attnserve-go-example" "$import_root/example"

if [[ ${1:-} == test ]]; then
  shift
  export ATTNSERVE_BIN=${ATTNSERVE_BIN:-$root/build/bin/attnserve}
  "$go" test -count=1 "$@" "$import_root/attnserve"
fi
