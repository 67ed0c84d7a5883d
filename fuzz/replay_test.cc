// Replays a fuzz target's checked-in inputs in the ordinary builds (no
// libFuzzer): every file of fuzz/corpus/TARGET and fuzz/regressions/TARGET
// through the target's LLVMFuzzerTestOneInput, which aborts on what it
// deems a bug. The Release and sanitizer test runs thereby keep running
// every input that once crashed a target. The target and its folders come
// from the build (ATTNSERVE_FUZZ_TARGET, ATTNSERVE_FUZZ_CORPUS,
// ATTNSERVE_FUZZ_REGRESSIONS).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gtest/gtest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace attnserve::fuzz {
namespace {

namespace fs = std::filesystem;

// Runs every file of `dir` (none if it does not exist), in name order;
// returns how many.
int ReplayFolder(const fs::path& dir) {
  std::vector<fs::path> files;
  if (fs::is_directory(dir)) {
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.is_regular_file()) files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end());
  for (const fs::path& file : files) {
    // Named before it runs: a crash ends the test here.
    std::fprintf(stderr, "replaying %s\n", file.c_str());
    std::ifstream in(file, std::ios::binary);
    const std::string bytes(std::istreambuf_iterator<char>(in), {});
    EXPECT_TRUE(in.good() || in.eof()) << file;
    EXPECT_EQ(LLVMFuzzerTestOneInput(
                  reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()),
              0)
        << file;
  }
  return static_cast<int>(files.size());
}

TEST(FuzzReplay, Corpus) {
  EXPECT_GT(ReplayFolder(ATTNSERVE_FUZZ_CORPUS), 0)
      << "no seeds for " ATTNSERVE_FUZZ_TARGET " in " ATTNSERVE_FUZZ_CORPUS;
}

TEST(FuzzReplay, Regressions) { ReplayFolder(ATTNSERVE_FUZZ_REGRESSIONS); }

}  // namespace
}  // namespace attnserve::fuzz
