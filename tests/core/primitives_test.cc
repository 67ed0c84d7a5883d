// The oneDNN building blocks against direct loops: matmuls and tile GEMMs in
// both dtypes, with leading dimensions and accumulation.
#include "core/primitives.h"

#include <random>
#include <vector>

#include "core/convert.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

struct Operand {
  std::vector<float> values;   // what the product sees (already rounded)
  std::vector<uint16_t> bf16;  // the same, as bfloat16
};

Operand RandomOperand(int64_t count, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  Operand op;
  for (int64_t i = 0; i < count; ++i) {
    const uint16_t b = FloatToBFloat16(uniform(rng));
    op.bf16.push_back(b);
    op.values.push_back(BFloat16ToFloat(b));
  }
  return op;
}

class TileGemmTest : public ::testing::TestWithParam<std::tuple<DType, bool>> {
};

TEST_P(TileGemmTest, MatchesLoops) {
  const auto [dtype, transposed] = GetParam();
  const int64_t m = 5, n = 7, k = 9, lda = 12, ldb = 11, ldc = 10;
  std::mt19937 rng(4);
  Operand a = RandomOperand(m * lda, rng);
  Operand b = RandomOperand((transposed ? n : k) * ldb, rng);
  for (bool accumulate : {false, true}) {
    std::vector<float> c(m * ldc, 0.5f);
    TileGemmShape shape{m, n, k, lda, ldb, ldc, transposed, accumulate, dtype};
    auto gemm = TileGemm::Create(shape);
    ASSERT_TRUE(gemm.ok()) << gemm.status();
    const bool bf16 = dtype == DType::kBFloat16;
    gemm->Run(bf16 ? static_cast<const void*>(a.bf16.data()) : a.values.data(),
              bf16 ? static_cast<const void*>(b.bf16.data()) : b.values.data(),
              c.data());
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double want = accumulate ? 0.5 : 0.0;
        for (int64_t x = 0; x < k; ++x) {
          const float bv =
              transposed ? b.values[j * ldb + x] : b.values[x * ldb + j];
          want += double(a.values[i * lda + x]) * bv;
        }
        EXPECT_NEAR(c[i * ldc + j], want, 1e-5) << i << "," << j;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, TileGemmTest,
                         ::testing::Combine(::testing::Values(DType::kFloat32,
                                                              DType::kBFloat16),
                                            ::testing::Bool()));

TEST(MatmulTest, BFloat16WithBiasAndBFloat16Output) {
  const int64_t m = 6, k = 10, n = 4;
  std::mt19937 rng(5);
  Operand a = RandomOperand(m * k, rng);
  Operand w = RandomOperand(n * k, rng);  // [n, k]: nn.Linear layout
  std::vector<float> bias = {0.5f, -1.0f, 0.25f, 2.0f};
  std::vector<uint16_t> c(m * n);
  MatmulShape shape;
  shape.m = m;
  shape.k = k;
  shape.n = n;
  shape.b_transposed = true;
  shape.b_shared = true;
  shape.has_bias = true;
  shape.a_dtype = shape.b_dtype = shape.c_dtype = DType::kBFloat16;
  ASSERT_TRUE(
      Matmul(shape, a.bf16.data(), w.bf16.data(), bias.data(), c.data()).ok());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double want = bias[j];
      for (int64_t x = 0; x < k; ++x)
        want += double(a.values[i * k + x]) * w.values[j * k + x];
      EXPECT_NEAR(BFloat16ToFloat(c[i * n + j]), want,
                  1e-2 * (1 + std::abs(want)));
    }
  }
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

class PackedLinearTest
    : public ::testing::TestWithParam<std::tuple<DType, int64_t>> {};

TEST_P(PackedLinearTest, MatchesLoopsForAnyRowCount) {
  const auto [dtype, rows] = GetParam();
  const int64_t in = 40, out = 24;
  std::mt19937 rng(6);
  Operand w = RandomOperand(out * in, rng);
  Operand x = RandomOperand(rows * in, rng);
  std::vector<float> bias(out);
  for (int64_t j = 0; j < out; ++j) bias[j] = 0.1f * j;
  const bool bf16 = dtype == DType::kBFloat16;
  auto packed = PackedLinear::Create(
      bf16 ? static_cast<const void*>(w.bf16.data()) : w.values.data(),
      bias.data(), out, in, dtype);
  ASSERT_TRUE(packed.ok()) << packed.status();
  std::vector<float> y(rows * out);
  ASSERT_TRUE((*packed)
                  ->Run(rows,
                        bf16 ? static_cast<const void*>(x.bf16.data())
                             : x.values.data(),
                        y.data(), DType::kFloat32)
                  .ok());
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < out; ++j) {
      double want = bias[j];
      for (int64_t c = 0; c < in; ++c)
        want += double(x.values[i * in + c]) * w.values[j * in + c];
      ASSERT_NEAR(y[i * out + j], want, 1e-4) << i << "," << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, PackedLinearTest,
                         ::testing::Combine(::testing::Values(DType::kFloat32,
                                                              DType::kBFloat16),
                                            ::testing::Values(1, 16, 300)));

}  // namespace
}  // namespace attnserve
