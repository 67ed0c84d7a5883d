#include "server/attention_service.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention.h"
#include "core/status_macros.h"
#include "core/thread_budget.h"
#include "proto/tensor_codec.h"
#include "server/grpc_status.h"

namespace attnserve {
namespace {

// A required tensor field.
absl::StatusOr<TensorView> Required(bool present, const v1::Tensor& tensor,
                                    absl::string_view field,
                                    const CallControl& control) {
  if (!present) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": missing"));
  }
  return DecodeTensor(tensor, field, control.shared_memory);
}

// An optional tensor field: absent stays absent.
absl::Status Optional(bool present, const v1::Tensor& tensor,
                      absl::string_view field, const CallControl& control,
                      std::optional<TensorView>* out) {
  if (!present) return absl::OkStatus();
  ATTN_ASSIGN_OR_RETURN(*out,
                        DecodeTensor(tensor, field, control.shared_memory));
  return absl::OkStatus();
}

#define ATTN_REQUIRED_TENSOR(msg, name, control) \
  Required((msg).has_##name(), (msg).name(), #name, (control))
#define ATTN_OPTIONAL_TENSOR(msg, name, control, out) \
  Optional((msg).has_##name(), (msg).name(), #name, (control), (out))

// Where a request's results go: its response, or the shared-memory regions
// it names.
template <typename Request, typename Response>
WireResults ResultsOf(const Request& request, Response* response,
                      v1::Tensor* weights, const CallControl& control) {
  return WireResults(
      response->mutable_output(), weights,
      request.has_result_regions() ? &request.result_regions() : nullptr,
      control.shared_memory);
}

// After a computation: the shared memory it read and wrote is still there.
absl::Status VerifySharedMemoryIntact(const CallControl& control) {
  return control.shared_memory != nullptr ? control.shared_memory->CheckIntact()
                                          : absl::OkStatus();
}

// The attention options both request messages carry, under the same names.
template <typename Request>
AttentionOptions AttentionOptionsOf(const Request& request) {
  AttentionOptions options;
  options.causal = request.causal();
  if (request.has_scale()) options.scale = request.scale();
  if (request.has_temperature()) options.temperature = request.temperature();
  options.return_weights = request.return_weights();
  options.compute_bf16 = request.compute_bf16();
  return options;
}

absl::StatusOr<MultiHeadWeights> DecodeWeights(const v1::AttentionWeights& w,
                                               const CallControl& c) {
  MultiHeadWeights weights;
  weights.num_heads = w.num_heads();
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(w, q_proj_weight, c, &weights.q_proj_weight));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(w, k_proj_weight, c, &weights.k_proj_weight));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(w, v_proj_weight, c, &weights.v_proj_weight));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(w, in_proj_weight, c, &weights.in_proj_weight));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(w, q_proj_bias, c, &weights.q_proj_bias));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(w, k_proj_bias, c, &weights.k_proj_bias));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(w, v_proj_bias, c, &weights.v_proj_bias));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(w, in_proj_bias, c, &weights.in_proj_bias));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(w, out_proj_weight, c, &weights.out_proj_weight));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(w, out_proj_bias, c, &weights.out_proj_bias));
  return weights;
}

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

}  // namespace

absl::Status HandleAttend(const v1::AttendRequest& request,
                          v1::AttendResponse* response,
                          const CallControl& control) {
  AttendInputs inputs;
  ATTN_ASSIGN_OR_RETURN(inputs.query,
                        ATTN_REQUIRED_TENSOR(request, query, control));
  ATTN_ASSIGN_OR_RETURN(inputs.key,
                        ATTN_REQUIRED_TENSOR(request, key, control));
  ATTN_ASSIGN_OR_RETURN(inputs.value,
                        ATTN_REQUIRED_TENSOR(request, value, control));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(request, attn_mask, control, &inputs.attn_mask));
  AttentionOptions options = AttentionOptionsOf(request);
  options.cancelled = control.cancelled;
  WireResults results =
      ResultsOf(request, response, response->mutable_weights(), control);
  ATTN_RETURN_IF_ERROR(Attend(inputs, options, results));
  if (!request.return_weights()) response->clear_weights();
  return VerifySharedMemoryIntact(control);
}

