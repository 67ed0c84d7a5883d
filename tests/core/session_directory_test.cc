// Durable sessions (core/session_directory.h with SessionStore's
// directory): an evicted session is saved and taken back by its next step;
// SaveAll lets another store (another process sharing the directory) take
// every session up; the taken session answers its next steps bit for bit as
// one that never left; a deleted session's file goes; a corrupt, foreign
// or symlinked file is DATA_LOSS (or refused) for that session only and is
// quarantined; the directory keeps within its byte limit.
#include "core/session_directory.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/decode_session.h"
#include "core/session_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr int kHeads = 2;
constexpr int64_t kDim = 32;

std::unique_ptr<DecodeSession> NewSession() {
  DecodeSessionConfig config;
  config.num_heads = kHeads;
  config.key_dim = kDim;
  config.rotary.dims = 8;
  config.max_length = 4096;
  return *DecodeSession::Create(config);
}

// A step's inputs, drawn from `seed`.
struct StepInputs {
  explicit StepInputs(int64_t n, unsigned seed) {
    std::mt19937 rng(seed);
    q = RandomTensor(DType::kFloat32, {1, kHeads, n, kDim}, rng);
    k = RandomTensor(DType::kFloat32, {1, kHeads, n, kDim}, rng);
    v = RandomTensor(DType::kFloat32, {1, kHeads, n, kDim}, rng);
  }
  Tensor q, k, v;
};

absl::StatusOr<Tensor> Step(SessionStore& store, const std::string& id,
                            int64_t n, unsigned seed,
                            std::optional<int64_t> position = std::nullopt) {
  const StepInputs data(n, seed);
  DecodeStepInputs in;
  in.query = data.q.view();
  in.key = data.k.view();
  in.value = data.v.view();
  in.position = position;
  TensorResults results;
  int64_t length = 0;
  const absl::Status status = store.Step(id, in, {}, results, &length);
  if (!status.ok()) return status;
  return *results.Take("output");
}

bool SameBits(const Tensor& a, const Tensor& b) {
  return a.num_bytes() == b.num_bytes() &&
         std::memcmp(a.data(), b.data(), a.num_bytes()) == 0;
}

class SessionDirectoryTest : public ::testing::Test {
 protected:
  SessionDirectoryTest() {
    path_ = fs::path(::testing::TempDir()) /
            absl::StrCat("sessions-", ::getpid(), "-", counter_++);
    fs::remove_all(path_);
  }
  ~SessionDirectoryTest() override { fs::remove_all(path_); }

  std::unique_ptr<SessionDirectory> OpenDirectory(uint64_t max_bytes = 0) {
    auto directory =
        SessionDirectory::Open({.path = path_.string(),
                                .max_bytes = max_bytes,
                                .max_file_bytes = uint64_t{1} << 30});
    EXPECT_TRUE(directory.ok()) << directory.status();
    return std::move(*directory);
  }
  static SessionStore::Options StoreOptions(SessionDirectory* directory) {
    SessionStore::Options options;
    options.idle_timeout = absl::InfiniteDuration();
    options.directory = directory;
    return options;
  }
  fs::path FileOf(const std::string& id) const {
    return path_ / (id + ".session");
  }
  // The reference: a session that never left, stepped the same way.
  std::string Reference(SessionStore& store) {
    return *store.Add(NewSession());
  }

  static inline int counter_ = 0;
  fs::path path_;
};

TEST_F(SessionDirectoryTest, AnEvictedSessionIsSavedAndTakenBackByItsStep) {
  auto directory = OpenDirectory();
  SessionStore::Options options = StoreOptions(directory.get());
  options.max_sessions = 1;
  SessionStore store(options);
  SessionStore reference_store(StoreOptions(nullptr));
  const std::string reference = Reference(reference_store);

  const std::string id = *store.Add(NewSession());
  ASSERT_TRUE(Step(store, id, 700, 1).ok());
  ASSERT_TRUE(Step(reference_store, reference, 700, 1).ok());
  // A second session evicts the first, which is saved.
  const std::string other = *store.Add(NewSession());
  EXPECT_TRUE(fs::exists(FileOf(id)));
  EXPECT_EQ(store.stats().saved, 1);
  // Its next step takes it back (evicting the other in turn).
  auto got = Step(store, id, 1, 2);
  auto want = Step(reference_store, reference, 1, 2);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(SameBits(*got, *want));
  EXPECT_FALSE(fs::exists(FileOf(id)));
  EXPECT_TRUE(fs::exists(FileOf(other)));
  EXPECT_EQ(store.stats().restored, 1);
  EXPECT_EQ((*store.Find(id))->length(), 701);
}

