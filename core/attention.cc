#include "core/attention.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/attention_kernel.h"
#include "core/convert.h"
#include "core/primitives.h"
#include "core/status_macros.h"
#include "core/verify.h"

namespace attnserve {
namespace {

// Row-major strides of `shape`.
std::vector<int64_t> Strides(absl::Span<const int64_t> shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i) {
    strides[i] = strides[i + 1] * shape[i + 1];
  }
  return strides;
}

// Checks that `mask` broadcasts right-aligned to `logits_shape`
// ([batch dims..., Lq, Lk]) and returns how the kernel reads it.
absl::StatusOr<MaskLayout> BroadcastMask(
    const TensorView& mask, absl::string_view field,
    absl::Span<const int64_t> logits_shape) {
  ATTN_RETURN_IF_ERROR(VerifyMask(mask, field));
  const int64_t rank = static_cast<int64_t>(logits_shape.size());
  if (mask.rank() > rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": rank ", mask.rank(), " (shape ", ShapeString(mask.shape),
        ") exceeds the rank of the logits ", ShapeString(logits_shape)));
  }
  // Strides of the mask laid over the logits dims; 0 where it broadcasts.
  std::vector<int64_t> strides(rank, 0);
  const std::vector<int64_t> own = Strides(mask.shape);
  const int64_t lead = rank - mask.rank();
  for (int64_t i = 0; i < mask.rank(); ++i) {
    const int64_t want = logits_shape[lead + i];
    if (mask.shape[i] != want && mask.shape[i] != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": shape ", ShapeString(mask.shape), " does not broadcast to ",
          ShapeString(logits_shape), " (dim ", i, " is ", mask.shape[i],
          ", expected 1 or ", want, ")"));
    }
    strides[lead + i] = mask.shape[i] == 1 ? 0 : own[i];
  }
  MaskLayout layout;
  layout.data = mask.data;
  layout.dtype = mask.dtype;
  layout.query_stride = strides[rank - 2];
  layout.key_stride = strides[rank - 1];
  const absl::Span<const int64_t> batch_dims = logits_shape.first(rank - 2);
  const int64_t batch = NumElements(batch_dims);
  layout.batch_offset.resize(batch);
  for (int64_t n = 0; n < batch; ++n) {
    int64_t rest = n, offset = 0;
    for (int64_t d = static_cast<int64_t>(batch_dims.size()) - 1; d >= 0; --d) {
      offset += (rest % batch_dims[d]) * strides[d];
      rest /= batch_dims[d];
    }
    layout.batch_offset[n] = offset;
  }
  return layout;
}

absl::StatusOr<float> LogitMultiplier(const AttentionOptions& options,
                                      int64_t key_dim) {
  float scale =
      key_dim > 0 ? 1.0f / std::sqrt(static_cast<float>(key_dim)) : 1.0f;
  if (options.scale.has_value()) {
    ATTN_RETURN_IF_ERROR(VerifyFinite(*options.scale, "scale"));
    scale = *options.scale;
  }
  float temperature = 1.0f;
  if (options.temperature.has_value()) {
    ATTN_RETURN_IF_ERROR(
        VerifyPositiveFinite(*options.temperature, "temperature"));
    temperature = *options.temperature;
  }
  return scale / temperature;
}

absl::Status VerifySameDType(const TensorView& t, absl::string_view field,
                             const TensorView& ref,
                             absl::string_view ref_field) {
  if (t.dtype == ref.dtype) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": dtype ", DTypeName(t.dtype), " != ", ref_field,
                   " dtype ", DTypeName(ref.dtype)));
}

absl::Status VerifySameRank(const TensorView& t, absl::string_view field,
                            const TensorView& ref,
                            absl::string_view ref_field) {
  if (t.rank() == ref.rank()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": rank ", t.rank(), " != ", ref_field, " rank ", ref.rank(),
      " (shapes ", ShapeString(t.shape), " and ", ShapeString(ref.shape), ")"));
}

// BFLOAT16 inputs run on the bfloat16 kernels (float32 accumulation), and
// so do the others when the caller asks; FLOAT32 and FLOAT16 inputs run in
// float32 otherwise.
DType ComputeDType(DType input, const AttentionOptions& options) {
  return input == DType::kBFloat16 || options.compute_bf16 ? DType::kBFloat16
                                                           : DType::kFloat32;
}

