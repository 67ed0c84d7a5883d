#include "tests/core_test_util.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/attention.h"
#include "core/convert.h"
#include "core/status_macros.h"

namespace attnserve::testing {
namespace {

using Metadata = std::map<std::string, std::string>;

// The number under `key` in `metadata`, if it has one.
absl::StatusOr<std::optional<float>> MetadataNumber(const Metadata& metadata,
                                                    const std::string& key) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) return std::nullopt;
  float value = 0;
  if (!absl::SimpleAtof(it->second, &value)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata '", key, "': '", it->second, "' is not a number"));
  }
  return value;
}

// The attention options of a golden file's metadata.
absl::StatusOr<AttentionOptions> GoldenAttentionOptions(
    const SafetensorsFile& file) {
  AttentionOptions options;
  const auto causal = file.metadata.find("causal");
  if (causal != file.metadata.end() &&
      !absl::SimpleAtob(causal->second, &options.causal)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata 'causal': '", causal->second, "' is not true or false"));
  }
  ATTN_ASSIGN_OR_RETURN(std::optional<float> scale,
                        MetadataNumber(file.metadata, "scale"));
  ATTN_ASSIGN_OR_RETURN(std::optional<float> temperature,
                        MetadataNumber(file.metadata, "temperature"));
  if (scale) options.scale = *scale;
  if (temperature) options.temperature = *temperature;
  options.return_weights = file.Find("expected_weights") != nullptr;
  return options;
}

std::optional<TensorView> FindView(const SafetensorsFile& file,
                                   const std::string& name) {
  const Tensor* t = file.Find(name);
  if (t == nullptr) return std::nullopt;
  return t->view();
}

absl::StatusOr<TensorView> RequireView(const SafetensorsFile& file,
                                       const std::string& name) {
  std::optional<TensorView> view = FindView(file, name);
  if (!view) {
    return absl::InvalidArgumentError(
        absl::StrCat("golden file has no tensor '", name, "'"));
  }
  return *view;
}

NamedResults ResultsOf(AttentionResult result) {
  NamedResults out;
  out.emplace("output", std::move(result.output));
  if (result.weights) out.emplace("weights", std::move(*result.weights));
  return out;
}

absl::StatusOr<NamedResults> RunGoldenAttend(const SafetensorsFile& file,
                                             const AttentionOptions& options) {
  ATTN_ASSIGN_OR_RETURN(TensorView query, RequireView(file, "query"));
  ATTN_ASSIGN_OR_RETURN(TensorView key, RequireView(file, "key"));
  ATTN_ASSIGN_OR_RETURN(TensorView value, RequireView(file, "value"));
  AttendInputs in{query, key, value, FindView(file, "attn_mask")};
  ATTN_ASSIGN_OR_RETURN(AttentionResult result, Attend(in, options));
  return ResultsOf(std::move(result));
}

absl::StatusOr<NamedResults> RunGoldenMultiHeadAttend(
    const SafetensorsFile& file, const AttentionOptions& attention) {
  ATTN_ASSIGN_OR_RETURN(std::optional<float> num_heads,
                        MetadataNumber(file.metadata, "num_heads"));
  MultiHeadWeights w;
  w.num_heads = static_cast<int>(num_heads.value_or(0));
  w.q_proj_weight = FindView(file, "q_proj_weight");
  w.k_proj_weight = FindView(file, "k_proj_weight");
  w.v_proj_weight = FindView(file, "v_proj_weight");
  w.in_proj_weight = FindView(file, "in_proj_weight");
  w.q_proj_bias = FindView(file, "q_proj_bias");
  w.k_proj_bias = FindView(file, "k_proj_bias");
  w.v_proj_bias = FindView(file, "v_proj_bias");
  w.in_proj_bias = FindView(file, "in_proj_bias");
  w.out_proj_weight = FindView(file, "out_proj_weight");
  w.out_proj_bias = FindView(file, "out_proj_bias");
  ATTN_ASSIGN_OR_RETURN(TensorView query, RequireView(file, "query"));
  MultiHeadInputs in{query, FindView(file, "key"), FindView(file, "value"),
                     FindView(file, "attn_mask"),
                     FindView(file, "key_padding_mask")};
  MultiHeadOptions options;
  options.attention = attention;
  ATTN_ASSIGN_OR_RETURN(AttentionResult result,
                        MultiHeadAttend(w, in, options));
  return ResultsOf(std::move(result));
}

