#include "tests/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "core/convert.h"

namespace attnserve::testing {

RefTensor ToRef(const TensorView& view) {
  RefTensor ref;
  ref.shape = view.shape;
  const int64_t n = view.num_elements();
  ref.values.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    switch (view.dtype) {
      case DType::kFloat32:
        ref.values[i] = view.data_as<float>()[i];
        break;
      case DType::kBFloat16:
        ref.values[i] = BFloat16ToFloat(view.data_as<uint16_t>()[i]);
        break;
      case DType::kFloat16:
        ref.values[i] = Float16ToFloat(view.data_as<uint16_t>()[i]);
        break;
      case DType::kBool:
      case DType::kUInt8:
        ref.values[i] = view.data_as<uint8_t>()[i];
        break;
      case DType::kInt8:
        ref.values[i] = view.data_as<int8_t>()[i];
        break;
    }
  }
  return ref;
}

namespace {

// Flat index into `t` of the element at `index` of a larger shape `full`
// that `t` broadcasts to (right-aligned).
int64_t BroadcastIndex(const RefTensor& t, const std::vector<int64_t>& index,
                       const Shape& full) {
  const size_t lead = full.size() - t.shape.size();
  int64_t flat = 0;
  for (size_t d = 0; d < t.shape.size(); ++d) {
    const int64_t i = t.shape[d] == 1 ? 0 : index[lead + d];
    flat = flat * t.shape[d] + i;
  }
  return flat;
}

}  // namespace

RefAttentionResult RefAttend(const RefTensor& q, const RefTensor& k,
                             const RefTensor& v,
                             const std::vector<RefTensor>& masks,
                             const std::vector<bool>& mask_is_keep,
                             const RefAttentionOptions& options) {
  const size_t rank = q.shape.size();
  const int64_t lq = q.shape[rank - 2], dk = q.shape[rank - 1];
  const int64_t lk = k.shape[rank - 2], dv = v.shape[rank - 1];
  int64_t batch = 1;
  for (size_t d = 0; d + 2 < rank; ++d) batch *= q.shape[d];
  const double scale = options.scale.value_or(1.0 / std::sqrt(double(dk)));
  const double temperature = options.temperature.value_or(1.0);

  Shape logits_shape(q.shape.begin(), q.shape.end() - 2);
  logits_shape.push_back(lq);
  logits_shape.push_back(lk);
  RefAttentionResult r;
  r.weights.shape = logits_shape;
  r.weights.values.assign(batch * lq * lk, 0.0);
  r.output.shape = Shape(q.shape.begin(), q.shape.end() - 1);
  r.output.shape.push_back(dv);
  r.output.values.assign(batch * lq * dv, 0.0);

  std::vector<int64_t> index(rank);
  for (int64_t n = 0; n < batch; ++n) {
    int64_t rest = n;
    for (int64_t d = static_cast<int64_t>(rank) - 3; d >= 0; --d) {
      index[d] = rest % q.shape[d];
      rest /= q.shape[d];
    }
    for (int64_t i = 0; i < lq; ++i) {
      std::vector<double> logits(lk);
      std::vector<bool> excluded(lk, false);
      for (int64_t j = 0; j < lk; ++j) {
        double dot = 0;
        for (int64_t c = 0; c < dk; ++c) {
          dot +=
              q.values[(n * lq + i) * dk + c] * k.values[(n * lk + j) * dk + c];
        }
        logits[j] = dot * scale / temperature;
        index[rank - 2] = i;
        index[rank - 1] = j;
        for (size_t m = 0; m < masks.size(); ++m) {
          const double mv =
              masks[m].values[BroadcastIndex(masks[m], index, logits_shape)];
          if (mask_is_keep[m]) {
            if (mv == 0) excluded[j] = true;
          } else if (std::isinf(mv)) {
            excluded[j] = true;
          } else {
            logits[j] += mv;
          }
        }
        if (options.causal && j > i) excluded[j] = true;
      }
      // The maximum of the kept logits; a NaN among them makes the row NaN
      // (exp(x - NaN) is NaN everywhere), as a +inf max does through
      // exp(inf - inf).
      bool has_nan = false;
      double max_logit = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < lk; ++j) {
        if (excluded[j]) continue;
        if (std::isnan(logits[j])) {
          has_nan = true;
        } else {
          max_logit = std::max(max_logit, logits[j]);
        }
      }
      if (!has_nan && max_logit == -std::numeric_limits<double>::infinity()) {
        continue;  // nothing left: zeros
      }
      if (has_nan) max_logit = std::numeric_limits<double>::quiet_NaN();
      double sum = 0;
      for (int64_t j = 0; j < lk; ++j) {
        if (!excluded[j]) sum += std::exp(logits[j] - max_logit);
      }
      for (int64_t j = 0; j < lk; ++j) {
        // 0 / sum: 0, or NaN in a NaN row.
        const double p =
            excluded[j] ? 0.0 / sum : std::exp(logits[j] - max_logit) / sum;
        r.weights.values[(n * lq + i) * lk + j] = p;
        if (excluded[j]) continue;  // its value row is not read
        for (int64_t c = 0; c < dv; ++c) {
          r.output.values[(n * lq + i) * dv + c] +=
              p * v.values[(n * lk + j) * dv + c];
        }
      }
    }
  }
  return r;
}

