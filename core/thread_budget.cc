#include "core/thread_budget.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>

namespace attnserve {

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
  // cgroup v2: "max 100000" or "<quota> <period>".
  std::ifstream cpu_max("/sys/fs/cgroup/cpu.max");
  std::string quota;
  long long period = 0;
  if (cpu_max >> quota >> period && quota != "max" && period > 0) {
    const long long q = std::stoll(quota);
    cores = std::min<long long>(
        cores, std::max<long long>(1, (q + period - 1) / period));
  }
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
