// Decode sessions (core/decode_session.h) against float64 references: each
// step of an attention session equals attention over the whole history
// (rotated, repeated for grouped heads, causal at the step's positions), and
// each step of a model session equals the matching rows of the stateless
// causal multi-head attention over the whole sequence. Also the session's
// input checks, its length limit and its cache's size.
#include "core/decode_session.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/multi_head_attention.h"
#include "gtest/gtest.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {
namespace {

struct SessionCase {
  std::string name;
  int64_t batch = 1;
  int heads = 4;
  int kv_heads = 4;
  int64_t dk = 8, dv = 8;
  DType dtype = DType::kFloat32;  // the session's
  DType input_dtype = DType::kFloat32;
  int64_t rotary_dims = 0;
  std::vector<int64_t> steps = {5, 1, 1, 3, 1};  // new tokens per step
  bool batched_inputs = true;
};

void PrintTo(const SessionCase& c, std::ostream* os) { *os << c.name; }

class AttentionSessionTest : public ::testing::TestWithParam<SessionCase> {};

TEST_P(AttentionSessionTest, EveryStepMatchesAttentionOverTheHistory) {
  const SessionCase& c = GetParam();
  std::mt19937 rng(5);
  DecodeSessionConfig config;
  config.num_heads = c.heads;
  config.num_kv_heads = c.kv_heads;
  config.key_dim = c.dk;
  config.value_dim = c.dv;
  config.dtype = c.dtype;
  config.rotary.dims = c.rotary_dims;
  config.batch = c.batch;
  config.max_length = 512;
  auto session = DecodeSession::Create(config);
  ASSERT_TRUE(session.ok()) << session.status();
  const int64_t b = c.batch;
  RefTensor keys, values;  // the history, unrotated
  int64_t first = 0;
  for (int64_t n : c.steps) {
    auto shape = [&](int64_t heads, int64_t d) {
      return c.batched_inputs ? Shape{b, heads, n, d} : Shape{heads, n, d};
    };
    Tensor q = RandomTensor(c.input_dtype, shape(c.heads, c.dk), rng);
    Tensor k = RandomTensor(c.input_dtype, shape(c.kv_heads, c.dk), rng);
    Tensor v = RandomTensor(c.input_dtype, shape(c.kv_heads, c.dv), rng);
    DecodeStepInputs in;
    in.query = q.view();
    in.key = k.view();
    in.value = v.view();
    TensorResults results;
    const absl::Status status = (*session)->Step(in, {}, results);
    ASSERT_TRUE(status.ok()) << status;
    std::optional<Tensor> out = results.Take("output");
    ASSERT_TRUE(out.has_value());
    EXPECT_EQ(out->dtype(), c.input_dtype);

    auto ref4 = [&](const Tensor& t, int64_t heads, int64_t d) {
      RefTensor r = ToRef(t.view());
      r.shape = {b, heads, n, d};
      return r;
    };
    keys = RefConcatRows(keys, ref4(k, c.kv_heads, c.dk));
    values = RefConcatRows(values, ref4(v, c.kv_heads, c.dv));
    const int64_t group = c.heads / c.kv_heads;
    RefTensor rq = ref4(q, c.heads, c.dk);
    RefTensor rk = keys;
    if (c.rotary_dims > 0) {
      rq = RefRotary(rq, c.rotary_dims, 10000.0, first);
      rk = RefRotary(rk, c.rotary_dims, 10000.0, 0);
    }
    RefAttentionResult ref =
        RefAttend(rq, RefRepeatHeads(rk, group), RefRepeatHeads(values, group),
                  {RefCausalKeep(first, n)}, {true}, {});
    if (!c.batched_inputs) ref.output.shape.erase(ref.output.shape.begin());
    EXPECT_TRUE(AllClose(
        out->view(), ref.output,
        ToleranceFor(c.dtype == DType::kFloat32 ? c.input_dtype : c.dtype)))
        << "step at position " << first;
    first += n;
    EXPECT_EQ((*session)->length(), first);
  }
}

const SessionCase kSessionCases[] = {
    Case("mha", [](SessionCase&) {}),
    Case("gqa", [](SessionCase& c) { c.kv_heads = 2; }),
    Case("mqa_batch3",
         [](SessionCase& c) {
           c.kv_heads = 1;
           c.batch = 3;
         }),
    Case("rotary", [](SessionCase& c) { c.rotary_dims = 8; }),
    Case("rotary_partial_gqa_dk_ne_dv",
         [](SessionCase& c) {
           c.kv_heads = 2;
           c.rotary_dims = 4;
           c.dv = 5;
           c.batch = 2;
         }),
    Case("bf16_cache",
         [](SessionCase& c) {
           c.dtype = DType::kBFloat16;
           c.kv_heads = 2;
           c.rotary_dims = 8;
         }),
    Case("bf16_inputs",
         [](SessionCase& c) {
           c.dtype = DType::kBFloat16;
           c.input_dtype = DType::kBFloat16;
         }),
    Case("f16_inputs_f32_cache",
         [](SessionCase& c) { c.input_dtype = DType::kFloat16; }),
    Case("unbatched_inputs", [](SessionCase& c) { c.batched_inputs = false; }),
    // Past the kernel's 128-query and key blocks, one token at a time after.
    Case("long_prefill",
         [](SessionCase& c) {
           c.kv_heads = 2;
           c.steps = {300, 1, 1, 130, 1};
         }),
    Case("tokens_one_at_a_time",
         [](SessionCase& c) {
           c.kv_heads = 2;
           c.rotary_dims = 8;
           c.steps = std::vector<int64_t>(12, 1);
         }),
    Case("empty_step",
         [](SessionCase& c) {
           c.steps = {3, 0, 1};
         }),
    // INT8 caches: split-KV steps read the codes, long steps (tiled) their
    // dequantized copy.
    Case("int8_cache_gqa_rotary",
         [](SessionCase& c) {
           c.dtype = DType::kInt8;
           c.kv_heads = 2;
           c.rotary_dims = 8;
         }),
    Case("int8_long_prefill_batch2_dk_ne_dv",
         [](SessionCase& c) {
           c.dtype = DType::kInt8;
           c.batch = 2;
           c.dv = 12;
           c.steps = {300, 1, 1, 130, 1};
         }),
    Case("int8_f16_inputs_unbatched",
         [](SessionCase& c) {
           c.dtype = DType::kInt8;
           c.input_dtype = DType::kFloat16;
           c.batched_inputs = false;
         }),
};

INSTANTIATE_TEST_SUITE_P(Table, AttentionSessionTest,
                         ::testing::ValuesIn(kSessionCases),
                         [](const auto& info) { return info.param.name; });

class SessionFixture : public ::testing::Test {
 protected:
  Tensor Random(DType dtype, Shape shape) {
    return RandomTensor(dtype, shape, rng_);
  }
  std::mt19937 rng_{17};
};

struct ModelCase {
  std::string name;
  int heads = 4;
  int kv_heads = 2;
  int64_t rotary_dims = 4;
  DType compute = DType::kFloat32;
  int64_t batch = 2;
  bool out_proj = true;
  std::optional<DType> cache;  // the session's cache_dtype
};

void PrintTo(const ModelCase& c, std::ostream* os) { *os << c.name; }

class ModelSessionTest : public ::testing::TestWithParam<ModelCase> {};

TEST_P(ModelSessionTest, EveryStepMatchesCausalAttentionOverTheSequence) {
  const ModelCase& m = GetParam();
  std::mt19937 rng(23);
  const int64_t e = 16, dk = 8, dv = 6, eo = 12, b = m.batch;
  auto weight = [&](Shape shape) {
    Tensor w = RandomTensor(DType::kFloat32, shape, rng);
    const float scale = 1.0f / std::sqrt(static_cast<float>(shape.back()));
    for (int64_t i = 0; i < w.num_elements(); ++i) {
      w.data_as<float>()[i] *= scale;
    }
    return w;
  };
  Tensor wq = weight({m.heads * dk, e}), wk = weight({m.kv_heads * dk, e}),
         wv = weight({m.kv_heads * dv, e}), wo = weight({eo, m.heads * dv});
  Tensor bq = RandomTensor(DType::kFloat32, {m.heads * dk}, rng);
  Tensor bk = RandomTensor(DType::kFloat32, {m.kv_heads * dk}, rng);
  Tensor bv = RandomTensor(DType::kFloat32, {m.kv_heads * dv}, rng);
  MultiHeadWeights w;
  w.num_heads = m.heads;
  w.num_kv_heads = m.kv_heads;
  w.q_proj_weight = wq.view();
  w.k_proj_weight = wk.view();
  w.v_proj_weight = wv.view();
  w.q_proj_bias = bq.view();
  w.k_proj_bias = bk.view();
  w.v_proj_bias = bv.view();
  if (m.out_proj) w.out_proj_weight = wo.view();
  MultiHeadLayer::Options layer_options;
  layer_options.compute_dtype = m.compute;
  layer_options.rotary.dims = m.rotary_dims;
  auto layer = MultiHeadLayer::Create(w, layer_options);
  ASSERT_TRUE(layer.ok()) << layer.status();

  DecodeSessionConfig config;
  config.layer = *layer;
  config.batch = b;
  config.max_length = 40;
  config.cache_dtype = m.cache;
  auto session = DecodeSession::Create(config);
  ASSERT_TRUE(session.ok()) << session.status();

  const std::vector<int64_t> steps = {7, 1, 1, 4, 1, 1};
  int64_t total = 0;
  for (int64_t n : steps) total += n;
  Tensor x = RandomTensor(DType::kFloat32, {b, total, e}, rng);
  RefMultiHeadWeights ref_w;
  ref_w.num_heads = m.heads;
  ref_w.num_kv_heads = m.kv_heads;
  ref_w.rotary_dims = m.rotary_dims;
  ref_w.q_proj_weight = ToRef(wq.view());
  ref_w.k_proj_weight = ToRef(wk.view());
  ref_w.v_proj_weight = ToRef(wv.view());
  ref_w.q_proj_bias = ToRef(bq.view());
  ref_w.k_proj_bias = ToRef(bk.view());
  ref_w.v_proj_bias = ToRef(bv.view());
  if (m.out_proj) ref_w.out_proj_weight = ToRef(wo.view());
  const RefTensor all = ToRef(x.view());
  const RefAttentionResult ref =
      RefMultiHeadAttend(ref_w, all, all, all, {}, {}, {true, {}, {}});

  int64_t first = 0;
  for (int64_t n : steps) {
    // This step's hidden states: rows [first, first + n) of each sequence.
    Tensor step = RandomTensor(DType::kFloat32, {b, n, e}, rng);
    const RefTensor rows = RefRows(all, first, n);
    for (size_t i = 0; i < rows.values.size(); ++i) {
      step.data_as<float>()[i] = static_cast<float>(rows.values[i]);
    }
    if (first > 0) {
      // Rewinds that fail change nothing, the cached tokens they would have
      // overwritten included: the step below still matches the reference.
      TensorResults ignored;
      Tensor wide = RandomTensor(DType::kFloat32, {b, n, e + 1}, rng);
      DecodeStepInputs refused;
      refused.input = wide.view();
      refused.position = first - 1;
      EXPECT_EQ((*session)->Step(refused, {}, ignored).message(),
                absl::StrCat("input: last dim ", e + 1, " != the model's ", e));
      std::atomic<bool> cancelled{true};
      DecodeStepOptions cancel;
      cancel.cancelled = &cancelled;
      DecodeStepInputs rewind;
      rewind.input = step.view();
      rewind.position = first - 1;
      EXPECT_EQ((*session)->Step(rewind, cancel, ignored).code(),
                absl::StatusCode::kCancelled);
      EXPECT_EQ((*session)->length(), first);
    }
    DecodeStepInputs in;
    in.input = step.view();
    TensorResults results;
    const absl::Status status = (*session)->Step(in, {}, results);
    ASSERT_TRUE(status.ok()) << status;
    std::optional<Tensor> out = results.Take("output");
    ASSERT_TRUE(out.has_value());
    EXPECT_TRUE(AllClose(out->view(), RefRows(ref.output, first, n),
                         ToleranceFor(m.cache.value_or(m.compute))))
        << "step at position " << first;
    first += n;
  }
  EXPECT_EQ((*session)->length(), total);
}

const ModelCase kModelCases[] = {
    {"gqa_rotary", 4, 2, 4, DType::kFloat32, 2, true, std::nullopt},
    {"mha_no_rotary", 4, 4, 0, DType::kFloat32, 2, true, std::nullopt},
    {"mqa_full_rotary_no_out_proj", 2, 1, 8, DType::kFloat32, 1, false,
     std::nullopt},
    {"bf16", 4, 2, 4, DType::kBFloat16, 2, true, std::nullopt},
    {"int8_cache_gqa_rotary", 4, 2, 4, DType::kFloat32, 2, true, DType::kInt8},
    {"bf16_int8_cache", 4, 2, 4, DType::kBFloat16, 1, true, DType::kInt8},
};

INSTANTIATE_TEST_SUITE_P(Table, ModelSessionTest,
                         ::testing::ValuesIn(kModelCases),
                         [](const auto& info) { return info.param.name; });

class SessionCheckTest : public SessionFixture {
 protected:
  SessionCheckTest() {
    config_.num_heads = 4;
    config_.num_kv_heads = 2;
    config_.key_dim = 8;
    config_.max_length = 10;
  }
  std::unique_ptr<DecodeSession> Make() {
    auto s = DecodeSession::Create(config_);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }
  absl::Status Step(DecodeSession& s, int64_t n, int q_heads = 4,
                    int kv_heads = 2,
                    const std::atomic<bool>* cancel = nullptr) {
    q_ = Random(DType::kFloat32, {1, q_heads, n, 8});
    k_ = Random(DType::kFloat32, {1, kv_heads, n, 8});
    v_ = Random(DType::kFloat32, {1, kv_heads, n, 8});
    DecodeStepInputs in;
    in.query = q_.view();
    in.key = k_.view();
    in.value = v_.view();
    DecodeStepOptions options;
    options.cancelled = cancel;
    TensorResults results;
    return s.Step(in, options, results);
  }
  absl::Status CreateError() { return DecodeSession::Create(config_).status(); }

