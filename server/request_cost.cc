#include "server/request_cost.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/attention_weights.h"
#include "core/tensor.h"
#include "proto/tensor_codec.h"

namespace attnserve {
namespace {

// Elements of a wire tensor's shape, or -1 when decoding will refuse the
// shape (CheckedNumElements, as the decoder calls it): a negative dim, or
// elements or their bytes beyond int64. Such a request is the operation's to
// refuse with INVALID_ARGUMENT, not the limits' with RESOURCE_EXHAUSTED. An
// unknown dtype, which the decoder refuses too, counts one byte an element.
int64_t Elements(const v1::Tensor& t) {
  const DType dtype =
      DTypeFromProto(t.dtype(), "dtype").value_or(DType::kUInt8);
  const absl::StatusOr<int64_t> n =
      CheckedNumElements(t.shape(), dtype, "shape");
  return n.ok() ? *n : -1;
}

// Costs are only estimated for shapes that validate: the operation reports
// the others with INVALID_ARGUMENT.
bool AllValid(std::initializer_list<const v1::Tensor*> tensors) {
  for (const v1::Tensor* t : tensors) {
    if (Elements(*t) < 0) return false;
  }
  return true;
}

int64_t Dim(const v1::Tensor& t, int i) {
  const int rank = t.shape_size();
  const int index = i < 0 ? rank + i : i;
  return index >= 0 && index < rank ? std::max<int64_t>(t.shape(index), 0) : 0;
}

// Product of all dims but the last two.
int64_t Batch(const v1::Tensor& t) {
  int64_t n = 1;
  for (int i = 0; i + 2 < t.shape_size(); ++i)
    n *= std::max<int64_t>(t.shape(i), 0);
  return n;
}

// Elements of the tensors that are present.
double PresentElements(
    std::initializer_list<std::pair<bool, const v1::Tensor*>> tensors) {
  double n = 0;
  for (const auto& [present, t] : tensors) {
    if (present) n += static_cast<double>(std::max<int64_t>(Elements(*t), 0));
  }
  return n;
}

// The logits the attention kernel evaluates for `pairs` (batch x heads)
// of lq x lk, whatever the head dims: none when no result reads them
// (value dim 0 without weights), nor when they are all 0 and it averages
// the values instead (key dim 0 without mask or weights).
double EvaluatedLogits(double pairs, double lq, double lk, double dk, double dv,
                       bool masked, bool weights) {
  if (!weights && (dv == 0 || (dk == 0 && !masked))) return 0;
  return pairs * lq * lk;
}

// The attention's FLOPs (`dk`, `dv` summed over heads): Q*K^T and P*V for
// the logits it evaluates, else the sums of the values it averages.
double AttentionFlops(double batch, double lq, double lk, double dk, double dv,
                      double logits) {
  return logits > 0 ? 2.0 * batch * lq * lk * (dk + dv) : batch * lk * dv;
}

// The work of reading and writing `elements`, reading `mask_reads` mask
// elements and evaluating `logits`.
double Work(double elements, double mask_reads, double logits) {
  return kElementWork * (elements + mask_reads) + kLogitWork * logits;
}

}  // namespace

RequestCost CostOf(const v1::AttendRequest& r) {
  RequestCost cost;
  if (!AllValid({&r.query(), &r.key(), &r.value(), &r.attn_mask()}))
    return cost;
  const double batch = static_cast<double>(Batch(r.query()));
  const double lq = Dim(r.query(), -2), dk = Dim(r.query(), -1);
  const double lk = Dim(r.key(), -2), dv = Dim(r.value(), -1);
  const double logits = EvaluatedLogits(batch, lq, lk, dk, dv,
                                        r.has_attn_mask(), r.return_weights());
  cost.flops = AttentionFlops(batch, lq, lk, dk, dv, logits);
  const double output = batch * lq * dv * 4;
  const double weights = r.return_weights() ? batch * lq * lk * 4 : 0;
  cost.bytes = static_cast<int64_t>(std::min(output + weights, 9e18));
  const double read = PresentElements({{r.has_query(), &r.query()},
                                       {r.has_key(), &r.key()},
                                       {r.has_value(), &r.value()},
                                       {r.has_attn_mask(), &r.attn_mask()}});
  cost.work = Work(read + (output + weights) / 4,
                   r.has_attn_mask() ? logits : 0, logits);
  cost.largest_tensor =
      std::max({Elements(r.query()), Elements(r.key()), Elements(r.value()),
                Elements(r.attn_mask())});
  return cost;
}

RequestCost CostOf(const v1::MultiHeadAttendRequest& r,
                   const MultiHeadLayer* layer) {
  RequestCost cost;
  if (!AllValid({&r.query(), &r.key(), &r.value(), &r.attn_mask(),
                 &r.key_padding_mask()})) {
    return cost;
  }
  if (layer == nullptr && r.has_weights()) {
    for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
      const v1::Tensor* t = FindWeightTensor(r.weights(), field);
      if (t != nullptr && Elements(*t) < 0) return cost;
    }
  }
  const v1::Tensor& key = r.has_key() ? r.key() : r.query();
  const double batch = r.query().shape_size() == 3 ? Dim(r.query(), 0) : 1;
  const double lq = Dim(r.query(), -2), lk = Dim(key, -2);
  double e_in = Dim(r.query(), -1), heads = 1, hdk = 0, hdv = 0, e_out = 0;
  if (layer != nullptr) {
    heads = layer->num_heads();
    hdk = heads * layer->head_key_dim();
    hdv = heads * layer->head_value_dim();
    e_out = layer->output_dim();
  } else if (r.has_weights()) {
    const v1::AttentionWeights& w = r.weights();
    hdk = w.has_in_proj_weight() ? Dim(w.in_proj_weight(), 1)
                                 : Dim(w.q_proj_weight(), 0);
    hdv = w.has_in_proj_weight() ? hdk : Dim(w.v_proj_weight(), 0);
    e_out = w.has_out_proj_weight() ? Dim(w.out_proj_weight(), 0) : hdv;
    // Heads that do not split the projections fail the call: 2^31 of them
    // must not price it (per-head weights) out of the memory limit first.
    const int kv_heads =
        w.num_kv_heads() > 0 ? w.num_kv_heads() : w.num_heads();
    if (w.num_heads() <= 0 || std::fmod(hdk, w.num_heads()) != 0 ||
        std::fmod(hdv, kv_heads) != 0) {
      return cost;
    }
    heads = w.num_heads();
  }
  const double projections =
      2.0 * batch *
      (lq * e_in * hdk + lk * e_in * (hdk + hdv) + lq * hdv * e_out);
  const int masks = r.has_attn_mask() + r.has_key_padding_mask();
  const double logits =
      EvaluatedLogits(batch * heads, lq, lk, hdk / heads, hdv / heads,
                      masks > 0, r.return_weights());
  cost.flops = projections + AttentionFlops(batch, lq, lk, hdk, hdv, logits);
  const double intermediates =
      batch * (lq * hdk + lk * (hdk + hdv) + 2 * lq * hdv) * 4;
  const double weights = r.return_weights() ? batch * heads * lq * lk * 4 *
                                                  (r.average_weights() ? 2 : 1)
                                            : 0;
  const double written = intermediates + batch * lq * e_out * 4 + weights;
  cost.bytes = static_cast<int64_t>(std::min(written, 9e18));
  double read =
      PresentElements({{r.has_query(), &r.query()},
                       {r.has_key(), &r.key()},
                       {r.has_value(), &r.value()},
                       {r.has_attn_mask(), &r.attn_mask()},
                       {r.has_key_padding_mask(), &r.key_padding_mask()}});
  if (layer == nullptr && r.has_weights()) {
    for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
      const v1::Tensor* t = FindWeightTensor(r.weights(), field);
      if (t != nullptr) read += static_cast<double>(Elements(*t));
    }
  }
  cost.work = Work(read + written / 4, masks * logits, logits);
  cost.largest_tensor =
      std::max({Elements(r.query()), Elements(r.key()), Elements(r.value()),
                Elements(r.attn_mask()), Elements(r.key_padding_mask())});
  return cost;
}

