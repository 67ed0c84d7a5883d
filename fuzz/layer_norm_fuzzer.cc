// Fuzz target: any bytes that parse as a LayerNormRequest, served as the
// service serves LayerNorm: cost estimate, limits, then the handler for tiny
// calls, with shared memory off; and the same bytes as an RmsNormRequest
// (the two share their field numbers), served as RmsNorm.
#include <cstddef>
#include <cstdint>

#include "attnserve/v1/attention.pb.h"
#include "fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attnserve::v1::LayerNormRequest request;
  if (request.ParseFromArray(data, static_cast<int>(size))) {
    attnserve::fuzz::ServeLayerNorm(request, /*registry=*/nullptr);
  }
  attnserve::v1::RmsNormRequest rms;
  if (rms.ParseFromArray(data, static_cast<int>(size))) {
    attnserve::fuzz::ServeRmsNorm(rms, /*registry=*/nullptr);
  }
  return 0;
}
