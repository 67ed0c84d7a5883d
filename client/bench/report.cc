#include "client/bench/report.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace attnserve {
namespace {

double Micros(int64_t nanos) { return nanos / 1000.0; }

// "1.234 ms" below a second, "1.23 s" above.
std::string Millis(double micros) {
  if (micros >= 1e6) return absl::StrFormat("%.2f s", micros / 1e6);
  return absl::StrFormat("%.3f ms", micros / 1e3);
}

int64_t TotalErrors(const BenchReport& report) {
  int64_t total = 0;
  for (const auto& [code, count] : report.errors) total += count;
  return total;
}

// The figures of a LatencySummary by name, for every format that lists
// them all.
constexpr std::pair<const char*, double LatencySummary::*> kLatencyFields[] = {
    {"min", &LatencySummary::min_us},       {"mean", &LatencySummary::mean_us},
    {"stddev", &LatencySummary::stddev_us}, {"p50", &LatencySummary::p50_us},
    {"p90", &LatencySummary::p90_us},       {"p95", &LatencySummary::p95_us},
    {"p99", &LatencySummary::p99_us},       {"p999", &LatencySummary::p999_us},
    {"max", &LatencySummary::max_us}};

nlohmann::json LatencyJson(const LatencySummary& s) {
  nlohmann::json j = {{"count", s.count}};
  for (const auto& [name, field] : kLatencyFields) j[name] = s.*field;
  return j;
}

nlohmann::json ServerStatsJson(const ServerStatsReport& s) {
  return {{"model", s.model},
          {"inference_count", s.inference_count},
          {"execution_count", s.execution_count},
          {"success_count", s.success_count},
          {"request_us", s.request_us},
          {"overhead_us", s.overhead_us},
          {"queue_us", s.queue_us},
          {"compute_input_us", s.compute_input_us},
          {"compute_infer_us", s.compute_infer_us},
          {"compute_output_us", s.compute_output_us}};
}

nlohmann::json StabilityJson(const StabilityReport& s) {
  return {{"percent", s.percent},
          {"max_windows", s.max_windows},
          {"window_s", s.window_s},
          {"windows", s.window_qps.size()},
          {"compared_windows", s.compared_windows},
          {"stable", s.stable},
          {"window_qps", s.window_qps},
          {"window_mean_us", s.window_mean_us},
          {"qps_spread_percent", s.qps_spread_percent},
          {"latency_spread_percent", s.latency_spread_percent}};
}

// "stable after 4 windows of 2.00 s: ..." or "UNSTABLE after 10 ...".
std::string StabilityLine(const StabilityReport& s) {
  return absl::StrFormat(
      "%s after %d windows of %.2f s: throughput varied %.1f%%, mean "
      "latency %.1f%% over the last %d (limit: less than %g%%)",
      s.stable ? "stable" : "UNSTABLE", s.window_qps.size(), s.window_s,
      s.qps_spread_percent, s.latency_spread_percent, s.compared_windows,
      s.percent);
}

// perf_analyzer's "Server:" section in two lines.
std::string ServerStatsText(const ServerStatsReport& s) {
  return absl::StrFormat(
      "server      model %s: %d inferences, %d executions, %d successful "
      "requests\n"
      "            avg request %.1f us (overhead %.1f us + queue %.1f us + "
      "compute input %.1f us + compute infer %.1f us + compute output %.1f "
      "us)\n",
      s.model, s.inference_count, s.execution_count, s.success_count,
      s.request_us, s.overhead_us, s.queue_us, s.compute_input_us,
      s.compute_infer_us, s.compute_output_us);
}

// Each failing code: its count and first message, when and from where.
void AppendErrorLines(const BenchReport& r, std::string* out) {
  for (const auto& [code, count] : r.errors) {
    const auto message = r.error_messages.find(code);
    absl::StrAppendFormat(
        out, "  %-22s %d  %s\n", code, count,
        message != r.error_messages.end() ? message->second : "");
    const auto at = r.error_first_at_s.find(code);
    if (at == r.error_first_at_s.end()) continue;
    const auto peer = r.error_first_peer.find(code);
    const std::string from =
        peer != r.error_first_peer.end() && !peer->second.empty()
            ? absl::StrCat(" from ", peer->second)
            : "";
    absl::StrAppendFormat(out, "  %-22s first at %.3f s%s\n", "", at->second,
                          from);
  }
}

nlohmann::json ReportJson(const BenchReport& r) {
  nlohmann::json j = {
      {"rpc", r.rpc},
      {"workload", r.workload},
      {"request_bytes", r.request_bytes},
      {"mode", r.target_rate > 0 ? "open" : "closed"},
      {"concurrency", r.concurrency},
      {"connections", r.connections},
      {"warmup_s", r.warmup_s},
      {"start_unix_s", r.start_unix_s},
      {"requests", r.requests},
      {"ok", r.ok},
      {"errors", r.errors},
      {"error_messages", r.error_messages},
      {"error_first_at_s", r.error_first_at_s},
      {"error_first_peer", r.error_first_peer},
      {"duration_s", r.duration_s},
      {"qps", r.qps},
      {"steps_per_request", r.steps_per_request},
      {"steps_per_s", r.qps * r.steps_per_request},
      {"layers", r.layers},
      {"tokens_per_s",
       r.qps * r.steps_per_request / std::max<int64_t>(r.layers, 1)},
      {"latency_us", LatencyJson(r.latency)},
      {"client_cpu_cores", r.client_cpu_cores},
      {"client_cores_available", r.client_cores_available},
      {"client_cpu_us_per_request", r.client_cpu_us_per_request},
      {"client_busiest_thread", r.client_busiest_thread},
      {"client_saturated", r.client_saturated},
  };
  if (!r.step.empty()) j["step"] = r.step;
  if (r.target_rate > 0) {
    j["target_rate"] = r.target_rate;
    j["arrival"] = r.arrival;
    j["late"] = r.late;
    j["late_share"] = r.requests > 0 ? double(r.late) / r.requests : 0.0;
    j["late_threshold_ms"] = r.late_threshold_ms;
  }
  if (r.server_compute) {
    j["server_compute_us"] = LatencyJson(*r.server_compute);
  }
  if (r.server_stats) j["server_stats"] = ServerStatsJson(*r.server_stats);
  if (!r.server_stats_note.empty()) {
    j["server_stats_note"] = r.server_stats_note;
  }
  if (r.stability) j["stability"] = StabilityJson(*r.stability);
  return j;
}

// One CSV column: its header and how a report's row shows it.
struct CsvColumn {
  std::string header;
  std::function<std::string(const BenchReport&)> value;
};

std::string CsvTable(const std::vector<CsvColumn>& columns,
                     const std::vector<BenchReport>& reports) {
  std::string out = absl::StrJoin(
      columns, ",", [](std::string* line, const CsvColumn& column) {
        line->append(column.header);
      });
  out += "\n";
  for (const BenchReport& r : reports) {
    absl::StrAppend(&out,
                    absl::StrJoin(columns, ",",
                                  [&r](std::string* line, const CsvColumn& c) {
                                    line->append(c.value(r));
                                  }),
                    "\n");
  }
  return out;
}

std::string Fixed(double value, int decimals) {
  return absl::StrFormat("%.*f", decimals, value);
}

std::vector<CsvColumn> NativeCsvColumns() {
  std::vector<CsvColumn> columns = {
      {"step", [](const BenchReport& r) { return r.step; }},
      {"rpc", [](const BenchReport& r) { return r.rpc; }},
      {"concurrency",
       [](const BenchReport& r) { return absl::StrCat(r.concurrency); }},
      {"connections",
       [](const BenchReport& r) { return absl::StrCat(r.connections); }},
      {"target_rate",
       [](const BenchReport& r) {
         return absl::StrFormat("%g", r.target_rate);
       }},
      {"requests",
       [](const BenchReport& r) { return absl::StrCat(r.requests); }},
      {"ok", [](const BenchReport& r) { return absl::StrCat(r.ok); }},
      {"errors",
       [](const BenchReport& r) { return absl::StrCat(TotalErrors(r)); }},
      {"duration_s",
       [](const BenchReport& r) { return Fixed(r.duration_s, 3); }},
      {"qps", [](const BenchReport& r) { return Fixed(r.qps, 1); }},
  };
  for (const auto& [name, field] : kLatencyFields) {
    columns.push_back(
        {absl::StrCat(name, "_us"), [field = field](const BenchReport& r) {
           return Fixed(r.latency.*field, 1);
         }});
  }
  for (const auto& [name, field] :
       {std::pair{"compute_p50_us", &LatencySummary::p50_us},
        std::pair{"compute_p99_us", &LatencySummary::p99_us}}) {
    columns.push_back(
        {name, [field = field](const BenchReport& r) {
           return Fixed(r.server_compute ? (*r.server_compute).*field : 0, 1);
         }});
  }
  columns.push_back(
      {"late", [](const BenchReport& r) { return absl::StrCat(r.late); }});
  columns.push_back({"client_cpu_cores", [](const BenchReport& r) {
                       return Fixed(r.client_cpu_cores, 2);
                     }});
  columns.push_back({"client_saturated", [](const BenchReport& r) {
                       return absl::StrCat(r.client_saturated ? 1 : 0);
                     }});
  return columns;
}

// Whole microseconds, as perf_analyzer writes every duration (truncated).
std::string WholeMicros(double micros) {
  return absl::StrCat(static_cast<int64_t>(std::max(micros, 0.0)));
}

// A server stage's average, 0 without the server's statistics.
CsvColumn ServerColumn(std::string header, double ServerStatsReport::*field) {
  return {std::move(header), [field](const BenchReport& r) {
            return WholeMicros(r.server_stats ? (*r.server_stats).*field : 0);
          }};
}

// perf_analyzer's "Network+Server Send/Recv": the client's mean latency less
// the server's queue and compute (and the client's send and receive, 0
// here), at least 0 since the two sides measure apart.
double NetworkMicros(const BenchReport& r) {
  if (!r.server_stats) return 0;
  const ServerStatsReport& s = *r.server_stats;
  return std::max(0.0, r.latency.mean_us - s.queue_us - s.compute_input_us -
                           s.compute_infer_us - s.compute_output_us);
}

std::vector<CsvColumn> PerfAnalyzerCsvColumns(CsvLevel level) {
  std::vector<CsvColumn> columns;
  if (level == CsvLevel::kConcurrency) {
    columns.push_back({"Concurrency", [](const BenchReport& r) {
                         return absl::StrCat(r.concurrency);
                       }});
  } else {
    columns.push_back({"Request Rate", [](const BenchReport& r) {
                         return absl::StrFormat("%g", r.target_rate);
                       }});
  }
  columns.push_back({"Inferences/Second", [](const BenchReport& r) {
                       return absl::StrFormat("%g", r.qps);
                     }});
  // The request is serialized once before the run and responses are not
  // parsed: attnctl has no per-call send or receive time to report.
  const auto unmeasured = [](const BenchReport&) { return std::string("0"); };
  columns.push_back({"Client Send", unmeasured});
  columns.push_back({"Network+Server Send/Recv", [](const BenchReport& r) {
                       return WholeMicros(NetworkMicros(r));
                     }});
  columns.push_back(ServerColumn("Server Queue", &ServerStatsReport::queue_us));
  columns.push_back(ServerColumn("Server Compute Input",
                                 &ServerStatsReport::compute_input_us));
  columns.push_back(ServerColumn("Server Compute Infer",
                                 &ServerStatsReport::compute_infer_us));
  columns.push_back(ServerColumn("Server Compute Output",
                                 &ServerStatsReport::compute_output_us));
  columns.push_back({"Client Recv", unmeasured});
  // perf_analyzer's percentiles, then the mean it adds with --verbose-csv.
  for (const auto& [header, field] :
       {std::pair{"p50 latency", &LatencySummary::p50_us},
        std::pair{"p90 latency", &LatencySummary::p90_us},
        std::pair{"p95 latency", &LatencySummary::p95_us},
        std::pair{"p99 latency", &LatencySummary::p99_us},
        std::pair{"Avg latency", &LatencySummary::mean_us}}) {
    columns.push_back({header, [field = field](const BenchReport& r) {
                         return WholeMicros(r.latency.*field);
                       }});
  }
  return columns;
}

// 1, 2 or 5 times a power of ten, about range / 5.
double TickStep(double range) {
  const double rough = range / 5;
  const double power = std::pow(10.0, std::floor(std::log10(rough)));
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * power >= rough) return m * power;
  }
  return 10 * power;
}

