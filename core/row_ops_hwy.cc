// The row operations written once for every instruction set with Highway
// (SSE4, AVX2, AVX-512, NEON, SVE...): this file is compiled once per
// target Highway's foreach_target.h names, each copy in its own namespace,
// and PortableRowOps lists the copies this CPU runs.
//
// Results follow RowOps' contract on every target; the bits depend on the
// target's vector width (summation order), never on anything else.
// Compiled with -ffp-contract=off: a multiply the code keeps apart from an
// add (the rounded logit of the shifted exp) must stay rounded.

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/row_ops_hwy.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// clang-format on

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/row_ops.h"
#include "core/row_ops_internal.h"
#include "hwy/cache_control.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace attnserve {
namespace HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;
using row_ops_internal::CachedElementBytes;
using row_ops_internal::FinishLayerNormRow;
using row_ops_internal::kIntegerDotMaxDim;
using row_ops_internal::kPrefetchBytes;
using row_ops_internal::LayerNormRow;
using row_ops_internal::QuantizeQueryInt16;
using row_ops_internal::RmsNormInverse;

using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// The most lanes of any vector of this target (bytes of a tail buffer).
constexpr size_t kMaxBytes = HWY_MAX_BYTES;

int64_t Lanes() { return static_cast<int64_t>(hn::Lanes(D())); }

// The n < Lanes() elements at p, the other lanes `fill`: tails are read
// through a buffer, never past the end of a row.
V LoadTail(const float* p, int64_t n, float fill) {
  const D d;
  HWY_ALIGN float buffer[kMaxBytes / sizeof(float)];
  hn::Store(hn::Set(d, fill), d, buffer);
  std::memcpy(buffer, p, static_cast<size_t>(n) * sizeof(float));
  return hn::Load(d, buffer);
}

void StoreTail(V v, float* p, int64_t n) {
  HWY_ALIGN float buffer[kMaxBytes / sizeof(float)];
  hn::Store(v, D(), buffer);
  std::memcpy(p, buffer, static_cast<size_t>(n) * sizeof(float));
}

// m, raised to v where v is larger; NaN lanes of v leave m (the max
// functions ignore NaN on every target, whatever its max instruction does).
V MaxIgnoringNaN(V m, V v) {
  return hn::IfThenElse(hn::IsNaN(v), m, hn::Max(m, v));
}

float MaxOfLanes(V m) { return hn::GetLane(hn::MaxOfLanes(D(), m)); }
float SumOfLanes(V s) { return hn::GetLane(hn::SumOfLanes(D(), s)); }

// Calls f(v, i, n) for the vectors of x[0..n): whole ones, then the tail
// (n - i < Lanes(), loaded with `fill`). f returns what to store, or
// nothing for a reading function.
template <class F>
void ForEachVector(const float* x, int64_t n, float fill, F&& f) {
  const D d;
  const int64_t lanes = Lanes();
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) f(hn::LoadU(d, x + i), i, lanes);
  if (i < n) f(LoadTail(x + i, n - i, fill), i, n - i);
}

// Lanes from `count` on: -inf (scaled tails: a negative multiplier turns
// a -inf fill into +inf).
V NegInfFrom(V v, int64_t count) {
  const D d;
  return hn::IfThenElse(hn::FirstN(d, static_cast<size_t>(count)), v,
                        hn::Set(d, kNegInf));
}

float ScaleMax(float* x, int64_t n, float multiplier) {
  const D d;
  const V mul = hn::Set(d, multiplier);
  V m = hn::Set(d, kNegInf);
  ForEachVector(x, n, kNegInf, [&](V v, int64_t i, int64_t count) {
    v = hn::Mul(v, mul);
    if (count == Lanes()) {
      hn::StoreU(v, d, x + i);
    } else {
      StoreTail(v, x + i, count);
    }
    m = MaxIgnoringNaN(m, count == Lanes() ? v : NegInfFrom(v, count));
  });
  return MaxOfLanes(m);
}

float Max(const float* x, int64_t n) {
  V m = hn::Set(D(), kNegInf);
  ForEachVector(x, n, kNegInf,
                [&](V v, int64_t, int64_t) { m = MaxIgnoringNaN(m, v); });
  return MaxOfLanes(m);
}

float MaxScaled(const float* x, int64_t n, float multiplier) {
  const V mul = hn::Set(D(), multiplier);
  V m = hn::Set(D(), kNegInf);
  ForEachVector(x, n, kNegInf, [&](V v, int64_t, int64_t count) {
    v = hn::Mul(v, mul);
    m = MaxIgnoringNaN(m, count == Lanes() ? v : NegInfFrom(v, count));
  });
  return MaxOfLanes(m);
}

// exp(x) for x <= 0 (the softmax only needs that range): 2^k * p(r) with
// x = k*ln2 + r, |r| <= ln2/2, p Cephes' degree-7 polynomial (about 1 ulp).
// exp(-inf) is exactly 0 and NaN stays NaN. kFull: float32 accuracy.
// Otherwise enough for values rounded to bfloat16 next (one-step ln2 and a
// degree-4 Taylor polynomial: relative error below 5e-5, against
// bfloat16's 4e-3), at about two thirds of the cost.
template <bool kFull>
V ExpNonPositive(V x) {
  const D d;
  const hn::RebindToSigned<D> di;
  // Below -110 the result rounds to exactly 0, which is what -inf (a
  // masked logit) must give; between -87.3 and -110 it is a denormal.
  const V clamped = hn::Max(hn::Set(d, -110.0f), x);
  const V k = hn::Round(hn::Mul(clamped, hn::Set(d, 1.44269504088896341f)));
  V p;
  if constexpr (kFull) {
    V r = hn::NegMulAdd(k, hn::Set(d, 0.693359375f), clamped);
    r = hn::NegMulAdd(k, hn::Set(d, -2.12194440e-4f), r);
    p = hn::Set(d, 1.9875691500e-4f);
    p = hn::MulAdd(p, r, hn::Set(d, 1.3981999507e-3f));
    p = hn::MulAdd(p, r, hn::Set(d, 8.3334519073e-3f));
    p = hn::MulAdd(p, r, hn::Set(d, 4.1665795894e-2f));
    p = hn::MulAdd(p, r, hn::Set(d, 1.6666665459e-1f));
    p = hn::MulAdd(p, r, hn::Set(d, 5.0000001201e-1f));
    p = hn::MulAdd(p, hn::Mul(r, r), hn::Add(r, hn::Set(d, 1.0f)));
  } else {
    const V r = hn::NegMulAdd(k, hn::Set(d, 0.69314718f), clamped);
    p = hn::Set(d, 1.0f / 24);
    p = hn::MulAdd(p, r, hn::Set(d, 1.0f / 6));
    p = hn::MulAdd(p, r, hn::Set(d, 0.5f));
    p = hn::MulAdd(p, r, hn::Set(d, 1.0f));
    p = hn::MulAdd(p, r, hn::Set(d, 1.0f));
  }
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  // AVX-512 scales by 2^k in one instruction (vscalefps, the same bits as
  // the two multiplies below): on a Zen 5 it made multi-head attention B8
  // L512 E512 11% faster in float32 and 18% in bfloat16 (one run).
  const V result{_mm512_scalef_ps(p.raw, k.raw)};
#else
  // 2^k as two normal powers (k >= -159: halves >= -80), so that the one
  // rounding into the denormals is the last multiply's, as a scalef's.
  // k as an integer: k + 1.5 * 2^23 holds k in its low mantissa bits
  // (exact for |k| < 2^22). Two instructions where ConvertTo's range
  // fix-up costs six, and the same bits.
  const auto ki = hn::Sub(hn::BitCast(di, hn::Add(k, hn::Set(d, 12582912.0f))),
                          hn::Set(di, 0x4B400000));
  const auto k1 = hn::ShiftRight<1>(ki);
  const auto k2 = hn::Sub(ki, k1);
  const auto bias = hn::Set(di, 127);
  const V pow1 = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(k1, bias)));
  const V pow2 = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(k2, bias)));
  const V result = hn::Mul(hn::Mul(p, pow1), pow2);
#endif
  return hn::IfThenElse(hn::IsNaN(x), x, result);
}

// exp(x * multiplier - shift): the product is rounded before the shift, as
// in max_scaled (`shift` is the largest rounded product; a fused product
// differs from it by up to half an ulp, which for logits above ~1e9
// overflows exp or underflows every term).
template <bool kFull>
V ShiftedExp(V x, V mul, V neg_shift) {
  return ExpNonPositive<kFull>(hn::Add(hn::Mul(x, mul), neg_shift));
}

// Float32 lanes rounded to bfloat16, nearest even, as FloatToBFloat16: NaN
// lanes are quieted (the rounding add would carry a NaN's payload into the
// exponent or the sign). The bfloat16 bits are in the low half of each
// 32-bit lane.
hn::Vec<hn::RebindToSigned<D>> ToBFloat16Bits(V v) {
  const hn::RebindToSigned<D> di;
  const auto bits = hn::BitCast(di, v);
  // Logical shifts: the sign bit must not spread.
  const hn::RebindToUnsigned<D> du;
  const auto high = hn::BitCast(di, hn::ShiftRight<16>(hn::BitCast(du, bits)));
  const auto rounding =
      hn::Add(hn::Set(di, 0x7fff), hn::And(high, hn::Set(di, 1)));
  const auto rounded = hn::BitCast(
      di, hn::ShiftRight<16>(hn::BitCast(du, hn::Add(bits, rounding))));
  return hn::IfThenElse(hn::RebindMask(di, hn::IsNaN(v)),
                        hn::Or(high, hn::Set(di, 0x40)), rounded);
}

// Stores `count` lanes of v as bfloat16 at out.
void StoreBFloat16(V v, uint16_t* out, int64_t count) {
  const hn::Rebind<uint16_t, D> d16;
  const auto narrow = hn::DemoteTo(d16, ToBFloat16Bits(v));
  if (count == Lanes()) {
    hn::StoreU(narrow, d16, out);
    return;
  }
  HWY_ALIGN uint16_t buffer[kMaxBytes / sizeof(float)];
  hn::StoreU(narrow, d16, buffer);
  std::memcpy(out, buffer, static_cast<size_t>(count) * sizeof(uint16_t));
}

// Lanes from `count` on: 0.
V KeepFirst(V v, int64_t count) {
  return hn::IfThenElseZero(hn::FirstN(D(), static_cast<size_t>(count)), v);
}

// exp_sum, or with kBFloat16 exp_sum_bf16_in_place: the values rounded to
// bfloat16 (and the shorter polynomial, enough for that), the sum of the
// values before rounding.
template <bool kBFloat16>
float ExpSumInPlace(float* x, int64_t n, float multiplier, float shift) {
  const D d;
  const hn::RebindToUnsigned<D> du;
  const V mul = hn::Set(d, multiplier);
  const V neg_shift = hn::Set(d, -shift);
  V sum = hn::Zero(d);
  ForEachVector(x, n, 0.0f, [&](V v, int64_t i, int64_t count) {
    v = ShiftedExp<!kBFloat16>(v, mul, neg_shift);
    V stored = v;
    if constexpr (kBFloat16) {
      stored =
          hn::BitCast(d, hn::ShiftLeft<16>(hn::BitCast(du, ToBFloat16Bits(v))));
    }
    if (count == Lanes()) {
      hn::StoreU(stored, d, x + i);
      sum = hn::Add(sum, v);
    } else {
      StoreTail(stored, x + i, count);
      sum = hn::Add(sum, KeepFirst(v, count));
    }
  });
  return SumOfLanes(sum);
}

