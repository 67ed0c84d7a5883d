// A decode session as bytes: what a session directory stores and what a
// session export carries, so that a session outlives its process and moves
// between replicas.
//
// Format (version 2, or 3 for a file with a base; little-endian):
//   header   "ATTNSESS", u32 version, u32 body size, the body (the
//            session's config, id, model, per-layer lengths and u32 flags:
//            bit 0, its lengths are unconfirmed, see below), u32 CRC-32C
//            of the body;
//   blocks   per layer in order, per block of kCacheBlockKeys tokens from
//            token 0 (the last of a layer may be shorter): "BLCK", u32
//            layer, i64 first token, i64 tokens, u32 CRC-32C of those
//            fields and the rows, then the rows (DecodeSession::RowBytes);
//   end      "DONE", i64 blocks, u32 CRC-32C of that count.
//
// Version 3 stores a fork's shared prefix once for the sessions sharing it:
// the header's flags have bit 1 set and name a base file, a version 2 file
// of the first `base.lengths` tokens of each layer (whole blocks), by its
// size and CRC-32C (u64 size, u32 CRC, i64 per layer after the flags); the
// blocks of each layer then start at its base length. The base is loaded
// first and must match both, and hold those lengths in the same config.
//
// A journal is the same header with every length 0 (and, version 3, a base
// file holding the fork's shared prefix: its blocks are the journal's
// first), followed by block records only, appended as the session runs: each
// full block once it fills (tokens kCacheBlockKeys), and a record of 0 tokens
// where a step rewound below blocks already written. Replayed in order, a
// record at token `first` drops every block of its layer from `first` on, then
// adds its own. A journal has no end record: the process writing it may die at
// any point, so a last record cut short or with a wrong checksum ends the
// replay (it was being written), and the session holds the full blocks
// before it, marked unconfirmed: its client resends from there.
//
// Loading treats the bytes as hostile: the file's size must be exactly
// what its header describes, each block must be the next one in order and
// match its checksum, the config must pass DecodeSession's checks and the
// caller's (the session store's budget), and the rows must be finite. A
// file that fails any check gives DATA_LOSS (or the config's error) naming
// the session file and what is wrong; nothing is half-loaded.
//
// Thread-safety: free functions without shared state (the session's own
// lock serializes reading it). Ownership: LoadSessionFile returns a new
// session the caller owns.
#ifndef ATTNSERVE_CORE_SESSION_FILE_H_
#define ATTNSERVE_CORE_SESSION_FILE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/decode_session.h"
#include "core/multi_head_attention.h"

