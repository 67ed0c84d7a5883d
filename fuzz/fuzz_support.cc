#include "fuzz/fuzz_support.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/safetensors.h"
#include "core/thread_budget.h"
#include "google/protobuf/stubs/logging.h"
#include "proto/tensor_codec.h"
#include "server/handlers.h"
#include "server/open_inference.h"

namespace attnserve::fuzz {
namespace {

namespace fs = std::filesystem;

// Protobuf logs every string field with invalid UTF-8 it parses, which
// fuzzed requests are full of: silenced, for speed and readable logs.
[[maybe_unused]] const bool kQuietProtobuf = [] {
  google::protobuf::SetLogHandler(nullptr);
  return true;
}();

[[noreturn]] void Die(absl::string_view what, absl::string_view problem) {
  std::fprintf(stderr, "fuzz: %.*s: %.*s\n", static_cast<int>(what.size()),
               what.data(), static_cast<int>(problem.size()), problem.data());
  std::abort();
}

// An OK answer's result must be a tensor a client can read.
void CheckResult(absl::string_view rpc, absl::string_view name,
                 const v1::Tensor& tensor, SharedMemoryResolver* resolver) {
  const absl::StatusOr<TensorView> view = DecodeTensor(tensor, name, resolver);
  if (!view.ok()) {
    Die(rpc, absl::StrCat("OK answer with an unreadable ", name, ": ",
                          view.status().ToString()));
  }
}

// Whether the service admits a call of `cost`: within the limits.
bool Admitted(const RequestCost& cost) {
  const ServerOptions& limits = FuzzServerOptions();
  return VerifyWithinLimits(cost, limits.max_tensor_elements,
                            limits.max_request_memory_mb << 20)
      .ok();
}

// The service leases a tiny call one thread (UsefulThreads).
ThreadBudget::Lease LeaseOneThread() {
  static ThreadBudget budget(1);
  return budget.Acquire(1);
}

// Runs `run(control)` as the service would dispatch a call of `cost` (see
// kCallTimeBound); false, without running it, when it is not admitted.
// `inline_call` says which way it ran.
template <typename Run>
bool Dispatch(absl::string_view rpc, const RequestCost& cost,
              const SharedMemoryRegistry* registry, bool* inline_call,
              absl::Status* status, Run run) {
  if (!Admitted(cost)) return false;
  *inline_call = RunsInline(cost);
  ThreadBudget::Lease lease = LeaseOneThread();
  std::atomic<bool> cancelled{!*inline_call};
  CallSharedMemory shared_memory(registry);
  const absl::Time start = absl::Now();
  *status = run(CallControl{&cancelled, &shared_memory}, &shared_memory);
  CheckCallTime(rpc, cost, *inline_call, absl::Now() - start);
  CheckStatus(rpc, *status);
  return true;
}

// The service's steps for one compute call (see ServeAttend).
template <typename Request, typename Response, typename Handler>
void Serve(absl::string_view rpc, const Request& request,
           const RequestCost& cost, const SharedMemoryRegistry* registry,
           Handler handle) {
  bool inline_call = false;
  absl::Status status;
  Dispatch(rpc, cost, registry, &inline_call, &status,
           [&](const CallControl& control, SharedMemoryResolver* resolver) {
             Response response;
             absl::Status answered = handle(request, &response, control);
             if (!answered.ok()) return answered;
             CheckResult(rpc, "output", response.output(), resolver);
             if constexpr (requires { request.return_weights(); }) {
               if (request.return_weights()) {
                 CheckResult(rpc, "weights", response.weights(), resolver);
               }
             }
             return answered;
           });
}

// An OK ModelInfer answer's outputs must be tensors a client can read: the
// protocol's datatype, and shape x datatype bytes in raw_output_contents
// or the shared-memory reference of its parameters.
void CheckInferResponse(const inference::ModelInferResponse& response,
                        SharedMemoryResolver* resolver) {
  constexpr absl::string_view kRpc = "ModelInfer";
  if (response.outputs_size() == 0 ||
      response.raw_output_contents_size() != response.outputs_size()) {
    Die(kRpc, absl::StrCat("OK answer with ", response.outputs_size(),
                           " outputs and ", response.raw_output_contents_size(),
                           " raw_output_contents"));
  }
  for (int i = 0; i < response.outputs_size(); ++i) {
    const auto& output = response.outputs(i);
    const absl::StatusOr<v1::DataType> dtype =
        NativeDatatype(output.datatype(), output.name());
    if (!dtype.ok()) Die(kRpc, dtype.status().ToString());
    v1::Tensor tensor;
    tensor.set_dtype(*dtype);
    tensor.mutable_shape()->CopyFrom(output.shape());
    const auto& parameters = output.parameters();
    if (const auto region = parameters.find("shared_memory_region");
        region != parameters.end()) {
      v1::SharedMemoryRef* ref = tensor.mutable_shared_memory();
      ref->set_region(region->second.string_param());
      if (const auto it = parameters.find("shared_memory_offset");
          it != parameters.end()) {
        ref->set_offset(it->second.uint64_param());
      }
      if (const auto it = parameters.find("shared_memory_byte_size");
          it != parameters.end()) {
        ref->set_byte_size(it->second.uint64_param());
      }
    } else {
      tensor.set_raw_data(response.raw_output_contents(i));
    }
    CheckResult(kRpc, output.name(), tensor, resolver);
  }
}

// Uniform in [-1, 1), from a seeded generator: the same models every run.
Tensor Random(Shape shape, std::mt19937& rng) {
  Tensor t = *Tensor::Allocate(DType::kFloat32, std::move(shape));
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    t.data_as<float>()[i] = uniform(rng);
  }
  return t;
}

void WriteModel(const fs::path& dir, const std::string& config,
                const std::map<std::string, Tensor>& weights) {
  fs::create_directories(dir);
  std::ofstream(dir / "config.pbtxt") << config;
  std::map<std::string, TensorView> views;
  for (const auto& [name, tensor] : weights) views.emplace(name, tensor.view());
  const absl::Status written =
      WriteSafetensors((dir / "weights.safetensors").string(), views, {});
  if (!written.ok()) Die("TinyModels", written.ToString());
}

// The process's shared-memory objects (see SharedMemoryKey).
struct SharedMemoryObjects {
  std::array<std::string, kSharedMemoryObjects> keys;
  std::array<char*, kSharedMemoryObjects> data{};
};

constexpr char kKeyPrefix[] = "attnserve-fuzz-";

// Objects of earlier fuzz processes that are gone: a crash skips the
// removal at exit.
void RemoveStaleObjects() {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  while (const dirent* entry = readdir(dir)) {
    const absl::string_view name = entry->d_name;
    if (name.substr(0, sizeof(kKeyPrefix) - 1) != kKeyPrefix) continue;
    const absl::string_view rest = name.substr(sizeof(kKeyPrefix) - 1);
    int pid = 0;
    if (!absl::SimpleAtoi(rest.substr(0, rest.find('-')), &pid) || pid <= 0) {
      continue;
    }
    if (kill(pid, 0) != 0 && errno == ESRCH) {
      shm_unlink(absl::StrCat("/", name).c_str());
    }
  }
  closedir(dir);
}

void RemoveObjects();

SharedMemoryObjects& Objects() {
  static SharedMemoryObjects* const objects = [] {
    RemoveStaleObjects();
    auto* created = new SharedMemoryObjects();
    for (int i = 0; i < kSharedMemoryObjects; ++i) {
      const std::string key = absl::StrCat("/", kKeyPrefix, getpid(), "-", i);
      shm_unlink(key.c_str());
      const int fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
      if (fd < 0) Die(key, std::strerror(errno));
      if (ftruncate(fd, kSharedMemoryObjectBytes) != 0) {
        Die(key, std::strerror(errno));
      }
      void* data = mmap(nullptr, kSharedMemoryObjectBytes,
                        PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
      if (data == MAP_FAILED) Die(key, std::strerror(errno));
      created->keys[i] = key;
      created->data[i] = static_cast<char*>(data);
    }
    std::atexit(&RemoveObjects);
    return created;
  }();
  return *objects;
}

void RemoveObjects() {
  for (const std::string& key : Objects().keys) shm_unlink(key.c_str());
}

}  // namespace

const ServerOptions& FuzzServerOptions() {
  static const ServerOptions* const options = [] {
    auto* o = new ServerOptions();
    o->max_tensor_elements = int64_t{1} << 20;
    o->max_request_memory_mb = 64;
    o->max_shared_memory_mb = 1;
    o->max_session_memory_mb = 1;
    o->max_session_length = 64;
    o->max_sessions = 4;
    return o;
  }();
  return *options;
}

void CheckCallTime(absl::string_view what, const RequestCost& cost,
                   bool inline_call, absl::Duration took) {
  if (took <= kCallTimeBound) return;
  Die(what, absl::StrCat(inline_call ? "ran inline (its cost says it is tiny)"
                                     : "was cancelled before it started",
                         " but took ", absl::FormatDuration(took),
                         "; cost: ", cost.flops, " FLOPs, work ", cost.work,
                         ", ", cost.bytes, " bytes"));
}

void CheckStatus(absl::string_view what, const absl::Status& status) {
  if (status.message().size() > kMaxStatusMessageBytes) {
    Die(what, absl::StrCat("a message of ", status.message().size(),
                           " bytes: ", status.message().substr(0, 300)));
  }
  if (status.code() == absl::StatusCode::kInternal ||
      status.code() == absl::StatusCode::kUnknown) {
    Die(what, absl::StrCat("unclear error: ", status.ToString()));
  }
  if (!status.ok() && status.message().empty()) {
    Die(what, absl::StrCat("error without a message: ", status.ToString()));
  }
}

const ModelRepository& TinyModels() {
  static const ModelRepository* const models = [] {
    char pattern[] = "/tmp/attnserve-fuzz-models-XXXXXX";
    if (mkdtemp(pattern) == nullptr) Die("TinyModels", std::strerror(errno));
    const fs::path root = pattern;
    std::mt19937 rng(20261121);
    std::map<std::string, Tensor> tiny;
    tiny.emplace("in_proj_weight", Random({24, 8}, rng));
    tiny.emplace("in_proj_bias", Random({24}, rng));
    tiny.emplace("out_proj.weight", Random({8, 8}, rng));
    tiny.emplace("out_proj.bias", Random({8}, rng));
    WriteModel(root / "tiny", "num_heads: 2\n", tiny);
    std::map<std::string, Tensor> cross;
    cross.emplace("q_proj_weight", Random({8, 8}, rng));
    cross.emplace("k_proj_weight", Random({8, 4}, rng));
    cross.emplace("v_proj_weight", Random({4, 6}, rng));
    cross.emplace("q_proj_bias", Random({8}, rng));
    cross.emplace("out_proj_weight", Random({5, 4}, rng));
    WriteModel(root / "tiny_cross",
               "num_heads: 2\ncompute_dtype: DATA_TYPE_BFLOAT16\n"
               "default_scale: 0.5\ndefault_causal: true\n",
               cross);
    auto* repository = new ModelRepository(root.string());
    const absl::Status loaded = repository->Reload();
    std::error_code ignored;
    fs::remove_all(root, ignored);
    if (!loaded.ok()) Die("TinyModels", loaded.ToString());
    return repository;
  }();
  return *models;
}

void ServeAttend(const v1::AttendRequest& request,
                 const SharedMemoryRegistry* registry) {
  Serve<v1::AttendRequest, v1::AttendResponse>(
      "Attend", request, CostOf(request), registry, &HandleAttend);
}

void ServeMultiHeadAttend(const v1::MultiHeadAttendRequest& request,
                          const SharedMemoryRegistry* registry) {
  // As the service: the model is looked up once, for the cost and the call.
  const MultiHeadAttendHandler handle(request, &TinyModels());
  Serve<v1::MultiHeadAttendRequest, v1::MultiHeadAttendResponse>(
      "MultiHeadAttend", request, CostOf(request, handle.layer()), registry,
      handle);
}

void ServeLayerNorm(const v1::LayerNormRequest& request,
                    const SharedMemoryRegistry* registry) {
  Serve<v1::LayerNormRequest, v1::LayerNormResponse>(
      "LayerNorm", request, CostOf(request), registry, &HandleLayerNorm);
}

void ServeRmsNorm(const v1::RmsNormRequest& request,
                  const SharedMemoryRegistry* registry) {
  Serve<v1::RmsNormRequest, v1::RmsNormResponse>(
      "RmsNorm", request, CostOf(request), registry, &HandleRmsNorm);
}

bool ServeModelInfer(inference::ModelInferRequest* request,
                     const SharedMemoryRegistry* registry,
                     inference::ModelInferResponse* response) {
  absl::StatusOr<std::unique_ptr<NativeInferCall>> call =
      NativeInferCall::FromRequest(request, &TinyModels());
  CheckStatus("ModelInfer", call.status());
  if (!call.ok()) return false;
  bool inline_call = false;
  absl::Status status;
  const bool ran =
      Dispatch("ModelInfer", (*call)->cost(), registry, &inline_call, &status,
               [&](const CallControl& control, SharedMemoryResolver* resolver) {
                 absl::Status answered = (*call)->Run(control);
                 if (!answered.ok()) return answered;
                 (*call)->ToResponse(*request, response);
                 CheckInferResponse(*response, resolver);
                 return answered;
               });
  return ran && status.ok();
}

bool ServeSessionStep(const v1::SessionStepRequest& request,
                      SessionStore* sessions,
                      const SharedMemoryRegistry* registry) {
  // As the service: the session is looked up once for the cost.
  const SessionStepHandler handle(request, sessions);
  bool inline_call = false;
  absl::Status status;
  const bool ran = Dispatch(
      "SessionStep", CostOf(request, handle.session()), registry, &inline_call,
      &status, [&](const CallControl& control, SharedMemoryResolver* resolver) {
        v1::SessionStepResponse response;
        absl::Status answered = handle(request, &response, control);
        if (answered.ok()) {
          CheckResult("SessionStep", "output", response.output(), resolver);
        }
        return answered;
      });
  return ran && status.ok();
}

bool ServeSessionSteps(const v1::SessionStepsRequest& request,
                       SessionStore* sessions,
                       const SharedMemoryRegistry* registry) {
  const int max_steps = FuzzServerOptions().max_steps_per_call;
  const absl::Status count = VerifyStepCount(request.steps_size(), max_steps);
  CheckStatus("SessionSteps", count);
  if (!count.ok()) return false;
  const SessionStepsHandler handle(request, sessions, max_steps);
  bool inline_call = false;
  absl::Status status;
  const bool ran = Dispatch(
      "SessionSteps", CostOf(request, handle.sessions()), registry,
      &inline_call, &status,
      [&](const CallControl& control, SharedMemoryResolver* resolver) {
        v1::SessionStepsResponse response;
        absl::Status answered = handle(request, &response, control);
        if (!answered.ok()) return answered;
        if (response.results_size() != request.steps_size()) {
          Die("SessionSteps",
              absl::StrCat("OK answer with ", response.results_size(),
                           " results for ", request.steps_size(), " steps"));
        }
        for (const v1::SessionStepResult& result : response.results()) {
          const absl::Status step(static_cast<absl::StatusCode>(result.code()),
                                  result.message());
          CheckStatus("SessionSteps step", step);
          if (step.ok()) {
            CheckResult("SessionSteps", "output", result.output(), resolver);
          }
        }
        return answered;
      });
  return ran && status.ok();
}

bool ServeModelMetadata(const std::string& name, const std::string& version,
                        inference::ModelMetadataResponse* metadata) {
  inference::ModelMetadataRequest metadata_request;
  metadata_request.set_name(name);
  metadata_request.set_version(version);
  const absl::Status found =
      HandleModelMetadata(metadata_request, &TinyModels(), metadata);
  CheckStatus("ModelMetadata", found);
  inference::ModelReadyRequest ready_request;
  ready_request.set_name(name);
  ready_request.set_version(version);
  inference::ModelReadyResponse ready;
  const absl::Status answered =
      HandleModelReady(ready_request, &TinyModels(), &ready);
  CheckStatus("ModelReady", answered);
  if (found.ok() != (answered.ok() && ready.ready())) {
    Die("ModelReady",
        absl::StrCat("ready ", ready.ready() ? "true" : "false", " (",
                     answered.ToString(), ") but metadata ", found.ToString()));
  }
  return found.ok();
}

const std::string& SharedMemoryKey(int index) { return Objects().keys[index]; }

void RefillSharedMemory() {
  for (char* data : Objects().data) {
    std::memset(data, kSharedMemoryFill, kSharedMemoryObjectBytes);
  }
}

void WriteSharedMemory(int index, size_t offset, absl::string_view bytes) {
  if (offset >= kSharedMemoryObjectBytes) return;
  const size_t n = std::min(bytes.size(), kSharedMemoryObjectBytes - offset);
  std::memcpy(Objects().data[index] + offset, bytes.data(), n);
}

const SharedMemoryRegistry& ComputeRegistry() {
  static const SharedMemoryRegistry* const registry = [] {
    auto* r = new SharedMemoryRegistry(uint64_t{1} << 20);
    const SharedMemoryRegionInfo regions[] = {
        {kSeedRegion, SharedMemoryKey(0), 0, kSeedRegionBytes},
        {"fuzz_odd", SharedMemoryKey(1), 2, kSharedMemoryObjectBytes - 2},
        {"fuzz_small", SharedMemoryKey(1), 0, 64},
    };
    for (const SharedMemoryRegionInfo& info : regions) {
      const absl::Status registered = r->Register(info);
      if (!registered.ok()) Die("ComputeRegistry", registered.ToString());
    }
    return r;
  }();
  return *registry;
}

bool Records::Next(uint8_t* tag, absl::string_view* payload) {
  if (size_ == 0) return false;
  *tag = static_cast<uint8_t>(data_[0]);
  size_t length = 0;
  if (size_ >= 3) {
    length = static_cast<uint8_t>(data_[1]) |
             static_cast<size_t>(static_cast<uint8_t>(data_[2])) << 8;
  }
  const size_t header = std::min<size_t>(size_, 3);
  length = std::min(length, size_ - header);
  *payload = absl::string_view(data_ + header, length);
  data_ += header + length;
  size_ -= header + length;
  return true;
}

std::string Record(uint8_t tag, absl::string_view payload) {
  std::string out;
  out.push_back(static_cast<char>(tag));
  out.push_back(static_cast<char>(payload.size() & 0xff));
  out.push_back(static_cast<char>((payload.size() >> 8) & 0xff));
  out.append(payload.data(), payload.size());
  return out;
}

std::optional<HttpInferCall> ReadHttpInferCall(const uint8_t* data,
                                               size_t size) {
  if (size < 3) return std::nullopt;
  constexpr int kModels = sizeof(kHttpInferModels) / sizeof(*kHttpInferModels);
  HttpInferCall call;
  call.model = kHttpInferModels[data[0] % kModels];
  const uint16_t length = static_cast<uint16_t>(data[1] | data[2] << 8);
  if (length != kNoJsonLength) call.json_length = length;
  call.body =
      absl::string_view(reinterpret_cast<const char*>(data) + 3, size - 3);
  return call;
}

std::string HttpInferInput(int model, std::optional<uint16_t> json_length,
                           absl::string_view body) {
  const uint16_t length = json_length.value_or(kNoJsonLength);
  std::string out;
  out.push_back(static_cast<char>(model));
  out.push_back(static_cast<char>(length & 0xff));
  out.push_back(static_cast<char>(length >> 8));
  out.append(body.data(), body.size());
  return out;
}

}  // namespace attnserve::fuzz
