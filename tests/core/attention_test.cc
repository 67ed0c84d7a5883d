// The core's Attend against the float64 reference over a table of shapes,
// masks and options, and its input checks.
#include "core/attention.h"

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
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
    // Key dim 0: every logit is 0 (the scale is given: the reference's
    // default 1/sqrt(0) is not finite), uniform weights over the keys seen.
    {"dk_zero", {2}, 6, 9, 0, 5, std::nullopt, DType::kBool, false, 1.0f},
    {"dk_zero_causal",
     {2, 2},
     9,
     6,
     0,
     4,
     std::nullopt,
     DType::kBool,
     true,
     1.0f},
    {"dk_zero_causal_lq_lt_lk",
     {1},
     5,
     9,
     0,
     3,
     std::nullopt,
     DType::kBool,
     true,
     1.0f},
    {"dk_zero_bf16",
     {2},
     6,
     9,
     0,
     5,
     std::nullopt,
     DType::kBool,
     true,
     1.0f,
     std::nullopt,
     0.7,
     DType::kBFloat16},
    {"dk_zero_f16",
     {2},
     6,
     9,
     0,
     5,
     std::nullopt,
     DType::kBool,
     false,
     1.0f,
     std::nullopt,
     0.7,
     DType::kFloat16},
    {"dk_zero_masked", {2}, 6, 9, 0, 5, Shape{6, 9}, DType::kBool, false, 1.0f},
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

