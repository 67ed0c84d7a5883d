// The Open Inference Protocol (KServe v2) over HTTP/JSON, on the server's
// own HTTP/1.1 engine (server/http/http_server.h):
//   GET  /v2/health/live, /v2/health/ready           (no token needed)
//   GET  /v2                                         server metadata
//   GET  /v2/models/{name}[/versions/{v}]            model metadata
//   GET  /v2/models/{name}[/versions/{v}]/ready      model readiness
//   POST /v2/models/{name}[/versions/{v}]/infer      inference
// An inference request is decoded from its JSON (and binary tensors) into
// the protocol's message and handed to the call pipeline
// (server/call_pipeline.h) directly: the same admission, queue, limits,
// cancellation (a client that disconnects stops its computation), metrics
// and access log as gRPC calls, with no gRPC in between.
//
// Before a body is read, the head alone decides refusals: an unknown path
// (404) or method (405), a token the server does not accept (401), a
// Content-Encoding other than gzip, deflate or identity (415); the body of
// a refused request is read and discarded, never parsed. Compressed
// request bodies (gzip, deflate) are inflated up to the body limit (413
// past it). Only inference responses are compressed, and only when the
// client's Accept-Encoding asks for gzip or deflate. Errors: {"error":
// message} with the HTTP status of the status code (400 INVALID_ARGUMENT,
// 401, 403, 404, 413, 429 RESOURCE_EXHAUSTED, 499 CANCELLED, 503
// UNAVAILABLE, 504 DEADLINE_EXCEEDED, 500).
//
// Thread-safety: requests are handled concurrently on the engine's handler
// threads and the pipeline's workers; the pipeline is thread-safe.
// Ownership: the returned server owns its sockets and threads; `pipeline`
// must outlive it (stop it first).
#ifndef ATTNSERVE_SERVER_HTTP_INFERENCE_H_
#define ATTNSERVE_SERVER_HTTP_INFERENCE_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/call_pipeline.h"
#include "server/http/http_server.h"

namespace attnserve {

// Starts serving on `options` (host, port, limits, timeouts); UNAVAILABLE
// naming --http_port when the port is taken.
absl::StatusOr<std::unique_ptr<HttpServer>> StartHttpInference(
    const HttpServerOptions& options, const CallPipeline* pipeline);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_HTTP_INFERENCE_H_
