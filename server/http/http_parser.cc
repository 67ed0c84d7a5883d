#include "server/http/http_parser.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace attnserve {
namespace {

// A chunk-size line (with its extensions) or a trailer line, at most.
constexpr size_t kMaxBodyLineBytes = 4096;
// The trailer section of a chunked body, at most.
constexpr size_t kMaxTrailerBytes = 8192;

// RFC 9110 5.6.2: token characters.
bool IsTokenChar(unsigned char c) {
  if (absl::ascii_isalnum(c)) return true;
  switch (c) {
    case '!':
    case '#':
    case '$':
    case '%':
    case '&':
    case '\'':
    case '*':
    case '+':
    case '-':
    case '.':
    case '^':
    case '_':
    case '`':
    case '|':
    case '~':
      return true;
    default:
      return false;
  }
}

bool IsToken(absl::string_view text) {
  return !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
    return IsTokenChar(static_cast<unsigned char>(c));
  });
}

// RFC 9110 5.5: field-value characters (VCHAR, obs-text, SP, HTAB).
bool IsFieldValueChar(unsigned char c) {
  return c == '\t' || c == ' ' || (c >= 0x21 && c != 0x7f);
}

absl::string_view TrimOws(absl::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) {
    text.remove_prefix(1);
  }
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) {
    text.remove_suffix(1);
  }
  return text;
}

HeadParse Error(int status, std::string message) {
  HeadParse parse;
  parse.kind = HeadParse::Kind::kError;
  parse.error = HttpError{status, std::move(message)};
  return parse;
}

// A field line "name: value" into `fields`; an error message, or empty.
std::string ParseFieldLine(
    absl::string_view line,
    std::vector<std::pair<std::string, std::string>>* fields) {
  if (line.front() == ' ' || line.front() == '\t') {
    return "header: a line folded onto the previous one (obs-fold) is not "
           "accepted";
  }
  const size_t colon = line.find(':');
  if (colon == absl::string_view::npos) {
    return "header: a line without ':'";
  }
  const absl::string_view name = line.substr(0, colon);
  if (!IsToken(name)) {
    return "header: a field name must be a token, with no white space "
           "before ':'";
  }
  const absl::string_view value = TrimOws(line.substr(colon + 1));
  for (char c : value) {
    if (!IsFieldValueChar(static_cast<unsigned char>(c))) {
      return absl::StrCat("header ", name,
                          ": control characters are not accepted in a value");
    }
  }
  fields->emplace_back(std::string(name), std::string(value));
  return "";
}

// The elements of a comma-separated list field, trimmed, empty ones
// dropped (RFC 9110 5.6.1).
std::vector<absl::string_view> ListElements(absl::string_view value) {
  std::vector<absl::string_view> elements;
  for (absl::string_view element : absl::StrSplit(value, ',')) {
    element = TrimOws(element);
    if (!element.empty()) elements.push_back(element);
  }
  return elements;
}

// Content-Length and Transfer-Encoding into the head's framing; an error,
// or nullopt.
std::optional<HttpError> ResolveFraming(HttpRequestHead* head,
                                        const HttpLimits& limits) {
  std::optional<uint64_t> length;
  std::vector<std::string> codings;
  bool has_transfer_encoding = false;
  for (const auto& [name, value] : head->fields) {
    if (absl::EqualsIgnoreCase(name, "Content-Length")) {
      const std::vector<absl::string_view> elements = ListElements(value);
      if (elements.empty()) {
        return HttpError{400, "Content-Length: expected a byte count"};
      }
      for (absl::string_view element : elements) {
        if (element.size() > 19 ||
            !std::all_of(element.begin(), element.end(), [](char c) {
              return absl::ascii_isdigit(static_cast<unsigned char>(c));
            })) {
          return HttpError{
              400, absl::StrCat("Content-Length: '", element.substr(0, 32),
                                "' is not a byte count")};
        }
        uint64_t n = 0;
        for (char c : element) n = n * 10 + static_cast<uint64_t>(c - '0');
        if (length.has_value() && *length != n) {
          return HttpError{400, "Content-Length: differing values"};
        }
        length = n;
      }
    } else if (absl::EqualsIgnoreCase(name, "Transfer-Encoding")) {
      has_transfer_encoding = true;
      for (absl::string_view element : ListElements(value)) {
        codings.push_back(absl::AsciiStrToLower(element));
      }
    }
  }
  if (has_transfer_encoding) {
    if (head->minor_version == 0) {
      return HttpError{400, "Transfer-Encoding: not allowed in HTTP/1.0"};
    }
    if (length.has_value()) {
      return HttpError{400,
                       "Content-Length and Transfer-Encoding: send one of "
                       "them, not both"};
    }
    if (codings.empty() || codings.back() != "chunked") {
      return HttpError{400,
                       "Transfer-Encoding: the last coding must be chunked"};
    }
    if (codings.size() != 1) {
      return HttpError{501,
                       "Transfer-Encoding: only chunked is implemented; use "
                       "Content-Encoding for compression"};
    }
    head->framing = BodyFraming::kChunked;
  } else if (length.has_value()) {
    if (*length > limits.max_body_bytes) {
      return HttpError{413, absl::StrCat("body: ", *length,
                                         " bytes exceed the server's limit of ",
                                         limits.max_body_bytes)};
    }
    head->framing = BodyFraming::kContentLength;
    head->content_length = *length;
  }
  return std::nullopt;
}

