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
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& worker : workers_) worker.join();
}

bool Scheduler::Submit(std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  // Room for max_inflight computing and max_queue waiting, no more.
  if (inflight_ + static_cast<int>(queue_.size()) >=
      max_inflight_ + max_queue_) {
    return false;
  }
  queue_.push_back(std::move(work));
  return true;
}

int Scheduler::inflight() const {
  absl::MutexLock lock(&mu_);
  return inflight_;
}

int Scheduler::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

void Scheduler::WorkerLoop() {
  while (true) {
    std::function<void()> work;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Scheduler* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
            return s->stopping_ || !s->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping, nothing left to run
      work = std::move(queue_.front());
      queue_.pop_front();
      ++inflight_;
    }
    work();
    absl::MutexLock lock(&mu_);
    --inflight_;
  }
}

}  // namespace attnserve