  DecodeSessionConfig config_;
  Tensor q_, k_, v_;
};

TEST_F(SessionCheckTest, ConfigIsChecked) {
  config_.num_kv_heads = 3;
  EXPECT_EQ(CreateError().message(),
            "num_kv_heads: 3 does not divide num_heads 4");
  config_.num_kv_heads = 2;
  config_.max_length = 0;
  EXPECT_EQ(CreateError().message(), "max_length: must be > 0, got 0");
  config_.max_length = 10;
  config_.rotary.dims = 10;
  EXPECT_EQ(CreateError().message(), "rotary_dims: 10 > head dim 8");
  config_.rotary.dims = 0;
  config_.dtype = DType::kFloat16;
  EXPECT_EQ(CreateError().message(),
            "dtype: FLOAT16 not supported for a session cache, expected "
            "FLOAT32, BFLOAT16 or INT8");
  config_.dtype = DType::kFloat32;
  config_.max_length = int64_t{1} << 60;
  EXPECT_EQ(CreateError().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SessionCheckTest, StepShapesAreChecked) {
  auto s = Make();
  absl::Status status = Step(*s, 2, /*q_heads=*/2);
  EXPECT_EQ(status.message(),
            "query: shape [1, 2, 2, 8], expected [1, 4, 2, 8]");
  status = Step(*s, 2, 4, /*kv_heads=*/4);
  EXPECT_EQ(status.message(), "key: shape [1, 4, 2, 8], expected [1, 2, 2, 8]");
  Tensor hidden = Random(DType::kFloat32, {1, 2, 32});
  DecodeStepInputs in;
  in.input = hidden.view();
  TensorResults results;
  EXPECT_EQ(s->Step(in, {}, results).message(),
            "input: an attention session takes query, key and value, not "
            "hidden states");
  EXPECT_EQ(s->length(), 0);
}

TEST_F(SessionCheckTest, MaxLengthIsOutOfRangeAndLeavesTheSessionAsItWas) {
  auto s = Make();
  ASSERT_TRUE(Step(*s, 8).ok());
  const absl::Status status = Step(*s, 3);
  EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(status.message(),
            "session: 8 cached + 3 new tokens exceed its max_length 10");
  EXPECT_EQ(s->length(), 8);
  EXPECT_TRUE(Step(*s, 2).ok());
  EXPECT_EQ(s->length(), 10);
}

TEST_F(SessionCheckTest, CancelledStepLeavesTheSessionAsItWas) {
  auto s = Make();
  ASSERT_TRUE(Step(*s, 3).ok());
  std::atomic<bool> cancelled{true};
  const absl::Status status = Step(*s, 2, 4, 2, &cancelled);
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(s->length(), 3);
}

TEST_F(SessionCheckTest, PositionDropsTheTailFirst) {
  // Tokens 0-5, then a step at position 4: the same as tokens 0-3 then that
  // step.
  std::mt19937 rng(8);
  const auto random = [&](int heads, int64_t n) {
    return RandomTensor(DType::kFloat32, {1, heads, n, 8}, rng);
  };
  Tensor q6 = random(4, 6), k6 = random(2, 6), v6 = random(2, 6);
  Tensor q2 = random(4, 2), k2 = random(2, 2), v2 = random(2, 2);
  // The first four tokens of k6/v6/q6, as their own tensors.
  const auto first4 = [](const Tensor& t) {
    const int64_t heads = t.shape()[1];
    Tensor out = *Tensor::Allocate(DType::kFloat32, {1, heads, 4, 8});
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(out.data_as<float>() + h * 32, t.data_as<float>() + h * 48,
                  32 * sizeof(float));
    }
    return out;
  };
  Tensor q4 = first4(q6), k4 = first4(k6), v4 = first4(v6);
  const auto step = [](DecodeSession& s, const Tensor& q, const Tensor& k,
                       const Tensor& v, std::optional<int64_t> position) {
    DecodeStepInputs in{std::nullopt, q.view(), k.view(), v.view(), position};
    TensorResults results;
    const absl::Status status = s.Step(in, {}, results);
    EXPECT_TRUE(status.ok()) << status;
    return results.Take("output");
  };
  auto rewound = Make();
  auto fresh = Make();
  step(*rewound, q6, k6, v6, std::nullopt);
  step(*fresh, q4, k4, v4, std::nullopt);
  std::optional<Tensor> a = step(*rewound, q2, k2, v2, 4);
  std::optional<Tensor> b = step(*fresh, q2, k2, v2, std::nullopt);
  ASSERT_TRUE(a.has_value() && b.has_value());
  EXPECT_EQ(rewound->length(), 6);
  EXPECT_EQ(0, std::memcmp(a->data(), b->data(), a->num_bytes()));

  DecodeStepInputs in{std::nullopt, q2.view(), k2.view(), v2.view(), 7};
  TensorResults results;
  EXPECT_EQ(rewound->Step(in, {}, results).message(),
            "position: 7 is not in [0, 6] (the tokens cached)");
  EXPECT_EQ(rewound->length(), 6);
}

// A step that fails changes nothing, also when it asked for a rewind:
// refused for its length or its shapes, or cancelled after writing its
// tokens over cached ones. The next step sees the tokens as they were.
TEST_F(SessionCheckTest, FailedRewindChangesNothing) {
  config_.max_length = 4;
  auto s = Make();
  std::mt19937 rng(9);
  const auto random = [&](int heads, int64_t n) {
    return RandomTensor(DType::kFloat32, {1, heads, n, 8}, rng);
  };
  const Tensor q3 = random(4, 3), k3 = random(2, 3), v3 = random(2, 3);
  TensorResults results;
  DecodeStepInputs prefill{std::nullopt, q3.view(), k3.view(), v3.view(),
                           std::nullopt};
  ASSERT_TRUE(s->Step(prefill, {}, results).ok());
  ASSERT_EQ(s->length(), 3);

  const Tensor q = random(4, 3), k = random(2, 3), v = random(2, 3);
  DecodeStepInputs too_long{std::nullopt, q.view(), k.view(), v.view(), 2};
  absl::Status status = s->Step(too_long, {}, results);
  EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(status.message(),
            "session: position 2 + 3 new tokens exceed its max_length 4 (the "
            "session holds 3 tokens; nothing was changed)");
  EXPECT_EQ(s->length(), 3);

  const Tensor wrong_key = random(4, 1);
  const Tensor q1 = random(4, 1), k1 = random(2, 1), v1 = random(2, 1);
  DecodeStepInputs bad_shape{std::nullopt, q1.view(), wrong_key.view(),
                             v1.view(), 1};
  status = s->Step(bad_shape, {}, results);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "key: shape [1, 4, 1, 8], expected [1, 2, 1, 8]");
  EXPECT_EQ(s->length(), 3);

