// Pieces the row-operation implementations share (core/row_ops.cc, the
// scalar one; core/row_ops_hwy.cc, the portable ones for every instruction
// set): not for use outside them.
//
// Thread-safety: constants and pure functions; the tables are immutable.
#ifndef ATTNSERVE_CORE_ROW_OPS_INTERNAL_H_
#define ATTNSERVE_CORE_ROW_OPS_INTERNAL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "core/row_ops.h"

namespace attnserve::row_ops_internal {

// Software prefetch of cached rows this far ahead: a decode step streams
// its cache from DRAM, and the hardware prefetchers stop at every 4 KiB
// page (and lose track of the tiles' strided order); measured against a
// read of the same bytes.
inline constexpr int64_t kPrefetchBytes = 4096;

inline int64_t CachedElementBytes(RowType type) {
  return type == RowType::kFloat32 ? 4 : type == RowType::kBFloat16 ? 2 : 1;
}

// A LayerNorm row's statistics in the form the output pass uses: y =
// (x - high) * rstd + offset, where high + low is the mean (high the float
// nearest it, low the float nearest the rest) and offset = -low * rstd.
// x - high is exact for the values near the mean (Sterbenz), so a mean
// much larger than the spread costs no accuracy; a constant row has
// x - high = 0, low = 0 and gives exactly 0 (then beta).
struct LayerNormRow {
  float high;
  float rstd;
  float offset;
};

// A row's mean and sum of squared deviations from it, from the sums over
// its values of d = x - shift and of d^2, shift one of its values: as
// (mean - shift)^2 is then at most n times the variance, the subtraction
// cancels at most log2(n + 1) of double's 53 bits. A constant row has
// every d = 0: its mean is exact and its squares 0.
inline std::pair<double, double> MeanAndSquares(double shift, double sum,
                                                double squares, int64_t n) {
  const double n_double = static_cast<double>(n);
  return {shift + sum / n_double,
          std::max(0.0, squares - sum * (sum / n_double))};
}

inline LayerNormRow FinishLayerNormRow(double mean, double squares, int64_t n,
                                       float eps) {
  const double n_double = static_cast<double>(n);
  const float high = static_cast<float>(mean);
  const float low = static_cast<float>(mean - high);
  const float rstd =
      static_cast<float>(1.0 / std::sqrt(squares / n_double + eps));
  return {high, rstd, -low * rstd};
}

inline float RmsNormInverse(double squares, int64_t n, float eps) {
  return static_cast<float>(1.0 /
                            std::sqrt(squares / static_cast<double>(n) + eps));
}

// Integer dot products of int8 keys with a query row rounded to int16 (one
// scale per row: max |q| / 32767, a relative error of 1.5e-5 of its largest
// element against int8's 1/254) are exact in int32 for head dims up to this:
// 512 * 32767 * 127 < 2^31. Rows holding NaN or +-Inf, and longer rows,
// take the float path, which keeps their IEEE results.
inline constexpr int64_t kIntegerDotMaxDim = 512;

// Query row q[0..dim) as int16 codes into codes[0..padded) (zero beyond
// dim; padded >= dim) with their scale (max |q| / 32767), for the integer
// path; false if the row is not all finite.
inline bool QuantizeQueryInt16(const float* q, int64_t dim, int64_t padded,
                               int16_t* codes, float* scale) {
  float max_abs = 0.0f;
  for (int64_t c = 0; c < dim; ++c) {
    if (!std::isfinite(q[c])) return false;
    max_abs = std::max(max_abs, std::abs(q[c]));
  }
  *scale = max_abs / 32767.0f;
  const float inverse = max_abs > 0.0f ? 32767.0f / max_abs : 0.0f;
  for (int64_t c = 0; c < padded; ++c) {
    // |q * inverse| <= 32767 up to rounding: clamp keeps it an int16.
    codes[c] = c < dim
                   ? static_cast<int16_t>(std::clamp(
                         std::nearbyint(q[c] * inverse), -32767.0f, 32767.0f))
                   : 0;
  }
  return true;
}

// The int8 code of x in a row quantized at `inverse` = 127 / max |x|
// (QuantizeInt8): x * inverse in double, rounded to nearest with ties away
// from zero.
inline int8_t Int8Code(float x, double inverse) {
  return static_cast<int8_t>(
      std::clamp(std::round(x * inverse), -127.0, 127.0));
}

// A row QuantizeInt8 takes no scale from: codes 0, and scale 0 for a row of
// zeros (never NaN), NaN for a row holding a NaN or +-Inf.
inline float QuantizeRowWithoutScale(bool finite, int64_t n, int8_t* codes) {
  std::fill(codes, codes + n, int8_t{0});
  return finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
}

// The portable implementations (core/row_ops_hwy.cc) this CPU runs, widest
// instruction set first.
const std::vector<const RowOps*>& PortableRowOps();

}  // namespace attnserve::row_ops_internal

#endif  // ATTNSERVE_CORE_ROW_OPS_INTERNAL_H_
