// A multi-head attention layer prepared once and run many times.
//
// MultiHeadLayer::Create validates the projection weights (nn.Linear's
// [out_features, in_features] layout; see MultiHeadWeights), converts them
// to the layer's compute dtype and, when asked, packs them into oneDNN's
// preferred blocked layout so that no run repacks them. The free function
// MultiHeadAttend (attention.h) builds an unpacked layer for one call.
//
// Ownership: a packed layer owns copies of everything it needs; an unpacked
// one reads FLOAT32 weights of a FLOAT32 layer in place, so they must outlive
// it. Thread-safety: immutable after Create; Run may be called from any
// number of threads at once.
#ifndef ATTNSERVE_CORE_MULTI_HEAD_ATTENTION_H_
#define ATTNSERVE_CORE_MULTI_HEAD_ATTENTION_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/attention.h"
#include "core/attention_kernel.h"
#include "core/convert.h"
#include "core/results.h"
#include "core/rotary.h"
#include "core/tensor.h"

namespace attnserve {

// A projection's weight packed for oneDNN (core/primitives.h): declared
// here only, so that this header does not bring oneDNN's into its users.
class PackedLinear;

class MultiHeadLayer {
 public:
  struct Options {
    // FLOAT32 or BFLOAT16: the dtype projections and attention run in.
    DType compute_dtype = DType::kFloat32;
    // Reorder (and copy) the weights for oneDNN once.
    bool pack = true;
    // Rotary position embeddings applied to the projected queries and keys
    // (positions 0, 1, ... of each sequence in Run).
    RotaryOptions rotary;
  };

  static absl::StatusOr<std::shared_ptr<const MultiHeadLayer>> Create(
      const MultiHeadWeights& weights, const Options& options);

  // Results "output" and, when asked, "weights", as MultiHeadAttend.
  // `options.attention.compute_bf16` is ignored: the layer's compute dtype
  // decides.
  absl::Status Run(const MultiHeadInputs& inputs,
                   const MultiHeadOptions& options,
                   ResultAllocator& results) const;

  int num_heads() const { return heads_; }
  // Key/value heads: num_heads, or fewer for grouped-query attention.
  int num_kv_heads() const { return kv_heads_; }
  const RotaryOptions& rotary() const { return rotary_; }
  DType compute_dtype() const { return compute_; }
  int64_t query_dim() const { return q_.in; }
  int64_t key_input_dim() const { return k_.in; }
  int64_t value_input_dim() const { return v_.in; }
  int64_t head_key_dim() const { return key_dim_; }
  int64_t head_value_dim() const { return value_dim_; }
  // The output's last dim: out_proj_weight's rows, or H * dv without it.
  int64_t output_dim() const;
  bool has_output_projection() const { return out_.has_value(); }

  // One projection alone, for callers that run attention themselves (decode
  // sessions): y = x * W^T + b for `rows` rows; x in the compute dtype, y in
  // `y_dtype` (the compute dtype or FLOAT32). kOutput without an output
  // projection fails with FAILED_PRECONDITION.
  enum class Part { kQuery, kKey, kValue, kOutput };
  absl::Status ProjectPart(Part part, int64_t rows, const void* x, void* y,
                           DType y_dtype) const;

 private:
  // One projection y = x * W^T + b: packed, or read in place (the fused
  // in_proj_weight a third at a time).
  struct Projection {
    const void* weight = nullptr;  // [out, in] in the compute dtype
    const float* bias = nullptr;   // [out] or null
    int64_t out = 0;
    int64_t in = 0;
    std::shared_ptr<const PackedLinear> packed;
  };

  // A run's sizes, and the scratch tensors it computes in (defined in the
  // .cc file).
  struct RunDims;
  struct RunBuffers;

  MultiHeadLayer() = default;

  // Steps of Create: check the weights and set up the projections.
  absl::Status Resolve(const MultiHeadWeights& w);
  absl::Status ResolveFused(const MultiHeadWeights& w);
  absl::Status ResolveSeparate(const MultiHeadWeights& w);
  absl::Status ResolveOutput(const MultiHeadWeights& w);
  absl::Status Pack();
  absl::StatusOr<const void*> Converted(const std::optional<TensorView>& t,
                                        DType dtype, absl::string_view field);
  absl::StatusOr<const float*> ConvertedBias(const std::optional<TensorView>& t,
                                             absl::string_view field);

  // Steps of Run, in order.
  absl::Status VerifyFeatureDims(const TensorView& query, const TensorView& key,
                                 const TensorView& value) const;
  absl::StatusOr<AttentionProblem> Problem(
      const MultiHeadInputs& in, const RunDims& dims,
      const AttentionOptions& options) const;
  absl::Status ProjectInputs(const MultiHeadInputs& in, const TensorView& key,
                             const TensorView& value, const RunDims& dims,
                             AttentionProblem& p, RunBuffers& buffers) const;
  absl::StatusOr<ResultBuffer> AllocateOutput(DType dtype, const RunDims& dims,
                                              ResultAllocator& results,
                                              AttentionProblem& p,
                                              RunBuffers& buffers) const;
  absl::StatusOr<float*> AllocateWeights(const MultiHeadOptions& options,
                                         const RunDims& dims,
                                         ResultAllocator& results,
                                         AttentionProblem& p,
                                         RunBuffers& buffers) const;
  absl::Status Project(const Projection& proj, int64_t rows, const void* x,
                       void* y, DType y_dtype) const;

  int heads_ = 0;
  int kv_heads_ = 0;
  RotaryOptions rotary_;
  DType compute_ = DType::kFloat32;
  std::vector<OperandData> owned_;  // converted copies
  Projection q_, k_, v_;
  std::optional<Projection> fused_qkv_;  // PyTorch's [3E, E] in_proj_weight
  std::optional<Projection> out_;
  int64_t key_dim_ = 0;    // per head
  int64_t value_dim_ = 0;  // per head
  // Field names for messages: "in_proj_weight" or "q/k/v_proj_weight".
  std::string q_name_, k_name_, v_name_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_MULTI_HEAD_ATTENTION_H_
