// Vectorized row operations of the softmax, of the normalizations and of
// the decode kernel's products with cached rows, chosen once, at first use,
// for the CPU: the portable implementation (one source, core/row_ops_hwy.cc,
// compiled for SSE4, AVX2, AVX-512, NEON, SVE and SVE2) for the widest
// instruction set the CPU has, scalar code last. The environment variable
// ATTNSERVE_CPU_ISA caps the choice (see ApplyCpuIsaSetting).
//
// Thread-safety: the tables are built once (thread-safe statics) and are
// read-only afterwards.
#ifndef ATTNSERVE_CORE_ROW_OPS_H_
#define ATTNSERVE_CORE_ROW_OPS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/convert.h"

namespace attnserve {

// The element type of cached key or value rows the decode kernel reads:
// FLOAT32, BFLOAT16, or INT8 with one float32 scale per row (the row's
// values are int8 * scale).
enum class RowType { kFloat32, kBFloat16, kInt8 };

// Rows of keys or values: row j at `data` + j * `stride` elements of
// `type`; for kInt8, its scale at scales[j].
struct CachedRows {
  const void* data = nullptr;
  int64_t stride = 0;
  RowType type = RowType::kFloat32;
  const float* scales = nullptr;
};

// Element c of cached row j as float32 (scaled, for kInt8).
inline float CachedValue(const CachedRows& rows, int64_t j, int64_t c) {
  const int64_t at = j * rows.stride + c;
  switch (rows.type) {
    case RowType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(rows.data)[at]);
    case RowType::kInt8:
      return static_cast<float>(static_cast<const int8_t*>(rows.data)[at]) *
             rows.scales[j];
    case RowType::kFloat32:
      break;
  }
  return static_cast<const float*>(rows.data)[at];
}

