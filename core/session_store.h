// The open decode sessions of a server, by id, within a memory budget.
//
// Each session gets a random id at Add. A session idle for longer than
// `idle_timeout` expires; when a step needs cache memory past `max_bytes`,
// or an Add finds `max_sessions` open or the address space its cache
// reserves past `max_reserved_bytes`, the least recently used other
// sessions are evicted until it fits. A session whose cache could never be
// held (reserving more than max_bytes or max_reserved_bytes) is refused. A step
// on a session that is gone is NOT_FOUND with a message that says why (expired,
// evicted, deleted) and what to do: create a new session and prefill it.
// Sessions hold memory until deleted, expired, evicted or the store is
// destroyed; a session evicted while one of its steps runs is freed when that
// step returns (the step still answers).
//
// Forked sessions (Fork) share frozen caches: each is counted once in
// cache_bytes and reserved_bytes (and in the budget) while any session
// holds it, and freed when the last one goes; evicting one of its holders
// frees that session's own cache only.
//
// The budget (max_bytes) counts, besides the caches' memory, what else a
// session makes the server hold: its per-layer bookkeeping
// (DecodeSession::bookkeeping_bytes, counted from Add on), and the weights
// of a model that only sessions keep alive. A model session holds its
// model's layer; when the repository replaces that model (a reload), the
// old weights stay as long as a session holds them: such a superseded model
// is counted once (DecodeSession::ModelBytes), however many sessions hold
// it, and released with the last of them. Which models are still served is
// asked of Options::model_served on Add, on Fork, by the background thread
// and on RecountModels.
//
// Ownership: owns its sessions. Thread-safety: every method may be called
// concurrently; steps on one session run one at a time, steps on different
// sessions in parallel. A background thread expires idle sessions.
#ifndef ATTNSERVE_CORE_SESSION_STORE_H_
#define ATTNSERVE_CORE_SESSION_STORE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/decode_session.h"
#include "core/kv_cache.h"
#include "core/multi_head_attention.h"
#include "core/mutex.h"
#include "core/results.h"
#include "core/session_directory.h"
#include "core/session_file.h"

namespace attnserve {

// Whether a call may wait for another replica to hand a session over (an
// RPC to it, up to its deadline). A call answered on gRPC's thread may not:
// where it would, it fails with a status IsWouldWait tells, and is then
// run again where it may wait (a worker).
enum class PeerWait { kAllowed, kRefused };

// Whether `status` is a kRefused call's where it would have waited.
bool IsWouldWait(const absl::Status& status);

class SessionStore {
 public:
  struct Options {
    // Cache memory of all sessions together; 0: no limit.
    size_t max_bytes = 0;
    // Sessions idle this long are freed; absl::InfiniteDuration(): never.
    absl::Duration idle_timeout = absl::Minutes(10);
    // Open sessions at most; 0: no limit.
    int64_t max_sessions = 0;
    // Address space all sessions' caches reserve together (each reserves
    // its whole max_length, committing pages as tokens fill them); 0: no
    // limit. It must stay well inside the process's address space: malloc
    // fails for everything else once mappings fill it.
    size_t max_reserved_bytes = 0;
    // Whether the model whose layer this is is served (the repository
    // holds it); a model that is not is counted in the budget while
    // sessions hold it. Called with the store's lock held: it must not
    // call into the store. Unset: every model is taken as served (none is
    // counted).
    std::function<bool(const MultiHeadLayer&)> model_served;
    // Durable sessions (null: none; must outlive the store). An evicted
    // session is saved there (when its last step returns), SaveAll saves
    // every session, and a step, fork, find or delete of a session the
    // store does not hold looks there first: a session saved by this or
    // another process is taken in under its id (its file removed), within
    // the budget as a new session is.
    SessionDirectory* directory = nullptr;
    // A model session's layer by its model's name, for sessions taken from
    // the directory: NOT_FOUND when that model is not served. Unset: model
    // sessions are not taken.
    std::function<absl::StatusOr<std::shared_ptr<const MultiHeadLayer>>(
        absl::string_view model)>
        layer_of;
    // With a directory: the address other replicas reach this one at. Each
    // open session is recorded there as held here (SessionDirectory::
    // Hold), so that a replica asked for a session it finds no file of can
    // ask its holder to hand it over. Empty: no records (until SetHolder).
    std::string holder;
    // Asks the replica at `holder` to hand session `id` over (save it to
    // the directory and free it: its HandOver). Unset: never asked.
    std::function<absl::Status(absl::string_view id, absl::string_view holder)>
        reclaim;
    // With a directory: keeps a journal of every open session there
    // (SessionDirectory::CreateJournal), each full block of kCacheBlockKeys
    // tokens appended by a background thread once it fills, so that a
    // process that dies leaves them behind. A session no live process holds
    // and that has no file is recovered from its journal, holding its full
    // blocks, and refuses steps that do not give their position (ABORTED)
    // until one does: its client resends what it lost.
    bool journal = false;
  };

