// Google Benchmark suite for the core's operations, with the baselines each
// is held against measured in the same run:
//   - SDPA against the two raw batched GEMMs of attention (Q*K^T and P*V as
//     plain oneDNN matmuls),
//   - multi-head attention against a 2048^3 float32 GEMM,
//   - decode-shaped SDPA and LayerNorm against a memory copy of their bytes,
//   - decode steps (one session, and batches of sessions in one call)
//     against the machine's read bandwidth: an OpenMP read of an L3-sized
//     and of a DRAM-sized buffer (BM_ReadBandwidth). Their bytes_per_second
//     is the key/value cache read per second, to be divided by the read
//     bandwidth of the same run.
// ATTNSERVE_CPU_ISA caps the row kernels and oneDNN, as in the server (the
// ops:N argument of the row-kernel cases picks an implementation itself).
// Counters: GFLOP/s (FLOPs of the non-causal computation, so that causal and
// non-causal rates compare as speedups) and GB/s (bytes that must move).
#include <immintrin.h>
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "benchmark/benchmark.h"
#include "core/attention.h"
#include "core/convert.h"
#include "core/decode_session.h"
#include "core/multi_head_attention.h"
#include "core/primitives.h"
#include "core/row_ops.h"
#include "core/session_directory.h"
#include "core/session_file.h"
#include "core/session_store.h"
#include "core/tensor.h"
#include "core/thread_budget.h"

