// Rotary position embeddings (RoPE) in the half-rotation layout of GPT-NeoX
// and Hugging Face's LLaMA: within each head, the first `dims` features are
// two halves x1 = x[:dims/2], x2 = x[dims/2:dims], rotated by the angle
// pos * base^(-2i/dims) of pair i:
//   x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin.
// Features past `dims` pass unchanged (partial rotary, as GPT-NeoX's
// rotary_pct). Angles are computed in double, the rotation in float32.
//
// Thread-safety: free functions without shared state; ApplyRotary writes
// only the operand it is given.
#ifndef ATTNSERVE_CORE_ROTARY_H_
#define ATTNSERVE_CORE_ROTARY_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/attention_kernel.h"
#include "core/tensor.h"

namespace attnserve {

struct RotaryOptions {
  // Rotated features at the start of each head: even, at most the head
  // dim; 0 turns rotary embeddings off.
  int64_t dims = 0;
  // The wavelength base (LLaMA: 10000; some long-context models 500000).
  float base = 10000.0f;
};

// `rotary.dims` is even and at most `head_dim`, and `base` finite and > 1;
// messages name `field`, e.g. "rotary_dims: 80 > head dim 64".
absl::Status VerifyRotary(const RotaryOptions& rotary, int64_t head_dim,
                          absl::string_view field);

// Rotates element (b, h, r, :dims) of a [batch, heads, rows, head_dim]
// operand of FLOAT32 or BFLOAT16 at `data` (see OperandLayout) as position
// first_position + r. A no-op when rotary.dims is 0.
void ApplyRotary(const RotaryOptions& rotary, DType dtype, void* data,
                 const OperandLayout& layout, int64_t batch, int64_t heads,
                 int64_t rows, int64_t first_position);

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_ROTARY_H_
