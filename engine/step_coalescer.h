// Runs single-session decode steps that arrive together as one batched pass
// over their caches (SessionStore::StepMany), as one SessionSteps call would:
// concurrent clients each stepping their own session share the cores' memory
// bandwidth in one kernel pass instead of one pass each.
//
// How: the first step to arrive when no pass is queued or running leads: the
// coalescer queues its runner on a worker (through `submit`). Steps arriving
// meanwhile join the pending ones. The runner takes the pending steps (each
// session once, at most max_batch), runs them in one pass, answers each, and
// loops while steps are pending: one pass runs at a time, and the steps that
// arrive during a pass go together in the next. Before a pass the runner
// waits up to `wait` for more steps, and only when the pass before it was
// answered less than `wait` ago and held more steps than are pending now
// (their clients are about to send their next ones): a lone client never
// waits.
//
// Each step keeps its own status, deadline and cancellation (its Prepare
// checks them before the pass; the pass honours its cancelled flag) and its
// own record of the call (its Finish). Results are those of the steps run
// one at a time, bit for bit (StepMany's guarantee).
//
// Deadlines: a pass is estimated (through the cost model) to take at most
// `max_pass`, or one step's time, and to end before the earliest deadline
// in it; steps that do not fit wait for the next pass. A step that could not
// end before its deadline even alone is answered DEADLINE_EXCEEDED at once,
// as are steps whose deadline passed or whose client left while they
// waited: no answer waits behind a pass it has no part in for longer than
// about `max_pass`.
//
// Ownership: owns each step from Add until it has called its Finish; the
// session store and thread budget must outlive it, and so must it every
// runner it queued (declare it before the scheduler that runs them).
// Thread-safety: Add and active() may be called from any thread.
#ifndef ATTNSERVE_ENGINE_STEP_COALESCER_H_
#define ATTNSERVE_ENGINE_STEP_COALESCER_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/mutex.h"
#include "core/session_store.h"
#include "core/thread_budget.h"

namespace attnserve {

class StepCoalescer {
 public:
  // A step waiting for its pass, implemented by the front end that received
  // it.
  class Step {
   public:
    virtual ~Step() = default;
    // The session it steps (one step per session in a pass).
    virtual const std::string& session_id() const = 0;
    // Its estimated FLOPs (the pass leases threads for the sum).
    virtual double flops() const = 0;
    // Just before the pass, on the runner's thread: checks that the call may
    // still run (not cancelled, deadline not passed) and decodes its entry,
    // which must stay valid until Finish. Not OK: the step is left out and
    // finishes with that status.
    virtual absl::StatusOr<const SessionStore::StepInput*> Prepare() = 0;
    // Why the step can no longer run (cancelled, deadline passed), or OK;
    // cheap, and safe to call under the coalescer's lock. Such steps are
    // answered as soon as a pass is formed, not after it.
    virtual absl::Status Expired() const = 0;
    // When its answer is due (absl::InfiniteFuture() when never).
    virtual absl::Time deadline() const = 0;
    // Called once: the step's status, when its pass started and how long it
    // computed (zero when the step was left out). The step is destroyed
    // right after.
    virtual void Finish(const absl::Status& status, absl::Time started,
                        absl::Duration compute) = 0;
  };

  struct Options {
    // The longest a pass waits for more steps (see above); zero: never.
    absl::Duration wait = absl::ZeroDuration();
    // Steps in one pass at most.
    int max_batch = 256;
    // Steps pending at most; more are refused with the busy status.
    size_t max_pending = 1024;
    // How long `flops` will take at the server's measured rate, and the
    // rate's update with a pass that took `took` (the server's CostModel).
    // Without `estimate`, only max_batch bounds a pass.
    std::function<absl::Duration(double flops)> estimate;
    std::function<void(double flops, absl::Duration took)> observe;
    // The longest a pass of several steps is estimated to take.
    absl::Duration max_pass = absl::Milliseconds(50);
  };
  // Queues `runner` on a worker; false when the server is too busy to.
  using Submit = std::function<bool(std::function<void()> runner)>;
  // The status of steps refused because the server is too busy.
  using Busy = std::function<absl::Status()>;

  StepCoalescer(SessionStore* sessions, ThreadBudget* threads,
                const Options& options, Submit submit, Busy busy);
  StepCoalescer(const StepCoalescer&) = delete;
  StepCoalescer& operator=(const StepCoalescer&) = delete;

  // Takes `step` into the next pass (queueing a runner if none is queued or
  // running); when the server is too busy, finishes it at once with the
  // busy status.
  void Add(std::unique_ptr<Step> step) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether a runner is queued or running: a step added now joins a pass.
  bool active() const ABSL_LOCKS_EXCLUDED(mu_);
  // Passes run so far, and the steps they computed (counted before the
  // pass's steps are answered).
  struct Stats {
    int64_t passes = 0;
    int64_t steps = 0;
  };
  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // A step taken out of the queue to be answered at once, and why.
  struct Refusal {
    std::unique_ptr<Step> step;
    absl::Status status;
  };
  // The runner: passes while steps are pending.
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  // The next pass's steps, after the wait for company; empty (and the runner
  // done) when none are pending. Moves the pending steps that expired
  // meanwhile, or cannot end before their deadline, into `refused`.
  std::vector<std::unique_ptr<Step>> TakeBatch(std::vector<Refusal>& refused)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Moves the pending steps that expired, or cannot end before their
  // deadline even alone, into `refused`.
  void TakeRefused(std::vector<Refusal>& refused)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // How long `flops` are estimated to take (zero without `estimate`).
  absl::Duration Estimate(double flops) const;
  void WaitForCompany() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunPass(std::vector<std::unique_ptr<Step>>& batch)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Finishes every pending step with `status` (the runner was refused).
  void FailPending(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

  SessionStore* const sessions_;
  ThreadBudget* const threads_;
  const Options options_;
  const Submit submit_;
  const Busy busy_;
  mutable Mutex mu_;
  CondVar arrived_;
  std::deque<std::unique_ptr<Step>> pending_ ABSL_GUARDED_BY(mu_);
  bool runner_ ABSL_GUARDED_BY(mu_) = false;  // queued or running
  // The last pass: its steps, and when they had been answered.
  size_t last_size_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_answered_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_STEP_COALESCER_H_
