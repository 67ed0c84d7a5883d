// HTTP/1.1 framing of both HTTP ports, over raw sockets: every request
// gets exactly one answer, a body is never read as a request, pipelined
// requests are answered in order, and slow clients are bounded. Also the
// request parser alone, byte by byte.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zlib.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/http/http_parser.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A raw connection to a port of 127.0.0.1.
class RawConnection {
 public:
  explicit RawConnection(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&address),
                         sizeof(address)) == 0;
  }
  ~RawConnection() { close(fd_); }
  bool connected() const { return connected_; }
  bool Send(const std::string& bytes) {
    return send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
           static_cast<ssize_t>(bytes.size());
  }
  // Reads until the server closes or `quiet` passes with nothing new;
  // sets closed() when the server closed.
  std::string Read(
      std::chrono::milliseconds quiet = std::chrono::milliseconds(500)) {
    std::string reply;
    char buffer[65536];
    while (true) {
      pollfd waiting{fd_, POLLIN, 0};
      if (poll(&waiting, 1, static_cast<int>(quiet.count())) <= 0) break;
      const ssize_t n = recv(fd_, buffer, sizeof(buffer), 0);
      if (n <= 0) {
        closed_ = true;
        break;
      }
      reply.append(buffer, n);
    }
    return reply;
  }
  bool closed() const { return closed_; }

 private:
  int fd_ = -1;
  bool connected_ = false;
  bool closed_ = false;
};

// The status codes of the responses in `bytes`, in order (responses are
// found by their Content-Length, so a body cannot pose as one).
std::vector<int> Statuses(const std::string& bytes) {
  std::vector<int> statuses;
  size_t at = 0;
  while (at < bytes.size()) {
    if (bytes.compare(at, 9, "HTTP/1.1 ") != 0) break;
    const int status = std::stoi(bytes.substr(at + 9, 3));
    const size_t end = bytes.find("\r\n\r\n", at);
    if (end == std::string::npos) break;
    const std::string head = bytes.substr(at, end - at);
    std::smatch length;
    size_t body = 0;
    if (std::regex_search(head, length, std::regex("Content-Length: (\\d+)"))) {
      body = std::stoul(length[1]);
    }
    if (status != 100) statuses.push_back(status);
    at = end + 4 + body;
  }
  return statuses;
}

std::string Exchange(int port, const std::string& request, bool* closed) {
  RawConnection connection(port);
  EXPECT_TRUE(connection.connected());
  EXPECT_TRUE(connection.Send(request));
  std::string reply = connection.Read();
  *closed = connection.closed();
  return reply;
}

// A request that would be answered 200 if its bytes were read as one.
const std::string kSmuggled = "GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n";

const std::string kLayerNormBody =
    R"({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2],)"
    R"( "data": [1, 3]}]})";

std::string Gzip(const std::string& text) {
  z_stream stream{};
  deflateInit2(&stream, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16, 8,
               Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&stream, text.size()) + 32, '\0');
  stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  stream.avail_in = static_cast<uInt>(text.size());
  stream.next_out = reinterpret_cast<Bytef*>(out.data());
  stream.avail_out = static_cast<uInt>(out.size());
  deflate(&stream, Z_FINISH);
  out.resize(out.size() - stream.avail_out);
  deflateEnd(&stream);
  return out;
}

std::string Gunzip(const std::string& data) {
  z_stream stream{};
  inflateInit2(&stream, 15 + 32);
  std::string out(1 << 20, '\0');
  stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  stream.avail_in = static_cast<uInt>(data.size());
  stream.next_out = reinterpret_cast<Bytef*>(out.data());
  stream.avail_out = static_cast<uInt>(out.size());
  inflate(&stream, Z_FINISH);
  out.resize(out.size() - stream.avail_out);
  inflateEnd(&stream);
  return out;
}

std::string BodyOf(const std::string& reply) {
  const size_t end = reply.find("\r\n\r\n");
  return end == std::string::npos ? "" : reply.substr(end + 4);
}

// --- The parser alone ---

HeadParse Parse(const std::string& bytes) {
  return ParseRequestHead(bytes, HttpLimits{});
}