  struct Stats {
    int64_t open = 0;
    size_t cache_bytes = 0;
    size_t reserved_bytes = 0;  // address space of the open sessions' caches
    int64_t created = 0;
    int64_t deleted = 0;
    int64_t expired = 0;
    int64_t evicted = 0;  // least recently used, to make room
    int64_t forked = 0;   // sessions opened by Fork (counted in created)
    // Frozen caches shared by forked sessions: how many, and their memory
    // (counted once each, in cache_bytes too).
    int64_t shared_caches = 0;
    size_t shared_bytes = 0;
    // The open sessions' per-layer bookkeeping (not in cache_bytes).
    size_t bookkeeping_bytes = 0;
    // Models no longer served that sessions hold: how many, and their
    // weights (counted once each; not in cache_bytes).
    int64_t superseded_models = 0;
    size_t superseded_model_bytes = 0;
    // What max_bytes limits: cache_bytes + bookkeeping_bytes +
    // superseded_model_bytes.
    size_t budget_bytes = 0;
    // Sessions saved to the directory (evicted; SaveAll), taken from it
    // (counted in created too), and saves that failed (the session lost).
    int64_t saved = 0;
    int64_t restored = 0;
    int64_t save_failures = 0;
    // Sessions recovered from journals (counted in restored too), blocks
    // journaled, and journals given up (a write failed: the session is
    // journaled no more).
    int64_t recovered = 0;
    int64_t journaled_blocks = 0;
    int64_t journal_failures = 0;
    // Sessions opened by an import (counted in created too), and imports
    // under way.
    int64_t imported = 0;
    int64_t importing = 0;
    // Sessions taken up or imported that share their first blocks with a
    // session held here (counted in restored or imported too).
    int64_t reshared = 0;
  };

  explicit SessionStore(const Options& options);
  ~SessionStore();
  SessionStore(const SessionStore&) = delete;
  SessionStore& operator=(const SessionStore&) = delete;

