// The core's MultiHeadAttend against a float64 reference built from
// RefLinear and RefAttend, over a table of layer layouts, masks and options,
// and its input checks.
#include "core/multi_head_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention.h"
#include "core/attention_common.h"
#include "core/attention_weights.h"
#include "core/convert.h"
#include "gtest/gtest.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {
namespace {

struct MhaCase {
  std::string name;
  int64_t batch = 2;  // 0: unbatched query [Lq, Eq]
  int64_t lq = 5, lk = 5;
  int64_t eq = 16, ek = 16, ev = 16;
  int heads = 4;
  int kv_heads = 0;  // grouped-query attention; 0: heads
  int64_t rotary_dims = 0;
  int64_t head_dk = 4, head_dv = 4;
  bool fused = false;  // in_proj_weight (requires eq = ek = ev = heads*dk)
  bool bias = true;
  int64_t out_dim = 16;  // 0: no output projection
  bool out_bias = true;
  bool cross = false;  // separate key/value tensors
  int mask_rank = 0;   // 0 none, 2 [Lq,Lk], 3 [B,Lq,Lk], 4 [B,H,Lq,Lk]
  DType mask_dtype = DType::kBool;
  bool key_padding = false;
  bool causal = false;
  std::optional<float> scale = std::nullopt;
  std::optional<float> temperature = std::nullopt;
  bool average = false;
  DType dtype = DType::kFloat32;
};

RefTensor Reshaped(RefTensor t, Shape shape) {
  t.shape = std::move(shape);
  return t;
}

std::optional<RefTensor> OptRef(const std::optional<Tensor>& t) {
  if (!t) return std::nullopt;
  return ToRef(t->view());
}

std::optional<TensorView> OptView(const std::optional<Tensor>& t) {
  if (!t) return std::nullopt;
  return t->view();
}

// Weights scaled like nn.Linear's initialization, so that activations keep
// unit scale and the absolute tolerance means the same at every width.
Tensor RandomWeight(Shape shape, std::mt19937& rng) {
  Tensor w = RandomTensor(DType::kFloat32, shape, rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(shape.back()));
  for (int64_t i = 0; i < w.num_elements(); ++i) w.data_as<float>()[i] *= scale;
  return w;
}

void PrintTo(const MhaCase& c, std::ostream* os) { *os << c.name; }

class MhaTableTest : public ::testing::TestWithParam<MhaCase> {};

TEST_P(MhaTableTest, MatchesFloat64Reference) {
  const MhaCase& c = GetParam();
  std::mt19937 rng(99);
  const bool batched = c.batch > 0;
  const int64_t b = batched ? c.batch : 1;
  const int64_t h = c.heads;
  const int64_t kvh = c.kv_heads == 0 ? h : c.kv_heads;
  auto shaped = [&](int64_t len, int64_t dim) {
    return batched ? Shape{b, len, dim} : Shape{len, dim};
  };
  Tensor query = RandomTensor(c.dtype, shaped(c.lq, c.eq), rng);
  std::optional<Tensor> key, value;
  if (c.cross) {
    key = RandomTensor(c.dtype, shaped(c.lk, c.ek), rng);
    value = RandomTensor(c.dtype, shaped(c.lk, c.ev), rng);
  }
  const int64_t lk = c.cross ? c.lk : c.lq;
  std::optional<Tensor> wq, wk, wv, win, bq, bk, bv, bin, wo, bo;
  if (c.fused) {
    win = RandomWeight({3 * c.eq, c.eq}, rng);
    if (c.bias) bin = RandomTensor(DType::kFloat32, {3 * c.eq}, rng);
  } else {
    wq = RandomWeight({h * c.head_dk, c.eq}, rng);
    wk = RandomWeight({kvh * c.head_dk, c.cross ? c.ek : c.eq}, rng);
    wv = RandomWeight({kvh * c.head_dv, c.cross ? c.ev : c.eq}, rng);
    if (c.bias) {
      bq = RandomTensor(DType::kFloat32, {h * c.head_dk}, rng);
      bk = RandomTensor(DType::kFloat32, {kvh * c.head_dk}, rng);
      bv = RandomTensor(DType::kFloat32, {kvh * c.head_dv}, rng);
    }
  }
  const int64_t dv_total = c.fused ? c.eq : h * c.head_dv;
  if (c.out_dim > 0) {
    wo = RandomWeight({c.out_dim, dv_total}, rng);
    if (c.out_bias) bo = RandomTensor(DType::kFloat32, {c.out_dim}, rng);
  }
  std::optional<Tensor> mask, padding;
  Shape mask_shape;
  if (c.mask_rank == 2) mask_shape = {c.lq, lk};
  if (c.mask_rank == 3) mask_shape = {b, c.lq, lk};
  if (c.mask_rank == 4) mask_shape = {b, h, c.lq, lk};
  if (c.mask_rank > 0) mask = RandomTensor(c.mask_dtype, mask_shape, rng, 0.6);
  if (c.key_padding) {
    padding = RandomTensor(DType::kUInt8, batched ? Shape{b, lk} : Shape{lk},
                           rng, 0.7);
  }

  MultiHeadWeights w;
  w.num_heads = c.heads;
  w.num_kv_heads = c.kv_heads;
  w.q_proj_weight = OptView(wq);
  w.k_proj_weight = OptView(wk);
  w.v_proj_weight = OptView(wv);
  w.in_proj_weight = OptView(win);
  w.q_proj_bias = OptView(bq);
  w.k_proj_bias = OptView(bk);
  w.v_proj_bias = OptView(bv);
  w.in_proj_bias = OptView(bin);
  w.out_proj_weight = OptView(wo);
  w.out_proj_bias = OptView(bo);
  MultiHeadInputs in{query.view(), OptView(key), OptView(value), OptView(mask),
                     OptView(padding)};
  MultiHeadOptions options;
  options.attention.causal = c.causal;
  options.attention.scale = c.scale;
  options.attention.temperature = c.temperature;
  options.attention.return_weights = true;
  options.average_weights = c.average;
  // Rotary embeddings are a prepared layer's option: the table checks them
  // through MultiHeadLayer below.
  TensorResults free_results;
  const absl::Status free_status =
      c.rotary_dims == 0 ? MultiHeadAttend(w, in, options, free_results)
                         : absl::OkStatus();
  ASSERT_TRUE(free_status.ok()) << free_status;

  // Reference: project, split heads, attend, merge, project.
  const RefTensor q_ref = Reshaped(ToRef(query.view()), {b, c.lq, c.eq});
  const RefTensor k_ref =
      key ? Reshaped(ToRef(key->view()), {b, lk, c.ek}) : q_ref;
  const RefTensor v_ref =
      value ? Reshaped(ToRef(value->view()), {b, lk, c.ev}) : k_ref;
  RefMultiHeadWeights ref_weights;
  ref_weights.num_heads = c.heads;
  ref_weights.num_kv_heads = c.kv_heads;
  ref_weights.rotary_dims = c.rotary_dims;
  ref_weights.q_proj_weight = OptRef(wq);
  ref_weights.k_proj_weight = OptRef(wk);
  ref_weights.v_proj_weight = OptRef(wv);
  ref_weights.in_proj_weight = OptRef(win);
  ref_weights.q_proj_bias = OptRef(bq);
  ref_weights.k_proj_bias = OptRef(bk);
  ref_weights.v_proj_bias = OptRef(bv);
  ref_weights.in_proj_bias = OptRef(bin);
  ref_weights.out_proj_weight = OptRef(wo);
  ref_weights.out_proj_bias = OptRef(bo);
  std::vector<RefTensor> masks;
  std::vector<bool> keep;
  if (mask) {
    RefTensor m = ToRef(mask->view());
    if (c.mask_rank == 3) m.shape = {b, 1, c.lq, lk};
    masks.push_back(m);
    keep.push_back(c.mask_dtype != DType::kFloat32);
  }
  if (padding) {
    masks.push_back(Reshaped(ToRef(padding->view()), {b, 1, 1, lk}));
    keep.push_back(true);
  }
  const RefAttentionResult att =
      RefMultiHeadAttend(ref_weights, q_ref, k_ref, v_ref, masks, keep,
                         {c.causal, c.scale, c.temperature});
  RefTensor out = att.output;
  if (!batched) out.shape.erase(out.shape.begin());
  RefTensor weights = att.weights;
  if (c.average) {
    RefTensor mean{{b, c.lq, lk}, std::vector<double>(b * c.lq * lk, 0.0)};
    const int64_t plane = c.lq * lk;
    for (int64_t i = 0; i < b; ++i)
      for (int64_t hh = 0; hh < h; ++hh)
        for (int64_t p = 0; p < plane; ++p)
          mean.values[i * plane + p] +=
              weights.values[(i * h + hh) * plane + p] / h;
    weights = mean;
  }
  if (!batched) weights.shape.erase(weights.shape.begin());

  if (c.rotary_dims == 0) {
    const AttentionResult result = TakeResult(free_results);
    EXPECT_EQ(result.output.dtype(), c.dtype);
    EXPECT_TRUE(AllClose(result.output.view(), out, ToleranceFor(c.dtype)));
    ASSERT_TRUE(result.weights.has_value());
    EXPECT_TRUE(AllClose(result.weights->view(), weights,
                         c.dtype == DType::kFloat32 ? kFloat32Tolerance
                                                    : ToleranceFor(c.dtype)));
  }

  // The same layer prepared once with packed weights, as a served model is.
  MultiHeadLayer::Options layer_options;
  layer_options.compute_dtype =
      c.dtype == DType::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
  layer_options.rotary.dims = c.rotary_dims;
  auto layer = MultiHeadLayer::Create(w, layer_options);
  ASSERT_TRUE(layer.ok()) << layer.status();
  TensorResults packed_results;
  ASSERT_TRUE((*layer)->Run(in, options, packed_results).ok());
  std::optional<Tensor> packed_output = packed_results.Take("output");
  ASSERT_TRUE(packed_output.has_value());
  EXPECT_TRUE(AllClose(packed_output->view(), out, ToleranceFor(c.dtype)));

  // A float32 model sent a lower-precision query computes in float32 and
  // answers in the query's dtype.
  if (c.dtype != DType::kFloat32) {
    MultiHeadLayer::Options f32_options;
    f32_options.rotary.dims = c.rotary_dims;
    auto f32_layer = MultiHeadLayer::Create(w, f32_options);
    ASSERT_TRUE(f32_layer.ok()) << f32_layer.status();
    TensorResults f32_results;
    const absl::Status run = (*f32_layer)->Run(in, options, f32_results);
    ASSERT_TRUE(run.ok()) << run;
    std::optional<Tensor> f32_output = f32_results.Take("output");
    ASSERT_TRUE(f32_output.has_value());
    EXPECT_EQ(f32_output->dtype(), c.dtype);
    EXPECT_TRUE(AllClose(f32_output->view(), out, ToleranceFor(c.dtype)));
  }
}

const MhaCase kMhaCases[] = {
    Case("default", [](MhaCase&) {}),
    Case("fused_in_proj", [](MhaCase& c) { c.fused = true; }),
    Case("fused_no_bias",
         [](MhaCase& c) {
           c.fused = true;
           c.bias = false;
         }),
    Case("no_bias", [](MhaCase& c) { c.bias = false; }),
    Case("no_out_proj", [](MhaCase& c) { c.out_dim = 0; }),
    Case("out_proj_no_bias", [](MhaCase& c) { c.out_bias = false; }),
    Case("out_dim_differs", [](MhaCase& c) { c.out_dim = 7; }),
    Case("single_head_dk_ne_dv",
         [](MhaCase& c) {
           c.heads = 1;
           c.head_dk = 6;
           c.head_dv = 10;
           c.out_dim = 0;
         }),
    Case("dk_ne_dv",
         [](MhaCase& c) {
           c.head_dk = 3;
           c.head_dv = 5;
         }),
    Case("cross_attention",
         [](MhaCase& c) {
           c.cross = true;
           c.lq = 3;
           c.lk = 9;
           c.ek = 12;
           c.ev = 20;
         }),
    Case("odd_sizes",
         [](MhaCase& c) {
           c.batch = 3;
           c.lq = 7;
           c.eq = 13;
           c.heads = 3;
           c.head_dk = 5;
           c.head_dv = 2;
           c.out_dim = 11;
         }),
    Case("unbatched", [](MhaCase& c) { c.batch = 0; }),
    Case("unbatched_masks",
         [](MhaCase& c) {
           c.batch = 0;
           c.mask_rank = 2;
           c.key_padding = true;
         }),
    Case("mask_lq_lk", [](MhaCase& c) { c.mask_rank = 2; }),
    Case("mask_b_lq_lk", [](MhaCase& c) { c.mask_rank = 3; }),
    Case("mask_b_h_lq_lk", [](MhaCase& c) { c.mask_rank = 4; }),
    Case("mask_additive",
         [](MhaCase& c) {
           c.mask_rank = 3;
           c.mask_dtype = DType::kFloat32;
         }),
    Case("mask_uint8",
         [](MhaCase& c) {
           c.mask_rank = 4;
           c.mask_dtype = DType::kUInt8;
         }),
    Case("key_padding", [](MhaCase& c) { c.key_padding = true; }),
    Case("key_padding_and_mask",
         [](MhaCase& c) {
           c.key_padding = true;
           c.mask_rank = 3;
         }),
    Case("causal",
         [](MhaCase& c) {
           c.causal = true;
           c.lq = 8;
         }),
    Case("causal_cross",
         [](MhaCase& c) {
           c.causal = true;
           c.cross = true;
           c.lq = 6;
           c.lk = 4;
         }),
    Case("scale_temperature",
         [](MhaCase& c) {
           c.scale = 0.25f;
           c.temperature = 2.0f;
         }),
    Case("average_weights",
         [](MhaCase& c) {
           c.average = true;
           c.mask_rank = 4;
         }),
    Case("average_unbatched",
         [](MhaCase& c) {
           c.average = true;
           c.batch = 0;
         }),
    Case("vit_block",
         [](MhaCase& c) {
           c.batch = 1;
           c.lq = 17;
           c.eq = 768;
           c.heads = 12;
           c.head_dk = 64;
           c.head_dv = 64;
           c.out_dim = 768;
           c.fused = true;
         }),
    Case("bf16",
         [](MhaCase& c) {
           c.dtype = DType::kBFloat16;
           c.mask_rank = 3;
         }),
    Case("f16", [](MhaCase& c) { c.dtype = DType::kFloat16; }),
    Case("tiles_fused_causal",
         [](MhaCase& c) {
           c.batch = 1;
           c.lq = 300;
           c.eq = 64;
           c.heads = 4;
           c.head_dk = 16;
           c.head_dv = 16;
           c.out_dim = 64;
           c.fused = true;
           c.causal = true;
         }),
    Case("tiles_cross_masks",
         [](MhaCase& c) {
           c.cross = true;
           c.lq = 70;
           c.lk = 300;
           c.ek = 12;
           c.ev = 20;
           c.mask_rank = 4;
           c.key_padding = true;
         }),
    Case("gqa",
         [](MhaCase& c) {
           c.heads = 4;
           c.kv_heads = 2;
           c.mask_rank = 4;
           c.key_padding = true;
         }),
    Case("mqa_causal",
         [](MhaCase& c) {
           c.heads = 4;
           c.kv_heads = 1;
           c.causal = true;
           c.lq = 9;
         }),
    Case("gqa_cross_dk_ne_dv",
         [](MhaCase& c) {
           c.kv_heads = 2;
           c.cross = true;
           c.lq = 3;
           c.lk = 7;
           c.ek = 12;
           c.ev = 20;
           c.head_dk = 6;
           c.head_dv = 2;
         }),
    Case("gqa_bf16",
         [](MhaCase& c) {
           c.kv_heads = 2;
           c.dtype = DType::kBFloat16;
         }),
    Case("rotary",
         [](MhaCase& c) {
           c.head_dk = 8;
           c.rotary_dims = 8;
           c.lq = 12;
         }),
    Case("rotary_partial_gqa_causal",
         [](MhaCase& c) {
           c.heads = 4;
           c.kv_heads = 2;
           c.head_dk = 8;
           c.rotary_dims = 4;
           c.causal = true;
           c.lq = 11;
         }),
    Case("rotary_fused_bf16",
         [](MhaCase& c) {
           c.fused = true;
           c.rotary_dims = 4;
           c.dtype = DType::kBFloat16;
         }),
    Case("rotary_cross",
         [](MhaCase& c) {
           c.cross = true;
           c.lq = 4;
           c.lk = 9;
           c.ek = 12;
           c.ev = 20;
           c.rotary_dims = 2;
         }),
};

INSTANTIATE_TEST_SUITE_P(Table, MhaTableTest, ::testing::ValuesIn(kMhaCases),
                         [](const auto& info) { return info.param.name; });

// Input checks, with the exact message users see.
class MhaErrorTest : public ::testing::Test {
 protected:
  MhaErrorTest() {
    query_ = RandomTensor(DType::kFloat32, {2, 5, 16}, rng_);
    wq_ = RandomTensor(DType::kFloat32, {16, 16}, rng_);
    wk_ = RandomTensor(DType::kFloat32, {16, 16}, rng_);
    wv_ = RandomTensor(DType::kFloat32, {16, 16}, rng_);
    weights_.num_heads = 4;
    weights_.q_proj_weight = wq_.view();
    weights_.k_proj_weight = wk_.view();
    weights_.v_proj_weight = wv_.view();
    inputs_.query = query_.view();
  }
  void ExpectError(const std::string& message) {
    auto r = MultiHeadAttend(weights_, inputs_, options_);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), message);
  }
  Tensor Random(DType dtype, Shape shape) {
    return RandomTensor(dtype, shape, rng_);
  }

  std::mt19937 rng_{11};
  Tensor query_, wq_, wk_, wv_;
  MultiHeadWeights weights_;
  MultiHeadInputs inputs_;
  MultiHeadOptions options_;
};

