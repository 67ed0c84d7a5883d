// Naive float64 references for the core's operations, written for clarity,
// not speed: the tests hold the core to these. NaN and +-Inf in the inputs
// propagate as the README's Semantics say (IEEE arithmetic; masked positions
// are not read; a query with no key left gets zeros).
#ifndef ATTNSERVE_TESTS_REFERENCE_H_
#define ATTNSERVE_TESTS_REFERENCE_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/strings/string_view.h"
#include "core/tensor.h"
#include "gtest/gtest.h"

namespace attnserve::testing {

// A tensor of doubles with its shape.
struct RefTensor {
  Shape shape;
  std::vector<double> values;
};

// Values of any core tensor (BOOL/UINT8 as 0/1... as stored) as doubles.
RefTensor ToRef(const TensorView& view);

struct RefAttentionOptions {
  bool causal = false;
  std::optional<double> scale;
  std::optional<double> temperature;
};

struct RefAttentionResult {
  RefTensor output;
  RefTensor weights;
};

// Attention over [..., L, d] inputs; `masks` broadcast right-aligned to
// [..., Lq, Lk]; `mask_is_keep[i]` says whether masks[i] keeps nonzero
// positions (BOOL/UINT8) or adds to the logits (FLOAT32, -inf excludes).
// A row with a NaN or +inf logit among the kept ones is NaN in the output
// and the weights; a value row reaches the output rows that keep its key
// (0 x NaN = NaN), never the rows that exclude it.
RefAttentionResult RefAttend(const RefTensor& q, const RefTensor& k,
                             const RefTensor& v,
                             const std::vector<RefTensor>& masks,
                             const std::vector<bool>& mask_is_keep,
                             const RefAttentionOptions& options);

// nn.MultiheadAttention's weights (see MultiHeadWeights in core/attention.h).
struct RefMultiHeadWeights {
  // The field named `name` (kMultiHeadWeightFields' names); null for none.
  std::optional<RefTensor>* Field(absl::string_view name);

  int num_heads = 0;
  // Grouped-query attention: k/v projections of this many heads (0: num_heads),
  // each serving num_heads / num_kv_heads query heads (repeat_interleave).
  int num_kv_heads = 0;
  // Rotary embeddings on the projected queries and keys (RefRotary, from
  // position 0); 0: none.
  int64_t rotary_dims = 0;
  double rotary_base = 10000.0;
  std::optional<RefTensor> q_proj_weight, k_proj_weight, v_proj_weight,
      in_proj_weight, q_proj_bias, k_proj_bias, v_proj_bias, in_proj_bias,
      out_proj_weight, out_proj_bias;
};

// Multi-head attention over batched [B, L, E] inputs: the projections,
// RefAttend per head (`masks` broadcast over [B, H, Lq, Lk]), the heads
// merged and the output projection. Output [B, Lq, Eo], weights per head
// [B, H, Lq, Lk].
RefAttentionResult RefMultiHeadAttend(
    const RefMultiHeadWeights& w, const RefTensor& query, const RefTensor& key,
    const RefTensor& value, const std::vector<RefTensor>& masks,
    const std::vector<bool>& mask_is_keep, const RefAttentionOptions& options);

// Rotary position embeddings, half-rotation layout (GPT-NeoX, Hugging Face
// LLaMA), written out in float64: for x [..., L, d], row t at position
// first_position + t, pair i < dims/2 with angle pos * base^(-2i/dims):
// x[i] <- x[i] cos - x[i + dims/2] sin, x[i + dims/2] <- x[i + dims/2] cos +
// x[i] sin; features from `dims` on unchanged.
RefTensor RefRotary(const RefTensor& x, int64_t dims, double base,
                    int64_t first_position);

// [B, Hkv, L, d] -> [B, Hkv * group, L, d], each head repeated `group` times
// in place (torch.repeat_interleave(x, group, dim=1)).
RefTensor RefRepeatHeads(const RefTensor& x, int64_t group);

// Rows [first, first + n) of dim -2 of a [..., L, d] tensor.
RefTensor RefRows(const RefTensor& t, int64_t first, int64_t n);

// [..., L1, d] and [..., L2, d] joined along dim -2 (an empty `a`: `b`).
RefTensor RefConcatRows(const RefTensor& a, const RefTensor& b);

// The keep mask [n, first + n] of n new queries at positions first ..
// first + n - 1 over every key up to them: key j for query i when
// j <= first + i (causal attention of a decode step).
RefTensor RefCausalKeep(int64_t first, int64_t n);

// y = x * W^T + b over the last dim of x; W is [out, in].
RefTensor RefLinear(const RefTensor& x, const RefTensor& w,
                    const std::optional<RefTensor>& b);

// LayerNorm over the trailing `normalized_ndim` dims.
RefTensor RefLayerNorm(const RefTensor& x,
                       const std::optional<RefTensor>& gamma,
                       const std::optional<RefTensor>& beta, double eps,
                       int normalized_ndim);

// RMSNorm (torch.nn.RMSNorm) over the trailing `normalized_ndim` dims:
// x / sqrt(mean(x^2) + eps) * gamma.
RefTensor RefRmsNorm(const RefTensor& x, const std::optional<RefTensor>& gamma,
                     double eps, int normalized_ndim);

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_REFERENCE_H_
