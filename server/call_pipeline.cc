#include "server/call_pipeline.h"

#include <algorithm>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.pb.h"
#include "core/status_macros.h"
#include "core/tensor.h"
#include "core/verify.h"

namespace attnserve {
namespace {

// A session step in the coalescer, from any front end: its cancellation,
// deadline and shared memory; decoded just before its pass, answered after.
class CoalescedStep final : public StepCoalescer::Step {
 public:
  CoalescedStep(const Engine* engine, EngineCall call, SessionStepCall step,
                const std::atomic<bool>* cancelled,
                const SharedMemoryRegistry* shared_memory,
                CallPipeline::StepComplete complete,
                CallPipeline::StepAnswer answer)
      : engine_(engine),
        call_(std::move(call)),
        step_(std::move(step)),
        cancelled_(cancelled),
        shared_memory_(shared_memory),
        complete_(std::move(complete)),
        answer_(std::move(answer)) {}

  const std::string& session_id() const override { return step_.session_id; }
  double flops() const override { return call_.cost.flops; }
  absl::Time deadline() const override { return call_.deadline; }

  absl::Status Expired() const override {
    if (cancelled_ != nullptr && cancelled_->load()) {
      return absl::CancelledError("call cancelled while queued");
    }
    if (absl::Now() >= call_.deadline) {
      return absl::DeadlineExceededError(
          "deadline passed while the call waited for a worker");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<const SessionStore::StepInput*> Prepare() override {
    ATTN_RETURN_IF_ERROR(Expired());
    return step_.decode(control());
  }

  void Finish(const absl::Status& status, absl::Time started,
              absl::Duration compute) override {
    absl::Status answer = step_.complete(status, control());
    if (complete_ != nullptr) answer = complete_(answer, compute);
    const absl::Duration queue_wait =
        std::max(started - call_.arrived, absl::ZeroDuration());
    engine_->Record(call_, answer, queue_wait, compute);
    answer_(answer, queue_wait, compute);
  }

 private:
  CallControl control() { return CallControl{cancelled_, &shared_memory_}; }

  const Engine* const engine_;
  const EngineCall call_;
  const SessionStepCall step_;
  const std::atomic<bool>* const cancelled_;
  CallSharedMemory shared_memory_;
  const CallPipeline::StepComplete complete_;
  const CallPipeline::StepAnswer answer_;
};

}  // namespace

std::string RpcName(const google::protobuf::Message& request) {
  std::string rpc = request.GetDescriptor()->name();
  rpc.resize(rpc.size() - std::string_view("Request").size());
  return rpc;
}

absl::Status CallPipeline::CheckAuthorization(
    std::optional<absl::string_view> authorization) const {
  return config_.auth != nullptr
             ? config_.auth->CheckAuthorization(authorization)
             : absl::OkStatus();
}

absl::Status CallPipeline::Compute(
    const EngineCall& call, const std::atomic<bool>* cancelled,
    absl::FunctionRef<absl::Status(const CallControl&)> handle,
    absl::Duration* compute) const {
  return engine().Compute(
      call.cost, cancelled, call.deadline,
      [&] {
        CallSharedMemory shared_memory(config_.shared_memory);
        return handle(CallControl{cancelled, &shared_memory});
      },
      compute);
}

void CallPipeline::Run(EngineCall call,
                       std::function<absl::Status(const CallControl&)> handle,
                       const std::atomic<bool>* cancelled,
                       std::function<void(const absl::Status&)> finish) const {
  engine().Submit(
      std::move(call),
      [this, handle = std::move(handle), cancelled] {
        CallSharedMemory shared_memory(config_.shared_memory);
        return handle(CallControl{cancelled, &shared_memory});
      },
      cancelled, std::move(finish));
}

void CallPipeline::Coalesce(EngineCall call, SessionStepCall step,
                            const std::atomic<bool>* cancelled,
                            StepComplete complete, StepAnswer answer) const {
  // `answer` moves into the step only when it is admitted; a refused call
  // (recorded by the engine) is answered here.
  const absl::Status refused = engine().Coalesce(call, [&] {
    return std::make_unique<CoalescedStep>(
        &engine(), call, std::move(step), cancelled, config_.shared_memory,
        std::move(complete), std::move(answer));
  });
  if (!refused.ok()) {
    answer(refused, absl::ZeroDuration(), absl::ZeroDuration());
  }
}

void CallPipeline::Run(
    EngineCall call, std::function<absl::Status(const CallControl&)> handle,
    const std::atomic<bool>* cancelled,
    std::function<void(const absl::Status&)> finish,
    absl::FunctionRef<std::optional<SessionStepCall>()> step) const {
  // Asked only when it would be coalesced: a step call allocates.
  std::optional<SessionStepCall> stepped =
      engine().Coalesces(call.cost) ? step() : std::nullopt;
  if (!stepped.has_value()) {
    return Run(std::move(call), std::move(handle), cancelled,
               std::move(finish));
  }
  Coalesce(
      std::move(call), *std::move(stepped), cancelled, nullptr,
      [finish = std::move(finish)](const absl::Status& status, absl::Duration,
                                   absl::Duration) { finish(status); });
}

}  // namespace attnserve
