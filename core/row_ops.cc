#include "core/row_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/convert.h"
#include "core/row_ops_internal.h"

namespace attnserve {
namespace {

using row_ops_internal::FinishLayerNormRow;
using row_ops_internal::LayerNormRow;
using row_ops_internal::RmsNormInverse;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// std::max(m, x) keeps m when x is NaN: the scalar maxima ignore NaN, as the
// vector ones do.
float ScalarScaleMax(float* x, int64_t n, float multiplier) {
  float m = kNegInf;
  for (int64_t i = 0; i < n; ++i) {
    x[i] *= multiplier;
    m = std::max(m, x[i]);
  }
  return m;
}

float ScalarMax(const float* x, int64_t n) {
  float m = kNegInf;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

float ScalarMaxScaled(const float* x, int64_t n, float multiplier) {
  float m = kNegInf;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i] * multiplier);
  return m;
}

float ScalarExpSum(float* x, int64_t n, float multiplier, float shift) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] * multiplier - shift);
    sum += x[i];
  }
  return sum;
}

float ScalarExpSumBFloat16(const float* x, int64_t n, float multiplier,
                           float shift, uint16_t* out) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float e = std::exp(x[i] * multiplier - shift);
    out[i] = FloatToBFloat16(e);
    sum += e;
  }
  return sum;
}

float ScalarExpSumBFloat16InPlace(float* x, int64_t n, float multiplier,
                                  float shift) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float e = std::exp(x[i] * multiplier - shift);
    x[i] = BFloat16ToFloat(FloatToBFloat16(e));
    sum += e;
  }
  return sum;
}

void ScalarScale(float* x, int64_t n, float a) {
  for (int64_t i = 0; i < n; ++i) x[i] *= a;
}

void ScalarScaleToBFloat16(const float* x, int64_t n, float a, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToBFloat16(x[i] * a);
}

bool ScalarAllFinite(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return false;
  }
  return true;
}

void ScalarDotRows(const float* q, int64_t rows, int64_t dim,
                   const CachedRows& keys, int64_t cols, float* out,
                   int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      float sum = 0.0f;
      for (int64_t c = 0; c < dim; ++c) {
        sum += q[r * dim + c] * CachedValue(keys, j, c);
      }
      out[r * ld + j] = sum;
    }
  }
}

void ScalarAddWeightedRows(const float* p, int64_t ld, int64_t rows,
                           const CachedRows& values, int64_t cols, int64_t dim,
                           float* acc) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      const float w = p[r * ld + j];
      for (int64_t c = 0; c < dim; ++c) {
        acc[r * dim + c] += w * CachedValue(values, j, c);
      }
    }
  }
}

void ScalarLayerNorm(const float* x, int64_t n, float eps, const float* gamma,
                     const float* beta, float* y) {
  // One pass in double over the deviations from the first value.
  const double shift = x[0];
  double sum = 0, squares = 0;
#pragma omp simd reduction(+ : sum, squares)
  for (int64_t i = 0; i < n; ++i) {
    const double d = double{x[i]} - shift;
    sum += d;
    squares += d * d;
  }
  const auto [mean, centered] =
      row_ops_internal::MeanAndSquares(shift, sum, squares, n);
  const LayerNormRow row = FinishLayerNormRow(mean, centered, n, eps);
  for (int64_t i = 0; i < n; ++i) {
    float v = (x[i] - row.high) * row.rstd + row.offset;
    if (gamma != nullptr) v *= gamma[i];
    if (beta != nullptr) v += beta[i];
    y[i] = v;
  }
}

void ScalarRmsNorm(const float* x, int64_t n, float eps, const float* gamma,
                   float* y) {
  double squares = 0;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += double{x[i]} * x[i];
  const float inverse = RmsNormInverse(squares, n, eps);
  if (gamma != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inverse * gamma[i];
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inverse;
  }
}

