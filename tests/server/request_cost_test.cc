// What the server expects a call to cost before it decodes anything: FLOPs,
// bytes and the largest tensor per RPC for known shapes, the compute-rate
// model, and the refusals that --max_request_memory_mb and
// --max_tensor_elements make from those estimates.
#include "server/request_cost.h"

#include <cstring>
#include <string>

#include "client/client.h"
#include "core/multi_head_attention.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

// A wire tensor of `shape` with zero values (FLOAT32) or, with
// `with_data` false, no values: costs read only shapes.
v1::Tensor Zeros(const Shape& shape, bool with_data = true,
                 v1::DataType dtype = v1::DATA_TYPE_FLOAT32) {
  // Counted only for data: shapes without it may overflow a product.
  const size_t bytes =
      with_data ? NumElements(shape) * DTypeSize(*FindDTypeByWire(dtype)) : 0;
  return WireTensor(dtype, shape, std::string(bytes, '\0'));
}

v1::Tensor Shaped(const Shape& shape) { return Zeros(shape, false); }

void ExpectCost(const RequestCost& cost, double flops, int64_t bytes,
                int64_t largest_tensor) {
  EXPECT_EQ(cost.flops, flops);
  EXPECT_EQ(cost.bytes, bytes);
  EXPECT_EQ(cost.largest_tensor, largest_tensor);
}

TEST(RequestCostTest, Attend) {
  v1::AttendRequest r;
  // Batch 2 x 3, Lq 4, Lk 5, dk 8, dv 16.
  *r.mutable_query() = Shaped({2, 3, 4, 8});
  *r.mutable_key() = Shaped({2, 3, 5, 8});
  *r.mutable_value() = Shaped({2, 3, 5, 16});
  // 2 * B * Lq * Lk * (dk + dv); the FLOAT32 output B x Lq x dv.
  ExpectCost(CostOf(r), 2.0 * 6 * 4 * 5 * (8 + 16), 6 * 4 * 16 * 4, 480);
  // Weights add B x Lq x Lk floats; a mask counts towards the largest
  // tensor only.
  r.set_return_weights(true);
  *r.mutable_attn_mask() = Shaped({2, 3, 4, 5});
  ExpectCost(CostOf(r), 5760, 1536 + 6 * 4 * 5 * 4, 480);
  *r.mutable_attn_mask() = Shaped({1, 1, 4, 500});
  EXPECT_EQ(CostOf(r).largest_tensor, 2000);
}

TEST(RequestCostTest, AttendWork) {
  v1::AttendRequest r;
  *r.mutable_query() = Shaped({6, 4, 8});
  *r.mutable_key() = Shaped({6, 5, 8});
  *r.mutable_value() = Shaped({6, 5, 16});
  // Elements read (192 + 240 + 480) and written (6 x 4 x 16), and 120
  // logits.
  EXPECT_EQ(CostOf(r).work,
            kElementWork * (192 + 240 + 480 + 384) + kLogitWork * 120);
  // A mask is read once per logit, weights are written.
  *r.mutable_attn_mask() = Shaped({4, 1});
  r.set_return_weights(true);
  EXPECT_EQ(CostOf(r).work,
            kElementWork * (192 + 240 + 480 + 4 + 384 + 120 + 120) +
                kLogitWork * 120);
}

