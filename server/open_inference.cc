#include "server/open_inference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/attention_weights.h"
#include "core/status_macros.h"
#include "core/verify.h"
#include "server/sequences.h"

#ifndef ATTNSERVE_VERSION
#define ATTNSERVE_VERSION "unknown"
#endif

namespace attnserve {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using inference::InferParameter;
using inference::ModelInferRequest;
using inference::ModelInferResponse;
using ParameterMap = google::protobuf::Map<std::string, InferParameter>;

// Triton's names for a tensor in shared memory.
constexpr absl::string_view kRegionParameter = "shared_memory_region";
constexpr absl::string_view kOffsetParameter = "shared_memory_offset";
constexpr absl::string_view kByteSizeParameter = "shared_memory_byte_size";

constexpr absl::string_view kOnlyVersion = "1";

absl::Status VerifyVersion(absl::string_view model, absl::string_view version,
                           absl::string_view field) {
  if (version.empty() || version == kOnlyVersion) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat(field, ": model ", EchoString(model),
                                          " has only version 1, not ",
                                          EchoString(version)));
}

// Triton reserves the prefix "triton_" for parameters of its own that its
// clients add to every request (e.g. triton_enable_empty_final_response):
// accepted, and honoured where ModelStreamInfer answers them.
bool IsTritonParameter(absl::string_view name) {
  return absl::StartsWith(name, "triton_");
}

// Triton checks the type of the one it reads.
absl::Status VerifyTritonParameter(absl::string_view name,
                                   const InferParameter& parameter) {
  if (name != "triton_enable_empty_final_response" ||
      parameter.parameter_choice_case() == InferParameter::kBoolParam) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "parameters: ", name, " must be a bool, got ", ParameterKind(parameter)));
}

// The fields of `message` that the protocol reaches by name: its tensors
// (inputs and outputs) or its scalar options (parameters).
bool IsTensorField(const FieldDescriptor& field) {
  return !field.is_repeated() &&
         field.message_type() == v1::Tensor::descriptor();
}
bool IsOptionField(const FieldDescriptor& field) {
  return !field.is_repeated() && (field.type() == FieldDescriptor::TYPE_BOOL ||
                                  field.type() == FieldDescriptor::TYPE_FLOAT ||
                                  field.type() == FieldDescriptor::TYPE_INT32);
}

// The messages whose fields a request's names may reach: the native request
// and, for multi_head_attend, its inline weights.
std::vector<Message*> Targets(Message* native) {
  std::vector<Message*> targets = {native};
  if (auto* multi_head = dynamic_cast<v1::MultiHeadAttendRequest*>(native);
      multi_head != nullptr && multi_head->has_weights()) {
    targets.push_back(multi_head->mutable_weights());
  }
  return targets;
}

// The field called `name` that `accept` takes in one of `targets`, with the
// message holding it; or an error listing the names `accept` takes.
template <typename Accept>
absl::StatusOr<std::pair<Message*, const FieldDescriptor*>> FindField(
    const std::vector<Message*>& targets, absl::string_view name, Accept accept,
    absl::string_view what, absl::string_view model) {
  std::vector<std::string> expected;
  for (Message* target : targets) {
    const Descriptor* descriptor = target->GetDescriptor();
    for (int i = 0; i < descriptor->field_count(); ++i) {
      const FieldDescriptor* field = descriptor->field(i);
      if (!accept(*field)) continue;
      if (field->name() == name) return std::pair(target, field);
      expected.push_back(field->name());
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      what, "s: unknown ", what, " ", EchoString(name), " for model ",
      EchoString(model), "; expected one of ", absl::StrJoin(expected, ", ")));
}

// A numeric parameter as a double; nullopt for bools, strings and empties.
std::optional<double> NumericValue(const InferParameter& parameter) {
  switch (parameter.parameter_choice_case()) {
    case InferParameter::kInt64Param:
      return static_cast<double>(parameter.int64_param());
    case InferParameter::kDoubleParam:
      return parameter.double_param();
    case InferParameter::kUint64Param:
      return static_cast<double>(parameter.uint64_param());
    default:
      return std::nullopt;
  }
}

