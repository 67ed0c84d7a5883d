// A C++ client for attnserve: one channel to a server, unary calls with a
// deadline, message-size limits raised to match the server's.
//
// Thread-safety: AttnClient is safe for concurrent calls (gRPC channels and
// stubs are). Ownership: it owns its channel.
#ifndef ATTNSERVE_CLIENT_CLIENT_H_
#define ATTNSERVE_CLIENT_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/requests.h"
#include "client/shared_memory.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "inference/grpc_service.grpc.pb.h"

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

class AttnClient;

// A request's tensors in a shared-memory object of this process, registered
// with the server while the session lives; the destructor unregisters the
// region and removes the object. Thread-compatible.
class SharedMemorySession {
 public:
  ~SharedMemorySession();
  SharedMemoryPlacer& placer() { return placer_; }
  const std::string& region() const { return region_; }

 private:
  friend class AttnClient;
  SharedMemorySession(AttnClient* client,
                      std::unique_ptr<SharedMemoryBuffer> buffer,
                      std::string region)
      : client_(client),
        buffer_(std::move(buffer)),
        region_(std::move(region)),
        placer_(buffer_.get(), region_) {}

  AttnClient* client_;
  std::unique_ptr<SharedMemoryBuffer> buffer_;
  std::string region_;
  SharedMemoryPlacer placer_;
};

class AttnClient {
 public:
  explicit AttnClient(const ClientOptions& options);

  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& request);
  absl::StatusOr<v1::MultiHeadAttendResponse> MultiHeadAttend(
      const v1::MultiHeadAttendRequest& request);
  absl::StatusOr<v1::LayerNormResponse> LayerNorm(
      const v1::LayerNormRequest& request);
  absl::StatusOr<v1::RmsNormResponse> RmsNorm(
      const v1::RmsNormRequest& request);
  absl::StatusOr<v1::ListModelsResponse> ListModels();
  absl::StatusOr<v1::GetModelMetadataResponse> GetModelMetadata(
      const std::string& name);

  // Shared memory on the server's host (client/shared_memory.h).
  absl::Status RegisterSharedMemory(const v1::SharedMemoryRegion& region);
  // `name` empty: every region.
  absl::Status UnregisterSharedMemory(const std::string& name);
  absl::StatusOr<v1::ListSharedMemoryResponse> ListSharedMemory(
      const std::string& name);
  // Moves `request`'s tensors (an AttendRequest, MultiHeadAttendRequest or
  // LayerNormRequest built with raw_data) into a new shared-memory object
  // registered with the server, with room for the results; `model`: the
  // metadata of the model an MHA request names (else null). The client must
  // outlive the session.
  absl::StatusOr<std::unique_ptr<SharedMemorySession>> PlaceInSharedMemory(
      google::protobuf::Message* request,
      const v1::GetModelMetadataResponse* model);

  // Runs `op` on named tensors (see requests.h): request built from
  // `tensors` and `params`, result as "output" and "weights".
  // `shared_memory`: tensors and results travel through a shared-memory
  // object created, registered, unregistered and removed for the call.
  absl::StatusOr<NamedTensors> Run(Operation op, const NamedViews& tensors,
                                   const OpParams& params,
                                   bool shared_memory = false);

  // Decode sessions: keys and values stay on the server between steps.
  absl::StatusOr<v1::CreateSessionResponse> CreateSession(
      const v1::CreateSessionRequest& request);
  absl::StatusOr<v1::SessionStepResponse> SessionStep(
      const v1::SessionStepRequest& request);
  // Steps of many sessions in one call; one result per step, each with its
  // own code (a step that fails does not fail the call).
  absl::StatusOr<v1::SessionStepsResponse> SessionSteps(
      const v1::SessionStepsRequest& request);
  absl::Status DeleteSession(const std::string& session_id);
  // Saves the session to the server's --session_dir and frees it there, for
  // another replica sharing the directory to take up.
  absl::Status HandOverSession(const std::string& session_id);
  // A new session sharing the first `length` tokens (all when unset) of
  // `session_id`, copy-on-write.
  absl::StatusOr<v1::ForkSessionResponse> ForkSession(
      const std::string& session_id,
      std::optional<int64_t> length = std::nullopt);

  // Session transfer. ExportSession streams session `session_id`'s file to
  // `write` in order; a stream that breaks (UNAVAILABLE) is resumed from
  // the bytes written, up to twice. ImportSession sends a file (one an
  // export wrote) in chunks of `chunk_bytes`; with `session_id` (the
  // exported session's), a stream that breaks is resumed from the bytes
  // the server took, up to twice.
  absl::Status ExportSession(
      const std::string& session_id,
      absl::FunctionRef<absl::Status(absl::string_view)> write);
  absl::StatusOr<v1::ImportSessionResponse> ImportSession(
      absl::string_view file, const std::string& session_id = "",
      size_t chunk_bytes = size_t{1} << 20);

  // One Open Inference Protocol ModelInfer call (e.g. a step of a sequence).
  absl::StatusOr<inference::ModelInferResponse> ModelInfer(
      const inference::ModelInferRequest& request);

  // The server's health for `service` ("" for the whole server).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Health(
      const std::string& service);

 private:
  // One unary call of `stub`'s `method` with this client's deadline and
  // metadata.
  template <typename Stub, typename Request, typename Response>
  absl::StatusOr<Response> Call(
      Stub* stub,
      grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                   Response*),
      const Request& request);
  // One export stream of `request`, its chunks' bytes to `write`;
  // `written` counts them, `version` gets the session's.
  absl::Status ExportStream(
      const v1::ExportSessionRequest& request,
      absl::FunctionRef<absl::Status(absl::string_view)> write,
      uint64_t& written, uint64_t& version);
  // One import stream: `file` from `offset` (nothing: asks how far the
  // import of `session_id` got).
  absl::StatusOr<v1::ImportSessionResponse> ImportStream(
      const std::string& session_id, absl::string_view file, uint64_t offset,
      size_t chunk_bytes);
  // Run with shared memory, for a request built with raw_data.
  template <typename Request>
  absl::StatusOr<NamedTensors> RunInSharedMemory(
      Request request, const v1::GetModelMetadataResponse* model);
  absl::StatusOr<v1::AttendResponse> Send(const v1::AttendRequest& r) {
    return Attend(r);
  }
  absl::StatusOr<v1::MultiHeadAttendResponse> Send(
      const v1::MultiHeadAttendRequest& r) {
    return MultiHeadAttend(r);
  }
  absl::StatusOr<v1::LayerNormResponse> Send(const v1::LayerNormRequest& r) {
    return LayerNorm(r);
  }
  absl::StatusOr<v1::RmsNormResponse> Send(const v1::RmsNormRequest& r) {
    return RmsNorm(r);
  }
  // Sends `request` (through shared memory when `shared_memory`; `model`:
  // the metadata of the model it names, else null) and returns its
  // results.
  template <typename Request>
  absl::StatusOr<NamedTensors> RunRequest(
      Request request, bool shared_memory,
      const v1::GetModelMetadataResponse* model);

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> inference_stub_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_CLIENT_H_