// Calls of (nearly) no FLOPs whose work is not small: none of them may run
// on gRPC's thread, where nothing can cancel it.
TEST(RequestCostTest, WorkOfCallsWithoutFlops) {
  const int64_t l = 262144;
  v1::AttendRequest r;
  *r.mutable_query() = Shaped({1, 1, l, 0});
  *r.mutable_key() = Shaped({1, 1, l, 0});
  *r.mutable_value() = Shaped({1, 1, l, 0});
  // Nothing to compute: no output elements, no logit needed.
  EXPECT_EQ(CostOf(r).effort(), 0);
  EXPECT_TRUE(RunsInline(CostOf(r)));
  // Their 2^36 logits when the weights are asked for (2^38 bytes of them).
  r.set_return_weights(true);
  EXPECT_EQ(CostOf(r).flops, 0);
  EXPECT_EQ(CostOf(r).work, (kElementWork + kLogitWork) * l * l);
  EXPECT_FALSE(RunsInline(CostOf(r)));
  // A mask makes the kernel evaluate them even for one value column...
  r.set_return_weights(false);
  *r.mutable_value() = Shaped({1, 1, l, 1});
  *r.mutable_attn_mask() = Shaped({});
  EXPECT_EQ(CostOf(r).flops, 2.0 * l * l);
  EXPECT_EQ(CostOf(r).work,
            kElementWork * (l + 1 + l + double(l) * l) + kLogitWork * l * l);
  // ... without one, each row is the mean of the values: Lk sums, and the
  // output written.
  r.clear_attn_mask();
  EXPECT_EQ(CostOf(r).flops, l);
  EXPECT_EQ(CostOf(r).work, kElementWork * 2 * l);
  EXPECT_FALSE(RunsInline(CostOf(r)));
  // No key: 2^20 x 16 zeros written, 0 FLOPs.
  *r.mutable_query() = Shaped({1, 1, 1 << 20, 0});
  *r.mutable_key() = Shaped({1, 1, 0, 0});
  *r.mutable_value() = Shaped({1, 1, 0, 16});
  EXPECT_EQ(CostOf(r).flops, 0);
  EXPECT_EQ(CostOf(r).work, kElementWork * 16 * (1 << 20));
  EXPECT_FALSE(RunsInline(CostOf(r)));

  // Multi-head attention with heads of width 0 and weights asked for.
  v1::MultiHeadAttendRequest m;
  *m.mutable_query() = Shaped({1, l, 0});
  v1::AttentionWeights* w = m.mutable_weights();
  w->set_num_heads(1);
  *w->mutable_in_proj_weight() = Shaped({0, 0});
  m.set_return_weights(true);
  EXPECT_EQ(CostOf(m, nullptr).flops, 0);
  EXPECT_GE(CostOf(m, nullptr).work, kLogitWork * l * l);
  EXPECT_FALSE(RunsInline(CostOf(m, nullptr)));

  // LayerNorm reads and writes every element.
  v1::LayerNormRequest n;
  *n.mutable_input() = Shaped({1000, 1000});
  EXPECT_EQ(CostOf(n).work, kElementWork * 2e6);
  EXPECT_FALSE(RunsInline(CostOf(n)));
  *n.mutable_input() = Shaped({100, 1000});
  EXPECT_TRUE(RunsInline(CostOf(n)));
}

TEST(RequestCostTest, EffortIsTheLargerOfFlopsAndWork) {
  RequestCost cost;
  cost.flops = 3e6;
  cost.work = 2e6;
  EXPECT_EQ(cost.effort(), 3e6);
  cost.work = 5e6;
  EXPECT_EQ(cost.effort(), 5e6);
  // The estimate of a call of 0 FLOPs is its work's.
  CostModel model(1e9);
  cost.flops = 0;
  EXPECT_EQ(model.Estimate(cost.effort()), absl::Milliseconds(5));
}

TEST(RequestCostTest, AttendBytesSaturateInsteadOfOverflowing) {
  v1::AttendRequest r;
  *r.mutable_query() = Shaped({int64_t{1} << 30, 1 << 20, 1});
  *r.mutable_key() = Shaped({int64_t{1} << 30, 1 << 20, 1});
  *r.mutable_value() = Shaped({int64_t{1} << 30, 1 << 20, 1 << 10});
  EXPECT_EQ(CostOf(r).bytes, int64_t{1} << 62);  // the output alone
  r.set_return_weights(true);                    // 2^72 more bytes
  EXPECT_EQ(CostOf(r).bytes, int64_t{9'000'000'000'000'000'000});
}

