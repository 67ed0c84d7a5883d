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
#include "server/request_cost.h"

namespace attnserve {

class SequenceCall;
class SequenceTable;
struct SequenceParameters;

// Names of the built-in models: the native operations that need no served
// model. They take precedence over served models of the same name.
inline constexpr absl::string_view kAttendModel = "attend";
inline constexpr absl::string_view kMultiHeadAttendModel = "multi_head_attend";
inline constexpr absl::string_view kLayerNormModel = "layer_norm";
// Its requests are steps of sequences on attention sessions
// (server/sequences.h).
inline constexpr absl::string_view kAttentionSessionModel = "attention_session";

bool IsBuiltInModel(absl::string_view model);
// The built-in models' names, sorted.
std::vector<std::string> BuiltInModels();

// A served model's sequences have a model name of their own, the served
// model's name and this suffix ("demo_session" for "demo"): a stateless
// request and a sequence step take different inputs and outputs, and
// Triton's tools read a model's inputs, outputs and sequence batching from
// its metadata and configuration. A served model of that name (a folder
// "demo_session") takes precedence.
inline constexpr absl::string_view kSequenceModelSuffix = "_session";

// What a protocol model name names.
enum class ProtocolModelKind {
  kAttend,
  kMultiHeadAttend,
  kLayerNorm,
  kAttentionSession,
  kServed,           // a served model, stateless (MultiHeadAttend)
  kServedSequences,  // the sequences of a served model (model sessions)
};

struct ProtocolModel {
  ProtocolModelKind kind = ProtocolModelKind::kAttend;
  std::string name;  // as the protocol names it
  // kServed and kServedSequences: the served model, looked up once (a call
  // keeps it even if the repository reloads meanwhile).
  std::shared_ptr<const Model> served;

  bool built_in() const { return served == nullptr; }
  // Whether its requests are steps of sequences (and only those).
  bool takes_sequences() const {
    return kind == ProtocolModelKind::kAttentionSession ||
           kind == ProtocolModelKind::kServedSequences;
  }
};

// The model `name` names: a built-in one, a served one, or a served one's
// sequences. INVALID_ARGUMENT (naming `field`) for a name no model can
// have; NOT_FOUND listing the models there are for other names. `models`
// may be null (no repository).
absl::StatusOr<ProtocolModel> FindProtocolModel(const std::string& name,
                                                const ModelRepository* models,
                                                absl::string_view field);
// Every model name the protocol answers to, sorted: the built-in models,
// each served model and its sequences' model.
std::vector<std::string> ProtocolModelNames(const ModelRepository* models);

// What a request parameter holds, for messages: "bool", "int64",
// "string", "double", "uint64" or "empty".
absl::string_view ParameterKind(const inference::InferParameter& parameter);

// The protocol's name of a native dtype ("FP32", "BF16", "FP16", "BOOL",
// "UINT8").
absl::string_view ProtocolDatatype(v1::DataType dtype);
// The native dtype of a protocol datatype; INVALID_ARGUMENT naming `field`
// for others.
absl::StatusOr<v1::DataType> NativeDatatype(absl::string_view datatype,
                                            absl::string_view field);

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
  enum class Kind { kAttend, kMultiHeadAttend, kLayerNorm, kSequenceStep };
  NativeInferCall(Kind kind, std::unique_ptr<google::protobuf::Message> request,
                  std::unique_ptr<google::protobuf::Message> response);
  // FromRequest for a request of a sequence.
  static absl::StatusOr<std::unique_ptr<NativeInferCall>> FromSequence(
      inference::ModelInferRequest* request,
      std::shared_ptr<const Model> served, SequenceTable* sequences,
      const SequenceParameters& sequence);

  Kind kind_;
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
