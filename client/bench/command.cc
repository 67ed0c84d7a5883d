#include "client/bench/command.h"

#include <unistd.h>

#include <cmath>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
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

absl::StatusOr<BenchReport> RunOne(const Workload& workload, LoadOptions load,
                                   const std::string& step,
                                   std::FILE* progress_out) {
  ProgressPrinter printer(progress_out, step);
  load.progress_interval = printer.interval();
  auto report = RunLoad(
      workload, load, [&printer](const LoadProgress& p) { printer.Print(p); });
  printer.Done();
  if (report.ok()) {
    report->step = step;
    report->steps_per_request = workload.steps_per_request;
    report->layers = workload.layers;
  }
  return report;
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

absl::Status RunBenchCommand(const Workload& workload,
                             const BenchCommandOptions& options,
                             std::FILE* report_out, std::FILE* progress_out) {
  ATTN_RETURN_IF_ERROR(VerifyLoadOptions(options.load));
  if (!options.save_request_path.empty()) {
    ATTN_RETURN_IF_ERROR(WriteFile(options.save_request_path,
                                   GrpcFrame(workload.request),
                                   "--save_request"));
  }
  if (options.sweep.empty()) {
    if (!options.plot_path.empty()) {
      return absl::InvalidArgumentError("--plot: needs --sweep");
    }
    ATTN_ASSIGN_OR_RETURN(BenchReport report,
                          RunOne(workload, options.load, "", progress_out));
    std::string out;
    switch (options.format) {
      case ReportFormat::kText:
        out = FormatText(report);
        break;
      case ReportFormat::kJson:
        out = FormatJson({report});
        break;
      case ReportFormat::kCsv:
        out = FormatCsv({report});
        break;
    }
    std::fputs(out.c_str(), report_out);
    return absl::OkStatus();
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
                          RunOne(workload, load, step, progress_out));
    if (progress_out != nullptr) {
      std::fprintf(progress_out, "%s: %.1f req/s, p50 %.3f ms, p99 %.3f ms\n",
                   step.c_str(), report.qps, report.latency.p50_us / 1e3,
                   report.latency.p99_us / 1e3);
    }
    reports.push_back(std::move(report));
  }
  std::string out;
  switch (options.format) {
    case ReportFormat::kText:
      out = absl::StrCat(workload.rpc, " ", workload.description, "\n",
                         FormatSweepTable(reports));
      break;
    case ReportFormat::kJson:
      out = FormatJson(reports);
      break;
    case ReportFormat::kCsv:
      out = FormatCsv(reports);
      break;
  }
  std::fputs(out.c_str(), report_out);
  if (!options.plot_path.empty()) {
    ATTN_RETURN_IF_ERROR(WriteFile(
        options.plot_path,
        RenderSweepSvg(reports,
                       absl::StrCat(workload.rpc, " ", workload.description)),
        "--plot"));
  }
  return absl::OkStatus();
}

}  // namespace attnserve