namespace attnserve {
namespace {

Tensor Random(DType dtype, Shape shape, uint32_t seed = 1) {
  Tensor t = *Tensor::Allocate(DType::kFloat32, shape);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  float* v = t.data_as<float>();
  for (int64_t i = 0; i < t.num_elements(); ++i) v[i] = uniform(rng);
  if (dtype == DType::kFloat32) return t;
  return *Float32ToTensor(t.data_as<float>(), shape, dtype);
}

// The row kernels of SupportedRowOps()[state.range(arg)] while it lives,
// named in the benchmark's label: one run compares every instruction set
// the CPU has.
class ScopedRowOps {
 public:
  ScopedRowOps(benchmark::State& state, int arg) {
    const RowOps* ops = SupportedRowOps()[state.range(arg)];
    SetRowOpsForTesting(ops);
    state.SetLabel(ops->name);
  }
  ~ScopedRowOps() { SetRowOpsForTesting(nullptr); }
};

// Adds each of `args` once per implementation SupportedRowOps lists (its
// index appended).
void PerRowOps(benchmark::internal::Benchmark* b,
               const std::vector<std::vector<int64_t>>& args) {
  for (std::vector<int64_t> a : args) {
    a.push_back(0);
    for (size_t i = 0; i < SupportedRowOps().size(); ++i) {
      a.back() = static_cast<int64_t>(i);
      b->Args(a);
    }
  }
}

void SetRate(benchmark::State& state, double flops, double bytes) {
  if (flops > 0) {
    state.counters["GFLOP/s"] = benchmark::Counter(
        flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  }
  if (bytes > 0) {
    state.counters["GB/s"] = benchmark::Counter(
        bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  }
}

// The decode kernels alone on one block of cached rows that stays in the
// L1/L2 caches (512 keys, one query row): the compute rate each kernel
// reaches when memory is not the bound. Args: d, cache (0 float32, 1
// bfloat16, 2 int8), kernel (0 dot_rows, 1 add_weighted_rows, 2
// quantize_int8: the 512 float32 rows a step appends to an int8 cache, cache
// 2 only; 3 exp_sum, 4 exp_sum_bf16 and 5 exp_sum_bf16_in_place: the
// softmax's exponentials of 512 rows of 512 logits, the in-place ones on a
// copy of each row, cache 0 only), ops (as BM_DecodeStep).
// bytes_per_second: the cached rows read (quantize_int8: the float32 rows;
// the exponentials: the logits).
void QuantizeRows(benchmark::State& state, const RowOps& ops, int64_t cols,
                  int64_t dim) {
  Tensor rows = Random(DType::kFloat32, {cols, dim}, 3);
  std::vector<int8_t> codes(static_cast<size_t>(cols * dim));
  std::vector<float> scales(static_cast<size_t>(cols));
  for (auto _ : state) {
    for (int64_t j = 0; j < cols; ++j) {
      scales[j] = ops.quantize_int8(rows.data_as<float>() + j * dim, dim,
                                    codes.data() + j * dim);
    }
    benchmark::DoNotOptimize(codes.data());
    benchmark::DoNotOptimize(scales.data());
  }
  SetRate(state, 0, 4.0 * cols * dim);
}

void Exponentials(benchmark::State& state, const RowOps& ops, int64_t cols,
                  int64_t kernel) {
  const int64_t rows = 512;
  Tensor logits = Random(DType::kFloat32, {rows, cols}, 7);
  std::vector<float> work(static_cast<size_t>(rows * cols));
  std::vector<uint16_t> out(static_cast<size_t>(cols));
  float sum = 0;
  for (auto _ : state) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = logits.data_as<float>() + r * cols;
      if (kernel == 4) {
        sum += ops.exp_sum_bf16(row, cols, 0.125f, 1.0f, out.data());
        continue;
      }
      float* x = work.data() + r * cols;
      std::memcpy(x, row, static_cast<size_t>(cols) * sizeof(float));
      sum += kernel == 3 ? ops.exp_sum(x, cols, 0.125f, 1.0f)
                         : ops.exp_sum_bf16_in_place(x, cols, 0.125f, 1.0f);
    }
    benchmark::DoNotOptimize(sum);
    benchmark::DoNotOptimize(out.data());
  }
  SetRate(state, 0, 4.0 * rows * cols);
}

void BM_RowKernel(benchmark::State& state) {
  const int64_t dim = state.range(0), cols = 512;
  constexpr RowType kTypes[] = {RowType::kFloat32, RowType::kBFloat16,
                                RowType::kInt8};
  const RowType type = kTypes[state.range(1)];
  const int64_t kernel = state.range(2);
  ScopedRowOps scoped(state, 3);
  const RowOps& ops = GetRowOps();
  if (kernel == 2) return QuantizeRows(state, ops, cols, dim);
  if (kernel >= 3) return Exponentials(state, ops, cols, kernel);
  // Float rows from Random; int8 rows as codes with one scale a row.
  Tensor rows =
      Random(type == RowType::kBFloat16 ? DType::kBFloat16 : DType::kFloat32,
             {type == RowType::kInt8 ? 1 : cols, dim}, 3);
  std::vector<int8_t> codes;
  std::vector<float> scales(static_cast<size_t>(cols), 1.0f / 127);
  if (type == RowType::kInt8) {
    std::mt19937 rng(4);
    codes.resize(static_cast<size_t>(cols * dim));
    for (int8_t& c : codes) c = static_cast<int8_t>(rng() % 255 - 127);
  }
  const CachedRows cached{type == RowType::kInt8 ? codes.data() : rows.data(),
                          dim, type, scales.data()};
  Tensor q = Random(DType::kFloat32, {dim}, 5);
  Tensor p = Random(DType::kFloat32, {cols}, 6);
  std::vector<float> out(static_cast<size_t>(std::max(cols, dim)));
  for (auto _ : state) {
    if (kernel == 0) {
      ops.dot_rows(q.data_as<float>(), 1, dim, cached, cols, out.data(), cols);
    } else {
      ops.add_weighted_rows(p.data_as<float>(), cols, 1, cached, cols, dim,
                            out.data());
    }
    benchmark::DoNotOptimize(out.data());
  }
  const double element = type == RowType::kInt8       ? 1
                         : type == RowType::kBFloat16 ? 2
                                                      : 4;
  SetRate(state, 2.0 * cols * dim, element * cols * dim);
}

int64_t MaxRssKiB() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

// Args: batch, heads, query_len, key_len, head_dim, causal, bf16 (bfloat16
// inputs on the bfloat16 kernels).
void BM_Sdpa(benchmark::State& state) {
  const int64_t b = state.range(0), h = state.range(1), lq = state.range(2),
                lk = state.range(3), d = state.range(4);
  const DType dtype = state.range(6) ? DType::kBFloat16 : DType::kFloat32;
  Tensor q = Random(dtype, {b, h, lq, d}, 1);
  Tensor k = Random(dtype, {b, h, lk, d}, 2);
  Tensor v = Random(dtype, {b, h, lk, d}, 3);
  AttentionOptions options;
  options.causal = state.range(5) != 0;
  options.compute_bf16 = dtype == DType::kBFloat16;
  AttendInputs in{q.view(), k.view(), v.view(), std::nullopt};
  const int64_t rss_before = MaxRssKiB();
  for (auto _ : state) {
    auto r = Attend(in, options);
    if (!r.ok()) state.SkipWithError(std::string(r.status().message()).c_str());
    benchmark::DoNotOptimize(r);
  }
  const double output_mib = double(b * h * lq * d * 4) / (1 << 20);
  state.counters["extra_MiB"] =
      std::max(0.0, double(MaxRssKiB() - rss_before) / 1024 - output_mib);
  SetRate(state, 4.0 * b * h * lq * lk * d,
          double(q.num_bytes() + k.num_bytes() + v.num_bytes()));
}

// Grouped-query attention. Args: B, H (query heads), Hkv (key/value heads),
// Lq, Lk, d. Hkv == H is the same call with key and value repeated to every
// query head, the baseline GQA is held against.
void BM_Gqa(benchmark::State& state) {
  const int64_t b = state.range(0), h = state.range(1), hkv = state.range(2),
                lq = state.range(3), lk = state.range(4), d = state.range(5);
  Tensor q = Random(DType::kFloat32, {b, h, lq, d}, 1);
  Tensor k = Random(DType::kFloat32, {b, hkv, lk, d}, 2);
  Tensor v = Random(DType::kFloat32, {b, hkv, lk, d}, 3);
  AttentionOptions options;
  options.enable_gqa = true;
  AttendInputs in{q.view(), k.view(), v.view(), std::nullopt};
  for (auto _ : state) {
    auto r = Attend(in, options);
    if (!r.ok()) state.SkipWithError(std::string(r.status().message()).c_str());
    benchmark::DoNotOptimize(r);
  }
  SetRate(state, 4.0 * b * h * lq * lk * d,
          double(q.num_bytes() + k.num_bytes() + v.num_bytes()));
}

// Key/value bytes a decode step over `tokens` cached tokens reads (an INT8
// cache's scales included).
double KvBytes(int64_t tokens, int64_t kv_heads, int64_t d, DType dtype) {
  const double scales = dtype == DType::kInt8 ? sizeof(float) : 0.0;
  return static_cast<double>(tokens * kv_heads * 2) *
         (static_cast<double>(d * DTypeSize(dtype)) + scales);
}

// The cache dtype of a benchmark argument: 0 float32, 1 bfloat16, 2 int8.
DType CacheDType(int64_t arg) {
  return arg == 2   ? DType::kInt8
         : arg == 1 ? DType::kBFloat16
                    : DType::kFloat32;
}

// An attention session of H query and Hkv key/value heads of dim d,
// prefilled with Lk random tokens, its cache in `dtype`.
absl::StatusOr<std::unique_ptr<DecodeSession>> PrefilledSession(
    int64_t h, int64_t hkv, int64_t d, int64_t lk, DType dtype, uint32_t seed) {
  DecodeSessionConfig config;
  config.num_heads = static_cast<int>(h);
  config.num_kv_heads = static_cast<int>(hkv);
  config.key_dim = d;
  config.max_length = lk + 1;
  config.dtype = dtype;
  auto session = DecodeSession::Create(config);
  if (!session.ok()) return session.status();
  // The prompt in chunks: each chunk's causal attention is cheaper than
  // one square prefill, and the cache ends the same.
  const int64_t chunk = 512;
  for (int64_t first = 0; first < lk; first += chunk) {
    const int64_t n = std::min(chunk, lk - first);
    Tensor q = Random(DType::kFloat32, {h, n, d}, seed + 3 * first);
    Tensor k = Random(DType::kFloat32, {hkv, n, d}, seed + 3 * first + 1);
    Tensor v = Random(DType::kFloat32, {hkv, n, d}, seed + 3 * first + 2);
    TensorResults results;
    DecodeStepInputs in{std::nullopt, q.view(), k.view(), v.view(),
                        std::nullopt};
    const absl::Status s = (*session)->Step(in, {}, results);
    if (!s.ok()) return s;
  }
  return session;
}

// One token's q, k, v for a session of H and Hkv heads of dim d.
std::array<Tensor, 3> TokenOperands(int64_t h, int64_t hkv, int64_t d,
                                    uint32_t seed) {
  return {Random(DType::kFloat32, {h, 1, d}, seed),
          Random(DType::kFloat32, {hkv, 1, d}, seed + 1),
          Random(DType::kFloat32, {hkv, 1, d}, seed + 2)};
}

// One decode step of an attention session holding Lk tokens: one new token
// of H query heads over Hkv key/value heads of dim d (each step rewinds to
// Lk, so the cache stays at Lk + 1), the cache in float32, bfloat16 or
// int8. Args: H, Hkv, d, Lk, cache (0 float32, 1 bfloat16, 2 int8), ops
// (index into SupportedRowOps: each implementation the CPU runs). Hkv ==
// H is the same step with keys and values repeated to every query head.
// bytes_per_second: the cache read.
void BM_DecodeStep(benchmark::State& state) {
  const int64_t h = state.range(0), hkv = state.range(1), d = state.range(2),
                lk = state.range(3);
  const DType dtype = CacheDType(state.range(4));
  const ScopedRowOps row_ops(state, 5);
  auto session = PrefilledSession(h, hkv, d, lk, dtype, 1);
  if (!session.ok()) {
    state.SkipWithError(std::string(session.status().message()).c_str());
    return;
  }
  const auto token = TokenOperands(h, hkv, d, 4);
  DecodeStepInputs in{std::nullopt, token[0].view(), token[1].view(),
                      token[2].view(), lk};
  for (auto _ : state) {
    TensorResults out;
    const absl::Status s = (*session)->Step(in, {}, out);
    if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
    benchmark::DoNotOptimize(out);
  }
  const double bytes = KvBytes(lk + 1, hkv, d, dtype);
  state.SetBytesProcessed(static_cast<int64_t>(bytes * state.iterations()));
  SetRate(state, 4.0 * h * (lk + 1) * d, bytes);
}

// A directory for session files under /tmp, removed with the object.
class ScratchSessionDirectory {
 public:
  explicit ScratchSessionDirectory(uint32_t file_version = kSessionFileVersion)
      : path_(absl::StrCat("/tmp/attn_bench_sessions_", ::getpid())) {
    auto directory =
        SessionDirectory::Open({.path = path_,
                                .max_file_bytes = uint64_t{1} << 34,
                                .file_version = file_version});
    if (directory.ok()) directory_ = *std::move(directory);
  }
  ~ScratchSessionDirectory() {
    directory_.reset();
    std::filesystem::remove_all(path_);
  }
  SessionDirectory* get() { return directory_.get(); }

