// NaN, +Inf and -Inf through a live server: in every input tensor and
// every weight of each RPC, for each dtype, the call succeeds and the
// non-finite value reaches exactly the output elements IEEE arithmetic (and
// the README's Semantics) say, against the float64 reference; the others
// stay finite and correct. FLOAT32 masks holding NaN or +inf are refused.
#include <cmath>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention_weights.h"
#include "core/convert.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

// Batch 2; batch 1 holds the corrupted input element, batch 0 stays clean.
constexpr int64_t kB = 2, kLq = 5, kLk = 6, kE = 16, kHeads = 4;
constexpr int64_t kBadQuery = 2, kBadKey = 4, kBadColumn = 3;
// In a weight: row 5, column kBadColumn (the query's third of
// in_proj_weight, head 1 of q/k/v_proj_weight); in a bias or in gamma and
// beta: element 5.
constexpr int64_t kBadFeature = 5;

struct Case {
  Operation op;
  std::string where;  // the corrupted tensor's field name
  float value;
  DType dtype;
};

std::string CaseName(const Case& c) {
  const char* op[] = {"Attend", "MultiHeadAttend", "LayerNorm"};
  const std::string value = std::isnan(c.value) ? "NaN"
                            : c.value > 0       ? "PlusInf"
                                                : "MinusInf";
  return absl::StrCat(op[static_cast<int>(c.op)], "_", c.where, "_", value, "_",
                      DTypeName(c.dtype));
}

void PrintTo(const Case& c, std::ostream* os) { *os << CaseName(c); }

// nn.Linear-scaled weights keep activations near unit scale.
Tensor RandomWeight(Shape shape, std::mt19937& rng) {
  Tensor w = RandomTensor(DType::kFloat32, shape, rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(shape.back()));
  for (int64_t i = 0; i < w.num_elements(); ++i) w.data_as<float>()[i] *= scale;
  return w;
}

// The case's tensors (float32, before the corruption and the conversion to
// the case's dtype).
NamedTensors CleanTensors(const Case& c, std::mt19937& rng) {
  NamedTensors t;
  if (c.op == Operation::kLayerNorm) {
    t.emplace("input", RandomTensor(DType::kFloat32, {kB, kLq, kE}, rng));
    t.emplace("gamma", RandomTensor(DType::kFloat32, {kE}, rng));
    t.emplace("beta", RandomTensor(DType::kFloat32, {kE}, rng));
    return t;
  }
  t.emplace("query", RandomTensor(DType::kFloat32, {kB, kLq, kE}, rng));
  t.emplace("key", RandomTensor(DType::kFloat32, {kB, kLk, kE}, rng));
  t.emplace("value", RandomTensor(DType::kFloat32, {kB, kLk, kE}, rng));
  if (c.op == Operation::kAttend) return t;
  if (c.where == "in_proj_weight" || c.where == "in_proj_bias") {
    t.emplace("in_proj_weight", RandomWeight({3 * kE, kE}, rng));
    t.emplace("in_proj_bias", RandomTensor(DType::kFloat32, {3 * kE}, rng));
  } else {
    for (const char* name :
         {"q_proj_weight", "k_proj_weight", "v_proj_weight"}) {
      t.emplace(name, RandomWeight({kE, kE}, rng));
    }
    for (const char* name : {"q_proj_bias", "k_proj_bias", "v_proj_bias"}) {
      t.emplace(name, RandomTensor(DType::kFloat32, {kE}, rng));
    }
  }
  t.emplace("out_proj_weight", RandomWeight({kE, kE}, rng));
  t.emplace("out_proj_bias", RandomTensor(DType::kFloat32, {kE}, rng));
  return t;
}

// Flat index of the corrupted element of tensor `where`.
int64_t BadIndex(const std::string& where, const Tensor& t) {
  if (where == "query" || where == "input") {
    return ((kLq + kBadQuery) * kE) + kBadColumn;
  }
  if (where == "key" || where == "value") {
    return ((kLk + kBadKey) * kE) + kBadColumn;
  }
  return t.shape().size() == 1 ? kBadFeature : kBadFeature * kE + kBadColumn;
}

