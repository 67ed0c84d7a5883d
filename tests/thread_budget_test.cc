// The thread budget's shares and the OpenMP setting it applies.
#include "core/thread_budget.h"

#include <omp.h>

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

}  // namespace
}  // namespace attnserve
