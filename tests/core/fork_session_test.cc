// Forked decode sessions (DecodeSession::Fork, SessionStore::Fork): a fork
// and its parent, each stepped on its own way (appends, rewinds into the
// shared tokens, forks of forks, the parent deleted), answer every step
// bit for bit as a fresh session given the same history does; the store
// counts a shared cache once and frees it with its last holder; 64 forks
// of one prefix hold one copy of it in resident memory.
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention_kernel.h"
#include "core/decode_session.h"
#include "core/session_store.h"
#include "gtest/gtest.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {
namespace {

constexpr int64_t kBatch = 2;
constexpr int kHeads = 4;
constexpr int kKvHeads = 2;
constexpr int64_t kKeyDim = 16;
constexpr int64_t kValueDim = 8;

// INT8: float32 attention on an int8 cache.
DecodeSessionConfig Config(DType dtype, int64_t layers = 1) {
  DecodeSessionConfig config;
  config.num_layers = layers;
  config.num_heads = kHeads;
  config.num_kv_heads = kKvHeads;
  config.key_dim = kKeyDim;
  config.value_dim = kValueDim;
  config.dtype = dtype;
  config.rotary.dims = 8;  // positions matter
  config.batch = kBatch;
  config.max_length = 8192;
  return config;
}

std::unique_ptr<DecodeSession> NewSession(DType dtype, int64_t layers = 1) {
  auto session = DecodeSession::Create(Config(dtype, layers));
  EXPECT_TRUE(session.ok()) << session.status();
  return session.ok() ? std::move(*session) : nullptr;
}

std::unique_ptr<DecodeSession> ForkOf(DecodeSession& s,
                                      std::optional<int64_t> length) {
  auto fork = s.Fork(length);
  EXPECT_TRUE(fork.ok()) << fork.status();
  return fork.ok() ? std::move(*fork) : nullptr;
}

// The keys and values a sequence holds, as its steps gave them (before
// rotation), token-major: token t's rows for every (batch entry, head).
struct History {
  int64_t length = 0;
  std::vector<float> keys, values;

  static constexpr int64_t kKeyFloats = kBatch * kKvHeads * kKeyDim;
  static constexpr int64_t kValueFloats = kBatch * kKvHeads * kValueDim;

  // Tokens [start, start + n) become those of k and v ([B, Hkv, n, d]);
  // the ones after are dropped.
  void Write(int64_t start, const Tensor& k, const Tensor& v) {
    const int64_t n = k.shape()[2];
    length = start + n;
    keys.resize(length * kKeyFloats);
    values.resize(length * kValueFloats);
    const auto copy = [&](const Tensor& from, std::vector<float>& to,
                          int64_t d) {
      const float* src = static_cast<const float*>(from.data());
      for (int64_t b = 0; b < kBatch; ++b) {
        for (int64_t g = 0; g < kKvHeads; ++g) {
          for (int64_t t = 0; t < n; ++t) {
            std::memcpy(
                &to[((start + t) * kBatch * kKvHeads + b * kKvHeads + g) * d],
                src + ((b * kKvHeads + g) * n + t) * d, d * sizeof(float));
          }
        }
      }
    };
    copy(k, keys, kKeyDim);
    copy(v, values, kValueDim);
  }

  // The first `n` tokens as step inputs [B, Hkv, n, d].
  Tensor Prefix(int64_t n, bool of_keys) const {
    const int64_t d = of_keys ? kKeyDim : kValueDim;
    const std::vector<float>& from = of_keys ? keys : values;
    Tensor t = *Tensor::Allocate(DType::kFloat32, {kBatch, kKvHeads, n, d});
    float* to = static_cast<float*>(t.data());
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t g = 0; g < kKvHeads; ++g) {
        for (int64_t i = 0; i < n; ++i) {
          std::memcpy(to + ((b * kKvHeads + g) * n + i) * d,
                      &from[(i * kBatch * kKvHeads + b * kKvHeads + g) * d],
                      d * sizeof(float));
        }
      }
    }
    return t;
  }
};

struct StepData {
  Tensor q, k, v;
};

