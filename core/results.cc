#include "core/results.h"

#include "core/convert.h"
#include "core/status_macros.h"

namespace attnserve {

absl::StatusOr<void*> ResultAllocator::Allocate(absl::string_view name,
                                                DType dtype,
                                                const Shape& shape) {
  ATTN_RETURN_IF_ERROR(VerifyTensorBytes(dtype, shape, name).status());
  return DoAllocate(name, dtype, shape);
}

absl::StatusOr<void*> TensorResults::DoAllocate(absl::string_view name,
                                                DType dtype,
                                                const Shape& shape) {
  ATTN_ASSIGN_OR_RETURN(Tensor tensor, Tensor::Allocate(dtype, shape));
  void* data = tensor.data();
  tensors_.insert_or_assign(std::string(name), std::move(tensor));
  return data;
}

std::optional<Tensor> TensorResults::Take(absl::string_view name) {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return std::nullopt;
  Tensor tensor = std::move(it->second);
  tensors_.erase(it);
  return tensor;
}

absl::StatusOr<ResultBuffer> ResultBuffer::Allocate(ResultAllocator& results,
                                                    absl::string_view name,
                                                    DType dtype,
                                                    const Shape& shape,
                                                    bool bf16_ok) {
  ResultBuffer buffer;
  ATTN_ASSIGN_OR_RETURN(buffer.result_, results.Allocate(name, dtype, shape));
  buffer.result_dtype_ = dtype;
  buffer.count_ = NumElements(shape);
  if (dtype == DType::kFloat32 || (bf16_ok && dtype == DType::kBFloat16)) {
    buffer.kernel_dtype_ = dtype;
    buffer.data_ = buffer.result_;
  } else {
    buffer.kernel_dtype_ = DType::kFloat32;
    ATTN_ASSIGN_OR_RETURN(buffer.scratch_,
                          Tensor::Allocate(DType::kFloat32, shape));
    buffer.data_ = buffer.scratch_.data();
  }
  return buffer;
}

void ResultBuffer::Finish() {
  if (data_ != result_) {
    StoreFloat32(static_cast<const float*>(data_), count_, result_dtype_,
                 result_);
  }
}

}  // namespace attnserve
