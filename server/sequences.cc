#include "server/sequences.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/status_macros.h"
#include "core/verify.h"
#include "openssl/evp.h"
#include "server/protocol_models.h"

namespace attnserve {
namespace {

using inference::InferParameter;
using ParameterMap = google::protobuf::Map<std::string, InferParameter>;

constexpr absl::string_view kId = "sequence_id";
constexpr absl::string_view kStart = "sequence_start";
constexpr absl::string_view kEnd = "sequence_end";
constexpr absl::string_view kPosition = "sequence_position";
constexpr absl::string_view kFork = "sequence_fork";
// The first request's settings, named like CreateSession's fields.
constexpr absl::string_view kMaxLength = "max_length";
constexpr absl::string_view kRotaryDims = "rotary_dims";
constexpr absl::string_view kRotaryBase = "rotary_base";
constexpr absl::string_view kDtype = "dtype";

// Sequences one model may hold: twice the store's sessions (entries of gone
// sessions stay until looked up or swept, to say why they are gone), at
// least 1024; 65536 when the store sets no max_sessions.
size_t DefaultMaxPerModel(const SessionStore* sessions) {
  if (sessions == nullptr || sessions->options().max_sessions <= 0) {
    return 65536;
  }
  return std::max<size_t>(
      2 * static_cast<size_t>(sessions->options().max_sessions), 1024);
}

std::string Where(absl::string_view name) {
  return absl::StrCat("parameters: ", name);
}

absl::StatusOr<bool> BoolOf(const InferParameter& parameter,
                            absl::string_view name) {
  if (parameter.parameter_choice_case() != InferParameter::kBoolParam) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(name), " must be a bool, got ", ParameterKind(parameter)));
  }
  return parameter.bool_param();
}

// A non-negative integer up to `max`, sent as int64 or uint64.
absl::StatusOr<int64_t> CountOf(const InferParameter& parameter,
                                absl::string_view name, int64_t max) {
  int64_t value = 0;
  switch (parameter.parameter_choice_case()) {
    case InferParameter::kInt64Param:
      value = parameter.int64_param();
      break;
    case InferParameter::kUint64Param:
      if (parameter.uint64_param() > static_cast<uint64_t>(max)) {
        value = -1;
        break;
      }
      value = static_cast<int64_t>(parameter.uint64_param());
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          Where(name), " must be an integer, got ", ParameterKind(parameter)));
  }
  if (value < 0 || value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(name), " must be in [0, ", max, "]"));
  }
  return value;
}

// A sequence id parameter (sequence_id, sequence_fork): a uint64, a
// non-negative int64 or a string.
absl::StatusOr<SequenceId> IdOf(const InferParameter& parameter,
                                absl::string_view name) {
  SequenceId id;
  switch (parameter.parameter_choice_case()) {
    case InferParameter::kUint64Param:
      id.number = parameter.uint64_param();
      return id;
    case InferParameter::kInt64Param:
      if (parameter.int64_param() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(Where(name), " must not be negative, got ",
                         parameter.int64_param()));
      }
      id.number = static_cast<uint64_t>(parameter.int64_param());
      return id;
    case InferParameter::kStringParam:
      // The table keeps ids of ended sequences too (until their sessions
      // are gone): bounded in bytes as in count.
      if (parameter.string_param().size() > kMaxSequenceIdBytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            Where(name), ": a string id of ", parameter.string_param().size(),
            " bytes; a sequence id has at most ", kMaxSequenceIdBytes));
      }
      id.is_string = true;
      id.text = parameter.string_param();
      return id;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(Where(name), " must be a uint64 or a string, got ",
                       ParameterKind(parameter)));
  }
}

absl::StatusOr<float> FloatOf(const InferParameter& parameter,
                              absl::string_view name) {
  double value = 0;
  switch (parameter.parameter_choice_case()) {
    case InferParameter::kDoubleParam:
      value = parameter.double_param();
      break;
    case InferParameter::kInt64Param:
      value = static_cast<double>(parameter.int64_param());
      break;
    case InferParameter::kUint64Param:
      value = static_cast<double>(parameter.uint64_param());
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          Where(name), " must be a number, got ", ParameterKind(parameter)));
  }
  if (!std::isfinite(value) ||
      std::abs(value) > std::numeric_limits<float>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(name), " = ", value, " is not a finite float32 value"));
  }
  return static_cast<float>(value);
}

