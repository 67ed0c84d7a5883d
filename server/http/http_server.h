// An HTTP/1.1 server: one event-loop thread (epoll) owns every connection
// and its bytes; complete requests go to a small pool of handler threads,
// which answer through an HttpResponder at once or later, from any thread.
//
// Framing is server/http/http_parser.h's. Per connection, one request is
// handled at a time and answers go out in request order, so pipelined
// requests are answered one after the other. Bounds on slow and idle
// clients: the request head must arrive within `header_timeout` of its
// first byte (of the accept, for a new connection's first request); a body
// must make progress every `body_timeout`; an answer must be taken by the
// client at that pace too; an idle keep-alive connection closes after
// `idle_timeout`; at most `max_connections` are open (one more closes an
// idle one, or is answered 503). A client that goes away while its request
// is handled sets the responder's cancelled flag.
//
// A request refused by the precheck (which sees only the head: a bad
// token, an unsupported encoding) is answered after its body has been read
// and discarded, unbuffered, so that no byte of it is taken for a request;
// a client waiting for "100 Continue" gets the refusal at once and the
// connection closes. Every error the server answers itself has a JSON
// body {"error": "..."} and closes the connection.
//
// Thread-safety: Start/Stop/port from any thread; HttpResponder::Send from
// any thread, once. Ownership: the server owns its sockets and threads;
// the handler and precheck must stay valid until Stop returns (the
// destructor stops).
#ifndef ATTNSERVE_SERVER_HTTP_HTTP_SERVER_H_
#define ATTNSERVE_SERVER_HTTP_HTTP_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/http/http_parser.h"

namespace attnserve {

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: a free port
  // The flag that set the port, for the error when it cannot be bound.
  std::string port_flag = "--http_port";
  HttpLimits limits;
  absl::Duration header_timeout = absl::Seconds(10);
  absl::Duration body_timeout = absl::Seconds(30);
  absl::Duration idle_timeout = absl::Seconds(60);
  int max_connections = 1024;
  int handler_threads = 2;
};

struct HttpRequest {
  HttpRequestHead head;
  std::string body;
  absl::Time arrived;  // when the head was complete
};

struct HttpResponse {
  int status = 200;
  // Besides Content-Length and Connection, which the server writes.
  std::vector<std::pair<std::string, std::string>> fields;
  std::string body;
  // Sent after `body` without joining them (binary tensors after JSON).
  std::string body_tail;
  // Close the connection after this response.
  bool close = false;
};

// {"error": message} with the JSON content type.
HttpResponse JsonErrorResponse(int status, absl::string_view message);

// The way back to the client of one request. Copyable; Send once.
class HttpResponder {
 public:
  struct Exchange;
  explicit HttpResponder(std::shared_ptr<Exchange> exchange)
      : exchange_(std::move(exchange)) {}
  // Queues `response` for the connection (dropped if it has closed).
  void Send(HttpResponse response) const;
  // Turns true when the client has gone away, or the server stops.
  const std::atomic<bool>* cancelled() const;

 private:
  std::shared_ptr<Exchange> exchange_;
};

using HttpHandler = std::function<void(HttpRequest, HttpResponder)>;
// Sees a request's head before its body is read; a response refuses it.
using HttpPrecheck =
    std::function<std::optional<HttpResponse>(const HttpRequestHead&)>;

class HttpServer {
 public:
  // Binds and starts serving; UNAVAILABLE naming options.port_flag when the
  // port cannot be bound. `precheck` may be null.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(
      const HttpServerOptions& options, HttpPrecheck precheck,
      HttpHandler handler);
  ~HttpServer();

  int port() const { return port_; }
  // Stops accepting connections at once; served ones go on.
  void StopListening();
  // Stops: no new connections, idle ones closed, answers close their
  // connection; requests being handled get until `deadline`, then are
  // cancelled; returns once every handler has answered.
  void Stop(absl::Time deadline);

  class Loop;

 private:
  HttpServer() = default;
  std::shared_ptr<Loop> loop_;
  int port_ = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_HTTP_HTTP_SERVER_H_
