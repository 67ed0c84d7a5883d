// The row kernels (core/row_ops.h) on every implementation this CPU runs
// (each instruction set of the portable one, then scalar),
// against float64 and the non-finite rules: small inputs, so that the suite
// also runs under emulation (scripts/test-arm.sh).
#include "core/row_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/convert.h"
#include "gtest/gtest.h"

namespace attnserve::testing {
namespace {

class RowOpsTest : public ::testing::TestWithParam<int> {
 protected:
  const RowOps& ops() const { return *SupportedRowOps()[GetParam()]; }
};

// The softmax's row operations agree with the scalar ones: maxima exactly,
// exp to 2e-7, bfloat16 values to their rounding.
TEST_P(RowOpsTest, MatchesScalar) {
  const RowOps& fast = ops();
  const RowOps& scalar = ScalarRowOps();
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> uniform(-30.0f, 5.0f);
  for (int64_t n : {1, 7, 16, 17, 100, 1000}) {
    std::vector<float> a(n), b(n);
    for (int64_t i = 0; i < n; ++i)
      a[i] = i % 5 == 3 ? -INFINITY : uniform(rng);
    b = a;
    EXPECT_EQ(fast.scale_max(a.data(), n, 0.5f),
              scalar.scale_max(b.data(), n, 0.5f));
    EXPECT_EQ(fast.max(a.data(), n), scalar.max(b.data(), n));
    const float shift = scalar.max(b.data(), n);
    std::vector<uint16_t> fast_bf16(n), scalar_bf16(n);
    EXPECT_NEAR(
        fast.exp_sum_bf16(a.data(), n, 0.5f, shift, fast_bf16.data()),
        scalar.exp_sum_bf16(b.data(), n, 0.5f, shift, scalar_bf16.data()),
        1e-5f * n);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_NEAR(BFloat16ToFloat(fast_bf16[i]),
                  BFloat16ToFloat(scalar_bf16[i]),
                  1e-2f * BFloat16ToFloat(scalar_bf16[i]) + 1e-30f);
    }
    EXPECT_EQ(fast.max_scaled(a.data(), n, -2.0f),
              scalar.max_scaled(b.data(), n, -2.0f));
    const float fast_sum = fast.exp_sum(a.data(), n, 1.0f, shift);
    const float scalar_sum = scalar.exp_sum(b.data(), n, 1.0f, shift);
    EXPECT_NEAR(fast_sum, scalar_sum, 1e-6f * scalar_sum) << n;
    for (int64_t i = 0; i < n; ++i) {
      if (i % 5 == 3) {
        EXPECT_EQ(a[i], 0.0f) << "exp(-inf) must be exactly 0";
      } else {
        EXPECT_NEAR(a[i], b[i], 2e-7f * b[i] + 1e-30f) << n << " " << i;
      }
    }
    fast.scale(a.data(), n, 3.0f);
    scalar.scale(b.data(), n, 3.0f);
    EXPECT_NEAR(a[0], b[0], 1e-6f * std::abs(b[0]) + 1e-30f);
  }
}

// Every row-ops implementation: maxima ignore NaN, exp passes it through,
// and conversions to bfloat16 keep NaN a NaN and Inf an Inf of its sign.
TEST_P(RowOpsTest, NonFiniteValues) {
  const uint32_t nan_bits[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u,
                               0x7fffffffu, 0xffffffffu, 0x7fbfffffu};
  {
    const RowOps* ops = &this->ops();
    for (int64_t n : {1, 5, 16, 17, 40}) {
      for (int64_t at = 0; at < n; at += 7) {
        std::vector<float> x(n);
        for (int64_t i = 0; i < n; ++i) x[i] = -0.25f * static_cast<float>(i);
        x[at] = NAN;
        const float expected_max = at == 0 ? (n > 1 ? -0.25f : -INFINITY) : 0;
        EXPECT_EQ(ops->max(x.data(), n), expected_max) << n << " " << at;
        EXPECT_EQ(ops->max_scaled(x.data(), n, 2.0f), 2 * expected_max);
        std::vector<float> y = x;
        EXPECT_EQ(ops->scale_max(y.data(), n, 2.0f), 2 * expected_max);
        EXPECT_TRUE(std::isnan(y[at]));
        EXPECT_FALSE(ops->all_finite(x.data(), n));
        std::vector<uint16_t> bf16(n);
        EXPECT_TRUE(std::isnan(
            ops->exp_sum_bf16(x.data(), n, 1.0f, 0.0f, bf16.data())));
        EXPECT_TRUE(std::isnan(BFloat16ToFloat(bf16[at])));
        y = x;
        EXPECT_TRUE(std::isnan(ops->exp_sum(y.data(), n, 1.0f, 0.0f)));
        EXPECT_TRUE(std::isnan(y[at]));
        if (n > 1) {
          EXPECT_NEAR(y[at == 0 ? 1 : 0], at == 0 ? std::exp(-0.25f) : 1.0f,
                      1e-6f);
        }
        x[at] = -INFINITY;
        y = x;
        EXPECT_FALSE(std::isnan(ops->exp_sum(y.data(), n, 1.0f, 0.0f)));
        EXPECT_EQ(y[at], 0.0f);
        x[at] = 1.0f;
        EXPECT_TRUE(ops->all_finite(x.data(), n));
        x[at] = -INFINITY;
        EXPECT_FALSE(ops->all_finite(x.data(), n));
      }
    }
    for (uint32_t bits : nan_bits) {
      std::vector<float> x(20, 1.5f);
      std::memcpy(&x[17], &bits, sizeof(float));
      x[3] = INFINITY;
      x[4] = -INFINITY;
      x[5] = 3.4028235e38f;  // rounds up to +Inf
      std::vector<uint16_t> out(20);
      ops->scale_to_bf16(x.data(), 20, 1.0f, out.data());
      EXPECT_TRUE(std::isnan(BFloat16ToFloat(out[17]))) << std::hex << bits;
      EXPECT_EQ(out[17] & 0x8000u, (bits >> 16) & 0x8000u) << std::hex << bits;
      EXPECT_EQ(BFloat16ToFloat(out[3]), INFINITY);
      EXPECT_EQ(BFloat16ToFloat(out[4]), -INFINITY);
      EXPECT_EQ(BFloat16ToFloat(out[5]), INFINITY);
      EXPECT_EQ(BFloat16ToFloat(out[0]), 1.5f);
    }
    // Denormals round as FloatToBFloat16 rounds them (not to 0) in
    // scale_to_bf16. exp_sum_bf16 (exp of -88 to -91.8: denormal floats, at
    // least bfloat16's smallest denormal, 2^-133) does too, but on the
    // AVX512_BF16 tables, whose instruction takes them for 0 (README).
    std::vector<float> tiny(20);
    for (int i = 0; i < 20; ++i) {
      tiny[i] = (i % 2 == 0 ? 1.0f : -1.0f) * 1.1754942e-38f / (1 << i);
    }
    std::vector<uint16_t> rounded(20), exps(20);
    ops->scale_to_bf16(tiny.data(), 20, 1.0f, rounded.data());
    std::vector<float> logits(20);
    for (int i = 0; i < 20; ++i) logits[i] = -88.0f - 0.2f * i;
    ops->exp_sum_bf16(logits.data(), 20, 1.0f, 0.0f, exps.data());
    const bool flushes = std::string(ops->name).ends_with("_bf16");
    for (int i = 0; i < 20; ++i) {
      EXPECT_EQ(rounded[i], FloatToBFloat16(tiny[i])) << ops->name << " " << i;
      if (flushes) {
        EXPECT_EQ(exps[i], 0) << ops->name << " " << i;
        continue;
      }
      const float e = std::exp(logits[i]);
      // exp_sum_bf16's exp is accurate to 5e-5 (relative) before rounding:
      // within one bfloat16 step (2^-133 among denormals) of the exact
      // value's rounding.
      EXPECT_NEAR(BFloat16ToFloat(exps[i]), BFloat16ToFloat(FloatToBFloat16(e)),
                  std::abs(e) * 0.01f + 1e-40f)
          << ops->name << " " << i;
      EXPECT_GT(exps[i], 0) << ops->name << " " << i;
    }
  }
}

// The decode kernel's row products on every row type (FLOAT32, BFLOAT16,
// INT8 with a scale per row) against float64 sums of the same (rounded)
// elements, over lengths that are not multiples of the vectors' and odd
// strides.
TEST_P(RowOpsTest, RowProductsMatchFloat64) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const RowOps& ops = this->ops();
  const bool int16_queries = ops.int8_integer_path;
  for (RowType type : {RowType::kFloat32, RowType::kBFloat16, RowType::kInt8}) {
    for (int64_t dim : {int64_t{5}, int64_t{64}, int64_t{72}, int64_t{128}}) {
      const int64_t rows = 3, cols = 37, stride = dim + 3;
      std::vector<float> f32(cols * stride);
      std::vector<uint16_t> bf16(cols * stride);
      std::vector<int8_t> i8(cols * stride);
      std::vector<float> scales(cols);
      std::vector<double> element(cols * stride);  // what each one stands for
      for (int64_t j = 0; j < cols; ++j) {
        scales[j] = 0.01f * static_cast<float>(j + 1);
        for (int64_t c = 0; c < stride; ++c) {
          const int64_t at = j * stride + c;
          f32[at] = uniform(rng);
          bf16[at] = FloatToBFloat16(f32[at]);
          i8[at] = static_cast<int8_t>(std::lround(127 * f32[at]));
          element[at] = type == RowType::kFloat32 ? f32[at]
                        : type == RowType::kBFloat16
                            ? BFloat16ToFloat(bf16[at])
                            : static_cast<double>(i8[at]) * scales[j];
        }
      }
      CachedRows cached;
      cached.data =
          type == RowType::kFloat32    ? static_cast<const void*>(f32.data())
          : type == RowType::kBFloat16 ? static_cast<const void*>(bf16.data())
                                       : static_cast<const void*>(i8.data());
      cached.stride = stride;
      cached.type = type;
      cached.scales = scales.data();
      std::vector<float> q(rows * dim), p(rows * cols);
      for (float& x : q) x = uniform(rng);
      for (float& x : p) x = uniform(rng);
      std::vector<float> logits(rows * cols, -1.0f);
      ops.dot_rows(q.data(), rows, dim, cached, cols, logits.data(), cols);
      // A key's product has the same bits wherever the call starts: calls
      // split at other keys (a batched pass, a single step) agree.
      constexpr int64_t kShift = 3;
      CachedRows shifted = cached;
      shifted.data = static_cast<const char*>(cached.data) +
                     kShift * stride *
                         (type == RowType::kFloat32    ? 4
                          : type == RowType::kBFloat16 ? 2
                                                       : 1);
      shifted.scales = scales.data() + kShift;
      std::vector<float> later(rows * (cols - kShift));
      ops.dot_rows(q.data(), rows, dim, shifted, cols - kShift, later.data(),
                   cols - kShift);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < cols - kShift; ++j) {
          EXPECT_EQ(later[r * (cols - kShift) + j],
                    logits[r * cols + j + kShift])
              << ops.name << " type " << static_cast<int>(type) << " dim "
              << dim << " row " << r << " key " << j + kShift;
        }
      }
      std::vector<float> acc(rows * dim, 0.5f);
      ops.add_weighted_rows(p.data(), cols, rows, cached, cols, dim,
                            acc.data());
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < cols; ++j) {
          double want = 0, max_q = 0, key_l1 = 0;
          for (int64_t c = 0; c < dim; ++c) {
            want += double{q[r * dim + c]} * element[j * stride + c];
            max_q = std::max(max_q, std::abs(double{q[r * dim + c]}));
            key_l1 += std::abs(element[j * stride + c]);
          }
          // The integer path rounds a query row to int16 codes of step
          // max|q| / 32767 (each code within half a step) for int8 keys.
          const double rounding = type == RowType::kInt8 && int16_queries
                                      ? 0.5 * max_q / 32767 * key_l1
                                      : 0.0;
          EXPECT_NEAR(logits[r * cols + j], want, 1e-5 * dim + rounding)
              << ops.name << " type " << static_cast<int>(type) << " dim "
              << dim << " row " << r << " key " << j;
        }
        // The integer path rounds a row's weights times the value rows'
        // scales to int16 codes of step max|w| / 32767 for int8 values.
        double max_w = 0;
        for (int64_t j = 0; j < cols; ++j) {
          max_w =
              std::max(max_w, std::abs(double{p[r * cols + j]} * scales[j]));
        }
        for (int64_t c = 0; c < dim; ++c) {
          double want = 0.5, codes_l1 = 0;
          for (int64_t j = 0; j < cols; ++j) {
            want += double{p[r * cols + j]} * element[j * stride + c];
            codes_l1 += std::abs(static_cast<double>(i8[j * stride + c]));
          }
          const double rounding = type == RowType::kInt8 && int16_queries
                                      ? 0.5 * max_w / 32767 * codes_l1
                                      : 0.0;
          EXPECT_NEAR(acc[r * dim + c], want, 1e-5 * cols + rounding)
              << ops.name << " type " << static_cast<int>(type) << " dim "
              << dim << " row " << r << " column " << c;
        }
      }
    }
  }
}

