#include "server/http_inference.h"

#include <zlib.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "inference/grpc_service.pb.h"
#include "server/http_extensions.h"
#include "server/http_status.h"
#include "server/open_inference.h"
#include "server/open_inference_json.h"

namespace attnserve {
namespace {

constexpr char kJson[] = "application/json";
// Triton's binary tensor extension: the length of the JSON part of a body
// that continues with binary tensors.
constexpr char kHeaderLength[] = "Inference-Header-Content-Length";

// What a request's path names.
struct Route {
  enum class Kind {
    kNone,
    kLive,
    kReady,
    kServerMetadata,
    kModelMetadata,
    kModelReady,
    kInfer,
    kExtension,  // Triton's extensions (server/http_extensions.h)
  } kind = Kind::kNone;
  std::optional<ExtensionRoute> extension;
  std::string model;
  std::string version;
  // GET (and HEAD) or POST.
  bool post = false;
  // Either (trace and log settings).
  bool get_or_post = false;
};

// /v2/models/{name}[/versions/{version}][/ready|/infer].
Route RouteOf(absl::string_view path) {
  Route route;
  if (std::optional<ExtensionRoute> extension = ExtensionRouteOf(path)) {
    route.kind = Route::Kind::kExtension;
    route.post = extension->post;
    route.get_or_post = extension->get_or_post;
    route.extension = std::move(extension);
    return route;
  }
  if (path == "/v2/health/live") {
    route.kind = Route::Kind::kLive;
  } else if (path == "/v2/health/ready") {
    route.kind = Route::Kind::kReady;
  } else if (path == "/v2") {
    route.kind = Route::Kind::kServerMetadata;
  } else if (absl::ConsumePrefix(&path, "/v2/models/")) {
    std::vector<absl::string_view> parts = absl::StrSplit(path, '/');
    if (parts.empty() || parts[0].empty()) return route;
    route.model = std::string(parts[0]);
    size_t next = 1;
    if (parts.size() >= 3 && parts[1] == "versions" && !parts[2].empty()) {
      route.version = std::string(parts[2]);
      next = 3;
    }
    if (parts.size() == next) {
      route.kind = Route::Kind::kModelMetadata;
    } else if (parts.size() == next + 1 && parts[next] == "ready") {
      route.kind = Route::Kind::kModelReady;
    } else if (parts.size() == next + 1 && parts[next] == "infer") {
      route.kind = Route::Kind::kInfer;
      route.post = true;
    }
  }
  return route;
}

HttpResponse JsonResponse(int status, std::string body) {
  HttpResponse response;
  response.status = status;
  response.fields.emplace_back("Content-Type", kJson);
  response.body = std::move(body);
  return response;
}

// The coding of a Content-Encoding or Accept-Encoding element, lowercased,
// without parameters.
std::string CodingOf(absl::string_view element) {
  return absl::AsciiStrToLower(
      absl::StripAsciiWhitespace(element.substr(0, element.find(';'))));
}

// "gzip" or "deflate" when the client's Accept-Encoding takes one (gzip
// preferred), else "".
std::string ResponseCoding(const HttpRequestHead& head) {
  const std::string* accept = head.Find("Accept-Encoding");
  if (accept == nullptr) return "";
  bool gzip = false;
  bool deflate = false;
  for (absl::string_view element : absl::StrSplit(*accept, ',')) {
    // "gzip;q=0" refuses gzip.
    const size_t q = element.find("q=");
    double weight = 1;
    if (q != absl::string_view::npos &&
        !absl::SimpleAtod(element.substr(q + 2), &weight)) {
      weight = 0;
    }
    if (weight <= 0) continue;
    const std::string coding = CodingOf(element);
    gzip |= coding == "gzip" || coding == "x-gzip";
    deflate |= coding == "deflate";
  }
  return gzip ? "gzip" : deflate ? "deflate" : "";
}

// Inflates a gzip or zlib body, to at most `limit` bytes.
absl::StatusOr<std::string> Inflate(absl::string_view compressed,
                                    size_t limit) {
  z_stream stream{};
  // 15 + 32: a zlib or a gzip header, whichever the body has.
  if (inflateInit2(&stream, 15 + 32) != Z_OK) {
    return absl::ResourceExhaustedError("body: cannot start decompression");
  }
  std::string out;
  stream.next_in =
      reinterpret_cast<Bytef*>(const_cast<char*>(compressed.data()));
  stream.avail_in = static_cast<uInt>(compressed.size());
  int result = Z_OK;
  while (result == Z_OK) {
    if (out.size() >= limit + 1) break;
    const size_t before = out.size();
    const size_t room = std::min<size_t>(limit + 1 - before, 1 << 20);
    out.resize(before + room);
    stream.next_out = reinterpret_cast<Bytef*>(out.data() + before);
    stream.avail_out = static_cast<uInt>(room);
    result = inflate(&stream, Z_NO_FLUSH);
    out.resize(before + room - stream.avail_out);
    if (result == Z_BUF_ERROR && stream.avail_in == 0) break;
  }
  inflateEnd(&stream);
  if (out.size() > limit) {
    return absl::ResourceExhaustedError(
        absl::StrCat("body: more than ", limit,
                     " bytes once decompressed (--max_message_mb)"));
  }
  if (result != Z_STREAM_END) {
    return absl::InvalidArgumentError(
        "body: not a complete gzip or deflate stream (Content-Encoding)");
  }
  return out;
}

// Compresses `parts` as gzip or (zlib) deflate.
std::string Deflate(const std::string& coding,
                    std::initializer_list<const std::string*> parts) {
  z_stream stream{};
  deflateInit2(&stream, Z_BEST_SPEED, Z_DEFLATED,
               coding == "gzip" ? 15 + 16 : 15, 8, Z_DEFAULT_STRATEGY);
  size_t total = 0;
  for (const std::string* part : parts) total += part->size();
  std::string out(deflateBound(&stream, total) + 64, '\0');
  stream.next_out = reinterpret_cast<Bytef*>(out.data());
  stream.avail_out = static_cast<uInt>(out.size());
  size_t index = 0;
  for (const std::string* part : parts) {
    ++index;
    stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(part->data()));
    stream.avail_in = static_cast<uInt>(part->size());
    deflate(&stream, index == parts.size() ? Z_FINISH : Z_NO_FLUSH);
  }
  out.resize(out.size() - stream.avail_out);
  deflateEnd(&stream);
  return out;
}

class HttpInference {
 public:
  HttpInference(const CallPipeline* pipeline, size_t max_body_bytes)
      : pipeline_(pipeline), max_body_bytes_(max_body_bytes) {}

