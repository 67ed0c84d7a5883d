// The AttentionService RPCs as plain functions, request -> core -> response:
// each decodes the request's wire tensors into core views (no copy), calls
// the core, and writes the result into the response (or the shared-memory
// regions the request names). No gRPC machinery: admission, queueing,
// deadlines and metrics are the service's (server/attention_service.h), so
// that these can be tested and reused directly.
//
// Thread-safety: the handlers may run concurrently; they share nothing but
// the ModelRepository and SharedMemoryRegistry passed in, which are
// thread-safe. Ownership: they own nothing they are given; the request,
// response and everything a CallControl points to must outlive the call.
#ifndef ATTNSERVE_SERVER_HANDLERS_H_
#define ATTNSERVE_SERVER_HANDLERS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "core/multi_head_attention.h"
#include "core/session_store.h"
#include "proto/tensor_codec.h"
#include "server/model_repository.h"
#include "server/shared_memory.h"

namespace attnserve {

// What a running call lets its handler see of the call.
struct CallControl {
  // Turns true when the client cancels or the deadline passes.
  const std::atomic<bool>* cancelled = nullptr;
  // Resolves the request's shared-memory references and keeps their regions
  // mapped for the call; null: references are refused.
  CallSharedMemory* shared_memory = nullptr;
};

absl::Status HandleAttend(const v1::AttendRequest& request,
                          v1::AttendResponse* response,
                          const CallControl& control = {});

// MultiHeadAttend with the request's model looked up once, when the call
// arrives, for both its cost estimate and its computation: the call keeps
// these weights even if the repository reloads meanwhile. Copyable; copies
// share the model.
class MultiHeadAttendHandler {
 public:
  // `models` may be null (no repository).
  MultiHeadAttendHandler(const v1::MultiHeadAttendRequest& request,
                         const ModelRepository* models);
  // With its model looked up already (null: the request sends its weights
  // inline).
  explicit MultiHeadAttendHandler(std::shared_ptr<const Model> model)
      : model_(std::move(model)) {}

  // The served layer, for the cost estimate; null when the request sends
  // its weights inline or its model was not found.
  const MultiHeadLayer* layer() const;

  // Fails with the lookup's error if the model was not found.
  absl::Status operator()(const v1::MultiHeadAttendRequest& request,
                          v1::MultiHeadAttendResponse* response,
                          const CallControl& control) const;

 private:
  // Null when the request sends its weights inline.
  absl::StatusOr<std::shared_ptr<const Model>> model_;
};

// MultiHeadAttendHandler's lookup and computation in one step. `models` may
// be null (no repository).
absl::Status HandleMultiHeadAttend(const v1::MultiHeadAttendRequest& request,
                                   const ModelRepository* models,
                                   v1::MultiHeadAttendResponse* response,
                                   const CallControl& control = {});
absl::Status HandleLayerNorm(const v1::LayerNormRequest& request,
                             v1::LayerNormResponse* response,
                             const CallControl& control = {});
absl::Status HandleRmsNorm(const v1::RmsNormRequest& request,
                           v1::RmsNormResponse* response,
                           const CallControl& control = {});

// Decode sessions. `sessions` null means sessions are off
// (FAILED_PRECONDITION); `models` may be null (no repository).
// `max_length` is the server's limit, and the length of sessions created
// without one. `as` (create and fork): the new session's id, chosen by the
// caller (SessionStore::AddNamed), instead of a new one.
absl::Status HandleCreateSession(const v1::CreateSessionRequest& request,
                                 const ModelRepository* models,
                                 SessionStore* sessions, int64_t max_length,
                                 v1::CreateSessionResponse* response,
                                 std::optional<std::string> as = std::nullopt);
absl::Status HandleHandOverSession(const v1::HandOverSessionRequest& request,
                                   SessionStore* sessions);
// SessionStore::HeldElsewhere, false without sessions.
bool WaitsForSession(SessionStore* sessions, absl::string_view id);

// `wait`: whether the call may wait for another replica (PeerWait).
absl::Status HandleDeleteSession(const v1::DeleteSessionRequest& request,
                                 SessionStore* sessions,
                                 PeerWait wait = PeerWait::kAllowed);
absl::Status HandleForkSession(const v1::ForkSessionRequest& request,
                               SessionStore* sessions,
                               v1::ForkSessionResponse* response,
                               std::optional<std::string> as = std::nullopt,
                               PeerWait wait = PeerWait::kAllowed);

// A SessionStep request decoded into the entry SessionStore::StepMany
// takes (SessionSteps, and SessionStep calls run together in one pass):
// views of the request's tensors, its options, and the allocator that
// writes its output into `output` (or the request's result region).
// Points into the request, `output` and the control's shared memory, which
// must outlive it; neither copyable nor movable (the entry points into it).
class DecodedStep {
 public:
  DecodedStep() = default;
  DecodedStep(const DecodedStep&) = delete;
  DecodedStep& operator=(const DecodedStep&) = delete;