// A session taken from its file is counted in the budget before its
// blocks are loaded: room is made first, and when none can be (imports
// hold it), the take is refused and the file stays for later.
TEST_F(SessionDirectoryTest, ATakeMakesRoomBeforeLoading) {
  auto directory = OpenDirectory();
  SessionStore::Options options = StoreOptions(directory.get());
  SessionStore sizing(StoreOptions(nullptr));
  const std::string sized = *sizing.Add(NewSession());
  ASSERT_TRUE(Step(sizing, sized, 4096, 1).ok());
  const size_t one = sizing.stats().budget_bytes;  // a full session
  options.max_bytes = one * 3 / 2;
  SessionStore store(options);
  const std::string id = *store.Add(NewSession());
  ASSERT_TRUE(Step(store, id, 4096, 1).ok());
  ASSERT_TRUE(store.HandOver(id).ok());
  // Another session fills the budget; taking the first evicts it before
  // loading, and the budget is never passed.
  const std::string other = *store.Add(NewSession());
  ASSERT_TRUE(Step(store, other, 4096, 2).ok());
  ASSERT_TRUE(Step(store, id, 1, 3, 4000).ok());
  EXPECT_EQ(store.stats().evicted, 1);
  EXPECT_LE(store.stats().budget_bytes, options.max_bytes);
  ASSERT_TRUE(store.HandOver(id).ok());
  // An import under way holds the budget: the take is refused, its file
  // kept, and it succeeds once the import is gone.
  std::string file;
  ASSERT_TRUE(WriteSessionFile(*sizing.Find(sized).value(), "00ff",
                               [&](absl::string_view piece) {
                                 file.append(piece.data(), piece.size());
                                 return absl::OkStatus();
                               })
                  .ok());
  SessionStore::Import import;
  ASSERT_TRUE(store.ImportBytes(import, 0, file.substr(0, 1000)).ok());
  const absl::Status refused = Step(store, id, 1, 4, 4001).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr("do not fit beside the sessions being loaded"));
  EXPECT_TRUE(fs::exists(FileOf(id)));
  ASSERT_TRUE(store.Delete("00ff").ok());
  store.EndImport(import);
  EXPECT_TRUE(Step(store, id, 1, 4, 4001).ok());
  EXPECT_LE(store.stats().budget_bytes, options.max_bytes);
}

TEST_F(SessionDirectoryTest, SavedSessionsMoveToAnotherStoreAndStepAlike) {
  auto directory = OpenDirectory();
  SessionStore reference_store(StoreOptions(nullptr));
  std::vector<std::string> ids, references;
  {
    SessionStore first(StoreOptions(directory.get()));
    for (int i = 0; i < 3; ++i) {
      ids.push_back(*first.Add(NewSession()));
      references.push_back(Reference(reference_store));
      ASSERT_TRUE(Step(first, ids[i], 300 + 400 * i, 10 + i).ok());
      ASSERT_TRUE(
          Step(reference_store, references[i], 300 + 400 * i, 10 + i).ok());
    }
    const SessionStore::SaveReport report = first.SaveAll();
    EXPECT_EQ(report.sessions, 3);
    EXPECT_TRUE(report.first_error.ok()) << report.first_error;
  }
  // Another process: its own directory handle on the same path.
  auto second_directory = OpenDirectory();
  SessionStore second(StoreOptions(second_directory.get()));
  for (int i = 0; i < 3; ++i) {
    for (unsigned step = 0; step < 3; ++step) {
      auto got = Step(second, ids[i], 1, 100 + step);
      auto want = Step(reference_store, references[i], 1, 100 + step);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(SameBits(*got, *want)) << "session " << i << " step " << step;
    }
  }
  EXPECT_EQ(second.stats().restored, 3);
  // A fork of a saved session takes it in first.
  EXPECT_TRUE(second.Fork(ids[0], 100).ok());
}

// Forks come back from their files (a drain) or journals (a crash) as full
// copies; each one taken up shares its leading blocks with the fork taken
// up before it, so that together they hold one copy of their prefix again,
// and every step answers as the forks did.
class ForksTakenUpTest : public SessionDirectoryTest,
                         public ::testing::WithParamInterface<bool> {};

