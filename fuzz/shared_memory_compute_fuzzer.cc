// Fuzz target: compute requests whose tensors and results may live in
// shared memory. The first byte picks the RPC (Attend, MultiHeadAttend,
// LayerNorm: byte % 3), the rest is its request, served as the service
// serves it (fuzz_support's Serve*) with ComputeRegistry's regions "fuzz",
// "fuzz_odd" and "fuzz_small" registered. The objects behind them are
// refilled before each input, so that an input does not see what an
// earlier one wrote.
#include <cstddef>
#include <cstdint>

#include "attnserve/v1/attention.pb.h"
#include "fuzz/fuzz_support.h"

namespace attnserve::fuzz {
namespace {

template <typename Request>
bool Parse(const uint8_t* data, size_t size, Request* request) {
  return request->ParseFromArray(data, static_cast<int>(size));
}

}  // namespace
}  // namespace attnserve::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;        // NOLINT: one function
  using namespace attnserve::fuzz;  // NOLINT
  if (size == 0) return 0;
  const SharedMemoryRegistry& registry = ComputeRegistry();
  RefillSharedMemory();
  switch (data[0] % 3) {
    case 0: {
      v1::AttendRequest request;
      if (Parse(data + 1, size - 1, &request)) ServeAttend(request, &registry);
      break;
    }
    case 1: {
      v1::MultiHeadAttendRequest request;
      if (Parse(data + 1, size - 1, &request)) {
        ServeMultiHeadAttend(request, &registry);
      }
      break;
    }
    case 2: {
      v1::LayerNormRequest request;
      if (Parse(data + 1, size - 1, &request)) {
        ServeLayerNorm(request, &registry);
      }
      break;
    }
  }
  return 0;
}
