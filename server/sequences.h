// Triton's sequence extension on decode sessions: a ModelInfer request with
// the parameters sequence_id (a uint64, or a string), sequence_start and
// sequence_end (bools) is one step of a decode session (core/session_store.h)
// instead of a stateless call. The first request of a sequence (start)
// creates the session and its inputs are the first step (the prompt);
// later requests append a step each; the last one (end) frees the session
// once it is answered. A sequence id of 0 or "" means "no sequence", as in
// Triton.
//
// Two kinds of models take sequences:
//  - served models: model sessions of the model's layer; the request's
//    "query" is the step's hidden states [B, n, E] or [n, E] (self-attention:
//    keys and values are projected from them);
//  - the built-in "attention_session": attention sessions whose heads and
//    dims are those of the first request's query [B, H, n, dk], key
//    [B, Hkv, n, dk] and value [B, Hkv, n, dv] (B may be left out).
// The first request may also set max_length (tokens the sequence may hold;
// default --max_session_length) and, for attention_session, rotary_dims,
// rotary_base and dtype ("FP32" or "BF16": what the cache stores). Every
// step may set scale and temperature, and sequence_position, a rewind: the
// step's tokens start there, dropping the cached ones from there on.
//
// A start may fork: sequence_fork (an id, as sequence_id) names an open
// sequence of the same model, the parent; the new sequence's session is a
// fork of the parent's (SessionStore::Fork: the cached tokens shared
// copy-on-write, nothing copied), holding its first sequence_position
// tokens (every one when unset), and the request's inputs are its first
// step after them. The parent stays open and unchanged. A fork has its
// parent's settings (max_length and the others are refused with it) and
// may not name itself; like any start it replaces a sequence open under
// its id. A sequence_fork of 0 or "" forks nothing, as for sequence_id. A
// parent not open on the model is refused (naming the model it is open on, if
// any); one whose session is gone is NOT_FOUND.
//
// A request that fails changes nothing: a failed start leaves no sequence
// (a fork whose first step fails is freed; its parent is as it was), a
// failed step leaves the session as it was, a failed end leaves the
// sequence open. A step on a sequence that was never started (or has ended)
// is refused with Triton's message; one whose session expired or was
// evicted is NOT_FOUND, saying so, and its sequence is forgotten.
//
// A sequence's session has an id derived from its model and sequence id
// (SequenceSessionId), the same on every replica: with a --session_dir
// shared by replicas, a sequence lives on through drains, crashes and
// moves as any session does. A request of a sequence not open here looks
// for its session there (a replica draining saved it, a live one holds
// it, or a dead one's journal has it) before it is refused.
//
// The table maps (model, sequence id) to session ids, at most
// max_per_model sequences a model; entries whose sessions the store has
// freed (expired, evicted) are dropped lazily, without touching the
// sessions' idle clocks.
//
// Thread-safety: SequenceTable is thread-safe; SequenceCall is
// thread-compatible (one call, one thread). Ownership: the table owns its
// entries; the session store and repository must outlive it.
#ifndef ATTNSERVE_SERVER_SEQUENCES_H_
#define ATTNSERVE_SERVER_SEQUENCES_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"
#include "core/mutex.h"
#include "core/session_store.h"
#include "inference/grpc_service.pb.h"
#include "server/handlers.h"
#include "server/model_repository.h"
#include "server/protocol_models.h"
#include "server/request_cost.h"

namespace attnserve {

// The longest string sequence id, in bytes (a UUID has 36).
inline constexpr size_t kMaxSequenceIdBytes = 256;

// A sequence id as the protocol sends it: a number or a string; 42 and
// "42" are different sequences.
struct SequenceId {
  bool is_string = false;
  uint64_t number = 0;
  std::string text;

