// The Open Inference Protocol's HTTP/JSON bodies as its gRPC messages and
// back, so that the HTTP endpoints run the same ModelInfer as gRPC clients.
//
// Request tensors: "data" (flat or nested, row-major) is checked against
// "shape" and "datatype" here and sent on as raw bytes; or, with Triton's
// binary tensor extension, the input's parameter "binary_data_size" takes
// that many bytes from after the JSON (whose length the header
// Inference-Header-Content-Length gives). Response tensors: "data" as JSON
// numbers or booleans (NaN and infinities, which JSON cannot write, as
// null), or binary after the JSON for outputs asked for with the parameter
// "binary_data" (or every output with the request parameter
// "binary_data_output").
//
// Thread-safety: free functions without shared state.
#ifndef ATTNSERVE_SERVER_OPEN_INFERENCE_JSON_H_
#define ATTNSERVE_SERVER_OPEN_INFERENCE_JSON_H_

#include <cstddef>
#include <map>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "inference/grpc_service.pb.h"

namespace attnserve {

// How the HTTP response should carry each output.
struct JsonOutputOptions {
  // Every output as binary (request parameter "binary_data_output").
  bool all_binary = false;
  // Outputs whose parameter "binary_data" says true or false: it wins over
  // all_binary, as in Triton.
  std::map<std::string, bool> binary;
};

// Parses an infer request body into `request` (model name and version come
// from the URL). `json_length`: the JSON part's length when the body also
// holds binary tensors; nullopt when it is all JSON. INVALID_ARGUMENT names
// what is wrong, e.g. "inputs[1] (key): 5 values, shape [2, 3] needs 6".
absl::Status InferRequestFromJson(absl::string_view body,
                                  std::optional<size_t> json_length,
                                  inference::ModelInferRequest* request,
                                  JsonOutputOptions* output_options);

// An HTTP body: JSON, followed by binary outputs when json_length is set.
struct HttpBody {
  std::string body;
  std::optional<size_t> json_length;
};

// The infer response's body; takes the bytes of `response`'s outputs.
HttpBody InferResponseToJson(inference::ModelInferResponse* response,
                             const JsonOutputOptions& output_options);

std::string ModelMetadataToJson(
    const inference::ModelMetadataResponse& metadata);
std::string ServerMetadataToJson(
    const inference::ServerMetadataResponse& metadata);
// {"name": name, "ready": ready}
std::string ModelReadyToJson(absl::string_view name, bool ready);
// {"error": message}
std::string ErrorJson(absl::string_view message);

// INVALID_ARGUMENT when `text` nests arrays and objects deeper than a
// request needs (checked before parsing: the parser recurses per level).
absl::Status VerifyJsonDepth(absl::string_view text);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_OPEN_INFERENCE_JSON_H_