TEST_F(MhaErrorTest, ValidInputsWork) {
  EXPECT_TRUE(MultiHeadAttend(weights_, inputs_, options_).ok());
}

TEST_F(MhaErrorTest, SharedInProjBiasWithSeparateWeightsBiasesEachThird) {
  // PyTorch's layout with kdim/vdim != embed_dim: separate weights, one
  // [3E] in_proj_bias. It must equal the same bias given in thirds.
  Tensor shared = Random(DType::kFloat32, {48});
  const float* data = shared.data_as<float>();
  weights_.in_proj_bias = shared.view();
  auto together = MultiHeadAttend(weights_, inputs_, options_);
  ASSERT_TRUE(together.ok()) << together.status();
  weights_.in_proj_bias.reset();
  weights_.q_proj_bias = TensorView{DType::kFloat32, {16}, data};
  weights_.k_proj_bias = TensorView{DType::kFloat32, {16}, data + 16};
  weights_.v_proj_bias = TensorView{DType::kFloat32, {16}, data + 32};
  auto apart = MultiHeadAttend(weights_, inputs_, options_);
  ASSERT_TRUE(apart.ok()) << apart.status();
  const float* a = together->output.data_as<float>();
  const float* b = apart->output.data_as<float>();
  for (int64_t i = 0; i < together->output.num_elements(); ++i) {
    ASSERT_EQ(a[i], b[i]) << i;
  }
  weights_.in_proj_bias = shared.view();
  ExpectError(
      "in_proj_bias: give either in_proj_bias or "
      "q_proj_bias/k_proj_bias/v_proj_bias, not both");
  weights_.q_proj_bias.reset();
  weights_.k_proj_bias.reset();
  weights_.v_proj_bias.reset();
  Tensor short_bias = Random(DType::kFloat32, {40});
  weights_.in_proj_bias = short_bias.view();
  auto r = MultiHeadAttend(weights_, inputs_, options_);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("in_proj_bias"), std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("48"), std::string::npos)
      << r.status().message();
}

