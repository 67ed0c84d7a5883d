#include "core/buffer_pool.h"

#include <cstdlib>

namespace attnserve {

BufferPool::BufferPool(size_t max_cached_bytes)
    : max_cached_bytes_(max_cached_bytes) {}

BufferPool::~BufferPool() {
  for (auto& [size, buffers] : free_) {
    for (void* p : buffers) std::free(p);
  }
}

BufferPool& BufferPool::Global() {
  static BufferPool* pool = new BufferPool(size_t{256} << 20);
  return *pool;
}

void* BufferPool::Acquire(size_t bytes, size_t* capacity) {
  if (bytes < kMinPooledBytes) {
    *capacity = (bytes + kAlignment) / kAlignment * kAlignment;
    return std::aligned_alloc(kAlignment, *capacity);
  }
  constexpr size_t kGranule = size_t{64} << 10;
  *capacity = (bytes + kGranule - 1) / kGranule * kGranule;
  {
    MutexLock lock(&mu_);
    auto it = free_.find(*capacity);
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= *capacity;
      return p;
    }
  }
  return std::aligned_alloc(kAlignment, *capacity);
}

void BufferPool::Release(void* buffer, size_t capacity) {
  if (buffer == nullptr) return;
  if (capacity >= kMinPooledBytes) {
    MutexLock lock(&mu_);
    if (cached_bytes_ + capacity <= max_cached_bytes_) {
      free_[capacity].push_back(buffer);
      cached_bytes_ += capacity;
      return;
    }
  }
  std::free(buffer);
}

size_t BufferPool::cached_bytes() const {
  MutexLock lock(&mu_);
  return cached_bytes_;
}

}  // namespace attnserve
