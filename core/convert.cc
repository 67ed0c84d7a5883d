#include "core/convert.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace attnserve {

float Float16ToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // subnormal
  } else if (exponent == 0x1f) {
    magnitude = mantissa == 0 ? INFINITY : NAN;
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u),
                           static_cast<int>(exponent) - 25);
  }
  uint32_t out;
  std::memcpy(&out, &magnitude, sizeof(out));
  out |= sign;
  float f;
  std::memcpy(&f, &out, sizeof(f));
  return f;
}

uint16_t FloatToFloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs_bits >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf
  float abs_value;
  std::memcpy(&abs_value, &abs_bits, sizeof(abs_value));
  if (abs_bits < 0x38800000u) {
    // Subnormal half: a multiple of 2^-24, rounded to nearest even.
    const float scaled = abs_value * 16777216.0f;  // 2^24
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  // Normal half: drop 13 mantissa bits with round-to-nearest-even.
  const uint32_t rounding = 0xfffu + ((abs_bits >> 13) & 1u);
  const uint32_t rebased = abs_bits - (112u << 23) + rounding;
  return sign | static_cast<uint16_t>(rebased >> 13);
}

absl::StatusOr<Float32Data> Float32Data::From(const TensorView& view,
                                              absl::string_view field) {
  Float32Data result;
  const int64_t count = view.num_elements();
  switch (view.dtype) {
    case DType::kFloat32:
      result.data_ = view.data_as<float>();
      return result;
    case DType::kBFloat16:
    case DType::kFloat16: {
      ATTN_ASSIGN_OR_RETURN(Tensor owned,
                            Tensor::Allocate(DType::kFloat32, view.shape));
      float* out = owned.data_as<float>();
      const uint16_t* in = view.data_as<uint16_t>();
      if (view.dtype == DType::kBFloat16) {
        for (int64_t i = 0; i < count; ++i) out[i] = BFloat16ToFloat(in[i]);
      } else {
        for (int64_t i = 0; i < count; ++i) out[i] = Float16ToFloat(in[i]);
      }
      result.owned_ = std::move(owned);
      result.data_ = result.owned_.data_as<float>();
      return result;
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": dtype ", DTypeName(view.dtype),
                       " is not a floating-point type"));
  }
}

absl::StatusOr<OperandData> OperandData::From(const TensorView& view,
                                              DType target,
                                              absl::string_view field) {
  OperandData result;
  if (view.dtype == target) {
    result.data_ = view.data;
    return result;
  }
  ATTN_ASSIGN_OR_RETURN(const Float32Data widened,
                        Float32Data::From(view, field));
  ATTN_ASSIGN_OR_RETURN(result.owned_,
                        Float32ToTensor(widened.data(), view.shape, target));
  result.data_ = result.owned_.data();
  return result;
}

void StoreFloat32(const float* values, int64_t count, DType dtype, void* out) {
  switch (dtype) {
    case DType::kBFloat16: {
      uint16_t* dst = static_cast<uint16_t*>(out);
      for (int64_t i = 0; i < count; ++i) dst[i] = FloatToBFloat16(values[i]);
      return;
    }
    case DType::kFloat16: {
      uint16_t* dst = static_cast<uint16_t*>(out);
      for (int64_t i = 0; i < count; ++i) dst[i] = FloatToFloat16(values[i]);
      return;
    }
    default:
      if (count > 0) std::memcpy(out, values, count * sizeof(float));
      return;
  }
}

absl::StatusOr<Tensor> Float32ToTensor(const float* values, Shape shape,
                                       DType dtype) {
  auto tensor = Tensor::Allocate(dtype, std::move(shape));
  if (!tensor.ok()) return tensor.status();
  StoreFloat32(values, tensor->num_elements(), dtype, tensor->data());
  return tensor;
}

}  // namespace attnserve
