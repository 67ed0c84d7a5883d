#include "core/decode_session.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention_common.h"
#include "core/attention_kernel.h"
#include "core/convert.h"
#include "core/status_macros.h"
#include "core/verify.h"

namespace attnserve {
namespace {

absl::Status VerifyPositive(int64_t value, absl::string_view field) {
  if (value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": must be > 0, got ", value));
}

// The plain session's head counts and dims, checked.
absl::Status VerifyAttentionConfig(const DecodeSessionConfig& c) {
  ATTN_RETURN_IF_ERROR(VerifyPositive(c.num_heads, "num_heads"));
  ATTN_RETURN_IF_ERROR(VerifyKvHeads(c.num_heads, c.num_kv_heads));
  ATTN_RETURN_IF_ERROR(VerifyPositive(c.key_dim, "head_dim"));
  if (c.value_dim < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("value_head_dim: must be >= 0, got ", c.value_dim));
  }
  if (c.dtype != DType::kFloat32 && c.dtype != DType::kBFloat16 &&
      c.dtype != DType::kInt8) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype: ", DTypeName(c.dtype),
                     " not supported for a session cache, expected FLOAT32, "
                     "BFLOAT16 or INT8"));
  }
  return VerifyRotary(c.rotary, c.key_dim, "rotary_dims");
}

// The cache dtype of a session computing in `compute`: `requested` (the
// compute dtype or INT8) or, unset, `fallback`.
absl::StatusOr<DType> CacheDTypeOf(std::optional<DType> requested,
                                   DType compute, DType fallback) {
  const DType cache = requested.value_or(fallback);
  if (cache == compute || cache == DType::kInt8) return cache;
  return absl::InvalidArgumentError(absl::StrCat(
      "cache_dtype: ", DTypeName(cache), " not supported with compute dtype ",
      DTypeName(compute), ", expected ", DTypeName(compute), " or INT8"));
}

// A model session's layer: self-attention over one hidden state.
absl::Status VerifyModelLayer(const MultiHeadLayer& layer) {
  if (layer.key_input_dim() != layer.query_dim() ||
      layer.value_input_dim() != layer.query_dim()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: key/value input widths ", layer.key_input_dim(), "/",
        layer.value_input_dim(), " differ from the query's ", layer.query_dim(),
        "; a session projects one hidden state (self-attention)"));
  }
  return absl::OkStatus();
}

// Rank `full` with the batch dim, or `full - 1` without it for a batch of
// one.
absl::Status VerifyBatchedRank(const TensorView& t, absl::string_view field,
                               int64_t full, int64_t batch) {
  if (t.rank() == full || (batch == 1 && t.rank() == full - 1)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": rank ", t.rank(), ", expected ", full,
      batch == 1 ? absl::StrCat(" (or ", full - 1, " without the batch dim)")
                 : ""));
}

// Copies the n new tokens of `src`, a [B, heads, n, d] operand of
// `src_dtype` (the cache's, or FLOAT32/BFLOAT16 for an INT8 cache, which
// quantizes each row) laid out as `layout`, into the rows first ..
// first + n - 1 of each (batch, head) of `layer` of the cache: of its keys,
// or of its values.
void AppendToCache(const void* src, DType src_dtype,
                   const OperandLayout& layout, int64_t batch, int64_t heads,
                   int64_t n, int64_t d, bool keys, int64_t layer,
                   int64_t first, KvCache& cache) {
  const size_t elem = DTypeSize(src_dtype);
  const char* from = static_cast<const char*>(src);
  std::vector<float> row(cache.quantized() ? d : 0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      char* to = static_cast<char*>(keys ? cache.key_row(layer, b, h, first)
                                         : cache.value_row(layer, b, h, first));
      const char* head =
          from + (b * layout.batch_stride + h * layout.head_stride) * elem;
      if (cache.quantized()) {
        float* scales = keys ? cache.key_scale(layer, b, h, first)
                             : cache.value_scale(layer, b, h, first);
        for (int64_t t = 0; t < n; ++t) {
          const void* x = head + t * layout.row_stride * elem;
          if (src_dtype == DType::kBFloat16) {
            for (int64_t c = 0; c < d; ++c) {
              row[c] = BFloat16ToFloat(static_cast<const uint16_t*>(x)[c]);
            }
          } else {
            std::memcpy(row.data(), x, d * sizeof(float));
          }
          scales[t] = QuantizeInt8(row.data(), d,
                                   reinterpret_cast<int8_t*>(to) + t * d);
        }
        continue;
      }
      if (layout.row_stride == d) {  // the head's rows are contiguous
        std::memcpy(to, head, n * d * elem);
        continue;
      }
      for (int64_t t = 0; t < n; ++t) {
        std::memcpy(to + t * d * elem, head + t * layout.row_stride * elem,
                    d * elem);
      }
    }
  }
}

// The cached rows [first, end) of every (batch entry, head) plane, keys
// and values, copied out: a step that starts before the cached length
// writes its tokens over them, and a step that then fails puts them back.
class SavedRows {
 public:
  // RESOURCE_EXHAUSTED when the copy cannot be allocated.
  static absl::StatusOr<SavedRows> Save(KvCache& cache, int64_t layer,
                                        int64_t first, int64_t end) {
    SavedRows saved;
    if (end <= first) return saved;
    const KvCache::Dims& d = cache.dims();
    saved.layer_ = layer;
    saved.first_ = first;
    saved.key_bytes_ = (end - first) * d.key_dim * DTypeSize(d.dtype);
    saved.value_bytes_ = (end - first) * d.value_dim * DTypeSize(d.dtype);
    saved.scale_bytes_ = cache.quantized() ? (end - first) * sizeof(float) : 0;
    ATTN_ASSIGN_OR_RETURN(
        saved.bytes_,
        Tensor::Allocate(
            DType::kUInt8,
            {d.batch * d.kv_heads *
             static_cast<int64_t>(saved.key_bytes_ + saved.value_bytes_ +
                                  2 * saved.scale_bytes_)}));
    saved.Copy(cache, /*restore=*/false);
    return saved;
  }
  void Restore(KvCache& cache) { Copy(cache, /*restore=*/true); }

