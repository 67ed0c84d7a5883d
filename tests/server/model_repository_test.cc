// The model repository: loading (both weight namings), refusing broken
// models with the file and the problem, refusing model files that are no
// regular files, too large or symlinked out of the repository, atomic
// reloads, and the model RPCs; the table of weight fields both namings and
// the wire go through.
#include "server/model_repository.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/attention_weights.h"
#include "core/files.h"
#include "core/safetensors.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "proto/tensor_codec.h"
#include "server/handlers.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

namespace fs = std::filesystem;

// A temporary model repository, removed with the object.
class TempRepository {
 public:
  TempRepository() {
    root_ = (fs::temp_directory_path() /
             absl::StrCat("attnserve_models_", ::getpid(), "_", counter_++))
                .string();
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  ~TempRepository() { fs::remove_all(root_); }
  const std::string& root() const { return root_; }

  // Writes NAME/config.pbtxt and NAME/weights.safetensors.
  void Write(const std::string& name, const std::string& config,
             const NamedTensors& weights) const {
    const fs::path dir = fs::path(root_) / name;
    fs::create_directories(dir);
    std::ofstream(dir / "config.pbtxt") << config;
    ASSERT_TRUE(WriteSafetensors((dir / "weights.safetensors").string(),
                                 ViewsOf(weights), {})
                    .ok());
  }

 private:
  static inline int counter_ = 0;
  std::string root_;
};

// nn.MultiheadAttention's state_dict for E=16, H=4, seeded.
NamedTensors StateDict(uint32_t seed, int64_t e = 16) {
  std::mt19937 rng(seed);
  NamedTensors t;
  t.emplace("in_proj_weight", RandomTensor(DType::kFloat32, {3 * e, e}, rng));
  t.emplace("in_proj_bias", RandomTensor(DType::kFloat32, {3 * e}, rng));
  t.emplace("out_proj.weight", RandomTensor(DType::kFloat32, {e, e}, rng));
  t.emplace("out_proj.bias", RandomTensor(DType::kFloat32, {e}, rng));
  return t;
}

// The same layer as inline request weights.
v1::AttentionWeights InlineWeights(const NamedTensors& state, int heads) {
  v1::AttentionWeights w;
  w.set_num_heads(heads);
  EncodeTensor(state.at("in_proj_weight").view(), w.mutable_in_proj_weight());
  EncodeTensor(state.at("in_proj_bias").view(), w.mutable_in_proj_bias());
  EncodeTensor(state.at("out_proj.weight").view(), w.mutable_out_proj_weight());
  EncodeTensor(state.at("out_proj.bias").view(), w.mutable_out_proj_bias());
  return w;
}

v1::MultiHeadAttendRequest QueryRequest(uint32_t seed) {
  std::mt19937 rng(seed);
  v1::MultiHeadAttendRequest r;
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {2, 5, 16}, rng);
  return r;
}

constexpr char kConfig[] = "num_heads: 4\n";

TEST(ModelRepositoryTest, ServesPyTorchStateDictLikeInlineWeights) {
  TempRepository repo;
  const NamedTensors state = StateDict(1);
  repo.Write("mha", kConfig, state);
  ModelRepository models(repo.root());
  ASSERT_TRUE(models.Reload().ok());

  v1::MultiHeadAttendRequest by_model = QueryRequest(2);
  by_model.set_model("mha");
  v1::MultiHeadAttendRequest inline_request = QueryRequest(2);
  *inline_request.mutable_weights() = InlineWeights(state, 4);
  v1::MultiHeadAttendResponse a, b;
  ASSERT_TRUE(HandleMultiHeadAttend(by_model, &models, &a).ok());
  ASSERT_TRUE(HandleMultiHeadAttend(inline_request, nullptr, &b).ok());
  auto out_a = CopyTensor(a.output(), "output");
  auto out_b = CopyTensor(b.output(), "output");
  ASSERT_TRUE(out_a.ok() && out_b.ok());
  EXPECT_TRUE(AllClose(out_a->view(), ToRef(out_b->view()), kFloat32Tolerance));
}

