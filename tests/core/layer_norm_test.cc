// The core's LayerNorm against the float64 reference, and its input checks.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention.h"
#include "core/convert.h"
#include "core/row_ops.h"
#include "gtest/gtest.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {
namespace {

// Random values times 3 plus `offset`, in `dtype`: a normalization's input.
Tensor NormInput(const Shape& shape, float offset, DType dtype,
                 std::mt19937& rng) {
  Tensor input = RandomTensor(DType::kFloat32, shape, rng);
  for (int64_t i = 0; i < input.num_elements(); ++i) {
    input.data_as<float>()[i] = input.data_as<float>()[i] * 3.0f + offset;
  }
  if (dtype == DType::kFloat32) return input;
  return *Float32ToTensor(input.data_as<float>(), input.shape(), dtype);
}

struct LayerNormCase {
  std::string name;
  Shape shape;
  int normalized_ndim = 1;
  bool gamma = true;
  bool beta = true;
  float eps = 1e-5f;
  DType dtype = DType::kFloat32;
  float offset = 0.0f;  // added to every input value
};

void PrintTo(const LayerNormCase& c, std::ostream* os) { *os << c.name; }

class LayerNormTableTest : public ::testing::TestWithParam<LayerNormCase> {};

TEST_P(LayerNormTableTest, MatchesFloat64Reference) {
  const LayerNormCase& c = GetParam();
  std::mt19937 rng(21);
  const Tensor input = NormInput(c.shape, c.offset, c.dtype, rng);
  const Shape normalized(c.shape.end() - c.normalized_ndim, c.shape.end());
  std::optional<Tensor> gamma, beta;
  if (c.gamma) gamma = RandomTensor(DType::kFloat32, normalized, rng);
  if (c.beta) beta = RandomTensor(DType::kFloat32, normalized, rng);
  std::optional<TensorView> gamma_view, beta_view;
  if (gamma) gamma_view = gamma->view();
  if (beta) beta_view = beta->view();
  auto out = LayerNorm(input.view(), gamma_view, beta_view,
                       {c.eps, c.normalized_ndim});
  ASSERT_TRUE(out.ok()) << out.status();
  std::optional<RefTensor> gamma_ref, beta_ref;
  if (gamma) gamma_ref = ToRef(gamma->view());
  if (beta) beta_ref = ToRef(beta->view());
  const RefTensor ref = RefLayerNorm(ToRef(input.view()), gamma_ref, beta_ref,
                                     c.eps, c.normalized_ndim);
  EXPECT_EQ(out->dtype(), c.dtype);
  EXPECT_TRUE(AllClose(out->view(), ref, ToleranceFor(c.dtype)));
}

INSTANTIATE_TEST_SUITE_P(
    Table, LayerNormTableTest,
    ::testing::Values(
        LayerNormCase{"affine", {2, 10, 512}},
        LayerNormCase{"gamma_only", {3, 7}, 1, true, false},
        LayerNormCase{"beta_only", {3, 7}, 1, false, true},
        LayerNormCase{"no_affine", {5, 33}, 1, false, false},
        LayerNormCase{"two_trailing_dims", {4, 3, 5, 6}, 2, false, false},
        LayerNormCase{"all_dims", {4, 3, 5}, 3, true, true},
        LayerNormCase{"rank1", {17}, 1},
        LayerNormCase{"eps_1e-6", {2, 64}, 1, true, true, 1e-6f},
        LayerNormCase{"large_eps", {2, 64}, 1, true, true, 0.5f},
        LayerNormCase{"single_column", {6, 1}},
        LayerNormCase{"wide_row", {2, 8192}},
        LayerNormCase{"large_offset",
                      {4, 256},
                      1,
                      true,
                      true,
                      1e-5f,
                      DType::kFloat32,
                      1000.0f},
        LayerNormCase{"bf16", {4, 128}, 1, true, true, 1e-5f, DType::kBFloat16},
        LayerNormCase{"f16", {4, 128}, 1, true, true, 1e-5f, DType::kFloat16}),
    [](const auto& info) {
      std::string name = info.param.name;
      for (char& ch : name) {
        if (ch == '-') ch = '_';
      }
      return name;
    });

struct RmsNormCase {
  std::string name;
  Shape shape;
  int normalized_ndim = 1;
  bool gamma = true;
  std::optional<float> eps =
      std::nullopt;  // unset: DefaultRmsNormEps of the dtype
  DType dtype = DType::kFloat32;
  float offset = 0.0f;  // added to every input value
};

void PrintTo(const RmsNormCase& c, std::ostream* os) { *os << c.name; }

class RmsNormTableTest : public ::testing::TestWithParam<RmsNormCase> {};

TEST_P(RmsNormTableTest, MatchesFloat64Reference) {
  const RmsNormCase& c = GetParam();
  std::mt19937 rng(23);
  const Tensor input = NormInput(c.shape, c.offset, c.dtype, rng);
  const Shape normalized(c.shape.end() - c.normalized_ndim, c.shape.end());
  std::optional<Tensor> gamma;
  std::optional<TensorView> gamma_view;
  std::optional<RefTensor> gamma_ref;
  if (c.gamma) {
    gamma = RandomTensor(DType::kFloat32, normalized, rng);
    gamma_view = gamma->view();
    gamma_ref = ToRef(gamma->view());
  }
  LayerNormOptions options;
  options.rms_norm = true;
  options.normalized_ndim = c.normalized_ndim;
  options.eps = c.eps.value_or(DefaultRmsNormEps(c.dtype));
  auto out = LayerNorm(input.view(), gamma_view, std::nullopt, options);
  ASSERT_TRUE(out.ok()) << out.status();
  const RefTensor ref = RefRmsNorm(ToRef(input.view()), gamma_ref, options.eps,
                                   c.normalized_ndim);
  EXPECT_EQ(out->dtype(), c.dtype);
  EXPECT_EQ(out->shape(), c.shape);
  EXPECT_TRUE(AllClose(out->view(), ref, ToleranceFor(c.dtype)));
}

INSTANTIATE_TEST_SUITE_P(
    Table, RmsNormTableTest,
    ::testing::Values(
        RmsNormCase{"gamma", {2, 10, 512}},
        RmsNormCase{"no_gamma", {5, 33}, 1, false},
        RmsNormCase{"two_trailing_dims", {4, 3, 5, 6}, 2},
        RmsNormCase{"rank1", {17}},
        RmsNormCase{"eps_1e_5", {2, 64}, 1, true, 1e-5f},
        RmsNormCase{"large_eps", {2, 64}, 1, true, 0.5f},
        RmsNormCase{"single_column", {6, 1}},
        RmsNormCase{"llama_row", {3, 4096}},
        RmsNormCase{"many_rows_threaded", {512, 512}},
        RmsNormCase{"large_offset",
                    {4, 256},
                    1,
                    true,
                    std::nullopt,
                    DType::kFloat32,
                    1000.0f},
        RmsNormCase{"bf16", {4, 128}, 1, true, std::nullopt, DType::kBFloat16},
        RmsNormCase{"f16", {4, 128}, 1, true, std::nullopt, DType::kFloat16}),
    [](const auto& info) { return info.param.name; });

TEST(RmsNormTest, DefaultEpsIsTheDtypesMachineEpsilon) {
  // torch.finfo(dtype).eps, which torch.nn.RMSNorm(eps=None) uses.
  EXPECT_EQ(DefaultRmsNormEps(DType::kFloat32), 1.1920928955078125e-07f);
  EXPECT_EQ(DefaultRmsNormEps(DType::kBFloat16), 0.0078125f);
  EXPECT_EQ(DefaultRmsNormEps(DType::kFloat16), 0.0009765625f);
}

TEST(RmsNormTest, RefusesBetaAndPropagatesNaN) {
  Tensor x = *Float32ToTensor(std::vector<float>{1, 2, 3, 4}.data(), {2, 2},
                              DType::kFloat32);
  Tensor beta =
      *Float32ToTensor(std::vector<float>{0, 0}.data(), {2}, DType::kFloat32);
  LayerNormOptions options;
  options.rms_norm = true;
  auto refused = LayerNorm(x.view(), std::nullopt, beta.view(), options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(),
            "beta: RMSNorm has no shift (torch.nn.RMSNorm); leave beta unset");
  // A NaN spoils its own row only, as in PyTorch; zeros stay zeros.
  Tensor y = *Float32ToTensor(std::vector<float>{NAN, 1, 0, 0}.data(), {2, 2},
                              DType::kFloat32);
  auto out = LayerNorm(y.view(), std::nullopt, std::nullopt, options);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(std::isnan(out->data_as<float>()[0]));
  EXPECT_TRUE(std::isnan(out->data_as<float>()[1]));
  EXPECT_EQ(out->data_as<float>()[2], 0.0f);
  EXPECT_EQ(out->data_as<float>()[3], 0.0f);
}

// Runs each test on every RowOps implementation this CPU has (AVX-512, the
// portable one), as the server would on CPUs with and without AVX-512.
class NormAccuracyTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { SetRowOpsForTesting(SupportedRowOps()[GetParam()]); }
  void TearDown() override { SetRowOpsForTesting(nullptr); }
};