TEST_F(MhaErrorTest, UnbatchedQueryTakesAPerHeadMaskAsPyTorchDoes) {
  // PyTorch: an unbatched query's 3-D attn_mask is [H, Lq, Lk].
  Tensor query = Random(DType::kFloat32, {5, 16});
  Tensor mask = Random(DType::kFloat32, {4, 5, 5});
  inputs_.query = query.view();
  inputs_.attn_mask = mask.view();
  auto unbatched = MultiHeadAttend(weights_, inputs_, options_);
  ASSERT_TRUE(unbatched.ok()) << unbatched.status();
  // The same as a batch of one with the [1, H, Lq, Lk] mask.
  inputs_.query = TensorView{DType::kFloat32, {1, 5, 16}, query.data()};
  inputs_.attn_mask = TensorView{DType::kFloat32, {1, 4, 5, 5}, mask.data()};
  auto batched = MultiHeadAttend(weights_, inputs_, options_);
  ASSERT_TRUE(batched.ok()) << batched.status();
  ASSERT_EQ(unbatched->output.num_elements(), batched->output.num_elements());
  for (int64_t i = 0; i < batched->output.num_elements(); ++i) {
    ASSERT_EQ(unbatched->output.data_as<float>()[i],
              batched->output.data_as<float>()[i])
        << i;
  }
  Tensor wrong = Random(DType::kFloat32, {3, 5, 5});
  inputs_.query = query.view();
  inputs_.attn_mask = wrong.view();
  ExpectError(
      "attn_mask: shape [3, 5, 5], expected [5, 5], [4, 5, 5] or "
      "[1, 4, 5, 5]");
}

