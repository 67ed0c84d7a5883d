#include "server/model_config.h"

#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "server/handlers.h"
#include "server/open_inference.h"

namespace attnserve {
namespace {

void SetParameter(inference::ModelConfig* config, const std::string& name,
                  const std::string& value) {
  (*config->mutable_parameters())[name].set_string_value(value);
}

// What a built-in model computes, as its operation declares it.
void BuiltInParameters(const OperationSpec& operation,
                       inference::ModelConfig* config) {
  SetParameter(config, "operation", std::string(operation.summary));
  for (const auto& [name, value] : operation.config) {
    SetParameter(config, std::string(name), std::string(value));
  }
}

// A served model's layer, from the native metadata.
void ServedParameters(const ProtocolModel& model,
                      inference::ModelConfig* config) {
  v1::GetModelMetadataResponse native;
  DescribeModel(*model.served, &native);
  if (model.takes_sequences()) {
    SetParameter(config, "operation",
                 absl::StrCat("multi-head attention of a sequence's steps "
                              "over its cached keys and values (model ",
                              model.served->name, ")"));
  } else {
    SetParameter(config, "operation", "multi-head attention");
    SetParameter(config, "key_default", "query");
    SetParameter(config, "value_default", "key");
  }
  SetParameter(config, "num_heads", absl::StrCat(native.num_heads()));
  SetParameter(config, "num_kv_heads", absl::StrCat(native.num_kv_heads()));
  SetParameter(config, "query_dim", absl::StrCat(native.query_dim()));
  SetParameter(config, "key_dim", absl::StrCat(native.key_dim()));
  SetParameter(config, "value_dim", absl::StrCat(native.value_dim()));
  SetParameter(config, "output_dim", absl::StrCat(native.output_dim()));
  SetParameter(config, "compute_dtype",
               v1::DataType_Name(native.compute_dtype()));
  SetParameter(config, "rotary_dims", absl::StrCat(native.rotary_dims()));
  if (!native.description().empty()) {
    SetParameter(config, "description", native.description());
  }
}

using Control = inference::ModelSequenceBatching::Control;

void AddControl(inference::ModelSequenceBatching* batching,
                absl::string_view name, Control::Kind kind,
                inference::DataType type) {
  inference::ModelSequenceBatching::ControlInput* input =
      batching->add_control_input();
  input->set_name(std::string(name));
  Control* control = input->add_control();
  control->set_kind(kind);
  control->set_data_type(type);
  if (type == inference::TYPE_BOOL) {
    control->add_bool_false_true(false);
    control->add_bool_false_true(true);
  }
}

// Sequence batching of a model that takes sequences: the idle timeout, and
// the request parameters that carry the sequence's controls (attnserve's
// sessions take them from the parameters, not from input tensors).
void SequenceBatching(absl::string_view model, const SequenceTable& sequences,
                      inference::ModelConfig* config) {
  inference::ModelSequenceBatching* batching =
      config->mutable_sequence_batching();
  const absl::Duration idle = sequences.idle_timeout();
  batching->set_max_sequence_idle_microseconds(
      idle == absl::InfiniteDuration()
          ? std::numeric_limits<uint64_t>::max()
          : static_cast<uint64_t>(absl::ToInt64Microseconds(idle)));
  AddControl(batching, "sequence_start", Control::CONTROL_SEQUENCE_START,
             inference::TYPE_BOOL);
  AddControl(batching, "sequence_end", Control::CONTROL_SEQUENCE_END,
             inference::TYPE_BOOL);
  AddControl(batching, "sequence_id", Control::CONTROL_SEQUENCE_CORRID,
             inference::TYPE_UINT64);
  SetParameter(config, "sequence_parameters",
               absl::StrJoin(SequenceParameterNames(model), ", "));
}

}  // namespace

absl::StatusOr<inference::DataType> ConfigDataType(absl::string_view datatype) {
  inference::DataType type = inference::TYPE_INVALID;
  if (!inference::DataType_Parse(absl::StrCat("TYPE_", datatype), &type) ||
      type == inference::TYPE_INVALID) {
    return absl::InvalidArgumentError(
        absl::StrCat("datatype '", datatype, "' has no model config type"));
  }
  return type;
}

namespace {

// The metadata's inputs and outputs as the configuration's.
absl::Status AddTensors(const inference::ModelMetadataResponse& metadata,
                        inference::ModelConfig* config) {
  for (const auto& tensor : metadata.inputs()) {
    inference::ModelInput* input = config->add_input();
    input->set_name(tensor.name());
    ATTN_ASSIGN_OR_RETURN(inference::DataType type,
                          ConfigDataType(tensor.datatype()));
    input->set_data_type(type);
    input->mutable_dims()->CopyFrom(tensor.shape());
    const auto optional = tensor.parameters().find("optional");
    input->set_optional(optional != tensor.parameters().end() &&
                        optional->second.bool_param());
  }
  for (const auto& tensor : metadata.outputs()) {
    inference::ModelOutput* output = config->add_output();
    output->set_name(tensor.name());
    ATTN_ASSIGN_OR_RETURN(inference::DataType type,
                          ConfigDataType(tensor.datatype()));
    output->set_data_type(type);
    output->mutable_dims()->CopyFrom(tensor.shape());
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status HandleModelConfig(const inference::ModelConfigRequest& request,
                               const SequenceTable* sequences,
                               inference::ModelConfigResponse* response) {
  const ModelRepository* models = sequences->models();
  inference::ModelMetadataRequest metadata_request;
  metadata_request.set_name(request.name());
  metadata_request.set_version(request.version());
  inference::ModelMetadataResponse metadata;
  ATTN_RETURN_IF_ERROR(
      HandleModelMetadata(metadata_request, models, &metadata));
  ATTN_ASSIGN_OR_RETURN(const ProtocolModel model,
                        FindProtocolModel(request.name(), models, "name"));
  inference::ModelConfig* config = response->mutable_config();
  config->set_name(metadata.name());
  config->set_platform(metadata.platform());
  config->set_backend("attnserve");
  config->set_max_batch_size(0);
  ATTN_RETURN_IF_ERROR(AddTensors(metadata, config));
  SetParameter(config, "request_parameters",
               absl::StrJoin(RequestParameterNames(model), ", "));
  if (sequences->sessions() != nullptr && model.takes_sequences()) {
    SequenceBatching(model.name, *sequences, config);
  }
  if (model.built_in()) {
    BuiltInParameters(*model.operation, config);
  } else {
    ServedParameters(model, config);
  }
  return absl::OkStatus();
}

}  // namespace attnserve
