#include "core/kv_cache.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/row_ops.h"
#include "core/status_macros.h"

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

// Bytes of one plane of `cols` elements of `elem` bytes a token for
// `max_length` tokens, page-rounded, in double: the caller checks that it
// fits.
double PlaneBytesOf(int64_t max_length, int64_t cols, size_t elem) {
  const double page = static_cast<double>(PageSize());
  const double bytes = static_cast<double>(max_length) *
                       static_cast<double>(cols) * static_cast<double>(elem);
  return std::ceil(bytes / page) * page;
}

}  // namespace

KvCache::RegionShape KvCache::ShapeOf(const Dims& dims, int region) {
  switch (region) {
    case kKeys:
      return {dims.key_dim, DTypeSize(dims.dtype)};
    case kValues:
      return {dims.value_dim, DTypeSize(dims.dtype)};
    default:
      return {dims.dtype == DType::kInt8 ? 1 : 0, sizeof(float)};
  }
}

absl::StatusOr<size_t> KvCache::ReservedBytes(const Dims& dims) {
  const double planes = static_cast<double>(dims.layers) *
                        static_cast<double>(dims.batch) *
                        static_cast<double>(dims.kv_heads);
  double plane = 0;
  for (int region = 0; region < kRegions; ++region) {
    const RegionShape shape = ShapeOf(dims, region);
    plane += PlaneBytesOf(dims.max_length, shape.cols, shape.elem);
  }
  const double bytes = planes * plane;
  // Below 2^62: exact in size_t, and far beyond any address space.
  if (!(bytes < 0x1p62)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "max_length: a cache of ", dims.max_length, " tokens x ", dims.layers,
        " layers x ", dims.batch, " sequences x ", dims.kv_heads, " heads x (",
        dims.key_dim, " + ", dims.value_dim, ") dims would need ", bytes,
        " bytes of address space, beyond any machine's"));
  }
  return static_cast<size_t>(bytes);
}

size_t KvCache::reserved_bytes() const {
  size_t plane = 0;
  for (size_t bytes : plane_) plane += bytes;
  return plane * planes();
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const Dims& dims) {
  std::unique_ptr<KvCache> cache(new KvCache());
  cache->dims_ = dims;
  // One mapping for every region: a process may hold at most
  // vm.max_map_count (65530 by default) mappings, malloc's included, and
  // the sessions and the caches forks share must stay well inside that.
  size_t offset[kRegions];
  size_t total = 0;
  for (int region = 0; region < kRegions; ++region) {
    const RegionShape shape = ShapeOf(dims, region);
    cache->plane_[region] = RoundUpToPage(
        static_cast<size_t>(dims.max_length * shape.cols) * shape.elem);
    offset[region] = total;
    total += cache->plane_[region] * cache->planes();
  }
  ATTN_ASSIGN_OR_RETURN(void* base, Reserve(total, "keys and values"));
  cache->mapping_ = base;
  cache->mapping_bytes_ = total;
  for (int region = 0; region < kRegions; ++region) {
    if (cache->plane_[region] == 0) continue;
    cache->base_[region] = static_cast<char*>(base) + offset[region];
  }
  return cache;
}

KvCache::~KvCache() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_bytes_);
}

size_t KvCache::BytesFor(int64_t tokens) const {
  size_t per_plane = 0;
  for (int region = 0; region < kRegions; ++region) {
    const RegionShape shape = ShapeOf(dims_, region);
    per_plane +=
        RoundUpToPage(static_cast<size_t>(tokens * shape.cols) * shape.elem);
  }
  return per_plane * layer_planes();
}

size_t KvCache::BytesBetween(int64_t first, int64_t tokens) const {
  if (tokens <= first) return 0;
  const size_t page = PageSize();
  size_t per_plane = 0;
  for (int region = 0; region < kRegions; ++region) {
    const RegionShape shape = ShapeOf(dims_, region);
    const size_t row = static_cast<size_t>(shape.cols) * shape.elem;
    per_plane += RoundUpToPage(static_cast<size_t>(tokens) * row) -
                 static_cast<size_t>(first) * row / page * page;
  }
  return per_plane * layer_planes();
}

void KvCache::CopyTokens(const KvCache& from, int64_t layer, int64_t first,
                         int64_t end) {
  if (end <= first) return;
  for (int region = 0; region < kRegions; ++region) {
    if (base_[region] == nullptr) continue;
    const RegionShape shape = ShapeOf(dims_, region);
    const size_t row = static_cast<size_t>(shape.cols) * shape.elem;
    const size_t bytes = static_cast<size_t>(end - first) * row;
    for (int64_t b = 0; b < dims_.batch; ++b) {
      for (int64_t h = 0; h < dims_.kv_heads; ++h) {
        std::memcpy(At(region, layer, b, h, first),
                    from.At(region, layer, b, h, first), bytes);
      }
    }
  }
}

int64_t KvCache::Truncate(int64_t layer, int64_t written, int64_t new_length) {
  const size_t elem = DTypeSize(dims_.dtype);
  const size_t dropped = static_cast<size_t>(written - new_length) *
                         std::max(dims_.key_dim, dims_.value_dim) * elem;
  if (dropped < kReleaseBytes) return written;
  for (int region = 0; region < kRegions; ++region) {
    const RegionShape shape = ShapeOf(dims_, region);
    const size_t keep = RoundUpToPage(
        static_cast<size_t>(new_length * shape.cols) * shape.elem);
    if (keep >= plane_[region]) continue;
    char* first = static_cast<char*>(At(region, layer, 0, 0, 0));
    for (size_t i = 0; i < layer_planes(); ++i) {
      // Anonymous private pages read back as zeros once released.
      madvise(first + i * plane_[region] + keep, plane_[region] - keep,
              MADV_DONTNEED);
    }
  }
  return new_length;
}