// Non-finite values: the max functions ignore NaN (a NaN lane never wins a
// vector max, so that every implementation agrees), and exp_sum passes NaN
// through, so a row holding a NaN ends with a NaN sum; the kernel relies on
// that instead of testing every element. Conversions to bfloat16 keep NaN a
// (quiet) NaN and +-Inf an infinity of the same sign.
struct RowOps {
  // Multiplies x[0..n) by `multiplier` in place and returns the maximum
  // (-inf for n == 0), ignoring NaN.
  float (*scale_max)(float* x, int64_t n, float multiplier);
  // Returns the maximum of x[i] * multiplier (-inf for n == 0), reading only
  // and ignoring NaN.
  float (*max_scaled)(const float* x, int64_t n, float multiplier);
  // Returns the maximum of x[0..n) (-inf for n == 0), ignoring NaN.
  float (*max)(const float* x, int64_t n);
  // x[i] = exp(x[i] * multiplier - shift) in place, for arguments <= 0 or
  // NaN: exp(-inf) is exactly 0 and NaN stays NaN. Returns the sum of the
  // new values.
  float (*exp_sum)(float* x, int64_t n, float multiplier, float shift);
  // As exp_sum, but writes the values rounded to bfloat16 into `out` and
  // leaves x alone.
  float (*exp_sum_bf16)(const float* x, int64_t n, float multiplier,
                        float shift, uint16_t* out);
  // As exp_sum_bf16, but in place: x[i] holds the value exp_sum_bf16 writes
  // to out[i], widened back to float32 (for products that run in float32,
  // where the CPU has no bfloat16 matmul). The same sum.
  float (*exp_sum_bf16_in_place)(float* x, int64_t n, float multiplier,
                                 float shift);
  // x[i] *= a.
  void (*scale)(float* x, int64_t n, float a);
  // out[i] = bfloat16(x[i] * a), rounded to nearest even.
  void (*scale_to_bf16)(const float* x, int64_t n, float a, uint16_t* out);
  // out[i] = x[i], bfloat16 bits widened to float32 (exact).
  void (*widen_bf16)(const uint16_t* x, int64_t n, float* out);
  // Whether no x[0..n) is NaN or +-Inf.
  bool (*all_finite)(const float* x, int64_t n);
  // LayerNorm of one row of n > 0 values: y = (x - mean) / sqrt(var + eps)
  // * gamma + beta, biased variance; gamma and beta may be null (1 and 0).
  // The mean and the variance are summed in double in one pass over the
  // deviations from the row's first value (row_ops_internal::
  // MeanAndSquares): a constant row has variance exactly 0 and gives beta.
  // The deviations the output scales are taken from the mean split into
  // two floats (high and low part), so they are as accurate as the float32
  // values allow, also for rows whose mean is large against their spread.
  // A NaN or +-Inf makes the whole row NaN.
  void (*layer_norm)(const float* x, int64_t n, float eps, const float* gamma,
                     const float* beta, float* y);
  // RMSNorm of one row of n > 0 values: y = x / sqrt(mean(x^2) + eps) *
  // gamma (gamma may be null), the mean square summed in double.
  void (*rms_norm)(const float* x, int64_t n, float eps, const float* gamma,
                   float* y);
  // Quantizes a row of n values to int8 codes and returns its scale, as
  // QuantizeInt8 (core/kv_cache.h) states: the same codes and scale on every
  // implementation.
  float (*quantize_int8)(const float* x, int64_t n, int8_t* codes);
  // The decode kernel's products with cached rows. dot_rows:
  // out[r * ld + j] = sum_c q[r * dim + c] * keys_j[c] for r < rows,
  // j < cols. add_weighted_rows: acc[r * dim + c] += sum_j p[r * ld + j] *
  // values_j[c] for r < rows, c < dim, j < cols (IEEE products: a weight 0
  // times an infinite value is NaN). Summation orders are fixed by the
  // arguments: the same call gives the same bits.
  void (*dot_rows)(const float* q, int64_t rows, int64_t dim,
                   const CachedRows& keys, int64_t cols, float* out,
                   int64_t ld);
  void (*add_weighted_rows)(const float* p, int64_t ld, int64_t rows,
                            const CachedRows& values, int64_t cols, int64_t dim,
                            float* acc);
  // Whether INT8 rows take the integer path: dot_rows rounds each
  // all-finite query row to int16 codes (one scale per row: max |q| /
  // 32767) for head dims up to 512 and sums the products in int32, exactly
  // (error at most half a code step times the key row's L1 norm);
  // add_weighted_rows rounds each row's weights times the value rows'
  // scales, per block of up to 512 value rows with all of them finite, to
  // int16 codes (step max |w| / 32767) and sums in int32, exactly (error at
  // most half a step times the column's sum of |int8 codes|).
  bool int8_integer_path;
  // Name of the implementation, e.g. "avx512" or "avx2".
  const char* name;
  // The instruction set it needs, as ATTNSERVE_CPU_ISA names it: "scalar",
  // "sse4", "avx2", "avx512", "neon", "sve" or "sve2".
  const char* isa;
};

// The fastest implementation this CPU runs within ATTNSERVE_CPU_ISA (or the
// one set for testing).
const RowOps& GetRowOps();
// The instruction sets ATTNSERVE_CPU_ISA may name on this architecture,
// narrowest first ("scalar", "sse4", "avx2", "avx512" on x86-64; "scalar",
// "neon", "sve", "sve2" on AArch64). A value above what the CPU has is
// capped at what it has.
const std::vector<std::string>& KnownCpuIsas();
// Checks ATTNSERVE_CPU_ISA (INVALID_ARGUMENT naming it and the values it
// takes) and caps oneDNN alike: sets ONEDNN_MAX_CPU_ISA, unless it is set,
// to the matching oneDNN level. Call at start, before oneDNN's first
// primitive.
absl::Status ApplyCpuIsaSetting();
// Makes GetRowOps return `ops` (null: the CPU's choice again), so that tests
// can run the kernels on the fallback path. Not for use while computing.
void SetRowOpsForTesting(const RowOps* ops);
// The portable implementation (for tests that compare the two).
const RowOps& ScalarRowOps();
// Every implementation this CPU runs, fastest (GetRowOps' choice) first and
// the portable one last, for tests that run them all.
const std::vector<const RowOps*>& SupportedRowOps();

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_ROW_OPS_H_
