#include "server/open_inference_json.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/convert.h"
#include "core/dtype.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace attnserve {
namespace {

using inference::InferParameter;
using inference::ModelInferRequest;
using json = nlohmann::json;
using ParameterMap = google::protobuf::Map<std::string, InferParameter>;

// Deeper nesting than a tensor of 64 dims in an object needs is refused
// before parsing: the parser recurses once per level.
constexpr int kMaxJsonDepth = 80;

// Calls `visit(i)` for each byte text[i] outside JSON strings; `visit`
// returns how many bytes after it to pass over (text.size() stops).
template <typename Visit>
void ForEachOutsideStrings(absl::string_view text, Visit visit) {
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else {
      i += visit(i);
    }
  }
}

absl::Status VerifyDepth(absl::string_view text) {
  int depth = 0;
  absl::Status status;
  ForEachOutsideStrings(text, [&](size_t i) -> size_t {
    const char c = text[i];
    if (c == ']' || c == '}') --depth;
    if ((c != '[' && c != '{') || ++depth <= kMaxJsonDepth) return 0;
    status = absl::InvalidArgumentError(absl::StrCat(
        "body: JSON nested deeper than ", kMaxJsonDepth, " levels"));
    return text.size();
  });
  return status;
}

// Triton parses JSON with rapidjson's kParseNanAndInfFlag, so NaN, -NaN,
// Inf, Infinity, -Inf and -Infinity are numbers there, and Triton's Python
// client writes them for non-finite values. nlohmann's parser refuses
// them: outside strings they become strings that start with this byte
// (no JSON text holds it raw), which NonFinite reads back as numbers.
constexpr char kNonFiniteMark = '\x01';

// The text with its non-finite number tokens marked (see above); nullopt
// when it has none (parsed as it is).
std::optional<std::string> MarkNonFinite(absl::string_view text) {
  std::optional<std::string> out;
  size_t copied = 0;  // text[0, copied) is in *out
  ForEachOutsideStrings(text, [&](size_t i) -> size_t {
    const absl::string_view rest = text.substr(i);
    for (absl::string_view token :
         {"NaN", "-NaN", "-Infinity", "Infinity", "-Inf", "Inf"}) {
      if (!absl::StartsWith(rest, token)) continue;
      if (!out.has_value()) out.emplace();
      absl::StrAppend(&*out, text.substr(copied, i - copied), "\"\\u0001",
                      token, "\"");
      copied = i + token.size();
      return token.size() - 1;
    }
    return 0;
  });
  if (out.has_value()) absl::StrAppend(&*out, text.substr(copied));
  return out;
}

absl::StatusOr<json> ParseJson(absl::string_view text) {
  ATTN_RETURN_IF_ERROR(VerifyDepth(text));
  const std::optional<std::string> marked = MarkNonFinite(text);
  if (marked.has_value()) text = *marked;
  json parsed;
  try {
    parsed = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("body: not valid JSON: ", e.what()));
  }
  if (!parsed.is_object()) {
    return absl::InvalidArgumentError("body: expected a JSON object");
  }
  return parsed;
}

// The value of a non-finite number token (see kNonFiniteMark).
std::optional<double> NonFinite(const json& value) {
  if (!value.is_string()) return std::nullopt;
  const std::string& text = value.get_ref<const std::string&>();
  if (text.empty() || text[0] != kNonFiniteMark) return std::nullopt;
  if (absl::EndsWith(text, "NaN")) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  const double infinity = std::numeric_limits<double>::infinity();
  return text[1] == '-' ? -infinity : infinity;
}

// What a JSON value is, for messages.
std::string KindOf(const json& value) {
  return NonFinite(value).has_value() ? "number" : value.type_name();
}

absl::Status FieldError(absl::string_view field, absl::string_view expected,
                        const json& got) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": expected ", expected, ", got ", KindOf(got)));
}