RequestCost CostOf(const v1::SessionStepRequest& r,
                   const DecodeSession* session) {
  RequestCost cost;
  // Each tensor's elements once (a SessionSteps call costs every step); an
  // absent tensor has none.
  const auto present = [](bool has, const v1::Tensor& t) {
    return has ? Elements(t) : int64_t{0};
  };
  const int64_t input = present(r.has_input(), r.input()),
                query = present(r.has_query(), r.query()),
                key = present(r.has_key(), r.key()),
                value = present(r.has_value(), r.value());
  cost.largest_tensor = std::max({input, query, key, value});
  if (session == nullptr) {
    // Not open here: the step takes it up (a file, a hand-over) first. Its
    // output is at least as large as its query (or hidden states), in
    // float32: what the limits can hold it to before the session is known.
    cost.may_wait = true;
    const int64_t leading = std::max<int64_t>({0, input, query});
    cost.bytes = static_cast<int64_t>(
        std::min(4.0 * static_cast<double>(leading), 9e18));
    return cost;
  }
  if (std::min({input, query, key, value}) < 0) return cost;
  const bool model = session->is_model_session();
  const v1::Tensor& leading = model ? r.input() : r.query();
  if (leading.shape_size() < 2) return cost;
  const double n = Dim(leading, -2);
  const double batch = static_cast<double>(session->batch());
  cost.flops = session->StepFlops(static_cast<int64_t>(n), r.layer());
  // The step's projections or converted operands and its output; the
  // cache's growth is the session store's to limit.
  const double width =
      session->num_heads() * (session->key_dim() + 2.0 * session->value_dim());
  cost.bytes = static_cast<int64_t>(std::min(batch * n * width * 4, 9e18));
  // Its tokens appended to the cache, which it then reads whole.
  const double keys = static_cast<double>(session->length(r.layer())) + n;
  const double cache = batch * session->num_kv_heads() *
                       (session->key_dim() + session->value_dim());
  const double read = static_cast<double>(input) + static_cast<double>(query) +
                      static_cast<double>(key) + static_cast<double>(value);
  cost.work = Work(read + batch * n * width + cache * (n + keys), 0,
                   batch * session->num_heads() * n * keys);
  return cost;
}

