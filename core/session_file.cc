#include "core/session_file.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/attention_kernel.h"
#include "core/checksum.h"
#include "core/status_macros.h"
#include "core/verify.h"

namespace attnserve {
namespace {

constexpr absl::string_view kMagic = "ATTNSESS";
constexpr absl::string_view kBlockTag = "BLCK";
constexpr absl::string_view kEndTag = "DONE";
// A block record's fields before its rows: tag, layer, first, tokens, CRC.
constexpr size_t kBlockFieldBytes = 4 + 4 + 8 + 8 + 4;
constexpr size_t kEndBytes = 4 + 8 + 4;
// Ids and model names longer than these are not ours.
constexpr size_t kMaxIdBytes = 256;
constexpr size_t kMaxModelBytes = 1024;
// A header body: its fixed fields, an id, a model name and
// kMaxSessionLayers lengths take less.
constexpr uint32_t kMaxHeaderBodyBytes = 64 << 10;

uint32_t Crc(absl::string_view bytes, uint32_t crc = 0) {
  return Crc32c(bytes, crc);
}

// Appends little-endian fields (x86-64 and aarch64 are little-endian).
class Encoder {
 public:
  template <typename T>
  void Put(T value) {
    out_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  void PutString(absl::string_view s) {
    Put(static_cast<uint32_t>(s.size()));
    out_.append(s.data(), s.size());
  }
  void PutRaw(absl::string_view s) { out_.append(s.data(), s.size()); }
  const std::string& bytes() const { return out_; }

 private:
  std::string out_;
};

// Reads fields from the front of `bytes`; every read is bounds-checked.
class Decoder {
 public:
  explicit Decoder(absl::string_view bytes) : in_(bytes) {}
  template <typename T>
  bool Get(T* value) {
    if (in_.size() < sizeof(T)) return false;
    std::memcpy(value, in_.data(), sizeof(T));
    in_.remove_prefix(sizeof(T));
    return true;
  }
  bool GetString(size_t max, std::string* s) {
    uint32_t size;
    if (!Get(&size) || size > max || in_.size() < size) return false;
    s->assign(in_.data(), size);
    in_.remove_prefix(size);
    return true;
  }
  bool GetRaw(size_t size, absl::string_view* s) {
    if (in_.size() < size) return false;
    *s = in_.substr(0, size);
    in_.remove_prefix(size);
    return true;
  }
  size_t left() const { return in_.size(); }

