#include "core/kv_cache.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

size_t RoundUpToPage(size_t bytes) {
  const size_t page = PageSize();
  return (bytes + page - 1) / page * page;
}

// Address space for `bytes` that commits nothing until written.
absl::StatusOr<void*> Reserve(size_t bytes, absl::string_view what) {
  if (bytes == 0) return nullptr;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("session cache: cannot reserve ", bytes, " bytes for ",
                     what, ": ", std::strerror(errno)));
  }
  return p;
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const Dims& dims) {
  std::unique_ptr<KvCache> cache(new KvCache());
  cache->dims_ = dims;
  cache->key_region_ = cache->RegionBytes(dims.key_dim);
  cache->value_region_ = cache->RegionBytes(dims.value_dim);
  auto keys = Reserve(cache->key_region_ * dims.batch, "keys");
  if (!keys.ok()) return keys.status();
  cache->keys_ = *keys;
  auto values = Reserve(cache->value_region_ * dims.batch, "values");
  if (!values.ok()) return values.status();
  cache->values_ = *values;
  return cache;
}

KvCache::~KvCache() {
  if (keys_ != nullptr) munmap(keys_, key_region_ * dims_.batch);
  if (values_ != nullptr) munmap(values_, value_region_ * dims_.batch);
}

size_t KvCache::RegionBytes(int64_t dim) const {
  return RoundUpToPage(
      static_cast<size_t>(dims_.max_length * dims_.kv_heads * dim) *
      DTypeSize(dims_.dtype));
}

size_t KvCache::BytesFor(int64_t tokens) const {
  const size_t elem = DTypeSize(dims_.dtype);
  const size_t per_entry =
      RoundUpToPage(
          static_cast<size_t>(tokens * dims_.kv_heads * dims_.key_dim) * elem) +
      RoundUpToPage(
          static_cast<size_t>(tokens * dims_.kv_heads * dims_.value_dim) *
          elem);
  return per_entry * dims_.batch;
}

OperandLayout KvCache::key_layout() const {
  const int64_t elem = static_cast<int64_t>(DTypeSize(dims_.dtype));
  return {static_cast<int64_t>(key_region_) / elem, dims_.key_dim,
          dims_.kv_heads * dims_.key_dim};
}

OperandLayout KvCache::value_layout() const {
  const int64_t elem = static_cast<int64_t>(DTypeSize(dims_.dtype));
  return {static_cast<int64_t>(value_region_) / elem, dims_.value_dim,
          dims_.kv_heads * dims_.value_dim};
}

void* KvCache::key_row(int64_t b, int64_t token) {
  return static_cast<char*>(keys_) + b * key_region_ +
         token * dims_.kv_heads * dims_.key_dim * DTypeSize(dims_.dtype);
}

void* KvCache::value_row(int64_t b, int64_t token) {
  return static_cast<char*>(values_) + b * value_region_ +
         token * dims_.kv_heads * dims_.value_dim * DTypeSize(dims_.dtype);
}

}  // namespace attnserve