StepData RandomStep(int64_t n, std::mt19937& rng) {
  return {RandomTensor(DType::kFloat32, {kBatch, kHeads, n, kKeyDim}, rng),
          RandomTensor(DType::kFloat32, {kBatch, kKvHeads, n, kKeyDim}, rng),
          RandomTensor(DType::kFloat32, {kBatch, kKvHeads, n, kValueDim}, rng)};
}

absl::StatusOr<Tensor> RunStep(DecodeSession& s, const StepData& data,
                               std::optional<int64_t> position,
                               const std::atomic<bool>* cancelled = nullptr,
                               int64_t layer = 0) {
  DecodeStepInputs in;
  in.layer = layer;
  in.query = data.q.view();
  in.key = data.k.view();
  in.value = data.v.view();
  in.position = position;
  DecodeStepOptions options;
  options.cancelled = cancelled;
  TensorResults results;
  const absl::Status status = s.Step(in, options, results);
  if (!status.ok()) return status;
  return *results.Take("output");
}

// Steps `s` by `n` new tokens at `position` (after its tokens when unset),
// and a fresh session given the history's tokens up to there in one step
// and then the same new tokens: the two outputs agree bit for bit. The new
// tokens go into `history`.
// `layer` of a multi-layer session is compared with a fresh one-layer
// session.
void ExpectStepLikeFresh(DecodeSession& s, History& history, int64_t n,
                         std::optional<int64_t> position, std::mt19937& rng,
                         const std::string& what, int64_t layer = 0) {
  SCOPED_TRACE(what);
  const int64_t start = position.value_or(history.length);
  ASSERT_EQ(s.length(layer), history.length);
  const StepData data = RandomStep(n, rng);
  auto got = RunStep(s, data, position, nullptr, layer);
  ASSERT_TRUE(got.ok()) << got.status();
  auto fresh = NewSession(s.config().dtype);
  if (start > 0) {
    StepData prefill = RandomStep(start, rng);
    prefill.k = history.Prefix(start, /*of_keys=*/true);
    prefill.v = history.Prefix(start, /*of_keys=*/false);
    ASSERT_TRUE(RunStep(*fresh, prefill, std::nullopt).ok());
  }
  auto want = RunStep(*fresh, data, std::nullopt);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(got->num_bytes(), want->num_bytes());
  EXPECT_EQ(std::memcmp(got->data(), want->data(), got->num_bytes()), 0)
      << "the step's output differs from a fresh session's";
  history.Write(start, data.k, data.v);
  EXPECT_EQ(s.length(layer), history.length);
}

// A session fed `length` tokens in steps of up to 700.
void Fill(DecodeSession& s, History& history, int64_t length, std::mt19937& rng,
          int64_t layer = 0) {
  while (history.length < length) {
    const int64_t n = std::min<int64_t>(700, length - history.length);
    const StepData data = RandomStep(n, rng);
    ASSERT_TRUE(RunStep(s, data, std::nullopt, nullptr, layer).ok());
    history.Write(history.length, data.k, data.v);
  }
}

struct ForkCase {
  int64_t length;
  DType dtype;
};

void PrintTo(const ForkCase& c, std::ostream* os) {
  *os << DTypeName(c.dtype) << " at " << c.length;
}

class ForkAtLengthTest : public ::testing::TestWithParam<ForkCase> {};

