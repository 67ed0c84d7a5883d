// oneDNN primitives built once and executed many times.
//
// `PrimitiveCache` maps a key (operation, shapes, dtype and the OpenMP thread
// count) to a primitive created on the first request of that key; later
// requests only execute it. Primitives are created with
// `scratchpad_mode::user` and every execution supplies a scratchpad owned by
// the calling thread, so one primitive can run on several threads at once.
//
// Thread-safety: PrimitiveCache is safe for concurrent use; the functions
// below may be called from any number of threads. No exception leaves them:
// oneDNN errors become INTERNAL and allocation failures RESOURCE_EXHAUSTED.
#ifndef ATTNSERVE_CORE_PRIMITIVES_H_
#define ATTNSERVE_CORE_PRIMITIVES_H_

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/mutex.h"
#include "core/tensor.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve {

// The process-wide CPU engine.
const dnnl::engine& CpuEngine();

// A primitive together with the descriptor it was created from.
struct CachedPrimitive {
  dnnl::primitive_desc_base desc;
  dnnl::primitive primitive;
};

// A bounded least-recently-used cache of primitives.
class PrimitiveCache {
 public:
  explicit PrimitiveCache(size_t capacity);

  // The cache that the core's operations use.
  static PrimitiveCache& Global();

  // The primitive for `key`, created by `create` on a miss. The key is
  // extended with `threads`, the thread count the primitive is created for
  // (0: the calling thread's OpenMP thread count), and `create` runs with
  // that OpenMP thread count.
  absl::StatusOr<std::shared_ptr<const CachedPrimitive>> GetOrCreate(
      const std::string& key, absl::FunctionRef<CachedPrimitive()> create,
      int threads = 0) ABSL_LOCKS_EXCLUDED(mu_);

  // How many primitives this cache has created since start-up.
  int64_t creations() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Entry = std::pair<std::string, std::shared_ptr<const CachedPrimitive>>;
  const size_t capacity_;
  mutable Mutex mu_;
  std::list<Entry> lru_ ABSL_GUARDED_BY(mu_);  // most recent first
  absl::flat_hash_map<std::string, std::list<Entry>::iterator> index_
      ABSL_GUARDED_BY(mu_);
  int64_t creations_ ABSL_GUARDED_BY(mu_) = 0;
};

// Whether this CPU's oneDNN runs bf16 matmuls (computed once).
bool NativeBf16Matmul();

// Shape of C[b] = A[b] * op(B[b]) + bias, row-major; A, B and C are FLOAT32
// or BFLOAT16 (products accumulate in float32), bias is FLOAT32. On CPUs
// whose oneDNN has no bf16 matmul (no AVX-512), BFLOAT16 operands are
// widened to float32 and computed in float32: the same products, the same
// float32 accumulation.
// A is [batch, m, k]; B is [batch, k, n], or [batch, n, k] when
// `b_transposed` (the nn.Linear weight layout, or keys for Q*K^T); a
// `b_batch` of 1 shares B across the batch; bias is [n]; C is [batch, m, n].
struct MatmulShape {
  int64_t batch = 1;
  int64_t m = 0;
  int64_t k = 0;
  int64_t n = 0;
  bool b_transposed = false;
  bool b_shared = false;
  bool has_bias = false;
  DType a_dtype = DType::kFloat32;
  DType b_dtype = DType::kFloat32;
  DType c_dtype = DType::kFloat32;
};

// Runs the matmul described by `shape`. `bias` is read only if has_bias.
absl::Status Matmul(const MatmulShape& shape, const void* a, const void* b,
                    const float* bias, void* c);

// The weight of y = x * W^T + b (W as [out, in], nn.Linear's layout),
// reordered once into the blocked layout oneDNN's matmul prefers, so that
// runs skip packing it; the bias is kept in float32. Immutable after
// Create; Run may be called from any number of threads at once.
class PackedLinear {
 public:
  // `weight` and `bias` (null: none) are copied; `dtype` (FLOAT32 or
  // BFLOAT16) is the dtype of the weight and of every x.
  static absl::StatusOr<std::shared_ptr<const PackedLinear>> Create(
      const void* weight, const float* bias, int64_t out, int64_t in,
      DType dtype);

  // y[rows, out] = x[rows, in] * W^T + b, y in `y_dtype`.
  absl::Status Run(int64_t rows, const void* x, void* y, DType y_dtype) const;

  int64_t out() const { return out_; }
  int64_t in() const { return in_; }
  DType dtype() const { return dtype_; }

 private:
  PackedLinear() = default;
  int64_t out_ = 0;
  int64_t in_ = 0;
  DType dtype_ = DType::kFloat32;
  // The packed weight's dtype: dtype_, or FLOAT32 where this CPU has no
  // bf16 matmul (the weight is widened once).
  DType packed_dtype_ = DType::kFloat32;
  dnnl::memory::desc packed_md_;
  std::vector<std::byte> packed_;
  std::vector<float> bias_;
};

// One thread's share of a tiled computation: C[m, n] = A[m, k] * B[k, n]
// (+ C when `accumulate`) with leading dimensions, where B is read from
// [n, k] rows when `b_transposed`; A and B are `ab_dtype` (FLOAT32 or
// BFLOAT16), C is FLOAT32. The primitives are created for one
// thread and meant to run inside the caller's own OpenMP parallel region.
struct TileGemmShape {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t lda = 0;
  int64_t ldb = 0;
  int64_t ldc = 0;
  bool b_transposed = false;
  bool accumulate = false;
  DType ab_dtype = DType::kFloat32;
  // A is FLOAT32 though ab_dtype is BFLOAT16 (values bfloat16 holds, such
  // as probabilities rounded to it): only where !NativeBf16Matmul(), whose
  // products run in float32 anyway; A is then read as it is, not widened.
  bool a_float32 = false;

  friend bool operator==(const TileGemmShape&, const TileGemmShape&) = default;
};

// Runs tile GEMMs of one shape on the calling thread, with memory objects
// and a scratchpad made once and reused for every tile. Not thread-safe:
// one per thread.
class TileGemm {
 public:
  static absl::StatusOr<TileGemm> Create(const TileGemmShape& shape);
  TileGemm(TileGemm&&) = default;
  TileGemm& operator=(TileGemm&&) = default;

  const TileGemmShape& shape() const { return shape_; }
  // Throws dnnl::error on failure: call inside a GuardDnnl.
  void Run(const void* a, const void* b, float* c);

 private:
  TileGemm() = default;

  TileGemmShape shape_;
  std::shared_ptr<const CachedPrimitive> cached_;
  dnnl::memory a_, b_, c_;
  std::vector<std::byte> scratchpad_;
  std::unordered_map<int, dnnl::memory> args_;
  // Where this CPU has no bf16 matmul: each tile's A and B widened to
  // float32 (empty otherwise).
  std::vector<float> a_widened_;
  std::vector<float> b_widened_;
};

// Converts the exceptions oneDNN and the allocator throw into a status, so
// that none leaves the core.
template <typename F>
absl::Status GuardDnnl(absl::string_view what, F&& f) {
  try {
    f();
    return absl::OkStatus();
  } catch (const dnnl::error& e) {
    return absl::InternalError(
        absl::StrCat(what, ": oneDNN error ", e.status, ": ", e.what()));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": out of memory"));
  }
}

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_PRIMITIVES_H_
