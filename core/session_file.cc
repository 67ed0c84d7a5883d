#include "core/session_file.h"

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

std::string HeaderBody(const DecodeSession& session, absl::string_view id,
                       absl::string_view model, bool journal,
                       bool unconfirmed) {
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
  for (int64_t layer = 0; layer < config.num_layers; ++layer) {
    body.Put<int64_t>(journal ? 0 : session.length(layer));
  }
  body.Put<uint32_t>(unconfirmed ? kUnconfirmedFlag : 0);
  return body.bytes();
}

// The header record of a session file whose body is `body`.
std::string HeaderRecord(absl::string_view body) {
  Encoder header;
  header.PutRaw(kMagic);
  header.Put<uint32_t>(kSessionFileVersion);
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
  if (version >= 2 && (!in.Get(&flags) || (flags & ~kUnconfirmedFlag) != 0)) {
    return false;
  }
  header->unconfirmed = (flags & kUnconfirmedFlag) != 0;
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

// Reads the block records of `session` from `read`, from byte `at` on, and
// appends their rows. A piece `read` gives is valid until its next call.
absl::Status LoadBlocks(const SessionFileSource& source, uint64_t at,
                        const SessionFileHeader& header, absl::string_view name,
                        DecodeSession& session) {
  int64_t count = 0;
  for (size_t layer = 0; layer < header.lengths.size(); ++layer) {
    for (int64_t first = 0; first < header.lengths[layer];
         first += kCacheBlockKeys, ++count) {
      const int64_t expected =
          std::min(kCacheBlockKeys, header.lengths[layer] - first);
      const std::string block =
          absl::StrCat("block ", count, " (layer ", layer, ", tokens ", first,
                       "..", first + expected, ")");
      ATTN_ASSIGN_OR_RETURN(const absl::string_view record,
                            source.read(at, kBlockFieldBytes));
      at += kBlockFieldBytes;
      if (record.size() != kBlockFieldBytes) {
        return Corrupt(name, absl::StrCat(block, ": truncated"));
      }
      const absl::string_view fields = record.substr(0, kBlockFieldBytes - 4);
      uint32_t layer_field = 0, crc = 0;
      int64_t first_field = 0, tokens = 0;
      Decoder field(record.substr(4));
      field.Get(&layer_field);
      field.Get(&first_field);
      field.Get(&tokens);
      field.Get(&crc);
      if (fields.substr(0, 4) != kBlockTag) {
        return Corrupt(name, absl::StrCat(block, ": not a block record"));
      }
      if (layer_field != layer || first_field != first || tokens != expected) {
        return Corrupt(name, absl::StrCat(block, ": found a record of layer ",
                                          layer_field, ", tokens ", first_field,
                                          " + ", tokens, " instead"));
      }
      // Before the rows' read, which replaces the fields' bytes.
      const uint32_t fields_crc = Crc(fields);
      const size_t row_bytes = session.RowBytes(tokens);
      ATTN_ASSIGN_OR_RETURN(const absl::string_view rows,
                            source.read(at, row_bytes));
      at += row_bytes;
      if (rows.size() != row_bytes) {
        return Corrupt(name, absl::StrCat(block, ": truncated"));
      }
      if (Crc(rows, fields_crc) != crc) {
        return Corrupt(name, absl::StrCat(block, ": checksum mismatch"));
      }
      const absl::Status appended =
          session.AppendRows(static_cast<int64_t>(layer), first, tokens, rows);
      if (!appended.ok()) {
        return Corrupt(name, absl::StrCat(block, ": ", appended.message()));
      }
    }
  }
  ATTN_ASSIGN_OR_RETURN(const absl::string_view end,
                        source.read(at, kEndBytes));
  Decoder in(end);
  absl::string_view tag;
  int64_t blocks = -1;
  uint32_t crc = 0;
  if (!in.GetRaw(4, &tag) || tag != kEndTag || !in.Get(&blocks) ||
      !in.Get(&crc) ||
      crc != Crc(absl::string_view(reinterpret_cast<const char*>(&blocks),
                                   sizeof(blocks))) ||
      blocks != count) {
    return Corrupt(name, "its end record is missing or wrong");
  }
  return absl::OkStatus();
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

// The bytes of a header record, to skip it.
size_t HeaderRecordBytes(absl::string_view bytes) {
  uint32_t body_size = 0;
  std::memcpy(&body_size, bytes.data() + kMagic.size() + sizeof(uint32_t),
              sizeof(body_size));
  return kMagic.size() + 3 * sizeof(uint32_t) + body_size;
}

// A journal's block records, replayed: per layer, the rows of the full
// blocks it holds in order. A record that ends the file torn (cut short,
// or its checksum wrong) ends the replay; anywhere else it is corruption.
absl::StatusOr<std::vector<std::vector<absl::string_view>>> ReplayJournal(
    Decoder& in, const DecodeSession& session, absl::string_view name) {
  std::vector<std::vector<absl::string_view>> blocks(
      static_cast<size_t>(session.num_layers()));
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
                                                 absl::string_view id) {
  ATTN_RETURN_IF_ERROR(VerifyWritable(session));
  return HeaderRecord(HeaderBody(session, id, session.config().model,
                                 /*journal=*/true, /*unconfirmed=*/false));
}

absl::StatusOr<std::unique_ptr<DecodeSession>> LoadSessionJournal(
    absl::string_view bytes, absl::string_view name,
    const SessionFileLoader& loader, SessionFileHeader* header_out) {
  SessionFileHeader header;
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<DecodeSession> session,
                        CreateFromHeader(bytes, name, loader, header));
  for (int64_t length : header.lengths) {
    if (length != 0) return Corrupt(name, "not a journal (it holds lengths)");
  }
  Decoder in(bytes.substr(HeaderRecordBytes(bytes)));
  ATTN_ASSIGN_OR_RETURN(const auto blocks, ReplayJournal(in, *session, name));
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
    header.lengths[layer] =
        static_cast<int64_t>(blocks[layer].size()) * kCacheBlockKeys;
  }
  header.unconfirmed = true;
  if (header_out != nullptr) *header_out = std::move(header);
  return session;
}

