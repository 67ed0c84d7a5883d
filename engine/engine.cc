#include "engine/engine.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace attnserve {

Engine::Engine(const EngineOptions& options)
    : options_(options),
      cost_model_(options.initial_flops_per_second),
      scheduler_(options.max_inflight, options.max_queue) {
  if (options.sessions == nullptr ||
      options.coalesce_wait <= absl::ZeroDuration()) {
    return;
  }
  StepCoalescer::Options coalescing;
  coalescing.wait = options.coalesce_wait;
  coalescing.max_batch = options.max_steps_per_pass;
  // As many as the scheduler would hold, and a full pass more.
  coalescing.max_pending = static_cast<size_t>(
      options.max_queue + options.max_inflight + options.max_steps_per_pass);
  coalescing.estimate = [this](double flops) {
    return cost_model_.Estimate(flops);
  };
  coalescing.observe = [this](double flops, absl::Duration took) {
    cost_model_.Observe(flops, took);
  };
  step_coalescer_ = std::make_unique<StepCoalescer>(
      options.sessions, options.thread_budget, coalescing,
      [this](std::function<void()> runner) {
        return scheduler_.Submit(std::move(runner));
      },
      [this] { return BusyError(); });
}

absl::Status Engine::Admit(const RequestCost& cost, absl::Time deadline) const {
  if (draining_.load()) {
    last_refused_ns_.store(absl::ToUnixNanos(absl::Now()));
    return absl::UnavailableError(
        "server is shutting down; retry on another replica");
  }
  ATTN_RETURN_IF_ERROR(VerifyWithinLimits(cost, options_.max_tensor_elements,
                                          options_.max_request_bytes));
  const absl::Duration until_deadline = deadline - absl::Now();
  if (until_deadline <= absl::ZeroDuration()) {
    return absl::DeadlineExceededError(
        "deadline passed before the call started");
  }
  const absl::Duration estimate = cost_model_.Estimate(cost.effort());
  if (estimate > until_deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("call needs about ", absl::ToInt64Milliseconds(estimate),
                     " ms at this server's measured rate; the deadline is in ",
                     absl::ToInt64Milliseconds(until_deadline), " ms"));
  }
  return absl::OkStatus();
}

absl::Status Engine::BusyError() const {
  return absl::ResourceExhaustedError(
      absl::StrCat("server busy: ", scheduler_.max_inflight(),
                   " calls computing and ", scheduler_.max_queue(),
                   " waiting (--max_inflight, --max_queue); retry later"));
}

void Engine::Dispatch(const RequestCost& cost, absl::Time deadline,
                      const Route& route) const {
  const absl::Status admitted = Admit(cost, deadline);
  if (!admitted.ok()) {
    route.refuse(admitted);
    return;
  }
  // A tiny call computes in less time than a hand-over to a worker takes.
  if (IsTiny(cost) && scheduler_.RunHereIfIdle(route.here)) return;
  if (!scheduler_.Submit(route.queued())) route.refuse(BusyError());
}

absl::Status Engine::Compute(const RequestCost& cost,
                             const std::atomic<bool>* cancelled,
                             absl::Time deadline,
                             absl::FunctionRef<absl::Status()> compute,
                             absl::Duration* took) const {
  *took = absl::ZeroDuration();
  if (cancelled != nullptr && cancelled->load()) {
    return absl::CancelledError("call cancelled while queued");
  }
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError(
        "deadline passed while the call waited for a worker");
  }
  const absl::Time started = absl::Now();
  absl::Status status;
  {
    // This call's share of the cores while it computes, no more threads
    // than its size keeps busy.
    ThreadBudget::Lease lease =
        options_.thread_budget->Acquire(UsefulThreads(cost.flops));
    status = compute();
  }
  *took = absl::Now() - started;
  if (status.ok()) cost_model_.Observe(cost.effort(), *took);
  return status;
}

void Engine::Record(const EngineCall& call, const absl::Status& status,
                    absl::Duration queue_wait, absl::Duration compute) const {
  if (options_.recorder == nullptr) return;
  const absl::Duration total = absl::Now() - call.arrived;
  // The request's translation precedes the queue.
  const absl::Duration input =
      std::clamp(call.decoded - call.arrived, absl::ZeroDuration(), queue_wait);
  options_.recorder->Record(
      call, status,
      {.total = total,
       .input = input,
       .queue = queue_wait - input,
       .compute = compute},
      compute > absl::ZeroDuration() || status.ok() ? call.cost.flops : 0);
}

void Engine::Submit(EngineCall call, std::function<absl::Status()> compute,
                    const std::atomic<bool>* cancelled,
                    std::function<void(const absl::Status&)> finish) const {
  // Computes and records an admitted call; the status `finish` gets.
  auto run = [this](const EngineCall& call,
                    absl::FunctionRef<absl::Status()> compute,
                    const std::atomic<bool>* cancelled) {
    const absl::Time started = absl::Now();
    absl::Duration took;
    const absl::Status status =
        Compute(call.cost, cancelled, call.deadline, compute, &took);
    Record(call, status, started - call.arrived, took);
    return status;
  };
  // Shared by the queued work and the refusal of a full queue.
  auto shared_finish =
      std::make_shared<std::function<void(const absl::Status&)>>(
          std::move(finish));
  Dispatch(call.cost, call.deadline,
           {.refuse =
                [&](const absl::Status& status) {
                  Record(call, status, absl::ZeroDuration(),
                         absl::ZeroDuration());
                  (*shared_finish)(status);
                },
            .here = [&] { (*shared_finish)(run(call, compute, cancelled)); },
            .queued = [&]() -> std::function<void()> {
              return [run, call, compute = std::move(compute), cancelled,
                      shared_finish] {
                (*shared_finish)(run(call, compute, cancelled));
              };
            }});
}

bool Engine::Coalesces(const RequestCost& cost) const {
  // A step that may wait for its session (a file, a hand-over) runs alone:
  // in a pass, the pass would wait with it.
  return step_coalescer_ != nullptr && !cost.may_wait &&
         (step_coalescer_->active() || !IsTiny(cost));
}

absl::Status Engine::Coalesce(
    const EngineCall& call,
    absl::FunctionRef<std::unique_ptr<StepCoalescer::Step>()> make_step) const {
  const absl::Status admitted = Admit(call.cost, call.deadline);
  if (!admitted.ok()) {
    Record(call, admitted, absl::ZeroDuration(), absl::ZeroDuration());
    return admitted;
  }
  step_coalescer_->Add(make_step());
  return absl::OkStatus();
}

}  // namespace attnserve
