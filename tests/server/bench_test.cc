// attnctl bench's pieces: the latency histogram, the arrival schedule, the
// reports and chart, the workloads, and load tests against a live server.
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/bench/arrivals.h"
#include "client/bench/command.h"
#include "client/bench/histogram.h"
#include "client/bench/load.h"
#include "client/bench/report.h"
#include "client/bench/server_stats.h"
#include "client/bench/stability.h"
#include "client/bench/workload.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using testing::TestServer;

// ---- LatencyHistogram ----

TEST(LatencyHistogramTest, BucketsTileTheRangeWithinOnePercent) {
  int64_t expected_low = 0;
  for (int b = 0; b < LatencyHistogram::BucketOf(int64_t{1} << 62); ++b) {
    ASSERT_EQ(LatencyHistogram::BucketLow(b), expected_low) << b;
    const int64_t width = LatencyHistogram::BucketWidth(b);
    if (expected_low >= 256) {
      ASSERT_LE(static_cast<double>(width) / expected_low, 1.0 / 128) << b;
    }
    ASSERT_EQ(LatencyHistogram::BucketOf(expected_low), b);
    ASSERT_EQ(LatencyHistogram::BucketOf(expected_low + width - 1), b);
    expected_low += width;
  }
  EXPECT_EQ(LatencyHistogram::BucketOf(-5), 0);
  const int64_t largest = std::numeric_limits<int64_t>::max();
  EXPECT_GE(largest,
            LatencyHistogram::BucketLow(LatencyHistogram::BucketOf(largest)));
}

TEST(LatencyHistogramTest, PercentilesAreWithinOnePercentOfExact) {
  std::mt19937_64 random(7);
  // Latencies spread over five decades: 1 us .. 100 ms.
  std::uniform_real_distribution<double> log_ns(3, 8);
  std::vector<int64_t> values(100000);
  LatencyHistogram histogram;
  for (int64_t& v : values) {
    v = static_cast<int64_t>(std::pow(10.0, log_ns(random)));
    histogram.Record(v);
  }
  std::sort(values.begin(), values.end());
  for (double p : {1.0, 10.0, 50.0, 90.0, 95.0, 99.0, 99.9, 99.99, 100.0}) {
    const size_t rank = static_cast<size_t>(std::ceil(p / 100 * values.size()));
    const double exact = values[std::max<size_t>(rank, 1) - 1];
    EXPECT_NEAR(histogram.Percentile(p), exact, exact * 0.01) << "p" << p;
  }
  EXPECT_EQ(histogram.count(), 100000);
  EXPECT_EQ(histogram.min(), values.front());
  EXPECT_EQ(histogram.max(), values.back());
  const double mean =
      std::accumulate(values.begin(), values.end(), 0.0) / values.size();
  EXPECT_NEAR(histogram.mean(), mean, mean * 1e-9);
  double squares = 0;
  for (int64_t v : values) squares += (v - mean) * (v - mean);
  const double stddev = std::sqrt(squares / (values.size() - 1));
  EXPECT_NEAR(histogram.stddev(), stddev, stddev * 0.01);
}

TEST(LatencyHistogramTest, SmallValuesAreExactAndEmptyIsZero) {
  LatencyHistogram histogram;
  EXPECT_EQ(histogram.Percentile(50), 0);
  EXPECT_EQ(histogram.min(), 0);
  EXPECT_EQ(histogram.mean(), 0);
  for (int64_t v : {3, 100, 200, 255}) histogram.Record(v);
  EXPECT_EQ(histogram.Percentile(25), 3);
  EXPECT_EQ(histogram.Percentile(50), 100);
  EXPECT_EQ(histogram.Percentile(75), 200);
  EXPECT_EQ(histogram.Percentile(100), 255);
}

TEST(LatencyHistogramTest, ConcurrentRecordsAndMergeLoseNothing) {
  LatencyHistogram shared, merged;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&shared, t] {
      for (int i = 0; i < 50000; ++i) shared.Record(1000 * (t + 1) + i % 7);
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(shared.count(), 200000);
  EXPECT_EQ(shared.min(), 1000);
  EXPECT_EQ(shared.max(), 4006);
  LatencyHistogram other;
  other.Record(10);
  other.Record(1'000'000);
  merged.Merge(shared);
  merged.Merge(other);
  EXPECT_EQ(merged.count(), 200002);
  EXPECT_EQ(merged.min(), 10);
  EXPECT_EQ(merged.max(), 1'000'000);
  EXPECT_EQ(merged.Percentile(50), shared.Percentile(50));
}

// ---- ArrivalSchedule ----

TEST(ArrivalScheduleTest, ConstantArrivalsAreEvenlySpaced) {
  ArrivalSchedule schedule(Arrival::kConstant, 400);
  for (int i = 0; i < 10000; ++i) {
    ASSERT_EQ(schedule.Next(), absl::Seconds(i / 400.0)) << i;
  }
}

TEST(ArrivalScheduleTest, PoissonGapsAreExponentialAtTheRate) {
  ArrivalSchedule schedule(Arrival::kPoisson, 1000, 42);
  std::vector<double> gaps;
  absl::Duration previous = schedule.Next();
  EXPECT_EQ(previous, absl::ZeroDuration());
  for (int i = 0; i < 200000; ++i) {
    const absl::Duration next = schedule.Next();
    ASSERT_GE(next, previous);
    gaps.push_back(absl::ToDoubleSeconds(next - previous));
    previous = next;
  }
  const double mean =
      std::accumulate(gaps.begin(), gaps.end(), 0.0) / gaps.size();
  double squares = 0;
  for (double g : gaps) squares += (g - mean) * (g - mean);
  const double cv = std::sqrt(squares / gaps.size()) / mean;
  EXPECT_NEAR(mean, 1e-3, 1e-3 * 0.01);
  EXPECT_NEAR(cv, 1.0, 0.02);  // an exponential's stddev equals its mean
  // A gap shorter than the mean for 1 - 1/e of arrivals.
  const double short_share = std::count_if(gaps.begin(), gaps.end(),
                                           [](double g) { return g < 1e-3; }) /
                             static_cast<double>(gaps.size());
  EXPECT_NEAR(short_share, 1 - std::exp(-1.0), 0.01);
  // The same seed, the same schedule.
  ArrivalSchedule again(Arrival::kPoisson, 1000, 42);
  ArrivalSchedule first(Arrival::kPoisson, 1000, 42);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(again.Next(), first.Next());
}

TEST(ArrivalScheduleTest, ParsesNames) {
  EXPECT_EQ(*ParseArrival("poisson"), Arrival::kPoisson);
  EXPECT_EQ(*ParseArrival("constant"), Arrival::kConstant);
  EXPECT_EQ(ParseArrival("bursty").status().message(),
            "--arrival: 'bursty' is not one of constant, poisson");
}

// ---- Reports ----

BenchReport SampleReport(const std::string& step, double qps, double p50_ms) {
  BenchReport r;
  r.step = step;
  r.rpc = "LayerNorm";
  r.workload = "input=[1, 64] FLOAT32";
  r.request_bytes = 802;
  r.concurrency = 8;
  r.connections = 2;
  r.requests = 1000;
  r.ok = 990;
  r.errors = {{"UNAVAILABLE", 10}};
  r.error_messages = {{"UNAVAILABLE", "connection refused"}};
  r.start_unix_s = 1.7e9;
  r.error_first_at_s = {{"UNAVAILABLE", 7.25}};
  r.error_first_peer = {{"UNAVAILABLE", "ipv4:127.0.0.1:50051"}};
  r.duration_s = 1000 / qps;
  r.qps = qps;
  r.latency.count = 1000;
  r.latency.p50_us = p50_ms * 1e3;
  r.latency.p90_us = p50_ms * 1.5e3;
  r.latency.p99_us = p50_ms * 2e3;
  r.latency.p999_us = p50_ms * 4e3;
  r.latency.max_us = p50_ms * 5e3;
  r.client_cpu_cores = 0.5;
  r.client_cores_available = 2;
  return r;
}