TEST_P(ForksTakenUpTest, ShareTheirPrefixAgain) {
  const bool crashed = GetParam();
  constexpr int kForks = 4;
  auto directory = OpenDirectory();
  SessionStore reference_store(StoreOptions(nullptr));
  SessionStore::Options options = StoreOptions(directory.get());
  options.journal = crashed;
  std::vector<std::string> ids, references;
  size_t held_bytes = 0;
  {
    SessionStore first(options);
    const std::string parent = *first.Add(NewSession());
    ASSERT_TRUE(Step(first, parent, 1100, 1).ok());
    for (int i = 0; i < kForks; ++i) {
      ids.push_back(*first.Fork(parent, std::nullopt));
      references.push_back(Reference(reference_store));
      ASSERT_TRUE(Step(reference_store, references[i], 1100, 1).ok());
      ASSERT_TRUE(Step(first, ids[i], 1, 10 + i).ok());
      ASSERT_TRUE(Step(reference_store, references[i], 1, 10 + i).ok());
    }
    ASSERT_TRUE(first.Delete(parent).ok());
    held_bytes = first.stats().cache_bytes;
    if (crashed) {
      first.WaitForJournals();  // and no save: the store dies
      // The prefix was journaled once: by the parent (if its journal began
      // before the forks froze its cache), or in the base file each fork's
      // journal names, linked.
      EXPECT_LE(first.stats().journaled_blocks, 2);
      for (const std::string& id : ids) {
        struct stat base;
        ASSERT_EQ(::stat((path_ / (id + ".jbase")).c_str(), &base), 0) << id;
        EXPECT_EQ(base.st_nlink, static_cast<nlink_t>(kForks));
        EXPECT_LT(fs::file_size(path_ / (id + ".journal")), uint64_t{4} << 10);
      }
    } else {
      ASSERT_EQ(first.SaveAll().sessions, kForks);
    }
  }
  if (!crashed) {
    // The prefix is on disk once: one base file, a link per fork.
    struct stat base;
    ASSERT_EQ(::stat((path_ / (ids[0] + ".base")).c_str(), &base), 0);
    EXPECT_EQ(base.st_nlink, static_cast<nlink_t>(kForks));
    for (const std::string& id : ids) {
      struct stat link;
      ASSERT_EQ(::stat((path_ / (id + ".base")).c_str(), &link), 0);
      EXPECT_EQ(link.st_ino, base.st_ino);
      EXPECT_LT(fs::file_size(FileOf(id)), uint64_t{100} << 10);
    }
    const SessionDirectory::Stats saved = directory->stats();
    EXPECT_EQ(saved.linked_bases, kForks - 1);
    EXPECT_EQ(saved.bytes, static_cast<uint64_t>(base.st_size) +
                               kForks * fs::file_size(FileOf(ids[0])));
  }
  const size_t one_copy = (*reference_store.Find(references[0]))->cache_bytes();
  SessionStore second(options);
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < kForks; ++i) {
      SCOPED_TRACE(::testing::Message() << "fork " << i << " round " << round);
      // A fork recovered from its journal holds its full blocks: its client
      // resends from there.
      const std::optional<int64_t> position =
          crashed && round == 0 ? std::optional<int64_t>(1024) : std::nullopt;
      const int64_t n = position.has_value() ? 77 : 1;
      auto got = Step(second, ids[i], n, 20 + round, position);
      auto want = Step(reference_store, references[i], n, 20 + round, position);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(SameBits(*got, *want));
    }
  }
  for (const auto& entry : fs::directory_iterator(path_)) {
    EXPECT_NE(entry.path().extension(), ".base") << entry.path();
    EXPECT_NE(entry.path().extension(), ".session") << entry.path();
  }
  // (The second store journals the sessions of the crashed case anew.)
  if (!crashed) {
    EXPECT_EQ(directory->stats().bytes, 0u);
  }
  const SessionStore::Stats stats = second.stats();
  EXPECT_EQ(stats.restored, kForks);
  EXPECT_EQ(stats.reshared, kForks - 1);
  EXPECT_EQ(stats.shared_caches, 1);
  // Four full copies would hold four times one session's cache.
  EXPECT_LT(stats.cache_bytes, 2 * one_copy)
      << "held before: " << held_bytes << ", one copy: " << one_copy;
}

INSTANTIATE_TEST_SUITE_P(DrainedOrCrashed, ForksTakenUpTest, ::testing::Bool(),
                         [](const auto& info) {
                           return info.param ? "Crashed" : "Drained";
                         });

// Two replicas' stores: a session's calls moving from one to the other (a
// load balancer's hash moving the key, and back) find it each time, the
// one asked reclaiming it from the one that holds it.
TEST_F(SessionDirectoryTest, ASessionHeldElsewhereIsHandedOverOnDemand) {
  auto directory_a = OpenDirectory();
  auto directory_b = OpenDirectory();
  SessionStore* stores[2] = {nullptr, nullptr};
  const auto options = [&](SessionDirectory* directory, const char* holder) {
    SessionStore::Options o = StoreOptions(directory);
    o.holder = holder;
    o.reclaim = [&](absl::string_view id, absl::string_view from) {
      SessionStore* peer = from == "a" ? stores[0] : stores[1];
      return peer->HandOver(id);
    };
    return o;
  };
  SessionStore a(options(directory_a.get(), "a"));
  SessionStore b(options(directory_b.get(), "b"));
  stores[0] = &a;
  stores[1] = &b;
  SessionStore reference_store(StoreOptions(nullptr));
  const std::string reference = Reference(reference_store);
  const std::string id = *a.Add(NewSession());
  ASSERT_TRUE(Step(a, id, 600, 1).ok());
  ASSERT_TRUE(Step(reference_store, reference, 600, 1).ok());
  SessionStore* turns[] = {&b, &b, &a, &b, &a};
  for (unsigned turn = 0; turn < 5; ++turn) {
    auto got = Step(*turns[turn], id, 1, 10 + turn);
    auto want = Step(reference_store, reference, 1, 10 + turn);
    ASSERT_TRUE(got.ok()) << "turn " << turn << ": " << got.status();
    EXPECT_TRUE(SameBits(*got, *want)) << "turn " << turn;
  }
  EXPECT_EQ(a.stats().open + b.stats().open, 1);
  EXPECT_EQ(a.stats().restored + b.stats().restored, 4);
  // A holder that does not answer (gone): the session is not found.
  SessionStore::Options orphan = StoreOptions(directory_b.get());
  orphan.holder = "c";
  orphan.reclaim = [](absl::string_view, absl::string_view) {
    return absl::UnavailableError("connection refused");
  };
  SessionStore c(orphan);
  EXPECT_EQ(Step(c, id, 1, 99).status().code(), absl::StatusCode::kNotFound);
  // Deleting it removes its holder record.
  ASSERT_TRUE(a.Delete(id).ok());
  EXPECT_FALSE(directory_a->Holder(id).has_value());
}

