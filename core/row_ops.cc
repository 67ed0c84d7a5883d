#include "core/row_ops.h"

// GCC 12's AVX-512 headers build masked intrinsics on _mm512_undefined_ps(),
// which its own -Wuninitialized flags (GCC bug 105593).
#if !defined(__clang__)  // clang has no -Wmaybe-uninitialized
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/convert.h"
#include "core/row_ops_internal.h"

namespace attnserve {
namespace {

using row_ops_internal::CachedElementBytes;
using row_ops_internal::FinishLayerNormRow;
using row_ops_internal::kIntegerDotMaxDim;
using row_ops_internal::kPrefetchBytes;
using row_ops_internal::LayerNormRow;
using row_ops_internal::QuantizeQueryInt16;
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
  // Summed in double: n < 2^29 equal floats sum exactly, in any order.
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  const double mean = sum / static_cast<double>(n);
  double squares = 0;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) {
    const double d = double{x[i]} - mean;
    squares += d * d;
  }
  const LayerNormRow row = FinishLayerNormRow(mean, squares, n, eps);
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

#if defined(__x86_64__)  // the hand-written AVX-512 kernels

#define ATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// exp(x) for x <= 0 (the softmax only needs that range): 2^k * p(r) with
// x = k*ln2 + r, |r| <= ln2/2, p Cephes' degree-7 polynomial (about 1 ulp).
// exp(-inf) is exactly 0 and NaN stays NaN.
// kFull: float32 accuracy. Otherwise enough for values rounded to bfloat16
// next (one-step ln2 and a degree-4 Taylor polynomial: relative error below
// 5e-5, against bfloat16's 4e-3), at about two thirds of the cost.
template <bool kFull>
ATTN_AVX512 inline __m512 Exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  // Below -110 the scaled result rounds to exactly 0, which is what -inf
  // (a masked logit) must give; between -87.3 and -110 it is a denormal.
  // vmaxps returns its second operand when either is NaN: x goes second so
  // that a NaN logit stays NaN rather than becoming exp(-110) = 0.
  x = _mm512_max_ps(_mm512_set1_ps(-110.0f), x);
  const __m512 k =
      _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
  if constexpr (kFull) {
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r),
                        _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, k);
  } else {
    const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.69314718f), x);
    __m512 p = _mm512_set1_ps(1.0f / 24);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
  }
}

ATTN_AVX512 inline __mmask16 TailMask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xffff)
                         : static_cast<__mmask16>((1u << remaining) - 1);
}

ATTN_AVX512 float Avx512ScaleMax(float* x, int64_t n, float multiplier) {
  const __m512 mul = _mm512_set1_ps(multiplier);
  __m512 m = _mm512_set1_ps(kNegInf);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + i), mul);
    _mm512_mask_storeu_ps(x + i, mask, v);
    m = _mm512_mask_max_ps(m, mask, v, m);  // m when v is NaN
  }
  return _mm512_reduce_max_ps(m);
}

ATTN_AVX512 float Avx512Max(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(kNegInf);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    m = _mm512_mask_max_ps(m, mask, _mm512_maskz_loadu_ps(mask, x + i), m);
  }
  return _mm512_reduce_max_ps(m);
}

ATTN_AVX512 float Avx512MaxScaled(const float* x, int64_t n, float multiplier) {
  const __m512 mul = _mm512_set1_ps(multiplier);
  __m512 m = _mm512_set1_ps(kNegInf);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    m = _mm512_mask_max_ps(
        m, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + i), mul), m);
  }
  return _mm512_reduce_max_ps(m);
}

// exp(x * multiplier - shift) for 16 lanes. The product is rounded before
// the shift, as in max_scaled: `shift` is the largest rounded product, and
// a fused (exact) one differs from it by up to half an ulp, which for
// logits above ~1e9 overflows exp (NaN rows) or underflows every term. An
// explicitly rounded multiply, since GCC fuses a plain one with the add.
template <bool kFull>
ATTN_AVX512 inline __m512 ShiftedExp512(const float* x, __mmask16 mask,
                                        __m512 mul, __m512 neg_shift) {
  const __m512 product =
      _mm512_mul_round_ps(_mm512_maskz_loadu_ps(mask, x), mul,
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return Exp512<kFull>(_mm512_add_ps(product, neg_shift));
}

// Float32 lanes rounded to bfloat16, nearest even, as FloatToBFloat16: the
// rounding add would carry a NaN's payload into the exponent or the sign
// (0x7f800001 -> +Inf, 0x7fffffff -> -0), so NaN lanes are quieted instead.
ATTN_AVX512 inline __m256i ToBFloat16x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i rounding = _mm512_add_epi32(
      _mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, rounding), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(
      _mm512_mask_or_epi32(rounded, nan, high, _mm512_set1_epi32(0x40)));
}

