#include "server/metrics.h"

#include <unistd.h>

#include <array>
#include <charconv>
#include <chrono>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "core/row_ops.h"

namespace attnserve {
namespace {

int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return resident * sysconf(_SC_PAGESIZE);
}

// The shortest text that reads back as `v`, as Prometheus' client libraries
// print: le="0.0005", not its 17-digit expansion "0.00050000000000000001".
std::string Number(double v) {
  std::array<char, 32> buffer;  // the longest double, -2.2250738585072014e-308
  char* end = std::to_chars(buffer.data(), buffer.data() + buffer.size(), v,
                            std::chars_format::general)
                  .ptr;
  return std::string(buffer.data(), end);
}

}  // namespace

void Metrics::Histogram::Observe(double seconds) {
  for (size_t i = 0; i < kBuckets.size(); ++i) {
    if (seconds <= kBuckets[i]) {
      ++counts[i];
      break;
    }
  }
  ++count;
  sum += seconds;
}

void Metrics::RecordCall(const std::string& rpc, const std::string& code,
                         absl::Duration total, absl::Duration queue_wait,
                         absl::Duration compute, double flops, int64_t bytes) {
  MutexLock lock(&mu_);
  ++calls_[{rpc, code}];
  total_[rpc].Observe(absl::ToDoubleSeconds(total));
  if (code == "OK") {
    queue_[rpc].Observe(absl::ToDoubleSeconds(queue_wait));
    compute_[rpc].Observe(absl::ToDoubleSeconds(compute));
    flops_ += flops;
    bytes_ += bytes;
  }
}

void Metrics::RenderHistogram(const std::string& name, const std::string& help,
                              const std::map<std::string, Histogram>& by_rpc,
                              std::string* out) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name,
                  " histogram\n");
  for (const auto& [rpc, h] : by_rpc) {
    int64_t cumulative = 0;
    for (size_t i = 0; i < kBuckets.size(); ++i) {
      cumulative += h.counts[i];
      absl::StrAppend(out, name, "_bucket{rpc=\"", rpc, "\",le=\"",
                      Number(kBuckets[i]), "\"} ", cumulative, "\n");
    }
    absl::StrAppend(out, name, "_bucket{rpc=\"", rpc, "\",le=\"+Inf\"} ",
                    h.count, "\n", name, "_sum{rpc=\"", rpc, "\"} ",
                    Number(h.sum), "\n", name, "_count{rpc=\"", rpc, "\"} ",
                    h.count, "\n");
  }
}