// Sets the option `field` of `target` from `parameter`, which must be of
// the field's kind.
absl::Status SetOption(const InferParameter& parameter, const std::string& name,
                       const FieldDescriptor& field, Message* target) {
  const Reflection* reflection = target->GetReflection();
  const std::string where = absl::StrCat("parameters: ", name);
  if (field.type() == FieldDescriptor::TYPE_BOOL) {
    if (parameter.parameter_choice_case() != InferParameter::kBoolParam) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " must be a bool, got ", ParameterKind(parameter)));
    }
    reflection->SetBool(target, &field, parameter.bool_param());
    return absl::OkStatus();
  }
  const std::optional<double> value = NumericValue(parameter);
  if (!value.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " must be a number, got ", ParameterKind(parameter)));
  }
  if (field.type() == FieldDescriptor::TYPE_FLOAT) {
    if (!std::isfinite(*value) ||
        std::abs(*value) > std::numeric_limits<float>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " = ", *value, " is not a finite float32 value"));
    }
    reflection->SetFloat(target, &field, static_cast<float>(*value));
    return absl::OkStatus();
  }
  // INT32: an integer sent as any number kind, within range.
  if (*value != std::floor(*value) ||
      *value < std::numeric_limits<int32_t>::min() ||
      *value > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " = ", *value, " is not a 32-bit integer"));
  }
  reflection->SetInt32(target, &field, static_cast<int32_t>(*value));
  return absl::OkStatus();
}

// The request's parameters, in name order so that the first error reported
// does not depend on the map's order; the sequence parameters are
// SequenceParametersOf's.
absl::Status ApplyParameters(const ParameterMap& parameters,
                             absl::string_view model, Message* native,
                             bool in_sequence) {
  std::vector<const ParameterMap::value_type*> sorted;
  for (const auto& entry : parameters) sorted.push_back(&entry);
  std::sort(sorted.begin(), sorted.end(),
            [](const auto* a, const auto* b) { return a->first < b->first; });
  for (const auto* entry : sorted) {
    // Triton clients' scheduling hints: accepted and ignored (calls are
    // served in arrival order; the gRPC deadline bounds their time).
    if (entry->first == "priority" || entry->first == "timeout") continue;
    if (IsTritonParameter(entry->first)) {
      ATTN_RETURN_IF_ERROR(VerifyTritonParameter(entry->first, entry->second));
      continue;
    }
    if (IsSequenceParameter(entry->first, in_sequence)) continue;
    ATTN_ASSIGN_OR_RETURN(
        auto target, FindField(Targets(native), entry->first, IsOptionField,
                               "parameter", model));
    ATTN_RETURN_IF_ERROR(
        SetOption(entry->second, entry->first, *target.second, target.first));
  }
  return absl::OkStatus();
}

// A non-negative integer parameter of a tensor.
absl::StatusOr<uint64_t> Unsigned(const InferParameter& parameter,
                                  absl::string_view field) {
  switch (parameter.parameter_choice_case()) {
    case InferParameter::kUint64Param:
      return parameter.uint64_param();
    case InferParameter::kInt64Param:
      if (parameter.int64_param() >= 0) return parameter.int64_param();
      return absl::InvalidArgumentError(absl::StrCat(
          field, " must not be negative, got ", parameter.int64_param()));
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, " must be an integer, got ", ParameterKind(parameter)));
  }
}

// The shared-memory reference of a tensor's parameters (Triton's names);
// nullopt when they name no region. Other parameters are refused.
absl::StatusOr<std::optional<v1::SharedMemoryRef>> SharedMemoryOf(
    const ParameterMap& parameters, absl::string_view tensor) {
  std::optional<v1::SharedMemoryRef> ref;
  bool has_byte_size = false;
  for (const auto& [name, parameter] : parameters) {
    if (IsTritonParameter(name)) continue;
    const std::string field = absl::StrCat(tensor, ": parameter ", name);
    if (!ref.has_value()) ref.emplace();
    if (name == kRegionParameter) {
      if (parameter.parameter_choice_case() != InferParameter::kStringParam) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, " must be a string, got ", ParameterKind(parameter)));
      }
      ref->set_region(parameter.string_param());
    } else if (name == kOffsetParameter) {
      ATTN_ASSIGN_OR_RETURN(uint64_t offset, Unsigned(parameter, field));
      ref->set_offset(offset);
    } else if (name == kByteSizeParameter) {
      ATTN_ASSIGN_OR_RETURN(uint64_t byte_size, Unsigned(parameter, field));
      ref->set_byte_size(byte_size);
      has_byte_size = true;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(tensor, ": unknown parameter ", EchoString(name),
                       "; expected ", kRegionParameter, ", ", kOffsetParameter,
                       " or ", kByteSizeParameter));
    }
  }
  if (!ref.has_value()) return ref;
  if (ref->region().empty() || !has_byte_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(tensor, ": shared memory needs both ", kRegionParameter,
                     " and ", kByteSizeParameter));
  }
  return ref;
}

