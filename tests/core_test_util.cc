#include "tests/core_test_util.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "core/convert.h"

namespace attnserve::testing {

Tensor RandomTensor(DType dtype, Shape shape, std::mt19937& rng, double keep) {
  Tensor t = *Tensor::Allocate(dtype, std::move(shape));
  const int64_t n = t.num_elements();
  if (dtype == DType::kBool || dtype == DType::kUInt8) {
    std::bernoulli_distribution coin(keep);
    for (int64_t i = 0; i < n; ++i) t.data_as<uint8_t>()[i] = coin(rng) ? 1 : 0;
    return t;
  }
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = uniform(rng);
  StoreFloat32(values.data(), n, dtype, t.data());
  return t;
}

Tolerance ToleranceFor(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return kBFloat16Tolerance;
    case DType::kFloat16:
      return kFloat16Tolerance;
    default:
      return kFloat32Tolerance;
  }
}

::testing::AssertionResult AllClose(const TensorView& got,
                                    const RefTensor& expected, Tolerance tol) {
  if (got.shape != expected.shape) {
    return ::testing::AssertionFailure()
           << "shape " << ShapeString(got.shape) << " != expected "
           << ShapeString(expected.shape);
  }
  const RefTensor actual = ToRef(got);
  int64_t bad = 0, worst = -1;
  double worst_excess = 0;
  for (size_t i = 0; i < actual.values.size(); ++i) {
    const double a = actual.values[i], e = expected.values[i];
    // An expected NaN or infinity is matched exactly (the non-finite rule).
    const bool finite = std::isfinite(e);
    const bool same = std::isnan(e) ? std::isnan(a) : a == e;
    const double allowed = finite ? tol.atol + tol.rtol * std::abs(e) : 0;
    const double diff = finite ? std::abs(a - e) : (same ? 0 : NAN);
    if (!(diff <= allowed)) {  // NaN fails too
      ++bad;
      const double excess = std::isnan(diff) ? INFINITY : diff - allowed;
      if (worst < 0 || excess > worst_excess) {
        worst = static_cast<int64_t>(i);
        worst_excess = excess;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << actual.values.size()
         << " elements out of tolerance; worst at flat index " << worst
         << ": got " << actual.values[worst] << ", expected "
         << expected.values[worst];
}

std::string GoldensDir() { return ATTNSERVE_GOLDENS_DIR; }

std::vector<std::string> GoldenFiles() {
  std::vector<std::string> files;
  std::error_code error;
  for (const auto& entry :
       std::filesystem::directory_iterator(GoldensDir(), error)) {
    if (entry.path().extension() == ".safetensors") {
      files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace attnserve::testing
