#include "server/handlers.h"

#include <cstdint>
#include <deque>
#include <initializer_list>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/attention.h"
#include "core/status_macros.h"
#include "core/verify.h"
#include "proto/tensor_codec.h"
#include "server/request_cost.h"

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
  return control.shared_memory != nullptr
             ? control.shared_memory->VerifyIntact()
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

// The served model `name` (request field `model`); `without_repository`
// says what to do instead on a server that has none.
absl::StatusOr<std::shared_ptr<const Model>> FindModel(
    absl::string_view name, const ModelRepository* models,
    absl::string_view without_repository) {
  ATTN_RETURN_IF_ERROR(VerifyModelName(name, "model"));
  if (models == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("model: ", EchoString(name),
                     " not found: this server has no model repository; ",
                     without_repository));
  }
  return models->Find(name);
}

// The served model a request names; null when it sends its weights inline.
absl::StatusOr<std::shared_ptr<const Model>> RequestedModel(
    const v1::MultiHeadAttendRequest& request, const ModelRepository* models) {
  switch (request.weights_source_case()) {
    case v1::MultiHeadAttendRequest::kModel:
      return FindModel(request.model(), models,
                       "send the weights inline in `weights`");
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
    ATTN_ASSIGN_OR_RETURN(
        weights,
        DecodeAttentionWeights(request.weights(), control.shared_memory));
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

absl::Status NoSharedMemory() {
  return absl::FailedPreconditionError(
      "shared memory is off on this server (--max_shared_memory_mb=0)");
}

absl::Status NoSessions() {
  return absl::FailedPreconditionError(
      "decode sessions are off on this server (--max_session_memory_mb=0)");
}

// A CreateSession request as the core's session config.
absl::StatusOr<DecodeSessionConfig> SessionConfigOf(
    const v1::CreateSessionRequest& request, const ModelRepository* models,
    int64_t max_length) {
  DecodeSessionConfig config;
  if (request.max_length() < 0 || request.max_length() > max_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_length: ", request.max_length(), " is not in [0, ", max_length,
        "] (0: the server's --max_session_length ", max_length, ")"));
  }
  config.max_length =
      request.max_length() == 0 ? max_length : request.max_length();
  if (request.batch() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch: must be >= 0 (0 means 1), got ", request.batch()));
  }
  config.batch = request.batch() == 0 ? 1 : request.batch();
  if (request.num_layers() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_layers: must be >= 0 (0 means 1), got ", request.num_layers()));
  }
  config.num_layers = request.num_layers() == 0 ? 1 : request.num_layers();
  if (request.cache_dtype() != v1::DATA_TYPE_UNSPECIFIED) {
    ATTN_ASSIGN_OR_RETURN(config.cache_dtype,
                          DTypeFromProto(request.cache_dtype(), "cache_dtype"));
  }
  if (!request.model().empty()) {
    ATTN_ASSIGN_OR_RETURN(
        std::shared_ptr<const Model> model,
        FindModel(request.model(), models,
                  "give num_heads and head_dim for an attention session"));
    config.layer =
        std::shared_ptr<const MultiHeadLayer>(model, model->layer.get());
    config.model = request.model();
    if (model->config.has_default_scale()) {
      config.default_scale = model->config.default_scale();
    }
    if (!config.cache_dtype.has_value() &&
        model->config.cache_dtype() != v1::DATA_TYPE_UNSPECIFIED) {
      ATTN_ASSIGN_OR_RETURN(
          config.cache_dtype,
          DTypeFromProto(model->config.cache_dtype(), "cache_dtype"));
    }
    return config;
  }
  config.num_heads = request.num_heads();
  config.num_kv_heads = request.num_kv_heads();
  config.key_dim = request.head_dim();
  config.value_dim = request.value_head_dim();
  if (request.dtype() != v1::DATA_TYPE_UNSPECIFIED) {
    ATTN_ASSIGN_OR_RETURN(config.dtype,
                          DTypeFromProto(request.dtype(), "dtype"));
  }
  config.rotary.dims = request.rotary_dims();
  if (request.has_rotary_base()) config.rotary.base = request.rotary_base();
  return config;
}

// A session's cache reserves its whole max_length of address space: refused
// up front when one session may not hold that much, naming the flag, the
// dims and the longest session of those dims that fits.
absl::Status VerifySessionReservation(const DecodeSessionConfig& config,
                                      const SessionStore& sessions) {
  ATTN_ASSIGN_OR_RETURN(const KvCache::Dims dims,
                        DecodeSession::CacheDims(config));
  ATTN_ASSIGN_OR_RETURN(const size_t reserved, KvCache::ReservedBytes(dims));
  const size_t limit = sessions.max_session_bytes();
  if (limit == 0 || reserved <= limit) return absl::OkStatus();
  int64_t fits = 0, too_long = dims.max_length;
  while (too_long - fits > 1) {
    KvCache::Dims shorter = dims;
    shorter.max_length = fits + (too_long - fits) / 2;
    const absl::StatusOr<size_t> bytes = KvCache::ReservedBytes(shorter);
    (bytes.ok() && *bytes <= limit ? fits : too_long) = shorter.max_length;
  }
  const size_t budget = sessions.options().max_bytes;
  const std::string what =
      budget == limit
          ? absl::StrCat("--max_session_memory_mb ", budget >> 20,
                         " allows one session")
          : absl::StrCat("the ", limit >> 20,
                         " MiB of address space one session may reserve");
  return absl::ResourceExhaustedError(absl::StrCat(
      "max_length: ", dims.max_length, " tokens x ",
      dims.layers > 1 ? absl::StrCat(dims.layers, " layers x ") : "",
      dims.batch, " sequences x ", dims.kv_heads, " key/value heads x (",
      dims.key_dim, " + ", dims.value_dim, ") dims of ", DTypeName(dims.dtype),
      " reserve ", reserved >> 20, " MiB of cache, more than ", what, "; ",
      fits > 0 ? absl::StrCat("at most ", fits, " tokens fit")
               : std::string("not one token fits: use smaller dims")));
}

// An allocation that fails (std::bad_alloc: a result or a copy larger than
// the memory left) fails its call with RESOURCE_EXHAUSTED, not the server.
template <typename Run>
absl::Status OutOfMemoryFailsTheCall(Run run) {
  try {
    return run();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        "request: the server is out of memory for this call; retry later or "
        "send a smaller one");
  }
}