// The names of the contents fields that hold values, e.g. "fp32_contents".
std::vector<std::string> FilledContents(
    const inference::InferTensorContents& contents) {
  std::vector<std::string> filled;
  const Reflection* reflection = contents.GetReflection();
  const Descriptor* descriptor = contents.GetDescriptor();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    if (reflection->FieldSize(contents, descriptor->field(i)) > 0) {
      filled.push_back(descriptor->field(i)->name());
    }
  }
  return filled;
}

// Moves an input's typed contents into `tensor`: FP32 as float_data, BOOL
// and UINT8 as raw bytes. FP16 and BF16 have no contents field.
absl::Status TakeContents(inference::InferTensorContents* contents,
                          const std::string& name, v1::Tensor* tensor) {
  const std::vector<std::string> filled = FilledContents(*contents);
  const absl::string_view datatype = ProtocolDatatype(tensor->dtype());
  absl::string_view expected;
  switch (tensor->dtype()) {
    case v1::DATA_TYPE_FLOAT32:
      expected = "fp32_contents";
      break;
    case v1::DATA_TYPE_BOOL:
      expected = "bool_contents";
      break;
    case v1::DATA_TYPE_UINT8:
      expected = "uint_contents";
      break;
    default:
      if (filled.empty()) break;
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": ", datatype,
          " values travel only in raw_input_contents (the protocol has no ",
          datatype, " contents field)"));
  }
  if (filled.empty()) return absl::OkStatus();
  if (filled.size() > 1 || filled[0] != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": datatype ", datatype, " takes ", expected,
                     ", got ", absl::StrJoin(filled, ", ")));
  }
  if (tensor->dtype() == v1::DATA_TYPE_FLOAT32) {
    tensor->mutable_float_data()->Swap(contents->mutable_fp32_contents());
    return absl::OkStatus();
  }
  std::string* bytes = tensor->mutable_raw_data();
  if (tensor->dtype() == v1::DATA_TYPE_BOOL) {
    bytes->assign(contents->bool_contents().begin(),
                  contents->bool_contents().end());
    return absl::OkStatus();
  }
  const auto& values = contents->uint_contents();
  bytes->resize(values.size());
  for (int i = 0; i < values.size(); ++i) {
    if (values[i] > 255) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": uint_contents[",
                                                     i, "] = ", values[i],
                                                     " is out of UINT8 range"));
    }
    (*bytes)[i] = static_cast<char>(values[i]);
  }
  return absl::OkStatus();
}

// Fills the native tensor fields from the request's inputs.
absl::Status ApplyInputs(ModelInferRequest* request, Message* native) {
  const bool raw = request->raw_input_contents_size() > 0;
  int raw_used = 0;
  for (ModelInferRequest::InferInputTensor& input :
       *request->mutable_inputs()) {
    const std::string& name = input.name();
    ATTN_ASSIGN_OR_RETURN(
        auto target, FindField(Targets(native), name, IsTensorField, "input",
                               request->model_name()));
    auto [message, field] = target;
    if (message->GetReflection()->HasField(*message, field)) {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs: '", name, "' given more than once"));
    }
    auto* tensor = static_cast<v1::Tensor*>(
        message->GetReflection()->MutableMessage(message, field));
    ATTN_ASSIGN_OR_RETURN(v1::DataType dtype,
                          NativeDatatype(input.datatype(), name));
    tensor->set_dtype(dtype);
    tensor->mutable_shape()->Assign(input.shape().begin(), input.shape().end());
    ATTN_ASSIGN_OR_RETURN(std::optional<v1::SharedMemoryRef> shared,
                          SharedMemoryOf(input.parameters(), name));
    const bool has_contents = !FilledContents(input.contents()).empty();
    if (shared.has_value()) {
      if (has_contents) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, ": values both in shared memory and in contents"));
      }
      *tensor->mutable_shared_memory() = *std::move(shared);
    } else if (raw) {
      if (has_contents) {
        return absl::InvalidArgumentError(absl::StrCat(
            name,
            ": typed contents in a request with raw_input_contents; send "
            "every input one way"));
      }
      if (raw_used == request->raw_input_contents_size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "raw_input_contents: ", raw_used, " entries, fewer than the ",
            "inputs not in shared memory (none left for '", name, "')"));
      }
      tensor->mutable_raw_data()->swap(
          *request->mutable_raw_input_contents(raw_used++));
    } else {
      ATTN_RETURN_IF_ERROR(
          TakeContents(input.mutable_contents(), name, tensor));
    }
  }
  if (raw && raw_used != request->raw_input_contents_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "raw_input_contents: ", request->raw_input_contents_size(),
        " entries, more than the ", raw_used, " inputs not in shared memory"));
  }
  return absl::OkStatus();
}

