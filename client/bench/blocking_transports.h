// The load generator's transports other than unary gRPC, for the Open
// Inference Protocol's ModelInfer: its gRPC stream (ModelStreamInfer, one
// stream a connection) and HTTP/1.1 (one keep-alive connection each, the
// binary tensor extension). Each carries one call at a time, in order, on
// the thread that calls it.
//
// Thread-safety: a connection is used by one thread at a time. Ownership:
// a connection owns its stream or socket and closes it when destroyed.
#ifndef ATTNSERVE_CLIENT_BENCH_BLOCKING_TRANSPORTS_H_
#define ATTNSERVE_CLIENT_BENCH_BLOCKING_TRANSPORTS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/bench/workload.h"
#include "client/client.h"
#include "inference/grpc_service.pb.h"

namespace attnserve {

// A ModelStreamInfer stream on a connection of its own to `options.target`;
// each call's request is a serialized ModelInferRequest, and a response
// that carries an error message fails the call with it.
absl::StatusOr<std::unique_ptr<BlockingConnection>> OpenStreamConnection(
    const ClientOptions& options);

// An HTTP/1.1 connection to `target` ("HOST:PORT"); each call's request is
// a whole HTTP request (HttpInferRequest), and a status other than 200
// fails the call with the response's error. A call waits at most
// `options.timeout` for its answer.
absl::StatusOr<std::unique_ptr<BlockingConnection>> OpenHttpConnection(
    absl::string_view target, const ClientOptions& options);

// `request` as an HTTP request to /v2/models/MODEL/infer on `host`: its
// tensors as binary data (Inference-Header-Content-Length), its parameters
// in the JSON header, its outputs asked for as binary data, and the bearer
// token of `options` when it has one.
absl::StatusOr<std::string> HttpInferRequest(
    const inference::ModelInferRequest& request, absl::string_view host,
    const ClientOptions& options);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_BENCH_BLOCKING_TRANSPORTS_H_
