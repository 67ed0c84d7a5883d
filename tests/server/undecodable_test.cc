// Requests whose bytes do not parse as their RPC's message, sent through a
// live server as raw bytes: every RPC answers INVALID_ARGUMENT naming the
// byte count and the message type, counts the call in the metrics, and
// serves the next valid call; authentication still comes first.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "client/shared_memory.h"
#include "core/safetensors.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "inference/grpc_service.grpc.pb.h"
#include "proto/tensor_codec.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

namespace fs = std::filesystem;

// One RPC: a valid request, and the bytes inside it that the truncated
// request cuts through (a tensor's raw_data, or a string).
struct RpcCase {
  std::string rpc;  // "Attend"
  std::unique_ptr<google::protobuf::Message> request;
  std::string payload;
};

template <typename Request>
RpcCase Case(const std::string& rpc, const Request& request,
             const std::string& payload) {
  return {rpc, std::make_unique<Request>(request), payload};
}

// A valid request of every RPC, in an order in which each succeeds on a
// server that serves the model "mha" (E=16), maps `shm` as the region named
// "r" once RegisterSharedMemory ran, and holds the decode session
// `session_id` of the model "mha".
std::vector<RpcCase> EveryRpc(const SharedMemoryBuffer& shm,
                              const std::string& session_id = "s") {
  std::mt19937 rng(7);
  std::vector<RpcCase> cases;
  v1::AttendRequest attend;
  *attend.mutable_query() = RandomWireTensor(DType::kFloat32, {2, 3, 8}, rng);
  *attend.mutable_key() = RandomWireTensor(DType::kFloat32, {2, 5, 8}, rng);
  *attend.mutable_value() = RandomWireTensor(DType::kFloat32, {2, 5, 4}, rng);
  cases.push_back(Case("Attend", attend, attend.key().raw_data()));
  v1::MultiHeadAttendRequest multi_head;
  multi_head.set_model("mha");
  *multi_head.mutable_query() =
      RandomWireTensor(DType::kFloat32, {2, 5, 16}, rng);
  cases.push_back(
      Case("MultiHeadAttend", multi_head, multi_head.query().raw_data()));
  v1::LayerNormRequest layer_norm;
  *layer_norm.mutable_input() = RandomWireTensor(DType::kFloat32, {4, 6}, rng);
  cases.push_back(Case("LayerNorm", layer_norm, layer_norm.input().raw_data()));
  v1::RmsNormRequest rms_norm;
  *rms_norm.mutable_input() = RandomWireTensor(DType::kFloat32, {4, 6}, rng);
  cases.push_back(Case("RmsNorm", rms_norm, rms_norm.input().raw_data()));
  // Its request has no field: an unknown one to cut through (a valid
  // request keeps it as an unknown field).
  v1::ListModelsRequest list_models;
  list_models.GetReflection()
      ->MutableUnknownFields(&list_models)
      ->AddLengthDelimited(1, "future field");
  cases.push_back(Case("ListModels", list_models, "future field"));
  v1::GetModelMetadataRequest metadata;
  metadata.set_name("mha");
  cases.push_back(Case("GetModelMetadata", metadata, "mha"));
  v1::RegisterSharedMemoryRequest register_region;
  register_region.mutable_region()->set_name("r");
  register_region.mutable_region()->set_key(shm.key());
  register_region.mutable_region()->set_byte_size(shm.size());
  cases.push_back(Case("RegisterSharedMemory", register_region, shm.key()));
  v1::ListSharedMemoryRequest list_regions;
  list_regions.set_name("r");
  cases.push_back(Case("ListSharedMemory", list_regions, "r"));
  v1::UnregisterSharedMemoryRequest unregister;
  unregister.set_name("r");
  cases.push_back(Case("UnregisterSharedMemory", unregister, "r"));
  v1::CreateSessionRequest create_session;
  create_session.set_model("mha");
  cases.push_back(Case("CreateSession", create_session, "mha"));
  v1::SessionStepRequest step;
  step.set_session_id(session_id);
  *step.mutable_input() = RandomWireTensor(DType::kFloat32, {1, 3, 16}, rng);
  cases.push_back(Case("SessionStep", step, step.input().raw_data()));
  v1::SessionStepsRequest steps;
  *steps.add_steps() = step;
  cases.push_back(
      Case("SessionSteps", steps, steps.steps(0).input().raw_data()));
  // A small session's file, in one chunk; and an import's first bytes.
  v1::ExportSessionRequest export_session;
  export_session.set_session_id(session_id);
  cases.push_back(Case("ExportSession", export_session, session_id));
  v1::ImportSessionChunk import_session;
  import_session.set_data("ATTNSESS");
  cases.push_back(Case("ImportSession", import_session, "ATTNSESS"));
  // Before DeleteSession, whose valid call deletes the session.
  v1::ForkSessionRequest fork_session;
  fork_session.set_session_id(session_id);
  fork_session.set_length(1);
  cases.push_back(Case("ForkSession", fork_session, session_id));
  // The valid call saves the session to --session_dir; DeleteSession then
  // removes its file.
  v1::HandOverSessionRequest hand_over;
  hand_over.set_session_id(session_id);
  cases.push_back(Case("HandOverSession", hand_over, session_id));
  v1::DeleteSessionRequest delete_session;
  delete_session.set_session_id(session_id);
  cases.push_back(Case("DeleteSession", delete_session, session_id));
  return cases;
}

