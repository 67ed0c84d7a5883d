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

// What a built-in model computes.
void BuiltInParameters(absl::string_view model,
                       inference::ModelConfig* config) {
  if (model == kAttendModel) {
    SetParameter(config, "operation", "scaled dot-product attention");
  } else if (model == kLayerNormModel) {
    SetParameter(config, "operation", "layer normalization");
  } else if (model == kAttentionSessionModel) {
    SetParameter(config, "operation",
                 "causal attention over a sequence's cached keys and values");
  } else {
    SetParameter(config, "operation",
                 "multi-head attention with the request's weights");
    SetParameter(config, "key_default", "query");
    SetParameter(config, "value_default", "key");
  }
}

// A served model's layer, from the native metadata.
absl::Status ServedParameters(absl::string_view model,
                              const ModelRepository* models,
                              inference::ModelConfig* config) {
  v1::GetModelMetadataRequest request;
  request.set_name(std::string(model));
  v1::GetModelMetadataResponse native;
  ATTN_RETURN_IF_ERROR(HandleGetModelMetadata(request, models, &native));
  SetParameter(config, "operation", "multi-head attention");
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
  SetParameter(config, "key_default", "query");
  SetParameter(config, "value_default", "key");
  return absl::OkStatus();
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
  inference::ModelConfig* config = response->mutable_config();
  config->set_name(metadata.name());
  config->set_platform(metadata.platform());
  config->set_backend("attnserve");
  config->set_max_batch_size(0);
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
  SetParameter(config, "request_parameters",
               absl::StrJoin(RequestParameterNames(metadata.name()), ", "));
  if (sequences->sessions() != nullptr && TakesSequences(metadata.name())) {
    SequenceBatching(metadata.name(), *sequences, config);
  }
  if (metadata.platform() == "attnserve_builtin") {
    BuiltInParameters(metadata.name(), config);
    return absl::OkStatus();
  }
  return ServedParameters(metadata.name(), models, config);
}

}  // namespace attnserve
