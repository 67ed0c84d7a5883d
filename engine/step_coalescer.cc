#include "engine/step_coalescer.h"

#include <algorithm>
#include <new>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "engine/scheduler.h"

namespace attnserve {

StepCoalescer::StepCoalescer(SessionStore* sessions, ThreadBudget* threads,
                             const Options& options, Submit submit, Busy busy)
    : sessions_(sessions),
      threads_(threads),
      options_(options),
      submit_(std::move(submit)),
      busy_(std::move(busy)) {}

void StepCoalescer::Add(std::unique_ptr<Step> step) {
  bool queue_runner = false;
  {
    MutexLock lock(&mu_);
    if (pending_.size() < options_.max_pending) {
      pending_.push_back(std::move(step));
      queue_runner = !runner_;
      runner_ = true;
      arrived_.SignalAll();
    }
  }
  if (step != nullptr) {
    step->Finish(busy_(), absl::Now(), absl::ZeroDuration());
    return;
  }
  if (queue_runner && !submit_([this] { Run(); })) FailPending(busy_());
}

StepCoalescer::Stats StepCoalescer::stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

bool StepCoalescer::active() const {
  MutexLock lock(&mu_);
  return runner_;
}

void StepCoalescer::FailPending(const absl::Status& status) {
  std::deque<std::unique_ptr<Step>> refused;
  {
    MutexLock lock(&mu_);
    refused.swap(pending_);
    runner_ = false;
  }
  for (auto& step : refused) {
    step->Finish(status, absl::Now(), absl::ZeroDuration());
  }
}

void StepCoalescer::Run() {
  for (;;) {
    std::vector<Refusal> refused;
    std::vector<std::unique_ptr<Step>> batch = TakeBatch(refused);
    // Answered before the pass, not after it.
    for (Refusal& refusal : refused) {
      refusal.step->Finish(refusal.status, absl::Now(), absl::ZeroDuration());
      refusal.step.reset();
    }
    if (batch.empty()) {
      if (refused.empty()) return;
      continue;
    }
    RunPass(batch);
  }
}

absl::Duration StepCoalescer::Estimate(double flops) const {
  return options_.estimate ? options_.estimate(flops) : absl::ZeroDuration();
}

void StepCoalescer::WaitForCompany() {
  const absl::Time now = absl::Now();
  if (options_.wait <= absl::ZeroDuration() ||
      now - last_answered_ >= options_.wait) {
    return;
  }
  const size_t expected =
      std::min(last_size_, static_cast<size_t>(options_.max_batch));
  const auto until = std::chrono::steady_clock::now() +
                     absl::ToChronoNanoseconds(options_.wait);
  while (pending_.size() < expected) {
    if (arrived_.WaitUntil(&mu_, until)) break;  // timed out
  }
}

void StepCoalescer::TakeRefused(std::vector<Refusal>& refused) {
  const absl::Time now = absl::Now();
  for (auto it = pending_.begin(); it != pending_.end();) {
    absl::Status status = (*it)->Expired();
    const absl::Duration own = Estimate((*it)->flops());
    if (status.ok() && now + own > (*it)->deadline()) {
      status = absl::DeadlineExceededError(absl::StrCat(
          "step needs about ", absl::ToInt64Milliseconds(own),
          " ms at this server's measured rate; its deadline is in ",
          absl::ToInt64Milliseconds((*it)->deadline() - now), " ms"));
    }
    if (status.ok()) {
      ++it;
      continue;
    }
    refused.push_back({std::move(*it), std::move(status)});
    it = pending_.erase(it);
  }
}

std::vector<std::unique_ptr<StepCoalescer::Step>> StepCoalescer::TakeBatch(
    std::vector<Refusal>& refused) {
  MutexLock lock(&mu_);
  WaitForCompany();
  TakeRefused(refused);
  std::vector<std::unique_ptr<Step>> batch;
  const absl::Time now = absl::Now();
  absl::Duration pass = absl::ZeroDuration();  // the batch's estimate
  absl::Time due = absl::InfiniteFuture();     // its earliest deadline
  // A session's second step waits for the next pass: it must see the
  // first one's tokens, as it would if the calls ran one after the other.
  absl::flat_hash_set<absl::string_view> sessions;
  std::deque<std::unique_ptr<Step>> later;
  while (!pending_.empty() &&
         batch.size() < static_cast<size_t>(options_.max_batch)) {
    std::unique_ptr<Step> step = std::move(pending_.front());
    pending_.pop_front();
    if (sessions.contains(step->session_id())) {
      later.push_back(std::move(step));
      continue;
    }
    const absl::Duration own = Estimate(step->flops());
    // Full: by the pass's length, or the earliest deadline in it.
    if (!batch.empty() &&
        (pass + own > options_.max_pass ||
         now + pass + own > std::min(due, step->deadline()))) {
      later.push_back(std::move(step));
      break;
    }
    sessions.insert(step->session_id());
    pass += own;
    due = std::min(due, step->deadline());
    batch.push_back(std::move(step));
  }
  while (!later.empty()) {
    pending_.push_front(std::move(later.back()));
    later.pop_back();
  }
  // An empty batch means nothing is pending (its first step always fits).
  // The runner stays on while it has refusals to answer: Run takes another
  // batch after answering them.
  if (batch.empty()) runner_ = !refused.empty();
  return batch;
}

void StepCoalescer::RunPass(std::vector<std::unique_ptr<Step>>& batch) {
  const absl::Time started = absl::Now();
  std::vector<absl::Status> statuses(batch.size());
  std::vector<SessionStore::StepInput> inputs;
  std::vector<size_t> index;  // inputs[k] is batch[index[k]]'s
  double flops = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    absl::StatusOr<const SessionStore::StepInput*> input = batch[i]->Prepare();
    if (!input.ok()) {
      // Answered now: the pass has nothing to give it.
      batch[i]->Finish(input.status(), started, absl::ZeroDuration());
      batch[i].reset();
      continue;
    }
    inputs.push_back(**input);
    index.push_back(i);
    flops += batch[i]->flops();
  }
  if (!inputs.empty()) {
    ThreadBudget::Lease lease = threads_->Acquire(UsefulThreads(flops));
    std::vector<absl::Status> ran;
    try {
      ran = sessions_->StepMany(inputs);
    } catch (const std::bad_alloc&) {
      ran.assign(inputs.size(),
                 absl::ResourceExhaustedError(
                     "request: the server is out of memory for this call; "
                     "retry later or send a smaller one"));
    }
    for (size_t k = 0; k < index.size(); ++k) statuses[index[k]] = ran[k];
  }
  const absl::Duration compute = absl::Now() - started;
  // The rate is learned from the steps that computed: a refused or
  // cancelled one takes no time for its FLOPs.
  double computed = 0;
  for (size_t k = 0; k < index.size(); ++k) {
    if (statuses[index[k]].ok()) computed += batch[index[k]]->flops();
  }
  if (computed > 0 && options_.observe) options_.observe(computed, compute);
  if (!index.empty()) {
    // Counted before any step is answered: a client that has its answer
    // sees its step in the statistics.
    MutexLock lock(&mu_);
    ++stats_.passes;
    stats_.steps += static_cast<int64_t>(index.size());
  }
  for (size_t k = 0; k < index.size(); ++k) {
    batch[index[k]]->Finish(statuses[index[k]], started, compute);
    batch[index[k]].reset();
  }
  MutexLock lock(&mu_);
  last_size_ = batch.size();
  last_answered_ = absl::Now();
}

}  // namespace attnserve
