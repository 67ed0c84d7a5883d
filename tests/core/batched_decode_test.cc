// Batched decode steps (StepSessions in core/decode_session.h) and the
// split-KV kernel under them: a batch's results equal the same steps run
// one by one, bit for bit, and attention over the whole history in float64;
// an entry that fails (refused, cancelled, repeated) fails alone and leaves
// its session as it was. Also decode-shaped Attend calls, whose key blocks
// are merged, against float64 references on every row-ops implementation.
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention.h"
#include "core/convert.h"
#include "core/decode_session.h"
#include "core/row_ops.h"
#include "gtest/gtest.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {
namespace {

struct LaneConfig {
  std::string name;
  int heads = 4;
  int kv_heads = 4;
  int64_t dk = 16, dv = 16;
  DType dtype = DType::kFloat32;
  int64_t rotary_dims = 0;
  int64_t batch = 1;
  int64_t prefill = 5;
};

// A session stepped in batches, its twin stepped one step at a time with
// the same inputs, and the history both hold (unrotated) for the
// reference.
struct Lane {
  LaneConfig c;
  std::unique_ptr<DecodeSession> batched;
  std::unique_ptr<DecodeSession> single;
  RefTensor keys, values;
  int64_t length = 0;
  // This round's inputs and results.
  Tensor q, k, v;
  TensorResults batched_results, single_results;
};

std::unique_ptr<DecodeSession> MakeSession(const LaneConfig& c) {
  DecodeSessionConfig config;
  config.num_heads = c.heads;
  config.num_kv_heads = c.kv_heads;
  config.key_dim = c.dk;
  config.value_dim = c.dv;
  config.dtype = c.dtype;
  config.rotary.dims = c.rotary_dims;
  config.batch = c.batch;
  config.max_length = 2048;
  auto session = DecodeSession::Create(config);
  EXPECT_TRUE(session.ok()) << session.status();
  return session.ok() ? std::move(*session) : nullptr;
}

class BatchedDecodeTest : public ::testing::Test {
 protected:
  void AddLane(LaneConfig c) {
    auto lane = std::make_unique<Lane>();
    lane->c = std::move(c);
    lane->batched = MakeSession(lane->c);
    lane->single = MakeSession(lane->c);
    lanes_.push_back(std::move(lane));
  }

  // New random inputs of n tokens for `lane`.
  void NewInputs(Lane& lane, int64_t n) {
    const LaneConfig& c = lane.c;
    lane.q = RandomTensor(DType::kFloat32, {c.batch, c.heads, n, c.dk}, rng_);
    lane.k =
        RandomTensor(DType::kFloat32, {c.batch, c.kv_heads, n, c.dk}, rng_);
    lane.v =
        RandomTensor(DType::kFloat32, {c.batch, c.kv_heads, n, c.dv}, rng_);
    lane.batched_results = TensorResults();
    lane.single_results = TensorResults();
  }

  static DecodeStepInputs InputsOf(const Lane& lane) {
    DecodeStepInputs in;
    in.query = lane.q.view();
    in.key = lane.k.view();
    in.value = lane.v.view();
    return in;
  }

