#include <cstdint>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/attention.h"
#include "core/convert.h"
#include "core/row_ops.h"
#include "core/status_macros.h"
#include "core/verify.h"

namespace attnserve {
namespace {

absl::Status VerifyAffine(const std::optional<TensorView>& t,
                          absl::string_view field,
                          absl::Span<const int64_t> normalized_shape) {
  if (!t.has_value()) return absl::OkStatus();
  ATTN_RETURN_IF_ERROR(VerifyFloating(*t, field));
  return VerifyShape(*t, field, normalized_shape);
}

// LayerNorm or RMSNorm over rows of `cols` float32 values, rows split over
// the calling thread's OpenMP threads. Each row is read three times
// (RMSNorm: twice) while it is in cache (RowOps::layer_norm): memory-bound.
void NormalizeRows(const LayerNormOptions& options, int64_t rows, int64_t cols,
                   const float* src, const float* gamma, const float* beta,
                   float* dst) {
  if (rows == 0 || cols == 0) return;
  const RowOps& ops = GetRowOps();
  const float eps = options.eps;
  const bool rms = options.rms_norm;
  // Rows of a few thousand elements take microseconds: threads only pay
  // for themselves past ~64K elements.
#pragma omp parallel for schedule(static) if (rows * cols > (int64_t{1} << 16))
  for (int64_t r = 0; r < rows; ++r) {
    if (rms) {
      ops.rms_norm(src + r * cols, cols, eps, gamma, dst + r * cols);
    } else {
      ops.layer_norm(src + r * cols, cols, eps, gamma, beta, dst + r * cols);
    }
  }
}

}  // namespace

float DefaultRmsNormEps(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return 0x1p-7f;
    case DType::kFloat16:
      return 0x1p-10f;
    default:
      return 0x1p-23f;
  }
}

absl::StatusOr<Tensor> LayerNorm(const TensorView& input,
                                 const std::optional<TensorView>& gamma,
                                 const std::optional<TensorView>& beta,
                                 const LayerNormOptions& options) {
  TensorResults results;
  ATTN_RETURN_IF_ERROR(LayerNorm(input, gamma, beta, options, results));
  return *results.Take("output");
}

absl::Status LayerNorm(const TensorView& input,
                       const std::optional<TensorView>& gamma,
                       const std::optional<TensorView>& beta,
                       const LayerNormOptions& options,
                       ResultAllocator& results) {
  ATTN_RETURN_IF_ERROR(VerifyFloating(input, "input"));
  if (options.normalized_ndim < 1 || options.normalized_ndim > input.rank()) {
    return absl::InvalidArgumentError(
        absl::StrCat("normalized_ndim: ", options.normalized_ndim,
                     " is not in [1, rank of input ", input.rank(),
                     "] (input shape ", ShapeString(input.shape), ")"));
  }
  ATTN_RETURN_IF_ERROR(VerifyPositiveFinite(options.eps, "eps"));
  const absl::Span<const int64_t> normalized_shape =
      absl::Span<const int64_t>(input.shape)
          .last(static_cast<size_t>(options.normalized_ndim));
  ATTN_RETURN_IF_ERROR(VerifyAffine(gamma, "gamma", normalized_shape));
  ATTN_RETURN_IF_ERROR(VerifyAffine(beta, "beta", normalized_shape));
  if (options.rms_norm && beta.has_value()) {
    return absl::InvalidArgumentError(
        "beta: RMSNorm has no shift (torch.nn.RMSNorm); leave beta unset");
  }

  const int64_t cols = NumElements(normalized_shape);
  const int64_t rows = cols == 0 ? 0 : input.num_elements() / cols;
  ATTN_ASSIGN_OR_RETURN(Float32Data src, Float32Data::From(input, "input"));
  std::optional<Float32Data> scale, shift;
  if (gamma.has_value()) {
    ATTN_ASSIGN_OR_RETURN(scale, Float32Data::From(*gamma, "gamma"));
  }
  if (beta.has_value()) {
    ATTN_ASSIGN_OR_RETURN(shift, Float32Data::From(*beta, "beta"));
  }
  ATTN_ASSIGN_OR_RETURN(
      ResultBuffer output,
      ResultBuffer::Allocate(results, "output", input.dtype, input.shape,
                             /*bf16_ok=*/false));
  NormalizeRows(options, rows, cols, src.data(),
                scale ? scale->data() : nullptr,
                shift ? shift->data() : nullptr, output.f32());
  output.Finish();
  return absl::OkStatus();
}

}  // namespace attnserve
