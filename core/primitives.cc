#include "core/primitives.h"

#include <omp.h>

#include <new>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/convert.h"
#include "core/row_ops.h"
#include "core/status_macros.h"

namespace attnserve {
namespace {

using dnnl::memory;
using Dims = memory::dims;

// The calling thread's stream.
dnnl::stream& ThreadStream() {
  thread_local dnnl::stream stream(CpuEngine());
  return stream;
}

// Executes a cached primitive on the calling thread's stream, with the
// calling thread's scratchpad. `args` pairs oneDNN argument ids with
// pointers to the data they describe.
void Execute(const CachedPrimitive& cached,
             std::initializer_list<std::pair<int, const void*>> args) {
  dnnl::stream& stream = ThreadStream();
  thread_local std::vector<std::byte> scratchpad;
  std::unordered_map<int, memory> exec_args;
  for (const auto& [arg, ptr] : args) {
    exec_args.emplace(
        arg, memory(cached.desc.query_md(dnnl::query::exec_arg_md, arg),
                    CpuEngine(), const_cast<void*>(ptr)));
  }
  const memory::desc scratch_md = cached.desc.scratchpad_desc();
  if (scratch_md.get_size() > 0) {
    if (scratchpad.size() < scratch_md.get_size()) {
      scratchpad.resize(scratch_md.get_size());
    }
    exec_args.emplace(DNNL_ARG_SCRATCHPAD,
                      memory(scratch_md, CpuEngine(), scratchpad.data()));
  }
  cached.primitive.execute(stream, exec_args);
  stream.wait();
}

memory::data_type ToDnnl(DType dtype) {
  return dtype == DType::kBFloat16 ? memory::data_type::bf16
                                   : memory::data_type::f32;
}

}  // namespace

// Needs AVX-512 (with AVX2 alone their creation fails). Where it cannot,
// bf16 operands are widened to float32, exactly, and the product computed
// in float32: the same products, accumulated in float32 as oneDNN's bf16
// kernels do.
bool NativeBf16Matmul() {
  static const bool native = [] {
    try {
      const memory::desc ab({2, 2}, memory::data_type::bf16,
                            memory::format_tag::ab);
      const memory::desc c({2, 2}, memory::data_type::f32,
                           memory::format_tag::ab);
      dnnl::matmul::primitive_desc(dnnl::matmul::desc(ab, ab, c), CpuEngine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return native;
}

namespace {

// The dtype a matmul of `dtype` operands runs in: float32 for bf16 where
// the CPU has no bf16 matmul (NativeBf16Matmul), `dtype` itself otherwise.
DType MatmulDType(DType dtype) {
  return dtype == DType::kBFloat16 && !NativeBf16Matmul() ? DType::kFloat32
                                                          : dtype;
}

// `rows` rows of `cols` bf16 values, `stride` elements apart, widened into
// `out` (rows x cols, packed).
void WidenBf16(const void* src, int64_t rows, int64_t cols, int64_t stride,
               float* out) {
  const auto* bits = static_cast<const uint16_t*>(src);
  const RowOps& ops = GetRowOps();
  for (int64_t r = 0; r < rows; ++r) {
    ops.widen_bf16(bits + r * stride, cols, out + r * cols);
  }
}

// Float32 values of an operand of `dtype`: its own when FLOAT32, else
// widened into `storage`.
const float* AsFloat32(const void* values, DType dtype, int64_t count,
                       std::vector<float>* storage) {
  if (dtype == DType::kFloat32) return static_cast<const float*>(values);
  storage->resize(count);
  WidenBf16(values, 1, count, count, storage->data());
  return storage->data();
}

dnnl::primitive_attr UserScratchpadAttr() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

}  // namespace

const dnnl::engine& CpuEngine() {
  static const dnnl::engine* engine =
      new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

PrimitiveCache::PrimitiveCache(size_t capacity) : capacity_(capacity) {}

PrimitiveCache& PrimitiveCache::Global() {
  static PrimitiveCache* cache = new PrimitiveCache(1024);
  return *cache;
}

absl::StatusOr<std::shared_ptr<const CachedPrimitive>>
PrimitiveCache::GetOrCreate(const std::string& key,
                            absl::FunctionRef<CachedPrimitive()> create,
                            int threads) {
  const int default_threads = omp_get_max_threads();
  if (threads <= 0) threads = default_threads;
  const std::string full_key = absl::StrCat(key, "|threads=", threads);
  {
    MutexLock lock(&mu_);
    auto it = index_.find(full_key);
    if (it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return it->second->second;
    }
  }
  // Created outside the lock: creation can take milliseconds and must not
  // hold up requests of other shapes. Two threads may race to create the same
  // key; the first insert wins.
  std::shared_ptr<const CachedPrimitive> created;
  // oneDNN sizes a primitive's work split by the OpenMP thread count at
  // creation; the setting is per thread, so this affects no other request.
  if (threads != default_threads) omp_set_num_threads(threads);
  absl::Status status = GuardDnnl(key, [&] {
    created = std::make_shared<const CachedPrimitive>(create());
  });
  if (threads != default_threads) omp_set_num_threads(default_threads);
  if (!status.ok()) return status;
  MutexLock lock(&mu_);
  ++creations_;
  auto it = index_.find(full_key);
  if (it != index_.end()) return it->second->second;
  lru_.emplace_front(full_key, created);
  index_[full_key] = lru_.begin();
  while (lru_.size() > capacity_) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  return created;
}

int64_t PrimitiveCache::creations() const {
  MutexLock lock(&mu_);
  return creations_;
}

namespace {

// Matmul in float32 for CPUs without bf16 matmuls (see NativeBf16Matmul).
absl::Status WidenedMatmul(const MatmulShape& s, const void* a, const void* b,
                           const float* bias, void* c) {
  MatmulShape wide = s;
  wide.a_dtype = wide.b_dtype = wide.c_dtype = DType::kFloat32;
  std::vector<float> a32, b32, c32;
  const float* a_values = AsFloat32(a, s.a_dtype, s.batch * s.m * s.k, &a32);
  const float* b_values =
      AsFloat32(b, s.b_dtype, (s.b_shared ? 1 : s.batch) * s.k * s.n, &b32);
  const int64_t c_count = s.batch * s.m * s.n;
  if (s.c_dtype == DType::kFloat32) {
    return Matmul(wide, a_values, b_values, bias, c);
  }
  c32.resize(c_count);
  ATTN_RETURN_IF_ERROR(Matmul(wide, a_values, b_values, bias, c32.data()));
  StoreFloat32(c32.data(), c_count, s.c_dtype, c);
  return absl::OkStatus();
}

}  // namespace

absl::Status Matmul(const MatmulShape& s, const void* a, const void* b,
                    const float* bias, void* c) {
  if (s.batch == 0 || s.m == 0 || s.n == 0) return absl::OkStatus();
  if (s.k == 0) {
    // An empty reduction: oneDNN does not take zero dims, the answer is bias.
    std::vector<float> row(s.n, 0.0f);
    if (s.has_bias) row.assign(bias, bias + s.n);
    const size_t row_bytes = s.n * DTypeSize(s.c_dtype);
    for (int64_t r = 0; r < s.batch * s.m; ++r) {
      StoreFloat32(row.data(), s.n, s.c_dtype,
                   static_cast<char*>(c) + r * row_bytes);
    }
    return absl::OkStatus();
  }
  if (MatmulDType(s.a_dtype) != s.a_dtype ||
      MatmulDType(s.b_dtype) != s.b_dtype ||
      MatmulDType(s.c_dtype) != s.c_dtype) {
    return WidenedMatmul(s, a, b, bias, c);
  }
  const std::string key = absl::StrCat(
      "matmul|", s.batch, "x", s.m, "x", s.k, "x", s.n, "|bt=", s.b_transposed,
      "|bs=", s.b_shared, "|bias=", s.has_bias, "|dt=", DTypeName(s.a_dtype),
      ",", DTypeName(s.b_dtype), ",", DTypeName(s.c_dtype));
  auto cached = PrimitiveCache::Global().GetOrCreate(key, [&] {
    const int64_t b_batch = s.b_shared ? 1 : s.batch;
    const memory::desc a_md({s.batch, s.m, s.k}, ToDnnl(s.a_dtype),
                            Dims{s.m * s.k, s.k, 1});
    const memory::desc b_md(
        {b_batch, s.k, s.n}, ToDnnl(s.b_dtype),
        s.b_transposed ? Dims{s.n * s.k, 1, s.k} : Dims{s.k * s.n, s.n, 1});
    const memory::desc bias_md({1, 1, s.n}, memory::data_type::f32,
                               Dims{s.n, s.n, 1});
    const memory::desc c_md({s.batch, s.m, s.n}, ToDnnl(s.c_dtype),
                            Dims{s.m * s.n, s.n, 1});
    const auto desc = s.has_bias ? dnnl::matmul::desc(a_md, b_md, bias_md, c_md)
                                 : dnnl::matmul::desc(a_md, b_md, c_md);
    dnnl::matmul::primitive_desc pd(desc, UserScratchpadAttr(), CpuEngine());
    return CachedPrimitive{pd, dnnl::matmul(pd)};
  });
  if (!cached.ok()) return cached.status();
  return GuardDnnl(key, [&] {
    if (s.has_bias) {
      Execute(**cached, {{DNNL_ARG_SRC, a},
                         {DNNL_ARG_WEIGHTS, b},
                         {DNNL_ARG_BIAS, bias},
                         {DNNL_ARG_DST, c}});
    } else {
      Execute(**cached,
              {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    }
  });
}

namespace {

// The matmul y[rows, out] = x * W^T (+ b) with W in `weight_md`.
dnnl::matmul::primitive_desc LinearDesc(int64_t rows, int64_t in, int64_t out,
                                        DType x_dtype,
                                        const memory::desc& weight_md,
                                        bool has_bias, DType y_dtype) {
  const memory::desc x_md({rows, in}, ToDnnl(x_dtype), memory::format_tag::ab);
  const memory::desc y_md({rows, out}, ToDnnl(y_dtype), memory::format_tag::ab);
  const memory::desc bias_md({1, out}, memory::data_type::f32,
                             memory::format_tag::ab);
  const auto desc = has_bias
                        ? dnnl::matmul::desc(x_md, weight_md, bias_md, y_md)
                        : dnnl::matmul::desc(x_md, weight_md, y_md);
  return dnnl::matmul::primitive_desc(desc, UserScratchpadAttr(), CpuEngine());
}

// The row count the packed layout is chosen for: oneDNN picks the weight
// layout by its K x N blocking, so one packing serves every row count.
constexpr int64_t kPackingRows = 256;

}  // namespace

absl::StatusOr<std::shared_ptr<const PackedLinear>> PackedLinear::Create(
    const void* weight, const float* bias, int64_t out, int64_t in,
    DType dtype) {
  std::shared_ptr<PackedLinear> packed(new PackedLinear());
  packed->out_ = out;
  packed->in_ = in;
  packed->dtype_ = dtype;
  if (bias != nullptr) packed->bias_.assign(bias, bias + out);
  packed->packed_dtype_ = MatmulDType(dtype);
  if (out == 0 || in == 0) return packed;
  std::vector<float> widened;
  if (packed->packed_dtype_ != dtype) {
    weight = AsFloat32(weight, dtype, out * in, &widened);
  }
  const DType packed_dtype = packed->packed_dtype_;
  absl::Status status = GuardDnnl("pack linear weight", [&] {
    // W^T as the matmul's [in, out] weights: W's rows are its columns.
    const memory::desc plain_md({in, out}, ToDnnl(packed_dtype), Dims{1, in});
    const memory::desc any_md({in, out}, ToDnnl(packed_dtype),
                              memory::format_tag::any);
    const auto pd = LinearDesc(kPackingRows, in, out, packed_dtype, any_md,
                               bias != nullptr, packed_dtype);
    packed->packed_md_ = pd.weights_desc();
    packed->packed_.resize(packed->packed_md_.get_size());
    memory src(plain_md, CpuEngine(), const_cast<void*>(weight));
    memory dst(packed->packed_md_, CpuEngine(), packed->packed_.data());
    dnnl::reorder(src, dst).execute(ThreadStream(), src, dst);
    ThreadStream().wait();
  });
  if (!status.ok()) return status;
  return packed;
}

absl::Status PackedLinear::Run(int64_t rows, const void* x, void* y,
                               DType y_dtype) const {
  const bool has_bias = !bias_.empty();
  if (rows == 0 || out_ == 0) return absl::OkStatus();
  if (in_ == 0) {
    std::vector<float> row(out_, 0.0f);
    if (has_bias) row = bias_;
    const size_t row_bytes = out_ * DTypeSize(y_dtype);
    for (int64_t r = 0; r < rows; ++r) {
      StoreFloat32(row.data(), out_, y_dtype,
                   static_cast<char*>(y) + r * row_bytes);
    }
    return absl::OkStatus();
  }
  // Without bf16 matmuls (NativeBf16Matmul): x widened to float32 like the
  // packed weight, y computed in float32 and rounded.
  std::vector<float> x32, y32;
  if (packed_dtype_ != dtype_) x = AsFloat32(x, dtype_, rows * in_, &x32);
  const DType compute_y = MatmulDType(y_dtype);
  void* y_compute = y;
  if (compute_y != y_dtype) {
    y32.resize(rows * out_);
    y_compute = y32.data();
  }
  const std::string key = absl::StrCat(
      "packed_linear|", rows, "x", in_, "x", out_, "|bias=", has_bias,
      "|dt=", DTypeName(packed_dtype_), ",", DTypeName(compute_y));
  auto cached = PrimitiveCache::Global().GetOrCreate(key, [&] {
    const auto pd = LinearDesc(rows, in_, out_, packed_dtype_, packed_md_,
                               has_bias, compute_y);
    return CachedPrimitive{pd, dnnl::matmul(pd)};
  });
  if (!cached.ok()) return cached.status();
  ATTN_RETURN_IF_ERROR(GuardDnnl(key, [&] {
    if (has_bias) {
      Execute(**cached, {{DNNL_ARG_SRC, x},
                         {DNNL_ARG_WEIGHTS, packed_.data()},
                         {DNNL_ARG_BIAS, bias_.data()},
                         {DNNL_ARG_DST, y_compute}});
    } else {
      Execute(**cached, {{DNNL_ARG_SRC, x},
                         {DNNL_ARG_WEIGHTS, packed_.data()},
                         {DNNL_ARG_DST, y_compute}});
    }
  }));
  if (compute_y != y_dtype) StoreFloat32(y32.data(), rows * out_, y_dtype, y);
  return absl::OkStatus();
}

absl::StatusOr<TileGemm> TileGemm::Create(const TileGemmShape& shape) {
  // Without bf16 matmuls (NativeBf16Matmul), each tile's operands are
  // widened into packed float32 buffers: the primitive reads those.
  const bool widen = MatmulDType(shape.ab_dtype) != shape.ab_dtype;
  if (shape.a_float32 && !widen) {
    return absl::InternalError(
        "tile matmul: a float32 A with bfloat16 B where the CPU multiplies "
        "bfloat16");
  }
  TileGemmShape s = shape;
  if (widen) {
    s.ab_dtype = DType::kFloat32;
    if (!shape.a_float32) s.lda = s.k;
    s.ldb = s.b_transposed ? s.k : s.n;
  }
  const std::string key =
      absl::StrCat("tile_gemm|", s.m, "x", s.n, "x", s.k, "|ld=", s.lda, ",",
                   s.ldb, ",", s.ldc, "|bt=", s.b_transposed,
                   "|acc=", s.accumulate, "|dt=", DTypeName(s.ab_dtype));
  const memory::desc a_md({s.m, s.k}, ToDnnl(s.ab_dtype), Dims{s.lda, 1});
  const memory::desc b_md({s.k, s.n}, ToDnnl(s.ab_dtype),
                          s.b_transposed ? Dims{1, s.ldb} : Dims{s.ldb, 1});
  const memory::desc c_md({s.m, s.n}, memory::data_type::f32, Dims{s.ldc, 1});
  auto cached = PrimitiveCache::Global().GetOrCreate(
      key,
      [&] {
        dnnl::primitive_attr attr = UserScratchpadAttr();
        if (s.accumulate) {
          dnnl::post_ops ops;
          ops.append_sum(1.0f);
          attr.set_post_ops(ops);
        }
        dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md),
                                        attr, CpuEngine());
        return CachedPrimitive{pd, dnnl::matmul(pd)};
      },
      /*threads=*/1);
  if (!cached.ok()) return cached.status();
  TileGemm gemm;
  gemm.shape_ = shape;
  if (widen) {
    if (!shape.a_float32) gemm.a_widened_.resize(s.m * s.k);
    gemm.b_widened_.resize(s.k * s.n);
  }
  gemm.cached_ = *std::move(cached);
  absl::Status status = GuardDnnl(key, [&] {
    gemm.a_ = memory(a_md, CpuEngine(), DNNL_MEMORY_NONE);
    gemm.b_ = memory(b_md, CpuEngine(), DNNL_MEMORY_NONE);
    gemm.c_ = memory(c_md, CpuEngine(), DNNL_MEMORY_NONE);
    gemm.args_ = {{DNNL_ARG_SRC, gemm.a_},
                  {DNNL_ARG_WEIGHTS, gemm.b_},
                  {DNNL_ARG_DST, gemm.c_}};
    const memory::desc scratch_md = gemm.cached_->desc.scratchpad_desc();
    if (scratch_md.get_size() > 0) {
      gemm.scratchpad_.resize(scratch_md.get_size());
      gemm.args_.emplace(DNNL_ARG_SCRATCHPAD, memory(scratch_md, CpuEngine(),
                                                     gemm.scratchpad_.data()));
    }
  });
  if (!status.ok()) return status;
  return gemm;
}

void TileGemm::Run(const void* a, const void* b, float* c) {
  const TileGemmShape& s = shape_;
  if (!a_widened_.empty()) {
    WidenBf16(a, s.m, s.k, s.lda, a_widened_.data());
    a = a_widened_.data();
  }
  if (!b_widened_.empty()) {
    if (s.b_transposed) {
      WidenBf16(b, s.n, s.k, s.ldb, b_widened_.data());
    } else {
      WidenBf16(b, s.k, s.n, s.ldb, b_widened_.data());
    }
    b = b_widened_.data();
  }
  a_.set_data_handle(const_cast<void*>(a));
  b_.set_data_handle(const_cast<void*>(b));
  c_.set_data_handle(c);
  // CPU streams run in order and return when the work is done.
  cached_->primitive.execute(ThreadStream(), args_);
}

}  // namespace attnserve