TEST_F(MhaErrorTest, HeadsMustDivide) {
  weights_.num_heads = 3;
  ExpectError("q_proj_weight: dim 0 (16) is not divisible by num_heads 3");
}

TEST_F(MhaErrorTest, KvHeadsMustDivideHeads) {
  weights_.num_kv_heads = 3;
  ExpectError("num_kv_heads: 3 does not divide num_heads 4");
}

TEST_F(MhaErrorTest, KvProjectionsHaveKvHeads) {
  weights_.num_kv_heads = 2;  // k/v_proj_weight keep 4 heads' rows
  ExpectError(
      "k_proj_weight: dim 0 16 != num_kv_heads x head dim (q_proj_weight dim "
      "0 / num_heads) = 8");
}

TEST_F(MhaErrorTest, FusedProjectionHasNoKvHeads) {
  Tensor in_proj = Random(DType::kFloat32, {48, 16});
  weights_ = MultiHeadWeights{};
  weights_.num_heads = 4;
  weights_.num_kv_heads = 2;
  weights_.in_proj_weight = in_proj.view();
  ExpectError(
      "in_proj_weight: the fused projection has num_heads key/value heads; "
      "with num_kv_heads 2 give k_proj_weight and v_proj_weight");
}

TEST_F(MhaErrorTest, RotaryDimsAreCheckedAtCreation) {
  MultiHeadLayer::Options options;
  options.rotary.dims = 6;  // head dim 4
  auto layer = MultiHeadLayer::Create(weights_, options);
  ASSERT_FALSE(layer.ok());
  EXPECT_EQ(layer.status().message(), "rotary_dims: 6 > head dim 4");
  options.rotary.dims = 3;
  layer = MultiHeadLayer::Create(weights_, options);
  ASSERT_FALSE(layer.ok());
  EXPECT_EQ(layer.status().message(),
            "rotary_dims: must be even and >= 0 (the halves rotate in pairs), "
            "got 3");
}