 private:
  void Copy(KvCache& cache, bool restore) {
    if (key_bytes_ + value_bytes_ == 0) return;
    char* saved = static_cast<char*>(bytes_.data());
    const KvCache::Dims& d = cache.dims();
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t h = 0; h < d.kv_heads; ++h) {
        const bool scales = scale_bytes_ > 0;
        const std::pair<void*, size_t> rows[] = {
            {cache.key_row(layer_, b, h, first_), key_bytes_},
            {cache.value_row(layer_, b, h, first_), value_bytes_},
            {scales ? cache.key_scale(layer_, b, h, first_) : nullptr,
             scale_bytes_},
            {scales ? cache.value_scale(layer_, b, h, first_) : nullptr,
             scale_bytes_}};
        for (const auto& [row, bytes] : rows) {
          if (bytes == 0) continue;
          if (restore) {
            std::memcpy(row, saved, bytes);
          } else {
            std::memcpy(saved, row, bytes);
          }
          saved += bytes;
        }
      }
    }
  }

  int64_t layer_ = 0;
  int64_t first_ = 0;
  size_t key_bytes_ = 0;
  size_t value_bytes_ = 0;
  size_t scale_bytes_ = 0;  // of keys' and of values' scales, each
  Tensor bytes_;
};

}  // namespace

absl::StatusOr<KvCache::Dims> DecodeSession::Configure(
    const DecodeSessionConfig& config) {
  config_ = config;
  ATTN_RETURN_IF_ERROR(VerifyPositive(config.batch, "batch"));
  ATTN_RETURN_IF_ERROR(VerifyPositive(config.max_length, "max_length"));
  ATTN_RETURN_IF_ERROR(VerifyPositive(config.num_layers, "num_layers"));
  if (config.num_layers > kMaxSessionLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers: ", config.num_layers, " is more than the ",
                     kMaxSessionLayers, " layers a session may hold"));
  }
  if (config.layer != nullptr) {
    const MultiHeadLayer& layer = *config.layer;
    ATTN_RETURN_IF_ERROR(VerifyModelLayer(layer));
    heads_ = layer.num_heads();
    kv_heads_ = layer.num_kv_heads();
    key_dim_ = layer.head_key_dim();
    value_dim_ = layer.head_value_dim();
    dtype_ = layer.compute_dtype();
    rotary_ = layer.rotary();
    ATTN_ASSIGN_OR_RETURN(cache_dtype_,
                          CacheDTypeOf(config.cache_dtype, dtype_, dtype_));
    model_bytes_ = ModelBytes(layer);
  } else {
    ATTN_RETURN_IF_ERROR(VerifyAttentionConfig(config));
    heads_ = config.num_heads;
    kv_heads_ =
        config.num_kv_heads == 0 ? config.num_heads : config.num_kv_heads;
    key_dim_ = config.key_dim;
    value_dim_ = config.value_dim == 0 ? config.key_dim : config.value_dim;
    // INT8: float32 attention on an INT8 cache.
    const bool int8 = config.dtype == DType::kInt8;
    dtype_ = int8 ? DType::kFloat32 : config.dtype;
    rotary_ = config.rotary;
    if (int8 && config.cache_dtype.has_value() &&
        *config.cache_dtype != DType::kInt8) {
      return absl::InvalidArgumentError(
          absl::StrCat("cache_dtype: ", DTypeName(*config.cache_dtype),
                       " contradicts dtype INT8 (an INT8 cache)"));
    }
    ATTN_ASSIGN_OR_RETURN(
        cache_dtype_, CacheDTypeOf(config.cache_dtype, dtype_, config.dtype));
  }
  KvCache::Dims dims;
  dims.batch = config.batch;
  dims.kv_heads = kv_heads_;
  dims.key_dim = key_dim_;
  dims.value_dim = value_dim_;
  dims.max_length = config.max_length;
  dims.dtype = cache_dtype_;
  dims.layers = config.num_layers;
  // The reservation must fit the address space's arithmetic: refuse sizes
  // whose bytes overflow, as tensors do.
  const Shape reserved = {dims.layers, dims.batch, dims.max_length,
                          dims.kv_heads, dims.key_dim + dims.value_dim};
  ATTN_RETURN_IF_ERROR(
      CheckedNumElements(reserved, dims.dtype, "max_length").status());
  ATTN_RETURN_IF_ERROR(KvCache::ReservedBytes(dims).status());
  dims_ = dims;
  return dims;
}

size_t DecodeSession::ModelBytes(const MultiHeadLayer& layer) {
  // Rows x (inputs + a bias) per projection.
  const size_t in = static_cast<size_t>(layer.query_dim());
  const size_t heads = static_cast<size_t>(layer.num_heads());
  const size_t kv_heads = static_cast<size_t>(layer.num_kv_heads());
  const size_t dk = static_cast<size_t>(layer.head_key_dim());
  const size_t dv = static_cast<size_t>(layer.head_value_dim());
  size_t elements = (heads * dk + kv_heads * (dk + dv)) * (in + 1);
  // A layer given PyTorch's fused [3E, E] in_proj_weight keeps q, k and v
  // packed twice (apart, and fused for self-attention calls). The layer
  // does not tell which it was given: a shape that allows it counts both.
  if (kv_heads == heads && dk == dv && heads * dk == in &&
      layer.key_input_dim() == layer.query_dim() &&
      layer.value_input_dim() == layer.query_dim()) {
    elements *= 2;
  }
  if (layer.has_output_projection()) {
    elements += static_cast<size_t>(layer.output_dim()) * (heads * dv + 1);
  }
  return elements * sizeof(float);
}

absl::StatusOr<KvCache::Dims> DecodeSession::CacheDims(
    const DecodeSessionConfig& config) {
  DecodeSession unused;
  return unused.Configure(config);
}

absl::StatusOr<std::unique_ptr<DecodeSession>> DecodeSession::Create(
    const DecodeSessionConfig& config) {
  std::unique_ptr<DecodeSession> s(new DecodeSession());
  ATTN_ASSIGN_OR_RETURN(const KvCache::Dims dims, s->Configure(config));
  ATTN_ASSIGN_OR_RETURN(SessionLayers layers, SessionLayers::Create(dims));
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(dims));
  MutexLock lock(&s->mu_);
  s->Adopt(std::move(cache), std::move(layers));
  return s;
}

size_t DecodeSession::reserved_bytes() const {
  MutexLock lock(&mu_);
  return cache_->reserved_bytes();
}

size_t DecodeSession::OwnBytes(int64_t layer, int64_t first,
                               int64_t tokens) const {
  return cache_->BytesBetween(first,
                              std::max(tokens, layers_.layer(layer).written));
}

size_t DecodeSession::BytesAt(int64_t tokens, int64_t layer) const {
  MutexLock lock(&mu_);
  size_t bytes = 0;
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    bytes +=
        OwnBytes(l, layers_.layer(l).own_from,
                 l == layer ? std::clamp<int64_t>(tokens, 0, config_.max_length)
                            : length(l));
  }
  return bytes;
}

namespace {

int64_t BlocksOf(int64_t tokens) {
  return (tokens + kCacheBlockKeys - 1) / kCacheBlockKeys;
}

}  // namespace