  // Cancelled once its keys and values are in the cache, over tokens 1-2.
  std::atomic<bool> cancelled{true};
  DecodeStepOptions cancel;
  cancel.cancelled = &cancelled;
  const Tensor q2 = random(4, 2), k2 = random(2, 2), v2 = random(2, 2);
  DecodeStepInputs rewind{std::nullopt, q2.view(), k2.view(), v2.view(), 1};
  EXPECT_EQ(s->Step(rewind, cancel, results).code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ(s->length(), 3);

  // The fourth token attends to the three of the prefill.
  DecodeStepInputs next{std::nullopt, q1.view(), k1.view(), v1.view(),
                        std::nullopt};
  TensorResults next_results;
  status = s->Step(next, {}, next_results);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(s->length(), 4);
  const RefTensor keys = RefConcatRows(ToRef(k3.view()), ToRef(k1.view()));
  const RefTensor values = RefConcatRows(ToRef(v3.view()), ToRef(v1.view()));
  const RefAttentionResult ref =
      RefAttend(ToRef(q1.view()), RefRepeatHeads(keys, 2),
                RefRepeatHeads(values, 2), {}, {}, {});
  std::optional<Tensor> out = next_results.Take("output");
  ASSERT_TRUE(out.has_value());
  EXPECT_TRUE(AllClose(out->view(), ref.output, kFloat32Tolerance));
}

TEST_F(SessionCheckTest, LongRewindsGiveMemoryBackShortOnesKeepIt) {
  config_.num_heads = 2;
  config_.num_kv_heads = 2;
  config_.key_dim = 64;
  config_.max_length = 8192;
  auto s = Make();
  const auto step = [&](int64_t n, std::optional<int64_t> position) {
    Tensor q = Random(DType::kFloat32, {2, n, 64});
    Tensor k = Random(DType::kFloat32, {2, n, 64});
    Tensor v = Random(DType::kFloat32, {2, n, 64});
    DecodeStepInputs in{std::nullopt, q.view(), k.view(), v.view(), position};
    TensorResults results;
    EXPECT_TRUE(s->Step(in, {}, results).ok());
  };
  step(4096, std::nullopt);
  const size_t full = s->cache_bytes();
  EXPECT_EQ(full, s->BytesAt(4096));
  // Back one token: the pages stay committed (and counted).
  step(1, 4095);
  EXPECT_EQ(s->length(), 4096);
  EXPECT_EQ(s->cache_bytes(), full);
  // Back to the start: 1 MiB a plane dropped, given back.
  step(1, 0);
  EXPECT_EQ(s->length(), 1);
  EXPECT_LT(s->cache_bytes(), full / 64);
}

TEST_F(SessionCheckTest, CacheHoldsWhatItsTokensNeed) {
  config_.num_heads = 8;
  config_.num_kv_heads = 8;
  config_.key_dim = 64;
  config_.max_length = 8192;
  auto s = Make();
  EXPECT_EQ(s->cache_bytes(), 0u);
  // 4096 tokens x 8 heads x 64 x 4 bytes, for keys and for values.
  const size_t needed = size_t{4096} * 8 * 64 * 4 * 2;
  EXPECT_EQ(s->BytesAt(4096), needed);
  // One token commits a page per operand, however long max_length is.
  EXPECT_LE(s->BytesAt(1), size_t{2} * 65536);
  EXPECT_LE(s->BytesAt(4097), needed + size_t{2} * 65536);
}

TEST_F(SessionCheckTest, Int8CacheCountsItsScales) {
  config_.num_heads = 8;
  config_.num_kv_heads = 8;
  config_.key_dim = 64;
  config_.max_length = 8192;
  config_.dtype = DType::kInt8;
  auto s = Make();
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->dtype(), DType::kFloat32);
  EXPECT_EQ(s->cache_dtype(), DType::kInt8);
  // 4096 tokens x 8 heads x (64 one-byte codes + a 4-byte scale), for keys
  // and for values.
  EXPECT_EQ(s->BytesAt(4096), size_t{4096} * 8 * (64 + 4) * 2);
  // The whole max_length, scales included.
  EXPECT_EQ(s->reserved_bytes(), size_t{8192} * 8 * (64 + 4) * 2);
  auto dims = DecodeSession::CacheDims(config_);
  ASSERT_TRUE(dims.ok());
  EXPECT_EQ(*KvCache::ReservedBytes(*dims), s->reserved_bytes());
}

