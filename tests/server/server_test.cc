// The server's answers to bad requests (code and message), that it keeps
// serving after each of them, and valid calls' results against the float64
// reference.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "core/convert.h"
#include "core/primitives.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/impl/codegen/client_context.h"
#include "grpcpp/impl/codegen/rpc_method.h"
#include "grpcpp/impl/codegen/sync_stream.h"
#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "reflection_test/reflection.pb.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

v1::AttendRequest ValidAttend() {
  v1::AttendRequest r;
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {2, 3, 8}, 17);
  *r.mutable_key() = RandomWireTensor(DType::kFloat32, {2, 5, 8}, 17);
  *r.mutable_value() = RandomWireTensor(DType::kFloat32, {2, 5, 4}, 17);
  return r;
}

v1::MultiHeadAttendRequest ValidMha() {
  v1::MultiHeadAttendRequest r;
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {2, 3, 8}, 17);
  v1::AttentionWeights* w = r.mutable_weights();
  w->set_num_heads(2);
  *w->mutable_q_proj_weight() = RandomWireTensor(DType::kFloat32, {8, 8}, 17);
  *w->mutable_k_proj_weight() = RandomWireTensor(DType::kFloat32, {8, 8}, 17);
  *w->mutable_v_proj_weight() = RandomWireTensor(DType::kFloat32, {8, 8}, 17);
  return r;
}

v1::LayerNormRequest ValidLayerNorm() {
  v1::LayerNormRequest r;
  *r.mutable_input() = RandomWireTensor(DType::kFloat32, {2, 6}, 17);
  return r;
}

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = new TestServer(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  ServerTest() : client_(server_->MakeClient()) {}

  // The call fails with `code` and exactly `message`, and a valid call right
  // after it still succeeds.
  template <typename Response>
  void ExpectError(const absl::StatusOr<Response>& response,
                   absl::StatusCode code, const std::string& message) {
    ASSERT_FALSE(response.ok());
    EXPECT_EQ(response.status().code(), code) << response.status();
    EXPECT_EQ(response.status().message(), message);
    auto ok = client_.Attend(ValidAttend());
    EXPECT_TRUE(ok.ok()) << "server stopped serving: " << ok.status();
  }

  static TestServer* server_;
  AttnClient client_;
};
TestServer* ServerTest::server_ = nullptr;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;

