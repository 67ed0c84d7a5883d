// Helpers for the suites of the core: random tensors, comparisons against the
// float64 reference, tables of cases and the golden files. They need only
// attnserve::core.
#ifndef ATTNSERVE_TESTS_CORE_TEST_UTIL_H_
#define ATTNSERVE_TESTS_CORE_TEST_UTIL_H_

#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/safetensors.h"
#include "core/tensor.h"
#include "gtest/gtest.h"
#include "tests/reference.h"

// Defined in builds with AddressSanitizer or ThreadSanitizer (GCC's macros,
// clang's __has_feature), whose allocators keep freed memory resident
// (quarantine): tests of resident memory skip there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define ATTNSERVE_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define ATTNSERVE_SANITIZED 1
#endif
#endif

namespace attnserve::testing {

// Floating tensors uniform in [-1, 1); BOOL/UINT8 tensors 1 with
// probability `keep`.
Tensor RandomTensor(DType dtype, Shape shape, std::mt19937& rng,
                    double keep = 0.7);

// Tolerances of the golden README: f32 1e-4 + 1e-4*|expected|, bf16 2e-2.
struct Tolerance {
  double atol;
  double rtol;
};
inline constexpr Tolerance kFloat32Tolerance{1e-4, 1e-4};
inline constexpr Tolerance kBFloat16Tolerance{2e-2, 2e-2};
inline constexpr Tolerance kFloat16Tolerance{5e-3, 5e-3};
// INT8 caches (the session's dtype INT8): quantization errors of up to
// max|row| / 254 per cached element.
inline constexpr Tolerance kInt8Tolerance{2e-2, 2e-2};
Tolerance ToleranceFor(DType dtype);

// Passes if shapes match, every |got - expected| <= atol + rtol*|expected|,
// and `got` is NaN exactly where `expected` is and has the same infinity
// where `expected` has one; otherwise says how many elements differ and
// where the worst one is.
::testing::AssertionResult AllClose(const TensorView& got,
                                    const RefTensor& expected, Tolerance tol);

namespace internal {
template <typename Member>
struct EditedCase;
template <typename Lambda, typename C>
struct EditedCase<void (Lambda::*)(C&) const> {
  using type = C;
};
}  // namespace internal

// An entry of a table of parameterized cases: the case struct that `edit`
// takes (a `name` member and defaults for the rest), named `name` and then
// changed by `edit`, as in Case("gqa", [](SessionCase& c) { c.kv_heads = 2; }).
template <typename Edit>
auto Case(std::string name, Edit edit) {
  typename internal::EditedCase<decltype(&Edit::operator())>::type c;
  c.name = std::move(name);
  edit(c);
  return c;
}

// The golden folder that every golden suite needs (ATTNSERVE_GOLDENS_DIR,
// by default the committed tests/goldens) and the *.safetensors files of
// `dir`, sorted. Empty if the folder is missing.
std::string GoldensDir();
std::vector<std::string> GoldenFiles(const std::string& dir = GoldensDir());
// The files of an extra set that the golden suites also run when its folder
// (ATTNSERVE_SHARED_GOLDENS_DIR, by default ../shared/goldens beside the
// checkout) is there: empty when it is missing, or is GoldensDir() itself,
// so that a checkout alone passes and no set runs twice.
std::vector<std::string> SharedGoldenFiles();
// A test name for a golden file: its stem, other characters than letters
// and digits as '_'.
std::string GoldenCaseName(const ::testing::TestParamInfo<std::string>& info);

// Results by name: "output" and, where asked for, "weights".
using NamedResults = std::map<std::string, Tensor>;
// A golden case run through the core directly, its operation and options
// read from the file's metadata (op, causal, scale, temperature, num_heads,
// eps, normalized_ndim); "weights" when the file expects them.
absl::StatusOr<NamedResults> RunGoldenThroughCore(const SafetensorsFile& file);
// Expects `results` to be the file's expected_output (in the dtype of its
// query or input) and expected_weights (float32), within the goldens'
// tolerance: bf16 for files whose metadata says dtype bf16.
void ExpectMatchesGolden(const SafetensorsFile& file,
                         const NamedResults& results);

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_CORE_TEST_UTIL_H_
