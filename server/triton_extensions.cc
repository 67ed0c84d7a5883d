#include "server/triton_extensions.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "core/verify.h"
#include "server/handlers.h"
#include "server/open_inference.h"

namespace attnserve {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using json = nlohmann::json;

// attnserve serves one repository: it may be named by its path, or not at
// all.
absl::Status VerifyRepositoryName(absl::string_view name,
                                  const ModelRepository* models) {
  if (name.empty() || (models != nullptr && name == models->root())) {
    return absl::OkStatus();
  }
  return absl::NotFoundError(
      absl::StrCat("repository_name: ", EchoString(name),
                   " is not this server's repository; send an empty name",
                   models != nullptr && !models->root().empty()
                       ? absl::StrCat(" or '", models->root(), "'")
                       : ""));
}

absl::Status NoRepository() {
  return absl::FailedPreconditionError(absl::StrCat(
      "model_name: this server has no --model_repository; its models are "
      "the built-in ",
      absl::StrJoin(BuiltInModels(), ", ")));
}

// Parameters a load or unload request may carry: only Triton's
// unload_dependents (attnserve's models depend on none).
absl::Status VerifyRepositoryParameters(
    const google::protobuf::Map<
        std::string, inference::ModelRepositoryParameter>& parameters,
    bool unload) {
  for (const auto& [name, parameter] : parameters) {
    if (unload && name == "unload_dependents") continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "parameters: ", EchoString(name), " is not accepted; attnserve ",
        unload ? "unloads a model by its name alone"
               : "loads models only from their folder in --model_repository "
                 "(no config or file overrides)"));
  }
  return absl::OkStatus();
}

json FieldValue(const Message& message, const FieldDescriptor& field,
                int index) {
  const Reflection* reflection = message.GetReflection();
  const bool repeated = field.is_repeated();
#define ATTN_FIELD(getter)                                            \
  (repeated ? reflection->GetRepeated##getter(message, &field, index) \
            : reflection->Get##getter(message, &field))
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return ATTN_FIELD(Int32);
    case FieldDescriptor::CPPTYPE_INT64:
      return ATTN_FIELD(Int64);
    case FieldDescriptor::CPPTYPE_UINT32:
      return ATTN_FIELD(UInt32);
    case FieldDescriptor::CPPTYPE_UINT64:
      return ATTN_FIELD(UInt64);
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return ATTN_FIELD(Double);
    case FieldDescriptor::CPPTYPE_FLOAT:
      return ATTN_FIELD(Float);
    case FieldDescriptor::CPPTYPE_BOOL:
      return ATTN_FIELD(Bool);
    case FieldDescriptor::CPPTYPE_ENUM:
      return ATTN_FIELD(Enum)->name();
    case FieldDescriptor::CPPTYPE_STRING:
      return ATTN_FIELD(String);
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return MessageToJson(ATTN_FIELD(Message));
  }
#undef ATTN_FIELD
  return nullptr;
}

// Load and unload name folders: a served model's sequences model comes and
// goes with it.
absl::Status VerifyNotSequenceModel(const std::string& name,
                                    const ModelRepository* models) {
  const absl::StatusOr<ProtocolModel> model =
      FindProtocolModel(name, models, "model_name");
  if (!model.ok() || !model->served_sequences()) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "model_name: ", EchoString(name), " is the sequences of model ",
      EchoString(model->served->name), ", which loads and unloads it"));
}

}  // namespace

json MessageToJson(const Message& message) {
  json out = json::object();
  const google::protobuf::Descriptor* descriptor = message.GetDescriptor();
  const Reflection* reflection = message.GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    if (field->real_containing_oneof() != nullptr &&
        !reflection->HasField(message, field)) {
      continue;
    }
    if (field->is_map()) {
      // Map entries: key and value, the key's text as the JSON key.
      json map = json::object();
      for (int j = 0; j < reflection->FieldSize(message, field); ++j) {
        const Message& entry =
            reflection->GetRepeatedMessage(message, field, j);
        const FieldDescriptor* key = entry.GetDescriptor()->map_key();
        const FieldDescriptor* value = entry.GetDescriptor()->map_value();
        json key_json = FieldValue(entry, *key, 0);
        map[key_json.is_string() ? key_json.get<std::string>()
                                 : key_json.dump()] =
            FieldValue(entry, *value, 0);
      }
      out[field->name()] = std::move(map);
    } else if (field->is_repeated()) {
      json list = json::array();
      for (int j = 0; j < reflection->FieldSize(message, field); ++j) {
        list.push_back(FieldValue(message, *field, j));
      }
      out[field->name()] = std::move(list);
    } else {
      out[field->name()] = FieldValue(message, *field, 0);
    }
  }
  return out;
}

