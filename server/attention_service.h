// AttentionService on the gRPC callback API: each RPC converts the request's
// wire tensors into core views (no copy), calls the core, and writes the
// result into the response.
//
// Thread-safety: gRPC calls the handlers concurrently; the service's own
// mutable state is its draining flag, atomic (the model repository is
// thread-safe). Ownership:
// the server owns the service; it must outlive the server.
#ifndef ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
#define ATTNSERVE_SERVER_ATTENTION_SERVICE_H_

#include <atomic>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "server/auth.h"
#include "server/message_pool.h"
#include "server/metrics.h"
#include "server/model_repository.h"
#include "server/request_cost.h"
#include "server/scheduler.h"
#include "server/shared_memory.h"

namespace attnserve {

// What a running call lets its handler see of the call.
struct CallControl {
  // Turns true when the client cancels or the deadline passes.
  const std::atomic<bool>* cancelled = nullptr;
  // Resolves the request's shared-memory references and keeps their regions
  // mapped for the call; null: references are refused.
  CallSharedMemory* shared_memory = nullptr;
};

// Request handling without gRPC's machinery, so that it can be tested and
// reused directly.
absl::Status HandleAttend(const v1::AttendRequest& request,
                          v1::AttendResponse* response,
                          const CallControl& control = {});
// `models` may be null (no repository).
absl::Status HandleMultiHeadAttend(const v1::MultiHeadAttendRequest& request,
                                   const ModelRepository* models,
                                   v1::MultiHeadAttendResponse* response,
                                   const CallControl& control = {});
absl::Status HandleListModels(const ModelRepository* models,
                              v1::ListModelsResponse* response);
absl::Status HandleGetModelMetadata(const v1::GetModelMetadataRequest& request,
                                    const ModelRepository* models,
                                    v1::GetModelMetadataResponse* response);
absl::Status HandleLayerNorm(const v1::LayerNormRequest& request,
                             v1::LayerNormResponse* response,
                             const CallControl& control = {});
// `registry` may be null (shared memory off).
absl::Status HandleRegisterSharedMemory(
    const v1::RegisterSharedMemoryRequest& request,
    SharedMemoryRegistry* registry);
absl::Status HandleListSharedMemory(const v1::ListSharedMemoryRequest& request,
                                    const SharedMemoryRegistry* registry,
                                    v1::ListSharedMemoryResponse* response);

// What the service needs from the server around it; every pointer must
// outlive the service.
struct ServiceConfig {
  const ModelRepository* models = nullptr;  // null: no repository
  // Null: no shared memory (its RPCs answer FAILED_PRECONDITION).
  SharedMemoryRegistry* shared_memory = nullptr;
  Scheduler* scheduler = nullptr;   // required
  CostModel* cost_model = nullptr;  // required
  Metrics* metrics = nullptr;       // required
  // Null: no authentication.
  const TokenAuthenticator* auth = nullptr;
  // Write one access-log line per call to stderr.
  bool access_log = false;
  // Refused with RESOURCE_EXHAUSTED before any allocation.
  int64_t max_tensor_elements = 0;
  int64_t max_request_bytes = 0;
};

// Each compute call: limits checked from the request's shapes, deadline
// checked against the estimated compute time, then queued on the scheduler
// (RESOURCE_EXHAUSTED when full); on a worker it computes with its share of
// the cores, stops at the next block boundary if cancelled, and reports its
// compute time in the trailer `attnserve-compute-us`.
class AttentionServiceImpl final
    : public v1::AttentionService::CallbackService {
 public:
  explicit AttentionServiceImpl(const ServiceConfig& config);

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;
  grpc::ServerUnaryReactor* MultiHeadAttend(
      grpc::CallbackServerContext* context,
      const v1::MultiHeadAttendRequest* request,
      v1::MultiHeadAttendResponse* response) override;
  grpc::ServerUnaryReactor* LayerNorm(grpc::CallbackServerContext* context,
                                      const v1::LayerNormRequest* request,
                                      v1::LayerNormResponse* response) override;
  grpc::ServerUnaryReactor* ListModels(
      grpc::CallbackServerContext* context,
      const v1::ListModelsRequest* request,
      v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* GetModelMetadata(
      grpc::CallbackServerContext* context,
      const v1::GetModelMetadataRequest* request,
      v1::GetModelMetadataResponse* response) override;
  grpc::ServerUnaryReactor* RegisterSharedMemory(
      grpc::CallbackServerContext* context,
      const v1::RegisterSharedMemoryRequest* request,
      v1::RegisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(
      grpc::CallbackServerContext* context,
      const v1::UnregisterSharedMemoryRequest* request,
      v1::UnregisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* ListSharedMemory(
      grpc::CallbackServerContext* context,
      const v1::ListSharedMemoryRequest* request,
      v1::ListSharedMemoryResponse* response) override;

  // From now on compute calls are refused with UNAVAILABLE "server is
  // shutting down; retry on another replica"; accepted calls finish, and
  // ListModels and GetModelMetadata still answer.
  void StopAcceptingCalls() { draining_.store(true); }
  // When a call was last refused for that (absl::UnixEpoch(): never).
  absl::Time last_refused() const {
    return absl::FromUnixNanos(last_refused_ns_.load());
  }

 private:
  template <typename Request, typename Response, typename Handler>
  grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* context,
                                  const Request* request, Response* response,
                                  const RequestCost& cost, Handler handle);
  absl::Status Authenticate(const grpc::CallbackServerContext& context) const;
  absl::Status Admit(const grpc::CallbackServerContext& context,
                     const RequestCost& cost) const;
  // Metrics and the access log for one finished call.
  void Record(const std::string& rpc, const google::protobuf::Message& request,
              const google::protobuf::Message* response,
              const absl::Status& status, absl::Time arrived,
              absl::Duration queue_wait, absl::Duration compute,
              double flops) const;

  ServiceConfig config_;
  std::atomic<bool> draining_{false};
  mutable std::atomic<int64_t> last_refused_ns_{0};
  // Messages of the compute RPCs, reused across calls.
  MessagePool<v1::AttendRequest, v1::AttendResponse> attend_messages_;
  MessagePool<v1::MultiHeadAttendRequest, v1::MultiHeadAttendResponse>
      multi_head_messages_;
  MessagePool<v1::LayerNormRequest, v1::LayerNormResponse> layer_norm_messages_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
