// gRPC's side of a call, for every gRPC service of the server: RPCs on
// gRPC's raw callback API (requests and responses as bytes), authenticated
// first, then parsed (bytes that are not the RPC's request answer
// INVALID_ARGUMENT "request: could not parse N bytes as attnserve.v1.
// AttendRequest" and are recorded, where gRPC's own parse would answer
// UNIMPLEMENTED with no message), then handed to the call pipeline
// (server/call_pipeline.h) or answered from server state.
//
// A service registers each RPC with one line in its constructor:
//   AddCompute<v1::AttendRequest, v1::AttendResponse>(
//       [](const v1::AttendRequest& r) { return Bound(CostOf(r),
//       &HandleAttend); });
//   AddState<v1::ListModelsRequest, v1::ListModelsResponse>(handler);
// The RPC is the one named after the request type ("AttendRequest" ->
// Attend); its metrics label is that name; its cost is what the bind
// returns. Every RPC of the service must be registered
// (VerifyEveryRpcAdded, at the end of the constructor).
//
// Thread-safety: gRPC calls the registered RPCs concurrently; GrpcCalls holds
// only the pipeline, and each compute RPC's message pool is locked.
// Ownership: a RawService owns its message pools; the pipeline must outlive
// it.
#ifndef ATTNSERVE_SERVER_GRPC_CALLS_H_
#define ATTNSERVE_SERVER_GRPC_CALLS_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/session_store.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/impl/codegen/server_callback_handlers.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/call_pipeline.h"
#include "server/call_records.h"
#include "server/message_pool.h"

namespace attnserve {

// What a compute RPC's bind returns for a call it accepts: its cost, its
// handler, run as handle(request, response, control) once admitted, and
// the call's label in the metrics and the access log when it is not the
// RPC's name (the Open Inference Protocol's ModelInfer is labelled by the
// operation it computes, "ModelInfer/Attend").
template <typename Handler>
struct BoundCall {
  RequestCost cost;
  Handler handle;
  std::string rpc;
};
template <typename Handler>
absl::StatusOr<BoundCall<Handler>> Bound(RequestCost cost, Handler handle,
                                         std::string rpc = "") {
  return BoundCall<Handler>{cost, std::move(handle), std::move(rpc)};
}

// When `context`'s call is due (absl::InfiniteFuture(): never).
absl::Time DeadlineOf(const grpc::CallbackServerContext& context);

// Parses the bytes of a request (or a stream's message) into `request`:
// INVALID_ARGUMENT "request: could not parse N bytes as <type>" when they
// are not one, `request` left empty. Consumes `raw`'s bytes.
absl::Status ParseMessage(const grpc::ByteBuffer& raw,
                          google::protobuf::Message* request);
// Serializes `response` into `raw`, for gRPC to send (INTERNAL if it
// cannot).
absl::Status SerializeMessage(const google::protobuf::Message& response,
                              grpc::ByteBuffer* raw);

class GrpcCalls {
 public:
  explicit GrpcCalls(CallPipeline* pipeline) : pipeline_(pipeline) {}
  CallPipeline* pipeline() const { return pipeline_; }

  // A compute call: takes a request and response pair from `pool`,
  // authenticates, parses; `bind(request)` gives the cost and handler (or
  // an error that refuses the call); then the pipeline admits it and the
  // handler computes here (tiny calls) or on a worker, cancellable. The
  // response is serialized into `raw_response`.
  template <typename Request, typename Response, typename Bind>
  grpc::ServerUnaryReactor* ServeCompute(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer& raw_request,
                                         grpc::ByteBuffer* raw_response,
                                         MessagePool<Request, Response>* pool,
                                         const Bind& bind);

  // A call that reads or registers server state: authenticated (when
  // `authenticate`), parsed into `request`, then answered by `handle()`
  // filling `response`, on gRPC's thread. Only requests that do not parse
  // are recorded: they mark a broken client.
  grpc::ServerUnaryReactor* ServeState(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer& raw_request,
      grpc::ByteBuffer* raw_response, bool authenticate,
      google::protobuf::Message* request, google::protobuf::Message* response,
      absl::FunctionRef<absl::Status()> handle) const;