// Sets `flag` after `delay` unless destroyed first: a call that ignores its
// key or value dims of 0 ends CANCELLED instead of running for minutes.
class Watchdog {
 public:
  Watchdog(std::atomic<bool>* flag, std::chrono::milliseconds delay)
      : thread_([this, flag, delay] {
          std::unique_lock<std::mutex> lock(mu_);
          if (!cv_.wait_for(lock, delay, [this] { return done_; })) {
            flag->store(true);
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

TEST(AttendTest, ValueDimZeroComputesNoLogits) {
  // 2^48 logits, none of which reaches the (empty) output.
  const int64_t len = int64_t{1} << 24;
  Tensor q = *Tensor::Zeros(DType::kFloat32, {1, 1, len, 0});
  Tensor k = *Tensor::Zeros(DType::kFloat32, {1, 1, len, 0});
  Tensor v = *Tensor::Zeros(DType::kFloat32, {1, 1, len, 0});
  std::atomic<bool> cancelled{false};
  AttentionOptions options;
  options.cancelled = &cancelled;
  options.causal = true;
  Watchdog watchdog(&cancelled, std::chrono::seconds(20));
  auto r = Attend({q.view(), k.view(), v.view(), std::nullopt}, options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->output.shape(), (Shape{1, 1, len, 0}));
}

// Key dim 0 without a mask: each query's output is the mean of the values
// it sees, computed without its query_len x key_len logits.
TEST(AttendTest, KeyDimZeroIsTheMeanOfTheValuesSeen) {
  std::mt19937 rng(41);
  for (const bool causal : {false, true}) {
    for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      // Several poll intervals of rows, queries beyond the keys.
      const int64_t lq = 2600, lk = 2100, dv = 3;
      Tensor q = *Tensor::Zeros(dtype, {2, lq, 0});
      Tensor k = *Tensor::Zeros(dtype, {2, lk, 0});
      Tensor v = RandomTensor(dtype, {2, lk, dv}, rng);
      AttentionOptions options;
      options.causal = causal;
      auto r = Attend({q.view(), k.view(), v.view(), std::nullopt}, options);
      ASSERT_TRUE(r.ok()) << r.status();
      const RefTensor values = ToRef(v.view());
      RefTensor expected{{2, lq, dv}, std::vector<double>(2 * lq * dv)};
      for (int64_t b = 0; b < 2; ++b) {
        std::vector<double> sum(dv, 0.0);
        int64_t seen = 0;
        for (int64_t i = 0; i < lq; ++i) {
          const int64_t visible = causal ? std::min(i + 1, lk) : lk;
          for (; seen < visible; ++seen) {
            for (int64_t c = 0; c < dv; ++c) {
              sum[c] += values.values[(b * lk + seen) * dv + c];
            }
          }
          for (int64_t c = 0; c < dv; ++c) {
            expected.values[(b * lq + i) * dv + c] = sum[c] / visible;
          }
        }
      }
      EXPECT_TRUE(AllClose(r->output.view(), expected, ToleranceFor(dtype)))
          << (causal ? "causal " : "") << DTypeName(dtype);
    }
  }
}

TEST(AttendTest, KeyDimZeroWithMillionsOfKeysIsLinear) {
  // 2^40 logits for the tiled kernel; 2^21 value rows read here.
  const int64_t len = int64_t{1} << 20;
  Tensor q = *Tensor::Zeros(DType::kFloat32, {1, 1, len, 0});
  Tensor k = *Tensor::Zeros(DType::kFloat32, {1, 1, len, 0});
  Tensor v = *Tensor::Allocate(DType::kFloat32, {1, 1, len, 1});
  for (int64_t i = 0; i < len; ++i) v.data_as<float>()[i] = i % 2 ? 1.0f : 3.0f;
  std::atomic<bool> cancelled{false};
  AttentionOptions options;
  options.cancelled = &cancelled;
  Watchdog watchdog(&cancelled, std::chrono::seconds(20));
  auto r = Attend({q.view(), k.view(), v.view(), std::nullopt}, options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->output.data_as<float>()[0], 2.0f);
  EXPECT_EQ(r->output.data_as<float>()[len - 1], 2.0f);
  options.causal = true;
  r = Attend({q.view(), k.view(), v.view(), std::nullopt}, options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->output.data_as<float>()[0], 3.0f);
  EXPECT_EQ(r->output.data_as<float>()[1], 2.0f);
  cancelled = true;
  EXPECT_EQ(Attend({q.view(), k.view(), v.view(), std::nullopt}, options)
                .status()
                .code(),
            absl::StatusCode::kCancelled);
}

// One block of queries over 2^24 keys is a single work item: the
// cancellation is polled at every key block inside it too.
TEST(AttendTest, CancelStopsABlockOfQueriesAmongManyKeys) {
  std::mt19937 rng(13);
  const int64_t keys = int64_t{1} << 23;
  Tensor q = RandomTensor(DType::kFloat32, {1, 1, 64, 1}, rng);
  Tensor k = RandomTensor(DType::kFloat32, {1, 1, keys, 1}, rng);
  Tensor v = RandomTensor(DType::kFloat32, {1, 1, keys, 1}, rng);
  const AttendInputs in{q.view(), k.view(), v.view(), std::nullopt};
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(Attend(in, {}).ok());
  const auto full = std::chrono::steady_clock::now() - start;
  std::atomic<bool> cancelled{false};
  AttentionOptions options;
  options.cancelled = &cancelled;
  const auto cancel_start = std::chrono::steady_clock::now();
  absl::Status status;
  {
    Watchdog watchdog(
        &cancelled,
        std::chrono::duration_cast<std::chrono::milliseconds>(full / 10));
    status = Attend(in, options).status();
  }
  const auto cancelled_after = std::chrono::steady_clock::now() - cancel_start;
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_LT(cancelled_after, full / 2)
      << "full call " << std::chrono::duration<double>(full).count()
      << " s, cancelled after "
      << std::chrono::duration<double>(cancelled_after).count() << " s";
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

// Non-finite inputs: NaN and +-Inf propagate as IEEE arithmetic does
// (README, Semantics); masked positions are not read.

void SetElement(Tensor& t, int64_t i, float value) {
  switch (t.dtype()) {
    case DType::kBFloat16:
      t.data_as<uint16_t>()[i] = FloatToBFloat16(value);
      break;
    case DType::kFloat16:
      t.data_as<uint16_t>()[i] = FloatToFloat16(value);
      break;
    default:
      t.data_as<float>()[i] = value;
  }
}

enum class Corrupt { kQuery, kKey, kValue };
// kMask: a BOOL mask hides the corrupted key from every row but the last,
// and hides every key from row 3 (which holds a corrupted query too).
enum class Exclusion { kNone, kMask, kCausal };

struct NonFiniteCase {
  Corrupt where;
  float value;
  DType dtype;
  Exclusion exclusion;
  int row_ops;  // index into SupportedRowOps()
};

std::string NonFiniteName(const NonFiniteCase& c) {
  const char* where[] = {"query", "key", "value"};
  const char* exclusion[] = {"", "_masked", "_causal"};
  std::string value = std::isnan(c.value) ? "NaN"
                      : c.value > 0       ? "PlusInf"
                                          : "MinusInf";
  return absl::StrCat(where[static_cast<int>(c.where)], "_", value, "_",
                      DTypeName(c.dtype),
                      exclusion[static_cast<int>(c.exclusion)], "_",
                      SupportedRowOps()[c.row_ops]->name);
}

class AttendNonFiniteTest : public ::testing::TestWithParam<NonFiniteCase> {
 protected:
  void SetUp() override {
    SetRowOpsForTesting(SupportedRowOps()[GetParam().row_ops]);
  }
  void TearDown() override { SetRowOpsForTesting(nullptr); }
};

// Batch 2 (batch 1 corrupted, batch 0 clean), Lq 6, Lk 9, dk 8, dv 5.
constexpr int64_t kLq = 6, kLk = 9, kDk = 8, kDv = 5;
constexpr int64_t kBadKey = 4, kBadColumn = 2;

TEST_P(AttendNonFiniteTest, PropagatesAsTheReferenceDoes) {
  const NonFiniteCase& c = GetParam();
  std::mt19937 rng(31);
  Tensor q = RandomTensor(c.dtype, {2, kLq, kDk}, rng);
  Tensor k = RandomTensor(c.dtype, {2, kLk, kDk}, rng);
  Tensor v = RandomTensor(c.dtype, {2, kLk, kDv}, rng);
  switch (c.where) {
    case Corrupt::kQuery:  // rows 2 and 3
      SetElement(q, (kLq + 2) * kDk + 1, c.value);
      SetElement(q, (kLq + 3) * kDk + 5, c.value);
      break;
    case Corrupt::kKey:
      SetElement(k, (kLk + kBadKey) * kDk + 1, c.value);
      break;
    case Corrupt::kValue:
      SetElement(v, (kLk + kBadKey) * kDv + kBadColumn, c.value);
      break;
  }
  std::optional<Tensor> mask;
  if (c.exclusion == Exclusion::kMask) {
    mask = *Tensor::Allocate(DType::kBool, {kLq, kLk});
    for (int64_t i = 0; i < kLq; ++i) {
      for (int64_t j = 0; j < kLk; ++j) {
        const bool keep = i != 3 && (j != kBadKey || i == kLq - 1);
        mask->data_as<uint8_t>()[i * kLk + j] = keep ? 1 : 0;
      }
    }
  }
  AttendInputs in{q.view(), k.view(), v.view(), std::nullopt};
  if (mask) in.attn_mask = mask->view();
  AttentionOptions options;
  options.causal = c.exclusion == Exclusion::kCausal;
  options.return_weights = true;
  auto with_weights = Attend(in, options);
  ASSERT_TRUE(with_weights.ok()) << with_weights.status();
  options.return_weights = false;
  auto without_weights = Attend(in, options);
  ASSERT_TRUE(without_weights.ok()) << without_weights.status();

  std::vector<RefTensor> masks;
  if (mask) masks.push_back(ToRef(mask->view()));
  const RefAttentionResult ref =
      RefAttend(ToRef(q.view()), ToRef(k.view()), ToRef(v.view()), masks,
                std::vector<bool>(masks.size(), true),
                {options.causal, std::nullopt, std::nullopt});
  const Tolerance tol = ToleranceFor(c.dtype);
  EXPECT_TRUE(AllClose(with_weights->output.view(), ref.output, tol));
  EXPECT_TRUE(AllClose(without_weights->output.view(), ref.output, tol));
  EXPECT_TRUE(
      AllClose(with_weights->weights->view(), ref.weights, kFloat32Tolerance));

  // The clean batch is finite; the rule's NaN cases, spelled out.
  const RefTensor out = ToRef(without_weights->output.view());
  const RefTensor weights = ToRef(with_weights->weights->view());
  for (int64_t e = 0; e < kLq * kDv; ++e) {
    ASSERT_TRUE(std::isfinite(out.values[e])) << e;
  }
  if (!std::isnan(c.value)) return;
  for (int64_t i = 0; i < kLq; ++i) {
    // Does row i of batch 1 keep the corrupted key?
    bool keeps_key = true;
    if (c.exclusion == Exclusion::kMask) keeps_key = i == kLq - 1;
    if (c.exclusion == Exclusion::kCausal) keeps_key = i >= kBadKey;
    const bool fully_masked = c.exclusion == Exclusion::kMask && i == 3;
    bool nan_row = false;
    if (c.where == Corrupt::kQuery) nan_row = (i == 2 || i == 3);
    if (c.where == Corrupt::kKey) nan_row = keeps_key;
    if (fully_masked) nan_row = false;
    for (int64_t col = 0; col < kDv; ++col) {
      const bool nan_value = c.where == Corrupt::kValue && keeps_key &&
                             col == kBadColumn && !fully_masked;
      const double got = out.values[(kLq + i) * kDv + col];
      EXPECT_EQ(std::isnan(got), nan_row || nan_value) << i << "," << col;
      if (fully_masked) {
        EXPECT_EQ(got, 0.0) << i << "," << col;
      }
    }
    for (int64_t j = 0; j < kLk; ++j) {
      EXPECT_EQ(std::isnan(weights.values[(kLq + i) * kLk + j]), nan_row)
          << i << "," << j;
    }
  }
}

std::vector<NonFiniteCase> NonFiniteCases() {
  std::vector<NonFiniteCase> cases;
  for (Corrupt where : {Corrupt::kQuery, Corrupt::kKey, Corrupt::kValue}) {
    for (float value : {NAN, INFINITY, -INFINITY}) {
      for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        for (Exclusion exclusion :
             {Exclusion::kNone, Exclusion::kMask, Exclusion::kCausal}) {
          for (size_t ops = 0; ops < SupportedRowOps().size(); ++ops) {
            cases.push_back(
                {where, value, dtype, exclusion, static_cast<int>(ops)});
          }
        }
      }
    }
  }
  return cases;
}

void PrintTo(const NonFiniteCase& c, std::ostream* os) {
  *os << NonFiniteName(c);
}

INSTANTIATE_TEST_SUITE_P(Table, AttendNonFiniteTest,
                         ::testing::ValuesIn(NonFiniteCases()),
                         [](const auto& info) {
                           return NonFiniteName(info.param);
                         });

// Several key tiles, a padding mask and causality: the non-finite keys and
// values all sit where the mask hides them, but for one key that some rows
// see. Excluded value rows are not read even when their tile is multiplied.
class AttendNonFiniteTilesTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { SetRowOpsForTesting(SupportedRowOps()[GetParam()]); }
  void TearDown() override { SetRowOpsForTesting(nullptr); }
};

TEST_P(AttendNonFiniteTilesTest, MaskedGarbageIsNotRead) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), causal ? " causal" : ""));
      constexpr int64_t lq = 150, lk = 600, d = 16;
      std::mt19937 rng(17);
      Tensor q = RandomTensor(dtype, {2, lq, d}, rng);
      Tensor k = RandomTensor(dtype, {2, lk, d}, rng);
      Tensor v = RandomTensor(dtype, {2, lk, d}, rng);
      Tensor padding = *Tensor::Allocate(DType::kBool, {2, 1, lk});
      for (int64_t b = 0; b < 2; ++b) {
        for (int64_t j = 0; j < lk; ++j) {
          // Padding: keys 100..139 and 520..599 of batch 1.
          const bool pad = b == 1 && ((j >= 100 && j < 140) || j >= 520);
          padding.data_as<uint8_t>()[b * lk + j] = pad ? 0 : 1;
          if (pad) {
            SetElement(k, (b * lk + j) * d + j % d, NAN);
            SetElement(v, (b * lk + j) * d + (j + 3) % d,
                       j % 2 ? NAN : -INFINITY);
          }
        }
      }
      // Key 130 of batch 0 is kept: its +Inf value reaches the rows that
      // see it (all, or rows >= 130 when causal), in column 5.
      SetElement(v, 130 * d + 5, INFINITY);
      AttentionOptions options;
      options.causal = causal;
      AttendInputs in{q.view(), k.view(), v.view(), padding.view()};
      const RefAttentionResult ref =
          RefAttend(ToRef(q.view()), ToRef(k.view()), ToRef(v.view()),
                    {ToRef(padding.view())}, {true},
                    {causal, std::nullopt, std::nullopt});
      for (bool weights : {false, true}) {
        options.return_weights = weights;
        auto r = Attend(in, options);
        ASSERT_TRUE(r.ok()) << r.status();
        const Tolerance tol = ToleranceFor(dtype);
        EXPECT_TRUE(AllClose(r->output.view(), ref.output, tol));
        if (weights) {
          EXPECT_TRUE(
              AllClose(r->weights->view(), ref.weights, kFloat32Tolerance));
        }
        // Batch 1 is entirely finite; batch 0 only has +Inf in column 5.
        const RefTensor out = ToRef(r->output.view());
        for (int64_t i = 0; i < lq; ++i) {
          for (int64_t col = 0; col < d; ++col) {
            const bool inf = col == 5 && (!causal || i >= 130);
            ASSERT_EQ(out.values[i * d + col] == INFINITY, inf) << i;
            ASSERT_TRUE(std::isfinite(out.values[(lq + i) * d + col])) << i;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    RowOps, AttendNonFiniteTilesTest,
    ::testing::Range(0, static_cast<int>(SupportedRowOps().size())),
    [](const auto& info) {
      return std::string(SupportedRowOps()[info.param]->name);
    });

TEST(AttendTest, FullyMaskedRowIsZeroWhateverTheValues) {
  // No key left: zeros, even with NaN and Inf in every value and key.
  Tensor q = *Tensor::Zeros(DType::kFloat32, {2, 4});
  Tensor k = *Tensor::Allocate(DType::kFloat32, {3, 4});
  Tensor v = *Tensor::Allocate(DType::kFloat32, {3, 2});
  for (int i = 0; i < 12; ++i) k.data_as<float>()[i] = NAN;
  for (int i = 0; i < 6; ++i) v.data_as<float>()[i] = i % 2 ? NAN : INFINITY;
  Tensor mask = *Tensor::Zeros(DType::kBool, {2, 3});
  for (bool weights : {false, true}) {
    AttentionOptions options;
    options.return_weights = weights;
    auto r = Attend({q.view(), k.view(), v.view(), mask.view()}, options);
    ASSERT_TRUE(r.ok()) << r.status();
    for (int i = 0; i < 4; ++i) EXPECT_EQ(r->output.data_as<float>()[i], 0.0f);
    if (weights) {
      for (int i = 0; i < 6; ++i)
        EXPECT_EQ(r->weights->data_as<float>()[i], 0.0f);
    }
  }
}

TEST(AttendTest, AdditiveMinusInfExcludesANaNLogit) {
  // A -inf in a FLOAT32 mask replaces the logit (NaN + -inf would be NaN).
  Tensor q = *Tensor::Allocate(DType::kFloat32, {1, 2});
  Tensor k = *Tensor::Allocate(DType::kFloat32, {2, 2});
  Tensor v = *Tensor::Allocate(DType::kFloat32, {2, 1});
  const float qv[] = {1, 1}, kv[] = {1, 0, NAN, 0}, vv[] = {3, NAN};
  std::copy(qv, qv + 2, q.data_as<float>());
  std::copy(kv, kv + 4, k.data_as<float>());
  std::copy(vv, vv + 2, v.data_as<float>());
  Tensor mask = *Tensor::Allocate(DType::kFloat32, {1, 2});
  mask.data_as<float>()[0] = 0.5f;
  mask.data_as<float>()[1] = -INFINITY;
  AttentionOptions options;
  options.return_weights = true;
  auto r = Attend({q.view(), k.view(), v.view(), mask.view()}, options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->output.data_as<float>()[0], 3.0f);
  EXPECT_EQ(r->weights->data_as<float>()[0], 1.0f);
  EXPECT_EQ(r->weights->data_as<float>()[1], 0.0f);
}

TEST(AttendTest, MaskRejectsNaNAndPlusInfNamingTheIndex) {
  Tensor q = *Tensor::Zeros(DType::kFloat32, {4, 2});
  Tensor k = *Tensor::Zeros(DType::kFloat32, {5, 2});
  Tensor v = *Tensor::Zeros(DType::kFloat32, {5, 2});
  const struct {
    float value;
    std::string message;
  } cases[] = {
      {NAN,
       "attn_mask: FLOAT32 mask values must be finite or -inf, found nan at "
       "flat index 12"},
      {-NAN,
       "attn_mask: FLOAT32 mask values must be finite or -inf, found nan at "
       "flat index 12"},
      {INFINITY,
       "attn_mask: FLOAT32 mask values must be finite or -inf, found inf at "
       "flat index 12"},
  };
  for (const auto& c : cases) {
    Tensor mask = *Tensor::Zeros(DType::kFloat32, {4, 5});
    mask.data_as<float>()[3] = -INFINITY;  // allowed
    mask.data_as<float>()[12] = c.value;
    mask.data_as<float>()[15] = NAN;  // only the first is named
    auto r = Attend({q.view(), k.view(), v.view(), mask.view()}, {});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), c.message);
  }
}