absl::Status RunAttend(const v1::AttendRequest& request,
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
  options.enable_gqa = request.enable_gqa();
  options.cancelled = control.cancelled;
  WireResults results =
      ResultsOf(request, response, response->mutable_weights(), control);
  ATTN_RETURN_IF_ERROR(Attend(inputs, options, results));
  if (!request.return_weights()) response->clear_weights();
  return VerifySharedMemoryIntact(control);
}

// LayerNorm, or RMSNorm when `rms_norm`, of a LayerNormRequest or an
// RmsNormRequest (which has no beta): eps by default 1e-5, for RMSNorm the
// machine epsilon of the input's dtype.
template <typename Request, typename Response>
absl::Status RunNorm(const Request& request, Response* response,
                     const CallControl& control, bool rms_norm) {
  ATTN_ASSIGN_OR_RETURN(TensorView input,
                        ATTN_REQUIRED_TENSOR(request, input, control));
  std::optional<TensorView> gamma, beta;
  ATTN_RETURN_IF_ERROR(ATTN_OPTIONAL_TENSOR(request, gamma, control, &gamma));
  if constexpr (requires { request.beta(); }) {
    ATTN_RETURN_IF_ERROR(ATTN_OPTIONAL_TENSOR(request, beta, control, &beta));
  }
  LayerNormOptions options;
  options.rms_norm = rms_norm;
  if (request.has_eps()) {
    options.eps = request.eps();
  } else if (rms_norm) {
    options.eps = DefaultRmsNormEps(input.dtype);
  }
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

absl::Status CreateSession(const v1::CreateSessionRequest& request,
                           const ModelRepository* models,
                           SessionStore* sessions, int64_t max_length,
                           v1::CreateSessionResponse* response,
                           std::optional<std::string> as) {
  if (sessions == nullptr) return NoSessions();
  ATTN_ASSIGN_OR_RETURN(const DecodeSessionConfig config,
                        SessionConfigOf(request, models, max_length));
  ATTN_RETURN_IF_ERROR(VerifySessionReservation(config, *sessions));
  ATTN_RETURN_IF_ERROR(sessions->VerifyConfig(config));
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<DecodeSession> session,
                        DecodeSession::Create(config));
  response->set_max_length(session->max_length());
  response->set_num_heads(session->num_heads());
  response->set_num_kv_heads(session->num_kv_heads());
  response->set_head_dim(session->key_dim());
  response->set_value_head_dim(session->value_dim());
  response->set_batch(session->batch());
  ATTN_ASSIGN_OR_RETURN(
      std::string id,
      as.has_value() ? sessions->AddNamed(std::move(session), *std::move(as))
                     : sessions->Add(std::move(session)));
  response->set_session_id(std::move(id));
  return absl::OkStatus();
}

}  // namespace

