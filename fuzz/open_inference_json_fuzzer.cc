// Fuzz target: an HTTP/JSON infer call of the Open Inference Protocol
// (fuzz_support's HttpInferCall: the model of the URL, the optional
// Inference-Header-Content-Length and the body), handled as the HTTP
// server handles it: InferRequestFromJson, then the request through the
// gRPC wire into ModelInfer (fuzz_support's ServeModelInfer, with
// ComputeRegistry's regions) and the answer back to JSON with
// InferResponseToJson. The parsed inputs are also echoed back as a
// response's outputs, whatever their datatype and size, to reach every
// path of InferResponseToJson; errors become ErrorJson bodies; the body
// itself is used as a model name for ModelReadyToJson (a URL's name may be
// any bytes).
//
// Every body written must be valid JSON of the documented form: an error
// object, a ready object, or outputs whose binary_data_size parameters add
// up to the binary bytes after the JSON part.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "fuzz/fuzz_support.h"
#include "inference/grpc_service.pb.h"
#include "nlohmann/json.hpp"
#include "server/open_inference_json.h"

namespace attnserve::fuzz {
namespace {

using json = nlohmann::json;

[[noreturn]] void Die(absl::string_view what, absl::string_view problem) {
  std::fprintf(stderr, "fuzz: %.*s: %.*s\n", static_cast<int>(what.size()),
               what.data(), static_cast<int>(problem.size()), problem.data());
  std::abort();
}

json ParseObject(absl::string_view what, absl::string_view text) {
  const json parsed = json::parse(text.begin(), text.end(), nullptr,
                                  /*allow_exceptions=*/false);
  if (!parsed.is_object()) {
    Die(what, absl::StrCat("not a JSON object: ", text.substr(0, 200)));
  }
  return parsed;
}

// `response` through InferResponseToJson, and the body checked.
void CheckResponseJson(inference::ModelInferResponse* response,
                       const JsonOutputOptions& options) {
  constexpr absl::string_view kWhat = "InferResponseToJson";
  const int outputs = response->outputs_size();
  const HttpBody body = InferResponseToJson(response, options);
  const size_t json_length = body.json_length.value_or(body.body.size());
  if (json_length > body.body.size()) {
    Die(kWhat, absl::StrCat("JSON length ", json_length, " beyond the ",
                            body.body.size(), "-byte body"));
  }
  const json parsed =
      ParseObject(kWhat, absl::string_view(body.body).substr(0, json_length));
  const json& items = parsed.value("outputs", json());
  if (!items.is_array() || static_cast<int>(items.size()) != outputs) {
    Die(kWhat, absl::StrCat("expected ", outputs, " outputs in ",
                            parsed.dump().substr(0, 200)));
  }
  uint64_t binary = 0;
  bool any_binary = false;
  for (const json& item : items) {
    const json& parameters = item.value("parameters", json::object());
    if (const auto size = parameters.find("binary_data_size");
        size != parameters.end()) {
      if (!size->is_number_unsigned()) Die(kWhat, size->dump());
      binary += size->get<uint64_t>();
      any_binary = true;
    }
  }
  if (binary != body.body.size() - json_length ||
      any_binary != body.json_length.has_value()) {
    Die(kWhat, absl::StrCat(binary, " binary bytes announced, ",
                            body.body.size() - json_length, " sent"));
  }
}

// The request's inputs as a response's outputs: their values (raw
// contents, in the order of the inputs that are not in shared memory) and
// parameters.
inference::ModelInferResponse Echo(const inference::ModelInferRequest& in) {
  inference::ModelInferResponse out;
  out.set_model_name(in.model_name());
  out.set_id(in.id());
  int raw = 0;
  for (const auto& input : in.inputs()) {
    auto* output = out.add_outputs();
    output->set_name(input.name());
    output->set_datatype(input.datatype());
    output->mutable_shape()->CopyFrom(input.shape());
    *output->mutable_parameters() = input.parameters();
    std::string* bytes = out.add_raw_output_contents();
    if (!input.parameters().contains("shared_memory_region") &&
        raw < in.raw_input_contents_size()) {
      *bytes = in.raw_input_contents(raw++);
    }
  }
  return out;
}

void Run(const HttpInferCall& call) {
  // The URL's model name, as any bytes, answered as GET .../ready does.
  inference::ModelMetadataResponse metadata;
  const bool ready = ServeModelMetadata(call.model, "", &metadata);
  const json ready_body =
      ParseObject("ModelReadyToJson", ModelReadyToJson(call.body, ready));
  if (!ready_body.value("name", json()).is_string() ||
      ready_body.value("ready", json()) != ready) {
    Die("ModelReadyToJson", ready_body.dump());
  }

  inference::ModelInferRequest request;
  request.set_model_name(call.model);
  JsonOutputOptions options;
  const absl::Status parsed =
      InferRequestFromJson(call.body, call.json_length, &request, &options);
  CheckStatus("InferRequestFromJson", parsed);
  if (!parsed.ok()) {
    // The message quotes the body, which need not be UTF-8.
    const json error = ParseObject("ErrorJson", ErrorJson(parsed.message()));
    if (!error.value("error", json()).is_string()) {
      Die("ErrorJson", error.dump());
    }
    return;
  }
  inference::ModelInferResponse echo = Echo(request);
  CheckResponseJson(&echo, options);

  // The HTTP server sends the request on to ModelInfer over gRPC.
  std::string wire;
  inference::ModelInferRequest received;
  if (!request.SerializeToString(&wire) || !received.ParseFromString(wire)) {
    Die("InferRequestFromJson", "the request does not survive the gRPC wire");
  }
  RefillSharedMemory();
  inference::ModelInferResponse response;
  if (ServeModelInfer(&received, &ComputeRegistry(), &response)) {
    CheckResponseJson(&response, options);
  }
}

}  // namespace
}  // namespace attnserve::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::optional<attnserve::fuzz::HttpInferCall> call =
      attnserve::fuzz::ReadHttpInferCall(data, size);
  if (call.has_value()) attnserve::fuzz::Run(*call);
  return 0;
}
