// A C++ client for attnserve: one channel to a server, unary calls with a
// deadline, message-size limits raised to match the server's.
//
// Thread-safety: AttnClient is safe for concurrent calls (gRPC channels and
// stubs are). Ownership: it owns its channel.
#ifndef ATTNSERVE_CLIENT_CLIENT_H_
#define ATTNSERVE_CLIENT_CLIENT_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/requests.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"

namespace attnserve {

struct ClientOptions {
  // "host:port" (or any gRPC target URI) of the server.
  std::string target = "127.0.0.1:50051";
  // Deadline of each call.
  absl::Duration timeout = absl::Seconds(60);
  // Largest request and response message, in MiB.
  int max_message_mb = 256;
  // TLS: PEM CA certificates to verify the server with (empty: plaintext).
  std::string tls_ca_pem;
  // Mutual TLS: this client's PEM certificate chain and private key.
  std::string tls_cert_pem;
  std::string tls_key_pem;
  // Sent as `authorization: Bearer <token>` when not empty.
  std::string token;
  // A gRPC service config in JSON, e.g. round_robin load balancing over the
  // addresses of an `ipv4:` target, and a retry policy (empty: none).
  std::string service_config_json;
};

// A channel to `options.target` with its credentials, message limits and
// service config. `own_connection`: never share the connection with other
// channels of this process (load tests open several on purpose).
std::shared_ptr<grpc::Channel> CreateChannel(const ClientOptions& options,
                                             bool own_connection = false);

// Adds the deadline and the bearer token of `options` to a call.
void PrepareContext(const ClientOptions& options, grpc::ClientContext* context);

// The gRPC status as an absl::Status with the same code and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

class AttnClient {
 public:
  explicit AttnClient(const ClientOptions& options);

  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& request);
  absl::StatusOr<v1::MultiHeadAttendResponse> MultiHeadAttend(
      const v1::MultiHeadAttendRequest& request);
  absl::StatusOr<v1::LayerNormResponse> LayerNorm(
      const v1::LayerNormRequest& request);
  absl::StatusOr<v1::ListModelsResponse> ListModels();
  absl::StatusOr<v1::GetModelMetadataResponse> GetModelMetadata(
      const std::string& name);

  // Runs `op` on named tensors (see requests.h): request built from
  // `tensors` and `params`, result as "output" and "weights".
  absl::StatusOr<NamedTensors> Run(Operation op, const NamedViews& tensors,
                                   const OpParams& params);

  // The server's health for `service` ("" for the whole server).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Health(
      const std::string& service);

 private:
  template <typename Request, typename Response, typename Method>
  absl::StatusOr<Response> Call(Method method, const Request& request);

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_CLIENT_H_