namespace {

// The decode sessions' gauges and counters.
void RenderSessionGauges(const SessionStore::Stats& sessions,
                         std::string* out) {
  absl::StrAppend(
      out,
      "# HELP attnserve_sessions_open Decode sessions open.\n"
      "# TYPE attnserve_sessions_open gauge\nattnserve_sessions_open ",
      sessions.open,
      "\n# HELP attnserve_session_cache_bytes Key/value cache memory of the "
      "open decode sessions.\n"
      "# TYPE attnserve_session_cache_bytes gauge\n"
      "attnserve_session_cache_bytes ",
      sessions.cache_bytes,
      "\n# HELP attnserve_session_reserved_bytes Address space the open "
      "decode sessions' caches reserve (their max_length).\n"
      "# TYPE attnserve_session_reserved_bytes gauge\n"
      "attnserve_session_reserved_bytes ",
      sessions.reserved_bytes,
      "\n# HELP attnserve_sessions_closed_total Decode sessions freed, by "
      "why.\n"
      "# TYPE attnserve_sessions_closed_total counter\n"
      "attnserve_sessions_closed_total{reason=\"deleted\"} ",
      sessions.deleted,
      "\nattnserve_sessions_closed_total{reason=\"expired\"} ",
      sessions.expired,
      "\nattnserve_sessions_closed_total{reason=\"evicted\"} ",
      sessions.evicted,
      "\n# HELP attnserve_sessions_created_total Decode sessions created.\n"
      "# TYPE attnserve_sessions_created_total counter\n"
      "attnserve_sessions_created_total ",
      sessions.created,
      "\n# HELP attnserve_session_files_total Decode sessions saved to "
      "--session_dir (evicted, or on a drain), taken up from it, saves that "
      "failed, sessions recovered from the journal a server that died left, "
      "blocks journaled, journals given up (a write failed), sessions "
      "opened by ImportSession, and sessions taken up or imported that "
      "share their first blocks with one held again.\n"
      "# TYPE attnserve_session_files_total counter\n"
      "attnserve_session_files_total{event=\"saved\"} ",
      sessions.saved, "\nattnserve_session_files_total{event=\"restored\"} ",
      sessions.restored,
      "\nattnserve_session_files_total{event=\"save_failed\"} ",
      sessions.save_failures,
      "\nattnserve_session_files_total{event=\"recovered\"} ",
      sessions.recovered,
      "\nattnserve_session_files_total{event=\"journaled_block\"} ",
      sessions.journaled_blocks,
      "\nattnserve_session_files_total{event=\"journal_failed\"} ",
      sessions.journal_failures,
      "\nattnserve_session_files_total{event=\"imported\"} ", sessions.imported,
      "\nattnserve_session_files_total{event=\"reshared\"} ", sessions.reshared,
      "\n# HELP attnserve_sessions_forked_total Decode sessions created by "
      "ForkSession or a sequence_fork (counted in "
      "attnserve_sessions_created_total too).\n"
      "# TYPE attnserve_sessions_forked_total counter\n"
      "attnserve_sessions_forked_total ",
      sessions.forked,
      "\n# HELP attnserve_session_shared_caches Frozen caches that forked "
      "decode sessions share.\n"
      "# TYPE attnserve_session_shared_caches gauge\n"
      "attnserve_session_shared_caches ",
      sessions.shared_caches,
      "\n# HELP attnserve_session_shared_bytes Memory of the shared caches, "
      "counted once each (part of attnserve_session_cache_bytes).\n"
      "# TYPE attnserve_session_shared_bytes gauge\n"
      "attnserve_session_shared_bytes ",
      sessions.shared_bytes,
      "\n# HELP attnserve_session_bookkeeping_bytes Per-layer lengths and "
      "block tables of the open decode sessions.\n"
      "# TYPE attnserve_session_bookkeeping_bytes gauge\n"
      "attnserve_session_bookkeeping_bytes ",
      sessions.bookkeeping_bytes,
      "\n# HELP attnserve_session_superseded_models Models no longer served "
      "(replaced by a reload) that decode sessions keep alive.\n"
      "# TYPE attnserve_session_superseded_models gauge\n"
      "attnserve_session_superseded_models ",
      sessions.superseded_models,
      "\n# HELP attnserve_session_superseded_model_bytes Weights of those "
      "models, counted once each.\n"
      "# TYPE attnserve_session_superseded_model_bytes gauge\n"
      "attnserve_session_superseded_model_bytes ",
      sessions.superseded_model_bytes,
      "\n# HELP attnserve_session_memory_bytes What --max_session_memory_mb "
      "limits: cache, bookkeeping and superseded models' weights.\n"
      "# TYPE attnserve_session_memory_bytes gauge\n"
      "attnserve_session_memory_bytes ",
      sessions.budget_bytes, "\n");
}

}  // namespace