TEST(RequestCostTest, ShapesThatDoNotValidateCostNothing) {
  v1::AttendRequest attend;
  *attend.mutable_query() = Shaped({4, 8});
  *attend.mutable_key() = Shaped({-5, 8});
  *attend.mutable_value() = Shaped({5, 8});
  ExpectCost(CostOf(attend), 0, 0, 0);
  // A product past 2^62 is refused by the operation too.
  *attend.mutable_key() = Shaped({int64_t{1} << 32, int64_t{1} << 31});
  ExpectCost(CostOf(attend), 0, 0, 0);

  v1::MultiHeadAttendRequest mha;
  *mha.mutable_query() = Shaped({2, 4, 16});
  *mha.mutable_key_padding_mask() = Shaped({2, -1});
  ExpectCost(CostOf(mha, nullptr), 0, 0, 0);

  v1::LayerNormRequest layer_norm;
  *layer_norm.mutable_input() = Shaped({3, -7});
  ExpectCost(CostOf(layer_norm), 0, 0, 0);
}

// Batch 2, L 4, E 16, 2 heads, self-attention with a fused in_proj_weight.
v1::MultiHeadAttendRequest FusedSelfAttention() {
  v1::MultiHeadAttendRequest r;
  *r.mutable_query() = Shaped({2, 4, 16});
  v1::AttentionWeights* w = r.mutable_weights();
  w->set_num_heads(2);
  *w->mutable_in_proj_weight() = Shaped({48, 16});
  *w->mutable_out_proj_weight() = Shaped({16, 16});
  return r;
}

// Its FLOPs: the Q, K, V and output projections, then attention over all
// heads (H*dk = H*dv = 16).
constexpr double kFusedFlops =
    2.0 * 2 * (4 * 16 * 16 + 4 * 16 * 32 + 4 * 16 * 16) + 2.0 * 2 * 4 * 4 * 32;
// Its bytes: the projected Q, K and V, two Lq x H*dv intermediates, then the
// output.
constexpr int64_t kFusedBytes =
    2 * (4 * 16 + 4 * 32 + 2 * 4 * 16) * 4 + 2 * 4 * 16 * 4;

TEST(RequestCostTest, MultiHeadAttendWithFusedWeights) {
  v1::MultiHeadAttendRequest r = FusedSelfAttention();
  ExpectCost(CostOf(r, nullptr), kFusedFlops, kFusedBytes, 128);
  // Weights: B x H x Lq x Lk floats, estimated at twice that when
  // averaged over heads.
  r.set_return_weights(true);
  EXPECT_EQ(CostOf(r, nullptr).bytes, kFusedBytes + 2 * 2 * 4 * 4 * 4);
  r.set_average_weights(true);
  EXPECT_EQ(CostOf(r, nullptr).bytes, kFusedBytes + 2 * 2 * 4 * 4 * 4 * 2);
}

TEST(RequestCostTest, MultiHeadAttendWithSeparateWeights) {
  v1::MultiHeadAttendRequest r;
  // Unbatched: Lq 4, Lk 6, E 16; H*dk 8, H*dv 12, output dim 20.
  *r.mutable_query() = Shaped({4, 16});
  *r.mutable_key() = Shaped({6, 16});
  *r.mutable_value() = Shaped({6, 16});
  v1::AttentionWeights* w = r.mutable_weights();
  w->set_num_heads(2);
  *w->mutable_q_proj_weight() = Shaped({8, 16});
  *w->mutable_k_proj_weight() = Shaped({8, 16});
  *w->mutable_v_proj_weight() = Shaped({12, 16});
  *w->mutable_out_proj_weight() = Shaped({20, 12});
  const double flops =
      2.0 * (4 * 16 * 8 + 6 * 16 * (8 + 12) + 4 * 12 * 20) + 2.0 * 4 * 6 * 20;
  const int64_t bytes = (4 * 8 + 6 * 20 + 2 * 4 * 12) * 4 + 4 * 20 * 4;
  ExpectCost(CostOf(r, nullptr), flops, bytes, 96);
  // Without out_proj_weight the output keeps H*dv.
  w->clear_out_proj_weight();
  EXPECT_EQ(CostOf(r, nullptr).bytes,
            (4 * 8 + 6 * 20 + 2 * 4 * 12) * 4 + 4 * 12 * 4);
}