namespace {

// [B, L, H*d] -> [B, H, L, d].
RefTensor SplitHeads(const RefTensor& x, int64_t heads) {
  const int64_t b = x.shape[0], l = x.shape[1], d = x.shape[2] / heads;
  RefTensor y{{b, heads, l, d}, std::vector<double>(x.values.size())};
  for (int64_t i = 0; i < b; ++i)
    for (int64_t t = 0; t < l; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t c = 0; c < d; ++c)
          y.values[((i * heads + h) * l + t) * d + c] =
              x.values[((i * l + t) * heads + h) * d + c];
  return y;
}

// [B, H, L, d] -> [B, L, H*d].
RefTensor MergeHeads(const RefTensor& x) {
  const int64_t b = x.shape[0], heads = x.shape[1], l = x.shape[2],
                d = x.shape[3];
  RefTensor y{{b, l, heads * d}, std::vector<double>(x.values.size())};
  for (int64_t i = 0; i < b; ++i)
    for (int64_t t = 0; t < l; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t c = 0; c < d; ++c)
          y.values[((i * l + t) * heads + h) * d + c] =
              x.values[((i * heads + h) * l + t) * d + c];
  return y;
}

// Rows [i * rows, (i + 1) * rows) of a 2-D [k * rows, cols] tensor, or
// elements [i * rows, (i + 1) * rows) of a 1-D one: a third of PyTorch's
// fused in_proj_weight and in_proj_bias.
RefTensor Part(const RefTensor& t, int i, int64_t rows) {
  const int64_t cols = t.shape.size() == 2 ? t.shape[1] : 1;
  RefTensor part;
  part.shape = t.shape.size() == 2 ? Shape{rows, cols} : Shape{rows};
  part.values.assign(t.values.begin() + i * rows * cols,
                     t.values.begin() + (i + 1) * rows * cols);
  return part;
}

}  // namespace

std::optional<RefTensor>* RefMultiHeadWeights::Field(absl::string_view name) {
  const std::pair<absl::string_view, std::optional<RefTensor>*> fields[] = {
      {"q_proj_weight", &q_proj_weight},
      {"k_proj_weight", &k_proj_weight},
      {"v_proj_weight", &v_proj_weight},
      {"in_proj_weight", &in_proj_weight},
      {"q_proj_bias", &q_proj_bias},
      {"k_proj_bias", &k_proj_bias},
      {"v_proj_bias", &v_proj_bias},
      {"in_proj_bias", &in_proj_bias},
      {"out_proj_weight", &out_proj_weight},
      {"out_proj_bias", &out_proj_bias}};
  for (const auto& [field_name, field] : fields) {
    if (field_name == name) return field;
  }
  return nullptr;
}

