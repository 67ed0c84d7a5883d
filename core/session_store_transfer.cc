// SessionStore's session transfer: exports and imports of session files,
// and the sharing of sessions taken up (see core/session_store.h).
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/checksum.h"
#include "core/session_store.h"
#include "core/status_macros.h"
#include "core/verify.h"

namespace attnserve {

absl::StatusOr<SessionStore::Export> SessionStore::ExportSession(
    absl::string_view id, PeerWait wait) {
  ATTN_RETURN_IF_ERROR(TakeIfSaved(id, /*reused=*/false, wait));
  ATTN_ASSIGN_OR_RETURN(const std::shared_ptr<Slot> slot, SlotOf(id));
  bool unconfirmed = false;
  {
    MutexLock step_lock(&slot->step_mu);
    unconfirmed = !slot->unconfirmed.empty();
  }
  // Shares the slot's ownership, as Find does.
  std::shared_ptr<const DecodeSession> session(slot, slot->session.get());
  // A step while the fingerprint is read aborts it: read again, a few
  // times, as a stream whose session steps would be asked again.
  absl::Status fingerprinted;
  for (int attempt = 0; attempt < 3; ++attempt) {
    ATTN_ASSIGN_OR_RETURN(SessionFileImage image,
                          SessionFileImage::Of(*session, id, unconfirmed));
    fingerprinted = image.Fingerprint();
    if (fingerprinted.ok()) return Export{std::move(session), std::move(image)};
  }
  return fingerprinted;
}

namespace {

// A key of `session`'s config and first block of layer 0, the same for
// sessions forked alike; 0 when a layer holds less than a block (nothing
// to share).
uint64_t PrefixKey(const DecodeSession& session) {
  for (int64_t l = 0; l < session.num_layers(); ++l) {
    if (session.length(l) < kCacheBlockKeys) return 0;
  }
  std::string rows;
  if (!session.CopyRows(0, 0, kCacheBlockKeys, rows).ok()) return 0;
  const KvCache::Dims& dims = session.cache_dims();
  const std::string shape = absl::StrCat(
      dims.batch, ",", dims.kv_heads, ",", dims.key_dim, ",", dims.value_dim,
      ",", dims.max_length, ",", static_cast<int>(dims.dtype), ",", dims.layers,
      ",", session.num_heads(), ",", session.config().model);
  const uint64_t key = uint64_t{Crc32c(rows)} << 32 | Crc32c(shape);
  return key != 0 ? key : 1;
}

}  // namespace

std::unique_ptr<DecodeSession> SessionStore::ShareWithHeld(
    std::unique_ptr<DecodeSession> loaded, uint64_t& prefix_key) {
  prefix_key = PrefixKey(*loaded);
  std::shared_ptr<Slot> holder;
  std::string holder_id;
  {
    MutexLock lock(&mu_);
    const auto it = prefix_holders_.find(prefix_key);
    if (prefix_key == 0 || it == prefix_holders_.end()) return loaded;
    holder_id = it->second;
    holder = sessions_.at(holder_id).slot;
  }
  // Steps on the holder wait: its tokens compared must be those forked.
  MutexLock step_lock(&holder->step_mu);
  const int64_t shared = loaded->SharedPrefix(*holder->session);
  if (shared == 0) return loaded;
  {
    // The fork's caches must fit beside the loaded copy, which is still
    // counted: no session is evicted for sharing.
    const absl::StatusOr<size_t> room =
        holder->session->ForkReservedBytes(shared);
    MutexLock lock(&mu_);
    if (!room.ok() || !HoldsSlot(holder_id, *holder) ||
        !VerifySharedCacheCount().ok() ||
        (options_.max_reserved_bytes > 0 &&
         reserved_space() + *room > options_.max_reserved_bytes)) {
      return loaded;
    }
  }
  absl::StatusOr<std::unique_ptr<DecodeSession>> fork =
      holder->session->Fork(shared);
  if (!fork.ok()) return loaded;
  {
    MutexLock lock(&mu_);
    if (HoldsSlot(holder_id, *holder)) {
      RecountOwn(sessions_.at(holder_id), *holder->session);
    }
  }
  // The tokens past the shared ones, a block at a time.
  std::string rows;
  for (int64_t l = 0; l < loaded->num_layers(); ++l) {
    for (int64_t first = shared; first < loaded->length(l);
         first += kCacheBlockKeys) {
      const int64_t tokens =
          std::min(kCacheBlockKeys, loaded->length(l) - first);
      rows.clear();
      if (!loaded->CopyRows(l, first, tokens, rows).ok() ||
          !(*fork)->AppendRows(l, first, tokens, rows).ok()) {
        return loaded;
      }
    }
  }
  MutexLock lock(&mu_);
  ++counts_.reshared;
  return *std::move(fork);
}

absl::StatusOr<std::shared_ptr<SessionFileBuilder>> SessionStore::ClaimImport(
    Import& import) {
  MutexLock lock(&mu_);
  const auto it = imports_.find(import.id);
  if (it == imports_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "session_id: no import of session ", EchoString(import.id, '"'),
        " is under way here (it completed, was dropped after ",
        absl::FormatDuration(options_.idle_timeout),
        " idle, or began on another replica); import it again from offset "
        "0"));
  }
  PendingImport& pending = it->second;
  if (pending.stream != nullptr && pending.stream != &import) {
    // Often a stream the client has given up on and the server has not
    // yet seen end: worth a retry.
    return absl::UnavailableError(absl::StrCat(
        "session_id: session ", EchoString(import.id, '"'),
        " is being imported by another stream now; retry once it has "
        "ended"));
  }
  pending.stream = &import;
  pending.last_used = absl::Now();
  import.received = pending.received;
  import.size = pending.builder->expected_size();
  return pending.builder;
}