TEST(ConvertTest, NonFiniteValuesKeepTheirClass) {
  const uint32_t nan_bits[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u,
                               0x7fffffffu, 0xffffffffu, 0xff800001u};
  for (uint32_t bits : nan_bits) {
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    const uint16_t bf16 = FloatToBFloat16(f);
    const uint16_t f16 = FloatToFloat16(f);
    EXPECT_TRUE(std::isnan(BFloat16ToFloat(bf16))) << std::hex << bits;
    EXPECT_TRUE(std::isnan(Float16ToFloat(f16))) << std::hex << bits;
    EXPECT_EQ(std::signbit(BFloat16ToFloat(bf16)), std::signbit(f));
    EXPECT_EQ(std::signbit(Float16ToFloat(f16)), std::signbit(f));
  }
  for (float inf : {INFINITY, -INFINITY}) {
    EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(inf)), inf);
    EXPECT_EQ(Float16ToFloat(FloatToFloat16(inf)), inf);
  }
  // Finite values past the largest of the format round to Inf.
  EXPECT_EQ(Float16ToFloat(FloatToFloat16(70000.0f)), INFINITY);
  EXPECT_EQ(Float16ToFloat(FloatToFloat16(-70000.0f)), -INFINITY);
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(-3.4028235e38f)), -INFINITY);
  // Half NaN and Inf bit patterns widen to float NaN and Inf.
  EXPECT_TRUE(std::isnan(Float16ToFloat(0x7c01)));
  EXPECT_TRUE(std::isnan(Float16ToFloat(0xfe00)));
  EXPECT_TRUE(std::signbit(Float16ToFloat(0xfe00)));
  EXPECT_EQ(Float16ToFloat(0x7c00), INFINITY);
  EXPECT_EQ(Float16ToFloat(0xfc00), -INFINITY);
  // A whole tensor, through the copies the operations make.
  Tensor t = *Tensor::Allocate(DType::kFloat16, {3});
  t.data_as<uint16_t>()[0] = 0x7e00;
  t.data_as<uint16_t>()[1] = 0xfc00;
  t.data_as<uint16_t>()[2] = 0x3c00;
  auto bf16 = OperandData::From(t.view(), DType::kBFloat16, "x");
  ASSERT_TRUE(bf16.ok());
  const uint16_t* b = static_cast<const uint16_t*>(bf16->data());
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(b[0])));
  EXPECT_EQ(BFloat16ToFloat(b[1]), -INFINITY);
  EXPECT_EQ(BFloat16ToFloat(b[2]), 1.0f);
}

}  // namespace
}  // namespace attnserve::testing