TEST(BenchReportTest, JsonHasEveryFigure) {
  BenchReport report = SampleReport("", 5000, 0.5);
  report.server_compute = LatencySummary{1000, 1, 2, 1, 2, 3, 3, 4, 5, 6};
  report.target_rate = 6000;
  report.arrival = "poisson";
  report.late = 25;
  const auto json = nlohmann::json::parse(FormatJson({report}));
  EXPECT_EQ(json["rpc"], "LayerNorm");
  EXPECT_EQ(json["mode"], "open");
  EXPECT_EQ(json["requests"], 1000);
  EXPECT_EQ(json["ok"], 990);
  EXPECT_EQ(json["errors"]["UNAVAILABLE"], 10);
  EXPECT_EQ(json["error_messages"]["UNAVAILABLE"], "connection refused");
  EXPECT_EQ(json["start_unix_s"], 1.7e9);
  EXPECT_EQ(json["error_first_at_s"]["UNAVAILABLE"], 7.25);
  EXPECT_EQ(json["error_first_peer"]["UNAVAILABLE"], "ipv4:127.0.0.1:50051");
  EXPECT_EQ(json["qps"], 5000);
  EXPECT_EQ(json["latency_us"]["p50"], 500);
  EXPECT_EQ(json["latency_us"]["p999"], 2000);
  EXPECT_EQ(json["server_compute_us"]["p99"], 4);
  EXPECT_EQ(json["late"], 25);
  EXPECT_DOUBLE_EQ(json["late_share"], 0.025);
  EXPECT_EQ(json["arrival"], "poisson");
  const auto sweep = nlohmann::json::parse(
      FormatJson({SampleReport("concurrency=1", 100, 1),
                  SampleReport("concurrency=2", 200, 1)}));
  ASSERT_TRUE(sweep.is_array());
  EXPECT_EQ(sweep[1]["step"], "concurrency=2");
}

TEST(BenchReportTest, CsvRowsMatchTheHeader) {
  const std::string csv = FormatCsv(
      {SampleReport("rate=10", 10, 1), SampleReport("rate=20", 20, 2)});
  const std::vector<std::string> lines =
      absl::StrSplit(csv, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u);
  const std::vector<std::string> header = absl::StrSplit(lines[0], ',');
  for (int i = 1; i < 3; ++i) {
    const std::vector<std::string> row = absl::StrSplit(lines[i], ',');
    ASSERT_EQ(row.size(), header.size()) << lines[i];
    EXPECT_EQ(row[0], i == 1 ? "rate=10" : "rate=20");
    const auto qps = std::find(header.begin(), header.end(), "qps");
    EXPECT_EQ(std::stod(row[qps - header.begin()]), i * 10);
    const auto errors = std::find(header.begin(), header.end(), "errors");
    EXPECT_EQ(row[errors - header.begin()], "10");
  }
}

TEST(BenchReportTest, TextWarnsWhenTheClientIsTheLimit) {
  BenchReport report = SampleReport("", 5000, 0.5);
  std::string text = FormatText(report);
  EXPECT_THAT(text, HasSubstr("throughput  5000.0 req/s"));
  EXPECT_THAT(text, HasSubstr("UNAVAILABLE"));
  EXPECT_THAT(text, HasSubstr("first at 7.250 s from ipv4:127.0.0.1:50051\n"));
  EXPECT_THAT(text, HasSubstr("p50 0.500 ms"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("WARNING")));
  report.client_saturated = true;
  EXPECT_THAT(FormatText(report),
              HasSubstr("WARNING: the client is saturated"));
}

TEST(BenchReportTest, SweepChartPlotsEveryPercentileAtEveryStep) {
  const std::vector<BenchReport> reports = {
      SampleReport("concurrency=1", 1000, 0.5),
      SampleReport("concurrency=2", 1800, 0.6),
      SampleReport("concurrency=4", 2500, 1.0)};
  const std::string svg = RenderSweepSvg(reports, "LayerNorm <tiny>");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_THAT(svg, HasSubstr("LayerNorm &lt;tiny&gt;"));
  EXPECT_THAT(svg, HasSubstr("</svg>"));
  for (const auto& r : reports) EXPECT_THAT(svg, HasSubstr(r.step));
  std::vector<std::vector<std::pair<double, double>>> lines;
  for (size_t at = svg.find("<polyline "); at != std::string::npos;
       at = svg.find("<polyline ", at + 1)) {
    const size_t begin = svg.find("points=\"", at) + 8;
    const std::string coordinates =
        svg.substr(begin, svg.find('"', begin) - begin);
    std::vector<std::pair<double, double>> points;
    for (absl::string_view point : absl::StrSplit(coordinates, ' ')) {
      const std::vector<std::string> xy = absl::StrSplit(point, ',');
      points.emplace_back(std::stod(xy[0]), std::stod(xy[1]));
    }
    lines.push_back(points);
  }
  ASSERT_EQ(lines.size(), 4u);  // p50, p90, p99, p99.9
  for (const auto& points : lines) {
    ASSERT_EQ(points.size(), 3u);
    for (const auto& [x, y] : points) {
      EXPECT_GT(x, 0);
      EXPECT_LT(x, 800);
      EXPECT_GT(y, 0);
      EXPECT_LT(y, 500);
    }
    // More throughput to the right, more latency higher up (smaller y).
    EXPECT_LT(points[0].first, points[2].first);
    EXPECT_GT(points[0].second, points[2].second);
  }
  // At each step p99.9 is drawn above p50.
  for (int i = 0; i < 3; ++i) EXPECT_LT(lines[3][i].second, lines[0][i].second);
}

// perf_analyzer's CSV header, as its `-f FILE` writes it (with the mean of
// its --verbose-csv).
constexpr char kPerfAnalyzerColumns[] =
    "Network+Server Send/Recv,Server Queue,Server Compute Input,"
    "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,"
    "p90 latency,p95 latency,p99 latency,Avg latency";

// The cells of a CSV line by the header's column names.
std::map<std::string, std::string> CsvRow(const std::string& header,
                                          const std::string& line) {
  const std::vector<std::string> names = absl::StrSplit(header, ',');
  const std::vector<std::string> cells = absl::StrSplit(line, ',');
  EXPECT_EQ(names.size(), cells.size()) << line;
  std::map<std::string, std::string> row;
  for (size_t i = 0; i < names.size() && i < cells.size(); ++i) {
    row[names[i]] = cells[i];
  }
  return row;
}

ServerStatsReport SampleServerStats() {
  ServerStatsReport s;
  s.model = "layer_norm";
  s.inference_count = s.execution_count = s.success_count = 990;
  s.request_us = 300.9;
  s.queue_us = 100.7;
  s.compute_input_us = 0;
  s.compute_infer_us = 150.2;
  s.compute_output_us = 40.5;
  s.overhead_us = 9.5;
  return s;
}

TEST(BenchReportTest, PerfAnalyzerCsvHasItsColumnsInMicroseconds) {
  BenchReport with_server = SampleReport("concurrency=8", 5000, 0.5);
  with_server.latency.mean_us = 600.9;
  with_server.server_stats = SampleServerStats();
  BenchReport without = SampleReport("concurrency=16", 5500.5, 1);
  without.concurrency = 16;
  without.latency.mean_us = 1000;
  without.server_stats_note = "no server statistics: ...";
  const std::vector<std::string> lines = absl::StrSplit(
      FormatPerfAnalyzerCsv({with_server, without}, CsvLevel::kConcurrency),
      '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], absl::StrCat("Concurrency,Inferences/Second,Client Send,",
                                   kPerfAnalyzerColumns));
  auto row = CsvRow(lines[0], lines[1]);
  EXPECT_EQ(row["Concurrency"], "8");
  EXPECT_EQ(row["Inferences/Second"], "5000");
  EXPECT_EQ(row["Client Send"], "0");
  EXPECT_EQ(row["Client Recv"], "0");
  // The client's mean less the server's queue and compute, truncated.
  EXPECT_EQ(row["Network+Server Send/Recv"], "309");
  EXPECT_EQ(row["Server Queue"], "100");
  EXPECT_EQ(row["Server Compute Input"], "0");
  EXPECT_EQ(row["Server Compute Infer"], "150");
  EXPECT_EQ(row["Server Compute Output"], "40");
  EXPECT_EQ(row["p50 latency"], "500");
  EXPECT_EQ(row["p90 latency"], "750");
  EXPECT_EQ(row["p99 latency"], "1000");
  EXPECT_EQ(row["Avg latency"], "600");
  // Without the server's statistics its columns are 0, as perf_analyzer
  // writes what it did not measure.
  row = CsvRow(lines[0], lines[2]);
  EXPECT_EQ(row["Concurrency"], "16");
  EXPECT_EQ(row["Inferences/Second"], "5500.5");
  for (const char* column :
       {"Network+Server Send/Recv", "Server Queue", "Server Compute Input",
        "Server Compute Infer", "Server Compute Output"}) {
    EXPECT_EQ(row[column], "0") << column;
  }
  EXPECT_EQ(row["Avg latency"], "1000");

  without.target_rate = 250.5;
  const std::string by_rate =
      FormatPerfAnalyzerCsv({without}, CsvLevel::kRequestRate);
  EXPECT_EQ(by_rate.substr(0, by_rate.find('\n')),
            absl::StrCat("Request Rate,Inferences/Second,Client Send,",
                         kPerfAnalyzerColumns));
  EXPECT_EQ(by_rate.substr(by_rate.find('\n') + 1, 6), "250.5,");
}

