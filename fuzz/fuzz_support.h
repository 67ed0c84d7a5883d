// What the fuzz targets share: the server's limits lowered for fuzzing, the
// service's admission steps without gRPC (cost estimate, limits, the
// handler), the check that turns an unclear error into a crash the fuzzer
// reports, and the small models and shared-memory objects the targets run
// against.
//
// The Open Inference Protocol (KServe v2) is served the same way: its
// ModelInfer translated to the native call (ServeModelInfer), its metadata
// and readiness (ServeModelMetadata).
//
// The promise checked: every request gets an answer or a clear error. A
// crash, a sanitizer report, a hang, an INTERNAL or UNKNOWN status, an error
// without a message, or an OK answer whose results do not decode is a bug;
// the checks abort so that the fuzzer (or the replay test) reports the input.
//
// Ownership: the fixtures (TinyModels, the shared-memory objects) live until
// the process exits, which removes the objects. Thread-safety: one input at
// a time, as libFuzzer runs them.
#ifndef ATTNSERVE_FUZZ_FUZZ_SUPPORT_H_
#define ATTNSERVE_FUZZ_FUZZ_SUPPORT_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"
#include "core/session_store.h"
#include "inference/grpc_service.pb.h"
#include "server/model_repository.h"
#include "server/options.h"
#include "server/request_cost.h"
#include "server/shared_memory.h"

namespace attnserve::fuzz {

// The server's default options with the limits lowered, so that no input
// makes a target allocate more than tens of MiB (sessions: 1 MiB of cache,
// 64 tokens).
const ServerOptions& FuzzServerOptions();

// The service's dispatch decision, fuzzed: a call within the limits that
// RunsInline (its cost says it is tiny) is computed as the service computes
// it on gRPC's thread, where nothing can stop it, and must end within
// kCallTimeBound; any other is computed with its cancellation flag already
// set, as a cancel, its deadline or the drain leaves it, and must stop
// within the same bound. A call whose cost misses its work (0 FLOPs over
// billions of logits) or that ignores its flag aborts. Only inline calls
// compute to the end, which keeps the execution rate high.
inline constexpr absl::Duration kCallTimeBound = absl::Seconds(1);

// Aborts, printing `what` and the status, when `status` is INTERNAL or
// UNKNOWN or an error with an empty message, or with a message longer than
// kMaxStatusMessageBytes (an echo of a client's string that was not cut:
// gRPC clients accept 8 KiB of metadata by default).
inline constexpr size_t kMaxStatusMessageBytes = 4096;
void CheckStatus(absl::string_view what, const absl::Status& status);

// Aborts when a call of `cost` took longer than kCallTimeBound (see above;
// `inline_call`: whether it ran as an inline call, or cancelled).
void CheckCallTime(absl::string_view what, const RequestCost& cost,
                   bool inline_call, absl::Duration took);

// Models "tiny" (E=8, H=2, PyTorch's fused in_proj_weight with biases) and
// "tiny_cross" (separate q/k/v weights with key dim 4 and value dim 6,
// BFLOAT16 compute, a default scale and default causal), loaded once.
const ModelRepository& TinyModels();

// The compute RPCs as the service runs them, minus gRPC: cost estimate,
// limits, then, for tiny calls, the handler under a one-thread lease with a
// CallControl whose shared memory is `registry` (null: shared memory off).
// An OK answer's results must decode (through the call's shared memory).
void ServeAttend(const v1::AttendRequest& request,
                 const SharedMemoryRegistry* registry);
void ServeMultiHeadAttend(const v1::MultiHeadAttendRequest& request,
                          const SharedMemoryRegistry* registry);
void ServeLayerNorm(const v1::LayerNormRequest& request,
                    const SharedMemoryRegistry* registry);
void ServeRmsNorm(const v1::RmsNormRequest& request,
                  const SharedMemoryRegistry* registry);
// SessionStep on `sessions` the same way (cost from the session the
// request names). True when it answered OK.
bool ServeSessionStep(const v1::SessionStepRequest& request,
                      SessionStore* sessions,
                      const SharedMemoryRegistry* registry);
// SessionSteps likewise (the step count checked first, as the service's
// bind does): an OK answer has one result per step, and each OK result's
// output decodes. True when the call answered OK.
bool ServeSessionSteps(const v1::SessionStepsRequest& request,
                       SessionStore* sessions,
                       const SharedMemoryRegistry* registry);

// ModelInfer as the service runs it, minus gRPC: translation
// (NativeInferCall::FromRequest against TinyModels, taking `request`'s
// raw_input_contents), cost estimate, limits, then, for tiny calls, the
// native handler with shared memory `registry` (null: off) and the protocol
// response. True when `response` holds an OK answer, whose outputs must
// decode (shape x datatype bytes, or a readable shared-memory reference).
bool ServeModelInfer(inference::ModelInferRequest* request,
                     const SharedMemoryRegistry* registry,
                     inference::ModelInferResponse* response);

// ModelMetadata and ModelReady for `name` and `version` against
// TinyModels, which must agree: ready exactly when the metadata is found.
// True when found (`metadata` then holds it).
bool ServeModelMetadata(const std::string& name, const std::string& version,
                        inference::ModelMetadataResponse* metadata);

// Shared-memory objects this process creates, fills with kSharedMemoryFill
// and removes at exit: kSharedMemoryObjects of kSharedMemoryObjectBytes
// each. Objects left by processes that died (a crash) are removed first.
inline constexpr int kSharedMemoryObjects = 2;
inline constexpr size_t kSharedMemoryObjectBytes = 64 << 10;
// Every byte of the objects: a valid value of every dtype (FLOAT32 0.0115,
// FLOAT16 1.06, a BOOL/UINT8 "keep").
inline constexpr uint8_t kSharedMemoryFill = 0x3c;
// The shm_open key of object `index`, e.g. "/attnserve-fuzz-123-0"; creates
// the objects on first use.
const std::string& SharedMemoryKey(int index);
// Sets every byte of the objects back to kSharedMemoryFill.
void RefillSharedMemory();
// Writes `bytes` into object `index` from `offset`, as much as fits.
void WriteSharedMemory(int index, size_t offset, absl::string_view bytes);

// A registry holding the regions the seed requests of the
// shared_memory_compute target refer to: "fuzz" (all of object 0, where the
// seeds place their tensors and results), "fuzz_odd" (object 1 from byte
// 2: no 4-byte aligned offset 0) and "fuzz_small" (the first 64 bytes of
// object 1).
const SharedMemoryRegistry& ComputeRegistry();
inline constexpr char kSeedRegion[] = "fuzz";
inline constexpr size_t kSeedRegionBytes = kSharedMemoryObjectBytes;

// Splits an input into records: a tag byte, a little-endian 16-bit length,
// then that many payload bytes (fewer when the input ends first).
class Records {
 public:
  Records(const uint8_t* data, size_t size)
      : data_(reinterpret_cast<const char*>(data)), size_(size) {}
  // False at the end of the input.
  bool Next(uint8_t* tag, absl::string_view* payload);

