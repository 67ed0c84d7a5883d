// `attnctl bench` once its flags are read: one load test or a sweep of them,
// each measured in one period or in windows until stable, with the
// server's statistics around them; live progress on stderr, the report on
// stdout, an SVG chart for sweeps and perf_analyzer's CSV.
//
// Thread-safety: RunBenchCommand blocks; call it from one thread.
#ifndef ATTNSERVE_CLIENT_BENCH_COMMAND_H_
#define ATTNSERVE_CLIENT_BENCH_COMMAND_H_

#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/bench/load.h"
#include "client/bench/report.h"
#include "client/bench/stability.h"
#include "client/bench/workload.h"

namespace attnserve {

// A sweep: the load option it varies and the values, in order.
struct Sweep {
  // "concurrency" or "rate".
  std::string parameter;
  std::vector<double> values;
};

// "concurrency=1,2,4" or "rate=100,200.5"; INVALID_ARGUMENT naming --sweep
// for anything else (unknown parameter, empty list, values that are not
// positive numbers, a fractional concurrency).
absl::StatusOr<Sweep> ParseSweep(absl::string_view text);

struct BenchCommandOptions {
  LoadOptions load;
  ReportFormat format = ReportFormat::kText;
  // Empty: a single run.
  std::string sweep;
  // Sweeps: where to write the SVG chart (empty: none).
  std::string plot_path;
  // Where to write the request as a gRPC-framed HTTP/2 body, for other load
  // tools (empty: none).
  std::string save_request_path;
  // Where to write perf_analyzer's CSV, one row per level (empty: none).
  std::string csv_path;
  // Measurement windows until stable (no percentage: one period).
  StabilityOptions stability;
};

// OK when `options` can run; INVALID_ARGUMENT naming the flag otherwise.
// Asks the server nothing; creates --csv's file, empty, to know it can be
// written before the run rather than after.
absl::Status VerifyBenchCommandOptions(const BenchCommandOptions& options);

// Runs the test(s), prints progress to `progress_out` (one updating line on
// a terminal, plain lines otherwise) and the report to `report_out`, then
// writes the files asked for. When a level did not meet the stability
// criterion, everything is still reported and written, then
// FAILED_PRECONDITION names the levels.
absl::Status RunBenchCommand(const Workload& workload,
                             const BenchCommandOptions& options,
                             std::FILE* report_out, std::FILE* progress_out);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_BENCH_COMMAND_H_
