#include "server/grpc_calls.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.pb.h"
#include "core/status_macros.h"
#include "grpcpp/impl/codegen/proto_utils.h"  // SerializationTraits<Message>
#include "grpcpp/support/proto_buffer_reader.h"
#include "proto/wire_scan.h"
#include "server/grpc_status.h"
#include "server/handlers.h"

namespace attnserve {
namespace {

// A call's reactor: records cancellation (client gone, deadline passed) for
// the computation to see, and deletes itself when gRPC is done with it.
class CallReactor : public grpc::ServerUnaryReactor {
 public:
  void OnCancel() override { cancelled_.store(true); }
  void OnDone() override { delete this; }
  const std::atomic<bool>* cancelled() const { return &cancelled_; }

 private:
  std::atomic<bool> cancelled_{false};
};

// How many times field `number` occurs at the top level of `raw`, counted
// without decoding anything.
int64_t CountTopLevelField(const grpc::ByteBuffer& raw, int number) {
  auto* buffer = const_cast<grpc::ByteBuffer*>(&raw);  // read, not consumed
  grpc::ProtoBufferReader reader(buffer);
  return ::attnserve::CountTopLevelField(&reader, number);
}

}  // namespace

// Parses the bytes of a call's request into `request`. Bytes that are not
// such a message: INVALID_ARGUMENT, and `request` is left empty (not
// half-parsed, for the access log).
absl::Status ParseMessage(const grpc::ByteBuffer& raw,
                          google::protobuf::Message* request) {
  const size_t bytes = raw.Length();
  // gRPC hands the request over as const but no longer needs it; parsing
  // consumes it, freeing the received bytes at once.
  auto* buffer = const_cast<grpc::ByteBuffer*>(&raw);
  if (!grpc::SerializationTraits<google::protobuf::Message>::Deserialize(
           buffer, request)
           .ok()) {
    request->Clear();
    return absl::InvalidArgumentError(
        absl::StrCat("request: could not parse ", bytes, " bytes as ",
                     request->GetDescriptor()->full_name()));
  }
  return absl::OkStatus();
}

// Serializes `response` into `raw`, for gRPC to send.
absl::Status SerializeMessage(const google::protobuf::Message& response,
                              grpc::ByteBuffer* raw) {
  bool own_buffer = false;
  if (!grpc::SerializationTraits<google::protobuf::Message>::Serialize(
           response, raw, &own_buffer)
           .ok()) {
    return absl::InternalError(absl::StrCat("response: could not serialize ",
                                            response.ByteSizeLong(), " bytes"));
  }
  return absl::OkStatus();
}

absl::Time DeadlineOf(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) {
    return absl::InfiniteFuture();
  }
  return absl::Now() +
         absl::FromChrono(deadline - std::chrono::system_clock::now());
}

absl::Status GrpcCalls::Accept(const grpc::CallbackServerContext& context,
                               const grpc::ByteBuffer& raw_request,
                               google::protobuf::Message* request) const {
  const TokenAuthenticator* auth = pipeline_->config().auth;
  if (auth != nullptr) {
    absl::Status status = auth->Check(context);
    if (!status.ok()) return status;
  }
  ATTN_RETURN_IF_ERROR(VerifyBeforeParse(raw_request, *request));
  return ParseMessage(raw_request, request);
}

absl::Status GrpcCalls::VerifyBeforeParse(
    const grpc::ByteBuffer& raw_request,
    const google::protobuf::Message& request) const {
  // Each step decodes into a message of its own: 16 million empty steps
  // (32 MB) took 1.7 GB to parse before their count was refused.
  if (request.GetDescriptor() != v1::SessionStepsRequest::descriptor()) {
    return absl::OkStatus();
  }
  const int max_steps = pipeline_->config().max_steps_per_call;
  const int64_t steps = CountTopLevelField(
      raw_request, v1::SessionStepsRequest::kStepsFieldNumber);
  return steps > max_steps ? VerifyStepCount(steps, max_steps)
                           : absl::OkStatus();
}

std::function<void()> GrpcCalls::QueuedWork(
    std::shared_ptr<Call> call,
    std::function<absl::Status(const CallControl&)> handle,
    grpc::ServerUnaryReactor** reactor) const {
  auto* own = new CallReactor();
  *reactor = own;
  return [this, call = std::move(call), handle = std::move(handle), own] {
    Compute(*call, handle, own, own->cancelled());
  };
}

void GrpcCalls::Compute(Call& call, Handle handle,
                        grpc::ServerUnaryReactor* reactor,
                        const std::atomic<bool>* cancelled) const {
  const absl::Time started = absl::Now();
  absl::Duration compute;
  absl::Status status =
      pipeline_->Compute(call.record, cancelled, handle, &compute);
  Answer(call, std::move(status), started - call.record.arrived, compute,
         reactor);
}