// A call that may not wait for another replica (one answered on gRPC's
// thread) asks no peer: a session a live replica holds gives the status
// IsWouldWait tells, and stays where it is; the same call allowed to wait
// takes it over.
TEST_F(SessionDirectoryTest, ACallThatMayNotWaitAsksNoPeer) {
  auto directory_a = OpenDirectory();
  auto directory_b = OpenDirectory();
  SessionStore* holder = nullptr;
  int asked = 0;
  SessionStore::Options a_options = StoreOptions(directory_a.get());
  a_options.holder = "a";
  SessionStore a(a_options);
  SessionStore::Options b_options = StoreOptions(directory_b.get());
  b_options.holder = "b";
  b_options.reclaim = [&](absl::string_view id, absl::string_view) {
    ++asked;
    return holder->HandOver(id);
  };
  SessionStore b(b_options);
  holder = &a;
  const std::string id = *a.Add(NewSession());
  ASSERT_TRUE(Step(a, id, 40, 1).ok());
  ASSERT_TRUE(b.HeldElsewhere(id));

  const absl::Status deleted = b.Delete(id, PeerWait::kRefused);
  EXPECT_TRUE(IsWouldWait(deleted)) << deleted;
  EXPECT_EQ(deleted.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(deleted.message()),
              HasSubstr("moved to replica \"a\""));
  const absl::Status forked =
      b.Fork(id, std::nullopt, nullptr, std::nullopt, PeerWait::kRefused)
          .status();
  EXPECT_TRUE(IsWouldWait(forked)) << forked;
  const absl::Status exported =
      b.ExportSession(id, PeerWait::kRefused).status();
  EXPECT_TRUE(IsWouldWait(exported)) << exported;
  EXPECT_EQ(asked, 0);
  EXPECT_TRUE(a.FindHere(id).ok()) << "the session must stay with its holder";
  EXPECT_FALSE(IsWouldWait(absl::UnavailableError("moved")));

  auto fork = b.Fork(id, std::nullopt, nullptr, std::nullopt);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(asked, 1);
  EXPECT_TRUE(b.FindHere(id).ok());
  EXPECT_FALSE(a.FindHere(id).ok());
  // Held here now: nothing to wait for.
  EXPECT_TRUE(b.Delete(id, PeerWait::kRefused).ok());
  EXPECT_TRUE(b.Delete(*fork, PeerWait::kRefused).ok());
}

TEST_F(SessionDirectoryTest, DeletedSessionsLeaveNoFileAndStayGone) {
  auto directory = OpenDirectory();
  SessionStore store(StoreOptions(directory.get()));
  const std::string id = *store.Add(NewSession());
  ASSERT_TRUE(Step(store, id, 10, 1).ok());
  ASSERT_EQ(store.SaveAll().sessions, 1);
  ASSERT_TRUE(fs::exists(FileOf(id)));
  EXPECT_EQ(store.stats().open, 0);  // saved sessions live on in their files
  ASSERT_TRUE(store.Delete(id).ok());
  EXPECT_FALSE(fs::exists(FileOf(id)));
  const absl::Status gone = Step(store, id, 1, 2).status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(gone.message()), HasSubstr("was deleted"));
  // A saved session this store never held is deleted by its file.
  SessionStore other(StoreOptions(nullptr));
  const std::string saved = *other.Add(NewSession());
  ASSERT_TRUE(directory->Save(saved, **other.Find(saved)).ok());
  EXPECT_TRUE(store.Delete(saved).ok());
  EXPECT_FALSE(fs::exists(FileOf(saved)));
  EXPECT_EQ(store.Delete(saved).code(), absl::StatusCode::kNotFound);
}

