#include "core/multi_head_attention.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention_common.h"
#include "core/attention_kernel.h"
#include "core/convert.h"
#include "core/primitives.h"
#include "core/status_macros.h"
#include "core/verify.h"

namespace attnserve {
namespace {

absl::Status VerifyBias(const std::optional<TensorView>& bias,
                        absl::string_view field, int64_t expected_len) {
  if (!bias.has_value()) return absl::OkStatus();
  ATTN_RETURN_IF_ERROR(VerifyFloating(*bias, field));
  const int64_t expected[] = {expected_len};
  return VerifyShape(*bias, field, expected);
}

absl::Status VerifyHeadsDivide(const TensorView& weight,
                               absl::string_view field, int num_heads) {
  if (weight.dim(0) % num_heads == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": dim 0 (", weight.dim(0),
                   ") is not divisible by num_heads ", num_heads));
}

// Reads a multi-head attn_mask: [Lq, Lk], [B, Lq, Lk] shared by all heads,
// or [B, H, Lq, Lk]; for an unbatched query also PyTorch's [H, Lq, Lk].
absl::StatusOr<MaskLayout> MultiHeadMask(const TensorView& mask, bool batched,
                                         int64_t batch, int64_t heads,
                                         int64_t query_len, int64_t key_len) {
  ATTN_RETURN_IF_ERROR(VerifyMask(mask, "attn_mask"));
  const int64_t plane = query_len * key_len;
  MaskLayout layout;
  layout.data = mask.data;
  layout.dtype = mask.dtype;
  layout.query_stride = key_len;
  layout.key_stride = 1;
  layout.batch_offset.resize(batch * heads);
  const Shape shape2 = {query_len, key_len};
  const Shape shape3 = {batch, query_len, key_len};
  const Shape shape4 = {batch, heads, query_len, key_len};
  const Shape per_head = {heads, query_len, key_len};
  for (int64_t n = 0; n < batch * heads; ++n) {
    if (!batched && mask.shape == per_head) {
      layout.batch_offset[n] = n * plane;  // batch is 1: n is the head
    } else if (mask.shape == shape2) {
      layout.batch_offset[n] = 0;
    } else if (mask.shape == shape3) {
      layout.batch_offset[n] = (n / heads) * plane;
    } else if (mask.shape == shape4) {
      layout.batch_offset[n] = n * plane;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "attn_mask: shape ", ShapeString(mask.shape), ", expected ",
          ShapeString(shape2), ", ", ShapeString(batched ? shape3 : per_head),
          " or ", ShapeString(shape4)));
    }
  }
  return layout;
}

absl::StatusOr<MaskLayout> KeyPaddingMask(const TensorView& mask, bool batched,
                                          int64_t batch, int64_t heads,
                                          int64_t key_len) {
  ATTN_RETURN_IF_ERROR(VerifyMask(mask, "key_padding_mask"));
  const Shape expected = batched ? Shape{batch, key_len} : Shape{key_len};
  ATTN_RETURN_IF_ERROR(VerifyShape(mask, "key_padding_mask", expected));
  MaskLayout layout;
  layout.data = mask.data;
  layout.dtype = mask.dtype;
  layout.query_stride = 0;
  layout.key_stride = 1;
  layout.batch_offset.resize(batch * heads);
  for (int64_t n = 0; n < batch * heads; ++n) {
    layout.batch_offset[n] = (n / heads) * key_len;
  }
  return layout;
}

}  // namespace

absl::StatusOr<AttentionResult> MultiHeadAttend(
    const MultiHeadWeights& weights, const MultiHeadInputs& inputs,
    const MultiHeadOptions& options) {
  TensorResults results;
  ATTN_RETURN_IF_ERROR(MultiHeadAttend(weights, inputs, options, results));
  return TakeResult(results);
}

