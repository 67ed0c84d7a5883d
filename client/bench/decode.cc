#include "client/bench/decode.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/bench/blocking_transports.h"
#include "core/convert.h"
#include "core/dtype.h"
#include "core/status_macros.h"
#include "proto/tensor_codec.h"

namespace attnserve {
namespace {

// Seeded uniform values in [-1, 1) as a wire tensor.
absl::Status RandomWire(Shape shape, DType dtype, std::mt19937& random,
                        v1::Tensor* out) {
  ATTN_ASSIGN_OR_RETURN(Tensor t,
                        RandomUniform(std::move(shape), dtype, &random));
  EncodeTensor(t.view(), out);
  return absl::OkStatus();
}

// The dtype attention sessions compute in for inputs of `dtype`: bfloat16
// inputs compute in bfloat16, every other dtype in float32.
DType ComputeDType(DType dtype) {
  return dtype == DType::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
}

// A step of `tokens` new tokens with random inputs for `session`.
absl::StatusOr<v1::SessionStepRequest> StepRequest(
    const v1::CreateSessionResponse& session, int64_t embed, int64_t tokens,
    DType dtype, std::mt19937& random) {
  v1::SessionStepRequest step;
  step.set_session_id(session.session_id());
  if (embed > 0) {
    ATTN_RETURN_IF_ERROR(
        RandomWire({1, tokens, embed}, dtype, random, step.mutable_input()));
    return step;
  }
  const int64_t d = session.head_dim(), dv = session.value_head_dim();
  ATTN_RETURN_IF_ERROR(RandomWire({1, session.num_heads(), tokens, d}, dtype,
                                  random, step.mutable_query()));
  ATTN_RETURN_IF_ERROR(RandomWire({1, session.num_kv_heads(), tokens, d}, dtype,
                                  random, step.mutable_key()));
  ATTN_RETURN_IF_ERROR(RandomWire({1, session.num_kv_heads(), tokens, dv},
                                  dtype, random, step.mutable_value()));
  return step;
}

// Sends `batched` once (one SessionStep call of its only step when
// `batch_sessions` is 0) and fails with the first step's error: the load
// test counts calls, and a SessionSteps call succeeds even when its steps
// fail, so a step the server refuses must stop the benchmark here.
absl::Status CheckStep(AttnClient& client,
                       const v1::SessionStepsRequest& batched,
                       int batch_sessions) {
  if (batch_sessions == 0) {
    return client.SessionStep(batched.steps(0)).status();
  }
  ATTN_ASSIGN_OR_RETURN(v1::SessionStepsResponse response,
                        client.SessionSteps(batched));
  for (int i = 0; i < response.results_size(); ++i) {
    const v1::SessionStepResult& result = response.results(i);
    if (result.code() == 0) continue;
    return absl::Status(
        static_cast<absl::StatusCode>(result.code()),
        absl::StrCat("SessionSteps step ", i, " (layer ",
                     batched.steps(i).layer(), "): ", result.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DecodeProtocol> ParseDecodeProtocol(absl::string_view text) {
  if (text == "native") return DecodeProtocol::kNative;
  if (text == "open_inference") return DecodeProtocol::kOpenInference;
  if (text == "open_inference_stream") {
    return DecodeProtocol::kOpenInferenceStream;
  }
  if (text == "open_inference_http") return DecodeProtocol::kOpenInferenceHttp;
  return absl::InvalidArgumentError(
      absl::StrCat("--protocol: '", text,
                   "' is not one of native, open_inference, "
                   "open_inference_stream, open_inference_http"));
}

namespace {

// The native flags a sequence of the Open Inference Protocol has no
// counterpart for.
absl::Status VerifySequenceOptions(const DecodeBenchOptions& options) {
  if (options.batch_sessions != 0) {
    return absl::InvalidArgumentError(
        "--batch_sessions: a ModelInfer request steps one sequence; only "
        "with --protocol=native");
  }
  if (options.layers != 1) {
    return absl::InvalidArgumentError(
        "--layers: a sequence holds one layer; only with --protocol=native");
  }
  if (options.cache_dtype.has_value() && !options.model.empty()) {
    return absl::InvalidArgumentError(
        "--cache_dtype: a served model's sequences cache its configured "
        "dtype; only with --protocol=native");
  }
  if (options.cache_dtype == DType::kInt8) {
    return absl::InvalidArgumentError(
        "--cache_dtype: sequences of attention_session cache FP32 or BF16; "
        "INT8 only with --protocol=native");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status VerifyDecodeBenchOptions(const DecodeBenchOptions& options) {
  ATTN_RETURN_IF_ERROR(RequirePositive(options.kv_seq, "--kv_seq"));
  ATTN_RETURN_IF_ERROR(RequirePositive(options.step_tokens, "--seq"));
  ATTN_RETURN_IF_ERROR(RequirePositive(options.sessions, "--connections"));
  if (options.batch_sessions < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--batch_sessions: must be >= 0, got ", options.batch_sessions));
  }
  if (options.layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--layers: ", options.layers, " is not >= 1"));
  }
  if (options.model.empty()) {
    ATTN_RETURN_IF_ERROR(RequirePositive(options.heads, "--heads"));
    ATTN_RETURN_IF_ERROR(RequirePositive(options.head_dim, "--dim"));
  }
  if (options.protocol != DecodeProtocol::kNative) {
    ATTN_RETURN_IF_ERROR(VerifySequenceOptions(options));
  }
  const bool http = options.protocol == DecodeProtocol::kOpenInferenceHttp;
  if (http == options.http_target.empty()) {
    return absl::InvalidArgumentError(
        http ? "--http_target: the server's HTTP address (HOST:PORT) is "
               "needed with --protocol=open_inference_http"
             : "--http_target: only with --protocol=open_inference_http");
  }
  if (!options.cache_dtype.has_value()) return absl::OkStatus();
  const DType cache = *options.cache_dtype;
  if (cache != DType::kFloat32 && cache != DType::kBFloat16 &&
      cache != DType::kInt8) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cache_dtype: ", DTypeName(cache),
                     " is not one of FLOAT32, BFLOAT16, INT8"));
  }
  // A model's compute dtype is the server's to check.
  const DType compute = ComputeDType(options.dtype);
  if (options.model.empty() && cache != DType::kInt8 && cache != compute) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cache_dtype: ", DTypeName(cache),
                     " is not the sessions' compute "
                     "dtype ",
                     DTypeName(compute),
                     " (from --dtype); a cache stores the "
                     "compute dtype or INT8"));
  }
  return absl::OkStatus();
}

namespace {

// The sessions' CreateSession request, their model's embedding (0 for
// attention sessions) and a description of their shape.
struct SessionShape {
  v1::CreateSessionRequest create;
  int64_t embed = 0;
  std::string description;
};

absl::StatusOr<SessionShape> ShapeOfSessions(
    AttnClient& client, const DecodeBenchOptions& options) {
  SessionShape shape;
  if (!options.model.empty()) {
    ATTN_ASSIGN_OR_RETURN(auto metadata,
                          client.GetModelMetadata(options.model));
    shape.embed = metadata.query_dim();
    shape.create.set_model(options.model);
    shape.description =
        absl::StrCat("model=", options.model, " input=[1, ",
                     options.step_tokens, ", ", shape.embed, "]");
  } else {
    shape.create.set_num_heads(static_cast<int32_t>(options.heads));
    shape.create.set_num_kv_heads(static_cast<int32_t>(options.kv_heads));
    shape.create.set_head_dim(options.head_dim);
    shape.create.set_dtype(DTypeToProto(ComputeDType(options.dtype)));
    shape.description = absl::StrCat(
        "heads=", options.heads,
        " kv_heads=", options.kv_heads > 0 ? options.kv_heads : options.heads,
        " head_dim=", options.head_dim, " ", DTypeName(options.dtype));
  }
  if (options.cache_dtype.has_value()) {
    shape.create.set_cache_dtype(DTypeToProto(*options.cache_dtype));
    absl::StrAppend(&shape.description, " cache ",
                    DTypeName(*options.cache_dtype));
  }
  shape.create.set_num_layers(options.layers);
  shape.create.set_max_length(options.kv_seq + options.step_tokens);
  return shape;
}

// Adds `name` to `request`'s inputs, its values in raw_input_contents.
void AddInput(const std::string& name, const Tensor& tensor,
              inference::ModelInferRequest* request) {
  inference::ModelInferRequest::InferInputTensor* input = request->add_inputs();
  input->set_name(name);
  input->set_datatype(std::string(DTypeInfoOf(tensor.dtype()).protocol));
  for (int64_t d : tensor.shape()) input->add_shape(d);
  request->add_raw_input_contents(static_cast<const char*>(tensor.data()),
                                  tensor.num_bytes());
}

// A request of sequence `id` of `model` stepping `tokens` new tokens with
// random inputs of the sessions' `shape`: hidden states [1, n, E] for a
// served model's sequences, else query, key and value [1, heads, n, d].
absl::StatusOr<inference::ModelInferRequest> SequenceRequest(
    const std::string& model, uint64_t id, const SessionShape& shape,
    int64_t tokens, DType dtype, std::mt19937& random) {
  inference::ModelInferRequest request;
  request.set_model_name(model);
  (*request.mutable_parameters())["sequence_id"].set_uint64_param(id);
  if (shape.embed > 0) {
    ATTN_ASSIGN_OR_RETURN(
        Tensor input, RandomUniform({1, tokens, shape.embed}, dtype, &random));
    AddInput("query", input, &request);
    return request;
  }
  const v1::CreateSessionRequest& create = shape.create;
  const int64_t heads = create.num_heads();
  const int64_t kv_heads =
      create.num_kv_heads() > 0 ? create.num_kv_heads() : heads;
  const int64_t d = create.head_dim();
  const std::pair<const char*, int64_t> inputs[] = {
      {"query", heads}, {"key", kv_heads}, {"value", kv_heads}};
  for (const auto& [name, h] : inputs) {
    ATTN_ASSIGN_OR_RETURN(Tensor t,
                          RandomUniform({1, h, tokens, d}, dtype, &random));
    AddInput(name, t, &request);
  }
  return request;
}

}  // namespace

namespace {

// A measured step as its transport sends it: the serialized request, or
// for HTTP the whole HTTP request.
absl::StatusOr<std::string> StepBytes(const inference::ModelInferRequest& step,
                                      const DecodeBenchOptions& options) {
  if (options.protocol == DecodeProtocol::kOpenInferenceHttp) {
    return HttpInferRequest(step, options.http_target, options.client);
  }
  std::string bytes;
  if (!step.SerializeToString(&bytes)) {
    return absl::InternalError("step request: could not serialize");
  }
  return bytes;
}

}  // namespace

absl::Status DecodeSessions::StartSequences(const DecodeBenchOptions& options) {
  ATTN_ASSIGN_OR_RETURN(SessionShape shape, ShapeOfSessions(client_, options));
  const std::string model = options.model.empty()
                                ? std::string("attention_session")
                                : absl::StrCat(options.model, "_session");
  // Ids of their own, so that two benchmarks of one server never meet.
  std::mt19937 random(1);
  const uint64_t first_id =
      (static_cast<uint64_t>(std::random_device()()) << 32) | 1;
  for (int c = 0; c < options.sessions; ++c) {
    const uint64_t id = first_id + static_cast<uint64_t>(c);
    ATTN_ASSIGN_OR_RETURN(inference::ModelInferRequest start,
                          SequenceRequest(model, id, shape, options.kv_seq,
                                          options.dtype, random));
    auto& parameters = *start.mutable_parameters();
    parameters["sequence_start"].set_bool_param(true);
    parameters["max_length"].set_int64_param(shape.create.max_length());
    if (options.cache_dtype.has_value()) {
      parameters["dtype"].set_string_param(
          std::string(DTypeInfoOf(*options.cache_dtype).protocol));
    }
    ATTN_RETURN_IF_ERROR(client_.ModelInfer(start).status());
    ATTN_ASSIGN_OR_RETURN(inference::ModelInferRequest step,
                          SequenceRequest(model, id, shape, options.step_tokens,
                                          options.dtype, random));
    (*step.mutable_parameters())["sequence_position"].set_int64_param(
        options.kv_seq);
    sequence_ends_.push_back(step);
    (*sequence_ends_.back().mutable_parameters())["sequence_end"]
        .set_bool_param(true);
    ATTN_RETURN_IF_ERROR(client_.ModelInfer(step).status());
    ATTN_ASSIGN_OR_RETURN(std::string bytes, StepBytes(step, options));
    workload_.per_connection.push_back({std::move(bytes)});
  }
  workload_.rpc = "ModelInfer";
  workload_.method = absl::StrCat(
      "/", inference::GRPCInferenceService::service_full_name(), "/ModelInfer");
  workload_.request = workload_.per_connection.front().front();
  workload_.statistics_model = model;
  workload_.description = absl::StrCat(
      "decode over Open Inference sequences of ", model, ": ",
      options.step_tokens, " token(s) a step after ", options.kv_seq,
      " cached, ", shape.description, ", ", options.sessions, " sequence(s)");
  SetTransport(options);
  return absl::OkStatus();
}

void DecodeSessions::SetTransport(const DecodeBenchOptions& options) {
  const ClientOptions client = options.client;
  switch (options.protocol) {
    case DecodeProtocol::kOpenInferenceStream:
      workload_.rpc = "ModelStreamInfer";
      workload_.connect = [client](int) {
        return OpenStreamConnection(client);
      };
      break;
    case DecodeProtocol::kOpenInferenceHttp:
      workload_.rpc = "HTTP infer";
      workload_.connect = [client, target = options.http_target](int) {
        return OpenHttpConnection(target, client);
      };
      break;
    default:
      return;
  }
  absl::StrAppend(&workload_.description, " (", workload_.rpc, ")");
}

absl::StatusOr<std::unique_ptr<DecodeSessions>> DecodeSessions::Open(
    AttnClient& client, const DecodeBenchOptions& options) {
  ATTN_RETURN_IF_ERROR(VerifyDecodeBenchOptions(options));
  if (options.protocol != DecodeProtocol::kNative) {
    std::unique_ptr<DecodeSessions> sequences(new DecodeSessions(client));
    ATTN_RETURN_IF_ERROR(sequences->StartSequences(options));
    return sequences;
  }
  const int per_call = std::max(options.batch_sessions, 1);
  ATTN_ASSIGN_OR_RETURN(SessionShape shape, ShapeOfSessions(client, options));
  const v1::CreateSessionRequest& create = shape.create;
  const int64_t embed = shape.embed;
  const std::string& shapes = shape.description;
  std::unique_ptr<DecodeSessions> sessions(new DecodeSessions(client));
  std::mt19937 random(1);
  for (int c = 0; c < options.sessions; ++c) {
    // One request per layer: its step of each of the connection's sessions.
    std::vector<v1::SessionStepsRequest> layers(options.layers);
    for (int i = 0; i < per_call; ++i) {
      ATTN_ASSIGN_OR_RETURN(v1::CreateSessionResponse session,
                            client.CreateSession(create));
      sessions->ids_.push_back(session.session_id());
      for (int layer = 0; layer < options.layers; ++layer) {
        ATTN_ASSIGN_OR_RETURN(
            v1::SessionStepRequest prefill,
            StepRequest(session, embed, options.kv_seq, options.dtype, random));
        prefill.set_layer(layer);
        ATTN_RETURN_IF_ERROR(client.SessionStep(prefill).status());
        ATTN_ASSIGN_OR_RETURN(v1::SessionStepRequest step,
                              StepRequest(session, embed, options.step_tokens,
                                          options.dtype, random));
        step.set_position(options.kv_seq);
        step.set_layer(layer);
        *layers[layer].add_steps() = std::move(step);
      }
    }
    std::vector<std::string>& cycle =
        sessions->workload_.per_connection.emplace_back();
    for (const v1::SessionStepsRequest& batched : layers) {
      ATTN_RETURN_IF_ERROR(CheckStep(client, batched, options.batch_sessions));
      std::string bytes;
      const bool serialized = options.batch_sessions > 0
                                  ? batched.SerializeToString(&bytes)
                                  : batched.steps(0).SerializeToString(&bytes);
      if (!serialized) {
        return absl::InternalError("step request: could not serialize");
      }
      cycle.push_back(std::move(bytes));
    }
  }
  Workload& workload = sessions->workload_;
  workload.rpc = options.batch_sessions > 0 ? "SessionSteps" : "SessionStep";
  workload.method = absl::StrCat("/", v1::AttentionService::service_full_name(),
                                 "/", workload.rpc);
  workload.request = workload.per_connection.front().front();
  workload.steps_per_request = per_call;
  workload.layers = options.layers;
  workload.description = absl::StrCat(
      "decode: ", options.step_tokens, " token(s) a step after ",
      options.kv_seq, " cached, ", shapes, ", ", options.sessions * per_call,
      " session(s)",
      options.layers > 1
          ? absl::StrCat(" of ", options.layers, " layers (a token is ",
                         options.layers, " calls, one per layer)")
          : "",
      options.batch_sessions > 0
          ? absl::StrCat(", ", per_call, " stepped by each call")
          : "");
  return sessions;
}

DecodeSessions::~DecodeSessions() {
  for (const std::string& id : ids_) client_.DeleteSession(id).IgnoreError();
  for (const inference::ModelInferRequest& end : sequence_ends_) {
    client_.ModelInfer(end).IgnoreError();
  }
}

}  // namespace attnserve
