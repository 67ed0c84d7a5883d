// The options and result of the attention operations (core/attention.h),
// apart from the operations so that their implementations' shared pieces
// (core/attention_common.h) need not include the operations' header.
//
// Thread-safety: plain values. Ownership: AttentionOptions::cancelled is not
// owned; a result owns its tensors.
#ifndef ATTNSERVE_CORE_ATTENTION_OPTIONS_H_
#define ATTNSERVE_CORE_ATTENTION_OPTIONS_H_

#include <atomic>
#include <optional>

#include "core/tensor.h"

namespace attnserve {

struct AttentionOptions {
  bool causal = false;
  // Multiplies Q*K^T; default 1/sqrt(dk).
  std::optional<float> scale;
  // Divides the scaled logits; default 1, must be > 0.
  std::optional<float> temperature;
  // Also return the attention probabilities (FLOAT32).
  bool return_weights = false;
  // Compute on the bfloat16 kernels, whatever the inputs' dtype (operands
  // rounded to bfloat16, float32 accumulation): faster, less exact, and
  // far less so for sharp softmax (large logits). Unset, every input dtype
  // is computed in float32.
  bool compute_bf16 = false;
  // Attend only: grouped-query attention (PyTorch's enable_gqa). Key and
  // value may have fewer heads (dim -3) than the query, dividing its head
  // count; each key/value head serves query.dim(-3) / key.dim(-3)
  // consecutive query heads, read once for all of them.
  bool enable_gqa = false;
  // Not owned; when set and it turns true (the caller gave up), the
  // operation stops at its next block boundary with CANCELLED and frees
  // what it allocated.
  const std::atomic<bool>* cancelled = nullptr;
};

struct AttentionResult {
  Tensor output;
  std::optional<Tensor> weights;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_ATTENTION_OPTIONS_H_