namespace attnserve {

// The newest version read (and written for a file with a base; others are
// written as version 2, which every release since durable sessions reads),
// and the oldest read (version 1: no header flags).
inline constexpr uint32_t kSessionFileVersion = 3;
inline constexpr uint32_t kOldestSessionFileVersion = 1;

// A version 3 file's base: the tokens per layer it holds, and its file's
// size and CRC-32C.
struct SessionFileBase {
  std::vector<int64_t> lengths;
  uint64_t size = 0;
  uint32_t crc = 0;
  friend bool operator==(const SessionFileBase&,
                         const SessionFileBase&) = default;
};

// Which file of a session to write: unset fields, the whole session.
struct SessionFileShape {
  // The session's first `prefix` tokens of each layer only (a base file).
  std::optional<std::vector<int64_t>> prefix;
  // A file of version 3 naming this base and holding the blocks after it.
  std::optional<SessionFileBase> base;
};

// What a session file says of its session besides the rows.
struct SessionFileHeader {
  std::string id;
  // A model session's model name (its layer is the served model's of that
  // name when loaded); empty for attention sessions.
  std::string model;
  // Without its layer; a model session's heads, dims and dtype are the
  // layer's and are checked against the model when loaded.
  DecodeSessionConfig config;
  // The session's heads, dims and dtypes as it ran (a model session's from
  // its layer).
  int num_heads = 0;
  int num_kv_heads = 0;
  int64_t key_dim = 0;
  int64_t value_dim = 0;
  DType dtype = DType::kFloat32;
  DType cache_dtype = DType::kFloat32;
  // Tokens per layer.
  std::vector<int64_t> lengths;
  // Whether the session may hold fewer tokens than its client sent: it was
  // recovered from a journal, and no step has given its position since.
  bool unconfirmed = false;
  // Version 3: the base file holding the session's first tokens.
  std::optional<SessionFileBase> base;
};

// Writes `session` (under id `id`; a model session names its config's
// model) as a session file through `write`, called with consecutive pieces
// of it; one consistent snapshot. Stops at the first error `write` returns.
absl::Status WriteSessionFile(
    const DecodeSession& session, absl::string_view id,
    absl::FunctionRef<absl::Status(absl::string_view)> write,
    bool unconfirmed = false, const SessionFileShape& shape = {});

// A journal's pieces: its header (FAILED_PRECONDITION for a model session
// without its model's name; naming `base` when given, whose blocks then
// come first), and a block record's fields before its rows (`rows` empty
// for a rewind's record of 0 tokens).
absl::StatusOr<std::string> SessionJournalHeader(
    const DecodeSession& session, absl::string_view id,
    const SessionFileBase* base = nullptr);
std::string SessionBlockFields(int64_t layer, int64_t first, int64_t tokens,
                               absl::string_view rows);

// The header of the session file `bytes`, checked (magic, version, size,
// checksum, config fields within their ranges); DATA_LOSS naming `name`
// (the file) otherwise.
absl::StatusOr<SessionFileHeader> ReadSessionFileHeader(absl::string_view bytes,
                                                        absl::string_view name);

// What loading needs from the caller.
struct SessionFileLoader {
  // A model session's layer for the model named in the file: NOT_FOUND
  // when it is not served.
  absl::FunctionRef<absl::StatusOr<std::shared_ptr<const MultiHeadLayer>>(
      absl::string_view model)>
      layer_of;
  // Checks the session's config before its memory is reserved (the
  // session store's VerifyConfig).
  absl::FunctionRef<absl::Status(const DecodeSessionConfig&)> verify;
  // Called with the header (a journal's: the lengths its replay holds)
  // and the empty session before any block is loaded into it, so that
  // the caller can make room for what it will hold (the session store's
  // budget); an error stops the load. Default: nothing.
  absl::FunctionRef<absl::Status(const SessionFileHeader&,
                                 const DecodeSession&)>
      admit = +[](const SessionFileHeader&, const DecodeSession&) {
        return absl::OkStatus();
      };
  // A version 3 file's base file, whole (its size and checksum are checked
  // here). Default: none, and such a file does not load (DATA_LOSS).
  absl::FunctionRef<absl::StatusOr<std::string>()> base =
      +[]() -> absl::StatusOr<std::string> {
    return absl::NotFoundError("no base file can be read here");
  };
};

// Where a session file is read from, piece by piece (a file need not be
// held whole): its size, and `read(offset, n)`, its n bytes from `offset`,
// valid until the next call (an error when they cannot be read).
struct SessionFileSource {
  uint64_t size = 0;
  absl::FunctionRef<absl::StatusOr<absl::string_view>(uint64_t offset,
                                                      size_t n)>
      read;
};

// The session file of a session, read piece by piece while the session
// lives on (an export stream). Its layout (size, records) is fixed when it
// is made, from the session's contents at that instant; each record is
// read from the session when asked for, and ABORTED once the session has
// changed since (a step or a rewind; see DecodeSession::contents()): its
// reader starts again, or reads a fork, which does not change.
//
// Thread-safety: one reader at a time. Ownership: reads `session`, which
// must outlive it.
class SessionFileImage {
 public:
  // The file of `session` (under id `id`; see WriteSessionFile) as it
  // holds now; FAILED_PRECONDITION as WriteSessionFile.
  static absl::StatusOr<SessionFileImage> Of(
      const DecodeSession& session, absl::string_view id,
      bool unconfirmed = false, const SessionFileShape& shape = {});

  uint64_t size() const { return size_; }
  // Sets version(), a fingerprint of the file's bytes (the checksums of its
  // header and of each block's rows; never 0), reading every block once:
  // the same for the same session on any replica and in any process, so
  // that a reader cut short resumes wherever the session went, and not
  // once it changed. ABORTED when the session changes meanwhile.
  absl::Status Fingerprint();
  // 0 before Fingerprint().
  uint64_t version() const { return version_; }
  // Up to `n` bytes from `offset` (at most to the end of the record
  // holding it; empty at size()), valid until the next call. OUT_OF_RANGE
  // past size(); ABORTED when the session changed.
  absl::StatusOr<absl::string_view> Read(uint64_t offset, size_t n);

 private:
  // A record: where it starts in the file, and for a block record its
  // layer, first token and tokens (layer -1: the header; -2: the end).
  struct Record {
    uint64_t offset = 0;
    int64_t layer = 0;
    int64_t first = 0;
    int64_t tokens = 0;
  };
  SessionFileImage(const DecodeSession& session) : session_(&session) {}
  // Builds record `index` into built_.
  absl::Status Build(size_t index);
  // Appends block `record`'s rows to `rows`; ABORTED when the session is
  // no longer the contents the records describe.
  absl::Status AppendRows(const Record& record, std::string& rows) const;

