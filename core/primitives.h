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
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
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
  // extended with the calling thread's OpenMP thread count.
  absl::StatusOr<std::shared_ptr<const CachedPrimitive>> GetOrCreate(
      const std::string& key, absl::FunctionRef<CachedPrimitive()> create);

  // How many primitives this cache has created since start-up.
  int64_t creations() const;
  // How many primitives it holds now.
  size_t size() const;

 private:
  using Entry = std::pair<std::string, std::shared_ptr<const CachedPrimitive>>;
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::list<Entry> lru_ ABSL_GUARDED_BY(mu_);  // most recent first
  absl::flat_hash_map<std::string, std::list<Entry>::iterator> index_
      ABSL_GUARDED_BY(mu_);
  int64_t creations_ ABSL_GUARDED_BY(mu_) = 0;
};

// Shape of C[b] = A[b] * op(B[b]) + bias, float32, row-major.
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
};

// Runs the matmul described by `shape`. `bias` is read only if has_bias.
absl::Status MatmulF32(const MatmulShape& shape, const float* a, const float* b,
                       const float* bias, float* c);

// LayerNorm over the last dim of [rows, cols], float32. gamma and beta may
// be null (no scale, no shift).
absl::Status LayerNormF32(int64_t rows, int64_t cols, float eps,
                          const float* src, const float* gamma,
                          const float* beta, float* dst);

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_PRIMITIVES_H_
