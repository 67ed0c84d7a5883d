#include "core/session_directory.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/checksum.h"
#include "core/files.h"
#include "core/status_macros.h"
#include "core/verify.h"

namespace attnserve {
namespace {

constexpr absl::string_view kHeldSuffix = ".held";
// Longest holder address read back.
constexpr uint64_t kMaxHolderBytes = 1024;
constexpr absl::string_view kQuarantine = "quarantine";

absl::Status ErrnoError(absl::string_view what, int error) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  return error == ENOSPC || error == EDQUOT
             ? absl::ResourceExhaustedError(message)
             : absl::FailedPreconditionError(message);
}

// Writes all of `bytes` to `fd`.
absl::Status WriteAll(int fd, absl::string_view bytes, absl::string_view path) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return ErrnoError(absl::StrCat("cannot write ", path), errno);
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

// Whether the open file `fd` is still the one named `path` (not one another
// process has renamed into its place since).
bool IsFileAt(int fd, const std::string& path) {
  struct stat open_file, named;
  return ::fstat(fd, &open_file) == 0 && ::stat(path.c_str(), &named) == 0 &&
         open_file.st_ino == named.st_ino && open_file.st_dev == named.st_dev;
}

// Whether a load's error marks the file itself as bad (hostile or
// corrupt), rather than this process's state (a model not served, a full
// budget).
bool FileIsBad(const absl::Status& status) {
  return absl::IsDataLoss(status) || absl::IsInvalidArgument(status);
}

SessionDirectory::Inode InodeOf(const struct stat& info) {
  return {static_cast<uint64_t>(info.st_dev),
          static_cast<uint64_t>(info.st_ino)};
}

int64_t ModifiedNanos(const struct stat& info) {
  return absl::ToUnixNanos(absl::TimeFromTimespec(info.st_mtim));
}

// Base files remembered for linking, at most.
constexpr size_t kMaxKnownBases = 4096;

// The whole of `file`, or the error it was opened with.
absl::StatusOr<std::string> ReadWhole(const absl::StatusOr<OpenedFile>& file) {
  ATTN_RETURN_IF_ERROR(file.status());
  std::string bytes(file->size(), '\0');
  ATTN_RETURN_IF_ERROR(file->ReadAt(0, bytes.size(), bytes.data()));
  return bytes;
}

}  // namespace

bool SessionDirectory::IsStorableId(absl::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

absl::StatusOr<std::unique_ptr<SessionDirectory>> SessionDirectory::Open(
    const Options& options) {
  const std::string& path = options.path;
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoError(absl::StrCat("--session_dir ", path, ": cannot create"),
                      errno);
  }
  ATTN_ASSIGN_OR_RETURN(std::string canonical, CanonicalPath(path));
  struct stat info;
  if (::stat(canonical.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--session_dir ", path, ": not a directory"));
  }
  const std::string quarantine = absl::StrCat(canonical, "/", kQuarantine);
  if ((::mkdir(quarantine.c_str(), 0700) != 0 && errno != EEXIST) ||
      ::access(canonical.c_str(), W_OK | X_OK) != 0) {
    return ErrnoError(
        absl::StrCat("--session_dir ", path, ": cannot be written"), errno);
  }
  std::unique_ptr<SessionDirectory> directory(
      new SessionDirectory(options, std::move(canonical)));
  directory->indexer_ =
      std::thread([d = directory.get()] { d->IndexExisting(); });
  return directory;
}

SessionDirectory::SessionDirectory(const Options& options, std::string path)
    : options_(options), path_(std::move(path)) {}

SessionDirectory::~SessionDirectory() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (indexer_.joinable()) indexer_.join();
}

std::string SessionDirectory::FileOf(absl::string_view id,
                                     absl::string_view suffix) const {
  return absl::StrCat(path_, "/", id, suffix);
}

