// HTTP/1.1 request framing (RFC 9112), strictly: a request's head is parsed
// only once it is complete, and its body is read by the framing the head
// declares, so that no byte of one request is ever taken for another.
//
// What is refused, always with the connection closed afterwards (the
// framing of what follows cannot be trusted):
//  - a request line or field line not ended by CRLF (a bare CR or LF), a
//    field name with white space before the colon, obs-fold (a line that
//    starts with white space), control characters in a value: 400;
//  - Content-Length that is not one run of digits, differing values (two
//    headers, or a list), both Content-Length and Transfer-Encoding, a
//    Transfer-Encoding on HTTP/1.0: 400; a transfer coding other than
//    "chunked" alone: 501;
//  - no Host, or more than one, on HTTP/1.1: 400; versions other than
//    HTTP/1.0 and HTTP/1.1: 505;
//  - a head over HttpLimits::max_head_bytes or max_fields: 431; a body over
//    max_body_bytes: 413.
// A request with neither Content-Length nor Transfer-Encoding has an empty
// body (RFC 9112 6.3). Up to two empty lines before a request line are
// skipped (RFC 9112 2.2).
//
// Thread-safety: the functions share nothing; a ChunkedBodyReader or
// BodyReader is used by one thread at a time.
#ifndef ATTNSERVE_SERVER_HTTP_HTTP_PARSER_H_
#define ATTNSERVE_SERVER_HTTP_HTTP_PARSER_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace attnserve {

struct HttpLimits {
  size_t max_head_bytes = 32 << 10;
  size_t max_fields = 100;
  uint64_t max_body_bytes = 1 << 20;
};

// An error answered with `status` and `message`, after which the
// connection closes.
struct HttpError {
  int status = 400;
  std::string message;
};

enum class BodyFraming { kNone, kContentLength, kChunked };

struct HttpRequestHead {
  std::string method;
  std::string target;  // as sent, e.g. "/v2/models/demo/infer?x=1"
  int minor_version = 1;
  // In the order received; names as sent (compare them case-insensitively).
  std::vector<std::pair<std::string, std::string>> fields;
  BodyFraming framing = BodyFraming::kNone;
  uint64_t content_length = 0;  // with kContentLength
  // Whether the connection may carry another request after this one
  // (HTTP/1.1 without "Connection: close", or HTTP/1.0 with keep-alive).
  bool keep_alive = true;
  // "Expect: 100-continue": the client waits for an interim response before
  // it sends the body.
  bool expect_continue = false;

  // The first field named `name` (case-insensitive), or nullptr.
  const std::string* Find(absl::string_view name) const;
  // The target's path (before any '?').
  absl::string_view path() const;
};

// The result of looking for a request head at the start of a buffer.
struct HeadParse {
  enum class Kind { kNeedMore, kHead, kError } kind = Kind::kNeedMore;
  HttpRequestHead head;  // with kHead
  size_t consumed = 0;   // bytes of the head, with kHead
  HttpError error;       // with kError
};

// Parses the request head at the start of `buffer`: kNeedMore until the
// empty line that ends it has arrived (or an error can already be seen).
HeadParse ParseRequestHead(absl::string_view buffer, const HttpLimits& limits);

// Reads a body by its framing from successive pieces of the connection's
// bytes, into a string or discarding it.
class BodyReader {
 public:
  BodyReader() = default;
  BodyReader(const HttpRequestHead& head, uint64_t max_body_bytes);

  // Takes what it can of `input` (the bytes after the head, or after what
  // the previous call consumed) and appends the body bytes to `body` (null:
  // discards them). Returns the bytes of `input` consumed; after an error,
  // error() is set and nothing more is taken.
  size_t Consume(absl::string_view input, std::string* body);
  bool done() const { return state_ == State::kDone; }
  const std::optional<HttpError>& error() const { return error_; }
  // Body bytes taken so far.
  uint64_t body_bytes() const { return body_bytes_; }

 private:
  enum class State {
    kLength,        // Content-Length: `remaining_` bytes to go
    kChunkSize,     // chunked: waiting for a chunk-size line
    kChunkData,     // chunked: `remaining_` bytes of chunk data
    kChunkDataEnd,  // chunked: the CRLF after chunk data
    kTrailers,      // chunked: trailer lines until an empty one
    kDone,
  };
  size_t Fail(int status, std::string message);
  // A chunk-size line or a trailer line at the start of `rest`: the bytes
  // it takes, or 0 when it has not all arrived (or on an error).
  size_t ChunkSizeLine(absl::string_view rest);
  size_t TrailerLine(absl::string_view rest);
  // One line (without CRLF) at the start of `input`: its length and the
  // bytes to consume, or nullopt when incomplete; sets error_ for a bare LF
  // or an over-long line.
  std::optional<std::pair<size_t, size_t>> Line(absl::string_view input);

  State state_ = State::kDone;
  uint64_t remaining_ = 0;
  uint64_t body_bytes_ = 0;
  uint64_t max_body_bytes_ = 0;
  size_t trailer_bytes_ = 0;
  std::optional<HttpError> error_;
};

// The standard reason phrase of `status` ("Not Found"), or "Status".
absl::string_view HttpReason(int status);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_HTTP_HTTP_PARSER_H_
