// Conversions between the floating-point element types. The core computes in
// float32; BFLOAT16 and FLOAT16 tensors are widened on the way in and rounded
// to nearest-even on the way out.
//
// Thread-safety: free functions without shared state.
#ifndef ATTNSERVE_CORE_CONVERT_H_
#define ATTNSERVE_CORE_CONVERT_H_

#include <cstdint>
#include <cstring>

#include "absl/status/statusor.h"
#include "core/tensor.h"

namespace attnserve {

inline float BFloat16ToFloat(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

inline uint16_t FloatToBFloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  }
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float Float16ToFloat(uint16_t bits);
uint16_t FloatToFloat16(float f);

// Float32 elements of a floating-point view: the view's own bytes when it is
// FLOAT32, otherwise a widened copy that this object owns. Move-only.
class Float32Data {
 public:
  // Fails with INVALID_ARGUMENT naming `field` if the view is not floating.
  static absl::StatusOr<Float32Data> From(const TensorView& view,
                                          absl::string_view field);
  const float* data() const { return data_; }

 private:
  const float* data_ = nullptr;
  Tensor owned_;
};

// Elements of a floating-point view in FLOAT32 or BFLOAT16: the view's own
// bytes when it already has that dtype, otherwise a converted copy that this
// object owns. Move-only.
class OperandData {
 public:
  // Fails with INVALID_ARGUMENT naming `field` if the view is not floating.
  static absl::StatusOr<OperandData> From(const TensorView& view, DType target,
                                          absl::string_view field);
  const void* data() const { return data_; }

 private:
  const void* data_ = nullptr;
  Tensor owned_;
};

// Copies `count` float32 values into `out`, converting to `out`'s dtype
// (FLOAT32, BFLOAT16 or FLOAT16).
void StoreFloat32(const float* values, int64_t count, DType dtype, void* out);

// A tensor of `dtype` and `shape` holding `values` (float32, row-major).
absl::StatusOr<Tensor> Float32ToTensor(const float* values, Shape shape,
                                       DType dtype);

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_CONVERT_H_