namespace {

// A temporary name in the directory for a file of `id`.
std::string TemporaryName(absl::string_view path, absl::string_view id,
                          absl::string_view suffix) {
  static std::atomic<uint64_t> counter{0};
  return absl::StrCat(path, "/.", id, ".", ::getpid(), ".", counter++, suffix);
}

// What a file's contents are written through, a piece at a time.
using FileSink = absl::FunctionRef<absl::Status(absl::string_view)>;

// Writes a file whole or not at all: the pieces `write` passes to its sink
// go to a new file `temporary`, renamed to `path` once all are written;
// on an error nothing is left behind.
absl::Status WriteWhole(const std::string& temporary, const std::string& path,
                        absl::FunctionRef<absl::Status(FileSink)> write) {
  const int fd =
      ::open(temporary.c_str(),
             O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    return ErrnoError(absl::StrCat("cannot create ", temporary), errno);
  }
  absl::Status written = write(
      [&](absl::string_view piece) { return WriteAll(fd, piece, temporary); });
  if (::close(fd) != 0 && written.ok()) {
    written = ErrnoError(absl::StrCat("cannot write ", temporary), errno);
  }
  if (written.ok() && ::rename(temporary.c_str(), path.c_str()) != 0) {
    written = ErrnoError(absl::StrCat("cannot rename to ", path), errno);
  }
  if (!written.ok()) ::unlink(temporary.c_str());
  return written;
}

}  // namespace

absl::Status SessionDirectory::Save(absl::string_view id,
                                    const DecodeSession& session,
                                    bool unconfirmed, uint32_t version) {
  if (!IsStorableId(id)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session id ", EchoString(id), " cannot name a session file"));
  }
  // A fork's shared prefix goes to its base file; a session saved whole
  // leaves none (a stale one of an earlier save would count for nothing).
  const DecodeSession::SharedBase shared = session.shared_base();
  SessionFileShape shape;
  if (!shared.key.empty() && std::min(version, options_.file_version) >= 3) {
    absl::StatusOr<SessionFileBase> base =
        SaveBase(id, session, shared, kBaseSuffix);
    if (base.ok()) shape.base = *std::move(base);
  }
  if (!shape.base.has_value()) RemoveBase(id);
  uint64_t bytes = 0;
  const absl::Status written = WriteWhole(TemporaryName(path_, id, ".tmp"),
                                          FileOf(id), [&](FileSink sink) {
                                            return WriteSessionFile(
                                                session, id,
                                                [&](absl::string_view piece) {
                                                  bytes += piece.size();
                                                  return sink(piece);
                                                },
                                                unconfirmed, shape);
                                          });
  if (!written.ok()) {
    RemoveBase(id);
    return written;
  }
  {
    MutexLock lock(&mu_);
    Index(absl::StrCat(id, kSessionSuffix), bytes, absl::Now());
    // This process's journal of the session goes once it is saved: the
    // file replaces it in the count.
    const auto journal = files_.find(absl::StrCat(id, kJournalSuffix));
    if (journal != files_.end() && journal->second.own_journal) {
      Unindex(std::string(journal->first));
    }
    ++counts_.saved;
  }
  MakeRoom(absl::StrCat(id, kSessionSuffix));
  return absl::OkStatus();
}