  // Decides from the head alone what is refused before the body is read.
  std::optional<HttpResponse> Precheck(const HttpRequestHead& head) const {
    const Route route = RouteOf(head.path());
    if (route.kind == Route::Kind::kNone) {
      return JsonErrorResponse(
          404, absl::StrCat("no such endpoint: ", head.method, " ",
                            head.path().substr(0, 128)));
    }
    const bool get = head.method == "GET" || head.method == "HEAD";
    const bool allowed = route.get_or_post ? get || head.method == "POST"
                         : route.post      ? head.method == "POST"
                                           : get;
    if (!allowed) {
      const char* use = route.get_or_post ? "GET or POST"
                        : route.post      ? "POST"
                                          : "GET";
      HttpResponse refusal =
          JsonErrorResponse(405, absl::StrCat(head.method.substr(0, 32), " ",
                                              head.path(), ": use ", use));
      refusal.fields.emplace_back("Allow", route.get_or_post ? "GET, HEAD, POST"
                                           : route.post      ? "POST"
                                                             : "GET, HEAD");
      return refusal;
    }
    if (const std::string* encoding = head.Find("Content-Encoding")) {
      const std::string coding = CodingOf(*encoding);
      if (coding != "gzip" && coding != "x-gzip" && coding != "deflate" &&
          coding != "identity") {
        return JsonErrorResponse(
            415, absl::StrCat("Content-Encoding: '", encoding->substr(0, 64),
                              "' is not accepted; send gzip, deflate or "
                              "identity"));
      }
    }
    if (route.kind != Route::Kind::kLive && route.kind != Route::Kind::kReady) {
      const std::string* authorization = head.Find("Authorization");
      const absl::Status status = pipeline_->CheckAuthorization(
          authorization != nullptr
              ? std::optional<absl::string_view>(*authorization)
              : std::nullopt);
      if (!status.ok()) {
        HttpResponse refusal = StatusResponse(status);
        refusal.fields.emplace_back("WWW-Authenticate", "Bearer");
        return refusal;
      }
    }
    return std::nullopt;
  }

