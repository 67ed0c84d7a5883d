// SessionStore (core/session_store.h): ids, deletion, idle expiry, the
// memory budget's least-recently-used eviction, the NOT_FOUND messages that
// say why a session is gone, concurrent sessions, and memory going back to
// the system when sessions are freed.
#include "core/session_store.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/decode_session.h"
#include "core/kv_cache.h"
#include "core/multi_head_attention.h"
#include "core/mutex.h"
#include "gtest/gtest.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {
namespace {

constexpr int kHeads = 2;
constexpr int64_t kDim = 64;

std::unique_ptr<DecodeSession> NewSession(int64_t max_length = 4096) {
  DecodeSessionConfig config;
  config.num_heads = kHeads;
  config.key_dim = kDim;
  config.max_length = max_length;
  auto session = DecodeSession::Create(config);
  EXPECT_TRUE(session.ok()) << session.status();
  return std::move(*session);
}

// One step of `n` tokens with inputs drawn from `rng`; the output in `out`.
absl::Status StepTokens(SessionStore& store, const std::string& id, int64_t n,
                        std::mt19937& rng, std::optional<Tensor>* out = nullptr,
                        int64_t* length = nullptr) {
  Tensor q = RandomTensor(DType::kFloat32, {1, kHeads, n, kDim}, rng);
  Tensor k = RandomTensor(DType::kFloat32, {1, kHeads, n, kDim}, rng);
  Tensor v = RandomTensor(DType::kFloat32, {1, kHeads, n, kDim}, rng);
  DecodeStepInputs in;
  in.query = q.view();
  in.key = k.view();
  in.value = v.view();
  TensorResults results;
  absl::Status status = store.Step(id, in, {}, results, length);
  if (out != nullptr) *out = results.Take("output");
  return status;
}

// The bytes of one session of kHeads x kDim holding `tokens` tokens.
size_t CacheBytes(int64_t tokens) {
  return NewSession(/*max_length=*/tokens)->BytesAt(tokens);
}

// The budget a session of `max_length` needs to fill its cache: the cache
// and the session's bookkeeping.
size_t BudgetFor(int64_t max_length) {
  return CacheBytes(max_length) + NewSession(max_length)->bookkeeping_bytes();
}

TEST(SessionStoreTest, StepsDeleteAndSayWhySessionsAreGone) {
  SessionStore store({});
  std::mt19937 rng(1);
  const std::string id = *store.Add(NewSession());
  EXPECT_EQ(id.size(), 32u);
  int64_t length = 0;
  ASSERT_TRUE(StepTokens(store, id, 5, rng, nullptr, &length).ok());
  EXPECT_EQ(length, 5);
  ASSERT_TRUE(StepTokens(store, id, 1, rng, nullptr, &length).ok());
  EXPECT_EQ(length, 6);
  EXPECT_EQ(store.stats().cache_bytes, CacheBytes(6));
  ASSERT_TRUE(store.Delete(id).ok());
  EXPECT_EQ(store.stats().cache_bytes, 0u);
  EXPECT_EQ(store.stats().open, 0);

  absl::Status status = StepTokens(store, id, 1, rng);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(status.message(), "session_id: session \"" + id + "\" was deleted");
  EXPECT_EQ(store.Delete(id).code(), absl::StatusCode::kNotFound);
  status = StepTokens(store, "0123", 1, rng);
  EXPECT_EQ(status.message(),
            "session_id: no session \"0123\" (expired, evicted, deleted, or "
            "opened on another replica); create a new one and prefill it");
  EXPECT_NE(*store.Add(NewSession()), *store.Add(NewSession()));
}

// An id opened again after it went (a sequence's) and gone again keeps its
// newer record while 4096 other ids go after its first: the record of why
// it went is dropped with the entry it was queued with, not an older one.
TEST(SessionStoreTest, AnIdGoneTwiceKeepsItsNewerRecord) {
  SessionStore store({});
  std::mt19937 rng(1);
  const std::string id = "5eed";
  const auto open_and_delete = [&](const std::string& name) {
    ASSERT_TRUE(store.AddNamed(NewSession(), name).ok());
    ASSERT_TRUE(store.Delete(name).ok());
  };
  open_and_delete(id);
  for (int i = 0; i < 100; ++i) open_and_delete(absl::StrFormat("a%04x", i));
  open_and_delete(id);
  // Past the first record's place in the queue, within the second's.
  for (int i = 0; i < 4000; ++i) {
    open_and_delete(absl::StrFormat("b%04x", i));
  }
  EXPECT_EQ(StepTokens(store, id, 1, rng).message(),
            "session_id: session \"5eed\" was deleted");
  // And it goes once the newer record is as old as the queue is long.
  for (int i = 0; i < 200; ++i) open_and_delete(absl::StrFormat("c%04x", i));
  EXPECT_NE(StepTokens(store, id, 1, rng).message().find("no session"),
            std::string::npos);
}

TEST(SessionStoreTest, IdleSessionsExpire) {
  SessionStore::Options options;
  options.idle_timeout = absl::Seconds(30);
  SessionStore store(options);
  std::mt19937 rng(2);
  const std::string idle = *store.Add(NewSession());
  const std::string busy = *store.Add(NewSession());
  ASSERT_TRUE(StepTokens(store, idle, 3, rng).ok());
  store.ExpireIdle(absl::Now() + absl::Seconds(10));
  EXPECT_EQ(store.stats().open, 2);
  store.ExpireIdle(absl::Now() + absl::Seconds(31));
  EXPECT_EQ(store.stats().open, 0);
  EXPECT_EQ(store.stats().expired, 2);
  EXPECT_EQ(store.stats().cache_bytes, 0u);
  EXPECT_EQ(StepTokens(store, busy, 1, rng).message(),
            "session_id: session \"" + busy +
                "\" expired after 30s idle; create a new one and prefill it");
}

TEST(SessionStoreTest, BackgroundThreadExpiresIdleSessions) {
  SessionStore::Options options;
  options.idle_timeout = absl::Milliseconds(50);
  SessionStore store(options);
  ASSERT_TRUE(store.Add(NewSession()).ok());
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (store.stats().open > 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(store.stats().open, 0);
  EXPECT_EQ(store.stats().expired, 1);
}

TEST(SessionStoreTest, MemoryBudgetEvictsTheLeastRecentlyUsed) {
  const int64_t tokens = 512;
  SessionStore::Options options;
  options.max_bytes = 2 * CacheBytes(tokens) + CacheBytes(tokens) / 2;
  SessionStore store(options);
  std::mt19937 rng(3);
  // Each could fill its whole cache within the budget.
  const std::string a = *store.Add(NewSession(tokens + 8));
  const std::string b = *store.Add(NewSession(tokens + 8));
  const std::string c = *store.Add(NewSession(tokens + 8));
  ASSERT_TRUE(StepTokens(store, a, tokens, rng).ok());
  ASSERT_TRUE(StepTokens(store, b, tokens, rng).ok());
  ASSERT_TRUE(StepTokens(store, a, 1, rng).ok());  // b is now the oldest
  ASSERT_TRUE(StepTokens(store, c, tokens, rng).ok());
  const SessionStore::Stats stats = store.stats();
  EXPECT_EQ(stats.evicted, 1);
  EXPECT_EQ(stats.open, 2);
  EXPECT_LE(stats.cache_bytes, options.max_bytes);
  EXPECT_EQ(StepTokens(store, b, 1, rng).message(),
            "session_id: session \"" + b +
                "\" was evicted (least recently used) to make room for other "
                "sessions; create a new one and prefill it");
  EXPECT_TRUE(StepTokens(store, a, 1, rng).ok());
  EXPECT_TRUE(StepTokens(store, c, 1, rng).ok());
}

// A cache reserves its whole max_length of address space: a session that
// could not fill it within the budget is refused when it is added, and the
// one that can is bounded by its max_length.
TEST(SessionStoreTest, SessionWhoseCacheCannotFitTheBudgetIsRefused) {
  SessionStore::Options options;
  options.max_bytes = BudgetFor(100);
  SessionStore store(options);
  std::unique_ptr<DecodeSession> large = NewSession(4096);
  const size_t reserved = large->reserved_bytes();
  EXPECT_EQ(reserved, CacheBytes(4096));
  const absl::StatusOr<std::string> refused = store.Add(std::move(large));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.status().message(),
            absl::StrCat("session: its cache would reserve ", reserved,
                         " bytes for its max_length, more than the ",
                         options.max_bytes, " bytes one session may hold"));
  EXPECT_EQ(store.stats().open, 0);
  EXPECT_EQ(store.stats().reserved_bytes, 0u);
  std::mt19937 rng(4);
  const std::string id = *store.Add(NewSession(100));
  EXPECT_EQ(store.stats().reserved_bytes, CacheBytes(100));
  int64_t length = 0;
  ASSERT_TRUE(StepTokens(store, id, 100, rng, nullptr, &length).ok());
  EXPECT_EQ(length, 100);
  EXPECT_EQ(StepTokens(store, id, 1, rng).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_LE(store.stats().cache_bytes, options.max_bytes);
}

// Sessions reserve address space as they are added: past
// max_reserved_bytes the least recently used go, as for max_sessions.
TEST(SessionStoreTest, ReservedAddressSpaceEvictsTheLeastRecentlyUsed) {
  const size_t one = NewSession(4096)->reserved_bytes();
  SessionStore::Options options;
  options.max_reserved_bytes = 2 * one + one / 2;
  SessionStore store(options);
  EXPECT_EQ(store.max_session_bytes(), options.max_reserved_bytes);
  std::mt19937 rng(8);
  const std::string a = *store.Add(NewSession(4096));
  const std::string b = *store.Add(NewSession(4096));
  ASSERT_TRUE(StepTokens(store, a, 1, rng).ok());  // b is now the oldest
  EXPECT_EQ(store.stats().reserved_bytes, 2 * one);
  const std::string c = *store.Add(NewSession(4096));
  EXPECT_EQ(store.stats().reserved_bytes, 2 * one);
  EXPECT_EQ(store.stats().evicted, 1);
  EXPECT_EQ(StepTokens(store, b, 1, rng).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(StepTokens(store, a, 1, rng).ok());
  EXPECT_TRUE(StepTokens(store, c, 1, rng).ok());
  ASSERT_TRUE(store.Delete(a).ok());
  ASSERT_TRUE(store.Delete(c).ok());
  EXPECT_EQ(store.stats().reserved_bytes, 0u);
  // Larger than all of it: refused, nothing evicted.
  const std::string d = *store.Add(NewSession(4096));
  EXPECT_EQ(store.Add(NewSession(16384)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(StepTokens(store, d, 1, rng).ok());
}

TEST(SessionStoreTest, MaxSessionsEvictsTheLeastRecentlyUsed) {
  SessionStore::Options options;
  options.max_sessions = 2;
  SessionStore store(options);
  std::mt19937 rng(5);
  const std::string a = *store.Add(NewSession());
  const std::string b = *store.Add(NewSession());
  ASSERT_TRUE(StepTokens(store, a, 1, rng).ok());
  const std::string c = *store.Add(NewSession());
  EXPECT_EQ(store.stats().open, 2);
  EXPECT_EQ(StepTokens(store, b, 1, rng).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(StepTokens(store, a, 1, rng).ok());
  EXPECT_TRUE(StepTokens(store, c, 1, rng).ok());
}

// Sessions stepped from several threads at once answer what each answers
// alone.
TEST(SessionStoreTest, ConcurrentSessionsMatchSerialRuns) {
  constexpr int kSessions = 4;
  constexpr int kSteps = 12;
  auto run = [](SessionStore& store, const std::string& id, int seed) {
    std::mt19937 rng(seed);
    std::vector<Tensor> outputs;
    for (int s = 0; s < kSteps; ++s) {
      std::optional<Tensor> out;
      EXPECT_TRUE(StepTokens(store, id, s == 0 ? 20 : 1, rng, &out).ok());
      outputs.push_back(std::move(*out));
    }
    return outputs;
  };
  SessionStore serial_store({});
  std::vector<std::vector<Tensor>> serial;
  for (int i = 0; i < kSessions; ++i) {
    serial.push_back(run(serial_store, *serial_store.Add(NewSession()), i));
  }
  SessionStore store({});
  std::vector<std::string> ids;
  for (int i = 0; i < kSessions; ++i) ids.push_back(*store.Add(NewSession()));
  std::vector<std::vector<Tensor>> parallel(kSessions);
  std::vector<std::thread> threads;
  for (int i = 0; i < kSessions; ++i) {
    threads.emplace_back([&, i] { parallel[i] = run(store, ids[i], i); });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kSessions; ++i) {
    for (int s = 0; s < kSteps; ++s) {
      ASSERT_EQ(parallel[i][s].num_bytes(), serial[i][s].num_bytes());
      EXPECT_EQ(0, std::memcmp(parallel[i][s].data(), serial[i][s].data(),
                               serial[i][s].num_bytes()))
          << "session " << i << " step " << s;
    }
  }
}

// Resident set size of this process, from /proc/self/statm.
size_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

// StepMany: each entry as Step would answer it (bitwise for the good ones),
// the room made and accounted the same, the bad entries failing alone.
// A step past its session's max_length is refused without making room for
// it: no other session is evicted.
TEST(SessionStoreTest, StepPastMaxLengthEvictsNobody) {
  SessionStore::Options options;
  options.max_bytes = CacheBytes(600);
  SessionStore store(options);
  std::mt19937 rng(3);
  const std::string first = *store.Add(NewSession(300));
  const std::string second = *store.Add(NewSession(300));
  ASSERT_TRUE(StepTokens(store, first, 250, rng).ok());
  ASSERT_TRUE(StepTokens(store, second, 250, rng).ok());
  const absl::Status past = StepTokens(store, second, 100, rng);
  EXPECT_EQ(past.code(), absl::StatusCode::kOutOfRange) << past;
  EXPECT_EQ(store.stats().open, 2);
  int64_t length = 0;
  EXPECT_TRUE(StepTokens(store, first, 1, rng, nullptr, &length).ok());
  EXPECT_EQ(length, 251);
}

TEST(SessionStoreTest, StepManyIsStepForEachEntry) {
  SessionStore::Options options;
  options.max_bytes = BudgetFor(900);
  SessionStore batched(options), single(options);
  std::mt19937 rng_a(5), rng_b(5);
  std::vector<std::string> a_ids, b_ids;
  for (int i = 0; i < 3; ++i) {
    // Sessions whose whole cache fits the budget (a larger one is refused).
    a_ids.push_back(*batched.Add(NewSession(900)));
    b_ids.push_back(*single.Add(NewSession(900)));
    ASSERT_TRUE(StepTokens(batched, a_ids[i], 200 + 50 * i, rng_a).ok());
    ASSERT_TRUE(StepTokens(single, b_ids[i], 200 + 50 * i, rng_b).ok());
  }
  std::mt19937 rng(9);
  const auto operands = [&](int64_t n) {
    return std::array<Tensor, 3>{
        RandomTensor(DType::kFloat32, {1, kHeads, n, kDim}, rng),
        RandomTensor(DType::kFloat32, {1, kHeads, n, kDim}, rng),
        RandomTensor(DType::kFloat32, {1, kHeads, n, kDim}, rng)};
  };
  const auto in = [](const std::array<Tensor, 3>& t) {
    return DecodeStepInputs{std::nullopt, t[0].view(), t[1].view(), t[2].view(),
                            std::nullopt};
  };
  const auto one = operands(1);
  const auto huge = operands(700);  // past its session's max_length
  std::vector<TensorResults> results(6);
  std::vector<int64_t> lengths(6, -1);
  std::vector<SessionStore::StepInput> steps = {
      {a_ids[0], in(one), {}, &results[0], &lengths[0]},
      {"00000000000000000000000000000000",
       in(one),
       {},
       &results[1],
       &lengths[1]},
      {a_ids[1], in(one), {}, &results[2], &lengths[2]},
      {a_ids[0], in(one), {}, &results[3], &lengths[3]},
      {a_ids[2], in(huge), {}, &results[4], &lengths[4]},
  };
  const std::vector<absl::Status> statuses = batched.StepMany(steps);
  ASSERT_EQ(statuses.size(), 5u);
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_EQ(statuses[1].code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(statuses[2].ok()) << statuses[2];
  EXPECT_EQ(statuses[3].message(),
            "steps[3]: session_id: also in steps[0]; a call steps each "
            "session at most once");
  EXPECT_EQ(statuses[4].code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(lengths[0], 201);
  EXPECT_EQ(lengths[2], 251);
  EXPECT_EQ(lengths[4], 300);  // refused: the session is where it was
  for (int i : {0, 1}) {
    TensorResults alone;
    int64_t length = 0;
    ASSERT_TRUE(single.Step(b_ids[i], in(one), {}, alone, &length).ok());
    EXPECT_EQ(length, lengths[2 * i]);
    std::optional<Tensor> got = results[2 * i].Take("output");
    std::optional<Tensor> want = alone.Take("output");
    ASSERT_TRUE(got.has_value() && want.has_value());
    EXPECT_EQ(0, std::memcmp(got->data(), want->data(), got->num_bytes()));
  }
  EXPECT_EQ(batched.stats().cache_bytes, single.stats().cache_bytes);
  EXPECT_EQ(batched.stats().open, 3);
}

// A multi-layer session's steps name their layer: Step and StepMany answer
// that layer's length, and the budget counts every layer's tokens: a
// session whose layers together pass max_bytes evicts the others.
TEST(SessionStoreTest, LayersAreCountedTogether) {
  const int64_t tokens = 512;
  SessionStore::Options options;
  options.max_bytes = 3 * CacheBytes(tokens) + CacheBytes(tokens) / 2;
  SessionStore store(options);
  std::mt19937 rng(5);
  const std::string single = *store.Add(NewSession(tokens + 8));
  ASSERT_TRUE(StepTokens(store, single, tokens, rng).ok());
  DecodeSessionConfig config;
  config.num_heads = kHeads;
  config.key_dim = kDim;
  config.max_length = tokens + 8;
  config.num_layers = 3;
  const std::string layered = *store.Add(*DecodeSession::Create(config));
  Tensor q = RandomTensor(DType::kFloat32, {kHeads, tokens, kDim}, rng);
  Tensor k = RandomTensor(DType::kFloat32, {kHeads, tokens, kDim}, rng);
  Tensor v = RandomTensor(DType::kFloat32, {kHeads, tokens, kDim}, rng);
  for (int64_t layer = 0; layer < 2; ++layer) {
    DecodeStepInputs in{std::nullopt, q.view(),     k.view(),
                        v.view(),     std::nullopt, layer};
    TensorResults results;
    int64_t length = 0;
    ASSERT_TRUE(store.Step(layered, in, {}, results, &length).ok());
    EXPECT_EQ(length, tokens);
  }
  EXPECT_EQ(store.stats().evicted, 0);
  // The third layer's tokens pass the budget with the single session's.
  TensorResults results;
  int64_t length = -1;
  SessionStore::StepInput step{
      layered,
      {std::nullopt, q.view(), k.view(), v.view(), std::nullopt, 2},
      {},
      &results,
      &length};
  const std::vector<absl::Status> statuses = store.StepMany({step});
  ASSERT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_EQ(length, tokens);
  EXPECT_EQ(store.stats().evicted, 1);
  EXPECT_EQ(store.stats().cache_bytes, 3 * CacheBytes(tokens));
  // Layer 0 (StepTokens' default) goes on from its own length.
  int64_t after = 0;
  ASSERT_TRUE(StepTokens(store, layered, 1, rng, nullptr, &after).ok());
  EXPECT_EQ(after, tokens + 1);
}

TEST(SessionStoreTest, FreedSessionsGiveTheirMemoryBack) {
#ifdef ATTNSERVE_SANITIZED
  // Their allocators hold freed step buffers in quarantine, which the
  // resident set then counts.
  GTEST_SKIP() << "resident memory under a sanitizer measures its allocator";
#endif
  SessionStore store({});
  std::mt19937 rng(6);
  // Four sessions of 8192 tokens x 2 heads x 64 x 4 bytes x (K and V) =
  // 8 MiB each, filled and deleted; the first round also warms the buffer
  // pool that the steps' inputs and outputs come from, which keeps its
  // buffers.
  size_t before = 0, full = 0;
  for (int round = 0; round < 2; ++round) {
    if (round == 1) before = ResidentBytes();
    std::vector<std::string> ids;
    for (int i = 0; i < 4; ++i) {
      ids.push_back(*store.Add(NewSession(/*max_length=*/32768)));
      ASSERT_TRUE(StepTokens(store, ids.back(), 8192, rng).ok());
    }
    full = ResidentBytes();
    EXPECT_EQ(store.stats().cache_bytes, 4 * CacheBytes(8192));
    for (const std::string& id : ids) ASSERT_TRUE(store.Delete(id).ok());
  }
  const size_t after = ResidentBytes();
  EXPECT_GE(full, before + size_t{30} * 1024 * 1024);
  EXPECT_LE(after, before + size_t{2} * 1024 * 1024)
      << "before " << before << " full " << full << " after " << after;
}

// A tiny session of `layers` layers (1 head of 1 dim): its cache reserves
// 2 pages a layer (keys and values) and commits nothing until stepped.
DecodeSessionConfig TinyLayers(int64_t layers, int64_t max_length = 1) {
  DecodeSessionConfig config;
  config.num_heads = 1;
  config.key_dim = 1;
  config.max_length = max_length;
  config.num_layers = layers;
  return config;
}

// A layer count past any model's is refused before anything is allocated;
// one whose bookkeeping does not fit beside its cache is too, naming
// num_layers, the flag and how many layers fit; both by the store's check
// (what a server asks before creating the session) and by Add.
TEST(SessionStoreTest, SessionsOfTooManyLayersAreRefused) {
  if (sysconf(_SC_PAGESIZE) != 4096) GTEST_SKIP() << "messages for 4 KiB";
  SessionStore::Options options;
  options.max_bytes = size_t{8} << 20;
  SessionStore store(options);
  const DecodeSessionConfig huge = TinyLayers(524287);
  EXPECT_EQ(store.VerifyConfig(huge).message(),
            "num_layers: 524287 is more than the 1024 layers a session may "
            "hold");
  EXPECT_EQ(DecodeSession::Create(huge).status().message(),
            store.VerifyConfig(huge).message());
  // 1024 layers x 2 pages of cache fill the 8 MiB exactly; their 1024 x
  // 48 bytes of bookkeeping (12 pages) do not fit beside them.
  const DecodeSessionConfig config = TinyLayers(1024);
  const absl::Status refused = store.VerifyConfig(config);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.message(),
            "num_layers: 1024 layers reserve 8388608 bytes of cache and 49152 "
            "of bookkeeping (lengths and block tables, 48 bytes a layer), "
            "8437760 in all, more than --max_session_memory_mb 8 allows one "
            "session; at most 1018 layers fit");
  EXPECT_EQ(store.Add(*DecodeSession::Create(config)).status(), refused);
  EXPECT_EQ(store.stats().open, 0);
  EXPECT_TRUE(store.VerifyConfig(TinyLayers(1018)).ok());
  EXPECT_FALSE(store.VerifyConfig(TinyLayers(1019)).ok());
  EXPECT_TRUE(store.Add(*DecodeSession::Create(TinyLayers(1018))).ok());
  // One layer of 2^20 tokens: 2 x 4 MiB of cache, and 2 x 2048 block
  // pointers (9 pages); what does not fit is its max_length.
  EXPECT_EQ(store.VerifyConfig(TinyLayers(1, 1 << 20)).message(),
            "max_length: its cache reserves 8388608 bytes and its bookkeeping "
            "(lengths and block tables) 36864, 8425472 in all, more than "
            "--max_session_memory_mb 8 allows one session");
}

// A session's bookkeeping is, per layer, its length, written tokens, first
// own token and table size (4 x 8 bytes) and one pointer per block of 512
// tokens for keys and for values (and for an INT8 cache's key and value
// scales); from a page on, whole pages. The budget counts it from Add on
// and gives it back when the session goes.
TEST(SessionStoreTest, BudgetCountsPerLayerBookkeeping) {
  DecodeSessionConfig config;
  config.num_heads = kHeads;
  config.key_dim = kDim;
  config.max_length = 1000;  // 2 blocks
  config.num_layers = 3;
  const KvCache::Dims dims = *DecodeSession::CacheDims(config);
  EXPECT_EQ(sizeof(SessionLayers::Layer), 32u);
  EXPECT_EQ(DecodeSession::BookkeepingBytes(dims), 3u * (32 + 2 * 8 * 2));
  KvCache::Dims int8 = dims;
  int8.dtype = DType::kInt8;
  EXPECT_EQ(DecodeSession::BookkeepingBytes(int8), 3u * (32 + 4 * 8 * 2));
  KvCache::Dims deep = dims;
  deep.layers = 64;
  deep.max_length = 32768;  // 64 blocks: 64 x 1056 bytes, 16.5 pages
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  EXPECT_EQ(DecodeSession::BookkeepingBytes(deep),
            (64 * 1056 + page - 1) / page * page);

  SessionStore store({});
  std::mt19937 rng(11);
  auto session = DecodeSession::Create(config);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->bookkeeping_bytes(), 192u);
  const std::string id = *store.Add(*std::move(session));
  SessionStore::Stats stats = store.stats();
  EXPECT_EQ(stats.bookkeeping_bytes, 192u);
  EXPECT_EQ(stats.cache_bytes, 0u);
  EXPECT_EQ(stats.budget_bytes, 192u);
  ASSERT_TRUE(StepTokens(store, id, 10, rng).ok());
  stats = store.stats();
  EXPECT_EQ(stats.budget_bytes, stats.cache_bytes + 192u);
  ASSERT_TRUE(store.Delete(id).ok());
  stats = store.stats();
  EXPECT_EQ(stats.bookkeeping_bytes, 0u);
  EXPECT_EQ(stats.budget_bytes, 0u);
}

// Sessions that hold nothing but bookkeeping still fill the budget: past
// it, the least recently used go.
TEST(SessionStoreTest, BookkeepingEvictsTheLeastRecentlyUsed) {
  const KvCache::Dims dims = *DecodeSession::CacheDims(TinyLayers(1024));
  const size_t bookkeeping = DecodeSession::BookkeepingBytes(dims);
  const size_t one = *KvCache::ReservedBytes(dims) + bookkeeping;
  SessionStore::Options options;
  options.max_bytes = one;  // the bookkeeping of one / bookkeeping sessions
  SessionStore store(options);
  const size_t fit = one / bookkeeping;
  std::vector<std::string> ids;
  for (size_t i = 0; i <= fit; ++i) {
    auto id = store.Add(*DecodeSession::Create(TinyLayers(1024)));
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  SessionStore::Stats stats = store.stats();
  EXPECT_EQ(stats.evicted, 1);
  EXPECT_EQ(stats.bookkeeping_bytes, fit * bookkeeping);
  EXPECT_LE(stats.budget_bytes, options.max_bytes);
  EXPECT_EQ(store.Find(ids[0]).status().code(), absl::StatusCode::kNotFound);
  store.Clear();
  EXPECT_EQ(store.stats().budget_bytes, 0u);
}

// The bookkeeping of a deep session is a mapping of its own: deleting
// sessions gives its pages back to the system, whatever malloc keeps.
TEST(SessionStoreTest, FreedBookkeepingGoesBackToTheSystem) {
#ifdef ATTNSERVE_SANITIZED
  GTEST_SKIP() << "resident memory under a sanitizer measures its allocator";
#endif
  SessionStore store({});
  const size_t before = ResidentBytes();
  std::vector<std::string> ids;
  // 512 sessions x 1024 layers x 32 bytes of records written at creation.
  for (int i = 0; i < 512; ++i) {
    ids.push_back(*store.Add(*DecodeSession::Create(TinyLayers(1024, 512))));
  }
  const size_t full = ResidentBytes();
  EXPECT_EQ(store.stats().bookkeeping_bytes, 512u * 48 * 1024);
  for (const std::string& id : ids) ASSERT_TRUE(store.Delete(id).ok());
  const size_t after = ResidentBytes();
  EXPECT_GE(full, before + size_t{14} * 1024 * 1024);
  EXPECT_LE(after, before + size_t{2} * 1024 * 1024)
      << "before " << before << " full " << full << " after " << after;
}

// A self-attention layer of width 16: 4 heads (2 key/value heads) of 4
// dims, biases and an output projection.
std::shared_ptr<const MultiHeadLayer> NewModelLayer(int seed) {
  std::mt19937 rng(seed);
  Tensor wq = RandomTensor(DType::kFloat32, {16, 16}, rng);
  Tensor wk = RandomTensor(DType::kFloat32, {8, 16}, rng);
  Tensor wv = RandomTensor(DType::kFloat32, {8, 16}, rng);
  Tensor wo = RandomTensor(DType::kFloat32, {16, 16}, rng);
  Tensor bq = RandomTensor(DType::kFloat32, {16}, rng);
  Tensor bk = RandomTensor(DType::kFloat32, {8}, rng);
  Tensor bv = RandomTensor(DType::kFloat32, {8}, rng);
  MultiHeadWeights w;
  w.num_heads = 4;
  w.num_kv_heads = 2;
  w.q_proj_weight = wq.view();
  w.k_proj_weight = wk.view();
  w.v_proj_weight = wv.view();
  w.out_proj_weight = wo.view();
  w.q_proj_bias = bq.view();
  w.k_proj_bias = bk.view();
  w.v_proj_bias = bv.view();
  auto layer = MultiHeadLayer::Create(w, {});
  EXPECT_TRUE(layer.ok()) << layer.status();
  return *layer;
}

std::unique_ptr<DecodeSession> ModelSession(
    std::shared_ptr<const MultiHeadLayer> layer) {
  DecodeSessionConfig config;
  config.layer = std::move(layer);
  config.max_length = 64;
  return *DecodeSession::Create(config);
}

// A model replaced in the repository stays alive while sessions hold it:
// its weights are counted in the budget once, however many sessions hold
// it, from the moment it is no longer served, and released with the last
// of them.
TEST(SessionStoreTest, SupersededModelIsCountedOnceUntilItsLastSession) {
  std::shared_ptr<const MultiHeadLayer> old_model = NewModelLayer(1);
  std::shared_ptr<const MultiHeadLayer> new_model = NewModelLayer(2);
  // (16 + 8 + 8) rows of 16 weights and a bias, and 16 of 16 + 1.
  const size_t weights = ((16 + 8 + 8) * 17 + 16 * 17) * sizeof(float);
  EXPECT_EQ(DecodeSession::ModelBytes(*old_model), weights);
  Mutex mu;
  const MultiHeadLayer* served = old_model.get();
  SessionStore::Options options;
  options.model_served = [&](const MultiHeadLayer& layer) {
    MutexLock lock(&mu);
    return &layer == served;
  };
  SessionStore store(options);
  const std::string a = *store.Add(ModelSession(old_model));
  const std::string b = *store.Add(ModelSession(old_model));
  EXPECT_EQ(store.stats().superseded_models, 0);
  const size_t bookkeeping = store.stats().bookkeeping_bytes;
  {
    MutexLock lock(&mu);
    served = new_model.get();  // a reload
  }
  store.RecountModels();
  SessionStore::Stats stats = store.stats();
  EXPECT_EQ(stats.superseded_models, 1);
  EXPECT_EQ(stats.superseded_model_bytes, weights);
  EXPECT_EQ(stats.budget_bytes, bookkeeping + weights);
  // A fork and a session on the new model add no weights; a session
  // opened on the old one is counted at once, with it.
  const std::string fork = *store.Fork(a, std::nullopt);
  const std::string c = *store.Add(ModelSession(new_model));
  const std::string d = *store.Add(ModelSession(old_model));
  stats = store.stats();
  EXPECT_EQ(stats.superseded_models, 1);
  EXPECT_EQ(stats.superseded_model_bytes, weights);
  for (const std::string& id : {a, b, fork}) {
    ASSERT_TRUE(store.Delete(id).ok());
    EXPECT_EQ(store.stats().superseded_model_bytes, weights);
  }
  ASSERT_TRUE(store.Delete(d).ok());
  stats = store.stats();
  EXPECT_EQ(stats.superseded_models, 0);
  EXPECT_EQ(stats.superseded_model_bytes, 0u);
  ASSERT_TRUE(store.Delete(c).ok());
  EXPECT_EQ(store.stats().budget_bytes, 0u);
}

// A superseded model's weights take budget: when they pass it, the least
// recently used sessions go; a step that could not fit beside them even
// alone is refused, saying why.
TEST(SessionStoreTest, SupersededModelTakesBudget) {
  std::shared_ptr<const MultiHeadLayer> model = NewModelLayer(3);
  std::atomic<bool> served{true};
  SessionStore::Options options;
  options.model_served = [&](const MultiHeadLayer&) { return served.load(); };
  const size_t weights = DecodeSession::ModelBytes(*model);
  const size_t bookkeeping = ModelSession(model)->bookkeeping_bytes();
  const size_t reserved = ModelSession(model)->reserved_bytes();
  // One model session's whole cache and bookkeeping, and the weights.
  options.max_bytes = reserved + bookkeeping + weights;
  SessionStore store(options);
  std::mt19937 rng(12);
  const std::string holder = *store.Add(ModelSession(model));
  std::vector<std::string> others;
  for (int i = 0; i < 2; ++i) {
    others.push_back(*store.Add(*DecodeSession::Create(TinyLayers(1))));
    Tensor t = RandomTensor(DType::kFloat32, {1, 1, 1}, rng);
    DecodeStepInputs in;
    in.query = in.key = in.value = t.view();
    TensorResults results;
    ASSERT_TRUE(store.Step(others.back(), in, {}, results, nullptr).ok());
  }
  ASSERT_TRUE(store.Find(holder).ok());  // others[0] is the oldest
  served = false;
  store.RecountModels();
  SessionStore::Stats stats = store.stats();
  EXPECT_EQ(stats.evicted, 1);
  EXPECT_EQ(stats.superseded_model_bytes, weights);
  EXPECT_EQ(store.Find(others[0]).status().code(), absl::StatusCode::kNotFound);
  // The holder's whole cache fits beside its model's weights alone.
  Tensor x = RandomTensor(DType::kFloat32, {64, 16}, rng);
  DecodeStepInputs in;
  in.input = x.view();
  TensorResults results;
  EXPECT_TRUE(store.Step(holder, in, {}, results, nullptr).ok());
  stats = store.stats();
  EXPECT_EQ(stats.evicted, 2);
  EXPECT_EQ(stats.budget_bytes, options.max_bytes);
  ASSERT_TRUE(store.Delete(holder).ok());
  EXPECT_EQ(store.stats().budget_bytes, 0u);

  // One byte less: its cache does not, and the step says so.
  options.max_bytes -= 1;
  SessionStore tight(options);
  served = true;
  const std::string id = *tight.Add(ModelSession(model));
  served = false;
  tight.RecountModels();
  const absl::Status refused = tight.Step(id, in, {}, results, nullptr);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.message(),
            absl::StrCat("session_id: session \"", id, "\" would need ",
                         reserved, " bytes of cache, ", bookkeeping,
                         " of bookkeeping and ", weights,
                         " of the weights of its model, which the repository "
                         "no longer serves, more than the server's session "
                         "memory limit of ",
                         options.max_bytes,
                         " bytes; open a new session on the served model"));
}

}  // namespace
}  // namespace attnserve::testing