// Int8 values over several blocks of 512 rows and tiles of rows: the
// integer path's error stays within half a weight step per code, a block
// whose weights hold a NaN gives that row NaN (IEEE, as the float path),
// and the other rows and blocks keep their integer sums.
TEST_P(RowOpsTest, Int8ValuesOverBlocksAndNonFiniteWeights) {
  std::mt19937 rng(31);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::uniform_int_distribution<int> code(-127, 127);
  const RowOps& ops = this->ops();
  for (int64_t dim : {int64_t{5}, int64_t{64}, int64_t{72}, int64_t{128}}) {
    const int64_t rows = 6, cols = 1100, stride = dim + 1;
    std::vector<int8_t> i8(cols * stride);
    std::vector<float> scales(cols), p(rows * cols);
    for (int8_t& x : i8) x = static_cast<int8_t>(code(rng));
    for (float& s : scales) s = 0.001f + 0.01f * uniform(rng);
    for (float& x : p) x = uniform(rng);
    // Rows 1 and 4 hold a NaN weight in their second block (row 1 within
    // a tile of four rows, row 4 past it).
    p[1 * cols + 600] = std::numeric_limits<float>::quiet_NaN();
    p[4 * cols + 700] = std::numeric_limits<float>::quiet_NaN();
    const CachedRows cached{i8.data(), stride, RowType::kInt8, scales.data()};
    std::vector<float> acc(rows * dim, 0.25f);
    ops.add_weighted_rows(p.data(), cols, rows, cached, cols, dim, acc.data());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < dim; ++c) {
        if (r == 1 || r == 4) {
          EXPECT_TRUE(std::isnan(acc[r * dim + c]))
              << ops.name << " dim " << dim << " column " << c;
          continue;
        }
        double want = 0.25, bound = 1e-5 * cols;
        for (int64_t j0 = 0; j0 < cols; j0 += 512) {
          double max_w = 0, codes_l1 = 0;
          for (int64_t j = j0; j < std::min(cols, j0 + 512); ++j) {
            const double w = double{p[r * cols + j]} * scales[j];
            const int8_t v = i8[j * stride + c];
            want += w * v;
            max_w = std::max(max_w, std::abs(w));
            codes_l1 += std::abs(static_cast<double>(v));
          }
          if (ops.int8_integer_path) bound += 0.5 * max_w / 32767 * codes_l1;
        }
        EXPECT_NEAR(acc[r * dim + c], want, bound)
            << ops.name << " dim " << dim << " row " << r << " column " << c;
        if (ops.int8_integer_path) {
          // The integer path's bits: per block, float weights rounded to
          // int16 codes, an exact integer sum, scaled back and added.
          float exact = 0.25f;
          for (int64_t j0 = 0; j0 < cols; j0 += 512) {
            const int64_t end = std::min(cols, j0 + 512);
            float largest = 0.0f;
            for (int64_t j = j0; j < end; ++j) {
              largest =
                  std::max(largest, std::abs(p[r * cols + j] * scales[j]));
            }
            const float inverse = 32767.0f / largest;
            int64_t sum = 0;
            for (int64_t j = j0; j < end; ++j) {
              const float w = p[r * cols + j] * scales[j];
              sum += static_cast<int64_t>(std::nearbyint(w * inverse)) *
                     i8[j * stride + c];
            }
            exact += static_cast<float>(sum) * (largest / 32767.0f);
          }
          EXPECT_EQ(acc[r * dim + c], exact)
              << ops.name << " dim " << dim << " row " << r << " column " << c;
        }
      }
    }
  }
}