// Whether the rule makes output element (b, i, col) NaN when the case's
// value is NaN: spelled out from the README, independently of the
// reference.
bool ExpectedNaN(const Case& c, int64_t b, int64_t i, int64_t col) {
  const std::string& w = c.where;
  if (c.op == Operation::kLayerNorm) {
    if (w == "input") return b == 1 && i == kBadQuery;  // its row
    return col == kBadFeature;                          // gamma, beta
  }
  if (w == "query") return b == 1 && i == kBadQuery;  // the query's row
  if (c.op == Operation::kAttend) {
    if (w == "key") return b == 1;       // every row sees the key
    return b == 1 && col == kBadColumn;  // value: its column
  }
  if (w == "key" || w == "value") return b == 1;  // projections mix columns
  // The output projection's row kBadFeature (or its bias) is one column;
  // any other weight corrupts a head that out_proj mixes into every column.
  if (w == "out_proj_weight" || w == "out_proj_bias") {
    return col == kBadFeature;
  }
  return true;
}

// One server per suite, a client per test.
template <typename Param>
class LiveServerTest : public ::testing::TestWithParam<Param> {
 protected:
  static void SetUpTestSuite() { server_ = new TestServer(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  LiveServerTest() : client_(server_->MakeClient()) {}

  static inline TestServer* server_ = nullptr;
  AttnClient client_;
};

class NonFiniteServerTest : public LiveServerTest<Case> {};

TEST_P(NonFiniteServerTest, PropagatesAsTheReferenceDoes) {
  const Case& c = GetParam();
  std::mt19937 rng(77);
  NamedTensors tensors = CleanTensors(c, rng);
  Tensor& bad = tensors.at(c.where);
  bad.data_as<float>()[BadIndex(c.where, bad)] = c.value;
  for (auto& [name, tensor] : tensors) {
    tensor = *Float32ToTensor(tensor.data_as<float>(), tensor.shape(), c.dtype);
  }
  OpParams params;
  params.return_weights = c.op != Operation::kLayerNorm;
  params.num_heads = kHeads;
  auto result = client_.Run(c.op, ViewsOf(tensors), params);
  ASSERT_TRUE(result.ok()) << result.status();

  // The float64 reference on the same (rounded) inputs.
  const auto ref = [&](const std::string& name) {
    return ToRef(tensors.at(name).view());
  };
  RefTensor expected_output;
  std::optional<RefTensor> expected_weights;
  if (c.op == Operation::kLayerNorm) {
    expected_output =
        RefLayerNorm(ref("input"), ref("gamma"), ref("beta"), 1e-5, 1);
  } else if (c.op == Operation::kAttend) {
    RefAttentionResult r =
        RefAttend(ref("query"), ref("key"), ref("value"), {}, {}, {});
    expected_output = std::move(r.output);
    expected_weights = std::move(r.weights);
  } else {
    RefMultiHeadWeights w;
    w.num_heads = kHeads;
    for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
      auto it = tensors.find(std::string(field.name));
      if (it != tensors.end()) {
        *w.Field(field.name) = ToRef(it->second.view());
      }
    }
    RefAttentionResult r = RefMultiHeadAttend(w, ref("query"), ref("key"),
                                              ref("value"), {}, {}, {});
    expected_output = std::move(r.output);
    expected_weights = std::move(r.weights);
  }
  const Tolerance tol = ToleranceFor(c.dtype);
  const Tensor& output = result->at("output");
  EXPECT_EQ(output.dtype(), c.dtype);
  EXPECT_TRUE(AllClose(output.view(), expected_output, tol));
  if (expected_weights.has_value()) {
    EXPECT_TRUE(AllClose(result->at("weights").view(), *expected_weights, tol));
  }

  // The NaN cases against the rule itself; for +-Inf, not vacuous: some
  // output element is non-finite.
  const RefTensor got = ToRef(output.view());
  const int64_t cols = output.shape().back();
  int64_t non_finite = 0;
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t i = 0; i < kLq; ++i) {
      for (int64_t col = 0; col < cols; ++col) {
        const double x = got.values[(b * kLq + i) * cols + col];
        if (!std::isfinite(x)) ++non_finite;
        if (std::isnan(c.value)) {
          EXPECT_EQ(std::isnan(x), ExpectedNaN(c, b, i, col))
              << b << "," << i << "," << col;
        }
      }
    }
  }
  // (-Inf in k_proj_bias gives every key the same -inf * q logit term: each
  // row of that head is all -inf, zeros, or all +inf, NaN.)
  if (!(c.where == "k_proj_bias" && c.value < 0)) {
    EXPECT_GT(non_finite, 0);
  }
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  const auto add = [&](Operation op, const std::string& where) {
    for (float value : {NAN, INFINITY, -INFINITY}) {
      for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        cases.push_back({op, where, value, dtype});
      }
    }
  };
  for (const char* where : {"query", "key", "value"}) {
    add(Operation::kAttend, where);
    add(Operation::kMultiHeadAttend, where);
  }
  for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
    add(Operation::kMultiHeadAttend, std::string(field.name));
  }
  for (const char* where : {"input", "gamma", "beta"}) {
    add(Operation::kLayerNorm, where);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Table, NonFiniteServerTest,
                         ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return CaseName(info.param); });

