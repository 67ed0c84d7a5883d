#include "core/attention_kernel.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "core/convert.h"
#include "core/mutex.h"
#include "core/primitives.h"
#include "core/row_ops.h"
#include "core/status_macros.h"

namespace attnserve {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Tile sizes: a 128 x 512 float32 logits tile is 256 KiB, which stays in a
// 1 MiB L2 with the key and value blocks it is made from; measured faster
// than 64 x 256 and 96 x 384 on the benchmark shapes.
constexpr int64_t kQueryBlock = 128;
constexpr int64_t kKeyBlock = 512;
static_assert(kKeyBlock == kCacheBlockKeys,
              "a block table's entries cover one key block each");

// Whether the caller gave up. Polled at every key block, not only between
// query blocks: a block of 128 queries over millions of keys would
// otherwise compute for seconds after a cancel.
bool Cancelled(const AttentionProblem& p) {
  return p.cancelled != nullptr && p.cancelled->load(std::memory_order_relaxed);
}

absl::Status CancelledStatus() {
  return absl::CancelledError("call cancelled");
}

template <typename T>
void ApplyKeepMask(const T* mask, int64_t key_stride, int64_t count,
                   float* row) {
  for (int64_t j = 0; j < count; ++j) {
    if (mask[j * key_stride] == 0) row[j] = kNegInf;
  }
}

// Applies `mask` to logits (n, i, j0 .. j0 + count) held in `row`. An
// excluded position's logit is replaced, not added to: a NaN or +inf logit
// there must not reach the row (NaN + -inf is NaN).
void ApplyMask(const MaskLayout& mask, int64_t n, int64_t i, int64_t j0,
               int64_t count, float* row) {
  const int64_t offset =
      mask.batch_offset[n] + i * mask.query_stride + j0 * mask.key_stride;
  if (mask.dtype == DType::kFloat32) {
    const float* values = static_cast<const float*>(mask.data) + offset;
    for (int64_t j = 0; j < count; ++j) {
      const float v = values[j * mask.key_stride];
      row[j] = v == kNegInf ? kNegInf : row[j] + v;
    }
  } else {
    ApplyKeepMask(static_cast<const uint8_t*>(mask.data) + offset,
                  mask.key_stride, count, row);
  }
}

// Whether key j is excluded from query i of (batch, head) n by causality or
// a mask (not merely given a -inf logit by the data).
bool Excluded(const AttentionProblem& p, int64_t n, int64_t i, int64_t j) {
  if (p.causal && j > i + p.causal_offset) return true;
  for (const MaskLayout& mask : p.masks) {
    const int64_t offset =
        mask.batch_offset[n] + i * mask.query_stride + j * mask.key_stride;
    if (mask.dtype == DType::kFloat32) {
      if (static_cast<const float*>(mask.data)[offset] == kNegInf) return true;
    } else if (static_cast<const uint8_t*>(mask.data)[offset] == 0) {
      return true;
    }
  }
  return false;
}

// Whether some x[j] * multiplier is NaN. Only asked of rows whose maximum
// is -inf, to tell a row of NaN logits (NaN) from a fully masked one
// (zeros): the maxima ignore NaN.
bool AnyNaN(const float* x, int64_t n, float multiplier) {
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(x[j] * multiplier)) return true;
  }
  return false;
}

// Scales logits (n, i, j0 .. j0 + count) in `row`, applies the masks and
// causality, and returns the row maximum (-inf if nothing is left), NaN
// ignored.
float PrepareLogits(const AttentionProblem& p, const RowOps& ops, int64_t n,
                    int64_t i, int64_t j0, int64_t count, float* row) {
  float max_logit = ops.scale_max(row, count, p.logit_multiplier);
  const int64_t last_visible = i + p.causal_offset;
  const bool causal_cut = p.causal && j0 + count - 1 > last_visible;
  if (p.masks.empty() && !causal_cut) return max_logit;
  for (const MaskLayout& mask : p.masks) ApplyMask(mask, n, i, j0, count, row);
  if (causal_cut) {
    for (int64_t j = std::max<int64_t>(last_visible + 1 - j0, 0); j < count;
         ++j) {
      row[j] = kNegInf;
    }
  }
  return ops.max(row, count);
}

// The tile GEMMs one thread runs, created on first use of each shape.
class TileGemms {
 public:
  absl::StatusOr<TileGemm*> Get(const TileGemmShape& shape) {
    for (TileGemm& gemm : gemms_) {
      if (gemm.shape() == shape) return &gemm;
    }
    ATTN_ASSIGN_OR_RETURN(TileGemm gemm, TileGemm::Create(shape));
    gemms_.push_back(std::move(gemm));
    return &gemms_.back();
  }

  // c = a * b (+ c): handles the empty reduction oneDNN does not take.
  absl::Status Run(const TileGemmShape& shape, const void* a, const void* b,
                   float* c) {
    if (shape.m == 0 || shape.n == 0) return absl::OkStatus();
    if (shape.k == 0) {
      if (!shape.accumulate) {
        for (int64_t r = 0; r < shape.m; ++r) {
          std::fill(c + r * shape.ldc, c + r * shape.ldc + shape.n, 0.0f);
        }
      }
      return absl::OkStatus();
    }
    ATTN_ASSIGN_OR_RETURN(TileGemm * gemm, Get(shape));
    return GuardDnnl("tile matmul", [&] { gemm->Run(a, b, c); });
  }

 private:
  std::deque<TileGemm> gemms_;  // stable addresses
};

// The first error any thread hit; the others stop at their next block.
class SharedStatus {
 public:
  void Update(absl::Status status) ABSL_LOCKS_EXCLUDED(mu_) {
    if (status.ok()) return;
    MutexLock lock(&mu_);
    if (status_.ok()) status_ = std::move(status);
    failed_.store(true, std::memory_order_relaxed);
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  absl::Status status() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return status_;
  }

 private:
  Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> failed_{false};
};

struct Block {
  int64_t b, h, n, i0, rows;
};

// Per-thread buffers, sized once per call.
struct ThreadBuffers {
  std::unique_ptr<float[]> logits;  // kQueryBlock x kKeyBlock
  // Narrowed bf16 P (NarrowsProbabilities): logits' size, or a
  // kQueryBlock x key_len slab.
  std::unique_ptr<uint16_t[]> probs_bf16;
  std::unique_ptr<float[]> acc;  // kQueryBlock x value_dim
  std::unique_ptr<float[]> row_max;
  std::unique_ptr<float[]> row_sum;
  // A value tile with its non-finite elements zeroed, made when first
  // needed (ValueMode::kExcludeValues).
  std::unique_ptr<char[]> finite_values;
};