TEST(BenchReportTest, TextAndJsonShowServerStatsAndStability) {
  BenchReport report = SampleReport("", 5000, 0.5);
  report.server_stats = SampleServerStats();
  StabilityReport stability;
  stability.percent = 10;
  stability.max_windows = 10;
  stability.window_s = 2;
  stability.stable = true;
  stability.window_qps = {4000, 5000, 5100, 4950};
  stability.window_mean_us = {700, 510, 500, 505};
  stability.compared_windows = 3;
  stability.qps_spread_percent = 3.03;
  stability.latency_spread_percent = 2;
  report.stability = stability;
  const std::string text = FormatText(report);
  EXPECT_THAT(text, HasSubstr("stability   stable after 4 windows of 2.00 s: "
                              "throughput varied 3.0%, mean latency 2.0% over "
                              "the last 3 (limit: less than 10%)\n"));
  EXPECT_THAT(text,
              HasSubstr("server      model layer_norm: 990 inferences, 990 "
                        "executions, 990 successful requests\n"));
  EXPECT_THAT(text, HasSubstr("avg request 300.9 us (overhead 9.5 us + queue "
                              "100.7 us + compute input 0.0 us + compute "
                              "infer 150.2 us + compute output 40.5 us)"));
  const auto json = nlohmann::json::parse(FormatJson({report}));
  EXPECT_EQ(json["server_stats"]["model"], "layer_norm");
  EXPECT_EQ(json["server_stats"]["success_count"], 990);
  EXPECT_EQ(json["server_stats"]["compute_infer_us"], 150.2);
  EXPECT_EQ(json["stability"]["windows"], 4);
  EXPECT_EQ(json["stability"]["stable"], true);
  EXPECT_EQ(json["stability"]["window_qps"][1], 5000);

  report.server_stats.reset();
  report.server_stats_note = "no server statistics: SessionStep calls ...";
  report.stability->stable = false;
  EXPECT_THAT(FormatText(report),
              HasSubstr("server      no server statistics: SessionStep"));
  EXPECT_THAT(FormatText(report), HasSubstr("stability   UNSTABLE after 4"));
  EXPECT_EQ(nlohmann::json::parse(FormatJson({report}))["server_stats_note"],
            "no server statistics: SessionStep calls ...");
}

// ---- Stability and the server's statistics ----

// A window's report with `qps` and a mean latency of `mean_us`.
BenchReport Window(double qps, double mean_us) {
  BenchReport window;
  window.qps = qps;
  window.latency.mean_us = mean_us;
  return window;
}

TEST(BenchStabilityTest, SpreadIsMaxOverMinOfTheLastThreeWindows) {
  EXPECT_EQ(SpreadPercent({}), 0);
  EXPECT_EQ(SpreadPercent({100}), 0);
  EXPECT_NEAR(SpreadPercent({1, 100, 110, 105}), 10, 1e-9);
  EXPECT_NEAR(SpreadPercent({200, 100}), 100, 1e-9);
  EXPECT_TRUE(std::isinf(SpreadPercent({5, 0, 5})));
  EXPECT_EQ(SpreadPercent({0, 0, 0}), 0);
}

TEST(BenchStabilityTest, StableOnceTheLastThreeWindowsAgree) {
  StabilityOptions options;
  options.percent = 10;
  StabilityTracker tracker(options, absl::Seconds(2));
  EXPECT_TRUE(tracker.Add(Window(500, 900)));    // 1 window: too few
  EXPECT_TRUE(tracker.Add(Window(1000, 500)));   // 2 windows: too few
  EXPECT_TRUE(tracker.Add(Window(1050, 480)));   // throughput: 110%
  EXPECT_TRUE(tracker.Add(Window(1000, 600)));   // latency: 25%
  EXPECT_TRUE(tracker.Add(Window(1020, 560)));   // latency: 25%
  EXPECT_FALSE(tracker.Add(Window(1010, 570)));  // 2% and 7.1%
  const StabilityReport& report = tracker.report();
  EXPECT_TRUE(report.stable);
  EXPECT_EQ(report.window_qps.size(), 6u);
  EXPECT_EQ(report.window_mean_us[5], 570);
  EXPECT_EQ(report.compared_windows, 3);
  EXPECT_NEAR(report.qps_spread_percent, 2, 1e-9);
  EXPECT_NEAR(report.latency_spread_percent, 100.0 * 600 / 560 - 100, 1e-9);
  EXPECT_EQ(report.window_s, 2);
  EXPECT_EQ(report.max_windows, kDefaultMaxTrials);
}

TEST(BenchStabilityTest, ZeroPercentAndIdleWindowsNeverSettle) {
  StabilityOptions exact;
  exact.percent = 0;
  StabilityTracker never(exact, absl::Seconds(1));
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(never.Add(Window(1000, 500)));
  EXPECT_FALSE(never.report().stable);
  StabilityOptions loose;
  loose.percent = 1000;
  StabilityTracker idle(loose, absl::Seconds(1));
  EXPECT_TRUE(idle.Add(Window(0, 0)));
  EXPECT_TRUE(idle.Add(Window(100, 5)));
  EXPECT_TRUE(idle.Add(Window(100, 5)));
  EXPECT_FALSE(idle.Add(Window(100, 5)));
}

TEST(BenchStabilityTest, RefusesFlagsItCannotRun) {
  LoadOptions load;
  const auto message = [&load](StabilityOptions options) {
    return std::string(VerifyStabilityOptions(options, load).message());
  };
  StabilityOptions options;
  EXPECT_TRUE(VerifyStabilityOptions(options, load).ok());
  options.max_trials = 5;
  EXPECT_EQ(message(options), "--max_trials: needs --stability_percent");
  options = {};
  options.window_s = 1;
  EXPECT_EQ(message(options), "--window_s: needs --stability_percent");
  options = {};
  options.percent = -1;
  EXPECT_EQ(message(options),
            "--stability_percent: must be a number >= 0, got -1");
  options.percent = 10;
  options.max_trials = 2;
  EXPECT_EQ(message(options),
            "--max_trials: 2 is not in [3, 100] (stability compares the last "
            "3 windows)");
  options.max_trials = 101;
  EXPECT_THAT(message(options), HasSubstr("--max_trials: 101 is not in"));
  options.max_trials = 3;
  options.window_s = 0;
  EXPECT_EQ(message(options), "--window_s: must be > 0, got 0");
  options.window_s = 0.5;
  EXPECT_TRUE(VerifyStabilityOptions(options, load).ok());
  load.requests = 100;
  EXPECT_THAT(message(options), HasSubstr("--requests: not with "
                                          "--stability_percent"));
  // The windows it asks for.
  load.requests = 0;
  const LoadOptions windowed = WithWindows(load, options);
  EXPECT_EQ(windowed.window, absl::Milliseconds(500));
  EXPECT_EQ(windowed.max_windows, 3);
  EXPECT_EQ(windowed.report_windows, kStabilityWindows);
  options.window_s.reset();
  EXPECT_EQ(WithWindows(load, options).window, load.duration);
  EXPECT_EQ(WithWindows(load, {}).window, absl::ZeroDuration());
}