// Host, Connection and Expect; an error, or nullopt.
std::optional<HttpError> ResolveConnection(HttpRequestHead* head) {
  int hosts = 0;
  bool close = false;
  bool keep_alive = false;
  for (const auto& [name, value] : head->fields) {
    if (absl::EqualsIgnoreCase(name, "Host")) {
      ++hosts;
    } else if (absl::EqualsIgnoreCase(name, "Connection")) {
      for (absl::string_view option : ListElements(value)) {
        if (absl::EqualsIgnoreCase(option, "close")) close = true;
        if (absl::EqualsIgnoreCase(option, "keep-alive")) keep_alive = true;
      }
    } else if (absl::EqualsIgnoreCase(name, "Expect")) {
      if (!absl::EqualsIgnoreCase(value, "100-continue")) {
        return HttpError{417, "Expect: only 100-continue is supported"};
      }
      head->expect_continue = true;
    }
  }
  if (head->minor_version == 1 && hosts != 1) {
    return HttpError{400, hosts == 0 ? "Host: required in HTTP/1.1"
                                     : "Host: sent more than once"};
  }
  head->keep_alive = head->minor_version == 1 ? !close : keep_alive && !close;
  return std::nullopt;
}

// "METHOD SP target SP HTTP/1.x"; an error, or nullopt.
std::optional<HttpError> ParseRequestLine(absl::string_view line,
                                          HttpRequestHead* head) {
  const size_t first = line.find(' ');
  const size_t second =
      first == absl::string_view::npos ? first : line.find(' ', first + 1);
  if (second == absl::string_view::npos ||
      line.find(' ', second + 1) != absl::string_view::npos) {
    return HttpError{400,
                     "request line: expected 'METHOD TARGET HTTP/1.1' "
                     "separated by single spaces"};
  }
  const absl::string_view method = line.substr(0, first);
  const absl::string_view target = line.substr(first + 1, second - first - 1);
  const absl::string_view version = line.substr(second + 1);
  if (!IsToken(method)) {
    return HttpError{400, "request line: the method must be a token"};
  }
  if (target.empty() || !std::all_of(target.begin(), target.end(), [](char c) {
        return c > 0x20 && c < 0x7f;
      })) {
    return HttpError{400,
                     "request line: the target must be visible ASCII "
                     "characters"};
  }
  if (version == "HTTP/1.1") {
    head->minor_version = 1;
  } else if (version == "HTTP/1.0") {
    head->minor_version = 0;
  } else if (version.size() == 8 && absl::StartsWith(version, "HTTP/") &&
             absl::ascii_isdigit(static_cast<unsigned char>(version[5])) &&
             version[6] == '.' &&
             absl::ascii_isdigit(static_cast<unsigned char>(version[7]))) {
    return HttpError{505, absl::StrCat("request line: ", version,
                                       " is not supported; use HTTP/1.1")};
  } else {
    return HttpError{400, "request line: expected HTTP/1.1 or HTTP/1.0"};
  }
  head->method = std::string(method);
  head->target = std::string(target);
  return std::nullopt;
}

}  // namespace

const std::string* HttpRequestHead::Find(absl::string_view name) const {
  for (const auto& field : fields) {
    if (absl::EqualsIgnoreCase(field.first, name)) return &field.second;
  }
  return nullptr;
}

