// The client's side of attnserve's shared memory: a POSIX shared-memory
// object this process creates and maps, tensors placed in it as
// SharedMemoryRef references, and results read back from it.
//
// Ownership: a SharedMemoryBuffer owns its object and mapping; its destructor
// unmaps and removes (shm_unlink) the object. Unregister it from the server
// first. Thread-safety: SharedMemoryBuffer is thread-compatible;
// SharedMemoryPlacer serves one request at a time.
#ifndef ATTNSERVE_CLIENT_SHARED_MEMORY_H_
#define ATTNSERVE_CLIENT_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "client/requests.h"
#include "core/tensor.h"
#include "proto/tensor_codec.h"

namespace attnserve {

class SharedMemoryBuffer {
 public:
  // Creates the object `key` ("/NAME"; it must not exist yet) of `byte_size`
  // bytes and maps it read-write.
  static absl::StatusOr<std::unique_ptr<SharedMemoryBuffer>> Create(
      const std::string& key, size_t byte_size);
  ~SharedMemoryBuffer();
  SharedMemoryBuffer(const SharedMemoryBuffer&) = delete;
  SharedMemoryBuffer& operator=(const SharedMemoryBuffer&) = delete;

  const std::string& key() const { return key_; }
  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  SharedMemoryBuffer(std::string key, char* data, size_t size)
      : key_(std::move(key)), data_(data), size_(size) {}

  const std::string key_;
  char* const data_;
  const size_t size_;
};

// A unique object key for this process: "/attnserve-<pid>-<n>-<suffix>".
std::string UniqueSharedMemoryKey(const std::string& suffix);

// Places tensors one after another (64-byte aligned) in a buffer registered
// with the server as region `region`, and reads results back.
class SharedMemoryPlacer : public SharedMemoryResolver {
 public:
  SharedMemoryPlacer(SharedMemoryBuffer* buffer, std::string region)
      : buffer_(buffer), region_(std::move(region)) {}

  // Copies `view` into the next free bytes and points `out` at them.
  absl::Status Place(const TensorView& view, v1::Tensor* out);
  // Reserves `byte_size` bytes for a result.
  absl::StatusOr<v1::SharedMemoryRef> Reserve(uint64_t byte_size);
  // Bytes used so far.
  uint64_t used() const { return used_; }

  // Results the server wrote into this buffer (SharedMemoryResolver).
  absl::StatusOr<char*> Resolve(const v1::SharedMemoryRef& ref,
                                uint64_t byte_size, uint64_t alignment,
                                absl::string_view field) override;

 private:
  SharedMemoryBuffer* buffer_;
  std::string region_;
  uint64_t used_ = 0;
};

// What a request needs in shared memory: its tensors' bytes and room for
// its results (4 bytes an element, enough for every result dtype), each
// 64-byte aligned.
struct SharedMemoryPlan {
  uint64_t output_bytes = 0;
  uint64_t weights_bytes = 0;  // 0: no weights requested
  uint64_t total_bytes = 0;
};

// Plans from a request built with raw_data (client/requests.h).
// INVALID_ARGUMENT for tensors too small to tell the result's shape (the
// server reports the details).
absl::StatusOr<SharedMemoryPlan> PlanSharedMemory(
    const v1::AttendRequest& request);
// `model`: the metadata of the model the request names (else null).
absl::StatusOr<SharedMemoryPlan> PlanSharedMemory(
    const v1::MultiHeadAttendRequest& request,
    const v1::GetModelMetadataResponse* model);
absl::StatusOr<SharedMemoryPlan> PlanSharedMemory(
    const v1::LayerNormRequest& request);
absl::StatusOr<SharedMemoryPlan> PlanSharedMemory(
    const v1::RmsNormRequest& request);

// The plan of any of the stateless compute requests, by its type.
absl::StatusOr<SharedMemoryPlan> PlanSharedMemory(
    const google::protobuf::Message& request,
    const v1::GetModelMetadataResponse* model);

// Moves every tensor of `request` (inline weights too) from raw_data into
// `placer` and points its result_regions at room reserved per `plan`.
absl::Status PlaceRequest(const SharedMemoryPlan& plan,
                          SharedMemoryPlacer& placer,
                          google::protobuf::Message* request);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_SHARED_MEMORY_H_