absl::StatusOr<v1::DataType> CacheDtypeOf(const InferParameter& parameter) {
  if (parameter.parameter_choice_case() == InferParameter::kStringParam) {
    if (parameter.string_param() == "FP32") return v1::DATA_TYPE_FLOAT32;
    if (parameter.string_param() == "BF16") return v1::DATA_TYPE_BFLOAT16;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      Where(kDtype), " must be the string 'FP32' or 'BF16', got ",
      parameter.parameter_choice_case() == InferParameter::kStringParam
          ? EchoString(parameter.string_param())
          : std::string(ParameterKind(parameter))));
}

// The first request's settings: only with sequence_start and without
// sequence_fork (a fork has its parent's), and the rotary and dtype
// settings only for attention sessions (a model has its own).
absl::Status ReadSettings(const ParameterMap& parameters,
                          absl::string_view model, SequenceParameters* out) {
  for (absl::string_view name :
       {kMaxLength, kRotaryDims, kRotaryBase, kDtype}) {
    const auto it = parameters.find(std::string(name));
    if (it == parameters.end()) continue;
    if (!out->start) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(name),
                       " applies to the first request of a sequence only "
                       "(with sequence_start true)"));
    }
    if (!out->fork.none()) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(name), ": a fork keeps the settings of the sequence it forks (",
          kFork, " ", out->fork.ToString(), ")"));
    }
    if (name != kMaxLength && model != kAttentionSessionModel) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(name), ": model ", EchoString(model),
                       " has its own; only sequences of ",
                       kAttentionSessionModel, " take it"));
    }
    const InferParameter& parameter = it->second;
    if (name == kMaxLength) {
      ATTN_ASSIGN_OR_RETURN(
          out->max_length,
          CountOf(parameter, name, std::numeric_limits<int64_t>::max()));
    } else if (name == kRotaryDims) {
      ATTN_ASSIGN_OR_RETURN(
          out->rotary_dims,
          CountOf(parameter, name, std::numeric_limits<int32_t>::max()));
    } else if (name == kRotaryBase) {
      ATTN_ASSIGN_OR_RETURN(out->rotary_base, FloatOf(parameter, name));
    } else {
      ATTN_ASSIGN_OR_RETURN(out->dtype, CacheDtypeOf(parameter));
    }
  }
  return absl::OkStatus();
}

// "sequence 42 ... model 'm'" for messages.
std::string SequenceOf(absl::string_view model, const SequenceId& id) {
  return absl::StrCat("sequence ", id.ToString(), " of model ",
                      EchoString(model));
}

// A step on (`name` sequence_id) or a fork of (`name` sequence_fork) a
// sequence whose session the store no longer has.
absl::Status GoneError(absl::string_view name, absl::string_view model,
                       const SequenceId& id, const absl::Status& not_found) {
  absl::string_view why = not_found.message();
  absl::ConsumeSuffix(&why, "; create a new one and prefill it");
  return absl::NotFoundError(
      absl::StrCat(name, ": ", SequenceOf(model, id), " is gone (", why,
                   "); send its first request again with sequence_start"));
}

v1::Tensor ShapeOnly(const v1::Tensor& tensor) {
  v1::Tensor shape;
  shape.set_dtype(tensor.dtype());
  *shape.mutable_shape() = tensor.shape();
  return shape;
}

