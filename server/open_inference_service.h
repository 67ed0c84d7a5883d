// inference.GRPCInferenceService, the Open Inference Protocol (KServe v2)
// over gRPC, served beside AttentionService on the same port: ModelInfer
// runs through AttentionService's admission, queue, metrics, access log and
// authentication; the other RPCs answer from server state on gRPC's thread.
// ServerLive and ServerReady need no token, like the health service.
//
// Thread-safety: gRPC calls the RPCs concurrently; the service holds only
// pointers to thread-safe objects. Ownership: owns nothing; `attention`
// (and what its config points to) must outlive it.
#ifndef ATTNSERVE_SERVER_OPEN_INFERENCE_SERVICE_H_
#define ATTNSERVE_SERVER_OPEN_INFERENCE_SERVICE_H_

#include "grpcpp/support/byte_buffer.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/attention_service.h"

namespace attnserve {

// Every RPC on gRPC's raw callback API, as AttentionService: requests that
// do not parse get INVALID_ARGUMENT, not UNIMPLEMENTED.
using RawInferenceService =
    inference::GRPCInferenceService::WithRawCallbackMethod_ServerLive<
        inference::GRPCInferenceService::WithRawCallbackMethod_ServerReady<
            inference::GRPCInferenceService::WithRawCallbackMethod_ModelReady<
                inference::GRPCInferenceService::
                    WithRawCallbackMethod_ServerMetadata<
                        inference::GRPCInferenceService::
                            WithRawCallbackMethod_ModelMetadata<
                                inference::GRPCInferenceService::
                                    WithRawCallbackMethod_ModelInfer<
                                        inference::GRPCInferenceService::
                                            Service>>>>>>;

class OpenInferenceService final : public RawInferenceService {
 public:
  explicit OpenInferenceService(AttentionServiceImpl* attention)
      : attention_(attention) {}

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  // Not ready once the server starts draining.
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override {
    return attention_->ModelInfer(context, request, response);
  }

 private:
  AttentionServiceImpl* attention_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_OPEN_INFERENCE_SERVICE_H_
