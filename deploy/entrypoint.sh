#!/bin/sh
# Entry point of the attnserve image: runs attnserve with the given flags.
#
# attnserve --threads=0 sizes itself from its CPU affinity, its cgroup's CPU
# quota (cgroup v2 cpu.max, or v1 cpu.cfs_quota_us) and OMP_NUM_THREADS, so
# `--cpus=N` gives N compute threads on either cgroup version. An explicit
# --threads wins; OMP_NUM_THREADS can only lower the count.
set -eu

exec /usr/local/bin/attnserve "$@"