// Whether bfloat16 probabilities are narrowed into ThreadBuffers::
// probs_bf16: always with weights (WeightsBlock); without, only for bf16
// products. Where those run in float32 (!NativeBf16Matmul()), the
// probabilities stay in the logits, rounded to bfloat16 values: the same
// products, without narrowing and widening each tile.
bool NarrowsProbabilities(const AttentionProblem& p) {
  return p.operand_dtype == DType::kBFloat16 &&
         (p.weights != nullptr || NativeBf16Matmul());
}

// Keys a query block can see: all of them, or up to its last query when
// causal.
int64_t VisibleKeys(const AttentionProblem& p, const Block& blk) {
  return p.causal ? std::clamp<int64_t>(blk.i0 + blk.rows + p.causal_offset, 0,
                                        p.key_len)
                  : p.key_len;
}

// Pointers into operands of either dtype.
const void* At(const void* base, DType dtype, int64_t offset) {
  return static_cast<const char*>(base) + offset * DTypeSize(dtype);
}

RowType RowTypeOf(DType dtype) {
  return dtype == DType::kBFloat16 ? RowType::kBFloat16 : RowType::kFloat32;
}

// The key (or value) rows j0 .. of key/value head g of batch entry b.
CachedRows CachedRowsOf(const AttentionProblem& p, bool keys, int64_t b,
                        int64_t g, int64_t j0) {
  const OperandLayout& layout = keys ? p.key_layout : p.value_layout;
  const int64_t offset =
      b * layout.batch_stride + g * layout.head_stride + j0 * layout.row_stride;
  const size_t block = static_cast<size_t>(j0 / kCacheBlockKeys);
  const absl::Span<const void* const> table =
      keys ? p.key_blocks : p.value_blocks;
  const void* base = block < table.size() ? table[block]
                     : keys               ? p.key
                                          : p.value;
  if (!p.int8_kv) {
    return {At(base, p.operand_dtype, offset), layout.row_stride,
            RowTypeOf(p.operand_dtype), nullptr};
  }
  const absl::Span<const float* const> scale_table =
      keys ? p.key_scale_blocks : p.value_scale_blocks;
  const float* scales = block < scale_table.size() ? scale_table[block]
                        : keys                     ? p.key_scales
                                                   : p.value_scales;
  return {static_cast<const int8_t*>(base) + offset, layout.row_stride,
          RowType::kInt8,
          scales + b * p.scale_layout.batch_stride +
              g * p.scale_layout.head_stride + j0};
}

// Key (value) j0 of batch entry b, key/value head g, and the keys after it
// up to the end of j0's block, for the tiled path (never INT8: it reads
// dequantized copies).
const void* KeyRows(const AttentionProblem& p, int64_t b, int64_t g,
                    int64_t j0) {
  return CachedRowsOf(p, /*keys=*/true, b, g, j0).data;
}

const void* ValueRows(const AttentionProblem& p, int64_t b, int64_t g,
                      int64_t j0) {
  return CachedRowsOf(p, /*keys=*/false, b, g, j0).data;
}

struct BlockOperands {
  const void* q;  // first query row of the block
};

BlockOperands OperandsOf(const AttentionProblem& p, const Block& blk) {
  const DType t = p.operand_dtype;
  return {At(p.query, t,
             blk.b * p.query_layout.batch_stride +
                 blk.h * p.query_layout.head_stride +
                 blk.i0 * p.query_layout.row_stride)};
}

// The block's raw Q*K^T for keys j0 .. j0 + cols, into `logits` (rows
// `ldc` apart).
absl::Status BlockLogits(const AttentionProblem& p, const Block& blk,
                         const BlockOperands& in, int64_t j0, int64_t cols,
                         int64_t ldc, float* logits, TileGemms& gemms) {
  const DType t = p.operand_dtype;
  const TileGemmShape qk{blk.rows,
                         cols,
                         p.key_dim,
                         p.query_layout.row_stride,
                         p.key_layout.row_stride,
                         ldc,
                         true,
                         false,
                         t};
  return gemms.Run(qk, in.q, KeyRows(p, blk.b, blk.h / p.kv_group, j0), logits);
}

// A block's probabilities: rows `ld` elements apart, in the operand dtype,
// or in float32 holding bfloat16 values where the CPU's bf16 products run
// in float32 anyway (!NativeBf16Matmul()).
struct Probabilities {
  const void* data;
  int64_t ld;
  DType dtype;
};

// acc += probabilities * the `cols` value rows at `v` (`v_stride` apart).
absl::Status MultiplyValues(const AttentionProblem& p, const Block& blk,
                            const void* v, int64_t v_stride, int64_t cols,
                            const Probabilities& probs, float* acc,
                            TileGemms& gemms) {
  TileGemmShape pv{blk.rows,    p.value_dim, cols, probs.ld,       v_stride,
                   p.value_dim, false,       true, p.operand_dtype};
  pv.a_float32 = probs.dtype != p.operand_dtype;
  return gemms.Run(pv, probs.data, v, acc);
}

float OperandValue(const void* base, DType dtype, int64_t offset) {
  return dtype == DType::kBFloat16
             ? BFloat16ToFloat(static_cast<const uint16_t*>(base)[offset])
             : static_cast<const float*>(base)[offset];
}

// How acc += P * V treats the value rows of excluded keys. The GEMM
// multiplies every key of a tile, and an excluded key's probability 0 times
// a NaN or Inf value is NaN; kGemm accepts that (exact for finite values,
// and whenever no key is excluded), kExcludeValues does not read those rows.
enum class ValueMode { kGemm, kExcludeValues };

