// The workload of `attnctl bench --rpc=decode`: decode sessions opened on the
// server, one per connection, each prefilled with `kv_seq` tokens; every
// call is a step of `step_tokens` new tokens at position `kv_seq`, so each
// step replaces the previous one's tokens and the cache stays at kv_seq +
// step_tokens however many calls run. The report's latency is the latency
// of one decode step.
//
// Ownership: DecodeSessions deletes its sessions when destroyed; the client
// it was opened with must outlive it. Thread-safety: thread-compatible.
#ifndef ATTNSERVE_CLIENT_BENCH_DECODE_H_
#define ATTNSERVE_CLIENT_BENCH_DECODE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/bench/workload.h"
#include "client/client.h"
#include "core/tensor.h"

namespace attnserve {

struct DecodeBenchOptions {
  // A served model (steps send hidden states), or empty for attention
  // sessions of the shapes below.
  std::string model;
  // Tokens cached before the measured steps.
  int64_t kv_seq = 4096;
  // New tokens per step.
  int64_t step_tokens = 1;
  // Attention sessions: query heads, key/value heads (0: heads), head dim.
  int64_t heads = 8;
  int64_t kv_heads = 0;
  int64_t head_dim = 64;
  // Element type of the inputs; BFLOAT16 inputs get a bfloat16 cache.
  DType dtype = DType::kFloat32;
  // One per connection.
  int sessions = 1;
  // > 0: each connection's call is one SessionSteps call stepping this many
  // sessions of its own (sessions x batch_sessions in all).
  int batch_sessions = 0;
};

class DecodeSessions {
 public:
  // Creates and prefills the sessions; fails with the server's error.
  static absl::StatusOr<std::unique_ptr<DecodeSessions>> Open(
      AttnClient& client, const DecodeBenchOptions& options);
  ~DecodeSessions();
  DecodeSessions(const DecodeSessions&) = delete;
  DecodeSessions& operator=(const DecodeSessions&) = delete;

  // SessionStep requests, one per session, or SessionSteps requests, one
  // per connection (Workload::per_connection).
  const Workload& workload() const { return workload_; }

 private:
  explicit DecodeSessions(AttnClient& client) : client_(client) {}

  AttnClient& client_;
  std::vector<std::string> ids_;
  Workload workload_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_BENCH_DECODE_H_
