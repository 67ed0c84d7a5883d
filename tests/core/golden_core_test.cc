// Every golden file through the core alone, within the tolerances of the
// goldens' README; golden_test runs the same files through a live server.
#include <set>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "gtest/gtest.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {
namespace {

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, ThroughCore) {
  auto file = ReadSafetensors(GetParam());
  ASSERT_TRUE(file.ok()) << file.status();
  auto results = RunGoldenThroughCore(*file);
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

// The folder must be there and hold the cases: a missing folder would
// otherwise make the suites of the goldens silently empty.
TEST(GoldenFilesTest, FolderHoldsEveryOperation) {
  const std::vector<std::string> files = GoldenFiles();
  ASSERT_GE(files.size(), 3u) << "no golden files in " << GoldensDir();
  std::set<std::string> ops;
  for (const std::string& path : files) {
    auto file = ReadSafetensors(path);
    ASSERT_TRUE(file.ok()) << file.status();
    ops.insert(file->metadata.at("op"));
  }
  EXPECT_EQ(ops, (std::set<std::string>{"attend", "multi_head_attend",
                                        "layer_norm", "rms_norm"}));
}

}  // namespace
}  // namespace attnserve::testing
