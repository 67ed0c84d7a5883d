#include "core/thread_budget.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/files.h"

namespace attnserve {

namespace {

// ceil(quota / period), at least 1; 0 when `quota` sets no limit.
int64_t CoresOf(int64_t quota, int64_t period) {
  if (quota <= 0 || period <= 0) return 0;
  return std::max<int64_t>(1, quota / period + (quota % period != 0));
}

// The number in a file such as cpu.cfs_quota_us, if it holds one.
std::optional<int64_t> ReadNumber(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path, path);
  int64_t value = 0;
  if (!text.ok() ||
      !absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &value)) {
    return std::nullopt;
  }
  return value;
}

// cgroup v2: cpu.max is "max <period>" or "<quota> <period>".
int64_t CgroupV2Cores(const std::string& dir) {
  absl::StatusOr<std::string> text =
      ReadFileToString(dir + "/cpu.max", "cpu.max");
  if (!text.ok()) return 0;
  const std::vector<absl::string_view> fields =
      absl::StrSplit(absl::StripAsciiWhitespace(*text), ' ', absl::SkipEmpty());
  int64_t quota = 0, period = 0;
  if (fields.size() != 2 || !absl::SimpleAtoi(fields[0], &quota) ||
      !absl::SimpleAtoi(fields[1], &period)) {
    return 0;  // "max": no limit
  }
  return CoresOf(quota, period);
}

// cgroup v1: cpu.cfs_quota_us is -1 when there is no limit.
int64_t CgroupV1Cores(const std::string& dir) {
  const std::optional<int64_t> quota = ReadNumber(dir + "/cpu.cfs_quota_us");
  const std::optional<int64_t> period = ReadNumber(dir + "/cpu.cfs_period_us");
  return quota && period ? CoresOf(*quota, *period) : 0;
}

// `mount` + `path` ("/a/b"), then each ancestor up to `mount` itself.
std::vector<std::string> SelfAndAncestors(const std::string& mount,
                                          absl::string_view path) {
  absl::string_view rest = absl::StripAsciiWhitespace(path);
  while (absl::ConsumeSuffix(&rest, "/")) {
  }
  std::vector<std::string> dirs;
  while (true) {
    dirs.push_back(absl::StrCat(
        mount, rest.empty() || rest.front() == '/' ? "" : "/", rest));
    if (rest.empty()) return dirs;
    const size_t slash = rest.rfind('/');
    rest = slash == absl::string_view::npos ? absl::string_view()
                                            : rest.substr(0, slash);
  }
}

}  // namespace

int CgroupCpuLimit(const std::string& cgroup_root,
                   absl::string_view proc_self_cgroup) {
  // Lines of /proc/self/cgroup: "0::<path>" (v2), "<id>:<controllers>:<path>"
  // (v1). Without them, the mount roots are the process's cgroups.
  std::string v2_path = "/";
  std::string v1_path = "/";
  std::string v1_controllers = "cpu";
  for (absl::string_view line :
       absl::StrSplit(proc_self_cgroup, '\n', absl::SkipEmpty())) {
    const std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (fields.size() != 3) continue;
    if (fields[0] == "0" && fields[1].empty()) {
      v2_path = std::string(fields[2]);
      continue;
    }
    for (absl::string_view controller : absl::StrSplit(fields[1], ',')) {
      if (controller == "cpu") {
        v1_path = std::string(fields[2]);
        v1_controllers = std::string(fields[1]);
      }
    }
  }
  int64_t cores = 0;
  const auto tighten = [&cores](int64_t limit) {
    if (limit > 0 && (cores == 0 || limit < cores)) cores = limit;
  };
  for (const std::string& dir : SelfAndAncestors(cgroup_root, v2_path)) {
    tighten(CgroupV2Cores(dir));
  }
  if (cores == 0) {
    // The cpu controller's mount is named after the controllers mounted
    // with it; distributions also link the other spellings to it.
    std::vector<std::string> mounts = {v1_controllers, "cpu", "cpu,cpuacct",
                                       "cpuacct,cpu"};
    for (size_t i = 0; i < mounts.size(); ++i) {
      if (std::find(mounts.begin(), mounts.begin() + i, mounts[i]) !=
          mounts.begin() + i) {
        continue;
      }
      for (const std::string& dir :
           SelfAndAncestors(cgroup_root + "/" + mounts[i], v1_path)) {
        tighten(CgroupV1Cores(dir));
      }
    }
  }
  return static_cast<int>(
      std::min<int64_t>(cores, std::numeric_limits<int>::max()));
}

int AvailableCores() {
  int cores = 1;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    cores = std::max(1, CPU_COUNT(&set));
  }
  // An explicit OMP_NUM_THREADS caps the budget too.
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    const int requested = std::atoi(env);
    if (requested > 0) cores = std::min(cores, requested);
  }
  absl::StatusOr<std::string> own_cgroups =
      ReadFileToString("/proc/self/cgroup", "/proc/self/cgroup");
  const int limit = CgroupCpuLimit(
      "/sys/fs/cgroup", own_cgroups.ok() ? *own_cgroups : std::string());
  if (limit > 0) cores = std::min(cores, limit);
  return cores;
}

ThreadBudget::ThreadBudget(int total_threads)
    : total_(total_threads > 0 ? total_threads : AvailableCores()) {}

ThreadBudget& ThreadBudget::Global() {
  static ThreadBudget* budget = new ThreadBudget(0);
  return *budget;
}

void ThreadBudget::SetTotal(int total_threads) {
  total_.store(total_threads > 0 ? total_threads : AvailableCores());
}

ThreadBudget::Lease ThreadBudget::Acquire(int max_threads) {
  const int active = active_.fetch_add(1) + 1;
  int threads = std::max(1, total_.load() / active);
  if (max_threads > 0) threads = std::min(threads, max_threads);
  const int previous = omp_get_max_threads();
  omp_set_num_threads(threads);
  return Lease(this, threads, previous);
}

ThreadBudget::Lease::Lease(ThreadBudget* budget, int threads, int previous)
    : budget_(budget), threads_(threads), previous_(previous) {}

ThreadBudget::Lease::Lease(Lease&& other) noexcept
    : budget_(other.budget_),
      threads_(other.threads_),
      previous_(other.previous_) {
  other.budget_ = nullptr;
}

ThreadBudget::Lease::~Lease() {
  if (budget_ == nullptr) return;
  budget_->active_.fetch_sub(1);
  omp_set_num_threads(previous_);
}

}  // namespace attnserve