  // 0 and "": not in a sequence.
  bool none() const { return is_string ? text.empty() : number == 0; }
  // For messages: 42, or "abc".
  std::string ToString() const;
  // The table's key.
  std::string Key() const;
};

// The sequence parameters of one request.
struct SequenceParameters {
  SequenceId id;
  bool start = false;
  bool end = false;
  // sequence_fork: with start, the sequence to fork (none: a new session).
  SequenceId fork;
  // sequence_position: a rewind; with fork, the parent's tokens the fork
  // starts with.
  std::optional<int64_t> position;
  // Start only: the session's settings.
  std::optional<int64_t> max_length;
  std::optional<int32_t> rotary_dims;
  std::optional<float> rotary_base;
  std::optional<v1::DataType> dtype;
};

// The session id of sequence `id` of `model`: the first 20 bytes of the
// SHA-256 of both, in hex (40 digits: never one the store makes, 32).
// INTERNAL if the digest fails.
absl::StatusOr<std::string> SequenceSessionId(absl::string_view model,
                                              const SequenceId& id);

// Whether `name` is a parameter SequenceParametersOf reads (with the
// start-only settings when `in_sequence`).
bool IsSequenceParameter(absl::string_view name, bool in_sequence);

// The sequence parameters of `parameters`, checked: types, a start, end or
// fork without an id, a fork without a start or of itself, settings
// outside a start, with a fork or on a model that takes none; none on a
// model that answers sequences only. INVALID_ARGUMENT naming the parameter.
absl::StatusOr<SequenceParameters> SequenceParametersOf(
    const google::protobuf::Map<std::string, inference::InferParameter>&
        parameters,
    const ProtocolModel& model);
// The sequence parameters `model` takes, for its configuration.
std::vector<std::string> SequenceParameterNames(absl::string_view model);

class SequenceTable {
 public:
  // `sessions` null: sequences are off (FAILED_PRECONDITION). `models` may
  // be null (no repository). `max_session_length`: the server's limit.
  // `max_per_model` 0: twice the store's max_sessions (at least 1024), or
  // 65536 without one.
  SequenceTable(SessionStore* sessions, const ModelRepository* models,
                int64_t max_session_length, size_t max_per_model = 0);

  SessionStore* sessions() const { return sessions_; }
  const ModelRepository* models() const { return models_; }
  int64_t max_session_length() const { return max_session_length_; }
  size_t max_per_model() const { return max_per_model_; }
  // How long a sequence may sit idle (the store's idle timeout).
  absl::Duration idle_timeout() const;

