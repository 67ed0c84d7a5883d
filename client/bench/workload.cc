#include "client/bench/workload.h"

#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "core/convert.h"
#include "core/status_macros.h"

namespace attnserve {
namespace {

// "query=[1, 16, 64] FLOAT32": the shapes of the inputs `op` sends (not
// weights, not whatever else a file holds).
std::string Describe(Operation op, const NamedViews& tensors) {
  static const std::vector<std::string> kAttend = {"query", "key", "value",
                                                   "attn_mask"};
  static const std::vector<std::string> kMultiHead = {
      "query", "key", "value", "attn_mask", "key_padding_mask"};
  static const std::vector<std::string> kNorm = {"input", "gamma", "beta"};
  const std::vector<std::string>& names = op == Operation::kAttend ? kAttend
                                          : op == Operation::kMultiHeadAttend
                                              ? kMultiHead
                                              : kNorm;
  std::string out;
  for (const std::string& name : names) {
    const auto it = tensors.find(name);
    if (it == tensors.end()) continue;
    absl::StrAppend(&out, out.empty() ? "" : " ", name, "=",
                    ShapeString(it->second.shape));
  }
  if (const auto first = tensors.find(names.front()); first != tensors.end()) {
    absl::StrAppend(&out, " ", DTypeName(first->second.dtype));
  }
  return out;
}

}  // namespace

absl::StatusOr<Tensor> RandomUniform(Shape shape, DType dtype,
                                     std::mt19937* random, float scale) {
  std::uniform_real_distribution<float> uniform(-scale, scale);
  std::vector<float> values(NumElements(shape));
  for (float& v : values) v = uniform(*random);
  return Float32ToTensor(values.data(), std::move(shape), dtype);
}

absl::Status RequirePositive(int64_t value, absl::string_view flag) {
  if (value <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": must be > 0, got ", value));
  }
  return absl::OkStatus();
}

absl::StatusOr<NamedTensors> SyntheticTensors(Operation op,
                                              const SyntheticShape& shape,
                                              bool with_model) {
  ATTN_RETURN_IF_ERROR(RequirePositive(shape.batch, "--batch"));
  const bool norm = op == Operation::kLayerNorm || op == Operation::kRmsNorm;
  if (!norm || shape.seq != 0) {
    ATTN_RETURN_IF_ERROR(RequirePositive(shape.seq, "--seq"));
  }
  if (shape.kv_seq < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_seq: must be >= 0, got ", shape.kv_seq));
  }
  const int64_t b = shape.batch, l = shape.seq;
  const int64_t lk = shape.kv_seq > 0 ? shape.kv_seq : shape.seq;
  std::mt19937 random(1);
  NamedTensors tensors;
  switch (op) {
    case Operation::kAttend: {
      ATTN_RETURN_IF_ERROR(RequirePositive(shape.heads, "--heads"));
      const int64_t d = shape.dim > 0 ? shape.dim : 64;
      const int64_t h = shape.heads;
      ATTN_ASSIGN_OR_RETURN(tensors["query"],
                            RandomUniform({b, h, l, d}, shape.dtype, &random));
      ATTN_ASSIGN_OR_RETURN(tensors["key"],
                            RandomUniform({b, h, lk, d}, shape.dtype, &random));
      ATTN_ASSIGN_OR_RETURN(tensors["value"],
                            RandomUniform({b, h, lk, d}, shape.dtype, &random));
      break;
    }
    case Operation::kMultiHeadAttend: {
      ATTN_RETURN_IF_ERROR(RequirePositive(shape.heads, "--heads"));
      const int64_t e = shape.dim > 0 ? shape.dim : 512;
      if (e % shape.heads != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--dim: ", e, " is not a multiple of --heads ", shape.heads));
      }
      ATTN_ASSIGN_OR_RETURN(tensors["query"],
                            RandomUniform({b, l, e}, shape.dtype, &random));
      if (lk != l) {
        ATTN_ASSIGN_OR_RETURN(tensors["key"],
                              RandomUniform({b, lk, e}, shape.dtype, &random));
        ATTN_ASSIGN_OR_RETURN(tensors["value"],
                              RandomUniform({b, lk, e}, shape.dtype, &random));
      }
      if (!with_model) {
        // Scaled like PyTorch's default init, so outputs stay O(1).
        const float bound = 1.0f / std::sqrt(static_cast<float>(e));
        for (const char* name : {"q_proj_weight", "k_proj_weight",
                                 "v_proj_weight", "out_proj_weight"}) {
          ATTN_ASSIGN_OR_RETURN(
              tensors[name],
              RandomUniform({e, e}, DType::kFloat32, &random, bound));
        }
        for (const char* name :
             {"q_proj_bias", "k_proj_bias", "v_proj_bias", "out_proj_bias"}) {
          ATTN_ASSIGN_OR_RETURN(
              tensors[name],
              RandomUniform({e}, DType::kFloat32, &random, bound));
        }
      }
      break;
    }
    case Operation::kLayerNorm:
    case Operation::kRmsNorm: {
      const int64_t e = shape.dim > 0 ? shape.dim : 512;
      Shape input_shape = l > 0 ? Shape{b, l, e} : Shape{b, e};
      ATTN_ASSIGN_OR_RETURN(
          tensors["input"],
          RandomUniform(std::move(input_shape), shape.dtype, &random));
      ATTN_ASSIGN_OR_RETURN(tensors["gamma"],
                            RandomUniform({e}, DType::kFloat32, &random));
      if (op == Operation::kRmsNorm) break;  // no shift
      ATTN_ASSIGN_OR_RETURN(tensors["beta"],
                            RandomUniform({e}, DType::kFloat32, &random));
      break;
    }
  }
  return tensors;
}