// An attention session's heads, dims and batch, from the first step's
// query [B, H, n, dk], key [B, Hkv, n, dk] and value [B, Hkv, n, dv].
absl::Status AttentionSessionShape(const v1::SessionStepRequest& step,
                                   v1::CreateSessionRequest* create) {
  if (!step.has_query() || !step.has_key() || !step.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs: the first request of an ", kAttentionSessionModel,
        " sequence needs query, key and value (their shapes give the "
        "session's heads and dims)"));
  }
  const int rank = step.query().shape_size();
  if (rank != 3 && rank != 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "query: expected [B, H, n, dk] or [H, n, dk], got rank ", rank));
  }
  const std::pair<const char*, const v1::Tensor*> others[] = {
      {"key", &step.key()}, {"value", &step.value()}};
  for (const auto& [name, tensor] : others) {
    if (tensor->shape_size() != rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": rank ", tensor->shape_size(), " != query rank ", rank));
    }
  }
  const int heads = rank - 3;  // the heads' dim
  const auto dim = [&](const v1::Tensor& t, int i) { return t.shape(i); };
  for (const auto& [name, value] :
       {std::pair<const char*, int64_t>{"query", dim(step.query(), heads)},
        {"key", dim(step.key(), heads)}}) {
    if (value < 1 || value > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": heads dim ", value, " is not in [1, ",
                       std::numeric_limits<int32_t>::max(), "]"));
    }
  }
  if (rank == 4 && dim(step.query(), 0) < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "query: batch dim ", dim(step.query(), 0), " must be at least 1"));
  }
  create->set_num_heads(static_cast<int32_t>(dim(step.query(), heads)));
  create->set_num_kv_heads(static_cast<int32_t>(dim(step.key(), heads)));
  create->set_head_dim(dim(step.query(), heads + 2));
  create->set_value_head_dim(dim(step.value(), heads + 2));
  create->set_batch(rank == 4 ? dim(step.query(), 0) : 1);
  return absl::OkStatus();
}

// A start costs what a step on an empty cache computes: causal attention
// of its prompt (with the model's projections).
RequestCost StartCost(const Model* served, const v1::SessionStepRequest& step) {
  if (served != nullptr) {
    v1::MultiHeadAttendRequest prompt;
    prompt.set_model(served->name);
    prompt.set_causal(true);
    *prompt.mutable_query() = ShapeOnly(step.input());
    return CostOf(prompt, served->layer.get());
  }
  v1::AttendRequest prompt;
  prompt.set_causal(true);
  prompt.set_enable_gqa(true);
  *prompt.mutable_query() = ShapeOnly(step.query());
  *prompt.mutable_key() = ShapeOnly(step.key());
  *prompt.mutable_value() = ShapeOnly(step.value());
  return CostOf(prompt);
}

// A fork's sequence_position: the parent's tokens it starts with, at most
// what the parent holds (in each of its layers).
// Whether session `session_id` of sequence `id` of `model` is open, taken
// up here if it lives on elsewhere (a drain's file, a live holder's
// hand-over, a dead one's journal); the store's error otherwise, naming
// the sequence (its NOT_FOUND, which names session_id, means "nowhere").
absl::StatusOr<bool> TakeUpSequence(SessionStore& sessions,
                                    absl::string_view model,
                                    const SequenceId& id,
                                    const std::string& session_id) {
  const absl::Status taken = sessions.FindReused(session_id).status();
  if (taken.ok()) return true;
  if (absl::IsNotFound(taken) &&
      absl::StartsWith(taken.message(), "session_id:")) {
    return false;
  }
  return absl::Status(
      taken.code(),
      absl::StrCat(kId, ": sequence ", id.ToString(), " of model ",
                   EchoString(model), ": ", taken.message()));
}

absl::Status VerifyForkPosition(int64_t position, const DecodeSession& parent,
                                absl::string_view model,
                                const SequenceId& parent_id) {
  int64_t held = parent.length(0);
  for (int64_t l = 1; l < parent.num_layers(); ++l) {
    held = std::min(held, parent.length(l));
  }
  if (position <= held) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(Where(kPosition), ": ", position, " is not in [0, ", held,
                   "]: a fork starts with that many tokens of ",
                   SequenceOf(model, parent_id), ", which holds ", held));
}

}  // namespace

std::string SequenceId::ToString() const {
  return is_string ? EchoString(text, '"') : absl::StrCat(number);
}