TEST(HttpParserTest, HeadNeedsItsEmptyLine) {
  EXPECT_EQ(Parse("GET / HTTP/1.1\r\nHost: x\r\n").kind,
            HeadParse::Kind::kNeedMore);
  EXPECT_EQ(Parse("GET / HTTP/1.1\r\nHost: x\r\n\r").kind,
            HeadParse::Kind::kNeedMore);
  const HeadParse parse = Parse("\r\nGET /a?b HTTP/1.1\r\nHost: x\r\n\r\nrest");
  ASSERT_EQ(parse.kind, HeadParse::Kind::kHead);
  EXPECT_EQ(parse.consumed, 2 + 30u);
  EXPECT_EQ(parse.head.method, "GET");
  EXPECT_EQ(parse.head.path(), "/a");
  EXPECT_EQ(parse.head.framing, BodyFraming::kNone);
  EXPECT_TRUE(parse.head.keep_alive);
  // The absolute form proxies send names the same path.
  EXPECT_EQ(
      Parse("GET http://h:8000/v2/x?y HTTP/1.1\r\nHost: h\r\n\r\n").head.path(),
      "/v2/x");
}

TEST(HttpParserTest, RefusesAmbiguousFraming) {
  struct Case {
    std::string fields;
    int status;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"Content-Length: 0\r\nContent-Length: 48\r\n", 400, "differing"},
      {"Content-Length: 0, 48\r\n", 400, "differing"},
      {"Content-Length: 0x30\r\n", 400, "'0x30' is not a byte count"},
      {"Content-Length: 0abc\r\n", 400, "is not a byte count"},
      {"Content-Length: +0\r\n", 400, "is not a byte count"},
      {"Content-Length: 0 48\r\n", 400, "is not a byte count"},
      {"Content-Length: +78\r\n", 400, "is not a byte count"},
      {"Content-Length: -1\r\n", 400, "is not a byte count"},
      {"Content-Length: 99999999999999999999\r\n", 400, "not a byte count"},
      {"Content-Length: 0\r\n 48\r\n", 400, "obs-fold"},
      {"Content-Length : 5\r\n", 400, "no white space before ':'"},
      {"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n", 400, "not both"},
      {"Transfer-Encoding: chunked, gzip\r\n", 400, "last coding"},
      {"Transfer-Encoding: gzip, chunked\r\n", 501, "only chunked"},
      {"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", 501,
       "only chunked"},
      {"Content-Length: 2000000\r\n", 413, "exceed the server's limit"},
      {"X-Bad: a\x01z\r\n", 400, "control characters"},
      {"Expect: 200-ok\r\n", 417, "100-continue"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.fields);
    const HeadParse parse =
        Parse(absl::StrCat("POST / HTTP/1.1\r\nHost: x\r\n", c.fields, "\r\n"));
    ASSERT_EQ(parse.kind, HeadParse::Kind::kError);
    EXPECT_EQ(parse.error.status, c.status);
    EXPECT_THAT(parse.error.message, HasSubstr(c.message));
  }
  // Identical repeated lengths are one length (RFC 9110 8.6).
  const HeadParse same =
      Parse("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4, 4\r\n\r\n");
  ASSERT_EQ(same.kind, HeadParse::Kind::kHead);
  EXPECT_EQ(same.head.content_length, 4u);
}

