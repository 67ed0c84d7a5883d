#include "server/http/http_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

constexpr uint64_t kListenKey = 0;
constexpr uint64_t kWakeKey = 1;
// Bytes read per read() call, and at most per readiness event of one
// connection (others get their turn).
constexpr size_t kReadChunk = 256 << 10;
constexpr size_t kReadPerEvent = 4 << 20;
// How long a connection closing after an error keeps reading (and
// discarding) what the client still sends, so that the client reads the
// answer before the close resets the connection.
constexpr absl::Duration kLinger = absl::Seconds(2);
constexpr int kTickMs = 100;

std::string JsonEscape(absl::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  for (unsigned char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x7f) {
      // Bytes outside ASCII as code points, so that the body is JSON
      // whatever a client sent.
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
      out += escaped;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

}  // namespace

HttpResponse JsonErrorResponse(int status, absl::string_view message) {
  HttpResponse response;
  response.status = status;
  response.fields.emplace_back("Content-Type", "application/json");
  response.body = absl::StrCat("{\"error\":\"", JsonEscape(message), "\"}");
  return response;
}

struct HttpResponder::Exchange {
  std::weak_ptr<HttpServer::Loop> loop;
  uint64_t connection = 0;
  std::atomic<bool> cancelled{false};
  std::atomic<bool> sent{false};
};

class HttpServer::Loop : public std::enable_shared_from_this<Loop> {
 public:
  Loop(const HttpServerOptions& options, HttpPrecheck precheck,
       HttpHandler handler)
      : options_(options),
        precheck_(std::move(precheck)),
        handler_(std::move(handler)),
        scratch_(new char[kReadChunk]) {}
  ~Loop();

  // Binds, listens and starts the threads; the bound port.
  absl::StatusOr<int> Start();
  // From any thread: a response for `exchange` of connection `id`.
  void Post(uint64_t id, HttpResponder::Exchange* exchange,
            HttpResponse response);
  // From any thread: runs `command` on the loop thread.
  void Command(std::function<void()> command);
  void Stop(absl::Time deadline);
  void StopListening() {
    Command([this] { StopListeningNow(); });
  }

 private:
  enum class State { kHead, kBody, kHandling, kWriting, kLinger };
  struct Connection {
    int fd = -1;
    uint64_t id = 0;
    State state = State::kHead;
    std::string in;
    absl::Time deadline;
    bool peer_closed = false;
    // Closed: its socket is gone; erased once the loop's turn ends.
    bool closed = false;
    // The request being read.
    HttpRequestHead head;
    BodyReader body_reader;
    std::string body;
    std::optional<HttpResponse> refusal;  // from the precheck
    absl::Time arrived;
    // The request being handled.
    std::shared_ptr<HttpResponder::Exchange> exchange;
    // Output: head, body and tail of the response being written.
    std::string out[3];
    size_t out_sent = 0;
    bool final_pending = false;  // out holds a final response
    bool close_after = false;
    uint32_t interest = 0;
  };
  struct Posted {
    uint64_t id;
    HttpResponder::Exchange* exchange;
    HttpResponse response;
  };

  void Run();
  void RunHandlers();
  void Wake();
  void DrainWakeups();
  void Accept();
  void OnEvent(Connection& connection, uint32_t events);
  void Read(Connection& connection);
  // Parses and reads what `in` holds, as far as the state allows.
  void Process(Connection& connection);
  void OnHead(Connection& connection, HeadParse parse);
  void OnBodyDone(Connection& connection);
  void Dispatch(Connection& connection);
  void Respond(Connection& connection, HttpResponse response);
  void Fail(Connection& connection, int status, absl::string_view message);
  void Queue(Connection& connection, std::string head, std::string body,
             std::string tail);
  void Flush(Connection& connection);
  void OnFinalWritten(Connection& connection);
  void Linger(Connection& connection);
  void Close(Connection& connection);
  void SetInterest(Connection& connection);
  void Tick();
  void CloseIdle();
  bool CloseOneIdle();
  void StopListeningNow();
  bool Idle(const Connection& connection) const {
    return connection.state == State::kHead && connection.in.empty() &&
           !connection.final_pending && connection.out[0].empty();
  }

  const HttpServerOptions options_;
  const HttpPrecheck precheck_;
  const HttpHandler handler_;
  std::unique_ptr<char[]> scratch_;
  int epoll_fd_ = -1;
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  // Loop thread only.
  absl::flat_hash_map<uint64_t, std::unique_ptr<Connection>> connections_;
  // Closed connections, erased after the events of one epoll_wait, so that
  // no function up the stack holds a destroyed one.
  std::vector<uint64_t> closed_;
  uint64_t next_id_ = 2;
  bool draining_ = false;
  absl::Time accept_paused_until_ = absl::InfinitePast();
  absl::Time last_tick_ = absl::InfinitePast();

  // Shared with other threads.
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<Posted> posted_;
  std::vector<std::function<void()>> commands_;
  int inflight_ = 0;
  bool quit_ = false;
  // The handler pool.
  std::deque<std::function<void()>> tasks_;
  std::condition_variable task_ready_;
  bool stop_handlers_ = false;
  std::vector<std::thread> handler_threads_;
};

HttpServer::Loop::~Loop() {
  for (auto& [id, connection] : connections_) {
    if (!connection->closed) ::close(connection->fd);
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
}

absl::StatusOr<int> HttpServer::Loop::Start() {
  const auto unavailable = [&](absl::string_view why) {
    return absl::UnavailableError(
        absl::StrCat(options_.port_flag, ": cannot listen on ", options_.host,
                     ":", options_.port, " (", why, ")"));
  };
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(options_.port);
  if (::getaddrinfo(options_.host.c_str(), port.c_str(), &hints, &found) != 0 ||
      found == nullptr) {
    return unavailable("unknown host");
  }
  std::string error = "no address";
  for (addrinfo* address = found; address != nullptr;
       address = address->ai_next) {
    const int fd = ::socket(address->ai_family,
                            address->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                            address->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, address->ai_addr, address->ai_addrlen) == 0 &&
        ::listen(fd, 1024) == 0) {
      listen_fd_ = fd;
      break;
    }
    error = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(found);
  if (listen_fd_ < 0) return unavailable(error);
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &length);
  const int bound_port =
      bound.ss_family == AF_INET6
          ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
          : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);

  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epoll_fd_ < 0 || wake_fd_ < 0) return unavailable("epoll");
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.u64 = kListenKey;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &event);
  event.data.u64 = kWakeKey;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &event);
  for (int i = 0; i < std::max(1, options_.handler_threads); ++i) {
    handler_threads_.emplace_back([this] { RunHandlers(); });
  }
  thread_ = std::thread([this] { Run(); });
  return bound_port;
}

