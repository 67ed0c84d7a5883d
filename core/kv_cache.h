// The keys and values a decode session has seen, head-major as attention
// reads them: keys [batch, kv_heads, max_length, key_dim] and values
// [batch, kv_heads, max_length, value_dim] in FLOAT32, BFLOAT16 or INT8,
// each (batch, head) plane starting on a page; one such cache per layer of
// a multi-layer session (`layers`). The cache keeps no per-layer state of
// its own (its session keeps each layer's length and the tokens it has
// written, and counts them in its bookkeeping): its only memory is its
// mapping, and a frozen cache shared by forks holds nothing else. An INT8 cache
// also holds one float32 scale per token of each (batch, head) plane of keys
// and of values
// ([batch, kv_heads, max_length], planes page-aligned too): a token's row
// is its int8 codes times its scale (QuantizeInt8).
//
// The whole max_length is reserved as address space once (an anonymous
// mapping that commits no memory); the kernel commits pages as tokens are
// written into them, so the cache grows a page at a time, never moves, and
// holds within one page per (batch, head) plane of the bytes its tokens
// need. The destructor unmaps it: the memory goes back to the system at
// once.
//
// Ownership: owns its mapping. Thread-safety: none; its session serializes
// access (a frozen cache is only read).
#ifndef ATTNSERVE_CORE_KV_CACHE_H_
#define ATTNSERVE_CORE_KV_CACHE_H_

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "core/attention_kernel.h"
#include "core/tensor.h"

namespace attnserve {

class KvCache {
 public:
  struct Dims {
    int64_t batch = 1;
    int64_t kv_heads = 1;
    int64_t key_dim = 0;
    int64_t value_dim = 0;
    int64_t max_length = 0;
    DType dtype = DType::kFloat32;  // FLOAT32, BFLOAT16 or INT8
    // Layers of a model, each with its own keys and values (and length).
    int64_t layers = 1;
  };

  // RESOURCE_EXHAUSTED when the address space cannot be reserved.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const Dims& dims);
  // The address space a cache of `dims` reserves (keys, values and an INT8
  // cache's scales of every layer, every plane page-rounded);
  // RESOURCE_EXHAUSTED when it exceeds what 64-bit arithmetic holds.
  static absl::StatusOr<size_t> ReservedBytes(const Dims& dims);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const Dims& dims() const { return dims_; }
  size_t reserved_bytes() const;
  // Drops the tokens of `layer` from `new_length` on, of the `written`
  // whose pages are committed, and returns how many stay committed:
  // `new_length` when their pages went back to the system, `written` when
  // they were kept. They go back when they are many (kReleaseBytes a
  // plane): giving back pages costs a TLB shootdown of every thread, more
  // than a decode step, so a rewind by a few tokens keeps them for the
  // tokens that follow.
  int64_t Truncate(int64_t layer, int64_t written, int64_t new_length);
  // The memory a layer commits when holding `tokens` tokens (whole pages;
  // pass the most it has written, to count the pages a rewind kept).
  size_t BytesFor(int64_t tokens) const;
  // The same for a layer whose tokens below `first` were never written
  // (they are read from another cache): the pages from `first`'s on.
  size_t BytesBetween(int64_t first, int64_t tokens) const;
  // Copies tokens [first, end) of `layer`'s every (batch, head) plane (and
  // their scales) from `from`, a cache of the same dims (a cache shared
  // copy-on-write, before this one writes over them); the caller records
  // them as written.
  void CopyTokens(const KvCache& from, int64_t layer, int64_t first,
                  int64_t end);

  // Within a layer, element (b, h, token, :) of the keys (values) is at
  // keys(layer) + b * batch_stride + h * head_stride + token * row_stride.
  OperandLayout key_layout() const;
  OperandLayout value_layout() const;
  void* keys(int64_t layer) { return At(kKeys, layer, 0, 0, 0); }
  void* values(int64_t layer) { return At(kValues, layer, 0, 0, 0); }
  const void* keys(int64_t layer) const { return At(kKeys, layer, 0, 0, 0); }
  const void* values(int64_t layer) const {
    return At(kValues, layer, 0, 0, 0);
  }
  // Where token `token` of (layer, batch entry `b`, head `h`) starts: dim
  // elements, followed by the head's next tokens.
  void* key_row(int64_t layer, int64_t b, int64_t h, int64_t token);
  void* value_row(int64_t layer, int64_t b, int64_t h, int64_t token);

  // INT8 caches (null otherwise): the scale of token `token` of (layer, b,
  // h), followed by the head's next tokens' scales; a layer's scale planes
  // start at key_scales(layer) / value_scales(layer), (b, h)'s at
  // b * batch_stride + h * head_stride floats (scale_layout()).
  bool quantized() const { return dims_.dtype == DType::kInt8; }
  float* key_scales(int64_t layer) {
    return static_cast<float*>(At(kKeyScales, layer, 0, 0, 0));
  }
  float* value_scales(int64_t layer) {
    return static_cast<float*>(At(kValueScales, layer, 0, 0, 0));
  }
  const float* key_scales(int64_t layer) const {
    return static_cast<const float*>(At(kKeyScales, layer, 0, 0, 0));
  }
  const float* value_scales(int64_t layer) const {
    return static_cast<const float*>(At(kValueScales, layer, 0, 0, 0));
  }
  float* key_scale(int64_t layer, int64_t b, int64_t h, int64_t token);
  float* value_scale(int64_t layer, int64_t b, int64_t h, int64_t token);
  OperandLayout scale_layout() const;