TEST_F(ServerTest, ValidRequestsSucceed) {
  auto attend = client_.Attend(ValidAttend());
  ASSERT_TRUE(attend.ok()) << attend.status();
  EXPECT_EQ(attend->output().dtype(), v1::DATA_TYPE_FLOAT32);
  EXPECT_EQ(std::vector<int64_t>(attend->output().shape().begin(),
                                 attend->output().shape().end()),
            (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(attend->output().raw_data().size(), 2u * 3 * 4 * 4);
  EXPECT_FALSE(attend->has_weights());
  auto mha = client_.MultiHeadAttend(ValidMha());
  ASSERT_TRUE(mha.ok()) << mha.status();
  auto ln = client_.LayerNorm(ValidLayerNorm());
  ASSERT_TRUE(ln.ok()) << ln.status();
}

TEST_F(ServerTest, FloatDataIsAccepted) {
  v1::LayerNormRequest r;
  r.mutable_input()->set_dtype(v1::DATA_TYPE_FLOAT32);
  r.mutable_input()->add_shape(1);
  r.mutable_input()->add_shape(4);
  for (float v : {1.0f, 2.0f, 3.0f, 4.0f}) r.mutable_input()->add_float_data(v);
  auto response = client_.LayerNorm(r);
  ASSERT_TRUE(response.ok()) << response.status();
  auto out = CopyTensor(response->output(), "output");
  ASSERT_TRUE(out.ok());
  // mean 2.5, variance 1.25
  const float inv = 1.0f / std::sqrt(1.25f + 1e-5f);
  EXPECT_NEAR(out->data_as<float>()[0], -1.5f * inv, 1e-6);
  EXPECT_NEAR(out->data_as<float>()[3], 1.5f * inv, 1e-6);
}

// Through the server: each row of the input one constant (values that
// float32 sums cannot add exactly, large, negative, zero), over widths and
// eps: LayerNorm gives beta, RMSNorm gamma * x / sqrt(x^2 + eps), as the
// float64 reference does.
TEST_F(ServerTest, NormsOfConstantRowsMatchFloat64) {
  const std::vector<float> constants = {0.1f,     3.3f,    -12.345f, 1000.5f,
                                        -1000.5f, 65504.f, -7e-3f,   0.0f};
  const int64_t rows = static_cast<int64_t>(constants.size());
  std::mt19937 rng(47);
  for (int64_t dim : {1, 7, 197, 4096}) {
    Tensor input = *Tensor::Allocate(DType::kFloat32, {rows, dim});
    for (int64_t i = 0; i < input.num_elements(); ++i) {
      input.data_as<float>()[i] = constants[i / dim];
    }
    const Tensor gamma = RandomTensor(DType::kFloat32, {dim}, rng);
    const Tensor beta = RandomTensor(DType::kFloat32, {dim}, rng);
    for (float eps : {1e-12f, 1e-6f, 1e-2f}) {
      SCOPED_TRACE(absl::StrCat("dim ", dim, " eps ", eps));
      v1::LayerNormRequest request;
      EncodeTensor(input.view(), request.mutable_input());
      EncodeTensor(gamma.view(), request.mutable_gamma());
      EncodeTensor(beta.view(), request.mutable_beta());
      request.set_eps(eps);
      auto response = client_.LayerNorm(request);
      ASSERT_TRUE(response.ok()) << response.status();
      auto out = CopyTensor(response->output(), "output");
      ASSERT_TRUE(out.ok()) << out.status();
      const RefTensor ref = RefLayerNorm(
          ToRef(input.view()), ToRef(gamma.view()), ToRef(beta.view()), eps, 1);
      for (int64_t i = 0; i < input.num_elements(); ++i) {
        // The reference's constant rows are exactly beta.
        ASSERT_EQ(ref.values[i], beta.data_as<float>()[i % dim]);
        ASSERT_NEAR(out->data_as<float>()[i], ref.values[i], 1e-6)
            << "row of " << constants[i / dim] << ", column " << i % dim;
      }

      request.clear_beta();
      request.set_rms_norm(true);
      response = client_.LayerNorm(request);
      ASSERT_TRUE(response.ok()) << response.status();
      out = CopyTensor(response->output(), "output");
      ASSERT_TRUE(out.ok()) << out.status();
      const RefTensor rms =
          RefRmsNorm(ToRef(input.view()), ToRef(gamma.view()), eps, 1);
      for (int64_t i = 0; i < input.num_elements(); ++i) {
        ASSERT_NEAR(out->data_as<float>()[i], rms.values[i], 1e-6)
            << "RMSNorm row of " << constants[i / dim] << ", column "
            << i % dim;
      }
    }
  }
}

// Rows whose mean (10 to 1000) is large against their unit spread keep the
// digits the deviations need: within 1e-5 of the float64 reference.
TEST_F(ServerTest, LayerNormOfOffsetRowsMatchesFloat64) {
  std::mt19937 rng(53);
  std::normal_distribution<float> unit(0.0f, 1.0f);
  const std::vector<float> means = {10.0f, 100.0f, 1000.0f, -1000.0f};
  for (int64_t dim : {7, 197, 4096}) {
    Tensor input = *Tensor::Allocate(DType::kFloat32, {8, dim});
    for (int64_t i = 0; i < input.num_elements(); ++i) {
      input.data_as<float>()[i] = means[i / dim % means.size()] + unit(rng);
    }
    const Tensor gamma = RandomTensor(DType::kFloat32, {dim}, rng);
    const Tensor beta = RandomTensor(DType::kFloat32, {dim}, rng);
    v1::LayerNormRequest request;
    EncodeTensor(input.view(), request.mutable_input());
    EncodeTensor(gamma.view(), request.mutable_gamma());
    EncodeTensor(beta.view(), request.mutable_beta());
    request.set_eps(1e-6f);
    auto response = client_.LayerNorm(request);
    ASSERT_TRUE(response.ok()) << response.status();
    auto out = CopyTensor(response->output(), "output");
    ASSERT_TRUE(out.ok()) << out.status();
    const RefTensor ref = RefLayerNorm(ToRef(input.view()), ToRef(gamma.view()),
                                       ToRef(beta.view()), 1e-6, 1);
    EXPECT_TRUE(AllClose(out->view(), ref, {1e-5, 0.0})) << "dim " << dim;
  }
}

TEST_F(ServerTest, MissingTensor) {
  v1::AttendRequest r = ValidAttend();
  r.clear_key();
  ExpectError(client_.Attend(r), kInvalid, "key: missing");
}

TEST_F(ServerTest, UnspecifiedDType) {
  v1::AttendRequest r = ValidAttend();
  r.mutable_query()->set_dtype(v1::DATA_TYPE_UNSPECIFIED);
  ExpectError(client_.Attend(r), kInvalid,
              "query: dtype is DATA_TYPE_UNSPECIFIED, expected one of "
              "DATA_TYPE_FLOAT32, DATA_TYPE_BFLOAT16, DATA_TYPE_FLOAT16, "
              "DATA_TYPE_BOOL, DATA_TYPE_UINT8");
}

TEST_F(ServerTest, UnknownDType) {
  v1::AttendRequest r = ValidAttend();
  r.mutable_query()->set_dtype(static_cast<v1::DataType>(42));
  ExpectError(client_.Attend(r), kInvalid,
              "query: dtype 42 is not a known DataType");
}

TEST_F(ServerTest, RawDataLength) {
  v1::AttendRequest r = ValidAttend();
  r.mutable_value()->mutable_raw_data()->resize(12);
  ExpectError(client_.Attend(r), kInvalid,
              "value: raw_data has 12 bytes, expected 160 (shape [2, 5, 4] x 4 "
              "bytes of FLOAT32)");
}

TEST_F(ServerTest, BothRawAndFloatData) {
  v1::AttendRequest r = ValidAttend();
  r.mutable_query()->add_float_data(1.0f);
  ExpectError(
      client_.Attend(r), kInvalid,
      "query: both raw_data and float_data are set, expected exactly one");
}

TEST_F(ServerTest, FloatDataCount) {
  v1::LayerNormRequest r;
  r.mutable_input()->set_dtype(v1::DATA_TYPE_FLOAT32);
  r.mutable_input()->add_shape(2);
  r.mutable_input()->add_shape(2);
  r.mutable_input()->add_float_data(1.0f);
  ExpectError(client_.LayerNorm(r), kInvalid,
              "input: float_data has 1 values, expected 4 for shape [2, 2]");
}

TEST_F(ServerTest, FloatDataWithOtherDType) {
  v1::LayerNormRequest r;
  r.mutable_input()->set_dtype(v1::DATA_TYPE_BFLOAT16);
  r.mutable_input()->add_shape(1);
  r.mutable_input()->add_float_data(1.0f);
  ExpectError(client_.LayerNorm(r), kInvalid,
              "input: float_data is only for DATA_TYPE_FLOAT32, dtype is "
              "DATA_TYPE_BFLOAT16");
}

TEST_F(ServerTest, NegativeDim) {
  v1::AttendRequest r = ValidAttend();
  r.mutable_query()->set_shape(1, -3);
  ExpectError(client_.Attend(r), kInvalid,
              "query: dim 1 is negative (-3) in shape [2, -3, 8]");
}

TEST_F(ServerTest, OverflowingDims) {
  v1::AttendRequest r = ValidAttend();
  r.mutable_query()->clear_shape();
  for (int64_t d : {int64_t{1} << 40, int64_t{1} << 40, int64_t{8}}) {
    r.mutable_query()->add_shape(d);
  }
  ExpectError(client_.Attend(r), kInvalid,
              "query: shape [1099511627776, 1099511627776, 8] overflows 64-bit "
              "size");
}

TEST_F(ServerTest, WrongRank) {
  v1::AttendRequest r = ValidAttend();
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {8}, 17);
  ExpectError(client_.Attend(r), kInvalid,
              "query: rank 1 (shape [8]), expected rank >= 2");
}

TEST_F(ServerTest, MismatchedDims) {
  v1::AttendRequest r = ValidAttend();
  *r.mutable_key() = RandomWireTensor(DType::kFloat32, {2, 5, 6}, 17);
  ExpectError(client_.Attend(r), kInvalid,
              "key: last dim 6 != query last dim 8");
}

TEST_F(ServerTest, MaskDoesNotBroadcast) {
  v1::AttendRequest r = ValidAttend();
  r.mutable_attn_mask()->set_dtype(v1::DATA_TYPE_BOOL);
  r.mutable_attn_mask()->add_shape(3);
  r.mutable_attn_mask()->add_shape(4);
  r.mutable_attn_mask()->set_raw_data(std::string(12, '\1'));
  ExpectError(client_.Attend(r), kInvalid,
              "attn_mask: shape [3, 4] does not broadcast to [2, 3, 5] (dim 1 "
              "is 4, expected 1 or 5)");
}

TEST_F(ServerTest, NonPositiveTemperature) {
  v1::AttendRequest r = ValidAttend();
  r.set_temperature(0.0f);
  ExpectError(client_.Attend(r), kInvalid,
              "temperature: must be finite and > 0, got 0");
}

TEST_F(ServerTest, HeadsDoNotDivide) {
  v1::MultiHeadAttendRequest r = ValidMha();
  r.mutable_weights()->set_num_heads(3);
  ExpectError(client_.MultiHeadAttend(r), kInvalid,
              "q_proj_weight: dim 0 (8) is not divisible by num_heads 3");
}

TEST_F(ServerTest, BiasLength) {
  v1::MultiHeadAttendRequest r = ValidMha();
  *r.mutable_weights()->mutable_v_proj_bias() =
      RandomWireTensor(DType::kFloat32, {7}, 17);
  ExpectError(client_.MultiHeadAttend(r), kInvalid,
              "v_proj_bias: shape [7], expected [8]");
}

TEST_F(ServerTest, NoWeightsSource) {
  v1::MultiHeadAttendRequest r = ValidMha();
  r.clear_weights();
  ExpectError(client_.MultiHeadAttend(r), kInvalid,
              "weights: missing, expected either `model` or `weights`");
}

TEST_F(ServerTest, UnknownModelIsNotFound) {
  v1::MultiHeadAttendRequest r = ValidMha();
  r.set_model("bert");
  ExpectError(client_.MultiHeadAttend(r), absl::StatusCode::kNotFound,
              "model: 'bert' not found: this server has no model repository; "
              "send the weights inline in `weights`");
}

TEST_F(ServerTest, NegativeEps) {
  v1::LayerNormRequest r = ValidLayerNorm();
  r.set_eps(-1.0f);
  ExpectError(client_.LayerNorm(r), kInvalid,
              "eps: must be finite and > 0, got -1");
}

TEST_F(ServerTest, NegativeNormalizedNdim) {
  v1::LayerNormRequest r = ValidLayerNorm();
  r.set_normalized_ndim(-1);
  ExpectError(client_.LayerNorm(r), kInvalid,
              "normalized_ndim: must be >= 0 (0 means 1), got -1");
}

TEST_F(ServerTest, OversizedMessageIsResourceExhausted) {
  ClientOptions options;
  options.target = server_->target();
  options.max_message_mb = 512;
  AttnClient big_client(options);
  v1::LayerNormRequest r;
  r.mutable_input()->set_dtype(v1::DATA_TYPE_UINT8);
  r.mutable_input()->add_shape(int64_t{257} << 20);
  r.mutable_input()->mutable_raw_data()->resize(size_t{257} << 20);
  auto response = big_client.LayerNorm(r);
  ASSERT_FALSE(response.ok());
  EXPECT_EQ(response.status().code(), absl::StatusCode::kResourceExhausted)
      << response.status();
  auto ok = client_.Attend(ValidAttend());
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST_F(ServerTest, HealthIsServing) {
  auto overall = client_.Health("");
  ASSERT_TRUE(overall.ok()) << overall.status();
  EXPECT_EQ(*overall, grpc::health::v1::HealthCheckResponse::SERVING);
  auto service = client_.Health("attnserve.v1.AttentionService");
  ASSERT_TRUE(service.ok()) << service.status();
  EXPECT_EQ(*service, grpc::health::v1::HealthCheckResponse::SERVING);
  auto unknown = client_.Health("no.such.Service");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ServerTest, ResultsTooLargeAreResourceExhausted) {
  // 32768 x 32768 FLOAT32 weights are 4 GiB from 256 KiB of input.
  v1::AttendRequest r;
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {32768, 2}, 17);
  *r.mutable_key() = RandomWireTensor(DType::kFloat32, {32768, 2}, 17);
  *r.mutable_value() = RandomWireTensor(DType::kFloat32, {32768, 2}, 17);
  r.set_return_weights(true);
  ExpectError(client_.Attend(r), absl::StatusCode::kResourceExhausted,
              "request: needs about 4096 MiB for results and intermediates, "
              "above --max_request_memory_mb 4096");
}

TEST_F(ServerTest, SecondServerOnTheSamePortFails) {
  ServerOptions options;
  options.host = "127.0.0.1";
  options.port = server_->port();
  auto second = AttnServer::Start(options);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(second.status().message(),
            absl::StrCat("cannot listen on 127.0.0.1:", server_->port(),
                         " (address in use, or not an address of this host?)"));
}

TEST(ServerConnectionTest, ConnectionsAreClosedAfterTheirMaximumAge) {
  ServerOptions options;
  options.max_connection_age_seconds = 1;
  TestServer server(options);
  auto channel =
      grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  const auto check = [&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(10));
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    return stub->Check(&context, request, &response);
  };
  ASSERT_TRUE(check().ok());
  EXPECT_EQ(channel->GetState(false), GRPC_CHANNEL_READY);
  // After about a second (plus gRPC's 10% jitter) the server sends GOAWAY
  // and closes the idle connection; the channel goes back to IDLE.
  const auto deadline =
      std::chrono::system_clock::now() + std::chrono::seconds(8);
  while (channel->GetState(false) == GRPC_CHANNEL_READY &&
         std::chrono::system_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_NE(channel->GetState(false), GRPC_CHANNEL_READY);
  // A new call simply opens a new connection.
  EXPECT_TRUE(check().ok());
}

// The services a server lists through reflection, or the status of the
// reflection stream (`token`: sent as `authorization: Bearer <token>`).
absl::StatusOr<std::set<std::string>> ReflectedServices(
    const std::string& target, const std::string& token = "") {
  auto channel =
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  namespace reflection = attnserve::testing::reflection;
  using Request = reflection::ServerReflectionRequest;
  using Response = reflection::ServerReflectionResponse;
  const grpc::internal::RpcMethod method(
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      grpc::internal::RpcMethod::BIDI_STREAMING, channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(30));
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  std::unique_ptr<grpc::ClientReaderWriter<Request, Response>> stream(
      grpc::internal::ClientReaderWriterFactory<Request, Response>::Create(
          channel.get(), method, &context));
  Request request;
  request.set_list_services("");
  stream->Write(request);
  stream->WritesDone();
  Response response;
  std::set<std::string> names;
  while (stream->Read(&response)) {
    for (const auto& service : response.list_services_response().service()) {
      names.insert(service.name());
    }
  }
  const grpc::Status status = stream->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  return names;
}

TEST_F(ServerTest, ReflectionListsTheServices) {
  auto names = ReflectedServices(server_->target());
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_TRUE(names->count("attnserve.v1.AttentionService")) << names->size();
  EXPECT_TRUE(names->count("grpc.health.v1.Health"));
}

// Reflection tells only what the published proto files tell, so it answers
// without a token, like health checks; --reflection=false turns it off.
TEST(ServerReflectionTest, OpenWithTokensUnlessTurnedOff) {
  const std::string tokens = ::testing::TempDir() + "/reflection_test_tokens";
  std::ofstream(tokens) << "reflection-token\n";
  ServerOptions options;
  options.auth_token_file = tokens;
  TestServer guarded(options);
  auto names = ReflectedServices(guarded.target());
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_TRUE(names->count("attnserve.v1.AttentionService"));
  EXPECT_EQ(guarded.MakeClient().ListModels().status().code(),
            absl::StatusCode::kUnauthenticated);

  options.reflection = false;
  TestServer closed(options);
  for (const std::string token : {"", "reflection-token"}) {
    EXPECT_EQ(ReflectedServices(closed.target(), token).status().code(),
              absl::StatusCode::kUnimplemented)
        << token;
  }
  auto health = closed.MakeClient().Health("");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(ServerTest, ConcurrentCallsOfMixedShapesAreAllCorrect) {
  // Calls of three shapes from eight threads at once share the primitive
  // cache and the per-thread scratchpads.
  constexpr int kThreads = 8;
  constexpr int kCallsPerThread = 6;
  const Shape shapes[][3] = {{{2, 4, 9, 16}, {2, 4, 11, 16}, {2, 4, 11, 8}},
                             {{3, 17, 32}, {3, 5, 32}, {3, 5, 32}},
                             {{1, 2, 64, 64}, {1, 2, 64, 64}, {1, 2, 64, 64}}};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      for (int call = 0; call < kCallsPerThread; ++call) {
        const auto& shape = shapes[(t + call) % 3];
        Tensor q = RandomTensor(DType::kFloat32, shape[0], rng);
        Tensor k = RandomTensor(DType::kFloat32, shape[1], rng);
        Tensor v = RandomTensor(DType::kFloat32, shape[2], rng);
        v1::AttendRequest request;
        EncodeTensor(q.view(), request.mutable_query());
        EncodeTensor(k.view(), request.mutable_key());
        EncodeTensor(v.view(), request.mutable_value());
        request.set_causal(call % 2 == 1);
        auto response = client_.Attend(request);
        if (!response.ok()) {
          ++failures;
          continue;
        }
        auto output = CopyTensor(response->output(), "output");
        const RefAttentionResult ref =
            RefAttend(ToRef(q.view()), ToRef(k.view()), ToRef(v.view()), {}, {},
                      {call % 2 == 1, std::nullopt, std::nullopt});
        if (!output.ok() ||
            !AllClose(output->view(), ref.output, kFloat32Tolerance)) {
          ++failures;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_F(ServerTest, RepeatedShapesCreateNoPrimitives) {
  v1::MultiHeadAttendRequest mha = ValidMha();
  mha.set_causal(true);
  v1::AttendRequest attend = ValidAttend();
  attend.set_return_weights(true);
  v1::LayerNormRequest layer_norm = ValidLayerNorm();
  ASSERT_TRUE(client_.MultiHeadAttend(mha).ok());
  ASSERT_TRUE(client_.Attend(attend).ok());
  ASSERT_TRUE(client_.LayerNorm(layer_norm).ok());
  const int64_t created = PrimitiveCache::Global().creations();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(client_.MultiHeadAttend(mha).ok());
    ASSERT_TRUE(client_.Attend(attend).ok());
    ASSERT_TRUE(client_.LayerNorm(layer_norm).ok());
  }
  EXPECT_EQ(PrimitiveCache::Global().creations(), created);
}

TEST_F(ServerTest, ComputeBf16IsHonored) {
  std::mt19937 rng(23);
  Tensor q = RandomTensor(DType::kFloat32, {2, 40, 64}, rng);
  Tensor k = RandomTensor(DType::kFloat32, {2, 50, 64}, rng);
  Tensor v = RandomTensor(DType::kFloat32, {2, 50, 32}, rng);
  v1::AttendRequest request;
  EncodeTensor(q.view(), request.mutable_query());
  EncodeTensor(k.view(), request.mutable_key());
  EncodeTensor(v.view(), request.mutable_value());
  auto exact = client_.Attend(request);
  request.set_compute_bf16(true);
  auto fast = client_.Attend(request);
  ASSERT_TRUE(exact.ok() && fast.ok());
  EXPECT_EQ(fast->output().dtype(), v1::DATA_TYPE_FLOAT32);
  const RefAttentionResult ref =
      RefAttend(ToRef(q.view()), ToRef(k.view()), ToRef(v.view()), {}, {}, {});
  auto exact_out = CopyTensor(exact->output(), "output");
  auto fast_out = CopyTensor(fast->output(), "output");
  EXPECT_TRUE(AllClose(exact_out->view(), ref.output, kFloat32Tolerance));
  EXPECT_TRUE(AllClose(fast_out->view(), ref.output, kBFloat16Tolerance));
  // bfloat16 inputs cannot reproduce the float32 result to the last bit.
  EXPECT_NE(exact->output().raw_data(), fast->output().raw_data());
}

// BFLOAT16 inputs compute in float32 unless compute_bf16 is set: with a
// sharp softmax (scale 7.4) the float32 result, rounded to bfloat16, stays
// within float32's tolerance plus that rounding, where the bfloat16 kernels
// (their projections rounded to bfloat16) are far off.
TEST_F(ServerTest, Bfloat16InputsComputeInFloat32UnlessComputeBf16) {
  constexpr int64_t kE = 512;
  std::mt19937 rng(71);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x_values(2 * 16 * kE);
  for (float& v : x_values) v = normal(rng);
  const Tensor x =
      *Float32ToTensor(x_values.data(), {2, 16, kE}, DType::kBFloat16);
  v1::MultiHeadAttendRequest request;
  EncodeTensor(x.view(), request.mutable_query());
  v1::AttentionWeights* w = request.mutable_weights();
  w->set_num_heads(8);
  RefMultiHeadWeights ref_weights;
  ref_weights.num_heads = 8;
  const float w_std = 1.0f / std::sqrt(static_cast<float>(kE));
  const std::pair<v1::Tensor*, std::optional<RefTensor>*> projections[] = {
      {w->mutable_q_proj_weight(), &ref_weights.q_proj_weight},
      {w->mutable_k_proj_weight(), &ref_weights.k_proj_weight},
      {w->mutable_v_proj_weight(), &ref_weights.v_proj_weight},
      {w->mutable_out_proj_weight(), &ref_weights.out_proj_weight}};
  for (const auto& [field, ref] : projections) {
    std::vector<float> values(kE * kE);
    for (float& v : values) v = normal(rng) * w_std;
    const Tensor weight =
        *Float32ToTensor(values.data(), {kE, kE}, DType::kFloat32);
    EncodeTensor(weight.view(), field);
    *ref = ToRef(weight.view());
  }
  request.set_scale(7.4f);
  const RefTensor x_ref = ToRef(x.view());
  const RefTensor expected =
      RefMultiHeadAttend(ref_weights, x_ref, x_ref, x_ref, {}, {},
                         {false, 7.4, std::nullopt})
          .output;
  const auto max_error = [&](const Tensor& got) {
    const RefTensor values = ToRef(got.view());
    double worst = 0;
    for (size_t i = 0; i < values.values.size(); ++i) {
      worst = std::max(worst, std::abs(values.values[i] - expected.values[i]));
    }
    return worst;
  };

  auto float32 = client_.MultiHeadAttend(request);
  ASSERT_TRUE(float32.ok()) << float32.status();
  request.set_compute_bf16(true);
  auto bfloat16 = client_.MultiHeadAttend(request);
  ASSERT_TRUE(bfloat16.ok()) << bfloat16.status();
  auto float32_out = CopyTensor(float32->output(), "output");
  auto bfloat16_out = CopyTensor(bfloat16->output(), "output");
  ASSERT_TRUE(float32_out.ok() && bfloat16_out.ok());
  EXPECT_EQ(float32_out->dtype(), DType::kBFloat16);
  EXPECT_EQ(bfloat16_out->dtype(), DType::kBFloat16);
  // Half an ulp of bfloat16 is at most 2^-8 of the value.
  EXPECT_TRUE(AllClose(float32_out->view(), expected, {1e-4, 1e-4 + 0x1p-8}));
  EXPECT_GT(max_error(*bfloat16_out), 5 * max_error(*float32_out))
      << "float32 compute " << max_error(*float32_out) << ", compute_bf16 "
      << max_error(*bfloat16_out);
}

TEST(ServerOptionsTest, RejectsOutOfRangeFlags) {
  ServerOptions options;
  options.port = 70000;
  EXPECT_EQ(VerifyServerOptions(options).message(),
            "--port: 70000 is not in [0, 65535]");
  options = ServerOptions();
  options.max_message_mb = 0;
  EXPECT_EQ(VerifyServerOptions(options).message(),
            "--max_message_mb: 0 is not in [1, 2047] (protobuf messages are "
            "limited to 2 GiB)");
  options = ServerOptions();
  options.lame_duck_seconds = -1;
  EXPECT_EQ(VerifyServerOptions(options).message(),
            "--lame_duck_seconds: -1 is negative");
  options.lame_duck_seconds = 5;
  options.drain_seconds = 5;
  EXPECT_EQ(VerifyServerOptions(options).message(),
            "--lame_duck_seconds: 5 must be less than --drain_seconds (5), of "
            "which it is the first part, or 0");
  options.lame_duck_seconds = 0;
  options.drain_seconds = 0;
  EXPECT_TRUE(VerifyServerOptions(options).ok());
  options.max_connection_age_seconds = -1;
  EXPECT_EQ(VerifyServerOptions(options).message(),
            "--max_connection_age_seconds: -1 is negative");
  options = ServerOptions();
  options.session_file_version = 1;
  EXPECT_EQ(VerifyServerOptions(options).message(),
            "--session_file_version: 1 is out of range, expected 2 (every "
            "session whole) to 3 (forks over shared base files)");
  EXPECT_TRUE(VerifyServerOptions(ServerOptions()).ok());
}

TEST(ServerOptionsTest, LogLevelShowsItsSeverityAndAbove) {
  ServerOptions options;
  options.log_level = "info";
  EXPECT_TRUE(ShouldLog(options, LogSeverity::kInfo));
  EXPECT_TRUE(ShouldLog(options, LogSeverity::kWarning));
  options.log_level = "warning";
  EXPECT_FALSE(ShouldLog(options, LogSeverity::kInfo));
  EXPECT_TRUE(ShouldLog(options, LogSeverity::kWarning));
  EXPECT_TRUE(ShouldLog(options, LogSeverity::kError));
  options.log_level = "error";
  EXPECT_FALSE(ShouldLog(options, LogSeverity::kWarning));
  EXPECT_TRUE(ShouldLog(options, LogSeverity::kError));
}

}  // namespace
}  // namespace attnserve::testing
