// Helpers of the suites that need the server or the client: the golden
// cases run through a client, an in-process server and a health watch. The
// wire and core helpers come with them (tests/wire_test_util.h,
// tests/core_test_util.h).
#ifndef ATTNSERVE_TESTS_TEST_UTIL_H_
#define ATTNSERVE_TESTS_TEST_UTIL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/requests.h"
#include "core/safetensors.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "server/server.h"
#include "tests/wire_test_util.h"

namespace attnserve::testing {

// A golden case run through a client and a server, as RunGoldenThroughCore
// runs it through the core (`shared_memory`: tensors and results through a
// shared-memory region).
absl::StatusOr<NamedTensors> RunGoldenThroughClient(AttnClient& client,
                                                    const SafetensorsFile& file,
                                                    bool shared_memory = false);

// An attnserve server on a free loopback port for the test's lifetime.
class TestServer {
 public:
  // On 127.0.0.1 and a free port, whatever `options` say of those.
  explicit TestServer(ServerOptions options = {});
  int port() const { return server_->port(); }
  int metrics_port() const { return server_->metrics_port(); }
  int http_port() const { return server_->http_port(); }
  absl::Status ReloadModels() { return server_->ReloadModels(); }
  AttnServer& server() { return *server_; }
  std::string target() const;
  AttnClient MakeClient() const;

 private:
  std::unique_ptr<AttnServer> server_;
};

// A health Watch of `target`'s attnserve.v1.AttentionService, as a load
// balancer keeps one; cancelled, and its channel closed, with the object.
// Thread-compatible.
class HealthWatch {
 public:
  // The watch ends at `deadline` from now at the latest.
  explicit HealthWatch(const std::string& target,
                       absl::Duration deadline = absl::Seconds(20));
  ~HealthWatch();
  // Reads the first update: true if it says SERVING.
  bool FirstSaysServing();
  // Reads updates until one says NOT_SERVING (true) or the watch ends
  // (false).
  bool WaitForNotServing();

 private:
  std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<
      grpc::ClientReaderInterface<grpc::health::v1::HealthCheckResponse>>
      watch_;
};

// A model repository folder holding "mha" (E=16, 4 heads, in_proj and
// out_proj weights from a fixed seed), removed with the object. `tag` keeps
// the folders of different suites apart.
class TempModelRepository {
 public:
  explicit TempModelRepository(const std::string& tag);
  ~TempModelRepository();
  const std::string& root() const { return root_; }

 private:
  std::string root_;
};

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_TEST_UTIL_H_
