#include "server/model_repository.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/attention_weights.h"
#include "core/files.h"
#include "core/safetensors.h"
#include "core/status_macros.h"
#include "core/verify.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"

namespace attnserve {
namespace {

namespace fs = std::filesystem;

// Collects the first text-format parse error with its position.
class FirstError : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (error_.empty()) {
      error_ = absl::StrCat("line ", line + 1, " column ", column + 1, ": ",
                            message);
    }
  }
  const std::string& error() const { return error_; }

 private:
  std::string error_;
};

absl::StatusOr<v1::ModelConfig> ParseConfig(absl::string_view text,
                                            const std::string& path) {
  v1::ModelConfig config;
  google::protobuf::TextFormat::Parser parser;
  FirstError errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(std::string(text), &config)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", errors.error()));
  }
  if (config.num_heads() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": num_heads must be > 0, got ", config.num_heads()));
  }
  if (config.compute_dtype() != v1::DATA_TYPE_UNSPECIFIED &&
      config.compute_dtype() != v1::DATA_TYPE_FLOAT32 &&
      config.compute_dtype() != v1::DATA_TYPE_BFLOAT16) {
    return absl::InvalidArgumentError(absl::StrCat(
        path,
        ": compute_dtype must be DATA_TYPE_FLOAT32 or DATA_TYPE_BFLOAT16"));
  }
  if (config.cache_dtype() != v1::DATA_TYPE_UNSPECIFIED &&
      config.cache_dtype() != v1::DATA_TYPE_INT8 &&
      config.cache_dtype() != (config.compute_dtype() == v1::DATA_TYPE_BFLOAT16
                                   ? v1::DATA_TYPE_BFLOAT16
                                   : v1::DATA_TYPE_FLOAT32)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": cache_dtype must be the compute dtype or DATA_TYPE_INT8, got ",
        v1::DataType_Name(config.cache_dtype())));
  }
  if (config.num_kv_heads() < 0 ||
      (config.num_kv_heads() > 0 &&
       config.num_heads() % config.num_kv_heads() != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": num_kv_heads ", config.num_kv_heads(),
                     " does not divide num_heads ", config.num_heads()));
  }
  if (config.rotary_dims() < 0 || config.rotary_dims() % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": rotary_dims must be even and >= 0, got ",
                     config.rotary_dims()));
  }
  if (config.has_rotary_base() &&
      !(std::isfinite(config.rotary_base()) && config.rotary_base() > 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": rotary_base must be finite and > 1, got ",
                     config.rotary_base()));
  }
  if (config.has_default_scale() && !std::isfinite(config.default_scale())) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": default_scale must be finite"));
  }
  return config;
}

// The names a weight file may use, e.g. "..., out_proj_weight
// (out_proj.weight), ...", for the message that refuses any other.
std::string AcceptedNames() {
  std::string names;
  for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
    absl::StrAppend(&names, names.empty() ? "" : ", ", field.name);
    if (!field.state_dict_alias.empty()) {
      absl::StrAppend(&names, " (", field.state_dict_alias, ")");
    }
  }
  return names;
}

absl::StatusOr<MultiHeadWeights> WeightsFrom(const SafetensorsFile& file,
                                             int num_heads,
                                             const std::string& path) {
  MultiHeadWeights w;
  w.num_heads = num_heads;
  for (const auto& [name, tensor] : file.tensors) {
    if (name == "bias_k" || name == "bias_v") {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": ", name,
          ": add_bias_kv (learned key/value bias rows) is not supported"));
    }
    const MultiHeadWeightField* field = FindMultiHeadWeightField(name);
    if (field == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": unknown tensor '",
                                                     name, "' (expected ",
                                                     AcceptedNames(), ")"));
    }
    w.*field->member = tensor.view();
  }
  return w;
}

std::string ConfigPath(const std::string& dir) {
  return (fs::path(dir) / "config.pbtxt").string();
}

std::string WeightsPath(const std::string& dir) {
  return (fs::path(dir) / "weights.safetensors").string();
}

