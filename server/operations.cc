#include "server/operations.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "core/attention_weights.h"
#include "server/request_cost.h"

namespace attnserve {
namespace {

using google::protobuf::Message;

constexpr v1::DataType kFloat = v1::DATA_TYPE_FLOAT32;
constexpr v1::DataType kMask = v1::DATA_TYPE_BOOL;

// Fills `spec`'s native messages, cost and computation from a typed
// handler and cost.
template <typename Request, typename Response,
          RequestCost (*kCost)(const Request&),
          absl::Status (*kRun)(const Request&, Response*, const CallControl&)>
void Stateless(OperationSpec* spec) {
  spec->request = Request::descriptor();
  spec->response = Response::descriptor();
  spec->parameter_messages = {Request::descriptor()};
  spec->cost = [](const Message& request) {
    return kCost(static_cast<const Request&>(request));
  };
  spec->run = [](const Message& request, Message* response,
                 const CallControl& control) {
    return kRun(static_cast<const Request&>(request),
                static_cast<Response*>(response), control);
  };
}

// [B, H, L, d]: PyTorch's layout; fewer (or more) batch dims work.
OperationSpec Attend() {
  OperationSpec spec{.model = kAttendModel,
                     .rpc = "Attend",
                     .summary = "scaled dot-product attention"};
  for (const char* name : {"query", "key", "value"}) {
    spec.inputs.push_back({name, kFloat, {-1, -1, -1, -1}, 2});
  }
  spec.inputs.push_back({"attn_mask", kMask, {-1, -1, -1, -1}, 0, true});
  spec.outputs = {{"output", kFloat, {-1, -1, -1, -1}, 2},
                  {"weights", kFloat, {-1, -1, -1, -1}, 2}};
  Stateless<v1::AttendRequest, v1::AttendResponse, &CostOf, &HandleAttend>(
      &spec);
  return spec;
}

// [B, L, E] or [L, E]; key defaults to the query and value to the key; the
// weights in either layout (biases and out_proj_weight as the native
// request says). Bound per call: a served model's calls hold the model.
OperationSpec MultiHeadAttend() {
  OperationSpec spec{
      .model = kMultiHeadAttendModel,
      .rpc = "MultiHeadAttend",
      .summary =
          "multi-head attention with the request's "
          "weights",
      .config = {{"key_default", "query"}, {"value_default", "key"}}};
  spec.inputs.push_back({"query", kFloat, {-1, -1, -1}, 2});
  for (const char* name : {"key", "value"}) {
    spec.inputs.push_back({name, kFloat, {-1, -1, -1}, 2, true});
  }
  spec.inputs.push_back({"attn_mask", kMask, {-1, -1, -1, -1}, 2, true});
  spec.inputs.push_back({"key_padding_mask", kMask, {-1, -1}, 1, true});
  for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
    const bool matrix = absl::EndsWith(field.name, "_weight");
    spec.inputs.push_back(
        {field.name, kFloat,
         matrix ? std::vector<int64_t>{-1, -1} : std::vector<int64_t>{-1}, -1,
         true});
  }
  spec.outputs = {{"output", kFloat, {-1, -1, -1}, 2},
                  {"weights", kFloat, {-1, -1, -1, -1}, 2}};
  spec.request = v1::MultiHeadAttendRequest::descriptor();
  spec.response = v1::MultiHeadAttendResponse::descriptor();
  spec.parameter_messages = {v1::MultiHeadAttendRequest::descriptor(),
                             v1::AttentionWeights::descriptor()};
  return spec;
}

OperationSpec LayerNorm() {
  OperationSpec spec{.model = kLayerNormModel,
                     .rpc = "LayerNorm",
                     .summary = "layer normalization"};
  spec.inputs = {{"input", kFloat, {-1, -1}, 1},
                 {"gamma", kFloat, {-1}, -1, true},
                 {"beta", kFloat, {-1}, -1, true}};
  spec.outputs = {{"output", kFloat, {-1, -1}, 1}};
  Stateless<v1::LayerNormRequest, v1::LayerNormResponse, &CostOf,
            &HandleLayerNorm>(&spec);
  return spec;
}

OperationSpec RmsNorm() {
  OperationSpec spec{.model = kRmsNormModel,
                     .rpc = "RmsNorm",
                     .summary = "root-mean-square normalization"};
  spec.inputs = {{"input", kFloat, {-1, -1}, 1},
                 {"gamma", kFloat, {-1}, -1, true}};
  spec.outputs = {{"output", kFloat, {-1, -1}, 1}};
  Stateless<v1::RmsNormRequest, v1::RmsNormResponse, &CostOf, &HandleRmsNorm>(
      &spec);
  return spec;
}

// [B, H, n, d]; B may be left out. Bound per call: a step holds its
// sequence's session.
OperationSpec AttentionSession() {
  OperationSpec spec{
      .model = kAttentionSessionModel,
      .rpc = "SessionStep",
      .summary = "causal attention over a sequence's cached keys and values"};
  for (const char* name : {"query", "key", "value"}) {
    spec.inputs.push_back({name, kFloat, {-1, -1, -1, -1}, 3});
  }
  spec.outputs = {{"output", kFloat, {-1, -1, -1, -1}, 3}};
  spec.request = v1::SessionStepRequest::descriptor();
  spec.response = v1::SessionStepResponse::descriptor();
  spec.parameter_messages = {v1::SessionStepRequest::descriptor()};
  spec.sequences = true;
  return spec;
}

std::vector<OperationSpec> MakeOperations() {
  std::vector<OperationSpec> operations = {
      Attend(), MultiHeadAttend(), LayerNorm(), RmsNorm(), AttentionSession()};
  std::sort(operations.begin(), operations.end(),
            [](const OperationSpec& a, const OperationSpec& b) {
              return a.model < b.model;
            });
  return operations;
}

}  // namespace

std::unique_ptr<Message> OperationSpec::NewRequest() const {
  return std::unique_ptr<Message>(
      google::protobuf::MessageFactory::generated_factory()
          ->GetPrototype(request)
          ->New());
}

std::unique_ptr<Message> OperationSpec::NewResponse() const {
  return std::unique_ptr<Message>(
      google::protobuf::MessageFactory::generated_factory()
          ->GetPrototype(response)
          ->New());
}

const std::vector<OperationSpec>& BuiltInOperations() {
  static const std::vector<OperationSpec>* const operations =
      new std::vector<OperationSpec>(MakeOperations());
  return *operations;
}

const OperationSpec* FindOperation(absl::string_view model) {
  for (const OperationSpec& operation : BuiltInOperations()) {
    if (operation.model == model) return &operation;
  }
  return nullptr;
}

const OperationSpec* FindOperationByRequest(
    const google::protobuf::Descriptor& request) {
  for (const OperationSpec& operation : BuiltInOperations()) {
    if (operation.request == &request) return &operation;
  }
  return nullptr;
}

}  // namespace attnserve