absl::Status GrpcCalls::Complete(Call& call, absl::Status status,
                                 absl::Duration compute) const {
  if (compute > absl::ZeroDuration()) {
    call.context->AddTrailingMetadata(
        "attnserve-compute-us",
        std::to_string(absl::ToInt64Microseconds(compute)));
  }
  if (status.ok()) status = SerializeMessage(*call.response, call.raw_response);
  return status;
}

void GrpcCalls::Answer(Call& call, const absl::Status& status,
                       grpc::ServerUnaryReactor* reactor) const {
  // Back to the pool first: once answered, the server may be destroyed.
  call.messages.reset();
  reactor->Finish(ToGrpcStatus(status));
}

void GrpcCalls::Answer(Call& call, absl::Status status,
                       absl::Duration queue_wait, absl::Duration compute,
                       grpc::ServerUnaryReactor* reactor) const {
  status = Complete(call, std::move(status), compute);
  pipeline_->engine().Record(RecordOf(call), status, queue_wait, compute);
  Answer(call, status, reactor);
}

grpc::ServerUnaryReactor* GrpcCalls::Coalesce(
    Call call, SessionStepCall step, std::shared_ptr<const void> owner) const {
  auto* reactor = new CallReactor();
  auto shared = std::make_shared<Call>(std::move(call));
  pipeline_->Coalesce(
      RecordOf(*shared), std::move(step), reactor->cancelled(),
      [this, shared](const absl::Status& status, absl::Duration compute) {
        return Complete(*shared, status, compute);
      },
      [this, shared, reactor, owner = std::move(owner)](
          const absl::Status& status, absl::Duration, absl::Duration) {
        Answer(*shared, status, reactor);
      });
  return reactor;
}

grpc::ServerUnaryReactor* GrpcCalls::Refuse(Call& call,
                                            const absl::Status& status) const {
  pipeline_->engine().Record(RecordOf(call), status, absl::ZeroDuration(),
                             absl::ZeroDuration());
  grpc::ServerUnaryReactor* reactor = call.context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

absl::Status GrpcCalls::AcceptState(const grpc::CallbackServerContext& context,
                                    const grpc::ByteBuffer& raw_request,
                                    bool authenticate,
                                    google::protobuf::Message* request,
                                    absl::Time arrived) const {
  const TokenAuthenticator* auth = pipeline_->config().auth;
  if (authenticate && auth != nullptr) {
    ATTN_RETURN_IF_ERROR(auth->Check(context));
  }
  absl::Status status = ParseMessage(raw_request, request);
  if (!status.ok()) {
    const MessageSubject subject(request, nullptr);
    pipeline_->engine().Record(
        {.label = RpcName(*request), .subject = &subject, .arrived = arrived},
        status, absl::ZeroDuration(), absl::ZeroDuration());
  }
  return status;
}

grpc::ServerUnaryReactor* GrpcCalls::ServeState(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer& raw_request,
    grpc::ByteBuffer* raw_response, bool authenticate,
    google::protobuf::Message* request, google::protobuf::Message* response,
    absl::FunctionRef<absl::Status()> handle) const {
  absl::Status status =
      AcceptState(*context, raw_request, authenticate, request, absl::Now());
  if (status.ok()) status = handle();
  if (status.ok()) status = SerializeMessage(*response, raw_response);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* GrpcCalls::ServeWaitingState(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer& raw_request,
    grpc::ByteBuffer* raw_response, std::shared_ptr<StateMessages> messages,
    absl::FunctionRef<bool()> waits,
    std::function<absl::Status(PeerWait)> handle) const {
  const absl::Time arrived = absl::Now();
  const absl::Status accepted =
      AcceptState(*context, raw_request, /*authenticate=*/true,
                  messages->request.get(), arrived);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto answer = [messages, reactor, raw_response](absl::Status status) {
    if (status.ok()) {
      status = SerializeMessage(*messages->response, raw_response);
    }
    reactor->Finish(ToGrpcStatus(status));
  };
  if (!accepted.ok()) {
    answer(accepted);
    return reactor;
  }
  if (!waits()) {
    absl::Status status = handle(PeerWait::kRefused);
    if (!IsWouldWait(status)) {
      answer(std::move(status));
      return reactor;
    }
  }
  RequestCost cost;
  cost.may_wait = true;
  pipeline_->engine().Submit(
      {.label = RpcName(*messages->request),
       .subject = &messages->subject,
       .cost = cost,
       .arrived = arrived,
       .deadline = DeadlineOf(*context)},
      [handle = std::move(handle)] { return handle(PeerWait::kAllowed); },
      /*cancelled=*/nullptr, std::move(answer));
  return reactor;
}

}  // namespace attnserve