  // The request and response of a state call that may be answered on a
  // worker (ServeWaitingState), alive until it is answered.
  struct StateMessages {
    StateMessages(std::unique_ptr<google::protobuf::Message> request_message,
                  std::unique_ptr<google::protobuf::Message> response_message)
        : request(std::move(request_message)),
          response(std::move(response_message)),
          subject(request.get(), response.get()) {}
    std::unique_ptr<google::protobuf::Message> request, response;
    MessageSubject subject;
  };
  // ServeState for a call that may wait for a file or another replica (a
  // decode session not open here, taken up first): once parsed, when
  // `waits()`, `handle(PeerWait::kAllowed)` runs on an engine worker as a
  // call that may wait (recorded under the RPC's name; refused as compute
  // calls are when the queue is full) and the call is answered from there;
  // otherwise `handle(PeerWait::kRefused)` here, as ServeState, and on a
  // worker after all when it would have waited (the session moved away
  // after `waits()`: IsWouldWait). gRPC's threads never wait for a peer:
  // the peer's answer may need this server's (a hand-over asked both ways
  // at once).
  grpc::ServerUnaryReactor* ServeWaitingState(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer& raw_request,
      grpc::ByteBuffer* raw_response, std::shared_ptr<StateMessages> messages,
      absl::FunctionRef<bool()> waits,
      std::function<absl::Status(PeerWait)> handle) const;

 private:
  // Authenticates (when `authenticate`) and parses a state call's request,
  // recording a request that does not parse.
  absl::Status AcceptState(const grpc::CallbackServerContext& context,
                           const grpc::ByteBuffer& raw_request,
                           bool authenticate,
                           google::protobuf::Message* request,
                           absl::Time arrived) const;
  // A compute call from arrival to answer.
  struct Call {
    grpc::CallbackServerContext* context;
    google::protobuf::Message* response;
    grpc::ByteBuffer* raw_response;  // gRPC's, filled when the call succeeds
    // Its subject is set where the call is recorded (the call moves before
    // that, and `subject` with it).
    EngineCall record;
    MessageSubject subject;
    // Owns the request and `response`; null once back in their pool.
    PooledMessagesPtr messages;
  };
  using Handle = absl::FunctionRef<absl::Status(const CallControl&)>;
  // `call`'s record, pointing to its subject where the call is now.
  static const EngineCall& RecordOf(Call& call) {
    call.record.subject = &call.subject;
    return call.record;
  }

  // `call` through the engine's dispatch (Engine::Dispatch): refused,
  // computed here on gRPC's default reactor (tiny, a worker free), or
  // queued with a reactor that watches for cancellation. `handle` is a
  // template parameter so that the tiny path allocates nothing.
  template <typename BoundHandler>
  grpc::ServerUnaryReactor* Dispatch(Call call, BoundHandler handle) const;
  // The work of a queued call: `*reactor` is set to its own reactor, which
  // records cancellation for the computation to see.
  std::function<void()> QueuedWork(
      std::shared_ptr<Call> call,
      std::function<absl::Status(const CallControl&)> handle,
      grpc::ServerUnaryReactor** reactor) const;
  // Computes an admitted call and answers it through `reactor`, having
  // returned its messages to their pool.
  void Compute(Call& call, Handle handle, grpc::ServerUnaryReactor* reactor,
               const std::atomic<bool>* cancelled) const;
  // Hands `call` to the pipeline's step coalescer (CallPipeline::Coalesce)
  // with a reactor that watches for cancellation; `owner` (what `step`'s
  // functions use) lives until the call is answered.
  grpc::ServerUnaryReactor* Coalesce(Call call, SessionStepCall step,
                                     std::shared_ptr<const void> owner) const;
  // Answers a call that computed (or was refused on its way to computing):
  // Complete, the engine's record of it, then the answer.
  void Answer(Call& call, absl::Status status, absl::Duration queue_wait,
              absl::Duration compute, grpc::ServerUnaryReactor* reactor) const;
  // A computed call's response: its compute-time trailer and, if `status`
  // is OK, its serialization; the status to answer with.
  absl::Status Complete(Call& call, absl::Status status,
                        absl::Duration compute) const;
  // Finishes `reactor` with `status`, having returned the call's messages
  // to their pool.
  void Answer(Call& call, const absl::Status& status,
              grpc::ServerUnaryReactor* reactor) const;
  // Answers `call` with `status` (not OK) before it computes.
  grpc::ServerUnaryReactor* Refuse(Call& call,
                                   const absl::Status& status) const;
  // Authenticates, checks the limits VerifyBeforeParse checks, then
  // parses `raw_request` into `request`.
  absl::Status Accept(const grpc::CallbackServerContext& context,
                      const grpc::ByteBuffer& raw_request,
                      google::protobuf::Message* request) const;
  // The limits on a request's repeated fields, checked on its bytes before
  // it is decoded (decoding is what costs memory): a SessionSteps call's
  // steps (--max_steps_per_call).
  absl::Status VerifyBeforeParse(
      const grpc::ByteBuffer& raw_request,
      const google::protobuf::Message& request) const;

