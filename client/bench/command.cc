#include "client/bench/command.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/bench/server_stats.h"
#include "core/status_macros.h"

namespace attnserve {
namespace {

absl::Status WriteFile(const std::string& path, const std::string& contents,
                       absl::string_view flag) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  out.close();
  if (!out) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot write '", path, "'"));
  }
  return absl::OkStatus();
}

// Progress on a terminal: one line rewritten in place. Elsewhere (a log, a
// pipe): a plain line now and then.
class ProgressPrinter {
 public:
  ProgressPrinter(std::FILE* out, std::string step)
      : out_(out),
        tty_(out != nullptr && isatty(fileno(out))),
        step_(std::move(step)) {}

  absl::Duration interval() const {
    return tty_ ? absl::Milliseconds(500) : absl::Seconds(5);
  }

  void Print(const LoadProgress& p) {
    if (out_ == nullptr) return;
    const std::string line = absl::StrFormat(
        "%s%6.1fs %s %8d done  %9.1f req/s  p50 %.3f ms  p99 %.3f ms  "
        "%d errors",
        step_.empty() ? "" : step_ + " ", absl::ToDoubleSeconds(p.elapsed),
        p.warming_up ? "warm-up" : "       ", p.completed, p.qps,
        p.p50_ns / 1e6, p.p99_ns / 1e6, p.errors);
    if (tty_) {
      std::fprintf(out_, "\r\033[K%s", line.c_str());
      printed_ = true;
    } else {
      std::fprintf(out_, "%s\n", line.c_str());
    }
    std::fflush(out_);
  }

  // A line of its own, between updates of the progress line.
  void Line(const std::string& text) {
    if (out_ == nullptr) return;
    Done();
    std::fprintf(out_, "%s\n", text.c_str());
    std::fflush(out_);
  }

  // Ends the updating line.
  void Done() {
    if (tty_ && printed_) std::fprintf(out_, "\r\033[K");
  }

 private:
  std::FILE* out_;
  bool tty_;
  std::string step_;
  bool printed_ = false;
};

// One window's line, as perf_analyzer's verbose "Pass [i]" lines.
std::string WindowLine(const std::string& step, int index,
                       const BenchReport& window) {
  return absl::StrFormat("%swindow %d: %.1f req/s, mean latency %.3f ms",
                         step.empty() ? "" : step + " ", index, window.qps,
                         window.latency.mean_us / 1e3);
}

// One level: its load test, in windows until stable when asked, with the
// server's counters read at each window boundary.
absl::StatusOr<BenchReport> RunOne(const Workload& workload,
                                   const BenchCommandOptions& options,
                                   const LoadOptions& level,
                                   const std::string& step,
                                   std::FILE* progress_out) {
  ProgressPrinter printer(progress_out, step);
  LoadOptions load = WithWindows(level, options.stability);
  load.progress_interval = printer.interval();
  ServerStatsReader server(load.client, workload.statistics_model,
                           workload.rpc);
  std::optional<StabilityTracker> stability;
  if (options.stability.percent.has_value()) {
    stability.emplace(options.stability, load.window);
  }
  int windows = 0;
  LoadHooks hooks;
  hooks.progress = [&printer](const LoadProgress& p) { printer.Print(p); };
  hooks.measure_start = [&server] { server.Read(); };
  hooks.window_end = [&](const BenchReport& window) {
    server.Read();
    ++windows;
    if (!stability.has_value()) return true;
    printer.Line(WindowLine(step, windows, window));
    return stability->Add(window);
  };
  auto report = RunLoad(workload, load, hooks);
  printer.Done();
  if (!report.ok()) return report;
  report->step = step;
  report->steps_per_request = workload.steps_per_request;
  report->layers = workload.layers;
  // The readings around the windows the report covers.
  server.Fill(std::max(0, windows - load.report_windows), windows, &*report);
  if (stability.has_value()) report->stability = stability->report();
  return report;
}

// Every level asked for: the single run, or each value of the sweep.
absl::StatusOr<std::vector<BenchReport>> RunLevels(
    const Workload& workload, const BenchCommandOptions& options,
    std::FILE* progress_out) {
  if (options.sweep.empty()) {
    ATTN_ASSIGN_OR_RETURN(
        BenchReport report,
        RunOne(workload, options, options.load, "", progress_out));
    return std::vector<BenchReport>{std::move(report)};
  }
  ATTN_ASSIGN_OR_RETURN(const Sweep sweep, ParseSweep(options.sweep));
  std::vector<BenchReport> reports;
  for (double value : sweep.values) {
    LoadOptions load = options.load;
    if (sweep.parameter == "concurrency") {
      load.concurrency = static_cast<int>(value);
    } else {
      load.rate = value;
    }
    const std::string step = absl::StrCat(sweep.parameter, "=", value);
    ATTN_ASSIGN_OR_RETURN(BenchReport report,
                          RunOne(workload, options, load, step, progress_out));
    if (progress_out != nullptr) {
      std::fprintf(progress_out, "%s: %.1f req/s, p50 %.3f ms, p99 %.3f ms\n",
                   step.c_str(), report.qps, report.latency.p50_us / 1e3,
                   report.latency.p99_us / 1e3);
    }
    reports.push_back(std::move(report));
  }
  return reports;
}