void HttpServer::Loop::RunHandlers() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    task_ready_.wait(lock, [&] { return stop_handlers_ || !tasks_.empty(); });
    if (tasks_.empty()) return;
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    task();
    task = nullptr;
    lock.lock();
  }
}

void HttpServer::Loop::Wake() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t written = ::write(wake_fd_, &one, sizeof(one));
}

void HttpServer::Loop::Post(uint64_t id, HttpResponder::Exchange* exchange,
                            HttpResponse response) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    posted_.push_back(Posted{id, exchange, std::move(response)});
    --inflight_;
  }
  changed_.notify_all();
  Wake();
}

void HttpServer::Loop::Command(std::function<void()> command) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands_.push_back(std::move(command));
  }
  Wake();
}

void HttpServer::Loop::DrainWakeups() {
  uint64_t count = 0;
  [[maybe_unused]] ssize_t read = ::read(wake_fd_, &count, sizeof(count));
  std::vector<Posted> posted;
  std::vector<std::function<void()>> commands;
  {
    std::lock_guard<std::mutex> lock(mu_);
    posted.swap(posted_);
    commands.swap(commands_);
  }
  for (auto& command : commands) command();
  for (Posted& answer : posted) {
    auto found = connections_.find(answer.id);
    if (found == connections_.end()) continue;
    Connection& connection = *found->second;
    if (connection.closed || connection.exchange.get() != answer.exchange) {
      continue;
    }
    connection.exchange.reset();
    Respond(connection, std::move(answer.response));
  }
}