// LayerNorm, or RMSNorm when `rms_norm`.
absl::StatusOr<NamedResults> RunGoldenNorm(const SafetensorsFile& file,
                                           bool rms_norm) {
  ATTN_ASSIGN_OR_RETURN(std::optional<float> eps,
                        MetadataNumber(file.metadata, "eps"));
  ATTN_ASSIGN_OR_RETURN(std::optional<float> normalized_ndim,
                        MetadataNumber(file.metadata, "normalized_ndim"));
  LayerNormOptions options;
  options.rms_norm = rms_norm;
  if (eps) options.eps = *eps;
  if (normalized_ndim)
    options.normalized_ndim = static_cast<int>(*normalized_ndim);
  ATTN_ASSIGN_OR_RETURN(TensorView input, RequireView(file, "input"));
  ATTN_ASSIGN_OR_RETURN(Tensor output,
                        LayerNorm(input, FindView(file, "gamma"),
                                  FindView(file, "beta"), options));
  NamedResults out;
  out.emplace("output", std::move(output));
  return out;
}

// Tolerance for a golden: bf16 files say so in their metadata.
Tolerance GoldenTolerance(const SafetensorsFile& file) {
  auto it = file.metadata.find("dtype");
  return it != file.metadata.end() && it->second == "bf16" ? kBFloat16Tolerance
                                                           : kFloat32Tolerance;
}

}  // namespace

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
    case DType::kInt8:
      return kInt8Tolerance;
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
    // An expected NaN or infinity is matched exactly (the non-finite rule).
    const bool finite = std::isfinite(e);
    const bool same = std::isnan(e) ? std::isnan(a) : a == e;
    const double allowed = finite ? tol.atol + tol.rtol * std::abs(e) : 0;
    const double diff = finite ? std::abs(a - e) : (same ? 0 : NAN);
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

std::vector<std::string> GoldenFiles(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    if (entry.path().extension() == ".safetensors") {
      files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<std::string> SharedGoldenFiles() {
  const std::string dir = ATTNSERVE_SHARED_GOLDENS_DIR;
  std::error_code error;
  if (dir.empty() || std::filesystem::equivalent(dir, GoldensDir(), error)) {
    return {};
  }
  return GoldenFiles(dir);
}

std::string GoldenCaseName(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = std::filesystem::path(info.param).stem().string();
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

absl::StatusOr<NamedResults> RunGoldenThroughCore(const SafetensorsFile& file) {
  const auto op = file.metadata.find("op");
  const std::string name = op == file.metadata.end() ? "" : op->second;
  ATTN_ASSIGN_OR_RETURN(AttentionOptions attention,
                        GoldenAttentionOptions(file));
  if (name == "attend") return RunGoldenAttend(file, attention);
  if (name == "multi_head_attend") {
    return RunGoldenMultiHeadAttend(file, attention);
  }
  if (name == "layer_norm") return RunGoldenNorm(file, /*rms_norm=*/false);
  if (name == "rms_norm") return RunGoldenNorm(file, /*rms_norm=*/true);
  return absl::InvalidArgumentError(absl::StrCat(
      "metadata 'op': '", name,
      "' is not attend, multi_head_attend, layer_norm or rms_norm"));
}

void ExpectMatchesGolden(const SafetensorsFile& file,
                         const NamedResults& results) {
  for (const char* name : {"output", "weights"}) {
    const Tensor* expected = file.Find(std::string("expected_") + name);
    auto it = results.find(name);
    if (expected == nullptr) {
      EXPECT_EQ(it, results.end()) << name << " returned but not expected";
      continue;
    }
    ASSERT_NE(it, results.end()) << name << " missing from the results";
    const DType want_dtype =
        std::string(name) == "weights"
            ? DType::kFloat32
            : file.Find(file.Find("query") ? "query" : "input")->dtype();
    EXPECT_EQ(it->second.dtype(), want_dtype) << name;
    EXPECT_TRUE(AllClose(it->second.view(), ToRef(expected->view()),
                         GoldenTolerance(file)))
        << name;
  }
}

}  // namespace attnserve::testing
