#include "tests/test_util.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "core/attention.h"
#include "core/convert.h"
#include "core/status_macros.h"

namespace attnserve::testing {

Tensor RandomTensor(DType dtype, Shape shape, std::mt19937& rng, double keep) {
  Tensor t = *Tensor::Allocate(dtype, std::move(shape));
  const int64_t n = t.num_elements();
  if (dtype == DType::kBool || dtype == DType::kUInt8) {
    std::bernoulli_distribution coin(keep);
    for (int64_t i = 0; i < n; ++i) t.data_as<uint8_t>()[i] = coin(rng) ? 1 : 0;
    return t;
  }
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = uniform(rng);
  StoreFloat32(values.data(), n, dtype, t.data());
  return t;
}

Tolerance ToleranceFor(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return kBFloat16Tolerance;
    case DType::kFloat16:
      return kFloat16Tolerance;
    default:
      return kFloat32Tolerance;
  }
}

::testing::AssertionResult AllClose(const TensorView& got,
                                    const RefTensor& expected, Tolerance tol) {
  if (got.shape != expected.shape) {
    return ::testing::AssertionFailure()
           << "shape " << ShapeString(got.shape) << " != expected "
           << ShapeString(expected.shape);
  }
  const RefTensor actual = ToRef(got);
  int64_t bad = 0, worst = -1;
  double worst_excess = 0;
  for (size_t i = 0; i < actual.values.size(); ++i) {
    const double a = actual.values[i], e = expected.values[i];
    const double allowed = tol.atol + tol.rtol * std::abs(e);
    const double diff = std::abs(a - e);
    if (!(diff <= allowed)) {  // NaN fails too
      ++bad;
      const double excess = std::isnan(diff) ? INFINITY : diff - allowed;
      if (worst < 0 || excess > worst_excess) {
        worst = static_cast<int64_t>(i);
        worst_excess = excess;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << actual.values.size()
         << " elements out of tolerance; worst at flat index " << worst
         << ": got " << actual.values[worst] << ", expected "
         << expected.values[worst];
}

std::string GoldensDir() { return ATTNSERVE_GOLDENS_DIR; }

std::vector<std::string> GoldenFiles() {
  std::vector<std::string> files;
  std::error_code error;
  for (const auto& entry :
       std::filesystem::directory_iterator(GoldensDir(), error)) {
    if (entry.path().extension() == ".safetensors") {
      files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

namespace {

std::optional<TensorView> Find(const NamedViews& views,
                               const std::string& name) {
  auto it = views.find(name);
  if (it == views.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<OpParams> GoldenParams(const SafetensorsFile& file) {
  OpParams params;
  ATTN_RETURN_IF_ERROR(ApplyMetadata(file.metadata, &params));
  params.return_weights = file.Find("expected_weights") != nullptr;
  return params;
}

absl::StatusOr<Operation> GoldenOperation(const SafetensorsFile& file) {
  const auto op = file.metadata.find("op");
  return ParseOperation(op == file.metadata.end() ? "" : op->second);
}

void AddResult(AttentionResult result, NamedTensors* out) {
  out->emplace("output", std::move(result.output));
  if (result.weights) out->emplace("weights", std::move(*result.weights));
}

}  // namespace

absl::StatusOr<NamedTensors> RunGoldenThroughCore(const SafetensorsFile& file) {
  ATTN_ASSIGN_OR_RETURN(OpParams params, GoldenParams(file));
  const NamedViews v = ViewsOf(file.tensors);
  ATTN_ASSIGN_OR_RETURN(Operation op, GoldenOperation(file));
  AttentionOptions attention;
  attention.causal = params.causal;
  attention.scale = params.scale;
  attention.temperature = params.temperature;
  attention.return_weights = params.return_weights;
  NamedTensors out;
  if (op == Operation::kAttend) {
    AttendInputs in{v.at("query"), v.at("key"), v.at("value"),
                    Find(v, "attn_mask")};
    ATTN_ASSIGN_OR_RETURN(AttentionResult r, Attend(in, attention));
    AddResult(std::move(r), &out);
  } else if (op == Operation::kMultiHeadAttend) {
    MultiHeadWeights w;
    w.num_heads = params.num_heads;
    w.q_proj_weight = Find(v, "q_proj_weight");
    w.k_proj_weight = Find(v, "k_proj_weight");
    w.v_proj_weight = Find(v, "v_proj_weight");
    w.in_proj_weight = Find(v, "in_proj_weight");
    w.q_proj_bias = Find(v, "q_proj_bias");
    w.k_proj_bias = Find(v, "k_proj_bias");
    w.v_proj_bias = Find(v, "v_proj_bias");
    w.in_proj_bias = Find(v, "in_proj_bias");
    w.out_proj_weight = Find(v, "out_proj_weight");
    w.out_proj_bias = Find(v, "out_proj_bias");
    MultiHeadInputs in{v.at("query"), Find(v, "key"), Find(v, "value"),
                       Find(v, "attn_mask"), Find(v, "key_padding_mask")};
    MultiHeadOptions options;
    options.attention = attention;
    ATTN_ASSIGN_OR_RETURN(AttentionResult r, MultiHeadAttend(w, in, options));
    AddResult(std::move(r), &out);
  } else {
    LayerNormOptions options;
    if (params.eps) options.eps = *params.eps;
    if (params.normalized_ndim > 0)
      options.normalized_ndim = params.normalized_ndim;
    ATTN_ASSIGN_OR_RETURN(Tensor r, LayerNorm(v.at("input"), Find(v, "gamma"),
                                              Find(v, "beta"), options));
    out.emplace("output", std::move(r));
  }
  return out;
}

absl::StatusOr<NamedTensors> RunGoldenThroughClient(AttnClient& client,
                                                    const SafetensorsFile& file,
                                                    bool shared_memory) {
  ATTN_ASSIGN_OR_RETURN(OpParams params, GoldenParams(file));
  ATTN_ASSIGN_OR_RETURN(Operation op, GoldenOperation(file));
  return client.Run(op, ViewsOf(file.tensors), params, shared_memory);
}

TestServer::TestServer(ServerOptions options) {
  options.host = "127.0.0.1";
  // A free metrics port (tests run side by side), or off.
  if (options.metrics_port > 0) options.metrics_port = 0;
  options.port = 0;
  auto server = AttnServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (server.ok()) server_ = *std::move(server);
}

std::string TestServer::target() const {
  return absl::StrCat("127.0.0.1:", port());
}

AttnClient TestServer::MakeClient() const {
  ClientOptions options;
  options.target = target();
  options.timeout = absl::Seconds(60);
  return AttnClient(options);
}

}  // namespace attnserve::testing
