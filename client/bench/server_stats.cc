#include "client/bench/server_stats.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

ModelCounters::Duration DurationOf(const inference::StatisticDuration& d) {
  return {d.count(), d.ns()};
}

// `after` - `before`; false when it would be negative.
bool Subtract(uint64_t before, uint64_t after, uint64_t* delta) {
  if (after < before) return false;
  *delta = after - before;
  return true;
}

bool Subtract(const ModelCounters::Duration& before,
              const ModelCounters::Duration& after,
              ModelCounters::Duration* delta) {
  return Subtract(before.count, after.count, &delta->count) &&
         Subtract(before.ns, after.ns, &delta->ns);
}

// Average microseconds of a duration; 0 when the server counted none (it
// counts some stages zero times).
double AverageMicros(const ModelCounters::Duration& d) {
  return d.count == 0 ? 0 : static_cast<double>(d.ns) / d.count / 1000.0;
}

}  // namespace

ModelCounters CountersOf(const inference::ModelStatistics& stats) {
  const inference::InferStatistics& infer = stats.inference_stats();
  ModelCounters counters;
  counters.inference_count = stats.inference_count();
  counters.execution_count = stats.execution_count();
  counters.success = DurationOf(infer.success());
  counters.queue = DurationOf(infer.queue());
  counters.compute_input = DurationOf(infer.compute_input());
  counters.compute_infer = DurationOf(infer.compute_infer());
  counters.compute_output = DurationOf(infer.compute_output());
  return counters;
}

absl::StatusOr<ServerStatsReport> StatsBetween(const std::string& model,
                                               const ModelCounters& before,
                                               const ModelCounters& after) {
  ModelCounters delta;
  const bool forward =
      Subtract(before.inference_count, after.inference_count,
               &delta.inference_count) &&
      Subtract(before.execution_count, after.execution_count,
               &delta.execution_count) &&
      Subtract(before.success, after.success, &delta.success) &&
      Subtract(before.queue, after.queue, &delta.queue) &&
      Subtract(before.compute_input, after.compute_input,
               &delta.compute_input) &&
      Subtract(before.compute_infer, after.compute_infer,
               &delta.compute_infer) &&
      Subtract(before.compute_output, after.compute_output,
               &delta.compute_output);
  if (!forward) {
    return absl::FailedPreconditionError(
        absl::StrCat("the counters of model ", model,
                     " went backwards (did the server restart?)"));
  }
  ServerStatsReport report;
  report.model = model;
  report.inference_count = static_cast<int64_t>(delta.inference_count);
  report.execution_count = static_cast<int64_t>(delta.execution_count);
  report.success_count = static_cast<int64_t>(delta.success.count);
  report.request_us = AverageMicros(delta.success);
  report.queue_us = AverageMicros(delta.queue);
  report.compute_input_us = AverageMicros(delta.compute_input);
  report.compute_infer_us = AverageMicros(delta.compute_infer);
  report.compute_output_us = AverageMicros(delta.compute_output);
  // The two sides of the subtraction average over different counts: the
  // difference can come out below 0.
  report.overhead_us = std::max(
      0.0, report.request_us - report.queue_us - report.compute_input_us -
               report.compute_infer_us - report.compute_output_us);
  return report;
}

ServerStatsReader::ServerStatsReader(const ClientOptions& client,
                                     std::string model, std::string rpc)
    : client_(client), model_(std::move(model)), rpc_(std::move(rpc)) {
  if (!model_.empty()) {
    stub_ = inference::GRPCInferenceService::NewStub(CreateChannel(client));
  }
}

void ServerStatsReader::Read() {
  if (model_.empty() || !error_.ok()) return;
  inference::ModelStatisticsRequest request;
  request.set_name(model_);
  inference::ModelStatisticsResponse response;
  grpc::ClientContext context;
  PrepareContext(client_, &context);
  const grpc::Status status =
      stub_->ModelStatistics(&context, request, &response);
  if (!status.ok()) {
    error_ = FromGrpcStatus(status);
    return;
  }
  for (const inference::ModelStatistics& stats : response.model_stats()) {
    if (stats.name() == model_) {
      readings_.push_back(CountersOf(stats));
      return;
    }
  }
  error_ = absl::NotFoundError(
      absl::StrCat("ModelStatistics has no model ", model_));
}

void ServerStatsReader::Fill(int first, int last, BenchReport* report) const {
  if (model_.empty()) {
    report->server_stats_note = absl::StrCat(
        "no server statistics: ", rpc_,
        " calls belong to no model (the statistics extension counts per "
        "model)");
    return;
  }
  if (!error_.ok()) {
    report->server_stats_note =
        absl::StrCat("no server statistics: ModelStatistics of ", model_, ": ",
                     error_.ToString());
    return;
  }
  if (first < 0 || first > last || last >= static_cast<int>(readings_.size())) {
    report->server_stats_note = "no server statistics: readings missing";
    return;
  }
  absl::StatusOr<ServerStatsReport> stats =
      StatsBetween(model_, readings_[first], readings_[last]);
  if (!stats.ok()) {
    report->server_stats_note =
        absl::StrCat("no server statistics: ", stats.status().message());
    return;
  }
  report->server_stats = *std::move(stats);
}

}  // namespace attnserve