 private:
  // The cache's planes: keys, values, and an INT8 cache's scales.
  enum Region { kKeys, kValues, kKeyScales, kValueScales, kRegions };
  // Elements of one token in a plane of `region`, and their size.
  struct RegionShape {
    int64_t cols;
    size_t elem;
  };
  static RegionShape ShapeOf(const Dims& dims, int region);

  KvCache() = default;
  // (batch, head) planes of one layer, and of all.
  size_t layer_planes() const {
    return static_cast<size_t>(dims_.batch * dims_.kv_heads);
  }
  size_t planes() const {
    return layer_planes() * static_cast<size_t>(dims_.layers);
  }
  // Where token `token` of plane (layer, b, h) of `region` starts (null for
  // a region without bytes).
  void* At(int region, int64_t layer, int64_t b, int64_t h,
           int64_t token) const;

  Dims dims_;
  // Each region's mapping (null when it has no bytes) and its bytes per
  // (batch, head) plane for max_length tokens, page-rounded.
  void* base_[kRegions] = {};
  size_t plane_[kRegions] = {};
  // The one mapping the regions are carved from.
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
};

// The per-layer state of a decode session, in one allocation whose size
// follows from the session's dims alone, so that it is known (and counted
// against the session memory budget) before it exists: each layer's
// length, the tokens its own cache has written, and its block table (where
// each block of kCacheBlockKeys tokens is read from: the keys', values' and
// an INT8 cache's scales' bases), with room for every block of max_length.
// From a page on the block is a mapping of its own, so that it goes back to
// the system when the session ends (tcmalloc keeps freed blocks for reuse);
// a smaller one comes from the allocator, as a mapping would take a page.
//
// Ownership: owns its memory; movable. Thread-safety: the lengths are
// atomic; the rest belongs to its session, which serializes access.
class SessionLayers {
 public:
  struct Layer {
    std::atomic<int64_t> length{0};
    // Tokens whose pages the session's own cache has committed: the
    // length, or more after a rewind that kept them.
    int64_t written = 0;
    // The first token the own cache may hold: it has written none below.
    int64_t own_from = 0;
    // Entries in the block table; blocks past them are in the own cache.
    int64_t blocks = 0;
  };

  // The bytes Create allocates for a session whose cache has `dims`
  // (checked by DecodeSession::CacheDims, so that nothing overflows):
  // dims.layers x (sizeof(Layer) + tables x 8 x ceil(max_length /
  // kCacheBlockKeys)), with 2 tables (keys, values) or 4 for an INT8 cache
  // (and its scales); rounded up to whole pages from a page on.
  static size_t BytesFor(const KvCache::Dims& dims);
  // One layer's share: sizeof(Layer) and its tables, before page rounding.
  static size_t LayerBytes(const KvCache::Dims& dims);
  // RESOURCE_EXHAUSTED when the memory cannot be had.
  static absl::StatusOr<SessionLayers> Create(const KvCache::Dims& dims);

  SessionLayers() = default;
  SessionLayers(SessionLayers&& other) noexcept { *this = std::move(other); }
  SessionLayers& operator=(SessionLayers&& other) noexcept;
  ~SessionLayers() { Free(); }

  int64_t count() const { return layers_; }
  // What the block holds (BytesFor its dims).
  size_t bytes() const { return bytes_; }
  // Entries each table of a layer has room for.
  int64_t capacity() const { return capacity_; }
  Layer& layer(int64_t l) { return reinterpret_cast<Layer*>(base_)[l]; }
  const Layer& layer(int64_t l) const {
    return reinterpret_cast<const Layer*>(base_)[l];
  }
  // Layer l's tables, capacity() entries each (the scales' are null for a
  // cache that is not INT8).
  const void** keys(int64_t l) const { return Table(0, l); }
  const void** values(int64_t l) const { return Table(1, l); }
  const float** key_scales(int64_t l) const {
    return reinterpret_cast<const float**>(Table(2, l));
  }
  const float** value_scales(int64_t l) const {
    return reinterpret_cast<const float**>(Table(3, l));
  }
  // Copies the first `blocks` entries of layer l's tables from `from`, a
  // block of the same dims.
  void CopyTables(const SessionLayers& from, int64_t l, int64_t blocks);

 private:
  const void** Table(int table, int64_t l) const;
  void Free();

  std::byte* base_ = nullptr;  // the Layer records, then the tables
  size_t bytes_ = 0;
  bool mapped_ = false;
  int64_t layers_ = 0;
  int64_t capacity_ = 0;
  int tables_ = 0;
};

// Quantizes the n values of `x` to int8 codes in `codes` and returns their
// scale: symmetric, scale = max|x| / 127 and code = x / scale rounded to
// nearest (ties away from zero), so that code * scale is within scale / 2
// of x. A row of zeros has scale 0 and codes 0 (never NaN); a row holding
// a NaN or +-Inf has scale NaN (codes 0), so that what reads it is NaN as
// with a float cache.
float QuantizeInt8(const float* x, int64_t n, int8_t* codes);

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_KV_CACHE_H_
