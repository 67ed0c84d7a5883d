#include "core/session_store.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "core/verify.h"

namespace attnserve {
namespace {

// How many gone ids keep their reason for the NOT_FOUND message.
constexpr size_t kRememberedGoneIds = 4096;

// Ids are 32 hex digits; anything much longer is no id, and is not echoed
// (the status must stay small enough to reach the client).
constexpr size_t kMaxIdBytes = 128;

absl::Status VerifySessionId(absl::string_view id) {
  if (id.empty()) {
    return absl::InvalidArgumentError(
        "session_id: empty, expected the id CreateSession returned");
  }
  if (id.size() > kMaxIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("session_id: ", id.size(),
                     " bytes, longer than any session id (32 hex digits)"));
  }
  return absl::OkStatus();
}

// An id a caller chose (AddNamed, Fork's `as`): one that can name a file.
absl::Status VerifyChosenId(absl::string_view id) {
  if (!SessionDirectory::IsStorableId(id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("session_id: ", EchoString(id, '"'),
                     " is not 1 to 64 lowercase hex digits"));
  }
  return absl::OkStatus();
}

absl::Status IsOpen(absl::string_view id) {
  return absl::AlreadyExistsError(
      absl::StrCat("session_id: ", EchoString(id, '"'), " is open"));
}

// The payload that marks a status as WouldWait's.
constexpr absl::string_view kWouldWaitPayload = "attnserve.would_wait";

// A kRefused call's where it would wait for `holder` to hand `id` over:
// UNAVAILABLE, which a client may retry, should it ever reach one.
absl::Status WouldWait(absl::string_view id, absl::string_view holder) {
  absl::Status status = absl::UnavailableError(absl::StrCat(
      "session ", EchoString(id, '"'), " moved to replica ",
      EchoString(holder, '"'), " while this call was answered; try again"));
  status.SetPayload(kWouldWaitPayload, absl::Cord());
  return status;
}

absl::Duration ReaperPeriod(absl::Duration idle_timeout) {
  return std::clamp(idle_timeout / 4, absl::Milliseconds(10), absl::Seconds(1));
}

}  // namespace

bool IsWouldWait(const absl::Status& status) {
  return absl::IsUnavailable(status) &&
         status.GetPayload(kWouldWaitPayload).has_value();
}

SessionStore::SessionStore(const Options& options)
    : options_(options),
      id_bits_(std::random_device{}()),
      holder_(options.holder) {
  if (options_.idle_timeout != absl::InfiniteDuration()) {
    reaper_ = std::thread([this] { ReaperLoop(); });
  }
  if (journaling()) journaler_ = std::thread([this] { JournalLoop(); });
}

SessionStore::~SessionStore() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  reaper_wake_.SignalAll();
  if (reaper_.joinable()) reaper_.join();
  {
    MutexLock lock(&journal_mu_);
    journal_stopping_ = true;
  }
  journal_wake_.SignalAll();
  if (journaler_.joinable()) journaler_.join();
  Clear();
}

void SessionStore::ReaperLoop() {
  const auto period =
      absl::ToChronoMilliseconds(ReaperPeriod(options_.idle_timeout));
  while (true) {
    {
      MutexLock lock(&mu_);
      if (stopping_) return;
      reaper_wake_.WaitFor(&mu_, period);
      if (stopping_) return;
    }
    ExpireIdle(absl::Now());
    // A reload may have replaced models that sessions hold.
    RecountModels();
  }
}

size_t SessionStore::max_session_bytes() const {
  if (options_.max_bytes == 0) return options_.max_reserved_bytes;
  if (options_.max_reserved_bytes == 0) return options_.max_bytes;
  return std::min(options_.max_bytes, options_.max_reserved_bytes);
}

absl::Status SessionStore::VerifyReservation(size_t bytes) const {
  const size_t limit = max_session_bytes();
  if (limit == 0 || bytes <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("session: its cache would reserve ", bytes,
                   " bytes for its max_length, more than the ", limit,
                   " bytes one session may hold"));
}

namespace {

// What a limit of one session is, for messages: the budget's flag, or the
// address space.
std::string SessionLimit(size_t limit, size_t max_bytes) {
  if (limit != max_bytes) {
    return absl::StrCat("the ", limit,
                        " bytes of address space one session may reserve");
  }
  constexpr size_t kMiB = size_t{1} << 20;
  if (limit % kMiB == 0) {
    return absl::StrCat("--max_session_memory_mb ", limit / kMiB,
                        " allows one session");
  }
  return absl::StrCat("the session memory limit of ", limit,
                      " bytes (--max_session_memory_mb) allows one session");
}

// A session's cache reservation and bookkeeping together.
size_t SessionBytes(const KvCache::Dims& dims) {
  const absl::StatusOr<size_t> reserved = KvCache::ReservedBytes(dims);
  if (!reserved.ok()) return std::numeric_limits<size_t>::max();
  return *reserved + DecodeSession::BookkeepingBytes(dims);
}

}  // namespace

absl::Status SessionStore::VerifyFits(const KvCache::Dims& dims) const {
  ATTN_ASSIGN_OR_RETURN(const size_t reserved, KvCache::ReservedBytes(dims));
  ATTN_RETURN_IF_ERROR(VerifyReservation(reserved));
  const size_t limit = max_session_bytes();
  const size_t bookkeeping = DecodeSession::BookkeepingBytes(dims);
  if (limit == 0 || reserved + bookkeeping <= limit) return absl::OkStatus();
  if (dims.layers == 1) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "max_length: its cache reserves ", reserved, " bytes and its ",
        "bookkeeping (lengths and block tables) ", bookkeeping, ", ",
        reserved + bookkeeping, " in all, more than ",
        SessionLimit(limit, options_.max_bytes)));
  }
  // The most layers that fit: fewer layers need less of both.
  int64_t fits = 0, too_many = dims.layers;
  while (too_many - fits > 1) {
    KvCache::Dims fewer = dims;
    fewer.layers = fits + (too_many - fits) / 2;
    (SessionBytes(fewer) <= limit ? fits : too_many) = fewer.layers;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("num_layers: ", dims.layers, " layers reserve ", reserved,
                   " bytes of cache and ", bookkeeping,
                   " of bookkeeping (lengths and block tables, ",
                   SessionLayers::LayerBytes(dims), " bytes a layer), ",
                   reserved + bookkeeping, " in all, more than ",
                   SessionLimit(limit, options_.max_bytes), "; ",
                   fits > 0 ? absl::StrCat("at most ", fits, " layers fit")
                            : std::string("not one layer fits")));
}

absl::Status SessionStore::VerifyConfig(
    const DecodeSessionConfig& config) const {
  ATTN_ASSIGN_OR_RETURN(const KvCache::Dims dims,
                        DecodeSession::CacheDims(config));
  return VerifyFits(dims);
}

absl::StatusOr<std::string> SessionStore::Add(
    std::unique_ptr<DecodeSession> session) {
  return AddAs(std::move(session), std::nullopt);
}