// Mappings of this process (lines of /proc/self/maps).
int MappingCount() {
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return -1;
  int lines = 0;
  for (int c = std::fgetc(maps); c != EOF; c = std::fgetc(maps)) {
    if (c == '\n') ++lines;
  }
  std::fclose(maps);
  return lines;
}

// A process holds at most vm.max_map_count mappings (malloc's included):
// a session's cache, keys, values and scales of every layer, is one; its
// per-layer bookkeeping is another only from a page on (so that it goes
// back to the system when the session ends).
TEST_F(SessionCheckTest, CacheIsOneMapping) {
#ifdef ATTNSERVE_SANITIZED
  GTEST_SKIP() << "a sanitizer's allocator maps memory of its own";
#endif
  config_.num_heads = 8;
  config_.num_kv_heads = 8;
  config_.key_dim = 64;
  config_.max_length = 4096;
  config_.dtype = DType::kInt8;
  int before = MappingCount();
  auto s = Make();
  ASSERT_NE(s, nullptr);
  EXPECT_LT(s->bookkeeping_bytes(), 4096u);
  EXPECT_EQ(MappingCount(), before + 1);
  s.reset();
  EXPECT_EQ(MappingCount(), before);
  config_.max_length = 1 << 20;  // far past malloc's arenas
  config_.num_layers = 4;
  before = MappingCount();
  s = Make();
  ASSERT_NE(s, nullptr);
  // 4 layers x (32 + 4 tables x 8 bytes x 2048 blocks), 64.03 pages.
  EXPECT_EQ(s->bookkeeping_bytes(), 65u * 4096);
  EXPECT_EQ(MappingCount(), before + 2);
  s.reset();
  EXPECT_EQ(MappingCount(), before);
}

