#include "server/open_inference_service.h"

#include "server/open_inference.h"

namespace attnserve {

grpc::ServerUnaryReactor* OpenInferenceService::ServerLive(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  inference::ServerLiveRequest parsed;
  inference::ServerLiveResponse answer;
  return attention_->ServeStateCall(context, *request, response,
                                    /*authenticate=*/false, &parsed, &answer,
                                    [&] {
                                      answer.set_live(true);
                                      return absl::OkStatus();
                                    });
}

grpc::ServerUnaryReactor* OpenInferenceService::ServerReady(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  inference::ServerReadyRequest parsed;
  inference::ServerReadyResponse answer;
  return attention_->ServeStateCall(context, *request, response,
                                    /*authenticate=*/false, &parsed, &answer,
                                    [&] {
                                      answer.set_ready(attention_->ready());
                                      return absl::OkStatus();
                                    });
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelReady(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  inference::ModelReadyRequest parsed;
  inference::ModelReadyResponse answer;
  return attention_->ServeStateCall(
      context, *request, response, /*authenticate=*/true, &parsed, &answer,
      [&] {
        return HandleModelReady(parsed, attention_->config().models, &answer);
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::ServerMetadata(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  inference::ServerMetadataRequest parsed;
  inference::ServerMetadataResponse answer;
  return attention_->ServeStateCall(context, *request, response,
                                    /*authenticate=*/true, &parsed, &answer,
                                    [&] {
                                      HandleServerMetadata(&answer);
                                      return absl::OkStatus();
                                    });
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelMetadata(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  inference::ModelMetadataRequest parsed;
  inference::ModelMetadataResponse answer;
  return attention_->ServeStateCall(
      context, *request, response, /*authenticate=*/true, &parsed, &answer,
      [&] {
        return HandleModelMetadata(parsed, attention_->config().models,
                                   &answer);
      });
}

}  // namespace attnserve
