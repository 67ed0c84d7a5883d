// The Open Inference Protocol (KServe v2) in terms of the native API: a
// ModelInferRequest becomes the native request of the operation its model
// names (the built-in models "attend", "multi_head_attend", "layer_norm",
// or a served model, run as MultiHeadAttend), is computed by the native
// handlers, and the native response becomes a ModelInferResponse. Model
// metadata and readiness likewise. No gRPC machinery, like handlers.h: the
// service (server/attention_service.h) admits, queues and records the call.
//
// Mapping (the README's "Open Inference Protocol" section for users):
//  - an input named like a Tensor field of the native request (query, key,
//    value, attn_mask, key_padding_mask; input, gamma, beta; for
//    multi_head_attend also the weight fields, e.g. in_proj_weight) fills
//    that field;
//  - a request parameter named like a scalar field (causal, scale,
//    temperature, return_weights, average_weights, compute_bf16, eps,
//    normalized_ndim; num_heads for multi_head_attend) sets it;
//  - outputs "output" and "weights"; asking for "weights" sets
//    return_weights;
//  - Triton's shared-memory parameters (shared_memory_region,
//    shared_memory_offset, shared_memory_byte_size) on an input or a
//    requested output read it from or write it to a region registered with
//    RegisterSharedMemory.
//
//  - sequences (Triton's sequence extension) on a served model's sequences
//    model ("demo_session" for "demo") and the built-in
//    "attention_session" are decode-session steps (server/sequences.h);
//  - a request that names no output gets every output of its model.
//
// Thread-safety: NativeInferCall is thread-compatible (one call, one
// thread at a time); the free functions share nothing but the thread-safe
// ModelRepository. Ownership: a NativeInferCall owns its native messages
// and the model it looked up.
#ifndef ATTNSERVE_SERVER_OPEN_INFERENCE_H_
#define ATTNSERVE_SERVER_OPEN_INFERENCE_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "inference/grpc_service.pb.h"
#include "server/handlers.h"
#include "server/model_repository.h"
#include "server/protocol_models.h"
#include "server/request_cost.h"

namespace attnserve {

class SequenceCall;
class SequenceTable;
struct SequenceParameters;

// The request parameters `model` takes (the scalar fields of its native
// request), in field order.
std::vector<std::string> RequestParameterNames(const ProtocolModel& model);

// One ModelInfer call as a native call.
class NativeInferCall {
 public:
  // Translates `request`, taking its raw_input_contents (moved, not
  // copied). INVALID_ARGUMENT names the input, output or parameter at
  // fault; NOT_FOUND for a model that is neither built in nor served (or a
  // version other than "" and "1"). `models` may be null (no repository).
  // `sequences` null: requests of a sequence are refused
  // (FAILED_PRECONDITION), as on a server without decode sessions.
  static absl::StatusOr<std::unique_ptr<NativeInferCall>> FromRequest(
      inference::ModelInferRequest* request, const ModelRepository* models,
      SequenceTable* sequences = nullptr);
  ~NativeInferCall();

  // What the native call will cost, for admission.
  RequestCost cost() const;
  // Its label in the metrics and the access log: "ModelInfer/" and the
  // native operation, e.g. "ModelInfer/Attend".
  std::string label() const;
  // Computes the native call.
  absl::Status Run(const CallControl& control);
  // A continuing sequence's step as the step coalescer takes it, in place
  // of Run (this call must outlive the answer); nullopt for other calls.
  std::optional<SessionStepCall> StepCall();
  // The native response as the protocol's, its result bytes moved into
  // raw_output_contents; model name, version and id from `request`.
  void ToResponse(const inference::ModelInferRequest& request,
                  inference::ModelInferResponse* response);
  // The native request, for tests.
  const google::protobuf::Message& native_request() const { return *request_; }

 private:
  explicit NativeInferCall(const OperationSpec& operation);
  // FromRequest for a request of a sequence, which runs `operation`
  // (attention_session's steps).
  static absl::StatusOr<std::unique_ptr<NativeInferCall>> FromSequence(
      inference::ModelInferRequest* request, const OperationSpec& operation,
      std::shared_ptr<const Model> served, SequenceTable* sequences,
      const SequenceParameters& sequence);

  const OperationSpec& operation_;
  std::unique_ptr<google::protobuf::Message> request_;
  std::unique_ptr<google::protobuf::Message> response_;
  // MultiHeadAttend only: the model looked up once, for cost and compute.
  std::optional<MultiHeadAttendHandler> multi_head_;
  // Sequence steps only: the sequence's session and what to do with it.
  std::unique_ptr<SequenceCall> sequence_;
  // The outputs the client asked for; empty: all.
  std::vector<std::string> requested_outputs_;
};

// ModelMetadata: the built-in models' inputs and outputs, or a served
// model's; inputs a request may leave out carry the parameter "optional"
// (true). NOT_FOUND for other names and versions.
absl::Status HandleModelMetadata(const inference::ModelMetadataRequest& request,
                                 const ModelRepository* models,
                                 inference::ModelMetadataResponse* response);
// ModelReady: true for the built-in models and served ones, false for
// others (and other versions); INVALID_ARGUMENT for a name no model can
// have.
absl::Status HandleModelReady(const inference::ModelReadyRequest& request,
                              const ModelRepository* models,
                              inference::ModelReadyResponse* response);
// ServerMetadata: name "attnserve", the build's version, the extensions
// (Triton's names) that both front ends implement; "sequence" only when
// `sequences` (decode sessions are on).
void HandleServerMetadata(bool sequences,
                          inference::ServerMetadataResponse* response);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_OPEN_INFERENCE_H_
