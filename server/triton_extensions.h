// Triton's protocol extensions beyond inference, for both front ends (the
// gRPC service in server/open_inference_service.h and the HTTP endpoints
// in server/http_inference.h): handlers without gRPC or HTTP machinery, as
// server/handlers.h, and the JSON form of their messages.
//
//  - Model repository: the index lists the built-in models (always READY)
//    and every folder of --model_repository, READY when served, else
//    UNAVAILABLE; load (re)loads one folder's model as SIGHUP reloads all;
//    unload stops serving one (calls in flight finish on it). A SIGHUP
//    reload serves every folder again, unloaded ones included.
//  - System shared memory: register, unregister and status on the server's
//    one registry (server/shared_memory.h), with the checks and limits of
//    attnserve's own RegisterSharedMemory; regions registered either way
//    are visible and usable both ways.
//  - CUDA shared memory: UNIMPLEMENTED (attnserve computes on CPU).
//
// Thread-safety: free functions; the repository and registry are
// thread-safe.
#ifndef ATTNSERVE_SERVER_TRITON_EXTENSIONS_H_
#define ATTNSERVE_SERVER_TRITON_EXTENSIONS_H_

#include <string>

#include "absl/status/status.h"
#include "google/protobuf/message.h"
#include "inference/grpc_service.pb.h"
#include "nlohmann/json.hpp"
#include "server/model_repository.h"
#include "server/shared_memory.h"

namespace attnserve {

// `models` null: a server without --model_repository (built-ins only; load
// and unload answer FAILED_PRECONDITION).
absl::Status HandleRepositoryIndex(
    const inference::RepositoryIndexRequest& request,
    const ModelRepository* models,
    inference::RepositoryIndexResponse* response);
absl::Status HandleRepositoryModelLoad(
    const inference::RepositoryModelLoadRequest& request,
    ModelRepository* models);
absl::Status HandleRepositoryModelUnload(
    const inference::RepositoryModelUnloadRequest& request,
    ModelRepository* models);

// `registry` null: shared memory is off (FAILED_PRECONDITION).
absl::Status HandleSystemSharedMemoryRegister(
    const inference::SystemSharedMemoryRegisterRequest& request,
    SharedMemoryRegistry* registry);
// Unregistering a region that is not registered succeeds (as in Triton;
// the native UnregisterSharedMemory answers NOT_FOUND).
absl::Status HandleSystemSharedMemoryUnregister(
    const inference::SystemSharedMemoryUnregisterRequest& request,
    SharedMemoryRegistry* registry);
absl::Status HandleSystemSharedMemoryStatus(
    const inference::SystemSharedMemoryStatusRequest& request,
    const SharedMemoryRegistry* registry,
    inference::SystemSharedMemoryStatusResponse* response);

// CUDA shared memory, as a Triton without GPUs answers it: no region is
// ever registered, so the status lists none (NOT_FOUND for a named one),
// unregistering succeeds, and registering is UNIMPLEMENTED saying to use
// system shared memory.
absl::Status HandleCudaSharedMemoryStatus(absl::string_view name);
absl::Status HandleCudaSharedMemoryRegister();

// A message as Triton's HTTP endpoints write it: field names as in the
// .proto, enums by name, 64-bit integers as JSON numbers, every field but
// unset oneof members (so counters at zero are present).
nlohmann::json MessageToJson(const google::protobuf::Message& message);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRITON_EXTENSIONS_H_