absl::StatusOr<SessionFileBase> SessionDirectory::SaveBase(
    absl::string_view id, const DecodeSession& session,
    const DecodeSession::SharedBase& shared, absl::string_view suffix) {
  const std::string name = absl::StrCat(id, suffix);
  const std::string path = FileOf(id, suffix);
  const bool own = suffix == kJournalBaseSuffix;  // counted as its journal
  std::optional<BaseFile> known;
  {
    MutexLock lock(&mu_);
    const auto it = bases_.find(shared.key);
    if (it != bases_.end()) known = it->second;
  }
  struct stat info;
  const auto is_known = [&](const struct stat& file) {
    return InodeOf(file) == known->inode &&
           ModifiedNanos(file) == known->modified_ns &&
           static_cast<uint64_t>(file.st_size) == known->base.size;
  };
  const auto keep = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Index(name, known->base.size, absl::Now(), known->inode);
    files_[name].own_journal = own;
    if (own) journal_bases_[id] = known->inode;
  };
  // Already in place (a journal started again over the same prefix).
  if (known.has_value() && ::lstat(path.c_str(), &info) == 0 &&
      is_known(info)) {
    MutexLock lock(&mu_);
    keep();
    return known->base;
  }
  RemoveBase(id, suffix);
  // Linked to the file an earlier save wrote, if some name still holds it
  // unchanged (that session may have been taken up and saved anew since).
  if (known.has_value() && ::link(absl::StrCat(path_, "/", known->name).c_str(),
                                  path.c_str()) == 0) {
    if (::lstat(path.c_str(), &info) == 0 && is_known(info)) {
      MutexLock lock(&mu_);
      keep();
      bases_[shared.key].name = name;  // the newest link lives longest
      ++counts_.linked_bases;
      return known->base;
    }
    ::unlink(path.c_str());
  }
  SessionFileBase base{.lengths = shared.lengths};
  ATTN_RETURN_IF_ERROR(WriteWhole(
      TemporaryName(path_, id, ".base.tmp"), path, [&](FileSink sink) {
        return WriteSessionFile(
            session, id,
            [&](absl::string_view piece) {
              base.size += piece.size();
              base.crc = Crc32c(piece, base.crc);
              return sink(piece);
            },
            /*unconfirmed=*/false,
            {.prefix = shared.lengths, .base = std::nullopt});
      }));
  if (::lstat(path.c_str(), &info) != 0) {
    return ErrnoError(absl::StrCat("cannot read ", path), errno);
  }
  MutexLock lock(&mu_);
  Index(name, base.size, absl::Now(), InodeOf(info));
  files_[name].own_journal = own;
  if (own) journal_bases_[std::string(id)] = InodeOf(info);
  if (bases_.size() >= kMaxKnownBases) bases_.clear();
  bases_[shared.key] = {name, InodeOf(info), ModifiedNanos(info), base};
  return base;
}

void SessionDirectory::RemoveBase(absl::string_view id,
                                  absl::string_view suffix) {
  if (!IsStorableId(id)) return;
  ::unlink(FileOf(id, suffix).c_str());
  MutexLock lock(&mu_);
  Unindex(absl::StrCat(id, suffix));
}

void SessionDirectory::RemoveJournalBase(absl::string_view id) {
  Inode ours;
  {
    MutexLock lock(&mu_);
    const auto it = journal_bases_.find(id);
    if (it == journal_bases_.end()) return;
    ours = it->second;
    journal_bases_.erase(it);
    Unindex(absl::StrCat(id, kJournalBaseSuffix));
  }
  struct stat info;
  const std::string path = FileOf(id, kJournalBaseSuffix);
  if (::lstat(path.c_str(), &info) == 0 && InodeOf(info) == ours) {
    ::unlink(path.c_str());
  }
}

absl::StatusOr<SessionFileBase> SessionDirectory::SaveJournalBase(
    absl::string_view id, const DecodeSession& session,
    const DecodeSession::SharedBase& shared) {
  if (options_.file_version < 3 || shared.key.empty()) {
    return absl::NotFoundError("no base file for this journal");
  }
  return SaveBase(id, session, shared, kJournalBaseSuffix);
}

absl::StatusOr<std::unique_ptr<DecodeSession>> SessionDirectory::Take(
    absl::string_view id, const SessionFileLoader& loader,
    SessionFileHeader* header) {
  return TakeFile(id, kSessionSuffix,
                  static_cast<LoadFunction>(&LoadSessionFile), loader, header);
}

