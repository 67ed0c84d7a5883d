#include "core/attention.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/attention_common.h"
#include "core/attention_kernel.h"
#include "core/convert.h"
#include "core/primitives.h"
#include "core/status_macros.h"
#include "core/verify.h"

namespace attnserve {
namespace {

// Row-major strides of `shape`.
std::vector<int64_t> Strides(absl::Span<const int64_t> shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i) {
    strides[i] = strides[i + 1] * shape[i + 1];
  }
  return strides;
}

// Checks that `mask` broadcasts right-aligned to `logits_shape`
// ([batch dims..., Lq, Lk]) and returns how the kernel reads it.
absl::StatusOr<MaskLayout> BroadcastMask(
    const TensorView& mask, absl::string_view field,
    absl::Span<const int64_t> logits_shape) {
  ATTN_RETURN_IF_ERROR(VerifyMask(mask, field));
  const int64_t rank = static_cast<int64_t>(logits_shape.size());
  if (mask.rank() > rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": rank ", mask.rank(), " (shape ", ShapeString(mask.shape),
        ") exceeds the rank of the logits ", ShapeString(logits_shape)));
  }
  // Strides of the mask laid over the logits dims; 0 where it broadcasts.
  std::vector<int64_t> strides(rank, 0);
  const std::vector<int64_t> own = Strides(mask.shape);
  const int64_t lead = rank - mask.rank();
  for (int64_t i = 0; i < mask.rank(); ++i) {
    const int64_t want = logits_shape[lead + i];
    if (mask.shape[i] != want && mask.shape[i] != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": shape ", ShapeString(mask.shape), " does not broadcast to ",
          ShapeString(logits_shape), " (dim ", i, " is ", mask.shape[i],
          ", expected 1 or ", want, ")"));
    }
    strides[lead + i] = mask.shape[i] == 1 ? 0 : own[i];
  }
  MaskLayout layout;
  layout.data = mask.data;
  layout.dtype = mask.dtype;
  layout.query_stride = strides[rank - 2];
  layout.key_stride = strides[rank - 1];
  const absl::Span<const int64_t> batch_dims = logits_shape.first(rank - 2);
  const int64_t batch = NumElements(batch_dims);
  layout.batch_offset.resize(batch);
  for (int64_t n = 0; n < batch; ++n) {
    int64_t rest = n, offset = 0;
    for (int64_t d = static_cast<int64_t>(batch_dims.size()) - 1; d >= 0; --d) {
      offset += (rest % batch_dims[d]) * strides[d];
      rest /= batch_dims[d];
    }
    layout.batch_offset[n] = offset;
  }
  return layout;
}

// How many query heads share each key/value head: 1 unless enable_gqa and
// key and value have fewer heads (dim -3) than the query, which they must
// divide.
absl::StatusOr<int64_t> QueryHeadsPerKeyHead(const AttendInputs& in,
                                             const AttentionOptions& options) {
  const int64_t rank = in.query.rank();
  if (!options.enable_gqa || rank < 3 || in.key.dim(-3) == in.query.dim(-3)) {
    return 1;
  }
  const int64_t query_heads = in.query.dim(-3);
  const int64_t key_heads = in.key.dim(-3);
  if (key_heads <= 0 || query_heads % key_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key: ", key_heads, " heads (dim ", rank - 3,
        ") do not divide the query's ", query_heads, " (enable_gqa)"));
  }
  ATTN_RETURN_IF_ERROR(
      VerifyDim(in.value, "value", -3, key_heads,
                absl::StrCat("key heads (dim ", rank - 3, ")")));
  return query_heads / key_heads;
}