 private:
  std::string path_;
  std::unique_ptr<SessionDirectory> directory_;
};

// Saving sessions to files, as a drain does: N attention sessions of 8
// heads x 64 holding Lk float32 tokens, each written to a session file
// (the page cache; not synced). bytes_per_second: the session files.
void BM_SessionSave(benchmark::State& state) {
  const int64_t n = state.range(0), lk = state.range(1);
  ScratchSessionDirectory directory;
  std::vector<std::unique_ptr<DecodeSession>> sessions;
  for (int64_t i = 0; i < n; ++i) {
    auto session = PrefilledSession(8, 8, 64, lk, DType::kFloat32,
                                    static_cast<uint32_t>(i));
    if (!session.ok() || directory.get() == nullptr) {
      state.SkipWithError("no session or directory");
      return;
    }
    sessions.push_back(*std::move(session));
  }
  for (auto _ : state) {
    for (int64_t i = 0; i < n; ++i) {
      const absl::Status saved = directory.get()->Save(
          absl::StrFormat("%032x", i), *sessions[static_cast<size_t>(i)]);
      if (!saved.ok())
        state.SkipWithError(std::string(saved.message()).c_str());
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(
      static_cast<double>(n) * KvBytes(lk, 8, 64, DType::kFloat32) *
      static_cast<double>(state.iterations())));
}

// Taking a saved session up (a restore on another replica): reading its
// file from the page cache, checking it and loading it into a new session
// (8 heads x 64, Lk float32 tokens). bytes_per_second: the session.
void BM_SessionTake(benchmark::State& state) {
  const int64_t lk = state.range(0);
  ScratchSessionDirectory directory;
  auto session = PrefilledSession(8, 8, 64, lk, DType::kFloat32, 1);
  if (!session.ok() || directory.get() == nullptr) {
    state.SkipWithError("no session or directory");
    return;
  }
  const std::string id = "0123456789abcdef";
  const auto no_models = [](absl::string_view)
      -> absl::StatusOr<std::shared_ptr<const MultiHeadLayer>> {
    return absl::NotFoundError("no models");
  };
  const auto any_config = [](const DecodeSessionConfig&) {
    return absl::OkStatus();
  };
  const SessionFileLoader loader{.layer_of = no_models, .verify = any_config};
  for (auto _ : state) {
    state.PauseTiming();
    const absl::Status saved = directory.get()->Save(id, **session);
    state.ResumeTiming();
    auto taken = directory.get()->Take(id, loader);
    if (!saved.ok() || !taken.ok()) state.SkipWithError("save or take failed");
    benchmark::DoNotOptimize(taken);
  }
  state.SetBytesProcessed(
      static_cast<int64_t>(KvBytes(lk, 8, 64, DType::kFloat32) *
                           static_cast<double>(state.iterations())));
}

// Taking up N forks a drain saved (each a full copy on disk): forks of an
// 8 heads x 64 session of Lk float32 tokens, each one token further, taken
// up by a new store, each sharing its prefix again with the one before.
// Counters: the store's cache memory after all are taken up (cache_MB),
// against N full copies (copies_MB), the forks that share (reshared), and
// the drain's files: their bytes (disk_MB: the prefix once, in a base file
// the forks' files link) and the time SaveAll took (save_ms).
void BM_ForksTakenUp(benchmark::State& state) {
  const int64_t n = state.range(0), lk = state.range(1);
  ScratchSessionDirectory directory;
  SessionStore::Options options;
  options.directory = directory.get();
  auto held = std::make_unique<SessionStore>(options);
  auto prefix = PrefilledSession(8, 8, 64, lk, DType::kFloat32, 1);
  if (!prefix.ok() || directory.get() == nullptr) {
    state.SkipWithError("no session or directory");
    return;
  }
  const std::string parent = *held->Add(*std::move(prefix));
  const auto token = TokenOperands(8, 8, 64, 4);
  const DecodeStepInputs in{std::nullopt, token[0].view(), token[1].view(),
                            token[2].view(), std::nullopt};
  std::vector<std::string> ids;
  for (int64_t i = 0; i < n; ++i) {
    TensorResults out;
    auto fork = held->Fork(parent, std::nullopt);
    if (!fork.ok() || !held->Step(*fork, in, {}, out, nullptr).ok()) {
      state.SkipWithError("fork or step failed");
      return;
    }
    ids.push_back(*fork);
  }
  if (!held->Delete(parent).ok()) state.SkipWithError("delete failed");
  SessionStore::Stats stats;
  double disk_bytes = 0, save_ms = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const absl::Time start = absl::Now();
    held->SaveAll();
    save_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    disk_bytes = static_cast<double>(directory.get()->stats().bytes);
    held = std::make_unique<SessionStore>(options);
    state.ResumeTiming();
    for (const std::string& id : ids) {
      if (!held->Find(id).ok()) state.SkipWithError("take-up failed");
    }
    stats = held->stats();
  }
  state.counters["cache_MB"] = static_cast<double>(stats.cache_bytes) / 1e6;
  state.counters["copies_MB"] =
      static_cast<double>(n) * KvBytes(lk + 1, 8, 64, DType::kFloat32) / 1e6;
  state.counters["reshared"] = static_cast<double>(stats.reshared);
  state.counters["disk_MB"] = disk_bytes / 1e6;
  state.counters["save_ms"] = save_ms;
}

// Journaling N forks: forks of an 8 heads x 64 session of Lk float32
// tokens, each one token further, in a store that journals its sessions;
// timed until every journal is written. Counter: the directory's bytes
// then (journal_MB). Format 3: the prefix once, in a base file the forks'
// journals link; format 2 (as before base files): every journal holds it.
void BM_ForkJournals(benchmark::State& state) {
  const int64_t n = state.range(0), lk = state.range(1);
  ScratchSessionDirectory directory(static_cast<uint32_t>(state.range(2)));
  SessionStore::Options options;
  options.directory = directory.get();
  options.journal = true;
  SessionStore store(options);
  auto prefix = PrefilledSession(8, 8, 64, lk, DType::kFloat32, 1);
  if (!prefix.ok() || directory.get() == nullptr) {
    state.SkipWithError("no session or directory");
    return;
  }
  const std::string parent = *store.Add(*std::move(prefix));
  store.WaitForJournals();
  const auto token = TokenOperands(8, 8, 64, 4);
  const DecodeStepInputs in{std::nullopt, token[0].view(), token[1].view(),
                            token[2].view(), std::nullopt};
  double journal_bytes = 0;
  for (auto _ : state) {
    std::vector<std::string> forks;
    for (int64_t i = 0; i < n; ++i) {
      TensorResults out;
      auto fork = store.Fork(parent, std::nullopt);
      if (!fork.ok() || !store.Step(*fork, in, {}, out, nullptr).ok()) {
        state.SkipWithError("fork or step failed");
        return;
      }
      forks.push_back(*fork);
    }
    store.WaitForJournals();
    state.PauseTiming();
    journal_bytes = static_cast<double>(directory.get()->stats().bytes);
    for (const std::string& fork : forks) (void)store.Delete(fork);
    state.ResumeTiming();
  }
  state.counters["journal_MB"] = journal_bytes / 1e6;
}

// Moving a session between stores as ExportSession and ImportSession do,
// without the network: its file read from the session in chunks of 1 MiB
// (SessionFileImage) and taken in by a new store piece by piece
// (ImportBytes), 8 heads x 64, Lk float32 tokens. bytes_per_second: the
// session.
void BM_SessionTransfer(benchmark::State& state) {
  const int64_t lk = state.range(0);
  SessionStore::Options options;
  options.idle_timeout = absl::InfiniteDuration();
  SessionStore source(options);
  auto session = PrefilledSession(8, 8, 64, lk, DType::kFloat32, 1);
  if (!session.ok()) {
    state.SkipWithError("no session");
    return;
  }
  const absl::StatusOr<std::string> id = source.Add(*std::move(session));
  if (!id.ok()) {
    state.SkipWithError("no session");
    return;
  }
  constexpr size_t kChunk = size_t{1} << 20;
  std::string chunk;
  for (auto _ : state) {
    SessionStore target(options);
    absl::StatusOr<SessionStore::Export> exported = source.ExportSession(*id);
    SessionStore::Import import;
    absl::Status status = exported.status();
    for (uint64_t at = 0; status.ok() && at < exported->image.size();) {
      chunk.clear();
      while (chunk.size() < kChunk && at < exported->image.size()) {
        auto piece = exported->image.Read(at, kChunk - chunk.size());
        if (!piece.ok()) break;
        chunk.append(piece->data(), piece->size());
        at += piece->size();
      }
      status = target.ImportBytes(import, at - chunk.size(), chunk);
    }
    if (!status.ok() || !import.complete) {
      state.SkipWithError("transfer failed");
      return;
    }
    target.EndImport(import);
  }
  state.SetBytesProcessed(
      static_cast<int64_t>(KvBytes(lk, 8, 64, DType::kFloat32) *
                           static_cast<double>(state.iterations())));
}

// A lone session's one-token steps through a SessionStore with a session
// directory, its journal off (0) or on (1): 8 heads x 64, float32, from
// 4096 cached tokens one token a step, back to 4096 (a rewind) at 8191;
// 4096 steps, so that the journal writes 7 blocks of 512 tokens (2 MB
// each) while they run. What journaling costs a step, in one run: the
// steps' p50, p99 and slowest (counters), off and on three times each.
void BM_JournaledStep(benchmark::State& state) {
  ScratchSessionDirectory directory;
  SessionStore::Options options;
  options.idle_timeout = absl::InfiniteDuration();
  options.directory = directory.get();
  options.journal = state.range(0) != 0;
  SessionStore store(options);
  DecodeSessionConfig config;
  config.num_heads = 8;
  config.key_dim = 64;
  config.max_length = 8192;
  auto session = DecodeSession::Create(config);
  absl::StatusOr<std::string> id =
      session.ok() ? store.Add(*std::move(session)) : session.status();
  for (int64_t first = 0; id.ok() && first < 4096; first += 512) {
    const Tensor q = Random(DType::kFloat32, {8, 512, 64}, 3 * first);
    const Tensor k = Random(DType::kFloat32, {8, 512, 64}, 3 * first + 1);
    const Tensor v = Random(DType::kFloat32, {8, 512, 64}, 3 * first + 2);
    TensorResults results;
    const absl::Status stepped = store.Step(
        *id, {std::nullopt, q.view(), k.view(), v.view(), std::nullopt}, {},
        results, nullptr);
    if (!stepped.ok()) id = stepped;
  }
  if (!id.ok() || directory.get() == nullptr) {
    state.SkipWithError("no session or directory");
    return;
  }
  store.WaitForJournals();
  const auto token = TokenOperands(8, 8, 64, 4);
  int64_t length = 4096;
  std::vector<double> step_us;
  for (auto _ : state) {
    DecodeStepInputs in{std::nullopt, token[0].view(), token[1].view(),
                        token[2].view(), std::nullopt};
    if (length == 8191) {
      in.position = 4096;
      length = 4096;
    }
    TensorResults results;
    const auto start = std::chrono::steady_clock::now();
    const absl::Status stepped = store.Step(*id, in, {}, results, nullptr);
    step_us.push_back(std::chrono::duration<double, std::micro>(
                          std::chrono::steady_clock::now() - start)
                          .count());
    if (!stepped.ok()) state.SkipWithError(stepped.ToString().c_str());
    ++length;
  }
  store.WaitForJournals();
  std::sort(step_us.begin(), step_us.end());
  state.counters["p50_us"] = step_us[step_us.size() / 2];
  state.counters["p99_us"] = step_us[step_us.size() * 99 / 100];
  state.counters["max_us"] = step_us.back();
  state.counters["journaled_blocks"] =
      static_cast<double>(store.stats().journaled_blocks);
}

// ForkSession's core: a fork of an attention session of 8 heads x 64
// (float32) holding Lk tokens. Mode 0: the parent's cache is already
// frozen (a later fork of one prefix); 1: the fork freezes the parent's
// own tokens (a first fork: one more cache reserved for the parent);
// 2: a fork and its first one-token step, which copies the prefix's
// partial block of 512 tokens (none when Lk is a multiple of 512).
// Freeing the fork is not timed.
void BM_ForkSession(benchmark::State& state) {
  const int64_t h = 8, d = 64, lk = state.range(0), mode = state.range(1);
  auto prefix = PrefilledSession(h, h, d, lk, DType::kFloat32, 1);
  if (!prefix.ok()) {
    state.SkipWithError(std::string(prefix.status().message()).c_str());
    return;
  }
  DecodeSession& parent = **prefix;
  // The parent's first fork freezes its cache; later ones share it.
  auto first = parent.Fork(std::nullopt);
  if (!first.ok()) {
    state.SkipWithError(std::string(first.status().message()).c_str());
    return;
  }
  const auto token = TokenOperands(h, h, d, 4);
  const DecodeStepInputs in{std::nullopt, token[0].view(), token[1].view(),
                            token[2].view(), std::nullopt};
  for (auto _ : state) {
    std::unique_ptr<DecodeSession> source;
    if (mode == 1) {
      // A parent with one token of its own, not yet shared.
      state.PauseTiming();
      source = *parent.Fork(lk - 1);
      TensorResults out;
      if (!source->Step(in, {}, out).ok()) state.SkipWithError("step failed");
      state.ResumeTiming();
    }
    auto fork = (source != nullptr ? *source : parent).Fork(std::nullopt);
    if (!fork.ok()) {
      state.SkipWithError(std::string(fork.status().message()).c_str());
      break;
    }
    if (mode == 2) {
      TensorResults out;
      if (!(*fork)->Step(in, {}, out).ok()) state.SkipWithError("step failed");
    }
    state.PauseTiming();
    fork->reset();
    source.reset();
    state.ResumeTiming();
  }
}

// Sessions prefilled once per process and shape, shared by the batch
// benchmarks (a 4096-token prefill of 64 sessions takes seconds).
std::vector<std::unique_ptr<DecodeSession>>& SessionPool(int64_t count,
                                                         int64_t h, int64_t hkv,
                                                         int64_t d, int64_t lk,
                                                         DType dtype) {
  static std::mutex mu;
  static std::map<std::array<int64_t, 5>,
                  std::vector<std::unique_ptr<DecodeSession>>>
      pools;
  std::lock_guard<std::mutex> lock(mu);
  auto& pool = pools[{h, hkv, d, lk, static_cast<int64_t>(dtype)}];
  while (static_cast<int64_t>(pool.size()) < count) {
    auto session = PrefilledSession(h, hkv, d, lk, dtype,
                                    static_cast<uint32_t>(10 * pool.size()));
    if (!session.ok()) break;
    pool.push_back(std::move(*session));
  }
  return pool;
}

// One decode step of N sessions in one StepSessions call (each rewinds to
// Lk, as BM_DecodeStep). Args: N, H, Hkv, d, Lk, cache (0 float32, 1
// bfloat16, 2 int8), ops (as BM_DecodeStep). bytes_per_second: the caches read,
// all sessions together.
void BM_DecodeBatch(benchmark::State& state) {
  const int64_t count = state.range(0), h = state.range(1),
                hkv = state.range(2), d = state.range(3), lk = state.range(4);
  const DType dtype = CacheDType(state.range(5));
  const ScopedRowOps row_ops(state, 6);
  auto& pool = SessionPool(count, h, hkv, d, lk, dtype);
  if (static_cast<int64_t>(pool.size()) < count) {
    state.SkipWithError("session prefill failed");
    return;
  }
  std::vector<std::array<Tensor, 3>> tokens;
  std::vector<TensorResults> results(count);
  std::vector<SessionStepInput> steps(count);
  for (int64_t i = 0; i < count; ++i) {
    tokens.push_back(TokenOperands(h, hkv, d, static_cast<uint32_t>(7 * i)));
    steps[i].session = pool[i].get();
    steps[i].inputs = {std::nullopt, tokens[i][0].view(), tokens[i][1].view(),
                       tokens[i][2].view(), lk};
    steps[i].results = &results[i];
  }
  for (auto _ : state) {
    const std::vector<absl::Status> statuses = StepSessions(steps);
    for (const absl::Status& s : statuses) {
      if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
    }
    benchmark::DoNotOptimize(results);
  }
  const double bytes = count * KvBytes(lk + 1, hkv, d, dtype);
  state.SetBytesProcessed(static_cast<int64_t>(bytes * state.iterations()));
  state.counters["steps_per_second"] =
      benchmark::Counter(static_cast<double>(count),
                         benchmark::Counter::kIsIterationInvariantRate);
}

// XOR of words[0 .. n): four independent 64-byte streams with AVX-512 (as
// the decode kernel reads), plain words elsewhere; with `prefetch`, each
// 256 bytes also prefetch the 256 bytes 1 KiB on, as the decode kernel
// does (on some machines the hardware prefetchers alone leave bandwidth
// unused, and the limit must be the best read, not the plainest).
__attribute__((target("avx512f"))) uint64_t XorWordsAvx512(const uint64_t* w,
                                                           int64_t n,
                                                           bool prefetch) {
  constexpr int64_t kAheadWords = 1024 / 8;
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if (prefetch) {
      const char* ahead = reinterpret_cast<const char*>(w + i + kAheadWords);
      for (int line = 0; line < 4; ++line) {
        _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
      }
    }
    a = _mm512_xor_si512(a, _mm512_loadu_si512(w + i));
    b = _mm512_xor_si512(b, _mm512_loadu_si512(w + i + 8));
    c = _mm512_xor_si512(c, _mm512_loadu_si512(w + i + 16));
    d = _mm512_xor_si512(d, _mm512_loadu_si512(w + i + 24));
  }
  uint64_t lanes[8];
  _mm512_storeu_si512(
      lanes, _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d)));
  uint64_t x = 0;
  for (uint64_t lane : lanes) x ^= lane;
  for (; i < n; ++i) x ^= w[i];
  return x;
}

