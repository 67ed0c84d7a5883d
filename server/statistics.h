// Per-model inference statistics, Triton's statistics extension: for each
// model, successful and failed calls with their cumulative durations, and
// where the successful calls' time went (the request's translation, queue,
// compute, and what follows the computation until the answer is ready),
// counted from every compute
// call that names a model: ModelInfer over gRPC and HTTP, ModelStreamInfer,
// and the native Attend, LayerNorm and MultiHeadAttend (under "attend",
// "layer_norm", "multi_head_attend" or the served model they name).
//
// Only models the server serves are counted (built-in ones and those of
// the repository), so that requests naming other models cannot grow the
// table; an unloaded model keeps its counters for when it is loaded again.
//
// Thread-safety: all methods may be called concurrently. Ownership: the
// repository (may be null) must outlive the table.
#ifndef ATTNSERVE_SERVER_STATISTICS_H_
#define ATTNSERVE_SERVER_STATISTICS_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/mutex.h"
#include "engine/call_record.h"
#include "google/protobuf/message.h"
#include "inference/grpc_service.pb.h"
#include "server/model_repository.h"

namespace attnserve {

class StatisticsTable {
 public:
  explicit StatisticsTable(const ModelRepository* models) : models_(models) {}

  // One finished compute call for `model` (ignored unless served).
  void Record(const std::string& model, const absl::Status& status,
              const CallTimes& durations) ABSL_LOCKS_EXCLUDED(mu_);

  // ModelStatistics: every served model when `request.name` is empty, else
  // that one; version "" or "1". NOT_FOUND for models not served and other
  // versions.
  absl::Status Handle(const inference::ModelStatisticsRequest& request,
                      inference::ModelStatisticsResponse* response) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Counters {
    uint64_t success_count = 0;
    uint64_t success_ns = 0;
    uint64_t fail_count = 0;
    uint64_t fail_ns = 0;
    uint64_t input_ns = 0;
    uint64_t queue_ns = 0;
    uint64_t compute_ns = 0;
    uint64_t output_ns = 0;
    uint64_t last_inference_ms = 0;
  };
  bool IsServed(const std::string& model) const;
  void Fill(const std::string& model, inference::ModelStatistics* stats) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ModelRepository* const models_;
  mutable Mutex mu_;
  std::map<std::string, Counters, std::less<>> counters_ ABSL_GUARDED_BY(mu_);
};

// The model a compute request is for (see above); empty for requests of no
// model (sessions).
std::string ModelOfRequest(const google::protobuf::Message& request);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_STATISTICS_H_