TEST(BenchServerStatsTest, AveragesEachStageOverItsOwnCount) {
  ModelCounters before;
  before.inference_count = before.execution_count = 10;
  before.success = {10, 10'000'000};
  before.queue = {10, 1'000'000};
  before.compute_infer = {10, 5'000'000};
  before.compute_output = {10, 2'000'000};
  ModelCounters after = before;
  after.inference_count = after.execution_count = 110;
  after.success = {110, 40'000'000};  // 100 calls of 300 us
  after.queue = {110, 6'000'000};     // 50 us
  // A stage the server does not count: 0, not a division by zero.
  after.compute_input = {0, 0};
  after.compute_infer = {110, 25'000'000};  // 200 us
  after.compute_output = {110, 3'000'000};  // 10 us
  auto stats = StatsBetween("attend", before, after);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->model, "attend");
  EXPECT_EQ(stats->inference_count, 100);
  EXPECT_EQ(stats->execution_count, 100);
  EXPECT_EQ(stats->success_count, 100);
  EXPECT_DOUBLE_EQ(stats->request_us, 300);
  EXPECT_DOUBLE_EQ(stats->queue_us, 50);
  EXPECT_DOUBLE_EQ(stats->compute_input_us, 0);
  EXPECT_DOUBLE_EQ(stats->compute_infer_us, 200);
  EXPECT_DOUBLE_EQ(stats->compute_output_us, 10);
  EXPECT_DOUBLE_EQ(stats->overhead_us, 40);
  // A restarted server's counters start again from 0.
  EXPECT_EQ(StatsBetween("attend", after, before).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // No calls between the readings: all 0.
  auto idle = StatsBetween("attend", after, after);
  ASSERT_TRUE(idle.ok());
  EXPECT_EQ(idle->success_count, 0);
  EXPECT_EQ(idle->request_us, 0);
}

TEST(BenchCommandTest, ParsesSweeps) {
  auto sweep = ParseSweep("concurrency=1,2,4");
  ASSERT_TRUE(sweep.ok());
  EXPECT_EQ(sweep->parameter, "concurrency");
  EXPECT_EQ(sweep->values, (std::vector<double>{1, 2, 4}));
  EXPECT_EQ(ParseSweep("rate=100,250.5")->values,
            (std::vector<double>{100, 250.5}));
  EXPECT_EQ(ParseSweep("threads=1").status().message(),
            "--sweep: 'threads=1' is not concurrency=N,N,... or rate=R,R,...");
  EXPECT_EQ(ParseSweep("concurrency=1,1.5").status().message(),
            "--sweep: '1.5' is not a positive integer");
  EXPECT_EQ(ParseSweep("rate=10,-1").status().message(),
            "--sweep: '-1' is not a positive number");
}

// ---- Workloads ----

TEST(WorkloadTest, SyntheticShapesFollowTheFlags) {
  SyntheticShape shape;
  shape.batch = 2;
  shape.seq = 16;
  shape.kv_seq = 24;
  shape.heads = 4;
  auto attend = SyntheticTensors(Operation::kAttend, shape, false);
  ASSERT_TRUE(attend.ok()) << attend.status();
  EXPECT_EQ(attend->at("query").shape(), (Shape{2, 4, 16, 64}));
  EXPECT_EQ(attend->at("key").shape(), (Shape{2, 4, 24, 64}));
  shape.dim = 64;
  auto mha = SyntheticTensors(Operation::kMultiHeadAttend, shape, false);
  ASSERT_TRUE(mha.ok()) << mha.status();
  EXPECT_EQ(mha->at("query").shape(), (Shape{2, 16, 64}));
  EXPECT_EQ(mha->at("value").shape(), (Shape{2, 24, 64}));
  EXPECT_EQ(mha->at("q_proj_weight").shape(), (Shape{64, 64}));
  EXPECT_EQ(SyntheticTensors(Operation::kMultiHeadAttend, shape, true)
                ->count("q_proj_weight"),
            0u);
  shape.seq = 0;
  auto layer_norm = SyntheticTensors(Operation::kLayerNorm, shape, false);
  ASSERT_TRUE(layer_norm.ok());
  EXPECT_EQ(layer_norm->at("input").shape(), (Shape{2, 64}));
  shape.heads = 5;
  shape.seq = 8;
  EXPECT_EQ(SyntheticTensors(Operation::kMultiHeadAttend, shape, false)
                .status()
                .message(),
            "--dim: 64 is not a multiple of --heads 5");
  shape.batch = 0;
  EXPECT_EQ(
      SyntheticTensors(Operation::kLayerNorm, shape, false).status().message(),
      "--batch: must be > 0, got 0");
}

TEST(WorkloadTest, FramesTheRequestForHttp2Tools) {
  const std::string frame = GrpcFrame(std::string(300, 'x'));
  ASSERT_EQ(frame.size(), 305u);
  EXPECT_EQ(frame.substr(0, 5), std::string("\0\0\0\x01\x2c", 5));
  EXPECT_EQ(HealthCheckWorkload().method, "/grpc.health.v1.Health/Check");
}

// ---- Load against a live server ----

Workload TinyLayerNorm() {
  SyntheticShape shape;
  shape.seq = 0;
  shape.dim = 64;
  auto tensors = SyntheticTensors(Operation::kLayerNorm, shape, false);
  auto workload =
      MakeWorkload(Operation::kLayerNorm, ViewsOf(*tensors), OpParams{});
  EXPECT_EQ(workload->method, "/attnserve.v1.AttentionService/LayerNorm");
  return *workload;
}

LoadOptions QuickLoad(const TestServer& server) {
  LoadOptions options;
  options.client.target = server.target();
  options.client.timeout = absl::Seconds(10);
  options.warmup = absl::Milliseconds(100);
  options.progress_interval = absl::Milliseconds(50);
  return options;
}

int64_t TotalErrors(const BenchReport& report) {
  int64_t total = 0;
  for (const auto& [code, count] : report.errors) total += count;
  return total;
}

TEST(LoadTest, ClosedLoopCountsEveryRequestOnce) {
  TestServer server;
  LoadOptions options = QuickLoad(server);
  options.concurrency = 6;
  options.connections = 3;
  options.requests = 500;
  int progress_calls = 0;
  auto report = RunLoad(TinyLayerNorm(), options,
                        [&](const LoadProgress&) { ++progress_calls; });
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->requests, 500);
  EXPECT_EQ(report->ok, 500);
  EXPECT_EQ(TotalErrors(*report), 0);
  EXPECT_EQ(report->latency.count, 500);
  ASSERT_TRUE(report->server_compute.has_value());
  EXPECT_EQ(report->server_compute->count, 500);
  EXPECT_LE(report->server_compute->p50_us, report->latency.p50_us);
  EXPECT_GT(report->qps, 0);
  EXPECT_NEAR(report->qps, 500 / report->duration_s, 1e-6 * report->qps);
  EXPECT_LE(report->latency.min_us, report->latency.p50_us);
  EXPECT_LE(report->latency.p50_us, report->latency.p99_us);
  EXPECT_LE(report->latency.p99_us, report->latency.max_us);
  EXPECT_GT(report->client_cpu_cores, 0);
  EXPECT_GT(progress_calls, 0);
  // The server counted the same calls, plus the warm-up's.
  const std::string metrics = server.server().RenderMetrics();
  const std::string calls =
      "attnserve_requests_total{rpc=\"LayerNorm\",code=\"OK\"} ";
  const size_t at = metrics.find(calls);
  ASSERT_NE(at, std::string::npos) << metrics;
  EXPECT_GE(std::stoll(metrics.substr(at + calls.size())), 500);
}

TEST(LoadTest, OpenLoopKeepsTheRateAndReportsLateSends) {
  TestServer server;
  LoadOptions options = QuickLoad(server);
  options.rate = 400;
  options.arrival = Arrival::kPoisson;
  options.concurrency = 16;
  options.duration = absl::Seconds(1);
  auto report = RunLoad(TinyLayerNorm(), options);
  ASSERT_TRUE(report.ok()) << report.status();
  // Poisson counts over one second at 400/s: stddev 20.
  EXPECT_NEAR(report->requests, 400, 100);
  EXPECT_EQ(report->ok + TotalErrors(*report), report->requests);
  EXPECT_EQ(report->latency.count, report->requests);
  EXPECT_GE(report->late, 0);
  EXPECT_LT(report->late, report->requests / 2);
  EXPECT_EQ(report->target_rate, 400);
  EXPECT_EQ(report->arrival, "poisson");
}

TEST(LoadTest, OpenLoopCapOnOutstandingCallsMakesSendsLate) {
  TestServer server;
  LoadOptions options = QuickLoad(server);
  // A call of a few milliseconds, one at a time, asked for at 2000/s: the
  // client must fall behind, and say so.
  SyntheticShape shape;
  shape.seq = 64;
  shape.dim = 512;
  auto tensors = SyntheticTensors(Operation::kMultiHeadAttend, shape, false);
  OpParams params;
  params.num_heads = 8;
  auto workload =
      MakeWorkload(Operation::kMultiHeadAttend, ViewsOf(*tensors), params);
  ASSERT_TRUE(workload.ok()) << workload.status();
  options.rate = 2000;
  options.concurrency = 1;
  options.requests = 100;
  // Without a warm-up the first call is on time, and each later one waits
  // for all before it.
  options.warmup = absl::ZeroDuration();
  auto report = RunLoad(*workload, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->requests, 100);
  EXPECT_GT(report->late, 50);
  // Latency counts from the scheduled send: the last call was due 50 ms
  // in, yet ran at the end of the backlog.
  EXPECT_GT(report->latency.max_us, 0.5 * report->duration_s * 1e6);
}