absl::StatusOr<std::unique_ptr<DecodeSession>> SessionDirectory::TakeJournal(
    absl::string_view id, const SessionFileLoader& loader,
    SessionFileHeader* header) {
  if (!IsStorableId(id)) return TakeFile(id, kJournalSuffix, nullptr, loader);
  // Its lock, held while it is taken: a live process holds the session.
  const int fd = ::open(FileOf(id, kJournalSuffix).c_str(),
                        O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("no journal for ", EchoString(id)));
  }
  absl::Cleanup close_fd = [fd] { ::close(fd); };
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    return absl::UnavailableError(absl::StrCat(
        "session_id: session ", EchoString(id, '"'),
        " is held by a running server (its journal is locked) that did not "
        "hand it over; retry"));
  }
  if (!IsFileAt(fd, FileOf(id, kJournalSuffix))) {
    return absl::UnavailableError(
        absl::StrCat("session_id: session ", EchoString(id, '"'),
                     " is being taken up by another server; retry"));
  }
  return TakeFile(id, kJournalSuffix,
                  static_cast<LoadFunction>(&LoadSessionJournal), loader,
                  header);
}

absl::StatusOr<std::unique_ptr<DecodeSession>> SessionDirectory::TakeFile(
    absl::string_view id, absl::string_view suffix, LoadFunction load,
    const SessionFileLoader& loader, SessionFileHeader* header_out) {
  const auto not_found = [&] {
    return absl::NotFoundError(absl::StrCat(
        suffix == kSessionSuffix ? "no session file" : "no journal", " for ",
        EchoString(id)));
  };
  if (!IsStorableId(id) || load == nullptr) return not_found();
  // A session file's base, opened before the file is claimed: a process
  // making room removes a base whose session file it does not find.
  const absl::string_view base_suffix =
      suffix == kSessionSuffix ? kBaseSuffix : kJournalBaseSuffix;
  const absl::StatusOr<OpenedFile> base = OpenRegularFile(
      FileOf(id, base_suffix), {.max_bytes = options_.max_file_bytes,
                                .limit_name = "the largest session",
                                .within = path_});
  // Claimed by renaming it first: of two processes taking it at once, one
  // gets it.
  const std::string file = TemporaryName(path_, id, ".taking");
  const std::string name = FileOf(id, suffix);
  if (::rename(name.c_str(), file.c_str()) != 0) return not_found();
  absl::StatusOr<OpenedFile> opened =
      OpenRegularFile(file, {.max_bytes = options_.max_file_bytes,
                             .limit_name = "the largest session",
                             .within = path_});
  if (!opened.ok()) {
    ::rename(file.c_str(), name.c_str());
    Quarantine(id, suffix);
    return opened.status();
  }
  // Read a record at a time into one buffer: no buffer of the file's size.
  std::string buffer;
  const auto read = [&](uint64_t offset,
                        size_t n) -> absl::StatusOr<absl::string_view> {
    if (offset > opened->size() || n > opened->size() - offset) {
      return absl::DataLossError(absl::StrCat(file, ": truncated"));
    }
    if (buffer.size() < n) buffer.resize(n);
    ATTN_RETURN_IF_ERROR(opened->ReadAt(offset, n, buffer.data()));
    return absl::string_view(buffer.data(), n);
  };
  SessionFileHeader header;
  const std::string shown = absl::StrCat(id, suffix);
  const auto read_base = [&base] { return ReadWhole(base); };
  const SessionFileLoader with_base{.layer_of = loader.layer_of,
                                    .verify = loader.verify,
                                    .admit = loader.admit,
                                    .base = read_base};
  absl::StatusOr<std::unique_ptr<DecodeSession>> session =
      load(SessionFileSource{opened->size(), read}, shown, with_base, &header);
  if (session.ok() && header.id != id) {
    session = absl::DataLossError(
        absl::StrCat("session file ", EchoString(shown), " holds session ",
                     EchoString(header.id)));
  }
  // Back under its name: quarantined if bad, else left for later.
  if (!session.ok()) {
    ::rename(file.c_str(), name.c_str());
    if (FileIsBad(session.status())) {
      Quarantine(id, suffix);
      // Its base is of no use without it (other links keep their data).
      RemoveBase(id, base_suffix);
    }
    return session.status();
  }
  ::unlink(file.c_str());
  if (header.base.has_value()) RemoveBase(id, base_suffix);
  if (header_out != nullptr) *header_out = std::move(header);
  MutexLock lock(&mu_);
  Unindex(absl::StrCat(id, suffix));
  ++counts_.taken;
  return session;
}

