#include "server/attention_service.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "core/tensor.h"
#include "core/verify.h"
#include "grpcpp/impl/codegen/proto_utils.h"  // SerializationTraits<Message>
#include "server/grpc_status.h"
#include "server/handlers.h"
#include "server/open_inference.h"

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

absl::Duration UntilDeadline(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) {
    return absl::InfiniteDuration();
  }
  return absl::FromChrono(deadline - std::chrono::system_clock::now());
}

// Parses the bytes of a call's request into `request`. Bytes that are not
// such a message: INVALID_ARGUMENT, and `request` is left empty (not
// half-parsed, for the access log).
absl::Status Parse(const grpc::ByteBuffer& raw,
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
absl::Status Serialize(const google::protobuf::Message& response,
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

// What a Serve bind returns for a call it accepts: its cost and handler.
template <typename Handler>
absl::StatusOr<std::pair<RequestCost, Handler>> Bound(RequestCost cost,
                                                      Handler handle) {
  return std::pair(cost, std::move(handle));
}

// Idle message pairs kept per RPC, and their capacity: enough for the calls
// a busy server has in flight, small next to what those calls compute with.
constexpr size_t kPooledMessages = 64;
constexpr size_t kPooledBytes = size_t{64} << 20;

}  // namespace

struct AttentionServiceImpl::Call {
  grpc::CallbackServerContext* context;
  google::protobuf::Message* response;
  grpc::ByteBuffer* raw_response;  // gRPC's, filled when the call succeeds
  // Its request and response, cost and arrival.
  PipelineCall record;
  // Owns the request and `response`; null once they are back in their pool.
  PooledMessagesPtr messages;
};

AttentionServiceImpl::AttentionServiceImpl(CallPipeline* pipeline)
    : pipeline_(pipeline),
      config_(pipeline->config()),
      attend_messages_(kPooledMessages, kPooledBytes),
      multi_head_messages_(kPooledMessages, kPooledBytes),
      layer_norm_messages_(kPooledMessages, kPooledBytes),
      session_step_messages_(kPooledMessages, kPooledBytes),
      model_infer_messages_(kPooledMessages, kPooledBytes) {}

template <typename Request, typename Response, typename Bind>
grpc::ServerUnaryReactor* AttentionServiceImpl::Serve(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer& raw_request,
    grpc::ByteBuffer* raw_response, MessagePool<Request, Response>* pool,
    Bind bind) {
  const absl::Time arrived = absl::Now();
  typename MessagePool<Request, Response>::Messages* messages =
      pool->AllocateMessages();
  Request* request = messages->request();
  Response* response = messages->response();
  Call call{.context = context,
            .response = response,
            .raw_response = raw_response,
            .record = {.rpc = RpcName(*request),
                       .request = request,
                       .response = response,
                       .cost = {},  // known once the request is parsed
                       .arrived = arrived},
            .messages = PooledMessagesPtr(messages)};
  // Authenticated first: an unauthenticated client's bytes are not parsed.
  absl::Status status = Authenticate(*context);
  if (status.ok()) status = Parse(raw_request, request);
  if (!status.ok()) return Refuse(call, status);
  auto bound = bind(*request);
  if (!bound.ok()) return Refuse(call, bound.status());
  auto& [cost, handle] = *bound;
  call.record.cost = cost;
  return Dispatch(std::move(call),
                  [request, response,
                   handle = std::move(handle)](const CallControl& control) {
                    return handle(*request, response, control);
                  });
}

template <typename BoundHandler>
grpc::ServerUnaryReactor* AttentionServiceImpl::Dispatch(Call call,
                                                         BoundHandler handle) {
  const absl::Status admitted =
      pipeline_->Admit(call.record.cost, UntilDeadline(*call.context));
  if (!admitted.ok()) return Refuse(call, admitted);
  // A tiny call computes in less time than a hand-over to a worker takes,
  // and on gRPC's default reactor: a reactor of our own that watches for
  // cancellation costs gRPC about 15 us of CPU per call, several times
  // what such a call computes.
  if (CallPipeline::IsTiny(call.record.cost)) {
    grpc::ServerUnaryReactor* reactor = nullptr;
    if (config_.scheduler->RunHereIfIdle([&] {
          reactor = call.context->DefaultReactor();
          Compute(call, handle, reactor, nullptr);
        })) {
      return reactor;
    }
  }
  auto* reactor = new CallReactor();
  // Shared with the queued work, which the scheduler drops when it refuses.
  auto queued_call = std::make_shared<Call>(std::move(call));
  const bool queued = config_.scheduler->Submit(
      [this, queued_call, handle = std::move(handle), reactor] {
        Compute(*queued_call, handle, reactor, reactor->cancelled());
      });
  if (!queued) {
    const absl::Status busy = pipeline_->BusyError();
    pipeline_->Record(queued_call->record, busy, absl::ZeroDuration(),
                      absl::ZeroDuration(), 0);
    reactor->Finish(ToGrpcStatus(busy));
  }
  return reactor;
}

void AttentionServiceImpl::Compute(
    Call& call, absl::FunctionRef<absl::Status(const CallControl&)> handle,
    grpc::ServerUnaryReactor* reactor, const std::atomic<bool>* cancelled) {
  const absl::Time started = absl::Now();
  absl::Duration compute;
  absl::Status status =
      pipeline_->Compute(call.record.cost, cancelled,
                         UntilDeadline(*call.context), handle, &compute);
  if (compute > absl::ZeroDuration()) {
    call.context->AddTrailingMetadata(
        "attnserve-compute-us",
        std::to_string(absl::ToInt64Microseconds(compute)));
  }
  if (status.ok()) status = Serialize(*call.response, call.raw_response);
  pipeline_->Record(call.record, status, started - call.record.arrived, compute,
                    call.record.cost.flops);
  // Back to the pool first: once answered, the server may be destroyed.
  call.messages.reset();
  reactor->Finish(ToGrpcStatus(status));
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Refuse(
    const Call& call, const absl::Status& status) const {
  PipelineCall refused = call.record;
  refused.response = nullptr;
  pipeline_->Record(refused, status, absl::ZeroDuration(), absl::ZeroDuration(),
                    0);
  grpc::ServerUnaryReactor* reactor = call.context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

template <typename Request, typename Response, typename Handler>
grpc::ServerUnaryReactor* AttentionServiceImpl::ServeInline(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer& raw_request,
    grpc::ByteBuffer* raw_response, Handler handle) const {
  Request request;
  Response response;
  return ServeStateCall(context, raw_request, raw_response,
                        /*authenticate=*/true, &request, &response, [&] {
                          return handle(std::as_const(request), &response);
                        });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ServeStateCall(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer& raw_request,
    grpc::ByteBuffer* raw_response, bool authenticate,
    google::protobuf::Message* request, google::protobuf::Message* response,
    absl::FunctionRef<absl::Status()> handle) const {
  const absl::Time arrived = absl::Now();
  absl::Status status =
      authenticate ? Authenticate(*context) : absl::OkStatus();
  if (status.ok()) {
    status = Parse(raw_request, request);
    if (!status.ok()) {
      pipeline_->Record({.rpc = RpcName(*request),
                         .request = request,
                         .response = nullptr,
                         .cost = {},
                         .arrived = arrived},
                        status, absl::ZeroDuration(), absl::ZeroDuration(), 0);
    }
  }
  if (status.ok()) status = handle();
  if (status.ok()) status = Serialize(*response, raw_response);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

absl::Status AttentionServiceImpl::Authenticate(
    const grpc::CallbackServerContext& context) const {
  return config_.auth != nullptr ? config_.auth->Check(context)
                                 : absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return Serve(context, *request, response, &attend_messages_,
               [](const v1::AttendRequest& request) {
                 return Bound(CostOf(request), &HandleAttend);
               });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::MultiHeadAttend(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return Serve(context, *request, response, &multi_head_messages_,
               [this](const v1::MultiHeadAttendRequest& request) {
                 MultiHeadAttendHandler handle(request, config_.models);
                 const RequestCost cost = CostOf(request, handle.layer());
                 return Bound(cost, std::move(handle));
               });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::LayerNorm(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return Serve(context, *request, response, &layer_norm_messages_,
               [](const v1::LayerNormRequest& request) {
                 return Bound(CostOf(request), &HandleLayerNorm);
               });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ModelInfer(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  using Handle = std::function<absl::Status(const inference::ModelInferRequest&,
                                            inference::ModelInferResponse*,
                                            const CallControl&)>;
  return Serve(
      context, *request, response, &model_infer_messages_,
      [this](inference::ModelInferRequest& request)
          -> absl::StatusOr<std::pair<RequestCost, Handle>> {
        ATTN_ASSIGN_OR_RETURN(
            std::shared_ptr<NativeInferCall> native,
            NativeInferCall::FromRequest(&request, config_.models));
        const RequestCost cost = native->cost();
        return Bound(
            cost, Handle([native](const inference::ModelInferRequest& request,
                                  inference::ModelInferResponse* response,
                                  const CallControl& control) {
              ATTN_RETURN_IF_ERROR(native->Run(control));
              native->ToResponse(request, response);
              return absl::OkStatus();
            }));
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return ServeInline<v1::ListModelsRequest, v1::ListModelsResponse>(
      context, *request, response,
      [this](const v1::ListModelsRequest&, v1::ListModelsResponse* response) {
        return HandleListModels(config_.models, response);
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModelMetadata(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return ServeInline<v1::GetModelMetadataRequest, v1::GetModelMetadataResponse>(
      context, *request, response,
      [this](const v1::GetModelMetadataRequest& request,
             v1::GetModelMetadataResponse* response) {
        return HandleGetModelMetadata(request, config_.models, response);
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::RegisterSharedMemory(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return ServeInline<v1::RegisterSharedMemoryRequest,
                     v1::RegisterSharedMemoryResponse>(
      context, *request, response,
      [this](const v1::RegisterSharedMemoryRequest& request,
             v1::RegisterSharedMemoryResponse*) {
        return HandleRegisterSharedMemory(request, config_.shared_memory);
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::UnregisterSharedMemory(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return ServeInline<v1::UnregisterSharedMemoryRequest,
                     v1::UnregisterSharedMemoryResponse>(
      context, *request, response,
      [this](const v1::UnregisterSharedMemoryRequest& request,
             v1::UnregisterSharedMemoryResponse*) {
        return HandleUnregisterSharedMemory(request, config_.shared_memory);
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListSharedMemory(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return ServeInline<v1::ListSharedMemoryRequest, v1::ListSharedMemoryResponse>(
      context, *request, response,
      [this](const v1::ListSharedMemoryRequest& request,
             v1::ListSharedMemoryResponse* response) {
        return HandleListSharedMemory(request, config_.shared_memory, response);
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CreateSession(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return ServeInline<v1::CreateSessionRequest, v1::CreateSessionResponse>(
      context, *request, response,
      [this](const v1::CreateSessionRequest& request,
             v1::CreateSessionResponse* response) {
        if (pipeline_->draining()) {
          return absl::UnavailableError(
              "server is shutting down; create the session on another "
              "replica");
        }
        return HandleCreateSession(request, config_.models, config_.sessions,
                                   config_.max_session_length, response);
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::SessionStep(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return Serve(context, *request, response, &session_step_messages_,
               [this](const v1::SessionStepRequest& request) {
                 SessionStepHandler handle(request, config_.sessions);
                 const RequestCost cost = CostOf(request, handle.session());
                 return Bound(cost, std::move(handle));
               });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::DeleteSession(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return ServeInline<v1::DeleteSessionRequest, v1::DeleteSessionResponse>(
      context, *request, response,
      [this](const v1::DeleteSessionRequest& request,
             v1::DeleteSessionResponse*) {
        return HandleDeleteSession(request, config_.sessions);
      });
}

}  // namespace attnserve