absl::StatusOr<std::string> SessionStore::AddNamed(
    std::unique_ptr<DecodeSession> session, std::string id) {
  ATTN_RETURN_IF_ERROR(VerifyChosenId(id));
  return AddAs(std::move(session), std::move(id));
}

absl::StatusOr<std::string> SessionStore::AddAs(
    std::unique_ptr<DecodeSession> session, std::optional<std::string> id,
    bool unconfirmed, uint64_t prefix_key) {
  ATTN_RETURN_IF_ERROR(VerifyFits(session->cache_dims()));
  const size_t reserved = session->reserved_bytes();
  const size_t bookkeeping = session->bookkeeping_bytes();
  const size_t bytes = session->cache_bytes();
  auto slot = std::make_shared<Slot>();
  if (unconfirmed) {
    MutexLock step_lock(&slot->step_mu);
    slot->unconfirmed.assign(static_cast<size_t>(session->num_layers()), true);
  }
  slot->session = std::move(session);
  const std::shared_ptr<Slot> journaled = slot;
  std::vector<std::shared_ptr<Slot>> freed;
  MutexLock lock(&mu_);
  // Held first, so that evicting its other holders keeps it.
  HoldModel(*slot->session);
  CountSupersededModels();
  const auto no_room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return (options_.max_sessions > 0 &&
            static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) ||
           (options_.max_reserved_bytes > 0 &&
            reserved_space() + reserved + bookkeeping >
                options_.max_reserved_bytes) ||
           (options_.max_bytes > 0 &&
            budget_bytes() + bookkeeping + bytes +
                    UncountedSharedBytes(*slot->session) >
                options_.max_bytes);
  };
  if (id.has_value() && sessions_.contains(*id)) {
    ReleaseModel(slot->session->config().layer.get());
    return IsOpen(*id);
  }
  while (no_room() && !lru_.empty()) {
    Remove(lru_.back(), GoneReason::kEvicted, freed);
  }
  std::string opened = Open(std::move(slot), reserved, std::move(id));
  Entry& entry = sessions_.at(opened);
  AccountShared(entry, *entry.slot->session);
  if (prefix_key != 0) {
    entry.prefix_key = prefix_key;
    prefix_holders_[prefix_key] = opened;
  }
  Hold(opened);
  QueueJournal(journaled);
  return opened;
}

void SessionStore::Hold(const std::string& id) {
  if (options_.directory != nullptr && !holder_.empty()) {
    options_.directory->Hold(id, holder_);
  }
}

void SessionStore::SetHolder(std::string holder) {
  MutexLock lock(&mu_);
  holder_ = std::move(holder);
}

std::string SessionStore::Open(std::shared_ptr<Slot> slot, size_t reserved,
                               std::optional<std::string> given) {
  std::string id;
  if (given.has_value()) {
    id = *std::move(given);
    gone_.erase(id);  // its entry in gone_order_ ages out
  } else {
    do {
      id = absl::StrFormat("%016x%016x", id_bits_(), id_bits_());
    } while (sessions_.contains(id) || gone_.contains(id));
  }
  lru_.push_front(id);
  slot->id = id;
  const DecodeSession& session = *slot->session;
  Entry& entry = sessions_[id];
  entry.last_used = absl::Now();
  entry.lru = lru_.begin();
  entry.reserved_bytes = reserved;
  reserved_ += reserved;
  entry.bookkeeping = session.bookkeeping_bytes();
  bookkeeping_ += entry.bookkeeping;
  entry.accounted_bytes = session.cache_bytes();
  bytes_ += entry.accounted_bytes;
  entry.model = session.config().layer.get();
  entry.slot = std::move(slot);
  ++counts_.created;
  return id;
}

void SessionStore::HoldModel(const DecodeSession& session) {
  const MultiHeadLayer* layer = session.config().layer.get();
  if (layer == nullptr) return;
  HeldModel& model = models_[layer];
  if (model.holders++ == 0) model.bytes = session.model_bytes();
}

void SessionStore::ReleaseModel(const MultiHeadLayer* layer) {
  if (layer == nullptr) return;
  const auto it = models_.find(layer);
  if (--it->second.holders > 0) return;
  if (it->second.superseded) superseded_ -= it->second.bytes;
  models_.erase(it);
}

bool SessionStore::CountSupersededModels() {
  if (!options_.model_served) return false;
  const size_t before = superseded_;
  for (auto& [layer, model] : models_) {
    const bool superseded = !options_.model_served(*layer);
    if (superseded == model.superseded) continue;
    model.superseded = superseded;
    if (superseded) {
      superseded_ += model.bytes;
    } else {
      superseded_ -= model.bytes;
    }
  }
  return superseded_ > before;
}

void SessionStore::RecountModels() {
  std::vector<std::shared_ptr<Slot>> freed;
  MutexLock lock(&mu_);
  // Only newly counted weights make room here: steps and creates make their
  // own.
  if (!CountSupersededModels()) return;
  while (options_.max_bytes > 0 && budget_bytes() > options_.max_bytes &&
         !lru_.empty()) {
    Remove(lru_.back(), GoneReason::kEvicted, freed);
  }
}

size_t SessionStore::UncountedSharedBytes(const DecodeSession& session) const {
  size_t bytes = 0;
  for (const DecodeSession::SharedCache& cache : session.shared_caches()) {
    if (!shared_.contains(cache.id)) bytes += cache.bytes;
  }
  return bytes;
}

void SessionStore::RecountOwn(Entry& entry, const DecodeSession& session) {
  AccountShared(entry, session);
  const size_t own = session.cache_bytes();
  bytes_ = bytes_ - entry.accounted_bytes + own;
  entry.accounted_bytes = own;
  const size_t own_reserved = session.reserved_bytes();
  reserved_ = reserved_ - entry.reserved_bytes + own_reserved;
  entry.reserved_bytes = own_reserved;
}

void SessionStore::AccountShared(Entry& entry, const DecodeSession& session) {
  for (const DecodeSession::SharedCache& cache : session.shared_caches()) {
    if (std::find(entry.shared.begin(), entry.shared.end(), cache.id) !=
        entry.shared.end()) {
      continue;
    }
    entry.shared.push_back(cache.id);
    Shared& shared = shared_[cache.id];
    if (shared.holders++ == 0) {
      shared.bytes = cache.bytes;
      shared.reserved_bytes = cache.reserved_bytes;
      bytes_ += cache.bytes;
      reserved_ += cache.reserved_bytes;
    }
  }
}