 private:
  absl::string_view in_;
};

absl::Status Corrupt(absl::string_view name, absl::string_view what) {
  return absl::DataLossError(
      absl::StrCat("session file ", EchoString(name), ": ", what));
}

// Header flags.
constexpr uint32_t kUnconfirmedFlag = 1;
constexpr uint32_t kBaseFlag = 2;  // version 3
// The version written for files without a base.
constexpr uint32_t kPlainVersion = 2;

std::string HeaderBody(const DecodeSession& session, absl::string_view id,
                       absl::string_view model,
                       const std::vector<int64_t>& lengths, bool unconfirmed,
                       const SessionFileBase* base = nullptr) {
  const DecodeSessionConfig& config = session.config();
  Encoder body;
  body.Put<uint32_t>(session.is_model_session() ? 1 : 0);
  body.Put<int32_t>(session.num_heads());
  body.Put<int32_t>(session.num_kv_heads());
  body.Put<int64_t>(session.key_dim());
  body.Put<int64_t>(session.value_dim());
  body.Put<uint32_t>(DTypeInfoOf(session.dtype()).wire);
  body.Put<uint32_t>(DTypeInfoOf(session.cache_dtype()).wire);
  body.Put<int64_t>(config.batch);
  body.Put<int64_t>(config.max_length);
  body.Put<int64_t>(config.num_layers);
  body.Put<int64_t>(config.rotary.dims);
  body.Put<float>(config.rotary.base);
  body.Put<uint8_t>(config.default_scale.has_value() ? 1 : 0);
  body.Put<float>(config.default_scale.value_or(0.0f));
  body.PutString(id);
  body.PutString(model);
  for (int64_t length : lengths) body.Put<int64_t>(length);
  body.Put<uint32_t>((unconfirmed ? kUnconfirmedFlag : 0) |
                     (base != nullptr ? kBaseFlag : 0));
  if (base != nullptr) {
    body.Put<uint64_t>(base->size);
    body.Put<uint32_t>(base->crc);
    for (int64_t length : base->lengths) body.Put<int64_t>(length);
  }
  return body.bytes();
}

// The size of the header record that `prefix` (at least its first 16
// bytes) starts: its magic, version and body size checked.
absl::StatusOr<size_t> HeaderRecordSize(absl::string_view prefix,
                                        absl::string_view name) {
  Decoder in(prefix);
  absl::string_view magic;
  uint32_t version = 0, size = 0;
  if (!in.GetRaw(kMagic.size(), &magic) || magic != kMagic) {
    return Corrupt(name, "not a session file (no ATTNSESS magic)");
  }
  // Version 1 (no header flags) is read as well, so that a rolling update
  // takes up the files the replicas it replaces left.
  if (!in.Get(&version) || version < kOldestSessionFileVersion ||
      version > kSessionFileVersion) {
    return Corrupt(name, absl::StrCat("format version ", version,
                                      "; this server reads versions ",
                                      kOldestSessionFileVersion, " to ",
                                      kSessionFileVersion));
  }
  if (!in.Get(&size)) return Corrupt(name, "truncated header");
  if (size > kMaxHeaderBodyBytes) {
    return Corrupt(name, absl::StrCat("a header of ", size,
                                      " bytes; a header takes at most ",
                                      kMaxHeaderBodyBytes));
  }
  return kMagic.size() + 3 * sizeof(uint32_t) + size;
}

// The header record of a session file of `version` whose body is `body`.
std::string HeaderRecord(absl::string_view body,
                         uint32_t version = kPlainVersion) {
  Encoder header;
  header.PutRaw(kMagic);
  header.Put<uint32_t>(version);
  header.Put<uint32_t>(static_cast<uint32_t>(body.size()));
  header.PutRaw(body);
  header.Put<uint32_t>(Crc(body));
  return header.bytes();
}

// The DType whose wire number is `wire`, if it is one a session may use.
bool DTypeOfWire(uint32_t wire, bool cache, DType* dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (static_cast<uint32_t>(info.wire) != wire) continue;
    *dtype = info.dtype;
    return info.dtype == DType::kFloat32 || info.dtype == DType::kBFloat16 ||
           (cache && info.dtype == DType::kInt8);
  }
  return false;
}

// Parses a header body into `header`; false when it is malformed.
bool ParseHeaderBody(absl::string_view bytes, uint32_t version,
                     SessionFileHeader* header, bool* model_session) {
  Decoder in(bytes);
  uint32_t kind, dtype, cache_dtype;
  int32_t heads, kv_heads;
  uint8_t has_scale;
  float scale;
  DecodeSessionConfig& c = header->config;
  if (!in.Get(&kind) || kind > 1 || !in.Get(&heads) || !in.Get(&kv_heads) ||
      !in.Get(&header->key_dim) || !in.Get(&header->value_dim) ||
      !in.Get(&dtype) || !DTypeOfWire(dtype, false, &header->dtype) ||
      !in.Get(&cache_dtype) ||
      !DTypeOfWire(cache_dtype, true, &header->cache_dtype) ||
      !in.Get(&c.batch) || !in.Get(&c.max_length) || !in.Get(&c.num_layers) ||
      c.num_layers < 1 || c.num_layers > kMaxSessionLayers ||
      !in.Get(&c.rotary.dims) || !in.Get(&c.rotary.base) ||
      !in.Get(&has_scale) || has_scale > 1 || !in.Get(&scale) ||
      !in.GetString(kMaxIdBytes, &header->id) || header->id.empty() ||
      !in.GetString(kMaxModelBytes, &header->model) ||
      (kind == 1) == header->model.empty()) {
    return false;
  }
  header->num_heads = heads;
  header->num_kv_heads = kv_heads;
  if (has_scale == 1) c.default_scale = scale;
  header->lengths.resize(static_cast<size_t>(c.num_layers));
  for (int64_t& length : header->lengths) {
    if (!in.Get(&length) || length < 0 || length > c.max_length) return false;
  }
  uint32_t flags = 0;  // version 1 has none
  const uint32_t known =
      version >= 3 ? kUnconfirmedFlag | kBaseFlag : kUnconfirmedFlag;
  if (version >= 2 && (!in.Get(&flags) || (flags & ~known) != 0)) {
    return false;
  }
  header->unconfirmed = (flags & kUnconfirmedFlag) != 0;
  if ((flags & kBaseFlag) != 0) {
    // Whole blocks within each layer's length, at least one.
    SessionFileBase& base = header->base.emplace();
    if (!in.Get(&base.size) || !in.Get(&base.crc)) return false;
    base.lengths.resize(header->lengths.size());
    bool any = false;
    for (size_t l = 0; l < base.lengths.size(); ++l) {
      int64_t& length = base.lengths[l];
      if (!in.Get(&length) || length < 0 || length % kCacheBlockKeys != 0 ||
          length > header->lengths[l]) {
        return false;
      }
      any = any || length > 0;
    }
    if (!any) return false;
  }
  *model_session = kind == 1;
  return in.left() == 0;
}

// The config a session of `header` is created with; a model session's
// layer comes from `loader`.
absl::StatusOr<DecodeSessionConfig> ConfigOf(const SessionFileHeader& header,
                                             const SessionFileLoader& loader) {
  DecodeSessionConfig config = header.config;
  config.cache_dtype = header.cache_dtype;
  config.model = header.model;
  if (!header.model.empty()) {
    ATTN_ASSIGN_OR_RETURN(config.layer, loader.layer_of(header.model));
    return config;
  }
  config.num_heads = header.num_heads;
  config.num_kv_heads = header.num_kv_heads;
  config.key_dim = header.key_dim;
  config.value_dim = header.value_dim;
  config.dtype = header.dtype;
  return config;
}

// FAILED_PRECONDITION when the session `dims` describes is not the one the
// file was written from (a model whose heads or dims changed since).
absl::Status VerifySameDims(const KvCache::Dims& dims,
                            const SessionFileHeader& header,
                            absl::string_view name) {
  if (dims.kv_heads == header.num_kv_heads && dims.key_dim == header.key_dim &&
      dims.value_dim == header.value_dim && dims.dtype == header.cache_dtype) {
    return absl::OkStatus();
  }
  const std::string now =
      absl::StrCat(dims.kv_heads, " key/value heads of dims ", dims.key_dim,
                   "/", dims.value_dim, " (", DTypeName(dims.dtype), " cache)");
  const std::string saved =
      absl::StrCat(header.num_kv_heads, " of ", header.key_dim, "/",
                   header.value_dim, " (", DTypeName(header.cache_dtype), ")");
  if (header.model.empty()) {
    return absl::DataLossError(absl::StrCat("session file ", EchoString(name),
                                            ": its config makes ", now,
                                            "; its rows are of ", saved));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "session file ", EchoString(name), ": model ", EchoString(header.model),
      " now has ", now, "; the session was saved with ", saved));
}

absl::Status VerifyWritable(const DecodeSession& session) {
  if (session.is_model_session() && session.config().model.empty()) {
    return absl::FailedPreconditionError(
        "a model session without its model's name cannot be written");
  }
  return absl::OkStatus();
}

// The session a file's header describes, created empty after every check
// of its config; `header` gets the header.
absl::StatusOr<std::unique_ptr<DecodeSession>> CreateFromHeader(
    absl::string_view bytes, absl::string_view name,
    const SessionFileLoader& loader, SessionFileHeader& header) {
  ATTN_ASSIGN_OR_RETURN(header, ReadSessionFileHeader(bytes, name));
  ATTN_ASSIGN_OR_RETURN(const DecodeSessionConfig config,
                        ConfigOf(header, loader));
  ATTN_ASSIGN_OR_RETURN(const KvCache::Dims dims,
                        DecodeSession::CacheDims(config));
  ATTN_RETURN_IF_ERROR(VerifySameDims(dims, header, name));
  // Within the caller's budget, so that the sizes below cannot overflow.
  ATTN_RETURN_IF_ERROR(loader.verify(config));
  return DecodeSession::Create(config);
}

// The base file a version 3 header names, read through `loader` and
// checked (the file named by size and checksum, of the lengths named, in
// the config of `like`, the session the header makes): its bytes, and the
// session they hold.
struct LoadedBase {
  std::string bytes;
  std::unique_ptr<DecodeSession> session;
};
absl::StatusOr<LoadedBase> LoadBase(const SessionFileHeader& header,
                                    const SessionFileLoader& loader,
                                    absl::string_view name,
                                    const DecodeSession& like) {
  const SessionFileBase& base = *header.base;
  const std::string what = absl::StrCat("its base file (", base.size,
                                        " bytes, checksum ", base.crc, ")");
  absl::StatusOr<std::string> bytes = loader.base();
  if (!bytes.ok()) {
    return Corrupt(name, absl::StrCat(what, ": ", bytes.status().message()));
  }
  if (const uint32_t crc = Crc(*bytes);
      bytes->size() != base.size || crc != base.crc) {
    return Corrupt(name, absl::StrCat(what, " is another: ", bytes->size(),
                                      " bytes, checksum ", crc));
  }
  // Counted by the caller with this file (its admit); a base names no base.
  const SessionFileLoader base_loader{.layer_of = loader.layer_of,
                                      .verify = loader.verify};
  SessionFileHeader base_header;
  absl::StatusOr<std::unique_ptr<DecodeSession>> loaded = LoadSessionFile(
      *bytes, absl::StrCat(name, " base"), base_loader, &base_header);
  if (!loaded.ok()) {
    return Corrupt(name, absl::StrCat(what, ": ", loaded.status().message()));
  }
  if (base_header.lengths != base.lengths || !(*loaded)->SameConfig(like)) {
    return Corrupt(name, absl::StrCat(what, " holds another session's tokens"));
  }
  return LoadedBase{*std::move(bytes), *std::move(loaded)};
}

// A journal's block records, replayed over `blocks` (per layer, the rows of
// the full blocks of its base, if any): per layer, the rows of the full
// blocks it holds in order. A record that ends the file torn (cut short,
// or its checksum wrong) ends the replay; anywhere else it is corruption.
absl::StatusOr<std::vector<std::vector<absl::string_view>>> ReplayJournal(
    Decoder& in, const DecodeSession& session, absl::string_view name,
    std::vector<std::vector<absl::string_view>> blocks) {
  for (int64_t count = 0; in.left() >= kBlockFieldBytes; ++count) {
    absl::string_view fields, rows;
    uint32_t layer = 0, crc = 0;
    int64_t first = 0, tokens = 0;
    in.GetRaw(kBlockFieldBytes - 4, &fields);
    in.Get(&crc);
    Decoder field(fields.substr(4));
    field.Get(&layer);
    field.Get(&first);
    field.Get(&tokens);
    const std::string record = absl::StrCat("journal record ", count);
    if (fields.substr(0, 4) != kBlockTag) {
      return Corrupt(name, absl::StrCat(record, ": not a block record"));
    }
    if (layer >= blocks.size() || first < 0 || first % kCacheBlockKeys != 0 ||
        (tokens != 0 && tokens != kCacheBlockKeys) ||
        first + tokens > session.max_length()) {
      return Corrupt(
          name, absl::StrCat(record, ": layer ", layer, ", tokens ", first,
                             " + ", tokens, " is no block of this session"));
    }
    if (!in.GetRaw(session.RowBytes(tokens), &rows)) break;  // torn
    if (Crc(rows, Crc(fields)) != crc) {
      if (in.left() == 0) break;  // torn
      return Corrupt(name, absl::StrCat(record, ": checksum mismatch"));
    }
    std::vector<absl::string_view>& held = blocks[layer];
    const size_t block = static_cast<size_t>(first / kCacheBlockKeys);
    if (block > held.size()) {
      return Corrupt(
          name, absl::StrCat(record, ": starts at token ", first, "; layer ",
                             layer, " holds ", held.size() * kCacheBlockKeys));
    }
    held.resize(block);  // a rewind drops what follows
    if (tokens > 0) held.push_back(rows);
  }
  return blocks;
}

}  // namespace