TEST_F(MhaErrorTest, HeadsMustBePositive) {
  weights_.num_heads = 0;
  ExpectError("num_heads: must be > 0, got 0");
}

TEST_F(MhaErrorTest, MissingProjection) {
  weights_.v_proj_weight.reset();
  ExpectError(
      "v_proj_weight: missing (give q_proj_weight, k_proj_weight and "
      "v_proj_weight, or in_proj_weight)");
}

TEST_F(MhaErrorTest, FusedAndSeparateTogether) {
  Tensor fused = Random(DType::kFloat32, {48, 16});
  weights_.in_proj_weight = fused.view();
  ExpectError(
      "in_proj_weight: give either in_proj_weight or "
      "q_proj_weight/k_proj_weight/v_proj_weight, not both");
}

TEST_F(MhaErrorTest, FusedShape) {
  Tensor fused = Random(DType::kFloat32, {40, 16});
  weights_ = MultiHeadWeights{};
  weights_.num_heads = 4;
  weights_.in_proj_weight = fused.view();
  ExpectError("in_proj_weight: dim 0 40 != 3 x dim 1 = 48");
}

TEST_F(MhaErrorTest, BiasLength) {
  Tensor bias = Random(DType::kFloat32, {15});
  weights_.k_proj_bias = bias.view();
  ExpectError("k_proj_bias: shape [15], expected [16]");
}

TEST_F(MhaErrorTest, QueryDimMismatch) {
  Tensor query = Random(DType::kFloat32, {2, 5, 12});
  inputs_.query = query.view();
  ExpectError("query: last dim 12 != q_proj_weight dim 1 16");
}

TEST_F(MhaErrorTest, KeyRowsMustMatchQueryRows) {
  Tensor wk = Random(DType::kFloat32, {8, 16});
  weights_.k_proj_weight = wk.view();
  ExpectError("k_proj_weight: dim 0 8 != q_proj_weight dim 0 16");
}

TEST_F(MhaErrorTest, OutProjInputDim) {
  Tensor wo = Random(DType::kFloat32, {16, 12});
  weights_.out_proj_weight = wo.view();
  ExpectError("out_proj_weight: dim 1 12 != v_proj_weight rows (H*dv) = 16");
}

TEST_F(MhaErrorTest, OutProjBiasWithoutWeight) {
  Tensor bo = Random(DType::kFloat32, {16});
  weights_.out_proj_bias = bo.view();
  ExpectError("out_proj_bias: given without out_proj_weight");
}

TEST_F(MhaErrorTest, QueryRank) {
  Tensor query = Random(DType::kFloat32, {1, 2, 5, 16});
  inputs_.query = query.view();
  ExpectError("query: rank 4 (shape [1, 2, 5, 16]), expected rank 2 to 3");
}

TEST_F(MhaErrorTest, KeyBatch) {
  Tensor key = Random(DType::kFloat32, {3, 5, 16});
  inputs_.key = key.view();
  ExpectError("key: dim 0 3 != query dim 0 2");
}

TEST_F(MhaErrorTest, ValueLength) {
  Tensor key = Random(DType::kFloat32, {2, 6, 16});
  Tensor value = Random(DType::kFloat32, {2, 7, 16});
  inputs_.key = key.view();
  inputs_.value = value.view();
  ExpectError("value: dim 1 7 != key dim 1 6");
}

