// The ten tensor fields of MultiHeadWeights in one table: the name each has
// on the wire (attnserve.v1.AttentionWeights) and in weight files, the
// PyTorch state_dict key a weight file may use instead, and the member it
// fills. Everything that reads or writes the fields one by one walks this
// table, so that a field is added in one place.
//
// Thread-safety: constant data and pure functions.
#ifndef ATTNSERVE_CORE_ATTENTION_WEIGHTS_H_
#define ATTNSERVE_CORE_ATTENTION_WEIGHTS_H_

#include <array>
#include <optional>

#include "absl/strings/string_view.h"
#include "core/attention.h"
#include "core/tensor.h"

namespace attnserve {

struct MultiHeadWeightField {
  // The proto field's name, also the tensor's name in a weight file and the
  // field named in error messages.
  absl::string_view name;
  // nn.MultiheadAttention's state_dict key when it differs from `name`
  // ("out_proj.weight"); empty otherwise.
  absl::string_view state_dict_alias;
  std::optional<TensorView> MultiHeadWeights::*member;
};

// In the order of the proto's field numbers (and of MultiHeadWeights).
inline constexpr std::array<MultiHeadWeightField, 10> kMultiHeadWeightFields = {
    {
        {"q_proj_weight", "", &MultiHeadWeights::q_proj_weight},
        {"k_proj_weight", "", &MultiHeadWeights::k_proj_weight},
        {"v_proj_weight", "", &MultiHeadWeights::v_proj_weight},
        {"in_proj_weight", "", &MultiHeadWeights::in_proj_weight},
        {"q_proj_bias", "", &MultiHeadWeights::q_proj_bias},
        {"k_proj_bias", "", &MultiHeadWeights::k_proj_bias},
        {"v_proj_bias", "", &MultiHeadWeights::v_proj_bias},
        {"in_proj_bias", "", &MultiHeadWeights::in_proj_bias},
        {"out_proj_weight", "out_proj.weight",
         &MultiHeadWeights::out_proj_weight},
        {"out_proj_bias", "out_proj.bias", &MultiHeadWeights::out_proj_bias},
    }};

// The field a weight-file tensor named `name` (or its state_dict alias)
// fills; null for none.
constexpr const MultiHeadWeightField* FindMultiHeadWeightField(
    absl::string_view name) {
  for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
    if (name == field.name ||
        (!field.state_dict_alias.empty() && name == field.state_dict_alias)) {
      return &field;
    }
  }
  return nullptr;
}

// The name of the field `member` is, e.g. "q_proj_weight".
constexpr absl::string_view MultiHeadWeightFieldName(
    std::optional<TensorView> MultiHeadWeights::*member) {
  for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
    if (field.member == member) return field.name;
  }
  return "";
}

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_ATTENTION_WEIGHTS_H_