// Result names are the native response's tensor fields.
bool IsResultField(const FieldDescriptor& field) {
  return IsTensorField(field);
}

// Sets return_weights of `native` (where it has one).
void ReturnWeights(Message* native) {
  if (const FieldDescriptor* return_weights =
          native->GetDescriptor()->FindFieldByName("return_weights")) {
    native->GetReflection()->SetBool(native, return_weights, true);
  }
}

// The requested outputs: names checked, "weights" turns return_weights on,
// shared-memory parameters become result regions. A request that names no
// output asks for every output (the protocol's rule): weights too, unless
// its parameter return_weights says otherwise.
absl::Status ApplyOutputs(const ModelInferRequest& request,
                          const Descriptor& response_type, Message* native,
                          std::vector<std::string>* requested) {
  if (request.outputs().empty() &&
      !request.parameters().contains("return_weights")) {
    ReturnWeights(native);
  }
  std::unique_ptr<Message> response_fields(
      google::protobuf::MessageFactory::generated_factory()
          ->GetPrototype(&response_type)
          ->New());
  for (const auto& output : request.outputs()) {
    ATTN_RETURN_IF_ERROR(FindField({response_fields.get()}, output.name(),
                                   IsResultField, "output",
                                   request.model_name())
                             .status());
    requested->push_back(output.name());
    const Descriptor* descriptor = native->GetDescriptor();
    if (output.name() == "weights") ReturnWeights(native);
    ATTN_ASSIGN_OR_RETURN(std::optional<v1::SharedMemoryRef> shared,
                          SharedMemoryOf(output.parameters(), output.name()));
    if (!shared.has_value()) continue;
    const FieldDescriptor* regions_field =
        descriptor->FindFieldByName("result_regions");
    auto* regions = static_cast<v1::ResultRegions*>(
        native->GetReflection()->MutableMessage(native, regions_field));
    const FieldDescriptor* region_field =
        regions->GetDescriptor()->FindFieldByName(output.name());
    *static_cast<v1::SharedMemoryRef*>(regions->GetReflection()->MutableMessage(
        regions, region_field)) = *std::move(shared);
  }
  return absl::OkStatus();
}

// A native result tensor's values as raw little-endian bytes (float_data,
// which the handlers do not write, converted for completeness).
void TakeRawBytes(v1::Tensor* tensor, std::string* out) {
  if (tensor->float_data_size() > 0) {
    out->resize(tensor->float_data_size() * sizeof(float));
    std::memcpy(out->data(), tensor->float_data().data(), out->size());
    return;
  }
  out->swap(*tensor->mutable_raw_data());
}

void SetParameter(ParameterMap* parameters, absl::string_view name,
                  uint64_t value) {
  (*parameters)[std::string(name)].set_uint64_param(value);
}

using TensorMetadata = inference::ModelMetadataResponse::TensorMetadata;

// Inputs a request of `model` may leave out: as its operation declares
// (server/operations.h); a served model's requests may leave out all but
// the query (key and value default to it, the weights are the model's).
bool IsOptionalInput(const ProtocolModel& model, absl::string_view input) {
  if (!model.built_in()) return !model.takes_sequences() && input != "query";
  for (const TensorSpec& spec : model.operation->inputs) {
    if (spec.name == input) return spec.optional;
  }
  return false;
}