absl::Status SessionStore::MakeRoomBeside(
    const std::string& keep, size_t reserved, size_t bytes,
    std::vector<std::shared_ptr<Slot>>& freed) {
  while (true) {
    const bool too_many =
        options_.max_sessions > 0 &&
        static_cast<int64_t>(sessions_.size()) >= options_.max_sessions;
    const bool too_large =
        options_.max_reserved_bytes > 0 &&
        reserved_space() + reserved > options_.max_reserved_bytes;
    const bool too_full =
        options_.max_bytes > 0 && budget_bytes() + bytes > options_.max_bytes;
    if (!too_many && !too_large && !too_full) return absl::OkStatus();
    auto victim = lru_.rbegin();
    if (victim != lru_.rend() && *victim == keep) ++victim;
    if (victim == lru_.rend()) {
      std::string why;
      if (too_many) {
        why = absl::StrCat(": max_sessions ", options_.max_sessions,
                           " would be passed");
      } else if (too_large) {
        why = absl::StrCat(": its cache would reserve ", reserved,
                           " bytes past max_reserved_bytes ",
                           options_.max_reserved_bytes);
      } else {
        why = absl::StrCat(": its ", bytes,
                           " bytes of bookkeeping would pass the session "
                           "memory limit of ",
                           options_.max_bytes, " bytes");
      }
      return absl::ResourceExhaustedError(absl::StrCat(
          "session_id: no room to fork session ", EchoString(keep, '"'), why));
    }
    Remove(std::string(*victim), GoneReason::kEvicted, freed);
  }
}

absl::StatusOr<std::string> SessionStore::Fork(absl::string_view id,
                                               std::optional<int64_t> length,
                                               int64_t* forked_length,
                                               std::optional<std::string> as,
                                               PeerWait wait) {
  if (as.has_value()) ATTN_RETURN_IF_ERROR(VerifyChosenId(*as));
  ATTN_RETURN_IF_ERROR(TakeIfSaved(id, /*reused=*/false, wait));
  ATTN_ASSIGN_OR_RETURN(const std::shared_ptr<Slot> slot, SlotOf(id));
  const std::string key(id);
  // Steps on the session wait: its cache may be frozen and counted anew.
  MutexLock step_lock(&slot->step_mu);
  std::vector<std::shared_ptr<Slot>> freed;
  {
    // Room first: a fork refused afterwards would have frozen the cache
    // for nothing (a later write copies a block of it).
    ATTN_ASSIGN_OR_RETURN(const size_t room,
                          slot->session->ForkReservedBytes(length));
    const size_t bookkeeping = slot->session->bookkeeping_bytes();
    MutexLock lock(&mu_);
    if (!sessions_.contains(key)) return NotFound(key);  // gone meanwhile
    if (as.has_value() && sessions_.contains(*as)) return IsOpen(*as);
    ATTN_RETURN_IF_ERROR(VerifySharedCacheCount());
    CountSupersededModels();
    ATTN_RETURN_IF_ERROR(
        MakeRoomBeside(key, room + bookkeeping, bookkeeping, freed));
  }
  freed.clear();
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<DecodeSession> fork,
                        slot->session->Fork(length));
  const int64_t fork_length = fork->length();
  const size_t reserved = fork->reserved_bytes();
  const size_t bookkeeping = fork->bookkeeping_bytes();
  auto fork_slot = std::make_shared<Slot>();
  fork_slot->session = std::move(fork);
  {
    MutexLock fork_lock(&fork_slot->step_mu);
    fork_slot->unconfirmed = slot->unconfirmed;
  }
  const std::shared_ptr<Slot> journaled = fork_slot;
  std::string fork_id;
  {
    MutexLock lock(&mu_);
    const auto it = sessions_.find(key);
    if (it == sessions_.end() || it->second.slot != slot) {
      return NotFound(key);  // gone meanwhile
    }
    // The session's cache may now be frozen: shared, counted once, and
    // the session's own cache a new one.
    RecountOwn(it->second, *slot->session);
    // Room was made above; a session opened since may have taken it.
    if (as.has_value() && sessions_.contains(*as)) return IsOpen(*as);
    ATTN_RETURN_IF_ERROR(
        MakeRoomBeside(key, reserved + bookkeeping, bookkeeping, freed));
    HoldModel(*fork_slot->session);
    fork_id = Open(std::move(fork_slot), reserved, std::move(as));
    Hold(fork_id);
    Entry& forked = sessions_.at(fork_id);
    AccountShared(forked, *forked.slot->session);
    ++counts_.forked;
  }
  QueueJournal(journaled);
  if (forked_length != nullptr) *forked_length = fork_length;
  return fork_id;
}

bool SessionStore::HoldsSlot(const std::string& id, const Slot& slot) const {
  const auto it = sessions_.find(id);
  return it != sessions_.end() && it->second.slot.get() == &slot;
}

absl::Status SessionStore::Rename(absl::string_view from,
                                  const std::string& to) {
  ATTN_RETURN_IF_ERROR(VerifyChosenId(to));
  ATTN_ASSIGN_OR_RETURN(const std::shared_ptr<Slot> slot, SlotOf(from));
  const std::string key(from);
  {
    // The id is read under the step lock (journal, messages).
    MutexLock step_lock(&slot->step_mu);
    MutexLock journal_lock(&slot->journal_mu);
    MutexLock lock(&mu_);
    const auto it = sessions_.find(key);
    if (it == sessions_.end() || it->second.slot != slot) {
      return NotFound(key);  // gone meanwhile
    }
    if (sessions_.contains(to)) return IsOpen(to);
    // The journal of the old id goes; the journal thread writes one under
    // the new id, with every full block.
    if (slot->journal != nullptr) slot->journal->Remove();
    slot->journal.reset();
    Entry entry = std::move(it->second);
    sessions_.erase(it);
    *entry.lru = to;
    sessions_.emplace(to, std::move(entry));
    slot->id = to;
    gone_.erase(to);
    if (options_.directory != nullptr && !holder_.empty()) {
      options_.directory->Release(key);
    }
    Hold(to);
  }
  QueueJournal(slot);
  return absl::OkStatus();
}

absl::Status SessionStore::VerifySharedCacheCount() const {
  if (options_.max_sessions <= 0 ||
      static_cast<int64_t>(shared_.size()) < options_.max_sessions) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "session_id: forks already share ", shared_.size(),
      " frozen caches, as many as max_sessions ", options_.max_sessions,
      " allows; delete sessions that forked or were forked first"));
}

absl::Status SessionStore::NotFound(absl::string_view id) const {
  if (const auto importing = imports_.find(id); importing != imports_.end()) {
    return absl::UnavailableError(
        absl::StrCat("session_id: session ", EchoString(id, '"'),
                     " is being imported (", importing->second.received, " of ",
                     importing->second.builder->expected_size(),
                     " bytes taken); it opens once its last byte has come"));
  }
  const auto gone = gone_.find(id);
  const std::string what =
      absl::StrCat("session_id: session ", EchoString(id, '"'));
  const absl::string_view advice = "; create a new one and prefill it";
  if (gone == gone_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "session_id: no session ", EchoString(id, '"'),
        " (expired, evicted, deleted, or opened on another replica)", advice));
  }
  switch (gone->second.reason) {
    case GoneReason::kExpired:
      return absl::NotFoundError(absl::StrCat(
          what, " expired after ", absl::FormatDuration(options_.idle_timeout),
          " idle", advice));
    case GoneReason::kEvicted:
      return absl::NotFoundError(
          absl::StrCat(what,
                       " was evicted (least recently used) to make room for "
                       "other sessions",
                       advice));
    case GoneReason::kSaved:
      return absl::NotFoundError(absl::StrCat(
          what,
          " was saved to the session directory, and its file is gone (taken "
          "up by another replica, or removed)",
          advice));
    case GoneReason::kClosed:
      return absl::NotFoundError(
          absl::StrCat(what, " was closed with its server", advice));
    case GoneReason::kDeleted:
      break;
  }
  return absl::NotFoundError(absl::StrCat(what, " was deleted"));
}

