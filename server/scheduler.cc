#include "server/scheduler.h"

#include <utility>

namespace attnserve {

Scheduler::Scheduler(int max_inflight, int max_queue)
    : max_inflight_(max_inflight), max_queue_(max_queue) {
  workers_.reserve(max_inflight);
  for (int i = 0; i < max_inflight; ++i) {
    workers_.emplace_back([this] { WorkerLoop(); });
  }
}

Scheduler::~Scheduler() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  work_ready_.SignalAll();
  for (std::thread& worker : workers_) worker.join();
}

bool Scheduler::Submit(std::function<void()> work) {
  {
    MutexLock lock(&mu_);
    // Room for max_inflight computing and max_queue waiting, no more.
    if (inflight_ + static_cast<int>(queue_.size()) >=
        max_inflight_ + max_queue_) {
      return false;
    }
    queue_.push_back(std::move(work));
  }
  work_ready_.Signal();
  return true;
}

bool Scheduler::RunHereIfIdle(absl::FunctionRef<void()> work) {
  {
    MutexLock lock(&mu_);
    if (!queue_.empty() || inflight_ >= max_inflight_) return false;
    ++inflight_;
  }
  work();
  ReleaseSlot();
  return true;
}

void Scheduler::ReleaseSlot() {
  bool waiting;
  {
    MutexLock lock(&mu_);
    --inflight_;
    waiting = !queue_.empty();
  }
  // Only a queued call needs a worker woken: waking one for nothing costs
  // two context switches per call.
  if (waiting) work_ready_.Signal();
}

int Scheduler::inflight() const {
  MutexLock lock(&mu_);
  return inflight_;
}

int Scheduler::queued() const {
  MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

void Scheduler::WorkerLoop() {
  while (true) {
    std::function<void()> work;
    {
      MutexLock lock(&mu_);
      // Calls run here (RunHereIfIdle) count against max_inflight too.
      while (!stopping_ && (queue_.empty() || inflight_ >= max_inflight_)) {
        work_ready_.Wait(&mu_);
      }
      if (queue_.empty()) return;  // stopping, nothing left to run
      work = std::move(queue_.front());
      queue_.pop_front();
      ++inflight_;
    }
    work();
    ReleaseSlot();
  }
}

}  // namespace attnserve
