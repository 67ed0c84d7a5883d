// A decode session: one or more sequences generated token by token, whose
// keys and values stay on this side (KvCache) so that each step sends only
// its new tokens.
//
// Two kinds:
//  - attention sessions take each step's new queries, keys and values,
//    already projected ([B, H, n, dk], [B, Hkv, n, dk], [B, Hkv, n, dv]),
//    and answer the attention output [B, H, n, dv];
//  - model sessions take hidden states [B, n, E] and run a served
//    MultiHeadLayer: project, rotate (the layer's rotary settings), append,
//    attend, project out: [B, n, Eo].
// A step appends its n keys and values after the `length` cached ones and
// attends its queries to everything cached, causally within the step: new
// token i (position length + i) sees positions <= length + i. A long prompt
// is one step (prefill), then one token a step. A step that fails, refused
// or not (cancelled, out of memory), leaves the session as it was, also
// one that asked for a rewind.
//
// A session may be forked (Fork): the new one shares the tokens it starts
// with, copy-on-write by blocks of kCacheBlockKeys tokens. The cache a
// session writes into is frozen when a fork shares it and read from then
// on by every session that holds it; a write into one of its blocks copies
// that block's earlier tokens into the writer's own cache first, so that
// sharers never see each other's writes.
//
// Memory: the cache (KvCache), and the per-layer bookkeeping
// (SessionLayers: lengths and block tables), whose size follows from the
// config alone (BookkeepingBytes) and is fixed at Create.
//
// Ownership: owns its cache and bookkeeping; shares frozen caches with the
// sessions forked from and of it; a model session shares its layer (and so
// keeps that model's weights alive). Thread-safety: Step,
// Fork and the accessors may be called from any thread; steps and forks on
// one session run one at a time, in the order they take its lock.
#ifndef ATTNSERVE_CORE_DECODE_SESSION_H_
#define ATTNSERVE_CORE_DECODE_SESSION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/kv_cache.h"
#include "core/multi_head_attention.h"
#include "core/mutex.h"
#include "core/results.h"
#include "core/rotary.h"
#include "core/tensor.h"

