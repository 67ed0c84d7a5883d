#include "server/attention_service.h"

#include "core/status_macros.h"
#include "server/handlers.h"
#include "server/operations.h"
#include "server/request_cost.h"
#include "server/session_transfer.h"

namespace attnserve {

namespace {

// A new session would die with a draining server: refused there.
absl::Status RefuseNewSessionsWhileDraining(const CallPipeline& pipeline) {
  if (!pipeline.engine().draining()) return absl::OkStatus();
  return absl::UnavailableError(
      "server is shutting down; create the session on another replica");
}

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(GrpcCalls* calls)
    : RawService(calls) {
  AddComputeRpcs(calls->pipeline()->config());
  AddStateRpcs(calls->pipeline()->config());
  AddSessionRpcs(calls->pipeline());
  VerifyEveryRpcAdded();
}

void AttentionServiceImpl::AddComputeRpcs(const ServiceConfig& config) {
  AddOperation<v1::AttendRequest, v1::AttendResponse>();
  AddOperation<v1::LayerNormRequest, v1::LayerNormResponse>();
  AddOperation<v1::RmsNormRequest, v1::RmsNormResponse>();
  AddCompute<v1::MultiHeadAttendRequest, v1::MultiHeadAttendResponse>(
      [models = config.models](const v1::MultiHeadAttendRequest& request) {
        MultiHeadAttendHandler handle(request, models);
        // Costed before the move: argument order is unspecified.
        const RequestCost cost = CostOf(request, handle.layer());
        return Bound(cost, std::move(handle));
      });
  AddCompute<v1::SessionStepRequest, v1::SessionStepResponse>(
      [sessions = config.sessions](const v1::SessionStepRequest& request) {
        SessionStepHandler handle(request, sessions);
        const RequestCost cost = CostOf(request, handle.session());
        return Bound(cost, std::move(handle));
      });
  AddCompute<v1::SessionStepsRequest, v1::SessionStepsResponse>(
      [sessions = config.sessions, max_steps = config.max_steps_per_call,
       limits = StepLimits{config.engine->options().max_tensor_elements,
                           config.engine->options().max_request_bytes}](
          const v1::SessionStepsRequest& request)
          -> absl::StatusOr<BoundCall<SessionStepsHandler>> {
        ATTN_RETURN_IF_ERROR(VerifyStepCount(request.steps_size(), max_steps));
        SessionStepsHandler handle(request, sessions, max_steps, limits);
        const RequestCost cost = CostOf(request, handle.sessions());
        return Bound(cost, std::move(handle));
      });
}

void AttentionServiceImpl::AddStateRpcs(const ServiceConfig& config) {
  AddState<v1::ListModelsRequest, v1::ListModelsResponse>(
      [models = config.models](const v1::ListModelsRequest&,
                               v1::ListModelsResponse* response) {
        return HandleListModels(models, response);
      });
  AddState<v1::GetModelMetadataRequest, v1::GetModelMetadataResponse>(
      [models = config.models](const v1::GetModelMetadataRequest& request,
                               v1::GetModelMetadataResponse* response) {
        return HandleGetModelMetadata(request, models, response);
      });
  AddState<v1::RegisterSharedMemoryRequest, v1::RegisterSharedMemoryResponse>(
      [registry = config.shared_memory](
          const v1::RegisterSharedMemoryRequest& request,
          v1::RegisterSharedMemoryResponse*) {
        return HandleRegisterSharedMemory(request, registry);
      });
  AddState<v1::UnregisterSharedMemoryRequest,
           v1::UnregisterSharedMemoryResponse>(
      [registry = config.shared_memory](
          const v1::UnregisterSharedMemoryRequest& request,
          v1::UnregisterSharedMemoryResponse*) {
        return HandleUnregisterSharedMemory(request, registry);
      });
  AddState<v1::ListSharedMemoryRequest, v1::ListSharedMemoryResponse>(
      [registry = config.shared_memory](
          const v1::ListSharedMemoryRequest& request,
          v1::ListSharedMemoryResponse* response) {
        return HandleListSharedMemory(request, registry, response);
      });
}

void AttentionServiceImpl::AddSessionRpcs(const CallPipeline* pipeline) {
  const ServiceConfig& config = pipeline->config();
  AddState<v1::CreateSessionRequest, v1::CreateSessionResponse>(
      [pipeline](const v1::CreateSessionRequest& request,
                 v1::CreateSessionResponse* response) {
        ATTN_RETURN_IF_ERROR(RefuseNewSessionsWhileDraining(*pipeline));
        const ServiceConfig& served = pipeline->config();
        return HandleCreateSession(request, served.models, served.sessions,
                                   served.max_session_length, response);
      });
  // Deletes and forks of a session held elsewhere take it up first (a
  // file, a peer's hand-over): on a worker.
  const auto waits = [sessions = config.sessions](const auto& request) {
    return WaitsForSession(sessions, request.session_id());
  };
  AddSessionState<v1::DeleteSessionRequest, v1::DeleteSessionResponse>(
      [sessions = config.sessions](const v1::DeleteSessionRequest& request,
                                   v1::DeleteSessionResponse*, PeerWait wait) {
        return HandleDeleteSession(request, sessions, wait);
      },
      waits);
  AddSessionState<v1::ForkSessionRequest, v1::ForkSessionResponse>(
      [pipeline](const v1::ForkSessionRequest& request,
                 v1::ForkSessionResponse* response, PeerWait wait) {
        ATTN_RETURN_IF_ERROR(RefuseNewSessionsWhileDraining(*pipeline));
        return HandleForkSession(request, pipeline->config().sessions, response,
                                 std::nullopt, wait);
      },
      waits);
  // Not refused while draining: the drain saves every session anyway.
  AddState<v1::HandOverSessionRequest, v1::HandOverSessionResponse>(
      [sessions = config.sessions](const v1::HandOverSessionRequest& request,
                                   v1::HandOverSessionResponse*) {
        return HandleHandOverSession(request, sessions);
      });
  AddServerStream("ExportSession",
                  [pipeline](grpc::CallbackServerContext* context,
                             const grpc::ByteBuffer* request) {
                    return StartExportSession(context, request, pipeline);
                  });
  AddClientStream("ImportSession",
                  [pipeline](grpc::CallbackServerContext* context,
                             grpc::ByteBuffer* response) {
                    return StartImportSession(context, response, pipeline);
                  });
}

}  // namespace attnserve