RefAttentionResult RefMultiHeadAttend(
    const RefMultiHeadWeights& w, const RefTensor& query, const RefTensor& key,
    const RefTensor& value, const std::vector<RefTensor>& masks,
    const std::vector<bool>& mask_is_keep, const RefAttentionOptions& options) {
  RefTensor pq, pk, pv;
  if (w.in_proj_weight) {
    const int64_t e = w.in_proj_weight->shape[1];
    const RefTensor* inputs[] = {&query, &key, &value};
    RefTensor* outputs[] = {&pq, &pk, &pv};
    for (int i = 0; i < 3; ++i) {
      std::optional<RefTensor> bias;
      if (w.in_proj_bias) bias = Part(*w.in_proj_bias, i, e);
      *outputs[i] = RefLinear(*inputs[i], Part(*w.in_proj_weight, i, e), bias);
    }
  } else {
    std::optional<RefTensor> bq = w.q_proj_bias, bk = w.k_proj_bias,
                             bv = w.v_proj_bias;
    if (w.in_proj_bias) {  // one [3E] bias for separate weights
      bq = Part(*w.in_proj_bias, 0, w.q_proj_weight->shape[0]);
      bk = Part(*w.in_proj_bias, 1, w.k_proj_weight->shape[0]);
      bv = Part(*w.in_proj_bias, 2, w.v_proj_weight->shape[0]);
    }
    pq = RefLinear(query, *w.q_proj_weight, bq);
    pk = RefLinear(key, *w.k_proj_weight, bk);
    pv = RefLinear(value, *w.v_proj_weight, bv);
  }
  const int64_t h = w.num_heads;
  const int64_t kv_heads = w.num_kv_heads == 0 ? h : w.num_kv_heads;
  RefTensor q = SplitHeads(pq, h), k = SplitHeads(pk, kv_heads);
  if (w.rotary_dims > 0) {
    q = RefRotary(q, w.rotary_dims, w.rotary_base, 0);
    k = RefRotary(k, w.rotary_dims, w.rotary_base, 0);
  }
  RefAttentionResult r =
      RefAttend(q, RefRepeatHeads(k, h / kv_heads),
                RefRepeatHeads(SplitHeads(pv, kv_heads), h / kv_heads), masks,
                mask_is_keep, options);
  r.output = MergeHeads(r.output);
  if (w.out_proj_weight) {
    r.output = RefLinear(r.output, *w.out_proj_weight, w.out_proj_bias);
  }
  return r;
}

RefTensor RefRotary(const RefTensor& x, int64_t dims, double base,
                    int64_t first_position) {
  RefTensor y = x;
  const int64_t d = x.shape.back();
  const int64_t len = x.shape[x.shape.size() - 2];
  const int64_t rows = static_cast<int64_t>(x.values.size()) / d;
  const int64_t half = dims / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const double pos = static_cast<double>(first_position + r % len);
    for (int64_t i = 0; i < half; ++i) {
      const double angle = pos * std::pow(base, -2.0 * i / dims);
      const double x1 = x.values[r * d + i], x2 = x.values[r * d + half + i];
      y.values[r * d + i] = x1 * std::cos(angle) - x2 * std::sin(angle);
      y.values[r * d + half + i] = x2 * std::cos(angle) + x1 * std::sin(angle);
    }
  }
  return y;
}

RefTensor RefRepeatHeads(const RefTensor& x, int64_t group) {
  const int64_t b = x.shape[0], heads = x.shape[1];
  const int64_t plane = x.shape[2] * x.shape[3];
  RefTensor y{{b, heads * group, x.shape[2], x.shape[3]}, {}};
  y.values.reserve(x.values.size() * group);
  for (int64_t i = 0; i < b; ++i)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t g = 0; g < group; ++g)
        y.values.insert(y.values.end(),
                        x.values.begin() + (i * heads + h) * plane,
                        x.values.begin() + (i * heads + h + 1) * plane);
  return y;
}

RefTensor RefRows(const RefTensor& t, int64_t first, int64_t n) {
  const int64_t len = t.shape[t.shape.size() - 2];
  const int64_t d = t.shape.back();
  RefTensor out{t.shape, {}};
  out.shape[out.shape.size() - 2] = n;
  const int64_t planes = static_cast<int64_t>(t.values.size()) / (len * d);
  for (int64_t p = 0; p < planes; ++p) {
    const auto begin = t.values.begin() + (p * len + first) * d;
    out.values.insert(out.values.end(), begin, begin + n * d);
  }
  return out;
}