std::string SessionBlockFields(int64_t layer, int64_t first, int64_t tokens,
                               absl::string_view rows) {
  Encoder fields;
  fields.PutRaw(kBlockTag);
  fields.Put<uint32_t>(static_cast<uint32_t>(layer));
  fields.Put<int64_t>(first);
  fields.Put<int64_t>(tokens);
  fields.Put<uint32_t>(Crc(rows, Crc(fields.bytes())));
  return fields.bytes();
}

absl::StatusOr<std::string> SessionJournalHeader(const DecodeSession& session,
                                                 absl::string_view id,
                                                 const SessionFileBase* base) {
  ATTN_RETURN_IF_ERROR(VerifyWritable(session));
  // A base's lengths stand for the layers' (a file's may not be below it).
  std::vector<int64_t> lengths(static_cast<size_t>(session.num_layers()), 0);
  if (base != nullptr) lengths = base->lengths;
  return HeaderRecord(HeaderBody(session, id, session.config().model, lengths,
                                 /*unconfirmed=*/false, base),
                      base != nullptr ? kSessionFileVersion : kPlainVersion);
}

absl::StatusOr<std::unique_ptr<DecodeSession>> LoadSessionJournal(
    absl::string_view bytes, absl::string_view name,
    const SessionFileLoader& loader, SessionFileHeader* header_out) {
  SessionFileHeader header;
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<DecodeSession> session,
                        CreateFromHeader(bytes, name, loader, header));
  // Lengths 0, or its base's.
  for (size_t l = 0; l < header.lengths.size(); ++l) {
    if (header.lengths[l] != (header.base ? header.base->lengths[l] : 0)) {
      return Corrupt(name, "not a journal (it holds lengths)");
    }
  }
  // The base's blocks come first, replayed over: the rows of its block
  // records, in place in its bytes (checked whole, every block full).
  std::vector<std::vector<absl::string_view>> replayed(header.lengths.size());
  LoadedBase base;
  if (header.base.has_value()) {
    ATTN_ASSIGN_OR_RETURN(base, LoadBase(header, loader, name, *session));
    ATTN_ASSIGN_OR_RETURN(size_t at, HeaderRecordSize(base.bytes, name));
    const size_t rows = session->RowBytes(kCacheBlockKeys);
    for (size_t l = 0; l < replayed.size(); ++l) {
      for (int64_t first = 0; first < header.lengths[l];
           first += kCacheBlockKeys) {
        replayed[l].push_back(
            absl::string_view(base.bytes).substr(at + kBlockFieldBytes, rows));
        at += kBlockFieldBytes + rows;
      }
    }
  }
  ATTN_ASSIGN_OR_RETURN(const size_t header_bytes,
                        HeaderRecordSize(bytes, name));
  Decoder in(bytes.substr(header_bytes));
  ATTN_ASSIGN_OR_RETURN(const auto blocks,
                        ReplayJournal(in, *session, name, std::move(replayed)));
  for (size_t layer = 0; layer < blocks.size(); ++layer) {
    header.lengths[layer] =
        static_cast<int64_t>(blocks[layer].size()) * kCacheBlockKeys;
  }
  ATTN_RETURN_IF_ERROR(loader.admit(header, *session));
  for (size_t layer = 0; layer < blocks.size(); ++layer) {
    for (size_t block = 0; block < blocks[layer].size(); ++block) {
      const int64_t first = static_cast<int64_t>(block) * kCacheBlockKeys;
      const absl::Status appended =
          session->AppendRows(static_cast<int64_t>(layer), first,
                              kCacheBlockKeys, blocks[layer][block]);
      if (!appended.ok()) {
        return Corrupt(name, absl::StrCat("layer ", layer, " tokens ", first,
                                          ": ", appended.message()));
      }
    }
  }
  header.unconfirmed = true;
  if (header_out != nullptr) *header_out = std::move(header);
  return session;
}

