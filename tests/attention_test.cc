// The core's Attend against the float64 reference over a table of shapes,
// masks and options, and its input checks.
#include "core/attention.h"

#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/convert.h"
#include "core/primitives.h"
#include "core/row_ops.h"
#include "gtest/gtest.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {
namespace {

struct AttendCase {
  std::string name;
  Shape batch = {};  // leading dims
  int64_t lq = 0, lk = 0, dk = 0, dv = 0;
  std::optional<Shape> mask_shape = std::nullopt;  // over [batch..., Lq, Lk]
  DType mask_dtype = DType::kBool;
  bool causal = false;
  std::optional<float> scale = std::nullopt;
  std::optional<float> temperature = std::nullopt;
  double keep = 0.7;
  DType dtype = DType::kFloat32;  // probability that a mask keeps a position
};

Shape With(Shape lead, std::initializer_list<int64_t> tail) {
  lead.insert(lead.end(), tail);
  return lead;
}

void PrintTo(const AttendCase& c, std::ostream* os) { *os << c.name; }

class AttendTableTest : public ::testing::TestWithParam<AttendCase> {};

void ExpectMatchesReference(const AttendCase& c) {
  std::mt19937 rng(1234);
  Tensor q = RandomTensor(c.dtype, With(c.batch, {c.lq, c.dk}), rng);
  Tensor k = RandomTensor(c.dtype, With(c.batch, {c.lk, c.dk}), rng);
  Tensor v = RandomTensor(c.dtype, With(c.batch, {c.lk, c.dv}), rng);
  std::optional<Tensor> mask;
  if (c.mask_shape) {
    if (c.mask_dtype == DType::kFloat32) {
      // Additive: finite values plus some -inf.
      mask = RandomTensor(DType::kFloat32, *c.mask_shape, rng);
      Tensor keep = RandomTensor(DType::kBool, *c.mask_shape, rng, c.keep);
      for (int64_t i = 0; i < mask->num_elements(); ++i) {
        if (keep.data_as<uint8_t>()[i] == 0)
          mask->data_as<float>()[i] = -INFINITY;
      }
    } else {
      mask = RandomTensor(c.mask_dtype, *c.mask_shape, rng, c.keep);
    }
  }

  AttendInputs in{q.view(), k.view(), v.view(), std::nullopt};
  if (mask) in.attn_mask = mask->view();
  AttentionOptions options;
  options.causal = c.causal;
  options.scale = c.scale;
  options.temperature = c.temperature;
  options.return_weights = true;
  auto result = Attend(in, options);
  ASSERT_TRUE(result.ok()) << result.status();

  std::vector<RefTensor> masks;
  std::vector<bool> keep;
  if (mask) {
    masks.push_back(ToRef(mask->view()));
    keep.push_back(c.mask_dtype != DType::kFloat32);
  }
  RefAttentionOptions ref_options{c.causal, c.scale, c.temperature};
  const RefAttentionResult ref =
      RefAttend(ToRef(q.view()), ToRef(k.view()), ToRef(v.view()), masks, keep,
                ref_options);
  EXPECT_EQ(result->output.dtype(), c.dtype);
  EXPECT_TRUE(
      AllClose(result->output.view(), ref.output, ToleranceFor(c.dtype)));
  ASSERT_TRUE(result->weights.has_value());
  EXPECT_EQ(result->weights->dtype(), DType::kFloat32);
  EXPECT_TRUE(
      AllClose(result->weights->view(), ref.weights, kFloat32Tolerance));

  // Without weights the output is the same (a different code path).
  options.return_weights = false;
  auto no_weights = Attend(in, options);
  ASSERT_TRUE(no_weights.ok()) << no_weights.status();
  EXPECT_FALSE(no_weights->weights.has_value());
  EXPECT_TRUE(
      AllClose(no_weights->output.view(), ref.output, ToleranceFor(c.dtype)));
}

const AttendCase kAttendCases[] = {
    {"rank2_square", {}, 8, 8, 16, 16},
    {"odd_sizes", {3}, 7, 13, 5, 9},
    {"cross_lq_gt_lk", {2}, 17, 3, 8, 4},
    {"b_h_l_d", {2, 3}, 10, 12, 64, 32},
    {"five_dims", {2, 1, 3}, 4, 6, 8, 8},
    {"single_query", {2, 2}, 1, 33, 16, 16},
    {"single_key", {2}, 5, 1, 16, 8},
    {"dk_one", {2}, 6, 6, 1, 3},
    {"long_keys", {1}, 4, 1000, 32, 16},
    {"bool_mask_lq_lk", {2, 2}, 6, 7, 8, 8, Shape{6, 7}, DType::kBool},
    {"uint8_mask_full", {2, 2}, 6, 7, 8, 8, Shape{2, 2, 6, 7}, DType::kUInt8},
    {"uint8_mask_broadcast_heads",
     {2, 3},
     5,
     5,
     8,
     8,
     Shape{2, 1, 5, 5},
     DType::kUInt8},
    {"bool_mask_broadcast_query",
     {2},
     5,
     9,
     8,
     8,
     Shape{2, 1, 9},
     DType::kBool},
    {"bool_mask_key_only", {2}, 5, 9, 8, 8, Shape{9}, DType::kBool},
    {"additive_mask_with_inf",
     {2, 2},
     6,
     6,
     8,
     8,
     Shape{2, 2, 6, 6},
     DType::kFloat32},
    {"additive_mask_broadcast", {3}, 4, 5, 8, 8, Shape{4, 5}, DType::kFloat32},
    {"mostly_masked_rows",
     {4},
     6,
     3,
     8,
     8,
     Shape{4, 6, 3},
     DType::kBool,
     false,
     std::nullopt,
     std::nullopt,
     0.2},
    {"all_masked",
     {2},
     3,
     4,
     8,
     8,
     Shape{2, 3, 4},
     DType::kBool,
     false,
     std::nullopt,
     std::nullopt,
     0.0},
    {"additive_all_inf",
     {2},
     3,
     4,
     8,
     8,
     Shape{3, 4},
     DType::kFloat32,
     false,
     std::nullopt,
     std::nullopt,
     0.0},
    {"causal_square", {2, 2}, 9, 9, 8, 8, std::nullopt, DType::kBool, true},
    {"causal_lq_lt_lk", {3}, 7, 11, 16, 24, std::nullopt, DType::kBool, true},
    {"causal_lq_gt_lk", {3}, 11, 4, 16, 8, std::nullopt, DType::kBool, true},
    {"causal_with_mask",
     {2},
     6,
     6,
     8,
     8,
     Shape{2, 6, 6},
     DType::kUInt8,
     true,
     std::nullopt,
     std::nullopt,
     0.5},
    {"scale", {2}, 5, 6, 8, 8, std::nullopt, DType::kBool, false, 0.3f},
    {"negative_scale",
     {2},
     5,
     6,
     8,
     8,
     std::nullopt,
     DType::kBool,
     false,
     -2.0f},
    {"zero_scale", {2}, 5, 6, 8, 8, std::nullopt, DType::kBool, false, 0.0f},
    {"temperature_half",
     {2, 2},
     10,
     10,
     64,
     64,
     std::nullopt,
     DType::kBool,
     false,
     std::nullopt,
     0.5f},
    {"scale_and_temperature",
     {2},
     5,
     6,
     8,
     8,
     Shape{5, 6},
     DType::kFloat32,
     true,
     2.0f,
     3.0f},
    {"bf16",
     {1, 2},
     32,
     32,
     64,
     64,
     std::nullopt,
     DType::kBool,
     false,
     std::nullopt,
     std::nullopt,
     0.7,
     DType::kBFloat16},
    {"bf16_masked_causal",
     {2},
     9,
     13,
     16,
     8,
     Shape{2, 9, 13},
     DType::kBool,
     true,
     std::nullopt,
     std::nullopt,
     0.7,
     DType::kBFloat16},
    {"f16",
     {2},
     6,
     7,
     16,
     8,
     std::nullopt,
     DType::kBool,
     false,
     std::nullopt,
     std::nullopt,
     0.7,
     DType::kFloat16},
    // clang-format off
    // Several query and key tiles, with partial tiles at the ends.
    {"tiles", {2}, 150, 600, 32, 24},
    {"tiles_causal", {1, 2}, 300, 300, 16, 16, std::nullopt, DType::kBool, true},
    {"tiles_causal_lq_gt_lk", {2}, 200, 70, 16, 8, std::nullopt, DType::kBool, true},
    {"tiles_causal_lq_lt_lk", {2}, 70, 600, 16, 8, std::nullopt, DType::kBool, true},
    {"tiles_sparse_mask", {2}, 130, 530, 8, 8, Shape{2, 130, 530}, DType::kBool,
     false, std::nullopt, std::nullopt, 0.05},
    {"tiles_additive_mask", {2}, 130, 530, 8, 8, Shape{130, 530}, DType::kFloat32,
     true, std::nullopt, std::nullopt, 0.5},
    {"tiles_key_mask", {3}, 65, 257, 8, 8, Shape{3, 1, 257}, DType::kUInt8, false,
     std::nullopt, std::nullopt, 0.01},
    // clang-format on
};

TEST_P(AttendTableTest, MatchesFloat64Reference) {
  ExpectMatchesReference(GetParam());
}

// The same table on the portable row operations, as on a CPU without
// AVX-512.
class AttendScalarTest : public AttendTableTest {
 protected:
  void SetUp() override { SetRowOpsForTesting(&ScalarRowOps()); }
  void TearDown() override { SetRowOpsForTesting(nullptr); }
};

TEST_P(AttendScalarTest, MatchesFloat64Reference) {
  ExpectMatchesReference(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Scalar, AttendScalarTest,
                         ::testing::ValuesIn(kAttendCases),
                         [](const auto& info) { return info.param.name; });

INSTANTIATE_TEST_SUITE_P(Table, AttendTableTest,
                         ::testing::ValuesIn(kAttendCases),
                         [](const auto& info) { return info.param.name; });

TEST(AttendTest, FullyMaskedRowIsExactlyZero) {
  std::mt19937 rng(7);
  Tensor q = RandomTensor(DType::kFloat32, {1, 3, 4}, rng);
  Tensor k = RandomTensor(DType::kFloat32, {1, 5, 4}, rng);
  Tensor v = RandomTensor(DType::kFloat32, {1, 5, 2}, rng);
  Tensor mask = *Tensor::Zeros(DType::kBool, {3, 5});
  for (int j = 0; j < 5; ++j) mask.data_as<uint8_t>()[2 * 5 + j] = 1;  // row 2
  AttentionOptions options;
  options.return_weights = true;
  auto r = Attend({q.view(), k.view(), v.view(), mask.view()}, options);
  ASSERT_TRUE(r.ok()) << r.status();
  for (int i = 0; i < 2 * 2; ++i)
    EXPECT_EQ(r->output.data_as<float>()[i], 0.0f);
  for (int i = 0; i < 2 * 5; ++i)
    EXPECT_EQ(r->weights->data_as<float>()[i], 0.0f);
  float row_sum = 0;
  for (int j = 0; j < 5; ++j) row_sum += r->weights->data_as<float>()[10 + j];
  EXPECT_NEAR(row_sum, 1.0f, 1e-6);
}

TEST(AttendTest, LargeLogitsStayFinite) {
  // Logits around 1e4: a softmax without the max subtraction overflows.
  Tensor q = *Tensor::Allocate(DType::kFloat32, {2, 8});
  Tensor k = *Tensor::Allocate(DType::kFloat32, {3, 8});
  Tensor v = *Tensor::Allocate(DType::kFloat32, {3, 1});
  for (int i = 0; i < 16; ++i) q.data_as<float>()[i] = 100.0f;
  for (int i = 0; i < 24; ++i) k.data_as<float>()[i] = 100.0f + (i / 8);
  for (int i = 0; i < 3; ++i) v.data_as<float>()[i] = float(i);
  auto r = Attend({q.view(), k.view(), v.view(), std::nullopt}, {});
  ASSERT_TRUE(r.ok()) << r.status();
  for (int i = 0; i < 2; ++i)
    EXPECT_FLOAT_EQ(r->output.data_as<float>()[i], 2.0f);
}

TEST(AttendTest, EmptyDimsGiveEmptyOrZeroResults) {
  Tensor q = *Tensor::Zeros(DType::kFloat32, {2, 3, 4});
  Tensor k = *Tensor::Zeros(DType::kFloat32, {2, 0, 4});
  Tensor v = *Tensor::Zeros(DType::kFloat32, {2, 0, 5});
  AttentionOptions options;
  options.return_weights = true;
  auto r = Attend({q.view(), k.view(), v.view(), std::nullopt}, options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->output.shape(), (Shape{2, 3, 5}));
  for (int i = 0; i < 30; ++i) EXPECT_EQ(r->output.data_as<float>()[i], 0.0f);
  EXPECT_EQ(r->weights->shape(), (Shape{2, 3, 0}));
}

TEST(AttendTest, PrimitivesAreCreatedOncePerShape) {
  std::mt19937 rng(3);
  Tensor q = RandomTensor(DType::kFloat32, {2, 4, 9, 16}, rng);
  Tensor k = RandomTensor(DType::kFloat32, {2, 4, 11, 16}, rng);
  Tensor v = RandomTensor(DType::kFloat32, {2, 4, 11, 8}, rng);
  AttendInputs in{q.view(), k.view(), v.view(), std::nullopt};
  ASSERT_TRUE(Attend(in, {}).ok());
  const int64_t after_first = PrimitiveCache::Global().creations();
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(Attend(in, {}).ok());
  EXPECT_EQ(PrimitiveCache::Global().creations(), after_first);
}

TEST(RowOpsTest, VectorizedMatchesScalar) {
  const RowOps& fast = GetRowOps();
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

TEST(AttendTest, CancelledCallStopsWithCancelled) {
  std::mt19937 rng(12);
  Tensor q = RandomTensor(DType::kFloat32, {2, 300, 16}, rng);
  Tensor k = RandomTensor(DType::kFloat32, {2, 300, 16}, rng);
  Tensor v = RandomTensor(DType::kFloat32, {2, 300, 16}, rng);
  std::atomic<bool> cancelled{true};
  AttentionOptions options;
  options.cancelled = &cancelled;
  auto r = Attend({q.view(), k.view(), v.view(), std::nullopt}, options);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled);
  cancelled = false;
  EXPECT_TRUE(
      Attend({q.view(), k.view(), v.view(), std::nullopt}, options).ok());
}

struct BadAttend {
  std::string name;
  Shape q = {}, k = {}, v = {};
  std::optional<Shape> mask = std::nullopt;
  DType mask_dtype = DType::kBool;
  std::optional<float> scale = std::nullopt, temperature = std::nullopt;
  DType key_dtype = DType::kFloat32;
  std::string message = "";
};

void PrintTo(const BadAttend& c, std::ostream* os) { *os << c.name; }

class AttendErrorTest : public ::testing::TestWithParam<BadAttend> {};

TEST_P(AttendErrorTest, NamesTheField) {
  const BadAttend& c = GetParam();
  std::mt19937 rng(5);
  Tensor q = RandomTensor(DType::kFloat32, c.q, rng);
  Tensor k = RandomTensor(c.key_dtype, c.k, rng);
  Tensor v = RandomTensor(DType::kFloat32, c.v, rng);
  std::optional<Tensor> mask;
  if (c.mask) mask = RandomTensor(c.mask_dtype, *c.mask, rng);
  if (mask && c.mask_dtype == DType::kFloat32)
    mask->data_as<float>()[0] = INFINITY;
  AttentionOptions options;
  options.scale = c.scale;
  options.temperature = c.temperature;
  AttendInputs in{q.view(), k.view(), v.view(), std::nullopt};
  if (mask) in.attn_mask = mask->view();
  auto r = Attend(in, options);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), c.message);
}