std::string SequenceId::Key() const {
  return is_string ? absl::StrCat("s", text) : absl::StrCat("u", number);
}

absl::StatusOr<std::string> SequenceSessionId(absl::string_view model,
                                              const SequenceId& id) {
  // NUL-separated: no model name holds one, so no two pairs give one text.
  const std::string name =
      absl::StrCat("attnserve sequence", absl::string_view("\0", 1), model,
                   absl::string_view("\0", 1), id.Key());
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (EVP_Digest(name.data(), name.size(), digest, &size, EVP_sha256(),
                 nullptr) != 1 ||
      size < 20) {
    return absl::InternalError(
        absl::StrCat(kId, ": could not derive the session id of sequence ",
                     id.ToString(), " (SHA-256 failed)"));
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), 20));
}

bool IsSequenceParameter(absl::string_view name, bool in_sequence) {
  if (name == kId || name == kStart || name == kEnd) return true;
  return in_sequence &&
         (name == kPosition || name == kFork || name == kMaxLength ||
          name == kRotaryDims || name == kRotaryBase || name == kDtype);
}

std::vector<std::string> SequenceParameterNames(absl::string_view model) {
  std::vector<std::string> names = {
      std::string(kId),       std::string(kStart), std::string(kEnd),
      std::string(kPosition), std::string(kFork),  std::string(kMaxLength)};
  if (model == kAttentionSessionModel) {
    for (absl::string_view name : {kRotaryDims, kRotaryBase, kDtype}) {
      names.emplace_back(name);
    }
  }
  return names;
}

absl::StatusOr<SequenceParameters> SequenceParametersOf(
    const ParameterMap& parameters, const ProtocolModel& protocol_model) {
  const absl::string_view model = protocol_model.name;
  SequenceParameters out;
  for (auto [name, id] : {std::pair{kId, &out.id}, {kFork, &out.fork}}) {
    const auto it = parameters.find(std::string(name));
    if (it == parameters.end()) continue;
    ATTN_ASSIGN_OR_RETURN(*id, IdOf(it->second, name));
  }
  for (auto [name, flag] : {std::pair{kStart, &out.start}, {kEnd, &out.end}}) {
    const auto it = parameters.find(std::string(name));
    if (it == parameters.end()) continue;
    ATTN_ASSIGN_OR_RETURN(*flag, BoolOf(it->second, name));
  }
  const auto position = parameters.find(std::string(kPosition));
  if (out.id.none()) {
    for (auto [name, set] : {std::pair{kStart, out.start},
                             {kEnd, out.end},
                             {kPosition, position != parameters.end()},
                             {kFork, !out.fork.none()}}) {
      if (!set) continue;
      return absl::InvalidArgumentError(
          absl::StrCat(Where(name),
                       " needs a sequence_id (a non-zero uint64 or a "
                       "non-empty string)"));
    }
    if (protocol_model.takes_sequences()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameters: model ", EchoString(model),
          " answers requests of a sequence only: set sequence_id (and "
          "sequence_start on the first request)"));
    }
    return out;
  }
  if (!protocol_model.takes_sequences()) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(kId), ": model ", EchoString(model),
        " keeps no state between requests; ",
        protocol_model.built_in()
            ? absl::StrCat("sequences run on ", kAttentionSessionModel,
                           " and on the sequence model of each served model")
            : absl::StrCat(
                  "its sequences are model ",
                  EchoString(absl::StrCat(model, kSequenceModelSuffix)))));
  }
  if (!out.fork.none() && !out.start) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(kFork),
                     " applies to the first request of a sequence only (with "
                     "sequence_start true): it starts sequence_id as a fork"));
  }
  if (!out.fork.none() && out.fork.Key() == out.id.Key()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(kFork), ": sequence ", out.id.ToString(),
                     " cannot fork itself; to go back in a sequence, step it "
                     "with sequence_position"));
  }
  if (position != parameters.end()) {
    ATTN_ASSIGN_OR_RETURN(out.position,
                          CountOf(position->second, kPosition,
                                  std::numeric_limits<int64_t>::max()));
  }
  ATTN_RETURN_IF_ERROR(ReadSettings(parameters, model, &out));
  return out;
}