// Ids a caller chooses (a sequence's, which lasts longer than any one of
// its sessions): opened and forked under them, refused when open or not
// storable; deleted here and opened again by another store under the same
// id, FindReused takes the new one up where Find says it was deleted.
TEST_F(SessionDirectoryTest, ChosenIdsAreOpenedForkedAndFoundAgainAfterReuse) {
  auto directory_a = OpenDirectory();
  auto directory_b = OpenDirectory();
  SessionStore a(StoreOptions(directory_a.get()));
  SessionStore reference_store(StoreOptions(nullptr));
  const std::string id(40, 'a'), fork_id(40, 'b');
  auto added = a.AddNamed(NewSession(), id);
  ASSERT_TRUE(added.ok()) << added.status();
  EXPECT_EQ(*added, id);
  EXPECT_EQ(a.AddNamed(NewSession(), id).status().code(),
            absl::StatusCode::kAlreadyExists);
  const absl::Status bad = a.AddNamed(NewSession(), "Not-Hex").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("hex digits"));
  ASSERT_TRUE(Step(a, id, 600, 1).ok());
  int64_t length = 0;
  auto forked = a.Fork(id, 300, &length, fork_id);
  ASSERT_TRUE(forked.ok()) << forked.status();
  EXPECT_EQ(*forked, fork_id);
  EXPECT_EQ(length, 300);
  EXPECT_EQ(a.Fork(id, 100, nullptr, fork_id).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(a.Fork(id, 100, nullptr, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(a.Delete(id).ok());
  // Another replica opens the id again and drains.
  {
    SessionStore b(StoreOptions(directory_b.get()));
    ASSERT_TRUE(b.AddNamed(NewSession(), id).ok());
    const std::string reference = Reference(reference_store);
    ASSERT_TRUE(Step(b, id, 20, 2).ok());
    ASSERT_TRUE(Step(reference_store, reference, 20, 2).ok());
    ASSERT_EQ(b.SaveAll().sessions, 1);
    EXPECT_EQ(a.Find(id).status().code(), absl::StatusCode::kNotFound);
    auto found = a.FindReused(id);
    ASSERT_TRUE(found.ok()) << found.status();
    EXPECT_EQ((*found)->length(), 20);
    auto got = Step(a, id, 1, 3);
    auto want = Step(reference_store, reference, 1, 3);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(SameBits(*got, *want));
  }
}

// A renamed session keeps stepping as before; its journal and its
// holder's record move to the new id (the journal written anew), so that a
// crash after the rename recovers it under the new id.
TEST_F(SessionDirectoryTest, ARenamedSessionKeepsItsTokensJournalAndHolder) {
  auto directory = OpenDirectory();
  SessionStore::Options options = StoreOptions(directory.get());
  options.holder = "a";
  options.journal = true;
  SessionStore reference_store(StoreOptions(nullptr));
  const std::string reference = Reference(reference_store);
  const std::string to(40, 'c');
  {
    SessionStore store(options);
    const std::string id = *store.Add(NewSession());
    ASSERT_TRUE(Step(store, id, 600, 1).ok());
    ASSERT_TRUE(Step(reference_store, reference, 600, 1).ok());
    store.WaitForJournals();
    ASSERT_TRUE(fs::exists(path_ / (id + ".journal")));
    EXPECT_EQ(store.Rename(id, "Bad").code(),
              absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(store.Rename(id, to).ok());
    EXPECT_EQ(store.Find(id).status().code(), absl::StatusCode::kNotFound);
    EXPECT_FALSE(fs::exists(path_ / (id + ".journal")));
    EXPECT_FALSE(directory->Holder(id).has_value());
    EXPECT_EQ(directory->Holder(to), "a");
    auto got = Step(store, to, 1, 2);
    auto want = Step(reference_store, reference, 1, 2);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(SameBits(*got, *want));
    store.WaitForJournals();
    EXPECT_TRUE(fs::exists(path_ / (to + ".journal")));
    EXPECT_EQ(store.Rename("0123", to).code(), absl::StatusCode::kNotFound);
    const std::string other = *store.Add(NewSession());
    EXPECT_EQ(store.Rename(other, to).code(), absl::StatusCode::kAlreadyExists);
    // A crash: the journal under the new id is what outlives the store.
  }
  SessionStore next(options);
  const absl::Status recovered = Step(next, to, 1, 3).status();
  EXPECT_EQ(recovered.code(), absl::StatusCode::kAborted) << recovered;
  EXPECT_THAT(std::string(recovered.message()), HasSubstr("layer 0 holds 512"));
}

TEST_F(SessionDirectoryTest, BadFilesFailTheirSessionAndAreQuarantined) {
  auto directory = OpenDirectory();
  // The session the files are written from, in a store of its own.
  SessionStore source(StoreOptions(nullptr));
  const std::string id = *source.Add(NewSession());
  ASSERT_TRUE(Step(source, id, 600, 1).ok());
  const std::shared_ptr<const DecodeSession> session = *source.Find(id);
  // A flipped byte in a block.
  ASSERT_TRUE(directory->Save(id, *session).ok());
  {
    std::fstream file(FileOf(id),
                      std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(4000);
    file.put('\x7f');
  }
  auto other_directory = OpenDirectory();
  SessionStore other(StoreOptions(other_directory.get()));
  const absl::Status corrupt = Step(other, id, 1, 2).status();
  EXPECT_EQ(corrupt.code(), absl::StatusCode::kDataLoss) << corrupt;
  EXPECT_THAT(std::string(corrupt.message()), HasSubstr("checksum mismatch"));
  EXPECT_FALSE(fs::exists(FileOf(id)));
  EXPECT_EQ(std::distance(fs::directory_iterator(path_ / "quarantine"),
                          fs::directory_iterator()),
            1);
  EXPECT_EQ(Step(other, id, 1, 2).status().code(), absl::StatusCode::kNotFound);

  // A file holding another session's id, and a symlink out of the
  // directory, are refused and quarantined too.
  const std::string renamed = "abcdef";
  ASSERT_TRUE(directory->Save(id, *session).ok());
  fs::rename(FileOf(id), FileOf(renamed));
  const absl::Status foreign = Step(other, renamed, 1, 2).status();
  EXPECT_EQ(foreign.code(), absl::StatusCode::kDataLoss) << foreign;
  EXPECT_THAT(std::string(foreign.message()), HasSubstr("holds session"));
  const fs::path outside = fs::path(::testing::TempDir()) /
                           absl::StrCat("outside-", ::getpid(), ".session");
  ASSERT_TRUE(directory->Save(id, *session).ok());
  fs::rename(FileOf(id), outside);
  fs::create_symlink(outside, FileOf("abc"));
  const absl::Status linked = Step(other, "abc", 1, 2).status();
  EXPECT_EQ(linked.code(), absl::StatusCode::kFailedPrecondition) << linked;
  EXPECT_FALSE(fs::exists(FileOf("abc")));
  EXPECT_TRUE(fs::exists(outside));
  fs::remove(outside);
  // Ids that are not storable never touch the disk.
  EXPECT_EQ(Step(other, "../etc/passwd", 1, 2).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(other_directory->stats().quarantined, 3);
}

// A fork's base file goes with its session file (a delete, room made for
// others), its data with the last link; a base that is not what its
// session names is DATA_LOSS for that session, whose file is quarantined.
TEST_F(SessionDirectoryTest, ABaseGoesWithItsSessionsAndIsChecked) {
  auto directory = OpenDirectory();
  std::vector<std::string> ids;
  {
    SessionStore first(StoreOptions(directory.get()));
    const std::string parent = *first.Add(NewSession());
    ASSERT_TRUE(Step(first, parent, 1100, 1).ok());
    for (int i = 0; i < 5; ++i) {
      ids.push_back(*first.Fork(parent, std::nullopt));
      ASSERT_TRUE(Step(first, ids[i], 1, 10 + i).ok());
    }
    ASSERT_TRUE(first.Delete(parent).ok());
    ASSERT_EQ(first.SaveAll().sessions, 5);
  }
  const auto base_of = [&](const std::string& id) {
    return path_ / (id + ".base");
  };
  const auto links = [&](const std::string& id) {
    struct stat info;
    return ::stat(base_of(id).c_str(), &info) == 0 ? info.st_nlink : 0;
  };
  EXPECT_EQ(links(ids[4]), 5u);
  EXPECT_EQ(links(ids[4]), 5u);
  EXPECT_TRUE(directory->Remove(ids[0]));
  EXPECT_FALSE(fs::exists(base_of(ids[0])));
  EXPECT_EQ(links(ids[4]), 4u);
  // The base's bytes count once in the limit.
  const uint64_t base_bytes = fs::file_size(base_of(ids[4]));
  EXPECT_EQ(directory->stats().bytes,
            base_bytes + 4 * fs::file_size(FileOf(ids[4])));

  // A base changed under its sessions fails them.
  {
    std::fstream base(base_of(ids[1]),
                      std::ios::in | std::ios::out | std::ios::binary);
    base.seekp(static_cast<std::streamoff>(base_bytes / 2));
    base.put('\x5a');
  }
  SessionStore second(StoreOptions(directory.get()));
  auto failed = Step(second, ids[1], 1, 20);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(failed.status().message()),
              HasSubstr("its base file"));
  EXPECT_FALSE(fs::exists(FileOf(ids[1])));
  EXPECT_FALSE(fs::exists(base_of(ids[1])));
  EXPECT_EQ(links(ids[4]), 3u);

  // An orphaned base (its session file gone) and the sessions with theirs
  // go when room is made.
  fs::remove(FileOf(ids[2]));
  auto smaller = OpenDirectory(1);
  // Two sessions with their bases, and the orphan.
  for (int tries = 0; tries < 200 && smaller->stats().removed_for_space < 3;
       ++tries) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(smaller->stats().removed_for_space, 3);
  EXPECT_EQ(smaller->stats().files, 0);
  EXPECT_EQ(smaller->stats().bytes, 0u);
  for (const std::string& id : ids) {
    EXPECT_FALSE(fs::exists(base_of(id))) << id;
    EXPECT_FALSE(fs::exists(FileOf(id))) << id;
  }
}

// Releases before format 3 read no base files: a hand-over asked by one
// (file_version 2), or a directory written for one, saves a fork whole.
TEST_F(SessionDirectoryTest, AReaderOfFormatTwoGetsForksWhole) {
  const auto has_base = [&](const std::string& id) {
    std::ifstream in(FileOf(id), std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)),
                            std::istreambuf_iterator<char>());
    auto header = ReadSessionFileHeader(bytes, "f");
    EXPECT_TRUE(header.ok()) << header.status();
    const bool named = header.ok() && header->base.has_value();
    EXPECT_EQ(named, fs::exists(path_ / (id + ".base")));
    return named;
  };
  auto directory = OpenDirectory();
  SessionStore store(StoreOptions(directory.get()));
  const std::string parent = *store.Add(NewSession());
  ASSERT_TRUE(Step(store, parent, 1100, 1).ok());
  const std::string fork = *store.Fork(parent, std::nullopt);
  const std::string second_fork = *store.Fork(parent, std::nullopt);
  ASSERT_TRUE(store.HandOver(fork, /*file_version=*/2).ok());
  EXPECT_FALSE(has_base(fork));
  ASSERT_TRUE(store.HandOver(second_fork).ok());
  EXPECT_TRUE(has_base(second_fork));
  ASSERT_TRUE(store.Find(fork).ok());
  ASSERT_TRUE(store.Find(second_fork).ok());

  auto older = SessionDirectory::Open({.path = path_.string(),
                                       .max_file_bytes = uint64_t{1} << 30,
                                       .file_version = 2});
  ASSERT_TRUE(older.ok());
  SessionStore for_older(StoreOptions(older->get()));
  const std::string other = *for_older.Add(NewSession());
  ASSERT_TRUE(Step(for_older, other, 600, 2).ok());
  const std::string other_fork = *for_older.Fork(other, std::nullopt);
  EXPECT_EQ(for_older.SaveAll().sessions, 2);
  EXPECT_FALSE(has_base(other_fork));
}

TEST_F(SessionDirectoryTest, TheDirectoryKeepsWithinItsLimitOldestFirst) {
  SessionStore store(StoreOptions(nullptr));
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) {
    ids.push_back(*store.Add(NewSession()));
    ASSERT_TRUE(Step(store, ids.back(), 512, i).ok());
  }
  auto probe = OpenDirectory();
  ASSERT_TRUE(probe->Save(ids[0], **store.Find(ids[0])).ok());
  const uint64_t one = probe->stats().bytes;
  probe.reset();
  fs::remove_all(path_);
  // Room for three files: the fourth save removes the oldest.
  auto directory = OpenDirectory(3 * one + one / 2);
  // Apart by more than the file system's timestamp granularity (a kernel
  // tick, up to 10 ms), which orders the files for the new handle below.
  for (const std::string& id : ids) {
    ASSERT_TRUE(directory->Save(id, **store.Find(id)).ok());
    absl::SleepFor(absl::Milliseconds(25));
  }
  EXPECT_FALSE(fs::exists(FileOf(ids[0])));
  for (int i = 1; i < 4; ++i) EXPECT_TRUE(fs::exists(FileOf(ids[i])));
  EXPECT_EQ(directory->stats().removed_for_space, 1);
  EXPECT_EQ(directory->stats().bytes, 3 * one);

  // A new handle indexes what is there and keeps the limit as well.
  auto smaller = OpenDirectory(one + one / 2);
  for (int tries = 0; tries < 200 && smaller->stats().files != 1; ++tries) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(smaller->stats().files, 1);
  EXPECT_TRUE(fs::exists(FileOf(ids[3])));
}

// A process that dies leaves its sessions' journals: another store takes
// each one up holding its full blocks, refuses a step that does not give its
// position with ABORTED naming the length it holds, and after the client
// resends from there answers bit for bit as a session that never left.
TEST_F(SessionDirectoryTest, AJournalOutlivesItsStoreAndTheClientResends) {
  auto directory = OpenDirectory();
  SessionStore reference_store(StoreOptions(nullptr));
  const std::string reference = Reference(reference_store);
  SessionStore::Options options = StoreOptions(directory.get());
  options.journal = true;
  std::string id;
  {
    SessionStore store(options);
    id = *store.Add(NewSession());
    // Three steps: 1100 tokens, two blocks of them full.
    for (auto [n, seed] : {std::pair{1000, 1u}, {90, 2u}, {10, 3u}}) {
      ASSERT_TRUE(Step(store, id, n, seed).ok());
      ASSERT_TRUE(Step(reference_store, reference, n, seed).ok());
    }
    store.WaitForJournals();
    EXPECT_EQ(store.stats().journaled_blocks, 2);
    EXPECT_TRUE(fs::exists(path_ / (id + ".journal")));
    // A store going away without saving (a crash) leaves the journal.
  }
  SessionStore next(options);
  auto refused = Step(next, id, 1, 4);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kAborted)
      << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("layer 0 holds 1024; resend the tokens from there, "
                        "giving position 1024"));
  // A position past what it holds is refused alike.
  EXPECT_EQ(Step(next, id, 1, 4, 1100).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ((*next.Find(id))->length(), 1024);
  EXPECT_EQ(next.stats().recovered, 1);
  // The reference rewinds to 1024 as well; both resend 76 other tokens.
  auto resent = Step(next, id, 76, 5, 1024);
  auto want = Step(reference_store, reference, 76, 5, 1024);
  ASSERT_TRUE(resent.ok()) << resent.status();
  EXPECT_TRUE(SameBits(*resent, *want));
  // Confirmed: steps without a position are taken again.
  auto next_step = Step(next, id, 1, 6);
  ASSERT_TRUE(next_step.ok()) << next_step.status();
  EXPECT_TRUE(SameBits(*next_step, *Step(reference_store, reference, 1, 6)));
}

