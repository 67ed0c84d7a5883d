#include "core/rotary.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/convert.h"

namespace attnserve {

absl::Status VerifyRotary(const RotaryOptions& rotary, int64_t head_dim,
                          absl::string_view field) {
  if (rotary.dims == 0) return absl::OkStatus();
  if (rotary.dims < 0 || rotary.dims % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": must be even and >= 0 (the halves rotate in pairs), got ",
        rotary.dims));
  }
  if (rotary.dims > head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", rotary.dims, " > head dim ", head_dim));
  }
  if (!std::isfinite(rotary.base) || rotary.base <= 1.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": base must be finite and > 1, got ", rotary.base));
  }
  return absl::OkStatus();
}

namespace {

// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin for the `half` pairs of one
// row, in float32.
void RotateRow(const float* cos, const float* sin, int64_t half, float* x) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i];
    const float x2 = x[half + i];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[half + i] = x2 * cos[i] + x1 * sin[i];
  }
}

}  // namespace

void ApplyRotary(const RotaryOptions& rotary, DType dtype, void* data,
                 const OperandLayout& layout, int64_t batch, int64_t heads,
                 int64_t rows, int64_t first_position) {
  if (rotary.dims == 0 || rows == 0) return;
  const int64_t half = rotary.dims / 2;
  // cos and sin of every (row, pair), shared by all batch entries and heads.
  std::vector<float> cos(rows * half), sin(rows * half);
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq = std::pow(
        static_cast<double>(rotary.base),
        -2.0 * static_cast<double>(i) / static_cast<double>(rotary.dims));
    for (int64_t r = 0; r < rows; ++r) {
      const double angle = static_cast<double>(first_position + r) * inv_freq;
      cos[r * half + i] = static_cast<float>(std::cos(angle));
      sin[r * half + i] = static_cast<float>(std::sin(angle));
    }
  }
  const int64_t pairs = batch * heads;
#pragma omp parallel for schedule(static) if (pairs * rows * half > 65536)
  for (int64_t n = 0; n < pairs; ++n) {
    const int64_t b = n / heads;
    const int64_t h = n % heads;
    std::vector<float> row(dtype == DType::kBFloat16 ? rotary.dims : 0);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t offset = b * layout.batch_stride + h * layout.head_stride +
                             r * layout.row_stride;
      if (dtype == DType::kBFloat16) {
        uint16_t* x = static_cast<uint16_t*>(data) + offset;
        for (int64_t c = 0; c < rotary.dims; ++c)
          row[c] = BFloat16ToFloat(x[c]);
        RotateRow(&cos[r * half], &sin[r * half], half, row.data());
        for (int64_t c = 0; c < rotary.dims; ++c)
          x[c] = FloatToBFloat16(row[c]);
      } else {
        RotateRow(&cos[r * half], &sin[r * half], half,
                  static_cast<float*>(data) + offset);
      }
    }
  }
}

}  // namespace attnserve