// As XorWordsAvx512, with four 32-byte streams: on a CPU without AVX-512
// the plain loop's 8-byte loads reached half of L3's read bandwidth.
__attribute__((target("avx2"))) uint64_t XorWordsAvx2(const uint64_t* w,
                                                      int64_t n,
                                                      bool prefetch) {
  constexpr int64_t kAheadWords = 1024 / 8;
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (prefetch) {
      const char* ahead = reinterpret_cast<const char*>(w + i + kAheadWords);
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
    const auto* v = reinterpret_cast<const __m256i*>(w + i);
    a = _mm256_xor_si256(a, _mm256_loadu_si256(v));
    b = _mm256_xor_si256(b, _mm256_loadu_si256(v + 1));
    c = _mm256_xor_si256(c, _mm256_loadu_si256(v + 2));
    d = _mm256_xor_si256(d, _mm256_loadu_si256(v + 3));
  }
  uint64_t lanes[4];
  _mm256_storeu_si256(
      reinterpret_cast<__m256i*>(lanes),
      _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d)));
  uint64_t x = 0;
  for (uint64_t lane : lanes) x ^= lane;
  for (; i < n; ++i) x ^= w[i];
  return x;
}

uint64_t XorWords(const uint64_t* w, int64_t n, bool prefetch) {
  if (__builtin_cpu_supports("avx512f")) {
    return XorWordsAvx512(w, n, prefetch);
  }
  if (__builtin_cpu_supports("avx2")) return XorWordsAvx2(w, n, prefetch);
  uint64_t x = 0;
  for (int64_t i = 0; i < n; ++i) x ^= w[i];
  return x;
}

