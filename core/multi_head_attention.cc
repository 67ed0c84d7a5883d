#include "core/multi_head_attention.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention_common.h"
#include "core/attention_kernel.h"
#include "core/attention_weights.h"
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
                               absl::string_view field, int num_heads,
                               absl::string_view heads_field) {
  if (weight.dim(0) % num_heads == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": dim 0 (", weight.dim(0), ") is not divisible by ",
                   heads_field, " ", num_heads));
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

// The checks of a run's inputs that need no weights: dtypes, ranks, and
// batch and sequence dims that agree.
absl::Status VerifyInputs(const TensorView& query, const TensorView& key,
                          const TensorView& value) {
  ATTN_RETURN_IF_ERROR(VerifyFloating(query, "query"));
  ATTN_RETURN_IF_ERROR(VerifyRank(query, "query", 2, 3));
  ATTN_RETURN_IF_ERROR(VerifySameDType(key, "key", query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameDType(value, "value", query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameRank(key, "key", query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameRank(value, "value", query, "query"));
  const bool batched = query.rank() == 3;
  if (batched) {
    ATTN_RETURN_IF_ERROR(VerifyDim(key, "key", 0, query.dim(0), "query dim 0"));
    ATTN_RETURN_IF_ERROR(
        VerifyDim(value, "value", 0, query.dim(0), "query dim 0"));
  }
  return VerifyDim(value, "value", -2, key.dim(-2),
                   batched ? "key dim 1" : "key dim 0");
}

// mean[b] = sum over h of per_head[b, h] / heads, each a plane of `plane`
// floats.
void AverageHeads(const float* per_head, int64_t batch, int64_t heads,
                  int64_t plane, float* mean) {
  const float inv_heads = 1.0f / static_cast<float>(heads);
  for (int64_t b = 0; b < batch; ++b) {
    float* out = mean + b * plane;
    std::fill(out, out + plane, 0.0f);
    for (int64_t h = 0; h < heads; ++h) {
      const float* src = per_head + (b * heads + h) * plane;
      for (int64_t i = 0; i < plane; ++i) out[i] += src[i];
    }
    for (int64_t i = 0; i < plane; ++i) out[i] *= inv_heads;
  }
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
  ATTN_RETURN_IF_ERROR(
      VerifyRotary(options.rotary, layer->key_dim_, "rotary_dims"));
  layer->rotary_ = options.rotary;
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

absl::StatusOr<const float*> MultiHeadLayer::ConvertedBias(
    const std::optional<TensorView>& t, absl::string_view field) {
  ATTN_ASSIGN_OR_RETURN(const void* data, Converted(t, DType::kFloat32, field));
  return static_cast<const float*>(data);
}

absl::Status MultiHeadLayer::Resolve(const MultiHeadWeights& w) {
  if (w.num_heads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_heads: must be > 0, got ", w.num_heads));
  }
  heads_ = w.num_heads;
  ATTN_RETURN_IF_ERROR(VerifyKvHeads(w.num_heads, w.num_kv_heads));
  kv_heads_ = w.num_kv_heads == 0 ? heads_ : w.num_kv_heads;
  const bool separate = w.q_proj_weight.has_value() ||
                        w.k_proj_weight.has_value() ||
                        w.v_proj_weight.has_value();
  if (separate && w.in_proj_weight.has_value()) {
    return absl::InvalidArgumentError(
        "in_proj_weight: give either in_proj_weight or "
        "q_proj_weight/k_proj_weight/v_proj_weight, not both");
  }
  // Stable addresses for the converted copies: at most one per field.
  owned_.reserve(kMultiHeadWeightFields.size());
  ATTN_RETURN_IF_ERROR(w.in_proj_weight.has_value() ? ResolveFused(w)
                                                    : ResolveSeparate(w));
  key_dim_ = q_.out / heads_;
  value_dim_ = v_.out / kv_heads_;
  return ResolveOutput(w);
}

// PyTorch's fused [3E, E] in_proj_weight: q, k and v read its thirds (and
// in_proj_bias's) in place.
absl::Status MultiHeadLayer::ResolveFused(const MultiHeadWeights& w) {
  const TensorView& in_proj = *w.in_proj_weight;
  if (kv_heads_ != heads_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "in_proj_weight: the fused projection has num_heads key/value heads; "
        "with num_kv_heads ",
        kv_heads_, " give k_proj_weight and v_proj_weight"));
  }
  ATTN_RETURN_IF_ERROR(VerifyFloating(in_proj, "in_proj_weight"));
  ATTN_RETURN_IF_ERROR(VerifyRank(in_proj, "in_proj_weight", 2, 2));
  const int64_t embed = in_proj.dim(1);
  ATTN_RETURN_IF_ERROR(
      VerifyDim(in_proj, "in_proj_weight", 0, 3 * embed, "3 x dim 1 ="));
  if (w.q_proj_bias || w.k_proj_bias || w.v_proj_bias) {
    const absl::string_view given = w.q_proj_bias   ? "q_proj_bias"
                                    : w.k_proj_bias ? "k_proj_bias"
                                                    : "v_proj_bias";
    return absl::InvalidArgumentError(absl::StrCat(
        given, ": with in_proj_weight, give the bias as in_proj_bias"));
  }
  ATTN_RETURN_IF_ERROR(VerifyBias(w.in_proj_bias, "in_proj_bias", 3 * embed));
  if (embed % heads_ != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("in_proj_weight: embed dim (dim 1) ", embed,
                     " is not divisible by num_heads ", heads_));
  }
  ATTN_ASSIGN_OR_RETURN(
      const void* weight,
      Converted(w.in_proj_weight, compute_, "in_proj_weight"));
  ATTN_ASSIGN_OR_RETURN(const float* bias,
                        ConvertedBias(w.in_proj_bias, "in_proj_bias"));
  fused_qkv_ = Projection{weight, bias, 3 * embed, embed, nullptr};
  Projection* parts[] = {&q_, &k_, &v_};
  for (int i = 0; i < 3; ++i) {
    parts[i]->weight = static_cast<const char*>(weight) +
                       i * embed * embed * DTypeSize(compute_);
    parts[i]->bias = bias != nullptr ? bias + i * embed : nullptr;
    parts[i]->out = embed;
    parts[i]->in = embed;
  }
  q_name_ = k_name_ = v_name_ = "in_proj_weight";
  return absl::OkStatus();
}

// Separate q/k/v_proj_weight, each with its own bias or the thirds of one
// in_proj_bias.
absl::Status MultiHeadLayer::ResolveSeparate(const MultiHeadWeights& w) {
  if (w.in_proj_bias.has_value() &&
      (w.q_proj_bias || w.k_proj_bias || w.v_proj_bias)) {
    return absl::InvalidArgumentError(
        "in_proj_bias: give either in_proj_bias or "
        "q_proj_bias/k_proj_bias/v_proj_bias, not both");
  }
  using Field = std::optional<TensorView> MultiHeadWeights::*;
  struct Part {
    Field weight;
    Field bias;
    Projection* proj;
    int heads;
  };
  const Part parts[] = {
      {&MultiHeadWeights::q_proj_weight, &MultiHeadWeights::q_proj_bias, &q_,
       heads_},
      {&MultiHeadWeights::k_proj_weight, &MultiHeadWeights::k_proj_bias, &k_,
       kv_heads_},
      {&MultiHeadWeights::v_proj_weight, &MultiHeadWeights::v_proj_bias, &v_,
       kv_heads_},
  };
  for (const Part& part : parts) {
    const std::optional<TensorView>& weight = w.*part.weight;
    const std::optional<TensorView>& bias = w.*part.bias;
    const absl::string_view weight_field =
        MultiHeadWeightFieldName(part.weight);
    const absl::string_view bias_field = MultiHeadWeightFieldName(part.bias);
    if (!weight.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          weight_field,
          ": missing (give q_proj_weight, k_proj_weight and v_proj_weight, "
          "or in_proj_weight)"));
    }
    ATTN_RETURN_IF_ERROR(VerifyFloating(*weight, weight_field));
    ATTN_RETURN_IF_ERROR(VerifyRank(*weight, weight_field, 2, 2));
    ATTN_RETURN_IF_ERROR(
        VerifyHeadsDivide(*weight, weight_field, part.heads,
                          part.heads == heads_ ? "num_heads" : "num_kv_heads"));
    ATTN_RETURN_IF_ERROR(VerifyBias(bias, bias_field, weight->dim(0)));
    ATTN_ASSIGN_OR_RETURN(part.proj->weight,
                          Converted(weight, compute_, weight_field));
    ATTN_ASSIGN_OR_RETURN(part.proj->bias, ConvertedBias(bias, bias_field));
    part.proj->out = weight->dim(0);
    part.proj->in = weight->dim(1);
  }
  if (kv_heads_ == heads_) {
    ATTN_RETURN_IF_ERROR(VerifyDim(*w.k_proj_weight, "k_proj_weight", 0, q_.out,
                                   "q_proj_weight dim 0"));
  } else {
    ATTN_RETURN_IF_ERROR(VerifyDim(
        *w.k_proj_weight, "k_proj_weight", 0, kv_heads_ * (q_.out / heads_),
        absl::StrCat("num_kv_heads x head dim (q_proj_weight dim 0 / "
                     "num_heads) =")));
  }
  // PyTorch keeps one in_proj_bias also when the q/k/v weights are
  // separate (kdim/vdim != embed_dim): its thirds bias q, k and v.
  if (w.in_proj_bias.has_value()) {
    ATTN_RETURN_IF_ERROR(
        VerifyBias(w.in_proj_bias, "in_proj_bias", q_.out + k_.out + v_.out));
    ATTN_ASSIGN_OR_RETURN(const float* bias,
                          ConvertedBias(w.in_proj_bias, "in_proj_bias"));
    q_.bias = bias;
    k_.bias = bias + q_.out;
    v_.bias = bias + q_.out + k_.out;
  }
  q_name_ = "q_proj_weight";
  k_name_ = "k_proj_weight";
  v_name_ = "v_proj_weight";
  return absl::OkStatus();
}

