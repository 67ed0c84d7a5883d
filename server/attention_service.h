// AttentionService on the gRPC callback API: the plumbing around the
// request handlers of server/handlers.h. Each call is authenticated; a
// compute call is also admitted (limits, deadline), queued on the scheduler,
// computed with its share of the cores, cancelled when the client goes,
// counted in the metrics and written to the access log.
//
// The RPCs take their request's bytes unparsed (gRPC's raw callback
// methods) and parse them here, after authentication: bytes that are not
// the RPC's request message are answered INVALID_ARGUMENT "request: could
// not parse N bytes as attnserve.v1.AttendRequest", counted and logged as a
// call of that RPC, where gRPC's own parse would answer UNIMPLEMENTED with
// no message, as if the method did not exist.
//
// Thread-safety: gRPC calls the RPC methods concurrently; the service's own
// mutable state is its draining flag and refusal time, atomic, and its
// message pools, locked (everything ServiceConfig points to is
// thread-safe). Ownership: the server owns the service; it must outlive the
// server, and everything ServiceConfig points to must outlive the service.
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
#include "grpcpp/support/byte_buffer.h"
#include "inference/grpc_service.pb.h"
#include "server/call_pipeline.h"
#include "server/message_pool.h"

namespace attnserve {

// Every RPC on gRPC's raw callback API: requests and responses as bytes.
using v1::AttentionService;
using RawAttentionService = AttentionService::WithRawCallbackMethod_Attend<
    AttentionService::WithRawCallbackMethod_MultiHeadAttend<
        AttentionService::WithRawCallbackMethod_LayerNorm<
            AttentionService::WithRawCallbackMethod_ListModels<
                AttentionService::WithRawCallbackMethod_GetModelMetadata<
                    AttentionService::WithRawCallbackMethod_RegisterSharedMemory<
                        AttentionService::WithRawCallbackMethod_UnregisterSharedMemory<
                            AttentionService::WithRawCallbackMethod_ListSharedMemory<
                                AttentionService::
                                    WithRawCallbackMethod_CreateSession<
                                        AttentionService::
                                            WithRawCallbackMethod_SessionStep<
                                                AttentionService::
                                                    WithRawCallbackMethod_DeleteSession<
                                                        AttentionService::
                                                            Service>>>>>>>>>>>;

// Each compute call: limits checked from the request's shapes, deadline
// checked against the estimated compute time, then queued on the scheduler
// (RESOURCE_EXHAUSTED when full); on a worker it computes with its share of
// the cores, stops at the next block boundary if cancelled, and reports its
// compute time in the trailer `attnserve-compute-us`.
class AttentionServiceImpl final : public RawAttentionService {
 public:
  // `pipeline` must outlive the service.
  explicit AttentionServiceImpl(CallPipeline* pipeline);

  // Each takes the serialized request and fills `response` with the
  // serialized answer when the call succeeds.
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* MultiHeadAttend(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* LayerNorm(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetModelMetadata(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RegisterSharedMemory(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListSharedMemory(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
      grpc::ByteBuffer* response) override;
  // Decode sessions: CreateSession and DeleteSession answer on gRPC's
  // thread (refused while draining: a new session would die with the
  // server); SessionStep is a compute call.
  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* SessionStep(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* DeleteSession(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;

  // The Open Inference Protocol's ModelInfer (server/open_inference.h):
  // authenticated, parsed, translated to the native call of its model,
  // then admitted, queued, computed and recorded as the native RPCs are.
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response);

  // For the other services of the server: an RPC that only reads or
  // registers server state. Authenticated (when `authenticate`), parsed
  // into `request`, then answered by `handle()` filling `response`, on
  // gRPC's thread. Only requests that do not parse are recorded.
  // `request` and `response` need to live only until this returns.
  grpc::ServerUnaryReactor* ServeStateCall(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer& raw_request,
      grpc::ByteBuffer* raw_response, bool authenticate,
      google::protobuf::Message* request, google::protobuf::Message* response,
      absl::FunctionRef<absl::Status()> handle) const;

  bool ready() const { return pipeline_->ready(); }
  const ServiceConfig& config() const { return pipeline_->config(); }

 private:
  // A compute call from arrival to answer; defined in the .cc.
  struct Call;

  // Compute RPCs: takes a request and response pair from `pool`,
  // authenticates the call and parses `raw_request` into the request; then
  // `bind(request)` gives the call's cost and its handler (or an error that
  // refuses the call; bind may take the request's contents), run as
  // `handle(request, response, control)` on a worker (or, when tiny, here)
  // once the call is admitted. The response is serialized into
  // `raw_response`.
  template <typename Request, typename Response, typename Bind>
  grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer& raw_request,
                                  grpc::ByteBuffer* raw_response,
                                  MessagePool<Request, Response>* pool,
                                  Bind bind);
  // Admits the authenticated, parsed `call`, then computes it with `handle`
  // (the RPC's handler bound to the request and the response) here if it is
  // tiny and a worker is free, or queues it on the scheduler. A template so
  // that the handler is not type-erased into an allocation on the tiny-call
  // path.
  template <typename BoundHandler>
  grpc::ServerUnaryReactor* Dispatch(Call call, BoundHandler handle);
  // Computes an admitted call and answers it through `reactor`, having
  // returned its messages to their pool (once answered, the server and its
  // pools may be destroyed). `cancelled`: set when the client cancels or the
  // deadline passes; null for calls too short to be worth stopping.
  void Compute(Call& call,
               absl::FunctionRef<absl::Status(const CallControl&)> handle,
               grpc::ServerUnaryReactor* reactor,
               const std::atomic<bool>* cancelled);
  // Answers `call` with `status` (not OK) before it computes.
  grpc::ServerUnaryReactor* Refuse(const Call& call,
                                   const absl::Status& status) const;
  // RPCs that only read or register server state: authenticated, parsed,
  // then answered by `handle(request, &response)` on gRPC's thread, outside
  // the scheduler. Only the requests that do not parse are counted in the
  // metrics and the access log: they mark a broken client.
  template <typename Request, typename Response, typename Handler>
  grpc::ServerUnaryReactor* ServeInline(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer& raw_request,
                                        grpc::ByteBuffer* raw_response,
                                        Handler handle) const;
  absl::Status Authenticate(const grpc::CallbackServerContext& context) const;

  CallPipeline* const pipeline_;
  const ServiceConfig& config_;
  // Messages of the compute RPCs, reused across calls.
  MessagePool<v1::AttendRequest, v1::AttendResponse> attend_messages_;
  MessagePool<v1::MultiHeadAttendRequest, v1::MultiHeadAttendResponse>
      multi_head_messages_;
  MessagePool<v1::LayerNormRequest, v1::LayerNormResponse> layer_norm_messages_;
  MessagePool<v1::SessionStepRequest, v1::SessionStepResponse>
      session_step_messages_;
  MessagePool<inference::ModelInferRequest, inference::ModelInferResponse>
      model_infer_messages_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