absl::StatusOr<std::unique_ptr<SessionJournal>> SessionDirectory::CreateJournal(
    absl::string_view id, absl::string_view header) {
  if (!IsStorableId(id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("session id ", EchoString(id), " cannot name a journal"));
  }
  std::string temporary = TemporaryName(path_, id, ".journal.tmp");
  const int fd =
      ::open(temporary.c_str(),
             O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    return ErrnoError(absl::StrCat("cannot create ", temporary), errno);
  }
  // Locked while this process holds it: a journal nobody has locked is
  // one whose process died, and may be taken (TakeJournal).
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    ::close(fd);
    ::unlink(temporary.c_str());
    return ErrnoError(absl::StrCat("cannot lock ", temporary), error);
  }
  std::unique_ptr<SessionJournal> journal(
      new SessionJournal(fd, std::move(temporary), FileOf(id, kJournalSuffix),
                         this, absl::StrCat(id, kJournalSuffix)));
  const absl::Status written = journal->Append(header);
  if (!written.ok()) {
    journal->Remove();
    return written;
  }
  return journal;
}

bool SessionDirectory::RemoveJournal(absl::string_view id) {
  if (!IsStorableId(id)) return false;
  const std::string name = FileOf(id, kJournalSuffix);
  const int fd =
      ::open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  const bool gone = fd < 0 && errno == ENOENT;
  bool removed = false;
  if (fd >= 0) {
    // Only the file locked: another process may have published its own
    // journal under the name since it was opened.
    removed = ::flock(fd, LOCK_EX | LOCK_NB) == 0 && IsFileAt(fd, name) &&
              ::unlink(name.c_str()) == 0;
    ::close(fd);
  }
  if (removed || gone) {
    RemoveBase(id, kJournalBaseSuffix);
    MutexLock lock(&mu_);
    Unindex(absl::StrCat(id, kJournalSuffix));
  }
  return removed;
}

SessionJournal::~SessionJournal() {
  if (fd_ >= 0) ::close(fd_);
  if (!temporary_.empty()) ::unlink(temporary_.c_str());
}

absl::Status SessionJournal::Append(absl::string_view bytes) {
  if (fd_ < 0) return absl::FailedPreconditionError("the journal is closed");
  ATTN_RETURN_IF_ERROR(
      WriteAll(fd_, bytes, temporary_.empty() ? path_ : temporary_));
  bytes_ += bytes.size();
  directory_->JournalWritten(name_, bytes_);
  return absl::OkStatus();
}

absl::Status SessionJournal::Publish() {
  if (temporary_.empty()) return absl::OkStatus();
  if (::rename(temporary_.c_str(), path_.c_str()) != 0) {
    return ErrnoError(absl::StrCat("cannot rename to ", path_), errno);
  }
  temporary_.clear();
  return absl::OkStatus();
}

