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
#include "core/tensor.h"
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

// Calls below this many FLOPs (LayerNorm of a few thousand elements, a
// few-token attention) run on gRPC's thread when a worker slot is free:
// they finish in a few microseconds, less than waking a worker costs.
constexpr double kRunInlineFlops = 1e6;

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
// the model it names, for the access log.
std::string Describe(const google::protobuf::Message& request) {
  std::string out;
  const google::protobuf::Reflection* reflection = request.GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(request, &fields);
  for (const google::protobuf::FieldDescriptor* field : fields) {
    if (field->name() == "model") {
      absl::StrAppend(&out, out.empty() ? "" : " ",
                      "model=", reflection->GetString(request, field));
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

// Idle message pairs kept per RPC, and their capacity: enough for the calls
// a busy server has in flight, small next to what those calls compute with.
constexpr size_t kPooledMessages = 64;
constexpr size_t kPooledBytes = size_t{64} << 20;

}  // namespace

struct AttentionServiceImpl::Call {
  grpc::CallbackServerContext* context;
  const google::protobuf::Message* request;
  google::protobuf::Message* response;
  std::string rpc;  // for the metrics and the access log
  RequestCost cost;
  absl::Time arrived;
};

AttentionServiceImpl::AttentionServiceImpl(const ServiceConfig& config)
    : config_(config),
      attend_messages_(kPooledMessages, kPooledBytes),
      multi_head_messages_(kPooledMessages, kPooledBytes),
      layer_norm_messages_(kPooledMessages, kPooledBytes) {
  SetMessageAllocatorFor_Attend(&attend_messages_);
  SetMessageAllocatorFor_MultiHeadAttend(&multi_head_messages_);
  SetMessageAllocatorFor_LayerNorm(&layer_norm_messages_);
}

template <typename Request, typename Response, typename Handler>
grpc::ServerUnaryReactor* AttentionServiceImpl::Serve(
    grpc::CallbackServerContext* context, const Request* request,
    Response* response, const RequestCost& cost, Handler handle) {
  const absl::Time arrived = absl::Now();
  return Dispatch(
      Call{context, request, response, RpcName(*request), cost, arrived},
      [request, response,
       handle = std::move(handle)](const CallControl& control) {
        return handle(*request, response, control);
      });
}

template <typename BoundHandler>
grpc::ServerUnaryReactor* AttentionServiceImpl::Dispatch(Call call,
                                                         BoundHandler handle) {
  absl::Status admitted = Authenticate(*call.context);
  if (admitted.ok()) admitted = Admit(*call.context, call.cost);
  if (!admitted.ok()) {
    Record(call.rpc, *call.request, nullptr, admitted, call.arrived,
           absl::ZeroDuration(), absl::ZeroDuration(), 0);
    grpc::ServerUnaryReactor* reactor = call.context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(admitted));
    return reactor;
  }
  // A tiny call computes in less time than a hand-over to a worker takes,
  // and on gRPC's default reactor: a reactor of our own that watches for
  // cancellation costs gRPC about 15 us of CPU per call, several times
  // what such a call computes.
  if (call.cost.flops < kRunInlineFlops) {
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
  auto queued_call = std::make_shared<const Call>(std::move(call));
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
    const Call& call,
    absl::FunctionRef<absl::Status(const CallControl&)> handle,
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
    if (status.ok()) config_.cost_model->Observe(call.cost.flops, compute);
    call.context->AddTrailingMetadata(
        "attnserve-compute-us",
        std::to_string(absl::ToInt64Microseconds(compute)));
  }
  if (!status.ok()) call.response->Clear();
  Record(call.rpc, *call.request, call.response, status, call.arrived,
         started - call.arrived, compute, call.cost.flops);
  reactor->Finish(ToGrpcStatus(status));
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ServeInline(
    grpc::CallbackServerContext* context, google::protobuf::Message* response,
    absl::FunctionRef<absl::Status()> handle) {
  absl::Status status = Authenticate(*context);
  if (status.ok()) status = handle();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!status.ok()) response->Clear();
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
  if (cost.largest_tensor > config_.max_tensor_elements) {
    return absl::ResourceExhaustedError(
        absl::StrCat("request: a tensor of ", cost.largest_tensor,
                     " elements exceeds --max_tensor_elements ",
                     config_.max_tensor_elements));
  }
  if (cost.bytes > config_.max_request_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request: needs about ", cost.bytes >> 20,
        " MiB for results and intermediates, above --max_request_memory_mb ",
        config_.max_request_bytes >> 20));
  }
  const absl::Duration remaining = UntilDeadline(context);
  if (remaining <= absl::ZeroDuration()) {
    return absl::DeadlineExceededError(
        "deadline passed before the call started");
  }
  const absl::Duration estimate = config_.cost_model->Estimate(cost.flops);
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
    std::fprintf(stderr, "access rpc=%s %s status=%s us=%lld\n", rpc.c_str(),
                 Describe(request).c_str(), code.c_str(),
                 static_cast<long long>(absl::ToInt64Microseconds(total)));
  }
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(
    grpc::CallbackServerContext* context, const v1::AttendRequest* request,
    v1::AttendResponse* response) {
  return Serve(context, request, response, CostOf(*request), &HandleAttend);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::MultiHeadAttend(
    grpc::CallbackServerContext* context,
    const v1::MultiHeadAttendRequest* request,
    v1::MultiHeadAttendResponse* response) {
  MultiHeadAttendHandler handle(*request, config_.models);
  return Serve(context, request, response, CostOf(*request, handle.layer()),
               std::move(handle));
}

grpc::ServerUnaryReactor* AttentionServiceImpl::LayerNorm(
    grpc::CallbackServerContext* context, const v1::LayerNormRequest* request,
    v1::LayerNormResponse* response) {
  return Serve(context, request, response, CostOf(*request), &HandleLayerNorm);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(
    grpc::CallbackServerContext* context, const v1::ListModelsRequest*,
    v1::ListModelsResponse* response) {
  return ServeInline(context, response, [&] {
    return HandleListModels(config_.models, response);
  });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModelMetadata(
    grpc::CallbackServerContext* context,
    const v1::GetModelMetadataRequest* request,
    v1::GetModelMetadataResponse* response) {
  return ServeInline(context, response, [&] {
    return HandleGetModelMetadata(*request, config_.models, response);
  });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::RegisterSharedMemory(
    grpc::CallbackServerContext* context,
    const v1::RegisterSharedMemoryRequest* request,
    v1::RegisterSharedMemoryResponse* response) {
  return ServeInline(context, response, [&] {
    return HandleRegisterSharedMemory(*request, config_.shared_memory);
  });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::UnregisterSharedMemory(
    grpc::CallbackServerContext* context,
    const v1::UnregisterSharedMemoryRequest* request,
    v1::UnregisterSharedMemoryResponse* response) {
  return ServeInline(context, response, [&] {
    return HandleUnregisterSharedMemory(*request, config_.shared_memory);
  });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListSharedMemory(
    grpc::CallbackServerContext* context,
    const v1::ListSharedMemoryRequest* request,
    v1::ListSharedMemoryResponse* response) {
  return ServeInline(context, response, [&] {
    return HandleListSharedMemory(*request, config_.shared_memory, response);
  });
}

}  // namespace attnserve