// Int8 keys whose rows lie side by side (stride == dim, as in a session's
// cache) take the fixed-layout groups at d64 and d128: the same bits as
// the same keys read through another stride.
TEST_P(RowOpsTest, Int8KeysSideBySideMatchStridedKeys) {
  std::mt19937 rng(41);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::uniform_int_distribution<int> code(-127, 127);
  const RowOps& ops = this->ops();
  for (int64_t dim : {int64_t{64}, int64_t{128}}) {
    const int64_t rows = 3, cols = 37;
    std::vector<int8_t> packed(cols * dim), strided(cols * (dim + 5));
    std::vector<float> scales(cols), q(rows * dim);
    for (int64_t j = 0; j < cols; ++j) {
      scales[j] = 0.01f * static_cast<float>(j + 1);
      for (int64_t c = 0; c < dim; ++c) {
        packed[j * dim + c] = strided[j * (dim + 5) + c] =
            static_cast<int8_t>(code(rng));
      }
    }
    for (float& x : q) x = uniform(rng);
    std::vector<float> side_by_side(rows * cols), apart(rows * cols);
    ops.dot_rows(q.data(), rows, dim,
                 {packed.data(), dim, RowType::kInt8, scales.data()}, cols,
                 side_by_side.data(), cols);
    ops.dot_rows(q.data(), rows, dim,
                 {strided.data(), dim + 5, RowType::kInt8, scales.data()}, cols,
                 apart.data(), cols);
    for (int64_t i = 0; i < rows * cols; ++i) {
      EXPECT_EQ(side_by_side[i], apart[i])
          << ops.name << " dim " << dim << " at " << i;
    }
  }
}

