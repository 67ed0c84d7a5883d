// Bearer tokens: the token file's format, which `authorization` values get
// in and the exact refusals, and the TLS files the server reads.
#include "server/auth.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/server_context.h"
#include "grpcpp/test/server_context_test_spouse.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

constexpr auto kUnauthenticated = absl::StatusCode::kUnauthenticated;

// A file in the temporary folder, removed with the object; named after the
// test, since ctest runs tests side by side.
class TempFile {
 public:
  explicit TempFile(const std::string& contents) {
    const ::testing::TestInfo* test =
        ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = (std::filesystem::temp_directory_path() /
             absl::StrCat("attnserve_auth_", test->name(), "_", getpid()))
                .string();
    std::ofstream(path_, std::ios::binary) << contents;
  }
  ~TempFile() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Check() on a call whose metadata has `authorization: <value>` (none when
// `value` is null).
absl::Status CheckWith(const TokenAuthenticator& auth, const char* value) {
  grpc::ServerContext context;
  grpc::testing::ServerContextTestSpouse spouse(&context);
  if (value != nullptr) spouse.AddClientMetadata("authorization", value);
  return auth.Check(context);
}

TEST(TokenAuthenticatorTest, FileHoldsOneTokenPerLine) {
  TempFile file(
      "# accepted tokens\n"
      "first-token\n"
      "\n"
      "  second-token\t\r\n"
      "   # an indented comment\n"
      "third token with spaces\n"
      "last-without-newline");
  auto auth = TokenAuthenticator::FromFile(file.path());
  ASSERT_TRUE(auth.ok()) << auth.status();
  // Surrounding whitespace (CRLF files too) is not part of a token; inner
  // spaces are.
  for (const char* value :
       {"Bearer first-token", "Bearer second-token",
        "Bearer third token with spaces", "Bearer last-without-newline"}) {
    EXPECT_TRUE(CheckWith(**auth, value).ok()) << value;
  }
  // Comments are not tokens, nor is the whitespace around a token.
  for (const char* value :
       {"Bearer # accepted tokens", "Bearer # an indented comment",
        "Bearer   second-token", "Bearer "}) {
    const absl::Status status = CheckWith(**auth, value);
    EXPECT_EQ(status.code(), kUnauthenticated) << value;
    EXPECT_EQ(status.message(), "authorization: token not accepted") << value;
  }
  EXPECT_EQ(CheckWith(**auth, "Bearer   second-token\t").message(),
            "authorization: the token holds bytes that are not printable "
            "ASCII");
}

TEST(TokenAuthenticatorTest, FileWithoutTokensIsRefused) {
  TempFile file("# only a comment\n\n   \n");
  auto auth = TokenAuthenticator::FromFile(file.path());
  ASSERT_FALSE(auth.ok());
  EXPECT_EQ(auth.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      auth.status().message(),
      absl::StrCat("--auth_token_file: '", file.path(), "' holds no token"));
}

TEST(TokenAuthenticatorTest, MissingFileIsNotFound) {
  auto auth = TokenAuthenticator::FromFile("/nonexistent/tokens");
  ASSERT_FALSE(auth.ok());
  EXPECT_EQ(auth.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(auth.status().message(),
            "--auth_token_file: cannot open '/nonexistent/tokens' for reading");
}

TEST(TokenAuthenticatorTest, MissingOrMalformedAuthorization) {
  const TokenAuthenticator auth({"secret"});
  const absl::Status missing = CheckWith(auth, nullptr);
  EXPECT_EQ(missing.code(), kUnauthenticated);
  EXPECT_EQ(missing.message(),
            "authorization: missing, expected 'Bearer <token>'");
  // The scheme is "Bearer" and one space, exactly.
  for (const char* value : {"secret", "Basic secret", "bearer secret", "Bearer",
                            "Bearersecret", "", " Bearer secret"}) {
    const absl::Status status = CheckWith(auth, value);
    EXPECT_EQ(status.code(), kUnauthenticated) << value;
    EXPECT_EQ(status.message(), "authorization: expected 'Bearer <token>'")
        << value;
  }
}

TEST(TokenAuthenticatorTest, OnlyWholeTokensAreAccepted) {
  const TokenAuthenticator auth({"alpha-0123456789", "beta"});
  EXPECT_TRUE(CheckWith(auth, "Bearer alpha-0123456789").ok());
  EXPECT_TRUE(CheckWith(auth, "Bearer beta").ok());
  // The comparison covers every byte and the length: a prefix, an
  // extension, a different last or first byte, another case, or one token's
  // start with another's end are all refused.
  for (const char* value :
       {"Bearer alpha-012345678", "Bearer alpha-01234567890",
        "Bearer alpha-0123456788", "Bearer Alpha-0123456789",
        "Bearer ALPHA-0123456789", "Bearer bet", "Bearer betaa", "Bearer  beta",
        "Bearer beta ", "Bearer alpha-beta"}) {
    const absl::Status status = CheckWith(auth, value);
    EXPECT_EQ(status.code(), kUnauthenticated) << value;
    EXPECT_EQ(status.message(), "authorization: token not accepted") << value;
  }
}

// A NUL ends nothing: the token is every byte of the value.
TEST(TokenAuthenticatorTest, BytesAfterANulAreComparedToo) {
  const TokenAuthenticator auth({"secret"});
  const std::string nul_after("Bearer secret\0", 14);
  const std::string nul_and_more("Bearer secret\0admin", 19);
  for (const std::string& value : {nul_after, nul_and_more}) {
    grpc::ServerContext context;
    grpc::testing::ServerContextTestSpouse spouse(&context);
    spouse.AddClientMetadata("authorization", value);
    const absl::Status status = auth.Check(context);
    EXPECT_EQ(status.code(), kUnauthenticated);
    EXPECT_EQ(status.message(),
              "authorization: the token holds bytes that are not printable "
              "ASCII");
    EXPECT_EQ(auth.CheckAuthorization(value).message(), status.message());
  }
  for (const char* value : {"Bearer sec\x01ret", "Bearer secret\x7f",
                            "Bearer s\xc3\xa9"
                            "cret",
                            "Bearer secret\n"}) {
    EXPECT_EQ(CheckWith(auth, value).code(), kUnauthenticated) << value;
  }
  EXPECT_TRUE(CheckWith(auth, "Bearer secret").ok());
}

TEST(TokenAuthenticatorTest, TokensOverTheLimitAreRefusedWithTheirSize) {
  const std::string longest(TokenAuthenticator::kMaxTokenBytes, 'k');
  const TokenAuthenticator auth({longest});
  EXPECT_TRUE(auth.CheckAuthorization("Bearer " + longest).ok());
  const absl::Status status =
      auth.CheckAuthorization("Bearer " + longest + "k");
  EXPECT_EQ(status.code(), kUnauthenticated);
  EXPECT_EQ(status.message(),
            "authorization: token of 4097 bytes, longer than the 4096 a token "
            "may have");
}

TEST(TokenAuthenticatorTest, FileTokensAClientCannotSendAreRefused) {
  TempFile long_token("ok\n" + std::string(4097, 'k') + "\n");
  auto refused = TokenAuthenticator::FromFile(long_token.path());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(),
            absl::StrCat("--auth_token_file: the token on line 2 of '",
                         long_token.path(),
                         "' is 4097 bytes, longer than the 4096 a token may "
                         "have"));
  TempFile control("ok\n# comment\nse\x01cret\n");
  refused = TokenAuthenticator::FromFile(control.path());
  EXPECT_EQ(refused.status().message(),
            absl::StrCat("--auth_token_file: the token on line 3 of '",
                         control.path(), "' is not printable ASCII"));
}

TEST(TokenAuthenticatorTest, EachTokenIsComparedOnItsOwn) {
  // Same-length tokens: bytes that match different tokens at different
  // places make no token.
  const TokenAuthenticator auth({"aaaa", "bbbb", "cccc"});
  for (const char* value : {"Bearer aaaa", "Bearer bbbb", "Bearer cccc"}) {
    EXPECT_TRUE(CheckWith(auth, value).ok()) << value;
  }
  for (const char* value : {"Bearer abca", "Bearer aaab", "Bearer cccb"}) {
    const absl::Status status = CheckWith(auth, value);
    EXPECT_EQ(status.code(), kUnauthenticated) << value;
    EXPECT_EQ(status.message(), "authorization: token not accepted") << value;
  }
}

TEST(ServerCredentialsTest, PlaintextWithoutACertificate) {
  auto credentials = ServerCredentialsFor(ServerOptions{});
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  EXPECT_NE(*credentials, nullptr);
}

TEST(ServerCredentialsTest, UnreadableFilesNameTheirFlag) {
  TempFile pem("not checked until a handshake");
  ServerOptions options;
  options.tls_cert = "/nonexistent/cert.pem";
  options.tls_key = pem.path();
  auto no_cert = ServerCredentialsFor(options);
  EXPECT_EQ(no_cert.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(no_cert.status().message(),
            "--tls_cert: cannot open '/nonexistent/cert.pem' for reading");
  options.tls_cert = pem.path();
  options.tls_key = "/nonexistent/key.pem";
  auto no_key = ServerCredentialsFor(options);
  EXPECT_EQ(no_key.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(no_key.status().message(),
            "--tls_key: cannot open '/nonexistent/key.pem' for reading");
  options.tls_key = pem.path();
  options.tls_client_ca = "/nonexistent/ca.pem";
  auto no_ca = ServerCredentialsFor(options);
  EXPECT_EQ(no_ca.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(no_ca.status().message(),
            "--tls_client_ca: cannot open '/nonexistent/ca.pem' for reading");
}

}  // namespace
}  // namespace attnserve