bool DecodeSession::OwnsBlock(int64_t layer, size_t block) const {
  return layers_.keys(layer)[block] == cache_->keys(layer);
}

void DecodeSession::PointBlock(int64_t layer, size_t block,
                               const KvCache& cache) {
  layers_.keys(layer)[block] = cache.keys(layer);
  layers_.values(layer)[block] = cache.values(layer);
  if (cache.quantized()) {
    layers_.key_scales(layer)[block] = cache.key_scales(layer);
    layers_.value_scales(layer)[block] = cache.value_scales(layer);
  }
}

size_t DecodeSession::BytesAfter(const DecodeStepInputs& inputs,
                                 int64_t new_tokens) const {
  const int64_t layer = inputs.layer;
  if (layer < 0 || layer >= config_.num_layers) return cache_bytes();
  const int64_t start =
      std::max<int64_t>(inputs.position.value_or(length(layer)), 0);
  const int64_t end =
      std::clamp<int64_t>(start + new_tokens, 0, config_.max_length);
  MutexLock lock(&mu_);
  size_t bytes = 0;
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    const SessionLayers::Layer& state = layers_.layer(l);
    if (l != layer) {
      bytes += OwnBytes(l, state.own_from, length(l));
      continue;
    }
    int64_t from = state.own_from;
    const int64_t last = std::min(BlocksOf(end), state.blocks);
    for (int64_t i = start / kCacheBlockKeys; new_tokens > 0 && i < last; ++i) {
      if (!OwnsBlock(l, i)) {
        from = std::min(from, i * kCacheBlockKeys);  // copied by OwnBlocks
        break;
      }
    }
    bytes += OwnBytes(l, from, end);
  }
  return bytes;
}

absl::Status DecodeSession::VerifyForkLength(int64_t length) const {
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    const int64_t held = this->length(l);
    if (length >= 0 && length <= held) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "length: ", length, " is not in [0, ", held, "] (the tokens ",
        config_.num_layers > 1 ? absl::StrCat("layer ", l, " of ") : "",
        "the session holds)"));
  }
  return absl::OkStatus();
}

std::vector<int64_t> DecodeSession::ForkLengths(
    std::optional<int64_t> length) const {
  std::vector<int64_t> lengths(config_.num_layers);
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    lengths[l] = length.value_or(this->length(l));
  }
  return lengths;
}

bool DecodeSession::ReadsOwnCache(absl::Span<const int64_t> tokens) const {
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    if (tokens[l] == 0) continue;
    const size_t blocks = static_cast<size_t>(BlocksOf(tokens[l]));
    if (static_cast<size_t>(layers_.layer(l).blocks) < blocks) return true;
    for (size_t i = 0; i < blocks; ++i) {
      if (OwnsBlock(l, i)) return true;
    }
  }
  return false;
}

void DecodeSession::FreezeFor(absl::Span<const int64_t> lengths,
                              std::unique_ptr<KvCache>& fresh) {
  if (!ReadsOwnCache(lengths)) return;
  size_t bytes = 0;
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    // Every block up to the layer's length gets an entry: those past the
    // old table were in cache_, which stays where it is, frozen.
    SessionLayers::Layer& state = layers_.layer(l);
    const int64_t blocks = BlocksOf(length(l));
    for (int64_t i = state.blocks; i < blocks; ++i) PointBlock(l, i, *cache_);
    state.blocks = std::max(state.blocks, blocks);
    bytes += OwnBytes(l, state.own_from, 0);
    state.own_from = blocks * kCacheBlockKeys;
    state.written = 0;  // of `fresh`, which holds nothing yet
  }
  frozen_.push_back({std::move(cache_), bytes, NewVersion()});
  cache_ = std::move(fresh);
}

absl::StatusOr<std::unique_ptr<DecodeSession>> DecodeSession::Fork(
    std::optional<int64_t> length) {
  MutexLock lock(&mu_);
  if (length.has_value()) ATTN_RETURN_IF_ERROR(VerifyForkLength(*length));
  const std::vector<int64_t> shared = ForkLengths(length);
  // Both new caches are reserved before anything changes.
  std::unique_ptr<DecodeSession> fork(new DecodeSession());
  ATTN_ASSIGN_OR_RETURN(const KvCache::Dims dims, fork->Configure(config_));
  ATTN_ASSIGN_OR_RETURN(SessionLayers layers, SessionLayers::Create(dims));
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(dims));
  std::unique_ptr<KvCache> fresh;
  if (ReadsOwnCache(shared)) {
    ATTN_ASSIGN_OR_RETURN(fresh, KvCache::Create(dims));
  }
  MutexLock fork_lock(&fork->mu_);
  fork->Adopt(std::move(cache), std::move(layers));
  FreezeFor(shared, fresh);
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    const int64_t blocks = BlocksOf(shared[l]);
    fork->layers_.CopyTables(layers_, l, blocks);
    SessionLayers::Layer& state = fork->layers_.layer(l);
    state.blocks = blocks;
    state.own_from = blocks * kCacheBlockKeys;
    state.length.store(shared[l], std::memory_order_release);
  }
  // The frozen caches the fork reads, and only those.
  for (const FrozenCache& frozen : frozen_) {
    for (int64_t l = 0; l < config_.num_layers; ++l) {
      const void** keys = fork->layers_.keys(l);
      const void** end = keys + fork->layers_.layer(l).blocks;
      if (std::find(keys, end, frozen.cache->keys(l)) != end) {
        fork->frozen_.push_back(frozen);
        break;
      }
    }
  }
  return fork;
}

absl::StatusOr<size_t> DecodeSession::ForkReservedBytes(
    std::optional<int64_t> length) const {
  MutexLock lock(&mu_);
  if (length.has_value()) ATTN_RETURN_IF_ERROR(VerifyForkLength(*length));
  const size_t one = cache_->reserved_bytes();
  return ReadsOwnCache(ForkLengths(length)) ? 2 * one : one;
}

std::vector<DecodeSession::SharedCache> DecodeSession::shared_caches() const {
  MutexLock lock(&mu_);
  std::vector<SharedCache> caches;
  for (const FrozenCache& frozen : frozen_) {
    caches.push_back(
        {frozen.cache.get(), frozen.bytes, frozen.cache->reserved_bytes()});
  }
  return caches;
}