absl::StatusOr<SessionStore::Entry*> SessionStore::Lookup(
    absl::string_view id) {
  ATTN_RETURN_IF_ERROR(VerifySessionId(id));
  const auto it = sessions_.find(id);
  if (it == sessions_.end()) return NotFound(id);
  Entry& entry = it->second;
  entry.last_used = absl::Now();
  lru_.splice(lru_.begin(), lru_, entry.lru);
  return &entry;
}

void SessionStore::Remove(std::string id, GoneReason reason,
                          std::vector<std::shared_ptr<Slot>>& freed) {
  const auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  bytes_ -= it->second.accounted_bytes;
  reserved_ -= it->second.reserved_bytes;
  bookkeeping_ -= it->second.bookkeeping;
  ReleaseModel(it->second.model);
  for (const void* key : it->second.shared) {
    const auto shared = shared_.find(key);
    if (--shared->second.holders > 0) continue;
    // The last holder: its memory goes with this session.
    bytes_ -= shared->second.bytes;
    reserved_ -= shared->second.reserved_bytes;
    shared_.erase(shared);
  }
  lru_.erase(it->second.lru);
  const auto prefix = prefix_holders_.find(it->second.prefix_key);
  if (prefix != prefix_holders_.end() && prefix->second == id) {
    prefix_holders_.erase(prefix);
  }
  // A saved session's record went before its save: another replica may
  // have taken it up and written its own since.
  if (options_.directory != nullptr && !holder_.empty() &&
      reason != GoneReason::kSaved) {
    options_.directory->Release(id);
  }
  if (reason == GoneReason::kDeleted || reason == GoneReason::kExpired) {
    it->second.slot->drop_journal = true;
  }
  if (reason == GoneReason::kEvicted && options_.directory != nullptr) {
    Slot& slot = *it->second.slot;
    slot.save_to = options_.directory;
    slot.save_as = id;
    slot.store = this;
  }
  freed.push_back(std::move(it->second.slot));
  sessions_.erase(it);
  switch (reason) {
    case GoneReason::kExpired:
      ++counts_.expired;
      break;
    case GoneReason::kEvicted:
      ++counts_.evicted;
      break;
    case GoneReason::kDeleted:
      ++counts_.deleted;
      break;
    case GoneReason::kSaved:  // counted by SaveAll
    case GoneReason::kClosed:
      break;
  }
  // By the queue's length: ids opened again (a sequence's) leave gone_ but
  // stay queued, and an entry drops only the record it was queued with.
  while (gone_order_.size() >= kRememberedGoneIds) {
    const auto& [old_id, serial] = gone_order_.front();
    const auto old = gone_.find(old_id);
    if (old != gone_.end() && old->second.serial == serial) gone_.erase(old);
    gone_order_.pop_front();
  }
  const uint64_t serial = ++gone_serial_;
  gone_[id] = {reason, serial};
  gone_order_.emplace_back(std::move(id), serial);
}

absl::Status SessionStore::VerifyNeed(const std::string& id, const Entry& entry,
                                      size_t bytes) const {
  // What evicting every other session cannot free: its own cache, its
  // bookkeeping, and its model's weights if no longer served.
  const auto model = models_.find(entry.model);
  const size_t weights = model != models_.end() && model->second.superseded
                             ? model->second.bytes
                             : 0;
  if (options_.max_bytes == 0 ||
      bytes + entry.bookkeeping + weights <= options_.max_bytes) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "session_id: session ", EchoString(id, '"'), " would need ", bytes,
      " bytes of cache", weights > 0 ? ", " : " and ", entry.bookkeeping,
      " of bookkeeping",
      weights > 0
          ? absl::StrCat(" and ", weights,
                         " of the weights of its model, which the repository "
                         "no longer serves")
          : "",
      ", more than the server's session memory limit of ", options_.max_bytes,
      " bytes", weights > 0 ? "; open a new session on the served model" : ""));
}

absl::Status SessionStore::Reserve(const std::string& id, size_t bytes,
                                   std::vector<std::shared_ptr<Slot>>& freed) {
  Entry* entry = &sessions_.at(id);
  if (bytes <= entry->accounted_bytes) return absl::OkStatus();
  const size_t extra = bytes - entry->accounted_bytes;
  ATTN_RETURN_IF_ERROR(VerifyNeed(id, *entry, bytes));
  while (options_.max_bytes > 0 &&
         budget_bytes() + extra > options_.max_bytes) {
    // The least recently used other session goes (this one is at the front).
    const std::string victim = lru_.back();
    if (victim == id) break;
    Remove(victim, GoneReason::kEvicted, freed);
  }
  entry = &sessions_.at(id);  // Remove may rehash
  bytes_ += extra;
  entry->accounted_bytes = bytes;
  return absl::OkStatus();
}

void SessionStore::Settle(const std::string& id,
                          const std::shared_ptr<Slot>& slot) {
  const auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.slot != slot) return;  // gone
  Entry& entry = it->second;
  --entry.active_steps;
  const size_t now_bytes = slot->session->cache_bytes();
  bytes_ = bytes_ - entry.accounted_bytes + now_bytes;
  entry.accounted_bytes = now_bytes;
  entry.last_used = absl::Now();
}

absl::Status SessionStore::Step(absl::string_view id,
                                const DecodeStepInputs& inputs,
                                const DecodeStepOptions& options,
                                ResultAllocator& results, int64_t* length) {
  ATTN_RETURN_IF_ERROR(TakeIfSaved(id));
  ATTN_ASSIGN_OR_RETURN(const std::shared_ptr<Slot> slot, SlotOf(id));
  DecodeSession& session = *slot->session;
  ATTN_ASSIGN_OR_RETURN(const int64_t new_tokens, session.NewTokens(inputs));
  const std::string key(id);
  absl::Status status;
  MutexLock step_lock(&slot->step_mu);
  ATTN_RETURN_IF_ERROR(VerifyConfirmed(*slot, inputs));
  std::vector<std::shared_ptr<Slot>> freed;
  {
    MutexLock lock(&mu_);
    // Gone meanwhile, or another session under its id (taken up again,
    // renamed onto it).
    if (!HoldsSlot(key, *slot)) return NotFound(key);
    // A step past max_length is refused by the session itself; making room
    // for it first would evict other sessions for nothing.
    const int64_t after = session.LengthAfter(inputs, new_tokens);
    if (after <= session.max_length()) {
      ATTN_RETURN_IF_ERROR(
          Reserve(key, session.BytesAfter(inputs, new_tokens), freed));
    }
    ++sessions_.at(key).active_steps;
  }
  freed.clear();  // evicted sessions' memory goes back before computing
  {
    // Settled however the step ends, an exception included.
    absl::Cleanup settle = [&] {
      MutexLock lock(&mu_);
      Settle(key, slot);
    };
    status = session.Step(inputs, options, results);
  }
  if (status.ok()) AfterStep(slot, inputs);
  if (length != nullptr) *length = session.length(inputs.layer);
  return status;
}

