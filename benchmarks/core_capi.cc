// A C entry point to the core for benchmarks/vs_pytorch.py, which loads it
// with ctypes so that attnserve and PyTorch are timed in one process, on the
// same buffers and the same OpenMP runtime. Each function returns 0, or -1
// after printing the error.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "core/attention.h"
#include "core/multi_head_attention.h"
#include "core/primitives.h"
#include "core/row_ops.h"

namespace {

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "attnserve: %s\n",
               std::string(status.message()).c_str());
  return -1;
}

// Results go straight into the caller's buffer, as a server's would go into
// its response.
class CallerOutput : public attnserve::ResultAllocator {
 public:
  explicit CallerOutput(void* out) : out_(out) {}

 protected:
  absl::StatusOr<void*> DoAllocate(absl::string_view name, attnserve::DType,
                                   const attnserve::Shape&) override {
    if (name != "output") return absl::InternalError("unexpected result");
    return out_;
  }

 private:
  void* out_;
};

int Check(const absl::Status& status) { return status.ok() ? 0 : Fail(status); }

attnserve::DType DTypeOf(int bf16) {
  return bf16 ? attnserve::DType::kBFloat16 : attnserve::DType::kFloat32;
}

}  // namespace

extern "C" {

// Scaled dot-product attention on [b, h, l, d] tensors (bf16: uint16 data,
// computed on the bfloat16 kernels).
int attnserve_sdpa(const void* q, const void* k, const void* v, void* out,
                   int64_t b, int64_t h, int64_t lq, int64_t lk, int64_t d,
                   int causal, int bf16) {
  using attnserve::TensorView;
  const attnserve::DType dtype = DTypeOf(bf16);
  attnserve::AttendInputs in{TensorView{dtype, {b, h, lq, d}, q},
                             TensorView{dtype, {b, h, lk, d}, k},
                             TensorView{dtype, {b, h, lk, d}, v}, std::nullopt};
  attnserve::AttentionOptions options;
  options.causal = causal != 0;
  options.compute_bf16 = bf16 != 0;
  CallerOutput results(out);
  return Check(attnserve::Attend(in, options, results));
}

// An nn.MultiheadAttention layer (fused in_proj, biases, out_proj) prepared
// once, as a served model is: returns a handle for attnserve_mha_run, or
// null. Free it with attnserve_mha_free.
void* attnserve_mha_create(const float* in_proj, const float* in_bias,
                           const float* out_proj, const float* out_bias,
                           int64_t e, int heads, int bf16) {
  using attnserve::DType;
  using attnserve::TensorView;
  attnserve::MultiHeadWeights w;
  w.num_heads = heads;
  w.in_proj_weight = TensorView{DType::kFloat32, {3 * e, e}, in_proj};
  w.in_proj_bias = TensorView{DType::kFloat32, {3 * e}, in_bias};
  w.out_proj_weight = TensorView{DType::kFloat32, {e, e}, out_proj};
  w.out_proj_bias = TensorView{DType::kFloat32, {e}, out_bias};
  attnserve::MultiHeadLayer::Options options;
  options.compute_dtype = DTypeOf(bf16);
  auto layer = attnserve::MultiHeadLayer::Create(w, options);
  if (!layer.ok()) {
    Fail(layer.status());
    return nullptr;
  }
  return new std::shared_ptr<const attnserve::MultiHeadLayer>(*layer);
}

// Self-attention of x [b, l, e] through a layer from attnserve_mha_create.
int attnserve_mha_run(void* layer, const void* x, void* out, int64_t b,
                      int64_t l, int64_t e, int bf16) {
  using attnserve::TensorView;
  auto& mha =
      *static_cast<std::shared_ptr<const attnserve::MultiHeadLayer>*>(layer);
  attnserve::MultiHeadInputs in{TensorView{DTypeOf(bf16), {b, l, e}, x},
                                std::nullopt, std::nullopt, std::nullopt,
                                std::nullopt};
  CallerOutput results(out);
  return Check(mha->Run(in, {}, results));
}

void attnserve_mha_free(void* layer) {
  delete static_cast<std::shared_ptr<const attnserve::MultiHeadLayer>*>(layer);
}

// LayerNorm over the last dim of [rows, cols].
int attnserve_layer_norm(const float* x, const float* gamma, const float* beta,
                         float* out, int64_t rows, int64_t cols, float eps) {
  using attnserve::DType;
  using attnserve::TensorView;
  attnserve::LayerNormOptions options;
  options.eps = eps;
  CallerOutput results(out);
  return Check(attnserve::LayerNorm(
      TensorView{DType::kFloat32, {rows, cols}, x},
      TensorView{DType::kFloat32, {cols}, gamma},
      TensorView{DType::kFloat32, {cols}, beta}, options, results));
}

// C[m, n] = A[m, k] * B[k, n], float32: the GEMM peak the others are held to.
int attnserve_matmul(const float* a, const float* b, float* c, int64_t m,
                     int64_t k, int64_t n) {
  attnserve::MatmulShape shape{1, m, k, n};
  return Check(attnserve::Matmul(shape, a, b, nullptr, c));
}

// Applies ATTNSERVE_CPU_ISA, which caps the row kernels and, through
// ONEDNN_MAX_CPU_ISA, oneDNN, as in the server. Call first, before any
// primitive.
int attnserve_apply_cpu_isa() { return Check(attnserve::ApplyCpuIsaSetting()); }

// The row kernels in use, e.g. "avx512" or "avx2".
const char* attnserve_row_kernels() { return attnserve::GetRowOps().name; }

}  // extern "C"