  // Checks lane's batched output: bitwise the single session's, and
  // attention over the history in float64.
  void CheckLane(Lane& lane) {
    const LaneConfig& c = lane.c;
    const int64_t n = lane.q.shape()[2];
    std::optional<Tensor> got = lane.batched_results.Take("output");
    std::optional<Tensor> want = lane.single_results.Take("output");
    ASSERT_TRUE(got.has_value() && want.has_value()) << c.name;
    ASSERT_EQ(got->num_bytes(), want->num_bytes()) << c.name;
    EXPECT_EQ(0, std::memcmp(got->data(), want->data(), got->num_bytes()))
        << c.name << ": batched differs from one by one at length "
        << lane.length;
    lane.keys = RefConcatRows(lane.keys, ToRef(lane.k.view()));
    lane.values = RefConcatRows(lane.values, ToRef(lane.v.view()));
    RefTensor rq = ToRef(lane.q.view());
    RefTensor rk = lane.keys;
    if (c.rotary_dims > 0) {
      rq = RefRotary(rq, c.rotary_dims, 10000.0, lane.length);
      rk = RefRotary(rk, c.rotary_dims, 10000.0, 0);
    }
    const int64_t group = c.heads / c.kv_heads;
    const RefAttentionResult ref = RefAttend(
        rq, RefRepeatHeads(rk, group), RefRepeatHeads(lane.values, group),
        {RefCausalKeep(lane.length, n)}, {true}, {});
    EXPECT_TRUE(AllClose(got->view(), ref.output, ToleranceFor(c.dtype)))
        << c.name << " at length " << lane.length;
    lane.length += n;
    EXPECT_EQ(lane.batched->length(), lane.length) << c.name;
    EXPECT_EQ(lane.single->length(), lane.length) << c.name;
  }

  // One round: every lane gets `tokens(lane)` new tokens, the batched
  // sessions in one StepSessions call, the twins one by one.
  template <typename F>
  void Round(F tokens) {
    std::vector<SessionStepInput> steps;
    for (auto& lane : lanes_) {
      NewInputs(*lane, tokens(*lane));
      steps.push_back(
          {lane->batched.get(), InputsOf(*lane), {}, &lane->batched_results});
    }
    const std::vector<absl::Status> statuses = StepSessions(steps);
    ASSERT_EQ(statuses.size(), lanes_.size());
    for (size_t i = 0; i < lanes_.size(); ++i) {
      Lane& lane = *lanes_[i];
      ASSERT_TRUE(statuses[i].ok()) << lane.c.name << ": " << statuses[i];
      const absl::Status single =
          lane.single->Step(InputsOf(lane), {}, lane.single_results);
      ASSERT_TRUE(single.ok()) << single;
      CheckLane(lane);
    }
  }

  std::mt19937 rng_{31};
  std::vector<std::unique_ptr<Lane>> lanes_;
};

LaneConfig MakeLane(std::string name, auto&& edit) {
  LaneConfig c;
  c.name = std::move(name);
  edit(c);
  return c;
}

// Mixed lengths (one key block, several, a last block of 1 key), GQA, MQA,
// rotary, bfloat16 and int8 caches, dk != dv, batches of sequences; then
// one-token rounds and a few-token round (causal within the step, across a
// block boundary for some).
TEST_F(BatchedDecodeTest, BatchedStepsEqualOneByOneAndTheReference) {
  AddLane(MakeLane("mha", [](LaneConfig&) {}));
  AddLane(MakeLane("gqa_rotary_1100", [](LaneConfig& c) {
    c.heads = 8;
    c.kv_heads = 2;
    c.rotary_dims = 16;
    c.prefill = 1100;
  }));
  AddLane(MakeLane("mqa_batch2_dv24", [](LaneConfig& c) {
    c.kv_heads = 1;
    c.batch = 2;
    c.dv = 24;
    c.prefill = 511;
  }));
  AddLane(MakeLane("bf16_gqa_700", [](LaneConfig& c) {
    c.dtype = DType::kBFloat16;
    c.kv_heads = 2;
    c.rotary_dims = 8;
    c.prefill = 700;
  }));
  AddLane(MakeLane("d64_1024", [](LaneConfig& c) {
    c.dk = c.dv = 64;
    c.heads = c.kv_heads = 2;
    c.prefill = 1024;
  }));
  AddLane(MakeLane("d128_gqa4", [](LaneConfig& c) {
    c.dk = c.dv = 128;
    c.heads = 8;
    c.kv_heads = 2;
    c.prefill = 513;
  }));
  // INT8 caches: the same steps one by one give the same bits.
  AddLane(MakeLane("int8_gqa_rotary_900", [](LaneConfig& c) {
    c.dtype = DType::kInt8;
    c.heads = 8;
    c.kv_heads = 2;
    c.rotary_dims = 16;
    c.prefill = 900;
  }));
  AddLane(MakeLane("int8_batch2_d64_dv24", [](LaneConfig& c) {
    c.dtype = DType::kInt8;
    c.batch = 2;
    c.dk = 64;
    c.dv = 24;
    c.prefill = 1030;
  }));
  Round([](const Lane& lane) { return lane.c.prefill; });
  for (int round = 0; round < 3; ++round) {
    Round([](const Lane&) { return int64_t{1}; });
  }
  Round([](const Lane&) { return int64_t{3}; });
  Round([](const Lane&) { return int64_t{1}; });
}

class BatchedFailureTest : public ::testing::Test {
 protected:
  BatchedFailureTest() {
    config_.num_heads = 4;
    config_.num_kv_heads = 2;
    config_.key_dim = 8;
    config_.max_length = 700;
  }
  std::unique_ptr<DecodeSession> Make() {
    auto s = DecodeSession::Create(config_);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }
  std::array<Tensor, 3> Operands(int64_t n, int q_heads = 4, int kv = 2) {
    return {RandomTensor(DType::kFloat32, {1, q_heads, n, 8}, rng_),
            RandomTensor(DType::kFloat32, {1, kv, n, 8}, rng_),
            RandomTensor(DType::kFloat32, {1, kv, n, 8}, rng_)};
  }
  static DecodeStepInputs In(const std::array<Tensor, 3>& t,
                             std::optional<int64_t> position = std::nullopt) {
    return {std::nullopt, t[0].view(), t[1].view(), t[2].view(), position};
  }