namespace {

// Fills `workload`'s request from `request` (transformed first), its RPC
// (named after the request) and the model its statistics count it under.
template <typename Request>
absl::StatusOr<bool> SerializeInto(absl::StatusOr<Request> request,
                                   std::string statistics_model,
                                   const RequestTransform& transform,
                                   Workload* workload) {
  ATTN_RETURN_IF_ERROR(request.status());
  if (transform) ATTN_RETURN_IF_ERROR(transform(&*request));
  // "LayerNormRequest": LayerNorm.
  workload->rpc = std::string(
      absl::StripSuffix(request->GetDescriptor()->name(), "Request"));
  workload->statistics_model = std::move(statistics_model);
  return request->SerializeToString(&workload->request);
}

}  // namespace

absl::StatusOr<Workload> MakeWorkload(Operation op, const NamedViews& tensors,
                                      const OpParams& params,
                                      const RequestTransform& transform) {
  Workload workload;
  absl::StatusOr<bool> serialized = false;
  switch (op) {
    case Operation::kAttend:
      serialized = SerializeInto(BuildAttendRequest(tensors, params), "attend",
                                 transform, &workload);
      break;
    case Operation::kMultiHeadAttend:
      serialized = SerializeInto(
          BuildMultiHeadAttendRequest(tensors, params),
          params.model.empty() ? "multi_head_attend" : params.model, transform,
          &workload);
      break;
    case Operation::kLayerNorm:
      serialized = SerializeInto(BuildLayerNormRequest(tensors, params),
                                 "layer_norm", transform, &workload);
      break;
    case Operation::kRmsNorm:
      serialized = SerializeInto(BuildRmsNormRequest(tensors, params),
                                 "rms_norm", transform, &workload);
      break;
  }
  ATTN_RETURN_IF_ERROR(serialized.status());
  if (!*serialized) {
    return absl::InvalidArgumentError(
        "request: too large to serialize (protobuf messages end at 2 GiB)");
  }
  workload.method = absl::StrCat("/", v1::AttentionService::service_full_name(),
                                 "/", workload.rpc);
  workload.description = Describe(op, tensors);
  if (!params.model.empty()) {
    absl::StrAppend(&workload.description, " model=", params.model);
  }
  return workload;
}

Workload HealthCheckWorkload() {
  Workload workload;
  workload.method = "/grpc.health.v1.Health/Check";
  workload.rpc = "Health.Check";
  workload.description = "(empty request)";
  // An empty HealthCheckRequest serializes to no bytes.
  return workload;
}

std::string GrpcFrame(const std::string& message) {
  std::string frame(5, '\0');
  const uint32_t size = static_cast<uint32_t>(message.size());
  for (int i = 0; i < 4; ++i) {
    frame[1 + i] = static_cast<char>((size >> (8 * (3 - i))) & 0xff);
  }
  return frame + message;
}

}  // namespace attnserve