// Fork and parent diverge: one token (the split-KV kernel), 40 tokens (the
// tiled kernel) and 600 tokens (across blocks) each, different ones.
TEST_P(ForkAtLengthTest, ForkAndParentEachEqualAFreshSession) {
  const ForkCase c = GetParam();
  std::mt19937 rng(static_cast<unsigned>(c.length) + 7);
  auto parent = NewSession(c.dtype);
  History parent_history;
  Fill(*parent, parent_history, c.length, rng);
  auto fork = ForkOf(*parent, std::nullopt);
  ASSERT_NE(fork, nullptr);
  EXPECT_EQ(fork->length(), c.length);
  History fork_history = parent_history;
  for (int64_t n : {1, 40, 1, 600, 1}) {
    ExpectStepLikeFresh(*fork, fork_history, n, std::nullopt, rng,
                        absl::StrCat("fork, ", n, " tokens"));
    ExpectStepLikeFresh(*parent, parent_history, n, std::nullopt, rng,
                        absl::StrCat("parent, ", n, " tokens"));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Lengths, ForkAtLengthTest,
    ::testing::Values(
        ForkCase{0, DType::kFloat32}, ForkCase{1, DType::kFloat32},
        ForkCase{511, DType::kFloat32}, ForkCase{512, DType::kFloat32},
        ForkCase{513, DType::kFloat32}, ForkCase{4096, DType::kFloat32},
        ForkCase{1, DType::kBFloat16}, ForkCase{513, DType::kBFloat16},
        ForkCase{4096, DType::kBFloat16}, ForkCase{1, DType::kInt8},
        ForkCase{513, DType::kInt8}, ForkCase{4096, DType::kInt8}),
    [](const ::testing::TestParamInfo<ForkCase>& info) {
      return absl::StrCat(DTypeName(info.param.dtype), "_", info.param.length);
    });

// Each layer of a multi-layer session is shared and copied on its own:
// layers at different lengths (a token stepped part way through the
// layers), forked, then each layer of fork and parent stepped, equal to a
// fresh one-layer session with that layer's history.
TEST(ForkSessionTest, MultiLayerForksShareEveryLayer) {
  for (DType dtype : {DType::kFloat32, DType::kInt8}) {
    SCOPED_TRACE(DTypeName(dtype));
    std::mt19937 rng(11);
    constexpr int64_t kLayers = 3;
    auto parent = NewSession(dtype, kLayers);
    std::vector<History> parent_history(kLayers);
    const int64_t lengths[kLayers] = {600, 600, 599};
    for (int64_t l = 0; l < kLayers; ++l) {
      Fill(*parent, parent_history[l], lengths[l], rng, l);
    }
    auto fork = ForkOf(*parent, std::nullopt);
    ASSERT_NE(fork, nullptr);
    std::vector<History> fork_history = parent_history;
    for (int64_t l = 0; l < kLayers; ++l) {
      EXPECT_EQ(fork->length(l), lengths[l]);
      for (int64_t n : {1, 40}) {
        ExpectStepLikeFresh(*fork, fork_history[l], n, std::nullopt, rng,
                            absl::StrCat("fork, layer ", l, ", ", n), l);
        ExpectStepLikeFresh(*parent, parent_history[l], n, std::nullopt, rng,
                            absl::StrCat("parent, layer ", l, ", ", n), l);
      }
    }
    // A shorter fork must fit every layer.
    auto refused = parent->Fork(700);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(refused.status().message(),
              "length: 700 is not in [0, 641] (the tokens layer 0 of the "
              "session holds)");
  }
}

// A rewind into the shared tokens, on either side, changes nothing for the
// other: they read the frozen copy, the rewinding side its own.
TEST(ForkSessionTest, RewindIntoTheSharedPartLeavesTheOtherIntact) {
  for (bool fork_rewinds : {true, false}) {
    SCOPED_TRACE(fork_rewinds ? "the fork rewinds" : "the parent rewinds");
    std::mt19937 rng(11);
    auto parent = NewSession(DType::kFloat32);
    History parent_history;
    Fill(*parent, parent_history, 1500, rng);
    auto fork = ForkOf(*parent, std::nullopt);
    ASSERT_NE(fork, nullptr);
    History fork_history = parent_history;
    DecodeSession& rewinder = fork_rewinds ? *fork : *parent;
    DecodeSession& other = fork_rewinds ? *parent : *fork;
    History& rewinder_history = fork_rewinds ? fork_history : parent_history;
    History& other_history = fork_rewinds ? parent_history : fork_history;
    // Into the third block, then into the first, then on across the
    // second, still shared.
    ExpectStepLikeFresh(rewinder, rewinder_history, 2, 1100, rng,
                        "rewind 1100");
    ExpectStepLikeFresh(other, other_history, 1, std::nullopt, rng, "other");
    ExpectStepLikeFresh(rewinder, rewinder_history, 3, 100, rng, "rewind 100");
    ExpectStepLikeFresh(other, other_history, 40, std::nullopt, rng, "other");
    ExpectStepLikeFresh(rewinder, rewinder_history, 700, std::nullopt, rng,
                        "append 700 after the rewind");
    ExpectStepLikeFresh(other, other_history, 1, std::nullopt, rng, "other");
  }
}

// A failed step on a fork (cancelled) that rewound into the shared part
// leaves both sides as they were.
TEST(ForkSessionTest, FailedRewindOfAForkChangesNothing) {
  std::mt19937 rng(12);
  auto parent = NewSession(DType::kFloat32);
  History parent_history;
  Fill(*parent, parent_history, 900, rng);
  auto fork = ForkOf(*parent, std::nullopt);
  ASSERT_NE(fork, nullptr);
  History fork_history = parent_history;
  const std::atomic<bool> cancelled{true};
  const absl::StatusOr<Tensor> failed =
      RunStep(*fork, RandomStep(5, rng), 200, &cancelled);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(fork->length(), 900);
  ExpectStepLikeFresh(*fork, fork_history, 1, std::nullopt, rng, "fork");
  ExpectStepLikeFresh(*parent, parent_history, 1, std::nullopt, rng, "parent");
}

// Forks of forks, at lengths inside and past the shared part, the first
// ones deleted while the later ones step on.
TEST(ForkSessionTest, ForksOfForksAndDeletedParents) {
  std::mt19937 rng(13);
  auto root = NewSession(DType::kFloat32);
  History root_history;
  Fill(*root, root_history, 1000, rng);
  auto child = ForkOf(*root, std::nullopt);
  ASSERT_NE(child, nullptr);
  History child_history = root_history;
  ExpectStepLikeFresh(*child, child_history, 300, std::nullopt, rng, "child");
  // Past the root's tokens: the child's own ones are frozen too.
  auto grandchild = ForkOf(*child, std::nullopt);
  ASSERT_NE(grandchild, nullptr);
  History grandchild_history = child_history;
  // Inside the root's part: reads the root's frozen cache only.
  auto short_fork = ForkOf(*child, 700);
  ASSERT_NE(short_fork, nullptr);
  EXPECT_EQ(short_fork->length(), 700);
  History short_history = child_history;
  short_history.length = 700;
  root.reset();
  ExpectStepLikeFresh(*child, child_history, 1, std::nullopt, rng, "child");
  child.reset();
  ExpectStepLikeFresh(*grandchild, grandchild_history, 1, std::nullopt, rng,
                      "grandchild");
  ExpectStepLikeFresh(*grandchild, grandchild_history, 600, 1200, rng,
                      "grandchild rewinds");
  ExpectStepLikeFresh(*short_fork, short_history, 40, std::nullopt, rng,
                      "short fork");
  ExpectStepLikeFresh(*short_fork, short_history, 1, 10, rng,
                      "short fork rewinds");
}

// A copy of `from`'s first `tokens` tokens (every layer) in a session of
// its own, through CopyRows and AppendRows, with byte `flip` of the rows of
// block `flip_block` (layer 0) changed when set.
std::unique_ptr<DecodeSession> CopyOf(const DecodeSession& from, int64_t tokens,
                                      std::optional<int64_t> flip_block = {}) {
  auto copy = DecodeSession::Create(from.config());
  EXPECT_TRUE(copy.ok()) << copy.status();
  for (int64_t first = 0; first < tokens; first += kCacheBlockKeys) {
    const int64_t n = std::min(kCacheBlockKeys, tokens - first);
    std::string rows;
    EXPECT_TRUE(from.CopyRows(0, first, n, rows).ok());
    if (flip_block == first / kCacheBlockKeys) rows[rows.size() / 3] ^= 1;
    EXPECT_TRUE((*copy)->AppendRows(0, first, n, rows).ok());
  }
  return std::move(*copy);
}

class SharedPrefixTest : public ::testing::TestWithParam<DType> {};

// What a session taken up from a file is checked with before it shares the
// blocks of one held: whole blocks, bit for bit, of the same config.
TEST_P(SharedPrefixTest, CountsWholeBlocksHeldAlike) {
  std::mt19937 rng(21);
  auto held = NewSession(GetParam());
  History history;
  Fill(*held, history, 1300, rng);
  EXPECT_EQ(CopyOf(*held, 1300)->SharedPrefix(*held), 1024);
  EXPECT_EQ(CopyOf(*held, 1100)->SharedPrefix(*held), 1024);
  EXPECT_EQ(CopyOf(*held, 1000)->SharedPrefix(*held), 512);
  EXPECT_EQ(CopyOf(*held, 1300, 1)->SharedPrefix(*held), 512);
  EXPECT_EQ(CopyOf(*held, 1300, 0)->SharedPrefix(*held), 0);
  EXPECT_EQ(held->SharedPrefix(*held), 0);
  DecodeSessionConfig other = Config(GetParam());
  other.max_length = 4096;
  auto unlike = DecodeSession::Create(other);
  ASSERT_TRUE(unlike.ok());
  std::string rows;
  ASSERT_TRUE(held->CopyRows(0, 0, 1024, rows).ok());
  ASSERT_TRUE((*unlike)->AppendRows(0, 0, 1024, rows).ok());
  EXPECT_EQ((*unlike)->SharedPrefix(*held), 0);
}

// A fork at the shared prefix with the rest appended answers as the copy
// it stands for; rows inside the shared blocks are refused.
TEST_P(SharedPrefixTest, AForkWithTheRestAppendedStepsAsTheCopy) {
  std::mt19937 rng(22);
  auto held = NewSession(GetParam());
  History history;
  Fill(*held, history, 1300, rng);
  auto copy = CopyOf(*held, 1300);
  auto fork = ForkOf(*held, 1024);
  ASSERT_NE(fork, nullptr);
  std::string rows;
  ASSERT_TRUE(copy->CopyRows(0, 512, 100, rows).ok());
  EXPECT_EQ(fork->AppendRows(0, 512, 100, rows).message(),
            "rows: token 512 of layer 0 is in a block shared with other "
            "sessions; append past token 1024");
  rows.clear();
  ASSERT_TRUE(copy->CopyRows(0, 1024, 276, rows).ok());
  ASSERT_TRUE(fork->AppendRows(0, 1024, 276, rows).ok());
  EXPECT_EQ(fork->length(), 1300);
  for (int64_t n : {1, 40, 600}) {
    const StepData data = RandomStep(n, rng);
    auto want = RunStep(*copy, data, std::nullopt);
    auto got = RunStep(*fork, data, std::nullopt);
    auto parent = RunStep(*held, data, std::nullopt);
    ASSERT_TRUE(want.ok() && got.ok() && parent.ok());
    EXPECT_EQ(std::memcmp(got->data(), want->data(), got->num_bytes()), 0)
        << n << " tokens";
    EXPECT_EQ(std::memcmp(parent->data(), want->data(), got->num_bytes()), 0)
        << n << " tokens";
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SharedPrefixTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16,
                                           DType::kInt8),
                         [](const auto& info) {
                           return std::string(DTypeName(info.param));
                         });

TEST(ForkSessionTest, LengthIsChecked) {
  std::mt19937 rng(14);
  auto s = NewSession(DType::kFloat32);
  History history;
  Fill(*s, history, 10, rng);
  EXPECT_EQ(s->Fork(11).status().message(),
            "length: 11 is not in [0, 10] (the tokens the session holds)");
  EXPECT_EQ(s->Fork(-1).status().code(), absl::StatusCode::kInvalidArgument);
  auto empty = ForkOf(*s, 0);
  ASSERT_NE(empty, nullptr);
  EXPECT_EQ(empty->length(), 0);
  EXPECT_TRUE(empty->shared_caches().empty());
}

// The kernel takes a block table only where it reads keys block by block.
TEST(ForkSessionTest, KernelRefusesWeightsFromABlockTable) {
  std::vector<float> q(8, 1.0f), k(8, 1.0f), v(8, 1.0f), out(8), weights(1);
  const void* blocks[] = {k.data()};
  const void* value_blocks[] = {v.data()};
  AttentionProblem p;
  p.batch = 1;
  p.query_len = 1;
  p.key_len = 1;
  p.key_dim = 8;
  p.value_dim = 8;
  p.query = q.data();
  p.query_layout = DenseLayout(1, 1, 8);
  p.key = k.data();
  p.key_layout = DenseLayout(1, 1, 8);
  p.value = v.data();
  p.value_layout = DenseLayout(1, 1, 8);
  p.output = out.data();
  p.output_layout = DenseLayout(1, 1, 8);
  p.key_blocks = blocks;
  p.value_blocks = value_blocks;
  EXPECT_TRUE(RunAttention(p).ok());
  p.weights = weights.data();
  EXPECT_EQ(RunAttention(p).message(),
            "attention: weights cannot be returned from a block-table cache");
}

// The store: what each side holds, counted once.
constexpr int64_t kStoreHeads = 8;
constexpr int64_t kStoreDim = 64;

std::unique_ptr<DecodeSession> StoreSession(int64_t max_length = 8192) {
  DecodeSessionConfig config;
  config.num_heads = kStoreHeads;
  config.key_dim = kStoreDim;
  config.max_length = max_length;
  return *DecodeSession::Create(config);
}

// Cache bytes of tokens [first, end) of one such session (float32 K and
// V, page-rounded per plane).
size_t StoreBytes(int64_t first, int64_t end) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t row = kStoreDim * sizeof(float);
  const size_t plane =
      (end * row + page - 1) / page * page - first * row / page * page;
  return plane * 2 * kStoreHeads;
}