void DecodeSession::OwnBlocks(int64_t layer, int64_t first, int64_t end,
                              int64_t held) {
  SessionLayers::Layer& state = layers_.layer(layer);
  const int64_t last = std::min(BlocksOf(end), state.blocks);
  for (int64_t i = first / kCacheBlockKeys; i < last; ++i) {
    if (OwnsBlock(layer, i)) continue;
    const int64_t from = i * kCacheBlockKeys;
    const int64_t copied = std::min(held, from + kCacheBlockKeys);
    cache_->CopyTokens(*FrozenAt(layer, i)->cache, layer, from, copied);
    state.written = std::max(state.written, copied);
    PointBlock(layer, i, *cache_);
    state.own_from = std::min(state.own_from, from);
  }
}

const DecodeSession::FrozenCache* DecodeSession::FrozenAt(int64_t layer,
                                                          size_t block) const {
  for (const FrozenCache& frozen : frozen_) {
    if (frozen.cache->keys(layer) == layers_.keys(layer)[block]) {
      return &frozen;
    }
  }
  return nullptr;  // unreachable: a block not owned is in a frozen cache
}

void DecodeSession::Adopt(std::unique_ptr<KvCache> cache,
                          SessionLayers layers) {
  cache_ = std::move(cache);
  layers_ = std::move(layers);
}

double DecodeSession::StepFlops(int64_t new_tokens, int64_t layer) const {
  const double b = static_cast<double>(config_.batch);
  const double n = static_cast<double>(new_tokens);
  const double keys = static_cast<double>(length(layer)) + n;
  double flops = 2.0 * b * heads_ * n * keys * (key_dim_ + value_dim_);
  if (config_.layer != nullptr) {
    const double e = static_cast<double>(config_.layer->query_dim());
    flops += 2.0 * b * n * e *
             (heads_ * key_dim_ + kv_heads_ * (key_dim_ + value_dim_));
    if (config_.layer->has_output_projection()) {
      flops += 2.0 * b * n * heads_ * value_dim_ * config_.layer->output_dim();
    }
  }
  return flops;
}

absl::StatusOr<int64_t> DecodeSession::NewTokens(
    const DecodeStepInputs& in) const {
  ATTN_RETURN_IF_ERROR(VerifyLayer(in.layer));
  const int64_t batch = config_.batch;
  if (config_.layer != nullptr) {
    if (!in.input.has_value()) {
      return absl::InvalidArgumentError(
          "input: missing (a model session takes hidden states [B, n, E])");
    }
    if (in.query || in.key || in.value) {
      return absl::InvalidArgumentError(
          "query: a model session takes `input` (hidden states), not "
          "query/key/value");
    }
    ATTN_RETURN_IF_ERROR(VerifyBatchedRank(*in.input, "input", 3, batch));
    return in.input->dim(-2);
  }
  if (in.input.has_value()) {
    return absl::InvalidArgumentError(
        "input: an attention session takes query, key and value, not hidden "
        "states");
  }
  const std::pair<const std::optional<TensorView>*, absl::string_view>
      operands[] = {
          {&in.query, "query"}, {&in.key, "key"}, {&in.value, "value"}};
  for (const auto& [operand, field] : operands) {
    if (!operand->has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field,
                       ": missing (an attention session takes query, "
                       "key and value)"));
    }
    ATTN_RETURN_IF_ERROR(VerifyBatchedRank(**operand, field, 4, batch));
  }
  return in.query->dim(-2);
}

absl::Status DecodeSession::VerifyLayer(int64_t layer) const {
  if (layer >= 0 && layer < config_.num_layers) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "layer: ", layer, " is out of range [0, ", config_.num_layers, ")"));
}

absl::Status DecodeSession::VerifyRoom(int64_t layer, int64_t start,
                                       int64_t new_tokens) const {
  const int64_t held = length(layer);
  if (start < 0 || start > held) {
    return absl::InvalidArgumentError(absl::StrCat(
        "position: ", start, " is not in [0, ", held, "] (the tokens cached)"));
  }
  if (new_tokens <= config_.max_length - start) return absl::OkStatus();
  if (start == held) {
    return absl::OutOfRangeError(
        absl::StrCat("session: ", start, " cached + ", new_tokens,
                     " new tokens exceed its max_length ", config_.max_length));
  }
  // A refused rewind drops nothing: say so, and what the session holds.
  return absl::OutOfRangeError(absl::StrCat(
      "session: position ", start, " + ", new_tokens,
      " new tokens exceed its max_length ", config_.max_length,
      " (the session holds ", held, " tokens; nothing was changed)"));
}

