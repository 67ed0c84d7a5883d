// Requests built from named tensors (the names of the golden files and of
// attnctl's safetensors files: query, key, value, attn_mask,
// key_padding_mask, q_proj_weight, ..., input, gamma, beta) and results read
// back as named tensors (output, weights).
//
// Thread-safety: free functions without shared state.
#ifndef ATTNSERVE_CLIENT_REQUESTS_H_
#define ATTNSERVE_CLIENT_REQUESTS_H_

#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "core/tensor.h"
#include "proto/tensor_codec.h"

namespace attnserve {

// Operation parameters, as attnctl's flags and a file's metadata name them.
struct OpParams {
  bool causal = false;
  std::optional<float> scale;
  std::optional<float> temperature;
  bool return_weights = false;
  bool average_weights = false;
  bool compute_bf16 = false;
  int num_heads = 0;
  std::string model;
  std::optional<float> eps;
  int normalized_ndim = 0;
  bool rms_norm = false;
};

using NamedViews = std::map<std::string, TensorView>;
using NamedTensors = std::map<std::string, Tensor>;

// Views of every tensor in `tensors`.
NamedViews ViewsOf(const NamedTensors& tensors);

// Applies the safetensors metadata keys causal, scale, temperature,
// num_heads, eps, normalized_ndim and rms_norm to `params`; INVALID_ARGUMENT
// naming a key whose value does not parse.
absl::Status ApplyMetadata(const std::map<std::string, std::string>& metadata,
                           OpParams* params);

// The requests; tensor names not used by the operation are ignored, except
// a beta for RmsNorm (INVALID_ARGUMENT: RMSNorm has no shift).
absl::StatusOr<v1::AttendRequest> BuildAttendRequest(const NamedViews& tensors,
                                                     const OpParams& params);
absl::StatusOr<v1::MultiHeadAttendRequest> BuildMultiHeadAttendRequest(
    const NamedViews& tensors, const OpParams& params);
absl::StatusOr<v1::LayerNormRequest> BuildLayerNormRequest(
    const NamedViews& tensors, const OpParams& params);
absl::StatusOr<v1::RmsNormRequest> BuildRmsNormRequest(
    const NamedViews& tensors, const OpParams& params);

// "output" and, when present, "weights" of a response; `shared_memory`
// resolves results the server wrote into shared memory.
absl::StatusOr<NamedTensors> ResultTensors(
    const v1::Tensor& output, const v1::Tensor* weights,
    SharedMemoryResolver* shared_memory = nullptr);

enum class Operation { kAttend, kMultiHeadAttend, kLayerNorm, kRmsNorm };

// The operation called `name`: attnctl's command names (attend, mha,
// layernorm, rmsnorm) or the golden files' "op" values (multi_head_attend,
// layer_norm, rms_norm); INVALID_ARGUMENT otherwise.
absl::StatusOr<Operation> ParseOperation(absl::string_view name);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_REQUESTS_H_