TEST(ModelRepositoryTest, AcceptsAttentionWeightsNamesAndSplitsSharedBias) {
  TempRepository repo;
  std::mt19937 rng(3);
  NamedTensors t;
  // PyTorch's kdim/vdim layout: separate weights, one [3E] in_proj_bias.
  t.emplace("q_proj_weight", RandomTensor(DType::kFloat32, {16, 16}, rng));
  t.emplace("k_proj_weight", RandomTensor(DType::kFloat32, {16, 8}, rng));
  t.emplace("v_proj_weight", RandomTensor(DType::kFloat32, {16, 12}, rng));
  t.emplace("in_proj_bias", RandomTensor(DType::kFloat32, {48}, rng));
  t.emplace("out_proj_weight", RandomTensor(DType::kFloat32, {16, 16}, rng));
  repo.Write("cross", kConfig, t);
  ModelRepository models(repo.root());
  ASSERT_TRUE(models.Reload().ok()) << models.Reload();
  auto model = models.Find("cross");
  ASSERT_TRUE(model.ok());
  EXPECT_EQ((*model)->layer->key_input_dim(), 8);
  EXPECT_EQ((*model)->layer->value_input_dim(), 12);
}

void ExpectLoadError(const std::string& config, const NamedTensors& weights,
                     const std::string& message_part) {
  TempRepository repo;
  repo.Write("bad", config, weights);
  ModelRepository models(repo.root());
  const absl::Status status = models.Reload();
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find(message_part), std::string::npos)
      << status.message();
  EXPECT_NE(status.message().find(repo.root() + "/bad/"), std::string::npos)
      << "the message names the file: " << status.message();
}

TEST(ModelRepositoryTest, BrokenModelsNameTheFileAndTheProblem) {
  ExpectLoadError("num_heads: four\n", StateDict(1),
                  "config.pbtxt: line 1 column 12: Expected integer");
  ExpectLoadError("num_heads: 0\n", StateDict(1),
                  "config.pbtxt: num_heads must be > 0, got 0");
  ExpectLoadError("num_heads: 1\ncache_dtype: DATA_TYPE_BFLOAT16\n",
                  StateDict(1),
                  "config.pbtxt: cache_dtype must be the compute dtype or "
                  "DATA_TYPE_INT8, got DATA_TYPE_BFLOAT16");
  ExpectLoadError("num_heads: 5\n", StateDict(1),
                  "weights.safetensors: in_proj_weight: embed dim (dim 1) 16 "
                  "is not divisible by num_heads 5");
  NamedTensors with_bias_k = StateDict(1);
  std::mt19937 rng(4);
  with_bias_k.emplace("bias_k", RandomTensor(DType::kFloat32, {1, 1, 16}, rng));
  ExpectLoadError(kConfig, with_bias_k,
                  "weights.safetensors: bias_k: add_bias_kv (learned key/value "
                  "bias rows) is not supported");
  NamedTensors unknown = StateDict(1);
  unknown.emplace("w_q", RandomTensor(DType::kFloat32, {16, 16}, rng));
  ExpectLoadError(kConfig, unknown,
                  "weights.safetensors: unknown tensor 'w_q' (expected "
                  "q_proj_weight, k_proj_weight, v_proj_weight, "
                  "in_proj_weight, q_proj_bias, k_proj_bias, v_proj_bias, "
                  "in_proj_bias, out_proj_weight (out_proj.weight), "
                  "out_proj_bias (out_proj.bias))");
}

