// Conversions between wire tensors (attnserve.v1.Tensor) and core tensors.
//
// Decoding never copies: a TensorView points into the message's raw_data or
// float_data, so the message must outlive the view. Thread-safety: free
// functions without shared state.
#ifndef ATTNSERVE_PROTO_TENSOR_CODEC_H_
#define ATTNSERVE_PROTO_TENSOR_CODEC_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "core/results.h"
#include "core/tensor.h"

namespace attnserve {

// The core dtype of a wire dtype; INVALID_ARGUMENT naming `field` for
// DATA_TYPE_UNSPECIFIED and values this build does not know.
absl::StatusOr<DType> DTypeFromProto(int dtype, absl::string_view field);
v1::DataType DTypeToProto(DType dtype);

// A view of `tensor`'s values after checking its dtype, dims and that exactly
// one of raw_data and float_data holds shape x dtype-size bytes. Messages
// name `field`, e.g. "query: raw_data has 12 bytes, expected 16 (...)".
absl::StatusOr<TensorView> DecodeTensor(const v1::Tensor& tensor,
                                        absl::string_view field);

// Writes `view` into `out` as raw_data.
void EncodeTensor(const TensorView& view, v1::Tensor* out);

// Hands out wire tensors' raw_data as result memory, so that operations
// compute straight into a response. `output` receives result "output";
// `weights` (may be null) result "weights". Thread-compatible.
class WireResults : public ResultAllocator {
 public:
  WireResults(v1::Tensor* output, v1::Tensor* weights)
      : output_(output), weights_(weights) {}

 protected:
  absl::StatusOr<void*> DoAllocate(absl::string_view name, DType dtype,
                                   const Shape& shape) override;

 private:
  v1::Tensor* output_;
  v1::Tensor* weights_;
};

// A copy of a wire tensor as a core tensor (for clients, which keep results
// beyond the response's life).
absl::StatusOr<Tensor> CopyTensor(const v1::Tensor& tensor,
                                  absl::string_view field);

}  // namespace attnserve

#endif  // ATTNSERVE_PROTO_TENSOR_CODEC_H_
