// attnctl: calls an attnserve server with tensors from a safetensors file and
// writes the results to one.
//
//   attnctl attend|mha|layernorm --target=HOST:PORT --in=FILE.safetensors
//           [--out=RESULT.safetensors] [operation flags]
//   attnctl health --target=HOST:PORT [--service=NAME]
//
// Operation parameters come from the flags, else from the input file's
// __metadata__ (causal, scale, temperature, num_heads, eps,
// normalized_ndim), else the server's defaults.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/requests.h"
#include "core/convert.h"
#include "core/safetensors.h"
#include "core/status_macros.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address HOST:PORT.");
ABSL_FLAG(std::string, in, "", "Input safetensors file.");
ABSL_FLAG(std::string, out, "",
          "Output safetensors file (tensors `output` and `weights`).");
ABSL_FLAG(double, timeout_s, 60, "Deadline of the call, in seconds.");
ABSL_FLAG(int, max_message_mb, 256, "Largest message, in MiB.");
ABSL_FLAG(bool, causal, false, "Query i attends to keys j <= i.");
ABSL_FLAG(std::optional<float>, scale, std::nullopt,
          "Multiplies Q*K^T (default 1/sqrt(dk)).");
ABSL_FLAG(std::optional<float>, temperature, std::nullopt,
          "Divides the scaled logits (default 1).");
ABSL_FLAG(bool, return_weights, false, "Also return attention weights.");
ABSL_FLAG(bool, average_weights, false,
          "mha: return weights averaged over heads.");
ABSL_FLAG(std::optional<int>, num_heads, std::nullopt, "mha: number of heads.");
ABSL_FLAG(std::string, model, "", "mha: name of a model loaded on the server.");
ABSL_FLAG(std::optional<float>, eps, std::nullopt,
          "layernorm: epsilon (default 1e-5).");
ABSL_FLAG(std::optional<int>, normalized_ndim, std::nullopt,
          "layernorm: trailing dims normalized (default 1).");
ABSL_FLAG(std::string, service, "",
          "health: service to check (empty: the whole server).");

namespace attnserve {
namespace {

// Flags override the file's metadata (--causal can only turn causal on).
absl::StatusOr<OpParams> Params(const SafetensorsFile& file) {
  OpParams params;
  ATTN_RETURN_IF_ERROR(ApplyMetadata(file.metadata, &params));
  if (absl::GetFlag(FLAGS_causal)) params.causal = true;
  if (auto v = absl::GetFlag(FLAGS_scale)) params.scale = v;
  if (auto v = absl::GetFlag(FLAGS_temperature)) params.temperature = v;
  if (auto v = absl::GetFlag(FLAGS_num_heads)) params.num_heads = *v;
  if (auto v = absl::GetFlag(FLAGS_eps)) params.eps = v;
  if (auto v = absl::GetFlag(FLAGS_normalized_ndim)) {
    params.normalized_ndim = *v;
  }
  params.return_weights = absl::GetFlag(FLAGS_return_weights);
  params.average_weights = absl::GetFlag(FLAGS_average_weights);
  params.model = absl::GetFlag(FLAGS_model);
  return params;
}

// Largest |a - b| over a float tensor and a reference of the same shape.
std::optional<double> MaxAbsDiff(const Tensor& got, const Tensor& expected) {
  if (got.shape() != expected.shape() || !IsFloating(got.dtype()) ||
      !IsFloating(expected.dtype())) {
    return std::nullopt;
  }
  auto a = Float32Data::From(got.view(), "output");
  auto b = Float32Data::From(expected.view(), "expected");
  if (!a.ok() || !b.ok()) return std::nullopt;
  double max_diff = 0;
  for (int64_t i = 0; i < got.num_elements(); ++i) {
    max_diff = std::max(
        max_diff, std::abs(static_cast<double>(a->data()[i]) - b->data()[i]));
  }
  return max_diff;
}

void PrintResults(const NamedTensors& results, const SafetensorsFile& input) {
  for (const auto& [name, tensor] : results) {
    std::printf("%s: %s %s", name.c_str(),
                std::string(DTypeName(tensor.dtype())).c_str(),
                ShapeString(tensor.shape()).c_str());
    if (const Tensor* expected = input.Find("expected_" + name)) {
      if (auto diff = MaxAbsDiff(tensor, *expected)) {
        std::printf(", max |diff| vs expected_%s = %.3g", name.c_str(), *diff);
      }
    }
    std::printf("\n");
  }
}

absl::Status RunOperation(const std::string& command) {
  const std::string in_path = absl::GetFlag(FLAGS_in);
  if (in_path.empty()) {
    return absl::InvalidArgumentError("--in: missing (a .safetensors file)");
  }
  ATTN_ASSIGN_OR_RETURN(SafetensorsFile file, ReadSafetensors(in_path));
  ATTN_ASSIGN_OR_RETURN(OpParams params, Params(file));
  const NamedViews views = ViewsOf(file.tensors);
  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  options.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  AttnClient client(options);

  ATTN_ASSIGN_OR_RETURN(Operation op, ParseOperation(command));
  ATTN_ASSIGN_OR_RETURN(NamedTensors results, client.Run(op, views, params));
  PrintResults(results, file);
  const std::string out_path = absl::GetFlag(FLAGS_out);
  if (!out_path.empty()) {
    ATTN_RETURN_IF_ERROR(WriteSafetensors(out_path, ViewsOf(results), {}));
    std::printf("wrote %s\n", out_path.c_str());
  }
  return absl::OkStatus();
}

absl::Status RunHealth() {
  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  AttnClient client(options);
  ATTN_ASSIGN_OR_RETURN(auto status,
                        client.Health(absl::GetFlag(FLAGS_service)));
  std::printf("%s\n",
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(status)
                  .c_str());
  if (status != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError("not serving");
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "attnctl attend|mha|layernorm --target=HOST:PORT --in=FILE.safetensors "
      "[--out=FILE.safetensors] [flags]\n"
      "attnctl health --target=HOST:PORT [--service=NAME]");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "%s\n", absl::ProgramUsageMessage().data());
    return 2;
  }
  const std::string command = args[1];
  absl::Status status;
  if (command == "health") {
    status = attnserve::RunHealth();
  } else if (command == "attend" || command == "mha" ||
             command == "layernorm") {
    status = attnserve::RunOperation(command);
  } else {
    std::fprintf(stderr, "attnctl: unknown command '%s'\n%s\n", command.c_str(),
                 absl::ProgramUsageMessage().data());
    return 2;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "attnctl: %s: %s\n",
                 absl::StatusCodeToString(status.code()).c_str(),
                 std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