TEST(ModelRepositoryTest, ParsesAModelFromMemoryAsFromItsFolder) {
  TempRepository repo;
  const NamedTensors state = StateDict(5);
  repo.Write("mha", kConfig, state);
  const std::string dir = repo.root() + "/mha";
  auto from_files = LoadModel(dir);
  auto weights = SerializeSafetensors(ViewsOf(state), {});
  ASSERT_TRUE(from_files.ok() && weights.ok());
  auto from_memory = ParseModel(dir, kConfig, *weights);
  ASSERT_TRUE(from_memory.ok()) << from_memory.status();
  EXPECT_EQ((*from_memory)->name, "mha");
  EXPECT_EQ((*from_memory)->layer->num_heads(), 4);
  EXPECT_EQ((*from_memory)->layer->query_dim(), 16);

  v1::MultiHeadAttendRequest request = QueryRequest(6);
  v1::MultiHeadAttendResponse a, b;
  MultiHeadInputs inputs;
  inputs.query = *DecodeTensor(request.query(), "query");
  WireResults results_a(a.mutable_output(), nullptr);
  WireResults results_b(b.mutable_output(), nullptr);
  ASSERT_TRUE((*from_files)->layer->Run(inputs, {}, results_a).ok());
  ASSERT_TRUE((*from_memory)->layer->Run(inputs, {}, results_b).ok());
  EXPECT_EQ(a.output().raw_data(), b.output().raw_data());

  const absl::Status bad = ParseModel(dir, "num_heads: 0\n", *weights).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.message(), dir + "/config.pbtxt: num_heads must be > 0, got 0");
  const absl::Status short_weights = ParseModel(dir, kConfig, "1234").status();
  EXPECT_EQ(short_weights.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(short_weights.message(),
            dir +
                "/weights.safetensors: 4 bytes is too short for a "
                "safetensors file");
}

TEST(ModelRepositoryTest, FailedReloadKeepsTheLoadedModels) {
  TempRepository repo;
  repo.Write("a", kConfig, StateDict(1));
  ModelRepository models(repo.root());
  ASSERT_TRUE(models.Reload().ok());
  repo.Write("b", "num_heads: -1\n", StateDict(2));
  EXPECT_FALSE(models.Reload().ok());
  EXPECT_TRUE(models.Find("a").ok());
  EXPECT_EQ(models.Find("b").status().code(), absl::StatusCode::kNotFound);
}

TEST(ModelRepositoryTest,
     ReloadSwapsAtomicallyAndInFlightCallsKeepTheirWeights) {
  TempRepository repo;
  repo.Write("m", kConfig, StateDict(1));
  ModelRepository models(repo.root());
  ASSERT_TRUE(models.Reload().ok());
  auto before = models.Find("m");
  ASSERT_TRUE(before.ok());
  repo.Write("m", kConfig, StateDict(9));  // new weights, same name
  repo.Write("n", kConfig, StateDict(3));
  ASSERT_TRUE(models.Reload().ok());
  auto after = models.Find("m");
  ASSERT_TRUE(after.ok());
  EXPECT_NE(before->get(), after->get());
  EXPECT_EQ(models.List().size(), 2u);

  // A call holding the old model still computes with the old weights.
  std::mt19937 rng(5);
  Tensor x = RandomTensor(DType::kFloat32, {1, 3, 16}, rng);
  MultiHeadInputs in{x.view(), std::nullopt, std::nullopt, std::nullopt,
                     std::nullopt};
  TensorResults old_results, new_results;
  ASSERT_TRUE((*before)->layer->Run(in, {}, old_results).ok());
  ASSERT_TRUE((*after)->layer->Run(in, {}, new_results).ok());
  const NamedTensors old_state = StateDict(1);
  MultiHeadWeights w;
  w.num_heads = 4;
  w.in_proj_weight = old_state.at("in_proj_weight").view();
  w.in_proj_bias = old_state.at("in_proj_bias").view();
  w.out_proj_weight = old_state.at("out_proj.weight").view();
  w.out_proj_bias = old_state.at("out_proj.bias").view();
  auto expected = MultiHeadAttend(w, in, {});
  ASSERT_TRUE(expected.ok());
  EXPECT_TRUE(AllClose(old_results.Take("output")->view(),
                       ToRef(expected->output.view()), kFloat32Tolerance));
  EXPECT_FALSE(AllClose(new_results.Take("output")->view(),
                        ToRef(expected->output.view()), kFloat32Tolerance));
}

