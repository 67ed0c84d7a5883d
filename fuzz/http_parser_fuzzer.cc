// Fuzz target: any bytes as what a client sends on an HTTP connection, read
// request after request as the server does (ParseRequestHead, then the
// body by its framing). The oracle: the requests, bodies and errors found
// must not depend on how the bytes arrive, whole or in pieces (the first
// input byte picks the piece size), and no read may take more than it was
// given.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/http/http_parser.h"

namespace {

[[noreturn]] void Fail(const char* problem) {
  std::fprintf(stderr, "fuzz: http parser: %s\n", problem);
  std::abort();
}

// What reading the connection found: one line per request or error.
std::vector<std::string> ReadAll(absl::string_view bytes, size_t piece) {
  attnserve::HttpLimits limits;
  limits.max_head_bytes = 2048;
  limits.max_fields = 16;
  limits.max_body_bytes = 4096;
  std::vector<std::string> found;
  std::string buffer;
  size_t offered = 0;
  bool in_body = false;
  attnserve::BodyReader reader;
  std::string body;
  std::string head_summary;
  while (true) {
    if (!in_body) {
      const attnserve::HeadParse parse =
          attnserve::ParseRequestHead(buffer, limits);
      if (parse.kind == attnserve::HeadParse::Kind::kError) {
        found.push_back(absl::StrCat("error ", parse.error.status));
        return found;  // the connection closes
      }
      if (parse.kind == attnserve::HeadParse::Kind::kHead) {
        if (parse.consumed > buffer.size()) Fail("head took unread bytes");
        buffer.erase(0, parse.consumed);
        head_summary = absl::StrCat(parse.head.method, " ", parse.head.target,
                                    " ", static_cast<int>(parse.head.framing),
                                    " ", parse.head.keep_alive);
        reader = attnserve::BodyReader(parse.head, limits.max_body_bytes);
        body.clear();
        in_body = true;
      }
    }
    if (in_body) {
      const size_t consumed = reader.Consume(buffer, &body);
      if (consumed > buffer.size()) Fail("body took unread bytes");
      if (reader.error().has_value()) {
        found.push_back(absl::StrCat("error ", reader.error()->status));
        return found;
      }
      buffer.erase(0, consumed);
      if (body.size() != reader.body_bytes()) Fail("body size miscounted");
      if (body.size() > limits.max_body_bytes) Fail("body over the limit");
      if (reader.done()) {
        found.push_back(absl::StrCat(head_summary, " body=", body));
        in_body = false;
        continue;  // the next request may already be buffered
      }
    }
    if (offered == bytes.size()) return found;
    const size_t take = std::min(piece, bytes.size() - offered);
    buffer.append(bytes.data() + offered, take);
    offered += take;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t piece = 1 + data[0] % 17;
  const absl::string_view bytes(reinterpret_cast<const char*>(data) + 1,
                                size - 1);
  const std::vector<std::string> whole = ReadAll(bytes, bytes.size() + 1);
  const std::vector<std::string> pieces = ReadAll(bytes, piece);
  if (whole != pieces) Fail("the result depends on how the bytes arrive");
  return 0;
}
