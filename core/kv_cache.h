// The keys and values a decode session has seen, head-major as attention
// reads them: keys [batch, kv_heads, max_length, key_dim] and values
// [batch, kv_heads, max_length, value_dim] in FLOAT32 or BFLOAT16, each
// (batch, head) plane starting on a page.
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
    DType dtype = DType::kFloat32;  // FLOAT32 or BFLOAT16
  };

  // RESOURCE_EXHAUSTED when the address space cannot be reserved.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const Dims& dims);
  // The address space a cache of `dims` reserves (keys and values, every
  // plane page-rounded); RESOURCE_EXHAUSTED when it exceeds what 64-bit
  // arithmetic holds.
  static absl::StatusOr<size_t> ReservedBytes(const Dims& dims);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const Dims& dims() const { return dims_; }
  size_t reserved_bytes() const;
  // Records that tokens up to `tokens` have been written (their pages are
  // committed). The session that owns the cache keeps its length.
  void Wrote(int64_t tokens) { written_ = std::max(written_, tokens); }
  // Drops the tokens from `new_length` on. Their pages go back to the
  // system when they are many (kReleaseBytes a plane): giving back pages
  // costs a TLB shootdown of every thread, more than a decode step, so a
  // rewind by a few tokens keeps them for the tokens that follow.
  void Truncate(int64_t new_length);
  // The memory the cache commits when holding `tokens` tokens (whole
  // pages), counting the pages a rewind kept.
  size_t BytesFor(int64_t tokens) const;
  // The same for a cache whose tokens below `first` were never written
  // (they are read from another cache): the pages from `first`'s on.
  size_t BytesBetween(int64_t first, int64_t tokens) const;
  // Copies tokens [first, end) of every (batch, head) plane from the cache
  // of the same dims whose keys and values start at `keys` and `values`
  // (a cache shared copy-on-write, before this one writes over them).
  void CopyTokens(const void* keys, const void* values, int64_t first,
                  int64_t end);

  // Element (b, h, token, :) of the keys (values) is at
  // data + b * batch_stride + h * head_stride + token * row_stride.
  OperandLayout key_layout() const;
  OperandLayout value_layout() const;
  void* keys() { return keys_; }
  void* values() { return values_; }
  const void* keys() const { return keys_; }
  const void* values() const { return values_; }
  // Where token `token` of (batch entry `b`, head `h`) starts: dim
  // elements, followed by the head's next tokens.
  void* key_row(int64_t b, int64_t h, int64_t token);
  void* value_row(int64_t b, int64_t h, int64_t token);

 private:
  KvCache() = default;
  // One (batch, head) plane's bytes for max_length tokens, page-rounded.
  size_t PlaneBytes(int64_t dim) const;

  Dims dims_;
  // Tokens whose pages are committed: the session's length, or more after
  // a rewind.
  int64_t written_ = 0;
  void* keys_ = nullptr;
  void* values_ = nullptr;
  size_t key_plane_ = 0;
  size_t value_plane_ = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_KV_CACHE_H_