// The optional output projection; its input is the heads' concatenation.
absl::Status MultiHeadLayer::ResolveOutput(const MultiHeadWeights& w) {
  if (!w.out_proj_weight.has_value()) {
    if (!w.out_proj_bias.has_value()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        "out_proj_bias: given without out_proj_weight");
  }
  const TensorView& out = *w.out_proj_weight;
  ATTN_RETURN_IF_ERROR(VerifyFloating(out, "out_proj_weight"));
  ATTN_RETURN_IF_ERROR(VerifyRank(out, "out_proj_weight", 2, 2));
  ATTN_RETURN_IF_ERROR(VerifyDim(
      out, "out_proj_weight", 1, heads_ * value_dim_,
      kv_heads_ == heads_
          ? absl::StrCat(v_name_, " rows (H*dv) =")
          : absl::StrCat("num_heads x ", v_name_, " rows / num_kv_heads =")));
  ATTN_RETURN_IF_ERROR(
      VerifyBias(w.out_proj_bias, "out_proj_bias", out.dim(0)));
  Projection proj;
  ATTN_ASSIGN_OR_RETURN(
      proj.weight, Converted(w.out_proj_weight, compute_, "out_proj_weight"));
  ATTN_ASSIGN_OR_RETURN(proj.bias,
                        ConvertedBias(w.out_proj_bias, "out_proj_bias"));
  proj.out = out.dim(0);
  proj.in = out.dim(1);
  out_ = proj;
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

absl::Status MultiHeadLayer::ProjectPart(Part part, int64_t rows, const void* x,
                                         void* y, DType y_dtype) const {
  switch (part) {
    case Part::kQuery:
      return Project(q_, rows, x, y, y_dtype);
    case Part::kKey:
      return Project(k_, rows, x, y, y_dtype);
    case Part::kValue:
      return Project(v_, rows, x, y, y_dtype);
    case Part::kOutput:
      if (!out_.has_value()) {
        return absl::FailedPreconditionError("layer has no output projection");
      }
      return Project(*out_, rows, x, y, y_dtype);
  }
  return absl::InternalError("unknown projection");
}

absl::Status MultiHeadAttend(const MultiHeadWeights& weights,
                             const MultiHeadInputs& inputs,
                             const MultiHeadOptions& options,
                             ResultAllocator& results) {
  ATTN_RETURN_IF_ERROR(VerifyFloating(inputs.query, "query"));
  MultiHeadLayer::Options layer_options;
  layer_options.compute_dtype = ComputeDType(options.attention);
  layer_options.pack = false;  // weights used once: read them in place
  ATTN_ASSIGN_OR_RETURN(auto layer,
                        MultiHeadLayer::Create(weights, layer_options));
  return layer->Run(inputs, options, results);
}

// A run's sizes, from its checked inputs.
struct MultiHeadLayer::RunDims {
  bool batched = false;  // [B, L, E] inputs, not [L, E]
  int64_t batch = 1;
  int64_t query_len = 0;
  int64_t key_len = 0;
};

// The scratch tensors a run computes in. The AttentionProblem points into
// them, so they live until Run returns.
struct MultiHeadLayer::RunBuffers {
  Tensor qkv_proj;                // fused self-attention: [B, L, 3E]
  Tensor q_proj, k_proj, v_proj;  // [B, L, H * d]
  Tensor concat;                  // heads side by side, for out_proj
  Tensor per_head_weights;        // [B, H, Lq, Lk], to be averaged
};

absl::Status MultiHeadLayer::Run(const MultiHeadInputs& in,
                                 const MultiHeadOptions& options,
                                 ResultAllocator& results) const {
  const TensorView& key = in.key.has_value() ? *in.key : in.query;
  const TensorView& value = in.value.has_value() ? *in.value : key;
  ATTN_RETURN_IF_ERROR(VerifyInputs(in.query, key, value));
  ATTN_RETURN_IF_ERROR(VerifyFeatureDims(in.query, key, value));
  RunDims dims;
  dims.batched = in.query.rank() == 3;
  dims.batch = dims.batched ? in.query.dim(0) : 1;
  dims.query_len = in.query.dim(-2);
  dims.key_len = key.dim(-2);

  ATTN_ASSIGN_OR_RETURN(AttentionProblem p,
                        Problem(in, dims, options.attention));
  RunBuffers buffers;
  ATTN_RETURN_IF_ERROR(ProjectInputs(in, key, value, dims, p, buffers));
  ATTN_ASSIGN_OR_RETURN(
      ResultBuffer output,
      AllocateOutput(in.query.dtype, dims, results, p, buffers));
  ATTN_ASSIGN_OR_RETURN(float* mean_weights,
                        AllocateWeights(options, dims, results, p, buffers));

  ATTN_RETURN_IF_ERROR(RunAttention(p));
  if (out_.has_value()) {
    ATTN_RETURN_IF_ERROR(Project(*out_, dims.batch * dims.query_len,
                                 buffers.concat.data(), output.data(),
                                 output.dtype()));
  }
  output.Finish();
  if (mean_weights != nullptr) {
    AverageHeads(buffers.per_head_weights.data_as<float>(), dims.batch, heads_,
                 dims.query_len * dims.key_len, mean_weights);
  }
  return absl::OkStatus();
}

// Each input's last dim is what its projection reads.
absl::Status MultiHeadLayer::VerifyFeatureDims(const TensorView& query,
                                               const TensorView& key,
                                               const TensorView& value) const {
  const auto verify = [](const TensorView& t, absl::string_view field,
                         int64_t expected,
                         absl::string_view weight_field) -> absl::Status {
    if (t.dim(-1) == expected) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": last dim ", t.dim(-1), " != ", weight_field,
                     " dim 1 ", expected));
  };
  ATTN_RETURN_IF_ERROR(verify(query, "query", q_.in, q_name_));
  ATTN_RETURN_IF_ERROR(verify(key, "key", k_.in, k_name_));
  return verify(value, "value", v_.in, v_name_);
}