ATTN_AVX512 float Avx512ExpSum(float* x, int64_t n, float multiplier,
                               float shift) {
  const __m512 mul = _mm512_set1_ps(multiplier);
  const __m512 neg_shift = _mm512_set1_ps(-shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    const __m512 v = ShiftedExp512<true>(x + i, mask, mul, neg_shift);
    _mm512_mask_storeu_ps(x + i, mask, v);
    sum = _mm512_mask_add_ps(sum, mask, sum, v);
  }
  return _mm512_reduce_add_ps(sum);
}

ATTN_AVX512 float Avx512ExpSumBFloat16(const float* x, int64_t n,
                                       float multiplier, float shift,
                                       uint16_t* out) {
  const __m512 mul = _mm512_set1_ps(multiplier);
  const __m512 neg_shift = _mm512_set1_ps(-shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    const __m512 v = ShiftedExp512<false>(x + i, mask, mul, neg_shift);
    _mm256_mask_storeu_epi16(out + i, mask, ToBFloat16x16(v));
    sum = _mm512_mask_add_ps(sum, mask, sum, v);
  }
  return _mm512_reduce_add_ps(sum);
}

ATTN_AVX512 void Avx512Scale(float* x, int64_t n, float a) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    _mm512_mask_storeu_ps(
        x + i, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + i), va));
  }
}

ATTN_AVX512 void Avx512ScaleToBFloat16(const float* x, int64_t n, float a,
                                       uint16_t* out) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    _mm256_mask_storeu_epi16(
        out + i, mask,
        ToBFloat16x16(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + i), va)));
  }
}

ATTN_AVX512 bool Avx512AllFinite(const float* x, int64_t n) {
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);
  __mmask16 non_finite = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    const __m512i bits = _mm512_maskz_loadu_epi32(mask, x + i);
    non_finite |= _mm512_mask_cmpeq_epi32_mask(
        mask, _mm512_and_si512(bits, exponent), exponent);
  }
  return non_finite == 0;
}

// Lanes 0-7 and 8-15 of v, widened to double.
ATTN_AVX512 inline __m512d LowToDouble(__m512 v) {
  return _mm512_cvtps_pd(_mm512_castps512_ps256(v));
}
ATTN_AVX512 inline __m512d HighToDouble(__m512 v) {
  return _mm512_cvtps_pd(
      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// The output pass of LayerNorm: y = (x - high) * rstd + offset, then gamma
// and beta.
template <bool kGamma, bool kBeta>
ATTN_AVX512 void Avx512LayerNormOutput(const float* x, int64_t n,
                                       const LayerNormRow& row,
                                       const float* gamma, const float* beta,
                                       float* y) {
  const __m512 high = _mm512_set1_ps(row.high);
  const __m512 rstd = _mm512_set1_ps(row.rstd);
  const __m512 offset = _mm512_set1_ps(row.offset);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
    __m512 r = _mm512_fmadd_ps(_mm512_sub_ps(v, high), rstd, offset);
    if constexpr (kGamma && kBeta) {
      r = _mm512_fmadd_ps(r, _mm512_maskz_loadu_ps(mask, gamma + i),
                          _mm512_maskz_loadu_ps(mask, beta + i));
    } else if constexpr (kGamma) {
      r = _mm512_mul_ps(r, _mm512_maskz_loadu_ps(mask, gamma + i));
    } else if constexpr (kBeta) {
      r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(mask, beta + i));
    }
    _mm512_mask_storeu_ps(y + i, mask, r);
  }
}

