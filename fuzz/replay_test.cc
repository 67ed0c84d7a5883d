// Replays a fuzz target's checked-in inputs in the ordinary builds (no
// libFuzzer): every file of fuzz/corpus/TARGET and fuzz/regressions/TARGET
// through the target's LLVMFuzzerTestOneInput, which aborts on what it
// deems a bug. The Release and sanitizer test runs thereby keep running
// every input that once crashed a target. Compiled once; each target's
// test links it with that target's entry point, and ctest passes its
// folders (--corpus=DIR --regressions=DIR).
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

// Set by main from the command line.
std::string* corpus_dir = nullptr;
std::string* regressions_dir = nullptr;

TEST(FuzzReplay, Corpus) {
  EXPECT_GT(ReplayFolder(*corpus_dir), 0) << "no seeds in " << *corpus_dir;
}

TEST(FuzzReplay, Regressions) { ReplayFolder(*regressions_dir); }

}  // namespace
}  // namespace attnserve::fuzz

// fuzz_TARGET_replay_test --corpus=DIR --regressions=DIR [gtest flags]
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::string corpus;
  std::string regressions;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--corpus=", 0) == 0) corpus = arg.substr(9);
    if (arg.rfind("--regressions=", 0) == 0) regressions = arg.substr(14);
  }
  if (corpus.empty() || regressions.empty()) {
    std::fprintf(stderr,
                 "usage: %s --corpus=DIR --regressions=DIR [gtest flags]\n",
                 argv[0]);
    return 2;
  }
  attnserve::fuzz::corpus_dir = &corpus;
  attnserve::fuzz::regressions_dir = &regressions;
  return RUN_ALL_TESTS();
}
