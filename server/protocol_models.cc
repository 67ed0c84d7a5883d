#include "server/protocol_models.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "core/dtype.h"
#include "core/status_macros.h"
#include "core/verify.h"
#include "proto/tensor_codec.h"

namespace attnserve {

using inference::InferParameter;

absl::string_view ParameterKind(const InferParameter& parameter) {
  switch (parameter.parameter_choice_case()) {
    case InferParameter::kBoolParam:
      return "bool";
    case InferParameter::kInt64Param:
      return "int64";
    case InferParameter::kStringParam:
      return "string";
    case InferParameter::kDoubleParam:
      return "double";
    case InferParameter::kUint64Param:
      return "uint64";
    default:
      return "empty";
  }
}

bool IsBuiltInModel(absl::string_view model) {
  return FindOperation(model) != nullptr;
}

std::vector<std::string> BuiltInModels() {
  std::vector<std::string> names;
  for (const OperationSpec& operation : BuiltInOperations()) {
    names.emplace_back(operation.model);
  }
  return names;
}

absl::StatusOr<ProtocolModel> FindProtocolModel(const std::string& name,
                                                const ModelRepository* models,
                                                absl::string_view field) {
  ProtocolModel model;
  model.name = name;
  model.operation = FindOperation(name);
  if (model.operation != nullptr) return model;
  ATTN_RETURN_IF_ERROR(VerifyModelName(name, field));
  if (models != nullptr) {
    if (auto served = models->Find(name); served.ok()) {
      model.operation = FindOperation(kMultiHeadAttendModel);
      model.served = *std::move(served);
      return model;
    }
    absl::string_view base = name;
    if (absl::ConsumeSuffix(&base, kSequenceModelSuffix)) {
      if (auto served = models->Find(std::string(base)); served.ok()) {
        model.operation = FindOperation(kAttentionSessionModel);
        model.served = *std::move(served);
        return model;
      }
    }
  }
  return absl::NotFoundError(absl::StrCat(
      field, ": model ", EchoString(name), " is not served; served models: ",
      absl::StrJoin(ProtocolModelNames(models), ", "),
      models == nullptr ? " (no model repository)" : ""));
}

std::vector<std::string> ProtocolModelNames(const ModelRepository* models) {
  std::vector<std::string> names = BuiltInModels();
  if (models != nullptr) {
    for (const auto& model : models->List()) {
      names.push_back(model->name);
      names.push_back(absl::StrCat(model->name, kSequenceModelSuffix));
    }
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

absl::string_view ProtocolDatatype(v1::DataType dtype) {
  const std::optional<DType> found = FindDTypeByWire(dtype);
  return found.has_value() ? DTypeInfoOf(*found).protocol : "INVALID";
}

absl::StatusOr<v1::DataType> NativeDatatype(absl::string_view datatype,
                                            absl::string_view field) {
  if (const std::optional<DType> found =
          FindDType(&DTypeInfo::protocol, datatype)) {
    return DTypeToProto(*found);
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": datatype ", EchoString(datatype),
                   " is not supported; expected ",
                   DTypeNameList(&DTypeInfo::protocol, " or ")));
}

}  // namespace attnserve