  CallPipeline* const pipeline_;
};

// A generated gRPC service (GrpcService is e.g. v1::AttentionService)
// whose RPCs are registered on the raw callback API with AddCompute and
// AddState.
template <typename GrpcService>
class RawService : public GrpcService::Service {
 protected:
  explicit RawService(GrpcCalls* calls) : calls_(calls) {}

  // The compute RPC named after Request, served with `bind` (see
  // GrpcCalls::ServeCompute).
  template <typename Request, typename Response, typename Bind>
  void AddCompute(Bind bind) {
    auto pool = std::make_shared<MessagePool<Request, Response>>(
        kPooledMessages, kPooledBytes);
    pools_.push_back(pool);
    Mark(MethodOf<Request>(),
         [this, pool, bind = std::move(bind)](
             grpc::CallbackServerContext* context,
             const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
           return calls_->ServeCompute(context, *request, response, pool.get(),
                                       bind);
         });
  }

  // The state RPC named after Request: handle(request, &response) on gRPC's
  // thread, authenticated unless `authenticate` is false.
  template <typename Request, typename Response, typename Handler>
  void AddState(Handler handle, bool authenticate = true) {
    Mark(MethodOf<Request>(), [this, handle = std::move(handle), authenticate](
                                  grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* raw_request,
                                  grpc::ByteBuffer* raw_response) {
      Request request;
      Response response;
      return calls_->ServeState(
          context, *raw_request, raw_response, authenticate, &request,
          &response, [&] { return handle(std::as_const(request), &response); });
    });
  }

  // A state RPC on a decode session, named after Request:
  // handle(request, &response, PeerWait) on gRPC's thread, or on a worker
  // when waits(request) (see GrpcCalls::ServeWaitingState).
  template <typename Request, typename Response, typename Handler,
            typename Waits>
  void AddSessionState(Handler handle, Waits waits) {
    Mark(MethodOf<Request>(), [this, handle = std::move(handle),
                               waits = std::move(waits)](
                                  grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* raw_request,
                                  grpc::ByteBuffer* raw_response) {
      auto messages = std::make_shared<GrpcCalls::StateMessages>(
          std::make_unique<Request>(), std::make_unique<Response>());
      const auto& request = static_cast<const Request&>(*messages->request);
      auto* response = static_cast<Response*>(messages->response.get());
      return calls_->ServeWaitingState(
          context, *raw_request, raw_response, messages,
          [&] { return waits(request); },
          [handle, &request, response](PeerWait wait) {
            return handle(request, response, wait);
          });
    });
  }

  // The streaming RPCs `method`: `start` returns the stream's reactor,
  // called with the context (bidirectional), the context and the request
  // (server streaming), or the context and the response to fill (client
  // streaming).
  template <typename Start>
  void AddStream(absl::string_view method, Start start) {
    AddRaw<grpc::internal::CallbackBidiHandler>(method, std::move(start));
  }
  template <typename Start>
  void AddServerStream(absl::string_view method, Start start) {
    AddRaw<grpc::internal::CallbackServerStreamingHandler>(method,
                                                           std::move(start));
  }
  template <typename Start>
  void AddClientStream(absl::string_view method, Start start) {
    AddRaw<grpc::internal::CallbackClientStreamingHandler>(method,
                                                           std::move(start));
  }

  // Aborts start-up when an RPC of the service was not registered (gRPC
  // would serve it on a synchronous thread pool the server does not have).
  void VerifyEveryRpcAdded() const {
    const google::protobuf::ServiceDescriptor* service = Descriptor();
    GPR_ASSERT(static_cast<int>(added_.size()) == service->method_count());
  }

  GrpcCalls* calls() const { return calls_; }

 private:
  // Idle message pairs kept per RPC, and their capacity: enough for the
  // calls a busy server has in flight, small next to what they compute.
  static constexpr size_t kPooledMessages = 64;
  static constexpr size_t kPooledBytes = size_t{64} << 20;

