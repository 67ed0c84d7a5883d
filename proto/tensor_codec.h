// Conversions between wire tensors (attnserve.v1.Tensor) and core tensors,
// and between wire and core attention weights.
//
// Decoding never copies: a TensorView points into the message's raw_data or
// float_data, so the message must outlive the view. Thread-safety: free
// functions without shared state.
#ifndef ATTNSERVE_PROTO_TENSOR_CODEC_H_
#define ATTNSERVE_PROTO_TENSOR_CODEC_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "core/attention.h"
#include "core/attention_weights.h"
#include "core/results.h"
#include "core/tensor.h"

namespace attnserve {

// The core dtype of a wire dtype; INVALID_ARGUMENT naming `field` for
// DATA_TYPE_UNSPECIFIED and values this build does not know.
absl::StatusOr<DType> DTypeFromProto(int dtype, absl::string_view field);
v1::DataType DTypeToProto(DType dtype);

// Turns shared-memory references into memory: the server's side of
// SharedMemoryRef. Implementations keep what they resolve valid for their own
// lifetime.
class SharedMemoryResolver {
 public:
  virtual ~SharedMemoryResolver() = default;
  // `byte_size` bytes at `ref` (ref.byte_size() is the caller's to check),
  // aligned to `alignment`: NOT_FOUND for an unknown region, INVALID_ARGUMENT
  // for bytes outside it or misaligned; messages name `field`.
  virtual absl::StatusOr<char*> Resolve(const v1::SharedMemoryRef& ref,
                                        uint64_t byte_size, uint64_t alignment,
                                        absl::string_view field) = 0;
};

// A view of `tensor`'s values after checking its dtype, dims (at most 64)
// and that exactly one of raw_data, float_data and shared_memory holds
// shape x dtype-size bytes. Messages name `field`, e.g. "query: raw_data has 12
// bytes, expected 16 (...)". `shared_memory` null: references are refused.
absl::StatusOr<TensorView> DecodeTensor(
    const v1::Tensor& tensor, absl::string_view field,
    SharedMemoryResolver* shared_memory = nullptr);

// Writes `view` into `out` as raw_data.
void EncodeTensor(const TensorView& view, v1::Tensor* out);

// Hands out wire tensors' raw_data as result memory, so that operations
// compute straight into a response. `output` receives result "output";
// `weights` (may be null) result "weights". A result that `regions` places in
// shared memory is written there through `shared_memory` instead, and its
// wire tensor carries the reference. Thread-compatible.
class WireResults : public ResultAllocator {
 public:
  WireResults(v1::Tensor* output, v1::Tensor* weights,
              const v1::ResultRegions* regions = nullptr,
              SharedMemoryResolver* shared_memory = nullptr)
      : output_(output),
        weights_(weights),
        regions_(regions),
        shared_memory_(shared_memory) {}

 protected:
  absl::StatusOr<void*> DoAllocate(absl::string_view name, DType dtype,
                                   const Shape& shape) override;

 private:
  v1::Tensor* output_;
  v1::Tensor* weights_;
  const v1::ResultRegions* regions_;
  SharedMemoryResolver* shared_memory_;
};

// A copy of a wire tensor as a core tensor (for clients, which keep results
// beyond the response's life).
absl::StatusOr<Tensor> CopyTensor(
    const v1::Tensor& tensor, absl::string_view field,
    SharedMemoryResolver* shared_memory = nullptr);

// The wire tensor of `field` in `weights` (reached by the field's name), or
// null when `weights` does not set it.
const v1::Tensor* FindWeightTensor(const v1::AttentionWeights& weights,
                                   const MultiHeadWeightField& field);
// The wire tensor of `field` in `weights`, which is set from now on.
v1::Tensor* MutableWeightTensor(v1::AttentionWeights* weights,
                                const MultiHeadWeightField& field);

// num_heads and a view of every tensor field `weights` sets, decoded by
// DecodeTensor in the order of kMultiHeadWeightFields: the first bad field
// fails the call with DecodeTensor's message, naming it (e.g.
// "q_proj_weight: raw_data has ..."). Fields `weights` does not set stay
// absent. Never copies: `weights` must outlive the result.
absl::StatusOr<MultiHeadWeights> DecodeAttentionWeights(
    const v1::AttentionWeights& weights,
    SharedMemoryResolver* shared_memory = nullptr);

}  // namespace attnserve

#endif  // ATTNSERVE_PROTO_TENSOR_CODEC_H_