absl::Status WriteSessionFile(
    const DecodeSession& session, absl::string_view id,
    absl::FunctionRef<absl::Status(absl::string_view)> write, bool unconfirmed,
    const SessionFileShape& shape) {
  ATTN_ASSIGN_OR_RETURN(SessionFileImage image,
                        SessionFileImage::Of(session, id, unconfirmed, shape));
  for (uint64_t at = 0; at < image.size();) {
    ATTN_ASSIGN_OR_RETURN(const absl::string_view piece,
                          image.Read(at, image.size() - at));
    ATTN_RETURN_IF_ERROR(write(piece));
    at += piece.size();
  }
  return absl::OkStatus();
}

absl::StatusOr<SessionFileImage> SessionFileImage::Of(
    const DecodeSession& session, absl::string_view id, bool unconfirmed,
    const SessionFileShape& shape) {
  ATTN_RETURN_IF_ERROR(VerifyWritable(session));
  SessionFileImage image(session);
  DecodeSession::Contents contents = session.contents();
  image.contents_version_ = contents.version;
  const size_t layers = contents.lengths.size();
  std::vector<int64_t> from(layers, 0);
  if (shape.base.has_value()) from = shape.base->lengths;
  if (shape.prefix.has_value()) contents.lengths = *shape.prefix;
  for (size_t l = 0; l < layers; ++l) {
    if (contents.lengths.size() != layers || from.size() != layers ||
        from[l] % kCacheBlockKeys != 0 || from[l] > contents.lengths[l] ||
        contents.lengths[l] > session.length(static_cast<int64_t>(l))) {
      return absl::InvalidArgumentError(
          "a session file's prefix or base is not within the session");
    }
  }
  image.header_ = HeaderRecord(
      HeaderBody(session, id, session.config().model, contents.lengths,
                 unconfirmed, shape.base ? &*shape.base : nullptr),
      shape.base ? kSessionFileVersion : kPlainVersion);
  image.records_.push_back(Record{0, -1, 0, 0});
  uint64_t at = image.header_.size();
  for (size_t layer = 0; layer < layers; ++layer) {
    for (int64_t first = from[layer]; first < contents.lengths[layer];
         first += kCacheBlockKeys) {
      const int64_t tokens =
          std::min(kCacheBlockKeys, contents.lengths[layer] - first);
      image.records_.push_back(
          Record{at, static_cast<int64_t>(layer), first, tokens});
      at += kBlockFieldBytes + session.RowBytes(tokens);
    }
  }
  image.records_.push_back(Record{at, -2, 0, 0});
  image.size_ = at + kEndBytes;
  return image;
}