// A JSON value as a protocol parameter.
absl::Status ToParameter(const json& value, absl::string_view field,
                         InferParameter* parameter) {
  if (value.is_boolean()) {
    parameter->set_bool_param(value.get<bool>());
  } else if (value.is_number_unsigned()) {
    const uint64_t number = value.get<uint64_t>();
    if (number <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      parameter->set_int64_param(static_cast<int64_t>(number));
    } else {
      parameter->set_uint64_param(number);
    }
  } else if (value.is_number_integer()) {
    parameter->set_int64_param(value.get<int64_t>());
  } else if (value.is_number_float()) {
    parameter->set_double_param(value.get<double>());
  } else if (const std::optional<double> number = NonFinite(value)) {
    parameter->set_double_param(*number);
  } else if (value.is_string()) {
    parameter->set_string_param(value.get<std::string>());
  } else {
    return FieldError(field, "a bool, number or string", value);
  }
  return absl::OkStatus();
}

// A "parameters" object into `out`, except the names in `take`, whose
// values are returned through their pointers (HTTP-only parameters).
absl::Status ToParameters(
    const json& object, absl::string_view field, ParameterMap* out,
    std::vector<std::pair<absl::string_view, const json**>> take = {}) {
  if (object.is_null()) return absl::OkStatus();
  if (!object.is_object()) return FieldError(field, "an object", object);
  for (const auto& [name, value] : object.items()) {
    bool taken = false;
    for (auto& [taken_name, where] : take) {
      if (name == taken_name) {
        *where = &value;
        taken = true;
      }
    }
    if (taken) continue;
    ATTN_RETURN_IF_ERROR(
        ToParameter(value, absl::StrCat(field, ".", name), &(*out)[name]));
  }
  return absl::OkStatus();
}

// The member `name` of `object`, or null.
const json& Member(const json& object, const char* name) {
  static const json* const kNull = new json();
  const auto it = object.find(name);
  return it == object.end() ? *kNull : *it;
}

// Appends the leaves of a (possibly nested) array, row-major.
void Flatten(const json& data, std::vector<const json*>* out) {
  if (!data.is_array()) {
    out->push_back(&data);
    return;
  }
  for (const json& item : data) Flatten(item, out);
}

// Appends element `index` of input `field` (named in errors only, as
// "field: data[index]") in `dtype` to `bytes`.
absl::Status AppendValue(const json& value, DType dtype,
                         absl::string_view input, size_t index,
                         std::string* bytes) {
  const auto field = [&] { return absl::StrCat(input, ": data[", index, "]"); };
  const auto append = [bytes](const auto& element) {
    bytes->append(reinterpret_cast<const char*>(&element), sizeof(element));
  };
  if (dtype == DType::kBool) {
    if (!value.is_boolean()) return FieldError(field(), "true or false", value);
    bytes->push_back(value.get<bool>() ? 1 : 0);
  } else if (dtype == DType::kUInt8) {
    if (!value.is_number_unsigned() || value.get<uint64_t>() > 255) {
      return absl::InvalidArgumentError(absl::StrCat(
          field(), ": expected an integer 0..255, got ", value.dump()));
    }
    bytes->push_back(static_cast<char>(value.get<uint64_t>()));
  } else {
    const std::optional<double> non_finite = NonFinite(value);
    if (!value.is_number() && !non_finite.has_value()) {
      return FieldError(field(), "a number", value);
    }
    const double wide =
        non_finite.value_or(value.is_number() ? value.get<double>() : 0.0);
    if (!non_finite.has_value() &&
        std::abs(wide) > std::numeric_limits<float>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field(), ": ", value.dump(), " is beyond float32's range"));
    }
    const float number = static_cast<float>(wide);
    if (dtype == DType::kFloat32) {
      append(number);
    } else if (dtype == DType::kBFloat16) {
      append(FloatToBFloat16(number));
    } else {
      append(FloatToFloat16(number));
    }
  }
  return absl::OkStatus();
}