float ExpSum(float* x, int64_t n, float multiplier, float shift) {
  return ExpSumInPlace<false>(x, n, multiplier, shift);
}

float ExpSumBFloat16(const float* x, int64_t n, float multiplier, float shift,
                     uint16_t* out) {
  const D d;
  const V mul = hn::Set(d, multiplier);
  const V neg_shift = hn::Set(d, -shift);
  V sum = hn::Zero(d);
  ForEachVector(x, n, 0.0f, [&](V v, int64_t i, int64_t count) {
    v = ShiftedExp<false>(v, mul, neg_shift);
    StoreBFloat16(v, out + i, count);
    sum = hn::Add(sum, count == Lanes() ? v : KeepFirst(v, count));
  });
  return SumOfLanes(sum);
}

float ExpSumBFloat16InPlace(float* x, int64_t n, float multiplier,
                            float shift) {
  return ExpSumInPlace<true>(x, n, multiplier, shift);
}

void Scale(float* x, int64_t n, float a) {
  const D d;
  const V va = hn::Set(d, a);
  ForEachVector(x, n, 0.0f, [&](V v, int64_t i, int64_t count) {
    if (count == Lanes()) {
      hn::StoreU(hn::Mul(v, va), d, x + i);
    } else {
      StoreTail(hn::Mul(v, va), x + i, count);
    }
  });
}

void ScaleToBFloat16(const float* x, int64_t n, float a, uint16_t* out) {
  const V va = hn::Set(D(), a);
  ForEachVector(x, n, 0.0f, [&](V v, int64_t i, int64_t count) {
    StoreBFloat16(hn::Mul(v, va), out + i, count);
  });
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// With AVX512_BF16 (Zen 4 and later, Sapphire Rapids) the rounding to
// bfloat16 is one vcvtneps2bf16 where ToBFloat16Bits takes eight
// instructions: on a Zen 5 it made bfloat16 SDPA B8 H8 L512 7% faster
// (one run). Nearest even and NaN quieted, as FloatToBFloat16. The
// instruction takes denormals for 0. scale_to_bf16 (a tensor's values)
// rounds a vector holding one by ToBFloat16Bits instead, so that its bits
// are those of the other tables; the softmax's exp_sum_bf16 keeps the 0:
// its probabilities below 2^-126 are common (logits 87 below the row's
// maximum) and, rounded by ToBFloat16Bits, cost MHA bfloat16 B8 L512 30%.
// Plain loops: a lambda would not take the function's target. The target
// names the whole set (clang replaces the enclosing pragma's set with a
// function's own).
#define ATTN_AVX512_BF16 __attribute__((target(HWY_TARGET_STR ",avx512bf16")))

template <bool kDenormals>
ATTN_AVX512_BF16 void StoreBFloat16Native(V v, uint16_t* out, int64_t count) {
  if constexpr (kDenormals) {
    const __m512 magnitude = _mm512_abs_ps(v.raw);
    const __mmask16 denormal =
        _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(FLT_MIN), _CMP_LT_OQ) &
        _mm512_cmp_ps_mask(magnitude, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    if (denormal != 0) return StoreBFloat16(v, out, count);
  }
  const __mmask16 mask =
      count >= 16 ? 0xffff : static_cast<__mmask16>((1u << count) - 1);
  _mm256_mask_storeu_epi16(
      out, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v.raw)));
}

// exp_sum_bf16 into `out` (uint16_t), or with kInPlace
// exp_sum_bf16_in_place into `out` (float, x itself).
template <bool kInPlace>
ATTN_AVX512_BF16 float NativeExpSumBFloat16(const float* x, int64_t n,
                                            float multiplier, float shift,
                                            void* out) {
  const D d;
  const V mul = hn::Set(d, multiplier);
  const V neg_shift = hn::Set(d, -shift);
  V sum = hn::Zero(d);
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t count = std::min<int64_t>(16, n - i);
    const V v = ShiftedExp<false>(
        count == 16 ? hn::LoadU(d, x + i) : LoadTail(x + i, count, 0.0f), mul,
        neg_shift);
    if constexpr (kInPlace) {
      const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v.raw));
      const __mmask16 mask =
          count >= 16 ? 0xffff : static_cast<__mmask16>((1u << count) - 1);
      _mm512_mask_storeu_ps(static_cast<float*>(out) + i, mask,
                            _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(bits), 16)));
    } else {
      StoreBFloat16Native</*kDenormals=*/false>(
          v, static_cast<uint16_t*>(out) + i, count);
    }
    sum = hn::Add(sum, count == 16 ? v : KeepFirst(v, count));
  }
  return SumOfLanes(sum);
}

ATTN_AVX512_BF16 float ExpSumBFloat16Native(const float* x, int64_t n,
                                            float multiplier, float shift,
                                            uint16_t* out) {
  return NativeExpSumBFloat16<false>(x, n, multiplier, shift, out);
}

ATTN_AVX512_BF16 float ExpSumBFloat16InPlaceNative(float* x, int64_t n,
                                                   float multiplier,
                                                   float shift) {
  return NativeExpSumBFloat16<true>(x, n, multiplier, shift, x);
}

ATTN_AVX512_BF16 void ScaleToBFloat16Native(const float* x, int64_t n, float a,
                                            uint16_t* out) {
  const D d;
  const V va = hn::Set(d, a);
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t count = std::min<int64_t>(16, n - i);
    const V v =
        count == 16 ? hn::LoadU(d, x + i) : LoadTail(x + i, count, 0.0f);
    StoreBFloat16Native</*kDenormals=*/true>(hn::Mul(v, va), out + i, count);
  }
}
#endif

void WidenBFloat16(const uint16_t* x, int64_t n, float* out) {
  const D d;
  const hn::RebindToUnsigned<D> du;
  const hn::Rebind<uint16_t, D> d16;
  const int64_t lanes = Lanes();
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto bits =
        hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, x + i)));
    hn::StoreU(hn::BitCast(d, bits), d, out + i);
  }
  for (; i < n; ++i) out[i] = BFloat16ToFloat(x[i]);
}

bool AllFinite(const float* x, int64_t n) {
  const D d;
  bool finite = true;
  ForEachVector(x, n, 0.0f, [&](V v, int64_t, int64_t) {
    finite = finite && hn::AllTrue(d, hn::IsFinite(v));
  });
  return finite;
}

// Sums over x[0..n) in double, in four accumulators (two vectors of
// floats a step: the adds' latency, not their throughput, bounds fewer):
// `accumulate(sum, v)` adds v's term to sum. Without float64 vectors (some
// targets), in scalar double.
#if HWY_HAVE_FLOAT64 && HWY_TARGET != HWY_SCALAR
using DD = hn::Repartition<double, D>;
template <class F>
double SumInDouble(const float* x, int64_t n, F&& accumulate) {
  const D d;
  const DD dd;
  const hn::Half<D> dh;
  const int64_t lanes = Lanes();
  auto s0 = hn::Zero(dd), s1 = hn::Zero(dd), s2 = hn::Zero(dd),
       s3 = hn::Zero(dd);
  int64_t i = 0;
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    const V a = hn::LoadU(d, x + i), b = hn::LoadU(d, x + i + lanes);
    s0 = accumulate(s0, hn::PromoteTo(dd, hn::LowerHalf(dh, a)));
    s1 = accumulate(s1, hn::PromoteTo(dd, hn::UpperHalf(dh, a)));
    s2 = accumulate(s2, hn::PromoteTo(dd, hn::LowerHalf(dh, b)));
    s3 = accumulate(s3, hn::PromoteTo(dd, hn::UpperHalf(dh, b)));
  }
  // The rest, a vector at a time; tail lanes load as 0 and are masked out
  // of the terms.
  const int64_t half = lanes / 2;
  for (; i < n; i += lanes) {
    const int64_t count = std::min(lanes, n - i);
    const V v =
        count == lanes ? hn::LoadU(d, x + i) : LoadTail(x + i, count, 0);
    const auto zero = hn::Zero(dd);
    const auto lo = hn::IfThenElseZero(
        hn::FirstN(dd, static_cast<size_t>(std::min(count, half))),
        accumulate(zero, hn::PromoteTo(dd, hn::LowerHalf(dh, v))));
    const auto hi = hn::IfThenElseZero(
        hn::FirstN(dd, static_cast<size_t>(std::max<int64_t>(count - half, 0))),
        accumulate(zero, hn::PromoteTo(dd, hn::UpperHalf(dh, v))));
    s0 = hn::Add(s0, lo);
    s1 = hn::Add(s1, hi);
  }
  return hn::GetLane(
      hn::SumOfLanes(dd, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3))));
}
#endif

// The sum of x^2 in double (RMSNorm's mean square).
double SumOfSquares(const float* x, int64_t n) {
#if HWY_HAVE_FLOAT64 && HWY_TARGET != HWY_SCALAR
  return SumInDouble(x, n, [](auto s, auto v) { return hn::MulAdd(v, v, s); });
#else
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += double{x[i]} * x[i];
  return sum;
#endif
}

// y = (x - high) * rstd + offset, times gamma and plus beta where given.
// A plain loop per combination: through a capturing lambda, the compiler
// reloaded the pointers from the closure for every vector (y might alias
// them), which cost 3x.
template <bool kGamma, bool kBeta>
void LayerNormOutputOf(const float* x, int64_t n, const LayerNormRow& row,
                       const float* gamma, const float* beta, float* y) {
  const D d;
  const int64_t lanes = Lanes();
  const V high = hn::Set(d, row.high);
  const V rstd = hn::Set(d, row.rstd);
  const V offset = hn::Set(d, row.offset);
  const auto output = [&](V v, V g, V b) {
    V r = hn::MulAdd(hn::Sub(v, high), rstd, offset);
    if constexpr (kGamma) r = hn::Mul(r, g);
    if constexpr (kBeta) r = hn::Add(r, b);
    return r;
  };
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    hn::StoreU(
        output(hn::LoadU(d, x + i), kGamma ? hn::LoadU(d, gamma + i) : high,
               kBeta ? hn::LoadU(d, beta + i) : high),
        d, y + i);
  }
  if (i < n) {
    const int64_t count = n - i;
    StoreTail(output(LoadTail(x + i, count, 0.0f),
                     kGamma ? LoadTail(gamma + i, count, 0.0f) : high,
                     kBeta ? LoadTail(beta + i, count, 0.0f) : high),
              y + i, count);
  }
}

