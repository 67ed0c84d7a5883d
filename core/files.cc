#include "core/files.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <ios>
#include <iterator>
#include <new>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "core/verify.h"

namespace attnserve {
namespace {

// An open file descriptor, closed with the object.
class Descriptor {
 public:
  explicit Descriptor(int fd) : fd_(fd) {}
  ~Descriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// `path` could not be resolved, stat'ed or opened: errno `error`. All say
// "cannot open", as the callers' users see it.
absl::Status CannotOpen(const std::string& path, int error) {
  const std::string message =
      absl::StrCat(path, ": cannot open: ", std::strerror(error));
  if (error == ENOENT || error == ENOTDIR) {
    return absl::NotFoundError(message);
  }
  // EACCES, ELOOP, ...: the file is there but this process cannot use it.
  // Only whoever writes the files can fix that, so not PERMISSION_DENIED,
  // which would tell a caller that it lacks a right.
  return absl::FailedPreconditionError(message);
}

const char* KindOf(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symlink";
  return "of an unknown kind";
}

absl::Status VerifyRegular(const std::string& path, const struct stat& st) {
  if (S_ISREG(st.st_mode)) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(path, ": is ", KindOf(st.st_mode), ", not a regular file"));
}

absl::Status VerifySize(const std::string& path, const struct stat& st,
                        const RegularFileLimits& limits) {
  if (static_cast<uint64_t>(st.st_size) <= limits.max_bytes) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat(path, ": ", st.st_size, " bytes, more than the ",
                   limits.max_bytes, " bytes ", limits.limit_name, " allows"));
}

// What to open for `path`: the path itself, or with `limits.within` its
// canonical path once that is known to lie within.
absl::StatusOr<std::string> Target(const std::string& path,
                                   const RegularFileLimits& limits) {
  if (limits.within.empty()) return path;
  ATTN_ASSIGN_OR_RETURN(std::string resolved, CanonicalPath(path));
  ATTN_RETURN_IF_ERROR(VerifyResolvesWithin(path, resolved, limits.within));
  return resolved;
}

// The file opened as `fd` still lies within `limits.within`: a folder on
// the way may have been replaced by a symlink between the check of the
// path and the open. /proc/self/fd names the file actually opened; without
// /proc the check before the open stands alone.
absl::Status VerifyOpenedWithin(const std::string& path, int fd,
                                const RegularFileLimits& limits) {
  if (limits.within.empty()) return absl::OkStatus();
  char opened[PATH_MAX];
  const std::string link = absl::StrCat("/proc/self/fd/", fd);
  const ssize_t length = ::readlink(link.c_str(), opened, sizeof(opened));
  if (length <= 0 || static_cast<size_t>(length) >= sizeof(opened)) {
    return absl::OkStatus();
  }
  return VerifyResolvesWithin(path, std::string(opened, length), limits.within);
}

}  // namespace

absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             absl::string_view what) {
  std::ifstream stream(path, std::ios::binary);
  if (!stream) {
    return absl::NotFoundError(
        absl::StrCat(what, ": cannot open '", path, "' for reading"));
  }
  // libstdc++ throws from the read when read(2) fails (a directory opens
  // fine, then fails with EISDIR): an exception escaping to gRPC would
  // answer UNIMPLEMENTED with no message, or end the process.
  try {
    std::string bytes((std::istreambuf_iterator<char>(stream)),
                      std::istreambuf_iterator<char>());
    if (!stream.bad()) return bytes;
  } catch (const std::ios_base::failure& e) {
    return absl::DataLossError(absl::StrCat(what, ": reading '", path,
                                            "' failed: ", e.code().message()));
  }
  return absl::DataLossError(
      absl::StrCat(what, ": reading '", path, "' failed"));
}

OpenedFile::~OpenedFile() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status OpenedFile::ReadAt(uint64_t offset, size_t n, char* out) const {
  size_t done = 0;
  while (done < n) {
    const ssize_t got =
        ::pread(fd_, out + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      return absl::DataLossError(
          absl::StrCat(path_, ": reading failed: ", std::strerror(errno)));
    }
    if (got == 0) {
      return absl::DataLossError(
          absl::StrCat(path_, ": shrank while being read (", offset + done,
                       " bytes read of ", size_, ")"));
    }
    done += static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

absl::StatusOr<OpenedFile> OpenRegularFile(const std::string& path,
                                           const RegularFileLimits& limits) {
  ATTN_ASSIGN_OR_RETURN(const std::string target, Target(path, limits));
  // Checked before the open, so that no FIFO or device is even opened
  // (opening some devices acts on them).
  struct stat st;
  if (::stat(target.c_str(), &st) != 0) return CannotOpen(path, errno);
  ATTN_RETURN_IF_ERROR(VerifyRegular(path, st));
  // O_NONBLOCK: should a FIFO have taken the file's place since, the open
  // returns at once instead of waiting for a writer (reads of a regular
  // file ignore it). O_NOFOLLOW: `target` was resolved, so a symlink there
  // now is a swap.
  int flags = O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY;
  if (!limits.within.empty()) flags |= O_NOFOLLOW;
  Descriptor fd(::open(target.c_str(), flags));
  if (fd.get() < 0) return CannotOpen(path, errno);
  // The descriptor's file is what is read: checked again, on it.
  if (::fstat(fd.get(), &st) != 0) return CannotOpen(path, errno);
  ATTN_RETURN_IF_ERROR(VerifyRegular(path, st));
  ATTN_RETURN_IF_ERROR(VerifyOpenedWithin(path, fd.get(), limits));
  ATTN_RETURN_IF_ERROR(VerifySize(path, st, limits));
  return OpenedFile(fd.release(), static_cast<uint64_t>(st.st_size), path);
}

absl::StatusOr<std::string> ReadRegularFile(const std::string& path,
                                            const RegularFileLimits& limits) {
  ATTN_ASSIGN_OR_RETURN(const OpenedFile file, OpenRegularFile(path, limits));
  // Exactly the size checked: a file that grows meanwhile is cut there, one
  // that shrinks is an error.
  std::string bytes;
  try {
    bytes.resize(file.size());
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(path, ": ", file.size(), " bytes do not fit in memory"));
  }
  ATTN_RETURN_IF_ERROR(file.ReadAt(0, bytes.size(), bytes.data()));
  return bytes;
}

absl::StatusOr<std::string> CanonicalPath(const std::string& path) {
  char* resolved = ::realpath(path.c_str(), nullptr);
  if (resolved == nullptr) return CannotOpen(path, errno);
  std::string canonical(resolved);
  std::free(resolved);
  return canonical;
}

absl::Status VerifyResolvesWithin(const std::string& path,
                                  const std::string& resolved,
                                  const std::string& within) {
  const std::string prefix =
      absl::EndsWith(within, "/") ? within : absl::StrCat(within, "/");
  // Strictly below: `within` itself is no file or folder in it.
  if (resolved.size() > prefix.size() && absl::StartsWith(resolved, prefix)) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat(path, ": resolves to ", EchoString(resolved), ", outside ",
                   EchoString(within), " (symlinks may lead only within it)"));
}

}  // namespace attnserve
