#include "core/files.h"

#include <fstream>
#include <iterator>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnserve {

absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             absl::string_view what) {
  std::ifstream stream(path, std::ios::binary);
  if (!stream) {
    return absl::NotFoundError(
        absl::StrCat(what, ": cannot open '", path, "' for reading"));
  }
  std::string bytes((std::istreambuf_iterator<char>(stream)),
                    std::istreambuf_iterator<char>());
  if (stream.bad()) {
    return absl::DataLossError(
        absl::StrCat(what, ": reading '", path, "' failed"));
  }
  return bytes;
}

}  // namespace attnserve
