// Reading and writing the safetensors format (an 8-byte little-endian header
// length, a JSON header naming each tensor's dtype, shape and byte range, then
// the raw little-endian data), so tensors move to and from PyTorch and NumPy
// without code.
//
// Ownership: a SafetensorsFile owns its tensors. Thread-safety: plain values
// and free functions.
#ifndef ATTNSERVE_CORE_SAFETENSORS_H_
#define ATTNSERVE_CORE_SAFETENSORS_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/tensor.h"

namespace attnserve {

struct SafetensorsFile {
  // The header's "__metadata__" entries.
  std::map<std::string, std::string> metadata;
  std::map<std::string, Tensor> tensors;

  // The tensor called `name`, or null.
  const Tensor* Find(absl::string_view name) const;
};

// Parses the bytes of a safetensors file. Errors are INVALID_ARGUMENT and say
// what is wrong, prefixed by `source` (a file name, for instance).
absl::StatusOr<SafetensorsFile> ParseSafetensors(absl::string_view bytes,
                                                 absl::string_view source);
// Reads and parses a file; NOT_FOUND if it cannot be opened.
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

// The safetensors bytes of `tensors` (written in name order) and `metadata`.
absl::StatusOr<std::string> SerializeSafetensors(
    const std::map<std::string, TensorView>& tensors,
    const std::map<std::string, std::string>& metadata);
absl::Status WriteSafetensors(
    const std::string& path, const std::map<std::string, TensorView>& tensors,
    const std::map<std::string, std::string>& metadata);

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_SAFETENSORS_H_