absl::Status HandleAttend(const v1::AttendRequest& request,
                          v1::AttendResponse* response,
                          const CallControl& control) {
  return OutOfMemoryFailsTheCall(
      [&] { return RunAttend(request, response, control); });
}

MultiHeadAttendHandler::MultiHeadAttendHandler(
    const v1::MultiHeadAttendRequest& request, const ModelRepository* models)
    : model_(RequestedModel(request, models)) {}

const MultiHeadLayer* MultiHeadAttendHandler::layer() const {
  return model_.ok() && *model_ != nullptr ? (*model_)->layer.get() : nullptr;
}

absl::Status MultiHeadAttendHandler::operator()(
    const v1::MultiHeadAttendRequest& request,
    v1::MultiHeadAttendResponse* response, const CallControl& control) const {
  if (!model_.ok()) return model_.status();
  return OutOfMemoryFailsTheCall([&] {
    return RunMultiHeadAttend(request, model_->get(), response, control);
  });
}

absl::Status HandleMultiHeadAttend(const v1::MultiHeadAttendRequest& request,
                                   const ModelRepository* models,
                                   v1::MultiHeadAttendResponse* response,
                                   const CallControl& control) {
  return MultiHeadAttendHandler(request, models)(request, response, control);
}

absl::Status HandleLayerNorm(const v1::LayerNormRequest& request,
                             v1::LayerNormResponse* response,
                             const CallControl& control) {
  return OutOfMemoryFailsTheCall(
      [&] { return RunNorm(request, response, control, request.rms_norm()); });
}

absl::Status HandleRmsNorm(const v1::RmsNormRequest& request,
                           v1::RmsNormResponse* response,
                           const CallControl& control) {
  return OutOfMemoryFailsTheCall(
      [&] { return RunNorm(request, response, control, /*rms_norm=*/true); });
}

absl::Status HandleCreateSession(const v1::CreateSessionRequest& request,
                                 const ModelRepository* models,
                                 SessionStore* sessions, int64_t max_length,
                                 v1::CreateSessionResponse* response,
                                 std::optional<std::string> as) {
  return OutOfMemoryFailsTheCall([&] {
    return CreateSession(request, models, sessions, max_length, response,
                         std::move(as));
  });
}

bool WaitsForSession(SessionStore* sessions, absl::string_view id) {
  return sessions != nullptr && sessions->HeldElsewhere(id);
}

absl::Status HandleDeleteSession(const v1::DeleteSessionRequest& request,
                                 SessionStore* sessions, PeerWait wait) {
  if (sessions == nullptr) return NoSessions();
  return sessions->Delete(request.session_id(), wait);
}

absl::Status HandleHandOverSession(const v1::HandOverSessionRequest& request,
                                   SessionStore* sessions) {
  if (sessions == nullptr) return NoSessions();
  // An asker of a release before format 3 sends no version: it reads 2.
  return sessions->HandOver(request.session_id(), request.file_version() == 0
                                                      ? 2
                                                      : request.file_version());
}

absl::Status HandleForkSession(const v1::ForkSessionRequest& request,
                               SessionStore* sessions,
                               v1::ForkSessionResponse* response,
                               std::optional<std::string> as, PeerWait wait) {
  if (sessions == nullptr) return NoSessions();
  return OutOfMemoryFailsTheCall([&]() -> absl::Status {
    int64_t length = 0;
    ATTN_ASSIGN_OR_RETURN(
        std::string id,
        sessions->Fork(request.session_id(),
                       request.has_length()
                           ? std::optional<int64_t>(request.length())
                           : std::nullopt,
                       &length, std::move(as), wait));
    response->set_session_id(std::move(id));
    response->set_length(length);
    return absl::OkStatus();
  });
}

SessionStepHandler::SessionStepHandler(const v1::SessionStepRequest& request,
                                       SessionStore* sessions)
    : sessions_(sessions) {
  if (sessions == nullptr) return;
  // Here only: a session elsewhere is taken up by the step, on the worker
  // that runs it, not on gRPC's thread.
  auto found = sessions->FindHere(request.session_id());
  if (found.ok()) {
    session_ = *std::move(found);
  } else if (!absl::IsNotFound(found.status())) {
    lookup_error_ = found.status();
  }
}

const DecodeSession* SessionStepHandler::session() const {
  return session_.get();
}