  void Handle(HttpRequest request, HttpResponder responder) const {
    const Route route = RouteOf(request.head.path());
    switch (route.kind) {
      case Route::Kind::kLive:
        return responder.Send(JsonResponse(200, R"({"live":true})"));
      case Route::Kind::kReady: {
        const bool ready = pipeline_->engine().ready();
        return responder.Send(
            JsonResponse(ready ? 200 : 503,
                         ready ? R"({"ready":true})" : R"({"ready":false})"));
      }
      case Route::Kind::kServerMetadata: {
        inference::ServerMetadataResponse metadata;
        HandleServerMetadata(pipeline_->config().sessions != nullptr,
                             &metadata);
        return responder.Send(
            JsonResponse(200, ServerMetadataToJson(metadata)));
      }
      case Route::Kind::kModelMetadata: {
        inference::ModelMetadataRequest query;
        query.set_name(route.model);
        query.set_version(route.version);
        inference::ModelMetadataResponse metadata;
        const absl::Status status =
            HandleModelMetadata(query, pipeline_->config().models, &metadata);
        if (!status.ok()) return responder.Send(StatusResponse(status));
        return responder.Send(JsonResponse(200, ModelMetadataToJson(metadata)));
      }
      case Route::Kind::kModelReady: {
        inference::ModelReadyRequest query;
        query.set_name(route.model);
        query.set_version(route.version);
        inference::ModelReadyResponse ready;
        const absl::Status status =
            HandleModelReady(query, pipeline_->config().models, &ready);
        if (!status.ok()) return responder.Send(StatusResponse(status));
        return responder.Send(
            JsonResponse(ready.ready() ? 200 : 503,
                         ModelReadyToJson(query.name(), ready.ready())));
      }
      case Route::Kind::kInfer:
        return Infer(route, std::move(request), std::move(responder));
      case Route::Kind::kExtension: {
        if (const std::string* encoding = request.head.Find("Content-Encoding");
            encoding != nullptr && CodingOf(*encoding) != "identity") {
          absl::StatusOr<std::string> inflated =
              Inflate(request.body, max_body_bytes_);
          if (absl::IsResourceExhausted(inflated.status())) {
            return responder.Send(
                JsonErrorResponse(413, inflated.status().message()));
          }
          if (!inflated.ok()) {
            return responder.Send(StatusResponse(inflated.status()));
          }
          request.body = *std::move(inflated);
        }
        return responder.Send(
            HandleExtension(*route.extension, request.body, *pipeline_));
      }
      case Route::Kind::kNone:
        break;
    }
    responder.Send(JsonErrorResponse(404, "no such endpoint"));
  }

 private:
  // One inference call from its arrival to its answer.
  struct InferCall {
    inference::ModelInferRequest request;
    inference::ModelInferResponse response;
    const MessageSubject subject{&request, &response};
    JsonOutputOptions output_options;
    std::unique_ptr<NativeInferCall> native;
    std::string response_coding;
  };