void LayerNormOutput(const float* x, int64_t n, const LayerNormRow& row,
                     const float* gamma, const float* beta, float* y) {
  if (gamma != nullptr) {
    return beta != nullptr
               ? LayerNormOutputOf<true, true>(x, n, row, gamma, beta, y)
               : LayerNormOutputOf<true, false>(x, n, row, gamma, beta, y);
  }
  return beta != nullptr
             ? LayerNormOutputOf<false, true>(x, n, row, gamma, beta, y)
             : LayerNormOutputOf<false, false>(x, n, row, gamma, beta, y);
}

// A LayerNorm row's mean and sum of squared deviations from it, in one
// pass in double over the deviations from its first value
// (row_ops_internal::MeanAndSquares).
std::pair<double, double> MeanAndSquares(const float* x, int64_t n) {
  const double shift = x[0];
  double sum = 0, squares = 0;
  int64_t i = 0;
#if HWY_HAVE_FLOAT64 && HWY_TARGET != HWY_SCALAR
  const D d;
  const DD dd;
  const hn::Half<D> dh;
  const auto k = hn::Set(dd, shift);
  // Two sets of accumulators, two vectors a step: the adds' latency, not
  // their throughput, bounds fewer.
  auto s0 = hn::Zero(dd), s1 = hn::Zero(dd), s2 = hn::Zero(dd),
       s3 = hn::Zero(dd), q0 = hn::Zero(dd), q1 = hn::Zero(dd),
       q2 = hn::Zero(dd), q3 = hn::Zero(dd);
  const auto add = [&](V v, auto& sum_lo, auto& sum_hi, auto& squares_lo,
                       auto& squares_hi) {
    const auto lo = hn::Sub(hn::PromoteTo(dd, hn::LowerHalf(dh, v)), k);
    const auto hi = hn::Sub(hn::PromoteTo(dd, hn::UpperHalf(dh, v)), k);
    sum_lo = hn::Add(sum_lo, lo);
    sum_hi = hn::Add(sum_hi, hi);
    squares_lo = hn::MulAdd(lo, lo, squares_lo);
    squares_hi = hn::MulAdd(hi, hi, squares_hi);
  };
  const int64_t lanes = Lanes();
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    add(hn::LoadU(d, x + i), s0, s1, q0, q1);
    add(hn::LoadU(d, x + i + lanes), s2, s3, q2, q3);
  }
  for (; i + lanes <= n; i += lanes) add(hn::LoadU(d, x + i), s0, s1, q0, q1);
  // The tail's other lanes hold x[0]: deviations of 0.
  if (i < n) add(LoadTail(x + i, n - i, x[0]), s2, s3, q2, q3);
  i = n;
  sum = hn::GetLane(
      hn::SumOfLanes(dd, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3))));
  squares = hn::GetLane(
      hn::SumOfLanes(dd, hn::Add(hn::Add(q0, q1), hn::Add(q2, q3))));
#endif
  for (; i < n; ++i) {
    const double deviation = x[i] - shift;
    sum += deviation;
    squares += deviation * deviation;
  }
  return row_ops_internal::MeanAndSquares(shift, sum, squares, n);
}

void LayerNorm(const float* x, int64_t n, float eps, const float* gamma,
               const float* beta, float* y) {
  const auto [mean, squares] = MeanAndSquares(x, n);
  LayerNormOutput(x, n, FinishLayerNormRow(mean, squares, n, eps), gamma, beta,
                  y);
}

// y = x * inverse, times gamma where given.
template <bool kGamma>
void RmsNormOutputOf(const float* x, int64_t n, float inverse,
                     const float* gamma, float* y) {
  const D d;
  const int64_t lanes = Lanes();
  const V scale = hn::Set(d, inverse);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    V r = hn::Mul(hn::LoadU(d, x + i), scale);
    if constexpr (kGamma) r = hn::Mul(r, hn::LoadU(d, gamma + i));
    hn::StoreU(r, d, y + i);
  }
  if (i < n) {
    const int64_t count = n - i;
    V r = hn::Mul(LoadTail(x + i, count, 0.0f), scale);
    if constexpr (kGamma) r = hn::Mul(r, LoadTail(gamma + i, count, 0.0f));
    StoreTail(r, y + i, count);
  }
}

void RmsNorm(const float* x, int64_t n, float eps, const float* gamma,
             float* y) {
  const float inverse = RmsNormInverse(SumOfSquares(x, n), n, eps);
  if (gamma != nullptr) return RmsNormOutputOf<true>(x, n, inverse, gamma, y);
  RmsNormOutputOf<false>(x, n, inverse, nullptr, y);
}

// QuantizeInt8 of one cache row: the maximum and finiteness a vector at a
// time, then the codes in double (as the scalar code computes them), half
// a vector of floats a step; ties round away from zero as std::round does:
// the truncated value, moved one away from zero where the part cut off
// (exact in double) is at least 1/2.
float QuantizeInt8(const float* x, int64_t n, int8_t* codes) {
  const D d;
  V max_abs_lanes = hn::Zero(d);
  bool finite = true;
  ForEachVector(x, n, 0.0f, [&](V v, int64_t, int64_t) {
    finite = finite && hn::AllTrue(d, hn::IsFinite(v));
    max_abs_lanes = hn::Max(max_abs_lanes, hn::Abs(v));
  });
  const float max_abs = MaxOfLanes(max_abs_lanes);
  if (!finite || max_abs == 0.0f) {
    return row_ops_internal::QuantizeRowWithoutScale(finite, n, codes);
  }
  // In double: 127 / max_abs overflows float for subnormal rows.
  const double inverse = 127.0 / max_abs;
  int64_t i = 0;
#if HWY_HAVE_FLOAT64 && HWY_TARGET != HWY_SCALAR
  const DD dd;
  const hn::Rebind<float, DD> df;
  const hn::Rebind<int32_t, DD> di;
  const hn::Rebind<int8_t, DD> d8;
  const auto scale = hn::Set(dd, inverse), half = hn::Set(dd, 0.5),
             one = hn::Set(dd, 1.0), limit = hn::Set(dd, 127.0);
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(dd));
  for (; i + lanes <= n; i += lanes) {
    const auto y = hn::Mul(hn::PromoteTo(dd, hn::LoadU(df, x + i)), scale);
    const auto cut = hn::Trunc(y);
    const auto away = hn::Ge(hn::Abs(hn::Sub(y, cut)), half);
    const auto code =
        hn::IfThenElse(away, hn::Add(cut, hn::CopySignToAbs(one, y)), cut);
    const auto clamped = hn::Min(hn::Max(code, hn::Neg(limit)), limit);
    hn::StoreU(hn::DemoteTo(d8, hn::DemoteTo(di, clamped)), d8, codes + i);
  }
#endif
  for (; i < n; ++i) codes[i] = row_ops_internal::Int8Code(x[i], inverse);
  return max_abs / 127.0f;
}

// The element type of a cached row.
template <RowType kType>
using CachedElement = std::conditional_t<
    kType == RowType::kFloat32, float,
    std::conditional_t<kType == RowType::kBFloat16, uint16_t, int8_t>>;

// Lanes() elements of cached row data at p, as float32 (kInt8 unscaled).
template <RowType kType>
V LoadWhole(const CachedElement<kType>* p) {
  const D d;
  if constexpr (kType == RowType::kFloat32) {
    return hn::LoadU(d, p);
  } else if constexpr (kType == RowType::kBFloat16) {
    const hn::RebindToUnsigned<D> du;
    const auto wide =
        hn::PromoteTo(du, hn::LoadU(hn::Rebind<uint16_t, D>(), p));
    return hn::BitCast(d, hn::ShiftLeft<16>(wide));
  } else {
    const hn::RebindToSigned<D> di;
    return hn::ConvertTo(
        d, hn::PromoteTo(di, hn::LoadU(hn::Rebind<int8_t, D>(), p)));
  }
}

// Lanes() elements of a cached row from `offset` on, as float32 (kInt8
// unscaled); `count` < Lanes() reads only that many (the rest 0).
template <RowType kType>
V LoadCached(const void* data, int64_t offset, int64_t count) {
  using T = CachedElement<kType>;
  const T* p = static_cast<const T*>(data) + offset;
  HWY_ALIGN T buffer[kMaxBytes / sizeof(float)];
  if (count < Lanes()) {
    std::memset(buffer, 0, sizeof(buffer));
    std::memcpy(buffer, p, static_cast<size_t>(count) * sizeof(T));
    p = buffer;
  }
  return LoadWhole<kType>(p);
}

// Prefetches `bytes` of a row (lines of 64 bytes).
void PrefetchRow(const char* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) hwy::Prefetch(row + b);
}

// kKeys keys at a time against each query row: their accumulators are
// independent chains, and the query's vectors are read once for all.
#if !HWY_HAVE_SCALABLE
template <RowType kType, int kKeys>
void DotKeys(const float* q, int64_t rows, int64_t dim, const CachedRows& keys,
             int64_t j, float* out, int64_t ld) {
  const D d;
  const int64_t lanes = Lanes();
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = q + r * dim;
    V acc[kKeys];
    for (int k = 0; k < kKeys; ++k) acc[k] = hn::Zero(d);
    for (int64_t c = 0; c < dim; c += lanes) {
      const int64_t count = std::min(lanes, dim - c);
      const V qv =
          count == lanes ? hn::LoadU(d, qr + c) : LoadTail(qr + c, count, 0);
      for (int k = 0; k < kKeys; ++k) {
        acc[k] = hn::MulAdd(
            qv, LoadCached<kType>(keys.data, (j + k) * keys.stride + c, count),
            acc[k]);
      }
    }
    for (int k = 0; k < kKeys; ++k) {
      float sum = SumOfLanes(acc[k]);
      if constexpr (kType == RowType::kInt8) sum *= keys.scales[j + k];
      out[r * ld + j + k] = sum;
    }
  }
}

#else   // Sizeless vectors (SVE) form no arrays: one accumulator at a time.
template <RowType kType, int kKeys>
void DotKeys(const float* q, int64_t rows, int64_t dim, const CachedRows& keys,
             int64_t j, float* out, int64_t ld) {
  const D d;
  const int64_t lanes = Lanes();
  for (int64_t r = 0; r < rows; ++r) {
    for (int k = 0; k < kKeys; ++k) {
      V acc = hn::Zero(d);
      for (int64_t c = 0; c < dim; c += lanes) {
        const int64_t count = std::min(lanes, dim - c);
        const float* qc = q + r * dim + c;
        acc = hn::MulAdd(
            count == lanes ? hn::LoadU(d, qc) : LoadTail(qc, count, 0),
            LoadCached<kType>(keys.data, (j + k) * keys.stride + c, count),
            acc);
      }
      float sum = SumOfLanes(acc);
      if constexpr (kType == RowType::kInt8) sum *= keys.scales[j + k];
      out[r * ld + j + k] = sum;
    }
  }
}
#endif  // !HWY_HAVE_SCALABLE

#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
// Targets of fixed-width vectors take the lane sums of a group of
// accumulators together (StoreGroupSums): eight keys a group where a vector
// holds one or two 128-bit blocks of 32-bit lanes, sixteen where it holds
// four (AVX-512).
constexpr bool kKeyGroups =
    hn::MaxLanes(D()) == 4 || hn::MaxLanes(D()) == 8 || hn::MaxLanes(D()) == 16;
