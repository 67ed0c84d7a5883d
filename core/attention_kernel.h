// The attention computation shared by Attend and MultiHeadAttend, on dense
// float32 buffers: out = softmax(mask(Q*K^T * scale / temperature)) * V for a
// batch of independent (query, key, value) triples.
//
// Thread-safety: RunAttention may be called concurrently; it only reads its
// inputs and writes the caller's output buffers.
#ifndef ATTNSERVE_CORE_ATTENTION_KERNEL_H_
#define ATTNSERVE_CORE_ATTENTION_KERNEL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/tensor.h"

namespace attnserve {

// How a mask is read for logit (n, i, j) of a problem: element
// data[batch_offset[n] + i * query_stride + j * key_stride], where `n` is the
// flat batch index. Broadcast dims have stride 0. BOOL/UINT8 masks keep
// nonzero positions; FLOAT32 masks add to the logits.
struct MaskLayout {
  const void* data = nullptr;
  DType dtype = DType::kBool;
  std::vector<int64_t> batch_offset;  // one per batch entry
  int64_t query_stride = 0;
  int64_t key_stride = 0;
};

struct AttentionProblem {
  int64_t batch = 0;  // independent attention problems
  int64_t query_len = 0;
  int64_t key_len = 0;
  int64_t key_dim = 0;
  int64_t value_dim = 0;
  const float* query = nullptr;   // [batch, query_len, key_dim]
  const float* key = nullptr;     // [batch, key_len, key_dim]
  const float* value = nullptr;   // [batch, key_len, value_dim]
  float logit_multiplier = 1.0f;  // scale / temperature
  bool causal = false;            // query i sees keys j <= i
  std::vector<MaskLayout> masks;
  float* output = nullptr;   // [batch, query_len, value_dim]
  float* weights = nullptr;  // [batch, query_len, key_len], or null
};

absl::Status RunAttention(const AttentionProblem& problem);

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_ATTENTION_KERNEL_H_