OperandLayout KvCache::key_layout() const {
  const int64_t plane =
      static_cast<int64_t>(plane_[kKeys] / DTypeSize(dims_.dtype));
  return {dims_.kv_heads * plane, plane, dims_.key_dim};
}

OperandLayout KvCache::value_layout() const {
  const int64_t plane =
      static_cast<int64_t>(plane_[kValues] / DTypeSize(dims_.dtype));
  return {dims_.kv_heads * plane, plane, dims_.value_dim};
}

OperandLayout KvCache::scale_layout() const {
  const int64_t plane =
      static_cast<int64_t>(plane_[kKeyScales] / sizeof(float));
  return {dims_.kv_heads * plane, plane, 1};
}

void* KvCache::At(int region, int64_t layer, int64_t b, int64_t h,
                  int64_t token) const {
  if (base_[region] == nullptr) return nullptr;
  const RegionShape shape = ShapeOf(dims_, region);
  return static_cast<char*>(base_[region]) +
         ((layer * dims_.batch + b) * dims_.kv_heads + h) * plane_[region] +
         token * shape.cols * shape.elem;
}

void* KvCache::key_row(int64_t layer, int64_t b, int64_t h, int64_t token) {
  return At(kKeys, layer, b, h, token);
}

void* KvCache::value_row(int64_t layer, int64_t b, int64_t h, int64_t token) {
  return At(kValues, layer, b, h, token);
}

float* KvCache::key_scale(int64_t layer, int64_t b, int64_t h, int64_t token) {
  return static_cast<float*>(At(kKeyScales, layer, b, h, token));
}

float* KvCache::value_scale(int64_t layer, int64_t b, int64_t h,
                            int64_t token) {
  return static_cast<float*>(At(kValueScales, layer, b, h, token));
}

namespace {

// Pointer tables of a layer: keys and values, and an INT8 cache's scales.
int TablesOf(const KvCache::Dims& dims) {
  return dims.dtype == DType::kInt8 ? 4 : 2;
}

int64_t CapacityOf(const KvCache::Dims& dims) {
  return (dims.max_length + kCacheBlockKeys - 1) / kCacheBlockKeys;
}

}  // namespace

size_t SessionLayers::LayerBytes(const KvCache::Dims& dims) {
  return sizeof(Layer) + static_cast<size_t>(TablesOf(dims)) * sizeof(void*) *
                             static_cast<size_t>(CapacityOf(dims));
}

size_t SessionLayers::BytesFor(const KvCache::Dims& dims) {
  const size_t bytes = static_cast<size_t>(dims.layers) * LayerBytes(dims);
  return bytes >= PageSize() ? RoundUpToPage(bytes) : bytes;
}

absl::StatusOr<SessionLayers> SessionLayers::Create(const KvCache::Dims& dims) {
  SessionLayers layers;
  layers.layers_ = dims.layers;
  layers.capacity_ = CapacityOf(dims);
  layers.tables_ = TablesOf(dims);
  layers.bytes_ = BytesFor(dims);
  layers.mapped_ = layers.bytes_ >= PageSize();
  if (layers.mapped_) {
    // Zero pages until written: the tables commit what forks fill.
    ATTN_ASSIGN_OR_RETURN(void* p, Reserve(layers.bytes_, "per-layer tables"));
    layers.base_ = static_cast<std::byte*>(p);
  } else {
    layers.base_ = new (std::nothrow) std::byte[layers.bytes_]();
    if (layers.base_ == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("session cache: cannot allocate ", layers.bytes_,
                       " bytes for per-layer tables"));
    }
  }
  for (int64_t l = 0; l < layers.layers_; ++l) {
    new (&layers.layer(l)) Layer();
  }
  return layers;
}

SessionLayers& SessionLayers::operator=(SessionLayers&& other) noexcept {
  if (this == &other) return *this;
  Free();
  base_ = std::exchange(other.base_, nullptr);
  bytes_ = std::exchange(other.bytes_, 0);
  mapped_ = std::exchange(other.mapped_, false);
  layers_ = std::exchange(other.layers_, 0);
  capacity_ = std::exchange(other.capacity_, 0);
  tables_ = std::exchange(other.tables_, 0);
  return *this;
}

void SessionLayers::Free() {
  if (base_ == nullptr) return;
  static_assert(std::is_trivially_destructible_v<Layer>);
  if (mapped_) {
    munmap(base_, bytes_);
  } else {
    delete[] base_;
  }
  base_ = nullptr;
}

void SessionLayers::CopyTables(const SessionLayers& from, int64_t l,
                               int64_t blocks) {
  // Bytes: a table holds pointers of its own type (void or float).
  for (int table = 0; table < tables_; ++table) {
    std::memcpy(Table(table, l), from.Table(table, l),
                static_cast<size_t>(blocks) * sizeof(void*));
  }
}

const void** SessionLayers::Table(int table, int64_t l) const {
  if (table >= tables_) return nullptr;
  // The records, then table by table, layer by layer.
  const void** tables = reinterpret_cast<const void**>(
      base_ + static_cast<size_t>(layers_) * sizeof(Layer));
  return tables + (static_cast<size_t>(table) * layers_ + l) * capacity_;
}

float QuantizeInt8(const float* x, int64_t n, int8_t* codes) {
  return GetRowOps().quantize_int8(x, n, codes);
}

}  // namespace attnserve