std::string Escape(absl::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

}  // namespace

LatencySummary Summarize(const LatencyHistogram& h) {
  LatencySummary s;
  s.count = h.count();
  s.min_us = Micros(h.min());
  s.mean_us = h.mean() / 1000.0;
  s.stddev_us = h.stddev() / 1000.0;
  s.p50_us = Micros(h.Percentile(50));
  s.p90_us = Micros(h.Percentile(90));
  s.p95_us = Micros(h.Percentile(95));
  s.p99_us = Micros(h.Percentile(99));
  s.p999_us = Micros(h.Percentile(99.9));
  s.max_us = Micros(h.max());
  return s;
}

absl::StatusOr<ReportFormat> ParseReportFormat(absl::string_view name) {
  if (name == "text") return ReportFormat::kText;
  if (name == "json") return ReportFormat::kJson;
  if (name == "csv") return ReportFormat::kCsv;
  return absl::InvalidArgumentError(
      absl::StrCat("--format: '", name, "' is not one of text, json, csv"));
}

std::string FormatText(const BenchReport& r) {
  std::string out;
  absl::StrAppend(&out, r.rpc, " ", r.workload, " (", r.request_bytes,
                  " request bytes)\n");
  if (r.target_rate > 0) {
    absl::StrAppendFormat(&out,
                          "open loop: %.1f req/s %s arrivals, at most %d "
                          "outstanding over %d connections",
                          r.target_rate, r.arrival, r.concurrency,
                          r.connections);
  } else {
    absl::StrAppendFormat(&out,
                          "closed loop: %d calls in flight over %d "
                          "connections",
                          r.concurrency, r.connections);
  }
  absl::StrAppendFormat(&out, ", %.2f s measured after %.2f s warm-up\n",
                        r.duration_s, r.warmup_s);
  if (r.stability) {
    absl::StrAppend(&out, "stability   ", StabilityLine(*r.stability), "\n");
  }
  absl::StrAppendFormat(&out, "requests    %d (ok %d, errors %d)\n", r.requests,
                        r.ok, TotalErrors(r));
  AppendErrorLines(r, &out);
  absl::StrAppendFormat(&out, "throughput  %.1f req/s\n", r.qps);
  if (r.steps_per_request > 1 || r.layers > 1) {
    const double steps = r.qps * r.steps_per_request;
    absl::StrAppendFormat(&out, "            %.1f steps/s (%s a call)\n", steps,
                          r.steps_per_request == 1
                              ? std::string("one step")
                              : absl::StrCat(r.steps_per_request, " steps"));
    if (r.layers > 1) {
      absl::StrAppendFormat(
          &out, "            %.1f tokens/s (%d layer steps a token)\n",
          steps / r.layers, r.layers);
    }
  }
  const LatencySummary& l = r.latency;
  absl::StrAppend(&out, "latency     min ", Millis(l.min_us), "  mean ",
                  Millis(l.mean_us), "  stddev ", Millis(l.stddev_us), "\n");
  absl::StrAppend(&out, "            p50 ", Millis(l.p50_us), "  p90 ",
                  Millis(l.p90_us), "  p95 ", Millis(l.p95_us), "\n");
  absl::StrAppend(&out, "            p99 ", Millis(l.p99_us), "  p99.9 ",
                  Millis(l.p999_us), "  max ", Millis(l.max_us), "\n");
  if (r.server_compute) {
    const LatencySummary& c = *r.server_compute;
    absl::StrAppend(&out, "server compute (attnserve-compute-us): mean ",
                    Millis(c.mean_us), "  p50 ", Millis(c.p50_us), "  p99 ",
                    Millis(c.p99_us), "\n");
  }
  if (r.server_stats) {
    absl::StrAppend(&out, ServerStatsText(*r.server_stats));
  } else if (!r.server_stats_note.empty()) {
    absl::StrAppend(&out, "server      ", r.server_stats_note, "\n");
  }
  if (r.target_rate > 0) {
    absl::StrAppendFormat(
        &out, "late sends  %d (%.2f%% sent more than %.1f ms after schedule)\n",
        r.late, r.requests > 0 ? 100.0 * r.late / r.requests : 0.0,
        r.late_threshold_ms);
  }
  absl::StrAppendFormat(
      &out,
      "client CPU  %.2f of %d cores, %.1f us per request, busiest thread "
      "%.0f%%\n",
      r.client_cpu_cores, r.client_cores_available, r.client_cpu_us_per_request,
      100 * r.client_busiest_thread);
  if (r.client_saturated) {
    absl::StrAppend(&out,
                    "WARNING: the client is saturated (nearly all its cores, "
                    "or a call-driving thread always busy): these figures "
                    "measure the client, not the server. Give it more "
                    "--connections/--client_threads, other cores (taskset) "
                    "or another machine.\n");
  }
  return out;
}

