// Shapes and the two tensor types of the core: `TensorView`, a
// read-only view of bytes someone else owns, and `Tensor`, which owns an
// aligned buffer.
//
// Thread-safety: both are plain values. Concurrent reads are safe; writes to
// one object need external synchronization. A TensorView never outlives the
// bytes it points to: that is the caller's contract.
#ifndef ATTNSERVE_CORE_TENSOR_H_
#define ATTNSERVE_CORE_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/dtype.h"

namespace attnserve {

using Shape = std::vector<int64_t>;

// "[2, 3, 4]".
std::string ShapeString(absl::Span<const int64_t> shape);

// Product of the dims. Fails with INVALID_ARGUMENT naming `field` if a dim is
// negative or the product (or its size in bytes for `dtype`) overflows.
absl::StatusOr<int64_t> CheckedNumElements(absl::Span<const int64_t> shape,
                                           DType dtype,
                                           absl::string_view field);

// Product of the dims, for shapes already checked.
int64_t NumElements(absl::Span<const int64_t> shape);

// A read-only view: dtype, shape and a pointer to row-major, little-endian
// elements that the view does not own.
struct TensorView {
  DType dtype = DType::kFloat32;
  Shape shape;
  const void* data = nullptr;

  int64_t num_elements() const { return NumElements(shape); }
  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  // Dim `i`, counted from the end when negative.
  int64_t dim(int64_t i) const { return shape[i < 0 ? rank() + i : i]; }
  template <typename T>
  const T* data_as() const {
    return static_cast<const T*>(data);
  }
};

// The largest tensor the core allocates: a protobuf message cannot carry
// more, and refusing up front beats running the machine out of memory.
inline constexpr size_t kMaxTensorBytes = size_t{2} << 30;

// The bytes of a tensor of `dtype` and `shape`: INVALID_ARGUMENT naming
// `field` for negative or overflowing dims, RESOURCE_EXHAUSTED above
// kMaxTensorBytes.
absl::StatusOr<size_t> VerifyTensorBytes(DType dtype,
                                         absl::Span<const int64_t> shape,
                                         absl::string_view field);

// A tensor that owns a 64-byte aligned buffer from BufferPool::Global().
// Move-only.
class Tensor {
 public:
  Tensor() = default;
  // Allocates an uninitialized tensor. Fails with INVALID_ARGUMENT on bad
  // shapes and RESOURCE_EXHAUSTED above kMaxTensorBytes or when memory is
  // not available.
  static absl::StatusOr<Tensor> Allocate(DType dtype, Shape shape);
  // As Allocate, with every byte zero.
  static absl::StatusOr<Tensor> Zeros(DType dtype, Shape shape);

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t num_elements() const { return NumElements(shape_); }
  size_t num_bytes() const { return num_elements() * DTypeSize(dtype_); }
  void* data() { return data_.get(); }
  const void* data() const { return data_.get(); }
  template <typename T>
  T* data_as() {
    return static_cast<T*>(data());
  }
  template <typename T>
  const T* data_as() const {
    return static_cast<const T*>(data());
  }
  TensorView view() const { return TensorView{dtype_, shape_, data()}; }

 private:
  // Returns the buffer to the BufferPool it came from.
  struct PoolDeleter {
    size_t capacity;
    void operator()(void* p) const;
  };
  DType dtype_ = DType::kFloat32;
  Shape shape_;
  std::unique_ptr<void, PoolDeleter> data_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_TENSOR_H_