absl::Status SessionFileImage::AppendRows(const Record& record,
                                          std::string& rows) const {
  const absl::StatusOr<uint64_t> read =
      session_->CopyRows(record.layer, record.first, record.tokens, rows);
  if (read.ok() && *read == contents_version_) return absl::OkStatus();
  return absl::AbortedError(
      "the session changed (a step or a rewind) while it was read");
}

absl::Status SessionFileImage::Fingerprint() {
  uint32_t blocks = 0;
  std::string rows;
  for (const Record& record : records_) {
    if (record.layer < 0) continue;
    rows.clear();
    ATTN_RETURN_IF_ERROR(AppendRows(record, rows));
    const uint32_t crc = Crc(rows);
    blocks =
        Crc(absl::string_view(reinterpret_cast<const char*>(&crc), sizeof(crc)),
            blocks);
  }
  version_ = uint64_t{Crc(header_)} << 32 | blocks;
  if (version_ == 0) version_ = 1;  // 0 asks for any version
  return absl::OkStatus();
}

absl::Status SessionFileImage::Build(size_t index) {
  const Record& record = records_[index];
  built_index_ = SIZE_MAX;
  built_.clear();
  if (record.layer == -1) {
    built_ = header_;
  } else if (record.layer == -2) {
    const int64_t blocks = static_cast<int64_t>(records_.size()) - 2;
    Encoder end;
    end.PutRaw(kEndTag);
    end.Put<int64_t>(blocks);
    end.Put<uint32_t>(Crc(absl::string_view(
        reinterpret_cast<const char*>(&blocks), sizeof(blocks))));
    built_ = end.bytes();
  } else {
    // The rows go after room for the fields, which need their checksum.
    built_.resize(kBlockFieldBytes);
    if (const absl::Status read = AppendRows(record, built_); !read.ok()) {
      built_.clear();
      return read;
    }
    const std::string fields =
        SessionBlockFields(record.layer, record.first, record.tokens,
                           absl::string_view(built_).substr(kBlockFieldBytes));
    std::memcpy(built_.data(), fields.data(), fields.size());
  }
  built_index_ = index;
  return absl::OkStatus();
}