  // Opens `session` under a new id, evicting the least recently used
  // sessions first if max_sessions are open, its reservation and
  // bookkeeping would pass max_reserved_bytes or its bookkeeping (and a
  // superseded model it holds) max_bytes; RESOURCE_EXHAUSTED (VerifyFits)
  // if it alone could never fit.
  absl::StatusOr<std::string> Add(std::unique_ptr<DecodeSession> session)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Add under `id`, which the caller chose (a sequence's, derived from its
  // name): INVALID_ARGUMENT unless it is 1 to 64 of [0-9a-f]
  // (SessionDirectory::IsStorableId), ALREADY_EXISTS when a session is
  // open under it here.
  absl::StatusOr<std::string> AddNamed(std::unique_ptr<DecodeSession> session,
                                       std::string id) ABSL_LOCKS_EXCLUDED(mu_);

  // The most one session's cache may reserve together with its
  // bookkeeping: max_bytes (its full cache must fit the budget) or
  // max_reserved_bytes, the smaller of those set; 0: no limit.
  size_t max_session_bytes() const;
  // RESOURCE_EXHAUSTED when a cache reserving `bytes` passes
  // max_session_bytes().
  absl::Status VerifyReservation(size_t bytes) const;
  // RESOURCE_EXHAUSTED when a session of cache `dims` could never fit: its
  // cache's reservation (VerifyReservation's message, naming max_length)
  // or, with its per-layer bookkeeping, max_session_bytes() (naming
  // num_layers, the limit and how many layers fit).
  absl::Status VerifyFits(const KvCache::Dims& dims) const;
  // The errors of DecodeSession::CacheDims(config), then VerifyFits: the
  // checks Add makes, made before the session's memory is allocated.
  absl::Status VerifyConfig(const DecodeSessionConfig& config) const;

  // Asks Options::model_served which of the models sessions hold are no
  // longer served, counts those in the budget (and stops counting any
  // served again), and, when that counted more, evicts the least recently
  // used sessions while the budget is passed. The background thread calls it,
  // Add and Fork count likewise; a server may call it after replacing models.
  void RecountModels() ABSL_LOCKS_EXCLUDED(mu_);

  // Runs one step of session `id` (see DecodeSession::Step), having made
  // room for the cache memory it adds: NOT_FOUND if the session is gone,
  // RESOURCE_EXHAUSTED if it alone would pass max_bytes. `length` gets the
  // length of the step's layer after the step.
  absl::Status Step(absl::string_view id, const DecodeStepInputs& inputs,
                    const DecodeStepOptions& options, ResultAllocator& results,
                    int64_t* length) ABSL_LOCKS_EXCLUDED(mu_);

  // One entry of StepMany.
  struct StepInput {
    std::string id;
    DecodeStepInputs inputs;
    DecodeStepOptions options;
    ResultAllocator* results = nullptr;  // not owned; gets "output"
    int64_t* length = nullptr;  // optional: the step's layer's length after
  };
  // Runs one step on each entry's session, as Step does for each (the
  // same room made, the same results and errors), their attention in one
  // kernel pass (StepSessions). One status per entry: an entry that fails
  // (gone, refused, over the memory limit, cancelled) fails alone. An id
  // may appear in one entry only; later entries naming it again fail with
  // INVALID_ARGUMENT.
  std::vector<absl::Status> StepMany(absl::Span<const StepInput> steps)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Opens a new session holding the first `length` tokens of session `id`
  // (every one when unset), sharing them copy-on-write
  // (DecodeSession::Fork); `length` gets the new session's length. Makes
  // room as Add does, never evicting `id` itself: RESOURCE_EXHAUSTED when
  // the other sessions cannot make it, or when forks already share
  // max_sessions frozen caches. NOT_FOUND as Step. `as`: the new session's
  // id, as AddNamed takes it (its errors), instead of a new one.
  absl::StatusOr<std::string> Fork(absl::string_view id,
                                   std::optional<int64_t> length,
                                   int64_t* forked_length = nullptr,
                                   std::optional<std::string> as = std::nullopt,
                                   PeerWait wait = PeerWait::kAllowed)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Moves session `from` to id `to` (AddNamed's rules): its journal is
  // written anew under `to`, and its holder's record follows. Waits for a
  // step running on it. NOT_FOUND as Step; ALREADY_EXISTS when `to` is
  // open here.
  absl::Status Rename(absl::string_view from, const std::string& to)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The session, for cost estimates and metadata; NOT_FOUND as Step.
  absl::StatusOr<std::shared_ptr<const DecodeSession>> Find(
      absl::string_view id) ABSL_LOCKS_EXCLUDED(mu_);
  // The session if it is open in this store: never the directory nor a
  // hand-over, for callers on threads that must not wait for a peer (gRPC's
  // callback threads: two replicas waiting on each other's would both stall
  // until the hand-over's deadline). NOT_FOUND as Step.
  absl::StatusOr<std::shared_ptr<const DecodeSession>> FindHere(
      absl::string_view id) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether a session not open here may be taken up under `id`: the
  // directory holds its file, its journal or its holder's record.
  bool KnownInDirectory(absl::string_view id) const {
    return options_.directory != nullptr && options_.directory->Knows(id);
  }
  // Whether a call on `id` would take its session up first, and so may
  // wait for a file or another replica: it is not open here, and the
  // directory knows it.
  bool HeldElsewhere(absl::string_view id) ABSL_LOCKS_EXCLUDED(mu_) {
    return !FindHere(id).ok() && KnownInDirectory(id);
  }
  // Find for ids used again after their session ends (a sequence's): the
  // directory is asked also when this store deleted or expired `id`, as
  // another replica may have opened a session under it since.
  absl::StatusOr<std::shared_ptr<const DecodeSession>> FindReused(
      absl::string_view id) ABSL_LOCKS_EXCLUDED(mu_);

  // Frees session `id` (its file or journal in the directory; one a live
  // replica holds is saved there first); NOT_FOUND as Step.
  absl::Status Delete(absl::string_view id, PeerWait wait = PeerWait::kAllowed)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Frees every session (shutdown).
  void Clear() ABSL_LOCKS_EXCLUDED(mu_);

  // Replaces Options::holder (a server knows its port once it listens).
  void SetHolder(std::string holder) ABSL_LOCKS_EXCLUDED(mu_);

  // Saves session `id` to the directory and frees it, for another replica
  // to take up (it asked: its load balancer sends it the session's calls
  // now), in a format of at most `file_version` (what the asker reads).
  // Waits for a step running on it. NOT_FOUND as Step;
  // FAILED_PRECONDITION without a directory; the save's error.
  absl::Status HandOver(absl::string_view id,
                        uint32_t file_version = kSessionFileVersion)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Saves every open session to the directory (a drain), each one
  // consistent (its steps wait), stopping at `deadline`, and frees each one
  // saved: it lives on in its file, for whichever store takes it next (this
  // one included). What it saved, and the first error (FAILED_PRECONDITION
  // without a directory; DEADLINE_EXCEEDED when time ran out).
  struct SaveReport {
    int64_t sessions = 0;
    int64_t failed = 0;
    absl::Status first_error;
  };
  SaveReport SaveAll(absl::Time deadline = absl::InfiniteFuture())
      ABSL_LOCKS_EXCLUDED(mu_);

  // Session transfer (ExportSession, ImportSession): a session's file
  // (core/session_file.h) read from one store and taken in by another.
  //
  // An export: the file of session `id` as it holds now, read piece by
  // piece while the session lives on (steps are not stopped; a piece read
  // after a step fails ABORTED), whose image's version() is set (read
  // once whole: the same for the same session wherever it is). It keeps
  // the session's memory alive while held, as a running step does.
  // NOT_FOUND as Step; UNAVAILABLE while the session is being imported;
  // ABORTED when it steps while its version is read, three times running.
  struct Export {
    std::shared_ptr<const DecodeSession> session;
    SessionFileImage image;  // reads *session
  };
  absl::StatusOr<Export> ExportSession(absl::string_view id,
                                       PeerWait wait = PeerWait::kAllowed)
      ABSL_LOCKS_EXCLUDED(mu_);
  // An import, as one stream sees it; its caller holds it between pieces
  // and ends it with EndImport. Set `id` before the first piece to resume
  // the import of that session (cut short earlier); leave it empty to
  // begin one.
  struct Import {
    std::string id;                // the session's, once its header has come
    uint64_t received = 0;         // bytes of the file taken so far
    uint64_t size = 0;             // the file's, once its header has come
    bool complete = false;         // the session is open under `id`
    std::vector<int64_t> lengths;  // its tokens per layer, once complete
    // A new import's bytes before its header (it has no id yet).
    std::unique_ptr<SessionFileBuilder> head;
  };
  // Takes the next `bytes` of an import, which start at byte `offset` of
  // the file: `offset` must be the bytes it has taken (FAILED_PRECONDITION
  // naming them otherwise; no bytes when resuming: only `import.received`
  // is set). Once the header has come, the session's whole
  // cache is counted in the budget (room is made as for a step) and the id
  // is taken: steps on it answer UNAVAILABLE until the last byte has come,
  // when the session opens as a new one. ALREADY_EXISTS when a session of
  // that id is open or being imported (a new import); UNAVAILABLE when a
  // resumed import is still held by another stream; NOT_FOUND when
  // resuming an import that is not under way here; DATA_LOSS and the
  // config's errors as a session file's (the import is then dropped).
  absl::Status ImportBytes(Import& import, uint64_t offset,
                           absl::string_view bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends a stream of `import`: an import not complete waits for another
  // stream to resume it, and is dropped if none does within the idle
  // timeout (or when its session is deleted).
  void EndImport(Import& import) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until the journal thread has written every block filled so far
  // (tests, benchmarks).
  void WaitForJournals() ABSL_LOCKS_EXCLUDED(journal_mu_);

  // Frees the sessions idle past the timeout as of `now`; the background
  // thread calls it, tests may too.
  void ExpireIdle(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);

  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);
  const Options& options() const { return options_; }

 private:
  // What a session being loaded counts (CountLoad).
  struct LoadCount {
    size_t bytes = 0;
    size_t reserved = 0;
  };
  // A session and the lock that runs its steps one at a time. An evicted
  // session is saved when its slot goes (after its last step).
  struct Slot {
    ~Slot();
    Mutex step_mu;
    std::unique_ptr<DecodeSession> session;
    std::string id;  // set when opened, before it is shared
    // Set on eviction with a directory: where and under which id to save.
    SessionDirectory* save_to = nullptr;
    std::string save_as;
    SessionStore* store = nullptr;  // counts the save
    // Its journal: the file, the full blocks written per layer, the
    // rewinds recorded (a block copied before one is stale), whether it
    // waits for the journal thread, and whether journaling stopped (a
    // failed write; the session saved). Appends to the file are serialized
    // by journal_mu, taken after step_mu when both are held. Set when
    // deleted or expired: the journal goes with the session (at once, by
    // RemoveJournals).
    Mutex journal_mu ABSL_ACQUIRED_AFTER(step_mu);
    std::unique_ptr<SessionJournal> journal ABSL_GUARDED_BY(journal_mu);
    std::vector<int64_t> journaled ABSL_GUARDED_BY(journal_mu);
    // The shared prefix (DecodeSession::SharedBase::key) whose base file
    // the journal names; empty: none.
    std::string journal_base_key ABSL_GUARDED_BY(journal_mu);
    int64_t rewinds ABSL_GUARDED_BY(journal_mu) = 0;
    std::atomic<bool> journal_queued{false};
    bool journal_off ABSL_GUARDED_BY(journal_mu) = false;
    std::atomic<bool> drop_journal{false};
    // Per layer, whether its length is unconfirmed (recovered from a
    // journal, no step has given its position since); empty once none is
    // (so that non-empty means "some layer is").
    std::vector<bool> unconfirmed ABSL_GUARDED_BY(step_mu);
  };
  struct Entry {
    std::shared_ptr<Slot> slot;
    size_t accounted_bytes = 0;             // counted in bytes_
    size_t reserved_bytes = 0;              // counted in reserved_
    size_t bookkeeping = 0;                 // counted in bookkeeping_
    const MultiHeadLayer* model = nullptr;  // a key of models_, or null
    absl::Time last_used;
    int active_steps = 0;                  // running steps never expire
    std::list<std::string>::iterator lru;  // in lru_
    std::vector<const void*> shared;       // keys of shared_ it holds
    uint64_t prefix_key = 0;               // its key in prefix_holders_
  };
  // A frozen cache of forked sessions, counted once in bytes_ and
  // reserved_.
  struct Shared {
    size_t bytes = 0;
    size_t reserved_bytes = 0;
    int holders = 0;
  };
  // A model layer sessions hold, counted once in superseded_ while it is
  // no longer served.
  struct HeldModel {
    size_t bytes = 0;
    int holders = 0;
    bool superseded = false;
  };
  enum class GoneReason { kExpired, kEvicted, kDeleted, kSaved, kClosed };

  absl::StatusOr<Entry*> Lookup(absl::string_view id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Lookup's slot, shared (it lives while the caller holds it).
  absl::StatusOr<std::shared_ptr<Slot>> SlotOf(absl::string_view id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Whether `id` is open here as `slot` (not gone, not another session
  // since taken up or renamed onto the id).
  bool HoldsSlot(const std::string& id, const Slot& slot) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // With a directory: takes session `id` from it if the store does not
  // hold it and it was not deleted or expired here (unless `reused`). OK
  // also when there is no file (the caller's lookup then says NOT_FOUND);
  // the load's error otherwise (a corrupt file: DATA_LOSS).
  absl::Status TakeIfSaved(absl::string_view id, bool reused = false,
                           PeerWait wait = PeerWait::kAllowed)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Records session `id` as held here (the holder).
  void Hold(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Add under a given id (nullopt: a new one), its lengths `unconfirmed`
  // or not; ALREADY_EXISTS when open.
  absl::StatusOr<std::string> AddAs(std::unique_ptr<DecodeSession> session,
                                    std::optional<std::string> id,
                                    bool unconfirmed = false,
                                    uint64_t prefix_key = 0)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A session taken up (from a file, a journal or an import) as `loaded`,
  // sharing memory again with the session held here that it was forked
  // alike with: the last one taken up whose first block was the same
  // (`prefix_key`, set here: what AddAs records the session under). The
  // result is a fork of that one at the tokens both hold alike
  // (DecodeSession::SharedPrefix) holding `loaded`'s later tokens, or
  // `loaded` itself when none is shared or no room can be made for the
  // fork: sharing saves memory, it is never needed.
  std::unique_ptr<DecodeSession> ShareWithHeld(
      std::unique_ptr<DecodeSession> loaded, uint64_t& prefix_key)
      ABSL_LOCKS_EXCLUDED(mu_);
  // After `session`'s cache may have been frozen by a fork: its entry
  // counts the frozen caches it holds as shared, and its own cache anew.
  void RecountOwn(Entry& entry, const DecodeSession& session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The memory of the frozen caches `session` holds that no session here
  // holds yet.
  size_t UncountedSharedBytes(const DecodeSession& session) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // TakeIfSaved's parts: the session file of `id`, or, when no process
  // holds it, its journal (`recovered` set); `count` what it counts in the
  // budget while it loads (CountLoad), for the caller to uncount.
  absl::StatusOr<std::unique_ptr<DecodeSession>> TakeSaved(
      absl::string_view id, SessionFileHeader& header, bool& recovered,
      LoadCount& count, PeerWait wait) ABSL_LOCKS_EXCLUDED(mu_);
  // Asks the live replica recorded as holding `id` (not this one) to save
  // it to the directory, whatever it answers; false when none is recorded.
  // With kRefused, asks nothing: the IsWouldWait status when one is.
  absl::StatusOr<bool> AskHolderToSave(absl::string_view id, PeerWait wait)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Journaling. Whether the store journals; queues `slot` for the journal
  // thread; the journal thread's loop and its work on one slot (creating
  // the journal, appending the blocks filled since, rewriting a journal
  // grown past twice what it holds); appends a slot's blocks to `journal`;
  // stops journaling a slot (its file removed, counted as a failure).
  bool journaling() const {
    return options_.journal && options_.directory != nullptr;
  }
  void QueueJournal(const std::shared_ptr<Slot>& slot)
      ABSL_LOCKS_EXCLUDED(journal_mu_);
  void JournalLoop() ABSL_LOCKS_EXCLUDED(journal_mu_);
  void WriteJournal(Slot& slot) ABSL_LOCKS_EXCLUDED(slot.step_mu);
  // One block of WriteJournal: the next full block not yet written,
  // copied under the step lock and appended after it (unless a rewind came
  // between); whether there was one.
  bool WriteNextBlock(Slot& slot, std::string& rows)
      ABSL_LOCKS_EXCLUDED(slot.step_mu, slot.journal_mu);
  absl::Status AppendBlocks(Slot& slot, SessionJournal& journal)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(slot.step_mu, slot.journal_mu);
  // A new journal of every full block the session holds (`with_blocks`;
  // otherwise its header only, the blocks to follow), published.
  absl::Status StartJournal(Slot& slot, bool with_blocks)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(slot.step_mu, slot.journal_mu);
  // The slot's journal file goes and it journals no more.
  void EndJournal(Slot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(slot.journal_mu);
  // EndJournal after a failed write, counted.
  void DropJournal(Slot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(slot.journal_mu);
  // The journals of `freed` slots of deleted or expired sessions go.
  void RemoveJournals(const std::vector<std::shared_ptr<Slot>>& freed)
      ABSL_LOCKS_EXCLUDED(mu_);
  // After a successful step of `inputs` on `slot`: a rewind below blocks
  // journaled is recorded before the step answers; blocks that filled are
  // queued; a step that gave its position confirms its layer's length.
  void AfterStep(const std::shared_ptr<Slot>& slot,
                 const DecodeStepInputs& inputs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(slot->step_mu);
  // ABORTED when the step's layer is unconfirmed and it gives no position,
  // or one past the tokens the layer holds.
  absl::Status VerifyConfirmed(const Slot& slot,
                               const DecodeStepInputs& inputs) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(slot.step_mu);
  // Saves `slot` (its step lock held) as session `id`, ending its journal.
  absl::Status SaveSlot(const std::string& id, Slot& slot,
                        uint32_t file_version = kSessionFileVersion)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(slot.step_mu);
  absl::Status NotFound(absl::string_view id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when forks share max_sessions frozen caches: each is
  // one more mapping (and a session's cache can be frozen once per fork),
  // which must stay within the process's vm.max_map_count.
  absl::Status VerifySharedCacheCount() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes `id`, remembering why; its slot is appended to `freed` so that
  // the memory is released after the lock.
  void Remove(std::string id, GoneReason reason,
              std::vector<std::shared_ptr<Slot>>& freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when `id`'s entry could not hold `bytes` of cache
  // even alone: beside its bookkeeping and, if no longer served, its
  // model's weights.
  absl::Status VerifyNeed(const std::string& id, const Entry& entry,
                          size_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Accounts `bytes` for `id`'s entry, evicting least recently used others
  // as needed; RESOURCE_EXHAUSTED if they cannot make room.
  absl::Status Reserve(const std::string& id, size_t bytes,
                       std::vector<std::shared_ptr<Slot>>& freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Settle(const std::string& id, const std::shared_ptr<Slot>& slot)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fork's parts: counts the frozen caches `session` holds that `entry`
  // does not yet; evicts least recently used sessions other than `keep`
  // until one more session reserving `reserved` fits; opens `slot` under a
  // new id.
  void AccountShared(Entry& entry, const DecodeSession& session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status MakeRoomBeside(const std::string& keep, size_t reserved,
                              size_t bytes,
                              std::vector<std::shared_ptr<Slot>>& freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Opens `slot` under a new id, accounting its reservation and
  // bookkeeping; its model must be held already (HoldModel).
  std::string Open(std::shared_ptr<Slot> slot, size_t reserved,
                   std::optional<std::string> id = std::nullopt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The memory max_bytes limits, and the address space max_reserved_bytes
  // does.
  size_t budget_bytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return bytes_ + bookkeeping_ + superseded_ + loading_bytes_;
  }
  size_t reserved_space() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return reserved_ + bookkeeping_ + loading_reserved_;
  }
  // A model session's layer for a session file (Options::layer_of;
  // NOT_FOUND without one).
  absl::StatusOr<std::shared_ptr<const MultiHeadLayer>> LayerOf(
      absl::string_view model) const;
  // A session file loader's layer_of and verify: `store`'s LayerOf and
  // VerifyConfig. It must outlive the SessionFileLoader built on it.
  struct FileChecks {
    const SessionStore* store;
    absl::StatusOr<std::shared_ptr<const MultiHeadLayer>> operator()(
        absl::string_view model) const {
      return store->LayerOf(model);
    }
    absl::Status operator()(const DecodeSessionConfig& config) const {
      return store->VerifyConfig(config);
    }
  };
  // ImportBytes' parts: the builder a stream of `import` adds to (a
  // resumed import's, claimed for this stream); opens the import whose
  // header `import.head` holds (checks, room, its entry in imports_);
  // opens its session once complete; drops an import (its budget freed).
  absl::StatusOr<std::shared_ptr<SessionFileBuilder>> ClaimImport(
      Import& import) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status BeginImport(Import& import) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status FinishImport(Import& import) ABSL_LOCKS_EXCLUDED(mu_);
  void DropImport(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Loading a session: what the session of `header` counts once its
  // blocks are in (its whole cache and bookkeeping, and its address
  // space); counting that, having evicted least recently used sessions to
  // make room (RESOURCE_EXHAUSTED naming session `id` when they cannot);
  // and no longer counting it.
  static LoadCount CountOf(const SessionFileHeader& header,
                           const DecodeSession& session);
  absl::Status CountLoad(const std::string& id, const LoadCount& count,
                         std::vector<std::shared_ptr<Slot>>& freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UncountLoad(LoadCount& count) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts one more (fewer) session holding `session`'s model, if any.
  void HoldModel(const DecodeSession& session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseModel(const MultiHeadLayer* model)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RecountModels without the eviction; true when it counted more weights
  // than before.
  bool CountSupersededModels() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // StepMany's parts: takes each entry's session lock once, in address
  // order (a session named again fails that entry); then steps the
  // entries still OK in one kernel pass and settles their accounts.
  std::vector<Slot*> LockOnceEach(std::vector<std::shared_ptr<Slot>>& slots,
                                  std::vector<absl::Status>& statuses);
  void RunAndSettle(absl::Span<const StepInput> steps,
                    const std::vector<std::shared_ptr<Slot>>& slots,
                    std::vector<absl::Status>& statuses)
      ABSL_LOCKS_EXCLUDED(mu_);
  void ReaperLoop() ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  mutable Mutex mu_;
  CondVar reaper_wake_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<std::string, Entry> sessions_ ABSL_GUARDED_BY(mu_);
  // Ids, most recently used first.
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
  size_t bookkeeping_ ABSL_GUARDED_BY(mu_) = 0;
  // The models sessions hold, by layer, and the weights of those
  // superseded.
  absl::flat_hash_map<const MultiHeadLayer*, HeldModel> models_
      ABSL_GUARDED_BY(mu_);
  size_t superseded_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<const void*, Shared> shared_ ABSL_GUARDED_BY(mu_);
  // Sessions taken up, by a key of their config and first block: the one
  // a session taken up next with the same key shares blocks with.
  absl::flat_hash_map<uint64_t, std::string> prefix_holders_
      ABSL_GUARDED_BY(mu_);
  Stats counts_ ABSL_GUARDED_BY(mu_);
  // Why recent sessions are gone, for the NOT_FOUND message (bounded).
  // Each record has a serial number, and gone_order_ the ids with the
  // serial they were queued with: an id gone again is queued again, and
  // its older entry must not drop the newer record.
  struct GoneRecord {
    GoneReason reason;
    uint64_t serial = 0;
  };
  absl::flat_hash_map<std::string, GoneRecord> gone_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<std::string, uint64_t>> gone_order_ ABSL_GUARDED_BY(mu_);
  uint64_t gone_serial_ ABSL_GUARDED_BY(mu_) = 0;
  std::mt19937_64 id_bits_ ABSL_GUARDED_BY(mu_);
  // Imports under way, by session id: the file taken so far, what it
  // counts in the budget (its whole cache, from its header on) and in the
  // address space, when a stream last took bytes, and the stream taking
  // them now (null between streams).
  struct PendingImport {
    std::shared_ptr<SessionFileBuilder> builder;
    uint64_t received = 0;  // builder->received() after its last piece
    LoadCount count;
    absl::Time last_used;
    const Import* stream = nullptr;
  };
  absl::flat_hash_map<std::string, PendingImport> imports_ ABSL_GUARDED_BY(mu_);
  // Sessions being loaded (imports under way, sessions taken from the
  // directory): what they count in the budget and the address space, each
  // its whole cache from its header on, until it opens.
  size_t loading_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t loading_reserved_ ABSL_GUARDED_BY(mu_) = 0;
  std::string holder_ ABSL_GUARDED_BY(mu_);
  std::thread reaper_;
  // The journal thread's queue (slots whose blocks filled), whether it is
  // writing, and its stop.
  Mutex journal_mu_;
  CondVar journal_wake_;
  CondVar journal_idle_;
  std::deque<std::weak_ptr<Slot>> journal_queue_ ABSL_GUARDED_BY(journal_mu_);
  bool journal_busy_ ABSL_GUARDED_BY(journal_mu_) = false;
  bool journal_stopping_ ABSL_GUARDED_BY(journal_mu_) = false;
  std::thread journaler_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_SESSION_STORE_H_