RequestCost CostOf(
    const v1::SessionStepsRequest& request,
    const std::vector<std::shared_ptr<const DecodeSession>>& sessions) {
  RequestCost cost;
  const int count =
      std::min(request.steps_size(), static_cast<int>(sessions.size()));
  for (int i = 0; i < count; ++i) {
    const RequestCost step = CostOf(request.steps(i), sessions[i].get());
    cost.may_wait = cost.may_wait || step.may_wait;
    // A step not open here was held to the limits alone (and fails alone).
    if (sessions[i] == nullptr) continue;
    cost.flops += step.flops;
    cost.work += step.work;
    cost.bytes = static_cast<int64_t>(std::min(
        static_cast<double>(cost.bytes) + static_cast<double>(step.bytes),
        9e18));
    cost.largest_tensor = std::max(cost.largest_tensor, step.largest_tensor);
  }
  return cost;
}

namespace {

// LayerNorm and RMSNorm: a few passes over the input, which a norm reads
// twice (statistics, then output) and writes once.
RequestCost NormCost(const v1::Tensor& input, double affine_elements) {
  RequestCost cost;
  const int64_t n = std::max<int64_t>(Elements(input), 0);
  cost.flops = 8.0 * n;
  cost.bytes = static_cast<int64_t>(std::min(4.0 * n, 9e18));
  cost.work = Work(2.0 * n + affine_elements, 0, 0);
  cost.largest_tensor = n;
  return cost;
}

}  // namespace

RequestCost CostOf(const v1::LayerNormRequest& r) {
  return NormCost(r.input(), PresentElements({{r.has_gamma(), &r.gamma()},
                                              {r.has_beta(), &r.beta()}}));
}

RequestCost CostOf(const v1::RmsNormRequest& r) {
  return NormCost(r.input(), PresentElements({{r.has_gamma(), &r.gamma()}}));
}

}  // namespace attnserve