TEST_F(MhaErrorTest, MaskShape) {
  Tensor mask = Random(DType::kBool, {2, 4, 5});
  inputs_.attn_mask = mask.view();
  ExpectError(
      "attn_mask: shape [2, 4, 5], expected [5, 5], [2, 5, 5] or [2, 4, 5, 5]");
}

TEST_F(MhaErrorTest, KeyPaddingShape) {
  Tensor mask = Random(DType::kBool, {2, 4});
  inputs_.key_padding_mask = mask.view();
  ExpectError("key_padding_mask: shape [2, 4], expected [2, 5]");
}

TEST_F(MhaErrorTest, WeightDType) {
  Tensor wq = Random(DType::kUInt8, {16, 16});
  weights_.q_proj_weight = wq.view();
  ExpectError(
      "q_proj_weight: dtype UINT8 not supported, expected FLOAT32 or BFLOAT16 "
      "or FLOAT16");
}

// NaN or +-Inf in an input or in any weight flows through the projections
// and the attention as IEEE arithmetic does (README, Semantics): against the
// float64 reference, unpacked (inline weights) and packed (a served model).
// With `padding`, key_padding_mask hides the corrupted key row: nothing of
// it may reach the output.
struct MhaNonFiniteCase {
  std::string where;  // query, key, value or a weight field's name
  float value;
  DType dtype;
  bool padding = false;
};

std::string MhaNonFiniteName(const MhaNonFiniteCase& c) {
  const std::string value = std::isnan(c.value) ? "NaN"
                            : c.value > 0       ? "PlusInf"
                                                : "MinusInf";
  return absl::StrCat(c.where, "_", value, "_", DTypeName(c.dtype),
                      c.padding ? "_padded" : "");
}

void PrintTo(const MhaNonFiniteCase& c, std::ostream* os) {
  *os << MhaNonFiniteName(c);
}

class MhaNonFiniteTest : public ::testing::TestWithParam<MhaNonFiniteCase> {};

TEST_P(MhaNonFiniteTest, PropagatesAsTheReferenceDoes) {
  const MhaNonFiniteCase& c = GetParam();
  constexpr int64_t kB = 2, kLq = 5, kLk = 6, kE = 16, kBadKey = 4;
  std::mt19937 rng(41);
  std::map<std::string, Tensor> t;
  t["query"] = RandomTensor(DType::kFloat32, {kB, kLq, kE}, rng);
  t["key"] = RandomTensor(DType::kFloat32, {kB, kLk, kE}, rng);
  t["value"] = RandomTensor(DType::kFloat32, {kB, kLk, kE}, rng);
  if (c.where == "in_proj_weight" || c.where == "in_proj_bias") {
    t["in_proj_weight"] = RandomWeight({3 * kE, kE}, rng);
    t["in_proj_bias"] = RandomTensor(DType::kFloat32, {3 * kE}, rng);
  } else {
    for (const char* name : {"q_proj_weight", "k_proj_weight", "v_proj_weight"})
      t[name] = RandomWeight({kE, kE}, rng);
    for (const char* name : {"q_proj_bias", "k_proj_bias", "v_proj_bias"})
      t[name] = RandomTensor(DType::kFloat32, {kE}, rng);
  }
  t["out_proj_weight"] = RandomWeight({kE, kE}, rng);
  t["out_proj_bias"] = RandomTensor(DType::kFloat32, {kE}, rng);
  // Batch 1's query row 2, key and value row 4; row 5, column 3 of a weight
  // (the query's third of in_proj_weight); element 5 of a bias.
  Tensor& bad = t.at(c.where);
  int64_t at = bad.shape().size() == 1 ? 5 : 5 * kE + 3;
  if (c.where == "query") at = (kLq + 2) * kE + 3;
  if (c.where == "key") at = (kLk + kBadKey) * kE + 1;
  if (c.where == "value") at = (kLk + kBadKey) * kE + 2;
  bad.data_as<float>()[at] = c.value;
  for (auto& [name, tensor] : t) {
    tensor = *Float32ToTensor(tensor.data_as<float>(), tensor.shape(), c.dtype);
  }
  std::optional<Tensor> padding;
  if (c.padding) {
    padding = *Tensor::Allocate(DType::kBool, {kB, kLk});
    for (int64_t i = 0; i < kB * kLk; ++i) {
      padding->data_as<uint8_t>()[i] = i == kLk + kBadKey ? 0 : 1;
    }
  }

  MultiHeadWeights w;
  RefMultiHeadWeights ref_w;
  w.num_heads = ref_w.num_heads = 4;
  for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
    auto it = t.find(std::string(field.name));
    if (it == t.end()) continue;
    w.*field.member = it->second.view();
    *ref_w.Field(field.name) = ToRef(it->second.view());
  }
  MultiHeadInputs in{t.at("query").view(), t.at("key").view(),
                     t.at("value").view(), std::nullopt, OptView(padding)};
  MultiHeadOptions options;
  options.attention.return_weights = true;
  std::vector<RefTensor> masks;
  if (padding) {
    masks.push_back(Reshaped(ToRef(padding->view()), {kB, 1, 1, kLk}));
  }
  const RefAttentionResult ref = RefMultiHeadAttend(
      ref_w, ToRef(t.at("query").view()), ToRef(t.at("key").view()),
      ToRef(t.at("value").view()), masks, std::vector<bool>(masks.size(), true),
      {false, std::nullopt, std::nullopt});
  const Tolerance tol = ToleranceFor(c.dtype);

  auto unpacked = MultiHeadAttend(w, in, options);
  ASSERT_TRUE(unpacked.ok()) << unpacked.status();
  EXPECT_TRUE(AllClose(unpacked->output.view(), ref.output, tol));
  EXPECT_TRUE(AllClose(unpacked->weights->view(), ref.weights, tol));

  MultiHeadLayer::Options layer_options;
  layer_options.compute_dtype =
      c.dtype == DType::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
  auto layer = MultiHeadLayer::Create(w, layer_options);
  ASSERT_TRUE(layer.ok()) << layer.status();
  TensorResults packed;
  ASSERT_TRUE((*layer)->Run(in, {}, packed).ok());
  EXPECT_TRUE(AllClose(packed.Take("output")->view(), ref.output, tol));

  // Not vacuous: the corruption shows, unless the mask hides it; a
  // corrupted input leaves the other batch finite.
  const RefTensor out = ToRef(unpacked->output.view());
  int64_t non_finite[kB] = {0, 0};
  for (int64_t i = 0; i < kB * kLq * kE; ++i) {
    if (!std::isfinite(out.values[i])) ++non_finite[i / (kLq * kE)];
  }
  if (c.padding) {
    EXPECT_EQ(non_finite[0] + non_finite[1], 0);
  } else if (!(c.where == "k_proj_bias" && c.value < 0)) {
    // (-Inf in k_proj_bias adds the same -inf * q to every key's logit: a
    // row of a head sees all -inf, zeros, or all +inf, NaN, by the sign of
    // its query; with this seed no row of batch 1 is NaN.)
    EXPECT_GT(non_finite[1], 0);
  }
  if (c.where == "query" || c.where == "key" || c.where == "value") {
    EXPECT_EQ(non_finite[0], 0);
  }
}

