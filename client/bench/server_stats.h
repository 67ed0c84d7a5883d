// The server's side of a load test, from the Open Inference Protocol's
// statistics extension: the cumulative ModelStatistics counters of the
// model the workload calls, read at each window boundary, and per-request
// averages of what the server counted between two readings.
//
// Thread-safety: thread-compatible. Ownership: the reader owns its channel.
#ifndef ATTNSERVE_CLIENT_BENCH_SERVER_STATS_H_
#define ATTNSERVE_CLIENT_BENCH_SERVER_STATS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/bench/report.h"
#include "client/client.h"
#include "inference/grpc_service.grpc.pb.h"

namespace attnserve {

// One model's counters at one moment: each duration's count and cumulative
// nanoseconds.
struct ModelCounters {
  struct Duration {
    uint64_t count = 0;
    uint64_t ns = 0;
  };
  uint64_t inference_count = 0;
  uint64_t execution_count = 0;
  Duration success;
  Duration queue;
  Duration compute_input;
  Duration compute_infer;
  Duration compute_output;
};

ModelCounters CountersOf(const inference::ModelStatistics& stats);

// What the server counted for `model` between two readings: the calls, and
// each stage's nanoseconds over its own count (0 for a count of 0).
// FAILED_PRECONDITION when a counter went backwards (the server restarted).
absl::StatusOr<ServerStatsReport> StatsBetween(const std::string& model,
                                               const ModelCounters& before,
                                               const ModelCounters& after);

class ServerStatsReader {
 public:
  // `model` empty: the calls belong to no model (decode sessions, health
  // checks), and the reader asks nothing; `rpc` names them in the note.
  ServerStatsReader(const ClientOptions& client, std::string model,
                    std::string rpc);

  // Reads the counters now. A failed reading ends the readings: the report
  // then says why instead.
  void Read();
  // Sets `report`'s server_stats to what the server counted between
  // readings `first` and `last`, or its server_stats_note to why not.
  void Fill(int first, int last, BenchReport* report) const;

 private:
  ClientOptions client_;
  std::string model_;
  std::string rpc_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
  std::vector<ModelCounters> readings_;
  absl::Status error_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_BENCH_SERVER_STATS_H_