namespace attnserve {

struct DecodeSessionConfig {
  // Model sessions: the layer that projects hidden states (self-attention:
  // its key and value inputs must be as wide as its query's). Its heads,
  // dims, compute dtype and rotary settings apply; the fields below up to
  // `rotary` are ignored.
  std::shared_ptr<const MultiHeadLayer> layer;
  // Model sessions: the served model's name, what a session file names so
  // that the session can be loaded again (core/session_file.h).
  std::string model;
  // Attention sessions: heads of the queries and of the keys/values (0:
  // num_heads; must divide num_heads), per-head dims (value_dim 0: key_dim).
  int num_heads = 0;
  int num_kv_heads = 0;
  int64_t key_dim = 0;
  int64_t value_dim = 0;
  // FLOAT32 or BFLOAT16: the dtype the cache stores and attention runs in;
  // INT8: attention runs in FLOAT32 on an INT8 cache.
  DType dtype = DType::kFloat32;
  // Applied to each step's queries and keys at their positions.
  RotaryOptions rotary;
  // Sequences decoded together, each with its own cache.
  int64_t batch = 1;
  // Tokens a sequence may hold; steps past it fail with OUT_OF_RANGE.
  int64_t max_length = 0;
  // Layers of a model whose caches the session holds, each with its own
  // length: a token is stepped layer by layer (DecodeStepInputs.layer).
  // Model sessions run every layer with the one `layer` above. At most
  // kMaxSessionLayers.
  int64_t num_layers = 1;
  // The scale of steps that give none (a model's default_scale); unset:
  // 1/sqrt(dk).
  std::optional<float> default_scale;
  // Both kinds: the dtype the cache stores, the compute dtype or INT8
  // (each token's key and value rows quantized per key/value head with one
  // float32 scale, see QuantizeInt8, and dequantized as attention reads
  // them). Unset: the compute dtype (INT8 for `dtype` INT8).
  std::optional<DType> cache_dtype;
};

struct DecodeStepInputs {
  // Model sessions: hidden states [B, n, E], or [n, E] for a batch of 1.
  std::optional<TensorView> input;
  // Attention sessions: [B, H, n, dk], [B, Hkv, n, dk], [B, Hkv, n, dv]
  // (without B for a batch of 1).
  std::optional<TensorView> query;
  std::optional<TensorView> key;
  std::optional<TensorView> value;
  // Where the step's tokens start: unset, after every cached token; a
  // smaller position first drops the cached tokens from there on (a
  // speculative draft that was rejected, a regenerated answer). The drop
  // happens only when the step succeeds: a step that fails drops nothing.
  // Both count the tokens of `layer`.
  std::optional<int64_t> position;
  // The layer whose cache the step appends to and attends over, in
  // [0, num_layers).
  int64_t layer = 0;
};

struct DecodeStepOptions {
  // Multiplies Q*K^T; default 1/sqrt(dk).
  std::optional<float> scale;
  // Divides the scaled logits; default 1, must be > 0.
  std::optional<float> temperature;
  // When set and it turns true, the step stops with CANCELLED and the
  // session stays as it was.
  const std::atomic<bool>* cancelled = nullptr;
};

class DecodeSession;

// The most layers one session holds: eight times the deepest models' (126),
// so that a session's per-layer bookkeeping and the work a step does per
// layer stay bounded whatever a request asks.
inline constexpr int64_t kMaxSessionLayers = 1024;

// One entry of a batched step (StepSessions).
struct SessionStepInput {
  DecodeSession* session = nullptr;  // not owned
  DecodeStepInputs inputs;
  DecodeStepOptions options;
  ResultAllocator* results = nullptr;  // not owned; gets "output"
};

// Runs one step on each entry's session, all their attention in one
// parallel pass (split by entry, key/value head and block of cached
// tokens), and returns one status per entry. Each entry's status, result
// and session afterwards are exactly those of session->Step(inputs,
// options, *results) (bit for bit): the work an entry's result depends on
// is split by its own length only. An entry that fails (refused,
// cancelled through its own flag) changes nothing in its session and
// nothing for the others. A session may appear in one entry only: later
// entries naming it again fail with INVALID_ARGUMENT. The sessions' locks
// are taken in address order, so concurrent calls do not deadlock.
std::vector<absl::Status> StepSessions(
    absl::Span<const SessionStepInput> steps);

class DecodeSession {
 public:
  // INVALID_ARGUMENT naming the config field at fault; RESOURCE_EXHAUSTED
  // when the cache's address space cannot be reserved.
  static absl::StatusOr<std::unique_ptr<DecodeSession>> Create(
      const DecodeSessionConfig& config);
  // The dims of the cache a session of `config` would have, reserving
  // nothing (KvCache::ReservedBytes tells its size); the errors of Create
  // but for the reservation itself.
  static absl::StatusOr<KvCache::Dims> CacheDims(
      const DecodeSessionConfig& config);
  // The per-layer bookkeeping a session of cache `dims` holds
  // (SessionLayers::BytesFor), allocated by Create beside the cache.
  static size_t BookkeepingBytes(const KvCache::Dims& dims) {
    return SessionLayers::BytesFor(dims);
  }
  // The memory a model layer's weights take once packed: every
  // projection's weight and bias elements at 4 bytes (float32, an upper
  // bound of the packed size), q, k and v twice when the layer may have
  // been given a fused in_proj_weight (it then keeps both packings).
  static size_t ModelBytes(const MultiHeadLayer& layer);

  // Result "output": [B, H, n, dv] in the query's dtype (attention
  // sessions) or [B, n, Eo] in the input's dtype (model sessions), without
  // B when the inputs have none.
  absl::Status Step(const DecodeStepInputs& inputs,
                    const DecodeStepOptions& options, ResultAllocator& results)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A new session of the same config holding this one's first `length`
  // tokens (every one when unset), which both read from now on from one
  // frozen copy: no tokens are copied, only a table of a pointer per
  // block of kCacheBlockKeys tokens. INVALID_ARGUMENT when `length` is not
  // in [0, length()]; RESOURCE_EXHAUSTED when the address space of the new
  // caches cannot be reserved (then nothing changed).
  absl::StatusOr<std::unique_ptr<DecodeSession>> Fork(
      std::optional<int64_t> length) ABSL_LOCKS_EXCLUDED(mu_);
  // The address space Fork(length) would reserve: the fork's cache, and
  // this session's new one when the fork freezes its cache; Fork's
  // INVALID_ARGUMENT.
  absl::StatusOr<size_t> ForkReservedBytes(std::optional<int64_t> length) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // A frozen cache the session reads, shared with other sessions: its
  // memory and address space, counted once however many hold it.
  struct SharedCache {
    const void* id = nullptr;  // the same for every session holding it
    size_t bytes = 0;
    size_t reserved_bytes = 0;
  };
  std::vector<SharedCache> shared_caches() const ABSL_LOCKS_EXCLUDED(mu_);