absl::string_view HttpRequestHead::path() const {
  absl::string_view path = target;
  // The absolute form "http://host/path" (RFC 9112 3.2.2), which proxies
  // send: the path is what follows the authority.
  for (absl::string_view scheme : {"http://", "https://"}) {
    if (absl::StartsWithIgnoreCase(path, scheme)) {
      path.remove_prefix(scheme.size());
      const size_t slash = path.find('/');
      path = slash == absl::string_view::npos ? "/" : path.substr(slash);
      break;
    }
  }
  return path.substr(0, path.find('?'));
}

HeadParse ParseRequestHead(absl::string_view buffer, const HttpLimits& limits) {
  // Empty lines before a request line are skipped (two at most).
  size_t start = 0;
  for (int skipped = 0; skipped < 2; ++skipped) {
    if (buffer.substr(start, 2) == "\r\n") {
      start += 2;
    } else {
      break;
    }
  }
  // Each line ends in CRLF; the head ends with an empty line.
  std::vector<absl::string_view> lines;
  size_t line_start = start;
  const size_t scan_end =
      std::min(buffer.size(), start + limits.max_head_bytes);
  for (size_t i = start; i < scan_end; ++i) {
    const char c = buffer[i];
    if (c == '\n') {
      return Error(400, "request: lines must end in CRLF, not a bare LF");
    }
    if (c != '\r') continue;
    if (i + 1 == buffer.size()) break;  // the LF has not arrived yet
    if (buffer[i + 1] != '\n') {
      return Error(400, "request: a CR not followed by LF");
    }
    const absl::string_view line = buffer.substr(line_start, i - line_start);
    ++i;  // past the LF
    line_start = i + 1;
    if (line.empty()) {
      if (lines.empty()) {
        return Error(400, "request: expected a request line");
      }
      HttpRequestHead head;
      if (auto error = ParseRequestLine(lines[0], &head)) {
        return Error(error->status, std::move(error->message));
      }
      if (lines.size() - 1 > limits.max_fields) {
        return Error(431, absl::StrCat("header: more than ", limits.max_fields,
                                       " fields"));
      }
      for (size_t j = 1; j < lines.size(); ++j) {
        std::string message = ParseFieldLine(lines[j], &head.fields);
        if (!message.empty()) return Error(400, std::move(message));
      }
      if (auto error = ResolveConnection(&head)) {
        return Error(error->status, std::move(error->message));
      }
      if (auto error = ResolveFraming(&head, limits)) {
        return Error(error->status, std::move(error->message));
      }
      HeadParse parse;
      parse.kind = HeadParse::Kind::kHead;
      parse.head = std::move(head);
      parse.consumed = line_start;
      return parse;
    }
    lines.push_back(line);
  }
  if (buffer.size() - start >= limits.max_head_bytes) {
    return Error(431, absl::StrCat("header: the request head exceeds ",
                                   limits.max_head_bytes, " bytes"));
  }
  return HeadParse{};
}

BodyReader::BodyReader(const HttpRequestHead& head, uint64_t max_body_bytes)
    : max_body_bytes_(max_body_bytes) {
  switch (head.framing) {
    case BodyFraming::kNone:
      state_ = State::kDone;
      break;
    case BodyFraming::kContentLength:
      remaining_ = head.content_length;
      state_ = remaining_ == 0 ? State::kDone : State::kLength;
      break;
    case BodyFraming::kChunked:
      state_ = State::kChunkSize;
      break;
  }
}

size_t BodyReader::Fail(int status, std::string message) {
  error_ = HttpError{status, std::move(message)};
  state_ = State::kDone;
  return 0;
}

std::optional<std::pair<size_t, size_t>> BodyReader::Line(
    absl::string_view input) {
  const size_t scan = std::min(input.size(), kMaxBodyLineBytes + 2);
  for (size_t i = 0; i < scan; ++i) {
    if (input[i] == '\n') {
      Fail(400, "body: chunked lines must end in CRLF, not a bare LF");
      return std::nullopt;
    }
    if (input[i] != '\r') continue;
    if (i + 1 == input.size()) return std::nullopt;
    if (input[i + 1] != '\n') {
      Fail(400, "body: a CR not followed by LF in a chunked body");
      return std::nullopt;
    }
    return std::pair(i, i + 2);
  }
  if (scan > kMaxBodyLineBytes) {
    Fail(400, absl::StrCat("body: a chunk-size or trailer line over ",
                           kMaxBodyLineBytes, " bytes"));
  }
  return std::nullopt;
}