absl::Status WriteSessionFile(
    const DecodeSession& session, absl::string_view id,
    absl::FunctionRef<absl::Status(absl::string_view)> write,
    bool unconfirmed) {
  ATTN_RETURN_IF_ERROR(VerifyWritable(session));
  const absl::string_view model = session.config().model;
  int64_t blocks = 0;
  ATTN_RETURN_IF_ERROR(session.ReadRows(
      // Under the session's lock: the lengths are those of the blocks.
      [&]() -> absl::Status {
        return write(HeaderRecord(
            HeaderBody(session, id, model, /*journal=*/false, unconfirmed)));
      },
      [&](int64_t layer, int64_t first, int64_t tokens,
          absl::string_view rows) -> absl::Status {
        ATTN_RETURN_IF_ERROR(
            write(SessionBlockFields(layer, first, tokens, rows)));
        ++blocks;
        return write(rows);
      }));
  Encoder end;
  end.PutRaw(kEndTag);
  end.Put<int64_t>(blocks);
  end.Put<uint32_t>(Crc(absl::string_view(
      reinterpret_cast<const char*>(&blocks), sizeof(blocks))));
  return write(end.bytes());
}

absl::StatusOr<SessionFileHeader> ReadSessionFileHeader(
    absl::string_view bytes, absl::string_view name) {
  Decoder in(bytes);
  absl::string_view magic, body;
  uint32_t version = 0, size = 0, crc = 0;
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
  if (in.Get(&size) && size > kMaxHeaderBodyBytes) {
    return Corrupt(name, absl::StrCat("a header of ", size,
                                      " bytes; a header takes at most ",
                                      kMaxHeaderBodyBytes));
  }
  if (!in.GetRaw(size, &body) || !in.Get(&crc)) {
    return Corrupt(name, "truncated header");
  }
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
  // The header record: its fixed fields, then as much as they say.
  ATTN_ASSIGN_OR_RETURN(absl::string_view prefix,
                        source.read(0, std::min<uint64_t>(source.size, 16)));
  uint64_t header_size = source.size;
  if (prefix.size() == 16) {
    uint32_t body_size = 0;
    std::memcpy(&body_size, prefix.data() + 12, sizeof(body_size));
    header_size = std::min<uint64_t>(
        source.size, 16 + std::min(body_size, kMaxHeaderBodyBytes + 1) + 4);
  }
  ATTN_ASSIGN_OR_RETURN(const absl::string_view header_bytes,
                        source.read(0, header_size));
  SessionFileHeader header;
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<DecodeSession> session,
                        CreateFromHeader(header_bytes, name, loader, header));
  // The size the header describes, checked before any block is read.
  const size_t header_record = HeaderRecordBytes(header_bytes);
  uint64_t expected = header_record + kEndBytes;
  for (int64_t length : header.lengths) {
    const int64_t blocks = (length + kCacheBlockKeys - 1) / kCacheBlockKeys;
    expected += static_cast<uint64_t>(blocks) * kBlockFieldBytes +
                session->RowBytes(length);
  }
  if (source.size != expected) {
    return Corrupt(name, absl::StrCat(source.size, " bytes; its header ",
                                      "describes ", expected));
  }
  ATTN_RETURN_IF_ERROR(
      LoadBlocks(source, header_record, header, name, *session));
  if (header_out != nullptr) *header_out = std::move(header);
  return session;
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