// acc += probabilities * the `cols` value rows at `v` (`stride` apart,
// keys j0 .. j0 + cols), reading no value row of a key a row excludes: with
// a non-finite element in the tile, the GEMM runs on a copy of the tile with
// those elements 0, and each is then added, with its IEEE product, to the
// rows that keep its key.
absl::Status AccumulateKeptValues(const AttentionProblem& p, const Block& blk,
                                  const void* v, int64_t stride, int64_t j0,
                                  int64_t cols, const Probabilities& probs,
                                  float* acc, TileGemms& gemms,
                                  ThreadBuffers& buf) {
  const DType t = p.operand_dtype;
  const int64_t dv = p.value_dim;
  std::vector<int64_t> bad;  // tile rows holding a non-finite value
  for (int64_t j = 0; j < cols; ++j) {
    for (int64_t c = 0; c < dv; ++c) {
      if (!std::isfinite(OperandValue(v, t, j * stride + c))) {
        bad.push_back(j);
        break;
      }
    }
  }
  if (bad.empty()) {
    return MultiplyValues(p, blk, v, stride, cols, probs, acc, gemms);
  }
  const size_t elem = DTypeSize(t);
  if (!buf.finite_values) {
    buf.finite_values.reset(new (std::nothrow) char[kKeyBlock * dv * elem]);
    if (!buf.finite_values) {
      return absl::ResourceExhaustedError(
          "attention: out of memory for a value tile");
    }
  }
  char* copy = buf.finite_values.get();
  for (int64_t j = 0; j < cols; ++j) {
    std::memcpy(copy + j * dv * elem, At(v, t, j * stride), dv * elem);
  }
  for (int64_t j : bad) {
    for (int64_t c = 0; c < dv; ++c) {
      const int64_t at = j * dv + c;
      if (std::isfinite(OperandValue(copy, t, at))) continue;
      if (t == DType::kBFloat16) {
        reinterpret_cast<uint16_t*>(copy)[at] = 0;
      } else {
        reinterpret_cast<float*>(copy)[at] = 0.0f;
      }
    }
  }
  ATTN_RETURN_IF_ERROR(
      MultiplyValues(p, blk, copy, dv, cols, probs, acc, gemms));
  for (int64_t r = 0; r < blk.rows; ++r) {
    for (int64_t j : bad) {
      if (Excluded(p, blk.n, blk.i0 + r, j0 + j)) continue;
      const float prob =
          OperandValue(probs.data, probs.dtype, r * probs.ld + j);
      for (int64_t c = 0; c < dv; ++c) {
        const float x = OperandValue(v, t, j * stride + c);
        if (!std::isfinite(x)) acc[r * dv + c] += prob * x;
      }
    }
  }
  return absl::OkStatus();
}

// acc += probabilities * V for keys j0 .. j0 + cols.
absl::Status AccumulateValues(const AttentionProblem& p, const Block& blk,
                              int64_t j0, int64_t cols,
                              const Probabilities& probs, float* acc,
                              TileGemms& gemms, ThreadBuffers& buf,
                              ValueMode mode) {
  const int64_t stride = p.value_layout.row_stride;
  const void* v = ValueRows(p, blk.b, blk.h / p.kv_group, j0);
  if (mode == ValueMode::kExcludeValues) {
    return AccumulateKeptValues(p, blk, v, stride, j0, cols, probs, acc, gemms,
                                buf);
  }
  return MultiplyValues(p, blk, v, stride, cols, probs, acc, gemms);
}

// Whether the kGemm pass may have let an excluded key's non-finite value
// into the block's output: some row that kept keys (finite, nonzero
// `row_scale`) has a non-finite sum, and some key may be excluded. The
// check reads value_dim floats a row, not the values; only corrupt input
// pays for the exact pass that follows.
bool MayHaveReadExcludedValues(const AttentionProblem& p, const RowOps& ops,
                               const Block& blk, const float* acc,
                               const float* row_scale) {
  if (p.masks.empty() && !p.causal) return false;
  for (int64_t r = 0; r < blk.rows; ++r) {
    if (std::isfinite(row_scale[r]) && row_scale[r] != 0.0f &&
        !ops.all_finite(acc + r * p.value_dim, p.value_dim)) {
      return true;
    }
  }
  return false;
}

// out rows = acc rows * scale[r], in the output's dtype; rows whose scale is
// 0 (no key left) are zeros, whatever acc holds.
void WriteOutput(const AttentionProblem& p, const RowOps& ops, const Block& blk,
                 const float* acc, const float* row_scale) {
  const int64_t dv = p.value_dim;
  const int64_t first = blk.b * p.output_layout.batch_stride +
                        blk.h * p.output_layout.head_stride +
                        blk.i0 * p.output_layout.row_stride;
  for (int64_t r = 0; r < blk.rows; ++r) {
    const int64_t offset = first + r * p.output_layout.row_stride;
    const float* src = acc + r * dv;
    const float scale = row_scale[r];
    if (scale == 0.0f) {
      if (p.output_dtype == DType::kBFloat16) {
        uint16_t* dst = static_cast<uint16_t*>(p.output) + offset;
        std::fill(dst, dst + dv, 0);
      } else {
        float* dst = static_cast<float*>(p.output) + offset;
        std::fill(dst, dst + dv, 0.0f);
      }
    } else if (p.output_dtype == DType::kBFloat16) {
      ops.scale_to_bf16(src, dv, scale,
                        static_cast<uint16_t*>(p.output) + offset);
    } else {
      float* dst = static_cast<float*>(p.output) + offset;
      for (int64_t c = 0; c < dv; ++c) dst[c] = src[c] * scale;
    }
  }
}