absl::Status StoreStep(SessionStore& store, const std::string& id, int64_t n,
                       std::mt19937& rng,
                       std::optional<int64_t> position = std::nullopt) {
  Tensor q = RandomTensor(DType::kFloat32, {kStoreHeads, n, kStoreDim}, rng);
  Tensor k = RandomTensor(DType::kFloat32, {kStoreHeads, n, kStoreDim}, rng);
  Tensor v = RandomTensor(DType::kFloat32, {kStoreHeads, n, kStoreDim}, rng);
  DecodeStepInputs in;
  in.query = q.view();
  in.key = k.view();
  in.value = v.view();
  in.position = position;
  TensorResults results;
  return store.Step(id, in, {}, results, nullptr);
}

TEST(ForkSessionStoreTest, SharedCacheIsCountedOnceAndFreedWithItsLastHolder) {
  SessionStore store({});
  std::mt19937 rng(15);
  const std::string parent = *store.Add(StoreSession());
  const size_t reservation = store.stats().reserved_bytes;
  ASSERT_TRUE(StoreStep(store, parent, 4096, rng).ok());
  EXPECT_EQ(store.stats().cache_bytes, StoreBytes(0, 4096));
  int64_t length = -1;
  auto child = store.Fork(parent, std::nullopt, &length);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(length, 4096);
  SessionStore::Stats stats = store.stats();
  EXPECT_EQ(stats.cache_bytes, StoreBytes(0, 4096));
  EXPECT_EQ(stats.shared_bytes, StoreBytes(0, 4096));
  EXPECT_EQ(stats.shared_caches, 1);
  EXPECT_EQ(stats.forked, 1);
  EXPECT_EQ(stats.open, 2);
  // The frozen cache, the parent's new one and the child's.
  EXPECT_EQ(stats.reserved_bytes, 3 * reservation);
  // A second fork shares the same frozen cache.
  auto second = store.Fork(parent, 100, &length);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(length, 100);
  EXPECT_EQ(store.stats().shared_caches, 1);
  EXPECT_EQ(store.stats().reserved_bytes, 4 * reservation);
  // Each side's own tokens count for it alone.
  ASSERT_TRUE(StoreStep(store, *child, 1, rng).ok());
  ASSERT_TRUE(StoreStep(store, parent, 1, rng).ok());
  EXPECT_EQ(store.stats().cache_bytes,
            StoreBytes(0, 4096) + 2 * StoreBytes(4096, 4097));
  // A rewind into the shared part copies that block's earlier tokens for
  // the rewinder (and gives back its pages past the new length).
  ASSERT_TRUE(StoreStep(store, parent, 1, rng, 600).ok());
  EXPECT_EQ(
      store.stats().cache_bytes,
      StoreBytes(0, 4096) + StoreBytes(4096, 4097) + StoreBytes(512, 601));
  ASSERT_TRUE(store.Delete(parent).ok());
  ASSERT_TRUE(store.Delete(*second).ok());
  stats = store.stats();
  EXPECT_EQ(stats.cache_bytes, StoreBytes(0, 4096) + StoreBytes(4096, 4097));
  EXPECT_EQ(stats.shared_caches, 1);
  EXPECT_EQ(stats.reserved_bytes, 2 * reservation);
  ASSERT_TRUE(StoreStep(store, *child, 1, rng).ok());
  ASSERT_TRUE(store.Delete(*child).ok());
  stats = store.stats();
  EXPECT_EQ(stats.cache_bytes, 0u);
  EXPECT_EQ(stats.shared_bytes, 0u);
  EXPECT_EQ(stats.shared_caches, 0);
  EXPECT_EQ(stats.reserved_bytes, 0u);
}