SequenceTable::SequenceTable(SessionStore* sessions,
                             const ModelRepository* models,
                             int64_t max_session_length, size_t max_per_model)
    : sessions_(sessions),
      models_(models),
      max_session_length_(max_session_length),
      max_per_model_(max_per_model > 0 ? max_per_model
                                       : DefaultMaxPerModel(sessions)) {}

absl::Duration SequenceTable::idle_timeout() const {
  return sessions_ != nullptr ? sessions_->options().idle_timeout
                              : absl::ZeroDuration();
}

void SequenceTable::Sweep(Sequences& sequences) {
  absl::erase_if(sequences, [](const auto& entry) {
    return entry.second.session.expired();
  });
}

SequenceTable::Lookup SequenceTable::LookUp(absl::string_view model,
                                            const SequenceId& id) {
  MutexLock lock(&mu_);
  const auto sequences = models_sequences_.find(model);
  if (sequences == models_sequences_.end()) return {};
  const auto it = sequences->second.find(id.Key());
  if (it == sequences->second.end()) return {};
  Lookup found{Lookup::kOpen, it->second.session_id};
  // A sequence whose session is gone stays so until it starts again (or
  // the table, full, sweeps it): every request naming it meanwhile gets
  // the same answer, as a request that fails changes nothing.
  if (it->second.session.expired()) found.state = Lookup::kGone;
  return found;
}

absl::StatusOr<SequenceTable::Lookup> SequenceTable::LookUpAnywhere(
    absl::string_view model, const SequenceId& id) {
  Lookup found = LookUp(model, id);
  if (found.state == Lookup::kOpen) return found;
  // Saved by a drain, held by a live replica or journaled by a dead one.
  ATTN_ASSIGN_OR_RETURN(std::string session_id, SequenceSessionId(model, id));
  ATTN_ASSIGN_OR_RETURN(const bool open,
                        TakeUpSequence(*sessions_, model, id, session_id));
  if (!open) return found;
  ATTN_RETURN_IF_ERROR(Insert(model, id, session_id));
  return Lookup{Lookup::kOpen, std::move(session_id)};
}

absl::Status SequenceTable::Gone(absl::string_view name,
                                 absl::string_view model, const SequenceId& id,
                                 const std::string& session_id) {
  const absl::Status found = sessions_->Find(session_id).status();
  return GoneError(
      name, model, id,
      found.ok() ? absl::NotFoundError("its session was freed") : found);
}

absl::StatusOr<std::string> SequenceTable::Find(absl::string_view model,
                                                const SequenceId& id) {
  ATTN_ASSIGN_OR_RETURN(Lookup found, LookUpAnywhere(model, id));
  switch (found.state) {
    case Lookup::kNone:
      return absl::InvalidArgumentError(absl::StrCat(
          kId, ": inference request for sequence ", id.ToString(), " to model ",
          EchoString(model),
          " must specify the START flag on the first request of the "
          "sequence"));
    case Lookup::kGone:
      return Gone(kId, model, id, found.session_id);
    case Lookup::kOpen:
      break;
  }
  return std::move(found.session_id);
}

absl::StatusOr<std::string> SequenceTable::FindParent(absl::string_view model,
                                                      const SequenceId& parent,
                                                      const SequenceId& child) {
  ATTN_ASSIGN_OR_RETURN(Lookup found, LookUpAnywhere(model, parent));
  switch (found.state) {
    case Lookup::kNone: {
      const std::string forks =
          absl::StrCat(kFork, ": inference request for sequence ",
                       child.ToString(), " to model ", EchoString(model),
                       " forks sequence ", parent.ToString());
      const std::optional<std::string> other = ModelHolding(parent, model);
      if (other.has_value()) {
        return absl::InvalidArgumentError(absl::StrCat(
            forks, ", which is a sequence of model ", EchoString(*other),
            "; a fork continues a sequence of its own model"));
      }
      return absl::InvalidArgumentError(absl::StrCat(
          forks,
          ", which has not been started or has ended; a fork continues an "
          "open sequence of its own model"));
    }
    case Lookup::kGone:
      return Gone(kFork, model, parent, found.session_id);
    case Lookup::kOpen:
      break;
  }
  return std::move(found.session_id);
}

