// Triton's logging and trace extensions, as far as they map to what
// attnserve does, for both front ends (gRPC LogSettings / TraceSetting,
// HTTP /v2/logging, /v2/trace/setting, /v2/models/{m}/trace/setting).
//
// Log settings (Triton's names):
//  - log_info (bool): the access log, one line per call on stderr; changes
//    at once. Starts as --log_level says (on for "info").
//  - log_warnings, log_errors (bool): set by --log_level at start; asking
//    for the value they have is accepted, another is INVALID_ARGUMENT.
//  - log_verbose_level (uint32): 0 only (attnserve has no verbose log);
//    log_file: "" only (stderr); log_format: "default" only.
// Trace settings: attnserve traces no request, so trace_level is OFF and
// only OFF is accepted; trace_rate (> 0), trace_count (>= -1),
// log_frequency (>= 0), trace_file and trace_mode ("triton" only) are
// checked, stored and reported (they take effect on nothing while the
// level is OFF). A model's settings are the global ones overlaid with its
// own; a setting given no value clears it (a model's then follows the
// global one, a global one returns to its default).
//
// Thread-safety: both classes are thread-safe. Ownership: plain values.
#ifndef ATTNSERVE_SERVER_RUNTIME_SETTINGS_H_
#define ATTNSERVE_SERVER_RUNTIME_SETTINGS_H_

#include <atomic>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/mutex.h"
#include "inference/grpc_service.pb.h"
#include "nlohmann/json.hpp"
#include "server/model_repository.h"

namespace attnserve {

class LogSettings {
 public:
  LogSettings(bool info, bool warnings, bool errors)
      : info_(info), warnings_(warnings), errors_(errors) {}

  // Whether the access log is on.
  bool info() const { return info_.load(std::memory_order_relaxed); }

  // Applies the request's settings (all checked first: a request with one
  // bad setting changes nothing) and answers every setting.
  absl::Status Handle(const inference::LogSettingsRequest& request,
                      inference::LogSettingsResponse* response);

 private:
  std::atomic<bool> info_;
  const bool warnings_;
  const bool errors_;
};

class TraceSettings {
 public:
  // `models` may be null (built-in models only).
  explicit TraceSettings(const ModelRepository* models) : models_(models) {}

  // Applies the request's settings to the model it names (none: the
  // global ones), all checked first, and answers that model's settings.
  // NOT_FOUND for a model not served.
  absl::Status Handle(const inference::TraceSettingRequest& request,
                      inference::TraceSettingResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Values = std::map<std::string, std::vector<std::string>>;
  const ModelRepository* const models_;
  Mutex mu_;
  Values global_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Values> per_model_ ABSL_GUARDED_BY(mu_);
};

// The HTTP bodies: Triton's JSON objects ({"log_info": true, ...},
// {"trace_level": ["OFF"], "trace_rate": "1000", ...}; null clears a trace
// setting). INVALID_ARGUMENT naming the member for other shapes.
absl::Status LogSettingsFromJson(const nlohmann::json& body,
                                 inference::LogSettingsRequest* request);
nlohmann::json LogSettingsToJson(
    const inference::LogSettingsResponse& response);
absl::Status TraceSettingsFromJson(const nlohmann::json& body,
                                   inference::TraceSettingRequest* request);
nlohmann::json TraceSettingsToJson(
    const inference::TraceSettingResponse& response);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RUNTIME_SETTINGS_H_
