#include "server/open_inference_service.h"

#include "server/model_config.h"
#include "server/open_inference.h"
#include "server/stream_infer.h"
#include "server/triton_extensions.h"

namespace attnserve {

template <typename Request, typename Response, typename Handler>
grpc::ServerUnaryReactor* OpenInferenceService::Serve(Context* context,
                                                      const Bytes* request,
                                                      Bytes* response,
                                                      Handler handle) {
  Request parsed;
  Response answer;
  return attention_->ServeStateCall(
      context, *request, response, /*authenticate=*/true, &parsed, &answer,
      [&] { return handle(std::as_const(parsed), &answer); });
}

grpc::ServerUnaryReactor* OpenInferenceService::ServerLive(Context* context,
                                                           const Bytes* request,
                                                           Bytes* response) {
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
    Context* context, const Bytes* request, Bytes* response) {
  inference::ServerReadyRequest parsed;
  inference::ServerReadyResponse answer;
  return attention_->ServeStateCall(context, *request, response,
                                    /*authenticate=*/false, &parsed, &answer,
                                    [&] {
                                      answer.set_ready(attention_->ready());
                                      return absl::OkStatus();
                                    });
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelReady(Context* context,
                                                           const Bytes* request,
                                                           Bytes* response) {
  return Serve<inference::ModelReadyRequest, inference::ModelReadyResponse>(
      context, request, response, [this](const auto& parsed, auto* answer) {
        return HandleModelReady(parsed, pipeline_->config().models, answer);
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::ServerMetadata(
    Context* context, const Bytes* request, Bytes* response) {
  return Serve<inference::ServerMetadataRequest,
               inference::ServerMetadataResponse>(
      context, request, response, [](const auto&, auto* answer) {
        HandleServerMetadata(answer);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelMetadata(
    Context* context, const Bytes* request, Bytes* response) {
  return Serve<inference::ModelMetadataRequest,
               inference::ModelMetadataResponse>(
      context, request, response, [this](const auto& parsed, auto* answer) {
        return HandleModelMetadata(parsed, pipeline_->config().models, answer);
      });
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
OpenInferenceService::ModelStreamInfer(Context* context) {
  return StartModelStreamInfer(context, pipeline_);
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelConfig(
    Context* context, const Bytes* request, Bytes* response) {
  return Serve<inference::ModelConfigRequest, inference::ModelConfigResponse>(
      context, request, response, [this](const auto& parsed, auto* answer) {
        return HandleModelConfig(parsed, pipeline_->config().models, answer);
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelStatistics(
    Context* context, const Bytes* request, Bytes* response) {
  return Serve<inference::ModelStatisticsRequest,
               inference::ModelStatisticsResponse>(
      context, request, response, [this](const auto& parsed, auto* answer) {
        return pipeline_->statistics().Handle(parsed, answer);
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::RepositoryIndex(
    Context* context, const Bytes* request, Bytes* response) {
  return Serve<inference::RepositoryIndexRequest,
               inference::RepositoryIndexResponse>(
      context, request, response, [this](const auto& parsed, auto* answer) {
        return HandleRepositoryIndex(parsed, pipeline_->config().models,
                                     answer);
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::RepositoryModelLoad(
    Context* context, const Bytes* request, Bytes* response) {
  return Serve<inference::RepositoryModelLoadRequest,
               inference::RepositoryModelLoadResponse>(
      context, request, response, [this](const auto& parsed, auto*) {
        return HandleRepositoryModelLoad(parsed,
                                         pipeline_->config().repository);
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::RepositoryModelUnload(
    Context* context, const Bytes* request, Bytes* response) {
  return Serve<inference::RepositoryModelUnloadRequest,
               inference::RepositoryModelUnloadResponse>(
      context, request, response, [this](const auto& parsed, auto*) {
        return HandleRepositoryModelUnload(parsed,
                                           pipeline_->config().repository);
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::SystemSharedMemoryStatus(
    Context* context, const Bytes* request, Bytes* response) {
  return Serve<inference::SystemSharedMemoryStatusRequest,
               inference::SystemSharedMemoryStatusResponse>(
      context, request, response, [this](const auto& parsed, auto* answer) {
        return HandleSystemSharedMemoryStatus(
            parsed, pipeline_->config().shared_memory, answer);
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::SystemSharedMemoryRegister(
    Context* context, const Bytes* request, Bytes* response) {
  return Serve<inference::SystemSharedMemoryRegisterRequest,
               inference::SystemSharedMemoryRegisterResponse>(
      context, request, response, [this](const auto& parsed, auto*) {
        return HandleSystemSharedMemoryRegister(
            parsed, pipeline_->config().shared_memory);
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::SystemSharedMemoryUnregister(
    Context* context, const Bytes* request, Bytes* response) {
  return Serve<inference::SystemSharedMemoryUnregisterRequest,
               inference::SystemSharedMemoryUnregisterResponse>(
      context, request, response, [this](const auto& parsed, auto*) {
        return HandleSystemSharedMemoryUnregister(
            parsed, pipeline_->config().shared_memory);
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::CudaSharedMemoryStatus(
    Context* context, const Bytes* request, Bytes* response) {
  return Serve<inference::CudaSharedMemoryStatusRequest,
               inference::CudaSharedMemoryStatusResponse>(
      context, request, response,
      [](const auto&, auto*) { return CudaSharedMemoryUnsupported(); });
}

grpc::ServerUnaryReactor* OpenInferenceService::CudaSharedMemoryRegister(
    Context* context, const Bytes* request, Bytes* response) {
  return Serve<inference::CudaSharedMemoryRegisterRequest,
               inference::CudaSharedMemoryRegisterResponse>(
      context, request, response,
      [](const auto&, auto*) { return CudaSharedMemoryUnsupported(); });
}

grpc::ServerUnaryReactor* OpenInferenceService::CudaSharedMemoryUnregister(
    Context* context, const Bytes* request, Bytes* response) {
  return Serve<inference::CudaSharedMemoryUnregisterRequest,
               inference::CudaSharedMemoryUnregisterResponse>(
      context, request, response,
      [](const auto&, auto*) { return CudaSharedMemoryUnsupported(); });
}

}  // namespace attnserve