// One tensor of a model's metadata. `shape` is its full form; a tensor
// whose leading dims may be left out (e.g. the batch) carries the
// parameter "min_rank", the fewest dims it takes.
void AddMetadata(google::protobuf::RepeatedPtrField<TensorMetadata>* list,
                 absl::string_view name, v1::DataType dtype,
                 std::vector<int64_t> shape, bool optional = false,
                 int64_t min_rank = -1) {
  TensorMetadata* tensor = list->Add();
  tensor->set_name(std::string(name));
  tensor->set_datatype(std::string(ProtocolDatatype(dtype)));
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  auto* parameters = tensor->mutable_parameters();
  if (optional) (*parameters)["optional"].set_bool_param(true);
  if (min_rank >= 0 && min_rank < static_cast<int64_t>(shape.size())) {
    (*parameters)["min_rank"].set_int64_param(min_rank);
  }
}

// A built-in model's inputs and outputs, as its operation declares them:
// any float dtype for values, any mask dtype for masks; -1 for dimensions
// of any size.
void BuiltInMetadata(const OperationSpec& operation,
                     inference::ModelMetadataResponse* response) {
  for (const TensorSpec& input : operation.inputs) {
    AddMetadata(response->mutable_inputs(), input.name, input.dtype,
                input.shape, input.optional, input.min_rank);
  }
  for (const TensorSpec& output : operation.outputs) {
    AddMetadata(response->mutable_outputs(), output.name, output.dtype,
                output.shape, false, output.min_rank);
  }
}

// A served model's inputs and outputs, or those of its sequences (the
// step's hidden states in, its attention out).
void ServedMetadata(const ProtocolModel& model,
                    inference::ModelMetadataResponse* response) {
  v1::GetModelMetadataResponse native;
  const MultiHeadLayer& layer = *model.served->layer;
  const auto f32 = v1::DATA_TYPE_FLOAT32;
  auto* inputs = response->mutable_inputs();
  auto* outputs = response->mutable_outputs();
  if (model.takes_sequences()) {
    AddMetadata(inputs, "query", f32, {-1, -1, layer.query_dim()}, false, 2);
    AddMetadata(outputs, "output", f32, {-1, -1, layer.output_dim()}, false, 2);
    return;
  }
  DescribeModel(*model.served, &native);
  // The batch may be left out of every tensor; masks and weights also
  // take [Lq, Lk] (the same for every batch entry and head).
  const auto min_rank = [](const v1::TensorMetadata& tensor) -> int64_t {
    if (tensor.name() == "attn_mask" || tensor.name() == "weights") return 2;
    return tensor.shape_size() - 1;
  };
  for (const v1::TensorMetadata& tensor : native.inputs()) {
    AddMetadata(inputs, tensor.name(), tensor.datatype(),
                {tensor.shape().begin(), tensor.shape().end()},
                IsOptionalInput(model, tensor.name()), min_rank(tensor));
  }
  for (const v1::TensorMetadata& tensor : native.outputs()) {
    AddMetadata(outputs, tensor.name(), tensor.datatype(),
                {tensor.shape().begin(), tensor.shape().end()}, false,
                min_rank(tensor));
  }
}