TEST_F(SessionCheckTest, CacheDTypeIsChecked) {
  config_.cache_dtype = DType::kBFloat16;
  EXPECT_EQ(CreateError().message(),
            "cache_dtype: BFLOAT16 not supported with compute dtype FLOAT32, "
            "expected FLOAT32 or INT8");
  config_.dtype = DType::kInt8;
  EXPECT_EQ(CreateError().message(),
            "cache_dtype: BFLOAT16 contradicts dtype INT8 (an INT8 cache)");
  config_.dtype = DType::kUInt8;
  config_.cache_dtype.reset();
  EXPECT_EQ(CreateError().message(),
            "dtype: UINT8 not supported for a session cache, expected FLOAT32, "
            "BFLOAT16 or INT8");
  config_.dtype = DType::kBFloat16;
  config_.cache_dtype = DType::kInt8;
  auto s = Make();
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->dtype(), DType::kBFloat16);
  EXPECT_EQ(s->cache_dtype(), DType::kInt8);
  EXPECT_TRUE(Step(*s, 3).ok());
}

TEST(QuantizeInt8Test, SymmetricRoundToNearestAndNeverNaNFromFiniteRows) {
  const float row[] = {0.5f, -1.27f, 0.004f, 0.006f, 1.0f};
  int8_t codes[5];
  const float scale = QuantizeInt8(row, 5, codes);
  EXPECT_FLOAT_EQ(scale, 1.27f / 127.0f);
  EXPECT_EQ(codes[1], -127);
  EXPECT_EQ(codes[0], 50);
  EXPECT_EQ(codes[2], 0);  // 0.4 rounds down
  EXPECT_EQ(codes[3], 1);  // 0.6 rounds up
  EXPECT_EQ(codes[4], 100);
  for (int i = 0; i < 5; ++i) {
    EXPECT_LE(std::fabs(codes[i] * scale - row[i]), scale / 2 * 1.0001f);
  }
  const float zeros[] = {0.0f, -0.0f, 0.0f};
  int8_t zero_codes[3] = {1, 1, 1};
  EXPECT_EQ(QuantizeInt8(zeros, 3, zero_codes), 0.0f);
  EXPECT_EQ(zero_codes[0] | zero_codes[1] | zero_codes[2], 0);
  // Subnormal rows: no overflow of 127 / max|x| into Inf or NaN.
  const float tiny[] = {1e-44f, -3e-45f};
  int8_t tiny_codes[2];
  EXPECT_FALSE(std::isnan(QuantizeInt8(tiny, 2, tiny_codes)));
  EXPECT_EQ(tiny_codes[0], 127);
  const float bad[] = {1.0f, std::numeric_limits<float>::infinity()};
  int8_t bad_codes[2];
  EXPECT_TRUE(std::isnan(QuantizeInt8(bad, 2, bad_codes)));
}

