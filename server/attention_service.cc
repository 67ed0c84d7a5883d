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

// Threads a call of `flops` keeps busy: each should get at least ~2 MFLOP
// (tens of microseconds), or starting and joining it costs more than it
// computes.
int UsefulThreads(double flops) {
  return static_cast<int>(std::clamp(flops / 2e6, 1.0, 1024.0));
}

absl::Duration UntilDeadline(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) {
    return absl::InfiniteDuration();
  }
  return absl::FromChrono(deadline - std::chrono::system_clock::now());
}

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

// "AttendRequest" -> "Attend": the RPC a request message is for.
std::string RpcName(const google::protobuf::Message& request) {
  std::string rpc = request.GetDescriptor()->name();
  rpc.resize(rpc.size() - std::string_view("Request").size());
  return rpc;
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
  const google::protobuf::Message* request;
  google::protobuf::Message* response;
  grpc::ByteBuffer* raw_response;  // gRPC's, filled when the call succeeds
  std::string rpc;                 // for the metrics and the access log
  RequestCost cost;
  absl::Time arrived;
  // Owns `request` and `response`; null once they are back in their pool.
  PooledMessagesPtr messages;
};

AttentionServiceImpl::AttentionServiceImpl(const ServiceConfig& config)
    : config_(config),
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
            .request = request,
            .response = response,
            .raw_response = raw_response,
            .rpc = RpcName(*request),
            .cost = {},  // known once the request is parsed
            .arrived = arrived,
            .messages = PooledMessagesPtr(messages)};
  // Authenticated first: an unauthenticated client's bytes are not parsed.
  absl::Status status = Authenticate(*context);
  if (status.ok()) status = Parse(raw_request, request);
  if (!status.ok()) return Refuse(call, status);
  auto bound = bind(*request);
  if (!bound.ok()) return Refuse(call, bound.status());
  auto& [cost, handle] = *bound;
  call.cost = cost;
  return Dispatch(std::move(call),
                  [request, response,
                   handle = std::move(handle)](const CallControl& control) {
                    return handle(*request, response, control);
                  });
}

template <typename BoundHandler>
grpc::ServerUnaryReactor* AttentionServiceImpl::Dispatch(Call call,
                                                         BoundHandler handle) {
  const absl::Status admitted = Admit(*call.context, call.cost);
  if (!admitted.ok()) return Refuse(call, admitted);
  // A tiny call computes in less time than a hand-over to a worker takes,
  // and on gRPC's default reactor: a reactor of our own that watches for
  // cancellation costs gRPC about 15 us of CPU per call, several times
  // what such a call computes.
  if (RunsInline(call.cost)) {
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
    const absl::Status busy = absl::ResourceExhaustedError(
        absl::StrCat("server busy: ", config_.scheduler->max_inflight(),
                     " calls computing and ", config_.scheduler->max_queue(),
                     " waiting (--max_inflight, --max_queue); retry later"));
    Record(queued_call->rpc, *queued_call->request, nullptr, busy,
           queued_call->arrived, absl::ZeroDuration(), absl::ZeroDuration(), 0);
    reactor->Finish(ToGrpcStatus(busy));
  }
  return reactor;
}

void AttentionServiceImpl::Compute(
    Call& call, absl::FunctionRef<absl::Status(const CallControl&)> handle,
    grpc::ServerUnaryReactor* reactor, const std::atomic<bool>* cancelled) {
  const absl::Time started = absl::Now();
  absl::Duration compute;
  absl::Status status;
  if (cancelled != nullptr && cancelled->load()) {
    status = absl::CancelledError("call cancelled while queued");
  } else if (UntilDeadline(*call.context) <= absl::ZeroDuration()) {
    status = absl::DeadlineExceededError(
        "deadline passed while the call waited for a worker");
  } else {
    {
      // This call's share of the cores while it computes, no more
      // threads than its size keeps busy.
      ThreadBudget::Lease lease =
          config_.thread_budget->Acquire(UsefulThreads(call.cost.flops));
      CallSharedMemory shared_memory(config_.shared_memory);
      status = handle(CallControl{cancelled, &shared_memory});
    }
    compute = absl::Now() - started;
    if (status.ok()) config_.cost_model->Observe(call.cost.effort(), compute);
    call.context->AddTrailingMetadata(
        "attnserve-compute-us",
        std::to_string(absl::ToInt64Microseconds(compute)));
  }
  if (status.ok()) status = Serialize(*call.response, call.raw_response);
  Record(call.rpc, *call.request, call.response, status, call.arrived,
         started - call.arrived, compute, call.cost.flops);
  // Back to the pool first: once answered, the server may be destroyed.
  call.messages.reset();
  reactor->Finish(ToGrpcStatus(status));
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Refuse(
    const Call& call, const absl::Status& status) const {
  Record(call.rpc, *call.request, nullptr, status, call.arrived,
         absl::ZeroDuration(), absl::ZeroDuration(), 0);
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
      Record(RpcName(*request), *request, nullptr, status, arrived,
             absl::ZeroDuration(), absl::ZeroDuration(), 0);
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

absl::Status AttentionServiceImpl::Admit(
    const grpc::CallbackServerContext& context, const RequestCost& cost) const {
  if (draining_.load()) {
    last_refused_ns_.store(absl::ToUnixNanos(absl::Now()));
    return absl::UnavailableError(
        "server is shutting down; retry on another replica");
  }
  ATTN_RETURN_IF_ERROR(VerifyWithinLimits(cost, config_.max_tensor_elements,
                                          config_.max_request_bytes));
  const absl::Duration remaining = UntilDeadline(context);
  if (remaining <= absl::ZeroDuration()) {
    return absl::DeadlineExceededError(
        "deadline passed before the call started");
  }
  const absl::Duration estimate = config_.cost_model->Estimate(cost.effort());
  if (estimate > remaining) {
    return absl::DeadlineExceededError(
        absl::StrCat("call needs about ", absl::ToInt64Milliseconds(estimate),
                     " ms at this server's measured rate; the deadline is in ",
                     absl::ToInt64Milliseconds(remaining), " ms"));
  }
  return absl::OkStatus();
}

void AttentionServiceImpl::Record(const std::string& rpc,
                                  const google::protobuf::Message& request,
                                  const google::protobuf::Message* response,
                                  const absl::Status& status,
                                  absl::Time arrived, absl::Duration queue_wait,
                                  absl::Duration compute, double flops) const {
  const absl::Duration total = absl::Now() - arrived;
  const std::string code = absl::StatusCodeToString(status.code());
  const int64_t bytes = status.ok() && response != nullptr
                            ? static_cast<int64_t>(request.ByteSizeLong() +
                                                   response->ByteSizeLong())
                            : 0;
  config_.metrics->RecordCall(rpc, code, total, queue_wait, compute, flops,
                              bytes);
  if (config_.access_log) {
    std::string described = Describe(request);
    if (!described.empty()) described += ' ';
    std::fprintf(stderr, "access rpc=%s %sstatus=%s us=%lld\n", rpc.c_str(),
                 described.c_str(), code.c_str(),
                 static_cast<long long>(absl::ToInt64Microseconds(total)));
  }
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
        if (draining_.load()) {
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