TEST(RequestCostTest, MultiHeadAttendWithAModelUsesTheModelsDims) {
  // The layer of FusedSelfAttention's weights, as a repository would hold.
  Tensor in_proj = *Tensor::Allocate(DType::kFloat32, {48, 16});
  Tensor out_proj = *Tensor::Allocate(DType::kFloat32, {16, 16});
  std::memset(in_proj.data(), 0, in_proj.num_bytes());
  std::memset(out_proj.data(), 0, out_proj.num_bytes());
  MultiHeadWeights weights;
  weights.num_heads = 2;
  weights.in_proj_weight = in_proj.view();
  weights.out_proj_weight = out_proj.view();
  auto layer = MultiHeadLayer::Create(weights, {});
  ASSERT_TRUE(layer.ok()) << layer.status();
  v1::MultiHeadAttendRequest r;
  *r.mutable_query() = Shaped({2, 4, 16});
  r.set_model("m");
  ExpectCost(CostOf(r, layer->get()), kFusedFlops, kFusedBytes, 128);
}

TEST(RequestCostTest, LayerNorm) {
  v1::LayerNormRequest r;
  *r.mutable_input() = Shaped({3, 5, 7});
  // About 8 FLOPs and one FLOAT32 output element per input element.
  ExpectCost(CostOf(r), 8.0 * 105, 105 * 4, 105);
  *r.mutable_gamma() = Shaped({7});
  ExpectCost(CostOf(r), 8.0 * 105, 105 * 4, 105);
}

TEST(RequestCostTest, LayerNormBytesSaturateInsteadOfOverflowing) {
  v1::LayerNormRequest r;
  // 9.2e18 bytes: decodable (under 2^63), above the 9e18 saturation.
  const int64_t elements = 2'300'000'000'000'000'000;
  *r.mutable_input() = Shaped({elements});
  RequestCost cost = CostOf(r);
  EXPECT_EQ(cost.largest_tensor, elements);
  EXPECT_EQ(cost.bytes, int64_t{9'000'000'000'000'000'000});
  // 2^64 bytes cannot decode: no cost, the decoder's INVALID_ARGUMENT.
  *r.mutable_input() = Shaped({int64_t{1} << 31, int64_t{1} << 31});
  cost = CostOf(r);
  EXPECT_EQ(cost.largest_tensor, 0);
  EXPECT_EQ(cost.bytes, 0);
}

TEST(CostModelTest, EstimatesFromTheInitialRateUntilCallsAreMeasured) {
  CostModel model(1e9);
  EXPECT_EQ(model.Estimate(2e9), absl::Seconds(2));
  EXPECT_EQ(model.Estimate(0), absl::ZeroDuration());
  // Too short to measure, or no time taken: ignored.
  model.Observe(9e6, absl::Microseconds(1));
  model.Observe(1e9, absl::ZeroDuration());
  EXPECT_EQ(model.Estimate(2e9), absl::Seconds(2));
}

TEST(CostModelTest, MeasuredCallsMoveTheRateAFifthOfTheWay) {
  CostModel model(1e9);
  model.Observe(2e9, absl::Seconds(1));  // 2 GFLOP/s seen: 1.2 GFLOP/s
  EXPECT_DOUBLE_EQ(absl::ToDoubleSeconds(model.Estimate(1.2e9)), 1.0);
  model.Observe(1.2e8, absl::Seconds(1));  // 0.12 GFLOP/s: 0.984 GFLOP/s
  EXPECT_DOUBLE_EQ(absl::ToDoubleSeconds(model.Estimate(0.984e9)), 1.0);
}

// The limits, through a server: the refusal names the estimate and the flag.
template <typename T>
void ExpectExhausted(const absl::StatusOr<T>& result,
                     const std::string& message) {
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted)
      << result.status();
  EXPECT_EQ(result.status().message(), message);
}

