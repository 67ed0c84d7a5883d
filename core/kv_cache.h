// The keys and values a decode session has seen, token-major:
// keys [batch, max_length, kv_heads, key_dim] and values
// [batch, max_length, kv_heads, value_dim] in FLOAT32 or BFLOAT16.
//
// The whole max_length is reserved as address space once (an anonymous
// mapping that commits no memory); the kernel commits pages as tokens are
// written into them, so the cache grows a page at a time, never moves, and
// holds within one page per batch entry of the bytes its tokens need. The
// destructor unmaps it: the memory goes back to the system at once.
//
// Ownership: owns its mapping. Thread-safety: none; its session serializes
// access.
#ifndef ATTNSERVE_CORE_KV_CACHE_H_
#define ATTNSERVE_CORE_KV_CACHE_H_

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
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const Dims& dims() const { return dims_; }
  // Tokens held.
  int64_t length() const { return length_; }
  // Makes tokens [length, new_length) part of the cache: they must have
  // been written.
  void set_length(int64_t new_length) { length_ = new_length; }
  // The memory the cache commits when holding `tokens` tokens (whole pages).
  size_t BytesFor(int64_t tokens) const;
  size_t bytes() const { return BytesFor(length_); }

  // Element (b, h, token, :) of the keys (values) is at
  // data + b * batch_stride + h * head_stride + token * row_stride.
  OperandLayout key_layout() const;
  OperandLayout value_layout() const;
  void* keys() { return keys_; }
  void* values() { return values_; }
  // Where token `token` of batch entry `b` starts: kv_heads * dim elements.
  void* key_row(int64_t b, int64_t token);
  void* value_row(int64_t b, int64_t token);

 private:
  KvCache() = default;
  size_t RegionBytes(int64_t dim) const;  // one batch entry's, page-rounded

  Dims dims_;
  int64_t length_ = 0;
  void* keys_ = nullptr;
  void* values_ = nullptr;
  size_t key_region_ = 0;    // bytes per batch entry
  size_t value_region_ = 0;  // bytes per batch entry
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_KV_CACHE_H_