Tensor FilledTensor(const Shape& shape, float value, DType dtype) {
  std::vector<float> values(NumElements(shape), value);
  return *Float32ToTensor(values.data(), shape, dtype);
}

double MaxAbsDiff(const RefTensor& a, const RefTensor& b) {
  EXPECT_EQ(a.shape, b.shape);
  double worst = 0;
  for (size_t i = 0; i < a.values.size(); ++i) {
    const double diff = std::abs(a.values[i] - b.values[i]);
    if (!(diff <= worst)) worst = diff;  // NaN sticks
  }
  return worst;
}

// Values for constant rows: small, large, negative, not representable in
// binary (their float32 sums are inexact), and zero.
constexpr float kConstants[] = {0.1f,     1.0f,    3.3f,   -12.345f, 1000.5f,
                                -1000.5f, 65504.f, -7e-3f, 0.0f};
constexpr int64_t kConstantDims[] = {1, 7, 16, 17, 197, 768, 4096};
constexpr float kEpsilons[] = {1e-12f, 1e-6f, 1e-5f, 1e-2f};

// A constant row's variance is 0: LayerNorm gives beta (0 without it),
// whatever the value, width, eps, gamma and input dtype.
TEST_P(NormAccuracyTest, LayerNormOfConstantRowsIsBeta) {
  std::mt19937 rng(31);
  double worst = 0;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int64_t dim : kConstantDims) {
      const Tensor gamma = RandomTensor(DType::kFloat32, {dim}, rng);
      const Tensor beta = RandomTensor(DType::kFloat32, {dim}, rng);
      for (float value : kConstants) {
        const Tensor input = FilledTensor({3, dim}, value, dtype);
        for (float eps : kEpsilons) {
          SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " dim ", dim, " value ",
                                    value, " eps ", eps));
          auto out =
              LayerNorm(input.view(), gamma.view(), beta.view(), {eps, 1});
          ASSERT_TRUE(out.ok()) << out.status();
          // beta rounded to the output's dtype, for each row.
          const Tensor expected_beta = *Float32ToTensor(
              beta.data_as<float>(), beta.shape(), out->dtype());
          RefTensor expected = ToRef(expected_beta.view());
          expected.shape = {3, dim};
          expected.values.resize(3 * dim);
          for (int64_t i = dim; i < 3 * dim; ++i) {
            expected.values[i] = expected.values[i % dim];
          }
          const double error = MaxAbsDiff(ToRef(out->view()), expected);
          EXPECT_LE(error, 1e-6);
          worst = std::max(worst, error);
          auto plain =
              LayerNorm(input.view(), gamma.view(), std::nullopt, {eps, 1});
          ASSERT_TRUE(plain.ok()) << plain.status();
          const RefTensor zeros{{3, dim}, std::vector<double>(3 * dim, 0.0)};
          EXPECT_LE(MaxAbsDiff(ToRef(plain->view()), zeros), 1e-6);
        }
      }
    }
  }
  std::cout << "constant rows: max |output - beta| " << worst << "\n";
}

