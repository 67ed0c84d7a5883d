#include "tests/reference.h"

#include <cmath>
#include <limits>

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
      double max_logit = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < lk; ++j) {
        if (!excluded[j]) max_logit = std::max(max_logit, logits[j]);
      }
      if (std::isinf(max_logit)) continue;  // nothing left: zeros
      double sum = 0;
      for (int64_t j = 0; j < lk; ++j) {
        if (!excluded[j]) sum += std::exp(logits[j] - max_logit);
      }
      for (int64_t j = 0; j < lk; ++j) {
        const double p =
            excluded[j] ? 0.0 : std::exp(logits[j] - max_logit) / sum;
        r.weights.values[(n * lq + i) * lk + j] = p;
        for (int64_t c = 0; c < dv; ++c) {
          r.output.values[(n * lq + i) * dv + c] +=
              p * v.values[(n * lk + j) * dv + c];
        }
      }
    }
  }
  return r;
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

RefTensor RefLayerNorm(const RefTensor& x,
                       const std::optional<RefTensor>& gamma,
                       const std::optional<RefTensor>& beta, double eps,
                       int normalized_ndim) {
  int64_t cols = 1;
  for (size_t d = x.shape.size() - normalized_ndim; d < x.shape.size(); ++d) {
    cols *= x.shape[d];
  }
  const int64_t rows =
      cols == 0 ? 0 : static_cast<int64_t>(x.values.size()) / cols;
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

}  // namespace attnserve::testing