absl::StatusOr<absl::string_view> SessionFileImage::Read(uint64_t offset,
                                                         size_t n) {
  if (offset > size_) {
    return absl::OutOfRangeError(absl::StrCat(
        "offset ", offset, " is past the file's ", size_, " bytes"));
  }
  if (offset == size_) return absl::string_view();
  // The last record starting at or before `offset`.
  const auto next = std::upper_bound(
      records_.begin(), records_.end(), offset,
      [](uint64_t at, const Record& record) { return at < record.offset; });
  const size_t index = static_cast<size_t>(next - records_.begin()) - 1;
  if (index != built_index_) ATTN_RETURN_IF_ERROR(Build(index));
  const size_t skip = static_cast<size_t>(offset - records_[index].offset);
  return absl::string_view(built_).substr(skip, n);
}

absl::StatusOr<SessionFileHeader> ReadSessionFileHeader(
    absl::string_view bytes, absl::string_view name) {
  ATTN_ASSIGN_OR_RETURN(const size_t record, HeaderRecordSize(bytes, name));
  if (bytes.size() < record) return Corrupt(name, "truncated header");
  uint32_t version = 0, crc = 0;
  std::memcpy(&version, bytes.data() + kMagic.size(), sizeof(version));
  const absl::string_view body = bytes.substr(16, record - 20);
  std::memcpy(&crc, bytes.data() + record - 4, sizeof(crc));
  if (Crc(body) != crc) return Corrupt(name, "header checksum mismatch");
  SessionFileHeader header;
  bool model_session = false;
  if (!ParseHeaderBody(body, version, &header, &model_session)) {
    return Corrupt(name, "malformed header");
  }
  return header;
}

