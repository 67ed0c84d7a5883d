#include "core/safetensors.h"

#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/files.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace attnserve {
namespace {

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

absl::StatusOr<Tensor> ParseEntry(const std::string& name,
                                  const nlohmann::json& entry,
                                  absl::string_view data,
                                  absl::string_view source) {
  const auto fail = [&](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": tensor '", name, "': ", what));
  };
  if (!entry.is_object() || !entry.contains("dtype") ||
      !entry.contains("shape") || !entry.contains("data_offsets")) {
    return fail("expected an object with dtype, shape and data_offsets");
  }
  const nlohmann::json& dtype_json = entry["dtype"];
  if (!dtype_json.is_string()) return fail("dtype is not a string");
  const std::string dtype_name = dtype_json.get<std::string>();
  const std::optional<DType> dtype =
      FindDType(&DTypeInfo::safetensors, dtype_name);
  if (!dtype.has_value()) {
    return fail(absl::StrCat("dtype ", dtype_name, " not supported (",
                             DTypeNameList(&DTypeInfo::safetensors), ")"));
  }
  Shape shape;
  if (!entry["shape"].is_array()) return fail("shape is not an array");
  for (const nlohmann::json& d : entry["shape"]) {
    if (!d.is_number_integer()) return fail("shape holds a non-integer");
    shape.push_back(d.get<int64_t>());
  }
  const nlohmann::json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 ||
      !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
    return fail("data_offsets is not two non-negative integers");
  }
  const uint64_t begin = offsets[0].get<uint64_t>();
  const uint64_t end = offsets[1].get<uint64_t>();
  if (begin > end || end > data.size()) {
    return fail(absl::StrCat("data_offsets [", begin, ", ", end,
                             "] outside the data section of ", data.size(),
                             " bytes"));
  }
  auto count = CheckedNumElements(shape, *dtype, name);
  if (!count.ok()) return fail(count.status().message());
  const uint64_t expected = static_cast<uint64_t>(*count) * DTypeSize(*dtype);
  if (end - begin != expected) {
    return fail(absl::StrCat(end - begin, " bytes, expected ", expected,
                             " for shape ", ShapeString(shape), " of ",
                             dtype_name));
  }
  ATTN_ASSIGN_OR_RETURN(Tensor tensor, Tensor::Allocate(*dtype, shape));
  if (expected > 0) std::memcpy(tensor.data(), data.data() + begin, expected);
  return tensor;
}

}  // namespace

const Tensor* SafetensorsFile::Find(absl::string_view name) const {
  auto it = tensors.find(std::string(name));
  return it == tensors.end() ? nullptr : &it->second;
}

absl::StatusOr<SafetensorsFile> ParseSafetensors(absl::string_view bytes,
                                                 absl::string_view source) {
  if (bytes.size() < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": ", bytes.size(),
                     " bytes is too short for a safetensors file"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) {
    header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  }
  if (header_len > kMaxHeaderBytes || header_len > bytes.size() - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": header length ", header_len,
                     " exceeds the file (", bytes.size(), " bytes)"));
  }
  const absl::string_view header = bytes.substr(8, header_len);
  const absl::string_view data = bytes.substr(8 + header_len);
  nlohmann::json json = nlohmann::json::parse(header, nullptr,
                                              /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": header is not a JSON object"));
  }
  SafetensorsFile file;
  for (auto it = json.begin(); it != json.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": __metadata__ is not an object"));
      }
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat(source, ": __metadata__ value of '", m.key(),
                           "' is not a string"));
        }
        file.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    ATTN_ASSIGN_OR_RETURN(Tensor tensor,
                          ParseEntry(it.key(), it.value(), data, source));
    file.tensors.emplace(it.key(), std::move(tensor));
  }
  return file;
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  ATTN_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path, path));
  return ParseSafetensors(bytes, path);
}

absl::StatusOr<std::string> SerializeSafetensors(
    const std::map<std::string, TensorView>& tensors,
    const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, view] : tensors) {
    ATTN_ASSIGN_OR_RETURN(int64_t count,
                          CheckedNumElements(view.shape, view.dtype, name));
    const uint64_t bytes = static_cast<uint64_t>(count) * DTypeSize(view.dtype);
    header[name] = {{"dtype", DTypeInfoOf(view.dtype).safetensors},
                    {"shape", view.shape},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header_text = header.dump();
  // Pad with spaces so that the data starts 8-byte aligned.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + header_text.size() + offset);
  const uint64_t header_len = header_text.size();
  for (int i = 0; i < 8; ++i) {
    out.push_back(static_cast<char>((header_len >> (8 * i)) & 0xff));
  }
  out += header_text;
  for (const auto& [name, view] : tensors) {
    out.append(static_cast<const char*>(view.data),
               view.num_elements() * DTypeSize(view.dtype));
  }
  return out;
}

absl::Status WriteSafetensors(
    const std::string& path, const std::map<std::string, TensorView>& tensors,
    const std::map<std::string, std::string>& metadata) {
  ATTN_ASSIGN_OR_RETURN(std::string bytes,
                        SerializeSafetensors(tensors, metadata));
  std::ofstream stream(path, std::ios::binary | std::ios::trunc);
  if (!stream) {
    return absl::PermissionDeniedError(
        absl::StrCat(path, ": cannot open for writing"));
  }
  stream.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  stream.close();
  if (!stream) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace attnserve