TEST(ModelRepositoryTest, ModelDefaultsApplyWhenTheRequestIsSilent) {
  TempRepository repo;
  const NamedTensors state = StateDict(1);
  repo.Write("plain", kConfig, state);
  repo.Write("causal",
             "num_heads: 4\ndefault_causal: true\ndefault_scale: 0.1\n", state);
  ModelRepository models(repo.root());
  ASSERT_TRUE(models.Reload().ok());
  v1::MultiHeadAttendRequest by_default = QueryRequest(6);
  by_default.set_model("causal");
  v1::MultiHeadAttendRequest explicit_request = QueryRequest(6);
  explicit_request.set_model("plain");
  explicit_request.set_causal(true);
  explicit_request.set_scale(0.1f);
  v1::MultiHeadAttendResponse a, b;
  ASSERT_TRUE(HandleMultiHeadAttend(by_default, &models, &a).ok());
  ASSERT_TRUE(HandleMultiHeadAttend(explicit_request, &models, &b).ok());
  EXPECT_EQ(a.output().raw_data(), b.output().raw_data());
}

TEST(ModelRepositoryTest, ReloadUnderLoadLosesNoCall) {
  TempRepository repo;
  repo.Write("m", kConfig, StateDict(1));
  ServerOptions options;
  options.model_repository = repo.root();
  TestServer server(options);
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, failed{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&, t] {
      AttnClient client = server.MakeClient();
      v1::MultiHeadAttendRequest request = QueryRequest(10 + t);
      request.set_model("m");
      while (!stop.load()) {
        if (client.MultiHeadAttend(request).ok()) {
          ++ok;
        } else {
          ++failed;
        }
      }
    });
  }
  // Five reloads with other weights while the callers run, each after at
  // least five more calls have completed (waiting on progress, not on time,
  // so a loaded machine slows the test down instead of failing it).
  for (int i = 0; i < 5; ++i) {
    const int before = ok.load() + failed.load();
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    while (ok.load() + failed.load() < before + 5 && absl::Now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    repo.Write("m", kConfig, StateDict(20 + i));
    ASSERT_TRUE(server.ReloadModels().ok());
  }
  stop = true;
  for (std::thread& caller : callers) caller.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_GE(ok.load(), 25);
}

TEST(ModelRepositoryTest, ListAndMetadataRpcs) {
  TempRepository repo;
  repo.Write("zeta", kConfig, StateDict(1));
  repo.Write("alpha", "num_heads: 2\ndescription: \"first\"\n", StateDict(2));
  ModelRepository models(repo.root());
  ASSERT_TRUE(models.Reload().ok());
  v1::ListModelsResponse list;
  ASSERT_TRUE(HandleListModels(&models, &list).ok());
  ASSERT_EQ(list.models_size(), 2);
  EXPECT_EQ(list.models(0).name(), "alpha");
  EXPECT_EQ(list.models(0).num_heads(), 2);
  EXPECT_EQ(list.models(0).embed_dim(), 16);
  v1::GetModelMetadataRequest request;
  request.set_name("alpha");
  v1::GetModelMetadataResponse metadata;
  ASSERT_TRUE(HandleGetModelMetadata(request, &models, &metadata).ok());
  EXPECT_EQ(metadata.description(), "first");
  EXPECT_EQ(metadata.head_key_dim(), 8);
  EXPECT_EQ(metadata.output_dim(), 16);
  ASSERT_EQ(metadata.inputs_size(), 5);
  EXPECT_EQ(metadata.inputs(0).name(), "query");
  EXPECT_EQ(std::vector<int64_t>(metadata.inputs(0).shape().begin(),
                                 metadata.inputs(0).shape().end()),
            (std::vector<int64_t>{-1, -1, 16}));
  request.set_name("beta");
  const absl::Status missing =
      HandleGetModelMetadata(request, &models, &metadata);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.message(),
            "model: 'beta' not found; loaded models: alpha, zeta");
}

// Model files that are not regular files, too large, or symlinked out of
// the repository: refused at once with the file named, the served models
// unchanged.

// The model "m" (seed 1) in `repo`, loaded into `models`.
void ServeModelM(const TempRepository& repo, ModelRepository& models) {
  repo.Write("m", kConfig, StateDict(1));
  ASSERT_TRUE(models.Reload().ok());
}

