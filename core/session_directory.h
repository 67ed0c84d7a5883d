// A directory of session files (core/session_file.h), one per session id
// ("<id>.session"), shared by the replicas that mount it: a session saved
// by one process (evicted, or every session on a drain) is taken up by
// whichever process is next asked for it.
//
// Files are written whole to a temporary name and renamed into place, so a
// reader never sees half a file. A session is taken (Take) by reading its
// file and removing it: one process holds a session at a time. A file that
// fails to load as hostile or corrupt (DATA_LOSS, or one that is not a
// regular file inside the directory, or larger than the largest session)
// is moved to quarantine/ and its error returned; it is never loaded.
//
// Journals ("<id>.journal", core/session_file.h) are the files of sessions
// a process holds, appended to as their blocks fill, so that a process that
// dies (SIGKILL, out of memory, a lost node) leaves each session's full
// blocks behind. A journal is written to a temporary name and published
// (renamed into place) with its header and the blocks it starts with; it
// is taken (TakeJournal) like a session file, by whichever process is
// asked for a session that no live process holds.
//
// Forks store their shared prefix once: a session that reads whole blocks
// from frozen caches (DecodeSession::shared_base) is saved as a file of
// version 3 naming a base file, "<id>.base", a session file of that prefix
// (core/session_file.h). The first session saved with a given prefix writes
// its base; the next ones hard-link theirs to it, so that the prefix is on
// disk once, and it is freed with the last session naming it, by whichever
// process takes or removes that session: the links count its users. A
// session's base goes with its file (taken, removed, quarantined). A fork's
// journal likewise names "<id>.jbase" (SaveJournalBase), which goes with
// the journal.
//
// Bounds: the session files and journals together stay within `max_bytes`:
// after a save or a journal's growth, the least recently written files are
// removed until they fit. Journals a live process holds (locked) are never
// removed, only counted; those of processes that died are removed like
// session files. Opening does
// not read the directory (start-up stays instant with a million files in
// it): a background thread indexes the files already there.
//
// Thread-safety: every method may be called from any thread. Ownership:
// owns its index and the indexing thread; the files belong to the
// directory.
#ifndef ATTNSERVE_CORE_SESSION_DIRECTORY_H_
#define ATTNSERVE_CORE_SESSION_DIRECTORY_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/decode_session.h"
#include "core/mutex.h"
#include "core/session_file.h"

namespace attnserve {

class SessionDirectory;

// File names in a session directory: "<id>" and one of these.
inline constexpr absl::string_view kSessionSuffix = ".session";
inline constexpr absl::string_view kJournalSuffix = ".journal";
inline constexpr absl::string_view kBaseSuffix = ".base";
// A journal's base ("<id>.jbase"): the same, for the journal of a fork.
inline constexpr absl::string_view kJournalBaseSuffix = ".jbase";

// One session's journal, open for appending. Ownership: owns its file
// descriptor. Thread-safety: none; its owner serializes calls (the session
// store under the session's step lock).
class SessionJournal {
 public:
  ~SessionJournal();
  SessionJournal(const SessionJournal&) = delete;
  SessionJournal& operator=(const SessionJournal&) = delete;

  // Appends `bytes` (a whole record or a piece of one); the write's error
  // (a full disk: RESOURCE_EXHAUSTED).
  absl::Status Append(absl::string_view bytes);
  // Renames the journal into place as the journal of its id, replacing any.
  absl::Status Publish();
  // Removes its file (published or not) and closes it.
  void Remove();
  // Bytes written so far.
  uint64_t bytes() const { return bytes_; }

