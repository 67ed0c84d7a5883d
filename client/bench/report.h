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

// The server's own account of the counted calls, from the Open Inference
// Protocol's statistics extension (ModelStatistics read before and after
// the measurement): counts and per-request averages, like perf_analyzer's
// "Server:" section. It counts every client's calls to the model, not only
// this run's.
struct ServerStatsReport {
  // The model the calls are counted under ("attend", "layer_norm",
  // "multi_head_attend" or a served model's name).
  std::string model;
  int64_t inference_count = 0;
  int64_t execution_count = 0;
  int64_t success_count = 0;
  // Averages in microseconds: each duration's nanoseconds over its own
  // count, 0 where the server counted none (it may count some stages
  // zero times, e.g. compute input when inputs are decoded before the
  // queue).
  double request_us = 0;
  // Request time that is neither queue nor compute (never below 0).
  double overhead_us = 0;
  double queue_us = 0;
  double compute_input_us = 0;
  double compute_infer_us = 0;
  double compute_output_us = 0;
};

// perf_analyzer's stability criterion, as one run met it (or not).
struct StabilityReport {
  // The limit: the last windows' throughputs, and their mean latencies,
  // must each vary by less than this (max / min - 1, in percent).
  double percent = 0;
  int max_windows = 0;
  double window_s = 0;
  bool stable = false;
  // Each window that ran, in order: its throughput and mean latency.
  std::vector<double> window_qps;
  std::vector<double> window_mean_us;
  // The last windows, which the spreads and the report cover.
  int compared_windows = 0;
  // Over those windows: max / min - 1, in percent.
  double qps_spread_percent = 0;
  double latency_spread_percent = 0;
};

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
  // From the server's statistics extension; when absent, the note says why
  // (decode sessions and health checks belong to no model, or the server
  // could not be asked).
  std::optional<ServerStatsReport> server_stats;
  std::string server_stats_note;
  // With a stability criterion: the measurement windows it took. The
  // figures above then cover the last windows only (perf_analyzer's
  // merge), not the ones before the run settled.
  std::optional<StabilityReport> stability;
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

// What the rows of a perf_analyzer CSV vary: the first column.
enum class CsvLevel { kConcurrency, kRequestRate };

// The columns of perf_analyzer's `-f FILE` CSV, one row per report in the
// order given: the level, Inferences/Second, the latency breakdown and
// client latency percentiles, in integer microseconds. Columns attnctl
// does not measure (Client Send, Client Recv, and the server's without
// server_stats) are 0, as perf_analyzer writes what it did not measure.
std::string FormatPerfAnalyzerCsv(const std::vector<BenchReport>& reports,
                                  CsvLevel level);
// Throughput against latency, one line per sweep step.
std::string FormatSweepTable(const std::vector<BenchReport>& reports);
// Latency percentiles (p50, p90, p99, p99.9) against achieved throughput,
// one point per sweep step, as a standalone SVG document.
std::string RenderSweepSvg(const std::vector<BenchReport>& reports,
                           absl::string_view title);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_BENCH_REPORT_H_