std::optional<std::string> SequenceTable::ModelHolding(
    const SequenceId& id, absl::string_view except) const {
  MutexLock lock(&mu_);
  std::optional<std::string> holder;
  for (const auto& [model, sequences] : models_sequences_) {
    if (model == except) continue;
    const auto it = sequences.find(id.Key());
    if (it == sequences.end() || it->second.session.expired()) continue;
    // The first by name: the same answer whatever the map's order.
    if (!holder.has_value() || model < *holder) holder = model;
  }
  return holder;
}

std::optional<std::string> SequenceTable::FindHere(absl::string_view model,
                                                   const SequenceId& id) {
  Lookup found = LookUp(model, id);
  if (found.state != Lookup::kOpen) return std::nullopt;
  return std::move(found.session_id);
}

absl::Status SequenceTable::Insert(absl::string_view model,
                                   const SequenceId& id,
                                   const std::string& session_id) {
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<const DecodeSession> session,
                        sessions_->Find(session_id));
  std::string replaced;
  {
    MutexLock lock(&mu_);
    Sequences& sequences = models_sequences_[model];
    if (!sequences.contains(id.Key()) && sequences.size() >= max_per_model_) {
      Sweep(sequences);
      if (sequences.size() >= max_per_model_) {
        return absl::ResourceExhaustedError(absl::StrCat(
            kId, ": model ", EchoString(model), " holds ", sequences.size(),
            " open sequences, the most one model may; end some with "
            "sequence_end first"));
      }
    }
    Entry& entry = sequences[id.Key()];
    replaced = std::move(entry.session_id);
    entry = Entry{session_id, session};
  }
  // A new start of an open sequence replaces it.
  if (!replaced.empty() && replaced != session_id) {
    sessions_->Delete(replaced).IgnoreError();  // gone already: nothing to free
  }
  return absl::OkStatus();
}

void SequenceTable::Erase(absl::string_view model, const SequenceId& id,
                          absl::string_view session_id) {
  MutexLock lock(&mu_);
  const auto sequences = models_sequences_.find(model);
  if (sequences == models_sequences_.end()) return;
  const auto it = sequences->second.find(id.Key());
  if (it != sequences->second.end() && it->second.session_id == session_id) {
    sequences->second.erase(it);
  }
}

size_t SequenceTable::size(absl::string_view model) const {
  MutexLock lock(&mu_);
  const auto sequences = models_sequences_.find(model);
  return sequences == models_sequences_.end() ? 0 : sequences->second.size();
}

