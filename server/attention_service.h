// AttentionService on the gRPC callback API: the plumbing around the
// request handlers of server/handlers.h. Each call is authenticated; a
// compute call is also admitted (limits, deadline), queued on the scheduler,
// computed with its share of the cores, cancelled when the client goes,
// counted in the metrics and written to the access log.
//
// Thread-safety: gRPC calls the RPC methods concurrently; the service's own
// mutable state is its draining flag and refusal time, atomic (everything
// ServiceConfig points to is thread-safe). Ownership: the server owns the
// service; it must outlive the server, and everything ServiceConfig points
// to must outlive the service.
#ifndef ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
#define ATTNSERVE_SERVER_ATTENTION_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "core/thread_budget.h"
#include "server/auth.h"
#include "server/message_pool.h"
#include "server/metrics.h"
#include "server/model_repository.h"
#include "server/request_cost.h"
#include "server/scheduler.h"
#include "server/shared_memory.h"

namespace attnserve {

struct CallControl;  // server/handlers.h

// What the service needs from the server around it; every pointer must
// outlive the service.
struct ServiceConfig {
  const ModelRepository* models = nullptr;  // null: no repository
  // Null: no shared memory (its RPCs answer FAILED_PRECONDITION).
  SharedMemoryRegistry* shared_memory = nullptr;
  Scheduler* scheduler = nullptr;   // required
  CostModel* cost_model = nullptr;  // required
  Metrics* metrics = nullptr;       // required
  // Required: the cores compute calls share. Each call leases its share
  // (no more threads than its size keeps busy) while it computes.
  ThreadBudget* thread_budget = nullptr;
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
  // A compute call from arrival to answer; defined in the .cc.
  struct Call;

  // Compute RPCs: `handle(*request, response, control)` runs on a worker
  // (or, when tiny, here) once the call is authenticated and admitted.
  template <typename Request, typename Response, typename Handler>
  grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* context,
                                  const Request* request, Response* response,
                                  const RequestCost& cost, Handler handle);
  // Authenticates and admits `call`, then computes it with `handle` (the
  // RPC's handler bound to the request and the response) here if it is tiny
  // and a worker is free, or queues it on the scheduler. A template so that
  // the handler is not type-erased into an allocation on the tiny-call path.
  template <typename BoundHandler>
  grpc::ServerUnaryReactor* Dispatch(Call call, BoundHandler handle);
  // Computes an admitted call and answers it through `reactor`.
  // `cancelled`: set when the client cancels or the deadline passes; null
  // for calls too short to be worth stopping.
  void Compute(const Call& call,
               absl::FunctionRef<absl::Status(const CallControl&)> handle,
               grpc::ServerUnaryReactor* reactor,
               const std::atomic<bool>* cancelled);
  // RPCs that only read or register server state: authenticated, then
  // answered on gRPC's thread, outside the scheduler and the metrics.
  grpc::ServerUnaryReactor* ServeInline(
      grpc::CallbackServerContext* context, google::protobuf::Message* response,
      absl::FunctionRef<absl::Status()> handle);
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