// LayerNorm and RMSNorm rows against float64, with and without gamma and
// beta, over lengths around the vectors'; a constant row gives beta exactly,
// and a mean large against the spread costs no accuracy.
TEST_P(RowOpsTest, NormsMatchFloat64) {
  std::mt19937 rng(21);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  for (int64_t n : {1, 3, 8, 17, 64, 100, 768}) {
    // Rows about 0, a mean far above the spread (1000 and 10000 with a
    // spread of 0.01), and a first element far from the others.
    struct Row {
      float offset, spread, first;
    };
    for (const Row& row :
         {Row{0.0f, 1.0f, 0.0f}, Row{1000.0f, 1.0f, 0.0f},
          Row{10000.0f, 0.005f, 0.0f}, Row{0.0f, 1.0f, 3000.0f}}) {
      const float offset = row.offset;
      std::vector<float> x(n), gamma(n), beta(n), y(n);
      for (int64_t i = 0; i < n; ++i) {
        x[i] = offset + row.spread * uniform(rng);
        gamma[i] = uniform(rng);
        beta[i] = uniform(rng);
      }
      x[0] += row.first;
      double mean = 0, squares = 0, rms = 0;
      for (float v : x) mean += v;
      mean /= static_cast<double>(n);
      for (float v : x) {
        squares += (v - mean) * (v - mean);
        rms += double{v} * v;
      }
      const double rstd = 1 / std::sqrt(squares / n + 1e-5);
      const double rms_inverse = 1 / std::sqrt(rms / n + 1e-5);
      for (bool affine : {false, true}) {
        ops().layer_norm(x.data(), n, 1e-5f, affine ? gamma.data() : nullptr,
                         affine ? beta.data() : nullptr, y.data());
        for (int64_t i = 0; i < n; ++i) {
          double want = (x[i] - mean) * rstd;
          if (affine) want = want * gamma[i] + beta[i];
          EXPECT_NEAR(y[i], want, 2e-5 * (1 + std::abs(want)))
              << ops().name << " layer_norm n " << n << " offset " << offset
              << " i " << i;
        }
        ops().rms_norm(x.data(), n, 1e-5f, affine ? gamma.data() : nullptr,
                       y.data());
        for (int64_t i = 0; i < n; ++i) {
          const double want = x[i] * rms_inverse * (affine ? gamma[i] : 1.0);
          EXPECT_NEAR(y[i], want, 2e-6 * (1 + std::abs(want)))
              << ops().name << " rms_norm n " << n << " i " << i;
        }
      }
    }
    std::vector<float> constant(n, 3.25f), y(n), beta(n, 0.5f);
    ops().layer_norm(constant.data(), n, 1e-5f, nullptr, beta.data(), y.data());
    for (float v : y) EXPECT_EQ(v, 0.5f) << ops().name << " n " << n;
  }
}