// Whether `models` still serves "m" as loaded by ServeModelM.
void ExpectModelMServes(const ModelRepository& models) {
  v1::MultiHeadAttendRequest request = QueryRequest(2);
  request.set_model("m");
  v1::MultiHeadAttendResponse response;
  EXPECT_TRUE(HandleMultiHeadAttend(request, &models, &response).ok());
  auto model = models.Find("m");
  ASSERT_TRUE(model.ok());
  EXPECT_EQ((*model)->layer->query_dim(), 16);
}

// models.LoadOne(name), failing the test (rather than hanging it) if it
// takes more than 10 s; `fifo`, if given, is then opened for writing, which
// releases a load blocked on opening it.
absl::Status LoadOneInTime(ModelRepository& models, const std::string& name,
                           const std::string& fifo = "") {
  std::promise<absl::Status> done;
  std::future<absl::Status> status = done.get_future();
  std::thread load([&] { done.set_value(models.LoadOne(name)); });
  if (status.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "LoadOne(" << name << ") blocked for 10 s";
    // O_NONBLOCK: opens only if the load holds the read end, never waits.
    const int writer =
        fifo.empty() ? -1 : ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (writer >= 0) ::close(writer);
  }
  load.join();
  return status.get();
}

void ExpectRefused(const absl::Status& status, const std::string& message) {
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_EQ(status.message(), message);
}

TEST(ModelRepositoryFilesTest,
     WeightsSymlinkedToDevZeroAreRefusedBeforeAnyRead) {
  TempRepository repo;
  ModelRepository models(repo.root());
  ServeModelM(repo, models);
  const std::string weights = repo.root() + "/m/weights.safetensors";
  fs::remove(weights);
  fs::create_symlink("/dev/zero", weights);
  const std::string refusal = weights + ": resolves to '/dev/zero', outside '" +
                              fs::canonical(repo.root()).string() +
                              "' (symlinks may lead only within it)";
  ExpectRefused(LoadOneInTime(models, "m"), refusal);
  ExpectRefused(models.Reload(), refusal);
  ExpectModelMServes(models);
}

TEST(ModelRepositoryFilesTest, DevicesAreRefusedByKind) {
  RegularFileLimits limits;
  limits.max_bytes = 1 << 20;
  limits.limit_name = "--max_model_mb=1";
  ExpectRefused(ReadRegularFile("/dev/zero", limits).status(),
                "/dev/zero: is a character device, not a regular file");
  EXPECT_EQ(ReadRegularFile("/nonexistent/x", limits).status(),
            absl::NotFoundError(
                "/nonexistent/x: cannot open: No such file or directory"));
}

TEST(ModelRepositoryFilesTest, FifosAreRefusedAtOnce) {
  for (const char* file : {"weights.safetensors", "config.pbtxt"}) {
    TempRepository repo;
    ModelRepository models(repo.root());
    ServeModelM(repo, models);
    const std::string path = repo.root() + "/m/" + file;
    fs::remove(path);
    ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << path;
    const std::string refusal = path + ": is a FIFO, not a regular file";
    ExpectRefused(LoadOneInTime(models, "m", path), refusal);
    ExpectRefused(models.Reload(), refusal);
    ExpectModelMServes(models);
  }
}

TEST(ModelRepositoryFilesTest, DirectoriesAreRefusedNamingTheFile) {
  for (const char* file : {"weights.safetensors", "config.pbtxt"}) {
    TempRepository repo;
    ModelRepository models(repo.root());
    ServeModelM(repo, models);
    const std::string path = repo.root() + "/m/" + file;
    fs::remove(path);
    fs::create_directory(path);
    const std::string refusal = path + ": is a directory, not a regular file";
    ExpectRefused(LoadOneInTime(models, "m"), refusal);
    ExpectRefused(models.Reload(), refusal);
    ExpectModelMServes(models);
  }
}

