// Shares the machine's cores among the requests that compute at once, so
// that concurrent requests do not oversubscribe them.
//
// Policy: a request that starts while n - 1 others are computing gets
// max(1, total / n) OpenMP threads for its whole computation, set on its
// handling thread (OpenMP's thread count is a per-thread setting, and the
// core's primitives are cached per thread count). Alone, a request uses
// every core; under load each gets an equal share, and the sum stays near
// the total: requests that started under lighter load keep their larger
// share until they finish, which is brief because they started earlier.
//
// Thread-safety: all methods may be called concurrently.
#ifndef ATTNSERVE_CORE_THREAD_BUDGET_H_
#define ATTNSERVE_CORE_THREAD_BUDGET_H_

#include <atomic>
#include <string>

#include "absl/strings/string_view.h"

namespace attnserve {

// The cores this process may use: its CPU affinity, capped by its cgroup's
// CPU quota (CgroupCpuLimit of /sys/fs/cgroup and /proc/self/cgroup) and by
// OMP_NUM_THREADS when either is set.
int AvailableCores();

// The CPU quota of a process's cgroup in whole cores (quota / period rounded
// up, at least 1), or 0 when there is none or it cannot be read.
// `cgroup_root` is where the cgroup file systems are mounted
// (/sys/fs/cgroup) and `proc_self_cgroup` the text of the process's
// /proc/self/cgroup. Reads cgroup v2's cpu.max ("max" or "<quota> <period>")
// and, when that sets no limit, cgroup v1's cpu.cfs_quota_us (-1: none) and
// cpu.cfs_period_us under the cpu controller's mount (cpu, cpu,cpuacct or
// cpuacct,cpu), in the process's cgroup and each ancestor up to the mount
// root (inside a container, the container's own cgroup), since a parent's
// limit holds for its children; the tightest wins. Separate from
// AvailableCores so that tests can feed it a directory tree.
int CgroupCpuLimit(const std::string& cgroup_root,
                   absl::string_view proc_self_cgroup);

class ThreadBudget {
 public:
  // `total_threads` <= 0 means AvailableCores().
  explicit ThreadBudget(int total_threads);

  // The budget the server uses; SetTotal changes its size (at start-up).
  static ThreadBudget& Global();
  void SetTotal(int total_threads);

  // A computing request's share: sets the calling thread's OpenMP thread
  // count while it lives. Move-only.
  class Lease {
   public:
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&&) = delete;
    ~Lease();
    int threads() const { return threads_; }

   private:
    friend class ThreadBudget;
    Lease(ThreadBudget* budget, int threads, int previous);
    ThreadBudget* budget_;
    int threads_;
    int previous_;  // the thread's OpenMP setting before, restored after
  };

  // `max_threads` > 0 caps the share: small computations run faster on
  // fewer threads than they lose to starting and joining more.
  Lease Acquire(int max_threads = 0);

  int total() const { return total_.load(); }
  // Requests computing now.
  int active() const { return active_.load(); }

 private:
  std::atomic<int> total_;
  std::atomic<int> active_{0};
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_THREAD_BUDGET_H_
