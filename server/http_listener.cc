#include "server/http_listener.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "httplib.h"

namespace attnserve {

absl::StatusOr<std::unique_ptr<HttpListener>> HttpListener::Start(
    std::unique_ptr<httplib::Server> routes, const std::string& host, int port,
    absl::string_view flag) {
  std::unique_ptr<HttpListener> listener(new HttpListener());
  listener->http_ = std::move(routes);
  httplib::Server* http = listener->http_.get();
  const int bound = port == 0 ? http->bind_to_any_port(host)
                              : (http->bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    return absl::UnavailableError(
        absl::StrCat(flag, ": cannot listen on ", host, ":", port));
  }
  listener->port_ = bound;
  std::atomic<bool>* ended = &listener->listen_ended_;
  listener->thread_ = std::thread([http, ended] {
    http->listen_after_bind();
    ended->store(true);
  });
  // httplib's stop() does nothing until the listening loop has started, so
  // a server stopped right after Start (a failed start-up further on) would
  // never end its thread: return only once it runs (or has given up).
  while (!http->is_running() && !ended->load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return listener;
}

void HttpListener::StopListening() {
  if (http_ != nullptr) http_->stop();
}

HttpListener::~HttpListener() {
  if (http_ != nullptr) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace attnserve