// Attend's checks of its inputs' dtypes, ranks and dims; the query heads
// per key/value head.
absl::StatusOr<int64_t> VerifyAttendInputs(const AttendInputs& in,
                                           const AttentionOptions& options) {
  ATTN_RETURN_IF_ERROR(VerifyFloating(in.query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameDType(in.key, "key", in.query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameDType(in.value, "value", in.query, "query"));
  ATTN_RETURN_IF_ERROR(VerifyRank(in.query, "query", 2, 1000));
  ATTN_RETURN_IF_ERROR(VerifySameRank(in.key, "key", in.query, "query"));
  ATTN_RETURN_IF_ERROR(VerifySameRank(in.value, "value", in.query, "query"));
  const int64_t rank = in.query.rank();
  ATTN_ASSIGN_OR_RETURN(const int64_t group, QueryHeadsPerKeyHead(in, options));
  for (int64_t d = 0; d < rank - 2; ++d) {
    if (group > 1 && d == rank - 3) continue;  // checked by the above
    const std::string what = absl::StrCat("query dim ", d);
    ATTN_RETURN_IF_ERROR(VerifyDim(in.key, "key", d, in.query.dim(d), what));
    ATTN_RETURN_IF_ERROR(
        VerifyDim(in.value, "value", d, in.query.dim(d), what));
  }
  ATTN_RETURN_IF_ERROR(
      VerifyDim(in.key, "key", -1, in.query.dim(-1), "query last dim"));
  ATTN_RETURN_IF_ERROR(VerifyDim(in.value, "value", -2, in.key.dim(-2),
                                 absl::StrCat("key dim ", rank - 2)));
  return group;
}

}  // namespace

absl::StatusOr<AttentionResult> Attend(const AttendInputs& inputs,
                                       const AttentionOptions& options) {
  TensorResults results;
  ATTN_RETURN_IF_ERROR(Attend(inputs, options, results));
  return TakeResult(results);
}

absl::Status Attend(const AttendInputs& in, const AttentionOptions& options,
                    ResultAllocator& results) {
  ATTN_ASSIGN_OR_RETURN(const int64_t group, VerifyAttendInputs(in, options));
  const Shape batch_dims(in.query.shape.begin(), in.query.shape.end() - 2);
  AttentionProblem p;
  // The query's heads (dim -3) are the problem's heads, `group` to a
  // key/value head; the kernel reads each key/value head once for its group.
  p.heads = in.query.rank() >= 3 ? in.query.dim(-3) : 1;
  p.batch = p.heads == 0 ? 0 : NumElements(batch_dims) / p.heads;
  p.kv_group = group;
  p.query_len = in.query.dim(-2);
  p.key_len = in.key.dim(-2);
  p.key_dim = in.query.dim(-1);
  p.value_dim = in.value.dim(-1);
  p.causal = options.causal;
  p.cancelled = options.cancelled;
  ATTN_ASSIGN_OR_RETURN(p.logit_multiplier,
                        LogitMultiplier(options, p.key_dim));

  Shape logits_shape = batch_dims;
  logits_shape.push_back(p.query_len);
  logits_shape.push_back(p.key_len);
  ATTN_RETURN_IF_ERROR(
      CheckedNumElements(logits_shape, DType::kFloat32, "weights").status());
  if (in.attn_mask.has_value()) {
    ATTN_ASSIGN_OR_RETURN(
        MaskLayout mask,
        BroadcastMask(*in.attn_mask, "attn_mask", logits_shape));
    p.masks.push_back(std::move(mask));
  }

  const DType compute = ComputeDType(options);
  ATTN_ASSIGN_OR_RETURN(OperandData query,
                        OperandData::From(in.query, compute, "query"));
  ATTN_ASSIGN_OR_RETURN(OperandData key,
                        OperandData::From(in.key, compute, "key"));
  ATTN_ASSIGN_OR_RETURN(OperandData value,
                        OperandData::From(in.value, compute, "value"));
  p.operand_dtype = compute;
  p.query = query.data();
  p.key = key.data();
  p.value = value.data();
  const int64_t kv_heads = p.heads / group;
  p.query_layout = DenseLayout(p.heads, p.query_len, p.key_dim);
  p.key_layout = DenseLayout(kv_heads, p.key_len, p.key_dim);
  p.value_layout = DenseLayout(kv_heads, p.key_len, p.value_dim);
  p.output_layout = DenseLayout(p.heads, p.query_len, p.value_dim);

  Shape output_shape = batch_dims;
  output_shape.push_back(p.query_len);
  output_shape.push_back(p.value_dim);
  ATTN_ASSIGN_OR_RETURN(
      ResultBuffer output,
      ResultBuffer::Allocate(results, "output", in.query.dtype, output_shape,
                             /*bf16_ok=*/true));
  p.output = output.data();
  p.output_dtype = output.dtype();
  if (options.return_weights) {
    ATTN_ASSIGN_OR_RETURN(
        void* weights,
        results.Allocate("weights", DType::kFloat32, logits_shape));
    p.weights = static_cast<float*>(weights);
  }
  ATTN_RETURN_IF_ERROR(RunAttention(p));
  output.Finish();
  return absl::OkStatus();
}

}  // namespace attnserve
