#include "core/attention_common.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "core/verify.h"

namespace attnserve {

absl::StatusOr<float> LogitMultiplier(const AttentionOptions& options,
                                      int64_t key_dim) {
  float scale =
      key_dim > 0 ? 1.0f / std::sqrt(static_cast<float>(key_dim)) : 1.0f;
  if (options.scale.has_value()) {
    ATTN_RETURN_IF_ERROR(VerifyFinite(*options.scale, "scale"));
    scale = *options.scale;
  }
  float temperature = 1.0f;
  if (options.temperature.has_value()) {
    ATTN_RETURN_IF_ERROR(
        VerifyPositiveFinite(*options.temperature, "temperature"));
    temperature = *options.temperature;
  }
  // Each is fine, their quotient may not be (1 / 1e-39): no logit would be
  // finite. A vanishing one is fine: uniform attention, as with scale 0.
  const float multiplier = scale / temperature;
  if (!std::isfinite(multiplier)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature: scale ", scale, " / temperature ",
                     temperature, " overflows float32"));
  }
  return multiplier;
}

absl::Status VerifySameDType(const TensorView& t, absl::string_view field,
                             const TensorView& ref,
                             absl::string_view ref_field) {
  if (t.dtype == ref.dtype) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": dtype ", DTypeName(t.dtype), " != ", ref_field,
                   " dtype ", DTypeName(ref.dtype)));
}

absl::Status VerifySameRank(const TensorView& t, absl::string_view field,
                            const TensorView& ref,
                            absl::string_view ref_field) {
  if (t.rank() == ref.rank()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": rank ", t.rank(), " != ", ref_field, " rank ", ref.rank(),
      " (shapes ", ShapeString(t.shape), " and ", ShapeString(ref.shape), ")"));
}

DType ComputeDType(const AttentionOptions& options) {
  return options.compute_bf16 ? DType::kBFloat16 : DType::kFloat32;
}

AttentionResult TakeResult(TensorResults& results) {
  AttentionResult result;
  result.output = *results.Take("output");
  result.weights = results.Take("weights");
  return result;
}

}  // namespace attnserve