// The float32 computation a plain implementation does: the mean summed in
// float, the variance from the float deviations, (x - mean) / sqrt(var +
// eps) * gamma + beta in float. Its error is the bar the core must clear.
RefTensor NaiveFloat32LayerNorm(const Tensor& x, const Tensor& gamma,
                                const Tensor& beta, float eps) {
  const int64_t cols = x.shape().back();
  const int64_t rows = x.num_elements() / cols;
  RefTensor y{x.shape(), std::vector<double>(x.num_elements())};
  const float* in = x.data_as<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = in + r * cols;
    float sum = 0;
    for (int64_t c = 0; c < cols; ++c) sum += row[c];
    const float mean = sum / static_cast<float>(cols);
    float squares = 0;
    for (int64_t c = 0; c < cols; ++c) {
      squares += (row[c] - mean) * (row[c] - mean);
    }
    const float rstd =
        1.0f / std::sqrt(squares / static_cast<float>(cols) + eps);
    for (int64_t c = 0; c < cols; ++c) {
      y.values[r * cols + c] =
          (row[c] - mean) * rstd * gamma.data_as<float>()[c] +
          beta.data_as<float>()[c];
    }
  }
  return y;
}

// Rows whose mean is large against their spread (1): the deviations must
// not lose the digits the mean takes. Against the float64 reference: under
// 1e-5, or no worse than 1.5 times the plain float32 computation.
TEST_P(NormAccuracyTest, LayerNormOfOffsetRowsMatchesFloat64) {
  std::mt19937 rng(37);
  double worst = 0, worst_naive = 0;
  std::normal_distribution<float> unit(0.0f, 1.0f);
  for (int64_t dim : {7, 197, 768, 4096}) {
    const Tensor gamma = RandomTensor(DType::kFloat32, {dim}, rng);
    const Tensor beta = RandomTensor(DType::kFloat32, {dim}, rng);
    for (float mean : {10.0f, 100.0f, 1000.0f, -1000.0f}) {
      Tensor input = *Tensor::Allocate(DType::kFloat32, {16, dim});
      for (int64_t i = 0; i < input.num_elements(); ++i) {
        input.data_as<float>()[i] = mean + unit(rng);
      }
      for (float eps : {1e-12f, 1e-5f}) {
        SCOPED_TRACE(absl::StrCat("dim ", dim, " mean ", mean, " eps ", eps));
        auto out = LayerNorm(input.view(), gamma.view(), beta.view(), {eps, 1});
        ASSERT_TRUE(out.ok()) << out.status();
        const RefTensor ref =
            RefLayerNorm(ToRef(input.view()), ToRef(gamma.view()),
                         ToRef(beta.view()), eps, 1);
        const double error = MaxAbsDiff(ToRef(out->view()), ref);
        const double naive =
            MaxAbsDiff(NaiveFloat32LayerNorm(input, gamma, beta, eps), ref);
        EXPECT_TRUE(error <= 1e-5 || error <= 1.5 * naive)
            << "error " << error << ", plain float32 " << naive;
        worst = std::max(worst, error);
        worst_naive = std::max(worst_naive, naive);
      }
    }
  }
  std::cout << "offset rows: max |error| vs float64 " << worst
            << " (plain float32: " << worst_naive << ")\n";
}