  // The new tokens a step with these inputs would append (validated by
  // Step itself), or INVALID_ARGUMENT when the layer is out of range or the
  // inputs of this session's kind are missing or of the wrong rank.
  absl::StatusOr<int64_t> NewTokens(const DecodeStepInputs& inputs) const;

  bool is_model_session() const { return config_.layer != nullptr; }
  const DecodeSessionConfig& config() const { return config_; }
  int num_heads() const { return heads_; }
  int num_kv_heads() const { return kv_heads_; }
  int64_t key_dim() const { return key_dim_; }
  int64_t value_dim() const { return value_dim_; }
  // The dtype attention computes in, and the one the cache stores.
  DType dtype() const { return dtype_; }
  DType cache_dtype() const { return cache_dtype_; }
  int64_t batch() const { return config_.batch; }
  int64_t max_length() const { return config_.max_length; }
  int64_t num_layers() const { return config_.num_layers; }
  // Tokens cached per sequence in `layer` (0 outside [0, num_layers)).
  int64_t length(int64_t layer = 0) const {
    return layer >= 0 && layer < config_.num_layers
               ? layers_.layer(layer).length.load(std::memory_order_acquire)
               : 0;
  }
  // The dims of its cache (CacheDims of its config).
  const KvCache::Dims& cache_dims() const { return dims_; }
  // Its per-layer bookkeeping (BookkeepingBytes of cache_dims()), fixed;
  // counted by none of the byte counts below.
  size_t bookkeeping_bytes() const { return layers_.bytes(); }
  // A model session's ModelBytes of its layer; 0 for attention sessions.
  size_t model_bytes() const { return model_bytes_; }
  // The address space the cache reserves (its whole max_length, every
  // layer), of which it commits what its tokens fill. A forked session's:
  // its own cache's, not counting shared_caches().
  size_t reserved_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  // Memory the cache commits now (every layer), and when `layer` holds
  // `tokens` tokens and the others what they hold (a forked session's own
  // cache, not counting shared_caches()).
  size_t cache_bytes() const { return BytesAt(length(0), 0); }
  size_t BytesAt(int64_t tokens, int64_t layer = 0) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Memory the cache commits after a step of `new_tokens` with these
  // inputs: BytesAt its end, and the shared blocks it copies first.
  size_t BytesAfter(const DecodeStepInputs& inputs, int64_t new_tokens) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The length of its layer a step with these inputs ends at (checked by
  // Step).
  int64_t LengthAfter(const DecodeStepInputs& inputs,
                      int64_t new_tokens) const {
    return inputs.position.value_or(length(inputs.layer)) + new_tokens;
  }
  // Floating-point operations of a step of `new_tokens` at the current
  // length of `layer` (cost estimates).
  double StepFlops(int64_t new_tokens, int64_t layer = 0) const;

  // The cached rows of `tokens` tokens of one layer, as ReadRows writes
  // them and AppendRows takes them: for every (batch, key/value head)
  // plane in order, its keys' rows in the cache's dtype; then its values'
  // likewise; then, for an INT8 cache, every plane's key scales and value
  // scales (float32).
  size_t RowBytes(int64_t tokens) const;
  // What the session holds, read at one instant: its tokens per layer, and
  // a version that every change of its tokens (a step, a rewind, appended
  // rows) makes new. Two reads with the same version saw the same tokens;
  // versions are unique within the process (no two sessions share one).
  struct Contents {
    uint64_t version = 0;
    std::vector<int64_t> lengths;
  };
  Contents contents() const ABSL_LOCKS_EXCLUDED(mu_);
  // Appends the rows (as RowBytes describes) of `tokens` tokens of `layer`
  // from token `first` to `rows`, while steps wait, and returns the
  // version they were read at (see contents()). OUT_OF_RANGE when the
  // layer does not hold them all.
  absl::StatusOr<uint64_t> CopyRows(int64_t layer, int64_t first,
                                    int64_t tokens, std::string& rows) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Appends `tokens` tokens to `layer` from `rows` as RowBytes describes;
  // `first` must be the layer's length, past the blocks the layer shares
  // with other sessions (a fork's appends after its shared prefix). The rows
  // are checked first (finite floats, INT8 scales finite and >= 0), so that a
  // session restored from bytes never answers NaN from finite inputs; on an
  // error nothing changes. INVALID_ARGUMENT naming what is wrong;
  // FAILED_PRECONDITION when `first` is in a shared block.
  absl::Status AppendRows(int64_t layer, int64_t first, int64_t tokens,
                          absl::string_view rows) ABSL_LOCKS_EXCLUDED(mu_);

  // The leading blocks of each layer that the session reads from frozen
  // caches, each whole (a fork's shared prefix): `lengths` per layer
  // (multiples of kCacheBlockKeys), and a key naming exactly those blocks
  // of those caches, the same for every session that shares them and never
  // for others in this process (empty when no block is shared). Session
  // files store such a prefix once for the sessions that share it
  // (core/session_file.h).
  struct SharedBase {
    std::vector<int64_t> lengths;
    std::string key;
  };
  SharedBase shared_base() const ABSL_LOCKS_EXCLUDED(mu_);

  // Whether this session and `other` run alike: the same config (heads,
  // dims, dtypes, rotary settings, batch, max_length, layers, default
  // scale, model layer), so that a fork of one is what the other would be.
  bool SameConfig(const DecodeSession& other) const;
  // The tokens from 0 that this session and `other` hold bit for bit
  // alike, in whole blocks of kCacheBlockKeys that every layer of both
  // holds: a fork of `other` at that length holds those tokens as this
  // session does (how sessions taken up from files share memory again).
  // 0 unless SameConfig. Locks `other`, then this session: call it on a
  // session that no other thread locks.
  int64_t SharedPrefix(const DecodeSession& other) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend std::vector<absl::Status> StepSessions(
      absl::Span<const SessionStepInput> steps);
  // A step between its checks and its attention: its tokens are in the
  // cache, its problem is ready for the kernel (defined in the .cc).
  struct PendingStep;

  DecodeSession() = default;
  // Checks a step and writes its tokens; on failure the session is as it
  // was.
  absl::StatusOr<std::unique_ptr<PendingStep>> Prepare(
      const DecodeStepInputs& inputs, const DecodeStepOptions& options,
      ResultAllocator& results) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes a step whose attention returned `attention`: the output
  // projection and the new length, or, on failure, the cache as it was.
  absl::Status Finish(PendingStep& step, absl::Status attention)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The checks of a step, made before it changes anything: its layer, room
  // for `new_tokens` from `start` in it, and the inputs of this session's
  // kind.
  // Checks `config` and takes its (or its layer's) heads, dims, dtype and
  // rotary settings; the dims of the cache it needs.
  absl::StatusOr<KvCache::Dims> Configure(const DecodeSessionConfig& config);
  absl::Status VerifyLayer(int64_t layer) const;
  absl::Status VerifyRoom(int64_t layer, int64_t start,
                          int64_t new_tokens) const;
  absl::Status VerifyAttentionInputs(const DecodeStepInputs& in) const;
  absl::Status VerifyModelInput(const TensorView& input) const;
  // The step's work on checked inputs up to its attention: writes its
  // tokens into the cache from row `first` on and sets up the problem.
  absl::Status PrepareAttention(const DecodeStepInputs& in, int64_t first,
                                ResultAllocator& results, PendingStep& step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PrepareModel(const TensorView& input, int64_t first,
                            ResultAllocator& results, PendingStep& step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copy-on-write: makes the blocks of `layer`'s tokens [first, end)
  // writable in cache_, copying the tokens below `held` of those read from
  // a frozen cache.
  void OwnBlocks(int64_t layer, int64_t first, int64_t end, int64_t held)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fork's part on this side: freezes cache_ into frozen_ when the first
  // `lengths` tokens of the layers read any of it, taking `fresh` as the
  // new cache_.
  void FreezeFor(absl::Span<const int64_t> lengths,
                 std::unique_ptr<KvCache>& fresh)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ReadsOwnCache(absl::Span<const int64_t> tokens) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `layer`'s block `block` of the table is in cache_; points it
  // at `cache`'s; the bytes the own cache commits in `layer` when it holds
  // `tokens` (and the pages a rewind kept).
  bool OwnsBlock(int64_t layer, size_t block) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PointBlock(int64_t layer, size_t block, const KvCache& cache)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  size_t OwnBytes(int64_t layer, int64_t first, int64_t tokens) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends `tokens` tokens of `layer` from `first` to `rows` (RowBytes).
  void GatherRows(int64_t layer, int64_t first, int64_t tokens,
                  std::string& rows) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Where token `token` of plane `plane` (b * kv_heads + h) of `layer`'s
  // region `region` (0 keys, 1 values, 2 key scales, 3 value scales) is
  // read, through the block table.
  const char* RowAt(int region, int64_t layer, int64_t plane,
                    int64_t token) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The frozen cache `layer`'s block `block` is read from (a block the
  // session does not own).
  struct FrozenCache;
  const FrozenCache* FrozenAt(int64_t layer, size_t block) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // INVALID_ARGUMENT unless every layer holds `length` tokens or more.
  absl::Status VerifyForkLength(int64_t length) const;
  // Per layer, the tokens a fork at `length` shares (unset: all).
  std::vector<int64_t> ForkLengths(std::optional<int64_t> length) const;
  // Takes `cache` as cache_ and `layers` (empty tables, lengths 0).
  void Adopt(std::unique_ptr<KvCache> cache, SessionLayers layers)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The problem of `n` queries at positions first .. first + n - 1 (layout
  // `query_layout` at `query`) over the cache's first `first + n` tokens,
  // writing [B, H, n, dv] at `output` by `output_layout`.
  void SetProblem(const void* query, const OperandLayout& query_layout,
                  int64_t first, int64_t n, void* output, DType output_dtype,
                  const OperandLayout& output_layout, PendingStep& step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // config_.layer is the model session's layer (null otherwise); the
  // fields below come from it or from the config.
  DecodeSessionConfig config_;
  int heads_ = 0;
  int kv_heads_ = 0;
  int64_t key_dim_ = 0;
  int64_t value_dim_ = 0;
  DType dtype_ = DType::kFloat32;
  DType cache_dtype_ = DType::kFloat32;
  RotaryOptions rotary_;
  KvCache::Dims dims_;
  size_t model_bytes_ = 0;
  // Serializes steps: a step writes the cache past its length, then moves
  // the length.
  mutable Mutex mu_;
  // Set by Create, replaced by a fork that freezes it; its dims never
  // change, its contents are written under mu_.
  std::unique_ptr<KvCache> cache_ ABSL_GUARDED_BY(mu_);
  // A forked session's frozen caches.
  struct FrozenCache {
    std::shared_ptr<const KvCache> cache;
    size_t bytes = 0;  // what it commits, fixed once frozen
    uint64_t uid = 0;  // unique in the process (NewVersion), never reused
  };
  std::vector<FrozenCache> frozen_ ABSL_GUARDED_BY(mu_);
  // See contents(): replaced by NewVersion() at every change of the tokens.
  uint64_t version_ ABSL_GUARDED_BY(mu_) = NewVersion();
  static uint64_t NewVersion();
  // Per layer, its length (readable without the lock), and where each
  // block of kCacheBlockKeys tokens is read: in a frozen cache or in
  // cache_. Blocks past a layer's table are in cache_; no table: every
  // block is. Set by Create (or Fork) before the session is shared; its
  // contents but the lengths are read and written under mu_.
  SessionLayers layers_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_DECODE_SESSION_H_