// The machine's read bandwidth, the limit of a decode step: each OpenMP
// thread reads its contiguous share of a buffer of `bytes`, 16 MiB staying
// in L3, 512 MiB coming from DRAM; plain (prefetch:0) and with software
// prefetch (prefetch:1). The limit is the faster of the two.
void BM_ReadBandwidth(benchmark::State& state) {
  const int64_t words = state.range(0) / 8;
  const bool prefetch = state.range(1) != 0;
  std::unique_ptr<uint64_t[]> buffer(new uint64_t[words]);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < words; ++i) buffer[i] = static_cast<uint64_t>(i);
  uint64_t sink = 0;
  for (auto _ : state) {
    uint64_t x = 0;
#pragma omp parallel reduction(^ : x)
    {
      const int64_t threads = omp_get_num_threads();
      const int64_t share = (words / threads + 7) / 8 * 8;
      const int64_t begin = std::min(words, omp_get_thread_num() * share);
      x ^= XorWords(buffer.get() + begin, std::min(share, words - begin),
                    prefetch);
    }
    sink ^= x;
  }
  benchmark::DoNotOptimize(sink);
  state.SetBytesProcessed(state.iterations() * words * 8);
  state.counters["threads"] = omp_get_max_threads();
}

// The two raw GEMMs of the same attention as plain batched oneDNN matmuls:
// [b*h] x (Lq x d) * (d x Lk), then [b*h] x (Lq x Lk) * (Lk x d).
void BM_RawAttentionGemms(benchmark::State& state) {
  const int64_t b = state.range(0), h = state.range(1), lq = state.range(2),
                lk = state.range(3), d = state.range(4);
  Tensor q = Random(DType::kFloat32, {b * h, lq, d}, 1);
  Tensor k = Random(DType::kFloat32, {b * h, lk, d}, 2);
  Tensor v = Random(DType::kFloat32, {b * h, lk, d}, 3);
  Tensor logits = Random(DType::kFloat32, {b * h, lq, lk}, 4);
  Tensor out = *Tensor::Allocate(DType::kFloat32, {b * h, lq, d});
  MatmulShape qk{b * h, lq, d, lk, /*b_transposed=*/true};
  MatmulShape pv{b * h, lq, lk, d};
  for (auto _ : state) {
    (void)Matmul(qk, q.data(), k.data(), nullptr, logits.data());
    (void)Matmul(pv, logits.data(), v.data(), nullptr, out.data());
    benchmark::ClobberMemory();
  }
  SetRate(state, 4.0 * b * h * lq * lk * d, 0);
}