absl::Status DecodeSession::VerifyAttentionInputs(
    const DecodeStepInputs& in) const {
  const TensorView& query = *in.query;
  const TensorView& key = *in.key;
  const TensorView& value = *in.value;
  ATTN_RETURN_IF_ERROR(VerifyFloating(query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameDType(key, "key", query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameDType(value, "value", query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameRank(key, "key", query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameRank(value, "value", query, "query"));
  const bool batched = query.rank() == 4;
  const int64_t n = query.dim(-2);
  const auto expect = [&](int64_t heads, int64_t d) {
    return batched ? Shape{config_.batch, heads, n, d} : Shape{heads, n, d};
  };
  ATTN_RETURN_IF_ERROR(VerifyShape(query, "query", expect(heads_, key_dim_)));
  ATTN_RETURN_IF_ERROR(VerifyShape(key, "key", expect(kv_heads_, key_dim_)));
  return VerifyShape(value, "value", expect(kv_heads_, value_dim_));
}

absl::Status DecodeSession::VerifyModelInput(const TensorView& input) const {
  const MultiHeadLayer& layer = *config_.layer;
  ATTN_RETURN_IF_ERROR(VerifyFloating(input, "input"));
  if (input.dim(-1) != layer.query_dim()) {
    return absl::InvalidArgumentError(
        absl::StrCat("input: last dim ", input.dim(-1), " != the model's ",
                     layer.query_dim()));
  }
  if (input.rank() == 3 && input.dim(0) != config_.batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("input: dim 0 ", input.dim(0), " != the session's batch ",
                     config_.batch));
  }
  return absl::OkStatus();
}

struct DecodeSession::PendingStep {
  int64_t layer = 0;
  int64_t start = 0;
  int64_t n = 0;
  int64_t held = 0;
  // The cached rows the step writes over (a rewind), for a failure.
  SavedRows overwritten;
  std::optional<ResultBuffer> output;
  // The operands the problem reads: the queries in the cache's dtype
  // (rotated), and the model session's keys/values/queries projections.
  OperandData query_data;
  Tensor rotated;
  Tensor projected_query;
  // A model session's attention output before its output projection.
  Tensor concat;
  const MultiHeadLayer* output_projection = nullptr;
  // Whether there is attention to run (a model step of 0 tokens has none).
  bool attend = false;
  float logit_multiplier = 1.0f;
  const std::atomic<bool>* cancelled = nullptr;
  AttentionProblem problem;
};

absl::StatusOr<std::unique_ptr<DecodeSession::PendingStep>>
DecodeSession::Prepare(const DecodeStepInputs& inputs,
                       const DecodeStepOptions& options,
                       ResultAllocator& results) {
  // Everything is checked before anything changes: a refused step leaves
  // the session as it was.
  ATTN_ASSIGN_OR_RETURN(const int64_t n, NewTokens(inputs));
  auto step = std::make_unique<PendingStep>();
  step->n = n;
  step->layer = inputs.layer;
  step->held = length(step->layer);
  step->start = inputs.position.value_or(step->held);
  ATTN_RETURN_IF_ERROR(VerifyRoom(step->layer, step->start, n));
  ATTN_RETURN_IF_ERROR(config_.layer != nullptr
                           ? VerifyModelInput(*inputs.input)
                           : VerifyAttentionInputs(inputs));
  AttentionOptions attention;
  attention.scale =
      options.scale.has_value() ? options.scale : config_.default_scale;
  attention.temperature = options.temperature;
  ATTN_ASSIGN_OR_RETURN(step->logit_multiplier,
                        LogitMultiplier(attention, key_dim_));
  step->cancelled = options.cancelled;
  // Copy-on-write: the blocks the step writes into become the session's
  // own first (for good, whether the step succeeds or not: they hold the
  // same tokens as the frozen ones).
  if (n > 0) OwnBlocks(step->layer, step->start, step->start + n, step->held);
  // A rewind writes the step's tokens over cached ones (rows start ..
  // held - 1); they are kept until the step has succeeded, so that a step
  // that fails later (cancelled, out of memory) is undone as well.
  ATTN_ASSIGN_OR_RETURN(step->overwritten,
                        SavedRows::Save(*cache_, step->layer, step->start,
                                        std::min(step->held, step->start + n)));
  const absl::Status status =
      config_.layer != nullptr
          ? PrepareModel(*inputs.input, step->start, results, *step)
          : PrepareAttention(inputs, step->start, results, *step);
  if (!status.ok()) {
    step->overwritten.Restore(*cache_);
    return status;
  }
  return step;
}

absl::Status DecodeSession::Finish(PendingStep& step, absl::Status status) {
  if (status.ok() && step.output_projection != nullptr) {
    status = step.output_projection->ProjectPart(
        MultiHeadLayer::Part::kOutput, config_.batch * step.n,
        step.concat.data(), step.output->data(), step.output->dtype());
  }
  if (!status.ok()) {
    step.overwritten.Restore(*cache_);
    return status;
  }
  step.output->Finish();
  const int64_t end = step.start + step.n;
  SessionLayers::Layer& state = layers_.layer(step.layer);
  if (end < step.held) {
    state.written = cache_->Truncate(step.layer, state.written, end);
  }
  state.written = std::max(state.written, end);
  state.length.store(end, std::memory_order_release);
  version_ = NewVersion();
  return absl::OkStatus();
}

absl::Status DecodeSession::Step(const DecodeStepInputs& inputs,
                                 const DecodeStepOptions& options,
                                 ResultAllocator& results) {
  MutexLock lock(&mu_);
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<PendingStep> step,
                        Prepare(inputs, options, results));
  absl::Status attention;
  if (step->attend) attention = RunAttention(step->problem);
  return Finish(*step, std::move(attention));
}

// Locks every session of `steps` (address order), prepares each step, runs
// all their problems in one kernel pass and finishes each. The locks are
// taken in a loop, which the thread-safety analysis cannot follow.
std::vector<absl::Status> StepSessions(absl::Span<const SessionStepInput> steps)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::vector<absl::Status> statuses(steps.size());
  std::vector<size_t> order;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (steps[i].session == nullptr) {
      statuses[i] = absl::InvalidArgumentError(
          absl::StrCat("steps[", i, "]: session: missing"));
    } else if (steps[i].results == nullptr) {
      statuses[i] = absl::InvalidArgumentError(
          absl::StrCat("steps[", i, "]: results: missing"));
    } else {
      order.push_back(i);
    }
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::less<const DecodeSession*>()(steps[a].session,
                                             steps[b].session);
  });
  std::vector<DecodeSession*> locked;
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    if (k > 0 && steps[order[k - 1]].session == steps[i].session) {
      // The first entry (lowest index, the sort is stable) keeps it.
      size_t first = k - 1;
      while (first > 0 && steps[order[first - 1]].session == steps[i].session) {
        --first;
      }
      statuses[i] = absl::InvalidArgumentError(
          absl::StrCat("steps[", i, "]: session: also in steps[", order[first],
                       "]; a call steps each session at most once"));
      continue;
    }
    steps[i].session->mu_.Lock();
    locked.push_back(steps[i].session);
  }
  std::vector<std::unique_ptr<DecodeSession::PendingStep>> pending(
      steps.size());
  std::vector<const AttentionProblem*> problems;
  std::vector<size_t> problem_of;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (!statuses[i].ok()) continue;
    auto step = steps[i].session->Prepare(steps[i].inputs, steps[i].options,
                                          *steps[i].results);
    if (!step.ok()) {
      statuses[i] = step.status();
      continue;
    }
    pending[i] = std::move(*step);
    if (pending[i]->attend) {
      problems.push_back(&pending[i]->problem);
      problem_of.push_back(i);
    }
  }
  const std::vector<absl::Status> attention = RunAttentionBatch(problems);
  std::vector<absl::Status> attention_of(steps.size());
  for (size_t k = 0; k < problem_of.size(); ++k) {
    attention_of[problem_of[k]] = attention[k];
  }
  for (size_t i = 0; i < steps.size(); ++i) {
    if (pending[i] == nullptr) continue;
    statuses[i] =
        steps[i].session->Finish(*pending[i], std::move(attention_of[i]));
  }
  for (DecodeSession* session : locked) session->mu_.Unlock();
  return statuses;
}

