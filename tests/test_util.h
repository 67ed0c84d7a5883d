// Helpers shared by the test suites: random tensors, comparisons against the
// float64 reference, the golden files and an in-process server.
#ifndef ATTNSERVE_TESTS_TEST_UTIL_H_
#define ATTNSERVE_TESTS_TEST_UTIL_H_

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/requests.h"
#include "core/safetensors.h"
#include "core/tensor.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "tests/reference.h"

namespace attnserve::testing {

// Floating tensors uniform in [-1, 1); BOOL/UINT8 tensors 1 with
// probability `keep`.
Tensor RandomTensor(DType dtype, Shape shape, std::mt19937& rng,
                    double keep = 0.7);

// Tolerances of the golden README: f32 1e-4 + 1e-4*|expected|, bf16 2e-2.
struct Tolerance {
  double atol;
  double rtol;
};
inline constexpr Tolerance kFloat32Tolerance{1e-4, 1e-4};
inline constexpr Tolerance kBFloat16Tolerance{2e-2, 2e-2};
inline constexpr Tolerance kFloat16Tolerance{5e-3, 5e-3};
Tolerance ToleranceFor(DType dtype);

// Passes if shapes match and every |got - expected| <= atol + rtol*|expected|;
// otherwise says how many elements differ and where the worst one is.
::testing::AssertionResult AllClose(const TensorView& got,
                                    const RefTensor& expected, Tolerance tol);

// The golden folder (ATTNSERVE_GOLDENS_DIR) and its *.safetensors files,
// sorted. Empty if the folder is missing.
std::string GoldensDir();
std::vector<std::string> GoldenFiles();

// A golden case run through the core directly: the tensors "output" and,
// when the file has expected weights, "weights".
absl::StatusOr<NamedTensors> RunGoldenThroughCore(const SafetensorsFile& file);
// The same through a server (`shared_memory`: tensors and results through a
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
  absl::Status ReloadModels() { return server_->ReloadModels(); }
  AttnServer& server() { return *server_; }
  std::string target() const;
  AttnClient MakeClient() const;

 private:
  std::unique_ptr<AttnServer> server_;
};

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_TEST_UTIL_H_
