// Admission control: at most `max_inflight` calls compute at once, on
// worker threads (that many, and spares); at most `max_queue` more wait for
// a worker; beyond
// that Submit refuses at once, so the server never builds an unbounded
// queue or stalls.
//
// A call that must wait for something other than compute (another
// replica's hand-over of a session, up to seconds) steps out of its slot
// for the wait (WaitOutsideSlot): a spare worker runs the next queued call
// meanwhile, and the call takes a slot again, before any queued call,
// when its wait ends. So at most max_inflight calls compute at once, and
// a slow replica holds no compute slot.
//
// A call goes to the worker that went idle last: a stream of calls stays on
// one worker, whose OpenMP team (each thread that starts parallel regions
// has its own) and caches are still warm, instead of waking a team that
// has gone to sleep (measured: a decode step computed in 0.47 ms on the
// warm team, 0.6 ms round robin over two).
//
// Thread-safety: Submit and the counters may be called from any thread.
// Ownership: the scheduler owns its workers; destruction runs what is queued,
// then joins them.
#ifndef ATTNSERVE_ENGINE_SCHEDULER_H_
#define ATTNSERVE_ENGINE_SCHEDULER_H_

#include <algorithm>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "core/mutex.h"

namespace attnserve {

// Threads a computation of `flops` keeps busy: each should get at least
// ~2 MFLOP (tens of microseconds), or starting and joining it costs more
// than it computes.
inline int UsefulThreads(double flops) {
  return static_cast<int>(std::clamp(flops / 2e6, 1.0, 1024.0));
}

class Scheduler {
 public:
  Scheduler(int max_inflight, int max_queue);
  ~Scheduler();

  // Runs `work` on a worker as soon as one is free; false, without running
  // it, when `max_queue` calls already wait.
  bool Submit(std::function<void()> work) ABSL_LOCKS_EXCLUDED(mu_);
  // Runs `work` on the calling thread, counted as in flight, when a worker
  // would be free for it at once (fewer than max_inflight computing and
  // nothing queued); false, without running it, otherwise. For calls so
  // small that handing them to a worker would cost more than they do.
  bool RunHereIfIdle(absl::FunctionRef<void()> work) ABSL_LOCKS_EXCLUDED(mu_);

  // Runs `wait` outside the calling worker's slot (see above); on any
  // other thread (not a worker of a scheduler, or a call run here), just
  // runs it.
  static void WaitOutsideSlot(absl::FunctionRef<void()> wait);

  int inflight() const ABSL_LOCKS_EXCLUDED(mu_);
  int queued() const ABSL_LOCKS_EXCLUDED(mu_);
  // Calls waiting outside their slots, or for a slot again.
  int waiting() const ABSL_LOCKS_EXCLUDED(mu_);
  int max_inflight() const { return max_inflight_; }
  int max_queue() const { return max_queue_; }

 private:
  // An idle worker's wake-up: set and signalled by WakeIdleWorker.
  struct IdleWorker {
    CondVar wake;
    bool woken = false;
  };

  void WorkerLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // Ends a call's hold on an in-flight slot and wakes a worker if calls
  // are queued.
  void ReleaseSlot() ABSL_LOCKS_EXCLUDED(mu_);
  // Wakes the worker that went idle last, if any is idle.
  void WakeIdleWorker() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A slot freed: to a call waiting to take one again first, else to a
  // queued call.
  void HandOverSlot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int max_inflight_;
  const int max_queue_;
  mutable Mutex mu_;
  // Idle workers, the most recently idle last.
  std::vector<IdleWorker*> idle_ ABSL_GUARDED_BY(mu_);
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  int inflight_ ABSL_GUARDED_BY(mu_) = 0;
  // Calls out of their slots (WaitOutsideSlot), and those of them waiting
  // for a slot again, whom slot_free_ wakes.
  int outside_ ABSL_GUARDED_BY(mu_) = 0;
  int returning_ ABSL_GUARDED_BY(mu_) = 0;
  CondVar slot_free_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_SCHEDULER_H_