  void Infer(const Route& route, HttpRequest http,
             HttpResponder responder) const {
    auto call = std::make_shared<InferCall>();
    const absl::Status decoded = Decode(route, &http, call.get());
    if (absl::IsResourceExhausted(decoded)) {
      // Only sizes are refused so here: the body is too large.
      return responder.Send(JsonErrorResponse(413, decoded.message()));
    }
    if (!decoded.ok()) return responder.Send(StatusResponse(decoded));
    call->response_coding = ResponseCoding(http.head);
    EngineCall record{.label = call->native->label(),
                      .subject = &call->subject,
                      .cost = call->native->cost(),
                      .arrived = http.arrived,
                      .decoded = absl::Now()};
    pipeline_->Run(
        std::move(record),
        [call](const CallControl& control) {
          return call->native->Run(control);
        },
        responder.cancelled(),
        [call, responder](const absl::Status& status) {
          if (!status.ok()) return responder.Send(StatusResponse(status));
          call->native->ToResponse(call->request, &call->response);
          responder.Send(Encode(call.get()));
        },
        // `finish` holds the call until the step is answered.
        [&call] { return call->native->StepCall(); });
  }

  // The HTTP request as the protocol's message and its native call.
  absl::Status Decode(const Route& route, HttpRequest* http,
                      InferCall* call) const {
    if (const std::string* encoding = http->head.Find("Content-Encoding");
        encoding != nullptr && CodingOf(*encoding) != "identity") {
      absl::StatusOr<std::string> inflated =
          Inflate(http->body, max_body_bytes_);
      if (!inflated.ok()) return inflated.status();
      http->body = *std::move(inflated);
    }
    std::optional<size_t> json_length;
    if (const std::string* length = http->head.Find(kHeaderLength)) {
      size_t parsed = 0;
      if (!absl::SimpleAtoi(*length, &parsed)) {
        return absl::InvalidArgumentError(
            absl::StrCat(kHeaderLength, ": expected a byte count"));
      }
      json_length = parsed;
    }
    call->request.set_model_name(route.model);
    call->request.set_model_version(route.version);
    if (absl::Status parsed = InferRequestFromJson(
            http->body, json_length, &call->request, &call->output_options);
        !parsed.ok()) {
      return absl::InvalidArgumentError(parsed.message());
    }
    http->body = std::string();  // its tensors are in the request now
    // JSON numbers can be shorter than the float32s they become.
    if (call->request.ByteSizeLong() > max_body_bytes_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "request: ", call->request.ByteSizeLong(),
          " bytes once converted from JSON exceed the server's limit of ",
          max_body_bytes_, " (--max_message_mb)"));
    }
    absl::StatusOr<std::unique_ptr<NativeInferCall>> native =
        NativeInferCall::FromRequest(&call->request, pipeline_->config().models,
                                     pipeline_->sequences());
    if (!native.ok()) return native.status();
    call->native = *std::move(native);
    return absl::OkStatus();
  }

  static HttpResponse Encode(InferCall* call) {
    HttpBody body = InferResponseToJson(&call->response, call->output_options);
    HttpResponse response;
    if (body.json_length.has_value()) {
      response.fields.emplace_back(kHeaderLength,
                                   std::to_string(*body.json_length));
      response.fields.emplace_back("Content-Type", "application/octet-stream");
    } else {
      response.fields.emplace_back("Content-Type", kJson);
    }
    if (!call->response_coding.empty()) {
      response.fields.emplace_back("Content-Encoding", call->response_coding);
      response.body = Deflate(call->response_coding, {&body.body});
    } else {
      response.body = std::move(body.body);
    }
    return response;
  }

  const CallPipeline* pipeline_;
  const size_t max_body_bytes_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<HttpServer>> StartHttpInference(
    const HttpServerOptions& options, const CallPipeline* pipeline) {
  auto inference = std::make_shared<HttpInference>(
      pipeline, static_cast<size_t>(options.limits.max_body_bytes));
  return HttpServer::Start(
      options,
      [inference](const HttpRequestHead& head) {
        return inference->Precheck(head);
      },
      [inference](HttpRequest request, HttpResponder responder) {
        inference->Handle(std::move(request), std::move(responder));
      });
}

}  // namespace attnserve