 private:
  friend class SessionDirectory;
  SessionJournal(int fd, std::string temporary, std::string path,
                 SessionDirectory* directory, std::string name)
      : fd_(fd),
        temporary_(std::move(temporary)),
        path_(std::move(path)),
        directory_(directory),
        name_(std::move(name)) {}
  int fd_;
  std::string temporary_;  // empty once published
  std::string path_;
  SessionDirectory* const directory_;  // counts its bytes; outlives it
  const std::string name_;             // "<id>.journal"
  uint64_t bytes_ = 0;
};

class SessionDirectory {
 public:
  struct Options {
    // The directory; created if missing.
    std::string path;
    // Bytes of all session files and journals together; 0: no limit.
    uint64_t max_bytes = 0;
    // The largest file read back (the largest session a store may hold,
    // and its records); larger files are quarantined unread.
    uint64_t max_file_bytes = 0;
    // The newest session file format written: kSessionFileVersion (forks
    // saved over base files), or 2 (every session whole, as releases
    // before format 3 read).
    uint32_t file_version = kSessionFileVersion;
  };
  struct Stats {
    int64_t saved = 0;
    int64_t taken = 0;
    int64_t quarantined = 0;
    int64_t removed_for_space = 0;
    int64_t files = 0;   // indexed
    uint64_t bytes = 0;  // of the indexed files (a base's links once)
    // Sessions saved with a base that another session's save wrote.
    int64_t linked_bases = 0;
  };

  // FAILED_PRECONDITION naming the path when it cannot be created, is not
  // a directory or cannot be written.
  static absl::StatusOr<std::unique_ptr<SessionDirectory>> Open(
      const Options& options);
  ~SessionDirectory();
  SessionDirectory(const SessionDirectory&) = delete;
  SessionDirectory& operator=(const SessionDirectory&) = delete;

  // A file's identity: device and inode.
  using Inode = std::pair<uint64_t, uint64_t>;

  // Whether `id` may name a file here: 1 to 64 of [0-9a-f] (the ids the
  // session store makes). Other ids are never looked up on disk.
  static bool IsStorableId(absl::string_view id);