// Cache rows quantized to int8: the codes and scale of the scalar
// quantizer, bit for bit, on every implementation and row length; ties
// round away from zero; x is within scale / 2 of code * scale; a row of
// zeros has scale 0 and a row holding NaN or Inf scale NaN, codes 0.
TEST_P(RowOpsTest, QuantizeInt8MatchesScalarAndRoundsTiesAway) {
  std::mt19937 rng(12);
  std::uniform_real_distribution<float> uniform(-3.0f, 3.0f);
  for (int64_t n : {1, 2, 3, 4, 7, 8, 9, 16, 17, 31, 64, 65, 128, 131}) {
    std::vector<float> x(n);
    for (float& v : x) v = uniform(rng);
    for (float magnitude : {1.0f, 1e-30f, 1e-40f, 1e38f}) {
      std::vector<float> row(x);
      for (float& v : row) v *= magnitude;
      std::vector<int8_t> fast(n, 99), scalar(n, 98);
      const float scale = ops().quantize_int8(row.data(), n, fast.data());
      EXPECT_EQ(scale,
                ScalarRowOps().quantize_int8(row.data(), n, scalar.data()));
      EXPECT_EQ(fast, scalar) << ops().name << " n " << n << " x" << magnitude;
      float max_abs = 0.0f;
      for (float v : row) max_abs = std::max(max_abs, std::abs(v));
      const double inverse = 127.0 / max_abs;
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_EQ(fast[i], static_cast<int8_t>(std::round(row[i] * inverse)))
            << ops().name << " n " << n << " i " << i;
        // (A subnormal scale keeps fewer bits: within max |x| only.)
        if (scale >= std::numeric_limits<float>::min()) {
          EXPECT_LE(std::abs(static_cast<double>(fast[i]) * scale - row[i]),
                    0.5000001 * scale);
        }
      }
    }
  }
  // max |x| = 127: the codes are x rounded, ties away from zero.
  std::vector<float> ties = {
      0.5f,   -0.5f, 1.5f, -1.5f, 2.5f,  -2.5f, 126.5f,  -126.5f, 0.49999997f,
      127.0f, -3.5f, 4.5f, 0.0f,  -0.0f, 5.5f,  -127.0f, 6.5f};
  std::vector<int8_t> codes(ties.size());
  EXPECT_EQ(ops().quantize_int8(ties.data(), ties.size(), codes.data()), 1.0f);
  EXPECT_EQ(codes, (std::vector<int8_t>{1, -1, 2, -2, 3, -3, 127, -127, 0, 127,
                                        -4, 5, 0, 0, 6, -127, 7}))
      << ops().name;
  for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    for (int64_t n : {1, 9, 40}) {
      std::vector<float> row(n, 1.0f);
      row[n - 1] = bad;
      std::vector<int8_t> out(n, 5);
      EXPECT_TRUE(std::isnan(ops().quantize_int8(row.data(), n, out.data())))
          << ops().name << " n " << n;
      EXPECT_EQ(out, std::vector<int8_t>(n, 0)) << ops().name;
    }
  }
  std::vector<float> zeros(33, 0.0f);
  std::vector<int8_t> out(33, 5);
  EXPECT_EQ(ops().quantize_int8(zeros.data(), 33, out.data()), 0.0f);
  EXPECT_EQ(out, std::vector<int8_t>(33, 0)) << ops().name;
}

