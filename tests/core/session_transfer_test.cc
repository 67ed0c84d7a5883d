// Session transfer between stores (SessionStore::ExportSession,
// ImportBytes): a session read from one store piece by piece and taken in
// by another, cut short and resumed, steps bit for bit as the original;
// imports are counted in the budget from their header on, refuse steps
// until complete, and go when deleted or abandoned.
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/decode_session.h"
#include "core/session_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kHeads = 2;
constexpr int64_t kDim = 64;

std::unique_ptr<DecodeSession> NewSession(int layers = 2) {
  DecodeSessionConfig config;
  config.num_heads = kHeads;
  config.key_dim = kDim;
  config.max_length = 4096;
  config.num_layers = layers;
  return *DecodeSession::Create(config);
}

// One step of `n` tokens of `layer` with inputs drawn from `rng` (seeded
// alike, two stores get the same inputs); its output in `out`.
absl::Status StepTokens(SessionStore& store, const std::string& id, int64_t n,
                        int64_t layer, std::mt19937 rng,
                        std::optional<Tensor>* out = nullptr) {
  Tensor q = RandomTensor(DType::kFloat32, {1, kHeads, n, kDim}, rng);
  Tensor k = RandomTensor(DType::kFloat32, {1, kHeads, n, kDim}, rng);
  Tensor v = RandomTensor(DType::kFloat32, {1, kHeads, n, kDim}, rng);
  DecodeStepInputs in;
  in.query = q.view();
  in.key = k.view();
  in.value = v.view();
  in.layer = static_cast<int32_t>(layer);
  TensorResults results;
  absl::Status status = store.Step(id, in, {}, results, nullptr);
  if (out != nullptr) *out = results.Take("output");
  return status;
}

// The whole export of `id`, read in pieces of `piece` bytes.
std::string ExportAll(SessionStore& store, const std::string& id,
                      size_t piece = 100000) {
  auto exported = store.ExportSession(id);
  EXPECT_TRUE(exported.ok()) << exported.status();
  std::string file;
  while (file.size() < exported->image.size()) {
    auto got = exported->image.Read(file.size(), piece);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) break;
    file.append(got->data(), got->size());
  }
  return file;
}

// A store holding one session of two layers (1100 and 300 tokens).
struct Source {
  SessionStore store{SessionStore::Options{}};
  std::string id;
  Source() {
    id = *store.Add(NewSession());
    EXPECT_TRUE(StepTokens(store, id, 1100, 0, std::mt19937(1)).ok());
    EXPECT_TRUE(StepTokens(store, id, 300, 1, std::mt19937(2)).ok());
  }
};

void ExpectSameNextSteps(SessionStore& a, SessionStore& b,
                         const std::string& id) {
  for (int64_t layer = 0; layer < 2; ++layer) {
    std::optional<Tensor> want, got;
    ASSERT_TRUE(StepTokens(a, id, 2, layer, std::mt19937(7), &want).ok());
    ASSERT_TRUE(StepTokens(b, id, 2, layer, std::mt19937(7), &got).ok());
    ASSERT_EQ(want->num_bytes(), got->num_bytes());
    EXPECT_EQ(std::memcmp(want->data(), got->data(), want->num_bytes()), 0);
  }
}

TEST(SessionTransferTest, AnImportCutShortResumesAndStepsAsTheOriginal) {
  Source source;
  const std::string file = ExportAll(source.store, source.id);
  SessionStore target(SessionStore::Options{});
  // A first stream ends a third of the way in.
  SessionStore::Import first;
  const size_t cut = file.size() / 3;
  for (size_t at = 0; at < cut; at += 50000) {
    ASSERT_TRUE(target
                    .ImportBytes(first, at,
                                 absl::string_view(file).substr(
                                     at, std::min<size_t>(50000, cut - at)))
                    .ok());
  }
  EXPECT_EQ(first.id, source.id);
  EXPECT_EQ(first.received, cut);
  EXPECT_EQ(first.size, file.size());
  EXPECT_FALSE(first.complete);
  target.EndImport(first);
  // Steps wait for it; its memory is counted already.
  const absl::Status early = StepTokens(target, source.id, 1, 0, {});
  EXPECT_EQ(early.code(), absl::StatusCode::kUnavailable) << early;
  EXPECT_THAT(std::string(early.message()), HasSubstr("being imported"));
  EXPECT_EQ(target.stats().importing, 1);
  EXPECT_GE(target.stats().budget_bytes, source.store.stats().cache_bytes);
  // A second stream resumes it: from the wrong offset, then the right one.
  SessionStore::Import second;
  second.id = source.id;
  const absl::Status wrong =
      target.ImportBytes(second, 0, absl::string_view(file).substr(0, 10));
  EXPECT_EQ(wrong.code(), absl::StatusCode::kFailedPrecondition) << wrong;
  EXPECT_THAT(std::string(wrong.message()),
              HasSubstr(absl::StrCat("send it from offset ", cut)));
  ASSERT_TRUE(
      target.ImportBytes(second, cut, absl::string_view(file).substr(cut))
          .ok());
  EXPECT_TRUE(second.complete);
  EXPECT_EQ(second.lengths, (std::vector<int64_t>{1100, 300}));
  target.EndImport(second);
  EXPECT_EQ(target.stats().imported, 1);
  EXPECT_EQ(target.stats().importing, 0);
  EXPECT_EQ(target.stats().budget_bytes, source.store.stats().budget_bytes);
  // The imported session exports to the same file, and steps alike.
  EXPECT_TRUE(ExportAll(target, source.id, 4096) == file);
  ExpectSameNextSteps(source.store, target, source.id);
}

