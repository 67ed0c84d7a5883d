// The engine under every front end (native gRPC, the Open Inference
// Protocol over gRPC, its stream and HTTP): admission (drain, limits, the
// deadline against the estimated compute time), the one dispatch decision
// (on the receiving thread when a call is tiny and a worker is free, else
// queued for a worker, else refused as busy), computation with the call's
// share of the cores and its cancellation, the cost model that learns from
// every computation, and decode steps in the step coalescer's shared
// passes, and the record of every call (engine/call_record.h). It knows no
// wire format: a call is its cost, its deadline, its subject and the front
// end's functions that compute and answer it.
//
// Thread-safety: every method may be called from any thread. Ownership:
// owns its scheduler (the workers), cost model and step coalescer; the
// thread budget, session store and recorder must outlive it, and it must
// be destroyed before them (its destructor runs what is queued).
#ifndef ATTNSERVE_ENGINE_ENGINE_H_
#define ATTNSERVE_ENGINE_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/session_store.h"
#include "core/thread_budget.h"
#include "engine/call_cost.h"
#include "engine/call_record.h"
#include "engine/scheduler.h"
#include "engine/step_coalescer.h"

namespace attnserve {

struct EngineOptions {
  // Calls computing at once (one worker each), and calls waiting for a
  // worker beyond them; more are refused as busy.
  int max_inflight = 1;
  int max_queue = 0;
  // The compute rate assumed until calls have been measured.
  double initial_flops_per_second = 20e9;
  // Required: the cores calls share. Each call leases its share (no more
  // threads than its size keeps busy) while it computes.
  ThreadBudget* thread_budget = nullptr;
  // Null: no decode sessions, and no step coalescer.
  SessionStore* sessions = nullptr;
  // Zero: each session step runs on its own. Else concurrent steps share
  // passes, and a pass waits up to this long for company (see
  // engine/step_coalescer.h).
  absl::Duration coalesce_wait = absl::ZeroDuration();
  // Steps in one pass at most.
  int max_steps_per_pass = 256;
  // Refused with RESOURCE_EXHAUSTED before any allocation.
  int64_t max_tensor_elements = 0;
  int64_t max_request_bytes = 0;
  // Null: calls are not recorded.
  const CallRecorder* recorder = nullptr;
};

class Engine {
 public:
  explicit Engine(const EngineOptions& options);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const EngineOptions& options() const { return options_; }
  const Scheduler& scheduler() const { return scheduler_; }
  const CostModel& cost_model() const { return cost_model_; }
  // Null when steps are not coalesced.
  const StepCoalescer* step_coalescer() const { return step_coalescer_.get(); }

  // Whether a call may start: not draining, within the limits, and its
  // estimated compute time before `deadline`.
  absl::Status Admit(const RequestCost& cost, absl::Time deadline) const;
  // Whether a call is small enough to compute on the thread that received
  // it (when a worker would be free at once).
  static bool IsTiny(const RequestCost& cost) { return RunsInline(cost); }
  // RESOURCE_EXHAUSTED naming --max_inflight and --max_queue.
  absl::Status BusyError() const;

  // A front end's side of one dispatched call: exactly one function is
  // called, once.
  struct Route {
    // The call is refused before it computes: not admitted, or every worker
    // is busy and the queue full. Answer it with `status`.
    absl::FunctionRef<void(const absl::Status& status)> refuse;
    // Compute and answer the call now, on this thread: it is tiny and a
    // worker is free.
    absl::FunctionRef<void()> here;
    // The work that computes and answers the call on a worker, asked for
    // only when the call is queued. If the queue turns out full, the work
    // is destroyed unrun and `refuse` is called after it.
    absl::FunctionRef<std::function<void()>()> queued;
  };
  // The one dispatch of compute calls (arrival: `deadline` is absolute).
  void Dispatch(const RequestCost& cost, absl::Time deadline,
                const Route& route) const;

  // Computes an admitted call with its share of the cores: refused if
  // cancelled or past its deadline before it starts; `*took` is the time
  // it computed (zero when refused). The cost model learns from calls that
  // succeed. `cancelled` may be null.
  absl::Status Compute(const RequestCost& cost,
                       const std::atomic<bool>* cancelled, absl::Time deadline,
                       absl::FunctionRef<absl::Status()> compute,
                       absl::Duration* took) const;

  // The whole path of a call: admits it, computes `compute()` with its
  // share of the cores (here when tiny and a worker is free, else on a
  // worker), records it, then calls `finish` once with the status, on
  // whichever thread computed. `cancelled` (may be null) must live until
  // `finish` is called, and so must `call.subject`.
  void Submit(EngineCall call, std::function<absl::Status()> compute,
              const std::atomic<bool>* cancelled,
              std::function<void(const absl::Status&)> finish) const;

  // Records one finished call: it waited `queue_wait` from its arrival to
  // the start of its computation, which took `compute`, and answers with
  // `status` now. For front ends that dispatch and compute through
  // Dispatch and Compute themselves (Submit records its calls).
  void Record(const EngineCall& call, const absl::Status& status,
              absl::Duration queue_wait, absl::Duration compute) const;

  // Whether a session step of `cost` joins the step coalescer's passes:
  // there is a coalescer, and a pass is forming or the step is not tiny (a
  // tiny step alone runs on the thread that received it).
  bool Coalesces(const RequestCost& cost) const;
  // Admits a session step and hands `make_step()` to the coalescer's next
  // pass (the step then answers itself through its Finish, and records
  // itself through Record). Not OK: the step was refused and recorded,
  // `make_step` was not called, and the caller answers.
  absl::Status Coalesce(
      const EngineCall& call,
      absl::FunctionRef<std::unique_ptr<StepCoalescer::Step>()> make_step)
      const;

  // Whether the server takes compute calls and wants more: false from
  // MarkNotReady (the drain's lame duck) or StopAcceptingCalls on.
  bool ready() const { return !not_ready_.load() && !draining_.load(); }
  void MarkNotReady() { not_ready_.store(true); }
  // From now on compute calls are refused with UNAVAILABLE "server is
  // shutting down; retry on another replica"; accepted calls finish.
  void StopAcceptingCalls() { draining_.store(true); }
  bool draining() const { return draining_.load(); }
  // Whether no admitted call is computing or waiting (for a worker, for
  // another replica outside its slot, or in the step coalescer).
  bool idle() const {
    return scheduler_.inflight() == 0 && scheduler_.queued() == 0 &&
           scheduler_.waiting() == 0 &&
           (step_coalescer_ == nullptr || !step_coalescer_->active());
  }
  // When a call was last refused for that (absl::UnixEpoch(): never).
  absl::Time last_refused() const {
    return absl::FromUnixNanos(last_refused_ns_.load());
  }

 private:
  const EngineOptions options_;
  mutable CostModel cost_model_;
  // Declared before the scheduler: its runners, queued there, finish
  // before it goes.
  std::unique_ptr<StepCoalescer> step_coalescer_;
  mutable Scheduler scheduler_;
  std::atomic<bool> draining_{false};
  std::atomic<bool> not_ready_{false};
  mutable std::atomic<int64_t> last_refused_ns_{0};
};

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_ENGINE_H_