// The stated accuracy of INT8 caches, for unit-variance (standard normal)
// queries, keys and values, d64, 8 heads (and 8 over 2 key/value heads),
// against float64 attention over the unquantized history (relative error:
// Frobenius norm of the error over the reference's): a 2048-token prefill
// (tiled path, dequantized) within 1e-2; 200 one-token steps after it
// (split-KV path, int8 rows read directly) within 1e-2 taken together and
// within 2e-2 each (a single token's 512 outputs scatter: about 3% of
// steps pass 1e-2).
TEST(Int8CacheAccuracyTest, RelativeErrorAgainstFloat64) {
#ifdef ATTNSERVE_SANITIZED
  // The float64 reference takes minutes under a sanitizer; the figures the
  // README states are the full test's.
  constexpr int64_t kPrefill = 512, kSteps = 20;
#else
  constexpr int64_t kPrefill = 2048, kSteps = 200;
#endif
  for (int kv_heads : {8, 2}) {
    std::mt19937 rng(kv_heads);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const auto random = [&](Shape shape) {
      Tensor t = *Tensor::Allocate(DType::kFloat32, shape);
      for (int64_t i = 0; i < t.num_elements(); ++i) {
        t.data_as<float>()[i] = normal(rng);
      }
      return t;
    };
    DecodeSessionConfig config;
    config.num_heads = 8;
    config.num_kv_heads = kv_heads;
    config.key_dim = 64;
    config.dtype = DType::kInt8;
    config.max_length = 4096;
    auto session = DecodeSession::Create(config);
    ASSERT_TRUE(session.ok()) << session.status();
    RefTensor keys, values;
    int64_t first = 0;
    double worst = 0;
    double steps_error = 0, steps_norm = 0;
    std::vector<int64_t> lengths = {kPrefill};
    lengths.resize(1 + kSteps, 1);
    for (int64_t n : lengths) {
      Tensor q = random({1, 8, n, 64});
      Tensor k = random({1, kv_heads, n, 64});
      Tensor v = random({1, kv_heads, n, 64});
      DecodeStepInputs in;
      in.query = q.view();
      in.key = k.view();
      in.value = v.view();
      TensorResults results;
      ASSERT_TRUE((*session)->Step(in, {}, results).ok());
      std::optional<Tensor> out = results.Take("output");
      ASSERT_TRUE(out.has_value());
      keys = RefConcatRows(keys, ToRef(k.view()));
      values = RefConcatRows(values, ToRef(v.view()));
      const int64_t group = 8 / kv_heads;
      const RefAttentionResult ref = RefAttend(
          ToRef(q.view()), RefRepeatHeads(keys, group),
          RefRepeatHeads(values, group), {RefCausalKeep(first, n)}, {true}, {});
      double error = 0, norm = 0;
      for (size_t i = 0; i < ref.output.values.size(); ++i) {
        const double d = out->data_as<float>()[i] - ref.output.values[i];
        error += d * d;
        norm += ref.output.values[i] * ref.output.values[i];
      }
      const double relative = std::sqrt(error / norm);
      if (n == 1) {
        worst = std::max(worst, relative);
        steps_error += error;
        steps_norm += norm;
        EXPECT_LE(relative, 2e-2) << "one-token step at " << first;
      } else {
        EXPECT_LE(relative, 1e-2) << "prefill of " << n;
      }
      first += n;
    }
    const double steps = std::sqrt(steps_error / steps_norm);
    EXPECT_LE(steps, 1e-2) << kSteps << " one-token steps together";
    std::printf(
        "int8 cache, 8 heads over %d, d64: %lld one-token steps after %lld "
        "tokens: relative error vs float64 %.2e together, at most %.2e in "
        "one step\n",
        kv_heads, static_cast<long long>(kSteps),
        static_cast<long long>(kPrefill), steps, worst);
  }
}

