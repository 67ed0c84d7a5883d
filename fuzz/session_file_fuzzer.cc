// Fuzz target: any bytes as a session file (LoadSessionFile) and as a
// journal (LoadSessionJournal), with a session budget of 64 MiB. What loads
// as a file must write back as a file that loads again and writes the same
// bytes, holding the lengths its header named; what loads as a journal
// holds whole blocks, the lengths it reports. The same bytes taken in
// pieces (an import stream: SessionFileBuilder) load exactly when the file
// does, into a session that writes the same bytes. A second session file
// in the input (from its second "ATTNSESS" on) is the first one's base
// file, for a file of version 3 that names one.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "core/kv_cache.h"
#include "core/session_file.h"
#include "core/session_store.h"
#include "fuzz/fuzz_support.h"

namespace attnserve::fuzz {
namespace {

[[noreturn]] void Fail(const char* problem) {
  std::fprintf(stderr, "fuzz: session file round trip: %s\n", problem);
  std::abort();
}

const SessionStore& Store() {
  static const SessionStore* store = [] {
    SessionStore::Options options;
    options.max_bytes = size_t{64} << 20;
    options.max_reserved_bytes = size_t{256} << 20;
    return new SessionStore(options);
  }();
  return *store;
}

// The input's base file, if any (see above); set per input.
absl::string_view base_file;

const SessionFileLoader& Loader() {
  static const auto* base = new auto([]() -> absl::StatusOr<std::string> {
    if (base_file.empty()) return absl::NotFoundError("no base file");
    return std::string(base_file);
  });
  static const auto* layer_of =
      new auto([](absl::string_view)
                   -> absl::StatusOr<std::shared_ptr<const MultiHeadLayer>> {
        return absl::NotFoundError("no models");
      });
  static const auto* verify = new auto([](const DecodeSessionConfig& config) {
    return Store().VerifyConfig(config);
  });
  static const SessionFileLoader* loader = new SessionFileLoader{
      .layer_of = *layer_of, .verify = *verify, .base = *base};
  return *loader;
}

// A session file read piece by piece into one buffer, as a session
// directory reads it; a journal whole.
absl::StatusOr<std::unique_ptr<DecodeSession>> Load(absl::string_view bytes,
                                                    SessionFileHeader* header,
                                                    bool journal = false) {
  if (journal) return LoadSessionJournal(bytes, "input", Loader(), header);
  std::string buffer;
  const auto read = [&](uint64_t offset,
                        size_t n) -> absl::StatusOr<absl::string_view> {
    if (offset > bytes.size() || n > bytes.size() - offset) {
      return absl::DataLossError("input: truncated");
    }
    buffer.assign(bytes.data() + offset, n);
    return absl::string_view(buffer);
  };
  return LoadSessionFile(SessionFileSource{bytes.size(), read}, "input",
                         Loader(), header);
}

std::string Write(const DecodeSession& session, const SessionFileHeader& h) {
  std::string bytes;
  const absl::Status written =
      WriteSessionFile(session, h.id, [&](absl::string_view piece) {
        bytes.append(piece.data(), piece.size());
        return absl::OkStatus();
      });
  if (!written.ok()) Fail(std::string(written.message()).c_str());
  return bytes;
}

// `bytes` taken by a SessionFileBuilder in pieces whose size the input
// picks.
absl::StatusOr<std::unique_ptr<DecodeSession>> Build(absl::string_view bytes) {
  const size_t piece = 1 + (bytes.size() * 7919) % 4099;
  SessionFileBuilder builder("input");
  for (size_t at = 0; at < bytes.size(); at += piece) {
    const absl::Status added = builder.Add(bytes.substr(at, piece), Loader());
    if (!added.ok()) return added;
    if (builder.received() != std::min(bytes.size(), at + piece)) {
      Fail("a builder took other than the bytes it was given");
    }
  }
  return builder.Release();
}

}  // namespace
}  // namespace attnserve::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;        // NOLINT: one function
  using namespace attnserve::fuzz;  // NOLINT
  absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  const size_t second = bytes.find("ATTNSESS", 1);
  base_file = second == absl::string_view::npos ? absl::string_view()
                                                : bytes.substr(second);
  bytes = bytes.substr(0, second);
  SessionFileHeader journal_header;
  absl::StatusOr<std::unique_ptr<DecodeSession>> journal =
      Load(bytes, &journal_header, /*journal=*/true);
  CheckStatus("LoadSessionJournal", journal.status());
  if (journal.ok()) {
    for (size_t layer = 0; layer < journal_header.lengths.size(); ++layer) {
      const int64_t length = (*journal)->length(static_cast<int64_t>(layer));
      if (length != journal_header.lengths[layer] ||
          length % kCacheBlockKeys != 0) {
        Fail("a journal's layer holds other than the whole blocks it reports");
      }
    }
  }
  SessionFileHeader header;
  absl::StatusOr<std::unique_ptr<DecodeSession>> session = Load(bytes, &header);
  CheckStatus("LoadSessionFile", session.status());
  absl::StatusOr<std::unique_ptr<DecodeSession>> built = Build(bytes);
  CheckStatus("SessionFileBuilder", built.status());
  if (built.ok() != session.ok()) {
    Fail("a file loads whole but not in pieces, or the other way round");
  }
  if (!session.ok()) return 0;
  if (Write(**built, header) != Write(**session, header)) {
    Fail("a file taken in pieces writes other bytes");
  }
  for (size_t layer = 0; layer < header.lengths.size(); ++layer) {
    if ((*session)->length(static_cast<int64_t>(layer)) !=
        header.lengths[layer]) {
      Fail("a layer's length is not its header's");
    }
  }
  const std::string written = Write(**session, header);
  SessionFileHeader again_header;
  absl::StatusOr<std::unique_ptr<DecodeSession>> again =
      Load(written, &again_header);
  if (!again.ok()) Fail(std::string(again.status().message()).c_str());
  if (Write(**again, again_header) != written) Fail("bytes differ");
  return 0;
}
