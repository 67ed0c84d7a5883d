// Where the core's operations put their results.
//
// An operation asks a ResultAllocator for each result's memory after it has
// validated its inputs and before it computes, then writes the result there
// directly: a server can hand out its response's own buffer, a benchmark a
// buffer it reuses. TensorResults is the allocator that makes Tensors.
//
// Ownership: memory handed out by an allocator belongs to the allocator's
// owner. Thread-safety: an allocator serves one operation at a time.
#ifndef ATTNSERVE_CORE_RESULTS_H_
#define ATTNSERVE_CORE_RESULTS_H_

#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/tensor.h"

namespace attnserve {

class ResultAllocator {
 public:
  virtual ~ResultAllocator() = default;
  // Memory for result `name` ("output" or "weights") of `dtype` and
  // `shape`: row-major, aligned to at least the element size, valid until
  // the operation returns. Results over kMaxTensorBytes are refused with
  // RESOURCE_EXHAUSTED before the allocator sees them; any error aborts the
  // operation with that status.
  absl::StatusOr<void*> Allocate(absl::string_view name, DType dtype,
                                 const Shape& shape);

 protected:
  // Called by Allocate with a shape whose size is known to be acceptable.
  virtual absl::StatusOr<void*> DoAllocate(absl::string_view name, DType dtype,
                                           const Shape& shape) = 0;
};

// Allocates each result as a Tensor and keeps it until taken.
class TensorResults : public ResultAllocator {
 public:
  // The result called `name`, if the operation produced it.
  std::optional<Tensor> Take(absl::string_view name);

 protected:
  absl::StatusOr<void*> DoAllocate(absl::string_view name, DType dtype,
                                   const Shape& shape) override;

 private:
  std::map<std::string, Tensor, std::less<>> tensors_;
};

// Memory a kernel writes a result of any floating dtype into: the result's
// own memory when the kernel can write that dtype (FLOAT32, and BFLOAT16
// when `bf16_ok`), otherwise a FLOAT32 scratch tensor that Finish() rounds
// into the result.
class ResultBuffer {
 public:
  static absl::StatusOr<ResultBuffer> Allocate(ResultAllocator& results,
                                               absl::string_view name,
                                               DType dtype, const Shape& shape,
                                               bool bf16_ok);
  void* data() { return data_; }
  float* f32() { return static_cast<float*>(data_); }
  // The dtype to write into data(): FLOAT32 or BFLOAT16.
  DType dtype() const { return kernel_dtype_; }
  // Writes scratch values into the result (no-op when written directly).
  void Finish();

 private:
  void* result_ = nullptr;
  DType result_dtype_ = DType::kFloat32;
  DType kernel_dtype_ = DType::kFloat32;
  int64_t count_ = 0;
  void* data_ = nullptr;
  Tensor scratch_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_RESULTS_H_
