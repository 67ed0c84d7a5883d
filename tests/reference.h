// Naive float64 references for the core's operations, written for clarity,
// not speed: the tests hold the core to these.
#ifndef ATTNSERVE_TESTS_REFERENCE_H_
#define ATTNSERVE_TESTS_REFERENCE_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "core/tensor.h"

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
// positions (BOOL/UINT8) or adds to the logits (FLOAT32).
RefAttentionResult RefAttend(const RefTensor& q, const RefTensor& k,
                             const RefTensor& v,
                             const std::vector<RefTensor>& masks,
                             const std::vector<bool>& mask_is_keep,
                             const RefAttentionOptions& options);

// y = x * W^T + b over the last dim of x; W is [out, in].
RefTensor RefLinear(const RefTensor& x, const RefTensor& w,
                    const std::optional<RefTensor>& b);

// LayerNorm over the trailing `normalized_ndim` dims.
RefTensor RefLayerNorm(const RefTensor& x,
                       const std::optional<RefTensor>& gamma,
                       const std::optional<RefTensor>& beta, double eps,
                       int normalized_ndim);

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_REFERENCE_H_