TEST(HttpParserTest, RefusesMalformedLines) {
  const std::vector<std::pair<std::string, int>> cases = {
      {"GET / HTTP/1.1\nHost: x\n\n", 400},
      {"GET / HTTP/1.1\r\nHost: x\rY: z\r\n\r\n", 400},
      {"GET  / HTTP/1.1\r\nHost: x\r\n\r\n", 400},
      {"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505},
      {"GET / FOO\r\nHost: x\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\n\r\n", 400},                        // no Host
      {"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400},  // two
      {"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
      {"\r\n\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n", 400},
      {absl::StrCat("GET / HTTP/1.1\r\nHost: x\r\nX: ", std::string(40000, 'a'),
                    "\r\n\r\n"),
       431},
  };
  for (const auto& [bytes, status] : cases) {
    SCOPED_TRACE(bytes.substr(0, 60));
    const HeadParse parse = Parse(bytes);
    ASSERT_EQ(parse.kind, HeadParse::Kind::kError);
    EXPECT_EQ(parse.error.status, status);
  }
  HttpLimits few;
  few.max_fields = 2;
  EXPECT_EQ(
      ParseRequestHead("GET / HTTP/1.1\r\nHost: x\r\nA: 1\r\nB: 2\r\n\r\n", few)
          .error.status,
      431);
}

// A chunked body fed one byte at a time reads as when fed whole.
TEST(HttpParserTest, ChunkedBodyIsIndependentOfHowItArrives) {
  const std::string head =
      "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  const std::string body =
      "5;name=value\r\nhello\r\nA\r\n0123456789\r\n0\r\nTrailer: t\r\n\r\n";
  const HeadParse parse = Parse(head + body + kSmuggled);
  ASSERT_EQ(parse.kind, HeadParse::Kind::kHead);
  ASSERT_EQ(parse.head.framing, BodyFraming::kChunked);
  const std::string rest = (head + body + kSmuggled).substr(parse.consumed);
  BodyReader whole(parse.head, 1 << 20);
  std::string whole_body;
  EXPECT_EQ(whole.Consume(rest, &whole_body), body.size());
  EXPECT_TRUE(whole.done());
  EXPECT_EQ(whole_body, "hello0123456789");
  BodyReader bytewise(parse.head, 1 << 20);
  std::string bytewise_body;
  size_t consumed = 0;
  std::string pending;
  for (char c : rest) {
    if (bytewise.done()) break;
    pending += c;
    const size_t n = bytewise.Consume(pending, &bytewise_body);
    pending.erase(0, n);
    consumed += n;
  }
  EXPECT_TRUE(bytewise.done());
  EXPECT_EQ(consumed, body.size());
  EXPECT_EQ(bytewise_body, whole_body);
}

TEST(HttpParserTest, RefusesBadChunks) {
  const std::string head =
      "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  const HeadParse parse = Parse(head);
  ASSERT_EQ(parse.kind, HeadParse::Kind::kHead);
  const std::vector<std::pair<std::string, int>> cases = {
      {"5\r\nhello!\r\n", 400},        // data longer than its size
      {"g\r\n", 400},                  // not hex
      {"5 \r\nhello\r\n", 400},        // white space without an extension
      {"5\nhello\n", 400},             // bare LF
      {"1234567890abcdef0\r\n", 400},  // too many digits
      {"200000\r\n", 413},             // over the limit
      {"0\r\nX : y\r\n\r\n", 400},     // a bad trailer
  };
  for (const auto& [bytes, status] : cases) {
    SCOPED_TRACE(bytes);
    BodyReader reader(parse.head, 1 << 20);
    std::string body;
    reader.Consume(bytes, &body);
    ASSERT_TRUE(reader.error().has_value());
    EXPECT_EQ(reader.error()->status, status);
  }
}

// --- Through a live server ---

class HttpFramingTest : public ::testing::Test {
 protected:
  static ServerOptions Options() {
    ServerOptions options;
    options.http_idle_timeout_s = 5;
    return options;
  }
  HttpFramingTest() : server_(Options()) {}
  int http() { return server_.http_port(); }
  TestServer server_;
};

// The reproductions of a body read as the next request: each gets one
// answer.
TEST_F(HttpFramingTest, RefusedBodiesAreNeverReadAsRequests) {
  const std::string smuggle_length = std::to_string(kSmuggled.size());
  struct Case {
    std::string name;
    std::string head;
    int status;
  };
  const std::vector<Case> cases = {
      {"unsupported encoding",
       "POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\nContent-Encoding: "
       "br\r\nContent-Length: " +
           smuggle_length + "\r\n\r\n",
       415},
      {"gzip that is not gzip",
       "POST /v2/models/layer_norm/infer HTTP/1.1\r\nHost: x\r\n"
       "Content-Encoding: gzip\r\nContent-Length: " +
           smuggle_length + "\r\n\r\n",
       400},
      {"GET with a body",
       "GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nContent-Length: " +
           smuggle_length + "\r\n\r\n",
       200},
      {"unknown path",
       "POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: " + smuggle_length +
           "\r\n\r\n",
       404},
      {"wrong method",
       "PUT /v2 HTTP/1.1\r\nHost: x\r\nContent-Length: " + smuggle_length +
           "\r\n\r\n",
       405},
      {"chunked",
       "POST /nope HTTP/1.1\r\nHost: x\r\n"
       "Transfer-Encoding: chunked\r\n\r\n" +
           absl::StrCat(absl::Hex(kSmuggled.size())) + "\r\n" + kSmuggled +
           "\r\n0\r\n\r\n",
       404},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    bool closed = false;
    const std::string body = c.name == "chunked" ? std::string() : kSmuggled;
    const std::string reply = Exchange(http(), c.head + body, &closed);
    EXPECT_THAT(Statuses(reply), ElementsAre(c.status)) << reply;
  }
  // The lenient lengths of the campaign: 400, the connection closed, and
  // nothing after it answered.
  for (const char* length :
       {"0\r\nContent-Length: 48", "0, 48", "0x30", "0abc", "+0", "0 48",
        "0\r\n 48", "48\r\nContent-Length: 0", "+78", "78 0"}) {
    SCOPED_TRACE(length);
    bool closed = false;
    const std::string reply = Exchange(
        http(),
        absl::StrCat("POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\n"
                     "Content-Length: ",
                     length, "\r\n\r\n", kSmuggled),
        &closed);
    EXPECT_THAT(Statuses(reply), ElementsAre(400)) << reply;
    EXPECT_TRUE(closed);
    EXPECT_THAT(reply, HasSubstr("Connection: close"));
    EXPECT_THAT(BodyOf(reply), HasSubstr("\"error\""));
  }
}

TEST_F(HttpFramingTest, PipelinedRequestsAreAnsweredInOrder) {
  RawConnection connection(http());
  ASSERT_TRUE(connection.Send(
      "GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
      "POST /v2/models/layer_norm/infer HTTP/1.1\r\nHost: x\r\n"
      "Content-Length: " +
      std::to_string(kLayerNormBody.size()) + "\r\n\r\n" + kLayerNormBody +
      "GET /v2/models/nope HTTP/1.1\r\nHost: x\r\n\r\n"
      "GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"));
  const std::string reply = connection.Read();
  EXPECT_THAT(Statuses(reply), ElementsAre(200, 200, 404, 200)) << reply;
  EXPECT_FALSE(connection.closed());
  // The LayerNorm of [1, 3] is [-1, 1] (within eps).
  EXPECT_THAT(reply, HasSubstr("\"data\":[-0.99999"));
}

TEST_F(HttpFramingTest, PostWithoutLengthHasAnEmptyBody) {
  bool closed = false;
  const std::string reply =
      Exchange(http(),
               "POST /v2/models/layer_norm/infer HTTP/1.1\r\nHost: x\r\n\r\n" +
                   kSmuggled,
               &closed);
  // The empty body is not JSON; the next request is answered on its own.
  EXPECT_THAT(Statuses(reply), ElementsAre(400, 200)) << reply;
  EXPECT_THAT(reply, HasSubstr("body: not valid JSON"));
}

TEST_F(HttpFramingTest, ChunkedAndCompressedBodiesAreDecoded) {
  // Chunked, in three chunks.
  const std::string a = kLayerNormBody.substr(0, 10);
  const std::string b = kLayerNormBody.substr(10, 30);
  const std::string c = kLayerNormBody.substr(40);
  std::string chunked =
      "POST /v2/models/layer_norm/infer HTTP/1.1\r\nHost: x\r\n"
      "Transfer-Encoding: chunked\r\n\r\n";
  for (const std::string& part : {a, b, c}) {
    absl::StrAppend(&chunked, absl::Hex(part.size()), "\r\n", part, "\r\n");
  }
  chunked += "0\r\n\r\n";
  bool closed = false;
  std::string reply = Exchange(http(), chunked + kSmuggled, &closed);
  EXPECT_THAT(Statuses(reply), ElementsAre(200, 200)) << reply;
  EXPECT_THAT(reply, HasSubstr("\"data\":[-0.99999"));
  // gzip in, gzip out when asked for; metadata is never compressed.
  const std::string gzipped = Gzip(kLayerNormBody);
  reply =
      Exchange(http(),
               "POST /v2/models/layer_norm/infer HTTP/1.1\r\nHost: x\r\n"
               "Content-Encoding: gzip\r\nAccept-Encoding: gzip, deflate\r\n"
               "Content-Length: " +
                   std::to_string(gzipped.size()) + "\r\n\r\n" + gzipped +
                   "GET /v2/models/layer_norm HTTP/1.1\r\nHost: x\r\n"
                   "Accept-Encoding: gzip, deflate\r\n\r\n",
               &closed);
  EXPECT_THAT(Statuses(reply), ElementsAre(200, 200));
  const size_t second = reply.find("HTTP/1.1 200", 10);
  ASSERT_NE(second, std::string::npos);
  const std::string first = reply.substr(0, second);
  EXPECT_THAT(first, HasSubstr("Content-Encoding: gzip"));
  EXPECT_THAT(Gunzip(BodyOf(first)), HasSubstr("\"data\":[-0.99999"));
  EXPECT_THAT(reply.substr(second),
              ::testing::Not(HasSubstr("Content-Encoding")));
  EXPECT_THAT(BodyOf(reply.substr(second)),
              HasSubstr("\"name\":\"layer_norm\""));
}

TEST_F(HttpFramingTest, ErrorsEchoAtMost128BytesOfClientStrings) {
  const std::string name(20000, 'q');
  const std::string body =
      R"({"inputs": [{"name": ")" + name +
      R"(", "datatype": "FP32", "shape": [2], "data": [1]}]})";
  bool closed = false;
  std::string reply = Exchange(
      http(),
      "POST /v2/models/attend/infer HTTP/1.1\r\nHost: x\r\nContent-Length: " +
          std::to_string(body.size()) + "\r\n\r\n" + body,
      &closed);
  EXPECT_THAT(Statuses(reply), ElementsAre(400));
  EXPECT_THAT(BodyOf(reply), HasSubstr("... (20000 bytes)"));
  EXPECT_LT(BodyOf(reply).size(), 600u);
  // A long path and method in the 404.
  reply = Exchange(
      http(),
      "GET /" + std::string(20000, 'p') + " HTTP/1.1\r\nHost: x\r\n\r\n",
      &closed);
  EXPECT_THAT(Statuses(reply), ElementsAre(404));
  EXPECT_LT(BodyOf(reply).size(), 600u);
}