// The step locks of the batch's sessions are taken in a loop (address
// order), which the thread-safety analysis cannot follow.
std::vector<absl::Status> SessionStore::StepMany(
    absl::Span<const StepInput> steps) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const size_t count = steps.size();
  std::vector<absl::Status> statuses(count);
  std::vector<std::shared_ptr<Slot>> slots(count);
  for (size_t i = 0; i < count; ++i) statuses[i] = TakeIfSaved(steps[i].id);
  {
    MutexLock lock(&mu_);
    for (size_t i = 0; i < count; ++i) {
      if (!statuses[i].ok()) continue;
      auto entry = Lookup(steps[i].id);
      if (!entry.ok()) {
        statuses[i] = entry.status();
      } else {
        slots[i] = (*entry)->slot;
      }
    }
  }
  std::vector<int64_t> new_tokens(count, 0);
  for (size_t i = 0; i < count; ++i) {
    if (slots[i] == nullptr) continue;
    if (steps[i].results == nullptr) {
      statuses[i] = absl::InvalidArgumentError(
          absl::StrCat("steps[", i, "]: results: missing"));
    } else if (auto n = slots[i]->session->NewTokens(steps[i].inputs);
               !n.ok()) {
      statuses[i] = n.status();
    } else {
      new_tokens[i] = *n;
    }
    if (!statuses[i].ok()) slots[i] = nullptr;
  }
  std::vector<Slot*> locked = LockOnceEach(slots, statuses);
  for (size_t i = 0; i < count; ++i) {
    if (slots[i] == nullptr) continue;
    if (absl::Status confirmed = VerifyConfirmed(*slots[i], steps[i].inputs);
        !confirmed.ok()) {
      statuses[i] = std::move(confirmed);
      slots[i] = nullptr;  // still locked, through `locked`
    }
  }
  std::vector<std::shared_ptr<Slot>> freed;
  {
    MutexLock lock(&mu_);
    for (size_t i = 0; i < count; ++i) {
      if (slots[i] == nullptr) continue;
      const auto it = sessions_.find(steps[i].id);
      absl::Status status;
      if (it == sessions_.end() || it->second.slot != slots[i]) {
        status = NotFound(steps[i].id);  // gone meanwhile
      } else {
        const DecodeSession& session = *slots[i]->session;
        // Past max_length the step refuses itself: no room made for it.
        const int64_t after =
            session.LengthAfter(steps[i].inputs, new_tokens[i]);
        if (after <= session.max_length()) {
          status = Reserve(steps[i].id,
                           session.BytesAfter(steps[i].inputs, new_tokens[i]),
                           freed);
        }
      }
      if (!status.ok()) {
        statuses[i] = std::move(status);
        continue;
      }
      ++sessions_.at(steps[i].id).active_steps;
    }
  }
  freed.clear();  // evicted sessions' memory goes back before computing
  RunAndSettle(steps, slots, statuses);
  for (size_t i = 0; i < count; ++i) {
    if (slots[i] != nullptr && statuses[i].ok()) {
      AfterStep(slots[i], steps[i].inputs);
    }
  }
  for (Slot* slot : locked) slot->step_mu.Unlock();
  return statuses;
}

std::vector<SessionStore::Slot*> SessionStore::LockOnceEach(
    std::vector<std::shared_ptr<Slot>>& slots,
    std::vector<absl::Status>& statuses) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const size_t count = slots.size();
  // Each session once (its first entry), locked in address order.
  std::vector<size_t> order;
  for (size_t i = 0; i < count; ++i) {
    if (slots[i] != nullptr) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::less<const Slot*>()(slots[a].get(), slots[b].get());
  });
  std::vector<Slot*> locked;
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    if (!locked.empty() && locked.back() == slots[i].get()) {
      size_t first = k - 1;
      while (first > 0 && slots[order[first - 1]] == slots[i]) --first;
      statuses[i] = absl::InvalidArgumentError(absl::StrCat(
          "steps[", i, "]: session_id: also in steps[", order[first],
          "]; a call steps each session at most once"));
      slots[i] = nullptr;
      continue;
    }
    slots[i]->step_mu.Lock();
    locked.push_back(slots[i].get());
  }
  return locked;
}

void SessionStore::RunAndSettle(absl::Span<const StepInput> steps,
                                const std::vector<std::shared_ptr<Slot>>& slots,
                                std::vector<absl::Status>& statuses) {
  const size_t count = steps.size();
  std::vector<SessionStepInput> batch;
  std::vector<size_t> index;
  for (size_t i = 0; i < count; ++i) {
    if (slots[i] == nullptr || !statuses[i].ok()) continue;
    batch.push_back({slots[i]->session.get(), steps[i].inputs, steps[i].options,
                     steps[i].results});
    index.push_back(i);
  }
  const std::vector<absl::Status> stepped = StepSessions(batch);
  {
    MutexLock lock(&mu_);
    for (size_t k = 0; k < index.size(); ++k) {
      const size_t i = index[k];
      statuses[i] = stepped[k];
      Settle(steps[i].id, slots[i]);
    }
  }
  for (size_t i : index) {
    if (steps[i].length != nullptr) {
      *steps[i].length = slots[i]->session->length(steps[i].inputs.layer);
    }
  }
}

absl::StatusOr<std::shared_ptr<const DecodeSession>> SessionStore::FindReused(
    absl::string_view id) {
  ATTN_RETURN_IF_ERROR(TakeIfSaved(id, /*reused=*/true));
  return Find(id);
}

absl::StatusOr<std::shared_ptr<const DecodeSession>> SessionStore::Find(
    absl::string_view id) {
  ATTN_RETURN_IF_ERROR(TakeIfSaved(id));
  return FindHere(id);
}

absl::StatusOr<std::shared_ptr<SessionStore::Slot>> SessionStore::SlotOf(
    absl::string_view id) {
  MutexLock lock(&mu_);
  ATTN_ASSIGN_OR_RETURN(Entry * entry, Lookup(id));
  return entry->slot;
}

absl::StatusOr<std::shared_ptr<const DecodeSession>> SessionStore::FindHere(
    absl::string_view id) {
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Slot> slot, SlotOf(id));
  // Shares the slot's ownership: the session lives while the caller holds it.
  return std::shared_ptr<const DecodeSession>(slot, slot->session.get());
}

