#include "server/http_extensions.h"

#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/status_macros.h"
#include "inference/grpc_service.pb.h"
#include "nlohmann/json.hpp"
#include "server/http_status.h"
#include "server/model_config.h"
#include "server/open_inference_json.h"
#include "server/runtime_settings.h"
#include "server/triton_extensions.h"

namespace attnserve {
namespace {

using json = nlohmann::json;
using Kind = ExtensionRoute::Kind;

HttpResponse JsonAnswer(const json& body) {
  HttpResponse response;
  response.fields.emplace_back("Content-Type", "application/json");
  response.body = body.dump(-1, ' ', false, json::error_handler_t::replace);
  return response;
}

// The body as a JSON object; an empty body is an empty object.
absl::StatusOr<json> BodyObject(absl::string_view body) {
  if (body.find_first_not_of(" \t\r\n") == absl::string_view::npos) {
    return json::object();
  }
  if (absl::Status depth = VerifyJsonDepth(body); !depth.ok()) return depth;
  json parsed = json::parse(body.begin(), body.end(), nullptr,
                            /*allow_exceptions=*/false);
  if (parsed.is_discarded() || !parsed.is_object()) {
    return absl::InvalidArgumentError("body: expected a JSON object");
  }
  return parsed;
}

// A member that must be a non-negative integer; `fallback` when absent.
absl::StatusOr<uint64_t> Unsigned(const json& object, const char* name,
                                  std::optional<uint64_t> fallback) {
  const auto it = object.find(name);
  if (it == object.end()) {
    if (fallback.has_value()) return *fallback;
    return absl::InvalidArgumentError(absl::StrCat(name, ": missing"));
  }
  if (it->is_number_unsigned()) return it->get<uint64_t>();
  return absl::InvalidArgumentError(
      absl::StrCat(name, ": expected a non-negative integer"));
}

// {"parameters": {...}} of a load or unload body, as the gRPC message's.
absl::Status RepositoryParameters(
    const json& body,
    google::protobuf::Map<std::string, inference::ModelRepositoryParameter>*
        out) {
  const auto it = body.find("parameters");
  if (it == body.end()) return absl::OkStatus();
  if (!it->is_object()) {
    return absl::InvalidArgumentError("parameters: expected a JSON object");
  }
  for (const auto& [name, value] : it->items()) {
    inference::ModelRepositoryParameter& parameter = (*out)[name];
    if (value.is_boolean()) {
      parameter.set_bool_param(value.get<bool>());
    } else if (value.is_number_integer()) {
      parameter.set_int64_param(value.get<int64_t>());
    } else if (value.is_string()) {
      parameter.set_string_param(value.get<std::string>());
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("parameters: ", name.substr(0, 128),
                       " must be a bool, an integer or a string"));
    }
  }
  return absl::OkStatus();
}

// Model configuration and statistics.
absl::StatusOr<json> AnswerModel(const ExtensionRoute& route,
                                 const CallPipeline& pipeline) {
  if (route.kind == Kind::kModelConfig) {
    inference::ModelConfigRequest request;
    request.set_name(route.model);
    request.set_version(route.version);
    inference::ModelConfigResponse response;
    ATTN_RETURN_IF_ERROR(
        HandleModelConfig(request, pipeline.sequences(), &response));
    return MessageToJson(response.config());
  }
  inference::ModelStatisticsRequest request;
  request.set_name(route.model);
  request.set_version(route.version);
  inference::ModelStatisticsResponse response;
  ATTN_RETURN_IF_ERROR(pipeline.statistics().Handle(request, &response));
  return MessageToJson(response);
}

// The repository's index, load and unload.
absl::StatusOr<json> AnswerRepository(const ExtensionRoute& route,
                                      absl::string_view body,
                                      const ServiceConfig& config) {
  ATTN_ASSIGN_OR_RETURN(const json parsed, BodyObject(body));
  if (route.kind == Kind::kRepositoryIndex) {
    inference::RepositoryIndexRequest request;
    if (const auto ready = parsed.find("ready"); ready != parsed.end()) {
      if (!ready->is_boolean()) {
        return absl::InvalidArgumentError("ready: expected true or false");
      }
      request.set_ready(ready->get<bool>());
    }
    inference::RepositoryIndexResponse response;
    ATTN_RETURN_IF_ERROR(
        HandleRepositoryIndex(request, config.models, &response));
    json list = json::array();
    for (const auto& model : response.models()) {
      json entry = {{"name", model.name()},
                    {"state", model.state()},
                    {"reason", model.reason()}};
      if (!model.version().empty()) entry["version"] = model.version();
      list.push_back(std::move(entry));
    }
    return list;
  }
  if (route.kind == Kind::kRepositoryLoad) {
    inference::RepositoryModelLoadRequest request;
    request.set_model_name(route.model);
    ATTN_RETURN_IF_ERROR(
        RepositoryParameters(parsed, request.mutable_parameters()));
    ATTN_RETURN_IF_ERROR(HandleRepositoryModelLoad(request, config.repository));
    return json::object();
  }
  inference::RepositoryModelUnloadRequest request;
  request.set_model_name(route.model);
  ATTN_RETURN_IF_ERROR(
      RepositoryParameters(parsed, request.mutable_parameters()));
  ATTN_RETURN_IF_ERROR(HandleRepositoryModelUnload(request, config.repository));
  return json::object();
}

// System shared memory: status, register, unregister.
// CUDA shared memory as a Triton without GPUs answers it: no regions.
absl::StatusOr<json> AnswerCudaSharedMemory(const ExtensionRoute& route) {
  switch (route.kind) {
    case Kind::kSharedMemoryStatus:
      ATTN_RETURN_IF_ERROR(HandleCudaSharedMemoryStatus(route.region));
      return json::array();
    case Kind::kSharedMemoryUnregister:
      return json::object();
    default:
      return HandleCudaSharedMemoryRegister();
  }
}

absl::StatusOr<json> AnswerSharedMemory(const ExtensionRoute& route,
                                        absl::string_view body,
                                        SharedMemoryRegistry* registry) {
  if (route.kind == Kind::kSharedMemoryStatus) {
    inference::SystemSharedMemoryStatusRequest request;
    request.set_name(route.region);
    inference::SystemSharedMemoryStatusResponse response;
    ATTN_RETURN_IF_ERROR(
        HandleSystemSharedMemoryStatus(request, registry, &response));
    // Sorted by name, as the registry lists them (the map is unordered).
    std::vector<json> regions;
    for (const auto& [name, region] : response.regions()) {
      regions.push_back(MessageToJson(region));
    }
    std::sort(regions.begin(), regions.end(), [](const json& a, const json& b) {
      return a["name"] < b["name"];
    });
    return json(regions);
  }
  if (route.kind == Kind::kSharedMemoryUnregister) {
    inference::SystemSharedMemoryUnregisterRequest request;
    request.set_name(route.region);
    ATTN_RETURN_IF_ERROR(HandleSystemSharedMemoryUnregister(request, registry));
    return json::object();
  }
  ATTN_ASSIGN_OR_RETURN(const json parsed, BodyObject(body));
  inference::SystemSharedMemoryRegisterRequest request;
  request.set_name(route.region);
  const auto key = parsed.find("key");
  if (key == parsed.end() || !key->is_string()) {
    return absl::InvalidArgumentError(
        "key: expected the shared-memory object's key as a string, e.g. "
        "\"/input_data\"");
  }
  request.set_key(key->get<std::string>());
  ATTN_ASSIGN_OR_RETURN(const uint64_t offset, Unsigned(parsed, "offset", 0));
  ATTN_ASSIGN_OR_RETURN(const uint64_t byte_size,
                        Unsigned(parsed, "byte_size", std::nullopt));
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  ATTN_RETURN_IF_ERROR(HandleSystemSharedMemoryRegister(request, registry));
  return json::object();
}

// Trace and log settings: the body's settings applied (none for a GET),
// then all of them.
absl::StatusOr<json> AnswerSettings(const ExtensionRoute& route,
                                    absl::string_view body,
                                    const CallPipeline& pipeline) {
  ATTN_ASSIGN_OR_RETURN(const json parsed, BodyObject(body));
  if (route.kind == Kind::kLogSettings) {
    inference::LogSettingsRequest request;
    ATTN_RETURN_IF_ERROR(LogSettingsFromJson(parsed, &request));
    inference::LogSettingsResponse response;
    ATTN_RETURN_IF_ERROR(pipeline.log_settings()->Handle(request, &response));
    return LogSettingsToJson(response);
  }
  inference::TraceSettingRequest request;
  request.set_model_name(route.model);
  ATTN_RETURN_IF_ERROR(TraceSettingsFromJson(parsed, &request));
  inference::TraceSettingResponse response;
  ATTN_RETURN_IF_ERROR(pipeline.trace_settings()->Handle(request, &response));
  return TraceSettingsToJson(response);
}

absl::StatusOr<json> Answer(const ExtensionRoute& route, absl::string_view body,
                            const CallPipeline& pipeline) {
  switch (route.kind) {
    case Kind::kModelConfig:
    case Kind::kModelStatistics:
      return AnswerModel(route, pipeline);
    case Kind::kRepositoryIndex:
    case Kind::kRepositoryLoad:
    case Kind::kRepositoryUnload:
      return AnswerRepository(route, body, pipeline.config());
    case Kind::kSharedMemoryStatus:
    case Kind::kSharedMemoryRegister:
    case Kind::kSharedMemoryUnregister:
      if (route.cuda) return AnswerCudaSharedMemory(route);
      return AnswerSharedMemory(route, body, pipeline.config().shared_memory);
    case Kind::kTraceSetting:
    case Kind::kLogSettings:
      return AnswerSettings(route, body, pipeline);
  }
  return absl::InternalError("unknown extension route");
}

// /v2/{shm}[/region/{r}]/{action}: the region and the action.
std::optional<ExtensionRoute> SharedMemoryRoute(absl::string_view rest,
                                                bool cuda) {
  std::vector<absl::string_view> parts = absl::StrSplit(rest, '/');
  ExtensionRoute route{};
  absl::string_view action;
  if (parts.size() == 1) {
    action = parts[0];
  } else if (parts.size() == 3 && parts[0] == "region" && !parts[1].empty()) {
    route.region = std::string(parts[1]);
    action = parts[2];
  } else {
    return std::nullopt;
  }
  if (action == "status") {
    route.kind = Kind::kSharedMemoryStatus;
  } else if (action == "register" && !route.region.empty()) {
    route.kind = Kind::kSharedMemoryRegister;
    route.post = true;
  } else if (action == "unregister") {
    route.kind = Kind::kSharedMemoryUnregister;
    route.post = true;
  } else {
    return std::nullopt;
  }
  route.cuda = cuda;
  return route;
}

}  // namespace

