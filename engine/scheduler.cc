#include "engine/scheduler.h"

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
    while (!idle_.empty()) WakeIdleWorker();
  }
  for (std::thread& worker : workers_) worker.join();
}

void Scheduler::WakeIdleWorker() {
  if (idle_.empty()) return;
  IdleWorker* worker = idle_.back();
  idle_.pop_back();
  worker->woken = true;
  worker->wake.Signal();
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
    WakeIdleWorker();
  }
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
  MutexLock lock(&mu_);
  --inflight_;
  // Only a queued call needs a worker woken: waking one for nothing costs
  // two context switches per call.
  if (!queue_.empty()) WakeIdleWorker();
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
  IdleWorker self;
  while (true) {
    std::function<void()> work;
    {
      MutexLock lock(&mu_);
      // Calls run here (RunHereIfIdle) count against max_inflight too.
      while (!stopping_ && (queue_.empty() || inflight_ >= max_inflight_)) {
        self.woken = false;
        idle_.push_back(&self);
        while (!self.woken) self.wake.Wait(&mu_);
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