absl::Status DecodedStep::Decode(const v1::SessionStepRequest& request,
                                 v1::Tensor* output,
                                 const CallControl& control) {
  DecodeStepInputs& inputs = input_.inputs;
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(request, input, control, &inputs.input));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(request, query, control, &inputs.query));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(request, key, control, &inputs.key));
  ATTN_RETURN_IF_ERROR(
      ATTN_OPTIONAL_TENSOR(request, value, control, &inputs.value));
  if (request.has_position()) inputs.position = request.position();
  DecodeStepOptions& options = input_.options;
  if (request.has_scale()) options.scale = request.scale();
  if (request.has_temperature()) options.temperature = request.temperature();
  inputs.layer = request.layer();
  options.cancelled = control.cancelled;
  results_.emplace(
      output, nullptr,
      request.has_result_regions() ? &request.result_regions() : nullptr,
      control.shared_memory);
  input_.id = request.session_id();
  input_.results = &*results_;
  input_.length = &length_;
  return absl::OkStatus();
}

absl::Status SessionStepHandler::operator()(
    const v1::SessionStepRequest& request, v1::SessionStepResponse* response,
    const CallControl& control) const {
  if (sessions_ == nullptr) return NoSessions();
  ATTN_RETURN_IF_ERROR(lookup_error_);
  DecodedStep step;
  ATTN_RETURN_IF_ERROR(
      step.Decode(request, response->mutable_output(), control));
  const SessionStore::StepInput& in = step.input();
  ATTN_RETURN_IF_ERROR(OutOfMemoryFailsTheCall([&] {
    return sessions_->Step(in.id, in.inputs, in.options, *in.results,
                           in.length);
  }));
  response->set_length(step.length());
  return VerifySharedMemoryIntact(control);
}

SessionStepCall SessionStepHandler::StepCall(
    const v1::SessionStepRequest& request,
    v1::SessionStepResponse* response) const {
  // Shared by the two functions: decoded before the pass, read after it.
  auto decoded = std::make_shared<DecodedStep>();
  return SessionStepCall{
      .session_id = request.session_id(),
      .decode = [sessions = sessions_, &request, response, decoded,
                 lookup_error = lookup_error_](const CallControl& control)
          -> absl::StatusOr<const SessionStore::StepInput*> {
        if (sessions == nullptr) return NoSessions();
        ATTN_RETURN_IF_ERROR(lookup_error);
        ATTN_RETURN_IF_ERROR(
            decoded->Decode(request, response->mutable_output(), control));
        return &decoded->input();
      },
      .complete =
          [response, decoded](const absl::Status& stepped,
                              const CallControl& control) {
            ATTN_RETURN_IF_ERROR(stepped);
            response->set_length(decoded->length());
            return VerifySharedMemoryIntact(control);
          }};
}

absl::Status VerifyStepCount(int64_t steps, int max_steps) {
  if (steps == 0) {
    return absl::InvalidArgumentError("steps: empty, expected at least one");
  }
  if (steps > max_steps) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "steps: ", steps, " steps, more than the ", max_steps,
        " one call may carry (--max_steps_per_call); split the call"));
  }
  return absl::OkStatus();
}

SessionStepsHandler::SessionStepsHandler(const v1::SessionStepsRequest& request,
                                         SessionStore* sessions, int max_steps,
                                         const StepLimits& limits)
    : sessions_(sessions), max_steps_(max_steps) {
  if (sessions == nullptr ||
      !VerifyStepCount(request.steps_size(), max_steps).ok()) {
    return;
  }
  found_.reserve(request.steps_size());
  refused_.resize(request.steps_size());
  for (int i = 0; i < request.steps_size(); ++i) {
    auto session = sessions->FindHere(request.steps(i).session_id());
    found_.push_back(session.ok() ? *std::move(session) : nullptr);
    // A step over the limits fails alone, and costs the call nothing; so
    // does one whose lookup failed (a session not open here is taken up by
    // the pass, on its worker).
    refused_[i] =
        !session.ok() && !absl::IsNotFound(session.status())
            ? session.status()
            : VerifyWithinLimits(CostOf(request.steps(i), found_[i].get()),
                                 limits.max_tensor_elements,
                                 limits.max_request_bytes,
                                 absl::StrCat("steps[", i, "]"));
    if (!refused_[i].ok()) found_[i] = nullptr;
  }
}