TEST(LoadTest, FailedCallsAreCountedByCodeWithTheirMessage) {
  TestServer server;
  LoadOptions options = QuickLoad(server);
  options.concurrency = 4;
  options.requests = 200;
  SyntheticShape shape;
  shape.seq = 0;
  shape.dim = 64;
  auto tensors = SyntheticTensors(Operation::kLayerNorm, shape, false);
  // gamma of the wrong size: every call fails validation.
  auto wrong = SyntheticTensors(Operation::kLayerNorm,
                                SyntheticShape{1, 0, 0, 32}, false);
  (*tensors)["gamma"] = std::move(wrong->at("gamma"));
  auto workload =
      MakeWorkload(Operation::kLayerNorm, ViewsOf(*tensors), OpParams{});
  auto report = RunLoad(*workload, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->requests, 200);
  EXPECT_EQ(report->ok, 0);
  EXPECT_EQ(report->errors.at("INVALID_ARGUMENT"), 200);
  EXPECT_THAT(report->error_messages.at("INVALID_ARGUMENT"),
              HasSubstr("gamma"));
  // The run started now, on the wall clock; its first failure after that,
  // from the server's address.
  EXPECT_NEAR(report->start_unix_s, absl::ToUnixSeconds(absl::Now()), 60);
  EXPECT_GT(report->error_first_at_s.at("INVALID_ARGUMENT"), 0);
  EXPECT_THAT(report->error_first_peer.at("INVALID_ARGUMENT"),
              HasSubstr(absl::StrCat(":", server.port())));
}

TEST(LoadTest, EachConnectionSendsItsRequestsInTurn) {
  TestServer server;
  LoadOptions options = QuickLoad(server);
  options.warmup = absl::ZeroDuration();
  options.requests = 100;
  // An empty LayerNorm request fails validation: in turn with a valid one,
  // exactly every other call fails.
  Workload workload = TinyLayerNorm();
  workload.per_connection = {{workload.request, ""}};
  auto report = RunLoad(workload, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->requests, 100);
  EXPECT_EQ(report->ok, 50);
  EXPECT_EQ(report->errors.at("INVALID_ARGUMENT"), 50);
  workload.per_connection = {{workload.request}, {}};
  EXPECT_EQ(RunLoad(workload, options).status().message(),
            "workload: a connection has no requests to send");
}

TEST(LoadTest, UnreachableServerFailsFastWithUnavailable) {
  LoadOptions options;
  options.client.target = "127.0.0.1:1";
  options.client.timeout = absl::Seconds(2);
  options.warmup = absl::ZeroDuration();
  options.requests = 50;
  options.concurrency = 2;
  auto report = RunLoad(TinyLayerNorm(), options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->requests, 50);
  EXPECT_EQ(report->errors.at("UNAVAILABLE"), 50);
}

TEST(LoadTest, RefusesOptionsItCannotRun) {
  LoadOptions options;
  options.concurrency = 0;
  EXPECT_EQ(VerifyLoadOptions(options).message(),
            "--concurrency: 0 is not in [1, 100000]");
  options.concurrency = 1;
  options.connections = 0;
  EXPECT_EQ(VerifyLoadOptions(options).message(),
            "--connections: 0 is not in [1, 1024]");
  options.connections = 1;
  options.duration = absl::ZeroDuration();
  EXPECT_EQ(VerifyLoadOptions(options).message(),
            "--duration_s: must be > 0 (or give --requests)");
  options.requests = 10;
  EXPECT_TRUE(VerifyLoadOptions(options).ok());
}

TEST(BenchServerStatsTest, ReadsTheModelOfTheWorkloadFromALiveServer) {
  TestServer server;
  ClientOptions client;
  client.target = server.target();
  const Workload workload = TinyLayerNorm();
  EXPECT_EQ(workload.statistics_model, "layer_norm");
  ServerStatsReader reader(client, workload.statistics_model, workload.rpc);
  reader.Read();
  LoadOptions options;
  options.client = client;
  options.warmup = absl::ZeroDuration();
  options.requests = 20;
  ASSERT_TRUE(RunLoad(workload, options).ok());
  reader.Read();
  BenchReport report;
  reader.Fill(0, 1, &report);
  ASSERT_TRUE(report.server_stats.has_value()) << report.server_stats_note;
  EXPECT_EQ(report.server_stats->model, "layer_norm");
  EXPECT_EQ(report.server_stats->success_count, 20);
  EXPECT_GT(report.server_stats->compute_infer_us, 0);
  // Calls of no model: a note, and no call to the server.
  ServerStatsReader none(client, "", "SessionStep");
  none.Read();
  BenchReport decode;
  none.Fill(0, 1, &decode);
  EXPECT_FALSE(decode.server_stats.has_value());
  EXPECT_THAT(decode.server_stats_note,
              HasSubstr("SessionStep calls belong to no model"));
  // A model the server does not serve: a note naming the error.
  ServerStatsReader missing(client, "no_such_model", "MultiHeadAttend");
  missing.Read();
  BenchReport unserved;
  missing.Fill(0, 1, &unserved);
  EXPECT_THAT(unserved.server_stats_note, HasSubstr("NOT_FOUND"));
}

TEST(LoadTest, WindowsRunBackToBackUntilAHookEndsThem) {
  TestServer server;
  LoadOptions options = QuickLoad(server);
  options.concurrency = 2;
  options.window = absl::Milliseconds(150);
  options.max_windows = 6;
  options.report_windows = 2;
  int starts = 0;
  std::vector<BenchReport> windows;
  LoadHooks hooks;
  hooks.measure_start = [&] {
    EXPECT_TRUE(windows.empty());
    ++starts;
  };
  hooks.window_end = [&](const BenchReport& window) {
    windows.push_back(window);
    return windows.size() < 4;
  };
  auto report = RunLoad(TinyLayerNorm(), options, hooks);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(starts, 1);
  ASSERT_EQ(windows.size(), 4u);
  for (const BenchReport& window : windows) {
    EXPECT_GT(window.requests, 0);
    EXPECT_EQ(window.ok, window.requests);
    EXPECT_DOUBLE_EQ(window.duration_s, 0.15);
    EXPECT_DOUBLE_EQ(window.qps, window.requests / 0.15);
    EXPECT_GT(window.client_cpu_cores, 0);
  }
  // The report covers the last two windows. A call that ended just before
  // a boundary may be recorded just after its window's report was made:
  // at most one per call in flight.
  const int64_t last_two = windows[2].requests + windows[3].requests;
  EXPECT_GE(report->requests, last_two);
  EXPECT_LE(report->requests, last_two + options.concurrency);
  EXPECT_EQ(report->latency.count, report->requests);
  EXPECT_DOUBLE_EQ(report->duration_s, 0.3);

  // A hook that never says stop: max_windows windows.
  int ends = 0;
  hooks.measure_start = nullptr;
  hooks.window_end = [&ends](const BenchReport&) { return ++ends > 0; };
  options.max_windows = 3;
  ASSERT_TRUE(RunLoad(TinyLayerNorm(), options, hooks).ok());
  EXPECT_EQ(ends, 3);
  // Windows are measured in time, not in calls.
  options.requests = 10;
  EXPECT_THAT(VerifyLoadOptions(options).message(),
              HasSubstr("--requests: not with measurement windows"));
}

// ---- The attnctl bench command line ----