// exp_sum_bf16_in_place leaves in x exactly what exp_sum_bf16 writes,
// widened, and returns the same sum: finite, masked (-inf), NaN and
// denormal-range logits, every tail length.
TEST_P(RowOpsTest, ExpSumInPlaceIsExpSumBFloat16Widened) {
  std::mt19937 rng(21);
  std::uniform_real_distribution<float> uniform(-95.0f, 0.0f);
  for (int64_t n : {1, 7, 16, 17, 31, 100, 513}) {
    for (bool with_nan : {false, true}) {
      std::vector<float> x(n);
      for (int64_t i = 0; i < n; ++i) {
        x[i] = i % 5 == 3 ? -INFINITY : uniform(rng);
      }
      if (with_nan) x[n / 2] = NAN;
      for (float multiplier : {1.0f, 0.5f}) {
        std::vector<uint16_t> narrow(n);
        std::vector<float> in_place = x;
        const float sum =
            ops().exp_sum_bf16(x.data(), n, multiplier, 0.0f, narrow.data());
        const float in_place_sum =
            ops().exp_sum_bf16_in_place(in_place.data(), n, multiplier, 0.0f);
        if (with_nan) {
          EXPECT_TRUE(std::isnan(in_place_sum)) << n;
        } else {
          EXPECT_EQ(in_place_sum, sum) << n;
        }
        for (int64_t i = 0; i < n; ++i) {
          uint32_t bits;
          std::memcpy(&bits, &in_place[i], sizeof(bits));
          ASSERT_EQ(bits, uint32_t{narrow[i]} << 16)
              << ops().name << " n " << n << " i " << i << " x " << x[i];
        }
      }
    }
  }
}

