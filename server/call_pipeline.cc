#include "server/call_pipeline.h"

#include <algorithm>
#include <cstdio>
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

// "query=[2, 3, 8] key=[2, 5, 8]": the shapes of a request's tensors, and
// the model it names, for the access log (names quoted and cut as status
// messages quote them: a client's newline must not start a log line).
std::string Describe(const google::protobuf::Message& request) {
  std::string out;
  const google::protobuf::Reflection* reflection = request.GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(request, &fields);
  for (const google::protobuf::FieldDescriptor* field : fields) {
    if (field->name() == "model" || field->name() == "model_name") {
      absl::StrAppend(&out, out.empty() ? "" : " ", "model=",
                      EchoString(reflection->GetString(request, field)));
    } else if (field->name() == "session_id") {
      absl::StrAppend(&out, out.empty() ? "" : " ", "session=",
                      EchoString(reflection->GetString(request, field)));
    } else if (field->name() == "steps" && field->is_repeated()) {
      absl::StrAppend(&out, out.empty() ? "" : " ", field->name(), "=",
                      reflection->FieldSize(request, field));
    } else if (field->message_type() == v1::Tensor::descriptor() &&
               !field->is_repeated()) {
      const auto& tensor = static_cast<const v1::Tensor&>(
          reflection->GetMessage(request, field));
      absl::StrAppend(
          &out, out.empty() ? "" : " ", field->name(), "=",
          ShapeString(Shape(tensor.shape().begin(), tensor.shape().end())));
    }
  }
  return out;
}

// A session step in the coalescer, from any front end: its cancellation,
// deadline and shared memory; decoded just before its pass, answered after.
class CoalescedStep final : public StepCoalescer::Step {
 public:
  CoalescedStep(const PipelineCall& call, SessionStepCall step,
                const std::atomic<bool>* cancelled,
                const SharedMemoryRegistry* shared_memory,
                CallPipeline::StepAnswer answer)
      : arrived_(call.arrived),
        deadline_(call.deadline),
        flops_(call.cost.flops),
        step_(std::move(step)),
        cancelled_(cancelled),
        shared_memory_(shared_memory),
        answer_(std::move(answer)) {}

  const std::string& session_id() const override { return step_.session_id; }
  double flops() const override { return flops_; }
  absl::Time deadline() const override { return deadline_; }

  absl::Status Expired() const override {
    if (cancelled_ != nullptr && cancelled_->load()) {
      return absl::CancelledError("call cancelled while queued");
    }
    if (absl::Now() >= deadline_) {
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
    const absl::Status answer = step_.complete(status, control());
    answer_(answer, std::max(started - arrived_, absl::ZeroDuration()),
            compute);
  }

 private:
  CallControl control() { return CallControl{cancelled_, &shared_memory_}; }

  const absl::Time arrived_;
  const absl::Time deadline_;
  const double flops_;
  const SessionStepCall step_;
  const std::atomic<bool>* const cancelled_;
  CallSharedMemory shared_memory_;
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
    const PipelineCall& call, const std::atomic<bool>* cancelled,
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

void CallPipeline::Record(const PipelineCall& call, const absl::Status& status,
                          absl::Duration queue_wait, absl::Duration compute,
                          double flops) const {
  const absl::Duration total = absl::Now() - call.arrived;
  const std::string code = absl::StatusCodeToString(status.code());
  const int64_t bytes =
      status.ok() && call.request != nullptr && call.response != nullptr
          ? static_cast<int64_t>(call.request->ByteSizeLong() +
                                 call.response->ByteSizeLong())
          : 0;
  config_.metrics->RecordCall(call.rpc, code, total, queue_wait, compute, flops,
                              bytes);
  if (call.request != nullptr) {
    // Triton's compute_input: the request's translation, which precedes
    // the queue here.
    const absl::Duration input = std::clamp(call.decoded - call.arrived,
                                            absl::ZeroDuration(), queue_wait);
    statistics_.Record(*call.request, status,
                       {.total = total,
                        .input = input,
                        .queue = queue_wait - input,
                        .compute = compute});
  }
  if (log_settings_.info()) {
    std::string described =
        call.request != nullptr ? Describe(*call.request) : "";
    if (!described.empty()) described += ' ';
    std::fprintf(stderr, "access rpc=%s %sstatus=%s us=%lld\n",
                 call.rpc.c_str(), described.c_str(), code.c_str(),
                 static_cast<long long>(absl::ToInt64Microseconds(total)));
  }
}

void CallPipeline::Coalesce(PipelineCall call, SessionStepCall step,
                            const std::atomic<bool>* cancelled,
                            StepAnswer answer) const {
  // `answer` moves into the step only when it is admitted; a refused call
  // is answered here.
  const absl::Status refused = engine().Coalesce(call.cost, call.deadline, [&] {
    return std::make_unique<CoalescedStep>(call, std::move(step), cancelled,
                                           config_.shared_memory,
                                           std::move(answer));
  });
  if (!refused.ok()) {
    answer(refused, absl::ZeroDuration(), absl::ZeroDuration());
  }
}

void CallPipeline::Run(
    PipelineCall call, std::function<absl::Status(const CallControl&)> handle,
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
  Coalesce(call, *std::move(stepped), cancelled,
           [this, call, finish = std::move(finish)](const absl::Status& status,
                                                    absl::Duration queue_wait,
                                                    absl::Duration compute) {
             Record(call, status, queue_wait, compute, call.cost.flops);
             finish(status);
           });
}

absl::Status CallPipeline::ComputeAndRecord(
    const PipelineCall& call, const std::atomic<bool>* cancelled,
    absl::FunctionRef<absl::Status(const CallControl&)> handle) const {
  const absl::Time started = absl::Now();
  absl::Duration compute;
  const absl::Status status = Compute(call, cancelled, handle, &compute);
  Record(call, status, started - call.arrived, compute, call.cost.flops);
  return status;
}

void CallPipeline::Run(PipelineCall call,
                       std::function<absl::Status(const CallControl&)> handle,
                       const std::atomic<bool>* cancelled,
                       std::function<void(const absl::Status&)> finish) const {
  // Shared by the queued work and the refusal of a full queue.
  auto shared_finish =
      std::make_shared<std::function<void(const absl::Status&)>>(
          std::move(finish));
  engine().Dispatch(
      call.cost, call.deadline,
      {.refuse =
           [&](const absl::Status& status) {
             Record(call, status, absl::ZeroDuration(), absl::ZeroDuration(),
                    0);
             (*shared_finish)(status);
           },
       .here =
           [&] { (*shared_finish)(ComputeAndRecord(call, cancelled, handle)); },
       .queued = [&]() -> std::function<void()> {
         return [this, call, handle = std::move(handle), cancelled,
                 shared_finish] {
           (*shared_finish)(ComputeAndRecord(call, cancelled, handle));
         };
       }});
}

}  // namespace attnserve