void HttpServer::Loop::Run() {
  epoll_event events[256];
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (quit_) break;
    }
    const int ready = ::epoll_wait(epoll_fd_, events, 256, kTickMs);
    for (int i = 0; i < ready; ++i) {
      const uint64_t key = events[i].data.u64;
      if (key == kListenKey) {
        Accept();
      } else if (key == kWakeKey) {
        DrainWakeups();
      } else if (auto found = connections_.find(key);
                 found != connections_.end() && !found->second->closed) {
        OnEvent(*found->second, events[i].events);
      }
    }
    if (absl::Now() - last_tick_ >= absl::Milliseconds(kTickMs)) Tick();
    for (uint64_t id : closed_) connections_.erase(id);
    closed_.clear();
  }
}

void HttpServer::Loop::Accept() {
  while (listen_fd_ >= 0) {
    const int fd =
        ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
          errno == ENOMEM) {
        // Out of descriptors: stop accepting for a moment instead of
        // spinning on a listening socket that stays readable.
        ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listen_fd_, nullptr);
        accept_paused_until_ = absl::Now() + absl::Milliseconds(kTickMs);
      }
      return;
    }
    if (static_cast<int>(connections_.size()) >= options_.max_connections &&
        !CloseOneIdle()) {
      static constexpr char kFull[] =
          "HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
          "application/json\r\nContent-Length: 66\r\nConnection: "
          "close\r\n\r\n{\"error\":\"server busy: too many connections "
          "(--http_max_connections)\"}";
      [[maybe_unused]] ssize_t sent =
          ::send(fd, kFull, sizeof(kFull) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      ::close(fd);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto connection = std::make_unique<Connection>();
    connection->fd = fd;
    connection->id = next_id_++;
    connection->deadline = absl::Now() + options_.header_timeout;
    Connection& added = *connection;
    connections_.emplace(added.id, std::move(connection));
    epoll_event event{};
    event.events = EPOLLIN | EPOLLRDHUP;
    event.data.u64 = added.id;
    added.interest = event.events;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event);
  }
}

void HttpServer::Loop::SetInterest(Connection& connection) {
  uint32_t interest = 0;
  const bool handling = connection.state == State::kHandling ||
                        connection.state == State::kWriting;
  // While a request is handled, the next ones may arrive (pipelining), up
  // to one head's worth; the client's close is watched for throughout.
  if (!connection.peer_closed &&
      (!handling || connection.in.size() < options_.limits.max_head_bytes)) {
    interest |= EPOLLIN | EPOLLRDHUP;
  }
  if (!connection.out[0].empty() || !connection.out[1].empty() ||
      !connection.out[2].empty()) {
    interest |= EPOLLOUT;
  }
  if (interest == connection.interest) return;
  connection.interest = interest;
  epoll_event event{};
  event.events = interest;
  event.data.u64 = connection.id;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, connection.fd, &event);
}

void HttpServer::Loop::OnEvent(Connection& connection, uint32_t events) {
  if (events & (EPOLLERR | EPOLLHUP)) {
    Close(connection);
    return;
  }
  if (events & EPOLLOUT) {
    Flush(connection);
    if (connection.closed) return;
  }
  if (events & (EPOLLIN | EPOLLRDHUP)) Read(connection);
}

void HttpServer::Loop::Read(Connection& connection) {
  size_t total = 0;
  while (total < kReadPerEvent) {
    const bool handling = connection.state == State::kHandling ||
                          connection.state == State::kWriting;
    if (handling && connection.in.size() >= options_.limits.max_head_bytes) {
      break;
    }
    const ssize_t n = ::recv(connection.fd, scratch_.get(), kReadChunk, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      Close(connection);
      return;
    }
    if (n == 0) {
      connection.peer_closed = true;
      if (connection.state == State::kHandling) {
        // The client is gone: stop its computation.
        connection.exchange->cancelled.store(true);
        SetInterest(connection);
      } else if (connection.state != State::kWriting) {
        Close(connection);
      } else {
        SetInterest(connection);
      }
      return;
    }
    total += static_cast<size_t>(n);
    const absl::string_view data(scratch_.get(), static_cast<size_t>(n));
    if (connection.state == State::kLinger) continue;  // discarded
    if (connection.state == State::kHead && connection.in.empty()) {
      // The head's time runs from its first byte.
      connection.deadline = absl::Now() + options_.header_timeout;
    }
    if (connection.state == State::kBody && connection.in.empty()) {
      // Straight into the body, without passing through `in`.
      const size_t consumed = connection.body_reader.Consume(
          data, connection.refusal ? nullptr : &connection.body);
      const absl::string_view rest = data.substr(consumed);
      connection.in.append(rest.data(), rest.size());
      connection.deadline = absl::Now() + options_.body_timeout;
    } else {
      connection.in.append(data.data(), data.size());
    }
    Process(connection);
    if (connection.closed) return;
  }
  SetInterest(connection);
}