// The refusal reaches a gRPC client as it is (an exception escaping the
// read used to answer UNIMPLEMENTED with no message).
TEST(ModelRepositoryFilesTest, RepositoryModelLoadAnswersTheRefusal) {
  TempRepository repo;
  repo.Write("m", kConfig, StateDict(1));
  ServerOptions options;
  options.model_repository = repo.root();
  TestServer server(options);
  const std::string weights = repo.root() + "/m/weights.safetensors";
  fs::remove(weights);
  fs::create_directory(weights);
  auto triton = inference::GRPCInferenceService::NewStub(
      grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(30));
  inference::RepositoryModelLoadRequest load;
  load.set_model_name("m");
  inference::RepositoryModelLoadResponse loaded;
  const grpc::Status status =
      triton->RepositoryModelLoad(&context, load, &loaded);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(status.error_message(),
            weights + ": is a directory, not a regular file");
  v1::MultiHeadAttendRequest request = QueryRequest(2);
  request.set_model("m");
  EXPECT_TRUE(server.MakeClient().MultiHeadAttend(request).ok());
}

TEST(ModelRepositoryFilesTest, FilesOverMaxModelMbAreRefusedNamingTheFlag) {
  TempRepository repo;
  ModelRepository models(repo.root(), /*max_model_mb=*/1);
  ServeModelM(repo, models);
  repo.Write("m", kConfig, StateDict(2, /*e=*/512));  // 4 MiB of weights
  const std::string weights = repo.root() + "/m/weights.safetensors";
  const std::string refusal =
      absl::StrCat(weights, ": ", fs::file_size(weights),
                   " bytes, more than the 1048576 bytes --max_model_mb=1 "
                   "allows");
  ExpectRefused(LoadOneInTime(models, "m"), refusal);
  ExpectRefused(models.Reload(), refusal);
  ExpectModelMServes(models);
  ModelRepository larger(repo.root(), /*max_model_mb=*/5);
  EXPECT_TRUE(larger.Reload().ok());
}

TEST(ModelRepositoryFilesTest, SymlinksMayLeadOnlyWithinTheRepository) {
  TempRepository repo;
  TempRepository outside;
  outside.Write("elsewhere", kConfig, StateDict(3));
  ModelRepository models(repo.root());
  ServeModelM(repo, models);
  // Within: a second name for a folder, and weights shared between models.
  fs::create_directory_symlink("m", repo.root() + "/alias");
  fs::create_directory(repo.root() + "/shared");
  std::ofstream(repo.root() + "/shared/config.pbtxt") << kConfig;
  fs::create_symlink("../m/weights.safetensors",
                     repo.root() + "/shared/weights.safetensors");
  ASSERT_TRUE(models.Reload().ok()) << models.Reload();
  EXPECT_EQ(models.List().size(), 3u);
  EXPECT_TRUE(models.Find("alias").ok());
  EXPECT_TRUE(models.Find("shared").ok());

  // Out: a folder symlinked to one outside, as a whole or file by file.
  const std::string link = repo.root() + "/out";
  fs::create_directory_symlink(outside.root() + "/elsewhere", link);
  const std::string refusal =
      link + ": resolves to '" +
      fs::canonical(outside.root() + "/elsewhere").string() + "', outside '" +
      fs::canonical(repo.root()).string() +
      "' (symlinks may lead only within it)";
  ExpectRefused(LoadOneInTime(models, "out"), refusal);
  ExpectRefused(models.Reload(), refusal);
  EXPECT_EQ(models.Find("out").status().code(), absl::StatusCode::kNotFound);
  ExpectModelMServes(models);
  fs::remove(link);
  fs::create_directory(link);
  fs::create_symlink(outside.root() + "/elsewhere/config.pbtxt",
                     link + "/config.pbtxt");
  fs::copy_file(outside.root() + "/elsewhere/weights.safetensors",
                link + "/weights.safetensors");
  const absl::Status file_out = LoadOneInTime(models, "out");
  EXPECT_EQ(file_out.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StartsWith(file_out.message(),
                               link + "/config.pbtxt: resolves to '"))
      << file_out;
  ExpectModelMServes(models);
}

