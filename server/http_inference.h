// The Open Inference Protocol (KServe v2) over HTTP/JSON:
//   GET  /v2/health/live, /v2/health/ready           (no token needed)
//   GET  /v2                                         server metadata
//   GET  /v2/models/{name}[/versions/{v}]            model metadata
//   GET  /v2/models/{name}[/versions/{v}]/ready      model readiness
//   POST /v2/models/{name}[/versions/{v}]/infer      inference
// Each request becomes the protocol's gRPC call on the server's own
// in-process channel, so HTTP calls get the same authentication (the
// Authorization header), admission, queue, limits, metrics and access log as
// gRPC ones. Before a body is read, requests are refused that carry a token
// the server does not accept (401), an Authorization header that is not
// printable ASCII (400), no Content-Length (411: chunked bodies could grow
// past the limit) or a Content-Encoding (415: a compressed body could).
// Errors: {"error": message} with the HTTP status of the gRPC
// code (400 INVALID_ARGUMENT, 401, 403, 404, 413 for a body over the limit,
// 429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, 504 DEADLINE_EXCEEDED, 500).
//
// Thread-safety: httplib's worker threads serve requests concurrently; the
// gRPC stub is thread-safe. Ownership: owns its listener; the channel's
// server must outlive it (stop this first).
#ifndef ATTNSERVE_SERVER_HTTP_INFERENCE_H_
#define ATTNSERVE_SERVER_HTTP_INFERENCE_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "server/auth.h"
#include "server/http_listener.h"

namespace attnserve {

struct HttpInferenceConfig {
  std::string host;
  int port = 0;  // 0: a free port
  // Larger bodies get 413.
  size_t max_body_bytes = 0;
  // The gRPC server's in-process channel.
  std::shared_ptr<grpc::Channel> channel;
  // Checks the Authorization header before a body is read (the gRPC call
  // checks it again); null: no authentication.
  const TokenAuthenticator* auth = nullptr;
};

// Starts serving; UNAVAILABLE naming --http_port when the port is taken.
absl::StatusOr<std::unique_ptr<HttpListener>> StartHttpInference(
    const HttpInferenceConfig& config);

// The HTTP status for a gRPC status code.
int HttpStatusOf(grpc::StatusCode code);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_HTTP_INFERENCE_H_