constexpr int kGroupKeys = hn::MaxLanes(D()) == 16 ? 16 : 8;
// Float32 and bfloat16 keys take groups only below sixteen lanes: on
// AVX-512, sixteen float chains were slower than four keys a call (the
// tree's shuffles cost more than they save where a key is a few vectors).
constexpr bool kFloatKeyGroups = kKeyGroups && hn::MaxLanes(D()) < 16;

// Per 128-bit block, the lane sums of a, b, c and e in its lanes 0..3,
// each (l0 + l2) + (l1 + l3): the same tree for every argument.
template <class DL, class VL = hn::Vec<DL>>
VL BlockSumsOfFour(DL d, VL a, VL b, VL c, VL e) {
  const hn::Repartition<uint64_t, DL> d64;
  const VL ab =
      hn::Add(hn::InterleaveLower(d, a, b), hn::InterleaveUpper(d, a, b));
  const VL ce =
      hn::Add(hn::InterleaveLower(d, c, e), hn::InterleaveUpper(d, c, e));
  const auto ab64 = hn::BitCast(d64, ab), ce64 = hn::BitCast(d64, ce);
  return hn::Add(hn::BitCast(d, hn::InterleaveLower(d64, ab64, ce64)),
                 hn::BitCast(d, hn::InterleaveUpper(d64, ab64, ce64)));
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// [a's blocks 0 and 2, b's blocks 0 and 2] plus [a's 1 and 3, b's 1 and 3]:
// Highway 1.0.3 has no portable shuffle of whole blocks.
template <class DL, class VL = hn::Vec<DL>>
VL AddBlockPairs(DL d, VL a, VL b) {
  const hn::Repartition<float, DL> df;
  const __m512 fa = hn::BitCast(df, a).raw, fb = hn::BitCast(df, b).raw;
  const hn::Vec<decltype(df)> even{
      _mm512_shuffle_f32x4(fa, fb, _MM_SHUFFLE(2, 0, 2, 0))};
  const hn::Vec<decltype(df)> odd{
      _mm512_shuffle_f32x4(fa, fb, _MM_SHUFFLE(3, 1, 3, 1))};
  return hn::Add(hn::BitCast(d, even), hn::BitCast(d, odd));
}
#endif

// Stores the lane sums of acc[0..kGroupKeys) at out[0..kGroupKeys), for
// 32-bit lanes. A key's sum takes the same tree in every slot (pairs within
// a block, then the blocks), so its bits do not depend on the keys beside
// it. One tree for eight keys costs about a third of eight SumOfLanes.
template <class DL>
HWY_INLINE void StoreGroupSums(DL d, const hn::Vec<DL> (&acc)[kGroupKeys],
                               hn::TFromD<DL>* out) {
  const auto x = BlockSumsOfFour(d, acc[0], acc[1], acc[2], acc[3]);
  const auto y = BlockSumsOfFour(d, acc[4], acc[5], acc[6], acc[7]);
  if constexpr (hn::MaxLanes(DL()) == 4) {
    hn::StoreU(x, d, out);
    hn::StoreU(y, d, out + 4);
  } else if constexpr (hn::MaxLanes(DL()) == 8) {
    hn::StoreU(
        hn::Add(hn::ConcatLowerLower(d, y, x), hn::ConcatUpperUpper(d, y, x)),
        d, out);
  } else {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
    // Four blocks: blocks 0 + 2 and 1 + 3 of each, then the two pairs.
    const auto z = BlockSumsOfFour(d, acc[8], acc[9], acc[10], acc[11]);
    const auto w = BlockSumsOfFour(d, acc[12], acc[13], acc[14], acc[15]);
    const auto xy =
        hn::Add(hn::ConcatLowerLower(d, y, x), hn::ConcatUpperUpper(d, y, x));
    const auto zw =
        hn::Add(hn::ConcatLowerLower(d, w, z), hn::ConcatUpperUpper(d, w, z));
    hn::StoreU(AddBlockPairs(d, xy, zw), d, out);
#endif
  }
}

// The rows of keys j..j+kGroupKeys-1 (those past `last` repeat it: their sums
// are dropped) into row[]; returns how many are real.
template <typename T>
int64_t GroupRows(const void* data, int64_t stride, int64_t j, int64_t last,
                  const T* (&row)[kGroupKeys]) {
  for (int k = 0; k < kGroupKeys; ++k) {
    row[k] = static_cast<const T*>(data) + std::min(j + k, last) * stride;
  }
  return std::min<int64_t>(kGroupKeys, last + 1 - j);
}

// Calls group(j) for j = 0, kGroupKeys, 2 kGroupKeys... below cols, each
// after prefetching the group's rows `ahead` of it (rows of `row_bytes`,
// `stride_bytes` apart from `base`).
template <class F>
void ForEachKeyGroup(const char* base, int64_t stride_bytes, int64_t row_bytes,
                     int64_t ahead, int64_t cols, F&& group) {
  for (int64_t j = 0; j < cols; j += kGroupKeys) {
    for (int k = 0; k < kGroupKeys; ++k) {
      PrefetchRow(base + (j + k + ahead) * stride_bytes, row_bytes);
    }
    group(j);
  }
}

// A group of keys from j against each query row, for head dims of whole
// vectors: kGroupKeys independent chains, each query vector read once for all,
// no tail branch in the loop (the compiler keeps every accumulator in a
// register). Keys past `last` repeat it; their sums are dropped.
template <RowType kType>
void DotKeyGroup(const float* q, int64_t rows, int64_t dim,
                 const CachedRows& keys, int64_t j, int64_t last, float* out,
                 int64_t ld) {
  const D d;
  const int64_t lanes = Lanes();
  const CachedElement<kType>* row[kGroupKeys];
  const int64_t n = GroupRows(keys.data, keys.stride, j, last, row);
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = q + r * dim;
    V acc[kGroupKeys];
    for (V& a : acc) a = hn::Zero(d);
    for (int64_t c = 0; c < dim; c += lanes) {
      const V qv = hn::LoadU(d, qr + c);
      for (int k = 0; k < kGroupKeys; ++k) {
        acc[k] = hn::MulAdd(qv, LoadWhole<kType>(row[k] + c), acc[k]);
      }
    }
    HWY_ALIGN float sums[kGroupKeys];
    StoreGroupSums(d, acc, sums);
    for (int64_t k = 0; k < n; ++k) {
      float sum = sums[k];
      if constexpr (kType == RowType::kInt8) sum *= keys.scales[j + k];
      out[r * ld + j + k] = sum;
    }
  }
}
#else
constexpr bool kKeyGroups = false;
#endif  // !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR

template <RowType kType>
void DotRowsOf(const float* q, int64_t rows, int64_t dim,
               const CachedRows& keys, int64_t cols, float* out, int64_t ld) {
  const int64_t elem = CachedElementBytes(kType);
  const int64_t row_bytes = dim * elem;
  const int64_t ahead =
      std::max<int64_t>(1, kPrefetchBytes / std::max<int64_t>(row_bytes, 1));
  const char* base = static_cast<const char*>(keys.data);
  const int64_t stride_bytes = keys.stride * elem;
  for (int64_t j = 0; j < std::min(cols, ahead); ++j) {
    PrefetchRow(base + j * stride_bytes, row_bytes);
  }
#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
  if constexpr (kFloatKeyGroups) {
    if (dim % Lanes() == 0) {
      ForEachKeyGroup(
          base, stride_bytes, row_bytes, ahead, cols, [&](int64_t j) {
            if constexpr (kType == RowType::kInt8) {
              hwy::Prefetch(keys.scales + j + ahead);
            }
            DotKeyGroup<kType>(q, rows, dim, keys, j, cols - 1, out, ld);
          });
      return;
    }
  }
#endif
  constexpr int kKeys = 4;
  int64_t j = 0;
  for (; j + kKeys <= cols; j += kKeys) {
    for (int k = 0; k < kKeys; ++k) {
      PrefetchRow(base + (j + k + ahead) * stride_bytes, row_bytes);
    }
    if constexpr (kType == RowType::kInt8)
      hwy::Prefetch(keys.scales + j + ahead);
    DotKeys<kType, kKeys>(q, rows, dim, keys, j, out, ld);
  }
  for (; j < cols; ++j) DotKeys<kType, 1>(q, rows, dim, keys, j, out, ld);
}

// Bfloat16 keys, two elements a 32-bit load: the even element is its low
// half shifted up, the odd one its high half masked, which costs two
// instructions for two vectors where widening costs four. The query rows
// are split to match (`split`: per 2 * Lanes() elements, the even ones
// then the odd ones); each key sums its even and odd products apart.
#if !HWY_HAVE_SCALABLE
template <int kKeys>
void PairedDotKeys(const float* split, int64_t rows, int64_t dim,
                   const CachedRows& keys, int64_t j, float* out, int64_t ld) {
  const D d;
  const hn::RebindToUnsigned<D> du;
  const auto high = hn::Set(du, 0xffff0000u);
  const int64_t lanes = Lanes();
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = split + r * dim;
    V even[kKeys], odd[kKeys];
    for (int k = 0; k < kKeys; ++k) even[k] = odd[k] = hn::Zero(d);
    for (int64_t c = 0; c < dim; c += 2 * lanes) {
      const V qe = hn::LoadU(d, qr + c);
      const V qo = hn::LoadU(d, qr + c + lanes);
      for (int k = 0; k < kKeys; ++k) {
        const auto pairs =
            hn::LoadU(du, reinterpret_cast<const uint32_t*>(
                              static_cast<const uint16_t*>(keys.data) +
                              (j + k) * keys.stride + c));
        even[k] =
            hn::MulAdd(qe, hn::BitCast(d, hn::ShiftLeft<16>(pairs)), even[k]);
        odd[k] = hn::MulAdd(qo, hn::BitCast(d, hn::And(pairs, high)), odd[k]);
      }
    }
    for (int k = 0; k < kKeys; ++k) {
      out[r * ld + j + k] = SumOfLanes(hn::Add(even[k], odd[k]));
    }
  }
}

#else   // Sizeless vectors (SVE) form no arrays: one accumulator at a time.
template <int kKeys>
void PairedDotKeys(const float* split, int64_t rows, int64_t dim,
                   const CachedRows& keys, int64_t j, float* out, int64_t ld) {
  const D d;
  const hn::RebindToUnsigned<D> du;
  const auto high = hn::Set(du, 0xffff0000u);
  const int64_t lanes = Lanes();
  for (int64_t r = 0; r < rows; ++r) {
    for (int k = 0; k < kKeys; ++k) {
      V even = hn::Zero(d), odd = hn::Zero(d);
      for (int64_t c = 0; c < dim; c += 2 * lanes) {
        const auto pairs =
            hn::LoadU(du, reinterpret_cast<const uint32_t*>(
                              static_cast<const uint16_t*>(keys.data) +
                              (j + k) * keys.stride + c));
        even = hn::MulAdd(hn::LoadU(d, split + r * dim + c),
                          hn::BitCast(d, hn::ShiftLeft<16>(pairs)), even);
        odd = hn::MulAdd(hn::LoadU(d, split + r * dim + c + lanes),
                         hn::BitCast(d, hn::And(pairs, high)), odd);
      }
      out[r * ld + j + k] = SumOfLanes(hn::Add(even, odd));
    }
  }
}
#endif  // !HWY_HAVE_SCALABLE