TEST(SessionTransferTest, AnExportReadAfterAStepIsAborted) {
  Source source;
  auto exported = source.store.ExportSession(source.id);
  ASSERT_TRUE(exported.ok());
  ASSERT_TRUE(exported->image.Read(0, 10).ok());
  ASSERT_TRUE(StepTokens(source.store, source.id, 1, 0, {}).ok());
  EXPECT_EQ(exported->image.Read(10000, 10).status().code(),
            absl::StatusCode::kAborted);
  // Deleted meanwhile, the session's memory stays while the export holds
  // it; its reads still see the session as it was.
  auto fresh = source.store.ExportSession(source.id);
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE(source.store.Delete(source.id).ok());
  EXPECT_TRUE(fresh->image.Read(fresh->image.size() - 1, 1).ok());
  EXPECT_EQ(source.store.ExportSession(source.id).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(SessionTransferTest, ImportsAreRefusedWhereTheyCannotBe) {
  Source source;
  const std::string file = ExportAll(source.store, source.id);
  // The id is open in the target.
  {
    SessionStore::Import import;
    const absl::Status open = source.store.ImportBytes(import, 0, file);
    EXPECT_EQ(open.code(), absl::StatusCode::kAlreadyExists) << open;
    EXPECT_THAT(std::string(open.message()), HasSubstr("is open here"));
  }
  // A budget too small for it, though its header alone fits.
  {
    SessionStore::Options small;
    small.max_bytes = source.store.stats().budget_bytes / 2;
    SessionStore target(small);
    SessionStore::Import import;
    const absl::Status full = target.ImportBytes(import, 0, file);
    EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
    EXPECT_EQ(target.stats().budget_bytes, 0u);
  }
  // A resume of an import that is not under way.
  {
    SessionStore target(SessionStore::Options{});
    SessionStore::Import import;
    import.id = source.id;
    const absl::Status none = target.ImportBytes(import, 100, "x");
    EXPECT_EQ(none.code(), absl::StatusCode::kNotFound) << none;
    EXPECT_THAT(std::string(none.message()), HasSubstr("from offset 0"));
  }
  // A corrupt block drops the import and its budget.
  {
    SessionStore target(SessionStore::Options{});
    std::string corrupt = file;
    corrupt[corrupt.size() / 2] ^= 1;
    SessionStore::Import import;
    const absl::Status lost = target.ImportBytes(import, 0, corrupt);
    EXPECT_EQ(lost.code(), absl::StatusCode::kDataLoss) << lost;
    EXPECT_EQ(target.stats().importing, 0);
    EXPECT_EQ(target.stats().budget_bytes, 0u);
  }
}

TEST(SessionTransferTest, AnImportGoesWhenDeletedOrAbandoned) {
  Source source;
  const std::string file = ExportAll(source.store, source.id);
  SessionStore::Options options;
  options.idle_timeout = absl::Minutes(1);
  SessionStore target(options);
  SessionStore::Import import;
  ASSERT_TRUE(target.ImportBytes(import, 0, file.substr(0, 1000)).ok());
  // Deleting the session drops the import under way: its stream's next
  // piece is refused.
  ASSERT_TRUE(target.Delete(source.id).ok());
  EXPECT_EQ(target.stats().budget_bytes, 0u);
  EXPECT_EQ(target.ImportBytes(import, 1000, file.substr(1000, 10)).code(),
            absl::StatusCode::kNotFound);
  target.EndImport(import);
  // An import no stream resumes goes after the idle timeout.
  SessionStore::Import again;
  ASSERT_TRUE(target.ImportBytes(again, 0, file.substr(0, 1000)).ok());
  target.EndImport(again);
  target.ExpireIdle(absl::Now());
  EXPECT_EQ(target.stats().importing, 1);
  target.ExpireIdle(absl::Now() + absl::Minutes(2));
  EXPECT_EQ(target.stats().importing, 0);
  EXPECT_EQ(target.stats().budget_bytes, 0u);
}

}  // namespace
}  // namespace attnserve::testing