absl::Status SessionStore::Delete(absl::string_view id, PeerWait wait) {
  // A journal left by a process that died goes too (a held session's
  // journal goes with its slot).
  bool removed_file = false;
  if (options_.directory != nullptr) {
    // A session a live replica holds is saved there first, then its file
    // removed here: never loaded only to be freed.
    if (HeldElsewhere(id)) {
      ATTN_RETURN_IF_ERROR(AskHolderToSave(id, wait).status());
    }
    removed_file = options_.directory->Remove(id);
    if (options_.directory->RemoveJournal(id)) removed_file = true;
  }
  std::vector<std::shared_ptr<Slot>> freed;
  {
    MutexLock lock(&mu_);
    ATTN_RETURN_IF_ERROR(VerifySessionId(id));
    if (imports_.contains(id)) {
      DropImport(std::string(id));  // the import's stream fails ABORTED
      return absl::OkStatus();
    }
    if (!sessions_.contains(id)) {
      if (!removed_file) return NotFound(id);
      if (const auto gone = gone_.find(id); gone != gone_.end()) {
        gone->second.reason = GoneReason::kDeleted;
      }
      return absl::OkStatus();
    }
    Remove(std::string(id), GoneReason::kDeleted, freed);
  }
  RemoveJournals(freed);
  return absl::OkStatus();
}

void SessionStore::RemoveJournals(
    const std::vector<std::shared_ptr<Slot>>& freed) {
  // Now, not when the last call or journal write holding the slot lets go:
  // a request right after the delete must not find the session held here.
  for (const std::shared_ptr<Slot>& slot : freed) {
    if (!slot->drop_journal) continue;
    MutexLock journal_lock(&slot->journal_mu);
    EndJournal(*slot);
  }
}

void SessionStore::Clear() {
  std::vector<std::shared_ptr<Slot>> freed;
  MutexLock lock(&mu_);
  // Their journals stay, for whichever process takes the sessions up.
  while (!lru_.empty()) Remove(lru_.back(), GoneReason::kClosed, freed);
}

void SessionStore::ExpireIdle(absl::Time now) {
  if (options_.idle_timeout == absl::InfiniteDuration()) return;
  std::vector<std::shared_ptr<Slot>> freed;
  {
    MutexLock lock(&mu_);
    // Least recently used last: stop at the first one still fresh.
    std::vector<std::string> expired;
    for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
      const Entry& entry = sessions_.at(*it);
      if (entry.active_steps > 0) continue;
      if (now - entry.last_used < options_.idle_timeout) break;
      expired.push_back(*it);
    }
    for (std::string& id : expired) {
      Remove(std::move(id), GoneReason::kExpired, freed);
    }
    // Imports no stream has resumed within the timeout.
    std::vector<std::string> abandoned;
    for (const auto& [id, pending] : imports_) {
      if (pending.stream == nullptr &&
          now - pending.last_used >= options_.idle_timeout) {
        abandoned.push_back(id);
      }
    }
    for (const std::string& id : abandoned) DropImport(id);
  }
  RemoveJournals(freed);
}

// Runs when the last reference goes, so no lock is needed for the fields
// the thread-safety analysis sees guarded.
SessionStore::Slot::~Slot() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (save_to != nullptr && session != nullptr) {
    const absl::Status saved =
        save_to->Save(save_as, *session, !unconfirmed.empty());
    if (saved.ok()) drop_journal = true;
    MutexLock lock(&store->mu_);
    ++(saved.ok() ? store->counts_.saved : store->counts_.save_failures);
  }
  if (journal != nullptr && drop_journal) journal->Remove();
}

absl::StatusOr<std::shared_ptr<const MultiHeadLayer>> SessionStore::LayerOf(
    absl::string_view model) const {
  if (!options_.layer_of) {
    return absl::NotFoundError(
        absl::StrCat("model ", EchoString(model, '"'), " is not served here"));
  }
  return options_.layer_of(model);
}

absl::StatusOr<bool> SessionStore::AskHolderToSave(absl::string_view id,
                                                   PeerWait wait) {
  const std::optional<std::string> holder =
      options_.reclaim ? options_.directory->Holder(id) : std::nullopt;
  std::string self;
  {
    MutexLock lock(&mu_);
    self = holder_;
  }
  if (!holder.has_value() || *holder == self) return false;
  if (wait == PeerWait::kRefused) return WouldWait(id, *holder);
  options_.reclaim(id, *holder).IgnoreError();
  return true;
}

absl::StatusOr<std::unique_ptr<DecodeSession>> SessionStore::TakeSaved(
    absl::string_view id, SessionFileHeader& header, bool& recovered,
    LoadCount& count, PeerWait wait) {
  const FileChecks checks{this};
  // Room is made for the whole session before its blocks are loaded.
  const auto admit = [&](const SessionFileHeader& loading,
                         const DecodeSession& session) -> absl::Status {
    std::vector<std::shared_ptr<Slot>> freed;
    MutexLock lock(&mu_);
    UncountLoad(count);  // an earlier attempt's
    const LoadCount needed = CountOf(loading, session);
    ATTN_RETURN_IF_ERROR(CountLoad(std::string(id), needed, freed));
    count = needed;
    return absl::OkStatus();
  };
  const SessionFileLoader loader{
      .layer_of = checks, .verify = checks, .admit = admit};
  const auto no_file = [](const absl::Status& status) {
    return absl::IsNotFound(status) &&
           absl::StartsWith(status.message(), "no session file");
  };
  absl::StatusOr<std::unique_ptr<DecodeSession>> session =
      options_.directory->Take(id, loader, &header);
  if (!no_file(session.status())) return session;
  // Held in another replica's memory: ask it to hand the session over,
  // then look for the file whatever it answered (a hand-over whose answer
  // was lost on the way left the file).
  ATTN_ASSIGN_OR_RETURN(const bool asked, AskHolderToSave(id, wait));
  if (asked) {
    session = options_.directory->Take(id, loader, &header);
    if (!no_file(session.status())) return session;
  }
  if (!journaling()) return session;
  // No process hands it over: one that held it died, leaving its journal.
  recovered = true;
  return options_.directory->TakeJournal(id, loader, &header);
}

absl::Status SessionStore::TakeIfSaved(absl::string_view id, bool reused,
                                       PeerWait wait) {
  if (options_.directory == nullptr || !SessionDirectory::IsStorableId(id)) {
    return absl::OkStatus();
  }
  {
    MutexLock lock(&mu_);
    if (sessions_.contains(id)) return absl::OkStatus();
    const auto gone = gone_.find(id);
    // Deleted and expired sessions are not brought back (their files went
    // with them), unless their id may have been opened again elsewhere.
    if (!reused && gone != gone_.end() &&
        (gone->second.reason == GoneReason::kDeleted ||
         gone->second.reason == GoneReason::kExpired)) {
      return absl::OkStatus();
    }
  }
  SessionFileHeader header;
  bool recovered = false;
  LoadCount count;
  absl::StatusOr<std::unique_ptr<DecodeSession>> session =
      TakeSaved(id, header, recovered, count, wait);
  uint64_t prefix_key = 0;
  // While the loaded copy is still counted.
  if (session.ok()) *session = ShareWithHeld(*std::move(session), prefix_key);
  {
    // Counted as a session from here (AddAs), or not at all.
    MutexLock lock(&mu_);
    UncountLoad(count);
  }
  // No file, no journal: the lookup says NOT_FOUND.
  if (absl::IsNotFound(session.status()) &&
      absl::StartsWith(session.status().message(), "no ")) {
    return absl::OkStatus();
  }
  ATTN_RETURN_IF_ERROR(session.status());
  const absl::StatusOr<std::string> added = AddAs(
      *std::move(session), std::string(id), header.unconfirmed, prefix_key);
  // Another call took it in meanwhile: that copy is the one.
  if (absl::IsAlreadyExists(added.status())) return absl::OkStatus();
  ATTN_RETURN_IF_ERROR(added.status());
  MutexLock lock(&mu_);
  ++counts_.restored;
  if (recovered) ++counts_.recovered;
  return absl::OkStatus();
}

