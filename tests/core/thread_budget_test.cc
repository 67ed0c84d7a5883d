// The thread budget's shares and the OpenMP setting it applies, and the
// cgroup CPU quota that sizes it.
#include "core/thread_budget.h"

#include <omp.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(ThreadBudgetTest, ConcurrentRequestsShareTheTotal) {
  ThreadBudget budget(4);
  const int before = omp_get_max_threads();
  {
    ThreadBudget::Lease first = budget.Acquire();
    EXPECT_EQ(first.threads(), 4);
    EXPECT_EQ(omp_get_max_threads(), 4);
    int second_threads = 0, third_threads = 0, seen_in_thread = 0;
    std::thread other([&] {
      ThreadBudget::Lease second = budget.Acquire();
      second_threads = second.threads();
      seen_in_thread = omp_get_max_threads();
      ThreadBudget::Lease third = budget.Acquire();
      third_threads = third.threads();
    });
    other.join();
    EXPECT_EQ(second_threads, 2);
    EXPECT_EQ(seen_in_thread, 2);
    EXPECT_EQ(third_threads, 1);
    EXPECT_EQ(budget.active(), 1);
    // The other thread's setting did not touch this one's.
    EXPECT_EQ(omp_get_max_threads(), 4);
  }
  EXPECT_EQ(budget.active(), 0);
  EXPECT_EQ(omp_get_max_threads(), before);
}

TEST(ThreadBudgetTest, NeverBelowOneThread) {
  ThreadBudget budget(2);
  ThreadBudget::Lease a = budget.Acquire();
  ThreadBudget::Lease b = budget.Acquire();
  ThreadBudget::Lease c = budget.Acquire();
  EXPECT_EQ(c.threads(), 1);
}

TEST(ThreadBudgetTest, DefaultsToAvailableCores) {
  EXPECT_GE(AvailableCores(), 1);
  EXPECT_EQ(ThreadBudget(0).total(), AvailableCores());
}

// A stand-in for /sys/fs/cgroup: a temporary folder that tests fill with
// the files a cgroup mount has.
class CgroupTree {
 public:
  CgroupTree()
      : root_(std::filesystem::temp_directory_path() /
              ("attnserve_cgroup_" + std::to_string(getpid()) + "_" +
               std::to_string(counter_++))) {
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
  }
  ~CgroupTree() { std::filesystem::remove_all(root_); }
  // Writes `text` to `path`, relative to the root.
  void Write(const std::string& path, const std::string& text) {
    const std::filesystem::path file = root_ / path;
    std::filesystem::create_directories(file.parent_path());
    std::ofstream(file) << text;
  }
  std::string root() const { return root_.string(); }

 private:
  static inline int counter_ = 0;
  std::filesystem::path root_;
};

TEST(CgroupCpuLimitTest, V2QuotaRoundsUp) {
  CgroupTree tree;
  tree.Write("cpu.max", "150000 100000\n");
  EXPECT_EQ(CgroupCpuLimit(tree.root(), "0::/\n"), 2);
  tree.Write("cpu.max", "20000 100000\n");
  EXPECT_EQ(CgroupCpuLimit(tree.root(), "0::/\n"), 1) << "at least one core";
}

TEST(CgroupCpuLimitTest, V2MaxIsNoLimit) {
  CgroupTree tree;
  tree.Write("cpu.max", "max 100000\n");
  EXPECT_EQ(CgroupCpuLimit(tree.root(), "0::/\n"), 0);
}

TEST(CgroupCpuLimitTest, V2NestedCgroupAndItsAncestors) {
  CgroupTree tree;
  const std::string own = "0::/kubepods.slice/pod1/container1\n";
  tree.Write("cpu.max", "max 100000\n");
  tree.Write("kubepods.slice/cpu.max", "max 100000\n");
  tree.Write("kubepods.slice/pod1/cpu.max", "300000 100000\n");
  tree.Write("kubepods.slice/pod1/container1/cpu.max", "max 100000\n");
  // The pod's limit holds for its container.
  EXPECT_EQ(CgroupCpuLimit(tree.root(), own), 3);
  tree.Write("kubepods.slice/pod1/container1/cpu.max", "100000 100000\n");
  EXPECT_EQ(CgroupCpuLimit(tree.root(), own), 1);
}

TEST(CgroupCpuLimitTest, V2PathMissingFallsBackToTheTopLevelFile) {
  // A container that sees the host's cgroup path but has its own cgroup
  // mounted as the root.
  CgroupTree tree;
  tree.Write("cpu.max", "200000 100000\n");
  EXPECT_EQ(CgroupCpuLimit(tree.root(), "0::/system.slice/docker-1.scope\n"),
            2);
}

TEST(CgroupCpuLimitTest, V1Quota) {
  CgroupTree tree;
  const std::string own =
      "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n"
      "3:cpuset:/docker/abc\n";
  // Inside the container the mount root is the container's cgroup.
  tree.Write("cpu,cpuacct/cpu.cfs_quota_us", "250000\n");
  tree.Write("cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(CgroupCpuLimit(tree.root(), own), 3);
}

TEST(CgroupCpuLimitTest, V1MinusOneIsNoLimit) {
  CgroupTree tree;
  tree.Write("cpu/cpu.cfs_quota_us", "-1\n");
  tree.Write("cpu/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(CgroupCpuLimit(tree.root(), "2:cpu:/\n1:cpuacct:/\n"), 0);
}

TEST(CgroupCpuLimitTest, V1NestedCgroup) {
  CgroupTree tree;
  tree.Write("cpu/cpu.cfs_quota_us", "-1\n");
  tree.Write("cpu/cpu.cfs_period_us", "100000\n");
  tree.Write("cpu/batch/job7/cpu.cfs_quota_us", "50000\n");
  tree.Write("cpu/batch/job7/cpu.cfs_period_us", "50000\n");
  EXPECT_EQ(CgroupCpuLimit(tree.root(), "2:cpu:/batch/job7\n1:cpuacct:/\n"), 1);
}

TEST(CgroupCpuLimitTest, V1BesideAnEmptyV2Hierarchy) {
  // Hybrid: a cgroup v2 line without a cpu.max file, the quota in v1.
  CgroupTree tree;
  tree.Write("cpu,cpuacct/cpu.cfs_quota_us", "400000\n");
  tree.Write("cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(CgroupCpuLimit(tree.root(), "2:cpu,cpuacct:/\n0::/user.slice\n"),
            4);
}

TEST(CgroupCpuLimitTest, MissingOrMalformedFilesAreNoLimit) {
  CgroupTree tree;
  EXPECT_EQ(CgroupCpuLimit(tree.root(), "0::/\n"), 0);
  EXPECT_EQ(CgroupCpuLimit(tree.root(), ""), 0);
  EXPECT_EQ(CgroupCpuLimit(tree.root() + "/absent", "2:cpu:/a\n0::/a\n"), 0);
  tree.Write("cpu.max", "lots\n");
  tree.Write("cpu/cpu.cfs_quota_us", "100000\n");  // no period
  EXPECT_EQ(CgroupCpuLimit(tree.root(), "2:cpu:/\n0::/\n"), 0);
}

}  // namespace
}  // namespace attnserve
