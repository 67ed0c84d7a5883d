// Recycles large aligned buffers, so that a server answering requests of
// recurring shapes does not map and fault in fresh pages for every result
// and intermediate.
//
// Buffers of at least kMinPooledBytes are rounded up to 64 KiB and kept on
// release, grouped by size, up to a budget of cached bytes; past it a
// released buffer is freed. Smaller buffers go straight to malloc.
//
// Thread-safety: all methods may be called concurrently.
#ifndef ATTNSERVE_CORE_BUFFER_POOL_H_
#define ATTNSERVE_CORE_BUFFER_POOL_H_

#include <cstddef>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "core/mutex.h"

namespace attnserve {

class BufferPool {
 public:
  static constexpr size_t kAlignment = 64;
  static constexpr size_t kMinPooledBytes = size_t{64} << 10;

  explicit BufferPool(size_t max_cached_bytes);
  ~BufferPool();

  // The pool the core's tensors use (256 MiB budget).
  static BufferPool& Global();

  // A kAlignment-aligned buffer of at least `bytes` (at least one byte), or
  // null when memory is exhausted; its capacity goes to *capacity and must
  // be passed back to Release.
  void* Acquire(size_t bytes, size_t* capacity) ABSL_LOCKS_EXCLUDED(mu_);
  void Release(void* buffer, size_t capacity) ABSL_LOCKS_EXCLUDED(mu_);

  // Bytes held for reuse now.
  size_t cached_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const size_t max_cached_bytes_;
  mutable Mutex mu_;
  absl::flat_hash_map<size_t, std::vector<void*>> free_ ABSL_GUARDED_BY(mu_);
  size_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_BUFFER_POOL_H_
