// Fuzz target: a series of calls over decode sessions and shared memory,
// where one call's state is the next one's input: sessions created,
// stepped, rewound, forked, deleted, expired and evicted; regions registered,
// written to by the client, used by steps and compute calls, and
// unregistered under them. Each record of the input (fuzz_support's
// Records) is one call; the tag picks it (tag % kOps), the payload is:
//
//   kCreate      a CreateSessionRequest
//   kStep        a session index byte (0xff: the request's own id), then a
//                SessionStepRequest whose id is replaced by that session's
//   kDelete      a session index byte
//   kRegister    a RegisterSharedMemoryRequest ("@0", "@1": this process's
//                shared-memory objects)
//   kUnregister  an UnregisterSharedMemoryRequest
//   kCompute     a byte picking Attend, MultiHeadAttend or LayerNorm (% 3),
//                then its request
//   kExpire      a byte: minutes from now at which idle sessions expire
//   kWrite       a 16-bit little-endian offset into object 0, then the bytes
//                the client writes there
//   kSteps       a count byte c (% 9), c session index bytes, then a
//                SessionStepsRequest whose first c steps' ids are replaced
//                by those sessions' (its steps counted on its bytes first,
//                as the server counts them)
//   kFork        a session index byte (0xff: the request's own id), then a
//                ForkSessionRequest whose id is replaced by that session's
//
// Every call is served as the service serves it (fuzz_support: limits,
// the inline-or-cancelled dispatch, clear errors). After each, the session
// store and the registry must be within their limits (cache memory, the
// address space sessions reserve, open sessions, registered bytes); at the
// end, deleting everything must give all of it back. Each input starts
// from an empty store (FuzzServerOptions' limits) and registry, and the
// objects refilled.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "attnserve/v1/attention.pb.h"
#include "core/session_store.h"
#include "fuzz/fuzz_support.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "proto/wire_scan.h"
#include "server/handlers.h"

namespace attnserve::fuzz {
namespace {

// The sessions an input has created, most recent last (at most 8 kept).
constexpr size_t kKeptIds = 8;

[[noreturn]] void Die(const std::string& problem) {
  std::fprintf(stderr, "fuzz: call_sequence: %s\n", problem.c_str());
  std::abort();
}

template <typename Message>
bool Parse(absl::string_view payload, Message* message) {
  return message->ParseFromArray(payload.data(),
                                 static_cast<int>(payload.size()));
}

SessionStore::Options StoreOptions() {
  const ServerOptions& limits = FuzzServerOptions();
  SessionStore::Options options;
  options.max_bytes = static_cast<size_t>(limits.max_session_memory_mb) << 20;
  options.max_sessions = limits.max_sessions;
  // Two sessions' worth of the budget: creating a third evicts.
  options.max_reserved_bytes = 2 * options.max_bytes;
  return options;
}

class Sequence {
 public:
  Sequence()
      : store_(StoreOptions()),
        registry_(
            static_cast<uint64_t>(FuzzServerOptions().max_shared_memory_mb)
            << 20) {}

  void Run(uint8_t tag, absl::string_view payload) {
    switch (tag % kOps) {
      case kCreate:
        Create(payload);
        break;
      case kStep:
        Step(payload);
        break;
      case kDelete:
        if (!payload.empty()) Delete(Id(payload[0]));
        break;
      case kRegister:
        Register(payload);
        break;
      case kUnregister: {
        v1::UnregisterSharedMemoryRequest request;
        if (!Parse(payload, &request)) return;
        CheckStatus("UnregisterSharedMemory",
                    HandleUnregisterSharedMemory(request, &registry_));
        break;
      }
      case kCompute:
        Compute(payload);
        break;
      case kExpire:
        store_.ExpireIdle(
            absl::Now() +
            absl::Minutes(payload.empty() ? 0
                                          : static_cast<uint8_t>(payload[0])));
        break;
      case kWrite:
        Write(payload);
        break;
      case kSteps:
        Steps(payload);
        break;
      case kFork:
        Fork(payload);
        break;
    }
    CheckLimits();
  }

  // Deletes everything: the store and the registry hold nothing after.
  void Finish() {
    for (const std::string& id : ids_) Delete(id);
    store_.Clear();
    CheckStatus("UnregisterSharedMemory(all)", registry_.Unregister(""));
    const SessionStore::Stats stats = store_.stats();
    if (stats.open != 0 || stats.cache_bytes != 0 ||
        stats.reserved_bytes != 0 || registry_.registered_bytes() != 0) {
      Die(absl::StrCat("after deleting everything: ", stats.open,
                       " sessions open, ", stats.cache_bytes, " cache bytes, ",
                       stats.reserved_bytes, " bytes reserved, ",
                       registry_.registered_bytes(),
                       " bytes of shared memory registered"));
    }
  }

 private:
  // The id of session `index` (0xff: none, the request keeps its own).
  std::string Id(char index) const {
    const auto i = static_cast<uint8_t>(index);
    if (ids_.empty() || i == 0xff) return "";
    return ids_[i % ids_.size()];
  }

  void Create(absl::string_view payload) {
    v1::CreateSessionRequest request;
    if (!Parse(payload, &request)) return;
    v1::CreateSessionResponse response;
    const ServerOptions& limits = FuzzServerOptions();
    const absl::Status status = HandleCreateSession(
        request, &TinyModels(), &store_, limits.max_session_length, &response);
    CheckStatus("CreateSession", status);
    if (!status.ok()) return;
    if (response.max_length() <= 0 ||
        response.max_length() > limits.max_session_length) {
      Die(absl::StrCat("CreateSession answered max_length ",
                       response.max_length()));
    }
    ids_.push_back(response.session_id());
    if (ids_.size() > kKeptIds) ids_.erase(ids_.begin());
  }

