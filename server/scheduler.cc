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
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

bool Scheduler::Submit(std::function<void()> work) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Room for max_inflight computing and max_queue waiting, no more.
    if (inflight_ + static_cast<int>(queue_.size()) >=
        max_inflight_ + max_queue_) {
      return false;
    }
    queue_.push_back(std::move(work));
  }
  work_ready_.notify_one();
  return true;
}

bool Scheduler::RunHereIfIdle(absl::FunctionRef<void()> work) {
  {
    std::lock_guard<std::mutex> lock(mu_);
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
    std::lock_guard<std::mutex> lock(mu_);
    --inflight_;
    waiting = !queue_.empty();
  }
  // Only a queued call needs a worker woken: waking one for nothing costs
  // two context switches per call.
  if (waiting) work_ready_.notify_one();
}

int Scheduler::inflight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return inflight_;
}

int Scheduler::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(queue_.size());
}

void Scheduler::WorkerLoop() {
  while (true) {
    std::function<void()> work;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Calls run here (RunHereIfIdle) count against max_inflight too.
      work_ready_.wait(lock, [this] {
        return stopping_ || (!queue_.empty() && inflight_ < max_inflight_);
      });
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
