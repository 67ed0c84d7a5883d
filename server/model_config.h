// Triton's model configuration extension: a model's inference.ModelConfig,
// built from what the server knows of it (its protocol metadata and, for a
// served model, its layer), never from a file: name, platform, backend
// "attnserve", max_batch_size 0 (no implicit batch dimension: where a model
// has a batch, it is the first of the listed dims), inputs and outputs
// with their data types and dims (-1: any size), the inputs a request may
// leave out (optional), and parameters that say what the model computes.
// Models that take sequences (server/sequences.h) configure
// sequence_batching when decode sessions are on: the idle timeout
// (--session_idle_timeout_s) and, as control inputs, the request parameters
// that carry the start, end and id of a sequence. attnserve batches nothing
// dynamically.
//
// Thread-safety: free functions; `models` is thread-safe.
#ifndef ATTNSERVE_SERVER_MODEL_CONFIG_H_
#define ATTNSERVE_SERVER_MODEL_CONFIG_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "inference/grpc_service.pb.h"
#include "server/sequences.h"

namespace attnserve {

// NOT_FOUND for models not served and versions other than "" and "1";
// INVALID_ARGUMENT for a name no model can have.
// `sequences` (not null) gives the repository and the session store.
absl::Status HandleModelConfig(const inference::ModelConfigRequest& request,
                               const SequenceTable* sequences,
                               inference::ModelConfigResponse* response);

// TYPE_FP32 for "FP32" and so on; INVALID_ARGUMENT for names Triton's
// DataType does not have.
absl::StatusOr<inference::DataType> ConfigDataType(absl::string_view datatype);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_MODEL_CONFIG_H_
