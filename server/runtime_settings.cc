#include "server/runtime_settings.h"

#include <cstdint>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "core/verify.h"
#include "server/open_inference.h"

namespace attnserve {
namespace {

using json = nlohmann::json;
using LogValue = inference::LogSettingsRequest::SettingValue;

constexpr const char* kLogSettings[] = {"log_file",          "log_info",
                                        "log_warnings",      "log_errors",
                                        "log_verbose_level", "log_format"};

absl::StatusOr<bool> LogBool(const LogValue& value, absl::string_view name) {
  if (value.parameter_choice_case() != LogValue::kBoolParam) {
    return absl::InvalidArgumentError(
        absl::StrCat("settings: ", name, " must be a bool"));
  }
  return value.bool_param();
}

// A setting attnserve cannot change: accepted when it asks for what is.
absl::Status VerifyFixed(const LogValue& value, absl::string_view name,
                         const LogValue& current, absl::string_view why) {
  if (value.parameter_choice_case() != current.parameter_choice_case()) {
    const absl::string_view kind =
        current.parameter_choice_case() == LogValue::kBoolParam ? "a bool"
        : current.parameter_choice_case() == LogValue::kUint32Param
            ? "a uint32"
            : "a string";
    return absl::InvalidArgumentError(
        absl::StrCat("settings: ", name, " must be ", kind));
  }
  if (value.SerializeAsString() == current.SerializeAsString()) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("settings: ", name, ": ", why));
}

LogValue Bool(bool b) {
  LogValue value;
  value.set_bool_param(b);
  return value;
}

// The trace settings and their defaults.
const std::map<std::string, std::vector<std::string>>& TraceDefaults() {
  static const auto* defaults =
      new std::map<std::string, std::vector<std::string>>{
          {"trace_file", {""}},     {"trace_level", {"OFF"}},
          {"trace_rate", {"1000"}}, {"trace_count", {"-1"}},
          {"log_frequency", {"0"}}, {"trace_mode", {"triton"}}};
  return *defaults;
}

absl::Status VerifyInteger(const std::string& text, absl::string_view name,
                           int64_t least) {
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < least) {
    return absl::InvalidArgumentError(
        absl::StrCat("settings: ", name, ": expected an integer >= ", least,
                     ", got ", EchoString(text)));
  }
  return absl::OkStatus();
}

// One trace setting's new values (none: cleared).
absl::Status VerifyTraceSetting(const std::string& name,
                                const std::vector<std::string>& values) {
  if (TraceDefaults().count(name) == 0) {
    std::vector<std::string> names;
    for (const auto& [known, unused] : TraceDefaults()) names.push_back(known);
    return absl::InvalidArgumentError(
        absl::StrCat("settings: unknown trace setting ", EchoString(name),
                     "; expected one of ", absl::StrJoin(names, ", ")));
  }
  if (values.empty()) return absl::OkStatus();
  if (name == "trace_level") {
    for (const std::string& level : values) {
      if (level != "OFF") {
        return absl::InvalidArgumentError(absl::StrCat(
            "settings: trace_level: attnserve does not trace requests; only "
            "OFF is accepted, got ",
            EchoString(level)));
      }
    }
    return absl::OkStatus();
  }
  if (values.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "settings: ", name, " takes one value, got ", values.size()));
  }
  if (name == "trace_rate") return VerifyInteger(values[0], name, 1);
  if (name == "trace_count") return VerifyInteger(values[0], name, -1);
  if (name == "log_frequency") return VerifyInteger(values[0], name, 0);
  if (name == "trace_mode" && values[0] != "triton") {
    return absl::InvalidArgumentError(
        absl::StrCat("settings: trace_mode: only 'triton' is accepted, got ",
                     EchoString(values[0])));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LogSettings::Handle(const inference::LogSettingsRequest& request,
                                 inference::LogSettingsResponse* response) {
  std::optional<bool> info;
  const auto fixed = [](uint32_t level) {
    LogValue value;
    value.set_uint32_param(level);
    return value;
  };
  LogValue empty;
  empty.set_string_param("");
  LogValue format;
  format.set_string_param("default");
  for (const auto& [name, value] : request.settings()) {
    if (name == "log_info") {
      ATTN_ASSIGN_OR_RETURN(info, LogBool(value, name));
    } else if (name == "log_warnings" || name == "log_errors") {
      ATTN_RETURN_IF_ERROR(VerifyFixed(
          value, name, Bool(name == "log_warnings" ? warnings_ : errors_),
          "set by --log_level when the server starts; it cannot change "
          "while the server runs"));
    } else if (name == "log_verbose_level") {
      ATTN_RETURN_IF_ERROR(VerifyFixed(value, name, fixed(0),
                                       "attnserve has no verbose log; only 0"));
    } else if (name == "log_file") {
      ATTN_RETURN_IF_ERROR(VerifyFixed(
          value, name, empty, "attnserve logs to stderr only; only \"\""));
    } else if (name == "log_format") {
      ATTN_RETURN_IF_ERROR(
          VerifyFixed(value, name, format, "only \"default\" is available"));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "settings: unknown log setting ", EchoString(name),
          "; expected one of ", absl::StrJoin(kLogSettings, ", ")));
    }
  }
  if (info.has_value()) info_.store(*info, std::memory_order_relaxed);
  auto& settings = *response->mutable_settings();
  settings["log_file"].set_string_param("");
  settings["log_info"].set_bool_param(this->info());
  settings["log_warnings"].set_bool_param(warnings_);
  settings["log_errors"].set_bool_param(errors_);
  settings["log_verbose_level"].set_uint32_param(0);
  settings["log_format"].set_string_param("default");
  return absl::OkStatus();
}