absl::Status SessionStore::SaveSlot(const std::string& id, Slot& slot,
                                    uint32_t file_version) {
  options_.directory->Release(id);
  ATTN_RETURN_IF_ERROR(options_.directory->Save(
      id, *slot.session, !slot.unconfirmed.empty(), file_version));
  // The file holds it all now; a journal would only be a stale copy.
  MutexLock journal_lock(&slot.journal_mu);
  EndJournal(slot);
  return absl::OkStatus();
}

absl::Status SessionStore::HandOver(absl::string_view id,
                                    uint32_t file_version) {
  if (options_.directory == nullptr) {
    return absl::FailedPreconditionError(
        "sessions have no directory to go to (--session_dir)");
  }
  ATTN_ASSIGN_OR_RETURN(const std::shared_ptr<Slot> slot, SlotOf(id));
  std::vector<std::shared_ptr<Slot>> freed;
  MutexLock step_lock(&slot->step_mu);
  const std::string key(id);
  {
    MutexLock lock(&mu_);
    if (!HoldsSlot(key, *slot)) return NotFound(key);  // gone or replaced
  }
  ATTN_RETURN_IF_ERROR(SaveSlot(key, *slot, file_version));
  MutexLock lock(&mu_);
  if (!HoldsSlot(key, *slot)) return absl::OkStatus();  // freed meanwhile
  Remove(key, GoneReason::kSaved, freed);
  ++counts_.saved;
  return absl::OkStatus();
}

SessionStore::SaveReport SessionStore::SaveAll(absl::Time deadline) {
  SaveReport report;
  if (options_.directory == nullptr) {
    report.first_error =
        absl::FailedPreconditionError("sessions have no directory to go to");
    return report;
  }
  std::vector<std::pair<std::string, std::shared_ptr<Slot>>> open;
  {
    MutexLock lock(&mu_);
    for (const std::string& id : lru_) {
      open.emplace_back(id, sessions_.at(id).slot);
    }
  }
  for (const auto& [id, slot] : open) {
    absl::Status saved =
        absl::Now() >= deadline
            ? absl::DeadlineExceededError("out of time to save sessions")
            : absl::OkStatus();
    std::vector<std::shared_ptr<Slot>> freed;
    if (saved.ok()) {
      MutexLock step_lock(&slot->step_mu);
      {
        // Deleted, renamed or replaced since the list: not this one's to save.
        MutexLock lock(&mu_);
        if (!HoldsSlot(id, *slot)) continue;
      }
      saved = SaveSlot(id, *slot);
      if (saved.ok()) {
        MutexLock lock(&mu_);
        Remove(id, GoneReason::kSaved, freed);
      }
    }
    if (saved.ok()) {
      ++report.sessions;
    } else {
      ++report.failed;
      if (report.first_error.ok()) report.first_error = saved;
    }
  }
  MutexLock lock(&mu_);
  counts_.saved += report.sessions;
  counts_.save_failures += report.failed;
  return report;
}

absl::Status SessionStore::VerifyConfirmed(
    const Slot& slot, const DecodeStepInputs& inputs) const {
  const int64_t layer = inputs.layer;
  if (layer < 0 || layer >= static_cast<int64_t>(slot.unconfirmed.size()) ||
      !slot.unconfirmed[static_cast<size_t>(layer)]) {
    return absl::OkStatus();
  }
  const int64_t held = slot.session->length(layer);
  if (inputs.position.has_value() && *inputs.position <= held) {
    return absl::OkStatus();
  }
  return absl::AbortedError(absl::StrCat(
      "session_id: session ", EchoString(slot.id, '"'),
      " was recovered from its journal after the server holding it stopped "
      "without saving it, and may hold fewer tokens than were sent: layer ",
      layer, " holds ", held,
      "; resend the tokens from there, giving position ", held,
      " (a step that gives a position up to it is taken)"));
}

void SessionStore::AfterStep(const std::shared_ptr<Slot>& slot,
                             const DecodeStepInputs& inputs) {
  const auto layer = static_cast<size_t>(inputs.layer);
  if (inputs.position.has_value() && layer < slot->unconfirmed.size()) {
    slot->unconfirmed[layer] = false;
    if (std::find(slot->unconfirmed.begin(), slot->unconfirmed.end(), true) ==
        slot->unconfirmed.end()) {
      slot->unconfirmed.clear();
    }
  }
  if (!journaling()) return;
  const int64_t full = slot->session->length(inputs.layer) / kCacheBlockKeys;
  int64_t written = 0;
  {
    MutexLock journal_lock(&slot->journal_mu);
    if (slot->journal_off) return;
    if (slot->journal != nullptr) {
      int64_t& journaled = slot->journaled[layer];
      // A rewind below blocks written: recorded before the step answers, so
      // that a recovery never holds tokens the client replaced.
      if (inputs.position.has_value() &&
          *inputs.position / kCacheBlockKeys < journaled) {
        journaled = *inputs.position / kCacheBlockKeys;
        ++slot->rewinds;
        const absl::Status recorded = slot->journal->Append(SessionBlockFields(
            inputs.layer, journaled * kCacheBlockKeys, 0, ""));
        if (!recorded.ok()) {
          DropJournal(*slot);
          return;
        }
      }
      written = journaled;
    }
  }
  if (full > written) QueueJournal(slot);
}

void SessionStore::QueueJournal(const std::shared_ptr<Slot>& slot) {
  if (!journaling() || slot->journal_queued.exchange(true)) return;
  {
    MutexLock lock(&journal_mu_);
    journal_queue_.push_back(slot);
  }
  journal_wake_.Signal();
}

void SessionStore::JournalLoop() {
  while (true) {
    std::shared_ptr<Slot> slot;
    {
      MutexLock lock(&journal_mu_);
      journal_busy_ = false;
      while (journal_queue_.empty() && !journal_stopping_) {
        journal_idle_.SignalAll();
        journal_wake_.Wait(&journal_mu_);
      }
      if (journal_stopping_) return;
      slot = journal_queue_.front().lock();
      journal_queue_.pop_front();
      journal_busy_ = true;
    }
    if (slot == nullptr) continue;  // gone meanwhile
    slot->journal_queued = false;
    WriteJournal(*slot);
  }
}