// The inputs of a sequence step: a served model's hidden states as
// "query"; an attention session's query, key and value.
absl::Status VerifySequenceInputs(const ModelInferRequest& request,
                                  bool served) {
  for (const auto& input : request.inputs()) {
    const std::string& name = input.name();
    if (name == "query" || (!served && (name == "key" || name == "value"))) {
      continue;
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs: unknown input ", EchoString(name), " in a sequence of model ",
        EchoString(request.model_name()), "; expected ",
        served ? "query (the step's hidden states [B, n, E] or [n, E]; keys "
                 "and values are projected from them)"
               : "query [B, H, n, dk], key [B, Hkv, n, dk] and value "
                 "[B, Hkv, n, dv] (B may be left out)"));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> RequestParameterNames(const ProtocolModel& model) {
  // A served model's weights are its own: only the request's fields.
  std::vector<const Descriptor*> targets = model.operation->parameter_messages;
  if (!model.built_in()) targets.resize(1);
  std::vector<std::string> names;
  for (const Descriptor* descriptor : targets) {
    for (int i = 0; i < descriptor->field_count(); ++i) {
      if (IsOptionField(*descriptor->field(i))) {
        names.push_back(descriptor->field(i)->name());
      }
    }
  }
  return names;
}

NativeInferCall::NativeInferCall(const OperationSpec& operation)
    : operation_(operation),
      request_(operation.NewRequest()),
      response_(operation.NewResponse()) {}

NativeInferCall::~NativeInferCall() = default;

absl::StatusOr<std::unique_ptr<NativeInferCall>> NativeInferCall::FromRequest(
    ModelInferRequest* request, const ModelRepository* models,
    SequenceTable* sequences) {
  const std::string& name = request->model_name();
  if (name.empty()) {
    return absl::InvalidArgumentError("model_name: missing");
  }
  ATTN_RETURN_IF_ERROR(
      VerifyVersion(name, request->model_version(), "model_version"));
  ATTN_ASSIGN_OR_RETURN(ProtocolModel model,
                        FindProtocolModel(name, models, "model_name"));
  ATTN_ASSIGN_OR_RETURN(const SequenceParameters sequence,
                        SequenceParametersOf(request->parameters(), model));
  if (model.takes_sequences()) {
    return FromSequence(request, *model.operation, std::move(model.served),
                        sequences, sequence);
  }
  const OperationSpec& operation = *model.operation;
  std::unique_ptr<NativeInferCall> call(new NativeInferCall(operation));
  Message* native = call->request_.get();
  if (!operation.stateless()) {
    // multi_head_attend: the request's weights, or the served model's.
    auto* multi_head = static_cast<v1::MultiHeadAttendRequest*>(native);
    if (model.built_in()) {
      multi_head->mutable_weights();
    } else {
      multi_head->set_model(name);
    }
  }
  ATTN_RETURN_IF_ERROR(ApplyParameters(request->parameters(), name, native,
                                       /*in_sequence=*/false));
  ATTN_RETURN_IF_ERROR(ApplyInputs(request, native));
  ATTN_RETURN_IF_ERROR(ApplyOutputs(*request, *call->response_->GetDescriptor(),
                                    native, &call->requested_outputs_));
  if (!operation.stateless()) {
    call->multi_head_.emplace(std::move(model.served));
  }
  return call;
}

absl::StatusOr<std::unique_ptr<NativeInferCall>> NativeInferCall::FromSequence(
    ModelInferRequest* request, const OperationSpec& operation,
    std::shared_ptr<const Model> served, SequenceTable* sequences,
    const SequenceParameters& sequence) {
  const std::string& model = request->model_name();
  ATTN_RETURN_IF_ERROR(VerifySequenceInputs(*request, served != nullptr));
  std::unique_ptr<NativeInferCall> call(new NativeInferCall(operation));
  auto* step = static_cast<v1::SessionStepRequest*>(call->request_.get());
  ATTN_RETURN_IF_ERROR(ApplyParameters(request->parameters(), model, step,
                                       /*in_sequence=*/true));
  ATTN_RETURN_IF_ERROR(ApplyInputs(request, step));
  if (served != nullptr && step->has_query()) {
    // A model session's step is its hidden states, sent as the query.
    step->mutable_input()->Swap(step->mutable_query());
    step->clear_query();
  }
  ATTN_RETURN_IF_ERROR(ApplyOutputs(*request, *call->response_->GetDescriptor(),
                                    step, &call->requested_outputs_));
  ATTN_ASSIGN_OR_RETURN(
      call->sequence_, SequenceCall::Create(sequences, model, std::move(served),
                                            sequence, *step));
  return call;
}

std::string NativeInferCall::label() const {
  return absl::StrCat("ModelInfer/", operation_.rpc);
}

RequestCost NativeInferCall::cost() const {
  if (sequence_ != nullptr) return sequence_->cost();
  if (multi_head_.has_value()) {
    return CostOf(static_cast<const v1::MultiHeadAttendRequest&>(*request_),
                  multi_head_->layer());
  }
  return operation_.cost(*request_);
}

absl::Status NativeInferCall::Run(const CallControl& control) {
  if (sequence_ != nullptr) {
    return sequence_->Run(
        static_cast<v1::SessionStepRequest*>(request_.get()),
        static_cast<v1::SessionStepResponse*>(response_.get()), control);
  }
  if (multi_head_.has_value()) {
    return (*multi_head_)(
        static_cast<const v1::MultiHeadAttendRequest&>(*request_),
        static_cast<v1::MultiHeadAttendResponse*>(response_.get()), control);
  }
  return operation_.run(*request_, response_.get(), control);
}

std::optional<SessionStepCall> NativeInferCall::StepCall() {
  if (sequence_ == nullptr) return std::nullopt;
  return sequence_->StepCall(
      static_cast<v1::SessionStepRequest*>(request_.get()),
      static_cast<v1::SessionStepResponse*>(response_.get()));
}

void NativeInferCall::ToResponse(const ModelInferRequest& request,
                                 ModelInferResponse* response) {
  response->set_model_name(request.model_name());
  response->set_model_version(std::string(kOnlyVersion));
  response->set_id(request.id());
  if (sequence_ != nullptr) {
    // Tokens the sequence holds after this step.
    (*response->mutable_parameters())["sequence_length"].set_int64_param(
        static_cast<const v1::SessionStepResponse&>(*response_).length());
    // The session behind it, for ExportSession and HandOverSession.
    if (const std::string id = sequence_->sequence_session_id(); !id.empty()) {
      (*response->mutable_parameters())["sequence_session_id"].set_string_param(
          id);
    }
  }
  const Descriptor* descriptor = response_->GetDescriptor();
  const Reflection* reflection = response_->GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    if (!IsTensorField(*field) || !reflection->HasField(*response_, field)) {
      continue;
    }
    if (!requested_outputs_.empty() &&
        std::find(requested_outputs_.begin(), requested_outputs_.end(),
                  field->name()) == requested_outputs_.end()) {
      continue;
    }
    auto* tensor = static_cast<v1::Tensor*>(
        reflection->MutableMessage(response_.get(), field));
    ModelInferResponse::InferOutputTensor* output = response->add_outputs();
    output->set_name(field->name());
    output->set_datatype(std::string(ProtocolDatatype(tensor->dtype())));
    output->mutable_shape()->Swap(tensor->mutable_shape());
    std::string* raw = response->add_raw_output_contents();
    if (tensor->has_shared_memory()) {
      const v1::SharedMemoryRef& ref = tensor->shared_memory();
      auto* parameters = output->mutable_parameters();
      (*parameters)[std::string(kRegionParameter)].set_string_param(
          ref.region());
      SetParameter(parameters, kOffsetParameter, ref.offset());
      SetParameter(parameters, kByteSizeParameter, ref.byte_size());
    } else {
      TakeRawBytes(tensor, raw);
    }
  }
}

