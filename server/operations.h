// The operations attnserve computes, each declared once: its name as a
// built-in model of the Open Inference Protocol and as a native RPC, what
// its model configuration says it computes, its inputs and outputs (the
// protocol's model metadata and configuration), the native messages whose
// scalar fields are its parameters, and, for the stateless operations, its
// cost and its computation. The native service registers an RPC per
// stateless operation from this table (server/attention_service.h); the
// protocol translates a request of a built-in model into the operation's
// native request (server/open_inference.h); statistics name calls by the
// operation's model.
//
// Adding an operation: its request and response and an RPC in the proto, a
// handler (server/handlers.h) and a CostOf (server/request_cost.h), one
// entry in BuiltInOperations (operations.cc) and one AddOperation line in
// the native service.
//
// Thread-safety: the table is built once and never changes; its entries
// may be read from any thread. Ownership: the table owns its entries,
// which live as long as the process.
#ifndef ATTNSERVE_SERVER_OPERATIONS_H_
#define ATTNSERVE_SERVER_OPERATIONS_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "engine/call_cost.h"
#include "server/handlers.h"

namespace attnserve {

// One input or output of an operation, as its model metadata shows it.
struct TensorSpec {
  absl::string_view name;
  v1::DataType dtype = v1::DATA_TYPE_FLOAT32;
  // The tensor's full shape; -1 for dims of any size.
  std::vector<int64_t> shape;
  // The fewest dims it takes when its leading (batch) dims may be left out;
  // -1: all of them.
  int64_t min_rank = -1;
  // Whether a request may leave it out.
  bool optional = false;
};

struct OperationSpec {
  // Its name as a built-in model of the Open Inference Protocol.
  absl::string_view model;
  // Its native RPC ("LayerNorm"); a protocol call is labelled
  // "ModelInfer/" and this in the metrics and the access log.
  absl::string_view rpc;
  // What it computes, the configuration's parameter "operation".
  absl::string_view summary;
  // Other parameters of its configuration, e.g. defaults of its inputs.
  std::vector<std::pair<absl::string_view, absl::string_view>> config = {};
  std::vector<TensorSpec> inputs = {};
  std::vector<TensorSpec> outputs = {};
  // The native request and the messages whose scalar fields a protocol
  // request sets by name (e.g. multi_head_attend's inline weights).
  const google::protobuf::Descriptor* request = nullptr;
  const google::protobuf::Descriptor* response = nullptr;
  std::vector<const google::protobuf::Descriptor*> parameter_messages = {};
  // Whether its requests are steps of sequences (and only those).
  bool sequences = false;

  // Stateless operations only (null for those whose calls hold state, a
  // served model or a sequence, which their front ends bind): the cost of
  // a request, read from its shapes, and the computation.
  RequestCost (*cost)(const google::protobuf::Message& request) = nullptr;
  absl::Status (*run)(const google::protobuf::Message& request,
                      google::protobuf::Message* response,
                      const CallControl& control) = nullptr;

  bool stateless() const { return run != nullptr; }
  // A new, empty native request and response.
  std::unique_ptr<google::protobuf::Message> NewRequest() const;
  std::unique_ptr<google::protobuf::Message> NewResponse() const;
};

// Every operation, sorted by model name.
const std::vector<OperationSpec>& BuiltInOperations();
// The operation of the built-in model `model`; null for other names.
const OperationSpec* FindOperation(absl::string_view model);
// The operation whose native request is `request`; null for requests of
// no operation (state RPCs, SessionSteps).
const OperationSpec* FindOperationByRequest(
    const google::protobuf::Descriptor& request);

// The operations' names as the protocol's model names: "attend",
// "multi_head_attend", "layer_norm", "rms_norm", "attention_session".
inline constexpr absl::string_view kAttendModel = "attend";
inline constexpr absl::string_view kMultiHeadAttendModel = "multi_head_attend";
inline constexpr absl::string_view kLayerNormModel = "layer_norm";
inline constexpr absl::string_view kRmsNormModel = "rms_norm";
// Its requests are steps of sequences on attention sessions
// (server/sequences.h).
inline constexpr absl::string_view kAttentionSessionModel = "attention_session";

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_OPERATIONS_H_
