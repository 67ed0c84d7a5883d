// Reading whole files.
//
// Thread-safety: free functions without shared state.
#ifndef ATTNSERVE_CORE_FILES_H_
#define ATTNSERVE_CORE_FILES_H_

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve {

// The bytes of the file at `path`, read to its end: any file that can be
// read, /proc files and pipes included (a pipe blocks until its writer
// closes). Errors start with `what` (a flag or the path itself): NOT_FOUND
// when it cannot be opened, DATA_LOSS when reading fails (a directory
// included).
absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             absl::string_view what);

// How ReadRegularFile bounds what it reads.
struct RegularFileLimits {
  // Largest file read, in bytes; a larger one is refused before any read.
  uint64_t max_bytes = 0;
  // What sets max_bytes, for the refusal, e.g. "--max_model_mb=4096".
  std::string limit_name;
  // If not empty: the canonical path (realpath, no symlinks) of a directory
  // the file must resolve inside. Symlinks are followed, so `path` may be
  // or pass through one, but only to somewhere below this directory.
  std::string within;
};

// The bytes of the regular file at `path`, for files that others can write
// (a model repository): it cannot block or read without bound. The file is
// checked (stat) before it is opened, so that no FIFO or device is even
// opened; opened with O_NONBLOCK, and checked again on the descriptor
// (fstat), so that a swap in between is caught; then exactly its size at
// that moment is read, so a file growing meanwhile changes nothing. Errors
// start with `path`:
//   NOT_FOUND            it does not exist, or is a dangling symlink
//                        ("cannot open: No such file or directory")
//   FAILED_PRECONDITION  not a regular file ("is a FIFO, not a regular
//                        file"), larger than `limits.max_bytes` (naming
//                        `limits.limit_name`), resolving outside
//                        `limits.within`, or not readable by this process
//   DATA_LOSS            reading failed, or the file shrank while read
//   RESOURCE_EXHAUSTED   its size cannot be allocated
absl::StatusOr<std::string> ReadRegularFile(const std::string& path,
                                            const RegularFileLimits& limits);

// A regular file opened and checked as ReadRegularFile checks it, to be
// read piece by piece (a large file without a buffer of its size).
// Ownership: owns its descriptor. Thread-safety: ReadAt may be called from
// any thread.
class OpenedFile {
 public:
  OpenedFile(int fd, uint64_t size, std::string path)
      : fd_(fd), size_(size), path_(std::move(path)) {}
  OpenedFile(OpenedFile&& other) noexcept
      : fd_(std::exchange(other.fd_, -1)),
        size_(other.size_),
        path_(std::move(other.path_)) {}
  OpenedFile& operator=(OpenedFile&&) = delete;
  ~OpenedFile();
  // Its size when it was checked.
  uint64_t size() const { return size_; }
  // Reads `n` bytes at `offset` into `out`: DATA_LOSS naming the path when
  // reading fails or the file ends before them (it shrank).
  absl::Status ReadAt(uint64_t offset, size_t n, char* out) const;

 private:
  int fd_;
  uint64_t size_;
  std::string path_;
};
absl::StatusOr<OpenedFile> OpenRegularFile(const std::string& path,
                                           const RegularFileLimits& limits);

// The canonical path of `path` (realpath: absolute, no symlinks, no "."
// or ".."), or an error naming `path` as ReadRegularFile's.
absl::StatusOr<std::string> CanonicalPath(const std::string& path);

// OK if the canonical path `resolved` (what `path` resolves to) lies
// strictly below the canonical directory `within`; otherwise
// FAILED_PRECONDITION naming `path`, where it leads and `within`.
absl::Status VerifyResolvesWithin(const std::string& path,
                                  const std::string& resolved,
                                  const std::string& within);

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_FILES_H_
