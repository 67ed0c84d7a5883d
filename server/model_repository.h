// Models served from a model repository: DIR/NAME/config.pbtxt (a text-format
// attnserve.v1.ModelConfig) and DIR/NAME/weights.safetensors, whose tensors
// are named as AttentionWeights' fields or as a PyTorch
// nn.MultiheadAttention state_dict (in_proj_weight, in_proj_bias,
// out_proj.weight, out_proj.bias, q_proj_weight, k_proj_weight,
// v_proj_weight). Weights are validated and packed once, at load.
//
// Whoever can write into the repository must not be able to hang or exhaust
// the server through it: both files are read as regular files only (a FIFO,
// a directory or a device is refused before it is read), each at most
// --max_model_mb, and a model folder or file may be a symlink only if it
// resolves inside the repository (so that nothing outside it is served).
//
// Ownership: the repository owns the current set of models; callers hold a
// model through a shared_ptr, so a reload never pulls weights from under a
// request that started on them. Thread-safety: all methods may be called
// concurrently; Reload calls are serialized.
#ifndef ATTNSERVE_SERVER_MODEL_REPOSITORY_H_
#define ATTNSERVE_SERVER_MODEL_REPOSITORY_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "core/multi_head_attention.h"
#include "core/mutex.h"

namespace attnserve {

struct Model {
  std::string name;
  v1::ModelConfig config;
  std::shared_ptr<const MultiHeadLayer> layer;
};

// The longest model name: a model is named after its folder, and Linux file
// names have at most 255 bytes.
inline constexpr size_t kMaxModelNameBytes = 255;

// OK if `name` could name a model: 1 to 255 bytes, one folder name (no '/'
// or NUL byte, not "." or ".."). Otherwise INVALID_ARGUMENT naming `field`
// (the request field that carries the name): no repository holds such a
// model, so NOT_FOUND would tell the caller to look elsewhere.
absl::Status VerifyModelName(absl::string_view name, absl::string_view field);

// The default of --max_model_mb: the largest model file, MiB.
inline constexpr int64_t kDefaultMaxModelMb = 4096;

// Loads the model in `dir`, a folder REPOSITORY/NAME (the model is named
// NAME). Errors name the file (or the folder) and the problem: NOT_FOUND
// for a missing file; FAILED_PRECONDITION for a file that is not a regular
// file, is larger than `max_model_mb` MiB, or resolves (through symlinks)
// outside REPOSITORY, as for a folder that does; INVALID_ARGUMENT for
// contents that are not a valid model.
absl::StatusOr<std::shared_ptr<const Model>> LoadModel(
    const std::string& dir, int64_t max_model_mb = kDefaultMaxModelMb);
// LoadModel on the contents of `dir`'s two files, already in memory:
// `config_text` (config.pbtxt) and `weights_bytes` (weights.safetensors).
// `dir` names the model and, with the file names, the errors; nothing is
// read from disk.
absl::StatusOr<std::shared_ptr<const Model>> ParseModel(
    const std::string& dir, absl::string_view config_text,
    absl::string_view weights_bytes);

class ModelRepository {
 public:
  // `root` empty: no repository, no models. `max_model_mb`
  // (--max_model_mb): the largest model file loaded, MiB, at least 1.
  explicit ModelRepository(std::string root,
                           int64_t max_model_mb = kDefaultMaxModelMb);

  // Loads every model under the root and, only if all load, replaces the
  // served set with them; otherwise keeps the current set and returns the
  // first error (NOT_FOUND or FAILED_PRECONDITION when the root itself
  // cannot be listed).
  absl::Status Reload() ABSL_LOCKS_EXCLUDED(reload_mu_, mu_);

  // Loads (or reloads) the one model `name` from its folder under the root
  // and serves it, the other models unchanged; if it does not load, the
  // served set stays as it was and the error names the file at fault (as
  // LoadModel's). INVALID_ARGUMENT for a name no folder can have,
  // FAILED_PRECONDITION without a root, NOT_FOUND when the root has no such
  // folder.
  absl::Status LoadOne(absl::string_view name)
      ABSL_LOCKS_EXCLUDED(reload_mu_, mu_);
  // Stops serving `name` (calls already holding it finish on it); NOT_FOUND
  // if it is not served. Reload and LoadOne serve it again.
  absl::Status Unload(absl::string_view name)
      ABSL_LOCKS_EXCLUDED(reload_mu_, mu_);
  // The names of the model folders under the root, sorted (served or not).
  std::vector<std::string> Folders() const;
  const std::string& root() const { return root_; }

  // The model called `name`, or NOT_FOUND naming the models there are.
  absl::StatusOr<std::shared_ptr<const Model>> Find(
      absl::string_view name) const ABSL_LOCKS_EXCLUDED(mu_);
  // Every model, sorted by name.
  std::vector<std::shared_ptr<const Model>> List() const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using ModelMap = std::map<std::string, std::shared_ptr<const Model>>;
  std::shared_ptr<const ModelMap> Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);

  const std::string root_;
  const int64_t max_model_mb_;
  // One reload at a time; taken before mu_, which a reload holds only to
  // swap in the new set.
  Mutex reload_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable Mutex mu_;
  std::shared_ptr<const ModelMap> models_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_MODEL_REPOSITORY_H_
