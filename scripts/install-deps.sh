#!/usr/bin/env bash
# Installs the Debian bookworm packages that attnserve builds and tests with.
# Safe to run again: apt-get skips what is already installed. The Python
# packages serve the Python client's tests (PyTorch is their reference), its
# pip install into a venv (README) and the manifest checks of deploy/;
# prometheus brings promtool for the checks of deploy/prometheus. clang
# (with its OpenMP runtime, which CMake's FindOpenMP needs to configure a
# clang build), lld and clang's runtime libraries (libFuzzer, the
# sanitizers) build the sanitizer tree, with its lock-annotation checks, and
# the fuzz targets; ninja and ccache serve every build; bc prints
# scripts/test.sh's stage minutes. The Go packages
# build the Go client (clients/go) offline: the compiler, gRPC and protobuf
# sources for GOPATH mode, and the protoc plugins (protoc-gen-go 1.28:
# golang-goprotobuf-dev's 1.3 plugin, which conflicts with it, refuses the
# proto's optional fields).
set -euo pipefail

# libdnnl-dev's CMake package looks for OpenCL (Debian builds oneDNN with its
# OpenCL GPU runtime), so the OpenCL loader's dev files are needed too.
packages=(
  build-essential cmake pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libdnnl-dev libhwy-dev ocl-icd-opencl-dev nlohmann-json3-dev
  libcpp-httplib-dev libssl-dev zlib1g-dev libbrotli-dev openssl
  libgtest-dev libgmock-dev googletest libbenchmark-dev libgoogle-perftools-dev
  clang libomp-dev ninja-build libclang-rt-14-dev lld ccache bc
  python3-grpcio python3-protobuf python3-yaml python3-torch python3-numpy
  python3-venv python3-setuptools
  golang-go golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev
  golang-google-protobuf-dev protoc-gen-go protoc-gen-go-grpc
  prometheus
)

sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
# prometheus brings promtool (the checks of deploy/prometheus) and a server
# whose service would listen on :9090, attnserve's default metrics port: on
# a machine where it is not installed yet, the service is masked first, so
# that systemd neither starts nor enables it.
if ! dpkg-query -W -f='${Status}' prometheus 2>/dev/null | grep -q 'ok installed'; then
  $sudo mkdir -p /etc/systemd/system
  $sudo ln -sf /dev/null /etc/systemd/system/prometheus.service
fi
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
# The Node client's tests need node and npm; machines that already have a
# Node.js distribution (with its own npm) keep it.
if ! command -v npm >/dev/null; then
  $sudo apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
echo "install-deps: ${#packages[@]} packages present, node $(node --version)"
