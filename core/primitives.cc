#include "core/primitives.h"

#include <omp.h>

#include <cstring>
#include <new>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/convert.h"

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
  if (out == 0 || in == 0) return packed;
  absl::Status status = GuardDnnl("pack linear weight", [&] {
    // W^T as the matmul's [in, out] weights: W's rows are its columns.
    const memory::desc plain_md({in, out}, ToDnnl(dtype), Dims{1, in});
    const memory::desc any_md({in, out}, ToDnnl(dtype),
                              memory::format_tag::any);
    const auto pd = LinearDesc(kPackingRows, in, out, dtype, any_md,
                               bias != nullptr, dtype);
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
  const std::string key = absl::StrCat(
      "packed_linear|", rows, "x", in_, "x", out_, "|bias=", has_bias,
      "|dt=", DTypeName(dtype_), ",", DTypeName(y_dtype));
  auto cached = PrimitiveCache::Global().GetOrCreate(key, [&] {
    const auto pd =
        LinearDesc(rows, in_, out_, dtype_, packed_md_, has_bias, y_dtype);
    return CachedPrimitive{pd, dnnl::matmul(pd)};
  });
  if (!cached.ok()) return cached.status();
  return GuardDnnl(key, [&] {
    if (has_bias) {
      Execute(**cached, {{DNNL_ARG_SRC, x},
                         {DNNL_ARG_WEIGHTS, packed_.data()},
                         {DNNL_ARG_BIAS, bias_.data()},
                         {DNNL_ARG_DST, y}});
    } else {
      Execute(**cached, {{DNNL_ARG_SRC, x},
                         {DNNL_ARG_WEIGHTS, packed_.data()},
                         {DNNL_ARG_DST, y}});
    }
  });
}

absl::StatusOr<TileGemm> TileGemm::Create(const TileGemmShape& s) {
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
  gemm.shape_ = s;
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
  a_.set_data_handle(const_cast<void*>(a));
  b_.set_data_handle(const_cast<void*>(b));
  c_.set_data_handle(c);
  // CPU streams run in order and return when the work is done.
  cached_->primitive.execute(ThreadStream(), args_);
}

absl::Status LayerNormF32(int64_t rows, int64_t cols, float eps,
                          const float* src, const float* gamma,
                          const float* beta, float* dst) {
  if (rows == 0 || cols == 0) return absl::OkStatus();
  uint32_t eps_bits;
  std::memcpy(&eps_bits, &eps, sizeof(eps_bits));
  const std::string key =
      absl::StrCat("layer_norm_f32|", rows, "x", cols, "|eps=", eps_bits,
                   "|scale=", gamma != nullptr, "|shift=", beta != nullptr);
  auto cached = PrimitiveCache::Global().GetOrCreate(key, [&] {
    const memory::desc data_md({rows, cols}, memory::data_type::f32,
                               memory::format_tag::ab);
    auto flags = dnnl::normalization_flags::none;
    if (gamma != nullptr) flags |= dnnl::normalization_flags::use_scale;
    if (beta != nullptr) flags |= dnnl::normalization_flags::use_shift;
    dnnl::layer_normalization_forward::desc desc(
        dnnl::prop_kind::forward_inference, data_md, eps, flags);
    dnnl::layer_normalization_forward::primitive_desc pd(
        desc, UserScratchpadAttr(), CpuEngine());
    return CachedPrimitive{pd, dnnl::layer_normalization_forward(pd)};
  });
  if (!cached.ok()) return cached.status();
  return GuardDnnl(key, [&] {
    if (gamma != nullptr && beta != nullptr) {
      Execute(**cached, {{DNNL_ARG_SRC, src},
                         {DNNL_ARG_SCALE, gamma},
                         {DNNL_ARG_SHIFT, beta},
                         {DNNL_ARG_DST, dst}});
    } else if (gamma != nullptr) {
      Execute(
          **cached,
          {{DNNL_ARG_SRC, src}, {DNNL_ARG_SCALE, gamma}, {DNNL_ARG_DST, dst}});
    } else if (beta != nullptr) {
      Execute(
          **cached,
          {{DNNL_ARG_SRC, src}, {DNNL_ARG_SHIFT, beta}, {DNNL_ARG_DST, dst}});
    } else {
      Execute(**cached, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}});
    }
  });
}

}  // namespace attnserve