ServerOptions MemoryLimit1MiB() {
  ServerOptions options;
  options.max_request_memory_mb = 1;
  options.metrics_port = -1;
  options.http_port = -1;
  return options;
}

constexpr char kTooMuchMemory[] =
    "request: needs about 2 MiB for results and intermediates, above "
    "--max_request_memory_mb 1";

TEST(RequestLimitsTest, AttendOverTheMemoryLimit) {
  TestServer server(MemoryLimit1MiB());
  AttnClient client = server.MakeClient();
  // 512 x 1024 FLOAT32 weights are 2 MiB; the output is 16 KiB more.
  v1::AttendRequest r;
  *r.mutable_query() = Zeros({512, 8});
  *r.mutable_key() = Zeros({1024, 8});
  *r.mutable_value() = Zeros({1024, 8});
  r.set_return_weights(true);
  ExpectExhausted(client.Attend(r), kTooMuchMemory);
  // Without the weights it fits.
  r.set_return_weights(false);
  auto ok = client.Attend(r);
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST(RequestLimitsTest, MultiHeadAttendOverTheMemoryLimit) {
  TestServer server(MemoryLimit1MiB());
  AttnClient client = server.MakeClient();
  // 2 heads x 512 x 512 FLOAT32 weights are 2 MiB; projections and output
  // 24 KiB more.
  v1::MultiHeadAttendRequest r;
  *r.mutable_query() = Zeros({1, 512, 2});
  v1::AttentionWeights* w = r.mutable_weights();
  w->set_num_heads(2);
  *w->mutable_in_proj_weight() = Zeros({6, 2});
  r.set_return_weights(true);
  ExpectExhausted(client.MultiHeadAttend(r), kTooMuchMemory);
  r.set_return_weights(false);
  auto ok = client.MultiHeadAttend(r);
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST(RequestLimitsTest, LayerNormAtAndOverTheMemoryLimit) {
  TestServer server(MemoryLimit1MiB());
  AttnClient client = server.MakeClient();
  v1::LayerNormRequest over;
  *over.mutable_input() = Zeros({512, 1024});
  ExpectExhausted(client.LayerNorm(over), kTooMuchMemory);
  // Exactly 1 MiB of output is within the limit.
  v1::LayerNormRequest at;
  *at.mutable_input() = Zeros({256, 1024});
  auto ok = client.LayerNorm(at);
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST(RequestLimitsTest, LargestTensorOfEachRpc) {
  ServerOptions options;
  options.max_tensor_elements = 1000;
  options.metrics_port = -1;
  options.http_port = -1;
  TestServer server(options);
  AttnClient client = server.MakeClient();
  constexpr char kTooLarge[] =
      "request: a tensor of 1200 elements exceeds --max_tensor_elements 1000";
  v1::AttendRequest attend;
  *attend.mutable_query() = Zeros({20, 8});
  *attend.mutable_key() = Zeros({60, 8});
  *attend.mutable_value() = Zeros({60, 8});
  *attend.mutable_attn_mask() = Zeros({20, 60}, true, v1::DATA_TYPE_BOOL);
  ExpectExhausted(client.Attend(attend), kTooLarge);
  v1::MultiHeadAttendRequest mha;
  *mha.mutable_query() = Zeros({1, 10, 4});
  *mha.mutable_value() = Zeros({1, 300, 4});
  ExpectExhausted(client.MultiHeadAttend(mha), kTooLarge);
  // At the limit is allowed.
  v1::LayerNormRequest layer_norm;
  *layer_norm.mutable_input() = Zeros({1000});
  auto ok = client.LayerNorm(layer_norm);
  EXPECT_TRUE(ok.ok()) << ok.status();
  *layer_norm.mutable_input() = Zeros({1001});
  ExpectExhausted(client.LayerNorm(layer_norm),
                  "request: a tensor of 1001 elements exceeds "
                  "--max_tensor_elements 1000");
}

}  // namespace
}  // namespace attnserve::testing