// The tensors an allocator-based operation produced.
AttentionResult TakeResult(TensorResults& results) {
  AttentionResult result;
  result.output = *results.Take("output");
  result.weights = results.Take("weights");
  return result;
}

}  // namespace

absl::StatusOr<AttentionResult> Attend(const AttendInputs& inputs,
                                       const AttentionOptions& options) {
  TensorResults results;
  ATTN_RETURN_IF_ERROR(Attend(inputs, options, results));
  return TakeResult(results);
}

absl::Status Attend(const AttendInputs& in, const AttentionOptions& options,
                    ResultAllocator& results) {
  ATTN_RETURN_IF_ERROR(VerifyFloating(in.query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameDType(in.key, "key", in.query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameDType(in.value, "value", in.query, "query"));
  ATTN_RETURN_IF_ERROR(VerifyRank(in.query, "query", 2, 1000));
  ATTN_RETURN_IF_ERROR(VerifySameRank(in.key, "key", in.query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameRank(in.value, "value", in.query, "query"));
  const int64_t rank = in.query.rank();
  for (int64_t d = 0; d < rank - 2; ++d) {
    const std::string what = absl::StrCat("query dim ", d);
    ATTN_RETURN_IF_ERROR(VerifyDim(in.key, "key", d, in.query.dim(d), what));
    ATTN_RETURN_IF_ERROR(
        VerifyDim(in.value, "value", d, in.query.dim(d), what));
  }
  ATTN_RETURN_IF_ERROR(
      VerifyDim(in.key, "key", -1, in.query.dim(-1), "query last dim"));
  ATTN_RETURN_IF_ERROR(VerifyDim(in.value, "value", -2, in.key.dim(-2),
                                 absl::StrCat("key dim ", rank - 2)));

  const Shape batch_dims(in.query.shape.begin(), in.query.shape.end() - 2);
  AttentionProblem p;
  p.batch = NumElements(batch_dims);
  p.query_len = in.query.dim(-2);
  p.key_len = in.key.dim(-2);
  p.key_dim = in.query.dim(-1);
  p.value_dim = in.value.dim(-1);
  p.causal = options.causal;
  ATTN_ASSIGN_OR_RETURN(p.logit_multiplier,
                        LogitMultiplier(options, p.key_dim));

  Shape logits_shape = batch_dims;
  logits_shape.push_back(p.query_len);
  logits_shape.push_back(p.key_len);
  ATTN_RETURN_IF_ERROR(
      CheckedNumElements(logits_shape, DType::kFloat32, "weights").status());
  if (in.attn_mask.has_value()) {
    ATTN_ASSIGN_OR_RETURN(
        MaskLayout mask,
        BroadcastMask(*in.attn_mask, "attn_mask", logits_shape));
    p.masks.push_back(std::move(mask));
  }

  const DType compute = ComputeDType(in.query.dtype, options);
  ATTN_ASSIGN_OR_RETURN(OperandData query,
                        OperandData::From(in.query, compute, "query"));
  ATTN_ASSIGN_OR_RETURN(OperandData key,
                        OperandData::From(in.key, compute, "key"));
  ATTN_ASSIGN_OR_RETURN(OperandData value,
                        OperandData::From(in.value, compute, "value"));
  p.operand_dtype = compute;
  p.query = query.data();
  p.key = key.data();
  p.value = value.data();
  p.query_layout = DenseLayout(1, p.query_len, p.key_dim);
  p.key_layout = DenseLayout(1, p.key_len, p.key_dim);
  p.value_layout = DenseLayout(1, p.key_len, p.value_dim);
  p.output_layout = DenseLayout(1, p.query_len, p.value_dim);

  Shape output_shape = batch_dims;
  output_shape.push_back(p.query_len);
  output_shape.push_back(p.value_dim);
  ATTN_ASSIGN_OR_RETURN(
      ResultBuffer output,
      ResultBuffer::Allocate(results, "output", in.query.dtype, output_shape,
                             /*bf16_ok=*/true));
  p.output = output.data();
  p.output_dtype = output.dtype();
  if (options.return_weights) {
    ATTN_ASSIGN_OR_RETURN(
        void* weights,
        results.Allocate("weights", DType::kFloat32, logits_shape));
    p.weights = static_cast<float*>(weights);
  }
  ATTN_RETURN_IF_ERROR(RunAttention(p));
  output.Finish();
  return absl::OkStatus();
}

namespace {

// One projection y = x * W^T + b after validation: where its weight and bias
// start (the fused in_proj_weight is read in place, a third at a time).
struct Projection {
  const void* weight = nullptr;  // [out, in], in the compute dtype
  const float* bias = nullptr;   // [out] or null
  int64_t out = 0;
  int64_t in = 0;
  DType dtype = DType::kFloat32;  // of weight, and of x
};

// x [rows, p.in] -> y [rows, p.out], y in `y_dtype`.
absl::Status Project(const Projection& proj, int64_t rows, const void* x,
                     void* y, DType y_dtype) {
  MatmulShape s;
  s.m = rows;
  s.k = proj.in;
  s.n = proj.out;
  s.b_transposed = true;
  s.b_shared = true;
  s.has_bias = proj.bias != nullptr;
  s.a_dtype = s.b_dtype = proj.dtype;
  s.c_dtype = y_dtype;
  return Matmul(s, x, proj.weight, proj.bias, y);
}

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

// Weights of a multi-head layer in the compute dtype (biases in float32),
// validated against the inputs.
struct ResolvedWeights {
  std::vector<OperandData> owned;  // keeps converted copies alive
  Projection q, k, v;
  // PyTorch's fused in_proj_weight as one [3E, E] projection.
  std::optional<Projection> fused_qkv;
  std::optional<Projection> out;
  int64_t key_dim = 0;    // per head
  int64_t value_dim = 0;  // per head
};

absl::StatusOr<const void*> Converted(ResolvedWeights& r,
                                      const std::optional<TensorView>& t,
                                      DType dtype, absl::string_view field) {
  if (!t.has_value()) return nullptr;
  ATTN_ASSIGN_OR_RETURN(OperandData data, OperandData::From(*t, dtype, field));
  r.owned.push_back(std::move(data));
  return r.owned.back().data();
}

absl::StatusOr<const float*> AsFloat32(ResolvedWeights& r,
                                       const std::optional<TensorView>& t,
                                       absl::string_view field) {
  ATTN_ASSIGN_OR_RETURN(const void* data,
                        Converted(r, t, DType::kFloat32, field));
  return static_cast<const float*>(data);
}

absl::StatusOr<ResolvedWeights> ResolveWeights(const MultiHeadWeights& w,
                                               int64_t query_dim,
                                               int64_t key_dim,
                                               int64_t value_dim, DType dtype) {
  if (w.num_heads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_heads: must be > 0, got ", w.num_heads));
  }
  const int heads = w.num_heads;
  const bool separate = w.q_proj_weight.has_value() ||
                        w.k_proj_weight.has_value() ||
                        w.v_proj_weight.has_value();
  if (separate && w.in_proj_weight.has_value()) {
    return absl::InvalidArgumentError(
        "in_proj_weight: give either in_proj_weight or "
        "q_proj_weight/k_proj_weight/v_proj_weight, not both");
  }
  ResolvedWeights r;
  r.owned.reserve(10);
  const auto weight_data = [&](const std::optional<TensorView>& t,
                               absl::string_view field) {
    return Converted(r, t, dtype, field);
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
                          weight_data(w.in_proj_weight, "in_proj_weight"));
    ATTN_ASSIGN_OR_RETURN(const float* bias,
                          AsFloat32(r, w.in_proj_bias, "in_proj_bias"));
    r.fused_qkv = Projection{weight, bias, 3 * embed, embed, dtype};
    Projection* parts[] = {&r.q, &r.k, &r.v};
    for (int i = 0; i < 3; ++i) {
      parts[i]->weight = static_cast<const char*>(weight) +
                         i * embed * embed * DTypeSize(dtype);
      parts[i]->dtype = dtype;
      parts[i]->bias = bias != nullptr ? bias + i * embed : nullptr;
      parts[i]->out = embed;
      parts[i]->in = embed;
    }
  } else {
    if (w.in_proj_bias.has_value()) {
      return absl::InvalidArgumentError(
          "in_proj_bias: given without in_proj_weight");
    }
    struct Part {
      const std::optional<TensorView>& weight;
      const std::optional<TensorView>& bias;
      const char* weight_field;
      const char* bias_field;
      Projection* proj;
    };
    const Part parts[] = {
        {w.q_proj_weight, w.q_proj_bias, "q_proj_weight", "q_proj_bias", &r.q},
        {w.k_proj_weight, w.k_proj_bias, "k_proj_weight", "k_proj_bias", &r.k},
        {w.v_proj_weight, w.v_proj_bias, "v_proj_weight", "v_proj_bias", &r.v},
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
                            weight_data(part.weight, part.weight_field));
      ATTN_ASSIGN_OR_RETURN(part.proj->bias,
                            AsFloat32(r, part.bias, part.bias_field));
      part.proj->out = part.weight->dim(0);
      part.proj->dtype = dtype;
      part.proj->in = part.weight->dim(1);
    }
    ATTN_RETURN_IF_ERROR(VerifyDim(*w.k_proj_weight, "k_proj_weight", 0,
                                   r.q.out, "q_proj_weight dim 0"));
  }
  const char* q_name = w.in_proj_weight ? "in_proj_weight" : "q_proj_weight";
  const char* k_name = w.in_proj_weight ? "in_proj_weight" : "k_proj_weight";
  const char* v_name = w.in_proj_weight ? "in_proj_weight" : "v_proj_weight";
  const auto check_input = [](int64_t actual, absl::string_view field,
                              int64_t expected,
                              absl::string_view weight_field) -> absl::Status {
    if (actual == expected) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(field, ": last dim ", actual,
                                                   " != ", weight_field,
                                                   " dim 1 ", expected));
  };
  ATTN_RETURN_IF_ERROR(check_input(query_dim, "query", r.q.in, q_name));
  ATTN_RETURN_IF_ERROR(check_input(key_dim, "key", r.k.in, k_name));
  ATTN_RETURN_IF_ERROR(check_input(value_dim, "value", r.v.in, v_name));
  r.key_dim = r.q.out / heads;
  r.value_dim = r.v.out / heads;

  if (w.out_proj_weight.has_value()) {
    const TensorView& out = *w.out_proj_weight;
    ATTN_RETURN_IF_ERROR(VerifyFloating(out, "out_proj_weight"));
    ATTN_RETURN_IF_ERROR(VerifyRank(out, "out_proj_weight", 2, 2));
    ATTN_RETURN_IF_ERROR(VerifyDim(out, "out_proj_weight", 1, r.v.out,
                                   absl::StrCat(v_name, " rows (H*dv) =")));
    ATTN_RETURN_IF_ERROR(
        VerifyBias(w.out_proj_bias, "out_proj_bias", out.dim(0)));
    Projection proj;
    ATTN_ASSIGN_OR_RETURN(proj.weight,
                          weight_data(w.out_proj_weight, "out_proj_weight"));
    ATTN_ASSIGN_OR_RETURN(proj.bias,
                          AsFloat32(r, w.out_proj_bias, "out_proj_bias"));
    proj.out = out.dim(0);
    proj.in = out.dim(1);
    proj.dtype = dtype;
    r.out = proj;
  } else if (w.out_proj_bias.has_value()) {
    return absl::InvalidArgumentError(
        "out_proj_bias: given without out_proj_weight");
  }
  return r;
}

// Reads a multi-head attn_mask: [Lq, Lk], [B, Lq, Lk] shared by all heads,
// or [B, H, Lq, Lk].
absl::StatusOr<MaskLayout> MultiHeadMask(const TensorView& mask, int64_t batch,
                                         int64_t heads, int64_t query_len,
                                         int64_t key_len) {
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
  for (int64_t n = 0; n < batch * heads; ++n) {
    if (mask.shape == shape2) {
      layout.batch_offset[n] = 0;
    } else if (mask.shape == shape3) {
      layout.batch_offset[n] = (n / heads) * plane;
    } else if (mask.shape == shape4) {
      layout.batch_offset[n] = n * plane;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("attn_mask: shape ", ShapeString(mask.shape),
                       ", expected ", ShapeString(shape2), ", ",
                       ShapeString(shape3), " or ", ShapeString(shape4)));
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

absl::Status MultiHeadAttend(const MultiHeadWeights& weights,
                             const MultiHeadInputs& in,
                             const MultiHeadOptions& options,
                             ResultAllocator& results) {
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
  const int64_t batch = batched ? in.query.dim(0) : 1;
  const int64_t query_len = in.query.dim(-2);
  const int64_t key_len = key.dim(-2);
  const DType compute = ComputeDType(in.query.dtype, options.attention);
  ATTN_ASSIGN_OR_RETURN(ResolvedWeights w,
                        ResolveWeights(weights, in.query.dim(-1), key.dim(-1),
                                       value.dim(-1), compute));
  const int64_t heads = weights.num_heads;

  AttentionProblem p;
  p.batch = batch;
  p.heads = heads;
  p.query_len = query_len;
  p.key_len = key_len;
  p.key_dim = w.key_dim;
  p.value_dim = w.value_dim;
  p.causal = options.attention.causal;
  ATTN_ASSIGN_OR_RETURN(p.logit_multiplier,
                        LogitMultiplier(options.attention, w.key_dim));
  const Shape per_head_weights = {batch, heads, query_len, key_len};
  ATTN_RETURN_IF_ERROR(
      CheckedNumElements(per_head_weights, DType::kFloat32, "weights")
          .status());
  if (in.attn_mask.has_value()) {
    ATTN_ASSIGN_OR_RETURN(
        MaskLayout mask,
        MultiHeadMask(*in.attn_mask, batch, heads, query_len, key_len));
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
  if (w.fused_qkv.has_value() && !in.key.has_value() && !in.value.has_value()) {
    // Self-attention with the fused weight: one [B*L, E] x [E, 3E] matmul.
    const int64_t e = w.q.out;
    ATTN_ASSIGN_OR_RETURN(qkv_proj,
                          Tensor::Allocate(compute, {batch, query_len, 3 * e}));
    char* qkv = static_cast<char*>(qkv_proj.data());
    ATTN_RETURN_IF_ERROR(
        Project(*w.fused_qkv, batch * query_len, query.data(), qkv, compute));
    const OperandLayout layout{query_len * 3 * e, w.key_dim, 3 * e};
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
        q_proj, Tensor::Allocate(compute, {batch, query_len, w.q.out}));
    ATTN_ASSIGN_OR_RETURN(k_proj,
                          Tensor::Allocate(compute, {batch, key_len, w.k.out}));
    ATTN_ASSIGN_OR_RETURN(v_proj,
                          Tensor::Allocate(compute, {batch, key_len, w.v.out}));
    ATTN_RETURN_IF_ERROR(
        Project(w.q, batch * query_len, query.data(), q_proj.data(), compute));
    ATTN_RETURN_IF_ERROR(
        Project(w.k, batch * key_len, key_data.data(), k_proj.data(), compute));
    ATTN_RETURN_IF_ERROR(Project(w.v, batch * key_len, value_data.data(),
                                 v_proj.data(), compute));
    p.query = q_proj.data();
    p.key = k_proj.data();
    p.value = v_proj.data();
    p.query_layout = InterleavedHeadsLayout(heads, query_len, w.key_dim);
    p.key_layout = InterleavedHeadsLayout(heads, key_len, w.key_dim);
    p.value_layout = InterleavedHeadsLayout(heads, key_len, w.value_dim);
  }

  // The heads' outputs land side by side: the concatenation the output
  // projection reads (in the compute dtype), or the result itself without
  // one.
  const int64_t concat_dim = heads * w.value_dim;
  const int64_t out_dim = w.out.has_value() ? w.out->out : concat_dim;
  const Shape output_shape =
      batched ? Shape{batch, query_len, out_dim} : Shape{query_len, out_dim};
  ATTN_ASSIGN_OR_RETURN(
      ResultBuffer output,
      ResultBuffer::Allocate(results, "output", in.query.dtype, output_shape,
                             /*bf16_ok=*/true));
  Tensor concat;
  if (w.out.has_value()) {
    ATTN_ASSIGN_OR_RETURN(
        concat, Tensor::Allocate(compute, {batch, query_len, concat_dim}));
    p.output = concat.data();
    p.output_dtype = compute;
  } else {
    p.output = output.data();
    p.output_dtype = output.dtype();
  }
  p.output_layout = InterleavedHeadsLayout(heads, query_len, w.value_dim);

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
  if (w.out.has_value()) {
    ATTN_RETURN_IF_ERROR(Project(*w.out, batch * query_len, concat.data(),
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
