#include "server/stream_infer.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "grpcpp/server_context.h"
#include "inference/grpc_service.pb.h"
#include "server/grpc_calls.h"
#include "server/grpc_status.h"
#include "server/open_inference.h"

namespace attnserve {
namespace {

using ByteBuffer = grpc::ByteBuffer;

absl::Time DeadlineOf(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

class StreamInferReactor final
    : public grpc::ServerBidiReactor<ByteBuffer, ByteBuffer> {
 public:
  StreamInferReactor(grpc::CallbackServerContext* context,
                     const CallPipeline* pipeline)
      : context_(context), pipeline_(pipeline) {
    const absl::Status authenticated =
        pipeline_->config().auth != nullptr
            ? pipeline_->config().auth->Check(*context_)
            : absl::OkStatus();
    if (!authenticated.ok()) {
      Finish(ToGrpcStatus(authenticated));
      return;
    }
    StartRead(&read_buffer_);
  }

  void OnReadDone(bool ok) override {
    // The client closed its side (or the stream broke): every request read
    // has been answered.
    if (!ok) {
      Finish(cancelled_.load() ? grpc::Status::CANCELLED : grpc::Status::OK);
      return;
    }
    call_ = std::make_shared<Call>();
    call_->arrived = absl::Now();
    const absl::Status parsed = ParseMessage(read_buffer_, &call_->request);
    if (!parsed.ok()) return Refuse(parsed);
    absl::StatusOr<std::unique_ptr<NativeInferCall>> native =
        NativeInferCall::FromRequest(&call_->request,
                                     pipeline_->config().models,
                                     pipeline_->sequences());
    if (!native.ok()) return Refuse(native.status());
    call_->native = *std::move(native);
    call_->decoded = absl::Now();
    std::shared_ptr<Call> call = call_;
    pipeline_->Run(
        Record(*call),
        [call](const CallControl& control) {
          return call->native->Run(control);
        },
        &cancelled_,
        // Runs once, here or on a worker, while no other operation of the
        // stream is outstanding.
        [this, call](const absl::Status& status) {
          if (status.ok()) {
            call->native->ToResponse(call->request,
                                     call->response.mutable_infer_response());
          }
          Answer(status);
        },
        // `finish` holds the call until the step is answered.
        [&call] { return call->native->StepCall(); });
  }

  void OnWriteDone(bool ok) override {
    call_.reset();
    if (!ok || cancelled_.load()) {
      Finish(grpc::Status::CANCELLED);
      return;
    }
    StartRead(&read_buffer_);
  }

  void OnCancel() override { cancelled_.store(true); }
  void OnDone() override { delete this; }

 private:
  // One request of the stream, from its arrival to its answer.
  struct Call {
    inference::ModelInferRequest request;
    inference::ModelStreamInferResponse response;
    const MessageSubject subject{&request, &response};
    std::unique_ptr<NativeInferCall> native;
    absl::Time arrived;
    absl::Time decoded = absl::InfinitePast();
  };

  EngineCall Record(const Call& call) const {
    return EngineCall{
        .label = "ModelStreamInfer",
        .subject = &call.subject,
        .cost = call.native != nullptr ? call.native->cost() : RequestCost{},
        .arrived = call.arrived,
        .decoded = call.decoded,
        .deadline = DeadlineOf(*context_)};
  }

  // Answers the current request with `status` before it computes.
  void Refuse(const absl::Status& status) {
    pipeline_->engine().Record(Record(*call_), status, absl::ZeroDuration(),
                               absl::ZeroDuration());
    Answer(status);
  }

  // Writes the current request's response, or its error.
  void Answer(const absl::Status& status) {
    inference::ModelStreamInferResponse& response = call_->response;
    if (!status.ok()) {
      response.Clear();
      response.set_error_message(status.ToString());
      // The id and model let the client tell which request failed.
      response.mutable_infer_response()->set_id(call_->request.id());
      response.mutable_infer_response()->set_model_name(
          call_->request.model_name());
    }
    // Each request has one response, its last, which Triton marks so:
    // Triton's C++ clients read the flag to end a request.
    (*response.mutable_infer_response()
          ->mutable_parameters())["triton_final_response"]
        .set_bool_param(true);
    // The previous response's bytes are sent: the buffer takes new ones.
    write_buffer_.Clear();
    const absl::Status serialized = SerializeMessage(response, &write_buffer_);
    if (!serialized.ok()) {
      Finish(ToGrpcStatus(serialized));
      return;
    }
    StartWrite(&write_buffer_);
  }

  grpc::CallbackServerContext* const context_;
  const CallPipeline* const pipeline_;
  std::atomic<bool> cancelled_{false};
  ByteBuffer read_buffer_;
  ByteBuffer write_buffer_;
  // The request being answered; shared with its computation.
  std::shared_ptr<Call> call_;
};

}  // namespace

grpc::ServerBidiReactor<ByteBuffer, ByteBuffer>* StartModelStreamInfer(
    grpc::CallbackServerContext* context, const CallPipeline* pipeline) {
  return new StreamInferReactor(context, pipeline);
}

}  // namespace attnserve