TEST_F(HttpFramingTest, ExpectContinueGetsAnInterimAnswer) {
  RawConnection connection(http());
  ASSERT_TRUE(
      connection.Send("POST /v2/models/layer_norm/infer HTTP/1.1\r\nHost: x\r\n"
                      "Expect: 100-continue\r\nContent-Length: " +
                      std::to_string(kLayerNormBody.size()) + "\r\n\r\n"));
  EXPECT_EQ(connection.Read(std::chrono::milliseconds(300)),
            "HTTP/1.1 100 Continue\r\n\r\n");
  ASSERT_TRUE(connection.Send(kLayerNormBody));
  EXPECT_THAT(Statuses(connection.Read()), ElementsAre(200));
  // Refused from its head: answered at once, and the connection closes
  // (the client may or may not send the body).
  RawConnection refused(http());
  ASSERT_TRUE(
      refused.Send("POST /nope HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                   "Content-Length: 5\r\n\r\n"));
  EXPECT_THAT(Statuses(refused.Read()), ElementsAre(404));
  EXPECT_TRUE(refused.closed());
}

TEST_F(HttpFramingTest, MetricsPortFramesAlike) {
  const int metrics = server_.metrics_port();
  bool closed = false;
  std::string reply = Exchange(metrics,
                               "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
                               "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
                               &closed);
  EXPECT_THAT(Statuses(reply), ElementsAre(200, 200));
  reply =
      Exchange(metrics,
               "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                   std::to_string(kSmuggled.size()) + "\r\n\r\n" + kSmuggled,
               &closed);
  EXPECT_THAT(Statuses(reply), ElementsAre(200));
  reply = Exchange(metrics, "GET /other HTTP/1.1\r\nHost: x\r\n\r\n", &closed);
  EXPECT_THAT(Statuses(reply), ElementsAre(404));
  EXPECT_THAT(BodyOf(reply), HasSubstr("\"error\":\"no such endpoint"));
  reply =
      Exchange(metrics, "DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n", &closed);
  EXPECT_THAT(Statuses(reply), ElementsAre(405));
  reply = Exchange(metrics,
                   "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1, 2"
                   "\r\n\r\n",
                   &closed);
  EXPECT_THAT(Statuses(reply), ElementsAre(400));
  EXPECT_TRUE(closed);
}

TEST(HttpAuthFramingTest, UnauthenticatedBodiesAreDiscardedNotParsed) {
  const std::string tokens =
      absl::StrCat(std::filesystem::temp_directory_path().string(),
                   "/attnserve_http_", ::getpid(), ".tokens");
  std::ofstream(tokens) << "s3cret\n";
  ServerOptions options;
  options.auth_token_file = tokens;
  TestServer server(options);
  const std::string length = std::to_string(kSmuggled.size());
  for (const std::string& authorization :
       {std::string(), std::string("Authorization: Bearer wrong\r\n"),
        std::string("Authorization: Bearer s3cret\0x\r\n", 32),
        std::string("Authorization: Bearer s3cretx\r\n")}) {
    SCOPED_TRACE(authorization);
    bool closed = false;
    const std::string reply = Exchange(
        server.http_port(),
        "POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\n" + authorization +
            "Content-Length: " + length + "\r\n\r\n" + kSmuggled +
            "GET /v2 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
            "\r\n",
        &closed);
    // The 401 (or a 400 for a NUL, which no header may hold), then the
    // authenticated request after the discarded body.
    const std::vector<int> statuses = Statuses(reply);
    ASSERT_FALSE(statuses.empty()) << reply;
    EXPECT_TRUE(statuses[0] == 401 || statuses[0] == 400) << reply;
    if (statuses[0] == 401) {
      EXPECT_THAT(statuses, ElementsAre(401, 200)) << reply;
      EXPECT_THAT(reply, HasSubstr("WWW-Authenticate: Bearer"));
    } else {
      EXPECT_TRUE(closed);
    }
  }
  std::filesystem::remove(tokens);
}

TEST(HttpSlowClientTest, SlowHeadsAreCutAndDoNotDelayOthers) {
  ServerOptions options;
  options.http_header_timeout_s = 2;
  TestServer server(options);
  // 300 connections sending a head a byte at a time.
  std::vector<std::unique_ptr<RawConnection>> slow;
  for (int i = 0; i < 300; ++i) {
    slow.push_back(std::make_unique<RawConnection>(server.http_port()));
    ASSERT_TRUE(slow.back()->connected());
  }
  const std::string head = "GET /v2/health/live HTTP/1.1\r\nHost: x\r\n";
  double worst_ms = 0;
  for (size_t byte = 0; byte < 5; ++byte) {
    for (auto& connection : slow) connection->Send(head.substr(byte, 1));
    const auto start = std::chrono::steady_clock::now();
    bool closed = false;
    const std::string reply = Exchange(
        server.http_port(),
        "GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        &closed);
    worst_ms = std::max(worst_ms, std::chrono::duration<double, std::milli>(
                                      std::chrono::steady_clock::now() - start)
                                      .count());
    EXPECT_THAT(Statuses(reply), ElementsAre(200));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  // A generous bound for a loaded test machine: the server answered while
  // 300 heads dripped (benchmarks/http_clients.py measures the latency).
  EXPECT_LT(worst_ms, 1000);
  // Past the head timeout, the slow ones get 408 and are closed.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const std::string reply = slow[0]->Read(std::chrono::milliseconds(1000));
  EXPECT_THAT(Statuses(reply), ElementsAre(408));
  EXPECT_TRUE(slow[0]->closed());
}

TEST(HttpSlowClientTest, ConnectionCapClosesIdleOnesFirst) {
  ServerOptions options;
  options.http_max_connections = 3;
  TestServer server(options);
  std::vector<std::unique_ptr<RawConnection>> idle;
  for (int i = 0; i < 3; ++i) {
    idle.push_back(std::make_unique<RawConnection>(server.http_port()));
  }
  // Busy (a head under way) rather than idle: kept.
  for (auto& connection : idle) connection->Send("GET /v2/health/live ");
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  bool closed = false;
  std::string reply =
      Exchange(server.http_port(),
               "GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n", &closed);
  EXPECT_THAT(Statuses(reply), ElementsAre(503));
  EXPECT_THAT(reply, HasSubstr("--http_max_connections"));
  // Once one of them is idle (answered), a new client takes its place.
  idle[0]->Send("HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_THAT(Statuses(idle[0]->Read()), ElementsAre(200));
  reply = Exchange(server.http_port(),
                   "GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n", &closed);
  EXPECT_THAT(Statuses(reply), ElementsAre(200));
  idle[0]->Read(std::chrono::milliseconds(100));
  EXPECT_TRUE(idle[0]->closed());
}

}  // namespace
}  // namespace attnserve::testing
