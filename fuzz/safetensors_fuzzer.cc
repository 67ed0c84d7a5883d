// Fuzz target: any bytes as a safetensors file (ParseSafetensors). What
// parses must serialize and parse back to the same tensors and metadata.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "absl/strings/string_view.h"
#include "core/safetensors.h"
#include "fuzz/fuzz_support.h"

namespace attnserve::fuzz {
namespace {

[[noreturn]] void Fail(const char* problem) {
  std::fprintf(stderr, "fuzz: safetensors round trip: %s\n", problem);
  std::abort();
}

bool SameTensor(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (a.num_bytes() == 0 ||
          std::memcmp(a.data(), b.data(), a.num_bytes()) == 0);
}

}  // namespace
}  // namespace attnserve::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;        // NOLINT: one function
  using namespace attnserve::fuzz;  // NOLINT
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(bytes, "input");
  CheckStatus("ParseSafetensors", file.status());
  if (!file.ok()) return 0;
  std::map<std::string, TensorView> views;
  for (const auto& [name, tensor] : file->tensors) {
    views.emplace(name, tensor.view());
  }
  absl::StatusOr<std::string> written =
      SerializeSafetensors(views, file->metadata);
  if (!written.ok()) Fail(std::string(written.status().message()).c_str());
  absl::StatusOr<SafetensorsFile> again = ParseSafetensors(*written, "copy");
  if (!again.ok()) Fail(std::string(again.status().message()).c_str());
  if (again->metadata != file->metadata) Fail("metadata differs");
  if (again->tensors.size() != file->tensors.size()) Fail("tensors differ");
  for (const auto& [name, tensor] : file->tensors) {
    const Tensor* copy = again->Find(name);
    if (copy == nullptr || !SameTensor(tensor, *copy)) {
      Fail(("tensor differs: " + name).c_str());
    }
  }
  return 0;
}
