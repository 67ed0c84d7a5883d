// The workload of `attnctl bench --rpc=decode`: decode sessions opened on the
// server, one per connection, each prefilled with `kv_seq` tokens in each of
// its layers; every call is a step of `step_tokens` new tokens at position
// `kv_seq`, so each step replaces the previous one's tokens and the cache
// stays at kv_seq + step_tokens however many calls run. With several layers
// a token is one call per layer, layer 0 first. The report's latency is the
// latency of one call (one layer's step).
//
// Over the Open Inference Protocol, each connection steps a sequence of
// `attention_session` (or of the served model's `NAME_session`) with
// ModelInfer: the prefill is the sequence's start (over gRPC), and every
// measured call carries `sequence_position` kv_seq, as the native step
// carries position. The measured calls go over unary gRPC, one
// ModelStreamInfer stream per connection, or an HTTP/1.1 connection each
// (the binary tensor extension).
//
// Ownership: DecodeSessions deletes its sessions when destroyed; the client
// it was opened with must outlive it. Thread-safety: thread-compatible.
#ifndef ATTNSERVE_CLIENT_BENCH_DECODE_H_
#define ATTNSERVE_CLIENT_BENCH_DECODE_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/bench/workload.h"
#include "client/client.h"
#include "core/tensor.h"

namespace attnserve {

// The wire API the steps are sent through.
enum class DecodeProtocol {
  kNative,               // SessionStep / SessionSteps
  kOpenInference,        // ModelInfer on a sequence (unary gRPC)
  kOpenInferenceStream,  // the same over ModelStreamInfer
  kOpenInferenceHttp,    // the same over HTTP/1.1 (/v2/models/NAME/infer)
};

// "native", "open_inference", "open_inference_stream" or
// "open_inference_http"; INVALID_ARGUMENT naming --protocol else.
absl::StatusOr<DecodeProtocol> ParseDecodeProtocol(absl::string_view text);

struct DecodeBenchOptions {
  DecodeProtocol protocol = DecodeProtocol::kNative;
  // kOpenInferenceHttp: the server's HTTP address, HOST:PORT.
  std::string http_target;
  // The gRPC connection's options (the stream transport opens its own
  // connections with them; the HTTP one takes the token and timeout).
  ClientOptions client;
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
  // Element type of the inputs; BFLOAT16 inputs compute in bfloat16.
  DType dtype = DType::kFloat32;
  // What the caches store: unset, the server's default (the compute dtype,
  // or a model's configured cache dtype); else FLOAT32, BFLOAT16 or INT8.
  std::optional<DType> cache_dtype;
  // Layers each session holds; each token is one step per layer.
  int layers = 1;
  // One per connection.
  int sessions = 1;
  // > 0: each connection's call is one SessionSteps call stepping this many
  // sessions of its own (sessions x batch_sessions in all).
  int batch_sessions = 0;
};

// OK when `options` can run; INVALID_ARGUMENT naming the flag otherwise,
// e.g. "--layers: 0 is not >= 1" (and the native-only flags with
// kOpenInference: --batch_sessions, --layers, an INT8 --cache_dtype). Asks
// the server nothing.
absl::Status VerifyDecodeBenchOptions(const DecodeBenchOptions& options);

class DecodeSessions {
 public:
  // Creates and prefills the sessions (or starts the sequences); fails with
  // the server's error.
  static absl::StatusOr<std::unique_ptr<DecodeSessions>> Open(
      AttnClient& client, const DecodeBenchOptions& options);
  ~DecodeSessions();
  DecodeSessions(const DecodeSessions&) = delete;
  DecodeSessions& operator=(const DecodeSessions&) = delete;

  // Per connection (Workload::per_connection), one request per layer:
  // SessionStep requests of its session, or SessionSteps requests of its
  // batch_sessions sessions.
  const Workload& workload() const { return workload_; }

 private:
  explicit DecodeSessions(AttnClient& client) : client_(client) {}
  // The protocol's transports: starts one sequence per connection.
  absl::Status StartSequences(const DecodeBenchOptions& options);
  // Sets how the workload's steps travel: unary gRPC, or the stream's or
  // HTTP connections (StartSequences wrote its requests in their form).
  void SetTransport(const DecodeBenchOptions& options);

  AttnClient& client_;
  std::vector<std::string> ids_;
  // Open Inference sequences: a step with sequence_end, one per sequence.
  std::vector<inference::ModelInferRequest> sequence_ends_;
  Workload workload_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_BENCH_DECODE_H_