std::string FormatReports(const Workload& workload,
                          const BenchCommandOptions& options,
                          const std::vector<BenchReport>& reports) {
  switch (options.format) {
    case ReportFormat::kText:
      if (options.sweep.empty()) return FormatText(reports[0]);
      return absl::StrCat(workload.rpc, " ", workload.description, "\n",
                          FormatSweepTable(reports));
    case ReportFormat::kJson:
      return FormatJson(reports);
    case ReportFormat::kCsv:
      return FormatCsv(reports);
  }
  return "";
}

// What the rows of the CSV vary: the sweep's parameter, or for a single
// run its mode.
CsvLevel CsvLevelOf(const BenchCommandOptions& options) {
  if (!options.sweep.empty()) {
    return absl::StartsWith(options.sweep, "rate=") ? CsvLevel::kRequestRate
                                                    : CsvLevel::kConcurrency;
  }
  return options.load.rate > 0 ? CsvLevel::kRequestRate
                               : CsvLevel::kConcurrency;
}

// perf_analyzer warns about a level that did not settle and leaves it out
// of its results; attnctl reports it with the others (its last windows),
// then fails so that a script cannot mistake it for a settled one.
absl::Status CheckStable(const std::vector<BenchReport>& reports) {
  std::vector<std::string> unstable;
  int windows = 0;
  for (const BenchReport& r : reports) {
    if (!r.stability.has_value() || r.stability->stable) continue;
    if (!r.step.empty()) unstable.push_back(r.step);
    windows = r.stability->max_windows;
  }
  if (windows == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "--stability_percent: ", absl::StrJoin(unstable, ", "),
      unstable.empty() ? "" : ": ", "not stable within --max_trials=", windows,
      " windows; the report shows the last ", kStabilityWindows,
      unstable.size() > 1 ? " of each" : ""));
}

// Fails now, not after the run, when `path` cannot be written. Leaves an
// empty file behind, which the run overwrites.
absl::Status CheckWritable(const std::string& path, absl::string_view flag) {
  std::ofstream out(path, std::ios::binary | std::ios::app);
  if (!out) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot write '", path, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Sweep> ParseSweep(absl::string_view text) {
  const std::vector<absl::string_view> parts = absl::StrSplit(text, '=');
  if (parts.size() != 2 || (parts[0] != "concurrency" && parts[0] != "rate")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--sweep: '", text, "' is not concurrency=N,N,... or rate=R,R,..."));
  }
  Sweep sweep;
  sweep.parameter = std::string(parts[0]);
  for (absl::string_view item : absl::StrSplit(parts[1], ',')) {
    double value = 0;
    if (!absl::SimpleAtod(item, &value) || !(value > 0) ||
        (sweep.parameter == "concurrency" && value != std::floor(value))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--sweep: '", item, "' is not a positive ",
          sweep.parameter == "concurrency" ? "integer" : "number"));
    }
    sweep.values.push_back(value);
  }
  return sweep;
}

absl::Status VerifyBenchCommandOptions(const BenchCommandOptions& options) {
  // First, so that a stability flag gets its own message rather than one
  // about the windows it asks for.
  ATTN_RETURN_IF_ERROR(VerifyStabilityOptions(options.stability, options.load));
  ATTN_RETURN_IF_ERROR(
      VerifyLoadOptions(WithWindows(options.load, options.stability)));
  if (!options.sweep.empty()) {
    ATTN_RETURN_IF_ERROR(ParseSweep(options.sweep).status());
  } else if (!options.plot_path.empty()) {
    return absl::InvalidArgumentError("--plot: needs --sweep");
  }
  if (!options.csv_path.empty()) {
    ATTN_RETURN_IF_ERROR(CheckWritable(options.csv_path, "--csv"));
  }
  return absl::OkStatus();
}

absl::Status RunBenchCommand(const Workload& workload,
                             const BenchCommandOptions& options,
                             std::FILE* report_out, std::FILE* progress_out) {
  ATTN_RETURN_IF_ERROR(VerifyBenchCommandOptions(options));
  if (!options.save_request_path.empty()) {
    ATTN_RETURN_IF_ERROR(WriteFile(options.save_request_path,
                                   GrpcFrame(workload.request),
                                   "--save_request"));
  }
  ATTN_ASSIGN_OR_RETURN(const std::vector<BenchReport> reports,
                        RunLevels(workload, options, progress_out));
  std::fputs(FormatReports(workload, options, reports).c_str(), report_out);
  if (!options.plot_path.empty()) {
    ATTN_RETURN_IF_ERROR(WriteFile(
        options.plot_path,
        RenderSweepSvg(reports,
                       absl::StrCat(workload.rpc, " ", workload.description)),
        "--plot"));
  }
  if (!options.csv_path.empty()) {
    ATTN_RETURN_IF_ERROR(WriteFile(
        options.csv_path, FormatPerfAnalyzerCsv(reports, CsvLevelOf(options)),
        "--csv"));
  }
  return CheckStable(reports);
}

}  // namespace attnserve