// The kernel's problem without its operands: sizes, options and masks.
absl::StatusOr<AttentionProblem> MultiHeadLayer::Problem(
    const MultiHeadInputs& in, const RunDims& dims,
    const AttentionOptions& options) const {
  AttentionProblem p;
  p.batch = dims.batch;
  p.heads = heads_;
  p.query_len = dims.query_len;
  p.key_len = dims.key_len;
  p.key_dim = key_dim_;
  p.value_dim = value_dim_;
  p.causal = options.causal;
  p.kv_group = heads_ / kv_heads_;
  p.cancelled = options.cancelled;
  ATTN_ASSIGN_OR_RETURN(p.logit_multiplier, LogitMultiplier(options, key_dim_));
  const Shape per_head_weights = {dims.batch, heads_, dims.query_len,
                                  dims.key_len};
  ATTN_RETURN_IF_ERROR(
      CheckedNumElements(per_head_weights, DType::kFloat32, "weights")
          .status());
  if (in.attn_mask.has_value()) {
    ATTN_ASSIGN_OR_RETURN(MaskLayout mask,
                          MultiHeadMask(*in.attn_mask, dims.batched, dims.batch,
                                        heads_, dims.query_len, dims.key_len));
    p.masks.push_back(std::move(mask));
  }
  if (in.key_padding_mask.has_value()) {
    ATTN_ASSIGN_OR_RETURN(MaskLayout mask,
                          KeyPaddingMask(*in.key_padding_mask, dims.batched,
                                         dims.batch, heads_, dims.key_len));
    p.masks.push_back(std::move(mask));
  }
  return p;
}