absl::Status SessionStore::ImportBytes(Import& import, uint64_t offset,
                                       absl::string_view bytes) {
  std::shared_ptr<SessionFileBuilder> builder;
  if (!import.id.empty()) {
    ATTN_ASSIGN_OR_RETURN(builder, ClaimImport(import));
  } else if (import.head == nullptr) {
    import.head = std::make_unique<SessionFileBuilder>("import");
  }
  // A resuming stream's first chunk may carry no bytes: it asks how far
  // the import got (import.received).
  if (builder != nullptr && bytes.empty()) return absl::OkStatus();
  if (offset != import.received) {
    return absl::FailedPreconditionError(absl::StrCat(
        "offset: ", offset, "; the import has taken ", import.received,
        " bytes of the file: send it from offset ", import.received));
  }
  const FileChecks checks{this};
  const SessionFileLoader loader{.layer_of = checks, .verify = checks};
  // A new import takes its header alone first: its session's memory is
  // counted (BeginImport) before any block fills it.
  while (builder == nullptr && !bytes.empty()) {
    const absl::string_view piece = bytes.substr(0, import.head->needed());
    const absl::Status added = import.head->Add(piece, loader);
    import.received = import.head->received();
    if (!added.ok()) {
      import.head.reset();
      return added;
    }
    bytes.remove_prefix(piece.size());
    if (import.head->header() != nullptr) {
      ATTN_RETURN_IF_ERROR(BeginImport(import));
      ATTN_ASSIGN_OR_RETURN(builder, ClaimImport(import));
    }
  }
  if (builder == nullptr) return absl::OkStatus();  // the header is not whole
  const absl::Status added = builder->Add(bytes, loader);
  import.received = builder->received();
  {
    MutexLock lock(&mu_);
    const auto it = imports_.find(import.id);
    if (it == imports_.end() || it->second.builder != builder) {
      return absl::AbortedError(absl::StrCat(
          "session_id: the import of session ", EchoString(import.id, '"'),
          " was dropped meanwhile (its session deleted)"));
    }
    it->second.received = import.received;
    if (!added.ok()) DropImport(import.id);
  }
  ATTN_RETURN_IF_ERROR(added);
  return builder->complete() ? FinishImport(import) : absl::OkStatus();
}