absl::StatusOr<std::shared_ptr<const MultiHeadLayer>> MultiHeadLayer::Create(
    const MultiHeadWeights& weights, const Options& options) {
  if (options.compute_dtype != DType::kFloat32 &&
      options.compute_dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("compute dtype: ", DTypeName(options.compute_dtype),
                     " not supported, expected FLOAT32 or BFLOAT16"));
  }
  std::shared_ptr<MultiHeadLayer> layer(new MultiHeadLayer());
  layer->compute_ = options.compute_dtype;
  ATTN_RETURN_IF_ERROR(layer->Resolve(weights));
  if (options.pack) ATTN_RETURN_IF_ERROR(layer->Pack());
  return layer;
}

int64_t MultiHeadLayer::output_dim() const {
  return out_.has_value() ? out_->out : heads_ * value_dim_;
}

absl::StatusOr<const void*> MultiHeadLayer::Converted(
    const std::optional<TensorView>& t, DType dtype, absl::string_view field) {
  if (!t.has_value()) return nullptr;
  ATTN_ASSIGN_OR_RETURN(OperandData data, OperandData::From(*t, dtype, field));
  owned_.push_back(std::move(data));
  return owned_.back().data();
}

absl::Status MultiHeadLayer::Resolve(const MultiHeadWeights& w) {
  if (w.num_heads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_heads: must be > 0, got ", w.num_heads));
  }
  heads_ = w.num_heads;
  const int heads = w.num_heads;
  const DType dtype = compute_;
  const bool separate = w.q_proj_weight.has_value() ||
                        w.k_proj_weight.has_value() ||
                        w.v_proj_weight.has_value();
  if (separate && w.in_proj_weight.has_value()) {
    return absl::InvalidArgumentError(
        "in_proj_weight: give either in_proj_weight or "
        "q_proj_weight/k_proj_weight/v_proj_weight, not both");
  }
  owned_.reserve(10);  // stable addresses for the converted copies
  const auto bias_data =
      [&](const std::optional<TensorView>& t,
          absl::string_view field) -> absl::StatusOr<const float*> {
    ATTN_ASSIGN_OR_RETURN(const void* data,
                          Converted(t, DType::kFloat32, field));
    return static_cast<const float*>(data);
  };
  if (w.in_proj_weight.has_value()) {
    const TensorView& in_proj = *w.in_proj_weight;
    ATTN_RETURN_IF_ERROR(VerifyFloating(in_proj, "in_proj_weight"));
    ATTN_RETURN_IF_ERROR(VerifyRank(in_proj, "in_proj_weight", 2, 2));
    const int64_t embed = in_proj.dim(1);
    ATTN_RETURN_IF_ERROR(
        VerifyDim(in_proj, "in_proj_weight", 0, 3 * embed, "3 x dim 1 ="));
    if (w.q_proj_bias || w.k_proj_bias || w.v_proj_bias) {
      return absl::InvalidArgumentError(
          "q_proj_bias: with in_proj_weight, give the bias as in_proj_bias");
    }
    ATTN_RETURN_IF_ERROR(VerifyBias(w.in_proj_bias, "in_proj_bias", 3 * embed));
    if (embed % heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("in_proj_weight: embed dim (dim 1) ", embed,
                       " is not divisible by num_heads ", heads));
    }
    ATTN_ASSIGN_OR_RETURN(const void* weight,
                          Converted(w.in_proj_weight, dtype, "in_proj_weight"));
    ATTN_ASSIGN_OR_RETURN(const float* bias,
                          bias_data(w.in_proj_bias, "in_proj_bias"));
    fused_qkv_ = Projection{weight, bias, 3 * embed, embed, nullptr};
    Projection* parts[] = {&q_, &k_, &v_};
    for (int i = 0; i < 3; ++i) {
      parts[i]->weight = static_cast<const char*>(weight) +
                         i * embed * embed * DTypeSize(dtype);
      parts[i]->bias = bias != nullptr ? bias + i * embed : nullptr;
      parts[i]->out = embed;
      parts[i]->in = embed;
    }
    q_name_ = k_name_ = v_name_ = "in_proj_weight";
  } else {
    if (w.in_proj_bias.has_value() &&
        (w.q_proj_bias || w.k_proj_bias || w.v_proj_bias)) {
      return absl::InvalidArgumentError(
          "in_proj_bias: give either in_proj_bias or "
          "q_proj_bias/k_proj_bias/v_proj_bias, not both");
    }
    struct Part {
      const std::optional<TensorView>& weight;
      const std::optional<TensorView>& bias;
      const char* weight_field;
      const char* bias_field;
      Projection* proj;
    };
    const Part parts[] = {
        {w.q_proj_weight, w.q_proj_bias, "q_proj_weight", "q_proj_bias", &q_},
        {w.k_proj_weight, w.k_proj_bias, "k_proj_weight", "k_proj_bias", &k_},
        {w.v_proj_weight, w.v_proj_bias, "v_proj_weight", "v_proj_bias", &v_},
    };
    for (const Part& part : parts) {
      if (!part.weight.has_value()) {
        return absl::InvalidArgumentError(absl::StrCat(
            part.weight_field,
            ": missing (give q_proj_weight, k_proj_weight and v_proj_weight, "
            "or in_proj_weight)"));
      }
      ATTN_RETURN_IF_ERROR(VerifyFloating(*part.weight, part.weight_field));
      ATTN_RETURN_IF_ERROR(VerifyRank(*part.weight, part.weight_field, 2, 2));
      ATTN_RETURN_IF_ERROR(
          VerifyHeadsDivide(*part.weight, part.weight_field, heads));
      ATTN_RETURN_IF_ERROR(
          VerifyBias(part.bias, part.bias_field, part.weight->dim(0)));
      ATTN_ASSIGN_OR_RETURN(part.proj->weight,
                            Converted(part.weight, dtype, part.weight_field));
      ATTN_ASSIGN_OR_RETURN(part.proj->bias,
                            bias_data(part.bias, part.bias_field));
      part.proj->out = part.weight->dim(0);
      part.proj->in = part.weight->dim(1);
    }
    ATTN_RETURN_IF_ERROR(VerifyDim(*w.k_proj_weight, "k_proj_weight", 0, q_.out,
                                   "q_proj_weight dim 0"));
    // PyTorch keeps one in_proj_bias also when the q/k/v weights are
    // separate (kdim/vdim != embed_dim): its thirds bias q, k and v.
    if (w.in_proj_bias.has_value()) {
      ATTN_RETURN_IF_ERROR(
          VerifyBias(w.in_proj_bias, "in_proj_bias", q_.out + k_.out + v_.out));
      ATTN_ASSIGN_OR_RETURN(const float* bias,
                            bias_data(w.in_proj_bias, "in_proj_bias"));
      q_.bias = bias;
      k_.bias = bias + q_.out;
      v_.bias = bias + q_.out + k_.out;
    }
    q_name_ = "q_proj_weight";
    k_name_ = "k_proj_weight";
    v_name_ = "v_proj_weight";
  }
  key_dim_ = q_.out / heads;
  value_dim_ = v_.out / heads;

  if (w.out_proj_weight.has_value()) {
    const TensorView& out = *w.out_proj_weight;
    ATTN_RETURN_IF_ERROR(VerifyFloating(out, "out_proj_weight"));
    ATTN_RETURN_IF_ERROR(VerifyRank(out, "out_proj_weight", 2, 2));
    ATTN_RETURN_IF_ERROR(VerifyDim(out, "out_proj_weight", 1, v_.out,
                                   absl::StrCat(v_name_, " rows (H*dv) =")));
    ATTN_RETURN_IF_ERROR(
        VerifyBias(w.out_proj_bias, "out_proj_bias", out.dim(0)));
    Projection proj;
    ATTN_ASSIGN_OR_RETURN(
        proj.weight, Converted(w.out_proj_weight, dtype, "out_proj_weight"));
    ATTN_ASSIGN_OR_RETURN(proj.bias,
                          bias_data(w.out_proj_bias, "out_proj_bias"));
    proj.out = out.dim(0);
    proj.in = out.dim(1);
    out_ = proj;
  } else if (w.out_proj_bias.has_value()) {
    return absl::InvalidArgumentError(
        "out_proj_bias: given without out_proj_weight");
  }
  return absl::OkStatus();
}

