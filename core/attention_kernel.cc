#include "core/attention_kernel.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/primitives.h"
#include "core/status_macros.h"

namespace attnserve {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Logits held at once when the caller does not want the weights back:
// bounds the extra memory of a request to 64 MiB however long it is.
constexpr int64_t kMaxScratchLogits = int64_t{16} << 20;

template <typename T>
void ApplyKeepMask(const T* mask, int64_t key_stride, int64_t key_len,
                   float* row) {
  for (int64_t j = 0; j < key_len; ++j) {
    if (mask[j * key_stride] == 0) row[j] = kNegInf;
  }
}

void ApplyMask(const MaskLayout& mask, int64_t n, int64_t i, int64_t key_len,
               float* row) {
  const int64_t offset = mask.batch_offset[n] + i * mask.query_stride;
  switch (mask.dtype) {
    case DType::kFloat32: {
      const float* values = static_cast<const float*>(mask.data) + offset;
      for (int64_t j = 0; j < key_len; ++j)
        row[j] += values[j * mask.key_stride];
      return;
    }
    default:
      ApplyKeepMask(static_cast<const uint8_t*>(mask.data) + offset,
                    mask.key_stride, key_len, row);
      return;
  }
}

// Turns one row of raw Q*K^T products into probabilities, in place.
void SoftmaxRow(const AttentionProblem& p, int64_t n, int64_t i, float* row) {
  const int64_t key_len = p.key_len;
  for (int64_t j = 0; j < key_len; ++j) row[j] *= p.logit_multiplier;
  for (const MaskLayout& mask : p.masks) ApplyMask(mask, n, i, key_len, row);
  if (p.causal) {
    for (int64_t j = std::max<int64_t>(i + 1, 0); j < key_len; ++j) {
      row[j] = kNegInf;
    }
  }
  float max_logit = kNegInf;
  for (int64_t j = 0; j < key_len; ++j) max_logit = std::max(max_logit, row[j]);
  if (max_logit == kNegInf) {
    // No key left for this query: zeros, not NaN.
    std::fill(row, row + key_len, 0.0f);
    return;
  }
  double sum = 0.0;
  for (int64_t j = 0; j < key_len; ++j) {
    const float e = std::exp(row[j] - max_logit);
    row[j] = e;
    sum += e;
  }
  const float inv_sum = static_cast<float>(1.0 / sum);
  for (int64_t j = 0; j < key_len; ++j) row[j] *= inv_sum;
}

}  // namespace

absl::Status RunAttention(const AttentionProblem& p) {
  const int64_t rows_per_item = p.query_len;
  const int64_t logits_per_item = p.query_len * p.key_len;
  if (p.batch == 0 || p.query_len == 0) return absl::OkStatus();

  // Without requested weights, the logits live in a scratch buffer sized for
  // a chunk of the batch; with them, straight in the caller's buffer.
  int64_t chunk = p.batch;
  Tensor scratch;
  if (p.weights == nullptr) {
    chunk = std::clamp<int64_t>(
        kMaxScratchLogits / std::max<int64_t>(logits_per_item, 1), 1, p.batch);
    ATTN_ASSIGN_OR_RETURN(
        scratch, Tensor::Allocate(DType::kFloat32, {chunk * logits_per_item}));
  }

  for (int64_t start = 0; start < p.batch; start += chunk) {
    const int64_t count = std::min(chunk, p.batch - start);
    float* logits = p.weights != nullptr ? p.weights + start * logits_per_item
                                         : scratch.data_as<float>();
    MatmulShape qk;
    qk.batch = count;
    qk.m = p.query_len;
    qk.k = p.key_dim;
    qk.n = p.key_len;
    qk.b_transposed = true;
    ATTN_RETURN_IF_ERROR(
        MatmulF32(qk, p.query + start * p.query_len * p.key_dim,
                  p.key + start * p.key_len * p.key_dim, nullptr, logits));

    const int64_t rows = count * rows_per_item;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      SoftmaxRow(p, start + r / rows_per_item, r % rows_per_item,
                 logits + r * p.key_len);
    }

    MatmulShape pv;
    pv.batch = count;
    pv.m = p.query_len;
    pv.k = p.key_len;
    pv.n = p.value_dim;
    ATTN_RETURN_IF_ERROR(
        MatmulF32(pv, logits, p.value + start * p.key_len * p.value_dim,
                  nullptr, p.output + start * p.query_len * p.value_dim));
  }
  return absl::OkStatus();
}

}  // namespace attnserve
