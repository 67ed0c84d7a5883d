#include "server/open_inference_service.h"

#include <functional>
#include <memory>

#include "core/status_macros.h"
#include "server/open_inference.h"

namespace attnserve {

OpenInferenceService::OpenInferenceService(GrpcCalls* calls)
    : RawService(calls) {
  const CallPipeline* pipeline = calls->pipeline();
  const ModelRepository* models = pipeline->config().models;
  AddState<inference::ServerLiveRequest, inference::ServerLiveResponse>(
      [](const inference::ServerLiveRequest&,
         inference::ServerLiveResponse* response) {
        response->set_live(true);
        return absl::OkStatus();
      },
      /*authenticate=*/false);
  // Not ready once the server starts draining.
  AddState<inference::ServerReadyRequest, inference::ServerReadyResponse>(
      [pipeline](const inference::ServerReadyRequest&,
                 inference::ServerReadyResponse* response) {
        response->set_ready(pipeline->ready());
        return absl::OkStatus();
      },
      /*authenticate=*/false);
  AddState<inference::ModelReadyRequest, inference::ModelReadyResponse>(
      [models](const inference::ModelReadyRequest& request,
               inference::ModelReadyResponse* response) {
        return HandleModelReady(request, models, response);
      });
  AddState<inference::ServerMetadataRequest, inference::ServerMetadataResponse>(
      [](const inference::ServerMetadataRequest&,
         inference::ServerMetadataResponse* response) {
        HandleServerMetadata(response);
        return absl::OkStatus();
      });
  AddState<inference::ModelMetadataRequest, inference::ModelMetadataResponse>(
      [models](const inference::ModelMetadataRequest& request,
               inference::ModelMetadataResponse* response) {
        return HandleModelMetadata(request, models, response);
      });
  using Handle = std::function<absl::Status(const inference::ModelInferRequest&,
                                            inference::ModelInferResponse*,
                                            const CallControl&)>;
  AddCompute<inference::ModelInferRequest, inference::ModelInferResponse>(
      [models](inference::ModelInferRequest& request)
          -> absl::StatusOr<BoundCall<Handle>> {
        ATTN_ASSIGN_OR_RETURN(std::shared_ptr<NativeInferCall> native,
                              NativeInferCall::FromRequest(&request, models));
        return Bound(
            native->cost(),
            Handle([native](const inference::ModelInferRequest& request,
                            inference::ModelInferResponse* response,
                            const CallControl& control) {
              ATTN_RETURN_IF_ERROR(native->Run(control));
              native->ToResponse(request, response);
              return absl::OkStatus();
            }),
            native->label());
      });
  VerifyEveryRpcAdded();
}

}  // namespace attnserve