// One input's JSON "data" as raw bytes, checked against its shape.
absl::Status DataToRaw(const json& data,
                       const ModelInferRequest::InferInputTensor& input,
                       absl::string_view field, std::string* raw) {
  int64_t expected = 1;
  for (int64_t dim : input.shape()) {
    if (dim < 0 || (dim > 0 && expected > (int64_t{1} << 40) / dim)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": shape [", absl::StrJoin(input.shape(), ", "),
                       "] is not a valid tensor shape"));
    }
    expected *= dim;
  }
  std::vector<const json*> values;
  Flatten(data, &values);
  if (static_cast<int64_t>(values.size()) != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", values.size(), " values, shape [",
                     absl::StrJoin(input.shape(), ", "), "] needs ", expected));
  }
  // Translation refuses other datatypes by name.
  const std::optional<DType> dtype =
      FindDType(&DTypeInfo::protocol, input.datatype());
  if (!dtype.has_value()) return absl::OkStatus();
  raw->reserve(values.size() * DTypeSize(*dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    ATTN_RETURN_IF_ERROR(AppendValue(*values[i], *dtype, field, i, raw));
  }
  return absl::OkStatus();
}

// Reads one element of the "inputs" array into `request`.
absl::Status InputFromJson(const json& item, size_t index,
                           absl::string_view* binary,
                           ModelInferRequest* request) {
  std::string field = absl::StrCat("inputs[", index, "]");
  if (!item.is_object()) return FieldError(field, "an object", item);
  ModelInferRequest::InferInputTensor* input = request->add_inputs();
  const json& name = Member(item, "name");
  const json& datatype = Member(item, "datatype");
  const json& shape = Member(item, "shape");
  if (!name.is_string()) return FieldError(field + ".name", "a string", name);
  input->set_name(name.get<std::string>());
  // At most 128 bytes of the name, as status messages echo client strings.
  const absl::string_view shown =
      absl::string_view(input->name()).substr(0, 128);
  field =
      absl::StrCat(field, " (", shown,
                   shown.size() < input->name().size()
                       ? absl::StrCat("... (", input->name().size(), " bytes)")
                       : "",
                   ")");
  if (!datatype.is_string()) {
    return FieldError(field + ".datatype", "a string", datatype);
  }
  input->set_datatype(datatype.get<std::string>());
  if (!shape.is_array()) return FieldError(field + ".shape", "an array", shape);
  for (const json& dim : shape) {
    if (!dim.is_number_integer()) {
      return FieldError(field + ".shape", "integers", dim);
    }
    input->add_shape(dim.get<int64_t>());
  }
  const json* binary_size = nullptr;
  ATTN_RETURN_IF_ERROR(ToParameters(
      Member(item, "parameters"), field + ".parameters",
      input->mutable_parameters(), {{"binary_data_size", &binary_size}}));
  if (input->parameters().contains("shared_memory_region")) {
    return absl::OkStatus();  // no data: translation reads the region
  }
  std::string* raw = request->add_raw_input_contents();
  if (binary_size != nullptr) {
    if (!binary_size->is_number_unsigned() ||
        binary_size->get<uint64_t>() > binary->size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": binary_data_size ", binary_size->dump(), " exceeds the ",
          binary->size(), " binary bytes left in the body"));
    }
    const size_t size = binary_size->get<size_t>();
    raw->assign(binary->data(), size);
    binary->remove_prefix(size);
    return absl::OkStatus();
  }
  const json& data = Member(item, "data");
  if (data.is_null())
    return absl::InvalidArgumentError(field + ": missing data");
  return DataToRaw(data, *input, field, raw);
}

absl::Status OutputsFromJson(const json& outputs, ModelInferRequest* request,
                             JsonOutputOptions* options) {
  if (outputs.is_null()) return absl::OkStatus();
  if (!outputs.is_array()) return FieldError("outputs", "an array", outputs);
  for (size_t i = 0; i < outputs.size(); ++i) {
    const json& item = outputs[i];
    const std::string field = absl::StrCat("outputs[", i, "]");
    if (!item.is_object()) return FieldError(field, "an object", item);
    const json& name = Member(item, "name");
    if (!name.is_string()) return FieldError(field + ".name", "a string", name);
    auto* output = request->add_outputs();
    output->set_name(name.get<std::string>());
    const json* binary = nullptr;
    ATTN_RETURN_IF_ERROR(
        ToParameters(Member(item, "parameters"), field + ".parameters",
                     output->mutable_parameters(), {{"binary_data", &binary}}));
    if (binary != nullptr && binary->is_boolean()) {
      options->binary[output->name()] = binary->get<bool>();
    }
  }
  return absl::OkStatus();
}

