// The keys and values a decode session has seen, head-major as attention
// reads them: keys [batch, kv_heads, max_length, key_dim] and values
// [batch, kv_heads, max_length, value_dim] in FLOAT32, BFLOAT16 or INT8,
// each (batch, head) plane starting on a page; one such cache per layer of
// a multi-layer session (`layers`), each with its own length. An INT8 cache
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
// access.
#ifndef ATTNSERVE_CORE_KV_CACHE_H_
#define ATTNSERVE_CORE_KV_CACHE_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

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
  // Records that tokens up to `tokens` of `layer` have been written (their
  // pages are committed). The session that owns the cache keeps the
  // lengths.
  void Wrote(int64_t layer, int64_t tokens) {
    written_[layer] = std::max(written_[layer], tokens);
  }
  // Drops the tokens of `layer` from `new_length` on. Their pages go back to
  // the system when they are many (kReleaseBytes a plane): giving back pages
  // costs a TLB shootdown of every thread, more than a decode step, so a
  // rewind by a few tokens keeps them for the tokens that follow.
  void Truncate(int64_t layer, int64_t new_length);
  // The memory `layer` commits when holding `tokens` tokens (whole pages),
  // counting the pages a rewind kept.
  size_t BytesFor(int64_t layer, int64_t tokens) const;
  // The same for a cache whose tokens below `first` were never written
  // (they are read from another cache): the pages from `first`'s on.
  size_t BytesBetween(int64_t layer, int64_t first, int64_t tokens) const;
  // Copies tokens [first, end) of `layer`'s every (batch, head) plane (and
  // their scales) from `from`, a cache of the same dims (a cache shared
  // copy-on-write, before this one writes over them).
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
  // Per layer, tokens whose pages are committed: the layer's length, or
  // more after a rewind.
  std::vector<int64_t> written_;
  // Each region's mapping (null when it has no bytes) and its bytes per
  // (batch, head) plane for max_length tokens, page-rounded.
  void* base_[kRegions] = {};
  size_t plane_[kRegions] = {};
  // The one mapping the regions are carved from.
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
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