std::optional<ExtensionRoute> ExtensionRouteOf(absl::string_view path) {
  ExtensionRoute route{};
  if (path == "/v2/models/stats") {
    route.kind = Kind::kModelStatistics;
    return route;
  }
  if (path == "/v2/trace/setting" || path == "/v2/logging") {
    route.kind =
        path == "/v2/logging" ? Kind::kLogSettings : Kind::kTraceSetting;
    route.get_or_post = true;
    return route;
  }
  if (path == "/v2/repository/index") {
    route.kind = Kind::kRepositoryIndex;
    route.post = true;
    return route;
  }
  if (absl::ConsumePrefix(&path, "/v2/systemsharedmemory/")) {
    return SharedMemoryRoute(path, /*cuda=*/false);
  }
  if (absl::ConsumePrefix(&path, "/v2/cudasharedmemory/")) {
    return SharedMemoryRoute(path, /*cuda=*/true);
  }
  if (absl::ConsumePrefix(&path, "/v2/repository/models/")) {
    std::vector<absl::string_view> parts = absl::StrSplit(path, '/');
    if (parts.size() != 2 || parts[0].empty()) return std::nullopt;
    route.model = std::string(parts[0]);
    route.post = true;
    if (parts[1] == "load") {
      route.kind = Kind::kRepositoryLoad;
    } else if (parts[1] == "unload") {
      route.kind = Kind::kRepositoryUnload;
    } else {
      return std::nullopt;
    }
    return route;
  }
  if (absl::ConsumePrefix(&path, "/v2/models/")) {
    std::vector<absl::string_view> parts = absl::StrSplit(path, '/');
    if (parts.size() < 2 || parts[0].empty()) return std::nullopt;
    route.model = std::string(parts[0]);
    if (parts.size() == 3 && parts[1] == "trace" && parts[2] == "setting") {
      route.kind = Kind::kTraceSetting;
      route.get_or_post = true;
      return route;
    }
    size_t next = 1;
    if (parts.size() == 4 && parts[1] == "versions" && !parts[2].empty()) {
      route.version = std::string(parts[2]);
      next = 3;
    }
    if (parts.size() != next + 1) return std::nullopt;
    if (parts[next] == "config") {
      route.kind = Kind::kModelConfig;
    } else if (parts[next] == "stats") {
      route.kind = Kind::kModelStatistics;
    } else {
      return std::nullopt;
    }
    return route;
  }
  return std::nullopt;
}

HttpResponse HandleExtension(const ExtensionRoute& route,
                             absl::string_view body,
                             const CallPipeline& pipeline) {
  absl::StatusOr<json> answer = Answer(route, body, pipeline);
  if (!answer.ok()) {
    // The shared-memory extension's errors are 400s ("typically 400").
    if (absl::IsUnimplemented(answer.status())) {
      return JsonErrorResponse(400, answer.status().message());
    }
    return StatusResponse(answer.status());
  }
  return JsonAnswer(*answer);
}

}  // namespace attnserve
