#include "engine/scheduler.h"

#include <algorithm>
#include <utility>

namespace attnserve {
namespace {

// The scheduler whose worker this thread is, while it runs a call.
thread_local Scheduler* running_on = nullptr;

// Workers beyond max_inflight, for the calls that run while others wait
// outside their slots.
int SpareWorkers(int max_inflight) { return std::max(max_inflight, 4); }

}  // namespace

Scheduler::Scheduler(int max_inflight, int max_queue)
    : max_inflight_(max_inflight), max_queue_(max_queue) {
  const int workers = max_inflight + SpareWorkers(max_inflight);
  workers_.reserve(workers);
  for (int i = 0; i < workers; ++i) {
    workers_.emplace_back([this] { WorkerLoop(); });
  }
}

void Scheduler::WaitOutsideSlot(absl::FunctionRef<void()> wait) {
  Scheduler* const scheduler = running_on;
  if (scheduler == nullptr) {
    wait();
    return;
  }
  {
    MutexLock lock(&scheduler->mu_);
    --scheduler->inflight_;
    ++scheduler->outside_;
    scheduler->HandOverSlot();
  }
  wait();
  MutexLock lock(&scheduler->mu_);
  ++scheduler->returning_;
  while (scheduler->inflight_ >= scheduler->max_inflight_) {
    scheduler->slot_free_.Wait(&scheduler->mu_);
  }
  --scheduler->returning_;
  --scheduler->outside_;
  ++scheduler->inflight_;
}

void Scheduler::HandOverSlot() {
  if (returning_ > 0) {
    slot_free_.Signal();
    return;
  }
  // Only a queued call needs a worker woken: waking one for nothing costs
  // two context switches per call.
  if (!queue_.empty()) WakeIdleWorker();
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
    // Room for max_inflight computing and max_queue waiting, no more
    // (calls waiting outside their slots are not computing).
    if (inflight_ + returning_ + static_cast<int>(queue_.size()) >=
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
    if (!queue_.empty() || inflight_ + returning_ >= max_inflight_) {
      return false;
    }
    ++inflight_;
  }
  work();
  ReleaseSlot();
  return true;
}

void Scheduler::ReleaseSlot() {
  MutexLock lock(&mu_);
  --inflight_;
  HandOverSlot();
}

int Scheduler::inflight() const {
  MutexLock lock(&mu_);
  return inflight_;
}

int Scheduler::queued() const {
  MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

int Scheduler::waiting() const {
  MutexLock lock(&mu_);
  return outside_;
}

void Scheduler::WorkerLoop() {
  IdleWorker self;
  while (true) {
    std::function<void()> work;
    {
      MutexLock lock(&mu_);
      // Calls run here (RunHereIfIdle) count against max_inflight too, and
      // calls taking their slots back go first; when stopping, what is
      // queued still runs within the slots.
      while (queue_.empty() ? !stopping_
                            : inflight_ + returning_ >= max_inflight_) {
        self.woken = false;
        idle_.push_back(&self);
        while (!self.woken) self.wake.Wait(&mu_);
      }
      if (queue_.empty()) return;  // stopping, nothing left to run
      work = std::move(queue_.front());
      queue_.pop_front();
      ++inflight_;
      // Workers that waited for a slot while stopping have nothing left.
      if (stopping_ && queue_.empty()) {
        while (!idle_.empty()) WakeIdleWorker();
      }
    }
    running_on = this;
    work();
    running_on = nullptr;
    ReleaseSlot();
  }
}

}  // namespace attnserve