absl::Status MultiHeadLayer::Pack() {
  const auto pack = [&](Projection& proj) -> absl::Status {
    ATTN_ASSIGN_OR_RETURN(proj.packed,
                          PackedLinear::Create(proj.weight, proj.bias, proj.out,
                                               proj.in, compute_));
    return absl::OkStatus();
  };
  for (Projection* proj : {&q_, &k_, &v_}) ATTN_RETURN_IF_ERROR(pack(*proj));
  if (fused_qkv_.has_value()) ATTN_RETURN_IF_ERROR(pack(*fused_qkv_));
  if (out_.has_value()) ATTN_RETURN_IF_ERROR(pack(*out_));
  // The packed copies are all a run reads: drop the plain ones.
  for (Projection* proj : {&q_, &k_, &v_}) {
    proj->weight = nullptr;
    proj->bias = nullptr;
  }
  if (fused_qkv_.has_value()) fused_qkv_->weight = fused_qkv_->bias = nullptr;
  if (out_.has_value()) out_->weight = out_->bias = nullptr;
  owned_.clear();
  return absl::OkStatus();
}

absl::Status MultiHeadLayer::Project(const Projection& proj, int64_t rows,
                                     const void* x, void* y,
                                     DType y_dtype) const {
  if (proj.packed != nullptr) return proj.packed->Run(rows, x, y, y_dtype);
  MatmulShape s;
  s.m = rows;
  s.k = proj.in;
  s.n = proj.out;
  s.b_transposed = true;
  s.b_shared = true;
  s.has_bias = proj.bias != nullptr;
  s.a_dtype = s.b_dtype = compute_;
  s.c_dtype = y_dtype;
  return Matmul(s, x, proj.weight, proj.bias, y);
}