  static const google::protobuf::ServiceDescriptor* Descriptor() {
    return google::protobuf::DescriptorPool::generated_pool()
        ->FindServiceByName(GrpcService::service_full_name());
  }
  // The index of the RPC named after Request ("AttendRequest": Attend).
  template <typename Request>
  static int MethodOf() {
    return MethodNamed(RpcName(Request::default_instance()));
  }
  static int MethodNamed(absl::string_view name) {
    const google::protobuf::MethodDescriptor* method =
        Descriptor()->FindMethodByName(std::string(name));
    GPR_ASSERT(method != nullptr && "no RPC of the service has this name");
    return method->index();
  }
  // `method` served by gRPC's raw callback `Handler` of `start`.
  template <template <typename, typename> class Handler, typename Start>
  void AddRaw(absl::string_view method, Start start) {
    const int index = MethodNamed(method);
    added_.push_back(index);
    this->MarkMethodRawCallback(
        index,
        new Handler<grpc::ByteBuffer, grpc::ByteBuffer>(std::move(start)));
  }
  template <typename Function>
  void Mark(int method, Function function) {
    added_.push_back(method);
    this->MarkMethodRawCallback(
        method, new grpc::internal::CallbackUnaryHandler<grpc::ByteBuffer,
                                                         grpc::ByteBuffer>(
                    std::move(function)));
  }

  GrpcCalls* const calls_;
  std::vector<std::shared_ptr<void>> pools_;
  std::vector<int> added_;
};

// The definitions of GrpcCalls' templates.

template <typename Request, typename Response, typename Bind>
grpc::ServerUnaryReactor* GrpcCalls::ServeCompute(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer& raw_request,
    grpc::ByteBuffer* raw_response, MessagePool<Request, Response>* pool,
    const Bind& bind) {
  const absl::Time arrived = absl::Now();
  typename MessagePool<Request, Response>::Messages* messages =
      pool->AllocateMessages();
  Request* request = messages->request();
  Response* response = messages->response();
  Call call{.context = context,
            .response = response,
            .raw_response = raw_response,
            .record = {.label = RpcName(*request),
                       .subject = nullptr,
                       .cost = {},  // known once the request is parsed
                       .arrived = arrived,
                       .deadline = DeadlineOf(*context)},
            .subject = MessageSubject(request, response),
            .messages = PooledMessagesPtr(messages)};
  // Authenticated first: an unauthenticated client's bytes are not parsed.
  const absl::Status accepted = Accept(*context, raw_request, request);
  if (!accepted.ok()) return Refuse(call, accepted);
  auto bound = bind(*request);
  if (!bound.ok()) return Refuse(call, bound.status());
  call.record.cost = bound->cost;
  call.record.decoded = absl::Now();
  if (!bound->rpc.empty()) call.record.label = std::move(bound->rpc);
  if constexpr (requires { bound->handle.StepCall(*request, response); }) {
    // A call that steps a session joins the coalescer's passes, unless it
    // is tiny and would run alone anyway (then it may run here, on gRPC's
    // thread).
    if (pipeline_->engine().Coalesces(call.record.cost)) {
      std::optional<SessionStepCall> step =
          bound->handle.StepCall(*request, response);
      if (step.has_value()) {
        return Coalesce(std::move(call), *std::move(step),
                        std::make_shared<decltype(bound->handle)>(
                            std::move(bound->handle)));
      }
    }
  }
  return Dispatch(std::move(call),
                  [request, response, handle = std::move(bound->handle)](
                      const CallControl& control) {
                    return handle(*request, response, control);
                  });
}

template <typename BoundHandler>
grpc::ServerUnaryReactor* GrpcCalls::Dispatch(Call call,
                                              BoundHandler handle) const {
  grpc::ServerUnaryReactor* reactor = nullptr;
  std::shared_ptr<Call> queued;  // set when the call is queued
  pipeline_->engine().Dispatch(
      call.record.cost, call.record.deadline,
      {.refuse =
           [&](const absl::Status& status) {
             if (queued == nullptr) {
               reactor = Refuse(call, status);
             } else {  // the queue was full
               Answer(*queued, status, absl::ZeroDuration(),
                      absl::ZeroDuration(), reactor);
             }
           },
       // A tiny call computes on gRPC's default reactor: a reactor of our
       // own that watches for cancellation costs gRPC about 15 us of CPU
       // per call, several times what such a call computes.
       .here =
           [&] {
             reactor = call.context->DefaultReactor();
             Compute(call, handle, reactor, nullptr);
           },
       .queued =
           [&] {
             queued = std::make_shared<Call>(std::move(call));
             return QueuedWork(queued, std::move(handle), &reactor);
           }});
  return reactor;
}

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_GRPC_CALLS_H_