absl::Status HandleModelMetadata(const inference::ModelMetadataRequest& request,
                                 const ModelRepository* models,
                                 inference::ModelMetadataResponse* response) {
  ATTN_RETURN_IF_ERROR(
      VerifyVersion(request.name(), request.version(), "version"));
  ATTN_ASSIGN_OR_RETURN(const ProtocolModel model,
                        FindProtocolModel(request.name(), models, "name"));
  response->add_versions(std::string(kOnlyVersion));
  response->set_name(model.name);
  if (model.built_in()) {
    response->set_platform("attnserve_builtin");
    BuiltInMetadata(*model.operation, response);
  } else {
    response->set_platform("attnserve_multi_head_attention");
    ServedMetadata(model, response);
  }
  return absl::OkStatus();
}

absl::Status HandleModelReady(const inference::ModelReadyRequest& request,
                              const ModelRepository* models,
                              inference::ModelReadyResponse* response) {
  inference::ModelMetadataRequest metadata_request;
  metadata_request.set_name(request.name());
  metadata_request.set_version(request.version());
  inference::ModelMetadataResponse metadata;
  const absl::Status status =
      HandleModelMetadata(metadata_request, models, &metadata);
  // A model (or version) not served is not ready: an answer, not an error,
  // as the protocol's clients expect.
  if (absl::IsNotFound(status)) {
    response->set_ready(false);
    return absl::OkStatus();
  }
  ATTN_RETURN_IF_ERROR(status);
  response->set_ready(true);
  return absl::OkStatus();
}

void HandleServerMetadata(bool sequences,
                          inference::ServerMetadataResponse* response) {
  response->set_name("attnserve");
  response->set_version(ATTNSERVE_VERSION);
  for (const char* extension :
       {"parameters", "binary_tensor_data", "model_configuration",
        "system_shared_memory", "statistics", "model_repository", "logging",
        "trace"}) {
    response->add_extensions(extension);
  }
  if (sequences) {
    response->add_extensions("sequence");
    response->add_extensions("sequence(string_id)");
  }
}

}  // namespace attnserve