absl::Status SessionStore::BeginImport(Import& import) {
  const SessionFileHeader& header = *import.head->header();
  const DecodeSession& session = *import.head->session();
  if (!SessionDirectory::IsStorableId(header.id)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the file's session id ", EchoString(header.id, '"'),
        " is not one a server issues (1 to 64 lowercase hex digits)"));
  }
  const LoadCount count = CountOf(header, session);
  const std::string shown = EchoString(header.id, '"');
  if (options_.directory != nullptr && options_.directory->Knows(header.id)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "session ", shown,
        " lives on in the session directory (a file, a journal or a "
        "replica holding it): step it there, or delete it before importing "
        "it"));
  }
  std::vector<std::shared_ptr<Slot>> freed;
  MutexLock lock(&mu_);
  if (sessions_.contains(header.id)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "session ", shown, " is open here; delete it before importing it"));
  }
  if (imports_.contains(header.id)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "session ", shown,
        " is being imported here already; resume that import (give its "
        "session_id), or delete the session to drop it"));
  }
  ATTN_RETURN_IF_ERROR(CountLoad(header.id, count, freed));
  PendingImport& pending = imports_[header.id];
  pending.builder = std::move(import.head);
  pending.received = pending.builder->received();
  pending.count = count;
  pending.last_used = absl::Now();
  import.id = header.id;
  import.size = pending.builder->expected_size();
  return absl::OkStatus();
}

SessionStore::LoadCount SessionStore::CountOf(const SessionFileHeader& header,
                                              const DecodeSession& session) {
  LoadCount count;
  count.bytes = session.bookkeeping_bytes();
  for (size_t layer = 0; layer < header.lengths.size(); ++layer) {
    count.bytes +=
        session.BytesAt(header.lengths[layer], static_cast<int64_t>(layer));
  }
  count.reserved = session.reserved_bytes() + session.bookkeeping_bytes();
  return count;
}

absl::Status SessionStore::CountLoad(
    const std::string& id, const LoadCount& count,
    std::vector<std::shared_ptr<Slot>>& freed) {
  const auto no_room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return (options_.max_sessions > 0 &&
            static_cast<int64_t>(sessions_.size() + imports_.size()) >=
                options_.max_sessions) ||
           (options_.max_reserved_bytes > 0 &&
            reserved_space() + count.reserved > options_.max_reserved_bytes) ||
           (options_.max_bytes > 0 &&
            budget_bytes() + count.bytes > options_.max_bytes);
  };
  while (no_room() && !lru_.empty()) {
    Remove(lru_.back(), GoneReason::kEvicted, freed);
  }
  if (no_room()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", EchoString(id, '"'), ": its ", count.bytes,
        " bytes do not fit beside the sessions being loaded (session memory "
        "limit ",
        options_.max_bytes, " bytes, max_sessions ", options_.max_sessions,
        ")"));
  }
  loading_bytes_ += count.bytes;
  loading_reserved_ += count.reserved;
  return absl::OkStatus();
}

void SessionStore::UncountLoad(LoadCount& count) {
  loading_bytes_ -= count.bytes;
  loading_reserved_ -= count.reserved;
  count = LoadCount{};
}

void SessionStore::DropImport(const std::string& id) {
  const auto it = imports_.find(id);
  if (it == imports_.end()) return;
  UncountLoad(it->second.count);
  imports_.erase(it);
}

absl::Status SessionStore::FinishImport(Import& import) {
  std::shared_ptr<SessionFileBuilder> builder;
  {
    MutexLock lock(&mu_);
    const auto it = imports_.find(import.id);
    if (it == imports_.end()) {
      return absl::AbortedError(absl::StrCat(
          "session_id: the import of session ", EchoString(import.id, '"'),
          " was dropped meanwhile (its session deleted)"));
    }
    builder = std::move(it->second.builder);
    DropImport(import.id);
  }
  const bool unconfirmed = builder->header()->unconfirmed;
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<DecodeSession> session,
                        builder->Release());
  std::vector<int64_t> lengths = session->contents().lengths;
  uint64_t prefix_key = 0;
  session = ShareWithHeld(std::move(session), prefix_key);
  ATTN_RETURN_IF_ERROR(
      AddAs(std::move(session), import.id, unconfirmed, prefix_key).status());
  import.complete = true;
  import.lengths = std::move(lengths);
  MutexLock lock(&mu_);
  ++counts_.imported;
  return absl::OkStatus();
}

void SessionStore::EndImport(Import& import) {
  import.head.reset();
  if (import.id.empty() || import.complete) return;
  MutexLock lock(&mu_);
  const auto it = imports_.find(import.id);
  if (it == imports_.end() || it->second.stream != &import) return;
  it->second.stream = nullptr;
  it->second.last_used = absl::Now();
}

}  // namespace attnserve