// Bytes that do not parse as `c`'s request: garbage, the valid request cut
// in the middle of its payload, and field 1 with a wire type that cannot
// stand there.
std::vector<std::string> Undecodable(const RpcCase& c) {
  const std::string valid = c.request->SerializeAsString();
  const size_t payload = valid.find(c.payload);
  EXPECT_NE(payload, std::string::npos) << c.rpc;
  return {
      "\xff\xff\xff",
      valid.substr(0, payload + c.payload.size() / 2),
      // Wire type 4, the end of a group, outside any group.
      valid + std::string("\x0c", 1),
      // Wire type 7 does not exist.
      std::string("\x0f\x01", 2) + valid,
  };
}

// Calls the RPCs of a service (attnserve.v1.AttentionService unless told)
// with any bytes as their request.
class RawClient {
 public:
  explicit RawClient(
      const std::string& target,
      std::string service = v1::AttentionService::service_full_name())
      : stub_(grpc::CreateChannel(target, grpc::InsecureChannelCredentials())),
        service_(std::move(service)) {}

  // `rpc` with `bytes` as its request, and `token` (if any) as its bearer
  // token; `response` (if given) receives the response's bytes.
  grpc::Status Call(const std::string& rpc, const std::string& bytes,
                    const std::string& token = "",
                    std::string* response = nullptr) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(60));
    if (!token.empty()) {
      context.AddMetadata("authorization", "Bearer " + token);
    }
    grpc::Slice slice(bytes);
    const grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer reply;
    std::promise<grpc::Status> done;
    stub_.UnaryCall(&context, absl::StrCat("/", service_, "/", rpc), {},
                    &request, &reply,
                    [&done](grpc::Status status) { done.set_value(status); });
    const grpc::Status status = done.get_future().get();
    if (response != nullptr && status.ok()) {
      std::vector<grpc::Slice> slices;
      EXPECT_TRUE(reply.Dump(&slices).ok());
      response->clear();
      for (const grpc::Slice& s : slices) {
        response->append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    return status;
  }

 private:
  grpc::GenericStub stub_;
  const std::string service_;
};

std::string ParseError(const RpcCase& c, const std::string& bytes) {
  return absl::StrCat("request: could not parse ", bytes.size(), " bytes as ",
                      c.request->GetDescriptor()->full_name());
}

// The Open Inference Protocol's unary RPCs (Triton's extensions among
// them) likewise; the valid empty request of each is answered (its own
// answer or error), and the server goes on.
TEST(UndecodableTest, EveryOpenInferenceRpcAnswersInvalidArgument) {
  TestServer server;
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          inference::GRPCInferenceService::service_full_name());
  ASSERT_NE(service, nullptr);
  RawClient client(server.target(), service->full_name());
  int unary = 0;
  for (int i = 0; i < service->method_count(); ++i) {
    const google::protobuf::MethodDescriptor* method = service->method(i);
    if (method->client_streaming() || method->server_streaming()) continue;
    ++unary;
    SCOPED_TRACE(method->name());
    for (const std::string& bytes :
         {std::string("\xff\xff\xff"), std::string("\x0f\x01", 2)}) {
      const grpc::Status status = client.Call(method->name(), bytes);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_EQ(status.error_message(),
                absl::StrCat("request: could not parse ", bytes.size(),
                             " bytes as ", method->input_type()->full_name()));
    }
    // The empty request: any answer but a broken call.
    const grpc::Status valid = client.Call(method->name(), "");
    EXPECT_NE(valid.error_code(), grpc::StatusCode::INTERNAL)
        << valid.error_message();
    EXPECT_NE(valid.error_code(), grpc::StatusCode::UNAVAILABLE)
        << valid.error_message();
  }
  // Every unary RPC, the trace and log settings included.
  EXPECT_EQ(unary, 19);
  std::string reply;
  ASSERT_TRUE(client.Call("LogSettings", "", "", &reply).ok());
  inference::LogSettingsResponse log;
  ASSERT_TRUE(log.ParseFromString(reply));
  EXPECT_TRUE(log.settings().at("log_info").bool_param());
}

