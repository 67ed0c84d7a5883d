// AttentionService on the gRPC callback API: each RPC converts the request's
// wire tensors into core views (no copy), calls the core, and writes the
// result into the response.
//
// Thread-safety: gRPC calls the handlers concurrently; the service holds no
// mutable state of its own (the model repository is thread-safe). Ownership:
// the server owns the service; it must outlive the server.
#ifndef ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
#define ATTNSERVE_SERVER_ATTENTION_SERVICE_H_

#include "absl/status/status.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "server/model_repository.h"

namespace attnserve {

// Request handling without gRPC's machinery, so that it can be tested and
// reused directly.
absl::Status HandleAttend(const v1::AttendRequest& request,
                          v1::AttendResponse* response);
// `models` may be null (no repository).
absl::Status HandleMultiHeadAttend(const v1::MultiHeadAttendRequest& request,
                                   const ModelRepository* models,
                                   v1::MultiHeadAttendResponse* response);
absl::Status HandleListModels(const ModelRepository* models,
                              v1::ListModelsResponse* response);
absl::Status HandleGetModelMetadata(const v1::GetModelMetadataRequest& request,
                                    const ModelRepository* models,
                                    v1::GetModelMetadataResponse* response);
absl::Status HandleLayerNorm(const v1::LayerNormRequest& request,
                             v1::LayerNormResponse* response);

class AttentionServiceImpl final
    : public v1::AttentionService::CallbackService {
 public:
  // `models` (may be null) must outlive the service.
  explicit AttentionServiceImpl(const ModelRepository* models)
      : models_(models) {}

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

 private:
  const ModelRepository* models_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
