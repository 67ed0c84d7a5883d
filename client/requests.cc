#include "client/requests.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/attention_weights.h"
#include "core/status_macros.h"
#include "proto/tensor_codec.h"

namespace attnserve {
namespace {

absl::Status RequireTensor(const NamedViews& tensors, const std::string& name) {
  if (tensors.count(name) > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("tensor '", name, "' is missing from the input"));
}

template <typename Message>
void Encode(const NamedViews& tensors, const std::string& name,
            v1::Tensor* (Message::*mutable_field)(), Message* message) {
  auto it = tensors.find(name);
  if (it != tensors.end())
    EncodeTensor(it->second, (message->*mutable_field)());
}

template <typename Request>
void SetAttentionOptions(const OpParams& params, Request* request) {
  request->set_causal(params.causal);
  if (params.scale.has_value()) request->set_scale(*params.scale);
  if (params.temperature.has_value()) {
    request->set_temperature(*params.temperature);
  }
  request->set_return_weights(params.return_weights);
  request->set_compute_bf16(params.compute_bf16);
}

absl::Status ParseFloat(const std::string& key, const std::string& text,
                        std::optional<float>* out) {
  float value;
  if (!absl::SimpleAtof(text, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata '", key, "': '", text, "' is not a number"));
  }
  *out = value;
  return absl::OkStatus();
}

absl::Status ParseInt(const std::string& key, const std::string& text,
                      int* out) {
  if (!absl::SimpleAtoi(text, out)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata '", key, "': '", text, "' is not an integer"));
  }
  return absl::OkStatus();
}

}  // namespace

NamedViews ViewsOf(const NamedTensors& tensors) {
  NamedViews views;
  for (const auto& [name, tensor] : tensors) views.emplace(name, tensor.view());
  return views;
}

absl::Status ApplyMetadata(const std::map<std::string, std::string>& metadata,
                           OpParams* params) {
  for (const auto& [key, text] : metadata) {
    if (key == "causal") {
      if (!absl::SimpleAtob(text, &params->causal)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "metadata 'causal': '", text, "' is not true or false"));
      }
    } else if (key == "scale") {
      ATTN_RETURN_IF_ERROR(ParseFloat(key, text, &params->scale));
    } else if (key == "temperature") {
      ATTN_RETURN_IF_ERROR(ParseFloat(key, text, &params->temperature));
    } else if (key == "eps") {
      ATTN_RETURN_IF_ERROR(ParseFloat(key, text, &params->eps));
    } else if (key == "num_heads") {
      ATTN_RETURN_IF_ERROR(ParseInt(key, text, &params->num_heads));
    } else if (key == "normalized_ndim") {
      ATTN_RETURN_IF_ERROR(ParseInt(key, text, &params->normalized_ndim));
    } else if (key == "rms_norm") {
      if (!absl::SimpleAtob(text, &params->rms_norm)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "metadata 'rms_norm': '", text, "' is not true or false"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::AttendRequest> BuildAttendRequest(const NamedViews& tensors,
                                                     const OpParams& params) {
  for (const char* name : {"query", "key", "value"}) {
    ATTN_RETURN_IF_ERROR(RequireTensor(tensors, name));
  }
  v1::AttendRequest request;
  Encode(tensors, "query", &v1::AttendRequest::mutable_query, &request);
  Encode(tensors, "key", &v1::AttendRequest::mutable_key, &request);
  Encode(tensors, "value", &v1::AttendRequest::mutable_value, &request);
  Encode(tensors, "attn_mask", &v1::AttendRequest::mutable_attn_mask, &request);
  SetAttentionOptions(params, &request);
  return request;
}

absl::StatusOr<v1::MultiHeadAttendRequest> BuildMultiHeadAttendRequest(
    const NamedViews& tensors, const OpParams& params) {
  using R = v1::MultiHeadAttendRequest;
  ATTN_RETURN_IF_ERROR(RequireTensor(tensors, "query"));
  R request;
  Encode(tensors, "query", &R::mutable_query, &request);
  Encode(tensors, "key", &R::mutable_key, &request);
  Encode(tensors, "value", &R::mutable_value, &request);
  Encode(tensors, "attn_mask", &R::mutable_attn_mask, &request);
  Encode(tensors, "key_padding_mask", &R::mutable_key_padding_mask, &request);
  if (!params.model.empty()) {
    request.set_model(params.model);
  } else {
    v1::AttentionWeights* weights = request.mutable_weights();
    weights->set_num_heads(params.num_heads);
    for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
      auto it = tensors.find(std::string(field.name));
      if (it != tensors.end()) {
        EncodeTensor(it->second, MutableWeightTensor(weights, field));
      }
    }
  }
  SetAttentionOptions(params, &request);
  request.set_average_weights(params.average_weights);
  return request;
}

absl::StatusOr<v1::LayerNormRequest> BuildLayerNormRequest(
    const NamedViews& tensors, const OpParams& params) {
  using R = v1::LayerNormRequest;
  ATTN_RETURN_IF_ERROR(RequireTensor(tensors, "input"));
  R request;
  Encode(tensors, "input", &R::mutable_input, &request);
  Encode(tensors, "gamma", &R::mutable_gamma, &request);
  Encode(tensors, "beta", &R::mutable_beta, &request);
  if (params.eps.has_value()) request.set_eps(*params.eps);
  request.set_normalized_ndim(params.normalized_ndim);
  request.set_rms_norm(params.rms_norm);
  return request;
}

absl::StatusOr<v1::RmsNormRequest> BuildRmsNormRequest(
    const NamedViews& tensors, const OpParams& params) {
  using R = v1::RmsNormRequest;
  ATTN_RETURN_IF_ERROR(RequireTensor(tensors, "input"));
  if (tensors.contains("beta")) {
    return absl::InvalidArgumentError(
        "beta: RMSNorm has no shift (torch.nn.RMSNorm); leave beta out");
  }
  R request;
  Encode(tensors, "input", &R::mutable_input, &request);
  Encode(tensors, "gamma", &R::mutable_gamma, &request);
  if (params.eps.has_value()) request.set_eps(*params.eps);
  request.set_normalized_ndim(params.normalized_ndim);
  return request;
}

absl::StatusOr<NamedTensors> ResultTensors(
    const v1::Tensor& output, const v1::Tensor* weights,
    SharedMemoryResolver* shared_memory) {
  NamedTensors result;
  ATTN_ASSIGN_OR_RETURN(Tensor out,
                        CopyTensor(output, "output", shared_memory));
  result.emplace("output", std::move(out));
  if (weights != nullptr) {
    ATTN_ASSIGN_OR_RETURN(Tensor w,
                          CopyTensor(*weights, "weights", shared_memory));
    result.emplace("weights", std::move(w));
  }
  return result;
}

absl::StatusOr<Operation> ParseOperation(absl::string_view name) {
  if (name == "attend") return Operation::kAttend;
  if (name == "mha" || name == "multi_head_attend") {
    return Operation::kMultiHeadAttend;
  }
  if (name == "layernorm" || name == "layer_norm") return Operation::kLayerNorm;
  if (name == "rmsnorm" || name == "rms_norm") return Operation::kRmsNorm;
  return absl::InvalidArgumentError(absl::StrCat(
      "operation '", name, "' is not attend, mha, layernorm or rmsnorm"));
}

}  // namespace attnserve
