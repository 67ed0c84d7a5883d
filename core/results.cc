#include "core/results.h"

#include "core/convert.h"
#include "core/status_macros.h"

namespace attnserve {

absl::StatusOr<void*> ResultAllocator::Allocate(absl::string_view name,
                                                DType dtype,
                                                const Shape& shape) {
  ATTN_RETURN_IF_ERROR(CheckTensorBytes(dtype, shape, name).status());
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

absl::StatusOr<Float32Result> Float32Result::Allocate(ResultAllocator& results,
                                                      absl::string_view name,
                                                      DType dtype,
                                                      const Shape& shape) {
  Float32Result result;
  ATTN_ASSIGN_OR_RETURN(result.result_, results.Allocate(name, dtype, shape));
  result.dtype_ = dtype;
  result.count_ = NumElements(shape);
  if (dtype == DType::kFloat32) {
    result.data_ = static_cast<float*>(result.result_);
  } else {
    ATTN_ASSIGN_OR_RETURN(result.scratch_,
                          Tensor::Allocate(DType::kFloat32, shape));
    result.data_ = result.scratch_.data_as<float>();
  }
  return result;
}

void Float32Result::Finish() {
  if (dtype_ != DType::kFloat32) StoreFloat32(data_, count_, dtype_, result_);
}

}  // namespace attnserve