void SessionStore::WaitForJournals() {
  MutexLock lock(&journal_mu_);
  while (!journal_queue_.empty() || journal_busy_) {
    journal_idle_.Wait(&journal_mu_);
  }
}

void SessionStore::WriteJournal(Slot& slot) {
  {
    MutexLock step_lock(&slot.step_mu);
    MutexLock journal_lock(&slot.journal_mu);
    if (slot.journal_off) return;
    absl::Status status;
    if (slot.journal == nullptr) {
      status = StartJournal(slot, /*with_blocks=*/false);
    } else {
      // Rewinds leave replaced blocks behind: past twice what it holds (and
      // a block's slack), the journal is written anew, under the locks.
      int64_t blocks = 0;
      for (int64_t held : slot.journaled) blocks += held;
      const uint64_t holds = static_cast<uint64_t>(blocks + 1) *
                             slot.session->RowBytes(kCacheBlockKeys);
      if (slot.journal->bytes() > 2 * holds) {
        status = StartJournal(slot, /*with_blocks=*/true);
      }
    }
    if (!status.ok()) {
      DropJournal(slot);
      return;
    }
  }
  std::string rows;
  while (WriteNextBlock(slot, rows)) {
  }
}

bool SessionStore::WriteNextBlock(Slot& slot, std::string& rows) {
  int64_t layer = 0, block = 0, rewinds = 0;
  {
    // The copy, under the step lock: steps wait for it, not for the write.
    MutexLock step_lock(&slot.step_mu);
    const DecodeSession& session = *slot.session;
    {
      MutexLock journal_lock(&slot.journal_mu);
      if (slot.journal_off || slot.journal == nullptr) return false;
      for (layer = 0; layer < session.num_layers(); ++layer) {
        block = slot.journaled[static_cast<size_t>(layer)];
        if (block < session.length(layer) / kCacheBlockKeys) break;
      }
      if (layer == session.num_layers()) return false;
      rewinds = slot.rewinds;
    }
    rows.clear();
    if (!session.CopyRows(layer, block * kCacheBlockKeys, kCacheBlockKeys, rows)
             .ok()) {
      return false;
    }
  }
  MutexLock journal_lock(&slot.journal_mu);
  // A rewind since the copy may have replaced the block: it is copied
  // again (or not, if no longer full) on the next round.
  if (slot.journal_off || slot.journal == nullptr) return false;
  if (slot.rewinds != rewinds) return true;
  int64_t& written = slot.journaled[static_cast<size_t>(layer)];
  if (written != block) return true;
  absl::Status status = slot.journal->Append(SessionBlockFields(
      layer, block * kCacheBlockKeys, kCacheBlockKeys, rows));
  if (status.ok()) status = slot.journal->Append(rows);
  if (!status.ok()) {
    DropJournal(slot);
    return false;
  }
  ++written;
  MutexLock lock(&mu_);
  ++counts_.journaled_blocks;
  return true;
}

absl::Status SessionStore::StartJournal(Slot& slot, bool with_blocks) {
  // A fork's shared prefix is journaled once, in a base file its forks'
  // journals link. A journal started again over another prefix holds every
  // block: the old one's base stays until the new journal replaces it.
  const DecodeSession::SharedBase shared = slot.session->shared_base();
  std::optional<SessionFileBase> base;
  if (slot.journal == nullptr || shared.key == slot.journal_base_key) {
    absl::StatusOr<SessionFileBase> saved =
        options_.directory->SaveJournalBase(slot.id, *slot.session, shared);
    if (saved.ok()) base = *std::move(saved);
  }
  absl::StatusOr<std::string> header =
      SessionJournalHeader(*slot.session, slot.id, base ? &*base : nullptr);
  absl::StatusOr<std::unique_ptr<SessionJournal>> created =
      header.ok() ? options_.directory->CreateJournal(slot.id, *header)
                  : header.status();
  if (!created.ok()) {
    // A base written for it goes too (an old journal's, kept, goes with
    // that journal when the caller drops it).
    if (slot.journal == nullptr) options_.directory->RemoveJournalBase(slot.id);
    return created.status();
  }
  std::unique_ptr<SessionJournal> journal = *std::move(created);
  slot.journaled.assign(static_cast<size_t>(slot.session->num_layers()), 0);
  for (size_t l = 0; base.has_value() && l < slot.journaled.size(); ++l) {
    slot.journaled[l] = base->lengths[l] / kCacheBlockKeys;
  }
  absl::Status status =
      with_blocks ? AppendBlocks(slot, *journal) : absl::OkStatus();
  if (status.ok()) status = journal->Publish();
  if (!status.ok()) {
    journal->Remove();
    return status;
  }
  if (!base.has_value()) options_.directory->RemoveJournalBase(slot.id);
  slot.journal_base_key = base.has_value() ? shared.key : "";
  slot.journal = std::move(journal);
  return absl::OkStatus();
}

absl::Status SessionStore::AppendBlocks(Slot& slot, SessionJournal& journal) {
  const DecodeSession& session = *slot.session;
  std::string rows;
  int64_t appended = 0;
  for (int64_t layer = 0; layer < session.num_layers(); ++layer) {
    int64_t& written = slot.journaled[static_cast<size_t>(layer)];
    for (; written < session.length(layer) / kCacheBlockKeys; ++written) {
      const int64_t first = written * kCacheBlockKeys;
      rows.clear();
      ATTN_RETURN_IF_ERROR(
          session.CopyRows(layer, first, kCacheBlockKeys, rows).status());
      ATTN_RETURN_IF_ERROR(journal.Append(
          SessionBlockFields(layer, first, kCacheBlockKeys, rows)));
      ATTN_RETURN_IF_ERROR(journal.Append(rows));
      ++appended;
    }
  }
  MutexLock lock(&mu_);
  counts_.journaled_blocks += appended;
  return absl::OkStatus();
}

void SessionStore::EndJournal(Slot& slot) {
  if (slot.journal != nullptr) slot.journal->Remove();
  slot.journal.reset();
  slot.journal_off = true;
}

void SessionStore::DropJournal(Slot& slot) {
  EndJournal(slot);
  MutexLock lock(&mu_);
  ++counts_.journal_failures;
}

SessionStore::Stats SessionStore::stats() const {
  MutexLock lock(&mu_);
  Stats s = counts_;
  s.open = static_cast<int64_t>(sessions_.size());
  s.cache_bytes = bytes_;
  s.reserved_bytes = reserved_;
  s.shared_caches = static_cast<int64_t>(shared_.size());
  for (const auto& [key, shared] : shared_) s.shared_bytes += shared.bytes;
  s.bookkeeping_bytes = bookkeeping_;
  for (const auto& [layer, model] : models_) {
    if (model.superseded) ++s.superseded_models;
  }
  s.superseded_model_bytes = superseded_;
  s.budget_bytes = budget_bytes();
  s.importing = static_cast<int64_t>(imports_.size());
  return s;
}

}  // namespace attnserve