RefTensor RefConcatRows(const RefTensor& a, const RefTensor& b) {
  if (a.values.empty()) return b;
  const int64_t la = a.shape[a.shape.size() - 2];
  const int64_t lb = b.shape[b.shape.size() - 2];
  const int64_t d = a.shape.back();
  RefTensor out{a.shape, {}};
  out.shape[out.shape.size() - 2] = la + lb;
  const int64_t planes = static_cast<int64_t>(a.values.size()) / (la * d);
  for (int64_t p = 0; p < planes; ++p) {
    out.values.insert(out.values.end(), a.values.begin() + p * la * d,
                      a.values.begin() + (p + 1) * la * d);
    out.values.insert(out.values.end(), b.values.begin() + p * lb * d,
                      b.values.begin() + (p + 1) * lb * d);
  }
  return out;
}

RefTensor RefCausalKeep(int64_t first, int64_t n) {
  RefTensor keep{{n, first + n}, {}};
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < first + n; ++j)
      keep.values.push_back(j <= first + i ? 1.0 : 0.0);
  return keep;
}

RefTensor RefLinear(const RefTensor& x, const RefTensor& w,
                    const std::optional<RefTensor>& b) {
  const int64_t out = w.shape[0], in = w.shape[1];
  const int64_t rows = static_cast<int64_t>(x.values.size()) / in;
  RefTensor y;
  y.shape = x.shape;
  y.shape.back() = out;
  y.values.assign(rows * out, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = b ? b->values[o] : 0.0;
      for (int64_t c = 0; c < in; ++c)
        acc += x.values[r * in + c] * w.values[o * in + c];
      y.values[r * out + o] = acc;
    }
  }
  return y;
}

namespace {

// A normalization's rows and the elements of each (the trailing
// `normalized_ndim` dims).
std::pair<int64_t, int64_t> RowsAndCols(const RefTensor& x,
                                        int normalized_ndim) {
  int64_t cols = 1;
  for (size_t d = x.shape.size() - normalized_ndim; d < x.shape.size(); ++d) {
    cols *= x.shape[d];
  }
  const int64_t rows =
      cols == 0 ? 0 : static_cast<int64_t>(x.values.size()) / cols;
  return {rows, cols};
}

}  // namespace

RefTensor RefLayerNorm(const RefTensor& x,
                       const std::optional<RefTensor>& gamma,
                       const std::optional<RefTensor>& beta, double eps,
                       int normalized_ndim) {
  const auto [rows, cols] = RowsAndCols(x, normalized_ndim);
  RefTensor y = x;
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t c = 0; c < cols; ++c) mean += x.values[r * cols + c];
    mean /= cols;
    for (int64_t c = 0; c < cols; ++c) {
      const double d = x.values[r * cols + c] - mean;
      var += d * d;
    }
    var /= cols;
    for (int64_t c = 0; c < cols; ++c) {
      double v = (x.values[r * cols + c] - mean) / std::sqrt(var + eps);
      if (gamma) v *= gamma->values[c];
      if (beta) v += beta->values[c];
      y.values[r * cols + c] = v;
    }
  }
  return y;
}

RefTensor RefRmsNorm(const RefTensor& x, const std::optional<RefTensor>& gamma,
                     double eps, int normalized_ndim) {
  const auto [rows, cols] = RowsAndCols(x, normalized_ndim);
  RefTensor y = x;
  for (int64_t r = 0; r < rows; ++r) {
    double mean_square = 0;
    for (int64_t c = 0; c < cols; ++c) {
      mean_square += x.values[r * cols + c] * x.values[r * cols + c];
    }
    mean_square /= cols;
    for (int64_t c = 0; c < cols; ++c) {
      double v = x.values[r * cols + c] / std::sqrt(mean_square + eps);
      if (gamma) v *= gamma->values[c];
      y.values[r * cols + c] = v;
    }
  }
  return y;
}

}  // namespace attnserve::testing