// Projections write [B, L, H * d] in the compute dtype; the kernel reads
// each head's columns in place, so heads are never copied apart or back
// together.
absl::Status MultiHeadLayer::ProjectInputs(
    const MultiHeadInputs& in, const TensorView& key, const TensorView& value,
    const RunDims& dims, AttentionProblem& p, RunBuffers& buffers) const {
  const DType compute = compute_;
  const int64_t batch = dims.batch;
  p.operand_dtype = compute;
  ATTN_ASSIGN_OR_RETURN(OperandData query,
                        OperandData::From(in.query, compute, "query"));
  if (fused_qkv_.has_value() && !in.key.has_value() && !in.value.has_value()) {
    // Self-attention with the fused weight: one [B*L, E] x [E, 3E] matmul.
    const int64_t e = q_.out;
    ATTN_ASSIGN_OR_RETURN(
        buffers.qkv_proj,
        Tensor::Allocate(compute, {batch, dims.query_len, 3 * e}));
    char* qkv = static_cast<char*>(buffers.qkv_proj.data());
    ATTN_RETURN_IF_ERROR(Project(*fused_qkv_, batch * dims.query_len,
                                 query.data(), qkv, compute));
    const size_t elem = DTypeSize(compute);
    const OperandLayout layout{dims.query_len * 3 * e, key_dim_, 3 * e};
    p.query = qkv;
    p.key = qkv + e * elem;
    p.value = qkv + 2 * e * elem;
    p.query_layout = p.key_layout = p.value_layout = layout;
    ApplyRotary(rotary_, compute, qkv, layout, batch, heads_, dims.query_len,
                0);
    ApplyRotary(rotary_, compute, qkv + e * elem, layout, batch, heads_,
                dims.query_len, 0);
    return absl::OkStatus();
  }
  ATTN_ASSIGN_OR_RETURN(OperandData key_data,
                        OperandData::From(key, compute, "key"));
  ATTN_ASSIGN_OR_RETURN(OperandData value_data,
                        OperandData::From(value, compute, "value"));
  ATTN_ASSIGN_OR_RETURN(
      buffers.q_proj,
      Tensor::Allocate(compute, {batch, dims.query_len, q_.out}));
  ATTN_ASSIGN_OR_RETURN(
      buffers.k_proj, Tensor::Allocate(compute, {batch, dims.key_len, k_.out}));
  ATTN_ASSIGN_OR_RETURN(
      buffers.v_proj, Tensor::Allocate(compute, {batch, dims.key_len, v_.out}));
  ATTN_RETURN_IF_ERROR(Project(q_, batch * dims.query_len, query.data(),
                               buffers.q_proj.data(), compute));
  ATTN_RETURN_IF_ERROR(Project(k_, batch * dims.key_len, key_data.data(),
                               buffers.k_proj.data(), compute));
  ATTN_RETURN_IF_ERROR(Project(v_, batch * dims.key_len, value_data.data(),
                               buffers.v_proj.data(), compute));
  p.query = buffers.q_proj.data();
  p.key = buffers.k_proj.data();
  p.value = buffers.v_proj.data();
  p.query_layout = InterleavedHeadsLayout(heads_, dims.query_len, key_dim_);
  p.key_layout = InterleavedHeadsLayout(kv_heads_, dims.key_len, key_dim_);
  p.value_layout = InterleavedHeadsLayout(kv_heads_, dims.key_len, value_dim_);
  ApplyRotary(rotary_, compute, buffers.q_proj.data(), p.query_layout, batch,
              heads_, dims.query_len, 0);
  ApplyRotary(rotary_, compute, buffers.k_proj.data(), p.key_layout, batch,
              kv_heads_, dims.key_len, 0);
  return absl::OkStatus();
}