absl::Status HandleRepositoryIndex(
    const inference::RepositoryIndexRequest& request,
    const ModelRepository* models,
    inference::RepositoryIndexResponse* response) {
  ATTN_RETURN_IF_ERROR(VerifyRepositoryName(request.repository_name(), models));
  // Served models whose folder has gone stay served until a reload; every
  // folder is listed with its sequences model, loaded or not (the index
  // lists the repository's models whatever their state, as Triton's does).
  std::vector<std::string> names = ProtocolModelNames(models);
  if (models != nullptr) {
    for (std::string& folder : models->Folders()) {
      names.push_back(absl::StrCat(folder, kSequenceModelSuffix));
      names.push_back(std::move(folder));
    }
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  for (const std::string& name : names) {
    const bool ready = FindProtocolModel(name, models, "name").ok();
    if (request.ready() && !ready) continue;
    auto* entry = response->add_models();
    entry->set_name(name);
    if (ready) {
      entry->set_version("1");
      entry->set_state("READY");
    } else {
      entry->set_state("UNAVAILABLE");
      entry->set_reason("unloaded");
    }
  }
  return absl::OkStatus();
}

absl::Status HandleRepositoryModelLoad(
    const inference::RepositoryModelLoadRequest& request,
    ModelRepository* models) {
  ATTN_RETURN_IF_ERROR(VerifyRepositoryName(request.repository_name(), models));
  ATTN_RETURN_IF_ERROR(VerifyRepositoryParameters(request.parameters(),
                                                  /*unload=*/false));
  const std::string& name = request.model_name();
  if (name.empty()) return absl::InvalidArgumentError("model_name: missing");
  ATTN_RETURN_IF_ERROR(VerifyNotSequenceModel(name, models));
  // Built-in models are always loaded.
  if (IsBuiltInModel(name)) return absl::OkStatus();
  if (models == nullptr) return NoRepository();
  return models->LoadOne(name);
}

absl::Status HandleRepositoryModelUnload(
    const inference::RepositoryModelUnloadRequest& request,
    ModelRepository* models) {
  ATTN_RETURN_IF_ERROR(VerifyRepositoryName(request.repository_name(), models));
  ATTN_RETURN_IF_ERROR(VerifyRepositoryParameters(request.parameters(),
                                                  /*unload=*/true));
  const std::string& name = request.model_name();
  if (name.empty()) return absl::InvalidArgumentError("model_name: missing");
  ATTN_RETURN_IF_ERROR(VerifyNotSequenceModel(name, models));
  if (IsBuiltInModel(name)) {
    return absl::FailedPreconditionError(
        absl::StrCat("model_name: ", EchoString(name),
                     " is built in and cannot be unloaded"));
  }
  if (models == nullptr) return NoRepository();
  return models->Unload(name);
}

absl::Status HandleSystemSharedMemoryRegister(
    const inference::SystemSharedMemoryRegisterRequest& request,
    SharedMemoryRegistry* registry) {
  v1::RegisterSharedMemoryRequest native;
  v1::SharedMemoryRegion* region = native.mutable_region();
  region->set_name(request.name());
  region->set_key(request.key());
  region->set_offset(request.offset());
  region->set_byte_size(request.byte_size());
  return HandleRegisterSharedMemory(native, registry);
}

absl::Status HandleSystemSharedMemoryUnregister(
    const inference::SystemSharedMemoryUnregisterRequest& request,
    SharedMemoryRegistry* registry) {
  v1::UnregisterSharedMemoryRequest native;
  native.set_name(request.name());
  const absl::Status status = HandleUnregisterSharedMemory(native, registry);
  return absl::IsNotFound(status) ? absl::OkStatus() : status;
}

absl::Status HandleSystemSharedMemoryStatus(
    const inference::SystemSharedMemoryStatusRequest& request,
    const SharedMemoryRegistry* registry,
    inference::SystemSharedMemoryStatusResponse* response) {
  v1::ListSharedMemoryRequest native_request;
  native_request.set_name(request.name());
  v1::ListSharedMemoryResponse native;
  ATTN_RETURN_IF_ERROR(
      HandleListSharedMemory(native_request, registry, &native));
  for (const v1::SharedMemoryRegion& region : native.regions()) {
    auto& status = (*response->mutable_regions())[region.name()];
    status.set_name(region.name());
    status.set_key(region.key());
    status.set_offset(region.offset());
    status.set_byte_size(region.byte_size());
  }
  return absl::OkStatus();
}

absl::Status HandleCudaSharedMemoryStatus(absl::string_view name) {
  if (name.empty()) return absl::OkStatus();
  return absl::NotFoundError(
      absl::StrCat("name: no CUDA shared memory region ", EchoString(name),
                   " is registered (attnserve computes on CPU and takes "
                   "system shared memory only)"));
}

absl::Status HandleCudaSharedMemoryRegister() {
  return absl::UnimplementedError(
      "CUDA shared memory is not supported: attnserve computes on CPU; "
      "register system shared memory instead");
}

}  // namespace attnserve