// One query block without weights, up to the output: online softmax over
// key blocks into acc, and each row's final scale (1 / sum; 0 for a row
// with no key left, NaN for a row with a NaN or +inf logit) into row_sum.
absl::Status FlashAccumulate(const AttentionProblem& p, const RowOps& ops,
                             const Block& blk, TileGemms& gemms,
                             ThreadBuffers& buf, ValueMode mode) {
  const BlockOperands in = OperandsOf(p, blk);
  const bool bf16 = p.operand_dtype == DType::kBFloat16;
  const bool narrow = NarrowsProbabilities(p);
  const int64_t dv = p.value_dim;
  float* logits = buf.logits.get();
  float* acc = buf.acc.get();
  float* row_max = buf.row_max.get();
  float* row_sum = buf.row_sum.get();
  std::fill(acc, acc + blk.rows * dv, 0.0f);
  std::fill(row_max, row_max + blk.rows, kNegInf);
  std::fill(row_sum, row_sum + blk.rows, 0.0f);
  const int64_t visible = VisibleKeys(p, blk);
  for (int64_t j0 = 0; j0 < visible; j0 += kKeyBlock) {
    if (Cancelled(p)) return CancelledStatus();
    const int64_t cols = std::min(kKeyBlock, visible - j0);
    absl::Status s =
        BlockLogits(p, blk, in, j0, cols, kKeyBlock, logits, gemms);
    if (!s.ok()) return s;
    // Without masks or a causal cut in this block, the multiplier is folded
    // into the exponent: the row is read once for its max and once for exp.
    const bool plain = p.masks.empty() &&
                       !(p.causal && j0 + cols - 1 > blk.i0 + p.causal_offset);
    for (int64_t r = 0; r < blk.rows; ++r) {
      float* row = logits + r * kKeyBlock;
      uint16_t* row_bf16 =
          narrow ? buf.probs_bf16.get() + r * kKeyBlock : nullptr;
      const float multiplier = plain ? p.logit_multiplier : 1.0f;
      const float block_max =
          plain ? ops.max_scaled(row, cols, multiplier)
                : PrepareLogits(p, ops, blk.n, blk.i0 + r, j0, cols, row);
      // The maxima ignore NaN; a NaN max (once set, std::max keeps it) makes
      // every exp below NaN, and so the row. A NaN among finite logits gets
      // there through exp_sum's sum.
      float new_max = std::max(row_max[r], block_max);
      if (new_max == kNegInf && AnyNaN(row, cols, multiplier)) new_max = kNaN;
      if (new_max == kNegInf) {
        // Nothing visible yet in this row: it adds zeros.
        if (narrow) {
          std::fill(row_bf16, row_bf16 + cols, 0);
        } else {
          std::fill(row, row + cols, 0.0f);
        }
        continue;
      }
      const float correction =
          row_max[r] == kNegInf ? 0.0f : std::exp(row_max[r] - new_max);
      const float block_sum =
          narrow ? ops.exp_sum_bf16(row, cols, multiplier, new_max, row_bf16)
          : bf16 ? ops.exp_sum_bf16_in_place(row, cols, multiplier, new_max)
                 : ops.exp_sum(row, cols, multiplier, new_max);
      if (correction != 1.0f) ops.scale(acc + r * dv, dv, correction);
      row_sum[r] = row_sum[r] * correction + block_sum;
      row_max[r] = new_max;
    }
    const Probabilities probs =
        narrow ? Probabilities{buf.probs_bf16.get(), kKeyBlock, p.operand_dtype}
               : Probabilities{logits, kKeyBlock, DType::kFloat32};
    s = AccumulateValues(p, blk, j0, cols, probs, acc, gemms, buf, mode);
    if (!s.ok()) return s;
  }
  // A row with no key left (sum 0) gets zeros; a NaN sum stays NaN.
  for (int64_t r = 0; r < blk.rows; ++r) {
    row_sum[r] = row_sum[r] == 0.0f ? 0.0f : 1.0f / row_sum[r];
  }
  return absl::OkStatus();
}

// One query block without weights.
absl::Status FlashBlock(const AttentionProblem& p, const RowOps& ops,
                        const Block& blk, TileGemms& gemms,
                        ThreadBuffers& buf) {
  ATTN_RETURN_IF_ERROR(
      FlashAccumulate(p, ops, blk, gemms, buf, ValueMode::kGemm));
  if (MayHaveReadExcludedValues(p, ops, blk, buf.acc.get(),
                                buf.row_sum.get())) {
    ATTN_RETURN_IF_ERROR(
        FlashAccumulate(p, ops, blk, gemms, buf, ValueMode::kExcludeValues));
  }
  WriteOutput(p, ops, blk, buf.acc.get(), buf.row_sum.get());
  return absl::OkStatus();
}

// One query block with weights: the logits go straight into the caller's
// weights rows, are normalized there, and multiply V.
absl::Status WeightsBlock(const AttentionProblem& p, const RowOps& ops,
                          const Block& blk, TileGemms& gemms,
                          ThreadBuffers& buf) {
  const BlockOperands in = OperandsOf(p, blk);
  const DType t = p.operand_dtype;
  const bool bf16 = t == DType::kBFloat16;
  const int64_t lk = p.key_len;
  const int64_t dv = p.value_dim;
  float* weights = p.weights + (blk.n * p.query_len + blk.i0) * lk;
  // Per row: 0 with no key left, NaN for a NaN row, else 1.
  float* row_scale = buf.row_sum.get();
  const int64_t visible = VisibleKeys(p, blk);
  for (int64_t j0 = 0; j0 < visible; j0 += kKeyBlock) {
    if (Cancelled(p)) return CancelledStatus();
    const int64_t cols = std::min(kKeyBlock, visible - j0);
    absl::Status s = BlockLogits(p, blk, in, j0, cols, lk, weights + j0, gemms);
    if (!s.ok()) return s;
  }
  for (int64_t r = 0; r < blk.rows; ++r) {
    float* row = weights + r * lk;
    const float max_logit =
        PrepareLogits(p, ops, blk.n, blk.i0 + r, 0, visible, row);
    row_scale[r] = 1.0f;
    if (max_logit == kNegInf && !AnyNaN(row, visible, 1.0f)) {
      std::fill(row, row + lk, 0.0f);
      row_scale[r] = 0.0f;
    } else if (max_logit == kNegInf) {
      std::fill(row, row + lk, kNaN);  // only NaN besides -inf
      row_scale[r] = kNaN;
    } else {
      // A NaN or +inf logit makes the sum NaN, and the whole row with it.
      const float sum = ops.exp_sum(row, visible, 1.0f, max_logit);
      ops.scale(row, visible, 1.0f / sum);
      if (std::isnan(sum)) row_scale[r] = kNaN;
    }
    // Keys past `visible` are causally hidden from every row of the block:
    // probability 0, or NaN in a NaN row as everywhere else in it.
    std::fill(row + visible, row + lk, std::isnan(row_scale[r]) ? kNaN : 0.0f);
    if (bf16) {
      ops.scale_to_bf16(row, visible, 1.0f, buf.probs_bf16.get() + r * lk);
    }
  }
  const void* probs = bf16 ? static_cast<const void*>(buf.probs_bf16.get())
                           : static_cast<const void*>(weights);
  float* acc = buf.acc.get();
  for (ValueMode mode : {ValueMode::kGemm, ValueMode::kExcludeValues}) {
    std::fill(acc, acc + blk.rows * dv, 0.0f);
    for (int64_t j0 = 0; j0 < visible; j0 += kKeyBlock) {
      if (Cancelled(p)) return CancelledStatus();
      const int64_t cols = std::min(kKeyBlock, visible - j0);
      absl::Status s = AccumulateValues(p, blk, j0, cols,
                                        Probabilities{At(probs, t, j0), lk, t},
                                        acc, gemms, buf, mode);
      if (!s.ok()) return s;
    }
    if (!MayHaveReadExcludedValues(p, ops, blk, acc, row_scale)) break;
  }
  WriteOutput(p, ops, blk, acc, row_scale);
  return absl::OkStatus();
}