#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
// PairedDotKeys for a group of keys from j (see DotKeyGroup): each key's
// even and odd products share one accumulator, so that the group fits the
// registers.
void PairedDotKeyGroup(const float* split, int64_t rows, int64_t dim,
                       const CachedRows& keys, int64_t j, int64_t last,
                       float* out, int64_t ld) {
  const D d;
  const hn::RebindToUnsigned<D> du;
  const auto high = hn::Set(du, 0xffff0000u);
  const int64_t lanes = Lanes();
  const uint16_t* row[kGroupKeys];
  const int64_t n = GroupRows(keys.data, keys.stride, j, last, row);
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = split + r * dim;
    V acc[kGroupKeys];
    for (V& a : acc) a = hn::Zero(d);
    for (int64_t c = 0; c < dim; c += 2 * lanes) {
      const V qe = hn::LoadU(d, qr + c);
      const V qo = hn::LoadU(d, qr + c + lanes);
      for (int k = 0; k < kGroupKeys; ++k) {
        const auto pairs =
            hn::LoadU(du, reinterpret_cast<const uint32_t*>(row[k] + c));
        acc[k] =
            hn::MulAdd(qe, hn::BitCast(d, hn::ShiftLeft<16>(pairs)), acc[k]);
        acc[k] = hn::MulAdd(qo, hn::BitCast(d, hn::And(pairs, high)), acc[k]);
      }
    }
    HWY_ALIGN float sums[kGroupKeys];
    StoreGroupSums(d, acc, sums);
    for (int64_t k = 0; k < n; ++k) out[r * ld + j + k] = sums[k];
  }
}
#endif  // !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR

// Whether bfloat16 rows of `dim` take the paired path: whole pairs of
// vectors.
bool PairsFit(int64_t dim) { return dim > 0 && dim % (2 * Lanes()) == 0; }

void PairedDotRows(const float* q, int64_t rows, int64_t dim,
                   const CachedRows& keys, int64_t cols, float* out,
                   int64_t ld) {
  // Reused by the thread's next call: no allocation per block of keys.
  thread_local std::vector<float> split;
  split.resize(static_cast<size_t>(rows * dim));
  const int64_t lanes = Lanes();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < dim; c += 2 * lanes) {
      for (int64_t i = 0; i < lanes; ++i) {
        split[r * dim + c + i] = q[r * dim + c + 2 * i];
        split[r * dim + c + lanes + i] = q[r * dim + c + 2 * i + 1];
      }
    }
  }
  const int64_t row_bytes = dim * 2;
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / row_bytes);
  const char* base = static_cast<const char*>(keys.data);
  const int64_t stride_bytes = keys.stride * 2;
  for (int64_t j = 0; j < std::min(cols, ahead); ++j) {
    PrefetchRow(base + j * stride_bytes, row_bytes);
  }
#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
  if constexpr (kFloatKeyGroups) {
    ForEachKeyGroup(base, stride_bytes, row_bytes, ahead, cols, [&](int64_t j) {
      PairedDotKeyGroup(split.data(), rows, dim, keys, j, cols - 1, out, ld);
    });
    return;
  }
#endif
  int64_t j = 0;
  for (; j + 4 <= cols; j += 4) {
    for (int k = 0; k < 4; ++k) {
      PrefetchRow(base + (j + k + ahead) * stride_bytes, row_bytes);
    }
    PairedDotKeys<4>(split.data(), rows, dim, keys, j, out, ld);
  }
  for (; j < cols; ++j)
    PairedDotKeys<1>(split.data(), rows, dim, keys, j, out, ld);
}

// The int8 keys' integer path: `codes` holds the query rows rounded to
// int16 (`padded` apart, zero beyond dim), and each key's int8 codes
// widened to int16 meet them in a widening multiply-add (pmaddwd on x86,
// smlal on NEON): a key's dot product is exact in int32.
using D16 = hn::ScalableTag<int16_t>;
using D32 = hn::Repartition<int32_t, D16>;

// Int16 lanes of int8 row data at p, widened; `count` < the lanes reads only
// that many (the rest 0).
template <bool kWhole>
hn::Vec<D16> LoadWidened(const int8_t* p, int64_t count) {
  const D16 d16;
  const hn::Rebind<int8_t, D16> d8;
  if constexpr (kWhole) {
    return hn::PromoteTo(d16, hn::LoadU(d8, p));
  } else {
    if (count >= static_cast<int64_t>(hn::Lanes(d16))) {
      return hn::PromoteTo(d16, hn::LoadU(d8, p));
    }
    HWY_ALIGN int8_t buffer[kMaxBytes / sizeof(int16_t)] = {};
    std::memcpy(buffer, p, static_cast<size_t>(std::max<int64_t>(count, 0)));
    return hn::PromoteTo(d16, hn::Load(d8, buffer));
  }
}

#if !HWY_HAVE_SCALABLE
template <int kKeys>
void IntegerDotKeys(const int16_t* codes, int64_t padded, const float* scales,
                    int64_t rows, int64_t dim, const CachedRows& keys,
                    int64_t j, float* out, int64_t ld) {
  const D16 d16;
  const D32 d32;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d16));
  for (int64_t r = 0; r < rows; ++r) {
    hn::Vec<D32> sum0[kKeys], sum1[kKeys];
    for (int k = 0; k < kKeys; ++k) sum0[k] = sum1[k] = hn::Zero(d32);
    for (int64_t c = 0; c < dim; c += lanes) {
      const auto qv = hn::LoadU(d16, codes + r * padded + c);
      const int64_t count = std::min(lanes, dim - c);
      for (int k = 0; k < kKeys; ++k) {
        const int8_t* p =
            static_cast<const int8_t*>(keys.data) + (j + k) * keys.stride + c;
        const auto kv = LoadWidened</*kWhole=*/false>(p, count);
        sum0[k] = hn::ReorderWidenMulAccumulate(d32, qv, kv, sum0[k], sum1[k]);
      }
    }
    for (int k = 0; k < kKeys; ++k) {
      const int32_t dot =
          hn::GetLane(hn::SumOfLanes(d32, hn::Add(sum0[k], sum1[k])));
      out[r * ld + j + k] =
          static_cast<float>(dot) * (scales[r] * keys.scales[j + k]);
    }
  }
}

#else   // Sizeless vectors (SVE) form no arrays: one accumulator at a time.
template <int kKeys>
void IntegerDotKeys(const int16_t* codes, int64_t padded, const float* scales,
                    int64_t rows, int64_t dim, const CachedRows& keys,
                    int64_t j, float* out, int64_t ld) {
  const D16 d16;
  const D32 d32;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d16));
  for (int64_t r = 0; r < rows; ++r) {
    for (int k = 0; k < kKeys; ++k) {
      auto sum0 = hn::Zero(d32), sum1 = hn::Zero(d32);
      for (int64_t c = 0; c < dim; c += lanes) {
        const int64_t count = std::min(lanes, dim - c);
        const int8_t* p =
            static_cast<const int8_t*>(keys.data) + (j + k) * keys.stride + c;
        sum0 = hn::ReorderWidenMulAccumulate(
            d32, hn::LoadU(d16, codes + r * padded + c),
            LoadWidened</*kWhole=*/false>(p, count), sum0, sum1);
      }
      const int32_t dot = hn::GetLane(hn::SumOfLanes(d32, hn::Add(sum0, sum1)));
      out[r * ld + j + k] =
          static_cast<float>(dot) * (scales[r] * keys.scales[j + k]);
    }
  }
}
#endif  // !HWY_HAVE_SCALABLE

#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
// IntegerDotKeys for a group of keys from j (see DotKeyGroup), for head dims of
// whole int16 vectors. kDim > 0: dim and the rows' stride are kDim, and the
// group is whole, so that every row's address is a constant offset from the
// first (the sixteen row pointers of the general case were kept on the
// stack and reloaded: a third of the instructions at d64).
template <int kDim>
void IntegerDotKeyGroup(const int16_t* codes, int64_t padded,
                        const float* scales, int64_t rows, int64_t dim,
                        const CachedRows& keys, int64_t j, int64_t last,
                        float* out, int64_t ld) {
  const D16 d16;
  const D32 d32;
  const hn::Rebind<int8_t, D16> d8;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d16));
  const int8_t* row[kGroupKeys];
  int64_t n = kGroupKeys;
  if constexpr (kDim == 0) {
    n = GroupRows(keys.data, keys.stride, j, last, row);
  } else {
    dim = kDim;
  }
  const int8_t* first = static_cast<const int8_t*>(keys.data) + j * kDim;
  for (int64_t r = 0; r < rows; ++r) {
    hn::Vec<D32> sum0[kGroupKeys], sum1[kGroupKeys];
    for (int k = 0; k < kGroupKeys; ++k) sum0[k] = sum1[k] = hn::Zero(d32);
    for (int64_t c = 0; c < dim; c += lanes) {
      const auto qv = hn::LoadU(d16, codes + r * padded + c);
      for (int k = 0; k < kGroupKeys; ++k) {
        const int8_t* key = kDim == 0 ? row[k] : first + k * kDim;
        const auto kv = hn::PromoteTo(d16, hn::LoadU(d8, key + c));
        sum0[k] = hn::ReorderWidenMulAccumulate(d32, qv, kv, sum0[k], sum1[k]);
      }
    }
    for (int k = 0; k < kGroupKeys; ++k) sum0[k] = hn::Add(sum0[k], sum1[k]);
    HWY_ALIGN int32_t dots[kGroupKeys];
    StoreGroupSums(d32, sum0, dots);
    if (n == kGroupKeys) {
      // The scalar loop's operations, a vector at a time.
      const D d;
      for (int64_t k = 0; k < n; k += Lanes()) {
        const V scale =
            hn::Mul(hn::Set(d, scales[r]), hn::LoadU(d, keys.scales + j + k));
        hn::StoreU(hn::Mul(hn::ConvertTo(d, hn::Load(d32, dots + k)), scale), d,
                   out + r * ld + j + k);
      }
      continue;
    }
    for (int64_t k = 0; k < n; ++k) {
      out[r * ld + j + k] =
          static_cast<float>(dots[k]) * (scales[r] * keys.scales[j + k]);
    }
  }
}

