// The core's LayerNorm against the float64 reference, and its input checks.
#include <optional>
#include <random>
#include <string>

#include "core/attention.h"
#include "core/convert.h"
#include "gtest/gtest.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {
namespace {

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
  Tensor input = RandomTensor(DType::kFloat32, c.shape, rng);
  for (int64_t i = 0; i < input.num_elements(); ++i) {
    input.data_as<float>()[i] = input.data_as<float>()[i] * 3.0f + c.offset;
  }
  if (c.dtype != DType::kFloat32) {
    input = *Float32ToTensor(input.data_as<float>(), input.shape(), c.dtype);
  }
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

TEST(LayerNormTest, ConstantRowGivesBeta) {
  Tensor input = *Tensor::Allocate(DType::kFloat32, {2, 4});
  for (int i = 0; i < 8; ++i) input.data_as<float>()[i] = 3.0f;
  Tensor beta = *Tensor::Allocate(DType::kFloat32, {4});
  for (int i = 0; i < 4; ++i) beta.data_as<float>()[i] = float(i);
  auto out = LayerNorm(input.view(), std::nullopt, beta.view(), {});
  ASSERT_TRUE(out.ok()) << out.status();
  for (int i = 0; i < 8; ++i)
    EXPECT_FLOAT_EQ(out->data_as<float>()[i], float(i % 4));
}

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

}  // namespace
}  // namespace attnserve::testing