// Attention with key dim 0, no mask and no weights: every logit is 0, so a
// query's output is the mean of the values it sees (all of them, or a
// prefix when causal; zeros when it sees none). Computed as running sums
// in O((query_len + key_len) * value_dim) per (batch, head), where the
// tiled kernel would evaluate query_len * key_len logits of nothing.
absl::Status UniformAttention(const AttentionProblem& p) {
  const int64_t pairs = p.batch * p.heads;
  const int64_t dv = p.value_dim;
  const DType t = p.operand_dtype;
  // Rows summed or written between polls of the cancellation flag.
  constexpr int64_t kRowsPerPoll = 1024;
  SharedStatus shared;
#pragma omp parallel
  {
    std::unique_ptr<double[]> sum(new (std::nothrow) double[dv]);
    if (!sum) {
      shared.Update(absl::ResourceExhaustedError(
          "attention: out of memory for per-thread buffers"));
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < pairs; ++n) {
      if (shared.failed()) continue;
      const int64_t b = n / p.heads, h = n % p.heads;
      const int64_t out_first =
          b * p.output_layout.batch_stride + h * p.output_layout.head_stride;
      std::fill(sum.get(), sum.get() + dv, 0.0);
      int64_t summed = 0;
      for (int64_t i = 0; i < p.query_len; ++i) {
        const int64_t visible =
            p.causal
                ? std::clamp<int64_t>(i + p.causal_offset + 1, 0, p.key_len)
                : p.key_len;
        for (; summed < visible; ++summed) {
          if (summed % kRowsPerPoll == 0 && Cancelled(p)) break;
          const void* row = ValueRows(p, b, h / p.kv_group, summed);
          for (int64_t c = 0; c < dv; ++c) {
            sum[c] += OperandValue(row, t, c);
          }
        }
        if (summed < visible || (i % kRowsPerPoll == 0 && Cancelled(p))) {
          shared.Update(CancelledStatus());
          break;
        }
        const double inverse = visible == 0 ? 0.0 : 1.0 / visible;
        const int64_t offset = out_first + i * p.output_layout.row_stride;
        for (int64_t c = 0; c < dv; ++c) {
          // A row that sees no key is zeros, whatever the sums hold.
          const float mean =
              visible == 0 ? 0.0f : static_cast<float>(sum[c] * inverse);
          if (p.output_dtype == DType::kBFloat16) {
            static_cast<uint16_t*>(p.output)[offset + c] =
                FloatToBFloat16(mean);
          } else {
            static_cast<float*>(p.output)[offset + c] = mean;
          }
        }
      }
    }
  }
  return shared.status();
}

}  // namespace

OperandLayout DenseLayout(int64_t heads, int64_t rows, int64_t cols) {
  return {heads * rows * cols, rows * cols, cols};
}

OperandLayout InterleavedHeadsLayout(int64_t heads, int64_t rows,
                                     int64_t cols) {
  return {rows * heads * cols, cols, heads * cols};
}

namespace {

// The tiled path: blocks of queries of one (batch, head) walk the keys.
absl::Status RunTiled(const AttentionProblem& p) {
  const int64_t pairs = p.batch * p.heads;
  if (pairs == 0 || p.query_len == 0) return absl::OkStatus();
  // No value columns and no weights: the output has no elements, and the
  // logits need not be computed ([1, 1, 262144, 0] operands would make
  // 2^36 of them, for nothing).
  if (p.value_dim == 0 && p.weights == nullptr) return absl::OkStatus();
  if (p.key_dim == 0 && p.masks.empty() && p.weights == nullptr) {
    return UniformAttention(p);
  }
  const int64_t query_blocks = (p.query_len + kQueryBlock - 1) / kQueryBlock;
  const int64_t items = pairs * query_blocks;
  const RowOps& ops = GetRowOps();
  SharedStatus shared;

#pragma omp parallel
  {
    TileGemms gemms;
    ThreadBuffers buf;
    const int64_t dv = std::max<int64_t>(p.value_dim, 1);
    const bool narrow = NarrowsProbabilities(p);
    const int64_t probs_cols =
        p.weights != nullptr ? std::max<int64_t>(p.key_len, 1) : kKeyBlock;
    buf.acc.reset(new (std::nothrow) float[kQueryBlock * dv]);
    buf.row_max.reset(new (std::nothrow) float[kQueryBlock]);
    buf.row_sum.reset(new (std::nothrow) float[kQueryBlock]);
    if (p.weights == nullptr) {
      buf.logits.reset(new (std::nothrow) float[kQueryBlock * kKeyBlock]);
    }
    if (narrow) {
      buf.probs_bf16.reset(new (std::nothrow)
                               uint16_t[kQueryBlock * probs_cols]);
    }
    if (!buf.acc || !buf.row_max || !buf.row_sum ||
        (p.weights == nullptr && !buf.logits) || (narrow && !buf.probs_bf16)) {
      shared.Update(absl::ResourceExhaustedError(
          "attention: out of memory for per-thread buffers"));
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      if (shared.failed()) continue;
      if (Cancelled(p)) {
        // Stop at this block boundary; every buffer is freed on return.
        shared.Update(CancelledStatus());
        continue;
      }
      Block blk;
      blk.n = item / query_blocks;
      blk.b = blk.n / p.heads;
      blk.h = blk.n % p.heads;
      blk.i0 = (item % query_blocks) * kQueryBlock;
      blk.rows = std::min(kQueryBlock, p.query_len - blk.i0);
      shared.Update(p.weights != nullptr ? WeightsBlock(p, ops, blk, gemms, buf)
                                         : FlashBlock(p, ops, blk, gemms, buf));
    }
  }
  return shared.status();
}

// The rows of head h of a [.., heads, rows, ..] operand laid out as
// `layout`, when consecutive heads' rows are one run of rows: for one row a
// head, or heads stored one after the other.
bool FoldableRows(const OperandLayout& layout, int64_t rows) {
  return rows == 1 || layout.head_stride == rows * layout.row_stride;
}

// The grouping rule of the tiled path: a group's query heads become the
// rows of one head against their key/value head when nothing tells them
// apart (no masks; causal only when the single query sees every key) and
// the query, output (and weights, always dense) rows of the group are one
// run. Otherwise each query head reads key/value head h / kv_group.
AttentionProblem FoldGroups(const AttentionProblem& in) {
  AttentionProblem p = in;
  if (p.causal && p.query_len == 1 && p.causal_offset >= p.key_len - 1) {
    p.causal = false;  // the one query sees every key
  }
  const int64_t group = p.kv_group;
  if (group <= 1 || !p.masks.empty() || p.causal ||
      !FoldableRows(p.query_layout, p.query_len) ||
      !FoldableRows(p.output_layout, p.query_len)) {
    return p;
  }
  const auto fold = [&](OperandLayout layout) {
    const int64_t row_stride =
        p.query_len == 1 ? layout.head_stride : layout.row_stride;
    return OperandLayout{layout.batch_stride, group * layout.head_stride,
                         row_stride};
  };
  p.query_layout = fold(p.query_layout);
  p.output_layout = fold(p.output_layout);
  p.heads /= group;
  p.query_len *= group;
  p.kv_group = 1;
  return p;
}

// The split-KV path.
constexpr int64_t kSplitKeys = 512;
static_assert(kSplitKeys == kCacheBlockKeys,
              "a block table's entries cover one split each");
// Query rows per key/value head up to which a problem takes it.
constexpr int64_t kMaxSplitRows = 16;

bool TakesSplitPath(const AttentionProblem& p) {
  return p.weights == nullptr && p.key_len > 0 && p.query_len > 0 &&
         p.batch * p.heads > 0 && p.kv_group * p.query_len <= kMaxSplitRows;
}

// Keys the last query of a problem sees.
int64_t SplitVisibleKeys(const AttentionProblem& p) {
  return p.causal
             ? std::clamp<int64_t>(p.query_len + p.causal_offset, 0, p.key_len)
             : p.key_len;
}

// One problem in a split pass: its (batch, key/value head) units, each
// with `splits` key blocks, and where its items and partials start.
struct SplitProblem {
  const AttentionProblem* p = nullptr;
  int64_t kv_heads = 0;
  int64_t rows = 0;  // kv_group * query_len
  int64_t splits = 0;
  int64_t first_item = 0;
  int64_t first_unit = 0;
  // Floats of one item's partial: rows maxima, rows sums, rows x value_dim
  // weighted values.
  int64_t partial_floats = 0;
  int64_t first_partial = 0;  // floats
  std::atomic<bool> failed{false};
  Mutex mu;
  absl::Status status ABSL_GUARDED_BY(mu);