// The heads' outputs land side by side: the concatenation the output
// projection reads (in the compute dtype), or the result itself without
// one.
absl::StatusOr<ResultBuffer> MultiHeadLayer::AllocateOutput(
    DType dtype, const RunDims& dims, ResultAllocator& results,
    AttentionProblem& p, RunBuffers& buffers) const {
  const int64_t concat_dim = heads_ * value_dim_;
  const int64_t out_dim = out_.has_value() ? out_->out : concat_dim;
  const Shape output_shape = dims.batched
                                 ? Shape{dims.batch, dims.query_len, out_dim}
                                 : Shape{dims.query_len, out_dim};
  ATTN_ASSIGN_OR_RETURN(
      ResultBuffer output,
      ResultBuffer::Allocate(results, "output", dtype, output_shape,
                             // float32 layers compute a bfloat16 query's
                             // output in float32 and round it at the end.
                             /*bf16_ok=*/compute_ == DType::kBFloat16));
  if (out_.has_value()) {
    ATTN_ASSIGN_OR_RETURN(
        buffers.concat,
        Tensor::Allocate(compute_, {dims.batch, dims.query_len, concat_dim}));
    p.output = buffers.concat.data();
    p.output_dtype = compute_;
  } else {
    p.output = output.data();
    p.output_dtype = output.dtype();
  }
  p.output_layout = InterleavedHeadsLayout(heads_, dims.query_len, value_dim_);
  return output;
}