std::string FormatJson(const std::vector<BenchReport>& reports) {
  if (reports.size() == 1) return ReportJson(reports[0]).dump(2) + "\n";
  nlohmann::json array = nlohmann::json::array();
  for (const BenchReport& r : reports) array.push_back(ReportJson(r));
  return array.dump(2) + "\n";
}

std::string FormatCsv(const std::vector<BenchReport>& reports) {
  return CsvTable(NativeCsvColumns(), reports);
}

std::string FormatPerfAnalyzerCsv(const std::vector<BenchReport>& reports,
                                  CsvLevel level) {
  return CsvTable(PerfAnalyzerCsvColumns(level), reports);
}

std::string FormatSweepTable(const std::vector<BenchReport>& reports) {
  std::string out = absl::StrFormat(
      "%-18s %10s %10s %10s %10s %10s %8s %7s %s\n", "step", "req/s", "p50 ms",
      "p90 ms", "p99 ms", "p99.9 ms", "errors", "late%", "client");
  for (const BenchReport& r : reports) {
    const LatencySummary& l = r.latency;
    absl::StrAppendFormat(
        &out, "%-18s %10.1f %10.3f %10.3f %10.3f %10.3f %8d %7.2f %s\n", r.step,
        r.qps, l.p50_us / 1e3, l.p90_us / 1e3, l.p99_us / 1e3, l.p999_us / 1e3,
        TotalErrors(r), r.requests > 0 ? 100.0 * r.late / r.requests : 0.0,
        r.client_saturated ? "SATURATED" : "ok");
  }
  for (const BenchReport& r : reports) {
    if (r.server_stats) {
      const ServerStatsReport& s = *r.server_stats;
      absl::StrAppendFormat(
          &out,
          "%s: server %s avg request %.1f us: queue %.1f + compute input %.1f "
          "+ infer %.1f + output %.1f us\n",
          r.step, s.model, s.request_us, s.queue_us, s.compute_input_us,
          s.compute_infer_us, s.compute_output_us);
    }
    if (r.stability) {
      absl::StrAppend(&out, r.step, ": ", StabilityLine(*r.stability), "\n");
    }
  }
  return out;
}