  void Fail(absl::Status s) ABSL_LOCKS_EXCLUDED(mu) {
    MutexLock lock(&mu);
    if (status.ok()) status = std::move(s);
    failed.store(true, std::memory_order_relaxed);
  }
  absl::Status Status() ABSL_LOCKS_EXCLUDED(mu) {
    MutexLock lock(&mu);
    return status;
  }
};

// Row r of a split unit: query head g * group + r / query_len, position
// r % query_len.
struct SplitRow {
  int64_t h, i;
};

SplitRow RowOf(const AttentionProblem& p, int64_t g, int64_t r) {
  return {g * p.kv_group + r / p.query_len, r % p.query_len};
}

// One item: the partial softmax of unit (b, g)'s rows over keys
// j0 .. j0 + cols, into `partial`: the rows' maxima, their sums, then
// rows x value_dim weighted values. `logits`
// holds rows x kSplitKeys floats, `q` rows x key_dim.
// The query rows of key/value head `g` of batch entry `b`, as float32, into
// `q` (rows x key_dim).
void GatherSplitQueries(const SplitProblem& sp, int64_t b, int64_t g,
                        float* q) {
  const AttentionProblem& p = *sp.p;
  const int64_t dk = p.key_dim;
  const DType t = p.operand_dtype;
  for (int64_t r = 0; r < sp.rows; ++r) {
    const SplitRow row = RowOf(p, g, r);
    const void* src = At(p.query, t,
                         b * p.query_layout.batch_stride +
                             row.h * p.query_layout.head_stride +
                             row.i * p.query_layout.row_stride);
    if (t == DType::kBFloat16) {
      const uint16_t* bits = static_cast<const uint16_t*>(src);
      for (int64_t c = 0; c < dk; ++c) q[r * dk + c] = BFloat16ToFloat(bits[c]);
    } else {
      std::memcpy(q + r * dk, src, dk * sizeof(float));
    }
  }
}

// With masks: a key a row excludes has probability 0, and its value row is
// not read (0 times a non-finite value would be NaN).
void AccumulateMaskedValues(const SplitProblem& sp, int64_t b, int64_t g,
                            int64_t j0, const float* logits,
                            const int64_t* kept, const CachedRows& values,
                            float* acc) {
  const AttentionProblem& p = *sp.p;
  const int64_t dv = p.value_dim;
  for (int64_t r = 0; r < sp.rows; ++r) {
    const SplitRow row = RowOf(p, g, r);
    const int64_t batch_head = b * p.heads + row.h;
    const float* prob = logits + r * kSplitKeys;
    for (int64_t j = 0; j < kept[r]; ++j) {
      if (prob[j] == 0.0f && Excluded(p, batch_head, row.i, j0 + j)) continue;
      for (int64_t c = 0; c < dv; ++c) {
        acc[r * dv + c] += prob[j] * CachedValue(values, j, c);
      }
    }
  }
}

void RunSplitItem(const SplitProblem& sp, const RowOps& ops, int64_t b,
                  int64_t g, int64_t j0, int64_t cols, float* logits, float* q,
                  float* partial) {
  const AttentionProblem& p = *sp.p;
  const int64_t rows = sp.rows, dk = p.key_dim, dv = p.value_dim;
  GatherSplitQueries(sp, b, g, q);
  const CachedRows keys = CachedRowsOf(p, /*keys=*/true, b, g, j0);
  const CachedRows values = CachedRowsOf(p, /*keys=*/false, b, g, j0);
  ops.dot_rows(q, rows, dk, keys, cols, logits, kSplitKeys);

  float* maxima = partial;
  float* sums = partial + rows;
  float* acc = partial + 2 * rows;
  std::fill(acc, acc + rows * dv, 0.0f);
  bool uniform = true;  // every row keeps all `cols` keys
  int64_t kept[kMaxSplitRows];
  for (int64_t r = 0; r < rows; ++r) {
    const SplitRow row = RowOf(p, g, r);
    float* logit = logits + r * kSplitKeys;
    // Causality cuts a row's keys to a prefix of the block.
    const int64_t n = p.causal ? std::clamp<int64_t>(
                                     row.i + p.causal_offset + 1 - j0, 0, cols)
                               : cols;
    float multiplier = p.logit_multiplier;
    float max_logit;
    if (p.masks.empty()) {
      max_logit = ops.max_scaled(logit, n, multiplier);
    } else {
      max_logit =
          PrepareLogits(p, ops, b * p.heads + row.h, row.i, j0, n, logit);
      multiplier = 1.0f;
    }
    if (max_logit == kNegInf && AnyNaN(logit, n, multiplier)) {
      max_logit = kNaN;
    }
    float sum = 0.0f;
    if (max_logit != kNegInf) {
      sum = ops.exp_sum(logit, n, multiplier, max_logit);
    } else {
      // Nothing visible in this block: the merge skips it.
      std::fill(logit, logit + n, 0.0f);
    }
    maxima[r] = max_logit;
    sums[r] = sum;
    kept[r] = n;
    if (n != cols) uniform = false;
  }
  if (p.masks.empty() && uniform) {
    // The common case: the block's values are read once for every row.
    ops.add_weighted_rows(logits, kSplitKeys, rows, values, cols, dv, acc);
    return;
  }
  if (p.masks.empty()) {
    for (int64_t r = 0; r < rows; ++r) {
      ops.add_weighted_rows(logits + r * kSplitKeys, kSplitKeys, 1, values,
                            kept[r], dv, acc + r * dv);
    }
    return;
  }
  AccumulateMaskedValues(sp, b, g, j0, logits, kept, values, acc);
}

// Merges unit (b, g)'s `splits` partials, in block order, into its output
// rows: a NaN max or sum makes the row NaN, a row with no key left is
// zeros. `tmp` holds value_dim floats.
void MergeSplitUnit(const SplitProblem& sp, const RowOps& ops, int64_t b,
                    int64_t g, const float* partials, float* tmp) {
  const AttentionProblem& p = *sp.p;
  const int64_t dv = p.value_dim, rows = sp.rows;
  for (int64_t r = 0; r < rows; ++r) {
    const SplitRow row = RowOf(p, g, r);
    const int64_t offset = b * p.output_layout.batch_stride +
                           row.h * p.output_layout.head_stride +
                           row.i * p.output_layout.row_stride;
    bool nan = false;
    float max_logit = kNegInf;
    for (int64_t s = 0; s < sp.splits; ++s) {
      const float* part = partials + s * sp.partial_floats;
      if (std::isnan(part[r]) || std::isnan(part[rows + r])) nan = true;
      max_logit = std::max(max_logit, part[r]);
    }
    float scale;
    if (nan) {
      std::fill(tmp, tmp + dv, kNaN);
      scale = 1.0f;
    } else if (max_logit == kNegInf) {
      std::fill(tmp, tmp + dv, 0.0f);
      scale = 0.0f;
    } else {
      std::fill(tmp, tmp + dv, 0.0f);
      float sum = 0.0f;
      for (int64_t s = 0; s < sp.splits; ++s) {
        const float* part = partials + s * sp.partial_floats;
        if (part[r] == kNegInf) continue;
        const float w = std::exp(part[r] - max_logit);
        sum += part[rows + r] * w;
        const float* values = part + 2 * rows + r * dv;
        for (int64_t c = 0; c < dv; ++c) tmp[c] += values[c] * w;
      }
      scale = 1.0f / sum;
    }
    if (p.output_dtype == DType::kBFloat16) {
      ops.scale_to_bf16(tmp, dv, scale,
                        static_cast<uint16_t*>(p.output) + offset);
    } else {
      float* dst = static_cast<float*>(p.output) + offset;
      for (int64_t c = 0; c < dv; ++c) dst[c] = tmp[c] * scale;
    }
  }
}

// The split-KV problems of a batch in one parallel pass: items (problem,
// batch entry, key/value head, key block), then the merge of each (problem,
// batch entry, key/value head).
// The split pass's totals over its problems, whose own offsets it sets.
struct SplitTotals {
  int64_t items = 0, units = 0, partial_floats = 0;
  int64_t max_rows = 1, max_dk = 1, max_dv = 1;
};

SplitTotals PlanSplits(std::deque<SplitProblem>& problems) {
  SplitTotals t;
  for (SplitProblem& sp : problems) {
    const AttentionProblem& p = *sp.p;
    sp.kv_heads = p.heads / p.kv_group;
    sp.rows = p.kv_group * p.query_len;
    sp.splits = (SplitVisibleKeys(p) + kSplitKeys - 1) / kSplitKeys;
    sp.first_item = t.items;
    sp.first_unit = t.units;
    sp.partial_floats = sp.rows * (p.value_dim + 2);
    sp.first_partial = t.partial_floats;
    const int64_t unit_count = p.batch * sp.kv_heads;
    t.items += unit_count * sp.splits;
    t.units += unit_count;
    t.partial_floats += unit_count * sp.splits * sp.partial_floats;
    t.max_rows = std::max(t.max_rows, sp.rows);
    t.max_dk = std::max(t.max_dk, p.key_dim);
    t.max_dv = std::max(t.max_dv, p.value_dim);
  }
  return t;
}

// The problem of item (or unit) `index`: the last whose first item (unit)
// is <= index, by binary search over `by_order`.
SplitProblem* OwnerOf(const std::vector<SplitProblem*>& by_order, int64_t index,
                      bool unit) {
  size_t lo = 0, hi = by_order.size();
  while (hi - lo > 1) {
    const size_t mid = (lo + hi) / 2;
    const int64_t first =
        unit ? by_order[mid]->first_unit : by_order[mid]->first_item;
    if (first <= index) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return by_order[lo];
}

// The weights path reads keys in one run per query block, not block by
// block: a problem with a block table cannot take it.
absl::Status VerifyBlockTable(const AttentionProblem& p) {
  if (p.key_blocks.empty() && p.value_blocks.empty()) return absl::OkStatus();
  if (p.weights != nullptr) {
    return absl::InvalidArgumentError(
        "attention: weights cannot be returned from a block-table cache");
  }
  return absl::OkStatus();
}

void RunSplitPass(std::deque<SplitProblem>& problems) {
  const SplitTotals totals = PlanSplits(problems);
  const int64_t items = totals.items, units = totals.units;
  const int64_t partial_floats = totals.partial_floats;
  const int64_t max_rows = totals.max_rows, max_dk = totals.max_dk,
                max_dv = totals.max_dv;
  std::unique_ptr<float[]> partials(new (std::nothrow) float[partial_floats]);
  if (!partials) {
    for (SplitProblem& sp : problems) {
      sp.Fail(absl::ResourceExhaustedError(
          "attention: out of memory for the partial softmax of key blocks"));
    }
    return;
  }
  std::vector<SplitProblem*> by_order;
  for (SplitProblem& sp : problems) by_order.push_back(&sp);
  const auto find = [&](int64_t index, bool unit) {
    return OwnerOf(by_order, index, unit);
  };
  const RowOps& ops = GetRowOps();
  std::atomic<bool> out_of_memory{false};

#pragma omp parallel
  {
    std::unique_ptr<float[]> logits(
        new (std::nothrow) float[max_rows * kSplitKeys]);
    std::unique_ptr<float[]> q(new (std::nothrow) float[max_rows * max_dk]);
    std::unique_ptr<float[]> tmp(new (std::nothrow) float[max_dv]);
    if (!logits || !q || !tmp) out_of_memory.store(true);
      // Guided: each thread takes runs of consecutive items (a unit's blocks
      // lie end to end in memory, so its prefetches past a block's end serve
      // its own next item), and the runs shrink towards the end for balance.
      // One item at a time interleaved the threads' blocks: int8 and bfloat16
      // caches streamed 10-25% slower.
#pragma omp for schedule(guided)
    for (int64_t item = 0; item < items; ++item) {
      if (!logits || !q || !tmp) continue;
      SplitProblem& sp = *find(item, /*unit=*/false);
      if (sp.failed.load(std::memory_order_relaxed)) continue;
      const AttentionProblem& p = *sp.p;
      if (p.cancelled != nullptr &&
          p.cancelled->load(std::memory_order_relaxed)) {
        sp.Fail(absl::CancelledError("call cancelled"));
        continue;
      }
      const int64_t local = item - sp.first_item;
      const int64_t unit = local / sp.splits, s = local % sp.splits;
      const int64_t b = unit / sp.kv_heads, g = unit % sp.kv_heads;
      const int64_t j0 = s * kSplitKeys;
      const int64_t cols = std::min(kSplitKeys, SplitVisibleKeys(p) - j0);
      RunSplitItem(sp, ops, b, g, j0, cols, logits.get(), q.get(),
                   partials.get() + sp.first_partial +
                       (unit * sp.splits + s) * sp.partial_floats);
    }
    // The implicit barrier: every partial is written.
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      if (!tmp || out_of_memory.load(std::memory_order_relaxed)) continue;
      SplitProblem& sp = *find(u, /*unit=*/true);
      if (sp.failed.load(std::memory_order_relaxed)) continue;
      const int64_t unit = u - sp.first_unit;
      MergeSplitUnit(sp, ops, unit / sp.kv_heads, unit % sp.kv_heads,
                     partials.get() + sp.first_partial +
                         unit * sp.splits * sp.partial_floats,
                     tmp.get());
    }
  }
  if (out_of_memory.load()) {
    for (SplitProblem& sp : problems) {
      sp.Fail(absl::ResourceExhaustedError(
          "attention: out of memory for per-thread buffers"));
    }
  }
}

// Keys an int8_kv problem's queries see (all with weights, whose rows span
// key_len).
int64_t DequantizedKeys(const AttentionProblem& p) {
  return p.weights != nullptr ? p.key_len : SplitVisibleKeys(p);
}

// Dense copies of the keys and values an int8_kv problem's queries see,
// dequantized into its operand dtype.
struct DequantizedCache {
  Tensor keys, values;
};

absl::StatusOr<DequantizedCache> Dequantize(const AttentionProblem& p) {
  const int64_t kv_heads = p.heads / p.kv_group;
  const int64_t keys = DequantizedKeys(p);
  DequantizedCache out;
  ATTN_ASSIGN_OR_RETURN(
      out.keys,
      Tensor::Allocate(p.operand_dtype, {p.batch, kv_heads, keys, p.key_dim}));
  ATTN_ASSIGN_OR_RETURN(
      out.values, Tensor::Allocate(p.operand_dtype,
                                   {p.batch, kv_heads, keys, p.value_dim}));
  const bool bf16 = p.operand_dtype == DType::kBFloat16;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < p.batch * kv_heads * 2; ++n) {
    const bool is_key = n % 2 == 0;
    const int64_t b = n / 2 / kv_heads, g = n / 2 % kv_heads;
    const int64_t dim = is_key ? p.key_dim : p.value_dim;
    Tensor& dst = is_key ? out.keys : out.values;
    const int64_t first = (b * kv_heads + g) * keys * dim;
    CachedRows rows;
    for (int64_t j = 0; j < keys; ++j) {
      // A block table's blocks may each be in another cache.
      if (j % kCacheBlockKeys == 0) rows = CachedRowsOf(p, is_key, b, g, j);
      for (int64_t c = 0; c < dim; ++c) {
        const float x = CachedValue(rows, j % kCacheBlockKeys, c);
        if (bf16) {
          static_cast<uint16_t*>(dst.data())[first + j * dim + c] =
              FloatToBFloat16(x);
        } else {
          static_cast<float*>(dst.data())[first + j * dim + c] = x;
        }
      }
    }
  }
  return out;
}

