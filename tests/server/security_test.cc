// TLS, mutual TLS and bearer tokens: who gets in and who is refused.
// Certificates are made with openssl when the suite starts.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

namespace fs = std::filesystem;

std::string ReadFile(const std::string& path) {
  std::ifstream stream(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(stream)),
                     std::istreambuf_iterator<char>());
}

// A CA, a server certificate for 127.0.0.1 and localhost, a client
// certificate from the same CA and one from an unrelated CA.
class Certificates {
 public:
  Certificates() {
    dir_ =
        (fs::temp_directory_path() / absl::StrCat("attnserve_tls_", ::getpid()))
            .string();
    fs::create_directories(dir_);
    const std::string d = dir_;
    const std::string script = absl::StrCat(
        "set -e; cd ", d, "\n",
        "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=test-ca "
        "-keyout ca.key -out ca.pem\n",
        "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=other-ca "
        "-keyout other.key -out other.pem\n",
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext\n",
        "openssl req -newkey rsa:2048 -nodes -subj /CN=localhost "
        "-keyout server.key -out server.csr\n",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key "
        "-CAcreateserial -days 2 -extfile san.ext -out server.pem\n",
        "openssl req -newkey rsa:2048 -nodes -subj /CN=client "
        "-keyout client.key -out client.csr\n",
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key "
        "-CAcreateserial -days 2 -out client.pem\n",
        "openssl req -newkey rsa:2048 -nodes -subj /CN=rogue "
        "-keyout rogue.key -out rogue.csr\n",
        "openssl x509 -req -in rogue.csr -CA other.pem -CAkey other.key "
        "-CAcreateserial -days 2 -out rogue.pem\n",
        "printf '# tokens\\nfirst-token\\n\\nsecond-token\\n' > tokens\n");
    ok_ = std::system(absl::StrCat("bash -c '", EscapeQuotes(script),
                                   "' > /dev/null 2>&1")
                          .c_str()) == 0;
  }
  ~Certificates() { fs::remove_all(dir_); }
  bool ok() const { return ok_; }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string pem(const std::string& name) const {
    return ReadFile(path(name));
  }

 private:
  static std::string EscapeQuotes(const std::string& s) {
    std::string out;
    for (char c : s) {
      if (c == '\'') {
        out += "'\\''";
      } else {
        out += c;
      }
    }
    return out;
  }
  std::string dir_;
  bool ok_ = false;
};

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { certs_ = new Certificates(); }
  static void TearDownTestSuite() { delete certs_; }
  void SetUp() override { ASSERT_TRUE(certs_->ok()) << "openssl failed"; }

  static absl::Status Call(const TestServer& server, ClientOptions options) {
    options.target = absl::StrCat("localhost:", server.port());
    options.timeout = absl::Seconds(10);
    AttnClient client(options);
    std::mt19937 rng(3);
    v1::LayerNormRequest request;
    *request.mutable_input() = RandomWireTensor(DType::kFloat32, {2, 4}, rng);
    return client.LayerNorm(request).status();
  }

  static ServerOptions Tls(bool mutual) {
    ServerOptions options;
    options.tls_cert = certs_->path("server.pem");
    options.tls_key = certs_->path("server.key");
    if (mutual) options.tls_client_ca = certs_->path("ca.pem");
    return options;
  }

  static Certificates* certs_;
};
Certificates* SecurityTest::certs_ = nullptr;

TEST_F(SecurityTest, TlsServesVerifyingClientsAndRefusesPlaintext) {
  TestServer server(Tls(/*mutual=*/false));
  ClientOptions tls;
  tls.tls_ca_pem = certs_->pem("ca.pem");
  EXPECT_TRUE(Call(server, tls).ok()) << Call(server, tls);
  EXPECT_EQ(Call(server, {}).code(), absl::StatusCode::kUnavailable);
  ClientOptions wrong_ca;
  wrong_ca.tls_ca_pem = certs_->pem("other.pem");
  EXPECT_EQ(Call(server, wrong_ca).code(), absl::StatusCode::kUnavailable);
}