namespace {

// The served model a request names; null when it sends its weights inline.
absl::StatusOr<std::shared_ptr<const Model>> RequestedModel(
    const v1::MultiHeadAttendRequest& request, const ModelRepository* models) {
  switch (request.weights_source_case()) {
    case v1::MultiHeadAttendRequest::kModel:
      if (models == nullptr) {
        return absl::NotFoundError(absl::StrCat(
            "model: '", request.model(),
            "' not found: this server has no model repository; send the "
            "weights inline in `weights`"));
      }
      return models->Find(request.model());
    case v1::MultiHeadAttendRequest::kWeights:
      return nullptr;
    default:
      return absl::InvalidArgumentError(
          "weights: missing, expected either `model` or `weights`");
  }
}

// HandleMultiHeadAttend once the model is resolved (`model`: null for
// inline weights).
absl::Status RunMultiHeadAttend(const v1::MultiHeadAttendRequest& request,
                                const Model* model,
                                v1::MultiHeadAttendResponse* response,
                                const CallControl& control) {
  MultiHeadWeights weights;
  if (model == nullptr) {
    ATTN_ASSIGN_OR_RETURN(weights, DecodeWeights(request.weights(), control));
  }
  MultiHeadInputs inputs;
  ATTN_ASSIGN_OR_RETURN(inputs.query,
                        ATTN_REQUIRED_TENSOR(request, query, control));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(request, key, control, &inputs.key));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(request, value, control, &inputs.value));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(request, attn_mask, control, &inputs.attn_mask));
  ATTN_RETURN_IF_ERROR(ATTN_OPTIONAL_TENSOR(request, key_padding_mask, control,
                                            &inputs.key_padding_mask));
  MultiHeadOptions options;
  options.attention = AttentionOptionsOf(request);
  options.attention.cancelled = control.cancelled;
  options.average_weights = request.average_weights();
  WireResults results =
      ResultsOf(request, response, response->mutable_weights(), control);
  if (model != nullptr) {
    // The model's defaults fill what the request leaves unset.
    if (!options.attention.scale.has_value() &&
        model->config.has_default_scale()) {
      options.attention.scale = model->config.default_scale();
    }
    options.attention.causal |= model->config.default_causal();
    ATTN_RETURN_IF_ERROR(model->layer->Run(inputs, options, results));
  } else {
    ATTN_RETURN_IF_ERROR(MultiHeadAttend(weights, inputs, options, results));
  }
  if (!request.return_weights()) response->clear_weights();
  return VerifySharedMemoryIntact(control);
}

}  // namespace

absl::Status HandleMultiHeadAttend(const v1::MultiHeadAttendRequest& request,
                                   const ModelRepository* models,
                                   v1::MultiHeadAttendResponse* response,
                                   const CallControl& control) {
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                        RequestedModel(request, models));
  return RunMultiHeadAttend(request, model.get(), response, control);
}

absl::Status HandleLayerNorm(const v1::LayerNormRequest& request,
                             v1::LayerNormResponse* response,
                             const CallControl& control) {
  ATTN_ASSIGN_OR_RETURN(TensorView input,
                        ATTN_REQUIRED_TENSOR(request, input, control));
  std::optional<TensorView> gamma, beta;
  ATTN_RETURN_IF_ERROR(ATTN_OPTIONAL_TENSOR(request, gamma, control, &gamma));
  ATTN_RETURN_IF_ERROR(ATTN_OPTIONAL_TENSOR(request, beta, control, &beta));
  LayerNormOptions options;
  if (request.has_eps()) options.eps = request.eps();
  if (request.normalized_ndim() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("normalized_ndim: must be >= 0 (0 means 1), got ",
                     request.normalized_ndim()));
  }
  options.normalized_ndim =
      request.normalized_ndim() == 0 ? 1 : request.normalized_ndim();
  WireResults results = ResultsOf(request, response, nullptr, control);
  ATTN_RETURN_IF_ERROR(LayerNorm(input, gamma, beta, options, results));
  return VerifySharedMemoryIntact(control);
}

