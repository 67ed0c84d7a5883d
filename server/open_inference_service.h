// inference.GRPCInferenceService, the Open Inference Protocol (KServe v2)
// over gRPC, served beside AttentionService on the same port: ModelInfer
// runs through AttentionService's admission, queue, metrics, access log and
// authentication; ModelStreamInfer through the same call pipeline
// (server/stream_infer.h); the other RPCs answer from server state on
// gRPC's thread. ServerLive and ServerReady need no token, like the health
// service. Triton's extensions: model configuration
// (server/model_config.h), statistics (server/statistics.h), model
// repository and shared memory (server/triton_extensions.h).
//
// Thread-safety: gRPC calls the RPCs concurrently; the service holds only
// pointers to thread-safe objects. Ownership: owns nothing; `attention`
// and `pipeline` (and what its config points to) must outlive it.
#ifndef ATTNSERVE_SERVER_OPEN_INFERENCE_SERVICE_H_
#define ATTNSERVE_SERVER_OPEN_INFERENCE_SERVICE_H_

#include "grpcpp/support/byte_buffer.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/attention_service.h"
#include "server/call_pipeline.h"

namespace attnserve {

// Every RPC on gRPC's raw callback API, as AttentionService: requests that
// do not parse get INVALID_ARGUMENT, not UNIMPLEMENTED.
namespace raw_inference {
using G = inference::GRPCInferenceService;
using S0 = G::WithRawCallbackMethod_ServerLive<G::Service>;
using S1 = G::WithRawCallbackMethod_ServerReady<S0>;
using S2 = G::WithRawCallbackMethod_ModelReady<S1>;
using S3 = G::WithRawCallbackMethod_ServerMetadata<S2>;
using S4 = G::WithRawCallbackMethod_ModelMetadata<S3>;
using S5 = G::WithRawCallbackMethod_ModelInfer<S4>;
using S6 = G::WithRawCallbackMethod_ModelStreamInfer<S5>;
using S7 = G::WithRawCallbackMethod_ModelConfig<S6>;
using S8 = G::WithRawCallbackMethod_ModelStatistics<S7>;
using S9 = G::WithRawCallbackMethod_RepositoryIndex<S8>;
using S10 = G::WithRawCallbackMethod_RepositoryModelLoad<S9>;
using S11 = G::WithRawCallbackMethod_RepositoryModelUnload<S10>;
using S12 = G::WithRawCallbackMethod_SystemSharedMemoryStatus<S11>;
using S13 = G::WithRawCallbackMethod_SystemSharedMemoryRegister<S12>;
using S14 = G::WithRawCallbackMethod_SystemSharedMemoryUnregister<S13>;
using S15 = G::WithRawCallbackMethod_CudaSharedMemoryStatus<S14>;
using S16 = G::WithRawCallbackMethod_CudaSharedMemoryRegister<S15>;
using S17 = G::WithRawCallbackMethod_CudaSharedMemoryUnregister<S16>;
}  // namespace raw_inference
using RawInferenceService = raw_inference::S17;

class OpenInferenceService final : public RawInferenceService {
 public:
  OpenInferenceService(AttentionServiceImpl* attention,
                       const CallPipeline* pipeline)
      : attention_(attention), pipeline_(pipeline) {}

  using Unary = grpc::ServerUnaryReactor;
  using Context = grpc::CallbackServerContext;
  using Bytes = grpc::ByteBuffer;

  Unary* ServerLive(Context* context, const Bytes* request,
                    Bytes* response) override;
  // Not ready once the server starts draining.
  Unary* ServerReady(Context* context, const Bytes* request,
                     Bytes* response) override;
  // False for models not served.
  Unary* ModelReady(Context* context, const Bytes* request,
                    Bytes* response) override;
  Unary* ServerMetadata(Context* context, const Bytes* request,
                        Bytes* response) override;
  Unary* ModelMetadata(Context* context, const Bytes* request,
                       Bytes* response) override;
  Unary* ModelInfer(Context* context, const Bytes* request,
                    Bytes* response) override {
    return attention_->ModelInfer(context, request, response);
  }
  grpc::ServerBidiReactor<Bytes, Bytes>* ModelStreamInfer(
      Context* context) override;
  Unary* ModelConfig(Context* context, const Bytes* request,
                     Bytes* response) override;
  Unary* ModelStatistics(Context* context, const Bytes* request,
                         Bytes* response) override;
  // Index, load and unload run on gRPC's thread: a load reads and packs
  // the model's weights before it answers.
  Unary* RepositoryIndex(Context* context, const Bytes* request,
                         Bytes* response) override;
  Unary* RepositoryModelLoad(Context* context, const Bytes* request,
                             Bytes* response) override;
  Unary* RepositoryModelUnload(Context* context, const Bytes* request,
                               Bytes* response) override;
  Unary* SystemSharedMemoryStatus(Context* context, const Bytes* request,
                                  Bytes* response) override;
  Unary* SystemSharedMemoryRegister(Context* context, const Bytes* request,
                                    Bytes* response) override;
  Unary* SystemSharedMemoryUnregister(Context* context, const Bytes* request,
                                      Bytes* response) override;
  // UNIMPLEMENTED, with a message that says to use system shared memory.
  Unary* CudaSharedMemoryStatus(Context* context, const Bytes* request,
                                Bytes* response) override;
  Unary* CudaSharedMemoryRegister(Context* context, const Bytes* request,
                                  Bytes* response) override;
  Unary* CudaSharedMemoryUnregister(Context* context, const Bytes* request,
                                    Bytes* response) override;

 private:
  // An authenticated state call: parses Request, answers with
  // handle(request, &response).
  template <typename Request, typename Response, typename Handler>
  Unary* Serve(Context* context, const Bytes* request, Bytes* response,
               Handler handle);

  AttentionServiceImpl* attention_;
  const CallPipeline* pipeline_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_OPEN_INFERENCE_SERVICE_H_
