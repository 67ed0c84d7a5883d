// What a load test measured, and the ways attnctl bench prints it: text for
// people, JSON and CSV for scripts, a table and an SVG chart for sweeps.
//
// Thread-safety: plain values and free functions.
#ifndef ATTNSERVE_CLIENT_BENCH_REPORT_H_
#define ATTNSERVE_CLIENT_BENCH_REPORT_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/bench/histogram.h"

namespace attnserve {

// Latency statistics in microseconds.
struct LatencySummary {
  int64_t count = 0;
  double min_us = 0;
  double mean_us = 0;
  double stddev_us = 0;
  double p50_us = 0;
  double p90_us = 0;
  double p95_us = 0;
  double p99_us = 0;
  double p999_us = 0;
  double max_us = 0;
};

LatencySummary Summarize(const LatencyHistogram& histogram);

struct BenchReport {
  // The sweep step ("concurrency=8"); empty for a single run.
  std::string step;
  // "LayerNorm", "MultiHeadAttend", "Attend".
  std::string rpc;
  // Shapes of the request's tensors, e.g. "input=[1, 64] FLOAT32".
  std::string workload;
  int64_t request_bytes = 0;
  // Closed loop: calls kept in flight. Open loop: the cap on outstanding
  // calls.
  int concurrency = 0;
  int connections = 0;
  // Open loop: requests per second asked for (0: closed loop) and how
  // arrivals are spaced ("constant", "poisson").
  double target_rate = 0;
  std::string arrival;
  double warmup_s = 0;
  // When the run started (warm-up included), Unix time in seconds.
  double start_unix_s = 0;
  // Counted calls: started after the warm-up.
  int64_t requests = 0;
  int64_t ok = 0;
  // Failed calls by status code name ("UNAVAILABLE").
  std::map<std::string, int64_t> errors;
  // For each failing code, its first failed call: the message, when it
  // ended (seconds from the start of the run, warm-up included: to line up
  // with events outside the client) and the address it last went to (empty
  // when it never reached one).
  std::map<std::string, std::string> error_messages;
  std::map<std::string, double> error_first_at_s;
  std::map<std::string, std::string> error_first_peer;
  // From the end of the warm-up to the last counted completion.
  double duration_s = 0;
  // Completed calls (ok or not) per second.
  double qps = 0;
  // Decode steps per call (SessionSteps carries several): steps/s is
  // qps x this.
  int64_t steps_per_request = 1;
  // Decode steps of one session that make a token (one per layer):
  // tokens/s is steps/s / this.
  int64_t layers = 1;
  // Closed loop: from send to completion. Open loop: from the scheduled
  // send time, so that a client falling behind shows up as latency.
  LatencySummary latency;
  // From the server's `attnserve-compute-us` trailer, when it sends one.
  std::optional<LatencySummary> server_compute;
  // Open loop: calls sent more than the late threshold after their
  // scheduled time (a full client, or waiting for an outstanding slot).
  int64_t late = 0;
  double late_threshold_ms = 0;
  // The client's own CPU use over the counted period.
  double client_cpu_cores = 0;
  int client_cores_available = 0;
  double client_cpu_us_per_request = 0;
  // The share of the time the busiest call-driving thread was on a CPU.
  double client_busiest_thread = 0;
  // True when the client used nearly all the cores it may run on, or its
  // busiest call-driving thread was busy nearly all the time: the figures
  // then measure the client, not the server.
  bool client_saturated = false;
};

enum class ReportFormat { kText, kJson, kCsv };

// "text", "json" or "csv"; INVALID_ARGUMENT naming --format otherwise.
absl::StatusOr<ReportFormat> ParseReportFormat(absl::string_view name);

// One run, for people.
std::string FormatText(const BenchReport& report);
// One object for a single report, an array for a sweep.
std::string FormatJson(const std::vector<BenchReport>& reports);
// A header line and one line per report.
std::string FormatCsv(const std::vector<BenchReport>& reports);
// Throughput against latency, one line per sweep step.
std::string FormatSweepTable(const std::vector<BenchReport>& reports);
// Latency percentiles (p50, p90, p99, p99.9) against achieved throughput,
// one point per sweep step, as a standalone SVG document.
std::string RenderSweepSvg(const std::vector<BenchReport>& reports,
                           absl::string_view title);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_BENCH_REPORT_H_
