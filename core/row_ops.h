// Vectorized row operations of the softmax: AVX-512 where the CPU has it
// (chosen once, at first use), portable scalar code elsewhere.
//
// Thread-safety: the table is built once (thread-safe static) and is
// read-only afterwards.
#ifndef ATTNSERVE_CORE_ROW_OPS_H_
#define ATTNSERVE_CORE_ROW_OPS_H_

#include <cstdint>

namespace attnserve {

struct RowOps {
  // Multiplies x[0..n) by `multiplier` in place and returns the maximum.
  float (*scale_max)(float* x, int64_t n, float multiplier);
  // Returns the maximum of x[i] * multiplier (-inf for n == 0), reading only.
  float (*max_scaled)(const float* x, int64_t n, float multiplier);
  // Returns the maximum of x[0..n) (-inf for n == 0).
  float (*max)(const float* x, int64_t n);
  // x[i] = exp(x[i] * multiplier - shift) in place, with exp(-inf) exactly 0;
  // returns the sum of the new values.
  float (*exp_sum)(float* x, int64_t n, float multiplier, float shift);
  // As exp_sum, but writes the values rounded to bfloat16 into `out` and
  // leaves x alone.
  float (*exp_sum_bf16)(const float* x, int64_t n, float multiplier,
                        float shift, uint16_t* out);
  // x[i] *= a.
  void (*scale)(float* x, int64_t n, float a);
  // out[i] = bfloat16(x[i] * a), rounded to nearest even (finite x).
  void (*scale_to_bf16)(const float* x, int64_t n, float a, uint16_t* out);
  // Name of the implementation, e.g. "avx512".
  const char* name;
};

// The fastest implementation this CPU runs (or the one set for testing).
const RowOps& GetRowOps();
// Makes GetRowOps return `ops` (null: the CPU's choice again), so that tests
// can run the kernels on the fallback path. Not for use while computing.
void SetRowOpsForTesting(const RowOps* ops);
// The portable implementation (for tests that compare the two).
const RowOps& ScalarRowOps();

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_ROW_OPS_H_
