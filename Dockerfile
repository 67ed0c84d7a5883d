# attnserve container image.
#   docker build -t attnserve .
#   docker run --rm --cpus=2 -p 50051:50051 -p 9090:9090 -p 8000:8000 attnserve
# (podman: `podman build --format docker` keeps the HEALTHCHECK; see
# deploy/README.md and deploy/container-test.sh.)
#
# Build stage: the -dev packages and the compiler (ocl-icd-opencl-dev because
# Debian's oneDNN CMake package requires OpenCL).
FROM debian:bookworm-slim AS build
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      build-essential cmake pkg-config \
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
      libabsl-dev libdnnl-dev libhwy-dev ocl-icd-opencl-dev nlohmann-json3-dev \
      libcpp-httplib-dev libssl-dev zlib1g-dev libbrotli-dev libgoogle-perftools-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY CMakeLists.txt ./
COPY proto proto
COPY core core
COPY server server
COPY client client
RUN cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DATTNSERVE_BUILD_TESTS=OFF -DATTNSERVE_BUILD_BENCHMARKS=OFF \
 && cmake --build build -j"$(nproc)" \
 && strip build/bin/attnserve build/bin/attnctl

# Runtime stage: shared libraries only, no compiler, no headers.
FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc++1.51 libgrpc29 libprotobuf32 libabsl20220623 libdnnl2 libhwy1 libgomp1 \
      libcpp-httplib0.11 libtcmalloc-minimal4 \
 && rm -rf /var/lib/apt/lists/* /var/cache/debconf/*-old /var/log/* \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin attnserve
COPY --from=build /src/build/bin/attnserve /src/build/bin/attnctl /usr/local/bin/
COPY --from=build /src/build/models /models
COPY deploy/entrypoint.sh /usr/local/bin/attnserve-entrypoint
USER 10001:10001
EXPOSE 50051 9090 8000
# Compute threads: with the default --threads=0 the server counts the cores
# it may use (CPU affinity, OMP_NUM_THREADS, and its cgroup's CPU quota:
# cgroup v2 cpu.max or v1 cpu.cfs_quota_us), so `--cpus=N` sizes it on
# either cgroup version; the entry point only execs it.
# The health check asks the standard gRPC health service on the default
# port; a container started with another --port needs its own
# --health-cmd.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["/usr/local/bin/attnctl", "health", "--target=127.0.0.1:50051", "--timeout_s=3"]
# The demo model stays loaded when `docker run IMAGE --flags` replaces CMD;
# a later --model_repository overrides this one.
ENTRYPOINT ["/usr/local/bin/attnserve-entrypoint", "--model_repository=/models"]
CMD ["--host=0.0.0.0", "--port=50051"]
