#include "tests/test_util.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"

namespace attnserve::testing {

absl::StatusOr<NamedTensors> RunGoldenThroughClient(AttnClient& client,
                                                    const SafetensorsFile& file,
                                                    bool shared_memory) {
  OpParams params;
  ATTN_RETURN_IF_ERROR(ApplyMetadata(file.metadata, &params));
  params.return_weights = file.Find("expected_weights") != nullptr;
  const auto op_name = file.metadata.find("op");
  ATTN_ASSIGN_OR_RETURN(
      Operation op,
      ParseOperation(op_name == file.metadata.end() ? "" : op_name->second));
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