absl::StatusOr<std::unique_ptr<SequenceCall>> SequenceCall::Create(
    SequenceTable* table, std::string model,
    std::shared_ptr<const Model> served, const SequenceParameters& parameters,
    const v1::SessionStepRequest& step) {
  if (table == nullptr || table->sessions() == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(kId,
                     ": sequences need decode sessions, which are off on this "
                     "server (--max_session_memory_mb=0)"));
  }
  std::unique_ptr<SequenceCall> call(
      new SequenceCall(table, std::move(model), parameters));
  ATTN_ASSIGN_OR_RETURN(call->target_,
                        SequenceSessionId(call->model_, parameters.id));
  if (!parameters.fork.none() || !parameters.start) {
    // The session (a fork's parent) here, or, if the directory may hold
    // it, left to Run (deferred_); else the lookup's error, here.
    const SequenceId& id =
        parameters.fork.none() ? parameters.id : parameters.fork;
    if (std::optional<std::string> here = table->FindHere(call->model_, id)) {
      call->Bind(*std::move(here));
      ATTN_RETURN_IF_ERROR(call->VerifyForkLength());
    } else {
      ATTN_ASSIGN_OR_RETURN(const std::string named,
                            SequenceSessionId(call->model_, id));
      call->deferred_ = table->sessions()->KnownInDirectory(named);
      if (!call->deferred_) ATTN_RETURN_IF_ERROR(call->FindSession());
    }
    // A fork's first step reads what its parent holds (up to the fork's
    // length).
    call->cost_ = CostOf(step, call->session());
    return call;
  }
  v1::CreateSessionRequest& create = call->create_;
  if (served != nullptr) {
    create.set_model(served->name);
    const int rank = step.input().shape_size();
    create.set_batch(rank == 3 ? std::max<int64_t>(step.input().shape(0), 1)
                               : 1);
  } else {
    ATTN_RETURN_IF_ERROR(AttentionSessionShape(step, &create));
    if (parameters.rotary_dims) create.set_rotary_dims(*parameters.rotary_dims);
    if (parameters.rotary_base) create.set_rotary_base(*parameters.rotary_base);
    if (parameters.dtype) create.set_dtype(*parameters.dtype);
  }
  if (parameters.max_length) create.set_max_length(*parameters.max_length);
  call->cost_ = StartCost(served.get(), step);
  // It ends the sequence open under its id first, which may be elsewhere.
  call->cost_.may_wait = true;
  return call;
}

void SequenceCall::Bind(std::string session_id) {
  session_id_ = std::move(session_id);
  v1::SessionStepRequest lookup;
  lookup.set_session_id(session_id_);
  handler_.emplace(lookup, table_->sessions());
}

const DecodeSession* SequenceCall::session() const {
  return handler_.has_value() ? handler_->session() : nullptr;
}

absl::Status SequenceCall::FindSession() {
  deferred_ = false;
  ATTN_ASSIGN_OR_RETURN(
      std::string found,
      !parameters_.fork.none()
          ? table_->FindParent(model_, parameters_.fork, parameters_.id)
          : table_->Find(model_, parameters_.id));
  Bind(std::move(found));
  return VerifyForkLength();
}

absl::Status SequenceCall::VerifyForkLength() const {
  if (parameters_.fork.none() || !parameters_.position ||
      session() == nullptr) {
    return absl::OkStatus();
  }
  return VerifyForkPosition(*parameters_.position, *session(), model_,
                            parameters_.fork);
}

absl::Status SequenceCall::Run(v1::SessionStepRequest* step,
                               v1::SessionStepResponse* response,
                               const CallControl& control) {
  if (deferred_) ATTN_RETURN_IF_ERROR(FindSession());
  if (!parameters_.fork.none()) return StartFork(step, response, control);
  if (parameters_.position) step->set_position(*parameters_.position);
  return parameters_.start ? Start(step, response, control)
                           : Continue(step, response, control);
}

absl::Status SequenceCall::Start(v1::SessionStepRequest* step,
                                 v1::SessionStepResponse* response,
                                 const CallControl& control) {
  const auto create =
      [&](std::optional<std::string> as) -> absl::StatusOr<std::string> {
    v1::CreateSessionResponse created;
    ATTN_RETURN_IF_ERROR(HandleCreateSession(
        create_, table_->models(), table_->sessions(),
        table_->max_session_length(), &created, std::move(as)));
    return created.session_id();
  };
  return OpenAndStep(create, step, response, control);
}

absl::Status SequenceCall::StartFork(v1::SessionStepRequest* step,
                                     v1::SessionStepResponse* response,
                                     const CallControl& control) {
  const auto fork_parent =
      [&](std::optional<std::string> as) -> absl::StatusOr<std::string> {
    v1::ForkSessionRequest fork;
    fork.set_session_id(session_id_);
    if (parameters_.position) fork.set_length(*parameters_.position);
    v1::ForkSessionResponse forked;
    const absl::Status status =
        HandleForkSession(fork, table_->sessions(), &forked, std::move(as));
    // The store's NOT_FOUND: the parent's session expired, was evicted or
    // deleted since the lookup.
    if (absl::IsNotFound(status) &&
        absl::StartsWith(status.message(), "session_id:")) {
      table_->Erase(model_, parameters_.fork, session_id_);
      return GoneError(kFork, model_, parameters_.fork, status);
    }
    // The parent went back (a rewind) since the lookup checked the length.
    if (absl::IsInvalidArgument(status) &&
        absl::StartsWith(status.message(), "length: ")) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(kPosition), ": ",
                       absl::StripPrefix(status.message(), "length: ")));
    }
    ATTN_RETURN_IF_ERROR(status);
    return forked.session_id();
  };
  return OpenAndStep(fork_parent, step, response, control);
}

