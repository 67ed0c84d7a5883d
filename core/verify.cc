#include "core/verify.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnserve {

absl::Status VerifyDType(const TensorView& t, absl::string_view field,
                         std::initializer_list<DType> allowed) {
  for (DType d : allowed) {
    if (t.dtype == d) return absl::OkStatus();
  }
  std::vector<absl::string_view> names;
  for (DType d : allowed) names.push_back(DTypeName(d));
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": dtype ", DTypeName(t.dtype),
                   " not supported, expected ", absl::StrJoin(names, " or ")));
}

absl::Status VerifyFloating(const TensorView& t, absl::string_view field) {
  return VerifyDType(t, field,
                     {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
}

absl::Status VerifyMask(const TensorView& t, absl::string_view field) {
  if (absl::Status s =
          VerifyDType(t, field, {DType::kBool, DType::kUInt8, DType::kFloat32});
      !s.ok()) {
    return s;
  }
  if (t.dtype != DType::kFloat32) return absl::OkStatus();
  const float* values = t.data_as<float>();
  const int64_t count = t.num_elements();
  for (int64_t i = 0; i < count; ++i) {
    const float v = values[i];
    if (!std::isfinite(v) && !(std::isinf(v) && v < 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": FLOAT32 mask values must be finite or -inf, found ", v,
          " at flat index ", i));
    }
  }
  return absl::OkStatus();
}

absl::Status VerifyRank(const TensorView& t, absl::string_view field,
                        int64_t min_rank, int64_t max_rank) {
  if (t.rank() >= min_rank && t.rank() <= max_rank) return absl::OkStatus();
  const std::string expected = min_rank == max_rank ? absl::StrCat(min_rank)
                               : max_rank > 64
                                   ? absl::StrCat(">= ", min_rank)
                                   : absl::StrCat(min_rank, " to ", max_rank);
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": rank ", t.rank(), " (shape ", ShapeString(t.shape),
                   "), expected rank ", expected));
}

absl::Status VerifyDim(const TensorView& t, absl::string_view field,
                       int64_t axis, int64_t expected, absl::string_view what) {
  const int64_t actual = t.dim(axis);
  if (actual == expected) return absl::OkStatus();
  std::string name;
  if (axis == -1) {
    name = "last dim";
  } else if (axis < 0) {
    name = absl::StrCat("dim ", t.rank() + axis);
  } else {
    name = absl::StrCat("dim ", axis);
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", name, " ", actual,
                                                 " != ", what, " ", expected));
}

absl::Status VerifyShape(const TensorView& t, absl::string_view field,
                         absl::Span<const int64_t> expected) {
  if (absl::Span<const int64_t>(t.shape) == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": shape ", ShapeString(t.shape), ", expected ",
                   ShapeString(expected)));
}

absl::Status VerifyPositiveFinite(float value, absl::string_view field) {
  if (std::isfinite(value) && value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": must be finite and > 0, got ", value));
}

absl::Status VerifyFinite(float value, absl::string_view field) {
  if (std::isfinite(value)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": must be finite, got ", value));
}

absl::Status VerifyKvHeads(int num_heads, int num_kv_heads) {
  const int kv_heads = num_kv_heads == 0 ? num_heads : num_kv_heads;
  if (kv_heads > 0 && num_heads % kv_heads == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("num_kv_heads: ", num_kv_heads,
                                                 " does not divide num_heads ",
                                                 num_heads));
}

}  // namespace attnserve