  // Writes `session` as the file of `id`, replacing any; then keeps the
  // directory within max_bytes. INVALID_ARGUMENT for an id that is not
  // storable; the write's error (a full disk: RESOURCE_EXHAUSTED) leaves no
  // file behind.
  // `unconfirmed`: see SessionFileHeader. `version`: the newest format the
  // reader will read (a hand-over's asker), within Options::file_version.
  absl::Status Save(absl::string_view id, const DecodeSession& session,
                    bool unconfirmed = false,
                    uint32_t version = kSessionFileVersion)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Loads the session of `id` and removes its file; `header` (if not null)
  // gets its header. NOT_FOUND when there is none; a hostile or corrupt
  // file is quarantined (see above); other errors (its model no longer
  // served, the store's budget) leave the file.
  absl::StatusOr<std::unique_ptr<DecodeSession>> Take(
      absl::string_view id, const SessionFileLoader& loader,
      SessionFileHeader* header = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the file of `id`; whether there was one.
  bool Remove(absl::string_view id) ABSL_LOCKS_EXCLUDED(mu_);

  // The base file of the journal of session `id`, a fork whose shared
  // prefix is `shared` (DecodeSession::shared_base), for its header
  // (SessionJournalHeader): "<id>.jbase", kept if it already holds that
  // prefix, else linked to a base file holding it or written anew. Counted
  // as the journal is; removed with it. The write's error; NOT_FOUND when
  // the directory writes format 2 only.
  absl::StatusOr<SessionFileBase> SaveJournalBase(
      absl::string_view id, const DecodeSession& session,
      const DecodeSession::SharedBase& shared) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the base of this process's journal of `id` (SaveJournalBase),
  // unless another process has written its own under the name since.
  void RemoveJournalBase(absl::string_view id) ABSL_LOCKS_EXCLUDED(mu_);
  // A new journal for session `id` starting with `header`, under a
  // temporary name until published, locked (flock) while it is open.
  // INVALID_ARGUMENT for an id that is not storable; the write's error.
  absl::StatusOr<std::unique_ptr<SessionJournal>> CreateJournal(
      absl::string_view id, absl::string_view header);
  // Loads the session the journal of `id` replays to and removes the
  // journal, as Take does a session file; UNAVAILABLE while a process holds
  // the journal open (it is alive and holds the session).
  absl::StatusOr<std::unique_ptr<DecodeSession>> TakeJournal(
      absl::string_view id, const SessionFileLoader& loader,
      SessionFileHeader* header = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the journal of `id` unless a live process holds it (a
  // process that died left it); whether there was one.
  bool RemoveJournal(absl::string_view id) ABSL_LOCKS_EXCLUDED(mu_);

  // Holder records ("<id>.held"): which replica holds session `id` in
  // memory (`holder`: the address peers reach it at), so that another
  // replica asked for it can ask that one to hand it over (save it here).
  // Hold writes the record (replacing any), Holder reads it (nullopt: none
  // or unreadable), Release removes it.
  void Hold(absl::string_view id, absl::string_view holder);
  std::optional<std::string> Holder(absl::string_view id) const;
  void Release(absl::string_view id);

  // Whether session `id` lives on through this directory: it has a file,
  // a journal or a holder record here (an import of it would make a
  // second copy).
  bool Knows(absl::string_view id) const;

  const std::string& path() const { return path_; }
  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class SessionJournal;  // reports its bytes (JournalWritten)
  explicit SessionDirectory(const Options& options, std::string path);
  std::string FileOf(absl::string_view id,
                     absl::string_view suffix = kSessionSuffix) const;
  // Take and TakeJournal: claims the file of `id` with `suffix` by renaming
  // it, loads it with `load`, and removes it; a bad one is quarantined.
  using LoadFunction = absl::StatusOr<std::unique_ptr<DecodeSession>> (*)(
      const SessionFileSource& source, absl::string_view name,
      const SessionFileLoader& loader, SessionFileHeader* header);
  absl::StatusOr<std::unique_ptr<DecodeSession>> TakeFile(
      absl::string_view id, absl::string_view suffix, LoadFunction load,
      const SessionFileLoader& loader, SessionFileHeader* header = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Moves the file of `id` with `suffix` to quarantine/.
  void Quarantine(absl::string_view id, absl::string_view suffix)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The base of `session` saved as `id` (shared_base: `shared`) as file
  // "<id><suffix>" (kBaseSuffix, kJournalBaseSuffix): kept if it already
  // holds that prefix, else a link to the one an earlier save wrote, or
  // written anew; an error when it cannot be (the session is then saved
  // whole).
  absl::StatusOr<SessionFileBase> SaveBase(
      absl::string_view id, const DecodeSession& session,
      const DecodeSession::SharedBase& shared, absl::string_view suffix)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the base file of `id` with `suffix`, if any.
  void RemoveBase(absl::string_view id, absl::string_view suffix = kBaseSuffix)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Index upkeep: file `name` ("<id>.session", "<id>.journal", "<id>.base")
  // with `bytes` written at `written`; a base's links (`inode`) count once.
  void Index(const std::string& name, uint64_t bytes, absl::Time written,
             std::optional<Inode> inode = std::nullopt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unindex(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the least recently written files while the index passes
  // max_bytes, keeping `keep` (a file name) and the journals live
  // processes hold.
  void MakeRoom(const std::string& keep) ABSL_LOCKS_EXCLUDED(mu_);
  // A journal of this process (its file name) holds `bytes` now / is gone.
  void JournalWritten(const std::string& name, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  void JournalRemoved(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  void IndexExisting() ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  const std::string path_;  // canonical
  mutable Mutex mu_;
  struct Entry {
    uint64_t bytes = 0;
    absl::Time written;
    bool own_journal = false;    // a journal this process holds open
    std::optional<Inode> inode;  // a base file's
  };
  // Indexed base files: their bytes, and the links naming them.
  struct LinkedFile {
    uint64_t bytes = 0;
    int links = 0;
  };
  absl::flat_hash_map<Inode, LinkedFile> inodes_ ABSL_GUARDED_BY(mu_);
  // The base files this process wrote or linked, by their prefix's key
  // (DecodeSession::SharedBase): a name that held it, what its file was
  // (identity and modification time, checked after a link) and what the
  // sessions naming it record.
  struct BaseFile {
    std::string name;
    Inode inode;
    int64_t modified_ns = 0;
    SessionFileBase base;
  };
  absl::flat_hash_map<std::string, BaseFile> bases_ ABSL_GUARDED_BY(mu_);
  // The bases of this process's journals, by session id.
  absl::flat_hash_map<std::string, Inode> journal_bases_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Entry> files_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<absl::Time, std::string>> by_age_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  Stats counts_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread indexer_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_SESSION_DIRECTORY_H_