absl::Status DecodeSession::PrepareAttention(const DecodeStepInputs& in,
                                             int64_t first,
                                             ResultAllocator& results,
                                             PendingStep& step) {
  const TensorView& query = *in.query;
  const TensorView& key = *in.key;
  const TensorView& value = *in.value;
  const bool batched = query.rank() == 4;
  const int64_t batch = config_.batch;
  const int64_t n = query.dim(-2);
  const auto expect = [&](int64_t heads, int64_t d) {
    return batched ? Shape{batch, heads, n, d} : Shape{heads, n, d};
  };
  ATTN_ASSIGN_OR_RETURN(
      step.output,
      ResultBuffer::Allocate(results, "output", query.dtype,
                             expect(heads_, value_dim_),
                             /*bf16_ok=*/dtype_ == DType::kBFloat16));
  ATTN_ASSIGN_OR_RETURN(OperandData key_data,
                        OperandData::From(key, dtype_, "key"));
  ATTN_ASSIGN_OR_RETURN(OperandData value_data,
                        OperandData::From(value, dtype_, "value"));
  ATTN_ASSIGN_OR_RETURN(step.query_data,
                        OperandData::From(query, dtype_, "query"));
  const void* q = step.query_data.data();
  if (rotary_.dims > 0) {
    ATTN_ASSIGN_OR_RETURN(
        step.rotated, Tensor::Allocate(dtype_, {batch, heads_, n, key_dim_}));
    std::memcpy(step.rotated.data(), q, step.rotated.num_bytes());
    ApplyRotary(rotary_, dtype_, step.rotated.data(),
                DenseLayout(heads_, n, key_dim_), batch, heads_, n, first);
    q = step.rotated.data();
  }
  const OperandLayout key_layout = DenseLayout(kv_heads_, n, key_dim_);
  const void* keys = key_data.data();
  Tensor rotated_keys;
  if (cache_->quantized() && rotary_.dims > 0) {
    // An INT8 cache quantizes the rotated keys.
    ATTN_ASSIGN_OR_RETURN(
        rotated_keys,
        Tensor::Allocate(dtype_, {batch, kv_heads_, n, key_dim_}));
    std::memcpy(rotated_keys.data(), keys, rotated_keys.num_bytes());
    ApplyRotary(rotary_, dtype_, rotated_keys.data(), key_layout, batch,
                kv_heads_, n, first);
    keys = rotated_keys.data();
  }
  // Nothing can fail from here on: the cache is written last.
  AppendToCache(keys, dtype_, key_layout, batch, kv_heads_, n, key_dim_,
                /*keys=*/true, step.layer, first, *cache_);
  AppendToCache(value_data.data(), dtype_,
                DenseLayout(kv_heads_, n, value_dim_), batch, kv_heads_, n,
                value_dim_, /*keys=*/false, step.layer, first, *cache_);
  if (!cache_->quantized()) {
    ApplyRotary(rotary_, dtype_, cache_->key_row(step.layer, 0, 0, first),
                cache_->key_layout(), batch, kv_heads_, n, first);
  }
  SetProblem(q, DenseLayout(heads_, n, key_dim_), first, n, step.output->data(),
             step.output->dtype(), DenseLayout(heads_, n, value_dim_), step);
  return absl::OkStatus();
}

absl::Status DecodeSession::PrepareModel(const TensorView& input, int64_t first,
                                         ResultAllocator& results,
                                         PendingStep& step) {
  const MultiHeadLayer& layer = *config_.layer;
  const bool batched = input.rank() == 3;
  const int64_t batch = config_.batch;
  const int64_t n = input.dim(-2);
  const Shape output_shape = batched ? Shape{batch, n, layer.output_dim()}
                                     : Shape{n, layer.output_dim()};
  ATTN_ASSIGN_OR_RETURN(
      step.output,
      ResultBuffer::Allocate(results, "output", input.dtype, output_shape,
                             /*bf16_ok=*/dtype_ == DType::kBFloat16));
  if (n == 0) return absl::OkStatus();
  ATTN_ASSIGN_OR_RETURN(OperandData x,
                        OperandData::From(input, dtype_, "input"));

  // Keys and values: projected for every sequence at once, [B, n, Hkv*d],
  // then each head's rows appended to its plane of the cache.
  ATTN_ASSIGN_OR_RETURN(
      Tensor k, Tensor::Allocate(dtype_, {batch, n, kv_heads_ * key_dim_}));
  ATTN_ASSIGN_OR_RETURN(
      Tensor v, Tensor::Allocate(dtype_, {batch, n, kv_heads_ * value_dim_}));
  ATTN_RETURN_IF_ERROR(layer.ProjectPart(MultiHeadLayer::Part::kKey, batch * n,
                                         x.data(), k.data(), dtype_));
  ATTN_RETURN_IF_ERROR(layer.ProjectPart(
      MultiHeadLayer::Part::kValue, batch * n, x.data(), v.data(), dtype_));
  ATTN_ASSIGN_OR_RETURN(
      step.projected_query,
      Tensor::Allocate(dtype_, {batch, n, heads_ * key_dim_}));
  ATTN_RETURN_IF_ERROR(layer.ProjectPart(MultiHeadLayer::Part::kQuery,
                                         batch * n, x.data(),
                                         step.projected_query.data(), dtype_));
  const int64_t concat_dim = heads_ * value_dim_;
  if (layer.has_output_projection()) {
    ATTN_ASSIGN_OR_RETURN(step.concat,
                          Tensor::Allocate(dtype_, {batch, n, concat_dim}));
    step.output_projection = &layer;
  }
  const OperandLayout k_layout = InterleavedHeadsLayout(kv_heads_, n, key_dim_);
  // An INT8 cache quantizes the rotated keys.
  if (cache_->quantized()) {
    ApplyRotary(rotary_, dtype_, k.data(), k_layout, batch, kv_heads_, n,
                first);
  }
  // Nothing can fail from here on: the cache is written last.
  AppendToCache(k.data(), dtype_, k_layout, batch, kv_heads_, n, key_dim_,
                /*keys=*/true, step.layer, first, *cache_);
  AppendToCache(
      v.data(), dtype_, InterleavedHeadsLayout(kv_heads_, n, value_dim_), batch,
      kv_heads_, n, value_dim_, /*keys=*/false, step.layer, first, *cache_);
  if (!cache_->quantized()) {
    ApplyRotary(rotary_, dtype_, cache_->key_row(step.layer, 0, 0, first),
                cache_->key_layout(), batch, kv_heads_, n, first);
  }
  const OperandLayout q_layout = InterleavedHeadsLayout(heads_, n, key_dim_);
  ApplyRotary(rotary_, dtype_, step.projected_query.data(), q_layout, batch,
              heads_, n, first);
  const OperandLayout out_layout =
      InterleavedHeadsLayout(heads_, n, value_dim_);
  if (step.output_projection == nullptr) {
    SetProblem(step.projected_query.data(), q_layout, first, n,
               step.output->data(), step.output->dtype(), out_layout, step);
  } else {
    SetProblem(step.projected_query.data(), q_layout, first, n,
               step.concat.data(), dtype_, out_layout, step);
  }
  return absl::OkStatus();
}

