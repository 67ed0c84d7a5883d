#include "client/bench/decode.h"

#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/convert.h"
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

}  // namespace

absl::StatusOr<std::unique_ptr<DecodeSessions>> DecodeSessions::Open(
    AttnClient& client, const DecodeBenchOptions& options) {
  ATTN_RETURN_IF_ERROR(VerifyDecodeBenchOptions(options));
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
}

}  // namespace attnserve