void HttpServer::Loop::Process(Connection& connection) {
  while (true) {
    if (connection.state == State::kHead) {
      if (connection.in.empty()) return;
      HeadParse parse = ParseRequestHead(connection.in, options_.limits);
      if (parse.kind == HeadParse::Kind::kNeedMore) return;
      if (parse.kind == HeadParse::Kind::kError) {
        return Fail(connection, parse.error.status, parse.error.message);
      }
      OnHead(connection, std::move(parse));
      if (connection.closed || connection.state != State::kBody) return;
    }
    if (connection.state != State::kBody) return;
    const size_t consumed = connection.body_reader.Consume(
        connection.in, connection.refusal ? nullptr : &connection.body);
    connection.in.erase(0, consumed);
    if (const auto& error = connection.body_reader.error()) {
      return Fail(connection, error->status, error->message);
    }
    if (!connection.body_reader.done()) return;
    OnBodyDone(connection);
    if (connection.closed || connection.state != State::kHead) return;
  }
}

void HttpServer::Loop::OnHead(Connection& connection, HeadParse parse) {
  connection.in.erase(0, parse.consumed);
  connection.head = std::move(parse.head);
  connection.arrived = absl::Now();
  connection.body.clear();
  connection.body_reader =
      BodyReader(connection.head, options_.limits.max_body_bytes);
  connection.refusal.reset();
  if (precheck_) connection.refusal = precheck_(connection.head);
  const bool body_follows = !connection.body_reader.done();
  if (connection.head.expect_continue && body_follows) {
    if (connection.refusal) {
      // The client has not sent the body and may never: refuse and close.
      connection.refusal->close = true;
      HttpResponse refusal = std::move(*connection.refusal);
      connection.refusal.reset();
      connection.state = State::kHandling;  // nothing more is read
      Respond(connection, std::move(refusal));
      return;
    }
    Queue(connection, "HTTP/1.1 100 Continue\r\n\r\n", "", "");
    if (connection.closed) return;
  }
  if (connection.head.framing == BodyFraming::kContentLength &&
      !connection.refusal) {
    // Room for the body at once, not in doublings; the limit bounds it.
    connection.body.reserve(connection.head.content_length);
  }
  connection.state = State::kBody;
  connection.deadline = absl::Now() + options_.body_timeout;
}

void HttpServer::Loop::OnBodyDone(Connection& connection) {
  if (connection.refusal) {
    HttpResponse refusal = std::move(*connection.refusal);
    connection.refusal.reset();
    connection.state = State::kHandling;
    Respond(connection, std::move(refusal));
    return;
  }
  Dispatch(connection);
}

void HttpServer::Loop::Dispatch(Connection& connection) {
  auto exchange = std::make_shared<HttpResponder::Exchange>();
  exchange->loop = weak_from_this();
  exchange->connection = connection.id;
  connection.exchange = exchange;
  connection.state = State::kHandling;
  HttpRequest request{.head = connection.head,
                      .body = std::move(connection.body),
                      .arrived = connection.arrived};
  connection.body = std::string();
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++inflight_;
    tasks_.push_back(
        [this, request = std::move(request),
         responder = HttpResponder(std::move(exchange))]() mutable {
          handler_(std::move(request), responder);
        });
  }
  task_ready_.notify_one();
}