std::string Metrics::Render(const ServingGauges& gauges) const {
  std::string out;
  MutexLock lock(&mu_);
  absl::StrAppend(
      &out,
      "# HELP attnserve_requests_total Calls finished, by RPC and "
      "gRPC status code.\n# TYPE attnserve_requests_total counter\n");
  for (const auto& [key, count] : calls_) {
    absl::StrAppend(&out, "attnserve_requests_total{rpc=\"", key.first,
                    "\",code=\"", key.second, "\"} ", count, "\n");
  }
  RenderHistogram("attnserve_request_duration_seconds",
                  "Time from arrival to answer.", total_, &out);
  RenderHistogram("attnserve_queue_wait_seconds",
                  "Time calls waited for a worker.", queue_, &out);
  RenderHistogram("attnserve_compute_seconds", "Time calls computed.", compute_,
                  &out);
  absl::StrAppend(
      &out,
      "# HELP attnserve_flops_total Floating-point operations of successful "
      "calls.\n# TYPE attnserve_flops_total counter\nattnserve_flops_total ",
      Number(flops_),
      "\n# HELP attnserve_bytes_total Tensor bytes of successful calls' "
      "requests and results.\n# TYPE attnserve_bytes_total counter\n"
      "attnserve_bytes_total ",
      bytes_,
      "\n# HELP attnserve_inflight_requests Calls computing now.\n"
      "# TYPE attnserve_inflight_requests gauge\nattnserve_inflight_requests ",
      gauges.inflight,
      "\n# HELP attnserve_queued_requests Calls waiting for a worker.\n"
      "# TYPE attnserve_queued_requests gauge\nattnserve_queued_requests ",
      gauges.queued,
      "\n# HELP attnserve_models_loaded Models in the repository.\n"
      "# TYPE attnserve_models_loaded gauge\nattnserve_models_loaded ",
      gauges.models_loaded, "\n");
  RenderSessionGauges(gauges.sessions, &out);
  absl::StrAppend(
      &out,
      "# HELP attnserve_step_passes_total Passes of the step coalescer: "
      "session steps of concurrent calls, from every front end, run "
      "together.\n"
      "# TYPE attnserve_step_passes_total counter\n"
      "attnserve_step_passes_total ",
      gauges.step_passes,
      "\n# HELP attnserve_coalesced_steps_total Session steps run in those "
      "passes.\n"
      "# TYPE attnserve_coalesced_steps_total counter\n"
      "attnserve_coalesced_steps_total ",
      gauges.coalesced_steps,
      "\n# HELP attnserve_build_info Build information: the version, the "
      "instruction set the row kernels use (ATTNSERVE_CPU_ISA caps it) and "
      "their implementation.\n"
      "# TYPE attnserve_build_info gauge\n"
      "attnserve_build_info{version=\"" ATTNSERVE_VERSION "\",isa=\"",
      GetRowOps().isa, "\",row_kernels=\"", GetRowOps().name,
      "\"} 1\n"
      "# HELP process_resident_memory_bytes Resident memory size.\n"
      "# TYPE process_resident_memory_bytes gauge\n"
      "process_resident_memory_bytes ",
      ResidentBytes(), "\n");
  return out;
}

absl::StatusOr<std::unique_ptr<HttpServer>> StartMetricsServer(
    HttpServerOptions options, std::function<std::string()> render) {
  options.port_flag = "--metrics_port";
  // Scrapes send no body; nothing larger is read.
  options.limits.max_body_bytes = 64 << 10;
  return HttpServer::Start(
      options,
      [](const HttpRequestHead& head) -> std::optional<HttpResponse> {
        if (head.path() != "/metrics") {
          return JsonErrorResponse(
              404,
              absl::StrCat("no such endpoint: ", head.path().substr(0, 128),
                           "; the metrics are at GET /metrics"));
        }
        if (head.method != "GET" && head.method != "HEAD") {
          HttpResponse refusal = JsonErrorResponse(
              405,
              absl::StrCat(head.method.substr(0, 32), " /metrics: use GET"));
          refusal.fields.emplace_back("Allow", "GET, HEAD");
          return refusal;
        }
        return std::nullopt;
      },
      [render = std::move(render)](HttpRequest, HttpResponder responder) {
        HttpResponse response;
        response.fields.emplace_back("Content-Type",
                                     "text/plain; version=0.0.4");
        response.body = render();
        responder.Send(std::move(response));
      });
}

}  // namespace attnserve