// RMSNorm of a constant row is gamma * x / sqrt(x^2 + eps) (gamma times
// the sign of x once eps is small against x^2).
TEST_P(NormAccuracyTest, RmsNormOfConstantRowsMatchesFloat64) {
  std::mt19937 rng(41);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int64_t dim : kConstantDims) {
      const Tensor gamma = RandomTensor(DType::kFloat32, {dim}, rng);
      for (float value : kConstants) {
        const Tensor input = FilledTensor({2, dim}, value, dtype);
        for (float eps : kEpsilons) {
          SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " dim ", dim, " value ",
                                    value, " eps ", eps));
          LayerNormOptions options;
          options.rms_norm = true;
          options.eps = eps;
          auto out =
              LayerNorm(input.view(), gamma.view(), std::nullopt, options);
          ASSERT_TRUE(out.ok()) << out.status();
          const RefTensor ref =
              RefRmsNorm(ToRef(input.view()), ToRef(gamma.view()), eps, 1);
          // bfloat16 and float16 outputs: plus the rounding to their dtype
          // (half an ulp: 2^-8 or 2^-11 relative).
          const double rounding = dtype == DType::kBFloat16  ? 0x1p-8
                                  : dtype == DType::kFloat16 ? 0x1p-11
                                                             : 0.0;
          const RefTensor got = ToRef(out->view());
          for (size_t i = 0; i < got.values.size(); ++i) {
            ASSERT_LE(std::abs(got.values[i] - ref.values[i]),
                      1e-6 + rounding * std::abs(ref.values[i]))
                << "at " << i << ": " << got.values[i] << " vs "
                << ref.values[i];
          }
        }
      }
    }
  }
}