void HttpServer::Loop::Respond(Connection& connection, HttpResponse response) {
  const bool close = response.close || !connection.head.keep_alive ||
                     draining_ || connection.peer_closed;
  const uint64_t length = response.body.size() + response.body_tail.size();
  std::string head =
      absl::StrCat("HTTP/1.1 ", response.status, " ",
                   HttpReason(response.status), "\r\nServer: attnserve\r\n");
  for (const auto& [name, value] : response.fields) {
    absl::StrAppend(&head, name, ": ", value, "\r\n");
  }
  absl::StrAppend(&head, "Content-Length: ", length, "\r\n");
  if (close) {
    absl::StrAppend(&head, "Connection: close\r\n");
  } else if (connection.head.minor_version == 0) {
    absl::StrAppend(&head, "Connection: keep-alive\r\n");
  }
  head += "\r\n";
  connection.state = State::kWriting;
  connection.close_after = close;
  connection.final_pending = true;
  connection.deadline = absl::Now() + options_.body_timeout;
  if (connection.head.method == "HEAD") {
    response.body.clear();
    response.body_tail.clear();
  }
  Queue(connection, std::move(head), std::move(response.body),
        std::move(response.body_tail));
}

void HttpServer::Loop::Fail(Connection& connection, int status,
                            absl::string_view message) {
  HttpResponse response = JsonErrorResponse(status, message);
  response.close = true;
  if (connection.state == State::kHead) {
    connection.head = HttpRequestHead();
  }
  connection.exchange.reset();
  Respond(connection, std::move(response));
}

void HttpServer::Loop::Queue(Connection& connection, std::string head,
                             std::string body, std::string tail) {
  // An interim response may still be waiting to go out: append after it.
  if (!connection.out[0].empty() || !connection.out[1].empty() ||
      !connection.out[2].empty()) {
    std::string joined;
    for (int i = 0; i < 3; ++i) joined += connection.out[i];
    joined.erase(0, connection.out_sent);
    joined += head;
    head = std::move(joined);
  }
  connection.out[0] = std::move(head);
  connection.out[1] = std::move(body);
  connection.out[2] = std::move(tail);
  connection.out_sent = 0;
  Flush(connection);
}

void HttpServer::Loop::Flush(Connection& connection) {
  while (true) {
    iovec parts[3];
    int count = 0;
    size_t skip = connection.out_sent;
    for (std::string& part : connection.out) {
      if (skip >= part.size()) {
        skip -= part.size();
        continue;
      }
      parts[count].iov_base = part.data() + skip;
      parts[count].iov_len = part.size() - skip;
      skip = 0;
      ++count;
    }
    if (count == 0) break;
    msghdr message{};
    message.msg_iov = parts;
    message.msg_iovlen = count;
    const ssize_t n = ::sendmsg(connection.fd, &message, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        SetInterest(connection);
        return;
      }
      Close(connection);
      return;
    }
    connection.out_sent += static_cast<size_t>(n);
    connection.deadline = absl::Now() + options_.body_timeout;
  }
  for (std::string& part : connection.out) part = std::string();
  connection.out_sent = 0;
  if (connection.final_pending) {
    OnFinalWritten(connection);
  } else {
    SetInterest(connection);
  }
}

void HttpServer::Loop::OnFinalWritten(Connection& connection) {
  connection.final_pending = false;
  if (connection.close_after) {
    Linger(connection);
    return;
  }
  connection.state = State::kHead;
  connection.head = HttpRequestHead();
  connection.deadline =
      absl::Now() +
      (connection.in.empty() ? options_.idle_timeout : options_.header_timeout);
  Process(connection);
  if (!connection.closed) SetInterest(connection);
}

void HttpServer::Loop::Linger(Connection& connection) {
  connection.state = State::kLinger;
  connection.deadline = absl::Now() + kLinger;
  connection.in = std::string();
  ::shutdown(connection.fd, SHUT_WR);
  if (connection.peer_closed) {
    Close(connection);
    return;
  }
  SetInterest(connection);
}

void HttpServer::Loop::Close(Connection& connection) {
  if (connection.closed) return;
  if (connection.exchange) connection.exchange->cancelled.store(true);
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, connection.fd, nullptr);
  ::close(connection.fd);
  connection.fd = -1;
  connection.closed = true;
  closed_.push_back(connection.id);
}