  DecodeSessionConfig config_;
  std::mt19937 rng_{41};
};

// Good entries succeed with the results they have alone; each bad entry
// gets its own error and its session is unchanged.
TEST_F(BatchedFailureTest, BadEntriesFailAlone) {
  std::vector<std::unique_ptr<DecodeSession>> batched, single;
  for (int i = 0; i < 5; ++i) {
    batched.push_back(Make());
    single.push_back(Make());
  }
  const auto prefill = Operands(600);
  for (int i = 0; i < 5; ++i) {
    for (auto* s : {batched[i].get(), single[i].get()}) {
      TensorResults ignored;
      ASSERT_TRUE(s->Step(In(prefill), {}, ignored).ok());
    }
  }
  const auto good = Operands(1);
  const auto wrong_key = Operands(1, 4, 4);
  const auto too_long = Operands(101);
  std::atomic<bool> cancelled{true};
  DecodeStepOptions cancel;
  cancel.cancelled = &cancelled;
  std::vector<TensorResults> results(8);
  const std::vector<SessionStepInput> steps = {
      {batched[0].get(), In(good), {}, &results[0]},
      {batched[1].get(), In(wrong_key), {}, &results[1]},
      {batched[2].get(), In(good), {}, &results[2]},
      {batched[3].get(), In(too_long), {}, &results[3]},
      // Cancelled after its tokens went over cached ones (a rewind).
      {batched[4].get(), In(good, 590), cancel, &results[4]},
      {batched[0].get(), In(good), {}, &results[5]},
      {nullptr, In(good), {}, &results[6]},
      {batched[2].get(), In(good), {}, nullptr},
  };
  const std::vector<absl::Status> statuses = StepSessions(steps);
  ASSERT_EQ(statuses.size(), 8u);
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_EQ(statuses[1].message(),
            "key: shape [1, 4, 1, 8], expected [1, 2, 1, 8]");
  EXPECT_TRUE(statuses[2].ok()) << statuses[2];
  EXPECT_EQ(statuses[3].code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(statuses[3].message(),
            "session: 600 cached + 101 new tokens exceed its max_length 700");
  EXPECT_EQ(statuses[4].code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(statuses[5].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(statuses[5].message(),
            "steps[5]: session: also in steps[0]; a call steps each session "
            "at most once");
  EXPECT_EQ(statuses[6].message(), "steps[6]: session: missing");
  EXPECT_EQ(statuses[7].message(), "steps[7]: results: missing");
  const int64_t lengths[] = {601, 600, 601, 600, 600};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(batched[i]->length(), lengths[i]) << i;
  }
  for (int i : {0, 2}) {
    TensorResults alone;
    ASSERT_TRUE(single[i]->Step(In(good), {}, alone).ok());
    std::optional<Tensor> a = results[i].Take("output");
    std::optional<Tensor> b = alone.Take("output");
    ASSERT_TRUE(a.has_value() && b.has_value());
    EXPECT_EQ(0, std::memcmp(a->data(), b->data(), a->num_bytes())) << i;
  }
  // The failed sessions were left as they were: their next step equals
  // the twin's that never saw the failure.
  const auto next = Operands(1);
  std::vector<SessionStepInput> again;
  std::vector<TensorResults> again_results(3);
  for (int i : {1, 3, 4}) {
    again.push_back(
        {batched[i].get(), In(next), {}, &again_results[again.size()]});
  }
  for (const absl::Status& s : StepSessions(again)) {
    ASSERT_TRUE(s.ok()) << s;
  }
  int k = 0;
  for (int i : {1, 3, 4}) {
    TensorResults alone;
    ASSERT_TRUE(single[i]->Step(In(next), {}, alone).ok());
    std::optional<Tensor> a = again_results[k++].Take("output");
    std::optional<Tensor> b = alone.Take("output");
    ASSERT_TRUE(a.has_value() && b.has_value());
    EXPECT_EQ(0, std::memcmp(a->data(), b->data(), a->num_bytes())) << i;
  }
}

TEST_F(BatchedFailureTest, EmptyBatchAndModelSessionsInABatch) {
  EXPECT_TRUE(StepSessions({}).empty());

  // A model session next to an attention session: equal to one by one.
  std::mt19937 rng(3);
  const int64_t e = 16;
  Tensor wq = RandomTensor(DType::kFloat32, {4 * 8, e}, rng);
  Tensor wk = RandomTensor(DType::kFloat32, {2 * 8, e}, rng);
  Tensor wv = RandomTensor(DType::kFloat32, {2 * 8, e}, rng);
  Tensor wo = RandomTensor(DType::kFloat32, {e, 4 * 8}, rng);
  MultiHeadWeights w;
  w.num_heads = 4;
  w.num_kv_heads = 2;
  w.q_proj_weight = wq.view();
  w.k_proj_weight = wk.view();
  w.v_proj_weight = wv.view();
  w.out_proj_weight = wo.view();
  MultiHeadLayer::Options layer_options;
  layer_options.rotary.dims = 4;
  auto layer = MultiHeadLayer::Create(w, layer_options);
  ASSERT_TRUE(layer.ok()) << layer.status();
  DecodeSessionConfig model_config;
  model_config.layer = *layer;
  model_config.max_length = 700;
  auto model_a = DecodeSession::Create(model_config);
  auto model_b = DecodeSession::Create(model_config);
  ASSERT_TRUE(model_a.ok() && model_b.ok());
  auto attn_a = Make();
  auto attn_b = Make();
  for (int64_t n : {int64_t{520}, int64_t{1}, int64_t{2}}) {
    Tensor x = RandomTensor(DType::kFloat32, {n, e}, rng);
    const auto ops = Operands(n);
    DecodeStepInputs model_in;
    model_in.input = x.view();
    TensorResults ra, rb, sa, sb;
    const std::vector<absl::Status> statuses =
        StepSessions({{model_a->get(), model_in, {}, &ra},
                      {attn_a.get(), In(ops), {}, &sa}});
    ASSERT_TRUE(statuses[0].ok()) << statuses[0];
    ASSERT_TRUE(statuses[1].ok()) << statuses[1];
    ASSERT_TRUE((*model_b)->Step(model_in, {}, rb).ok());
    ASSERT_TRUE(attn_b->Step(In(ops), {}, sb).ok());
    for (auto* pair : {&ra, &sa}) {
      TensorResults& other = pair == &ra ? rb : sb;
      std::optional<Tensor> a = pair->Take("output");
      std::optional<Tensor> b = other.Take("output");
      ASSERT_TRUE(a.has_value() && b.has_value());
      EXPECT_EQ(0, std::memcmp(a->data(), b->data(), a->num_bytes()))
          << "n " << n;
    }
  }
}

// Decode-shaped Attend calls (a few query rows a key/value head) take the
// split-KV path: against float64 over several key blocks, with GQA, masks,
// causality and values that masked keys must not leak, on every row-ops
// implementation.
class SplitAttendTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { SetRowOpsForTesting(SupportedRowOps()[GetParam()]); }
  void TearDown() override { SetRowOpsForTesting(nullptr); }
};

TEST_P(SplitAttendTest, MatchesTheReference) {
  std::mt19937 rng(7);
  struct Shape5 {
    int64_t b, h, hkv, lq, lk, d;
    bool causal, mask, bf16;
  };
  const Shape5 shapes[] = {
      {1, 8, 8, 1, 1300, 64, false, false, false},
      {2, 8, 2, 1, 1025, 32, false, true, false},
      {1, 4, 1, 3, 900, 16, true, false, false},
      {1, 4, 2, 2, 600, 128, false, true, false},
      {1, 8, 2, 1, 700, 64, false, false, true},
  };
  for (const Shape5& s : shapes) {
    Tensor q = RandomTensor(DType::kFloat32, {s.b, s.h, s.lq, s.d}, rng);
    Tensor k = RandomTensor(DType::kFloat32, {s.b, s.hkv, s.lk, s.d}, rng);
    Tensor v = RandomTensor(DType::kFloat32, {s.b, s.hkv, s.lk, s.d}, rng);
    // Scaled up so that the softmax is not flat.
    for (int64_t i = 0; i < q.num_elements(); ++i) q.data_as<float>()[i] *= 4;
    Tensor mask = RandomTensor(DType::kBool, {s.lq, s.lk}, rng, 0.6);
    if (s.mask) {
      // A masked key's value is infinite: it must not reach the output.
      uint8_t* keep = mask.data_as<uint8_t>();
      for (int64_t j = 0; j < s.lk; ++j) {
        if (keep[j] == 0) {
          v.data_as<float>()[j * s.d] = std::numeric_limits<float>::infinity();
          break;
        }
      }
    }
    AttendInputs in{q.view(), k.view(), v.view(), std::nullopt};
    if (s.mask) in.attn_mask = mask.view();
    AttentionOptions options;
    options.causal = s.causal;
    options.enable_gqa = true;
    options.compute_bf16 = s.bf16;
    auto got = Attend(in, options);
    ASSERT_TRUE(got.ok()) << got.status();
    const int64_t group = s.h / s.hkv;
    std::vector<RefTensor> masks;
    if (s.mask) masks.push_back(ToRef(mask.view()));
    RefAttentionOptions ref_options;
    ref_options.causal = s.causal;
    const RefAttentionResult ref =
        RefAttend(ToRef(q.view()), RefRepeatHeads(ToRef(k.view()), group),
                  RefRepeatHeads(ToRef(v.view()), group), masks,
                  std::vector<bool>(masks.size(), true), ref_options);
    EXPECT_TRUE(AllClose(got->output.view(), ref.output,
                         s.bf16 ? kBFloat16Tolerance : kFloat32Tolerance))
        << "Lk " << s.lk << " H " << s.h << "/" << s.hkv << " Lq " << s.lq;
  }
}

INSTANTIATE_TEST_SUITE_P(
    RowOps, SplitAttendTest,
    ::testing::Range(0, static_cast<int>(SupportedRowOps().size())),
    [](const auto& info) {
      return std::string(SupportedRowOps()[info.param]->name);
    });

}  // namespace
}  // namespace attnserve::testing