// The groups of keys from 0 to `cols`, prefetching `ahead` rows on.
template <int kDim>
void IntegerDotKeyGroups(const int16_t* codes, int64_t padded,
                         const float* scales, int64_t rows, int64_t dim,
                         const CachedRows& keys, int64_t cols, int64_t ahead,
                         float* out, int64_t ld) {
  const char* base = static_cast<const char*>(keys.data);
  ForEachKeyGroup(base, keys.stride, dim, ahead, cols, [&](int64_t j) {
    hwy::Prefetch(keys.scales + j + ahead);
    if (kDim > 0 && j + kGroupKeys <= cols) {
      IntegerDotKeyGroup<kDim>(codes, padded, scales, rows, dim, keys, j,
                               cols - 1, out, ld);
    } else {
      IntegerDotKeyGroup<0>(codes, padded, scales, rows, dim, keys, j, cols - 1,
                            out, ld);
    }
  });
}
#endif  // !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR

// Int8 keys: rows in groups of up to 16 take the integer path; a row that
// is not all finite takes the float path alone.
void IntegerDotRows(const float* q, int64_t rows, int64_t dim,
                    const CachedRows& keys, int64_t cols, float* out,
                    int64_t ld) {
  constexpr int64_t kGroup = 16;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(D16()));
  const int64_t padded = (dim + lanes - 1) / lanes * lanes;
  HWY_ALIGN int16_t codes[kGroup * (kIntegerDotMaxDim + 128)];
  float scales[kGroup];
  const char* base = static_cast<const char*>(keys.data);
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / dim);
  for (int64_t r0 = 0; r0 < rows; r0 += kGroup) {
    const int64_t n = std::min(kGroup, rows - r0);
    bool finite = true;
    for (int64_t r = 0; r < n && finite; ++r) {
      finite = QuantizeQueryInt16(q + (r0 + r) * dim, dim, padded,
                                  codes + r * padded, scales + r);
    }
    if (!finite) {
      DotRowsOf<RowType::kInt8>(q + r0 * dim, n, dim, keys, cols, out + r0 * ld,
                                ld);
      continue;
    }
    for (int64_t j = 0; j < std::min(cols, ahead); ++j) {
      PrefetchRow(base + j * keys.stride, dim);
    }
#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
    if (kKeyGroups && dim % lanes == 0) {
      // The common head dims, rows side by side, take the fixed layout.
      const int64_t fixed = keys.stride == dim ? dim : 0;
      if (fixed == 64) {
        IntegerDotKeyGroups<64>(codes, padded, scales, n, dim, keys, cols,
                                ahead, out + r0 * ld, ld);
      } else if (fixed == 128) {
        IntegerDotKeyGroups<128>(codes, padded, scales, n, dim, keys, cols,
                                 ahead, out + r0 * ld, ld);
      } else {
        IntegerDotKeyGroups<0>(codes, padded, scales, n, dim, keys, cols, ahead,
                               out + r0 * ld, ld);
      }
      continue;
    }
#endif
    int64_t j = 0;
    for (; j + 4 <= cols; j += 4) {
      for (int k = 0; k < 4; ++k) {
        PrefetchRow(base + (j + k + ahead) * keys.stride, dim);
      }
      hwy::Prefetch(keys.scales + j + ahead);
      IntegerDotKeys<4>(codes, padded, scales, n, dim, keys, j, out + r0 * ld,
                        ld);
    }
    for (; j < cols; ++j) {
      IntegerDotKeys<1>(codes, padded, scales, n, dim, keys, j, out + r0 * ld,
                        ld);
    }
  }
}

void DotRows(const float* q, int64_t rows, int64_t dim, const CachedRows& keys,
             int64_t cols, float* out, int64_t ld) {
  switch (keys.type) {
    case RowType::kFloat32:
      return DotRowsOf<RowType::kFloat32>(q, rows, dim, keys, cols, out, ld);
    case RowType::kBFloat16:
      if (PairsFit(dim)) {
        return PairedDotRows(q, rows, dim, keys, cols, out, ld);
      }
      return DotRowsOf<RowType::kBFloat16>(q, rows, dim, keys, cols, out, ld);
    case RowType::kInt8:
      if (dim > 0 && dim <= kIntegerDotMaxDim) {
        return IntegerDotRows(q, rows, dim, keys, cols, out, ld);
      }
      return DotRowsOf<RowType::kInt8>(q, rows, dim, keys, cols, out, ld);
  }
}

