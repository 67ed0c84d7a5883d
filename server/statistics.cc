#include "server/statistics.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.pb.h"
#include "core/status_macros.h"
#include "core/verify.h"
#include "server/operations.h"
#include "server/protocol_models.h"

namespace attnserve {
namespace {

uint64_t Nanos(absl::Duration duration) {
  return static_cast<uint64_t>(
      std::max<int64_t>(0, absl::ToInt64Nanoseconds(duration)));
}

void Set(inference::StatisticDuration* duration, uint64_t count, uint64_t ns) {
  duration->set_count(count);
  duration->set_ns(ns);
}

}  // namespace

std::string ModelOfRequest(const google::protobuf::Message& request) {
  if (const auto* infer =
          dynamic_cast<const inference::ModelInferRequest*>(&request)) {
    return infer->model_name();
  }
  if (const auto* multi_head =
          dynamic_cast<const v1::MultiHeadAttendRequest*>(&request);
      multi_head != nullptr && !multi_head->model().empty()) {
    return multi_head->model();
  }
  // A native call of a stateless operation counts under its model.
  const OperationSpec* operation =
      FindOperationByRequest(*request.GetDescriptor());
  if (operation == nullptr || operation->sequences) return "";
  return std::string(operation->model);
}

bool StatisticsTable::IsServed(const std::string& model) const {
  return !model.empty() && FindProtocolModel(model, models_, "name").ok();
}

void StatisticsTable::Record(const std::string& model,
                             const absl::Status& status,
                             const CallTimes& durations) {
  if (!IsServed(model)) return;
  const uint64_t now_ms =
      static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()));
  MutexLock lock(&mu_);
  Counters& counters = counters_[model];
  counters.last_inference_ms = now_ms;
  if (!status.ok()) {
    ++counters.fail_count;
    counters.fail_ns += Nanos(durations.total);
    return;
  }
  ++counters.success_count;
  counters.success_ns += Nanos(durations.total);
  counters.input_ns += Nanos(durations.input);
  counters.queue_ns += Nanos(durations.queue);
  counters.compute_ns += Nanos(durations.compute);
  // What follows the computation until the answer is ready: the result's
  // encoding (and the worker's hand-over), all of the call's time that is
  // neither input, queue nor computation.
  counters.output_ns += Nanos(durations.total - durations.input -
                              durations.queue - durations.compute);
}

void StatisticsTable::Fill(const std::string& model,
                           inference::ModelStatistics* stats) const {
  stats->set_name(model);
  stats->set_version("1");
  const auto it = counters_.find(model);
  const Counters counters = it != counters_.end() ? it->second : Counters{};
  stats->set_last_inference(counters.last_inference_ms);
  // No batching: each successful call is one inference and one execution.
  stats->set_inference_count(counters.success_count);
  stats->set_execution_count(counters.success_count);
  inference::InferStatistics* infer = stats->mutable_inference_stats();
  Set(infer->mutable_success(), counters.success_count, counters.success_ns);
  Set(infer->mutable_fail(), counters.fail_count, counters.fail_ns);
  Set(infer->mutable_queue(), counters.success_count, counters.queue_ns);
  // Every execution has its input, infer and output phases (Triton's tools
  // require the three counts to agree).
  Set(infer->mutable_compute_input(), counters.success_count,
      counters.input_ns);
  Set(infer->mutable_compute_infer(), counters.success_count,
      counters.compute_ns);
  Set(infer->mutable_compute_output(), counters.success_count,
      counters.output_ns);
  Set(infer->mutable_cache_hit(), 0, 0);
  Set(infer->mutable_cache_miss(), 0, 0);
}

absl::Status StatisticsTable::Handle(
    const inference::ModelStatisticsRequest& request,
    inference::ModelStatisticsResponse* response) const {
  std::vector<std::string> names;
  if (request.name().empty()) {
    names = ProtocolModelNames(models_);
  } else {
    ATTN_RETURN_IF_ERROR(
        FindProtocolModel(request.name(), models_, "name").status());
    names = {request.name()};
  }
  if (!request.version().empty() && request.version() != "1") {
    return absl::NotFoundError(
        absl::StrCat("version: models have only version 1, not ",
                     EchoString(request.version())));
  }
  MutexLock lock(&mu_);
  for (const std::string& name : names) Fill(name, response->add_model_stats());
  return absl::OkStatus();
}

}  // namespace attnserve