std::vector<MhaNonFiniteCase> MhaNonFiniteCases() {
  std::vector<std::string> wheres = {"query", "key", "value"};
  for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
    wheres.emplace_back(field.name);
  }
  std::vector<MhaNonFiniteCase> cases;
  for (const std::string& where : wheres) {
    for (float value : {NAN, INFINITY, -INFINITY}) {
      for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        cases.push_back({where, value, dtype});
        if (where == "key" || where == "value") {
          cases.push_back({where, value, dtype, /*padding=*/true});
        }
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Table, MhaNonFiniteTest,
                         ::testing::ValuesIn(MhaNonFiniteCases()),
                         [](const auto& info) {
                           return MhaNonFiniteName(info.param);
                         });

// The rule for BFLOAT16 inputs (README, Semantics 5): every input dtype
// computes in float32, BFLOAT16 inputs widened exactly, unless compute_bf16
// asks for the bfloat16 kernels. Measured against the float64 reference of
// the same values, for unit-variance inputs and for a sharp softmax (scale
// 7.4), float32 and bfloat16 inputs, both modes; the errors are printed
// (and recorded as test properties), as the README quotes them.
class Bf16RuleTest : public ::testing::Test {
 protected:
  // Normal values of standard deviation `stddev`, rounded to bfloat16 so
  // that the FLOAT32 and BFLOAT16 copies hold the same numbers.
  static Tensor Normal(const Shape& shape, float stddev, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, stddev);
    std::vector<float> values(NumElements(shape));
    for (float& v : values) v = BFloat16ToFloat(FloatToBFloat16(normal(rng)));
    return *Float32ToTensor(values.data(), shape, DType::kFloat32);
  }
  static Tensor As(const Tensor& t, DType dtype) {
    return *Float32ToTensor(t.data_as<float>(), t.shape(), dtype);
  }

  // The largest |got - expected|.
  static double MaxError(const TensorView& got, const RefTensor& expected) {
    const RefTensor values = ToRef(got);
    EXPECT_EQ(values.shape, expected.shape);
    double worst = 0;
    for (size_t i = 0; i < values.values.size(); ++i) {
      worst = std::max(worst, std::abs(values.values[i] - expected.values[i]));
    }
    return worst;
  }

  // The float32 tolerance widened by the output's bfloat16 rounding (half
  // an ulp, at most 2^-8 of the value): what float32 computation of
  // bfloat16 inputs must meet.
  static constexpr Tolerance kFloat32ThenBFloat16{1e-4, 1e-4 + 0x1p-8};

  // Checks one case's four results, in order: float32 inputs computed in
  // float32 and with compute_bf16, bfloat16 inputs likewise.
  static void Check(const std::string& what, bool sharp,
                    const std::vector<Tensor>& outputs,
                    const RefTensor& expected) {
    ASSERT_EQ(outputs.size(), 4u);
    const char* names[] = {
        "float32_inputs_float32_compute", "float32_inputs_compute_bf16",
        "bfloat16_inputs_float32_compute", "bfloat16_inputs_compute_bf16"};
    std::cout << what << ": max |error| vs float64:";
    double errors[4];
    for (int i = 0; i < 4; ++i) {
      errors[i] = MaxError(outputs[i].view(), expected);
      std::cout << " " << names[i] << " " << errors[i] << ";";
      ::testing::Test::RecordProperty(absl::StrCat(what, "_", names[i]),
                                      absl::StrCat(errors[i]));
    }
    std::cout << "\n";
    EXPECT_EQ(outputs[0].dtype(), DType::kFloat32);
    EXPECT_EQ(outputs[2].dtype(), DType::kBFloat16);
    EXPECT_TRUE(AllClose(outputs[0].view(), expected, kFloat32Tolerance));
    // Without compute_bf16, bfloat16 inputs get the float32 result rounded.
    EXPECT_TRUE(AllClose(outputs[2].view(), expected, kFloat32ThenBFloat16));
    // compute_bf16 takes the bfloat16 kernels for either input dtype.
    EXPECT_NE(0, std::memcmp(outputs[0].data(), outputs[1].data(),
                             outputs[0].num_bytes()));
    EXPECT_NE(0, std::memcmp(outputs[2].data(), outputs[3].data(),
                             outputs[2].num_bytes()));
    if (!sharp) {
      EXPECT_TRUE(AllClose(outputs[1].view(), expected, kBFloat16Tolerance));
      EXPECT_TRUE(AllClose(outputs[3].view(), expected, kBFloat16Tolerance));
    }
  }
};