std::string BinDir() {
  const char* dir = std::getenv("ATTNSERVE_BIN_DIR");
  return dir != nullptr ? dir : ".";
}

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          absl::StrCat("attnserve_bench_", getpid(), "_", name))
      .string();
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// Runs attnctl with `args`; stdout and stderr to their own files.
int RunAttnctl(const std::string& args, std::string* out, std::string* err) {
  const std::string out_path = TempPath("stdout"), err_path = TempPath("err");
  const int status = std::system(absl::StrCat(BinDir(), "/attnctl ", args,
                                              " > ", out_path, " 2> ", err_path)
                                     .c_str());
  *out = ReadAll(out_path);
  *err = ReadAll(err_path);
  std::filesystem::remove(out_path);
  std::filesystem::remove(err_path);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(AttnctlBenchTest, JsonReportOfARequestCountAddsUp) {
  TestServer server;
  std::string out, err;
  ASSERT_EQ(RunAttnctl(absl::StrCat("bench --target=", server.target(),
                                    " --rpc=mha --seq=16 --dim=64 --heads=4 "
                                    "--concurrency=4 --connections=2 "
                                    "--requests=120 --warmup_s=0.2 "
                                    "--format=json"),
                       &out, &err),
            0)
      << err;
  const auto json = nlohmann::json::parse(out);
  EXPECT_EQ(json["rpc"], "MultiHeadAttend");
  EXPECT_EQ(json["requests"], 120);
  EXPECT_EQ(json["ok"], 120);
  EXPECT_EQ(json["latency_us"]["count"], 120);
  EXPECT_EQ(json["server_compute_us"]["count"], 120);
  EXPECT_EQ(json["connections"], 2);
}

TEST(AttnctlBenchTest, SweepPrintsATableAndWritesTheChart) {
  TestServer server;
  const std::string svg = TempPath("sweep.svg");
  const std::string body = TempPath("request.bin");
  std::string out, err;
  ASSERT_EQ(
      RunAttnctl(absl::StrCat("bench --target=", server.target(),
                              " --rpc=layernorm --seq=0 --dim=64 "
                              "--sweep=concurrency=1,2,4 --duration_s=0.3 "
                              "--warmup_s=0.1 --plot=",
                              svg, " --save_request=", body),
                 &out, &err),
      0)
      << err;
  EXPECT_THAT(out, HasSubstr("req/s"));
  for (const char* step :
       {"concurrency=1 ", "concurrency=2 ", "concurrency=4 "}) {
    EXPECT_THAT(out, HasSubstr(step));
  }
  // Not a terminal: plain progress lines, one summary per step.
  EXPECT_THAT(err, HasSubstr("concurrency=4: "));
  EXPECT_THAT(ReadAll(svg), HasSubstr("<polyline class=\"p99\""));
  const std::string frame = ReadAll(body);
  ASSERT_GT(frame.size(), 5u);
  EXPECT_EQ(frame[0], '\0');
  EXPECT_EQ(
      (static_cast<uint8_t>(frame[3]) << 8) | static_cast<uint8_t>(frame[4]),
      static_cast<int>(frame.size() - 5));
  std::filesystem::remove(svg);
  std::filesystem::remove(body);
}

TEST(AttnctlBenchTest, SendsARequestReadFromAFile) {
  TestServer server;
  std::string out, err;
  const std::string golden = ::attnserve::testing::GoldensDir() +
                             "/attend_cross_causal_scale.safetensors";
  ASSERT_EQ(RunAttnctl(absl::StrCat("bench --target=", server.target(),
                                    " --rpc=attend --in=", golden,
                                    " --requests=30 --warmup_s=0 "
                                    "--format=json"),
                       &out, &err),
            0)
      << err;
  const auto json = nlohmann::json::parse(out);
  EXPECT_EQ(json["rpc"], "Attend");
  EXPECT_EQ(json["ok"], 30);
  // The file's tensors, not synthetic ones.
  EXPECT_THAT(json["workload"].get<std::string>(), HasSubstr("query="));
  EXPECT_THAT(json["workload"].get<std::string>(),
              ::testing::Not(HasSubstr("expected_output")));
}

TEST(AttnctlBenchTest, CsvAndBadFlags) {
  TestServer server;
  std::string out, err;
  ASSERT_EQ(RunAttnctl(absl::StrCat("bench --target=", server.target(),
                                    " --rpc=health --requests=50 "
                                    "--warmup_s=0 --format=csv"),
                       &out, &err),
            0)
      << err;
  const std::vector<std::string> lines =
      absl::StrSplit(out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u) << out;
  EXPECT_THAT(lines[1], HasSubstr(",Health.Check,"));
  EXPECT_EQ(RunAttnctl("bench --rpc=layernorm --format=xml", &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("--format: 'xml' is not one of text, json, csv"));
  EXPECT_EQ(RunAttnctl("bench --format=json", &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("--rpc: missing"));
  EXPECT_EQ(RunAttnctl("bench --rpc=layernorm --concurrency=0", &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("--concurrency: 0 is not in [1, 100000]"));
}

TEST(AttnctlBenchTest, CsvFileHasOneRowPerLevelWithTheServerBreakdown) {
  TestServer server;
  const std::string csv = TempPath("levels.csv");
  std::string out, err;
  ASSERT_EQ(RunAttnctl(absl::StrCat("bench --target=", server.target(),
                                    " --rpc=attend --seq=32 --heads=2 "
                                    "--sweep=concurrency=1,2 --duration_s=0.3 "
                                    "--warmup_s=0.1 --csv=",
                                    csv),
                       &out, &err),
            0)
      << err;
  std::vector<std::string> lines =
      absl::StrSplit(ReadAll(csv), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], absl::StrCat("Concurrency,Inferences/Second,Client Send,",
                                   kPerfAnalyzerColumns));
  for (int i = 1; i <= 2; ++i) {
    auto row = CsvRow(lines[0], lines[i]);
    EXPECT_EQ(row["Concurrency"], absl::StrCat(i));
    EXPECT_GT(std::stod(row["Inferences/Second"]), 0);
    EXPECT_GT(std::stoll(row["p50 latency"]), 0);
    EXPECT_LE(std::stoll(row["p50 latency"]), std::stoll(row["p99 latency"]));
    EXPECT_GT(std::stoll(row["Server Compute Infer"]), 0);
    EXPECT_LE(std::stoll(row["Server Compute Infer"]),
              std::stoll(row["Avg latency"]));
    EXPECT_EQ(row["Client Send"], "0");
    EXPECT_EQ(row["Client Recv"], "0");
  }
  EXPECT_THAT(out, HasSubstr("concurrency=2: server attend avg request"));

  // A single open-loop run: one row, by request rate.
  ASSERT_EQ(RunAttnctl(absl::StrCat("bench --target=", server.target(),
                                    " --rpc=layernorm --seq=0 --dim=64 "
                                    "--rate=200 --duration_s=0.3 "
                                    "--warmup_s=0.1 --csv=",
                                    csv),
                       &out, &err),
            0)
      << err;
  lines = absl::StrSplit(ReadAll(csv), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].rfind("Request Rate,Inferences/Second,", 0), 0u);
  EXPECT_EQ(CsvRow(lines[0], lines[1])["Request Rate"], "200");
  std::filesystem::remove(csv);
}

TEST(AttnctlBenchTest, StabilityStopsAtTheFirstStableWindows) {
  TestServer server;
  std::string out, err;
  // 1000%: any three windows with calls in them agree.
  ASSERT_EQ(RunAttnctl(absl::StrCat("bench --target=", server.target(),
                                    " --rpc=layernorm --seq=0 --dim=64 "
                                    "--stability_percent=1000 --max_trials=10 "
                                    "--window_s=0.3 --warmup_s=0.1 "
                                    "--format=json"),
                       &out, &err),
            0)
      << err;
  const auto json = nlohmann::json::parse(out);
  EXPECT_EQ(json["stability"]["windows"], 3);
  EXPECT_EQ(json["stability"]["stable"], true);
  EXPECT_EQ(json["stability"]["percent"], 1000);
  EXPECT_EQ(json["stability"]["window_qps"].size(), 3u);
  EXPECT_THAT(err, HasSubstr("window 3: "));
  EXPECT_THAT(err, ::testing::Not(HasSubstr("window 4: ")));
  // The report covers those three windows, and so do the server's counts
  // (read a little after each boundary).
  EXPECT_NEAR(json["duration_s"].get<double>(), 0.9, 1e-9);
  const int64_t requests = json["requests"];
  EXPECT_GT(requests, 0);
  EXPECT_EQ(json["server_stats"]["model"], "layer_norm");
  EXPECT_NEAR(json["server_stats"]["success_count"].get<int64_t>(), requests,
              10 + requests / 4);
  EXPECT_GT(json["server_stats"]["compute_infer_us"].get<double>(), 0);
}

TEST(AttnctlBenchTest, StabilityGivesUpAfterMaxTrialsAndSaysSo) {
  TestServer server;
  const std::string csv = TempPath("unstable.csv");
  std::string out, err;
  // 0%: no two windows are ever that close.
  EXPECT_EQ(RunAttnctl(absl::StrCat("bench --target=", server.target(),
                                    " --rpc=layernorm --seq=0 --dim=64 "
                                    "--stability_percent=0 --max_trials=4 "
                                    "--window_s=0.1 --warmup_s=0 --format=json "
                                    "--csv=",
                                    csv),
                       &out, &err),
            1);
  EXPECT_THAT(err, HasSubstr("FAILED_PRECONDITION: --stability_percent: not "
                             "stable within --max_trials=4 windows; the "
                             "report shows the last 3"));
  // Still reported and written: the last three windows.
  const auto json = nlohmann::json::parse(out);
  EXPECT_EQ(json["stability"]["windows"], 4);
  EXPECT_EQ(json["stability"]["stable"], false);
  EXPECT_NEAR(json["duration_s"].get<double>(), 0.3, 1e-9);
  const std::vector<std::string> lines =
      absl::StrSplit(ReadAll(csv), '\n', absl::SkipEmpty());
  EXPECT_EQ(lines.size(), 2u);
  std::filesystem::remove(csv);
}

TEST(AttnctlBenchTest, StabilityAndCsvFlagsAreCheckedBeforeAnyCall) {
  // No server: every one of these fails before connecting, decode sessions
  // included.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--stability_percent=-1",
       "--stability_percent: must be a number >= 0, got -1"},
      {"--stability_percent=nan",
       "--stability_percent: must be a number >= 0, got nan"},
      {"--max_trials=5", "--max_trials: needs --stability_percent"},
      {"--window_s=1", "--window_s: needs --stability_percent"},
      {"--stability_percent=10 --max_trials=2",
       "--max_trials: 2 is not in [3, 100]"},
      {"--stability_percent=10 --window_s=-1",
       "--window_s: must be > 0, got -1"},
      {"--stability_percent=10 --requests=50",
       "--requests: not with --stability_percent"},
      {"--csv=/nonexistent_attnserve_dir/x.csv",
       "--csv: cannot write '/nonexistent_attnserve_dir/x.csv'"},
  };
  std::string out, err;
  for (const char* rpc : {"layernorm", "decode --kv_seq=16"}) {
    for (const auto& [flags, message] : cases) {
      const std::string args =
          absl::StrCat("bench --target=127.0.0.1:1 --rpc=", rpc, " ", flags);
      EXPECT_EQ(RunAttnctl(args, &out, &err), 1) << args;
      EXPECT_THAT(err, HasSubstr(absl::StrCat("INVALID_ARGUMENT: ", message)))
          << args;
      EXPECT_THAT(err, ::testing::Not(HasSubstr("UNAVAILABLE"))) << args;
    }
  }
}

