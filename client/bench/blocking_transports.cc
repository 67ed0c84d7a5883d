#include "client/bench/blocking_transports.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/status_macros.h"
#include "inference/grpc_service.grpc.pb.h"
#include "nlohmann/json.hpp"

namespace attnserve {
namespace {

using inference::ModelInferRequest;
using json = nlohmann::json;

class StreamConnection final : public BlockingConnection {
 public:
  explicit StreamConnection(const ClientOptions& options)
      : stub_(inference::GRPCInferenceService::NewStub(
            CreateChannel(options, /*own_connection=*/true))) {
    // No deadline: the stream lives as long as the load test.
    if (!options.token.empty()) {
      context_.AddMetadata("authorization",
                           absl::StrCat("Bearer ", options.token));
    }
    stream_ = stub_->ModelStreamInfer(&context_);
  }
  ~StreamConnection() override {
    stream_->WritesDone();
    inference::ModelStreamInferResponse rest;
    while (stream_->Read(&rest)) {
    }
    stream_->Finish().ok();
  }

  absl::Status Call(const std::string& request) override {
    // Each connection sends one request over and over: parsed once.
    if (&request != parsed_from_) {
      if (!parsed_.ParseFromString(request)) {
        return absl::InvalidArgumentError("request: not a ModelInferRequest");
      }
      parsed_from_ = &request;
    }
    inference::ModelStreamInferResponse response;
    if (!stream_->Write(parsed_) || !stream_->Read(&response)) {
      return absl::UnavailableError(
          absl::StrCat("ModelStreamInfer: the stream ended: ",
                       FromGrpcStatus(stream_->Finish()).ToString()));
    }
    if (!response.error_message().empty()) {
      return absl::UnknownError(response.error_message());
    }
    return absl::OkStatus();
  }
  std::string peer() const override { return context_.peer(); }

 private:
  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<ModelInferRequest,
                                           inference::ModelStreamInferResponse>>
      stream_;
  const std::string* parsed_from_ = nullptr;
  ModelInferRequest parsed_;
};

// The status an HTTP answer of the protocol stands for.
absl::StatusCode CodeOfHttpStatus(int status) {
  switch (status) {
    case 400:
      return absl::StatusCode::kInvalidArgument;
    case 401:
      return absl::StatusCode::kUnauthenticated;
    case 403:
      return absl::StatusCode::kPermissionDenied;
    case 404:
      return absl::StatusCode::kNotFound;
    case 409:
      return absl::StatusCode::kAborted;
    case 413:
    case 429:
      return absl::StatusCode::kResourceExhausted;
    case 501:
      return absl::StatusCode::kUnimplemented;
    case 503:
      return absl::StatusCode::kUnavailable;
    case 504:
      return absl::StatusCode::kDeadlineExceeded;
    default:
      return absl::StatusCode::kUnknown;
  }
}

// The error an HTTP answer other than 200 carries: its JSON "error", else
// its body.
absl::Status ErrorOf(int status, absl::string_view body) {
  const json error = json::parse(body, nullptr, /*allow_exceptions=*/false);
  const bool has_message = error.is_object() && error.contains("error") &&
                           error["error"].is_string();
  return absl::Status(
      CodeOfHttpStatus(status),
      absl::StrCat(
          "HTTP ", status, ": ",
          has_message ? error["error"].get<std::string>() : std::string(body)));
}

class HttpConnection final : public BlockingConnection {
 public:
  HttpConnection(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}
  ~HttpConnection() override { close(fd_); }

  absl::Status Call(const std::string& request) override {
    ATTN_RETURN_IF_ERROR(Send(request));
    ATTN_ASSIGN_OR_RETURN(const size_t head_end, ReadUntilHeadEnds());
    int status = 0;
    size_t content_length = 0;
    ATTN_RETURN_IF_ERROR(
        ParseHead(absl::string_view(buffer_).substr(0, head_end), &status,
                  &content_length));
    const size_t body_start = head_end + 4;
    ATTN_RETURN_IF_ERROR(ReadAtLeast(body_start + content_length));
    const absl::Status answer =
        status == 200 ? absl::OkStatus()
                      : ErrorOf(status, absl::string_view(buffer_).substr(
                                            body_start, content_length));
    buffer_.erase(0, body_start + content_length);
    return answer;
  }
  std::string peer() const override { return peer_; }