TEST_F(Bf16RuleTest, Attend) {
  std::mt19937 rng(61);
  const Tensor q = Normal({2, 4, 32, 64}, 1.0f, rng);
  const Tensor k = Normal({2, 4, 48, 64}, 1.0f, rng);
  const Tensor v = Normal({2, 4, 48, 64}, 1.0f, rng);
  for (std::optional<float> scale : {std::optional<float>(), {7.4f}}) {
    const std::string what =
        scale ? "attend_sharp_scale_7.4" : "attend_unit_variance";
    SCOPED_TRACE(what);
    const RefAttentionResult ref =
        RefAttend(ToRef(q.view()), ToRef(k.view()), ToRef(v.view()), {}, {},
                  {false, scale, std::nullopt});
    std::vector<Tensor> outputs;
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      const Tensor qd = As(q, dtype), kd = As(k, dtype), vd = As(v, dtype);
      for (bool compute_bf16 : {false, true}) {
        AttentionOptions options;
        options.scale = scale;
        options.compute_bf16 = compute_bf16;
        auto result =
            Attend({qd.view(), kd.view(), vd.view(), std::nullopt}, options);
        ASSERT_TRUE(result.ok()) << result.status();
        outputs.push_back(std::move(result->output));
      }
    }
    Check(what, scale.has_value(), outputs, ref.output);
  }
}

// Embedding widths and heads: head dims 16 and 64.
class Bf16MultiHeadRuleTest
    : public Bf16RuleTest,
      public ::testing::WithParamInterface<std::pair<int64_t, int>> {};

TEST_P(Bf16MultiHeadRuleTest, MultiHeadAttend) {
  std::mt19937 rng(67);
  const auto [e, heads] = GetParam();
  const Tensor x = Normal({2, 32, e}, 1.0f, rng);
  // nn.Linear-like weights: the projections keep unit variance.
  const float w_std = 1.0f / std::sqrt(static_cast<float>(e));
  const Tensor wq = Normal({e, e}, w_std, rng);
  const Tensor wk = Normal({e, e}, w_std, rng);
  const Tensor wv = Normal({e, e}, w_std, rng);
  const Tensor wo = Normal({e, e}, w_std, rng);
  MultiHeadWeights w;
  w.num_heads = heads;
  w.q_proj_weight = wq.view();
  w.k_proj_weight = wk.view();
  w.v_proj_weight = wv.view();
  w.out_proj_weight = wo.view();
  RefMultiHeadWeights ref_weights;
  ref_weights.num_heads = heads;
  ref_weights.q_proj_weight = ToRef(wq.view());
  ref_weights.k_proj_weight = ToRef(wk.view());
  ref_weights.v_proj_weight = ToRef(wv.view());
  ref_weights.out_proj_weight = ToRef(wo.view());
  const RefTensor x_ref = ToRef(x.view());
  for (std::optional<float> scale : {std::optional<float>(), {7.4f}}) {
    const std::string what = absl::StrCat(
        "mha_E", e, "_H", heads, scale ? "_sharp_scale_7.4" : "_unit_variance");
    SCOPED_TRACE(what);
    const RefAttentionResult ref = RefMultiHeadAttend(
        ref_weights, x_ref, x_ref, x_ref, {}, {}, {false, scale, std::nullopt});
    std::vector<Tensor> outputs;
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      const Tensor xd = As(x, dtype);
      for (bool compute_bf16 : {false, true}) {
        MultiHeadOptions options;
        options.attention.scale = scale;
        options.attention.compute_bf16 = compute_bf16;
        TensorResults results;
        const absl::Status status = MultiHeadAttend(
            w,
            {xd.view(), std::nullopt, std::nullopt, std::nullopt, std::nullopt},
            options, results);
        ASSERT_TRUE(status.ok()) << status;
        outputs.push_back(*results.Take("output"));
      }
    }
    Check(what, scale.has_value(), outputs, ref.output);
    if (scale.has_value()) {
      // Projected queries and keys rounded to bfloat16 move logits this
      // large by whole units: far off, where float32 compute is not.
      EXPECT_GT(MaxError(outputs[3].view(), ref.output),
                5 * MaxError(outputs[2].view(), ref.output));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Widths, Bf16MultiHeadRuleTest,
                         ::testing::Values(std::pair<int64_t, int>{64, 4},
                                           std::pair<int64_t, int>{512, 8}),
                         [](const auto& info) {
                           return absl::StrCat("E", info.param.first, "_H",
                                               info.param.second);
                         });

}  // namespace
}  // namespace attnserve::testing
