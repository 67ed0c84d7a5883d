#include "server/options.h"

#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/session_file.h"
#include "core/status_macros.h"

namespace attnserve {
namespace {

// Where the server listens and the messages it accepts.
absl::Status VerifyListening(const ServerOptions& options) {
  if (options.host.empty()) {
    return absl::InvalidArgumentError("--host: must not be empty");
  }
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--port: ", options.port, " is not in [0, 65535]"));
  }
  if (options.max_message_mb < 1 || options.max_message_mb > 2047) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_message_mb: ", options.max_message_mb,
        " is not in [1, 2047] (protobuf messages are limited to 2 GiB)"));
  }
  return absl::OkStatus();
}

absl::Status VerifyThreads(const ServerOptions& options) {
  if (options.threads < 0 || options.threads > 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--threads: ", options.threads, " is not in [0, 4096] (0: all cores)"));
  }
  return absl::OkStatus();
}

absl::Status VerifyTls(const ServerOptions& options) {
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key: give both or neither");
  }
  if (!options.tls_client_ca.empty() && options.tls_cert.empty()) {
    return absl::InvalidArgumentError(
        "--tls_client_ca: needs --tls_cert and --tls_key");
  }
  return absl::OkStatus();
}

absl::Status VerifyMetricsAndLogs(const ServerOptions& options) {
  if (options.metrics_port < -1 || options.metrics_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_port: ", options.metrics_port,
                     " is not in [-1, 65535] (-1: off, 0: any free port)"));
  }
  if (options.http_port < -1 || options.http_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http_port: ", options.http_port,
                     " is not in [-1, 65535] (-1: off, 0: any free port)"));
  }
  for (const auto& [flag, value, low, high] :
       {std::tuple("--http_header_timeout_s", options.http_header_timeout_s, 1,
                   3600),
        std::tuple("--http_body_timeout_s", options.http_body_timeout_s, 1,
                   3600),
        std::tuple("--http_idle_timeout_s", options.http_idle_timeout_s, 1,
                   86400),
        std::tuple("--http_max_connections", options.http_max_connections, 1,
                   1000000),
        std::tuple("--http_threads", options.http_threads, 1, 256)}) {
    if (value < low || value > high) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, ": ", value, " is not in [", low, ", ", high, "]"));
    }
  }
  if (options.log_level != "info" && options.log_level != "warning" &&
      options.log_level != "error") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_level: '", options.log_level,
                     "', expected info, warning or error"));
  }
  return absl::OkStatus();
}

// The drain, and how long connections live.
absl::Status VerifyShutdown(const ServerOptions& options) {
  if (options.drain_seconds < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--drain_seconds: ", options.drain_seconds, " is negative"));
  }
  if (options.lame_duck_seconds < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--lame_duck_seconds: ", options.lame_duck_seconds, " is negative"));
  }
  if (options.lame_duck_seconds > 0 &&
      options.lame_duck_seconds >= options.drain_seconds) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--lame_duck_seconds: ", options.lame_duck_seconds,
        " must be less than --drain_seconds (", options.drain_seconds,
        "), of which it is the first part, or 0"));
  }
  if (options.max_connection_age_seconds < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_connection_age_seconds: ", options.max_connection_age_seconds,
        " is negative"));
  }
  return absl::OkStatus();
}

// Calls in flight and queued, and what one call may use.
absl::Status VerifyLimits(const ServerOptions& options) {
  if (options.max_inflight < 0 || options.max_inflight > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_inflight: ", options.max_inflight,
                     " is not in [0, 4096] (0: one per compute thread)"));
  }
  if (options.max_queue < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_queue: ", options.max_queue, " is negative"));
  }
  if (options.max_tensor_elements <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_tensor_elements: ", options.max_tensor_elements,
                     " must be > 0"));
  }
  if (options.max_shared_memory_mb < 0 ||
      options.max_shared_memory_mb > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_shared_memory_mb: ", options.max_shared_memory_mb,
                     " is out of range, expected 0 (off) to 2^40"));
  }
  if (options.max_session_memory_mb < 0 ||
      options.max_session_memory_mb > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_session_memory_mb: ", options.max_session_memory_mb,
                     " is out of range, expected 0 (sessions off) to 2^40"));
  }
  if (options.session_idle_timeout_s <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--session_idle_timeout_s: ", options.session_idle_timeout_s,
        " must be > 0"));
  }
  if (options.max_session_disk_mb < 0 ||
      options.max_session_disk_mb > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_session_disk_mb: ", options.max_session_disk_mb,
                     " is out of range, expected 0 (no limit) to 2^40"));
  }
  if (options.session_file_version < 2 ||
      options.session_file_version > static_cast<int>(kSessionFileVersion)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--session_file_version: ", options.session_file_version,
                     " is out of range, expected 2 (every session whole) to ",
                     kSessionFileVersion, " (forks over shared base files)"));
  }
  if (!options.session_dir.empty() && options.max_session_memory_mb == 0) {
    return absl::InvalidArgumentError(
        "--session_dir: sessions are off (--max_session_memory_mb=0)");
  }
  if (options.max_sessions <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_sessions: ", options.max_sessions, " must be > 0"));
  }
  if (options.max_session_length <= 0 ||
      options.max_session_length > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_session_length: ", options.max_session_length,
                     " is out of range, expected 1 to 2^30"));
  }
  if (options.max_steps_per_call < 1 || options.max_steps_per_call > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_steps_per_call: ", options.max_steps_per_call,
                     " is not in [1, 65536]"));
  }
  if (options.coalesce_steps_us < 0 || options.coalesce_steps_us > 100000) {
    return absl::InvalidArgumentError(
        absl::StrCat("--coalesce_steps_us: ", options.coalesce_steps_us,
                     " is not in [0, 100000] (0: off)"));
  }
  if (options.max_model_mb < 1 || options.max_model_mb > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_model_mb: ", options.max_model_mb,
                     " is out of range, expected 1 to 2^20 (1 TiB)"));
  }
  if (options.max_request_memory_mb <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_request_memory_mb: ", options.max_request_memory_mb,
                     " must be > 0"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status VerifyServerOptions(const ServerOptions& options) {
  ATTN_RETURN_IF_ERROR(VerifyListening(options));
  ATTN_RETURN_IF_ERROR(VerifyThreads(options));
  ATTN_RETURN_IF_ERROR(VerifyTls(options));
  ATTN_RETURN_IF_ERROR(VerifyMetricsAndLogs(options));
  ATTN_RETURN_IF_ERROR(VerifyShutdown(options));
  ATTN_RETURN_IF_ERROR(VerifyLimits(options));
  return absl::OkStatus();
}

bool ShouldLog(const ServerOptions& options, LogSeverity severity) {
  LogSeverity least = LogSeverity::kInfo;
  if (options.log_level == "warning") least = LogSeverity::kWarning;
  if (options.log_level == "error") least = LogSeverity::kError;
  return severity >= least;
}

std::string ListenAddress(const std::string& host, int port) {
  if (absl::StrContains(host, ':') && !absl::StartsWith(host, "[")) {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

}  // namespace attnserve