void DecodeSession::SetProblem(const void* query,
                               const OperandLayout& query_layout, int64_t first,
                               int64_t n, void* output, DType output_dtype,
                               const OperandLayout& output_layout,
                               PendingStep& step) {
  // The new tokens see every cached one and each other causally; the
  // kernel reads each key/value head once for its group of query heads.
  AttentionProblem& p = step.problem;
  p.batch = config_.batch;
  p.heads = heads_;
  p.kv_group = heads_ / kv_heads_;
  p.query_len = n;
  p.key_len = first + n;
  p.key_dim = key_dim_;
  p.value_dim = value_dim_;
  p.operand_dtype = dtype_;
  p.query = query;
  p.query_layout = query_layout;
  p.key = cache_->keys(step.layer);
  p.key_layout = cache_->key_layout();
  p.value = cache_->values(step.layer);
  p.value_layout = cache_->value_layout();
  const size_t blocks = static_cast<size_t>(layers_.layer(step.layer).blocks);
  p.key_blocks = {layers_.keys(step.layer), blocks};
  p.value_blocks = {layers_.values(step.layer), blocks};
  if (cache_->quantized()) {
    p.int8_kv = true;
    p.key_scales = cache_->key_scales(step.layer);
    p.value_scales = cache_->value_scales(step.layer);
    p.scale_layout = cache_->scale_layout();
    p.key_scale_blocks = {layers_.key_scales(step.layer), blocks};
    p.value_scale_blocks = {layers_.value_scales(step.layer), blocks};
  }
  p.output = output;
  p.output_dtype = output_dtype;
  p.output_layout = output_layout;
  p.logit_multiplier = step.logit_multiplier;
  p.causal = true;
  p.causal_offset = first;
  p.cancelled = step.cancelled;
  step.attend = true;
}

}  // namespace attnserve

namespace attnserve {
namespace {

// The bytes of one token's row in each region of a cache of `dims`: keys,
// values, and an INT8 cache's key and value scales.
std::array<size_t, 4> RegionRowBytes(const KvCache::Dims& dims) {
  const size_t elem = DTypeSize(dims.dtype);
  const size_t scale = dims.dtype == DType::kInt8 ? sizeof(float) : 0;
  return {static_cast<size_t>(dims.key_dim) * elem,
          static_cast<size_t>(dims.value_dim) * elem, scale, scale};
}

// OK if every element of `rows` (of cache dtype `dtype`, or float32 scales
// when `scales`) is finite, and scales are >= 0.
// Whether any of `n` float32 or bfloat16 elements (as their bits) at `p`
// has its exponent all ones (Inf or NaN); without an early exit, so
// that it vectorizes.
template <typename Bits>
bool AnyNonFinite(const char* p, size_t n, Bits exponent) {
  Bits any = 0;
  for (size_t i = 0; i < n; ++i) {
    Bits bits;
    std::memcpy(&bits, p + i * sizeof(Bits), sizeof(Bits));
    any |= static_cast<Bits>((bits & exponent) == exponent);
  }
  return any != 0;
}

// The first non-finite element of `n` at `p`, or `n`.
template <typename Bits>
size_t FirstNonFinite(const char* p, size_t n, Bits exponent) {
  constexpr size_t kChunk = 4096;
  for (size_t start = 0; start < n; start += kChunk) {
    const size_t count = std::min(kChunk, n - start);
    if (!AnyNonFinite<Bits>(p + start * sizeof(Bits), count, exponent)) {
      continue;
    }
    for (size_t i = start; i < start + count; ++i) {
      Bits bits;
      std::memcpy(&bits, p + i * sizeof(Bits), sizeof(Bits));
      if ((bits & exponent) == exponent) return i;
    }
  }
  return n;
}

absl::Status VerifyRows(const char* rows, size_t bytes, DType dtype,
                        bool scales, absl::string_view what) {
  size_t bad = bytes;
  if (scales) {
    for (size_t i = 0; i < bytes / sizeof(float); ++i) {
      float v;
      std::memcpy(&v, rows + i * sizeof(float), sizeof(float));
      if (!std::isfinite(v) || v < 0) {
        bad = i;
        break;
      }
    }
  } else if (dtype == DType::kFloat32) {
    const size_t n = bytes / sizeof(float);
    const size_t first = FirstNonFinite<uint32_t>(rows, n, 0x7f800000u);
    if (first < n) bad = first;
  } else if (dtype == DType::kBFloat16) {
    const size_t n = bytes / sizeof(uint16_t);
    const size_t first = FirstNonFinite<uint16_t>(rows, n, 0x7f80);
    if (first < n) bad = first;
  }
  if (bad == bytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": element ", bad, " is ",
                   scales ? "not a finite scale >= 0" : "not finite"));
}

}  // namespace

size_t DecodeSession::RowBytes(int64_t tokens) const {
  const std::array<size_t, 4> row = RegionRowBytes(dims_);
  const size_t planes = static_cast<size_t>(dims_.batch * dims_.kv_heads);
  size_t bytes = 0;
  for (size_t r : row) bytes += r * planes * static_cast<size_t>(tokens);
  return bytes;
}

const char* DecodeSession::RowAt(int region, int64_t layer, int64_t plane,
                                 int64_t token) const {
  const size_t block = static_cast<size_t>(token / kCacheBlockKeys);
  const bool tabled = static_cast<int64_t>(block) < layers_.layer(layer).blocks;
  const void* base = nullptr;
  switch (region) {
    case 0:
      base = tabled ? layers_.keys(layer)[block] : cache_->keys(layer);
      break;
    case 1:
      base = tabled ? layers_.values(layer)[block] : cache_->values(layer);
      break;
    case 2:
      base =
          tabled ? layers_.key_scales(layer)[block] : cache_->key_scales(layer);
      break;
    default:
      base = tabled ? layers_.value_scales(layer)[block]
                    : cache_->value_scales(layer);
  }
  // Every cache of the session has the same dims: a plane starts at the
  // same offset from its layer's base in each.
  const char* own_base = static_cast<const char*>(
      region == 0   ? cache_->keys(layer)
      : region == 1 ? cache_->values(layer)
      : region == 2 ? static_cast<const void*>(cache_->key_scales(layer))
                    : static_cast<const void*>(cache_->value_scales(layer)));
  const int64_t b = plane / dims_.kv_heads;
  const int64_t h = plane % dims_.kv_heads;
  KvCache& own = *cache_;
  const char* own_row = static_cast<const char*>(
      region == 0   ? own.key_row(layer, b, h, token)
      : region == 1 ? own.value_row(layer, b, h, token)
      : region == 2 ? static_cast<void*>(own.key_scale(layer, b, h, token))
                    : static_cast<void*>(own.value_scale(layer, b, h, token)));
  return static_cast<const char*>(base) + (own_row - own_base);
}