// Widening bfloat16 is exact for every one of its 65536 values (NaN
// payloads and signed zeros included), at every length and offset.
TEST_P(RowOpsTest, WidenBFloat16KeepsEveryBit) {
  std::vector<uint16_t> all(65536 + 3);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> out(all.size() + 1, 7.0f);
  for (int64_t offset : {0, 1, 3}) {
    const int64_t n = 65536 - offset;
    std::fill(out.begin(), out.end(), 7.0f);
    ops().widen_bf16(all.data() + offset, n, out.data());
    for (int64_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &out[i], sizeof(bits));
      ASSERT_EQ(bits, uint32_t{all[offset + i]} << 16) << offset << " " << i;
    }
    EXPECT_EQ(out[n], 7.0f) << "wrote past " << n;
  }
  for (int64_t n : {0, 1, 5, 17}) {
    std::fill(out.begin(), out.end(), 7.0f);
    ops().widen_bf16(all.data() + 0x3f80, n, out.data());
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(out[i], BFloat16ToFloat(all[0x3f80 + i]));
    }
    EXPECT_EQ(out[n], 7.0f) << "wrote past " << n;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Implementations, RowOpsTest,
    ::testing::Range(0, static_cast<int>(SupportedRowOps().size())),
    [](const auto& info) {
      return std::string(SupportedRowOps()[info.param]->name);
    });

}  // namespace
}  // namespace attnserve::testing
