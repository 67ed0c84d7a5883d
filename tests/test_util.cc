#include "tests/test_util.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/attention.h"
#include "core/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"

namespace attnserve::testing {

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
  if (options.http_port > 0) options.http_port = 0;
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

HealthWatch::HealthWatch(const std::string& target, absl::Duration deadline)
    : stub_(grpc::health::v1::Health::NewStub(
          grpc::CreateChannel(target, grpc::InsecureChannelCredentials()))) {
  context_.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service("attnserve.v1.AttentionService");
  watch_ = stub_->Watch(&context_, request);
}

HealthWatch::~HealthWatch() {
  context_.TryCancel();
  watch_->Finish().IgnoreError();
}

bool HealthWatch::FirstSaysServing() {
  grpc::health::v1::HealthCheckResponse update;
  return watch_->Read(&update) &&
         update.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

bool HealthWatch::WaitForNotServing() {
  grpc::health::v1::HealthCheckResponse update;
  while (watch_->Read(&update)) {
    if (update.status() == grpc::health::v1::HealthCheckResponse::NOT_SERVING) {
      return true;
    }
  }
  return false;
}

TempModelRepository::TempModelRepository(const std::string& tag)
    : root_((std::filesystem::temp_directory_path() /
             absl::StrCat("attnserve_", tag, "_", ::getpid()))
                .string()) {
  namespace fs = std::filesystem;
  fs::remove_all(root_);
  fs::create_directories(fs::path(root_) / "mha");
  std::ofstream(fs::path(root_) / "mha" / "config.pbtxt") << "num_heads: 4\n";
  std::mt19937 rng(3);
  NamedTensors state;
  state.emplace("in_proj_weight", RandomTensor(DType::kFloat32, {48, 16}, rng));
  state.emplace("in_proj_bias", RandomTensor(DType::kFloat32, {48}, rng));
  state.emplace("out_proj.weight",
                RandomTensor(DType::kFloat32, {16, 16}, rng));
  state.emplace("out_proj.bias", RandomTensor(DType::kFloat32, {16}, rng));
  EXPECT_TRUE(WriteSafetensors(
                  (fs::path(root_) / "mha" / "weights.safetensors").string(),
                  ViewsOf(state), {})
                  .ok());
}

TempModelRepository::~TempModelRepository() {
  std::filesystem::remove_all(root_);
}

}  // namespace attnserve::testing
