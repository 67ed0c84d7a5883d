// Every golden file, through the core and through a live server, within the
// tolerances of the goldens' README.
#include <filesystem>

#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

// Tolerance for a golden: bf16 files say so in their metadata.
Tolerance GoldenTolerance(const SafetensorsFile& file) {
  auto it = file.metadata.find("dtype");
  return it != file.metadata.end() && it->second == "bf16" ? kBFloat16Tolerance
                                                           : kFloat32Tolerance;
}

void ExpectMatchesGolden(const SafetensorsFile& file,
                         const NamedTensors& results) {
  for (const char* name : {"output", "weights"}) {
    const Tensor* expected = file.Find(std::string("expected_") + name);
    auto it = results.find(name);
    if (expected == nullptr) {
      EXPECT_EQ(it, results.end()) << name << " returned but not expected";
      continue;
    }
    ASSERT_NE(it, results.end()) << name << " missing from the results";
    const DType want_dtype =
        std::string(name) == "weights"
            ? DType::kFloat32
            : file.Find(file.Find("query") ? "query" : "input")->dtype();
    EXPECT_EQ(it->second.dtype(), want_dtype) << name;
    EXPECT_TRUE(AllClose(it->second.view(), ToRef(expected->view()),
                         GoldenTolerance(file)))
        << name;
  }
}

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

TEST_P(GoldenTest, ThroughCore) {
  auto file = ReadSafetensors(GetParam());
  ASSERT_TRUE(file.ok()) << file.status();
  auto results = RunGoldenThroughCore(*file);
  ASSERT_TRUE(results.ok()) << results.status();
  ExpectMatchesGolden(*file, *results);
}

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

std::string CaseName(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = std::filesystem::path(info.param).stem().string();
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(Goldens, GoldenTest,
                         ::testing::ValuesIn(GoldenFiles()), CaseName);

// The folder must be there and hold the cases: a missing folder would
// otherwise make the suite above silently empty.
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
                                        "layer_norm"}));
}

}  // namespace
}  // namespace attnserve::testing