// Runs `attnctl bench --rpc=decode` against `server` with `flags` and a
// JSON report; fails the test unless it exits 0.
nlohmann::json DecodeJson(const TestServer& server, const std::string& flags) {
  std::string out, err;
  EXPECT_EQ(RunAttnctl(absl::StrCat("bench --target=", server.target(),
                                    " --rpc=decode --seq=1 --heads=2 --dim=16 "
                                    "--warmup_s=0 --format=json ",
                                    flags),
                       &out, &err),
            0)
      << err;
  return out.empty() ? nlohmann::json() : nlohmann::json::parse(out);
}

TEST(AttnctlBenchTest, DecodeLayersCountStepsAndTokens) {
  TestServer server;
  // Single form: a token is one SessionStep call per layer.
  nlohmann::json single = DecodeJson(
      server,
      "--kv_seq=64 --layers=2 --connections=2 --concurrency=2 --requests=40");
  ASSERT_TRUE(single.is_object());
  EXPECT_EQ(single["rpc"], "SessionStep");
  EXPECT_EQ(single["requests"], 40);
  EXPECT_EQ(single["ok"], 40);
  EXPECT_EQ(single["steps_per_request"], 1);
  EXPECT_EQ(single["layers"], 2);
  const double qps = single["qps"];
  EXPECT_GT(qps, 0);
  EXPECT_DOUBLE_EQ(single["steps_per_s"].get<double>(), qps);
  EXPECT_DOUBLE_EQ(single["tokens_per_s"].get<double>(), qps / 2);
  EXPECT_THAT(single["workload"].get<std::string>(),
              HasSubstr("2 session(s) of 2 layers (a token is 2 calls"));

  // Batched form: one SessionSteps call of 3 sessions per layer.
  nlohmann::json batched = DecodeJson(
      server, "--kv_seq=64 --layers=2 --batch_sessions=3 --requests=30");
  ASSERT_TRUE(batched.is_object());
  EXPECT_EQ(batched["rpc"], "SessionSteps");
  EXPECT_EQ(batched["requests"], 30);
  EXPECT_EQ(batched["ok"], 30);
  EXPECT_EQ(batched["steps_per_request"], 3);
  EXPECT_EQ(batched["layers"], 2);
  const double calls = batched["qps"];
  EXPECT_DOUBLE_EQ(batched["steps_per_s"].get<double>(), calls * 3);
  EXPECT_DOUBLE_EQ(batched["tokens_per_s"].get<double>(), calls * 3 / 2);
  EXPECT_THAT(batched["workload"].get<std::string>(),
              HasSubstr("3 session(s) of 2 layers"));

  // The text report states both rates.
  std::string out, err;
  ASSERT_EQ(RunAttnctl(absl::StrCat("bench --target=", server.target(),
                                    " --rpc=decode --seq=1 --heads=2 --dim=16 "
                                    "--kv_seq=32 --layers=2 --batch_sessions=2 "
                                    "--requests=10 --warmup_s=0"),
                       &out, &err),
            0)
      << err;
  EXPECT_THAT(out, HasSubstr("steps/s (2 steps a call)"));
  EXPECT_THAT(out, HasSubstr("tokens/s (2 layer steps a token)"));
  // The sessions are gone once attnctl is.
  EXPECT_THAT(server.server().RenderMetrics(),
              HasSubstr("attnserve_session_cache_bytes 0\n"));
}

TEST(AttnctlBenchTest, DecodeHasNoServerBreakdown) {
  TestServer server;
  const std::string csv = TempPath("decode.csv");
  nlohmann::json json =
      DecodeJson(server, absl::StrCat("--kv_seq=32 --requests=20 --csv=", csv));
  ASSERT_TRUE(json.is_object());
  EXPECT_FALSE(json.contains("server_stats"));
  EXPECT_THAT(json["server_stats_note"].get<std::string>(),
              HasSubstr("SessionStep calls belong to no model"));
  const std::vector<std::string> lines =
      absl::StrSplit(ReadAll(csv), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u);
  auto row = CsvRow(lines[0], lines[1]);
  EXPECT_GT(std::stod(row["Inferences/Second"]), 0);
  for (const char* column :
       {"Network+Server Send/Recv", "Server Queue", "Server Compute Input",
        "Server Compute Infer", "Server Compute Output"}) {
    EXPECT_EQ(row[column], "0") << column;
  }
  std::filesystem::remove(csv);
}

TEST(AttnctlBenchTest, DecodeInt8CacheReachesTheServer) {
  // 2 MiB of session memory: 600 tokens of 8 key/value heads of d64 take
  // 2.4 MB in float32 and 0.65 MB in int8 (with its scales).
  ServerOptions options;
  options.max_session_memory_mb = 2;
  TestServer server(options);
  const std::string shape =
      " --rpc=decode --seq=1 --heads=8 --dim=64 --kv_seq=600 --warmup_s=0 "
      "--format=json --requests=20";
  std::string out, err;
  ASSERT_EQ(RunAttnctl(absl::StrCat("bench --target=", server.target(), shape),
                       &out, &err),
            1);
  EXPECT_THAT(err, HasSubstr("RESOURCE_EXHAUSTED"));
  EXPECT_THAT(err, HasSubstr("of FLOAT32 reserve"));

  nlohmann::json int8 =
      DecodeJson(server,
                 "--heads=8 --dim=64 --kv_seq=600 --cache_dtype=int8 "
                 "--requests=20");
  ASSERT_TRUE(int8.is_object());
  EXPECT_EQ(int8["ok"], 20);
  EXPECT_EQ(int8["layers"], 1);
  EXPECT_THAT(int8["workload"].get<std::string>(), HasSubstr("cache INT8"));

  // Two layers of int8, two sessions stepped by each call: 2.6 MB, so the
  // second session evicts the first. The call succeeds but its step fails,
  // and attnctl stops there with the step's error rather than count calls.
  ASSERT_EQ(RunAttnctl(absl::StrCat("bench --target=", server.target(), shape,
                                    " --cache_dtype=int8 --layers=2 "
                                    "--batch_sessions=2"),
                       &out, &err),
            1);
  EXPECT_THAT(err, HasSubstr("NOT_FOUND: SessionSteps step 0 (layer 0): "
                             "session_id: session"));
  EXPECT_THAT(err, HasSubstr("was evicted"));
  nlohmann::json layers = DecodeJson(
      server,
      "--heads=8 --dim=64 --kv_seq=600 --cache_dtype=int8 --layers=2 "
      "--requests=20");
  ASSERT_TRUE(layers.is_object());
  EXPECT_EQ(layers["ok"], 20);
  EXPECT_DOUBLE_EQ(layers["tokens_per_s"].get<double>(),
                   layers["qps"].get<double>() / 2);
}