  void Step(absl::string_view payload) {
    if (payload.empty()) return;
    v1::SessionStepRequest request;
    if (!Parse(payload.substr(1), &request)) return;
    const std::string id = Id(payload[0]);
    if (!id.empty()) request.set_session_id(id);
    ServeSessionStep(request, &store_, &registry_);
  }

  void Steps(absl::string_view payload) {
    if (payload.empty()) return;
    const size_t count = static_cast<uint8_t>(payload[0]) % 9;
    if (payload.size() < 1 + count) return;
    // The server counts the steps on the bytes, before it parses them.
    const absl::string_view bytes = payload.substr(1 + count);
    google::protobuf::io::ArrayInputStream stream(
        bytes.data(), static_cast<int>(bytes.size()));
    const int64_t counted =
        CountTopLevelField(&stream, v1::SessionStepsRequest::kStepsFieldNumber);
    const int max_steps = FuzzServerOptions().max_steps_per_call;
    if (counted > max_steps) {
      CheckStatus("SessionSteps", VerifyStepCount(counted, max_steps));
      return;
    }
    v1::SessionStepsRequest request;
    if (!Parse(bytes, &request)) return;
    if (request.steps_size() > counted) {
      Die(absl::StrCat("SessionSteps: ", request.steps_size(),
                       " steps parsed where the bytes counted ", counted));
    }
    for (size_t i = 0;
         i < count && i < static_cast<size_t>(request.steps_size()); ++i) {
      const std::string id = Id(payload[1 + i]);
      if (!id.empty()) request.mutable_steps(i)->set_session_id(id);
    }
    ServeSessionSteps(request, &store_, &registry_);
  }

  // A fork shares its parent's cache: the limits and the final check count
  // it once.
  void Fork(absl::string_view payload) {
    if (payload.empty()) return;
    v1::ForkSessionRequest request;
    if (!Parse(payload.substr(1), &request)) return;
    const std::string id = Id(payload[0]);
    if (!id.empty()) request.set_session_id(id);
    v1::ForkSessionResponse response;
    const absl::Status status = HandleForkSession(request, &store_, &response);
    CheckStatus("ForkSession", status);
    if (!status.ok()) return;
    ids_.push_back(response.session_id());
    if (ids_.size() > kKeptIds) ids_.erase(ids_.begin());
  }

  void Delete(const std::string& id) {
    v1::DeleteSessionRequest request;
    request.set_session_id(id);
    const absl::Status status = HandleDeleteSession(request, &store_);
    CheckStatus("DeleteSession", status);
  }

  void Register(absl::string_view payload) {
    v1::RegisterSharedMemoryRequest request;
    if (!Parse(payload, &request)) return;
    v1::SharedMemoryRegion* region = request.mutable_region();
    if (region->key() == "@0") region->set_key(SharedMemoryKey(0));
    if (region->key() == "@1") region->set_key(SharedMemoryKey(1));
    CheckStatus("RegisterSharedMemory",
                HandleRegisterSharedMemory(request, &registry_));
  }

  void Compute(absl::string_view payload) {
    if (payload.empty()) return;
    const absl::string_view bytes = payload.substr(1);
    switch (static_cast<uint8_t>(payload[0]) % 3) {
      case 0: {
        v1::AttendRequest request;
        if (Parse(bytes, &request)) ServeAttend(request, &registry_);
        break;
      }
      case 1: {
        v1::MultiHeadAttendRequest request;
        if (Parse(bytes, &request)) ServeMultiHeadAttend(request, &registry_);
        break;
      }
      case 2: {
        v1::LayerNormRequest request;
        if (Parse(bytes, &request)) ServeLayerNorm(request, &registry_);
        break;
      }
    }
  }

  // The client writes into its shared memory between calls, as clients do.
  void Write(absl::string_view payload) {
    if (payload.size() < 2) return;
    const size_t offset =
        (static_cast<uint8_t>(payload[0]) |
         static_cast<size_t>(static_cast<uint8_t>(payload[1])) << 8) %
        kSharedMemoryObjectBytes;
    const absl::string_view bytes = payload.substr(2);
    WriteSharedMemory(0, offset, bytes);
  }

  void CheckLimits() const {
    const SessionStore::Stats stats = store_.stats();
    const SessionStore::Options& options = store_.options();
    if (stats.cache_bytes > options.max_bytes ||
        stats.reserved_bytes > options.max_reserved_bytes ||
        stats.open > options.max_sessions) {
      Die(absl::StrCat("session store past its limits: ", stats.open,
                       " sessions open, ", stats.cache_bytes, " cache bytes, ",
                       stats.reserved_bytes, " bytes reserved"));
    }
    if (registry_.registered_bytes() > registry_.max_bytes()) {
      Die(absl::StrCat(registry_.registered_bytes(),
                       " bytes of shared memory registered, above the "
                       "limit"));
    }
  }

  SessionStore store_;
  SharedMemoryRegistry registry_;
  std::vector<std::string> ids_;
};

}  // namespace
}  // namespace attnserve::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve::fuzz;  // NOLINT: one function
  RefillSharedMemory();
  Sequence sequence;
  Records records(data, size);
  uint8_t tag;
  absl::string_view payload;
  while (records.Next(&tag, &payload)) sequence.Run(tag, payload);
  sequence.Finish();
  return 0;
}