// One output's raw bytes as JSON values; `datatype` is one the server
// wrote.
json RawToData(const std::string& datatype, const std::string& raw) {
  json data = json::array();
  const auto read = [&raw](size_t i, auto element) {
    std::memcpy(&element, raw.data() + i * sizeof(element), sizeof(element));
    return element;
  };
  const auto number = [](float value) {
    return std::isfinite(value) ? json(value) : json(nullptr);
  };
  switch (FindDType(&DTypeInfo::protocol, datatype).value_or(DType::kUInt8)) {
    case DType::kFloat32:
      for (size_t i = 0; i < raw.size() / 4; ++i) {
        data.push_back(number(read(i, float{})));
      }
      break;
    case DType::kBFloat16:
      for (size_t i = 0; i < raw.size() / 2; ++i) {
        data.push_back(number(BFloat16ToFloat(read(i, uint16_t{}))));
      }
      break;
    case DType::kFloat16:
      for (size_t i = 0; i < raw.size() / 2; ++i) {
        data.push_back(number(Float16ToFloat(read(i, uint16_t{}))));
      }
      break;
    case DType::kBool:
      for (char c : raw) data.push_back(c != 0);
      break;
    case DType::kUInt8:
      for (char c : raw) data.push_back(static_cast<uint8_t>(c));
      break;
    case DType::kInt8:
      for (char c : raw) data.push_back(static_cast<int8_t>(c));
      break;
  }
  return data;
}

json ParameterToJson(const InferParameter& parameter) {
  switch (parameter.parameter_choice_case()) {
    case InferParameter::kBoolParam:
      return parameter.bool_param();
    case InferParameter::kInt64Param:
      return parameter.int64_param();
    case InferParameter::kStringParam:
      return parameter.string_param();
    case InferParameter::kDoubleParam:
      return parameter.double_param();
    case InferParameter::kUint64Param:
      return parameter.uint64_param();
    default:
      return nullptr;
  }
}

json TensorMetadataToJson(
    const google::protobuf::RepeatedPtrField<
        inference::ModelMetadataResponse::TensorMetadata>& tensors) {
  json list = json::array();
  for (const auto& tensor : tensors) {
    json item = {{"name", tensor.name()},
                 {"datatype", tensor.datatype()},
                 {"shape", std::vector<int64_t>(tensor.shape().begin(),
                                                tensor.shape().end())}};
    if (!tensor.parameters().empty()) {
      json parameters = json::object();
      for (const auto& [name, parameter] : tensor.parameters()) {
        parameters[name] = ParameterToJson(parameter);
      }
      item["parameters"] = std::move(parameters);
    }
    list.push_back(std::move(item));
  }
  return list;
}

// JSON text; bytes that are not UTF-8 (none expected) become U+FFFD
// rather than an exception.
std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace

