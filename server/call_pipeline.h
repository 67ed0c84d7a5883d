// The path every compute call takes, whichever front end received it
// (native gRPC, the Open Inference Protocol over gRPC or HTTP): the engine
// (engine/engine.h: admission, dispatch, computation, step coalescing and
// the record of every call) with what the server keeps around it: the
// call's shared memory, the records (server/call_records.h) and the
// protocol's sequences and settings. Front ends authenticate and decode;
// they hand the pipeline a decoded request and its bound handler, and
// answer the client with what it returns.
//
// Thread-safety: every method may be called from any thread (everything
// ServiceConfig points to is thread-safe). Ownership: owns nothing
// ServiceConfig points to; those must outlive it.
#ifndef ATTNSERVE_SERVER_CALL_PIPELINE_H_
#define ATTNSERVE_SERVER_CALL_PIPELINE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/session_store.h"
#include "engine/engine.h"
#include "google/protobuf/message.h"
#include "server/auth.h"
#include "server/call_records.h"
#include "server/handlers.h"
#include "server/model_repository.h"
#include "server/request_cost.h"
#include "server/runtime_settings.h"
#include "server/sequences.h"
#include "server/shared_memory.h"

namespace attnserve {

// What the pipeline needs from the server around it; every pointer must
// outlive the pipeline.
struct ServiceConfig {
  const ModelRepository* models = nullptr;  // null: no repository
  // The same repository, for the protocol's model load and unload.
  ModelRepository* repository = nullptr;
  // Null: no shared memory (its RPCs answer FAILED_PRECONDITION).
  SharedMemoryRegistry* shared_memory = nullptr;
  // Required: admits, dispatches, computes and records the calls.
  Engine* engine = nullptr;
  // Required: what the engine records into (statistics, log settings).
  CallRecords* records = nullptr;
  // Null: decode sessions are off (their RPCs answer FAILED_PRECONDITION).
  SessionStore* sessions = nullptr;
  // The longest session, and the length of sessions created without one.
  int64_t max_session_length = 0;
  // Steps one SessionSteps call may carry.
  int max_steps_per_call = 256;
  // Null: no authentication.
  const TokenAuthenticator* auth = nullptr;
};

class CallPipeline {
 public:
  explicit CallPipeline(const ServiceConfig& config) : config_(config) {}

  const ServiceConfig& config() const { return config_; }
  Engine& engine() const { return *config_.engine; }
  // Per-model statistics of the calls the engine records.
  const StatisticsTable& statistics() const {
    return config_.records->statistics();
  }
  // The open sequences of the protocol's sequence extension (thread-safe).
  SequenceTable* sequences() const { return &sequences_; }
  // The logging and trace extensions' settings (thread-safe).
  LogSettings* log_settings() const { return config_.records->log_settings(); }
  TraceSettings* trace_settings() const { return &trace_settings_; }

  // Checks an `authorization` header's value (nullopt: none sent).
  absl::Status CheckAuthorization(
      std::optional<absl::string_view> authorization) const;
  // Engine::Compute of `handle` with the call's shared memory (mapped
  // for the call).
  absl::Status Compute(
      const EngineCall& call, const std::atomic<bool>* cancelled,
      absl::FunctionRef<absl::Status(const CallControl&)> handle,
      absl::Duration* compute) const;

  // Engine::Submit of `handle` with the call's shared memory: admitted,
  // computed (here when tiny and a worker is free, else on a worker),
  // recorded, then `finish` is called once with the status, on whichever
  // thread computed. `cancelled` (may be null) and `call.subject` must live
  // until `finish` is called.
  void Run(EngineCall call,
           std::function<absl::Status(const CallControl&)> handle,
           const std::atomic<bool>* cancelled,
           std::function<void(const absl::Status&)> finish) const;
  // Run for a call that may step a decode session: when Coalesces says so,
  // `step()` is asked (here, once) for its SessionStepCall, and a call that
  // has one joins the step coalescer's passes (`handle` is then not
  // called). Other calls, and all when the coalescer is off, take Run.
  void Run(EngineCall call,
           std::function<absl::Status(const CallControl&)> handle,
           const std::atomic<bool>* cancelled,
           std::function<void(const absl::Status&)> finish,
           absl::FunctionRef<std::optional<SessionStepCall>()> step) const;

  // The answer to a coalesced call: its status, how long it waited for its
  // pass and how long the pass computed. Called once, after the engine
  // recorded the call.
  using StepAnswer = std::function<void(
      const absl::Status&, absl::Duration queue_wait, absl::Duration compute)>;
  // Admits `call` and hands `step` to the coalescer for its next pass;
  // `answer` is called once, at once when the call is refused, else on the
  // pass's thread. `complete` (may be null) runs before the record, with
  // the pass's compute time: it finishes the call's response and returns
  // the status to answer with.
  // `cancelled` (may be null) and `call.subject` must live until `answer`.
  using StepComplete =
      std::function<absl::Status(const absl::Status&, absl::Duration)>;
  void Coalesce(EngineCall call, SessionStepCall step,
                const std::atomic<bool>* cancelled, StepComplete complete,
                StepAnswer answer) const;

 private:
  ServiceConfig config_;
  mutable SequenceTable sequences_{config_.sessions, config_.models,
                                   config_.max_session_length};
  mutable TraceSettings trace_settings_{config_.models};
};

// "AttendRequest" -> "Attend": the RPC a request message is for.
std::string RpcName(const google::protobuf::Message& request);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_CALL_PIPELINE_H_