  const DecodeSession* session_;
  // The session's contents the records describe (DecodeSession::Contents).
  uint64_t contents_version_ = 0;
  uint64_t version_ = 0;
  uint64_t size_ = 0;
  std::string header_;
  std::vector<Record> records_;
  std::string built_;
  size_t built_index_ = SIZE_MAX;
};

// A session file taken in piece by piece, as it arrives (an import
// stream): each record is checked and applied as soon as it is whole, so
// that at most one record is held besides the session being built. The
// checks and errors are LoadSessionFile's (the first error sticks).
//
// Thread-safety: one writer at a time. Ownership: owns the session it
// builds until Release.
class SessionFileBuilder {
 public:
  // `name` names the file in errors.
  explicit SessionFileBuilder(std::string name) : name_(std::move(name)) {}

  // Takes the next bytes of the file; `loader` is used once the header is
  // whole. An error (DATA_LOSS naming what is wrong, the config's error
  // or more bytes than the header describes) sticks.
  absl::Status Add(absl::string_view bytes, const SessionFileLoader& loader);
  // The bytes taken so far, and those the next record still needs.
  uint64_t received() const { return received_; }
  size_t needed() const { return need_ - pending_.size(); }
  // The header and the file's size, once the header is whole (null, 0
  // before).
  const SessionFileHeader* header() const {
    return session_ != nullptr ? &header_ : nullptr;
  }
  uint64_t expected_size() const { return expected_size_; }
  // The session built so far (null before the header), and whether the
  // end record came.
  const DecodeSession* session() const { return session_.get(); }
  bool complete() const { return stage_ == Stage::kDone; }
  // The session, once complete (FAILED_PRECONDITION before).
  absl::StatusOr<std::unique_ptr<DecodeSession>> Release();

 private:
  enum class Stage { kPrefix, kHeader, kFields, kRows, kEnd, kDone };
  // Applies the record `bytes` (need_ of them) of the current stage.
  absl::Status Take(absl::string_view bytes, const SessionFileLoader& loader);
  absl::Status TakeHeader(absl::string_view bytes,
                          const SessionFileLoader& loader);
  absl::Status TakeFields(absl::string_view bytes);
  absl::Status TakeRows(absl::string_view bytes);
  // A version 3 file's base, loaded as the session (its blocks follow).
  absl::Status TakeBase(const SessionFileLoader& loader);
  // The tokens of `layer` in the base (0 without one).
  int64_t BaseLength(size_t layer) const;
  // The next block's stage (fields, or the end after the last block).
  void NextBlock();
  std::string Block() const;

  const std::string name_;
  absl::Status status_;
  Stage stage_ = Stage::kPrefix;
  size_t need_ = 16;
  // The bytes of the record under way, and the last record gathered.
  std::string pending_;
  std::string record_;
  uint64_t received_ = 0;
  uint64_t expected_size_ = 0;
  SessionFileHeader header_;
  std::unique_ptr<DecodeSession> session_;
  // The block expected next: its layer, first token and tokens, its
  // number, and the fields' checksum and the CRC it declares.
  int64_t layer_ = 0;
  int64_t first_ = 0;
  int64_t tokens_ = 0;
  int64_t count_ = 0;
  uint32_t fields_crc_ = 0;
  uint32_t crc_ = 0;
};

// The session stored in `source` (see the format above), with `header` set
// to its header when not null. `name` names the file in errors.
absl::StatusOr<std::unique_ptr<DecodeSession>> LoadSessionFile(
    const SessionFileSource& source, absl::string_view name,
    const SessionFileLoader& loader, SessionFileHeader* header = nullptr);
// The same from bytes in memory.
absl::StatusOr<std::unique_ptr<DecodeSession>> LoadSessionFile(
    absl::string_view bytes, absl::string_view name,
    const SessionFileLoader& loader, SessionFileHeader* header = nullptr);

// The session the journal `bytes` replays to (see above), with `header`'s
// lengths those it holds and `unconfirmed` set. DATA_LOSS for corruption
// before its last record, as LoadSessionFile.
absl::StatusOr<std::unique_ptr<DecodeSession>> LoadSessionJournal(
    absl::string_view bytes, absl::string_view name,
    const SessionFileLoader& loader, SessionFileHeader* header = nullptr);
// The same from `source`, read whole (a journal's blocks are replayed
// before any is loaded).
absl::StatusOr<std::unique_ptr<DecodeSession>> LoadSessionJournal(
    const SessionFileSource& source, absl::string_view name,
    const SessionFileLoader& loader, SessionFileHeader* header = nullptr);

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_SESSION_FILE_H_
