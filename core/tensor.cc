#include "core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/buffer_pool.h"
#include "core/status_macros.h"

namespace attnserve {

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<int64_t> CheckedNumElements(absl::Span<const int64_t> shape,
                                           DType dtype,
                                           absl::string_view field) {
  int64_t count = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": dim ", i, " is negative (", shape[i],
                       ") in shape ", ShapeString(shape)));
    }
  }
  // The nonzero dims must not overflow even when a zero dim empties the
  // tensor: the operations multiply subsets of the dims (rows, batches).
  const int64_t limit = std::numeric_limits<int64_t>::max() /
                        static_cast<int64_t>(DTypeSize(dtype));
  bool empty = false;
  for (int64_t d : shape) {
    if (d == 0) {
      empty = true;
      continue;
    }
    // count * d <= limit, without a division per dim.
    int64_t product = 0;
    if (__builtin_mul_overflow(count, d, &product) || product > limit) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": shape ", ShapeString(shape), " overflows 64-bit size"));
    }
    count = product;
  }
  return empty ? 0 : count;
}

int64_t NumElements(absl::Span<const int64_t> shape) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  return count;
}

void Tensor::PoolDeleter::operator()(void* p) const {
  BufferPool::Global().Release(p, capacity);
}

absl::StatusOr<size_t> VerifyTensorBytes(DType dtype,
                                         absl::Span<const int64_t> shape,
                                         absl::string_view field) {
  ATTN_ASSIGN_OR_RETURN(const int64_t count,
                        CheckedNumElements(shape, dtype, field));
  const size_t bytes = static_cast<size_t>(count) * DTypeSize(dtype);
  if (bytes > kMaxTensorBytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a ", DTypeName(dtype), " tensor of shape ", ShapeString(shape),
        " needs ", bytes, " bytes, above the limit of ", kMaxTensorBytes,
        " bytes per tensor"));
  }
  return bytes;
}

absl::StatusOr<Tensor> Tensor::Allocate(DType dtype, Shape shape) {
  ATTN_ASSIGN_OR_RETURN(const size_t bytes,
                        VerifyTensorBytes(dtype, shape, "tensor"));
  size_t capacity = 0;
  void* p = BufferPool::Global().Acquire(bytes, &capacity);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate ", bytes, " bytes for a ", DTypeName(dtype),
        " tensor of shape ", ShapeString(shape)));
  }
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.data_ = std::unique_ptr<void, PoolDeleter>(p, PoolDeleter{capacity});
  return t;
}

absl::StatusOr<Tensor> Tensor::Zeros(DType dtype, Shape shape) {
  auto t = Allocate(dtype, std::move(shape));
  if (t.ok()) std::memset(t->data(), 0, t->num_bytes());
  return t;
}

}  // namespace attnserve