TEST(ModelRepositoryFilesTest, UnreadableEntriesDoNotThrow) {
  TempRepository repo;
  ModelRepository models(repo.root());
  ServeModelM(repo, models);
  // A symlink loop is no folder: listed by nothing, loaded by nothing.
  fs::create_directory_symlink("loop", repo.root() + "/loop");
  EXPECT_TRUE(models.Reload().ok());
  EXPECT_EQ(models.Folders(), std::vector<std::string>{"m"});
  EXPECT_EQ(models.LoadOne("loop").code(), absl::StatusCode::kNotFound);
  // ReadFileToString reads anything readable, and reports a directory.
  const absl::Status directory =
      ReadFileToString(repo.root(), "--auth_token_file").status();
  EXPECT_EQ(directory.code(), absl::StatusCode::kDataLoss) << directory;
  EXPECT_TRUE(absl::StartsWith(directory.message(), "--auth_token_file: "))
      << directory;
  ExpectModelMServes(models);
}

TEST(AttentionWeightsTableTest, CoversEveryTensorFieldOfTheProto) {
  const google::protobuf::Descriptor* message =
      v1::AttentionWeights::descriptor();
  int tensor_fields = 0;
  for (int i = 0; i < message->field_count(); ++i) {
    if (message->field(i)->message_type() == v1::Tensor::descriptor()) {
      ++tensor_fields;
    }
  }
  EXPECT_EQ(tensor_fields, static_cast<int>(kMultiHeadWeightFields.size()));
  for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
    const google::protobuf::FieldDescriptor* descriptor =
        message->FindFieldByName(std::string(field.name));
    ASSERT_NE(descriptor, nullptr) << field.name;
    EXPECT_EQ(descriptor->message_type(), v1::Tensor::descriptor());
    EXPECT_EQ(FindMultiHeadWeightField(field.name), &field);
    EXPECT_EQ(MultiHeadWeightFieldName(field.member), field.name);
  }
  ASSERT_NE(FindMultiHeadWeightField("out_proj.weight"), nullptr);
  EXPECT_EQ(FindMultiHeadWeightField("out_proj.weight")->name,
            "out_proj_weight");
  EXPECT_EQ(FindMultiHeadWeightField("out_proj.bias")->name, "out_proj_bias");
  EXPECT_EQ(FindMultiHeadWeightField("in_proj.weight"), nullptr);
  EXPECT_EQ(FindMultiHeadWeightField(""), nullptr);
}

TEST(AttentionWeightsTableTest, EveryFieldRoundTripsThroughTheWire) {
  std::mt19937 rng(7);
  v1::AttentionWeights wire;
  wire.set_num_heads(3);
  // Field i gets a [i + 1] tensor, so that a mixed-up field shows.
  int64_t len = 1;
  for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
    EXPECT_EQ(FindWeightTensor(wire, field), nullptr) << field.name;
    *MutableWeightTensor(&wire, field) =
        RandomWireTensor(DType::kFloat32, {len++}, rng);
  }
  EXPECT_EQ(wire.out_proj_bias().shape(0), 10);
  auto decoded = DecodeAttentionWeights(wire);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->num_heads, 3);
  len = 1;
  for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
    ASSERT_NE(FindWeightTensor(wire, field), nullptr) << field.name;
    const std::optional<TensorView>& view = (*decoded).*field.member;
    ASSERT_TRUE(view.has_value()) << field.name;
    EXPECT_EQ(view->shape, Shape{len++}) << field.name;
  }

  // Unset fields stay absent; a bad one fails, named.
  v1::AttentionWeights partial;
  *partial.mutable_k_proj_bias() = RandomWireTensor(DType::kFloat32, {4}, rng);
  decoded = DecodeAttentionWeights(partial);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(decoded->k_proj_bias.has_value());
  EXPECT_FALSE(decoded->q_proj_weight.has_value());
  EXPECT_FALSE(decoded->out_proj_bias.has_value());
  partial.mutable_out_proj_bias()->set_dtype(v1::DATA_TYPE_UNSPECIFIED);
  decoded = DecodeAttentionWeights(partial);
  ASSERT_FALSE(decoded.ok());
  EXPECT_TRUE(absl::StartsWith(decoded.status().message(),
                               "out_proj_bias: dtype is DATA_TYPE_UNSPECIFIED"))
      << decoded.status();
}

}  // namespace
}  // namespace attnserve::testing