// Two vectors a step in the sums: four double accumulators, so that the
// additions' latency does not bound the loop.
ATTN_AVX512 void Avx512LayerNorm(const float* x, int64_t n, float eps,
                                 const float* gamma, const float* beta,
                                 float* y) {
  __m512d s0 = _mm512_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i);
    const __m512 b = _mm512_loadu_ps(x + i + 16);
    s0 = _mm512_add_pd(s0, LowToDouble(a));
    s1 = _mm512_add_pd(s1, HighToDouble(a));
    s2 = _mm512_add_pd(s2, LowToDouble(b));
    s3 = _mm512_add_pd(s3, HighToDouble(b));
  }
  for (; i < n; i += 16) {  // masked lanes load as 0
    const __m512 a = _mm512_maskz_loadu_ps(TailMask(n - i), x + i);
    s0 = _mm512_add_pd(s0, LowToDouble(a));
    s1 = _mm512_add_pd(s1, HighToDouble(a));
  }
  const double mean = _mm512_reduce_add_pd(_mm512_add_pd(
                          _mm512_add_pd(s0, s1), _mm512_add_pd(s2, s3))) /
                      static_cast<double>(n);

  const __m512d m = _mm512_set1_pd(mean);
  s0 = s1 = s2 = s3 = _mm512_setzero_pd();
  for (i = 0; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i);
    const __m512 b = _mm512_loadu_ps(x + i + 16);
    const __m512d d0 = _mm512_sub_pd(LowToDouble(a), m);
    const __m512d d1 = _mm512_sub_pd(HighToDouble(a), m);
    const __m512d d2 = _mm512_sub_pd(LowToDouble(b), m);
    const __m512d d3 = _mm512_sub_pd(HighToDouble(b), m);
    s0 = _mm512_fmadd_pd(d0, d0, s0);
    s1 = _mm512_fmadd_pd(d1, d1, s1);
    s2 = _mm512_fmadd_pd(d2, d2, s2);
    s3 = _mm512_fmadd_pd(d3, d3, s3);
  }
  for (; i < n; i += 16) {
    // Masked lanes would add mean^2: they keep the accumulator.
    const __mmask16 mask = TailMask(n - i);
    const __m512 a = _mm512_maskz_loadu_ps(mask, x + i);
    const __m512d d0 = _mm512_sub_pd(LowToDouble(a), m);
    const __m512d d1 = _mm512_sub_pd(HighToDouble(a), m);
    s0 = _mm512_mask3_fmadd_pd(d0, d0, s0, static_cast<__mmask8>(mask));
    s1 = _mm512_mask3_fmadd_pd(d1, d1, s1, static_cast<__mmask8>(mask >> 8));
  }
  const double squares = _mm512_reduce_add_pd(
      _mm512_add_pd(_mm512_add_pd(s0, s1), _mm512_add_pd(s2, s3)));
  const LayerNormRow row = FinishLayerNormRow(mean, squares, n, eps);
  if (gamma != nullptr && beta != nullptr) {
    Avx512LayerNormOutput<true, true>(x, n, row, gamma, beta, y);
  } else if (gamma != nullptr) {
    Avx512LayerNormOutput<true, false>(x, n, row, gamma, beta, y);
  } else if (beta != nullptr) {
    Avx512LayerNormOutput<false, true>(x, n, row, gamma, beta, y);
  } else {
    Avx512LayerNormOutput<false, false>(x, n, row, gamma, beta, y);
  }
}

ATTN_AVX512 void Avx512RmsNorm(const float* x, int64_t n, float eps,
                               const float* gamma, float* y) {
  __m512d s0 = _mm512_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i);
    const __m512 b = _mm512_loadu_ps(x + i + 16);
    const __m512d d0 = LowToDouble(a), d1 = HighToDouble(a);
    const __m512d d2 = LowToDouble(b), d3 = HighToDouble(b);
    s0 = _mm512_fmadd_pd(d0, d0, s0);
    s1 = _mm512_fmadd_pd(d1, d1, s1);
    s2 = _mm512_fmadd_pd(d2, d2, s2);
    s3 = _mm512_fmadd_pd(d3, d3, s3);
  }
  for (; i < n; i += 16) {  // masked lanes load as 0
    const __m512 a = _mm512_maskz_loadu_ps(TailMask(n - i), x + i);
    const __m512d d0 = LowToDouble(a), d1 = HighToDouble(a);
    s0 = _mm512_fmadd_pd(d0, d0, s0);
    s1 = _mm512_fmadd_pd(d1, d1, s1);
  }
  const __m512 inverse = _mm512_set1_ps(
      RmsNormInverse(_mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(s0, s1),
                                                        _mm512_add_pd(s2, s3))),
                     n, eps));
  for (i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    __m512 r = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + i), inverse);
    if (gamma != nullptr) {
      r = _mm512_mul_ps(r, _mm512_maskz_loadu_ps(mask, gamma + i));
    }
    _mm512_mask_storeu_ps(y + i, mask, r);
  }
}