TEST_P(NormAccuracyTest, RmsNormOfOffsetRowsMatchesFloat64) {
  std::mt19937 rng(43);
  std::normal_distribution<float> unit(0.0f, 1.0f);
  for (int64_t dim : {7, 197, 768, 4096}) {
    const Tensor gamma = RandomTensor(DType::kFloat32, {dim}, rng);
    for (float mean : {0.0f, 10.0f, 1000.0f, -1000.0f}) {
      Tensor input = *Tensor::Allocate(DType::kFloat32, {16, dim});
      for (int64_t i = 0; i < input.num_elements(); ++i) {
        input.data_as<float>()[i] = mean + unit(rng);
      }
      for (float eps : {1e-12f, 1e-5f}) {
        SCOPED_TRACE(absl::StrCat("dim ", dim, " mean ", mean, " eps ", eps));
        LayerNormOptions options;
        options.rms_norm = true;
        options.eps = eps;
        auto out = LayerNorm(input.view(), gamma.view(), std::nullopt, options);
        ASSERT_TRUE(out.ok()) << out.status();
        const RefTensor ref =
            RefRmsNorm(ToRef(input.view()), ToRef(gamma.view()), eps, 1);
        EXPECT_LE(MaxAbsDiff(ToRef(out->view()), ref), 1e-6);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    RowOps, NormAccuracyTest,
    ::testing::Range(0, static_cast<int>(SupportedRowOps().size())),
    [](const auto& info) {
      return std::string(SupportedRowOps()[info.param]->name);
    });

void ExpectLayerNormError(const TensorView& input,
                          const std::optional<TensorView>& gamma,
                          LayerNormOptions options,
                          const std::string& message) {
  auto out = LayerNorm(input, gamma, std::nullopt, options);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out.status().message(), message);
}

TEST(LayerNormTest, RejectsBadInput) {
  std::mt19937 rng(1);
  Tensor input = RandomTensor(DType::kFloat32, {2, 3, 4}, rng);
  Tensor gamma = RandomTensor(DType::kFloat32, {3}, rng);
  Tensor mask = RandomTensor(DType::kUInt8, {2, 3}, rng);
  ExpectLayerNormError(input.view(), gamma.view(), {},
                       "gamma: shape [3], expected [4]");
  ExpectLayerNormError(input.view(), std::nullopt, {-1e-5f, 1},
                       "eps: must be finite and > 0, got -1e-05");
  ExpectLayerNormError(input.view(), std::nullopt, {0.0f, 1},
                       "eps: must be finite and > 0, got 0");
  ExpectLayerNormError(
      input.view(), std::nullopt, {1e-5f, 4},
      "normalized_ndim: 4 is not in [1, rank of input 3] (input "
      "shape [2, 3, 4])");
  ExpectLayerNormError(mask.view(), std::nullopt, {},
                       "input: dtype UINT8 not supported, expected FLOAT32 or "
                       "BFLOAT16 or FLOAT16");
}

// NaN or +-Inf in a row of the input makes that row NaN (its mean is NaN or
// Inf, and x - mean NaN somewhere); in gamma or beta it reaches that column
// of every row as IEEE arithmetic does. Against the float64 reference, over
// widths with and without a vector tail.
struct LayerNormNonFiniteCase {
  const char* where;  // "input", "gamma" or "beta"
  float value;
  DType dtype;
  int64_t cols;
};

std::string LayerNormNonFiniteName(const LayerNormNonFiniteCase& c) {
  const std::string value = std::isnan(c.value) ? "NaN"
                            : c.value > 0       ? "PlusInf"
                                                : "MinusInf";
  return absl::StrCat(c.where, "_", value, "_", DTypeName(c.dtype), "_",
                      c.cols);
}

void PrintTo(const LayerNormNonFiniteCase& c, std::ostream* os) {
  *os << LayerNormNonFiniteName(c);
}

class LayerNormNonFiniteTest
    : public ::testing::TestWithParam<LayerNormNonFiniteCase> {};

TEST_P(LayerNormNonFiniteTest, PropagatesAsTheReferenceDoes) {
  const LayerNormNonFiniteCase& c = GetParam();
  constexpr int64_t kRows = 4, kBadRow = 1;
  const int64_t bad_col = c.cols - 2;
  std::mt19937 rng(5);
  Tensor input = RandomTensor(DType::kFloat32, {kRows, c.cols}, rng);
  Tensor gamma = RandomTensor(DType::kFloat32, {c.cols}, rng);
  Tensor beta = RandomTensor(DType::kFloat32, {c.cols}, rng);
  const std::string where = c.where;
  if (where == "input") input.data_as<float>()[kBadRow * c.cols + 3] = c.value;
  if (where == "gamma") gamma.data_as<float>()[bad_col] = c.value;
  if (where == "beta") beta.data_as<float>()[bad_col] = c.value;
  input = *Float32ToTensor(input.data_as<float>(), input.shape(), c.dtype);
  gamma = *Float32ToTensor(gamma.data_as<float>(), gamma.shape(), c.dtype);
  beta = *Float32ToTensor(beta.data_as<float>(), beta.shape(), c.dtype);
  auto out = LayerNorm(input.view(), gamma.view(), beta.view(), {});
  ASSERT_TRUE(out.ok()) << out.status();
  const RefTensor ref = RefLayerNorm(ToRef(input.view()), ToRef(gamma.view()),
                                     ToRef(beta.view()), 1e-5, 1);
  const Tolerance tol = ToleranceFor(c.dtype);
  EXPECT_TRUE(AllClose(out->view(), ref, tol));
  // The rule, spelled out.
  const RefTensor got = ToRef(out->view());
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t col = 0; col < c.cols; ++col) {
      const double x = got.values[r * c.cols + col];
      if (where == "input") {
        EXPECT_EQ(std::isnan(x), r == kBadRow) << r << "," << col;
      } else if (col != bad_col) {
        EXPECT_TRUE(std::isfinite(x)) << r << "," << col;
      } else if (std::isnan(c.value)) {
        EXPECT_TRUE(std::isnan(x)) << r;
      } else if (where == "beta") {
        EXPECT_EQ(x, c.value) << r;
      } else {
        EXPECT_TRUE(std::isinf(x)) << r;  // gamma: +-Inf by the sign of x
      }
    }
  }
}

std::vector<LayerNormNonFiniteCase> LayerNormNonFiniteCases() {
  std::vector<LayerNormNonFiniteCase> cases;
  for (const char* where : {"input", "gamma", "beta"}) {
    for (float value : {NAN, INFINITY, -INFINITY}) {
      for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        for (int64_t cols : {7, 64, 768}) {
          cases.push_back({where, value, dtype, cols});
        }
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Table, LayerNormNonFiniteTest,
                         ::testing::ValuesIn(LayerNormNonFiniteCases()),
                         [](const auto& info) {
                           return LayerNormNonFiniteName(info.param);
                         });

}  // namespace
}  // namespace attnserve::testing
