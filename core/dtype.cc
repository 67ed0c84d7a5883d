#include "core/dtype.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace attnserve {

std::optional<DType> FindDType(DTypeColumn column, absl::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.tensor && info.*column == name) return info.dtype;
  }
  return std::nullopt;
}

std::optional<DType> FindDTypeByWire(int wire) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.wire == wire) return info.dtype;
  }
  return std::nullopt;
}

std::string DTypeNameList(DTypeColumn column,
                          absl::string_view last_separator) {
  std::vector<absl::string_view> names;
  for (const DTypeInfo& info : kDTypes) {
    if (info.tensor) names.push_back(info.*column);
  }
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) {
      absl::StrAppend(&out, i + 1 == names.size() ? last_separator : ", ");
    }
    absl::StrAppend(&out, names[i]);
  }
  return out;
}

}  // namespace attnserve
