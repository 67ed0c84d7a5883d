// An HTTP server (cpp-httplib) listening on its own thread: the metrics
// page and the Open Inference Protocol's HTTP/JSON endpoints.
//
// Thread-safety: httplib runs the routes on its worker threads; Stop() and
// the destructor may be called from any thread. Ownership: owns the
// httplib server and its thread.
#ifndef ATTNSERVE_SERVER_HTTP_LISTENER_H_
#define ATTNSERVE_SERVER_HTTP_LISTENER_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace httplib {
class Server;
}

namespace attnserve {

class HttpListener {
 public:
  // Binds host:port (0: a free port) and serves `routes` until stopped.
  // UNAVAILABLE names `flag` (e.g. "--metrics_port") when the port cannot
  // be bound.
  static absl::StatusOr<std::unique_ptr<HttpListener>> Start(
      std::unique_ptr<httplib::Server> routes, const std::string& host,
      int port, absl::string_view flag);
  // Stops taking connections, at once; requests being served finish.
  void StopListening();
  // Stops listening and waits for the routes running to return (and for
  // idle keep-alive connections to time out).
  ~HttpListener();

  int port() const { return port_; }

 private:
  HttpListener() = default;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  // Set by thread_ when httplib's listening loop returns.
  std::atomic<bool> listen_ended_{false};
  int port_ = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_HTTP_LISTENER_H_