absl::Status TraceSettings::Handle(
    const inference::TraceSettingRequest& request,
    inference::TraceSettingResponse* response) {
  const std::string& model = request.model_name();
  if (!model.empty()) {
    ATTN_RETURN_IF_ERROR(
        FindProtocolModel(model, models_, "model_name").status());
  }
  for (const auto& [name, value] : request.settings()) {
    ATTN_RETURN_IF_ERROR(
        VerifyTraceSetting(name, {value.value().begin(), value.value().end()}));
  }
  MutexLock lock(&mu_);
  Values& target = model.empty() ? global_ : per_model_[model];
  for (const auto& [name, value] : request.settings()) {
    if (value.value().empty()) {
      target.erase(name);
    } else {
      target[name] = {value.value().begin(), value.value().end()};
    }
  }
  Values answer = TraceDefaults();
  for (const Values* layer :
       {&global_, model.empty() ? &global_ : &per_model_[model]}) {
    for (const auto& [name, values] : *layer) answer[name] = values;
  }
  for (const auto& [name, values] : answer) {
    auto* out = (*response->mutable_settings())[name].mutable_value();
    out->Assign(values.begin(), values.end());
  }
  return absl::OkStatus();
}

absl::Status LogSettingsFromJson(const json& body,
                                 inference::LogSettingsRequest* request) {
  for (const auto& [name, value] : body.items()) {
    LogValue& setting = (*request->mutable_settings())[name];
    if (value.is_boolean()) {
      setting.set_bool_param(value.get<bool>());
    } else if (value.is_number_unsigned() &&
               value.get<uint64_t>() <= std::numeric_limits<uint32_t>::max()) {
      setting.set_uint32_param(static_cast<uint32_t>(value.get<uint64_t>()));
    } else if (value.is_string()) {
      setting.set_string_param(value.get<std::string>());
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          EchoString(name), ": expected a bool, a uint32 or a string"));
    }
  }
  return absl::OkStatus();
}

json LogSettingsToJson(const inference::LogSettingsResponse& response) {
  json body = json::object();
  for (const auto& [name, value] : response.settings()) {
    switch (value.parameter_choice_case()) {
      case inference::LogSettingsResponse::SettingValue::kBoolParam:
        body[name] = value.bool_param();
        break;
      case inference::LogSettingsResponse::SettingValue::kUint32Param:
        body[name] = value.uint32_param();
        break;
      default:
        body[name] = value.string_param();
    }
  }
  return body;
}

absl::Status TraceSettingsFromJson(const json& body,
                                   inference::TraceSettingRequest* request) {
  for (const auto& [name, value] : body.items()) {
    auto* values = (*request->mutable_settings())[name].mutable_value();
    if (value.is_null()) continue;  // clears
    if (value.is_string()) {
      values->Add(value.get<std::string>());
      continue;
    }
    if (!value.is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat(EchoString(name),
                       ": expected a string, an array of strings or null"));
    }
    for (const json& item : value) {
      if (!item.is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(EchoString(name), ": expected an array of strings"));
      }
      values->Add(item.get<std::string>());
    }
  }
  return absl::OkStatus();
}

json TraceSettingsToJson(const inference::TraceSettingResponse& response) {
  json body = json::object();
  for (const auto& [name, value] : response.settings()) {
    // trace_level is a list; the others are single strings.
    if (name == "trace_level") {
      body[name] =
          std::vector<std::string>(value.value().begin(), value.value().end());
    } else {
      body[name] = value.value().empty() ? "" : value.value(0);
    }
  }
  return body;
}

}  // namespace attnserve