INSTANTIATE_TEST_SUITE_P(
    Table, AttendErrorTest,
    ::testing::Values(
        BadAttend{"rank1",
                  {4},
                  {4},
                  {4},
                  {},
                  DType::kBool,
                  {},
                  {},
                  DType::kFloat32,
                  "query: rank 1 (shape [4]), expected rank >= 2"},
        BadAttend{"key_rank",
                  {2, 3, 4},
                  {3, 4},
                  {3, 4},
                  {},
                  DType::kBool,
                  {},
                  {},
                  DType::kFloat32,
                  "key: rank 2 != query rank 3 (shapes [3, 4] and [2, 3, 4])"},
        BadAttend{"key_last_dim",
                  {2, 3, 64},
                  {2, 5, 32},
                  {2, 5, 8},
                  {},
                  DType::kBool,
                  {},
                  {},
                  DType::kFloat32,
                  "key: last dim 32 != query last dim 64"},
        BadAttend{"batch_dim",
                  {2, 3, 4},
                  {3, 5, 4},
                  {2, 5, 4},
                  {},
                  DType::kBool,
                  {},
                  {},
                  DType::kFloat32,
                  "key: dim 0 3 != query dim 0 2"},
        BadAttend{"value_len",
                  {2, 3, 4},
                  {2, 5, 4},
                  {2, 6, 4},
                  {},
                  DType::kBool,
                  {},
                  {},
                  DType::kFloat32,
                  "value: dim 1 6 != key dim 1 5"},
        BadAttend{"key_dtype",
                  {3, 4},
                  {3, 4},
                  {3, 4},
                  {},
                  DType::kBool,
                  {},
                  {},
                  DType::kBFloat16,
                  "key: dtype BFLOAT16 != query dtype FLOAT32"},
        BadAttend{
            "mask_broadcast",
            {2, 3, 4},
            {2, 5, 4},
            {2, 5, 4},
            Shape{3, 4},
            DType::kBool,
            {},
            {},
            DType::kFloat32,
            "attn_mask: shape [3, 4] does not broadcast to [2, 3, 5] (dim 1 is "
            "4, expected 1 or 5)"},
        BadAttend{"mask_rank",
                  {3, 4},
                  {5, 4},
                  {5, 4},
                  Shape{2, 3, 5},
                  DType::kBool,
                  {},
                  {},
                  DType::kFloat32,
                  "attn_mask: rank 3 (shape [2, 3, 5]) exceeds the rank of the "
                  "logits [3, 5]"},
        BadAttend{
            "mask_plus_inf",
            {3, 4},
            {5, 4},
            {5, 4},
            Shape{3, 5},
            DType::kFloat32,
            {},
            {},
            DType::kFloat32,
            "attn_mask: FLOAT32 mask values must be finite or -inf, found inf "
            "at flat index 0"},
        BadAttend{"mask_dtype",
                  {3, 4},
                  {5, 4},
                  {5, 4},
                  Shape{3, 5},
                  DType::kBFloat16,
                  {},
                  {},
                  DType::kFloat32,
                  "attn_mask: dtype BFLOAT16 not supported, expected BOOL or "
                  "UINT8 or "
                  "FLOAT32"},
        BadAttend{"zero_temperature",
                  {3, 4},
                  {5, 4},
                  {5, 4},
                  {},
                  DType::kBool,
                  {},
                  0.0f,
                  DType::kFloat32,
                  "temperature: must be finite and > 0, got 0"},
        BadAttend{"negative_temperature",
                  {3, 4},
                  {5, 4},
                  {5, 4},
                  {},
                  DType::kBool,
                  {},
                  -1.0f,
                  DType::kFloat32,
                  "temperature: must be finite and > 0, got -1"},
        BadAttend{"nan_scale",
                  {3, 4},
                  {5, 4},
                  {5, 4},
                  {},
                  DType::kBool,
                  NAN,
                  {},
                  DType::kFloat32,
                  "scale: must be finite, got nan"}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace attnserve::testing