// Args: bf16 (inputs; the output is float32).
void BM_Gemm2048(benchmark::State& state) {
  const int64_t n = 2048;
  const DType dtype = state.range(0) ? DType::kBFloat16 : DType::kFloat32;
  Tensor a = Random(dtype, {n, n}, 1);
  Tensor b = Random(dtype, {n, n}, 2);
  Tensor c = *Tensor::Allocate(DType::kFloat32, {n, n});
  MatmulShape shape{1, n, n, n};
  shape.a_dtype = shape.b_dtype = dtype;
  for (auto _ : state) {
    (void)Matmul(shape, a.data(), b.data(), nullptr, c.data());
    benchmark::ClobberMemory();
  }
  SetRate(state, 2.0 * n * n * n, 0);
}

// Args: bytes.
void BM_MemoryCopy(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  std::vector<char> src(bytes, 1), dst(bytes);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  // A copy reads and writes every byte.
  SetRate(state, 0, 2.0 * bytes);
}

// Self-attention with nn.MultiheadAttention's weights (fused in_proj, both
// biases) on a random [b, l, e] query.
struct MultiHeadSetup {
  MultiHeadSetup(int64_t b, int64_t l, int64_t e, int heads, DType dtype)
      : x(Random(dtype, {b, l, e}, 1)),
        in_proj(Random(DType::kFloat32, {3 * e, e}, 2)),
        in_bias(Random(DType::kFloat32, {3 * e}, 3)),
        out_proj(Random(DType::kFloat32, {e, e}, 4)),
        out_bias(Random(DType::kFloat32, {e}, 5)) {
    weights.num_heads = heads;
    weights.in_proj_weight = in_proj.view();
    weights.in_proj_bias = in_bias.view();
    weights.out_proj_weight = out_proj.view();
    weights.out_proj_bias = out_bias.view();
    inputs.query = x.view();
  }
  Tensor x, in_proj, in_bias, out_proj, out_bias;
  MultiHeadWeights weights;
  MultiHeadInputs inputs;
};