TEST(AttnctlBenchTest, DecodeFlagsAreCheckedBeforeAnyCall) {
  // No server: every one of these fails before connecting.
  const std::string decode =
      "bench --target=127.0.0.1:1 --rpc=decode --kv_seq=16 ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--layers=0", "--layers: 0 is not >= 1"},
      {"--layers=-3", "--layers: -3 is not >= 1"},
      {"--cache_dtype=q4", "--cache_dtype: 'q4' is not one of f32, bf16, int8"},
      {"--cache_dtype=bf16",
       "--cache_dtype: BFLOAT16 is not the sessions' compute dtype FLOAT32 "
       "(from --dtype); a cache stores the compute dtype or INT8"},
      {"--dtype=bf16 --cache_dtype=f32",
       "--cache_dtype: FLOAT32 is not the sessions' compute dtype BFLOAT16"},
      {"--batch_sessions=-1", "--batch_sessions: must be >= 0, got -1"},
      {"--protocol=http",
       "--protocol: 'http' is not one of native, open_inference, "
       "open_inference_stream, open_inference_http"},
      {"--protocol=open_inference_http",
       "--http_target: the server's HTTP address (HOST:PORT) is needed with "
       "--protocol=open_inference_http"},
      {"--protocol=open_inference --http_target=127.0.0.1:8000",
       "--http_target: only with --protocol=open_inference_http"},
      {"--http_target=127.0.0.1:8000",
       "--http_target: only with --protocol=open_inference_http"},
      {"--protocol=open_inference_stream --connections=2 --concurrency=1",
       "--concurrency: this transport carries one call at a time per "
       "connection, closed loop: set --concurrency equal to --connections (2) "
       "and no --rate"},
      {"--protocol=open_inference_http --http_target=127.0.0.1:8000 "
       "--rate=100",
       "--concurrency: this transport carries one call at a time per "
       "connection, closed loop"},
      {"--protocol=open_inference --batch_sessions=2",
       "--batch_sessions: a ModelInfer request steps one sequence; only with "
       "--protocol=native"},
      {"--protocol=open_inference --layers=2",
       "--layers: a sequence holds one layer; only with --protocol=native"},
      {"--protocol=open_inference --cache_dtype=int8",
       "--cache_dtype: sequences of attention_session cache FP32 or BF16; "
       "INT8 only with --protocol=native"},
      {"--protocol=open_inference --model=demo --cache_dtype=f32",
       "--cache_dtype: a served model's sequences cache its configured "
       "dtype; only with --protocol=native"},
  };
  std::string out, err;
  for (const auto& [flags, message] : cases) {
    EXPECT_EQ(RunAttnctl(decode + flags, &out, &err), 1) << flags;
    EXPECT_THAT(err, HasSubstr(absl::StrCat("INVALID_ARGUMENT: ", message)))
        << flags;
    EXPECT_THAT(err, ::testing::Not(HasSubstr("UNAVAILABLE"))) << flags;
  }
  EXPECT_EQ(RunAttnctl("bench --target=127.0.0.1:1 --rpc=attend --layers=2",
                       &out, &err),
            1);
  EXPECT_THAT(err, HasSubstr("--layers: only for --rpc=decode"));
  EXPECT_EQ(RunAttnctl("bench --target=127.0.0.1:1 --rpc=mha "
                       "--cache_dtype=int8",
                       &out, &err),
            1);
  EXPECT_THAT(err, HasSubstr("--cache_dtype: only for --rpc=decode"));
  EXPECT_EQ(RunAttnctl("bench --target=127.0.0.1:1 --rpc=layernorm "
                       "--protocol=open_inference",
                       &out, &err),
            1);
  EXPECT_THAT(err, HasSubstr("--protocol: only for --rpc=decode"));
}

// Decode through the Open Inference Protocol: each connection steps a
// sequence of attention_session with ModelInfer, rewinding to --kv_seq.
TEST(AttnctlBenchTest, DecodeOverOpenInferenceSequences) {
  TestServer server;
  nlohmann::json json = DecodeJson(
      server,
      "--protocol=open_inference --kv_seq=48 --connections=3 --concurrency=3 "
      "--requests=30");
  ASSERT_TRUE(json.is_object());
  EXPECT_EQ(json["rpc"], "ModelInfer");
  EXPECT_EQ(json["requests"], 30);
  EXPECT_EQ(json["ok"], 30);
  EXPECT_EQ(json["steps_per_request"], 1);
  EXPECT_THAT(json["workload"].get<std::string>(),
              HasSubstr("decode over Open Inference sequences of "
                        "attention_session: 1 token(s) a step after 48 "
                        "cached, heads=2 kv_heads=2 head_dim=16 FLOAT32, 3 "
                        "sequence(s)"));
  // The statistics extension counts the steps under their model: the
  // starts, each sequence's checked first step, the measured steps and
  // (after the report) the ends.
  ASSERT_TRUE(json.contains("server_stats")) << json.dump();
  EXPECT_GE(json["server_stats"]["success_count"].get<int64_t>(), 30);
  // The sequences are ended once attnctl is: no cache is left.
  const std::string metrics = server.server().RenderMetrics();
  EXPECT_THAT(metrics, HasSubstr("attnserve_session_cache_bytes 0\n"));
  // A cache of bfloat16 is asked for on each sequence's start.
  nlohmann::json bf16 = DecodeJson(
      server,
      "--protocol=open_inference --kv_seq=48 --dtype=bf16 --cache_dtype=bf16 "
      "--requests=10");
  ASSERT_TRUE(bf16.is_object());
  EXPECT_EQ(bf16["ok"], 10);
  EXPECT_THAT(bf16["workload"].get<std::string>(), HasSubstr("cache BFLOAT16"));
}

// The same steps over the protocol's stream and its HTTP front end: each
// connection a stream or a keep-alive connection of its own.
TEST(AttnctlBenchTest, DecodeOverOpenInferenceStreamAndHttp) {
  ServerOptions options;
  options.http_port = 1;  // a free port
  TestServer server(options);
  const std::string http_target =
      absl::StrCat("127.0.0.1:", server.http_port());
  for (const auto& [flags, rpc] :
       std::vector<std::pair<std::string, std::string>>{
           {"--protocol=open_inference_stream", "ModelStreamInfer"},
           {absl::StrCat("--protocol=open_inference_http --http_target=",
                         http_target),
            "HTTP infer"}}) {
    SCOPED_TRACE(rpc);
    nlohmann::json json =
        DecodeJson(server, absl::StrCat(flags,
                                        " --kv_seq=48 --connections=2 "
                                        "--concurrency=2 --requests=20"));
    ASSERT_TRUE(json.is_object());
    EXPECT_EQ(json["rpc"], rpc);
    EXPECT_EQ(json["requests"], 20);
    EXPECT_EQ(json["ok"], 20);
    EXPECT_THAT(json["workload"].get<std::string>(),
                HasSubstr(absl::StrCat("2 sequence(s) (", rpc, ")")));
    ASSERT_TRUE(json.contains("server_stats")) << json.dump();
    EXPECT_GE(json["server_stats"]["success_count"].get<int64_t>(), 20);
  }
  EXPECT_THAT(server.server().RenderMetrics(),
              HasSubstr("attnserve_session_cache_bytes 0\n"));
  // An HTTP address nothing listens on fails the run before its first
  // step, naming the address.
  std::string out, err;
  EXPECT_EQ(RunAttnctl(absl::StrCat("bench --target=", server.target(),
                                    " --rpc=decode --protocol=open_inference_"
                                    "http --http_target=127.0.0.1:1 --seq=1 "
                                    "--heads=2 --dim=16 --kv_seq=8 "
                                    "--requests=2"),
                       &out, &err),
            1);
  EXPECT_THAT(err, HasSubstr("UNAVAILABLE: --http_target: cannot connect to "
                             "127.0.0.1:1"));
}

}  // namespace
}  // namespace attnserve
