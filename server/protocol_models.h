// The models the Open Inference Protocol answers to, by name: the built-in
// operations, each served model and its sequences' model; and the
// protocol's names of parameter kinds and datatypes. Shared by the
// protocol's translation (server/open_inference.h), its sequences
// (server/sequences.h), statistics and configuration.
//
// Thread-safety: free functions; they share nothing but the thread-safe
// ModelRepository. Ownership: a ProtocolModel shares the served model it
// found.
#ifndef ATTNSERVE_SERVER_PROTOCOL_MODELS_H_
#define ATTNSERVE_SERVER_PROTOCOL_MODELS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "inference/grpc_service.pb.h"
#include "server/model_repository.h"
#include "server/operations.h"

namespace attnserve {

// The built-in models are the operations (server/operations.h), by their
// names; they take precedence over served models of the same name.
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

// What a protocol model name names: a built-in operation, a served model
// (stateless: multi_head_attend with its weights) or a served model's
// sequences (attention_session's steps through the model's projections).
struct ProtocolModel {
  std::string name;  // as the protocol names it
  // The operation its requests run.
  const OperationSpec* operation = nullptr;
  // Served models and their sequences: the served model, looked up once
  // (a call keeps it even if the repository reloads meanwhile).
  std::shared_ptr<const Model> served;

  bool built_in() const { return served == nullptr; }
  // Whether its requests are steps of sequences (and only those).
  bool takes_sequences() const { return operation->sequences; }
  // Whether it is a served model's sequences.
  bool served_sequences() const { return !built_in() && takes_sequences(); }
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

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_PROTOCOL_MODELS_H_
