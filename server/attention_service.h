// attnserve.v1.AttentionService: each RPC registered with its handler
// (server/handlers.h) on the shared gRPC glue (server/grpc_calls.h). The
// compute RPCs (Attend, MultiHeadAttend, LayerNorm, SessionStep) go through
// the call pipeline: authenticated, admitted, queued, computed with their
// share of the cores, cancelled when the client goes, counted and logged;
// the others answer from server state on gRPC's thread.
//
// Adding a stateless operation: see server/operations.h; its RPC is one
// AddOperation line in AddComputeRpcs.
//
// Thread-safety: gRPC calls the RPCs concurrently; the service holds only
// the glue. Ownership: the server owns the service; `calls` (and what its
// pipeline points to) must outlive it.
#ifndef ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
#define ATTNSERVE_SERVER_ATTENTION_SERVICE_H_

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/grpc_calls.h"
#include "server/operations.h"

namespace attnserve {

class AttentionServiceImpl final : public RawService<v1::AttentionService> {
 public:
  explicit AttentionServiceImpl(GrpcCalls* calls);

 private:
  // The compute RPCs (through the call pipeline).
  void AddComputeRpcs(const ServiceConfig& config);
  // The RPC of the stateless operation whose native request is Request
  // (server/operations.h): its declared cost and computation.
  template <typename Request, typename Response>
  void AddOperation() {
    const OperationSpec* operation =
        FindOperationByRequest(*Request::descriptor());
    GPR_ASSERT(operation != nullptr && operation->stateless());
    AddCompute<Request, Response>([operation](const Request& request) {
      return Bound(operation->cost(request),
                   [operation](const Request& request, Response* response,
                               const CallControl& control) {
                     return operation->run(request, response, control);
                   });
    });
  }
  // Models and shared memory.
  void AddStateRpcs(const ServiceConfig& config);
  // Creating, forking and deleting decode sessions.
  void AddSessionRpcs(const CallPipeline* pipeline);
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