// The tiled path of an int8_kv problem: on its keys and values dequantized.
// The copy costs O(keys x dims), against the O(queries x keys x dims) of
// the more than kMaxSplitRows query rows a head that take this path.
absl::Status RunTiledInt8(const AttentionProblem& in) {
  if (Cancelled(in)) return CancelledStatus();
  ATTN_ASSIGN_OR_RETURN(const DequantizedCache cache, Dequantize(in));
  AttentionProblem p = in;
  const int64_t kv_heads = p.heads / p.kv_group;
  const int64_t keys = DequantizedKeys(p);
  p.int8_kv = false;
  p.key_blocks = {};
  p.value_blocks = {};
  p.key_scale_blocks = {};
  p.value_scale_blocks = {};
  p.key_len = keys;
  p.key = cache.keys.data();
  p.key_layout = DenseLayout(kv_heads, keys, p.key_dim);
  p.value = cache.values.data();
  p.value_layout = DenseLayout(kv_heads, keys, p.value_dim);
  return RunTiled(FoldGroups(p));
}

absl::Status RunTiledProblem(const AttentionProblem& p) {
  return p.int8_kv ? RunTiledInt8(p) : RunTiled(FoldGroups(p));
}

}  // namespace

std::vector<absl::Status> RunAttentionBatch(
    absl::Span<const AttentionProblem* const> problems) {
  std::vector<absl::Status> statuses(problems.size());
  std::deque<SplitProblem> split;  // stable addresses (atomics, mutex)
  std::vector<size_t> split_index;
  for (size_t i = 0; i < problems.size(); ++i) {
    statuses[i] = VerifyBlockTable(*problems[i]);
    if (!statuses[i].ok()) continue;
    if (TakesSplitPath(*problems[i])) {
      split.emplace_back().p = problems[i];
      split_index.push_back(i);
    }
  }
  if (!split.empty()) RunSplitPass(split);
  for (size_t k = 0; k < split.size(); ++k) {
    statuses[split_index[k]] = split[k].Status();
  }
  for (size_t i = 0; i < problems.size(); ++i) {
    if (statuses[i].ok() && !TakesSplitPath(*problems[i])) {
      statuses[i] = RunTiledProblem(*problems[i]);
    }
  }
  return statuses;
}

absl::Status RunAttention(const AttentionProblem& p) {
  const AttentionProblem* one[] = {&p};
  return RunAttentionBatch(one)[0];
}

}  // namespace attnserve
