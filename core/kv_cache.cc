#include "core/kv_cache.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// A rewind gives pages back when it drops at least this much of a plane.
constexpr size_t kReleaseBytes = size_t{256} << 10;

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
  // Small pages: a cache then commits what its tokens fill, not 2 MiB
  // huge pages on the first token, and a rewind releases pages without
  // splitting a huge one (which costs more than the step).
  madvise(p, bytes, MADV_NOHUGEPAGE);
  return p;
}

// Bytes of one plane of `dim` columns for `max_length` tokens, page-rounded,
// in double: the caller checks that it fits.
double PlaneBytesOf(const KvCache::Dims& dims, int64_t dim) {
  const double page = static_cast<double>(PageSize());
  const double bytes = static_cast<double>(dims.max_length) *
                       static_cast<double>(dim) *
                       static_cast<double>(DTypeSize(dims.dtype));
  return std::ceil(bytes / page) * page;
}

}  // namespace

absl::StatusOr<size_t> KvCache::ReservedBytes(const Dims& dims) {
  const double planes =
      static_cast<double>(dims.batch) * static_cast<double>(dims.kv_heads);
  const double bytes = planes * (PlaneBytesOf(dims, dims.key_dim) +
                                 PlaneBytesOf(dims, dims.value_dim));
  // Below 2^62: exact in size_t, and far beyond any address space.
  if (!(bytes < 0x1p62)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("max_length: a cache of ", dims.max_length, " tokens x ",
                     dims.batch, " sequences x ", dims.kv_heads, " heads x (",
                     dims.key_dim, " + ", dims.value_dim, ") dims would need ",
                     bytes, " bytes of address space, beyond any machine's"));
  }
  return static_cast<size_t>(bytes);
}

size_t KvCache::reserved_bytes() const {
  return (key_plane_ + value_plane_) *
         static_cast<size_t>(dims_.batch * dims_.kv_heads);
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const Dims& dims) {
  std::unique_ptr<KvCache> cache(new KvCache());
  cache->dims_ = dims;
  cache->key_plane_ = cache->PlaneBytes(dims.key_dim);
  cache->value_plane_ = cache->PlaneBytes(dims.value_dim);
  const size_t planes = static_cast<size_t>(dims.batch * dims.kv_heads);
  auto keys = Reserve(cache->key_plane_ * planes, "keys");
  if (!keys.ok()) return keys.status();
  cache->keys_ = *keys;
  auto values = Reserve(cache->value_plane_ * planes, "values");
  if (!values.ok()) return values.status();
  cache->values_ = *values;
  return cache;
}

KvCache::~KvCache() {
  const size_t planes = static_cast<size_t>(dims_.batch * dims_.kv_heads);
  if (keys_ != nullptr) munmap(keys_, key_plane_ * planes);
  if (values_ != nullptr) munmap(values_, value_plane_ * planes);
}

size_t KvCache::PlaneBytes(int64_t dim) const {
  return RoundUpToPage(static_cast<size_t>(dims_.max_length * dim) *
                       DTypeSize(dims_.dtype));
}

size_t KvCache::BytesFor(int64_t tokens) const {
  const size_t elem = DTypeSize(dims_.dtype);
  tokens = std::max(tokens, written_);
  const size_t per_plane =
      RoundUpToPage(static_cast<size_t>(tokens * dims_.key_dim) * elem) +
      RoundUpToPage(static_cast<size_t>(tokens * dims_.value_dim) * elem);
  return per_plane * static_cast<size_t>(dims_.batch * dims_.kv_heads);
}

size_t KvCache::BytesBetween(int64_t first, int64_t tokens) const {
  const size_t elem = DTypeSize(dims_.dtype);
  tokens = std::max(tokens, written_);
  if (tokens <= first) return 0;
  const size_t page = PageSize();
  const auto plane = [&](int64_t dim) {
    const size_t row = static_cast<size_t>(dim) * elem;
    return RoundUpToPage(static_cast<size_t>(tokens) * row) -
           static_cast<size_t>(first) * row / page * page;
  };
  return (plane(dims_.key_dim) + plane(dims_.value_dim)) *
         static_cast<size_t>(dims_.batch * dims_.kv_heads);
}

void KvCache::CopyTokens(const void* keys, const void* values, int64_t first,
                         int64_t end) {
  if (end <= first) return;
  const size_t elem = DTypeSize(dims_.dtype);
  const size_t planes = static_cast<size_t>(dims_.batch * dims_.kv_heads);
  const auto copy = [&](void* to, const void* from, size_t plane, int64_t dim) {
    const size_t row = static_cast<size_t>(dim) * elem;
    const size_t offset = static_cast<size_t>(first) * row;
    const size_t bytes = static_cast<size_t>(end - first) * row;
    for (size_t i = 0; i < planes; ++i) {
      std::memcpy(static_cast<char*>(to) + i * plane + offset,
                  static_cast<const char*>(from) + i * plane + offset, bytes);
    }
  };
  copy(keys_, keys, key_plane_, dims_.key_dim);
  copy(values_, values, value_plane_, dims_.value_dim);
  Wrote(end);
}

void KvCache::Truncate(int64_t new_length) {
  const size_t elem = DTypeSize(dims_.dtype);
  const size_t dropped = static_cast<size_t>(written_ - new_length) *
                         std::max(dims_.key_dim, dims_.value_dim) * elem;
  if (dropped < kReleaseBytes) return;
  const size_t planes = static_cast<size_t>(dims_.batch * dims_.kv_heads);
  const auto release = [&](void* base, size_t plane, int64_t dim) {
    const size_t keep =
        RoundUpToPage(static_cast<size_t>(new_length * dim) * elem);
    if (keep >= plane) return;
    for (size_t i = 0; i < planes; ++i) {
      // Anonymous private pages read back as zeros once released.
      madvise(static_cast<char*>(base) + i * plane + keep, plane - keep,
              MADV_DONTNEED);
    }
  };
  release(keys_, key_plane_, dims_.key_dim);
  release(values_, value_plane_, dims_.value_dim);
  written_ = new_length;
}

OperandLayout KvCache::key_layout() const {
  const int64_t plane =
      static_cast<int64_t>(key_plane_ / DTypeSize(dims_.dtype));
  return {dims_.kv_heads * plane, plane, dims_.key_dim};
}

OperandLayout KvCache::value_layout() const {
  const int64_t plane =
      static_cast<int64_t>(value_plane_ / DTypeSize(dims_.dtype));
  return {dims_.kv_heads * plane, plane, dims_.value_dim};
}

void* KvCache::key_row(int64_t b, int64_t h, int64_t token) {
  return static_cast<char*>(keys_) + (b * dims_.kv_heads + h) * key_plane_ +
         token * dims_.key_dim * DTypeSize(dims_.dtype);
}

void* KvCache::value_row(int64_t b, int64_t h, int64_t token) {
  return static_cast<char*>(values_) + (b * dims_.kv_heads + h) * value_plane_ +
         token * dims_.value_dim * DTypeSize(dims_.dtype);
}

}  // namespace attnserve
