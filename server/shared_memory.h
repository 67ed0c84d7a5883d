// System shared memory for clients on the same host: a client registers a
// window of a POSIX shared-memory object (shm_open key "/NAME", the file
// /dev/shm/NAME) under a name, then sends tensors as (region, offset,
// byte_size) references and names regions for results, so that tensor bytes
// never cross the socket.
//
// A region is mapped read-write once, at registration. Calls hold it through
// a shared_ptr: unregistering removes the name at once, and the mapping goes
// when the last call using it finishes. A client that shrinks the object
// while a call reads it would fault the server (SIGBUS); a process-wide fault
// guard maps zero pages over what was cut off instead, marks the region, and
// the call then fails with FAILED_PRECONDITION rather than answer from
// zeros.
//
// Thread-safety: SharedMemoryRegistry is safe for concurrent use; a
// SharedMemoryRegion is immutable but for its fault mark (atomic).
#ifndef ATTNSERVE_SERVER_SHARED_MEMORY_H_
#define ATTNSERVE_SERVER_SHARED_MEMORY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/mutex.h"
#include "proto/tensor_codec.h"

namespace attnserve {

// What a client registered.
struct SharedMemoryRegionInfo {
  std::string name;
  // Normalized shm_open key, with its leading '/'.
  std::string key;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
};

class SharedMemoryRegion {
 public:
  // Opens `info.key` read-write and maps its window; errors name the request
  // field at fault (key, offset, byte_size).
  static absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> Map(
      SharedMemoryRegionInfo info);
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const SharedMemoryRegionInfo& info() const { return info_; }

  // The bytes [offset, offset + size) of the region's window. INVALID_ARGUMENT
  // naming `field` when they do not lie inside it or when `offset` is not a
  // multiple of `alignment`.
  absl::StatusOr<char*> Slice(uint64_t offset, uint64_t size,
                              uint64_t alignment,
                              absl::string_view field) const;

  // FAILED_PRECONDITION naming the region when its object is now smaller
  // than the window, or was while it was read (the fault guard's mark).
  absl::Status VerifyIntact() const;

 private:
  SharedMemoryRegion(SharedMemoryRegionInfo info, int fd, char* map_base,
                     size_t map_length, int guard_slot);

  const SharedMemoryRegionInfo info_;
  const int fd_;
  char* const map_base_;  // page-aligned start of the mapping
  const size_t map_length_;
  char* const window_;    // the registered window: map_base_ + in-page offset
  const int guard_slot_;  // index in the fault guard's table
};

class SharedMemoryRegistry {
 public:
  // `max_bytes`: the most bytes all registered regions may span together.
  explicit SharedMemoryRegistry(uint64_t max_bytes);
  SharedMemoryRegistry(const SharedMemoryRegistry&) = delete;
  SharedMemoryRegistry& operator=(const SharedMemoryRegistry&) = delete;

  // INVALID_ARGUMENT for a bad name, key, offset or size; ALREADY_EXISTS for
  // a name in use; NOT_FOUND / PERMISSION_DENIED when the object cannot be
  // opened; RESOURCE_EXHAUSTED above `max_bytes` or the region count limit.
  absl::Status Register(const SharedMemoryRegionInfo& info)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Unregisters `name`, or every region when it is empty; NOT_FOUND for an
  // unknown name, INVALID_ARGUMENT for one no region can have.
  absl::Status Unregister(absl::string_view name) ABSL_LOCKS_EXCLUDED(mu_);
  // The region registered as `name`, or NOT_FOUND naming `field`
  // (INVALID_ARGUMENT naming `field`.region for a name no region can have).
  absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> Find(
      absl::string_view name, absl::string_view field) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Every region, sorted by name; only `name` when it is not empty
  // (NOT_FOUND if unknown, INVALID_ARGUMENT if malformed).
  absl::StatusOr<std::vector<SharedMemoryRegionInfo>> List(
      absl::string_view name) const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t registered_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t max_bytes() const { return max_bytes_; }

 private:
  // ALREADY_EXISTS or RESOURCE_EXHAUSTED when `info` cannot be added now.
  absl::Status VerifyRoomFor(const SharedMemoryRegionInfo& info) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t max_bytes_;
  mutable Mutex mu_;
  std::map<std::string, std::shared_ptr<const SharedMemoryRegion>, std::less<>>
      regions_ ABSL_GUARDED_BY(mu_);
  uint64_t registered_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// The regions one call uses: resolves its references and keeps those regions
// mapped until the call ends. Thread-compatible: one call, one object.
class CallSharedMemory : public SharedMemoryResolver {
 public:
  // `registry` null: the server offers no shared memory.
  explicit CallSharedMemory(const SharedMemoryRegistry* registry)
      : registry_(registry) {}

  absl::StatusOr<char*> Resolve(const v1::SharedMemoryRef& ref,
                                uint64_t byte_size, uint64_t alignment,
                                absl::string_view field) override;
  // After computing: FAILED_PRECONDITION if a region used shrank meanwhile.
  absl::Status VerifyIntact() const;

 private:
  const SharedMemoryRegistry* registry_;
  std::vector<std::shared_ptr<const SharedMemoryRegion>> held_;
};

// The most regions registered at once in one process (all registries).
inline constexpr int kMaxSharedMemoryRegions = 1024;

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SHARED_MEMORY_H_