namespace {

// The chart's page and margins, in SVG user units.
constexpr double kWidth = 800, kHeight = 500;
constexpr double kLeft = 70, kRight = 130, kTop = 40, kBottom = 60;
constexpr double kPlotW = kWidth - kLeft - kRight;
constexpr double kPlotH = kHeight - kTop - kBottom;

// A latency percentile drawn as one line.
struct Series {
  const char* name;
  const char* color;
  double LatencySummary::*field;
};
constexpr Series kSeries[] = {{"p50", "#1f77b4", &LatencySummary::p50_us},
                              {"p90", "#2ca02c", &LatencySummary::p90_us},
                              {"p99", "#ff7f0e", &LatencySummary::p99_us},
                              {"p99.9", "#d62728", &LatencySummary::p999_us}};

// The axes: requests/s across, milliseconds up, both from 0 to a round
// value a little above the largest point.
struct Axes {
  double x_step, y_step, x_max, y_max;
  double X(double qps) const { return kLeft + qps / x_max * kPlotW; }
  double Y(double ms) const { return kTop + kPlotH - ms / y_max * kPlotH; }
};

Axes AxesFor(const std::vector<BenchReport>& reports) {
  double max_qps = 0, max_ms = 0;
  for (const BenchReport& r : reports) {
    max_qps = std::max(max_qps, r.qps);
    max_ms = std::max(max_ms, r.latency.p999_us / 1e3);
  }
  Axes axes;
  axes.x_step = TickStep(max_qps > 0 ? max_qps * 1.05 : 1);
  axes.y_step = TickStep(max_ms > 0 ? max_ms * 1.05 : 1);
  axes.x_max =
      std::ceil(std::max(max_qps, 1e-9) * 1.05 / axes.x_step) * axes.x_step;
  axes.y_max =
      std::ceil(std::max(max_ms, 1e-9) * 1.05 / axes.y_step) * axes.y_step;
  return axes;
}

// Grid lines with their tick labels, the plot's frame and the axis titles.
void AppendGrid(const Axes& axes, std::string* svg) {
  for (double x = 0; x <= axes.x_max + axes.x_step / 2; x += axes.x_step) {
    absl::StrAppendFormat(
        svg,
        "<line x1=\"%.1f\" y1=\"%g\" x2=\"%.1f\" y2=\"%g\" stroke=\"#ddd\"/>"
        "<text x=\"%.1f\" y=\"%g\" text-anchor=\"middle\">%g</text>\n",
        axes.X(x), kTop, axes.X(x), kTop + kPlotH, axes.X(x),
        kTop + kPlotH + 18, x);
  }
  for (double y = 0; y <= axes.y_max + axes.y_step / 2; y += axes.y_step) {
    absl::StrAppendFormat(
        svg,
        "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#ddd\"/>"
        "<text x=\"%g\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
        kLeft, axes.Y(y), kLeft + kPlotW, axes.Y(y), kLeft - 6, axes.Y(y) + 4,
        y);
  }
  absl::StrAppendFormat(
      svg,
      "<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"none\" "
      "stroke=\"black\"/>\n"
      "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">throughput "
      "(requests/s)</text>\n"
      "<text transform=\"translate(18 %g) rotate(-90)\" "
      "text-anchor=\"middle\">latency (ms)</text>\n",
      kLeft, kTop, kPlotW, kPlotH, kLeft + kPlotW / 2, kHeight - 15,
      kTop + kPlotH / 2);
}

// Series number `index`: its line through the steps, a dot on each step and
// its legend entry.
void AppendSeries(const Axes& axes, const std::vector<BenchReport>& reports,
                  size_t index, std::string* svg) {
  const Series& line = kSeries[index];
  std::vector<std::string> points;
  for (const BenchReport& r : reports) {
    points.push_back(absl::StrFormat("%.1f,%.1f", axes.X(r.qps),
                                     axes.Y(r.latency.*line.field / 1e3)));
  }
  absl::StrAppendFormat(svg,
                        "<polyline class=\"%s\" fill=\"none\" stroke=\"%s\" "
                        "stroke-width=\"2\" points=\"%s\"/>\n",
                        line.name, line.color, absl::StrJoin(points, " "));
  // The dots reuse the rounded coordinates so that they sit on the line.
  for (const std::string& point : points) {
    const size_t comma = point.find(',');
    absl::StrAppendFormat(
        svg, "<circle cx=\"%s\" cy=\"%s\" r=\"3\" fill=\"%s\"/>\n",
        point.substr(0, comma), point.substr(comma + 1), line.color);
  }
  const double legend_y = kTop + 10 + 20 * index;
  absl::StrAppendFormat(
      svg,
      "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"%s\" "
      "stroke-width=\"2\"/><text x=\"%g\" y=\"%g\">%s</text>\n",
      kLeft + kPlotW + 12, legend_y, kLeft + kPlotW + 36, legend_y, line.color,
      kLeft + kPlotW + 42, legend_y + 4, line.name);
}

// Each step's name beside its p99 point.
void AppendStepLabels(const Axes& axes, const std::vector<BenchReport>& reports,
                      std::string* svg) {
  for (const BenchReport& r : reports) {
    absl::StrAppendFormat(svg,
                          "<text class=\"step\" x=\"%.1f\" y=\"%.1f\" "
                          "font-size=\"10\">%s</text>\n",
                          axes.X(r.qps) + 5, axes.Y(r.latency.p99_us / 1e3) - 5,
                          Escape(r.step));
  }
}

}  // namespace

std::string RenderSweepSvg(const std::vector<BenchReport>& reports,
                           absl::string_view title) {
  const Axes axes = AxesFor(reports);
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" "
      "viewBox=\"0 0 %g %g\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%g\" y=\"22\" font-size=\"15\">%s</text>\n",
      kWidth, kHeight, kWidth, kHeight, kLeft, Escape(title));
  AppendGrid(axes, &svg);
  for (size_t s = 0; s < std::size(kSeries); ++s) {
    AppendSeries(axes, reports, s, &svg);
  }
  AppendStepLabels(axes, reports, &svg);
  svg += "</svg>\n";
  return svg;
}

}  // namespace attnserve
