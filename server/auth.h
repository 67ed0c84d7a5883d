// Bearer-token authentication and TLS server credentials.
//
// Thread-safety: TokenAuthenticator is immutable after construction and may
// be used from any thread.
#ifndef ATTNSERVE_SERVER_AUTH_H_
#define ATTNSERVE_SERVER_AUTH_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"
#include "server/options.h"

namespace attnserve {

// Insecure credentials, or TLS (and mutual TLS) from the options' files.
// What this server presents when it calls a peer replica (a session's hand
// over): TLS with its own certificate, trusting --tls_client_ca (else its
// own certificate's issuer chain as given), when it serves TLS; plaintext
// otherwise.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> PeerCredentialsFor(
    const ServerOptions& options);

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const ServerOptions& options);

class TokenAuthenticator {
 public:
  // The longest token accepted, in the file and in a call. Longer ones are
  // refused with their size (UNAUTHENTICATED), not compared.
  static constexpr size_t kMaxTokenBytes = 4096;

  // Reads one token per line; blank lines and '#' comments are skipped.
  // Tokens are printable ASCII (spaces allowed inside), at most
  // kMaxTokenBytes each; INVALID_ARGUMENT naming the line otherwise.
  static absl::StatusOr<std::unique_ptr<TokenAuthenticator>> FromFile(
      const std::string& path);
  explicit TokenAuthenticator(std::vector<std::string> tokens);

  // OK if the call carries `authorization: Bearer <token>` with an accepted
  // token, else UNAUTHENTICATED. Tokens are compared in constant time, on
  // every byte and the length: a NUL ends nothing. A value with bytes
  // that are not printable ASCII, or a token over kMaxTokenBytes, is
  // refused before any comparison.
  absl::Status Check(const grpc::ServerContextBase& context) const;
  // The token this server sends when it calls a peer replica: the file's
  // first.
  const std::string& peer_token() const { return tokens_.front(); }
  // The same for the value of an `authorization` header (nullopt: none),
  // as HTTP requests carry it.
  absl::Status CheckAuthorization(
      std::optional<absl::string_view> authorization) const;

 private:
  std::vector<std::string> tokens_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_AUTH_H_
