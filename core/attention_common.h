// Pieces shared by the attention operations' implementations.
//
// Thread-safety: free functions without shared state.
#ifndef ATTNSERVE_CORE_ATTENTION_COMMON_H_
#define ATTNSERVE_CORE_ATTENTION_COMMON_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/attention_options.h"
#include "core/results.h"
#include "core/tensor.h"

namespace attnserve {

// scale / temperature, after checking both (scale finite, temperature finite
// and > 0) and that the quotient is finite; scale defaults to 1/sqrt(dk).
absl::StatusOr<float> LogitMultiplier(const AttentionOptions& options,
                                      int64_t key_dim);

// `t` has `ref`'s dtype (rank).
absl::Status VerifySameDType(const TensorView& t, absl::string_view field,
                             const TensorView& ref,
                             absl::string_view ref_field);
absl::Status VerifySameRank(const TensorView& t, absl::string_view field,
                            const TensorView& ref, absl::string_view ref_field);

// The dtype the kernels run in, whatever the inputs' dtype: float32 (the
// BFLOAT16 and FLOAT16 inputs widened exactly), or bfloat16 when
// options.compute_bf16 asks for it.
DType ComputeDType(const AttentionOptions& options);

// The "output" and "weights" tensors an operation produced.
AttentionResult TakeResult(TensorResults& results);

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_ATTENTION_COMMON_H_
