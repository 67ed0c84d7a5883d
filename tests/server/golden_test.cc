// Every golden file through a live server, by value and through shared
// memory, within the tolerances of the goldens' README; golden_core_test
// runs the same files through the core alone.
#include <string>

#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

class GoldenTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() { server_ = new TestServer(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static TestServer* server_;
};
TestServer* GoldenTest::server_ = nullptr;

TEST_P(GoldenTest, ThroughServer) {
  auto file = ReadSafetensors(GetParam());
  ASSERT_TRUE(file.ok()) << file.status();
  AttnClient client = server_->MakeClient();
  auto results = RunGoldenThroughClient(client, *file);
  ASSERT_TRUE(results.ok()) << results.status();
  ExpectMatchesGolden(*file, *results);
}

TEST_P(GoldenTest, ThroughSharedMemory) {
  auto file = ReadSafetensors(GetParam());
  ASSERT_TRUE(file.ok()) << file.status();
  AttnClient client = server_->MakeClient();
  auto results = RunGoldenThroughClient(client, *file, /*shared_memory=*/true);
  ASSERT_TRUE(results.ok()) << results.status();
  ExpectMatchesGolden(*file, *results);
}

INSTANTIATE_TEST_SUITE_P(Goldens, GoldenTest,
                         ::testing::ValuesIn(GoldenFiles()), GoldenCaseName);
// An independent set's files too, when its folder is there (see
// SharedGoldenFiles); none otherwise.
INSTANTIATE_TEST_SUITE_P(SharedGoldens, GoldenTest,
                         ::testing::ValuesIn(SharedGoldenFiles()),
                         GoldenCaseName);

}  // namespace
}  // namespace attnserve::testing
