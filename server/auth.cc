#include "server/auth.h"

#include <fstream>
#include <iterator>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/files.h"
#include "core/status_macros.h"
#include "grpcpp/security/server_credentials.h"

namespace attnserve {
namespace {

// Equal in time that depends only on the lengths, not on where they differ.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

// Bytes 0x20 to 0x7e: what an HTTP header value may carry as text. A NUL
// or control byte in a token would otherwise be one more byte to compare,
// which clients that cut strings at a NUL get wrong.
bool IsPrintableAscii(absl::string_view s) {
  for (const char c : s) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte > 0x7e) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> PeerCredentialsFor(
    const ServerOptions& options) {
  if (options.tls_cert.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ATTN_ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                        ReadFileToString(options.tls_cert, "--tls_cert"));
  ATTN_ASSIGN_OR_RETURN(ssl.pem_private_key,
                        ReadFileToString(options.tls_key, "--tls_key"));
  ssl.pem_root_certs = ssl.pem_cert_chain;
  if (!options.tls_client_ca.empty()) {
    ATTN_ASSIGN_OR_RETURN(
        ssl.pem_root_certs,
        ReadFileToString(options.tls_client_ca, "--tls_client_ca"));
  }
  return grpc::SslCredentials(ssl);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const ServerOptions& options) {
  if (options.tls_cert.empty()) return grpc::InsecureServerCredentials();
  ATTN_ASSIGN_OR_RETURN(std::string cert,
                        ReadFileToString(options.tls_cert, "--tls_cert"));
  ATTN_ASSIGN_OR_RETURN(std::string key,
                        ReadFileToString(options.tls_key, "--tls_key"));
  grpc::SslServerCredentialsOptions ssl(
      options.tls_client_ca.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  if (!options.tls_client_ca.empty()) {
    ATTN_ASSIGN_OR_RETURN(
        ssl.pem_root_certs,
        ReadFileToString(options.tls_client_ca, "--tls_client_ca"));
  }
  ssl.pem_key_cert_pairs.push_back({key, cert});
  return grpc::SslServerCredentials(ssl);
}

absl::StatusOr<std::unique_ptr<TokenAuthenticator>>
TokenAuthenticator::FromFile(const std::string& path) {
  ATTN_ASSIGN_OR_RETURN(const std::string text,
                        ReadFileToString(path, "--auth_token_file"));
  std::vector<std::string> tokens;
  std::istringstream lines(text);
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    absl::string_view token = absl::StripAsciiWhitespace(line);
    if (token.empty() || token[0] == '#') continue;
    // A token no client can send, or one the server would refuse for its
    // size, is a mistake in the file.
    if (token.size() > kMaxTokenBytes || !IsPrintableAscii(token)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--auth_token_file: the token on line ", number, " of '", path,
          "' is ",
          token.size() > kMaxTokenBytes
              ? absl::StrCat(token.size(), " bytes, longer than the ",
                             kMaxTokenBytes, " a token may have")
              : std::string("not printable ASCII")));
    }
    tokens.emplace_back(token);
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_token_file: '", path, "' holds no token"));
  }
  return std::make_unique<TokenAuthenticator>(std::move(tokens));
}

TokenAuthenticator::TokenAuthenticator(std::vector<std::string> tokens)
    : tokens_(std::move(tokens)) {}

absl::Status TokenAuthenticator::Check(
    const grpc::ServerContextBase& context) const {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return CheckAuthorization(std::nullopt);
  return CheckAuthorization(
      absl::string_view(it->second.data(), it->second.size()));
}

absl::Status TokenAuthenticator::CheckAuthorization(
    std::optional<absl::string_view> authorization) const {
  if (!authorization.has_value()) {
    return absl::UnauthenticatedError(
        "authorization: missing, expected 'Bearer <token>'");
  }
  absl::string_view value = *authorization;
  if (!absl::ConsumePrefix(&value, "Bearer ")) {
    return absl::UnauthenticatedError(
        "authorization: expected 'Bearer <token>'");
  }
  if (value.size() > kMaxTokenBytes) {
    return absl::UnauthenticatedError(absl::StrCat(
        "authorization: token of ", value.size(), " bytes, longer than the ",
        kMaxTokenBytes, " a token may have"));
  }
  if (!IsPrintableAscii(value)) {
    return absl::UnauthenticatedError(
        "authorization: the token holds bytes that are not printable ASCII");
  }
  // Every token is compared, so the time does not tell which one matched.
  bool accepted = false;
  for (const std::string& token : tokens_) {
    accepted |= ConstantTimeEquals(value, token);
  }
  if (!accepted) {
    return absl::UnauthenticatedError("authorization: token not accepted");
  }
  return absl::OkStatus();
}

}  // namespace attnserve