void DecodeSession::GatherRows(int64_t layer, int64_t first, int64_t tokens,
                               std::string& rows) const {
  const std::array<size_t, 4> row = RegionRowBytes(dims_);
  const int64_t planes = dims_.batch * dims_.kv_heads;
  const size_t at = rows.size();
  rows.resize(at + RowBytes(tokens));
  char* out = rows.data() + at;
  for (int region = 0; region < 4; ++region) {
    const size_t bytes = row[region] * static_cast<size_t>(tokens);
    if (bytes == 0) continue;
    for (int64_t plane = 0; plane < planes; ++plane) {
      std::memcpy(out, RowAt(region, layer, plane, first), bytes);
      out += bytes;
    }
  }
}

uint64_t DecodeSession::NewVersion() {
  // Process-wide, so that a version names one session's contents.
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

DecodeSession::Contents DecodeSession::contents() const {
  MutexLock lock(&mu_);
  Contents contents;
  contents.version = version_;
  for (int64_t layer = 0; layer < config_.num_layers; ++layer) {
    contents.lengths.push_back(length(layer));
  }
  return contents;
}

absl::StatusOr<uint64_t> DecodeSession::CopyRows(int64_t layer, int64_t first,
                                                 int64_t tokens,
                                                 std::string& rows) const {
  ATTN_RETURN_IF_ERROR(VerifyLayer(layer));
  MutexLock lock(&mu_);
  if (first < 0 || tokens < 0 || first > length(layer) - tokens) {
    return absl::OutOfRangeError(absl::StrCat("tokens ", first, "..",
                                              first + tokens, ": layer ", layer,
                                              " holds ", length(layer)));
  }
  GatherRows(layer, first, tokens, rows);
  return version_;
}

absl::Status DecodeSession::AppendRows(int64_t layer, int64_t first,
                                       int64_t tokens, absl::string_view rows) {
  ATTN_RETURN_IF_ERROR(VerifyLayer(layer));
  if (tokens < 0 || rows.size() != RowBytes(tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows: ", rows.size(), " bytes; ", tokens, " tokens take ",
                     RowBytes(std::max<int64_t>(tokens, 0))));
  }
  MutexLock lock(&mu_);
  SessionLayers::Layer& state = layers_.layer(layer);
  if (first < state.blocks * kCacheBlockKeys) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rows: token ", first, " of layer ", layer,
        " is in a block shared with other sessions; append past token ",
        state.blocks * kCacheBlockKeys));
  }
  if (first != length(layer)) {
    return absl::InvalidArgumentError(absl::StrCat("rows: start at token ",
                                                   first, "; layer ", layer,
                                                   " holds ", length(layer)));
  }
  ATTN_RETURN_IF_ERROR(VerifyRoom(layer, first, tokens));
  const std::array<size_t, 4> row = RegionRowBytes(dims_);
  const int64_t planes = dims_.batch * dims_.kv_heads;
  const char* in = rows.data();
  for (int region = 0; region < 4; ++region) {
    const size_t bytes =
        row[region] * static_cast<size_t>(tokens) * static_cast<size_t>(planes);
    ATTN_RETURN_IF_ERROR(VerifyRows(
        in, bytes, dims_.dtype, region >= 2,
        absl::StrCat(
            "rows of layer ", layer, " (",
            std::array{"keys", "values", "key scales", "value scales"}[region],
            ")")));
    in += bytes;
  }
  in = rows.data();
  for (int region = 0; region < 4; ++region) {
    const size_t bytes = row[region] * static_cast<size_t>(tokens);
    if (bytes == 0) continue;
    for (int64_t plane = 0; plane < planes; ++plane) {
      std::memcpy(const_cast<char*>(RowAt(region, layer, plane, first)), in,
                  bytes);
      in += bytes;
    }
  }
  state.written = std::max(state.written, first + tokens);
  state.length.store(first + tokens, std::memory_order_release);
  version_ = NewVersion();
  return absl::OkStatus();
}

DecodeSession::SharedBase DecodeSession::shared_base() const {
  MutexLock lock(&mu_);
  SharedBase base;
  bool any = false;
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    const int64_t whole =
        std::min(layers_.layer(l).blocks, length(l) / kCacheBlockKeys);
    int64_t block = 0;
    for (; block < whole && !OwnsBlock(l, static_cast<size_t>(block));
         ++block) {
      const uint64_t uid = FrozenAt(l, static_cast<size_t>(block))->uid;
      base.key.append(reinterpret_cast<const char*>(&uid), sizeof(uid));
    }
    base.lengths.push_back(block * kCacheBlockKeys);
    any = any || block > 0;
    base.key.push_back(';');  // the layers apart
  }
  if (!any) base.key.clear();
  return base;
}

bool DecodeSession::SameConfig(const DecodeSession& other) const {
  const DecodeSessionConfig& a = config_;
  const DecodeSessionConfig& b = other.config_;
  return a.layer == b.layer && a.model == b.model && heads_ == other.heads_ &&
         kv_heads_ == other.kv_heads_ && key_dim_ == other.key_dim_ &&
         value_dim_ == other.value_dim_ && dtype_ == other.dtype_ &&
         cache_dtype_ == other.cache_dtype_ &&
         rotary_.dims == other.rotary_.dims &&
         rotary_.base == other.rotary_.base && a.batch == b.batch &&
         a.max_length == b.max_length && a.num_layers == b.num_layers &&
         a.default_scale == b.default_scale;
}

int64_t DecodeSession::SharedPrefix(const DecodeSession& other) const {
  if (&other == this || !SameConfig(other)) return 0;
  MutexLock other_lock(&other.mu_);
  MutexLock lock(&mu_);
  int64_t blocks = config_.max_length;
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    blocks = std::min(blocks,
                      std::min(length(l), other.length(l)) / kCacheBlockKeys);
  }
  const std::array<size_t, 4> row = RegionRowBytes(dims_);
  const int64_t planes = dims_.batch * dims_.kv_heads;
  for (int64_t block = 0; block < blocks; ++block) {
    // A block lies in one cache: its rows of a plane are contiguous.
    const int64_t first = block * kCacheBlockKeys;
    for (int64_t l = 0; l < config_.num_layers; ++l) {
      for (int region = 0; region < 4; ++region) {
        const size_t bytes = row[region] * static_cast<size_t>(kCacheBlockKeys);
        for (int64_t plane = 0; bytes > 0 && plane < planes; ++plane) {
          if (std::memcmp(RowAt(region, l, plane, first),
                          other.RowAt(region, l, plane, first), bytes) != 0) {
            return first;
          }
        }
      }
    }
  }
  return blocks * kCacheBlockKeys;
}

}  // namespace attnserve