absl::Status InferRequestFromJson(absl::string_view body,
                                  std::optional<size_t> json_length,
                                  ModelInferRequest* request,
                                  JsonOutputOptions* output_options) {
  if (json_length.has_value() && *json_length > body.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Inference-Header-Content-Length: ", *json_length,
                     " exceeds the body's ", body.size(), " bytes"));
  }
  absl::string_view binary;
  if (json_length.has_value()) {
    binary = body.substr(*json_length);
    body = body.substr(0, *json_length);
  }
  ATTN_ASSIGN_OR_RETURN(json parsed, ParseJson(body));
  const json& id = Member(parsed, "id");
  if (id.is_string()) {
    request->set_id(id.get<std::string>());
  } else if (!id.is_null()) {
    return FieldError("id", "a string", id);
  }
  const json* binary_output = nullptr;
  ATTN_RETURN_IF_ERROR(ToParameters(Member(parsed, "parameters"), "parameters",
                                    request->mutable_parameters(),
                                    {{"binary_data_output", &binary_output}}));
  output_options->all_binary = binary_output != nullptr &&
                               binary_output->is_boolean() &&
                               binary_output->get<bool>();
  const json& inputs = Member(parsed, "inputs");
  if (!inputs.is_array()) return FieldError("inputs", "an array", inputs);
  for (size_t i = 0; i < inputs.size(); ++i) {
    ATTN_RETURN_IF_ERROR(InputFromJson(inputs[i], i, &binary, request));
  }
  if (!binary.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("body: ", binary.size(),
                     " binary bytes left over after the inputs' "
                     "binary_data_size"));
  }
  return OutputsFromJson(Member(parsed, "outputs"), request, output_options);
}

HttpBody InferResponseToJson(inference::ModelInferResponse* response,
                             const JsonOutputOptions& output_options) {
  json body = {{"model_name", response->model_name()},
               {"model_version", response->model_version()}};
  if (!response->id().empty()) body["id"] = response->id();
  if (!response->parameters().empty()) {
    json parameters = json::object();
    for (const auto& [name, value] : response->parameters()) {
      parameters[name] = ParameterToJson(value);
    }
    body["parameters"] = std::move(parameters);
  }
  json outputs = json::array();
  std::string binary;
  bool any_binary = false;
  for (int i = 0; i < response->outputs_size(); ++i) {
    const auto& output = response->outputs(i);
    json item = {{"name", output.name()},
                 {"datatype", output.datatype()},
                 {"shape", std::vector<int64_t>(output.shape().begin(),
                                                output.shape().end())}};
    // An output written to shared memory is its name, datatype and shape
    // alone, as Triton writes it: Triton's C++ client reads an output's
    // "parameters" as the binary extension's and needs binary_data_size
    // there.
    json parameters = json::object();
    const std::string* raw = i < response->raw_output_contents_size()
                                 ? response->mutable_raw_output_contents(i)
                                 : nullptr;
    if (output.parameters().contains("shared_memory_region") ||
        raw == nullptr) {
      // The result is in shared memory: no data.
    } else if (const auto chosen = output_options.binary.find(output.name());
               chosen != output_options.binary.end()
                   ? chosen->second
                   : output_options.all_binary) {
      parameters["binary_data_size"] = raw->size();
      binary += *raw;
      any_binary = true;
    } else {
      item["data"] = RawToData(output.datatype(), *raw);
    }
    if (!parameters.empty()) item["parameters"] = std::move(parameters);
    outputs.push_back(std::move(item));
  }
  body["outputs"] = std::move(outputs);
  HttpBody out{Dump(body), std::nullopt};
  if (any_binary) {
    out.json_length = out.body.size();
    out.body += binary;
  }
  return out;
}

std::string ModelMetadataToJson(
    const inference::ModelMetadataResponse& metadata) {
  return Dump(
      {{"name", metadata.name()},
       {"versions", std::vector<std::string>(metadata.versions().begin(),
                                             metadata.versions().end())},
       {"platform", metadata.platform()},
       {"inputs", TensorMetadataToJson(metadata.inputs())},
       {"outputs", TensorMetadataToJson(metadata.outputs())}});
}

std::string ServerMetadataToJson(
    const inference::ServerMetadataResponse& metadata) {
  return Dump(
      {{"name", metadata.name()},
       {"version", metadata.version()},
       {"extensions", std::vector<std::string>(metadata.extensions().begin(),
                                               metadata.extensions().end())}});
}

std::string ModelReadyToJson(absl::string_view name, bool ready) {
  return Dump({{"name", std::string(name)}, {"ready", ready}});
}

std::string ErrorJson(absl::string_view message) {
  return Dump({{"error", std::string(message)}});
}

absl::Status VerifyJsonDepth(absl::string_view text) {
  return VerifyDepth(text);
}

}  // namespace attnserve