absl::Status HandleListModels(const ModelRepository* models,
                              v1::ListModelsResponse* response) {
  if (models == nullptr) return absl::OkStatus();
  for (const auto& model : models->List()) {
    v1::ListModelsResponse::Model* entry = response->add_models();
    entry->set_name(model->name);
    entry->set_num_heads(model->layer->num_heads());
    entry->set_embed_dim(model->layer->query_dim());
  }
  return absl::OkStatus();
}

absl::Status HandleGetModelMetadata(const v1::GetModelMetadataRequest& request,
                                    const ModelRepository* models,
                                    v1::GetModelMetadataResponse* response) {
  if (models == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("name: model '", request.name(),
                     "' not found: this server has no model repository"));
  }
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                        models->Find(request.name()));
  const MultiHeadLayer& layer = *model->layer;
  response->set_name(model->name);
  response->set_platform("attnserve_multi_head_attention");
  response->set_num_heads(layer.num_heads());
  response->set_query_dim(layer.query_dim());
  response->set_key_dim(layer.key_input_dim());
  response->set_value_dim(layer.value_input_dim());
  response->set_head_key_dim(layer.head_key_dim());
  response->set_head_value_dim(layer.head_value_dim());
  response->set_output_dim(layer.output_dim());
  response->set_compute_dtype(DTypeToProto(layer.compute_dtype()));
  response->set_description(model->config.description());
  const auto add = [](auto* list, const char* name, v1::DataType dtype,
                      std::initializer_list<int64_t> shape) {
    v1::TensorMetadata* t = list->Add();
    t->set_name(name);
    t->set_datatype(dtype);
    t->mutable_shape()->Assign(shape.begin(), shape.end());
  };
  const auto f32 = v1::DATA_TYPE_FLOAT32;
  add(response->mutable_inputs(), "query", f32, {-1, -1, layer.query_dim()});
  add(response->mutable_inputs(), "key", f32, {-1, -1, layer.key_input_dim()});
  add(response->mutable_inputs(), "value", f32,
      {-1, -1, layer.value_input_dim()});
  add(response->mutable_inputs(), "attn_mask", v1::DATA_TYPE_BOOL,
      {-1, layer.num_heads(), -1, -1});
  add(response->mutable_inputs(), "key_padding_mask", v1::DATA_TYPE_BOOL,
      {-1, -1});
  add(response->mutable_outputs(), "output", f32, {-1, -1, layer.output_dim()});
  add(response->mutable_outputs(), "weights", f32,
      {-1, layer.num_heads(), -1, -1});
  return absl::OkStatus();
}

namespace {

absl::Status NoSharedMemory() {
  return absl::FailedPreconditionError(
      "shared memory is off on this server (--max_shared_memory_mb=0)");
}

}  // namespace

absl::Status HandleRegisterSharedMemory(
    const v1::RegisterSharedMemoryRequest& request,
    SharedMemoryRegistry* registry) {
  if (registry == nullptr) return NoSharedMemory();
  const v1::SharedMemoryRegion& region = request.region();
  return registry->Register(SharedMemoryRegionInfo{
      region.name(), region.key(), region.offset(), region.byte_size()});
}

absl::Status HandleListSharedMemory(const v1::ListSharedMemoryRequest& request,
                                    const SharedMemoryRegistry* registry,
                                    v1::ListSharedMemoryResponse* response) {
  if (registry == nullptr) return NoSharedMemory();
  ATTN_ASSIGN_OR_RETURN(std::vector<SharedMemoryRegionInfo> regions,
                        registry->List(request.name()));
  for (const SharedMemoryRegionInfo& info : regions) {
    v1::SharedMemoryRegion* region = response->add_regions();
    region->set_name(info.name);
    region->set_key(info.key);
    region->set_offset(info.offset);
    region->set_byte_size(info.byte_size);
  }
  return absl::OkStatus();
}