bool HttpServer::Loop::CloseOneIdle() {
  for (auto& [id, connection] : connections_) {
    if (!connection->closed && Idle(*connection)) {
      Close(*connection);
      return true;
    }
  }
  return false;
}

void HttpServer::Loop::CloseIdle() {
  std::vector<Connection*> idle;
  for (auto& [id, connection] : connections_) {
    if (!connection->closed && Idle(*connection)) {
      idle.push_back(connection.get());
    }
  }
  for (Connection* connection : idle) Close(*connection);
}

void HttpServer::Loop::Tick() {
  const absl::Time now = absl::Now();
  last_tick_ = now;
  if (listen_fd_ >= 0 && now >= accept_paused_until_ &&
      accept_paused_until_ != absl::InfinitePast()) {
    accept_paused_until_ = absl::InfinitePast();
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.u64 = kListenKey;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &event);
  }
  if (draining_) CloseIdle();
  std::vector<Connection*> expired;
  for (auto& [id, connection] : connections_) {
    if (!connection->closed && connection->state != State::kHandling &&
        now >= connection->deadline) {
      expired.push_back(connection.get());
    }
  }
  for (Connection* connection : expired) {
    const bool reading =
        connection->state == State::kBody ||
        (connection->state == State::kHead && !connection->in.empty());
    if (reading) {
      Fail(*connection, 408,
           connection->state == State::kHead
               ? absl::StrCat("request: the head did not arrive within ",
                              absl::FormatDuration(options_.header_timeout))
               : absl::StrCat("body: no bytes for ",
                              absl::FormatDuration(options_.body_timeout)));
    } else {
      Close(*connection);
    }
  }
}

void HttpServer::Loop::StopListeningNow() {
  if (listen_fd_ < 0) return;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listen_fd_, nullptr);
  ::close(listen_fd_);
  listen_fd_ = -1;
}

void HttpServer::Loop::Stop(absl::Time deadline) {
  if (!thread_.joinable()) return;
  Command([this] {
    draining_ = true;
    StopListeningNow();
    CloseIdle();
  });
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait_until(lock, absl::ToChronoTime(deadline),
                      [&] { return inflight_ == 0; });
  if (inflight_ > 0) {
    lock.unlock();
    Command([this] {
      for (auto& [id, connection] : connections_) {
        if (connection->exchange) connection->exchange->cancelled.store(true);
      }
    });
    lock.lock();
    changed_.wait(lock, [&] { return inflight_ == 0; });
  }
  // Answers still being written get a moment to go out.
  lock.unlock();
  const absl::Time flush_until = absl::Now() + absl::Seconds(1);
  while (absl::Now() < flush_until) {
    std::promise<bool> writing;
    auto result = writing.get_future();
    Command([this, &writing] {
      bool any = false;
      for (auto& [id, connection] : connections_) {
        any |= connection->state == State::kWriting;
      }
      writing.set_value(any);
    });
    if (!result.get()) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  lock.lock();
  quit_ = true;
  stop_handlers_ = true;
  lock.unlock();
  task_ready_.notify_all();
  Wake();
  thread_.join();
  for (std::thread& thread : handler_threads_) thread.join();
  handler_threads_.clear();
}

void HttpResponder::Send(HttpResponse response) const {
  if (exchange_->sent.exchange(true)) return;
  if (auto loop = exchange_->loop.lock()) {
    loop->Post(exchange_->connection, exchange_.get(), std::move(response));
  }
}

const std::atomic<bool>* HttpResponder::cancelled() const {
  return &exchange_->cancelled;
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(
    const HttpServerOptions& options, HttpPrecheck precheck,
    HttpHandler handler) {
  std::unique_ptr<HttpServer> server(new HttpServer());
  server->loop_ =
      std::make_shared<Loop>(options, std::move(precheck), std::move(handler));
  absl::StatusOr<int> port = server->loop_->Start();
  if (!port.ok()) return port.status();
  server->port_ = *port;
  return server;
}

void HttpServer::StopListening() {
  if (loop_ != nullptr) loop_->StopListening();
}

void HttpServer::Stop(absl::Time deadline) {
  if (loop_ != nullptr) loop_->Stop(deadline);
}

HttpServer::~HttpServer() { Stop(absl::Now()); }

}  // namespace attnserve
