// attnctl bench's pieces: the latency histogram, the arrival schedule, the
// reports and chart, the workloads, and load tests against a live server.
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
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
}

}  // namespace
}  // namespace attnserve
