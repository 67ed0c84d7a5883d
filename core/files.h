// Reading whole files.
//
// Thread-safety: free functions without shared state.
#ifndef ATTNSERVE_CORE_FILES_H_
#define ATTNSERVE_CORE_FILES_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve {

// The bytes of the file at `path`. Errors start with `what` (a flag or the
// path itself): NOT_FOUND when it cannot be opened, DATA_LOSS when reading
// fails.
absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             absl::string_view what);

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_FILES_H_
