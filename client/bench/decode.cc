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

}  // namespace

absl::StatusOr<std::unique_ptr<DecodeSessions>> DecodeSessions::Open(
    AttnClient& client, const DecodeBenchOptions& options) {
  ATTN_RETURN_IF_ERROR(RequirePositive(options.kv_seq, "--kv_seq"));
  ATTN_RETURN_IF_ERROR(RequirePositive(options.step_tokens, "--seq"));
  ATTN_RETURN_IF_ERROR(RequirePositive(options.sessions, "--connections"));
  if (options.batch_sessions < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--batch_sessions: must be >= 0, got ", options.batch_sessions));
  }
  const int per_call = std::max(options.batch_sessions, 1);
  v1::CreateSessionRequest create;
  int64_t embed = 0;
  std::string shapes;
  if (!options.model.empty()) {
    ATTN_ASSIGN_OR_RETURN(auto metadata,
                          client.GetModelMetadata(options.model));
    embed = metadata.query_dim();
    create.set_model(options.model);
    shapes = absl::StrCat("model=", options.model, " input=[1, ",
                          options.step_tokens, ", ", embed, "]");
  } else {
    ATTN_RETURN_IF_ERROR(RequirePositive(options.heads, "--heads"));
    ATTN_RETURN_IF_ERROR(RequirePositive(options.head_dim, "--dim"));
    create.set_num_heads(static_cast<int32_t>(options.heads));
    create.set_num_kv_heads(static_cast<int32_t>(options.kv_heads));
    create.set_head_dim(options.head_dim);
    create.set_dtype(options.dtype == DType::kBFloat16 ? v1::DATA_TYPE_BFLOAT16
                                                       : v1::DATA_TYPE_FLOAT32);
    shapes = absl::StrCat(
        "heads=", options.heads,
        " kv_heads=", options.kv_heads > 0 ? options.kv_heads : options.heads,
        " head_dim=", options.head_dim, " ", DTypeName(options.dtype));
  }
  create.set_max_length(options.kv_seq + options.step_tokens);
  std::unique_ptr<DecodeSessions> sessions(new DecodeSessions(client));
  std::mt19937 random(1);
  v1::SessionStepsRequest batched;
  for (int i = 0; i < options.sessions * per_call; ++i) {
    ATTN_ASSIGN_OR_RETURN(v1::CreateSessionResponse session,
                          client.CreateSession(create));
    sessions->ids_.push_back(session.session_id());
    ATTN_ASSIGN_OR_RETURN(
        v1::SessionStepRequest prefill,
        StepRequest(session, embed, options.kv_seq, options.dtype, random));
    ATTN_RETURN_IF_ERROR(client.SessionStep(prefill).status());
    ATTN_ASSIGN_OR_RETURN(v1::SessionStepRequest step,
                          StepRequest(session, embed, options.step_tokens,
                                      options.dtype, random));
    step.set_position(options.kv_seq);
    if (i % per_call == 0) batched.Clear();
    *batched.add_steps() = step;
    if (i % per_call != per_call - 1) continue;
    std::string bytes;
    const bool serialized = options.batch_sessions > 0
                                ? batched.SerializeToString(&bytes)
                                : step.SerializeToString(&bytes);
    if (!serialized) {
      return absl::InternalError("step request: could not serialize");
    }
    sessions->workload_.per_connection.push_back(std::move(bytes));
  }
  Workload& workload = sessions->workload_;
  workload.rpc = options.batch_sessions > 0 ? "SessionSteps" : "SessionStep";
  workload.method = absl::StrCat("/", v1::AttentionService::service_full_name(),
                                 "/", workload.rpc);
  workload.request = workload.per_connection.front();
  workload.steps_per_request = per_call;
  workload.description =
      absl::StrCat("decode: ", options.step_tokens, " token(s) a step after ",
                   options.kv_seq, " cached, ", shapes, ", ",
                   options.sessions * per_call, " session(s)",
                   options.batch_sessions > 0
                       ? absl::StrCat(", ", per_call, " stepped by each call")
                       : "");
  return sessions;
}

DecodeSessions::~DecodeSessions() {
  for (const std::string& id : ids_) client_.DeleteSession(id).IgnoreError();
}

}  // namespace attnserve
