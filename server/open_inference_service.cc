#include "server/open_inference_service.h"

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "core/status_macros.h"
#include "server/model_config.h"
#include "server/open_inference.h"
#include "server/stream_infer.h"
#include "server/triton_extensions.h"

namespace attnserve {

namespace oip = inference;

OpenInferenceService::OpenInferenceService(GrpcCalls* calls)
    : RawService(calls) {
  AddStateRpcs();
  AddExtensionRpcs();
  AddInferenceRpcs();
  VerifyEveryRpcAdded();
}

void OpenInferenceService::AddStateRpcs() {
  const CallPipeline* pipeline = calls()->pipeline();
  const ModelRepository* models = pipeline->config().models;
  AddState<oip::ServerLiveRequest, oip::ServerLiveResponse>(
      [](const auto&, auto* response) {
        response->set_live(true);
        return absl::OkStatus();
      },
      /*authenticate=*/false);
  // Not ready once the server starts draining.
  AddState<oip::ServerReadyRequest, oip::ServerReadyResponse>(
      [pipeline](const auto&, auto* response) {
        response->set_ready(pipeline->engine().ready());
        return absl::OkStatus();
      },
      /*authenticate=*/false);
  AddState<oip::ModelReadyRequest, oip::ModelReadyResponse>(
      [models](const auto& request, auto* response) {
        return HandleModelReady(request, models, response);
      });
  AddState<oip::ServerMetadataRequest, oip::ServerMetadataResponse>(
      [pipeline](const auto&, auto* response) {
        HandleServerMetadata(pipeline->config().sessions != nullptr, response);
        return absl::OkStatus();
      });
  AddState<oip::ModelMetadataRequest, oip::ModelMetadataResponse>(
      [models](const auto& request, auto* response) {
        return HandleModelMetadata(request, models, response);
      });
  AddState<oip::ModelConfigRequest, oip::ModelConfigResponse>(
      [pipeline](const auto& request, auto* response) {
        return HandleModelConfig(request, pipeline->sequences(), response);
      });
  AddState<oip::ModelStatisticsRequest, oip::ModelStatisticsResponse>(
      [pipeline](const auto& request, auto* response) {
        return pipeline->statistics().Handle(request, response);
      });
}

void OpenInferenceService::AddExtensionRpcs() {
  const CallPipeline* pipeline = calls()->pipeline();
  const ModelRepository* models = pipeline->config().models;
  ModelRepository* repository = pipeline->config().repository;
  SharedMemoryRegistry* regions = pipeline->config().shared_memory;
  // Index, load and unload run on gRPC's thread: a load reads and packs
  // the model's weights before it answers.
  AddState<oip::RepositoryIndexRequest, oip::RepositoryIndexResponse>(
      [models](const auto& request, auto* response) {
        return HandleRepositoryIndex(request, models, response);
      });
  AddState<oip::RepositoryModelLoadRequest, oip::RepositoryModelLoadResponse>(
      [repository](const auto& request, auto*) {
        return HandleRepositoryModelLoad(request, repository);
      });
  AddState<oip::RepositoryModelUnloadRequest,
           oip::RepositoryModelUnloadResponse>(
      [repository](const auto& request, auto*) {
        return HandleRepositoryModelUnload(request, repository);
      });
  AddState<oip::SystemSharedMemoryStatusRequest,
           oip::SystemSharedMemoryStatusResponse>(
      [regions](const auto& request, auto* response) {
        return HandleSystemSharedMemoryStatus(request, regions, response);
      });
  AddState<oip::SystemSharedMemoryRegisterRequest,
           oip::SystemSharedMemoryRegisterResponse>(
      [regions](const auto& request, auto*) {
        return HandleSystemSharedMemoryRegister(request, regions);
      });
  AddState<oip::SystemSharedMemoryUnregisterRequest,
           oip::SystemSharedMemoryUnregisterResponse>(
      [regions](const auto& request, auto*) {
        return HandleSystemSharedMemoryUnregister(request, regions);
      });
  AddState<oip::TraceSettingRequest, oip::TraceSettingResponse>(
      [pipeline](const auto& request, auto* response) {
        return pipeline->trace_settings()->Handle(request, response);
      });
  AddState<oip::LogSettingsRequest, oip::LogSettingsResponse>(
      [pipeline](const auto& request, auto* response) {
        return pipeline->log_settings()->Handle(request, response);
      });
  // CUDA shared memory as a Triton without GPUs answers it.
  AddState<oip::CudaSharedMemoryStatusRequest,
           oip::CudaSharedMemoryStatusResponse>([](const auto& request, auto*) {
    return HandleCudaSharedMemoryStatus(request.name());
  });
  AddState<oip::CudaSharedMemoryRegisterRequest,
           oip::CudaSharedMemoryRegisterResponse>(
      [](const auto&, auto*) { return HandleCudaSharedMemoryRegister(); });
  AddState<oip::CudaSharedMemoryUnregisterRequest,
           oip::CudaSharedMemoryUnregisterResponse>(
      [](const auto&, auto*) { return absl::OkStatus(); });
}

namespace {

// ModelInfer's handler: the native call it translates to, run alone or, for
// a continuing sequence, in the step coalescer's passes. Copyable.
struct InferHandler {
  std::shared_ptr<NativeInferCall> native;

  absl::Status operator()(const oip::ModelInferRequest& request,
                          oip::ModelInferResponse* response,
                          const CallControl& control) const {
    ATTN_RETURN_IF_ERROR(native->Run(control));
    native->ToResponse(request, response);
    return absl::OkStatus();
  }

  std::optional<SessionStepCall> StepCall(
      const oip::ModelInferRequest& request,
      oip::ModelInferResponse* response) const {
    std::optional<SessionStepCall> step = native->StepCall();
    if (!step.has_value()) return std::nullopt;
    step->complete = [native = native, &request, response,
                      complete = std::move(step->complete)](
                         const absl::Status& stepped,
                         const CallControl& control) {
      ATTN_RETURN_IF_ERROR(complete(stepped, control));
      native->ToResponse(request, response);
      return absl::OkStatus();
    };
    return step;
  }
};

}  // namespace

void OpenInferenceService::AddInferenceRpcs() {
  const CallPipeline* pipeline = calls()->pipeline();
  const ModelRepository* models = pipeline->config().models;
  AddCompute<oip::ModelInferRequest, oip::ModelInferResponse>(
      [models, pipeline](oip::ModelInferRequest& request)
          -> absl::StatusOr<BoundCall<InferHandler>> {
        ATTN_ASSIGN_OR_RETURN(std::shared_ptr<NativeInferCall> native,
                              NativeInferCall::FromRequest(
                                  &request, models, pipeline->sequences()));
        const RequestCost cost = native->cost();
        std::string label = native->label();
        return Bound(cost, InferHandler{std::move(native)}, std::move(label));
      });
  AddStream("ModelStreamInfer",
            [pipeline](grpc::CallbackServerContext* context) {
              return StartModelStreamInfer(context, pipeline);
            });
}

}  // namespace attnserve
