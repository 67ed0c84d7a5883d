// Element types and the one table of what every format calls them: bytes per
// element, attnserve's own name, the wire enum's number, the Open Inference
// Protocol's datatype, the safetensors dtype and the numpy dtype. Every codec
// looks names up here, so that a new dtype is one new row.
//
// INT8 is a session cache's dtype only (one float32 scale per cached row):
// no operation takes or returns INT8 tensors, and the codecs refuse them.
//
// Thread-safety: constants and pure functions.
#ifndef ATTNSERVE_CORE_DTYPE_H_
#define ATTNSERVE_CORE_DTYPE_H_

#include <cstddef>
#include <iterator>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace attnserve {

enum class DType { kFloat32, kBFloat16, kFloat16, kBool, kUInt8, kInt8 };

// One row of the dtype table.
struct DTypeInfo {
  DType dtype;
  // Bytes per element.
  size_t size;
  // attnserve's name, in messages and attnctl's output: "FLOAT32".
  absl::string_view name;
  // The attnserve.v1.DataType number (proto/tensor_codec.cc checks it
  // against the generated enum).
  int wire;
  // The Open Inference Protocol's datatype: "FP32".
  absl::string_view protocol;
  // The safetensors header's dtype: "F32".
  absl::string_view safetensors;
  // numpy's dtype name: "float32".
  absl::string_view numpy;
  // Whether tensors (inputs, results, weights) may have it; INT8 is a
  // session cache's dtype only.
  bool tensor;
};

// Rows in DType order.
inline constexpr DTypeInfo kDTypes[] = {
    {DType::kFloat32, 4, "FLOAT32", 1, "FP32", "F32", "float32", true},
    {DType::kBFloat16, 2, "BFLOAT16", 2, "BF16", "BF16", "bfloat16", true},
    {DType::kFloat16, 2, "FLOAT16", 3, "FP16", "F16", "float16", true},
    {DType::kBool, 1, "BOOL", 4, "BOOL", "BOOL", "bool", true},
    {DType::kUInt8, 1, "UINT8", 5, "UINT8", "U8", "uint8", true},
    {DType::kInt8, 1, "INT8", 6, "INT8", "I8", "int8", false},
};

constexpr bool DTypeTableInEnumOrder() {
  for (size_t i = 0; i < std::size(kDTypes); ++i) {
    if (static_cast<size_t>(kDTypes[i].dtype) != i) return false;
  }
  return true;
}
static_assert(DTypeTableInEnumOrder(), "kDTypes rows must follow DType");

// The row of `dtype`.
constexpr const DTypeInfo& DTypeInfoOf(DType dtype) {
  return kDTypes[static_cast<size_t>(dtype)];
}

// Bytes per element.
constexpr size_t DTypeSize(DType dtype) { return DTypeInfoOf(dtype).size; }
// attnserve's upper-case name, e.g. "FLOAT32".
constexpr absl::string_view DTypeName(DType dtype) {
  return DTypeInfoOf(dtype).name;
}
// True for the three floating-point types.
constexpr bool IsFloating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat16;
}

// A name column of the table, e.g. &DTypeInfo::protocol.
using DTypeColumn = absl::string_view DTypeInfo::*;

// The tensor dtype called `name` in `column` (case-sensitive), if any: the
// codecs' lookup, which finds no INT8 (a cache dtype only).
std::optional<DType> FindDType(DTypeColumn column, absl::string_view name);
// The dtype of wire number `wire`, if any (none for DATA_TYPE_UNSPECIFIED;
// INT8 too, which names a session's cache dtype on the wire).
std::optional<DType> FindDTypeByWire(int wire);

// Every tensor dtype's name in `column`, in table order, joined by ", " and
// by `last_separator` before the last: "FP32, BF16, FP16, BOOL or UINT8"
// with " or ". For the messages that list what a codec accepts (INT8, a
// cache dtype only, is not listed).
std::string DTypeNameList(DTypeColumn column,
                          absl::string_view last_separator = ", ");

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_DTYPE_H_