namespace attnserve::testing {
namespace {

// `t` ([..., Hkv, L, d]) with each head repeated `group` times along dim -3,
// as torch.repeat_interleave: the reference for grouped-query attention.
RefTensor RepeatHeads(const RefTensor& t, int64_t group) {
  RefTensor out;
  out.shape = t.shape;
  const size_t rank = t.shape.size();
  out.shape[rank - 3] *= group;
  const int64_t head = t.shape[rank - 2] * t.shape[rank - 1];
  const int64_t heads = static_cast<int64_t>(t.values.size()) / head;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t g = 0; g < group; ++g) {
      out.values.insert(out.values.end(), t.values.begin() + h * head,
                        t.values.begin() + (h + 1) * head);
    }
  }
  return out;
}

struct GqaCase {
  std::string name;
  int64_t query_heads = 8;
  int64_t key_heads = 2;
  int64_t query_len = 5;
  int64_t key_len = 7;
  bool causal = false;
  bool mask = false;  // a boolean mask over [B, Hq, Lq, Lk]
  bool return_weights = false;
  DType dtype = DType::kFloat32;
};

void PrintTo(const GqaCase& c, std::ostream* os) { *os << c.name; }

class AttendGqaTest : public ::testing::TestWithParam<GqaCase> {};

TEST_P(AttendGqaTest, MatchesTheReferenceWithRepeatedHeads) {
  const GqaCase& c = GetParam();
  std::mt19937 rng(29);
  const int64_t batch = 2, dk = 16, dv = 8;
  Tensor q =
      RandomTensor(c.dtype, {batch, c.query_heads, c.query_len, dk}, rng);
  Tensor k = RandomTensor(c.dtype, {batch, c.key_heads, c.key_len, dk}, rng);
  Tensor v = RandomTensor(c.dtype, {batch, c.key_heads, c.key_len, dv}, rng);
  AttendInputs inputs{q.view(), k.view(), v.view(), std::nullopt};
  std::optional<Tensor> mask;
  std::vector<RefTensor> ref_masks;
  if (c.mask) {
    mask = *Tensor::Zeros(DType::kBool,
                          {batch, c.query_heads, c.query_len, c.key_len});
    for (int64_t i = 0; i < mask->num_elements(); ++i) {
      mask->data_as<uint8_t>()[i] = (i % 3 != 0) ? 1 : 0;
    }
    inputs.attn_mask = mask->view();
    ref_masks.push_back(ToRef(mask->view()));
  }
  AttentionOptions options;
  options.enable_gqa = true;
  options.causal = c.causal;
  options.return_weights = c.return_weights;
  auto result = Attend(inputs, options);
  ASSERT_TRUE(result.ok()) << result.status();
  const int64_t group = c.query_heads / c.key_heads;
  RefAttentionOptions ref_options;
  ref_options.causal = c.causal;
  const RefAttentionResult ref =
      RefAttend(ToRef(q.view()), RepeatHeads(ToRef(k.view()), group),
                RepeatHeads(ToRef(v.view()), group), ref_masks,
                std::vector<bool>(ref_masks.size(), true), ref_options);
  EXPECT_EQ(result->output.shape(),
            (Shape{batch, c.query_heads, c.query_len, dv}));
  EXPECT_TRUE(
      AllClose(result->output.view(), ref.output, ToleranceFor(c.dtype)));
  if (c.return_weights) {
    ASSERT_TRUE(result->weights.has_value());
    EXPECT_TRUE(
        AllClose(result->weights->view(), ref.weights, ToleranceFor(c.dtype)));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Table, AttendGqaTest,
    ::testing::Values(
        GqaCase{"gqa"}, GqaCase{"mqa", 8, 1},
        GqaCase{"causal", 8, 2, 7, 7, true},
        GqaCase{"mask_and_weights", 6, 3, 5, 7, false, true, true},
        GqaCase{"decode", 32, 8, 1, 300},
        GqaCase{"long_keys_causal", 4, 2, 70, 300, true},
        GqaCase{"bf16", 8, 2, 5, 7, false, false, false, DType::kBFloat16}),
    [](const auto& info) { return info.param.name; });

TEST(AttendGqaTest, HeadsThatDoNotDivideAreRefusedNamingThem) {
  std::mt19937 rng(31);
  Tensor q = RandomTensor(DType::kFloat32, {1, 8, 2, 4}, rng);
  Tensor k = RandomTensor(DType::kFloat32, {1, 3, 2, 4}, rng);
  Tensor v2 = RandomTensor(DType::kFloat32, {1, 2, 2, 4}, rng);
  Tensor k2 = RandomTensor(DType::kFloat32, {1, 2, 2, 4}, rng);
  AttentionOptions options;
  options.enable_gqa = true;
  auto bad = Attend({q.view(), k.view(), k.view(), std::nullopt}, options);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(),
            "key: 3 heads (dim 1) do not divide the query's 8 (enable_gqa)");
  auto value_heads =
      Attend({q.view(), k2.view(), k.view(), std::nullopt}, options);
  EXPECT_EQ(value_heads.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(value_heads.status().message().find("value"), std::string::npos)
      << value_heads.status();
  // Without enable_gqa, fewer key heads are the shape error they always were.
  auto off = Attend({q.view(), k2.view(), v2.view(), std::nullopt}, {});
  EXPECT_EQ(off.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnserve::testing