// Args: batch, seq, embed, heads, bf16 (bfloat16 input and compute), packed.
void BM_MultiHeadAttention(benchmark::State& state) {
  const int64_t b = state.range(0), l = state.range(1), e = state.range(2);
  const DType dtype = state.range(4) ? DType::kBFloat16 : DType::kFloat32;
  const MultiHeadSetup setup(b, l, e, static_cast<int>(state.range(3)), dtype);
  const MultiHeadWeights& w = setup.weights;
  const MultiHeadInputs& in = setup.inputs;
  // Packed: a layer prepared once, as for a served model; else the weights
  // arrive with each call, as inline request weights do.
  const bool packed = state.range(5) != 0;
  MultiHeadLayer::Options layer_options;
  layer_options.compute_dtype = dtype;
  auto layer = MultiHeadLayer::Create(w, layer_options);
  if (!layer.ok()) state.SkipWithError("layer");
  MultiHeadOptions options;
  options.attention.compute_bf16 = dtype == DType::kBFloat16;
  for (auto _ : state) {
    TensorResults results;
    const absl::Status s = packed ? (*layer)->Run(in, options, results)
                                  : MultiHeadAttend(w, in, options, results);
    if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
    benchmark::DoNotOptimize(results);
  }
  SetRate(state, 2.0 * b * l * e * e * 4 + 4.0 * b * l * l * e, 0);
}

// The serving comparison's in-process side: a packed layer (as a served
// model is), called from several threads at once with the server's thread
// budget. Args: seq, embed, heads; batch 1.
void BM_MultiHeadServedShape(benchmark::State& state) {
  const MultiHeadSetup setup(1, state.range(0), state.range(1),
                             static_cast<int>(state.range(2)), DType::kFloat32);
  static std::mutex create_mu;
  absl::StatusOr<std::shared_ptr<const MultiHeadLayer>> layer;
  {
    std::lock_guard<std::mutex> lock(create_mu);
    layer = MultiHeadLayer::Create(setup.weights, {});
  }
  if (!layer.ok()) state.SkipWithError("layer");
  for (auto _ : state) {
    ThreadBudget::Lease lease = ThreadBudget::Global().Acquire();
    TensorResults results;
    const absl::Status s = (*layer)->Run(setup.inputs, {}, results);
    if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
    benchmark::DoNotOptimize(results);
  }
  // Summed over the benchmark's threads: the process's calls per second.
  state.counters["calls_per_second"] =
      benchmark::Counter(state.iterations(), benchmark::Counter::kIsRate);
}

// Args: rows, cols, ops (as BM_DecodeStep).
void BM_LayerNorm(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1);
  ScopedRowOps scoped(state, 2);
  Tensor x = Random(DType::kFloat32, {rows, cols}, 1);
  Tensor gamma = Random(DType::kFloat32, {cols}, 2);
  Tensor beta = Random(DType::kFloat32, {cols}, 3);
  for (auto _ : state) {
    auto r = LayerNorm(x.view(), gamma.view(), beta.view(), {});
    benchmark::DoNotOptimize(r);
  }
  SetRate(state, 0, 2.0 * rows * cols * 4);
}