  // The session of sequence `id` of `model`, taken up from the session
  // directory when not open here: INVALID_ARGUMENT (Triton's "must specify
  // the START flag") when none is open, NOT_FOUND saying why when its
  // session is gone (the entry is dropped then), the store's error when its
  // file cannot be taken up (DATA_LOSS, UNAVAILABLE...).
  absl::StatusOr<std::string> Find(absl::string_view model,
                                   const SequenceId& id);
  // The session of sequence `parent` of `model`, which sequence `child`
  // forks: Find's, the errors naming sequence_fork (INVALID_ARGUMENT
  // naming the model `parent` is open on instead, if any).
  absl::StatusOr<std::string> FindParent(absl::string_view model,
                                         const SequenceId& parent,
                                         const SequenceId& child);
  // The session of sequence `id` of `model` if it is open here; never the
  // directory (for gRPC's threads, which must not wait for a hand-over).
  std::optional<std::string> FindHere(absl::string_view model,
                                      const SequenceId& id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Records `session_id` (open in the store) as sequence `id` of `model`; a
  // sequence already open under that id is replaced and its session freed.
  // RESOURCE_EXHAUSTED when the model holds max_per_model sequences whose
  // sessions are all open.
  absl::Status Insert(absl::string_view model, const SequenceId& id,
                      const std::string& session_id);
  // Forgets sequence `id` of `model` if it is still `session_id`.
  void Erase(absl::string_view model, const SequenceId& id,
             absl::string_view session_id);
  // Sequences recorded for `model` (open or not yet found gone).
  size_t size(absl::string_view model) const;

 private:
  struct Entry {
    std::string session_id;
    // Expires when the store frees the session: tells a gone session
    // without touching its idle clock.
    std::weak_ptr<const DecodeSession> session;
  };
  using Sequences = absl::flat_hash_map<std::string, Entry>;
  struct Lookup {
    enum State { kNone, kOpen, kGone } state = kNone;
    std::string session_id;  // kOpen, kGone
  };
  // Sequence `id` of `model`; an entry found gone stays (kGone) until a
  // start replaces it or a full table sweeps it.
  Lookup LookUp(absl::string_view model, const SequenceId& id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // LookUp, then, for a sequence not open here, its session taken up from
  // the directory (recorded open if found); the store's error if that
  // fails other than NOT_FOUND.
  absl::StatusOr<Lookup> LookUpAnywhere(absl::string_view model,
                                        const SequenceId& id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND naming parameter `name`: sequence `id`'s session is gone.
  absl::Status Gone(absl::string_view name, absl::string_view model,
                    const SequenceId& id, const std::string& session_id);
  // The first model by name other than `except` with sequence `id` open.
  std::optional<std::string> ModelHolding(const SequenceId& id,
                                          absl::string_view except) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the entries of `sequences` whose sessions are gone.
  static void Sweep(Sequences& sequences);

  SessionStore* const sessions_;
  const ModelRepository* const models_;
  const int64_t max_session_length_;
  const size_t max_per_model_;
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, Sequences> models_sequences_
      ABSL_GUARDED_BY(mu_);
};

// One request of a sequence: its session created (start), forked (start
// with sequence_fork) or looked up, then one step.
class SequenceCall {
 public:
  // `step` is the request's step (inputs, scale, temperature) without its
  // session; `served` the model (null for attention_session). Looks the
  // sequence up unless it starts, the parent if it forks; the errors of
  // SequenceTable::Find and FindParent, of the start's settings and of a
  // fork's sequence_position past what the parent holds.
  static absl::StatusOr<std::unique_ptr<SequenceCall>> Create(
      SequenceTable* table, std::string model,
      std::shared_ptr<const Model> served, const SequenceParameters& parameters,
      const v1::SessionStepRequest& step);

  // The id of the sequence's session (SequenceSessionId), which
  // ExportSession, ImportSession and HandOverSession take; empty after a
  // request that ends the sequence.
  std::string sequence_session_id() const {
    return parameters_.end ? std::string() : target_;
  }
  // What the step will cost: a start as the causal attention of its prompt
  // (what a step on an empty cache computes), a step by its session.
  RequestCost cost() const { return cost_; }
  // Runs the step (`step` gets its session id), creating (or forking) the
  // session first when the sequence starts and freeing it after an end.
  absl::Status Run(v1::SessionStepRequest* step,
                   v1::SessionStepResponse* response,
                   const CallControl& control);
  // A continuing step as the step coalescer takes it (`step` gets its
  // session id; it, `response` and this call must outlive the answer);
  // nullopt for a start or a fork, which create their session first.
  std::optional<SessionStepCall> StepCall(v1::SessionStepRequest* step,
                                          v1::SessionStepResponse* response);

 private:
  SequenceCall(SequenceTable* table, std::string model,
               const SequenceParameters& parameters)
      : table_(table), model_(std::move(model)), parameters_(parameters) {}
  absl::Status Start(v1::SessionStepRequest* step,
                     v1::SessionStepResponse* response,
                     const CallControl& control);
  absl::Status StartFork(v1::SessionStepRequest* step,
                         v1::SessionStepResponse* response,
                         const CallControl& control);
  // Steps (or forks) `session_id`: session_id_ and handler_.
  void Bind(std::string session_id);
  // The bound session, if open here (null before Bind or once gone).
  const DecodeSession* session() const;
  // Looks the session (or a fork's parent) up anywhere and binds it,
  // checking a fork's sequence_position against the parent: in Create, or
  // by Run (on the worker, where a hand-over may be waited for) for a
  // sequence not open here at creation. Find's and FindParent's errors.
  absl::Status FindSession();
  // A fork's sequence_position against its bound parent's length
  // (INVALID_ARGUMENT naming it); OK for other calls or no parent here.
  absl::Status VerifyForkLength() const;
  // Opens the sequence's session with `open` (a create or a fork, given
  // the id to open it under, or nullopt for a new one) and runs its first
  // step: under the sequence's id, or, when a session is open under it (a
  // start replaces a sequence) or the start also ends, under a new id,
  // renamed to the sequence's once the step succeeded (the old session
  // freed then). Records the sequence; frees the new session if the step
  // fails (or ends the sequence), leaving an open one as it was.
  using Opener =
      std::function<absl::StatusOr<std::string>(std::optional<std::string> as)>;
  absl::Status OpenAndStep(const Opener& open, v1::SessionStepRequest* step,
                           v1::SessionStepResponse* response,
                           const CallControl& control);
  absl::Status Continue(v1::SessionStepRequest* step,
                        v1::SessionStepResponse* response,
                        const CallControl& control);
  // The sequence after a continuing step that gave `stepped`: forgotten
  // when its session is gone (the protocol's status for that) or when the
  // step ended it.
  absl::Status Continued(const absl::Status& stepped);

  SequenceTable* const table_;
  const std::string model_;
  const SequenceParameters parameters_;
  // The sequence's session id.
  std::string target_;
  // Start: the session to create.
  v1::CreateSessionRequest create_;
  // Other steps: the session, looked up once for the cost; a fork: its
  // parent's. Empty (`deferred_`) when not open here at creation.
  std::string session_id_;
  bool deferred_ = false;
  std::optional<SessionStepHandler> handler_;
  RequestCost cost_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SEQUENCES_H_