// How the files of the model folder `dir` are read: each at most
// `max_model_mb` MiB, resolving inside the repository that holds `dir` (its
// parent), as `dir` itself must: a symlink can then share a folder or file
// between models, but not serve anything from outside the repository.
absl::StatusOr<RegularFileLimits> ModelFileLimits(const std::string& dir,
                                                  int64_t max_model_mb) {
  RegularFileLimits limits;
  limits.max_bytes = static_cast<uint64_t>(max_model_mb) << 20;
  limits.limit_name = absl::StrCat("--max_model_mb=", max_model_mb);
  const fs::path repository = fs::path(dir).parent_path();
  ATTN_ASSIGN_OR_RETURN(
      limits.within,
      CanonicalPath(repository.empty() ? "." : repository.string()));
  ATTN_ASSIGN_OR_RETURN(const std::string folder, CanonicalPath(dir));
  ATTN_RETURN_IF_ERROR(VerifyResolvesWithin(dir, folder, limits.within));
  return limits;
}

// The names of the folders in `root` (symlinks to folders included),
// sorted. std::filesystem's error codes throughout: an exception here would
// end a SIGHUP reload, or answer RepositoryModelLoad UNIMPLEMENTED with no
// message. An entry that cannot be examined (a symlink loop) is no folder.
absl::StatusOr<std::vector<std::string>> ListFolders(const std::string& root) {
  std::vector<std::string> names;
  std::error_code error;
  fs::directory_iterator it(root, error);
  for (; !error && it != fs::directory_iterator(); it.increment(error)) {
    std::error_code entry_error;
    if (it->is_directory(entry_error)) {
      names.push_back(it->path().filename().string());
    }
  }
  if (error) {
    return absl::FailedPreconditionError(absl::StrCat(
        root, ": cannot list the model repository: ", error.message()));
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

absl::Status VerifyModelName(absl::string_view name, absl::string_view field) {
  if (name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": empty, expected the name of a loaded model (ListModels)"));
  }
  if (name.size() > kMaxModelNameBytes) {
    // Not echoed: the status must stay small enough to reach the client.
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", name.size(), " bytes, longer than the ",
                     kMaxModelNameBytes, " a model name may have"));
  }
  const std::string quoted = EchoString(name);
  if (name.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", quoted, " contains a NUL byte"));
  }
  if (name.find('/') != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", quoted,
                     " contains '/'; a model name is the name of a folder in "
                     "the model repository"));
  }
  if (name == "." || name == "..") {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", quoted,
                     " is not the name of a folder in the model repository"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Model>> LoadModel(const std::string& dir,
                                                       int64_t max_model_mb) {
  ATTN_ASSIGN_OR_RETURN(const RegularFileLimits limits,
                        ModelFileLimits(dir, max_model_mb));
  ATTN_ASSIGN_OR_RETURN(const std::string config_text,
                        ReadRegularFile(ConfigPath(dir), limits));
  ATTN_ASSIGN_OR_RETURN(const std::string weights_bytes,
                        ReadRegularFile(WeightsPath(dir), limits));
  return ParseModel(dir, config_text, weights_bytes);
}

absl::StatusOr<std::shared_ptr<const Model>> ParseModel(
    const std::string& dir, absl::string_view config_text,
    absl::string_view weights_bytes) {
  auto model = std::make_shared<Model>();
  model->name = fs::path(dir).filename().string();
  const std::string config_path = ConfigPath(dir);
  const std::string weights_path = WeightsPath(dir);
  ATTN_ASSIGN_OR_RETURN(model->config, ParseConfig(config_text, config_path));
  ATTN_ASSIGN_OR_RETURN(SafetensorsFile file,
                        ParseSafetensors(weights_bytes, weights_path));
  ATTN_ASSIGN_OR_RETURN(
      MultiHeadWeights weights,
      WeightsFrom(file, model->config.num_heads(), weights_path));
  weights.num_kv_heads = model->config.num_kv_heads();
  MultiHeadLayer::Options options;
  options.compute_dtype =
      model->config.compute_dtype() == v1::DATA_TYPE_BFLOAT16 ? DType::kBFloat16
                                                              : DType::kFloat32;
  options.pack = true;  // copies and packs: `file` may go
  options.rotary.dims = model->config.rotary_dims();
  if (model->config.has_rotary_base()) {
    options.rotary.base = model->config.rotary_base();
  }
  auto layer = MultiHeadLayer::Create(weights, options);
  if (!layer.ok()) {
    return absl::Status(
        layer.status().code(),
        absl::StrCat(weights_path, ": ", layer.status().message()));
  }
  model->layer = *std::move(layer);
  return model;
}

ModelRepository::ModelRepository(std::string root, int64_t max_model_mb)
    : root_(std::move(root)),
      max_model_mb_(max_model_mb),
      models_(std::make_shared<const ModelMap>()) {}

absl::Status ModelRepository::Reload() {
  MutexLock reload_lock(&reload_mu_);
  auto loaded = std::make_shared<ModelMap>();
  if (!root_.empty()) {
    std::error_code error;
    if (!fs::is_directory(root_, error)) {
      return absl::NotFoundError(
          absl::StrCat(root_, ": model repository is not a directory"));
    }
    ATTN_ASSIGN_OR_RETURN(const std::vector<std::string> names,
                          ListFolders(root_));
    for (const std::string& name : names) {
      ATTN_ASSIGN_OR_RETURN(
          std::shared_ptr<const Model> model,
          LoadModel((fs::path(root_) / name).string(), max_model_mb_));
      (*loaded)[model->name] = std::move(model);
    }
  }
  MutexLock lock(&mu_);
  models_ = std::move(loaded);
  return absl::OkStatus();
}

absl::Status ModelRepository::LoadOne(absl::string_view name) {
  ATTN_RETURN_IF_ERROR(VerifyModelName(name, "model_name"));
  if (root_.empty()) {
    return absl::FailedPreconditionError(
        "model_name: this server has no --model_repository to load from");
  }
  const std::string dir = (fs::path(root_) / std::string(name)).string();
  std::error_code error;
  if (!fs::is_directory(dir, error)) {
    return absl::NotFoundError(absl::StrCat("model_name: ", EchoString(name),
                                            " is not a folder of the model "
                                            "repository ",
                                            root_));
  }
  MutexLock reload_lock(&reload_mu_);
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                        LoadModel(dir, max_model_mb_));
  auto updated = std::make_shared<ModelMap>(*Snapshot());
  (*updated)[model->name] = std::move(model);
  MutexLock lock(&mu_);
  models_ = std::move(updated);
  return absl::OkStatus();
}