// Per-head weights go straight to the result unless they are averaged;
// then the kernel writes them to scratch and this returns where the mean
// goes (null otherwise).
absl::StatusOr<float*> MultiHeadLayer::AllocateWeights(
    const MultiHeadOptions& options, const RunDims& dims,
    ResultAllocator& results, AttentionProblem& p, RunBuffers& buffers) const {
  if (!options.attention.return_weights) return nullptr;
  const Shape per_head = {dims.batch, heads_, dims.query_len, dims.key_len};
  const bool average = options.average_weights;
  Shape weights_shape;
  if (average) {
    weights_shape = dims.batched
                        ? Shape{dims.batch, dims.query_len, dims.key_len}
                        : Shape{dims.query_len, dims.key_len};
  } else {
    weights_shape =
        dims.batched ? per_head : Shape{heads_, dims.query_len, dims.key_len};
  }
  ATTN_ASSIGN_OR_RETURN(
      void* weights_data,
      results.Allocate("weights", DType::kFloat32, weights_shape));
  if (!average) {
    p.weights = static_cast<float*>(weights_data);
    return nullptr;
  }
  ATTN_ASSIGN_OR_RETURN(buffers.per_head_weights,
                        Tensor::Allocate(DType::kFloat32, per_head));
  p.weights = buffers.per_head_weights.data_as<float>();
  return static_cast<float*>(weights_data);
}

}  // namespace attnserve