// A multi-layer session is one session per layer: every layer's steps
// (its own lengths, a rewind in one layer, layers stepped out of turn), alone
// and in StepSessions batches, give the bits of a single-layer session fed
// the same steps, for float32, bfloat16 and int8 caches.
TEST(MultiLayerSessionTest, EqualsOneSessionPerLayer) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kInt8}) {
    SCOPED_TRACE(DTypeName(dtype));
    std::mt19937 rng(9);
    DecodeSessionConfig config;
    config.num_heads = 4;
    config.num_kv_heads = 2;
    config.key_dim = 8;
    config.rotary.dims = 8;
    config.dtype = dtype;
    config.max_length = 64;
    std::vector<std::unique_ptr<DecodeSession>> singles;
    for (int l = 0; l < 3; ++l) {
      singles.push_back(*DecodeSession::Create(config));
    }
    config.num_layers = 3;
    auto multi = DecodeSession::Create(config);
    ASSERT_TRUE(multi.ok()) << multi.status();
    EXPECT_EQ((*multi)->reserved_bytes(), 3 * singles[0]->reserved_bytes());
    struct Step {
      int64_t layer, n;
      std::optional<int64_t> position;
    };
    const Step steps[] = {{0, 5, {}}, {1, 5, {}}, {2, 5, {}}, {0, 1, {}},
                          {1, 1, {}}, {0, 1, {}}, {2, 1, {}}, {1, 3, 4},
                          {2, 1, {}}, {1, 1, {}}, {0, 20, {}}};
    for (const Step& step : steps) {
      Tensor q = RandomTensor(DType::kFloat32, {4, step.n, 8}, rng);
      Tensor k = RandomTensor(DType::kFloat32, {2, step.n, 8}, rng);
      Tensor v = RandomTensor(DType::kFloat32, {2, step.n, 8}, rng);
      DecodeStepInputs in{std::nullopt, q.view(),      k.view(),
                          v.view(),     step.position, step.layer};
      TensorResults got, want;
      ASSERT_TRUE((*multi)->Step(in, {}, got).ok());
      in.layer = 0;
      ASSERT_TRUE(singles[step.layer]->Step(in, {}, want).ok());
      const Tensor a = *got.Take("output"), b = *want.Take("output");
      ASSERT_EQ(a.num_bytes(), b.num_bytes());
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.num_bytes()))
          << "layer " << step.layer;
      size_t bytes = 0;
      for (int l = 0; l < 3; ++l) {
        EXPECT_EQ((*multi)->length(l), singles[l]->length());
        bytes += singles[l]->cache_bytes();
      }
      EXPECT_EQ((*multi)->cache_bytes(), bytes);
    }
    // Batched: the multi-layer session in one entry (layer 1), a single
    // session in another.
    Tensor q = RandomTensor(DType::kFloat32, {4, 1, 8}, rng);
    Tensor k = RandomTensor(DType::kFloat32, {2, 1, 8}, rng);
    Tensor v = RandomTensor(DType::kFloat32, {2, 1, 8}, rng);
    DecodeStepInputs in{std::nullopt, q.view(),     k.view(),
                        v.view(),     std::nullopt, 1};
    DecodeStepInputs in0 = in;
    in0.layer = 0;
    TensorResults batched_multi, batched_single, want;
    const std::vector<absl::Status> statuses =
        StepSessions({{multi->get(), in, {}, &batched_multi},
                      {singles[2].get(), in0, {}, &batched_single}});
    ASSERT_TRUE(statuses[0].ok() && statuses[1].ok());
    ASSERT_TRUE(singles[1]->Step(in0, {}, want).ok());
    const Tensor a = *batched_multi.Take("output"), b = *want.Take("output");
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.num_bytes()));
    EXPECT_EQ((*multi)->length(1), singles[1]->length());
    EXPECT_EQ((*multi)->length(2), singles[2]->length() - 1);
  }
}

