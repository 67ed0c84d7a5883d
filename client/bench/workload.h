// The request a load test sends: one serialized message, built from shapes
// (synthetic tensors) or from named tensors read from a file, sent as is on
// every call.
//
// Thread-safety: plain values and free functions.
#ifndef ATTNSERVE_CLIENT_BENCH_WORKLOAD_H_
#define ATTNSERVE_CLIENT_BENCH_WORKLOAD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/requests.h"
#include "core/tensor.h"

namespace attnserve {

// A connection that carries one call at a time on the calling thread (the
// transports of client/bench/blocking_transports.h).
class BlockingConnection {
 public:
  virtual ~BlockingConnection() = default;
  // Sends `request` (in the transport's form) and waits for its answer:
  // OK, or the server's error.
  virtual absl::Status Call(const std::string& request) = 0;
  // Where it is connected, for error reports.
  virtual std::string peer() const = 0;
};

struct Workload {
  // Full gRPC method name, "/attnserve.v1.AttentionService/LayerNorm".
  std::string method;
  // "LayerNorm".
  std::string rpc;
  // The request message, serialized.
  std::string request;
  // "input=[1, 64] FLOAT32".
  std::string description;
  // When not empty: connection i sends the requests of
  // per_connection[i % size] in turn, over and over, instead of `request`
  // (decode steps: each connection on its own sessions, one request per
  // layer of a token).
  std::vector<std::vector<std::string>> per_connection;
  // Decode steps each call carries (SessionSteps: one per session).
  int64_t steps_per_request = 1;
  // Decode: steps of one session that make a token (one per layer).
  int64_t layers = 1;
  // The model the server's statistics extension counts these calls under
  // (server/statistics.cc): "attend", "layer_norm", "multi_head_attend" or
  // the served model an MHA request names; empty for calls of no model
  // (decode sessions, health checks).
  std::string statistics_model;
  // Set: calls go over the connections it opens (channel i: connect(i)),
  // one call at a time each, closed loop, instead of unary gRPC; the
  // requests are in the connections' form.
  std::function<absl::StatusOr<std::unique_ptr<BlockingConnection>>(int)>
      connect;
};

// Shapes of synthetic requests.
struct SyntheticShape {
  int64_t batch = 1;
  // attend: query length; mha: query length; layernorm: rows per batch
  // entry (0: the input is [batch, dim]).
  int64_t seq = 128;
  // attend and mha: key/value length (0: same as seq).
  int64_t kv_seq = 0;
  // attend: head dim (default 64); mha: embedding dim (default 512);
  // layernorm: normalized dim (default 512). 0 picks the default.
  int64_t dim = 0;
  // attend and mha: number of heads.
  int64_t heads = 8;
  DType dtype = DType::kFloat32;
};

// Seeded uniform values in [-scale, scale) as a tensor of `dtype`.
absl::StatusOr<Tensor> RandomUniform(Shape shape, DType dtype,
                                     std::mt19937* random, float scale = 1);

// OK if `value` > 0; INVALID_ARGUMENT "FLAG: must be > 0, got V" otherwise.
absl::Status RequirePositive(int64_t value, absl::string_view flag);

// Tensors of the shapes `shape` describes for `op`, filled with seeded
// uniform values in [-1, 1): query/key/value for attend; query (key/value
// when kv_seq differs) and, without a model, projection weights for mha;
// input, gamma and beta for layernorm. INVALID_ARGUMENT naming the flag for
// non-positive sizes or an embedding dim the heads do not divide.
absl::StatusOr<NamedTensors> SyntheticTensors(Operation op,
                                              const SyntheticShape& shape,
                                              bool with_model);

// Changes a request before it is serialized (e.g. moves its tensors into
// shared memory).
using RequestTransform =
    std::function<absl::Status(google::protobuf::Message*)>;

// The serialized request for `op` on `tensors` with `params`, passed through
// `transform` when given.
absl::StatusOr<Workload> MakeWorkload(Operation op, const NamedViews& tensors,
                                      const OpParams& params,
                                      const RequestTransform& transform = {});

// grpc.health.v1.Health/Check for the whole server: the cheapest unary call
// the server answers, to compare the others with.
Workload HealthCheckWorkload();

// `message` framed as one gRPC message (no compression flag, big-endian
// length), the body an HTTP/2 load tool sends.
std::string GrpcFrame(const std::string& message);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_BENCH_WORKLOAD_H_