absl::StatusOr<std::unique_ptr<DecodeSession>> LoadSessionFile(
    const SessionFileSource& source, absl::string_view name,
    const SessionFileLoader& loader, SessionFileHeader* header_out) {
  SessionFileBuilder builder{std::string(name)};
  // One record a read; the size the header describes is checked before
  // any block is read.
  for (uint64_t at = 0; !builder.complete();) {
    const size_t n = static_cast<size_t>(
        std::min<uint64_t>(builder.needed(), source.size - at));
    if (n == 0) {
      return Corrupt(
          name, builder.header() == nullptr ? "truncated header" : "truncated");
    }
    ATTN_ASSIGN_OR_RETURN(const absl::string_view piece, source.read(at, n));
    const bool had_header = builder.header() != nullptr;
    ATTN_RETURN_IF_ERROR(builder.Add(piece, loader));
    at += piece.size();
    if (!had_header && builder.header() != nullptr &&
        builder.expected_size() != source.size) {
      return Corrupt(name, absl::StrCat(source.size, " bytes; its header ",
                                        "describes ", builder.expected_size()));
    }
  }
  if (header_out != nullptr) *header_out = *builder.header();
  return builder.Release();
}

absl::Status SessionFileBuilder::Add(absl::string_view bytes,
                                     const SessionFileLoader& loader) {
  while (status_.ok() && !bytes.empty()) {
    if (stage_ == Stage::kDone) {
      status_ = Corrupt(name_, absl::StrCat("bytes past its end record (",
                                            expected_size_, " bytes)"));
      break;
    }
    // A whole record in `bytes` is taken where it lies; pieces of one are
    // gathered first.
    const size_t take = std::min(bytes.size(), need_ - pending_.size());
    received_ += take;
    if (pending_.empty() && take == need_) {
      status_ = Take(bytes.substr(0, take), loader);
    } else {
      pending_.append(bytes.data(), take);
      if (pending_.size() == need_) {
        record_.swap(pending_);
        pending_.clear();
        status_ = Take(record_, loader);
      }
    }
    bytes.remove_prefix(take);
  }
  return status_;
}

absl::Status SessionFileBuilder::Take(absl::string_view bytes,
                                      const SessionFileLoader& loader) {
  switch (stage_) {
    case Stage::kPrefix: {
      ATTN_ASSIGN_OR_RETURN(need_, HeaderRecordSize(bytes, name_));
      pending_.assign(bytes.data(), bytes.size());  // the header's start
      stage_ = Stage::kHeader;
      return absl::OkStatus();
    }
    case Stage::kHeader:
      return TakeHeader(bytes, loader);
    case Stage::kFields:
      return TakeFields(bytes);
    case Stage::kRows:
      return TakeRows(bytes);
    case Stage::kEnd: {
      Decoder in(bytes);
      absl::string_view tag;
      int64_t blocks = -1;
      uint32_t crc = 0;
      if (!in.GetRaw(4, &tag) || tag != kEndTag || !in.Get(&blocks) ||
          !in.Get(&crc) ||
          crc != Crc(absl::string_view(reinterpret_cast<const char*>(&blocks),
                                       sizeof(blocks))) ||
          blocks != count_) {
        return Corrupt(name_, "its end record is missing or wrong");
      }
      stage_ = Stage::kDone;
      return absl::OkStatus();
    }
    case Stage::kDone:
      break;
  }
  return absl::OkStatus();
}

absl::Status SessionFileBuilder::TakeHeader(absl::string_view bytes,
                                            const SessionFileLoader& loader) {
  ATTN_ASSIGN_OR_RETURN(session_,
                        CreateFromHeader(bytes, name_, loader, header_));
  ATTN_RETURN_IF_ERROR(loader.admit(header_, *session_));
  if (header_.base.has_value()) ATTN_RETURN_IF_ERROR(TakeBase(loader));
  expected_size_ = bytes.size() + kEndBytes;
  for (size_t l = 0; l < header_.lengths.size(); ++l) {
    const int64_t length = header_.lengths[l] - BaseLength(l);
    const int64_t blocks = (length + kCacheBlockKeys - 1) / kCacheBlockKeys;
    expected_size_ += static_cast<uint64_t>(blocks) * kBlockFieldBytes +
                      session_->RowBytes(length);
  }
  layer_ = 0;
  first_ = BaseLength(0) - kCacheBlockKeys;
  NextBlock();
  return absl::OkStatus();
}