size_t BodyReader::Consume(absl::string_view input, std::string* body) {
  size_t consumed = 0;
  while (state_ != State::kDone && !error_.has_value()) {
    const absl::string_view rest = input.substr(consumed);
    switch (state_) {
      case State::kLength:
      case State::kChunkData: {
        if (rest.empty()) return consumed;
        const size_t take =
            static_cast<size_t>(std::min<uint64_t>(remaining_, rest.size()));
        if (body != nullptr) body->append(rest.data(), take);
        consumed += take;
        remaining_ -= take;
        body_bytes_ += take;
        if (remaining_ == 0) {
          state_ =
              state_ == State::kLength ? State::kDone : State::kChunkDataEnd;
        }
        break;
      }
      case State::kChunkDataEnd:
        if (rest.size() < 2) {
          if (!rest.empty() && rest[0] != '\r') {
            return Fail(400, "body: chunk data longer than its chunk-size");
          }
          return consumed;
        }
        if (rest.substr(0, 2) != "\r\n") {
          return Fail(400, "body: chunk data longer than its chunk-size");
        }
        consumed += 2;
        state_ = State::kChunkSize;
        break;
      case State::kChunkSize:
      case State::kTrailers: {
        const size_t taken = state_ == State::kChunkSize ? ChunkSizeLine(rest)
                                                         : TrailerLine(rest);
        if (taken == 0) return error_.has_value() ? 0 : consumed;
        consumed += taken;
        break;
      }
      case State::kDone:
        break;
    }
  }
  return error_.has_value() ? 0 : consumed;
}

size_t BodyReader::ChunkSizeLine(absl::string_view rest) {
  const auto line = Line(rest);
  if (!line.has_value()) return 0;
  const absl::string_view text = rest.substr(0, line->first);
  size_t digits = 0;
  uint64_t size = 0;
  while (digits < text.size() &&
         absl::ascii_isxdigit(static_cast<unsigned char>(text[digits]))) {
    if (digits == 15) {
      return Fail(400, "body: a chunk-size over 15 hex digits");
    }
    const char c = absl::ascii_tolower(text[digits]);
    size = size * 16 + static_cast<uint64_t>(c <= '9' ? c - '0' : c - 'a' + 10);
    ++digits;
  }
  // Only a chunk extension may follow the size ("5 ;name=value").
  const absl::string_view after = text.substr(digits);
  const absl::string_view extension = TrimOws(after);
  if (digits == 0 ||
      (!after.empty() && (extension.empty() || extension.front() != ';'))) {
    return Fail(400, "body: expected a hexadecimal chunk-size");
  }
  for (char c : extension) {
    if (!IsFieldValueChar(static_cast<unsigned char>(c))) {
      return Fail(400, "body: control characters in a chunk extension");
    }
  }
  if (size > max_body_bytes_ - body_bytes_) {
    return Fail(413, absl::StrCat("body: over the server's limit of ",
                                  max_body_bytes_, " bytes"));
  }
  remaining_ = size;
  state_ = size == 0 ? State::kTrailers : State::kChunkData;
  return line->second;
}

size_t BodyReader::TrailerLine(absl::string_view rest) {
  const auto line = Line(rest);
  if (!line.has_value()) return 0;
  if (line->first == 0) {
    state_ = State::kDone;
    return line->second;
  }
  trailer_bytes_ += line->second;
  if (trailer_bytes_ > kMaxTrailerBytes) {
    return Fail(431, absl::StrCat("body: trailer fields over ",
                                  kMaxTrailerBytes, " bytes"));
  }
  std::vector<std::pair<std::string, std::string>> ignored;
  std::string message = ParseFieldLine(rest.substr(0, line->first), &ignored);
  if (!message.empty()) return Fail(400, std::move(message));
  return line->second;
}

absl::string_view HttpReason(int status) {
  switch (status) {
    case 100:
      return "Continue";
    case 200:
      return "OK";
    case 204:
      return "No Content";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 411:
      return "Length Required";
    case 413:
      return "Content Too Large";
    case 415:
      return "Unsupported Media Type";
    case 417:
      return "Expectation Failed";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 499:
      return "Client Closed Request";
    case 500:
      return "Internal Server Error";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    case 505:
      return "HTTP Version Not Supported";
    default:
      return "Status";
  }
}

}  // namespace attnserve
