// Fuzz target: any bytes that parse as an Open Inference Protocol (KServe
// v2) ModelInferRequest, served as the service serves ModelInfer
// (fuzz_support's ServeModelInfer: translation against TinyModels, cost
// estimate, limits, then the native handler and the protocol response for
// tiny calls) with ComputeRegistry's regions registered, so that Triton's
// shared-memory parameters can name them; and ModelMetadata and ModelReady
// for the request's model name and version. The objects behind the regions
// are refilled before each input.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "fuzz/fuzz_support.h"
#include "inference/grpc_service.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;        // NOLINT: one function
  using namespace attnserve::fuzz;  // NOLINT
  inference::ModelInferRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  RefillSharedMemory();
  inference::ModelMetadataResponse metadata;
  const bool found = ServeModelMetadata(request.model_name(),
                                        request.model_version(), &metadata);
  inference::ModelInferResponse response;
  const bool answered =
      ServeModelInfer(&request, &ComputeRegistry(), &response);
  // A model that computes is one the metadata RPCs know.
  if (answered && !found) {
    std::fprintf(stderr,
                 "fuzz: ModelInfer answered model '%s' version '%s', "
                 "which ModelMetadata does not find\n",
                 request.model_name().c_str(), request.model_version().c_str());
    std::abort();
  }
  return 0;
}