// The budget counts the shared cache once: forks that each add a token fit
// where copies would not, and evicting one sharer frees its own part only.
TEST(ForkSessionStoreTest, BudgetAndEvictionCountSharedPagesOnce) {
  SessionStore::Options options;
  // The prefix and 8 forks' own tokens, not 2 copies of the prefix (and
  // the 9 sessions' bookkeeping).
  const size_t cache = StoreBytes(0, 4096) + 8 * StoreBytes(4096, 4097);
  options.max_bytes = cache + 9 * StoreSession(4160)->bookkeeping_bytes();
  SessionStore store(options);
  std::mt19937 rng(16);
  // A max_length whose reservation fits the budget.
  const std::string parent = *store.Add(StoreSession(4160));
  ASSERT_TRUE(StoreStep(store, parent, 4096, rng).ok());
  std::vector<std::string> forks;
  for (int i = 0; i < 8; ++i) {
    auto fork = store.Fork(parent, std::nullopt);
    ASSERT_TRUE(fork.ok()) << fork.status();
    forks.push_back(*fork);
    ASSERT_TRUE(StoreStep(store, forks.back(), 1, rng).ok());
  }
  EXPECT_EQ(store.stats().evicted, 0);
  EXPECT_EQ(store.stats().cache_bytes, cache);
  // The parent's first own token needs room: the least recently used fork
  // goes, and with it only its own part.
  ASSERT_TRUE(StoreStep(store, parent, 1, rng).ok());
  SessionStore::Stats stats = store.stats();
  EXPECT_EQ(stats.evicted, 1);
  EXPECT_EQ(stats.cache_bytes, cache);
  EXPECT_EQ(stats.shared_bytes, StoreBytes(0, 4096));
  EXPECT_EQ(StoreStep(store, forks[0], 1, rng).code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(StoreStep(store, forks[1], 1, rng).ok());
  // A rewind into the shared part makes room for the block it copies
  // before it copies it: the budget holds after the step too.
  ASSERT_TRUE(StoreStep(store, parent, 1, rng, 600).ok());
  stats = store.stats();
  EXPECT_LE(stats.cache_bytes, options.max_bytes);
  EXPECT_GE(stats.evicted, 2);
}

TEST(ForkSessionStoreTest, ForkMakesRoomButNeverEvictsItsParent) {
  SessionStore::Options options;
  options.max_sessions = 2;
  SessionStore store(options);
  std::mt19937 rng(17);
  const std::string other = *store.Add(StoreSession());
  const std::string parent = *store.Add(StoreSession());
  ASSERT_TRUE(StoreStep(store, parent, 10, rng).ok());
  auto fork = store.Fork(parent, std::nullopt);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(StoreStep(store, other, 1, rng).code(),
            absl::StatusCode::kNotFound);
  // Parent and fork are the two open, the parent used last: a fork of the
  // fork evicts the parent, the least recently used, not the fork.
  ASSERT_TRUE(StoreStep(store, parent, 1, rng).ok());
  auto again = store.Fork(*fork, std::nullopt);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(StoreStep(store, parent, 1, rng).code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(StoreStep(store, *fork, 1, rng).ok());
  ASSERT_TRUE(StoreStep(store, *again, 1, rng).ok());
  EXPECT_EQ(store.Fork("0123", std::nullopt).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Fork(*fork, 100000).status().message(),
            "length: 100000 is not in [0, 11] (the tokens the session holds)");
}

TEST(ForkSessionStoreTest, ForkThatCannotMakeRoomIsRefused) {
  SessionStore::Options options;
  options.max_sessions = 1;
  SessionStore store(options);
  std::mt19937 rng(19);
  const std::string parent = *store.Add(StoreSession());
  ASSERT_TRUE(StoreStep(store, parent, 10, rng).ok());
  EXPECT_EQ(store.Fork(parent, std::nullopt).status().message(),
            absl::StrCat("session_id: no room to fork session \"", parent,
                         "\": max_sessions 1 would be passed"));
  ASSERT_TRUE(StoreStep(store, parent, 1, rng).ok());
  const SessionStore::Stats stats = store.stats();
  EXPECT_EQ(stats.open, 1);
  EXPECT_EQ(stats.cache_bytes, StoreBytes(0, 11));
}

// Each fork after the parent wrote freezes the parent's cache once more
// (one more mapping each): the frozen caches are bounded by max_sessions,
// and a fork past that is refused with the parent unharmed.
TEST(ForkSessionStoreTest, FrozenCachesAreBoundedByMaxSessions) {
  SessionStore::Options options;
  options.max_sessions = 3;
  SessionStore store(options);
  std::mt19937 rng(23);
  const std::string parent = *store.Add(StoreSession());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(StoreStep(store, parent, 1, rng).ok());
    ASSERT_TRUE(store.Fork(parent, std::nullopt).ok()) << i;
  }
  EXPECT_EQ(store.stats().shared_caches, 3);
  ASSERT_TRUE(StoreStep(store, parent, 1, rng).ok());
  const auto refused = store.Fork(parent, std::nullopt);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.status().message(),
            "session_id: forks already share 3 frozen caches, as many as "
            "max_sessions 3 allows; delete sessions that forked or were "
            "forked first");
  EXPECT_EQ(store.stats().shared_caches, 3);
  EXPECT_TRUE(StoreStep(store, parent, 1, rng).ok());
}