// Args: rows, cols, ops (as BM_DecodeStep). RMSNorm with gamma: reads x, writes
// y.
void BM_RmsNorm(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1);
  ScopedRowOps scoped(state, 2);
  Tensor x = Random(DType::kFloat32, {rows, cols}, 1);
  Tensor gamma = Random(DType::kFloat32, {cols}, 2);
  LayerNormOptions options;
  options.rms_norm = true;
  for (auto _ : state) {
    auto r = LayerNorm(x.view(), gamma.view(), std::nullopt, options);
    benchmark::DoNotOptimize(r);
  }
  SetRate(state, 0, 2.0 * rows * cols * 4);
}

// clang-format off
BENCHMARK(BM_Sdpa)->ArgNames({"B", "H", "Lq", "Lk", "d", "causal", "bf16"})
    ->Args({8, 8, 512, 512, 64, 0, 0})
    ->Args({1, 8, 4096, 4096, 64, 0, 0})
    ->Args({1, 8, 2048, 2048, 64, 0, 0})
    ->Args({1, 8, 2048, 2048, 64, 1, 0})
    ->Args({1, 8, 1, 4096, 64, 0, 0})
    ->Args({8, 8, 512, 512, 64, 0, 1})
    ->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Gqa)->ArgNames({"B", "H", "Hkv", "Lq", "Lk", "d"})
    ->Args({1, 32, 8, 1, 4096, 128})
    ->Args({1, 32, 32, 1, 4096, 128})
    ->Args({1, 32, 8, 512, 512, 128})
    ->Args({1, 32, 32, 512, 512, 128})
    ->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ReadBandwidth)->ArgNames({"bytes", "prefetch"})
    ->ArgsProduct({{int64_t{16} << 20, int64_t{512} << 20}, {0, 1}})
    ->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeStep)->ArgNames({"H", "Hkv", "d", "Lk", "cache", "ops"})
    ->Apply([](auto* b) {
      PerRowOps(b, {{8, 8, 64, 4096, 0}, {8, 8, 64, 4096, 1},
                    {8, 8, 64, 4096, 2}, {32, 8, 128, 4096, 0},
                    {32, 32, 128, 4096, 0}});
    })
    ->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RowKernel)->ArgNames({"d", "cache", "kernel", "ops"})
    ->Apply([](auto* b) {
      PerRowOps(b, {{64, 0, 0}, {64, 1, 0}, {64, 2, 0}, {64, 0, 1},
                    {64, 1, 1}, {64, 2, 1}, {128, 2, 0}, {128, 2, 1},
                    {64, 2, 2}, {64, 0, 3}, {64, 0, 4}, {64, 0, 5}});
    })
    ->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ForkSession)->ArgNames({"Lk", "mode"})
    ->Args({4096, 0})
    ->Args({4096, 1})
    ->Args({4096, 2})
    ->Args({4095, 2})
    ->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SessionSave)->ArgNames({"N", "Lk"})
    ->Args({1, 4096})
    ->Args({64, 4096})
    ->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SessionTake)->ArgNames({"Lk"})
    ->Arg(4096)
    ->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ForksTakenUp)->ArgNames({"N", "Lk"})
    ->Args({64, 4096})
    ->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ForkJournals)->ArgNames({"N", "Lk", "format"})
    ->Args({64, 4096, 2})
    ->Args({64, 4096, 3})
    ->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SessionTransfer)->ArgNames({"Lk"})
    ->Arg(4096)
    ->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_JournaledStep)->ArgNames({"journal"})
    ->Arg(0)->Arg(1)->Arg(0)->Arg(1)->Arg(0)->Arg(1)->Iterations(4096)
    ->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeBatch)
    ->ArgNames({"N", "H", "Hkv", "d", "Lk", "cache", "ops"})
    ->Apply([](auto* b) {
      PerRowOps(b, {{4, 8, 8, 64, 4096, 0}, {16, 8, 8, 64, 4096, 0},
                    {64, 8, 8, 64, 4096, 0}, {4, 8, 8, 64, 4096, 1},
                    {16, 8, 8, 64, 4096, 1}, {64, 8, 8, 64, 4096, 1},
                    {4, 8, 8, 64, 4096, 2}, {16, 8, 8, 64, 4096, 2},
                    {64, 8, 8, 64, 4096, 2}});
    })
    ->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RawAttentionGemms)->ArgNames({"B", "H", "Lq", "Lk", "d"})
    ->Args({8, 8, 512, 512, 64})
    ->Args({1, 8, 4096, 4096, 64})
    ->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Gemm2048)->ArgNames({"bf16"})->Arg(0)->Arg(1)
    ->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MemoryCopy)->ArgNames({"bytes"})
    ->Arg(2 * 8 * 4096 * 64 * 4)      // K and V of the decode case
    ->Arg(2 * 32 * 128 * 768 * 4)     // LayerNorm [4096, 768] in and out
    ->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MultiHeadAttention)
    ->ArgNames({"B", "L", "E", "H", "bf16", "packed"})
    ->Args({8, 512, 512, 8, 0, 1})
    ->Args({32, 128, 768, 12, 0, 1})
    ->Args({1, 16, 512, 8, 0, 1})
    ->Args({1, 16, 512, 8, 0, 0})
    ->Args({8, 512, 512, 8, 1, 1})
    ->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MultiHeadServedShape)->ArgNames({"L", "E", "H"})
    ->Args({128, 512, 8})
    ->Args({16, 512, 8})
    ->Threads(1)->Threads(2)->Threads(8)
    ->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LayerNorm)->ArgNames({"rows", "cols", "ops"})
    ->Apply([](auto* b) { PerRowOps(b, {{32 * 128, 768}}); })
    ->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RmsNorm)->ArgNames({"rows", "cols", "ops"})
    ->Apply([](auto* b) { PerRowOps(b, {{32 * 128, 768}, {8, 4096}}); })
    ->UseRealTime()->Unit(benchmark::kMicrosecond);
// clang-format on

}  // namespace
}  // namespace attnserve

// ATTNSERVE_CPU_ISA caps oneDNN as well as the row kernels, as in the
// server: the stateless rows then run at the instruction set asked for.
int main(int argc, char** argv) {
  if (const absl::Status isa = attnserve::ApplyCpuIsaSetting(); !isa.ok()) {
    std::fprintf(stderr, "attn_bench: %s\n",
                 std::string(isa.message()).c_str());
    return 2;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