TEST_F(SecurityTest, MutualTlsRequiresAClientCertificateFromTheCa) {
  TestServer server(Tls(/*mutual=*/true));
  ClientOptions no_cert;
  no_cert.tls_ca_pem = certs_->pem("ca.pem");
  EXPECT_EQ(Call(server, no_cert).code(), absl::StatusCode::kUnavailable);
  ClientOptions rogue = no_cert;
  rogue.tls_cert_pem = certs_->pem("rogue.pem");
  rogue.tls_key_pem = certs_->pem("rogue.key");
  EXPECT_EQ(Call(server, rogue).code(), absl::StatusCode::kUnavailable);
  ClientOptions good = no_cert;
  good.tls_cert_pem = certs_->pem("client.pem");
  good.tls_key_pem = certs_->pem("client.key");
  EXPECT_TRUE(Call(server, good).ok()) << Call(server, good);
}

TEST_F(SecurityTest, TokensGuardEveryRpcButHealth) {
  ServerOptions options;
  options.auth_token_file = certs_->path("tokens");
  TestServer server(options);
  absl::Status missing = Call(server, {});
  EXPECT_EQ(missing.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(missing.message(),
            "authorization: missing, expected 'Bearer <token>'");
  ClientOptions wrong;
  wrong.token = "first-tokex";
  EXPECT_EQ(Call(server, wrong).message(), "authorization: token not accepted");
  for (const char* token : {"first-token", "second-token"}) {
    ClientOptions right;
    right.token = token;
    EXPECT_TRUE(Call(server, right).ok()) << token;
  }
  // Model listing needs the token too; health checks do not.
  ClientOptions anonymous;
  anonymous.target = server.target();
  AttnClient client(anonymous);
  EXPECT_EQ(client.ListModels().status().code(),
            absl::StatusCode::kUnauthenticated);
  // So do the session transfer streams.
  EXPECT_EQ(client
                .ExportSession(
                    "0123", [](absl::string_view) { return absl::OkStatus(); })
                .code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(client.ImportSession("ATTNSESS").status().code(),
            absl::StatusCode::kUnauthenticated);
  auto health = client.Health("");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
}

// Tokens over the 4096 bytes a token may have get UNAUTHENTICATED with
// their size (they used to meet gRPC's 8 KiB header limit, which clients
// reported as RESOURCE_EXHAUSTED or a closed connection); headers over the
// server's 64 KiB still meet gRPC's limit, and the server goes on serving.
TEST_F(SecurityTest, OversizedTokensAreRefusedWithTheirSize) {
  ServerOptions options;
  options.auth_token_file = certs_->path("tokens");
  TestServer server(options);
  // Each call on a channel of its own: oversized metadata may end the
  // connection it came on (an HTTP/2 protocol error), failing the calls
  // that share it with "Broken pipe".
  const auto list = [&](const std::string& authorization) {
    grpc::ChannelArguments arguments;
    // Not gRPC's shared connection to the same address.
    arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto stub = v1::AttentionService::NewStub(grpc::CreateCustomChannel(
        server.target(), grpc::InsecureChannelCredentials(), arguments));
    grpc::ClientContext context;
    context.AddMetadata("authorization", authorization);
    v1::ListModelsResponse response;
    return stub->ListModels(&context, {}, &response);
  };
  for (const size_t size : {size_t{4097}, size_t{9000}, size_t{60000}}) {
    const grpc::Status status = list("Bearer " + std::string(size, 't'));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << size;
    EXPECT_EQ(status.error_message(),
              absl::StrCat("authorization: token of ", size,
                           " bytes, longer than the 4096 a token may have"));
  }
  const grpc::Status huge = list("Bearer " + std::string(200000, 't'));
  EXPECT_EQ(huge.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(huge.error_message(),
            "received initial metadata size exceeds limit");
  EXPECT_TRUE(list("Bearer first-token").ok());
  // A token is compared on every byte: one byte more is refused.
  EXPECT_EQ(list("Bearer first-token ").error_message(),
            "authorization: token not accepted");
}

TEST(ServerOptionsTest, TlsFlagsComeInPairs) {
  ServerOptions options;
  options.tls_cert = "cert.pem";
  EXPECT_EQ(VerifyServerOptions(options).message(),
            "--tls_cert and --tls_key: give both or neither");
  options = ServerOptions();
  options.tls_client_ca = "ca.pem";
  EXPECT_EQ(VerifyServerOptions(options).message(),
            "--tls_client_ca: needs --tls_cert and --tls_key");
}

}  // namespace
}  // namespace attnserve::testing