// Resident set size of this process, from /proc/self/statm.
size_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

// 64 forks of a 4096-token prefix of 8 heads x 64 dims (16 MiB of float32
// keys and values), each one token further: resident memory grows by their
// own tokens (a page per plane each), not by 64 copies of the prefix.
TEST(ForkSessionStoreTest, SixtyFourForksHoldOneCopyOfThePrefix) {
#ifdef ATTNSERVE_SANITIZED
  GTEST_SKIP() << "resident memory under a sanitizer measures its allocator";
#endif
  SessionStore store({});
  std::mt19937 rng(18);
  const std::string parent = *store.Add(StoreSession());
  const size_t empty = ResidentBytes();
  ASSERT_TRUE(StoreStep(store, parent, 4096, rng).ok());
  // A step on a first fork warms the step buffers the others reuse.
  auto warm = store.Fork(parent, std::nullopt);
  ASSERT_TRUE(warm.ok());
  ASSERT_TRUE(StoreStep(store, *warm, 1, rng).ok());
  const size_t one = ResidentBytes();
  for (int i = 0; i < 64; ++i) {
    auto fork = store.Fork(parent, std::nullopt);
    ASSERT_TRUE(fork.ok()) << fork.status();
    ASSERT_TRUE(StoreStep(store, *fork, 1, rng).ok());
  }
  const size_t all = ResidentBytes();
  const size_t prefix = StoreBytes(0, 4096);
  EXPECT_GE(one - empty, prefix) << "the prefix is resident once";
  // Their own tokens: 64 x 16 planes x 2 pages of 4 KiB = 8 MiB, and a
  // little for the tables and session objects: well under one more copy.
  EXPECT_LE(all - one, 64 * StoreBytes(4096, 4097) + (size_t{1} << 20))
      << "prefix " << prefix << " one fork " << one - empty << " 64 more "
      << all - one;
  EXPECT_EQ(store.stats().cache_bytes, prefix + 65 * StoreBytes(4096, 4097));
}

}  // namespace
}  // namespace attnserve::testing