int64_t SessionFileBuilder::BaseLength(size_t layer) const {
  return header_.base.has_value() && layer < header_.base->lengths.size()
             ? header_.base->lengths[layer]
             : 0;
}

absl::Status SessionFileBuilder::TakeBase(const SessionFileLoader& loader) {
  ATTN_ASSIGN_OR_RETURN(LoadedBase base,
                        LoadBase(header_, loader, name_, *session_));
  session_ = std::move(base.session);
  return absl::OkStatus();
}

void SessionFileBuilder::NextBlock() {
  first_ += kCacheBlockKeys;
  while (layer_ < static_cast<int64_t>(header_.lengths.size()) &&
         first_ >= header_.lengths[static_cast<size_t>(layer_)]) {
    ++layer_;
    first_ = BaseLength(static_cast<size_t>(layer_));
  }
  if (layer_ == static_cast<int64_t>(header_.lengths.size())) {
    stage_ = Stage::kEnd;
    need_ = kEndBytes;
    return;
  }
  tokens_ = std::min(kCacheBlockKeys,
                     header_.lengths[static_cast<size_t>(layer_)] - first_);
  stage_ = Stage::kFields;
  need_ = kBlockFieldBytes;
}

std::string SessionFileBuilder::Block() const {
  return absl::StrCat("block ", count_, " (layer ", layer_, ", tokens ", first_,
                      "..", first_ + tokens_, ")");
}

absl::Status SessionFileBuilder::TakeFields(absl::string_view record) {
  const absl::string_view fields = record.substr(0, kBlockFieldBytes - 4);
  uint32_t layer = 0;
  int64_t first = 0, tokens = 0;
  Decoder field(record.substr(4));
  field.Get(&layer);
  field.Get(&first);
  field.Get(&tokens);
  field.Get(&crc_);
  if (fields.substr(0, 4) != kBlockTag) {
    return Corrupt(name_, absl::StrCat(Block(), ": not a block record"));
  }
  if (layer != layer_ || first != first_ || tokens != tokens_) {
    return Corrupt(name_,
                   absl::StrCat(Block(), ": found a record of layer ", layer,
                                ", tokens ", first, " + ", tokens, " instead"));
  }
  fields_crc_ = Crc(fields);
  stage_ = Stage::kRows;
  need_ = session_->RowBytes(tokens_);
  return absl::OkStatus();
}

absl::Status SessionFileBuilder::TakeRows(absl::string_view rows) {
  if (Crc(rows, fields_crc_) != crc_) {
    return Corrupt(name_, absl::StrCat(Block(), ": checksum mismatch"));
  }
  const absl::Status appended =
      session_->AppendRows(layer_, first_, tokens_, rows);
  if (!appended.ok()) {
    return Corrupt(name_, absl::StrCat(Block(), ": ", appended.message()));
  }
  ++count_;
  NextBlock();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DecodeSession>> SessionFileBuilder::Release() {
  ATTN_RETURN_IF_ERROR(status_);
  if (stage_ != Stage::kDone) {
    return absl::FailedPreconditionError(
        absl::StrCat("session file ", EchoString(name_), ": ", received_,
                     " bytes taken of ", expected_size_));
  }
  return std::move(session_);
}

absl::StatusOr<std::unique_ptr<DecodeSession>> LoadSessionFile(
    absl::string_view bytes, absl::string_view name,
    const SessionFileLoader& loader, SessionFileHeader* header_out) {
  const auto read = [&](uint64_t offset,
                        size_t n) -> absl::StatusOr<absl::string_view> {
    if (offset > bytes.size() || n > bytes.size() - offset) {
      return Corrupt(name, "truncated");
    }
    return bytes.substr(offset, n);
  };
  return LoadSessionFile(SessionFileSource{bytes.size(), read}, name, loader,
                         header_out);
}

absl::StatusOr<std::unique_ptr<DecodeSession>> LoadSessionJournal(
    const SessionFileSource& source, absl::string_view name,
    const SessionFileLoader& loader, SessionFileHeader* header) {
  ATTN_ASSIGN_OR_RETURN(const absl::string_view bytes,
                        source.read(0, source.size));
  return LoadSessionJournal(bytes, name, loader, header);
}

}  // namespace attnserve