 private:
  absl::Status Send(absl::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t sent = send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (sent < 0 && errno == EINTR) continue;
      if (sent <= 0) return Broken("send");
      bytes.remove_prefix(static_cast<size_t>(sent));
    }
    return absl::OkStatus();
  }
  // Reads until buffer_ holds at least `size` bytes.
  absl::Status ReadAtLeast(size_t size) {
    char chunk[1 << 16];
    while (buffer_.size() < size) {
      const ssize_t got = recv(fd_, chunk, sizeof(chunk), 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return Broken("recv");
      buffer_.append(chunk, static_cast<size_t>(got));
    }
    return absl::OkStatus();
  }
  // Where the response's head ends ("\r\n\r\n").
  absl::StatusOr<size_t> ReadUntilHeadEnds() {
    constexpr size_t kMaxHead = 64 << 10;
    for (;;) {
      const size_t end = buffer_.find("\r\n\r\n");
      if (end != std::string::npos) return end;
      if (buffer_.size() > kMaxHead) {
        return absl::InternalError("HTTP: a response head over 64 KiB");
      }
      ATTN_RETURN_IF_ERROR(ReadAtLeast(buffer_.size() + 1));
    }
  }
  static absl::Status ParseHead(absl::string_view head, int* status,
                                size_t* content_length) {
    const std::vector<absl::string_view> lines = absl::StrSplit(head, "\r\n");
    const std::vector<absl::string_view> status_line =
        absl::StrSplit(lines[0], ' ');
    if (status_line.size() < 2 || !absl::SimpleAtoi(status_line[1], status)) {
      return absl::InternalError(
          absl::StrCat("HTTP: not a status line: ", lines[0]));
    }
    for (size_t i = 1; i < lines.size(); ++i) {
      const std::pair<absl::string_view, absl::string_view> header =
          absl::StrSplit(lines[i], absl::MaxSplits(':', 1));
      if (absl::EqualsIgnoreCase(header.first, "content-length") &&
          !absl::SimpleAtoi(absl::StripAsciiWhitespace(header.second),
                            content_length)) {
        return absl::InternalError(
            absl::StrCat("HTTP: bad Content-Length: ", header.second));
      }
    }
    return absl::OkStatus();
  }
  absl::Status Broken(absl::string_view what) const {
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return absl::DeadlineExceededError(
          absl::StrCat("HTTP: no answer from ", peer_, " in time"));
    }
    return absl::UnavailableError(absl::StrCat(
        "HTTP: ", what, " to ", peer_, " failed: ", std::strerror(errno)));
  }

  const int fd_;
  const std::string peer_;
  // Bytes received and not yet consumed.
  std::string buffer_;
};

// Parameters of the protocol as JSON values.
json ParameterJson(const inference::InferParameter& parameter) {
  switch (parameter.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam:
      return parameter.bool_param();
    case inference::InferParameter::kInt64Param:
      return parameter.int64_param();
    case inference::InferParameter::kUint64Param:
      return parameter.uint64_param();
    case inference::InferParameter::kDoubleParam:
      return parameter.double_param();
    case inference::InferParameter::kStringParam:
      return parameter.string_param();
    default:
      return nullptr;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<BlockingConnection>> OpenStreamConnection(
    const ClientOptions& options) {
  return std::make_unique<StreamConnection>(options);
}

absl::StatusOr<std::unique_ptr<BlockingConnection>> OpenHttpConnection(
    absl::string_view target, const ClientOptions& options) {
  const size_t colon = target.rfind(':');
  if (colon == absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http_target: '", target, "' is not HOST:PORT"));
  }
  const std::string host(target.substr(0, colon));
  const std::string port(target.substr(colon + 1));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int error = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
      error != 0) {
    return absl::UnavailableError(absl::StrCat(
        "--http_target: cannot resolve '", target, "': ", gai_strerror(error)));
  }
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd >= 0 && connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat(
        "--http_target: cannot connect to ", target, ": ", strerror(errno)));
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  const absl::Duration timeout = options.timeout;
  timeval wait = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof(wait));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &wait, sizeof(wait));
  return std::make_unique<HttpConnection>(fd, std::string(target));
}

absl::StatusOr<std::string> HttpInferRequest(const ModelInferRequest& request,
                                             absl::string_view host,
                                             const ClientOptions& options) {
  if (request.raw_input_contents_size() != request.inputs_size()) {
    return absl::InvalidArgumentError(
        "request: every input must be in raw_input_contents");
  }
  json header = {{"inputs", json::array()}};
  std::string binary;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const auto& input = request.inputs(i);
    const std::string& bytes = request.raw_input_contents(i);
    json entry = {{"name", input.name()}, {"datatype", input.datatype()}};
    entry["shape"] =
        std::vector<int64_t>(input.shape().begin(), input.shape().end());
    entry["parameters"] = {{"binary_data_size", bytes.size()}};
    header["inputs"].push_back(std::move(entry));
    binary += bytes;
  }
  json parameters = {{"binary_data_output", true}};
  for (const auto& [name, parameter] : request.parameters()) {
    parameters[name] = ParameterJson(parameter);
  }
  header["parameters"] = std::move(parameters);
  const std::string json_text = header.dump();
  std::string http = absl::StrCat(
      "POST /v2/models/", request.model_name(),
      "/infer HTTP/1.1\r\nHost: ", host,
      "\r\nContent-Type: application/octet-stream\r\n",
      "Inference-Header-Content-Length: ", json_text.size(),
      "\r\nContent-Length: ", json_text.size() + binary.size(), "\r\n");
  if (!options.token.empty()) {
    absl::StrAppend(&http, "Authorization: Bearer ", options.token, "\r\n");
  }
  absl::StrAppend(&http, "\r\n", json_text, binary);
  return http;
}

}  // namespace attnserve
