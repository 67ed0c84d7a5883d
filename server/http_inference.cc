#include "server/http_inference.h"

#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "httplib.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/open_inference_json.h"

namespace attnserve {
namespace {

using Stub = inference::GRPCInferenceService::Stub;

constexpr char kJson[] = "application/json";
// Triton's binary tensor extension: the length of the JSON part of a body
// that continues with binary tensors.
constexpr char kHeaderLength[] = "Inference-Header-Content-Length";
// Model name and optional version: /v2/models/{name}[/versions/{version}].
constexpr char kModelPath[] = "/v2/models/([^/]+)(?:/versions/([^/]+))?";

void SendError(httplib::Response& response, int status,
               absl::string_view message) {
  response.status = status;
  response.set_content(ErrorJson(message), kJson);
}

void SendStatus(httplib::Response& response, const grpc::Status& status) {
  SendError(response, HttpStatusOf(status.error_code()),
            status.error_message());
}

// A gRPC call's context carrying the HTTP request's credentials.
std::unique_ptr<grpc::ClientContext> ContextFor(
    const httplib::Request& request) {
  auto context = std::make_unique<grpc::ClientContext>();
  const std::string authorization = request.get_header_value("Authorization");
  if (!authorization.empty()) {
    context->AddMetadata("authorization", authorization);
  }
  return context;
}

// GET /v2/health/{live,ready}: 200 when true, else 503; no token needed.
void AddHealth(httplib::Server* http, std::shared_ptr<Stub> stub) {
  http->Get("/v2/health/live", [stub](const httplib::Request& request,
                                      httplib::Response& response) {
    inference::ServerLiveResponse live;
    const grpc::Status status =
        stub->ServerLive(ContextFor(request).get(), {}, &live);
    if (!status.ok()) return SendStatus(response, status);
    response.status = live.live() ? 200 : 503;
    response.set_content(live.live() ? R"({"live":true})" : R"({"live":false})",
                         kJson);
  });
  http->Get("/v2/health/ready", [stub](const httplib::Request& request,
                                       httplib::Response& response) {
    inference::ServerReadyResponse ready;
    const grpc::Status status =
        stub->ServerReady(ContextFor(request).get(), {}, &ready);
    if (!status.ok()) return SendStatus(response, status);
    response.status = ready.ready() ? 200 : 503;
    response.set_content(
        ready.ready() ? R"({"ready":true})" : R"({"ready":false})", kJson);
  });
}

// GET /v2, /v2/models/{name}, /v2/models/{name}/ready.
void AddMetadata(httplib::Server* http, std::shared_ptr<Stub> stub) {
  http->Get("/v2", [stub](const httplib::Request& request,
                          httplib::Response& response) {
    inference::ServerMetadataResponse metadata;
    const grpc::Status status =
        stub->ServerMetadata(ContextFor(request).get(), {}, &metadata);
    if (!status.ok()) return SendStatus(response, status);
    response.set_content(ServerMetadataToJson(metadata), kJson);
  });
  http->Get(kModelPath, [stub](const httplib::Request& request,
                               httplib::Response& response) {
    inference::ModelMetadataRequest query;
    query.set_name(request.matches[1]);
    query.set_version(request.matches[2]);
    inference::ModelMetadataResponse metadata;
    const grpc::Status status =
        stub->ModelMetadata(ContextFor(request).get(), query, &metadata);
    if (!status.ok()) return SendStatus(response, status);
    response.set_content(ModelMetadataToJson(metadata), kJson);
  });
  http->Get(
      absl::StrCat(kModelPath, "/ready"),
      [stub](const httplib::Request& request, httplib::Response& response) {
        inference::ModelReadyRequest query;
        query.set_name(request.matches[1]);
        query.set_version(request.matches[2]);
        inference::ModelReadyResponse ready;
        const grpc::Status status =
            stub->ModelReady(ContextFor(request).get(), query, &ready);
        if (!status.ok()) return SendStatus(response, status);
        response.status = ready.ready() ? 200 : 503;
        response.set_content(ModelReadyToJson(query.name(), ready.ready()),
                             kJson);
      });
}

// POST /v2/models/{name}/infer.
void AddInfer(httplib::Server* http, std::shared_ptr<Stub> stub,
              size_t max_body_bytes) {
  http->Post(absl::StrCat(kModelPath, "/infer"),
             [stub, max_body_bytes](const httplib::Request& request,
                                    httplib::Response& response) {
               std::optional<size_t> json_length;
               if (request.has_header(kHeaderLength)) {
                 size_t length = 0;
                 if (!absl::SimpleAtoi(request.get_header_value(kHeaderLength),
                                       &length)) {
                   return SendError(
                       response, 400,
                       absl::StrCat(kHeaderLength, ": expected a byte count"));
                 }
                 json_length = length;
               }
               inference::ModelInferRequest infer;
               infer.set_model_name(request.matches[1]);
               infer.set_model_version(request.matches[2]);
               JsonOutputOptions output_options;
               if (const absl::Status parsed = InferRequestFromJson(
                       request.body, json_length, &infer, &output_options);
                   !parsed.ok()) {
                 return SendError(response, 400, parsed.message());
               }
               // JSON numbers can be shorter than the float32s they become.
               if (infer.ByteSizeLong() > max_body_bytes) {
                 return SendError(
                     response, 413,
                     absl::StrCat("request: ", infer.ByteSizeLong(),
                                  " bytes once converted from JSON exceed the "
                                  "server's limit of ",
                                  max_body_bytes, " (--max_message_mb)"));
               }
               inference::ModelInferResponse result;
               const grpc::Status status =
                   stub->ModelInfer(ContextFor(request).get(), infer, &result);
               if (!status.ok()) return SendStatus(response, status);
               HttpBody body = InferResponseToJson(&result, output_options);
               if (body.json_length.has_value()) {
                 response.set_header(kHeaderLength,
                                     std::to_string(*body.json_length));
                 response.set_content(std::move(body.body),
                                      "application/octet-stream");
               } else {
                 response.set_content(std::move(body.body), kJson);
               }
             });
}

bool IsPrintableAscii(absl::string_view text) {
  for (char c : text) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

// What is checked before a request's body is read; nullopt: go on.
std::optional<std::pair<int, std::string>> Refusal(
    const httplib::Request& request, const TokenAuthenticator* auth) {
  const bool has_authorization = request.has_header("Authorization");
  const std::string authorization = request.get_header_value("Authorization");
  // gRPC metadata takes printable ASCII only (and aborts on anything else).
  if (!IsPrintableAscii(authorization)) {
    return std::pair(400,
                     "Authorization: holds bytes that are not printable "
                     "ASCII; expected 'Bearer <token>'");
  }
  if (request.method == "POST") {
    if (request.has_header("Transfer-Encoding") ||
        !request.has_header("Content-Length")) {
      return std::pair(411,
                       "body: send it with a Content-Length (chunked "
                       "bodies are not accepted)");
    }
    const std::string encoding = request.get_header_value("Content-Encoding");
    if (!encoding.empty() && encoding != "identity") {
      return std::pair(415, absl::StrCat("Content-Encoding: '", encoding,
                                         "' is not accepted; send the body "
                                         "uncompressed"));
    }
  }
  if (auth != nullptr && !absl::StartsWith(request.path, "/v2/health/")) {
    const absl::Status status = auth->CheckAuthorization(
        has_authorization ? std::optional<absl::string_view>(authorization)
                          : std::nullopt);
    if (!status.ok()) return std::pair(401, std::string(status.message()));
  }
  return std::nullopt;
}

}  // namespace

int HttpStatusOf(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return 200;
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE:
    case grpc::StatusCode::ALREADY_EXISTS:
      return 400;
    case grpc::StatusCode::UNAUTHENTICATED:
      return 401;
    case grpc::StatusCode::PERMISSION_DENIED:
      return 403;
    case grpc::StatusCode::NOT_FOUND:
      return 404;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return 429;
    case grpc::StatusCode::CANCELLED:
      return 499;
    case grpc::StatusCode::UNAVAILABLE:
      return 503;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return 504;
    default:
      return 500;
  }
}

absl::StatusOr<std::unique_ptr<HttpListener>> StartHttpInference(
    const HttpInferenceConfig& config) {
  auto http = std::make_unique<httplib::Server>();
  auto stub = std::shared_ptr<Stub>(
      inference::GRPCInferenceService::NewStub(config.channel));
  http->set_payload_max_length(config.max_body_bytes);
  http->set_pre_routing_handler(httplib::Server::HandlerWithResponse(
      [auth = config.auth](const httplib::Request& request,
                           httplib::Response& response) {
        const auto refusal = Refusal(request, auth);
        if (!refusal.has_value()) {
          return httplib::Server::HandlerResponse::Unhandled;
        }
        SendError(response, refusal->first, refusal->second);
        return httplib::Server::HandlerResponse::Handled;
      }));
  // A keep-alive connection holds a worker while it lasts: enough workers
  // for many clients, and connections rotated after 100 calls.
  http->new_task_queue = [] { return new httplib::ThreadPool(64); };
  // Without TCP_NODELAY a small response waits ~40 ms for the client's
  // delayed ACK (Nagle); clients keep their connection for many calls.
  http->set_tcp_nodelay(true);
  // An idle keep-alive connection closes after 5 s (also what a stop may
  // wait for it).
  http->set_keep_alive_max_count(100);
  http->set_keep_alive_timeout(5);
  // Errors httplib answers itself (no route, a body over the limit) get a
  // JSON body too; those of the routes already have one.
  http->set_error_handler(httplib::Server::HandlerWithResponse(
      [max = config.max_body_bytes](const httplib::Request& request,
                                    httplib::Response& response) {
        if (!response.body.empty())
          return httplib::Server::HandlerResponse::Unhandled;
        const std::string type = request.get_header_value("Content-Type");
        if (response.status == 413 &&
            type.rfind("application/x-www-form-urlencoded", 0) == 0) {
          // httplib caps form bodies (curl -d's default type) at 8 KiB.
          response.set_content(
              ErrorJson("body: a form-encoded body (Content-Type "
                        "application/x-www-form-urlencoded, curl -d's "
                        "default) is limited to 8192 bytes; send "
                        "Content-Type: application/json"),
              kJson);
        } else if (response.status == 413) {
          response.set_content(
              ErrorJson(absl::StrCat(
                  "body: ", request.get_header_value("Content-Length"),
                  " bytes exceed the server's limit of ", max,
                  " (--max_message_mb)")),
              kJson);
        } else if (response.status == 404) {
          response.set_content(
              ErrorJson(absl::StrCat("no such endpoint: ", request.method, " ",
                                     request.path)),
              kJson);
        } else {
          response.set_content(
              ErrorJson(absl::StrCat("HTTP ", response.status)), kJson);
        }
        return httplib::Server::HandlerResponse::Handled;
      }));
  AddHealth(http.get(), stub);
  AddMetadata(http.get(), stub);
  AddInfer(http.get(), stub, config.max_body_bytes);
  return HttpListener::Start(std::move(http), config.host, config.port,
                             "--http_port");
}

}  // namespace attnserve