absl::Status MultiHeadAttend(const MultiHeadWeights& weights,
                             const MultiHeadInputs& inputs,
                             const MultiHeadOptions& options,
                             ResultAllocator& results) {
  ATTN_RETURN_IF_ERROR(VerifyFloating(inputs.query, "query"));
  MultiHeadLayer::Options layer_options;
  layer_options.compute_dtype =
      ComputeDType(inputs.query.dtype, options.attention);
  layer_options.pack = false;  // weights used once: read them in place
  ATTN_ASSIGN_OR_RETURN(auto layer,
                        MultiHeadLayer::Create(weights, layer_options));
  return layer->Run(inputs, options, results);
}

absl::Status MultiHeadLayer::Run(const MultiHeadInputs& in,
                                 const MultiHeadOptions& options,
                                 ResultAllocator& results) const {
  ATTN_RETURN_IF_ERROR(VerifyFloating(in.query, "query"));
  ATTN_RETURN_IF_ERROR(VerifyRank(in.query, "query", 2, 3));
  const TensorView& key = in.key.has_value() ? *in.key : in.query;
  const TensorView& value = in.value.has_value() ? *in.value : key;
  ATTN_RETURN_IF_ERROR(VerifySameDType(key, "key", in.query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameDType(value, "value", in.query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameRank(key, "key", in.query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameRank(value, "value", in.query, "query"));
  const bool batched = in.query.rank() == 3;
  if (batched) {
    ATTN_RETURN_IF_ERROR(
        VerifyDim(key, "key", 0, in.query.dim(0), "query dim 0"));
    ATTN_RETURN_IF_ERROR(
        VerifyDim(value, "value", 0, in.query.dim(0), "query dim 0"));
  }
  ATTN_RETURN_IF_ERROR(VerifyDim(value, "value", -2, key.dim(-2),
                                 batched ? "key dim 1" : "key dim 0"));
  const auto check_input = [](const TensorView& t, absl::string_view field,
                              int64_t expected,
                              absl::string_view weight_field) -> absl::Status {
    if (t.dim(-1) == expected) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": last dim ", t.dim(-1), " != ", weight_field,
                     " dim 1 ", expected));
  };
  ATTN_RETURN_IF_ERROR(check_input(in.query, "query", q_.in, q_name_));
  ATTN_RETURN_IF_ERROR(check_input(key, "key", k_.in, k_name_));
  ATTN_RETURN_IF_ERROR(check_input(value, "value", v_.in, v_name_));
  const int64_t batch = batched ? in.query.dim(0) : 1;
  const int64_t query_len = in.query.dim(-2);
  const int64_t key_len = key.dim(-2);
  const DType compute = compute_;
  const int64_t heads = heads_;

  AttentionProblem p;
  p.batch = batch;
  p.heads = heads;
  p.query_len = query_len;
  p.key_len = key_len;
  p.key_dim = key_dim_;
  p.value_dim = value_dim_;
  p.causal = options.attention.causal;
  p.cancelled = options.attention.cancelled;
  ATTN_ASSIGN_OR_RETURN(p.logit_multiplier,
                        LogitMultiplier(options.attention, key_dim_));
  const Shape per_head_weights = {batch, heads, query_len, key_len};
  ATTN_RETURN_IF_ERROR(
      CheckedNumElements(per_head_weights, DType::kFloat32, "weights")
          .status());
  if (in.attn_mask.has_value()) {
    ATTN_ASSIGN_OR_RETURN(MaskLayout mask,
                          MultiHeadMask(*in.attn_mask, batched, batch, heads,
                                        query_len, key_len));
    p.masks.push_back(std::move(mask));
  }
  if (in.key_padding_mask.has_value()) {
    ATTN_ASSIGN_OR_RETURN(
        MaskLayout mask,
        KeyPaddingMask(*in.key_padding_mask, batched, batch, heads, key_len));
    p.masks.push_back(std::move(mask));
  }

  // Projections write [B, L, H * d] in the compute dtype; the kernel reads
  // each head's columns in place, so heads are never copied apart or back
  // together.
  const size_t elem = DTypeSize(compute);
  p.operand_dtype = compute;
  ATTN_ASSIGN_OR_RETURN(OperandData query,
                        OperandData::From(in.query, compute, "query"));
  Tensor q_proj, k_proj, v_proj, qkv_proj;
  if (fused_qkv_.has_value() && !in.key.has_value() && !in.value.has_value()) {
    // Self-attention with the fused weight: one [B*L, E] x [E, 3E] matmul.
    const int64_t e = q_.out;
    ATTN_ASSIGN_OR_RETURN(qkv_proj,
                          Tensor::Allocate(compute, {batch, query_len, 3 * e}));
    char* qkv = static_cast<char*>(qkv_proj.data());
    ATTN_RETURN_IF_ERROR(
        Project(*fused_qkv_, batch * query_len, query.data(), qkv, compute));
    const OperandLayout layout{query_len * 3 * e, key_dim_, 3 * e};
    p.query = qkv;
    p.key = qkv + e * elem;
    p.value = qkv + 2 * e * elem;
    p.query_layout = p.key_layout = p.value_layout = layout;
  } else {
    ATTN_ASSIGN_OR_RETURN(OperandData key_data,
                          OperandData::From(key, compute, "key"));
    ATTN_ASSIGN_OR_RETURN(OperandData value_data,
                          OperandData::From(value, compute, "value"));
    ATTN_ASSIGN_OR_RETURN(
        q_proj, Tensor::Allocate(compute, {batch, query_len, q_.out}));
    ATTN_ASSIGN_OR_RETURN(k_proj,
                          Tensor::Allocate(compute, {batch, key_len, k_.out}));
    ATTN_ASSIGN_OR_RETURN(v_proj,
                          Tensor::Allocate(compute, {batch, key_len, v_.out}));
    ATTN_RETURN_IF_ERROR(
        Project(q_, batch * query_len, query.data(), q_proj.data(), compute));
    ATTN_RETURN_IF_ERROR(
        Project(k_, batch * key_len, key_data.data(), k_proj.data(), compute));
    ATTN_RETURN_IF_ERROR(Project(v_, batch * key_len, value_data.data(),
                                 v_proj.data(), compute));
    p.query = q_proj.data();
    p.key = k_proj.data();
    p.value = v_proj.data();
    p.query_layout = InterleavedHeadsLayout(heads, query_len, key_dim_);
    p.key_layout = InterleavedHeadsLayout(heads, key_len, key_dim_);
    p.value_layout = InterleavedHeadsLayout(heads, key_len, value_dim_);
  }

  // The heads' outputs land side by side: the concatenation the output
  // projection reads (in the compute dtype), or the result itself without
  // one.
  const int64_t concat_dim = heads * value_dim_;
  const int64_t out_dim = out_.has_value() ? out_->out : concat_dim;
  const Shape output_shape =
      batched ? Shape{batch, query_len, out_dim} : Shape{query_len, out_dim};
  ATTN_ASSIGN_OR_RETURN(
      ResultBuffer output,
      ResultBuffer::Allocate(results, "output", in.query.dtype, output_shape,
                             // float32 layers compute a bfloat16 query's
                             // output in float32 and round it at the end.
                             /*bf16_ok=*/compute == DType::kBFloat16));
  Tensor concat;
  if (out_.has_value()) {
    ATTN_ASSIGN_OR_RETURN(
        concat, Tensor::Allocate(compute, {batch, query_len, concat_dim}));
    p.output = concat.data();
    p.output_dtype = compute;
  } else {
    p.output = output.data();
    p.output_dtype = output.dtype();
  }
  p.output_layout = InterleavedHeadsLayout(heads, query_len, value_dim_);

  // Per-head weights go straight to the result unless they are averaged.
  Tensor per_head;
  float* mean_weights = nullptr;
  if (options.attention.return_weights) {
    const bool average = options.average_weights;
    const Shape weights_shape =
        average
            ? (batched ? Shape{batch, query_len, key_len}
                       : Shape{query_len, key_len})
            : (batched ? per_head_weights : Shape{heads, query_len, key_len});
    ATTN_ASSIGN_OR_RETURN(
        void* weights_data,
        results.Allocate("weights", DType::kFloat32, weights_shape));
    if (average) {
      ATTN_ASSIGN_OR_RETURN(
          per_head, Tensor::Allocate(DType::kFloat32, per_head_weights));
      p.weights = per_head.data_as<float>();
      mean_weights = static_cast<float*>(weights_data);
    } else {
      p.weights = static_cast<float*>(weights_data);
    }
  }
  ATTN_RETURN_IF_ERROR(RunAttention(p));
  if (out_.has_value()) {
    ATTN_RETURN_IF_ERROR(Project(*out_, batch * query_len, concat.data(),
                                 output.data(), output.dtype()));
  }
  output.Finish();

  if (mean_weights != nullptr) {
    const int64_t plane = query_len * key_len;
    const float inv_heads = 1.0f / static_cast<float>(heads);
    for (int64_t b = 0; b < batch; ++b) {
      float* out = mean_weights + b * plane;
      std::fill(out, out + plane, 0.0f);
      for (int64_t h = 0; h < heads; ++h) {
        const float* src = per_head.data_as<float>() + (b * heads + h) * plane;
        for (int64_t i = 0; i < plane; ++i) out[i] += src[i];
      }
      for (int64_t i = 0; i < plane; ++i) out[i] *= inv_heads;
    }
  }
  return absl::OkStatus();
}

}  // namespace attnserve