namespace {

// The index of an earlier step naming the same session as step `i`, or -1.
// Checked here, in the request's numbering, so that a repeated session
// fails as the request counts its steps.
absl::Status VerifyFirstStepOfSession(
    const v1::SessionStepsRequest& request, int i,
    absl::flat_hash_map<absl::string_view, int>& first_step) {
  const auto [it, inserted] =
      first_step.emplace(request.steps(i).session_id(), i);
  if (inserted) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("steps[", i, "]: session_id: also in steps[", it->second,
                   "]; a call steps each session at most once"));
}

void SetResultStatus(const absl::Status& status,
                     v1::SessionStepResult* result) {
  result->set_code(static_cast<int32_t>(status.code()));
  result->set_message(std::string(status.message()));
  if (!status.ok()) result->clear_output();
}

}  // namespace

absl::Status SessionStepsHandler::operator()(
    const v1::SessionStepsRequest& request, v1::SessionStepsResponse* response,
    const CallControl& control) const {
  if (sessions_ == nullptr) return NoSessions();
  ATTN_RETURN_IF_ERROR(VerifyStepCount(request.steps_size(), max_steps_));
  const int count = request.steps_size();
  for (int i = 0; i < count; ++i) response->add_results();
  // Decoded steps point into themselves: a deque never moves them.
  std::deque<DecodedStep> decoded(count);
  std::vector<SessionStore::StepInput> inputs;
  std::vector<int> index;  // inputs[k] is step index[k]
  absl::flat_hash_map<absl::string_view, int> first_step;
  for (int i = 0; i < count; ++i) {
    v1::SessionStepResult* result = response->mutable_results(i);
    absl::Status status = VerifyFirstStepOfSession(request, i, first_step);
    if (status.ok() && i < static_cast<int>(refused_.size())) {
      status = refused_[i];
    }
    if (status.ok()) {
      status = decoded[i].Decode(request.steps(i), result->mutable_output(),
                                 control);
    }
    if (!status.ok()) {
      SetResultStatus(status, result);
      continue;
    }
    inputs.push_back(decoded[i].input());
    index.push_back(i);
  }
  std::vector<absl::Status> statuses;
  ATTN_RETURN_IF_ERROR(OutOfMemoryFailsTheCall([&] {
    statuses = sessions_->StepMany(inputs);
    return absl::OkStatus();
  }));
  for (size_t k = 0; k < index.size(); ++k) {
    v1::SessionStepResult* result = response->mutable_results(index[k]);
    SetResultStatus(statuses[k], result);
    if (statuses[k].ok()) result->set_length(decoded[index[k]].length());
  }
  if (control.cancelled != nullptr && control.cancelled->load()) {
    return absl::CancelledError("call cancelled");
  }
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
  ATTN_RETURN_IF_ERROR(VerifyModelName(request.name(), "name"));
  if (models == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("name: model ", EchoString(request.name()),
                     " not found: this server has no model repository"));
  }
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                        models->Find(request.name()));
  DescribeModel(*model, response);
  return absl::OkStatus();
}

void DescribeModel(const Model& model, v1::GetModelMetadataResponse* response) {
  const MultiHeadLayer& layer = *model.layer;
  response->set_name(model.name);
  response->set_platform("attnserve_multi_head_attention");
  response->set_num_heads(layer.num_heads());
  response->set_query_dim(layer.query_dim());
  response->set_key_dim(layer.key_input_dim());
  response->set_value_dim(layer.value_input_dim());
  response->set_head_key_dim(layer.head_key_dim());
  response->set_head_value_dim(layer.head_value_dim());
  response->set_output_dim(layer.output_dim());
  response->set_compute_dtype(DTypeToProto(layer.compute_dtype()));
  response->set_description(model.config.description());
  response->set_num_kv_heads(layer.num_kv_heads());
  response->set_rotary_dims(static_cast<int32_t>(layer.rotary().dims));
  if (layer.rotary().dims > 0) response->set_rotary_base(layer.rotary().base);
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
}

absl::Status HandleRegisterSharedMemory(
    const v1::RegisterSharedMemoryRequest& request,
    SharedMemoryRegistry* registry) {
  if (registry == nullptr) return NoSharedMemory();
  const v1::SharedMemoryRegion& region = request.region();
  return registry->Register(SharedMemoryRegionInfo{
      region.name(), region.key(), region.offset(), region.byte_size()});
}

absl::Status HandleUnregisterSharedMemory(
    const v1::UnregisterSharedMemoryRequest& request,
    SharedMemoryRegistry* registry) {
  if (registry == nullptr) return NoSharedMemory();
  return registry->Unregister(request.name());
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

}  // namespace attnserve
