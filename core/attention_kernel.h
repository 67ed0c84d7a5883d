// The attention computation shared by Attend and MultiHeadAttend:
// out = softmax(mask(Q*K^T * scale / temperature)) * V for every
// (batch, head) pair, on FLOAT32 or BFLOAT16 operands. Logits, softmax and
// accumulation are float32; with BFLOAT16 operands the probabilities are
// rounded to bfloat16 for the P*V product.
//
// The kernel is tiled flash-attention style: each thread takes a block of
// queries of one (batch, head), walks the key/value blocks with an online
// softmax (running max and sum in float32, accumulator rescaled as the max
// grows) and never holds more than a query block x key block of logits.
// Causal attention skips key blocks above the diagonal. When the caller
// wants the weights, the logits are written straight into its weights buffer
// and normalized there. Cancellation is polled at every key block.
//
// Dims of 0 cost no more than their output: with value_dim 0 and no
// weights nothing is computed; with key_dim 0, no mask and no weights every
// logit is 0 and each output row is the mean of the value rows its query
// sees, in O((query_len + key_len) * value_dim) per (batch, head).
//
// Grouped-query attention has one rule, here: `kv_group` query heads share
// each key/value head, and the kernel reads that head once for all of
// them, folding the group's queries into the rows of one computation
// against it wherever nothing tells them apart (no masks, and no causal cut
// between them).
//
// Few query rows per key/value head (decode steps: one token or a few,
// times the group) take the split-KV path instead of the tiles: the work is
// split by (problem, batch entry, key/value head, block of 512 keys),
// each block yields a partial softmax (its max, its sum and its weighted
// values) and a merge combines the blocks in a fixed order. The blocks of
// a problem depend on its own key length only, so a problem's result is the
// same, bit for bit, whatever other problems share the pass and however
// many threads run it.
//
// Thread-safety: RunAttention and RunAttentionBatch may be called
// concurrently; they only read their inputs and write the caller's output
// buffers.
#ifndef ATTNSERVE_CORE_ATTENTION_KERNEL_H_
#define ATTNSERVE_CORE_ATTENTION_KERNEL_H_

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/tensor.h"

namespace attnserve {

// Where element (b, h, row, col) of a [batch, heads, rows, cols] operand is:
// data + b * batch_stride + h * head_stride + row * row_stride + col.
struct OperandLayout {
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t row_stride = 0;
};

// The layout of a dense [batch, heads, rows, cols] operand.
OperandLayout DenseLayout(int64_t heads, int64_t rows, int64_t cols);
// The layout of head h's columns in a [batch, rows, heads * cols] operand,
// as projections write them.
OperandLayout InterleavedHeadsLayout(int64_t heads, int64_t rows, int64_t cols);

// How a mask is read for logit (n, i, j), n = b * heads + h: element
// data[batch_offset[n] + i * query_stride + j * key_stride]. Broadcast dims
// have stride 0. BOOL/UINT8 masks keep nonzero positions; FLOAT32 masks add
// to the logits.
struct MaskLayout {
  const void* data = nullptr;
  DType dtype = DType::kBool;
  std::vector<int64_t> batch_offset;  // one per (batch, head)
  int64_t query_stride = 0;
  int64_t key_stride = 0;
};

// The keys a block table entry covers (AttentionProblem::key_blocks): the
// kernel's key blocks, aligned at key 0.
inline constexpr int64_t kCacheBlockKeys = 512;

// Offsets in the layouts count elements of the operand's dtype.
struct AttentionProblem {
  int64_t batch = 0;
  int64_t heads = 1;
  int64_t query_len = 0;
  int64_t key_len = 0;
  int64_t key_dim = 0;
  int64_t value_dim = 0;
  // FLOAT32 or BFLOAT16, for query, key and value alike (but see int8_kv).
  DType operand_dtype = DType::kFloat32;
  // Keys and values of an INT8 cache: their elements are int8 codes (the
  // layouts count bytes), row j of (b, h) scaled by key_scales (value_scales)
  // [b * scale_layout.batch_stride + h * scale_layout.head_stride + j]; the
  // queries and the output keep operand_dtype. The split-KV path reads the
  // codes as they are; the tiled path (long steps) first dequantizes the
  // visible keys and values into operand_dtype.
  bool int8_kv = false;
  const float* key_scales = nullptr;
  const float* value_scales = nullptr;
  OperandLayout scale_layout;
  const void* query = nullptr;  // [batch, heads, query_len, key_dim]
  OperandLayout query_layout;
  const void* key = nullptr;  // [batch, heads, key_len, key_dim]
  OperandLayout key_layout;
  const void* value = nullptr;  // [batch, heads, key_len, value_dim]
  OperandLayout value_layout;
  // Optional block tables (a cache shared copy-on-write): keys i *
  // kCacheBlockKeys .. (i + 1) * kCacheBlockKeys - 1 are read from
  // key_blocks[i] instead of `key`, by key_layout and absolute key index;
  // keys past the table from `key`. Likewise for values. Not with weights.
  absl::Span<const void* const> key_blocks;
  absl::Span<const void* const> value_blocks;
  // With int8_kv, the scales of the same blocks (key_scales and
  // value_scales past the table).
  absl::Span<const float* const> key_scale_blocks;
  absl::Span<const float* const> value_scale_blocks;
  // FLOAT32 or BFLOAT16.
  DType output_dtype = DType::kFloat32;
  void* output = nullptr;  // [batch, heads, query_len, value_dim]
  OperandLayout output_layout;
  // Dense [batch, heads, query_len, key_len], or null.
  float* weights = nullptr;
  float logit_multiplier = 1.0f;  // scale / temperature
  bool causal = false;            // query i sees keys j <= i + causal_offset
  // Where the queries stand among the keys: a decode step's queries follow
  // the `causal_offset` keys already cached.
  int64_t causal_offset = 0;
  // Query heads per key/value head (grouped-query attention): query head h
  // reads key and value head h / kv_group of the key and value layouts.
  int64_t kv_group = 1;
  std::vector<MaskLayout> masks;
  // When set and true, the computation stops at the next block boundary
  // with CANCELLED.
  const std::atomic<bool>* cancelled = nullptr;
};

absl::Status RunAttention(const AttentionProblem& problem);

// Runs every problem, the split-KV ones in one parallel pass, and returns
// one status per problem: a problem that fails (cancelled through its own
// flag) leaves the others' results as they would be alone.
std::vector<absl::Status> RunAttentionBatch(
    absl::Span<const AttentionProblem* const> problems);

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_ATTENTION_KERNEL_H_
