// inference.GRPCInferenceService, the Open Inference Protocol (KServe v2)
// over gRPC, served beside AttentionService on the same port and on the
// same glue (server/grpc_calls.h): ModelInfer is translated to the native
// call of its model (server/open_inference.h) and goes through the call
// pipeline, labelled by the operation it computes ("ModelInfer/Attend");
// the other RPCs answer from server state on gRPC's thread. ServerLive and
// ServerReady need no token, like the health service.
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
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_OPEN_INFERENCE_SERVICE_H_