TEST_F(SessionDirectoryTest, ALiveHoldersJournalIsNotTaken) {
  auto directory = OpenDirectory();
  SessionStore::Options options = StoreOptions(directory.get());
  options.journal = true;
  SessionStore holder(options);
  const std::string id = *holder.Add(NewSession());
  ASSERT_TRUE(Step(holder, id, 600, 1).ok());
  holder.WaitForJournals();
  SessionStore other(options);
  auto step = Step(other, id, 1, 2);
  ASSERT_EQ(step.status().code(), absl::StatusCode::kUnavailable)
      << step.status();
  EXPECT_THAT(std::string(step.status().message()),
              HasSubstr("is held by a running server"));
  // Its holder still steps it; a delete there removes the journal at once,
  // though a call still holds the session: a request right after the
  // delete finds no holder.
  ASSERT_TRUE(Step(holder, id, 1, 3).ok());
  const std::shared_ptr<const DecodeSession> held = *holder.Find(id);
  ASSERT_TRUE(holder.Delete(id).ok());
  EXPECT_FALSE(fs::exists(path_ / (id + ".journal")));
  EXPECT_EQ(Step(other, id, 1, 2).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(held->length(0), 601);
  EXPECT_EQ(Step(other, id, 1, 2).status().code(), absl::StatusCode::kNotFound);
}

// Journals count in the directory's limit with the session files. When
// room is needed, the journal a dead store left goes first (oldest), while
// a live store's journal is never removed, however old: the next oldest
// session file goes instead.
TEST_F(SessionDirectoryTest, JournalsCountInTheLimitAndOnlyOrphansGo) {
  SessionStore plain(StoreOptions(nullptr));
  std::vector<std::string> files;
  for (int i = 0; i < 3; ++i) {
    files.push_back(*plain.Add(NewSession()));
    ASSERT_TRUE(Step(plain, files.back(), 512, 10 + i).ok());
  }
  auto probe = OpenDirectory();
  ASSERT_TRUE(probe->Save(files[0], **plain.Find(files[0])).ok());
  const uint64_t one = probe->stats().bytes;
  probe.reset();
  fs::remove_all(path_);

  auto directory = OpenDirectory(uint64_t{1} << 40);  // no removal yet
  SessionStore::Options options = StoreOptions(directory.get());
  options.journal = true;
  std::string orphan, live;
  {
    SessionStore dead(options);
    orphan = *dead.Add(NewSession());
    ASSERT_TRUE(Step(dead, orphan, 600, 1).ok());
    dead.WaitForJournals();
    // Gone without saving: its journal stays, unlocked.
  }
  SessionStore holder(options);
  live = *holder.Add(NewSession());
  ASSERT_TRUE(Step(holder, live, 600, 2).ok());
  holder.WaitForJournals();
  const fs::path orphan_journal = path_ / (orphan + ".journal");
  const fs::path live_journal = path_ / (live + ".journal");
  ASSERT_TRUE(fs::exists(orphan_journal));
  ASSERT_TRUE(fs::exists(live_journal));
  const uint64_t journals =
      fs::file_size(orphan_journal) + fs::file_size(live_journal);
  EXPECT_EQ(directory->stats().bytes, journals);
  EXPECT_EQ(directory->stats().files, 2);

  // Another handle on the directory (as another replica's), with room for
  // both journals and one file and a half: the second file's save removes
  // the orphan, the third's (the live journal being the oldest then) the
  // first file. The holder's journal stays with the first handle, which
  // outlives it.
  auto other = OpenDirectory(journals + one + one / 2);
  for (int tries = 0; tries < 200 && other->stats().files != 2; ++tries) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(other->stats().bytes, journals);
  ASSERT_TRUE(other->Save(files[0], **plain.Find(files[0])).ok());
  ASSERT_TRUE(other->Save(files[1], **plain.Find(files[1])).ok());
  EXPECT_FALSE(fs::exists(orphan_journal));
  EXPECT_TRUE(fs::exists(live_journal));
  EXPECT_TRUE(fs::exists(FileOf(files[0])));
  EXPECT_EQ(other->stats().removed_for_space, 1);
  ASSERT_TRUE(other->Save(files[2], **plain.Find(files[2])).ok());
  EXPECT_TRUE(fs::exists(live_journal));
  EXPECT_FALSE(fs::exists(FileOf(files[0])));
  EXPECT_TRUE(fs::exists(FileOf(files[1])));
  EXPECT_TRUE(fs::exists(FileOf(files[2])));
  EXPECT_EQ(other->stats().removed_for_space, 2);
  EXPECT_LE(other->stats().bytes, journals + one + one / 2);
  // The live session still steps, journaled.
  ASSERT_TRUE(Step(holder, live, 1, 3).ok());
}

// A journal the index counts that another process has since taken (its
// file gone) leaves the count when room is next made, instead of pushing
// the session files out for good.
TEST_F(SessionDirectoryTest, AJournalGoneFromDiskLeavesTheCount) {
  SessionStore plain(StoreOptions(nullptr));
  const std::string saved = *plain.Add(NewSession());
  ASSERT_TRUE(Step(plain, saved, 512, 1).ok());
  std::string orphan;
  uint64_t journal = 0;
  {
    auto directory = OpenDirectory();
    SessionStore::Options options = StoreOptions(directory.get());
    options.journal = true;
    SessionStore dead(options);
    orphan = *dead.Add(NewSession());
    ASSERT_TRUE(Step(dead, orphan, 600, 2).ok());
    dead.WaitForJournals();
    journal = fs::file_size(path_ / (orphan + ".journal"));
  }
  auto probe = OpenDirectory();
  ASSERT_TRUE(probe->Save(saved, **plain.Find(saved)).ok());
  const uint64_t one = fs::file_size(FileOf(saved));
  ASSERT_TRUE(probe->Remove(saved));
  probe.reset();
  // Room for the journal and half a file; the journal then goes from disk
  // behind the index's back.
  auto directory = OpenDirectory(journal + one / 2);
  for (int tries = 0; tries < 200 && directory->stats().files != 1; ++tries) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(directory->stats().bytes, journal);
  fs::remove(path_ / (orphan + ".journal"));
  ASSERT_TRUE(directory->Save(saved, **plain.Find(saved)).ok());
  EXPECT_TRUE(fs::exists(FileOf(saved)));
  EXPECT_EQ(directory->stats().files, 1);
  EXPECT_EQ(directory->stats().bytes, one);
  EXPECT_EQ(directory->stats().removed_for_space, 0);
}

TEST_F(SessionDirectoryTest, ARewindBelowJournaledBlocksIsRecordedAtOnce) {
  auto directory = OpenDirectory();
  SessionStore::Options options = StoreOptions(directory.get());
  options.journal = true;
  std::string id;
  {
    SessionStore store(options);
    id = *store.Add(NewSession());
    ASSERT_TRUE(Step(store, id, 1100, 1).ok());
    store.WaitForJournals();
    // Back to 300, then 100 more: block 0 no longer holds what was written.
    ASSERT_TRUE(Step(store, id, 100, 2, 300).ok());
  }
  SessionStore next(options);
  EXPECT_EQ((*next.Find(id))->length(), 0);
  // A drained session leaves a file and no journal.
  ASSERT_TRUE(Step(next, id, 600, 3, 0).ok());
  next.WaitForJournals();
  EXPECT_TRUE(fs::exists(path_ / (id + ".journal")));
  EXPECT_EQ(next.SaveAll().sessions, 1);
  EXPECT_FALSE(fs::exists(path_ / (id + ".journal")));
  EXPECT_TRUE(fs::exists(FileOf(id)));
}

TEST_F(SessionDirectoryTest, AnUnusableDirectoryIsRefusedAtOpen) {
  const fs::path file = fs::path(::testing::TempDir()) / "not-a-directory";
  std::ofstream(file) << "x";
  auto opened = SessionDirectory::Open({.path = file.string()});
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(opened.status().message()),
              HasSubstr("--session_dir"));
  fs::remove(file);
}

}  // namespace
}  // namespace attnserve::testing