absl::Status SequenceCall::OpenAndStep(const Opener& open,
                                       v1::SessionStepRequest* step,
                                       v1::SessionStepResponse* response,
                                       const CallControl& control) {
  SessionStore* sessions = table_->sessions();
  bool named = false;  // opened under the sequence's id
  if (!parameters_.end) {
    ATTN_ASSIGN_OR_RETURN(
        const bool replaces,
        TakeUpSequence(*sessions, model_, parameters_.id, target_));
    named = !replaces;
  }
  absl::StatusOr<std::string> opened =
      open(named ? std::optional<std::string>(target_) : std::nullopt);
  if (named && absl::IsAlreadyExists(opened.status())) {
    // Another start of the sequence opened it meanwhile: this one replaces
    // it, as it would have a moment later.
    opened = open(std::nullopt);
  }
  ATTN_ASSIGN_OR_RETURN(const std::string id, std::move(opened));
  step->set_session_id(id);
  const absl::Status stepped =
      SessionStepHandler(*step, sessions)(*step, response, control);
  // A failed start (or fork) leaves no new session and an open sequence as
  // it was; an end frees it once answered.
  if (!stepped.ok() || parameters_.end) {
    sessions->Delete(id).IgnoreError();  // evicted meanwhile: nothing to free
    return stepped;
  }
  if (id != target_) {
    // It replaces the open sequence: the old session goes, the new one
    // takes the sequence's id.
    sessions->Delete(target_).IgnoreError();  // gone meanwhile: fine
    const absl::Status renamed = sessions->Rename(id, target_);
    if (!renamed.ok()) {
      sessions->Delete(id).IgnoreError();
      return renamed;
    }
  }
  const absl::Status recorded = table_->Insert(model_, parameters_.id, target_);
  if (!recorded.ok()) sessions->Delete(target_).IgnoreError();
  return recorded;
}

std::optional<SessionStepCall> SequenceCall::StepCall(
    v1::SessionStepRequest* step, v1::SessionStepResponse* response) {
  // A sequence not open here is looked up first, by Run.
  if (!parameters_.fork.none() || parameters_.start || deferred_) {
    return std::nullopt;
  }
  if (parameters_.position) step->set_position(*parameters_.position);
  step->set_session_id(session_id_);
  SessionStepCall call = handler_->StepCall(*step, response);
  call.complete = [this, complete = std::move(call.complete)](
                      const absl::Status& stepped, const CallControl& control) {
    return Continued(complete(stepped, control));
  };
  return call;
}

absl::Status SequenceCall::Continue(v1::SessionStepRequest* step,
                                    v1::SessionStepResponse* response,
                                    const CallControl& control) {
  step->set_session_id(session_id_);
  return Continued((*handler_)(*step, response, control));
}

absl::Status SequenceCall::Continued(const absl::Status& stepped) {
  // The store's NOT_FOUND (its messages name session_id): the session
  // expired, was evicted or deleted since the lookup.
  if (absl::IsNotFound(stepped) &&
      absl::StartsWith(stepped.message(), "session_id:")) {
    table_->Erase(model_, parameters_.id, session_id_);
    return GoneError(kId, model_, parameters_.id, stepped);
  }
  if (stepped.ok() && parameters_.end) {
    table_->Erase(model_, parameters_.id, session_id_);
    // Freed meanwhile (evicted): the sequence has ended either way.
    table_->sessions()->Delete(session_id_).IgnoreError();
  }
  return stepped;
}

}  // namespace attnserve