#if !HWY_HAVE_SCALABLE
// kRows rows x kChunks vectors of acc (from column c0) in registers, over
// every value row: kChunks loads of a value row and kRows broadcasts feed
// kRows * kChunks multiply-adds. `count`: the columns left from c0 (the
// last vector may be partial). kWhole: every vector is whole, and the loop
// has no tail branch (with one, the compiler kept the accumulators on the
// stack: the tile ran at half the speed).
template <RowType kType, int kRows, int kChunks, bool kWhole = false>
void AddWeightedTile(const float* p, int64_t ld, const CachedRows& values,
                     int64_t cols, int64_t c0, int64_t dim, float* acc) {
  const D d;
  const int64_t lanes = Lanes();
  int64_t count[kChunks];
  for (int ch = 0; ch < kChunks; ++ch) {
    count[ch] =
        kWhole ? lanes : std::clamp<int64_t>(dim - c0 - ch * lanes, 0, lanes);
  }
  V a[kRows][kChunks];
  for (int r = 0; r < kRows; ++r) {
    for (int ch = 0; ch < kChunks; ++ch) {
      const float* at = acc + r * dim + c0 + ch * lanes;
      a[r][ch] =
          count[ch] == lanes ? hn::LoadU(d, at) : LoadTail(at, count[ch], 0.0f);
    }
  }
  const int64_t elem = CachedElementBytes(kType);
  const int64_t tile_bytes = std::min(dim - c0, kChunks * lanes) * elem;
  const int64_t ahead =
      std::max<int64_t>(1, kPrefetchBytes / std::max<int64_t>(dim * elem, 1));
  const char* base = static_cast<const char*>(values.data) + c0 * elem;
  const int64_t stride_bytes = values.stride * elem;
  for (int64_t j = 0; j < std::min(cols, ahead); ++j) {
    PrefetchRow(base + j * stride_bytes, tile_bytes);
  }
  const auto* data = static_cast<const CachedElement<kType>*>(values.data);
  for (int64_t j = 0; j < cols; ++j) {
    PrefetchRow(base + (j + ahead) * stride_bytes, tile_bytes);
    const auto load = [&](int ch) {
      const int64_t at = j * values.stride + c0 + ch * lanes;
      if constexpr (kWhole) {
        return LoadWhole<kType>(data + at);
      } else {
        return LoadCached<kType>(data, at, count[ch]);
      }
    };
    if constexpr (kRows == 1) {
      // Each vector goes into its multiply-add as it is converted: with
      // all eight converted first, an int8 tile needed 17 registers and
      // kept an accumulator on the stack (11 cycles a row, not 6).
      float w = p[j];
      if constexpr (kType == RowType::kInt8) w *= values.scales[j];
      const V wv = hn::Set(d, w);
      for (int ch = 0; ch < kChunks; ++ch) {
        a[0][ch] = hn::MulAdd(wv, load(ch), a[0][ch]);
      }
      continue;
    }
    V v[kChunks];
    for (int ch = 0; ch < kChunks; ++ch) v[ch] = load(ch);
    for (int r = 0; r < kRows; ++r) {
      float w = p[r * ld + j];
      if constexpr (kType == RowType::kInt8) w *= values.scales[j];
      const V wv = hn::Set(d, w);
      for (int ch = 0; ch < kChunks; ++ch) {
        a[r][ch] = hn::MulAdd(wv, v[ch], a[r][ch]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int ch = 0; ch < kChunks; ++ch) {
      float* at = acc + r * dim + c0 + ch * lanes;
      if (count[ch] == lanes) {
        hn::StoreU(a[r][ch], d, at);
      } else if (count[ch] > 0) {
        StoreTail(a[r][ch], at, count[ch]);
      }
    }
  }
}

#else   // Sizeless vectors (SVE) form no arrays: one accumulator at a time.
template <RowType kType, int kRows, int kChunks, bool kWhole = false>
void AddWeightedTile(const float* p, int64_t ld, const CachedRows& values,
                     int64_t cols, int64_t c0, int64_t dim, float* acc) {
  const D d;
  const int64_t lanes = Lanes();
  for (int r = 0; r < kRows; ++r) {
    for (int ch = 0; ch < kChunks; ++ch) {
      const int64_t c = c0 + ch * lanes;
      const int64_t count = std::clamp<int64_t>(dim - c, 0, lanes);
      if (count == 0) continue;
      float* at = acc + r * dim + c;
      V a = count == lanes ? hn::LoadU(d, at) : LoadTail(at, count, 0.0f);
      for (int64_t j = 0; j < cols; ++j) {
        float w = p[r * ld + j];
        if constexpr (kType == RowType::kInt8) w *= values.scales[j];
        a = hn::MulAdd(
            hn::Set(d, w),
            LoadCached<kType>(values.data, j * values.stride + c, count), a);
      }
      if (count == lanes) {
        hn::StoreU(a, d, at);
      } else {
        StoreTail(a, at, count);
      }
    }
  }
}
#endif  // !HWY_HAVE_SCALABLE

// A tile's columns: 64 floats where registers allow (a value row of a
// head dim up to 64 is read whole, front to back, for the prefetchers;
// narrower tiles read each row in parts, in passes over the block), in
// vectors of this target. Rows: as many as the registers hold with them
// (16 registers on x86 before AVX-512, 32 elsewhere).
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kTileChunks = 4;  // 4 x 16 lanes
constexpr int kTileRows = 4;
#elif HWY_ARCH_X86
constexpr int kTileChunks = 8;  // 8 x 8 lanes (AVX2), 8 x 4 (SSE4)
constexpr int kTileRows = 1;
#else
constexpr int kTileChunks = 8;  // 8 x 4 lanes (NEON, 128-bit SVE)
constexpr int kTileRows = 2;
#endif

#if !HWY_HAVE_SCALABLE
// AddWeightedTile for bfloat16 values in pairs (see PairedDotKeys): the
// even and odd columns of kPairs * 2 * Lanes() columns from c0 (all below
// dim) accumulate apart, deinterleaved on load and interleaved on store.
template <int kRows, int kPairs>
void PairedAddWeightedTile(const float* p, int64_t ld, const CachedRows& values,
                           int64_t cols, int64_t c0, int64_t dim, float* acc) {
  const D d;
  const hn::RebindToUnsigned<D> du;
  const auto high = hn::Set(du, 0xffff0000u);
  const int64_t lanes = Lanes();
  V even[kRows][kPairs], odd[kRows][kPairs];
  for (int r = 0; r < kRows; ++r) {
    for (int ch = 0; ch < kPairs; ++ch) {
      hn::LoadInterleaved2(d, acc + r * dim + c0 + ch * 2 * lanes, even[r][ch],
                           odd[r][ch]);
    }
  }
  const int64_t tile_bytes = kPairs * 2 * lanes * 2;
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / (dim * 2));
  const uint16_t* base = static_cast<const uint16_t*>(values.data) + c0;
  for (int64_t j = 0; j < std::min(cols, ahead); ++j) {
    PrefetchRow(reinterpret_cast<const char*>(base + j * values.stride),
                tile_bytes);
  }
  for (int64_t j = 0; j < cols; ++j) {
    PrefetchRow(
        reinterpret_cast<const char*>(base + (j + ahead) * values.stride),
        tile_bytes);
    V ve[kPairs], vo[kPairs];
    for (int ch = 0; ch < kPairs; ++ch) {
      const auto pairs =
          hn::LoadU(du, reinterpret_cast<const uint32_t*>(
                            base + j * values.stride + ch * 2 * lanes));
      ve[ch] = hn::BitCast(d, hn::ShiftLeft<16>(pairs));
      vo[ch] = hn::BitCast(d, hn::And(pairs, high));
    }
    for (int r = 0; r < kRows; ++r) {
      const V w = hn::Set(d, p[r * ld + j]);
      for (int ch = 0; ch < kPairs; ++ch) {
        even[r][ch] = hn::MulAdd(w, ve[ch], even[r][ch]);
        odd[r][ch] = hn::MulAdd(w, vo[ch], odd[r][ch]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int ch = 0; ch < kPairs; ++ch) {
      hn::StoreInterleaved2(even[r][ch], odd[r][ch], d,
                            acc + r * dim + c0 + ch * 2 * lanes);
    }
  }
}

#else   // Sizeless vectors (SVE) form no arrays: one accumulator at a time.
template <int kRows, int kPairs>
void PairedAddWeightedTile(const float* p, int64_t ld, const CachedRows& values,
                           int64_t cols, int64_t c0, int64_t dim, float* acc) {
  const D d;
  const hn::RebindToUnsigned<D> du;
  const auto high = hn::Set(du, 0xffff0000u);
  const int64_t lanes = Lanes();
  const uint16_t* base = static_cast<const uint16_t*>(values.data) + c0;
  for (int r = 0; r < kRows; ++r) {
    for (int ch = 0; ch < kPairs; ++ch) {
      float* at = acc + r * dim + c0 + ch * 2 * lanes;
      V even, odd;
      hn::LoadInterleaved2(d, at, even, odd);
      for (int64_t j = 0; j < cols; ++j) {
        const auto pairs =
            hn::LoadU(du, reinterpret_cast<const uint32_t*>(
                              base + j * values.stride + ch * 2 * lanes));
        const V w = hn::Set(d, p[r * ld + j]);
        even = hn::MulAdd(w, hn::BitCast(d, hn::ShiftLeft<16>(pairs)), even);
        odd = hn::MulAdd(w, hn::BitCast(d, hn::And(pairs, high)), odd);
      }
      hn::StoreInterleaved2(even, odd, d, at);
    }
  }
}
#endif  // !HWY_HAVE_SCALABLE

// Rows of the paired tile: what the registers hold with 2 * kTileChunks
// accumulators a row.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kPairedTileRows = 2;
#else
constexpr int kPairedTileRows = 1;
#endif

void PairedAddWeightedRows(const float* p, int64_t ld, int64_t rows,
                           const CachedRows& values, int64_t cols, int64_t dim,
                           float* acc) {
  constexpr int kPairs = kTileChunks / 2;
  const int64_t width = kPairs * 2 * Lanes();
  for (int64_t c0 = 0; c0 < dim; c0 += width) {
    for (int64_t r0 = 0; r0 < rows; r0 += kPairedTileRows) {
      const float* pr = p + r0 * ld;
      float* ar = acc + r0 * dim;
      const bool whole = dim - c0 >= width;
      if (whole && rows - r0 >= kPairedTileRows) {
        PairedAddWeightedTile<kPairedTileRows, kPairs>(pr, ld, values, cols, c0,
                                                       dim, ar);
        continue;
      }
      for (int64_t r = r0; r < std::min(rows, r0 + kPairedTileRows); ++r) {
        if (whole) {
          PairedAddWeightedTile<1, kPairs>(p + r * ld, ld, values, cols, c0,
                                           dim, acc + r * dim);
        } else {
          AddWeightedTile<RowType::kBFloat16, 1, kTileChunks>(
              p + r * ld, ld, values, cols, c0, dim, acc + r * dim);
        }
      }
    }
  }
}

// The tiles of columns c0.. of every row.
template <RowType kType, bool kWhole>
void AddWeightedTiles(const float* p, int64_t ld, int64_t rows,
                      const CachedRows& values, int64_t cols, int64_t c0,
                      int64_t dim, float* acc) {
  int64_t r0 = 0;
  for (; r0 + kTileRows <= rows; r0 += kTileRows) {
    AddWeightedTile<kType, kTileRows, kTileChunks, kWhole>(
        p + r0 * ld, ld, values, cols, c0, dim, acc + r0 * dim);
  }
  for (; r0 < rows; ++r0) {
    AddWeightedTile<kType, 1, kTileChunks, kWhole>(
        p + r0 * ld, ld, values, cols, c0, dim, acc + r0 * dim);
  }
}

template <RowType kType>
void AddWeightedRowsOf(const float* p, int64_t ld, int64_t rows,
                       const CachedRows& values, int64_t cols, int64_t dim,
                       float* acc) {
  const int64_t width = kTileChunks * Lanes();
  for (int64_t c0 = 0; c0 < dim; c0 += width) {
    if (dim - c0 >= width) {
      AddWeightedTiles<kType, true>(p, ld, rows, values, cols, c0, dim, acc);
    } else {
      AddWeightedTiles<kType, false>(p, ld, rows, values, cols, c0, dim, acc);
    }
  }
}

#if HWY_TARGET != HWY_SCALAR
// The int8 values' integer path. Each row's weights over a block of up to
// kIntegerBlockRows value rows (the probability times the value row's
// scale) are rounded to int16 codes of step max |w| / 32767, and each pair
// of value rows, widened to int16 and interleaved, meets its pair of codes
// in a widening multiply-add (pmaddwd on x86, smlal on NEON): a column's sum
// over the block is exact in int32 (512 * 32767 * 127 < 2^31) and scaled
// back once. Per value row and vector of columns that is a widening load,
// half an interleave and half a multiply-add, where the float path
// converts twice and multiplies once: on a Zen 5, 512 rows of d64 took
// 0.43 us against 0.57 (AVX-512), 0.76 against 0.97 (AVX2).
constexpr int64_t kIntegerBlockRows = 512;

// Rounds w_j = p[j] * scales[j] (j < n <= kIntegerBlockRows) to int16 codes
// into codes[0..n), zero up to the next whole vector, and sets *unit to the
// codes' step (max |w| / 32767). False where the float path takes the
// block: a weight that is not finite, or every weight below 1e-30 in
// magnitude (a step that would not be a normal float).
bool QuantizeWeights(const float* p, const float* scales, int64_t n,
                     int16_t* codes, float* unit) {
  const D d;
  const hn::Rebind<int16_t, D> d16;
  const int64_t lanes = Lanes();
  const auto weight = [&](int64_t i) {
    const int64_t count = std::min(lanes, n - i);
    return count == lanes
               ? hn::Mul(hn::LoadU(d, p + i), hn::LoadU(d, scales + i))
               : hn::Mul(LoadTail(p + i, count, 0.0f),
                         LoadTail(scales + i, count, 0.0f));
  };
  V max_abs = hn::Zero(d), poison = hn::Zero(d);
  for (int64_t i = 0; i < n; i += lanes) {
    const V w = weight(i);
    // NaN from here on once a weight is infinite or NaN.
    poison = hn::Add(poison, hn::Mul(w, hn::Zero(d)));
    max_abs = hn::Max(max_abs, hn::Abs(w));
  }
  if (!hn::AllTrue(d, hn::Eq(poison, poison))) return false;
  const float largest = MaxOfLanes(max_abs);
  if (!(largest >= 1e-30f)) return false;
  const V inverse = hn::Set(d, 32767.0f / largest);
  for (int64_t i = 0; i < n; i += lanes) {
    // |w| * 32767 / max |w| rounds to at most 32767: no clamp needed.
    hn::StoreU(hn::DemoteTo(d16, hn::NearestInt(hn::Mul(weight(i), inverse))),
               d16, codes + i);
  }
  *unit = largest / 32767.0f;
  return true;
}

// Adds a finished chunk's sums to acc: `lower` and `upper` hold the sums of
// the lower and upper four int16 lanes of each 128-bit block of the chunk
// (InterleaveLower/Upper pair them there), so lane i stands for column
// 8 * (i / 4) + i % 4 of the chunk (+ 4 for `upper`). Columns from `count`
// on are not real.
void AddChunkSums(hn::Vec<D32> lower, hn::Vec<D32> upper, float unit,
                  int64_t count, float* acc) {
  const D d;
  HWY_ALIGN float sums[2][kMaxBytes / sizeof(float)];
  hn::Store(hn::Mul(hn::ConvertTo(d, lower), hn::Set(d, unit)), d, sums[0]);
  hn::Store(hn::Mul(hn::ConvertTo(d, upper), hn::Set(d, unit)), d, sums[1]);
  for (int64_t i = 0; i < Lanes(); ++i) {
    const int64_t column = 8 * (i / 4) + i % 4;
    if (column < count) acc[column] += sums[0][i];
    if (column + 4 < count) acc[column + 4] += sums[1][i];
  }
}

// The int16 code pairs (rows t and t + 1) of a weight row, as one int32
// lane's bits.
hn::Vec<D16> CodePair(const int16_t* codes, int64_t t) {
  int32_t pair;
  std::memcpy(&pair, codes + t, sizeof(pair));
  return hn::BitCast(D16(), hn::Set(D32(), pair));
}

#if !HWY_HAVE_SCALABLE
// kRows weight rows (codes `ldc` apart) x kChunks int16 vectors of columns
// from c0, over the n value rows from `rows` (`stride` apart), in pairs.
template <int kRows, int kChunks, bool kWhole>
void IntegerAddWeightedTile(const int16_t* codes, int64_t ldc,
                            const float* units, const int8_t* rows,
                            int64_t stride, int64_t n, int64_t c0, int64_t dim,
                            float* acc) {
  const D16 d16;
  const D32 d32;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d16));
  int64_t count[kChunks];
  for (int ch = 0; ch < kChunks; ++ch) count[ch] = dim - c0 - ch * lanes;
  hn::Vec<D32> lower[kRows][kChunks], lower1[kRows][kChunks];
  hn::Vec<D32> upper[kRows][kChunks], upper1[kRows][kChunks];
  for (int r = 0; r < kRows; ++r) {
    for (int ch = 0; ch < kChunks; ++ch) {
      lower[r][ch] = lower1[r][ch] = upper[r][ch] = upper1[r][ch] =
          hn::Zero(d32);
    }
  }
  const int64_t tile_bytes = std::min(dim - c0, kChunks * lanes);
  const int64_t ahead = std::max<int64_t>(2, kPrefetchBytes / dim);
  const int8_t* base = rows + c0;
  for (int64_t t = 0; t < n; t += 2) {
    const int8_t* a = base + t * stride;
    // An odd last row pairs with itself; its partner's code is 0.
    const int8_t* b = t + 1 < n ? a + stride : a;
    PrefetchRow(reinterpret_cast<const char*>(a + ahead * stride), tile_bytes);
    PrefetchRow(reinterpret_cast<const char*>(b + ahead * stride), tile_bytes);
    hn::Vec<D16> x_low[kChunks], x_high[kChunks];
    for (int ch = 0; ch < kChunks; ++ch) {
      const auto x = LoadWidened<kWhole>(a + ch * lanes, count[ch]);
      const auto y = LoadWidened<kWhole>(b + ch * lanes, count[ch]);
      x_low[ch] = hn::InterleaveLower(d16, x, y);
      x_high[ch] = hn::InterleaveUpper(d16, x, y);
    }
    for (int r = 0; r < kRows; ++r) {
      const auto w = CodePair(codes + r * ldc, t);
      for (int ch = 0; ch < kChunks; ++ch) {
        lower[r][ch] = hn::ReorderWidenMulAccumulate(
            d32, x_low[ch], w, lower[r][ch], lower1[r][ch]);
        upper[r][ch] = hn::ReorderWidenMulAccumulate(
            d32, x_high[ch], w, upper[r][ch], upper1[r][ch]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int ch = 0; ch < kChunks; ++ch) {
      if (count[ch] <= 0) continue;
      AddChunkSums(hn::RearrangeToOddPlusEven(lower[r][ch], lower1[r][ch]),
                   hn::RearrangeToOddPlusEven(upper[r][ch], upper1[r][ch]),
                   units[r], count[ch], acc + r * dim + c0 + ch * lanes);
    }
  }
}

// Tiles: 64 columns where registers allow (32 on SSE4 and NEON, whose
// accumulators are twice as many), four weight rows a tile on AVX-512.
constexpr int kIntegerTileChunks =
    hn::MaxLanes(D16()) >= 16 ? 64 / hn::MaxLanes(D16()) : 4;
constexpr int kIntegerTileRows = hn::MaxLanes(D16()) == 32 ? 4 : 1;

#else   // Sizeless vectors (SVE) form no arrays: one vector at a time.
template <int kRows, int kChunks, bool kWhole>
void IntegerAddWeightedTile(const int16_t* codes, int64_t ldc,
                            const float* units, const int8_t* rows,
                            int64_t stride, int64_t n, int64_t c0, int64_t dim,
                            float* acc) {
  const D16 d16;
  const D32 d32;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d16));
  for (int r = 0; r < kRows; ++r) {
    for (int ch = 0; ch < kChunks; ++ch) {
      const int64_t c = c0 + ch * lanes, count = dim - c;
      if (count <= 0) continue;
      auto lower = hn::Zero(d32), lower1 = hn::Zero(d32);
      auto upper = hn::Zero(d32), upper1 = hn::Zero(d32);
      for (int64_t t = 0; t < n; t += 2) {
        const int8_t* a = rows + t * stride + c;
        const int8_t* b = t + 1 < n ? a + stride : a;
        const auto x = LoadWidened<kWhole>(a, count);
        const auto y = LoadWidened<kWhole>(b, count);
        const auto w = CodePair(codes + r * ldc, t);
        lower = hn::ReorderWidenMulAccumulate(
            d32, hn::InterleaveLower(d16, x, y), w, lower, lower1);
        upper = hn::ReorderWidenMulAccumulate(
            d32, hn::InterleaveUpper(d16, x, y), w, upper, upper1);
      }
      AddChunkSums(hn::RearrangeToOddPlusEven(lower, lower1),
                   hn::RearrangeToOddPlusEven(upper, upper1), units[r], count,
                   acc + r * dim + c);
    }
  }
}

constexpr int kIntegerTileChunks = 1;
constexpr int kIntegerTileRows = 1;
#endif  // !HWY_HAVE_SCALABLE

// The tiles of kRows weight rows, across the columns.
template <int kRows>
void IntegerAddWeightedTiles(const int16_t* codes, int64_t ldc,
                             const float* units, const int8_t* rows,
                             int64_t stride, int64_t n, int64_t dim,
                             float* acc) {
  const int64_t width =
      kIntegerTileChunks * static_cast<int64_t>(hn::Lanes(D16()));
  for (int64_t c0 = 0; c0 < dim; c0 += width) {
    if (dim - c0 >= width) {
      IntegerAddWeightedTile<kRows, kIntegerTileChunks, true>(
          codes, ldc, units, rows, stride, n, c0, dim, acc);
    } else {
      IntegerAddWeightedTile<kRows, kIntegerTileChunks, false>(
          codes, ldc, units, rows, stride, n, c0, dim, acc);
    }
  }
}

// Int8 values: per block of kIntegerBlockRows value rows, each row whose
// weights are finite takes the integer path, kIntegerTileRows rows a tile;
// the others take the float path alone.
void IntegerAddWeightedRows(const float* p, int64_t ld, int64_t rows,
                            const CachedRows& values, int64_t cols, int64_t dim,
                            float* acc) {
  constexpr int64_t kCodes = kIntegerBlockRows + kMaxBytes / sizeof(int16_t);
  HWY_ALIGN int16_t codes[kIntegerTileRows][kCodes];
  float units[kIntegerTileRows];
  for (int64_t j0 = 0; j0 < cols; j0 += kIntegerBlockRows) {
    const int64_t n = std::min(kIntegerBlockRows, cols - j0);
    CachedRows block = values;
    block.data = static_cast<const int8_t*>(values.data) + j0 * values.stride;
    block.scales = values.scales + j0;
    const auto* data = static_cast<const int8_t*>(block.data);
    for (int64_t r0 = 0; r0 < rows; r0 += kIntegerTileRows) {
      const int64_t tile = std::min<int64_t>(kIntegerTileRows, rows - r0);
      bool integer[kIntegerTileRows];
      bool all = tile == kIntegerTileRows;
      for (int64_t r = 0; r < tile; ++r) {
        integer[r] = QuantizeWeights(p + (r0 + r) * ld + j0, block.scales, n,
                                     codes[r], &units[r]);
        all = all && integer[r];
      }
      if (all) {
        IntegerAddWeightedTiles<kIntegerTileRows>(codes[0], kCodes, units, data,
                                                  values.stride, n, dim,
                                                  acc + r0 * dim);
        continue;
      }
      for (int64_t r = 0; r < tile; ++r) {
        float* row_acc = acc + (r0 + r) * dim;
        if (integer[r]) {
          IntegerAddWeightedTiles<1>(codes[r], kCodes, &units[r], data,
                                     values.stride, n, dim, row_acc);
        } else {
          AddWeightedRowsOf<RowType::kInt8>(p + (r0 + r) * ld + j0, ld, 1,
                                            block, n, dim, row_acc);
        }
      }
    }
  }
}
#endif  // HWY_TARGET != HWY_SCALAR

void AddWeightedRows(const float* p, int64_t ld, int64_t rows,
                     const CachedRows& values, int64_t cols, int64_t dim,
                     float* acc) {
  switch (values.type) {
    case RowType::kFloat32:
      return AddWeightedRowsOf<RowType::kFloat32>(p, ld, rows, values, cols,
                                                  dim, acc);
    case RowType::kBFloat16:
      if (PairsFit(dim)) {
        return PairedAddWeightedRows(p, ld, rows, values, cols, dim, acc);
      }
      return AddWeightedRowsOf<RowType::kBFloat16>(p, ld, rows, values, cols,
                                                   dim, acc);
    case RowType::kInt8:
#if HWY_TARGET != HWY_SCALAR
      return IntegerAddWeightedRows(p, ld, rows, values, cols, dim, acc);
#else
      return AddWeightedRowsOf<RowType::kInt8>(p, ld, rows, values, cols, dim,
                                               acc);
#endif
  }
}

// This target's functions, named.
RowOps MakeRowOps(const char* name, const char* isa) {
  return RowOps{ScaleMax,
                MaxScaled,
                Max,
                ExpSum,
                ExpSumBFloat16,
                ExpSumBFloat16InPlace,
                Scale,
                ScaleToBFloat16,
                WidenBFloat16,
                AllFinite,
                LayerNorm,
                RmsNorm,
                QuantizeInt8,
                DotRows,
                AddWeightedRows,
                /*int8_integer_path=*/HWY_TARGET != HWY_SCALAR,
                name,
                isa};
}

}  // namespace

