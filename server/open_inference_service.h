// inference.GRPCInferenceService, the Open Inference Protocol (KServe v2)
// over gRPC with Triton's extensions, served beside AttentionService on the
// same port and on the same glue (server/grpc_calls.h): ModelInfer is
// translated to the native call of its model (server/open_inference.h) and
// goes through the call pipeline, labelled by the operation it computes
// ("ModelInfer/Attend"); ModelStreamInfer runs each request of a stream the
// same way (server/stream_infer.h); the other RPCs answer from server state
// on gRPC's thread: model configuration (server/model_config.h), statistics
// (server/statistics.h), model repository and system shared memory
// (server/triton_extensions.h; CUDA shared memory answers UNIMPLEMENTED),
// trace and log settings (server/runtime_settings.h).
// ServerLive and ServerReady need no token, like the health service.
//
// Thread-safety: gRPC calls the RPCs concurrently; the service holds only
// the glue. Ownership: `calls` (and what its pipeline points to) must
// outlive the service.
#ifndef ATTNSERVE_SERVER_OPEN_INFERENCE_SERVICE_H_
#define ATTNSERVE_SERVER_OPEN_INFERENCE_SERVICE_H_

#include "inference/grpc_service.grpc.pb.h"
#include "server/grpc_calls.h"

namespace attnserve {

class OpenInferenceService final
    : public RawService<inference::GRPCInferenceService> {
 public:
  explicit OpenInferenceService(GrpcCalls* calls);

 private:
  // The protocol's state RPCs: health, metadata, configuration and
  // statistics.
  void AddStateRpcs();
  // Its extensions' RPCs: repository, shared memory, trace and log
  // settings.
  void AddExtensionRpcs();
  // ModelInfer and ModelStreamInfer.
  void AddInferenceRpcs();
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_OPEN_INFERENCE_SERVICE_H_