// 16 elements of cached rows from `offset` on (lanes off in `mask` read
// as 0), as float32; kInt8 rows are unscaled here.
template <RowType kType>
ATTN_AVX512 inline __m512 LoadCached16(const void* data, int64_t offset,
                                       __mmask16 mask) {
  if constexpr (kType == RowType::kFloat32) {
    return _mm512_maskz_loadu_ps(mask,
                                 static_cast<const float*>(data) + offset);
  } else if constexpr (kType == RowType::kBFloat16) {
    const __m256i bits = _mm256_maskz_loadu_epi16(
        mask, static_cast<const uint16_t*>(data) + offset);
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  } else {
    const __m128i bytes =
        _mm_maskz_loadu_epi8(mask, static_cast<const int8_t*>(data) + offset);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  }
}

// Prefetches row j's `bytes` (lines of 64 bytes) into L1.
inline void PrefetchRow(const char* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) {
    _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

// Prefetches the first `count` rows of a stream, whose loop then prefetches
// `count` rows ahead: without it every block of a split-KV pass starts its
// key and its value stream with misses (a 512-token block of int8 keys is
// only 32 KiB), which cost int8 caches a quarter of their rate from DRAM.
inline void PrefetchFirstRows(const char* first, int64_t count,
                              int64_t stride_bytes, int64_t bytes) {
  for (int64_t j = 0; j < count; ++j)
    PrefetchRow(first + j * stride_bytes, bytes);
}

// Prefetches the int8 scales of row `j` on (one line: 16 rows' scales).
inline void PrefetchScales(const float* scales, int64_t j) {
  _mm_prefetch(reinterpret_cast<const char*>(scales + j), _MM_HINT_T0);
}

// a + b lane by lane; kInt32: the lanes are int32 (moved as floats, added
// as integers).
template <bool kInt32>
ATTN_AVX512 inline __m512 AddLanes(__m512 a, __m512 b) {
  if constexpr (kInt32) {
    return _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  } else {
    return _mm512_add_ps(a, b);
  }
}

// Lane j of the result is the sum of the 16 lanes of v[j]: a transpose by
// pairs, quads and 128-bit lanes, 45 instructions for 16 sums (of float32
// lanes, or of int32 lanes with kInt32).
template <bool kInt32 = false>
ATTN_AVX512 inline __m512 SumEach16(const __m512 (&v)[16]) {
  __m512 pairs[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    pairs[i] = AddLanes<kInt32>(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 quads[4];
#pragma GCC unroll 8
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]);
    const __m512d b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = AddLanes<kInt32>(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // quads[i] holds, in each 128-bit lane L, the sums over lane L of
  // v[4i .. 4i + 3].
  __m512 halves[2];
#pragma GCC unroll 8
  for (int i = 0; i < 2; ++i) {
    halves[i] =
        AddLanes<kInt32>(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1],
                                              _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1],
                                              _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return AddLanes<kInt32>(
      _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
      _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 keys at a time: each row's 16 dot products accumulate in 16 vectors
// that SumEach16 reduces; the keys' tile stays in L1 for the next row.
template <RowType kType>
ATTN_AVX512 void Avx512DotRowsOf(const float* q, int64_t rows, int64_t dim,
                                 const CachedRows& keys, int64_t cols,
                                 float* out, int64_t ld) {
  const int64_t chunks = (dim + 15) / 16;
  const __mmask16 last = TailMask(dim - (chunks - 1) * 16);
  const int64_t elem = CachedElementBytes(kType);
  const int64_t row_bytes = dim * elem;
  const int64_t ahead =
      std::max<int64_t>(1, kPrefetchBytes / std::max<int64_t>(row_bytes, 1)) *
      keys.stride;
  const char* base = static_cast<const char*>(keys.data);
  const int64_t ahead_rows = ahead / std::max<int64_t>(keys.stride, 1);
  PrefetchFirstRows(base, std::min(cols, ahead_rows), keys.stride * elem,
                    row_bytes);
  for (int64_t j0 = 0; j0 < cols; j0 += 16) {
    const __mmask16 keep = TailMask(cols - j0);
    // A last tile of fewer keys repeats its last key; the store drops it.
    int64_t offset[16];
    for (int64_t jj = 0; jj < 16; ++jj) {
      offset[jj] = std::min(j0 + jj, cols - 1) * keys.stride;
      PrefetchRow(base + (offset[jj] + ahead) * elem, row_bytes);
    }
    __m512 scale = _mm512_set1_ps(1.0f);
    if constexpr (kType == RowType::kInt8) {
      PrefetchScales(keys.scales, j0 + ahead_rows);
      scale = _mm512_maskz_loadu_ps(keep, keys.scales + j0);
    }
    for (int64_t r = 0; r < rows; ++r) {
      __m512 acc[16];
#pragma GCC unroll 16
      for (int jj = 0; jj < 16; ++jj) acc[jj] = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __mmask16 mask =
            c + 1 == chunks ? last : static_cast<__mmask16>(0xffff);
        const __m512 qv = _mm512_maskz_loadu_ps(mask, q + r * dim + c * 16);
#pragma GCC unroll 16
        for (int jj = 0; jj < 16; ++jj) {
          acc[jj] = _mm512_fmadd_ps(
              qv, LoadCached16<kType>(keys.data, offset[jj] + c * 16, mask),
              acc[jj]);
        }
      }
      __m512 sums = SumEach16(acc);
      if constexpr (kType == RowType::kInt8) sums = _mm512_mul_ps(sums, scale);
      _mm512_mask_storeu_ps(out + r * ld + j0, keep, sums);
    }
  }
}

// With AVX512_VNNI, int8 keys take integer dot products: each query row is
// rounded to int16 with one scale (max |q| / 32767, a relative error of
// 1.5e-5 of its largest element, against int8's 1/254), and a key's codes
// widened to int16 meet it in vpdpwssd, 32 products per instruction
// instead of 16 multiply-adds after two conversions. The int32 sums are
// exact for head dims up to kVnniMaxDim; a row holding NaN or +-Inf, or a
// longer row, takes the float path, which keeps their IEEE results.
#define ATTN_AVX512_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
constexpr int64_t kVnniMaxDim = kIntegerDotMaxDim;

// dot_rows of `rows` query rows of int16 codes (`padded` apart, each with
// its scale) against int8 keys: 16 keys at a time, 32 dims a step, the
// keys' tile staying in L1 for the next row.
ATTN_AVX512_VNNI void Avx512VnniDotRowsInt8(
    const int16_t* codes, int64_t padded, const float* q_scales, int64_t rows,
    int64_t dim, const CachedRows& keys, int64_t cols, float* out, int64_t ld) {
  const int64_t steps = padded / 32;
  const __mmask32 last =
      static_cast<__mmask32>((uint64_t{1} << (dim - (steps - 1) * 32)) - 1);
  const int64_t ahead_rows = std::max<int64_t>(1, kPrefetchBytes / dim);
  const char* base = static_cast<const char*>(keys.data);
  PrefetchFirstRows(base, std::min(cols, ahead_rows), keys.stride, dim);
  for (int64_t j0 = 0; j0 < cols; j0 += 16) {
    const __mmask16 keep = TailMask(cols - j0);
    const int8_t* row[16];
    for (int64_t jj = 0; jj < 16; ++jj) {
      const int64_t offset = std::min(j0 + jj, cols - 1) * keys.stride;
      row[jj] = static_cast<const int8_t*>(keys.data) + offset;
      PrefetchRow(base + offset + ahead_rows * keys.stride, dim);
    }
    PrefetchScales(keys.scales, j0 + ahead_rows);
    const __m512 key_scales = _mm512_maskz_loadu_ps(keep, keys.scales + j0);
    for (int64_t r = 0; r < rows; ++r) {
      __m512i acc[16];
#pragma GCC unroll 16
      for (int jj = 0; jj < 16; ++jj) acc[jj] = _mm512_setzero_si512();
      for (int64_t step = 0; step < steps; ++step) {
        const __mmask32 mask =
            step + 1 == steps ? last : static_cast<__mmask32>(0xffffffffu);
        const __m512i qv = _mm512_loadu_si512(codes + r * padded + step * 32);
#pragma GCC unroll 16
        for (int jj = 0; jj < 16; ++jj) {
          const __m512i k = _mm512_cvtepi8_epi16(
              _mm256_maskz_loadu_epi8(mask, row[jj] + step * 32));
          acc[jj] = _mm512_dpwssd_epi32(acc[jj], qv, k);
        }
      }
      __m512 lanes[16];
#pragma GCC unroll 16
      for (int jj = 0; jj < 16; ++jj) lanes[jj] = _mm512_castsi512_ps(acc[jj]);
      const __m512 sums = _mm512_cvtepi32_ps(
          _mm512_castps_si512(SumEach16</*kInt32=*/true>(lanes)));
      const __m512 scale =
          _mm512_mul_ps(_mm512_set1_ps(q_scales[r]), key_scales);
      _mm512_mask_storeu_ps(out + r * ld + j0, keep,
                            _mm512_mul_ps(sums, scale));
    }
  }
}

ATTN_AVX512 void Avx512DotRows(const float* q, int64_t rows, int64_t dim,
                               const CachedRows& keys, int64_t cols, float* out,
                               int64_t ld);

// Runs of up to 16 consecutive query rows at a time; a row that is not all
// finite ends the run and takes the float path alone.
ATTN_AVX512_VNNI void Avx512VnniDotRows(const float* q, int64_t rows,
                                        int64_t dim, const CachedRows& keys,
                                        int64_t cols, float* out, int64_t ld) {
  if (keys.type != RowType::kInt8 || dim == 0 || dim > kVnniMaxDim) {
    return Avx512DotRows(q, rows, dim, keys, cols, out, ld);
  }
  constexpr int64_t kGroup = 16;
  const int64_t padded = (dim + 31) / 32 * 32;
  alignas(64) int16_t codes[kGroup * kVnniMaxDim];
  float q_scales[kGroup];
  int64_t first = 0, n = 0;  // the run: rows first .. first + n
  const auto flush = [&] {
    if (n > 0) {
      Avx512VnniDotRowsInt8(codes, padded, q_scales, n, dim, keys, cols,
                            out + first * ld, ld);
    }
    n = 0;
  };
  for (int64_t r = 0; r < rows; ++r) {
    if (n == 0) first = r;
    if (!QuantizeQueryInt16(q + r * dim, dim, padded, codes + n * padded,
                            q_scales + n)) {
      flush();
      Avx512DotRowsOf<RowType::kInt8>(q + r * dim, 1, dim, keys, cols,
                                      out + r * ld, ld);
      continue;
    }
    if (++n == kGroup) flush();
  }
  flush();
}

ATTN_AVX512 void Avx512DotRows(const float* q, int64_t rows, int64_t dim,
                               const CachedRows& keys, int64_t cols, float* out,
                               int64_t ld) {
  switch (keys.type) {
    case RowType::kFloat32:
      return Avx512DotRowsOf<RowType::kFloat32>(q, rows, dim, keys, cols, out,
                                                ld);
    case RowType::kBFloat16:
      return Avx512DotRowsOf<RowType::kBFloat16>(q, rows, dim, keys, cols, out,
                                                 ld);
    case RowType::kInt8:
      return Avx512DotRowsOf<RowType::kInt8>(q, rows, dim, keys, cols, out, ld);
  }
}

// kRows rows x kChunks * 16 columns (from c0) of acc in registers, over
// every value row: kChunks loads of a value row (read whole, front to
// back, for the prefetcher) and kRows broadcasts feed kRows * kChunks FMAs.
template <RowType kType, int kRows, int kChunks>
ATTN_AVX512 void Avx512AddWeightedTile(const float* p, int64_t ld,
                                       const CachedRows& values, int64_t cols,
                                       int64_t c0, int64_t dim, float* acc) {
  __mmask16 mask[kChunks];
#pragma GCC unroll 8
  for (int ch = 0; ch < kChunks; ++ch) {
    const int64_t left = dim - c0 - 16 * ch;
    mask[ch] = left > 0 ? TailMask(left) : static_cast<__mmask16>(0);
  }
  __m512 a[kRows][kChunks];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
    for (int ch = 0; ch < kChunks; ++ch) {
      a[r][ch] = _mm512_maskz_loadu_ps(mask[ch], acc + r * dim + c0 + 16 * ch);
    }
  }
  const int64_t elem = CachedElementBytes(kType);
  // This tile's columns of a row, and of the row `ahead` rows on.
  const int64_t tile_bytes =
      std::max<int64_t>(0, std::min<int64_t>(dim - c0, 16 * kChunks)) * elem;
  const int64_t ahead =
      std::max<int64_t>(1, kPrefetchBytes / std::max<int64_t>(dim * elem, 1));
  const char* base = static_cast<const char*>(values.data) + c0 * elem;
  PrefetchFirstRows(base, std::min(cols, ahead), values.stride * elem,
                    tile_bytes);
  for (int64_t j = 0; j < cols; ++j) {
    PrefetchRow(base + (j + ahead) * values.stride * elem, tile_bytes);
    if constexpr (kType == RowType::kInt8) {
      if (j % 16 == 0) PrefetchScales(values.scales, j + ahead);
    }
    __m512 v[kChunks];
#pragma GCC unroll 8
    for (int ch = 0; ch < kChunks; ++ch) {
      v[ch] = LoadCached16<kType>(values.data, j * values.stride + c0 + 16 * ch,
                                  mask[ch]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      float w = p[r * ld + j];
      if constexpr (kType == RowType::kInt8) w *= values.scales[j];
      const __m512 wv = _mm512_set1_ps(w);
#pragma GCC unroll 8
      for (int ch = 0; ch < kChunks; ++ch) {
        a[r][ch] = _mm512_fmadd_ps(wv, v[ch], a[r][ch]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
    for (int ch = 0; ch < kChunks; ++ch) {
      _mm512_mask_storeu_ps(acc + r * dim + c0 + 16 * ch, mask[ch], a[r][ch]);
    }
  }
}

// Tiles of up to 16 accumulators: rows x 64 columns for value rows of up to
// 64, 2 rows x 128 columns for longer ones.
template <RowType kType>
ATTN_AVX512 void Avx512AddWeightedRowsOf(const float* p, int64_t ld,
                                         int64_t rows, const CachedRows& values,
                                         int64_t cols, int64_t dim,
                                         float* acc) {
  const bool wide = dim > 64;
  const int64_t width = wide ? 128 : 64;
  const int64_t tile_rows = wide ? 2 : 4;
  for (int64_t c0 = 0; c0 < dim; c0 += width) {
    for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
      const float* pr = p + r0 * ld;
      float* ar = acc + r0 * dim;
      const int64_t n = std::min(rows - r0, tile_rows);
      if (wide) {
        if (n == 1) {
          Avx512AddWeightedTile<kType, 1, 8>(pr, ld, values, cols, c0, dim, ar);
        } else {
          Avx512AddWeightedTile<kType, 2, 8>(pr, ld, values, cols, c0, dim, ar);
        }
        continue;
      }
      switch (n) {
        case 1:
          Avx512AddWeightedTile<kType, 1, 4>(pr, ld, values, cols, c0, dim, ar);
          break;
        case 2:
          Avx512AddWeightedTile<kType, 2, 4>(pr, ld, values, cols, c0, dim, ar);
          break;
        case 3:
          Avx512AddWeightedTile<kType, 3, 4>(pr, ld, values, cols, c0, dim, ar);
          break;
        default:
          Avx512AddWeightedTile<kType, 4, 4>(pr, ld, values, cols, c0, dim, ar);
          break;
      }
    }
  }
}

ATTN_AVX512 void Avx512AddWeightedRows(const float* p, int64_t ld, int64_t rows,
                                       const CachedRows& values, int64_t cols,
                                       int64_t dim, float* acc) {
  switch (values.type) {
    case RowType::kFloat32:
      return Avx512AddWeightedRowsOf<RowType::kFloat32>(p, ld, rows, values,
                                                        cols, dim, acc);
    case RowType::kBFloat16:
      return Avx512AddWeightedRowsOf<RowType::kBFloat16>(p, ld, rows, values,
                                                         cols, dim, acc);
    case RowType::kInt8:
      return Avx512AddWeightedRowsOf<RowType::kInt8>(p, ld, rows, values, cols,
                                                     dim, acc);
  }
}

// With AVX512_BF16 the rounding to bfloat16 is one instruction.
#define ATTN_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

ATTN_AVX512_BF16 float Avx512Bf16ExpSumBFloat16(const float* x, int64_t n,
                                                float multiplier, float shift,
                                                uint16_t* out) {
  const __m512 mul = _mm512_set1_ps(multiplier);
  const __m512 neg_shift = _mm512_set1_ps(-shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    const __m512 v = ShiftedExp512<false>(x + i, mask, mul, neg_shift);
    _mm256_mask_storeu_epi16(out + i, mask,
                             reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    sum = _mm512_mask_add_ps(sum, mask, sum, v);
  }
  return _mm512_reduce_add_ps(sum);
}

ATTN_AVX512_BF16 void Avx512Bf16ScaleToBFloat16(const float* x, int64_t n,
                                                float a, uint16_t* out) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + i), va);
    _mm256_mask_storeu_epi16(out + i, mask,
                             reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
}

#endif  // defined(__x86_64__)

}  // namespace

const RowOps& ScalarRowOps() {
  static const RowOps ops{ScalarScaleMax,
                          ScalarMaxScaled,
                          ScalarMax,
                          ScalarExpSum,
                          ScalarExpSumBFloat16,
                          ScalarScale,
                          ScalarScaleToBFloat16,
                          ScalarAllFinite,
                          ScalarLayerNorm,
                          ScalarRmsNorm,
                          ScalarDotRows,
                          ScalarAddWeightedRows,
                          /*int8_keys_round_queries=*/false,
                          "scalar",
                          "scalar"};
  return ops;
}

namespace {

std::atomic<const RowOps*> row_ops_for_testing{nullptr};

#if defined(__x86_64__)
bool CpuHasAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

bool CpuHasAvx512Bf16() {
  return CpuHasAvx512() && __builtin_cpu_supports("avx512bf16");
}

const RowOps kAvx512Bf16RowOps{Avx512ScaleMax,
                               Avx512MaxScaled,
                               Avx512Max,
                               Avx512ExpSum,
                               Avx512Bf16ExpSumBFloat16,
                               Avx512Scale,
                               Avx512Bf16ScaleToBFloat16,
                               Avx512AllFinite,
                               Avx512LayerNorm,
                               Avx512RmsNorm,
                               Avx512DotRows,
                               Avx512AddWeightedRows,
                               /*int8_keys_round_queries=*/false,
                               "avx512_bf16",
                               "avx512"};
const RowOps kAvx512VnniRowOps{Avx512ScaleMax,
                               Avx512MaxScaled,
                               Avx512Max,
                               Avx512ExpSum,
                               Avx512Bf16ExpSumBFloat16,
                               Avx512Scale,
                               Avx512Bf16ScaleToBFloat16,
                               Avx512AllFinite,
                               Avx512LayerNorm,
                               Avx512RmsNorm,
                               Avx512VnniDotRows,
                               Avx512AddWeightedRows,
                               /*int8_keys_round_queries=*/true,
                               "avx512_vnni",
                               "avx512"};
const RowOps kAvx512RowOps{Avx512ScaleMax,
                           Avx512MaxScaled,
                           Avx512Max,
                           Avx512ExpSum,
                           Avx512ExpSumBFloat16,
                           Avx512Scale,
                           Avx512ScaleToBFloat16,
                           Avx512AllFinite,
                           Avx512LayerNorm,
                           Avx512RmsNorm,
                           Avx512DotRows,
                           Avx512AddWeightedRows,
                           /*int8_keys_round_queries=*/false,
                           "avx512",
                           "avx512"};
#endif  // defined(__x86_64__)

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
#if defined(__x86_64__)
    if (CpuHasAvx512Bf16() && __builtin_cpu_supports("avx512vnni")) {
      all.push_back(&kAvx512VnniRowOps);
    }
    if (CpuHasAvx512Bf16()) all.push_back(&kAvx512Bf16RowOps);
    if (CpuHasAvx512()) all.push_back(&kAvx512RowOps);
#endif
    for (const RowOps* ops : row_ops_internal::PortableRowOps()) {
      all.push_back(ops);
    }
    all.push_back(&ScalarRowOps());
    return all;
  }();
  return supported;
}

}  // namespace attnserve