// This target's table.
const RowOps* TargetRowOps(const char* name, const char* isa) {
  static const RowOps ops = MakeRowOps(name, isa);
  return &ops;
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// This target's table with the AVX512_BF16 roundings, for CPUs that have it.
const RowOps* TargetRowOpsBFloat16(const char* name) {
  static const RowOps ops = [name] {
    RowOps with = MakeRowOps(name, "avx512");
    with.exp_sum_bf16 = ExpSumBFloat16Native;
    with.exp_sum_bf16_in_place = ExpSumBFloat16InPlaceNative;
    with.scale_to_bf16 = ScaleToBFloat16Native;
    return with;
  }();
  return &ops;
}
#endif

}  // namespace HWY_NAMESPACE
}  // namespace attnserve
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attnserve::row_ops_internal {

const std::vector<const RowOps*>& PortableRowOps() {
  static const std::vector<const RowOps*> supported = [] {
    const uint32_t cpu = hwy::SupportedTargets();
    std::vector<const RowOps*> all;
    // Widest first; only targets this build compiled and this CPU runs.
    const auto add = [&](uint32_t target, auto table) {
      if ((HWY_TARGETS & target) != 0 && (cpu & target) != 0) {
        all.push_back(table());
      }
    };
    (void)add;
#if HWY_TARGETS & HWY_AVX3_DL
    if (__builtin_cpu_supports("avx512bf16")) {
      add(HWY_AVX3_DL,
          [] { return N_AVX3_DL::TargetRowOpsBFloat16("avx512_dl_bf16"); });
    }
    add(HWY_AVX3_DL,
        [] { return N_AVX3_DL::TargetRowOps("avx512_dl", "avx512"); });
#endif
#if HWY_TARGETS & HWY_AVX3
    if (__builtin_cpu_supports("avx512bf16")) {
      add(HWY_AVX3, [] { return N_AVX3::TargetRowOpsBFloat16("avx512_bf16"); });
    }
    add(HWY_AVX3, [] { return N_AVX3::TargetRowOps("avx512", "avx512"); });
#endif
#if HWY_TARGETS & HWY_AVX2
    add(HWY_AVX2, [] { return N_AVX2::TargetRowOps("avx2", "avx2"); });
#endif
#if HWY_TARGETS & HWY_SSE4
    add(HWY_SSE4, [] { return N_SSE4::TargetRowOps("sse4", "sse4"); });
#endif
#if HWY_TARGETS & HWY_SVE2
    add(HWY_SVE2, [] { return N_SVE2::TargetRowOps("sve2", "sve2"); });
#endif
#if HWY_TARGETS & HWY_SVE
    add(HWY_SVE, [] { return N_SVE::TargetRowOps("sve", "sve"); });
#endif
#if HWY_TARGETS & HWY_NEON
    add(HWY_NEON, [] { return N_NEON::TargetRowOps("neon", "neon"); });
#endif
    return all;
  }();
  return supported;
}

}  // namespace attnserve::row_ops_internal
#endif  // HWY_ONCE