TEST_F(SessionCheckTest, LayersAreChecked) {
  config_.num_layers = 0;
  EXPECT_EQ(CreateError().message(), "num_layers: must be > 0, got 0");
  // Bounded, so that the per-layer bookkeeping and a step's per-layer
  // work are too.
  config_.num_layers = kMaxSessionLayers + 1;
  EXPECT_EQ(CreateError().message(),
            "num_layers: 1025 is more than the 1024 layers a session may "
            "hold");
  EXPECT_EQ(DecodeSession::CacheDims(config_).status().message(),
            CreateError().message());
  config_.num_layers = kMaxSessionLayers;
  EXPECT_NE(Make(), nullptr);
  config_.num_layers = 4;
  auto s = Make();
  ASSERT_NE(s, nullptr);
  q_ = Random(DType::kFloat32, {4, 1, 8});
  k_ = Random(DType::kFloat32, {2, 1, 8});
  v_ = Random(DType::kFloat32, {2, 1, 8});
  for (int64_t layer : {int64_t{5}, int64_t{4}, int64_t{-1}}) {
    DecodeStepInputs in{std::nullopt, q_.view(),    k_.view(),
                        v_.view(),    std::nullopt, layer};
    TensorResults results;
    const absl::Status status = s->Step(in, {}, results);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(status.message(),
              absl::StrCat("layer: ", layer, " is out of range [0, 4)"));
  }
  // A position counts the named layer's tokens.
  DecodeStepInputs in{std::nullopt, q_.view(),    k_.view(),
                      v_.view(),    std::nullopt, 2};
  TensorResults results;
  ASSERT_TRUE(s->Step(in, {}, results).ok());
  in.layer = 1;
  in.position = 1;
  EXPECT_EQ(s->Step(in, {}, results).message(),
            "position: 1 is not in [0, 0] (the tokens cached)");
  in.layer = 2;
  ASSERT_TRUE(s->Step(in, {}, results).ok());
  EXPECT_EQ(s->length(2), 2);
  EXPECT_EQ(s->length(1), 0);
  // Room is per layer: max_length 10 in each.
  q_ = Random(DType::kFloat32, {4, 9, 8});
  k_ = Random(DType::kFloat32, {2, 9, 8});
  v_ = Random(DType::kFloat32, {2, 9, 8});
  in = {std::nullopt, q_.view(), k_.view(), v_.view(), std::nullopt, 2};
  EXPECT_EQ(s->Step(in, {}, results).message(),
            "session: 2 cached + 9 new tokens exceed its max_length 10");
  in.layer = 3;
  EXPECT_TRUE(s->Step(in, {}, results).ok());
  // Memory: every layer counted, BytesAt moving one layer only.
  EXPECT_EQ(s->cache_bytes(), s->BytesAt(2, 2));
  EXPECT_GT(s->BytesAt(10, 0), s->cache_bytes());
}

}  // namespace
}  // namespace attnserve::testing