// Idle message pairs kept per RPC, and their capacity: enough for the calls
// a busy server has in flight, small next to what those calls compute with.
constexpr size_t kPooledMessages = 64;
constexpr size_t kPooledBytes = size_t{64} << 20;

AttentionServiceImpl::AttentionServiceImpl(const ServiceConfig& config)
    : config_(config),
      attend_messages_(kPooledMessages, kPooledBytes),
      multi_head_messages_(kPooledMessages, kPooledBytes),
      layer_norm_messages_(kPooledMessages, kPooledBytes) {
  SetMessageAllocatorFor_Attend(&attend_messages_);
  SetMessageAllocatorFor_MultiHeadAttend(&multi_head_messages_);
  SetMessageAllocatorFor_LayerNorm(&layer_norm_messages_);
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

template <typename Request, typename Response, typename Handler>
grpc::ServerUnaryReactor* AttentionServiceImpl::Serve(
    grpc::CallbackServerContext* context, const Request* request,
    Response* response, const RequestCost& cost, Handler handle) {
  const absl::Time arrived = absl::Now();
  // "AttendRequest" -> "Attend".
  std::string rpc = Request::descriptor()->name();
  rpc.resize(rpc.size() - std::string_view("Request").size());
  absl::Status admitted = Authenticate(*context);
  if (admitted.ok()) admitted = Admit(*context, cost);
  if (!admitted.ok()) {
    Record(rpc, *request, nullptr, admitted, arrived, absl::ZeroDuration(),
           absl::ZeroDuration(), 0);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(admitted));
    return reactor;
  }
  // Computes the call and answers it through `reactor`. `cancelled`: set
  // when the client cancels or the deadline passes; null for calls too
  // short to be worth stopping.
  auto run = [this, context, request, response, cost, handle, arrived, rpc](
                 grpc::ServerUnaryReactor* reactor,
                 const std::atomic<bool>* cancelled) {
    const absl::Time started = absl::Now();
    absl::Duration compute;
    absl::Status status;
    if (cancelled != nullptr && cancelled->load()) {
      status = absl::CancelledError("call cancelled while queued");
    } else if (UntilDeadline(*context) <= absl::ZeroDuration()) {
      status = absl::DeadlineExceededError(
          "deadline passed while the call waited for a worker");
    } else {
      {
        // This call's share of the cores while it computes, no more
        // threads than its size keeps busy.
        ThreadBudget::Lease lease =
            ThreadBudget::Global().Acquire(UsefulThreads(cost.flops));
        CallSharedMemory shared_memory(config_.shared_memory);
        status =
            handle(*request, response, CallControl{cancelled, &shared_memory});
      }
      compute = absl::Now() - started;
      if (status.ok()) config_.cost_model->Observe(cost.flops, compute);
      context->AddTrailingMetadata(
          "attnserve-compute-us",
          std::to_string(absl::ToInt64Microseconds(compute)));
    }
    if (!status.ok()) response->Clear();
    Record(rpc, *request, response, status, arrived, started - arrived, compute,
           cost.flops);
    reactor->Finish(ToGrpcStatus(status));
  };
  // A tiny call computes in less time than a hand-over to a worker takes,
  // and on gRPC's default reactor: a reactor of our own that watches for
  // cancellation costs gRPC about 15 us of CPU per call, several times
  // what such a call computes.
  if (cost.flops < kRunInlineFlops) {
    grpc::ServerUnaryReactor* reactor = nullptr;
    if (config_.scheduler->RunHereIfIdle([&] {
          reactor = context->DefaultReactor();
          run(reactor, nullptr);
        })) {
      return reactor;
    }
  }
  auto* reactor = new CallReactor();
  const bool queued = config_.scheduler->Submit(
      [run, reactor] { run(reactor, reactor->cancelled()); });
  if (!queued) {
    const absl::Status busy = absl::ResourceExhaustedError(
        absl::StrCat("server busy: ", config_.scheduler->max_inflight(),
                     " calls computing and ", config_.scheduler->max_queue(),
                     " waiting (--max_inflight, --max_queue); retry later"));
    Record(rpc, *request, nullptr, busy, arrived, absl::ZeroDuration(),
           absl::ZeroDuration(), 0);
    reactor->Finish(ToGrpcStatus(busy));
  }
  return reactor;
}