 private:
  const char* data_;
  size_t size_;
};

// The record Records reads back as (tag, payload).
std::string Record(uint8_t tag, absl::string_view payload);

// An HTTP infer call of the open_inference_json target: the model of the
// URL, the Inference-Header-Content-Length header (none, or the length of
// the JSON part) and the body. As bytes: the model's index in
// kHttpInferModels (byte 0, modulo their count), the header as a
// little-endian 16-bit length (bytes 1-2; kNoJsonLength: no header), then
// the body.
inline constexpr const char* kHttpInferModels[] = {
    "attend", "multi_head_attend", "layer_norm",
    "tiny",   "tiny_cross",        "missing"};
inline constexpr uint16_t kNoJsonLength = 0xffff;
struct HttpInferCall {
  std::string model;
  std::optional<size_t> json_length;
  absl::string_view body;
};
// Inputs shorter than the 3-byte header are nullopt.
std::optional<HttpInferCall> ReadHttpInferCall(const uint8_t* data,
                                               size_t size);
// The bytes ReadHttpInferCall reads back as the call (model by index).
std::string HttpInferInput(int model, std::optional<uint16_t> json_length,
                           absl::string_view body);

// The calls of the call_sequence target, by the tag of its records
// (tag % kOps), shared with the seeds that make_corpus writes.
enum CallSequenceOp : uint8_t {
  kCreate,
  kStep,
  kDelete,
  kRegister,
  kUnregister,
  kCompute,
  kExpire,
  kWrite,
  kSteps,
  kFork,
  kOps
};

}  // namespace attnserve::fuzz

#endif  // ATTNSERVE_FUZZ_FUZZ_SUPPORT_H_