void SessionJournal::Remove() {
  const std::string& name = temporary_.empty() ? path_ : temporary_;
  // Another process may have taken the session up and published its own
  // journal under this name since: only this journal's file goes.
  if (fd_ >= 0 && IsFileAt(fd_, name)) ::unlink(name.c_str());
  if (fd_ >= 0) {
    directory_->JournalRemoved(name_);
    directory_->RemoveJournalBase(absl::string_view(name_).substr(
        0, name_.size() - kJournalSuffix.size()));
  }
  temporary_.clear();
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

bool SessionDirectory::Remove(absl::string_view id) {
  if (!IsStorableId(id)) return false;
  const bool removed = ::unlink(FileOf(id).c_str()) == 0;
  RemoveBase(id);
  MutexLock lock(&mu_);
  Unindex(absl::StrCat(id, kSessionSuffix));
  return removed;
}

void SessionDirectory::Hold(absl::string_view id, absl::string_view holder) {
  if (!IsStorableId(id) || holder.empty()) return;
  // A record that cannot be written leaves none: peers find no holder.
  WriteWhole(TemporaryName(path_, id, ".held.tmp"), FileOf(id, kHeldSuffix),
             [&](FileSink sink) { return sink(holder); })
      .IgnoreError();
}

std::optional<std::string> SessionDirectory::Holder(
    absl::string_view id) const {
  if (!IsStorableId(id)) return std::nullopt;
  absl::StatusOr<std::string> holder =
      ReadRegularFile(absl::StrCat(path_, "/", id, kHeldSuffix),
                      {.max_bytes = kMaxHolderBytes,
                       .limit_name = "a holder record's size",
                       .within = path_});
  if (!holder.ok() || holder->empty()) return std::nullopt;
  return *std::move(holder);
}

bool SessionDirectory::Knows(absl::string_view id) const {
  if (!IsStorableId(id)) return false;
  for (absl::string_view suffix :
       {kSessionSuffix, kJournalSuffix, kHeldSuffix}) {
    struct stat file;
    if (::lstat(FileOf(id, suffix).c_str(), &file) == 0) return true;
  }
  return false;
}

void SessionDirectory::Release(absl::string_view id) {
  if (!IsStorableId(id)) return;
  ::unlink(absl::StrCat(path_, "/", id, kHeldSuffix).c_str());
}

void SessionDirectory::Quarantine(absl::string_view id,
                                  absl::string_view suffix) {
  const std::string to = absl::StrCat(path_, "/", kQuarantine, "/", id, suffix,
                                      ".", absl::ToUnixNanos(absl::Now()));
  const std::string from = FileOf(id, suffix);
  if (::rename(from.c_str(), to.c_str()) != 0) ::unlink(from.c_str());
  MutexLock lock(&mu_);
  Unindex(absl::StrCat(id, suffix));
  ++counts_.quarantined;
}

void SessionDirectory::Index(const std::string& name, uint64_t bytes,
                             absl::Time written, std::optional<Inode> inode) {
  Unindex(name);
  files_[name] = {bytes, written, false, inode};
  by_age_.emplace(written, name);
  // A base file counts once, however many links name it.
  if (inode.has_value()) {
    LinkedFile& linked = inodes_[*inode];
    if (linked.links++ > 0) return;
    linked.bytes = bytes;
  }
  bytes_ += bytes;
}

void SessionDirectory::Unindex(const std::string& name) {
  auto it = files_.find(name);
  if (it == files_.end()) return;
  by_age_.erase({it->second.written, name});
  const uint64_t bytes = it->second.bytes;
  const std::optional<Inode> inode = it->second.inode;
  files_.erase(it);
  if (!inode.has_value()) {
    bytes_ -= bytes;
    return;
  }
  const auto linked = inodes_.find(*inode);
  if (--linked->second.links > 0) return;
  bytes_ -= linked->second.bytes;
  inodes_.erase(linked);
}

void SessionDirectory::MakeRoom(const std::string& keep) {
  if (options_.max_bytes == 0) return;
  // Journals a live process holds (its sessions' crash copies) stay, and
  // stay counted: this process's own are known, others' are found locked.
  std::set<std::string> held;
  while (true) {
    std::string oldest;
    {
      MutexLock lock(&mu_);
      if (bytes_ <= options_.max_bytes) return;
      auto it = by_age_.begin();
      while (it != by_age_.end() &&
             (it->second == keep || held.contains(it->second) ||
              files_.at(it->second).own_journal)) {
        ++it;
      }
      if (it == by_age_.end()) return;
      oldest = it->second;
      if (absl::EndsWith(oldest, kSessionSuffix)) {
        Unindex(oldest);
        ++counts_.removed_for_space;
      }
    }
    const auto id_of = [&](absl::string_view suffix) {
      return oldest.substr(0, oldest.size() - suffix.size());
    };
    struct stat info;
    if (absl::EndsWith(oldest, kSessionSuffix)) {
      ::unlink(absl::StrCat(path_, "/", oldest).c_str());
      RemoveBase(id_of(kSessionSuffix));
    } else if (absl::EndsWith(oldest, kBaseSuffix) ||
               absl::EndsWith(oldest, kJournalBaseSuffix)) {
      // A base goes with its session file or journal; one left alone (a
      // save or a take cut short, a process that died) goes here.
      const bool of_journal = absl::EndsWith(oldest, kJournalBaseSuffix);
      const absl::string_view suffix =
          of_journal ? kJournalBaseSuffix : kBaseSuffix;
      const std::string id = id_of(suffix);
      if (::lstat(
              FileOf(id, of_journal ? kJournalSuffix : kSessionSuffix).c_str(),
              &info) == 0) {
        held.insert(oldest);
      } else {
        RemoveBase(id, suffix);
        MutexLock lock(&mu_);
        ++counts_.removed_for_space;
      }
    } else if (RemoveJournal(
                   oldest.substr(0, oldest.size() - kJournalSuffix.size()))) {
      MutexLock lock(&mu_);
      ++counts_.removed_for_space;
    } else {
      held.insert(oldest);
    }
  }
}

void SessionDirectory::JournalWritten(const std::string& name, uint64_t bytes) {
  {
    MutexLock lock(&mu_);
    Index(name, bytes, absl::Now());
    files_[name].own_journal = true;
    if (options_.max_bytes == 0 || bytes_ <= options_.max_bytes) return;
  }
  MakeRoom(name);
}

void SessionDirectory::JournalRemoved(const std::string& name) {
  MutexLock lock(&mu_);
  Unindex(name);
}

void SessionDirectory::IndexExisting() {
  DIR* dir = ::opendir(path_.c_str());
  if (dir == nullptr) return;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    const absl::string_view suffix =
        absl::EndsWith(name, kSessionSuffix)       ? kSessionSuffix
        : absl::EndsWith(name, kJournalSuffix)     ? kJournalSuffix
        : absl::EndsWith(name, kBaseSuffix)        ? kBaseSuffix
        : absl::EndsWith(name, kJournalBaseSuffix) ? kJournalBaseSuffix
                                                   : "";
    struct stat info;
    if (suffix.empty() ||
        !IsStorableId(
            absl::string_view(name).substr(0, name.size() - suffix.size())) ||
        ::lstat(absl::StrCat(path_, "/", name).c_str(), &info) != 0 ||
        !S_ISREG(info.st_mode)) {
      continue;
    }
    MutexLock lock(&mu_);
    if (stopping_) break;
    if (files_.contains(name)) continue;  // written since
    Index(name, static_cast<uint64_t>(info.st_size),
          absl::TimeFromTimespec(info.st_mtim),
          suffix == kBaseSuffix || suffix == kJournalBaseSuffix
              ? std::optional<Inode>(InodeOf(info))
              : std::nullopt);
  }
  ::closedir(dir);
  MakeRoom("");
}

SessionDirectory::Stats SessionDirectory::stats() const {
  MutexLock lock(&mu_);
  Stats stats = counts_;
  stats.files = static_cast<int64_t>(files_.size());
  stats.bytes = bytes_;
  return stats;
}

}  // namespace attnserve