// Calls that only read server state run on gRPC's thread.
template <typename Response>
grpc::ServerUnaryReactor* ServeInline(grpc::CallbackServerContext* context,
                                      Response* response, absl::Status status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!status.ok()) response->Clear();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
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
  // Looked up once, for the cost estimate and the computation: the call
  // keeps these weights even if the repository reloads meanwhile.
  absl::StatusOr<std::shared_ptr<const Model>> model =
      RequestedModel(*request, config_.models);
  const MultiHeadLayer* layer =
      model.ok() && *model != nullptr ? (*model)->layer.get() : nullptr;
  return Serve(context, request, response, CostOf(*request, layer),
               [model = std::move(model)](const v1::MultiHeadAttendRequest& r,
                                          v1::MultiHeadAttendResponse* out,
                                          const CallControl& control) {
                 if (!model.ok()) return model.status();
                 return RunMultiHeadAttend(r, model->get(), out, control);
               });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::LayerNorm(
    grpc::CallbackServerContext* context, const v1::LayerNormRequest* request,
    v1::LayerNormResponse* response) {
  return Serve(context, request, response, CostOf(*request), &HandleLayerNorm);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(
    grpc::CallbackServerContext* context, const v1::ListModelsRequest*,
    v1::ListModelsResponse* response) {
  absl::Status status = Authenticate(*context);
  if (status.ok()) status = HandleListModels(config_.models, response);
  return ServeInline(context, response, status);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModelMetadata(
    grpc::CallbackServerContext* context,
    const v1::GetModelMetadataRequest* request,
    v1::GetModelMetadataResponse* response) {
  absl::Status status = Authenticate(*context);
  if (status.ok()) {
    status = HandleGetModelMetadata(*request, config_.models, response);
  }
  return ServeInline(context, response, status);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::RegisterSharedMemory(
    grpc::CallbackServerContext* context,
    const v1::RegisterSharedMemoryRequest* request,
    v1::RegisterSharedMemoryResponse* response) {
  absl::Status status = Authenticate(*context);
  if (status.ok()) {
    status = HandleRegisterSharedMemory(*request, config_.shared_memory);
  }
  return ServeInline(context, response, status);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::UnregisterSharedMemory(
    grpc::CallbackServerContext* context,
    const v1::UnregisterSharedMemoryRequest* request,
    v1::UnregisterSharedMemoryResponse* response) {
  absl::Status status = Authenticate(*context);
  if (status.ok()) {
    status = config_.shared_memory != nullptr
                 ? config_.shared_memory->Unregister(request->name())
                 : NoSharedMemory();
  }
  return ServeInline(context, response, status);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListSharedMemory(
    grpc::CallbackServerContext* context,
    const v1::ListSharedMemoryRequest* request,
    v1::ListSharedMemoryResponse* response) {
  absl::Status status = Authenticate(*context);
  if (status.ok()) {
    status = HandleListSharedMemory(*request, config_.shared_memory, response);
  }
  return ServeInline(context, response, status);
}

absl::Status AttentionServiceImpl::Authenticate(
    const grpc::CallbackServerContext& context) const {
  return config_.auth != nullptr ? config_.auth->Check(context)
                                 : absl::OkStatus();
}

}  // namespace attnserve