TEST(UndecodableTest, EveryRpcAnswersInvalidArgumentAndServesTheNextCall) {
  TempModelRepository repo("undecodable");
  ServerOptions options;
  options.model_repository = repo.root();
  const std::filesystem::path session_dir =
      std::filesystem::temp_directory_path() /
      absl::StrCat("attnserve_undecodable_sessions_", ::getpid());
  options.session_dir = session_dir.string();
  // Removed once the server has stopped: while it runs, its journal thread
  // may be writing a file there.
  absl::Cleanup remove_session_dir = [&session_dir] {
    std::error_code ignored;
    std::filesystem::remove_all(session_dir, ignored);
  };
  TestServer server(options);
  ASSERT_GT(server.metrics_port(), 0);
  auto shm =
      SharedMemoryBuffer::Create(UniqueSharedMemoryKey("undecodable"), 4096);
  ASSERT_TRUE(shm.ok()) << shm.status();

  v1::CreateSessionRequest create_session;
  create_session.set_model("mha");
  auto session = server.MakeClient().CreateSession(create_session);
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<RpcCase> cases = EveryRpc(**shm, session->session_id());
  // Every RPC of the service, with its request type.
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          v1::AttentionService::service_full_name());
  ASSERT_NE(service, nullptr);
  ASSERT_EQ(cases.size(), static_cast<size_t>(service->method_count()));
  for (const RpcCase& c : cases) {
    const google::protobuf::MethodDescriptor* method =
        service->FindMethodByName(c.rpc);
    ASSERT_NE(method, nullptr) << c.rpc;
    EXPECT_EQ(method->input_type(), c.request->GetDescriptor()) << c.rpc;
  }
  RawClient client(server.target());
  for (const RpcCase& c : cases) {
    SCOPED_TRACE(c.rpc);
    for (const std::string& bytes : Undecodable(c)) {
      // The premise: these bytes are not such a message.
      std::unique_ptr<google::protobuf::Message> parsed(c.request->New());
      ASSERT_FALSE(parsed->ParseFromString(bytes));
      const grpc::Status status = client.Call(c.rpc, bytes);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_EQ(status.error_message(), ParseError(c, bytes));
    }
    std::string reply;
    const grpc::Status valid =
        client.Call(c.rpc, c.request->SerializeAsString(), "", &reply);
    EXPECT_TRUE(valid.ok()) << valid.error_message();
  }

  httplib::Client http("127.0.0.1", server.metrics_port());
  auto page = http.Get("/metrics");
  ASSERT_TRUE(page) << "GET /metrics failed";
  for (const RpcCase& c : cases) {
    const std::string line = absl::StrCat(
        "attnserve_requests_total{rpc=\"", c.rpc,
        "\",code=\"INVALID_ARGUMENT\"} ", Undecodable(c).size(), "\n");
    EXPECT_NE(page->body.find(line), std::string::npos)
        << "missing: " << line << page->body;
  }
  // The compute RPCs count their valid calls too.
  for (const char* rpc : {"Attend", "MultiHeadAttend", "LayerNorm",
                          "SessionStep", "SessionSteps"}) {
    const std::string line = absl::StrCat("attnserve_requests_total{rpc=\"",
                                          rpc, "\",code=\"OK\"} 1\n");
    EXPECT_NE(page->body.find(line), std::string::npos)
        << "missing: " << line << page->body;
  }
}

// A compute result over the raw path is the one the typed client gets.
TEST(UndecodableTest, ValidBytesGetTheTypedClientsAnswer) {
  TestServer server;
  std::mt19937 rng(11);
  v1::LayerNormRequest request;
  *request.mutable_input() = RandomWireTensor(DType::kFloat32, {3, 10}, rng);
  std::string bytes;
  ASSERT_TRUE(RawClient(server.target())
                  .Call("LayerNorm", request.SerializeAsString(), "", &bytes)
                  .ok());
  v1::LayerNormResponse raw;
  ASSERT_TRUE(raw.ParseFromString(bytes));
  auto typed = server.MakeClient().LayerNorm(request);
  ASSERT_TRUE(typed.ok()) << typed.status();
  EXPECT_EQ(raw.output().raw_data(), typed->output().raw_data());
  EXPECT_EQ(raw.output().raw_data().size(), 30 * sizeof(float));
}

TEST(UndecodableTest, AuthenticationComesFirst) {
  const std::string tokens =
      absl::StrCat(::testing::TempDir(), "/undecodable_tokens_", ::getpid());
  std::ofstream(tokens) << "secret\n";
  absl::Cleanup remove_tokens = [&tokens] { std::remove(tokens.c_str()); };
  ServerOptions options;
  options.auth_token_file = tokens;
  TestServer server(options);
  auto shm =
      SharedMemoryBuffer::Create(UniqueSharedMemoryKey("undecodable"), 4096);
  ASSERT_TRUE(shm.ok()) << shm.status();
  RawClient client(server.target());
  for (const RpcCase& c : EveryRpc(**shm)) {
    SCOPED_TRACE(c.rpc);
    const grpc::Status anonymous = client.Call(c.rpc, "\xff\xff");
    EXPECT_EQ(anonymous.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(anonymous.error_message(),
              "authorization: missing, expected 'Bearer <token>'");
    const grpc::Status wrong = client.Call(c.rpc, "\xff\xff", "not-the-token");
    EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    const grpc::Status with_token = client.Call(c.rpc, "\xff\xff", "secret");
    EXPECT_EQ(with_token.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(with_token.error_message(), ParseError(c, "\xff\xff"));
  }
}

}  // namespace
}  // namespace attnserve::testing
