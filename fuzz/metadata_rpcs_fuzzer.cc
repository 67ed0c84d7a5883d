// Fuzz target: a sequence of the RPCs that read or register server state
// (ListModels, GetModelMetadata, RegisterSharedMemory,
// UnregisterSharedMemory, ListSharedMemory), each a record of fuzz_support's
// Records: the tag picks the RPC (tag % 5) and, with its top bit set, a
// server without model repository and shared memory; the payload is the
// request. Each input starts from an empty registry limited to
// FuzzServerOptions' shared memory.
//
// A registered key "@0" or "@1" stands for this process's shared-memory
// object 0 or 1 (their names hold the process id), so that registrations
// can succeed; any other key is looked up as it is. Registrations map
// nothing beyond the registry's limit, and every region is unregistered
// when the input ends.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "fuzz/fuzz_support.h"
#include "server/handlers.h"

namespace attnserve::fuzz {
namespace {

enum Rpc {
  kListModels,
  kGetModelMetadata,
  kRegister,
  kUnregister,
  kList,
  kRpcs
};

template <typename Message>
bool Parse(absl::string_view payload, Message* message) {
  return message->ParseFromArray(payload.data(),
                                 static_cast<int>(payload.size()));
}

void Run(uint8_t tag, absl::string_view payload,
         SharedMemoryRegistry* registry) {
  const bool off = (tag & 0x80) != 0;
  const ModelRepository* models = off ? nullptr : &TinyModels();
  SharedMemoryRegistry* shared_memory = off ? nullptr : registry;
  switch ((tag & 0x7f) % kRpcs) {
    case kListModels: {
      v1::ListModelsResponse response;
      CheckStatus("ListModels", HandleListModels(models, &response));
      break;
    }
    case kGetModelMetadata: {
      v1::GetModelMetadataRequest request;
      v1::GetModelMetadataResponse response;
      if (!Parse(payload, &request)) return;
      CheckStatus("GetModelMetadata",
                  HandleGetModelMetadata(request, models, &response));
      break;
    }
    case kRegister: {
      v1::RegisterSharedMemoryRequest request;
      if (!Parse(payload, &request)) return;
      v1::SharedMemoryRegion* region = request.mutable_region();
      if (region->key() == "@0") region->set_key(SharedMemoryKey(0));
      if (region->key() == "@1") region->set_key(SharedMemoryKey(1));
      CheckStatus("RegisterSharedMemory",
                  HandleRegisterSharedMemory(request, shared_memory));
      break;
    }
    case kUnregister: {
      v1::UnregisterSharedMemoryRequest request;
      if (!Parse(payload, &request)) return;
      CheckStatus("UnregisterSharedMemory",
                  HandleUnregisterSharedMemory(request, shared_memory));
      break;
    }
    case kList: {
      v1::ListSharedMemoryRequest request;
      v1::ListSharedMemoryResponse response;
      if (!Parse(payload, &request)) return;
      CheckStatus("ListSharedMemory",
                  HandleListSharedMemory(request, shared_memory, &response));
      break;
    }
  }
  if (registry->registered_bytes() > registry->max_bytes()) {
    std::fprintf(stderr, "fuzz: %llu bytes registered, above the limit\n",
                 static_cast<unsigned long long>(registry->registered_bytes()));
    std::abort();
  }
}

}  // namespace
}  // namespace attnserve::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve::fuzz;  // NOLINT: one function
  attnserve::SharedMemoryRegistry registry(
      static_cast<uint64_t>(FuzzServerOptions().max_shared_memory_mb) << 20);
  Records records(data, size);
  uint8_t tag;
  absl::string_view payload;
  while (records.Next(&tag, &payload)) Run(tag, payload, &registry);
  CheckStatus("UnregisterSharedMemory(all)", registry.Unregister(""));
  return 0;
}
