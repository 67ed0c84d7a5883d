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
// Bounds: the files together stay within `max_bytes`: after a save, the
// least recently written files are removed until they fit. Opening does
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

class SessionDirectory {
 public:
  struct Options {
    // The directory; created if missing.
    std::string path;
    // Bytes of all session files together; 0: no limit.
    uint64_t max_bytes = 0;
    // The largest file read back (the largest session a store may hold,
    // and its records); larger files are quarantined unread.
    uint64_t max_file_bytes = 0;
  };
  struct Stats {
    int64_t saved = 0;
    int64_t taken = 0;
    int64_t quarantined = 0;
    int64_t removed_for_space = 0;
    int64_t files = 0;   // indexed
    uint64_t bytes = 0;  // of the indexed files
  };

  // FAILED_PRECONDITION naming the path when it cannot be created, is not
  // a directory or cannot be written.
  static absl::StatusOr<std::unique_ptr<SessionDirectory>> Open(
      const Options& options);
  ~SessionDirectory();
  SessionDirectory(const SessionDirectory&) = delete;
  SessionDirectory& operator=(const SessionDirectory&) = delete;

  // Whether `id` may name a file here: 1 to 64 of [0-9a-f] (the ids the
  // session store makes). Other ids are never looked up on disk.
  static bool IsStorableId(absl::string_view id);

  // Writes `session` as the file of `id`, replacing any; then keeps the
  // directory within max_bytes. INVALID_ARGUMENT for an id that is not
  // storable; the write's error (a full disk: RESOURCE_EXHAUSTED) leaves no
  // file behind.
  absl::Status Save(absl::string_view id, const DecodeSession& session)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Loads the session of `id` and removes its file. NOT_FOUND when there
  // is none; a hostile or corrupt file is quarantined (see above); other
  // errors (its model no longer served, the store's budget) leave the file.
  absl::StatusOr<std::unique_ptr<DecodeSession>> Take(
      absl::string_view id, const SessionFileLoader& loader)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the file of `id`; whether there was one.
  bool Remove(absl::string_view id) ABSL_LOCKS_EXCLUDED(mu_);

  // Holder records ("<id>.held"): which replica holds session `id` in
  // memory (`holder`: the address peers reach it at), so that another
  // replica asked for it can ask that one to hand it over (save it here).
  // Hold writes the record (replacing any), Holder reads it (nullopt: none
  // or unreadable), Release removes it.
  void Hold(absl::string_view id, absl::string_view holder);
  std::optional<std::string> Holder(absl::string_view id) const;
  void Release(absl::string_view id);

  const std::string& path() const { return path_; }
  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit SessionDirectory(const Options& options, std::string path);
  std::string FileOf(absl::string_view id) const;
  // Moves the file of `id` to quarantine/.
  void Quarantine(absl::string_view id) ABSL_LOCKS_EXCLUDED(mu_);
  // Index upkeep: a file of `id` with `bytes` written at `written`.
  void Index(const std::string& id, uint64_t bytes, absl::Time written)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unindex(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the least recently written files while the index passes
  // max_bytes, keeping `keep`.
  void MakeRoom(const std::string& keep) ABSL_LOCKS_EXCLUDED(mu_);
  void IndexExisting() ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  const std::string path_;  // canonical
  mutable Mutex mu_;
  struct Entry {
    uint64_t bytes = 0;
    absl::Time written;
  };
  absl::flat_hash_map<std::string, Entry> files_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<absl::Time, std::string>> by_age_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  Stats counts_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread indexer_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_SESSION_DIRECTORY_H_
