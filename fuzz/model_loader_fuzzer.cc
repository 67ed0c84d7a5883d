// Fuzz target: a model folder's two files from one input (ParseModel, the
// model loader without the disk): a little-endian 16-bit length, that many
// bytes of config.pbtxt, and the rest as weights.safetensors. A model that
// loads then answers a two-token query of its dims, with its defaults.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "core/attention.h"
#include "fuzz/fuzz_support.h"
#include "proto/tensor_codec.h"
#include "server/model_repository.h"

namespace attnserve::fuzz {
namespace {

// A [1, 2, dim] tensor of zeros, or absent when that would be large.
bool Zeros(int64_t dim, Tensor* out) {
  if (dim <= 0 || dim > 100000) return false;
  absl::StatusOr<Tensor> t = Tensor::Zeros(DType::kFloat32, {1, 2, dim});
  if (!t.ok()) return false;
  *out = *std::move(t);
  return true;
}

void Query(const Model& model) {
  const MultiHeadLayer& layer = *model.layer;
  Tensor query, key, value;
  if (!Zeros(layer.query_dim(), &query) ||
      !Zeros(layer.key_input_dim(), &key) ||
      !Zeros(layer.value_input_dim(), &value)) {
    return;
  }
  MultiHeadInputs inputs;
  inputs.query = query.view();
  inputs.key = key.view();
  inputs.value = value.view();
  MultiHeadOptions options;
  options.attention.causal = model.config.default_causal();
  if (model.config.has_default_scale()) {
    options.attention.scale = model.config.default_scale();
  }
  options.attention.return_weights = true;
  v1::MultiHeadAttendResponse response;
  WireResults results(response.mutable_output(), response.mutable_weights());
  CheckStatus("MultiHeadLayer::Run", layer.Run(inputs, options, results));
}

}  // namespace
}  // namespace attnserve::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;        // NOLINT: one function
  using namespace attnserve::fuzz;  // NOLINT
  if (size < 2) return 0;
  const size_t config_size = std::min<size_t>(data[0] | data[1] << 8, size - 2);
  const absl::string_view config(reinterpret_cast<const char*>(data) + 2,
                                 config_size);
  const absl::string_view weights(
      reinterpret_cast<const char*>(data) + 2 + config_size,
      size - 2 - config_size);
  absl::StatusOr<std::shared_ptr<const Model>> model =
      ParseModel("/models/fuzz", config, weights);
  CheckStatus("ParseModel", model.status());
  if (model.ok()) Query(**model);
  return 0;
}
