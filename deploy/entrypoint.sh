#!/bin/sh
# Entry point of the attnserve image: runs attnserve with the given flags.
#
# attnserve --threads=0 sizes itself from its CPU affinity, a cgroup v2
# cpu.max quota and OMP_NUM_THREADS. On hosts with cgroup v1 CPU controllers
# the container's quota is in cpu.cfs_quota_us instead; turn it into
# OMP_NUM_THREADS (rounded up, at least 1) so `--cpus=N` sizes the server the
# same way there. An OMP_NUM_THREADS already set, or an explicit --threads,
# wins.
set -eu

if [ -z "${OMP_NUM_THREADS:-}" ] && [ ! -r /sys/fs/cgroup/cpu.max ]; then
  for dir in /sys/fs/cgroup/cpu /sys/fs/cgroup/cpu,cpuacct /sys/fs/cgroup/cpuacct,cpu; do
    if [ -r "$dir/cpu.cfs_quota_us" ] && [ -r "$dir/cpu.cfs_period_us" ]; then
      quota=$(cat "$dir/cpu.cfs_quota_us")
      period=$(cat "$dir/cpu.cfs_period_us")
      if [ "$quota" -gt 0 ] && [ "$period" -gt 0 ]; then
        threads=$(( (quota + period - 1) / period ))
        OMP_NUM_THREADS=$threads
        export OMP_NUM_THREADS
      fi
      break
    fi
  done
fi

exec /usr/local/bin/attnserve "$@"
