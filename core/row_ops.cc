#include "core/row_ops.h"

// GCC 12's AVX-512 headers build masked intrinsics on _mm512_undefined_ps(),
// which its own -Wuninitialized flags (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/convert.h"

namespace attnserve {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

float ScalarExpSum(float* x, int64_t n, float shift) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

void ScalarScale(float* x, int64_t n, float a) {
  for (int64_t i = 0; i < n; ++i) x[i] *= a;
}

void ScalarScaleToBFloat16(const float* x, int64_t n, float a, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToBFloat16(x[i] * a);
}

#define ATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// exp(x) for x <= 0 (the softmax only needs that range): 2^k * p(r) with
// x = k*ln2 + r, |r| <= ln2/2, p Cephes' degree-7 polynomial (about 1 ulp);
// below -87.3, where float underflows, and for -inf the result is 0.
ATTN_AVX512 inline __m512 Exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  const __mmask16 underflow =
      _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 k =
      _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(k, ln2_hi, x);
  r = _mm512_fnmadd_ps(k, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r),
                      _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512 result = _mm512_scalef_ps(p, k);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), result);
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
    m = _mm512_mask_max_ps(m, mask, m, v);
  }
  return _mm512_reduce_max_ps(m);
}

ATTN_AVX512 float Avx512Max(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(kNegInf);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    m = _mm512_mask_max_ps(m, mask, m, _mm512_maskz_loadu_ps(mask, x + i));
  }
  return _mm512_reduce_max_ps(m);
}

ATTN_AVX512 float Avx512ExpSum(float* x, int64_t n, float shift) {
  const __m512 s = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    const __m512 v =
        Exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x + i), s));
    _mm512_mask_storeu_ps(x + i, mask, v);
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
  const __m512i lsb = _mm512_set1_epi32(1);
  const __m512i bias = _mm512_set1_epi32(0x7fff);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = TailMask(n - i);
    const __m512i bits = _mm512_castps_si512(
        _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + i), va));
    // Round to nearest even: add 0x7fff plus the lowest kept bit.
    const __m512i rounding = _mm512_add_epi32(
        bias, _mm512_and_si512(_mm512_srli_epi32(bits, 16), lsb));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(bits, rounding), 16);
    _mm256_mask_storeu_epi16(out + i, mask, _mm512_cvtepi32_epi16(rounded));
  }
}

}  // namespace

const RowOps& ScalarRowOps() {
  static const RowOps ops{ScalarScaleMax,        ScalarMax,
                          ScalarExpSum,          ScalarScale,
                          ScalarScaleToBFloat16, "scalar"};
  return ops;
}

const RowOps& GetRowOps() {
  static const RowOps ops = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
      return RowOps{Avx512ScaleMax,        Avx512Max, Avx512ExpSum, Avx512Scale,
                    Avx512ScaleToBFloat16, "avx512"};
    }
    return ScalarRowOps();
  }();
  return ops;
}

}  // namespace attnserve