float ScalarQuantizeInt8(const float* x, int64_t n, int8_t* codes) {
  float max_abs = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) finite = false;
    max_abs = std::max(max_abs, std::fabs(x[i]));
  }
  if (!finite || max_abs == 0.0f) {
    return row_ops_internal::QuantizeRowWithoutScale(finite, n, codes);
  }
  // In double: 127 / max_abs overflows float for subnormal rows. (Their
  // scale may round to 0: they read back as zeros, within max|x|.)
  const double inverse = 127.0 / max_abs;
  for (int64_t i = 0; i < n; ++i) {
    codes[i] = row_ops_internal::Int8Code(x[i], inverse);
  }
  return max_abs / 127.0f;
}

void ScalarWidenBFloat16(const uint16_t* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = BFloat16ToFloat(x[i]);
}

}  // namespace

const RowOps& ScalarRowOps() {
  static const RowOps ops{ScalarScaleMax,
                          ScalarMaxScaled,
                          ScalarMax,
                          ScalarExpSum,
                          ScalarExpSumBFloat16,
                          ScalarExpSumBFloat16InPlace,
                          ScalarScale,
                          ScalarScaleToBFloat16,
                          ScalarWidenBFloat16,
                          ScalarAllFinite,
                          ScalarLayerNorm,
                          ScalarRmsNorm,
                          ScalarQuantizeInt8,
                          ScalarDotRows,
                          ScalarAddWeightedRows,
                          /*int8_integer_path=*/false,
                          "scalar",
                          "scalar"};
  return ops;
}

namespace {

std::atomic<const RowOps*> row_ops_for_testing{nullptr};

// The rank of `isa` among KnownCpuIsas() (-1: not one of them).
int IsaRank(const std::string& isa) {
  const std::vector<std::string>& known = KnownCpuIsas();
  const auto it = std::find(known.begin(), known.end(), isa);
  return it == known.end() ? -1 : static_cast<int>(it - known.begin());
}

// ATTNSERVE_CPU_ISA's value, or "" when it is unset or empty.
std::string CpuIsaSetting() {
  const char* value = std::getenv("ATTNSERVE_CPU_ISA");
  return value == nullptr ? "" : value;
}

}  // namespace

const std::vector<std::string>& KnownCpuIsas() {
#if defined(__aarch64__)
  static const std::vector<std::string> known = {"scalar", "neon", "sve",
                                                 "sve2"};
#else
  static const std::vector<std::string> known = {"scalar", "sse4", "avx2",
                                                 "avx512"};
#endif
  return known;
}

absl::Status ApplyCpuIsaSetting() {
  const std::string isa = CpuIsaSetting();
  if (isa.empty()) return absl::OkStatus();
  if (IsaRank(isa) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ATTNSERVE_CPU_ISA: '", isa, "' is not one of ",
                     absl::StrJoin(KnownCpuIsas(), ", "),
                     " (or unset: the widest the CPU has)"));
  }
#if !defined(__aarch64__)
  // oneDNN's own names for the same levels; avx512 leaves it uncapped.
  const char* onednn = isa == "avx2" ? "AVX2" : isa == "avx512" ? "" : "SSE41";
  if (*onednn != '\0') setenv("ONEDNN_MAX_CPU_ISA", onednn, /*overwrite=*/0);
#endif
  return absl::OkStatus();
}

void SetRowOpsForTesting(const RowOps* ops) { row_ops_for_testing = ops; }

const RowOps& GetRowOps() {
  if (const RowOps* forced = row_ops_for_testing.load()) return *forced;
  static const RowOps& ops = []() -> const RowOps& {
    const int cap = IsaRank(CpuIsaSetting());
    for (const RowOps* ops : SupportedRowOps()) {
      if (cap < 0 || IsaRank(ops->isa) <= cap) return *ops;
    }
    return ScalarRowOps();
  }();
  return ops;
}

const std::vector<const RowOps*>& SupportedRowOps() {
  static const std::vector<const RowOps*> supported = [] {
    std::vector<const RowOps*> all;
    for (const RowOps* ops : row_ops_internal::PortableRowOps()) {
      all.push_back(ops);
    }
    all.push_back(&ScalarRowOps());
    return all;
  }();
  return supported;
}

}  // namespace attnserve