  // INVALID_ARGUMENT naming the tensor field that does not decode.
  absl::Status Decode(const v1::SessionStepRequest& request, v1::Tensor* output,
                      const CallControl& control);
  const SessionStore::StepInput& input() const { return input_; }
  // The session's length after the step, once it has run.
  int64_t length() const { return length_; }

 private:
  std::optional<WireResults> results_;
  int64_t length_ = 0;
  SessionStore::StepInput input_;
};

// A call that steps one decode session, as the step coalescer takes it
// (CallPipeline::Coalesce): decoded just before its pass, completed after
// it. Front ends offer it beside the call's handler; with a coalescer the
// pipeline runs the step in a shared pass, whichever front end received it.
struct SessionStepCall {
  std::string session_id;
  // The step's input, valid until `complete` has returned; not OK: the
  // step is left out of the pass and answered with that status.
  std::function<absl::StatusOr<const SessionStore::StepInput*>(
      const CallControl&)>
      decode;
  // The call's status from its step's (`stepped`: the pass's status for
  // it, or why it was left out); fills the response when OK.
  std::function<absl::Status(const absl::Status& stepped, const CallControl&)>
      complete;
};

// SessionStep with the session looked up when the call arrives, for its
// cost estimate; the step itself looks it up again (it may be gone by
// then). Runs alone through operator(), or in the coalescer's passes
// through StepCall. Copyable.
class SessionStepHandler {
 public:
  SessionStepHandler(const v1::SessionStepRequest& request,
                     SessionStore* sessions);
  // Null when the session was not found (the step will say why).
  const DecodeSession* session() const;
  absl::Status operator()(const v1::SessionStepRequest& request,
                          v1::SessionStepResponse* response,
                          const CallControl& control) const;
  // The call as the coalescer takes it: `request` decoded before its pass,
  // then `response` completed. Both must outlive the call's answer.
  SessionStepCall StepCall(const v1::SessionStepRequest& request,
                           v1::SessionStepResponse* response) const;

 private:
  SessionStore* sessions_;
  std::shared_ptr<const DecodeSession> session_;
  // Why the lookup failed other than NOT_FOUND (an id too long); the step
  // answers it. OK otherwise: a session not open here is taken up (or said
  // NOT_FOUND) by the step.
  absl::Status lookup_error_;
};

// The most steps one SessionSteps call may carry by default
// (--max_steps_per_call).
inline constexpr int kDefaultMaxStepsPerCall = 256;

// RESOURCE_EXHAUSTED past `max_steps`, INVALID_ARGUMENT for no steps.
absl::Status VerifyStepCount(int64_t steps, int max_steps);

// The limits one step of a SessionSteps call is held to on its own.
struct StepLimits {
  int64_t max_tensor_elements = std::numeric_limits<int64_t>::max();
  int64_t max_request_bytes = std::numeric_limits<int64_t>::max();
};

// SessionSteps: the request's steps in one pass (SessionStore::StepMany),
// one result per step in the request's order, each with its own status: a
// step that fails (its session gone, its inputs wrong or over `limits`,
// its session named by an earlier step) fails alone. The call itself fails
// only as a whole (sessions off, too many steps, cancelled, shared memory
// gone). The sessions are looked up and each step is held to `limits`
// when the call arrives, for its cost estimate. Copyable.
class SessionStepsHandler {
 public:
  SessionStepsHandler(const v1::SessionStepsRequest& request,
                      SessionStore* sessions, int max_steps,
                      const StepLimits& limits = {});
  // The sessions found, one per step (null: not found).
  const std::vector<std::shared_ptr<const DecodeSession>>& sessions() const {
    return found_;
  }
  absl::Status operator()(const v1::SessionStepsRequest& request,
                          v1::SessionStepsResponse* response,
                          const CallControl& control) const;

 private:
  SessionStore* sessions_;
  int max_steps_;
  // Null for a step not found or refused.
  std::vector<std::shared_ptr<const DecodeSession>> found_;
  // Each step's refusal at arrival (OK: none).
  std::vector<absl::Status> refused_;
};

// `models` may be null (no repository).
absl::Status HandleListModels(const ModelRepository* models,
                              v1::ListModelsResponse* response);
absl::Status HandleGetModelMetadata(const v1::GetModelMetadataRequest& request,
                                    const ModelRepository* models,
                                    v1::GetModelMetadataResponse* response);
// A served model's layer and its request's tensors (GetModelMetadata's
// answer for it).
void DescribeModel(const Model& model, v1::GetModelMetadataResponse* response);

// `registry` may be null (shared memory off: FAILED_PRECONDITION).
absl::Status HandleRegisterSharedMemory(
    const v1::RegisterSharedMemoryRequest& request,
    SharedMemoryRegistry* registry);
absl::Status HandleUnregisterSharedMemory(
    const v1::UnregisterSharedMemoryRequest& request,
    SharedMemoryRegistry* registry);
absl::Status HandleListSharedMemory(const v1::ListSharedMemoryRequest& request,
                                    const SharedMemoryRegistry* registry,
                                    v1::ListSharedMemoryResponse* response);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_HANDLERS_H_
