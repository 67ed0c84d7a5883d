// The core's operations: scaled dot-product attention (`Attend`),
// multi-head attention with projections (`MultiHeadAttend`) and `LayerNorm`.
//
// Semantics (the project README states them in full): logits are
// (Q*K^T) * scale / temperature; BOOL/UINT8 masks keep positions where they
// are nonzero, FLOAT32 masks are added to the logits (-inf excludes); causal
// attention is top-left aligned; a query with no key left gets zeros, never
// NaN. Inputs may be FLOAT32, BFLOAT16 or FLOAT16; outputs have the query's
// (input's) dtype. Every input dtype is computed in float32 (BFLOAT16 and
// FLOAT16 inputs widened exactly, the output rounded to their dtype at the
// end) unless AttentionOptions::compute_bf16 asks for the bfloat16 kernels:
// operands and projections rounded to bfloat16, float32 accumulation,
// softmax and normalization.
//
// Ownership: inputs are views the caller keeps alive for the call; results
// own their buffers. Thread-safety: every function may be called
// concurrently from any number of threads.
#ifndef ATTNSERVE_CORE_ATTENTION_H_
#define ATTNSERVE_CORE_ATTENTION_H_

#include <atomic>
#include <optional>

#include "absl/status/statusor.h"
#include "core/attention_options.h"
#include "core/results.h"
#include "core/tensor.h"

namespace attnserve {

struct AttendInputs {
  TensorView query;  // [..., Lq, dk]
  TensorView key;    // [..., Lk, dk]
  TensorView value;  // [..., Lk, dv]
  // Broadcastable right-aligned to [..., Lq, Lk].
  std::optional<TensorView> attn_mask;
};

// Results "output" [..., Lq, dv] and, when asked, "weights" [..., Lq, Lk].
absl::Status Attend(const AttendInputs& inputs, const AttentionOptions& options,
                    ResultAllocator& results);
absl::StatusOr<AttentionResult> Attend(const AttendInputs& inputs,
                                       const AttentionOptions& options);

// Projection weights in nn.Linear's [out_features, in_features] layout.
// Either q/k/v_proj_weight or in_proj_weight ([3E, E]) is set.
struct MultiHeadWeights {
  int num_heads = 0;
  // Key/value heads (grouped-query attention, as LLaMA's num_key_value_heads):
  // a divisor of num_heads; k/v_proj_weight then have num_kv_heads * d
  // rows. 0 means num_heads.
  int num_kv_heads = 0;
  std::optional<TensorView> q_proj_weight;    // [H*dk, Eq]
  std::optional<TensorView> k_proj_weight;    // [Hkv*dk, Ek]
  std::optional<TensorView> v_proj_weight;    // [Hkv*dv, Ev]
  std::optional<TensorView> in_proj_weight;   // [3E, E]
  std::optional<TensorView> q_proj_bias;      // [H*dk]
  std::optional<TensorView> k_proj_bias;      // [Hkv*dk]
  std::optional<TensorView> v_proj_bias;      // [Hkv*dv]
  std::optional<TensorView> in_proj_bias;     // [3E]
  std::optional<TensorView> out_proj_weight;  // [Eo, H*dv]
  std::optional<TensorView> out_proj_bias;    // [Eo]
};

struct MultiHeadInputs {
  TensorView query;                 // [B, Lq, Eq] or [Lq, Eq]
  std::optional<TensorView> key;    // [B, Lk, Ek]; absent: the query
  std::optional<TensorView> value;  // [B, Lk, Ev]; absent: the key
  // [Lq, Lk], [B, Lq, Lk] (all heads) or [B, H, Lq, Lk].
  std::optional<TensorView> attn_mask;
  std::optional<TensorView> key_padding_mask;  // [B, Lk]
};

struct MultiHeadOptions {
  AttentionOptions attention;
  // With return_weights: the mean over heads [B, Lq, Lk] instead of the
  // per-head weights [B, H, Lq, Lk].
  bool average_weights = false;
};

// Results "output" [B, Lq, Eo] (or [B, Lq, H*dv] without out_proj_weight;
// no B for an unbatched query) and, when asked, "weights" [B, H, Lq, Lk]
// ([B, Lq, Lk] averaged).
absl::Status MultiHeadAttend(const MultiHeadWeights& weights,
                             const MultiHeadInputs& inputs,
                             const MultiHeadOptions& options,
                             ResultAllocator& results);
absl::StatusOr<AttentionResult> MultiHeadAttend(
    const MultiHeadWeights& weights, const MultiHeadInputs& inputs,
    const MultiHeadOptions& options);

struct LayerNormOptions {
  // Added to the variance (to the mean square with rms_norm); must be > 0.
  float eps = 1e-5f;
  // Trailing dims normalized together; at least 1, at most the rank.
  int normalized_ndim = 1;
  // RMSNorm (torch.nn.RMSNorm): x / sqrt(mean(x^2) + eps) * gamma; beta
  // must be absent.
  bool rms_norm = false;
};

// torch.nn.RMSNorm's eps when none is given: the machine epsilon of the
// input's dtype (float32 2^-23, bfloat16 2^-7, float16 2^-10).
float DefaultRmsNormEps(DType dtype);

// (x - mean) / sqrt(var + eps) * gamma + beta over the trailing dims, with
// the biased variance, or RMSNorm (options.rms_norm). gamma and beta have
// the shape of those dims. Result "output" has the input's shape and
// dtype.
absl::Status LayerNorm(const TensorView& input,
                       const std::optional<TensorView>& gamma,
                       const std::optional<TensorView>& beta,
                       const LayerNormOptions& options,
                       ResultAllocator& results);
absl::StatusOr<Tensor> LayerNorm(const TensorView& input,
                                 const std::optional<TensorView>& gamma,
                                 const std::optional<TensorView>& beta,
                                 const LayerNormOptions& options);

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_ATTENTION_H_