// FLOAT32 masks: -inf excludes, NaN and +inf are refused naming the field
// and the first offending flat index.
struct MaskCase {
  Operation op;
  std::string field;  // attn_mask or key_padding_mask
  float value;
};

class NonFiniteMaskTest : public LiveServerTest<MaskCase> {};

TEST_P(NonFiniteMaskTest, IsRefusedWithTheFirstIndex) {
  const MaskCase& c = GetParam();
  std::mt19937 rng(3);
  Case base{c.op, "query", 0.0f, DType::kFloat32};
  NamedTensors tensors = CleanTensors(base, rng);
  const Shape shape =
      c.field == "key_padding_mask" ? Shape{kB, kLk} : Shape{kLq, kLk};
  Tensor mask = *Tensor::Zeros(DType::kFloat32, shape);
  mask.data_as<float>()[1] = -INFINITY;
  mask.data_as<float>()[7] = c.value;
  mask.data_as<float>()[9] = NAN;
  tensors.emplace(c.field, std::move(mask));
  OpParams params;
  params.num_heads = kHeads;
  auto result = client_.Run(c.op, ViewsOf(tensors), params);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(result.status().message(),
            absl::StrCat(
                c.field, ": FLOAT32 mask values must be finite or -inf, found ",
                std::isnan(c.value) ? "nan" : "inf", " at flat index 7"));
  // -inf alone is a mask, and the server still serves.
  tensors.at(c.field).data_as<float>()[7] = 0.0f;
  tensors.at(c.field).data_as<float>()[9] = 0.0f;
  EXPECT_TRUE(client_.Run(c.op, ViewsOf(tensors), params).ok());
}

INSTANTIATE_TEST_SUITE_P(
    Masks, NonFiniteMaskTest,
    ::testing::Values(
        MaskCase{Operation::kAttend, "attn_mask", NAN},
        MaskCase{Operation::kAttend, "attn_mask", INFINITY},
        MaskCase{Operation::kMultiHeadAttend, "attn_mask", NAN},
        MaskCase{Operation::kMultiHeadAttend, "attn_mask", INFINITY},
        MaskCase{Operation::kMultiHeadAttend, "key_padding_mask", -NAN},
        MaskCase{Operation::kMultiHeadAttend, "key_padding_mask", INFINITY}),
    [](const auto& info) {
      return absl::StrCat(info.index, "_", info.param.field, "_",
                          std::isnan(info.param.value) ? "NaN" : "PlusInf");
    });

}  // namespace
}  // namespace attnserve::testing