absl::Status ModelRepository::Unload(absl::string_view name) {
  ATTN_RETURN_IF_ERROR(VerifyModelName(name, "model_name"));
  MutexLock reload_lock(&reload_mu_);
  auto updated = std::make_shared<ModelMap>(*Snapshot());
  if (updated->erase(std::string(name)) == 0) {
    return absl::NotFoundError(
        absl::StrCat("model_name: ", EchoString(name), " is not loaded"));
  }
  MutexLock lock(&mu_);
  models_ = std::move(updated);
  return absl::OkStatus();
}

std::vector<std::string> ModelRepository::Folders() const {
  if (root_.empty()) return {};
  absl::StatusOr<std::vector<std::string>> names = ListFolders(root_);
  if (!names.ok()) return {};
  return *std::move(names);
}

std::shared_ptr<const ModelRepository::ModelMap> ModelRepository::Snapshot()
    const {
  MutexLock lock(&mu_);
  return models_;
}

absl::StatusOr<std::shared_ptr<const Model>> ModelRepository::Find(
    absl::string_view name) const {
  const std::shared_ptr<const ModelMap> models = Snapshot();
  auto it = models->find(std::string(name));
  if (it != models->end()) return it->second;
  std::vector<std::string> names;
  for (const auto& [model_name, model] : *models) names.push_back(model_name);
  return absl::NotFoundError(
      absl::StrCat("model: ", EchoString(name), " not found; loaded models: ",
                   names.empty() ? "none" : absl::StrJoin(names, ", ")));
}

std::vector<std::shared_ptr<const Model>> ModelRepository::List() const {
  const std::shared_ptr<const ModelMap> models = Snapshot();
  std::vector<std::shared_ptr<const Model>> list;
  for (const auto& [name, model] : *models) list.push_back(model);
  return list;
}

}  // namespace attnserve
