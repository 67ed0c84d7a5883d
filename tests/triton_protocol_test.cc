// Triton's protocol extensions through a live server, over gRPC and
// HTTP/JSON, each test making the calls of one of Triton's published client
// examples in their order (simple_{grpc,http}_health_metadata,
// simple_{grpc,http}_infer_client, simple_{grpc,http}_shm_client,
// simple_{grpc,http}_model_control, the stream of
// simple_grpc_sequence_stream_infer_client without its sequence), with only
// model, input and output names, shapes and dtypes changed: what a Triton
// user's client sends, and what it must get back.
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/shared_memory.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "inference/grpc_service.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "proto/tensor_codec.h"
#include "tests/reference.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using json = nlohmann::json;

std::unique_ptr<grpc::ClientContext> Context() {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::seconds(60));
  return context;
}

std::vector<float> Floats(const std::string& raw) {
  std::vector<float> values(raw.size() / sizeof(float));
  std::memcpy(values.data(), raw.data(), raw.size());
  return values;
}

std::string Bytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()),
                     values.size() * sizeof(float));
}

// Random floats in [-1, 1).
std::vector<float> RandomFloats(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1, 1);
  std::vector<float> values(n);
  for (float& v : values) v = uniform(rng);
  return values;
}

// The attention of (q, k, v), each [2, 3, 8], in float64.
std::vector<double> Reference(const std::vector<float>& q,
                              const std::vector<float>& k,
                              const std::vector<float>& v) {
  const Shape shape = {2, 3, 8};
  const auto ref = [&](const std::vector<float>& x) {
    return RefTensor{shape, std::vector<double>(x.begin(), x.end())};
  };
  return RefAttend(ref(q), ref(k), ref(v), {}, {}, {}).output.values;
}

void ExpectNear(const std::vector<float>& actual,
                const std::vector<double>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], 1e-5) << "element " << i;
  }
}

constexpr const char* kNames[] = {"query", "key", "value"};

class TritonProtocolTest : public ::testing::Test {
 protected:
  static ServerOptions Options(const TempModelRepository& repo) {
    ServerOptions options;
    options.model_repository = repo.root();
    return options;
  }

  TritonProtocolTest()
      : repo_("triton_protocol"),
        server_(Options(repo_)),
        channel_(grpc::CreateChannel(server_.target(),
                                     grpc::InsecureChannelCredentials())),
        native_(v1::AttentionService::NewStub(channel_)),
        triton_(inference::GRPCInferenceService::NewStub(channel_)),
        http_("127.0.0.1", server_.http_port()) {
    http_.set_read_timeout(60);
    for (auto& values : qkv_) values = RandomFloats(2 * 3 * 8, rng_);
  }

  // The attend request of the infer examples: three FP32 [2, 3, 8] inputs
  // as raw contents, output "output" requested.
  ModelInferRequest AttendRequest(const std::string& id = "") const {
    ModelInferRequest request;
    request.set_model_name("attend");
    request.set_id(id);
    for (int i = 0; i < 3; ++i) {
      auto* input = request.add_inputs();
      input->set_name(kNames[i]);
      input->set_datatype("FP32");
      for (int64_t d : {2, 3, 8}) input->add_shape(d);
      request.add_raw_input_contents(Bytes(qkv_[i]));
    }
    request.add_outputs()->set_name("output");
    return request;
  }

  std::vector<double> Expected() const {
    return Reference(qkv_[0], qkv_[1], qkv_[2]);
  }

  inference::ModelStatistics Statistics(const std::string& model) {
    inference::ModelStatisticsRequest request;
    request.set_name(model);
    inference::ModelStatisticsResponse response;
    const grpc::Status status =
        triton_->ModelStatistics(Context().get(), request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.model_stats_size(), 1);
    return response.model_stats_size() == 1 ? response.model_stats(0)
                                            : inference::ModelStatistics();
  }

  bool Ready(const std::string& model) {
    inference::ModelReadyRequest request;
    request.set_name(model);
    inference::ModelReadyResponse response;
    const grpc::Status status =
        triton_->ModelReady(Context().get(), request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.ready();
  }

  json Get(const std::string& path, int expected_status = 200) {
    auto result = http_.Get(path.c_str());
    if (!result) {
      ADD_FAILURE() << "GET " << path << ": no answer";
      return nullptr;
    }
    EXPECT_EQ(result->status, expected_status) << path << ": " << result->body;
    return json::parse(result->body);
  }
  json Post(const std::string& path, const std::string& body,
            int expected_status = 200) {
    auto result = http_.Post(path.c_str(), body, "application/json");
    if (!result) {
      ADD_FAILURE() << "POST " << path << ": no answer";
      return nullptr;
    }
    EXPECT_EQ(result->status, expected_status) << path << ": " << result->body;
    return json::parse(result->body);
  }

  std::mt19937 rng_{26};
  std::vector<float> qkv_[3];
  TempModelRepository repo_;
  TestServer server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> native_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> triton_;
  httplib::Client http_;
};

// The names and optional flags of a config's inputs.
std::vector<std::string> ConfigInputs(const inference::ModelConfig& config) {
  std::vector<std::string> names;
  for (const auto& input : config.input()) {
    names.push_back(absl::StrCat(input.name(), input.optional() ? "?" : ""));
  }
  return names;
}

// simple_grpc_health_metadata: live, ready, model ready, server metadata,
// model metadata, then (as perf_analyzer and model_analyzer begin) the
// model configuration.
TEST_F(TritonProtocolTest, GrpcHealthMetadataAndConfig) {
  inference::ServerLiveResponse live;
  ASSERT_TRUE(triton_->ServerLive(Context().get(), {}, &live).ok());
  EXPECT_TRUE(live.live());
  inference::ServerReadyResponse ready;
  ASSERT_TRUE(triton_->ServerReady(Context().get(), {}, &ready).ok());
  EXPECT_TRUE(ready.ready());
  EXPECT_TRUE(Ready("mha"));
  EXPECT_TRUE(Ready("attend"));
  // A model not served: ready false, not an error.
  EXPECT_FALSE(Ready("wrong_model_name"));

  inference::ServerMetadataResponse server;
  ASSERT_TRUE(triton_->ServerMetadata(Context().get(), {}, &server).ok());
  EXPECT_EQ(server.name(), "attnserve");
  EXPECT_THAT(
      server.extensions(),
      ElementsAre("parameters", "binary_tensor_data", "model_configuration",
                  "system_shared_memory", "statistics", "model_repository"));

  inference::ModelMetadataRequest metadata_request;
  metadata_request.set_name("mha");
  inference::ModelMetadataResponse metadata;
  ASSERT_TRUE(
      triton_->ModelMetadata(Context().get(), metadata_request, &metadata)
          .ok());
  ASSERT_EQ(metadata.inputs_size(), 5);
  EXPECT_TRUE(metadata.inputs(0).parameters().empty());  // query: required
  EXPECT_TRUE(metadata.inputs(2).parameters().at("optional").bool_param())
      << "value may be left out (the key is used)";

  inference::ModelConfigRequest config_request;
  config_request.set_name("mha");
  inference::ModelConfigResponse config;
  grpc::Status status =
      triton_->ModelConfig(Context().get(), config_request, &config);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const inference::ModelConfig& mha = config.config();
  EXPECT_EQ(mha.name(), "mha");
  EXPECT_EQ(mha.platform(), "attnserve_multi_head_attention");
  EXPECT_EQ(mha.backend(), "attnserve");
  EXPECT_EQ(mha.max_batch_size(), 0);
  EXPECT_THAT(ConfigInputs(mha),
              ElementsAre("query", "key?", "value?", "attn_mask?",
                          "key_padding_mask?"));
  EXPECT_EQ(mha.input(0).data_type(), inference::TYPE_FP32);
  EXPECT_THAT(mha.input(0).dims(), ElementsAre(-1, -1, 16));
  EXPECT_EQ(mha.input(3).data_type(), inference::TYPE_BOOL);
  EXPECT_THAT(mha.input(3).dims(), ElementsAre(-1, 4, -1, -1));
  ASSERT_EQ(mha.output_size(), 2);
  EXPECT_EQ(mha.output(0).name(), "output");
  EXPECT_EQ(mha.output(0).data_type(), inference::TYPE_FP32);
  EXPECT_THAT(mha.output(0).dims(), ElementsAre(-1, -1, 16));
  EXPECT_EQ(mha.parameters().at("num_heads").string_value(), "4");
  EXPECT_EQ(mha.parameters().at("value_default").string_value(), "key");
  EXPECT_EQ(mha.parameters().at("request_parameters").string_value(),
            "causal, scale, temperature, return_weights, average_weights, "
            "compute_bf16");

  // The built-in models.
  config_request.set_name("attend");
  ASSERT_TRUE(
      triton_->ModelConfig(Context().get(), config_request, &config).ok());
  EXPECT_THAT(ConfigInputs(config.config()),
              ElementsAre("query", "key", "value", "attn_mask?"));
  EXPECT_EQ(config.config().platform(), "attnserve_builtin");
  config_request.set_name("layer_norm");
  ASSERT_TRUE(
      triton_->ModelConfig(Context().get(), config_request, &config).ok());
  EXPECT_THAT(ConfigInputs(config.config()),
              ElementsAre("input", "gamma?", "beta?"));

  config_request.set_name("wrong_model_name");
  status = triton_->ModelConfig(Context().get(), config_request, &config);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(),
            "model: 'wrong_model_name' not found; loaded models: mha");
  config_request.set_name("mha");
  config_request.set_version("2");
  status = triton_->ModelConfig(Context().get(), config_request, &config);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(),
            "version: model 'mha' has only version 1, not '2'");
}

// simple_http_health_metadata, then the configuration.
TEST_F(TritonProtocolTest, HttpHealthMetadataAndConfig) {
  EXPECT_EQ(http_.Get("/v2/health/live")->status, 200);
  EXPECT_EQ(http_.Get("/v2/health/ready")->status, 200);
  EXPECT_EQ(Get("/v2/models/mha/ready")["ready"], true);
  EXPECT_EQ(Get("/v2/models/wrong_model_name/ready", 503)["ready"], false);
  EXPECT_EQ(Get("/v2")["extensions"],
            json({"parameters", "binary_tensor_data", "model_configuration",
                  "system_shared_memory", "statistics", "model_repository"}));
  const json metadata = Get("/v2/models/mha");
  EXPECT_EQ(metadata["inputs"][2]["name"], "value");
  EXPECT_EQ(metadata["inputs"][2]["parameters"], json({{"optional", true}}));
  EXPECT_FALSE(metadata["inputs"][0].contains("parameters"));

  for (const char* path :
       {"/v2/models/mha/config", "/v2/models/mha/versions/1/config"}) {
    const json config = Get(path);
    EXPECT_EQ(config["name"], "mha");
    EXPECT_EQ(config["backend"], "attnserve");
    EXPECT_EQ(config["max_batch_size"], 0);
    EXPECT_EQ(config["input"][0], json({{"name", "query"},
                                        {"data_type", "TYPE_FP32"},
                                        {"format", "FORMAT_NONE"},
                                        {"dims", {-1, -1, 16}},
                                        {"optional", false}}));
    EXPECT_EQ(config["input"][3]["data_type"], "TYPE_BOOL");
    EXPECT_EQ(config["input"][3]["optional"], true);
    EXPECT_EQ(config["output"][1]["name"], "weights");
    EXPECT_EQ(config["parameters"]["num_heads"], json({{"string_value", "4"}}));
  }
  EXPECT_EQ(Get("/v2/models/wrong_model_name/config", 404)["error"],
            "model: 'wrong_model_name' not found; loaded models: mha");
  EXPECT_EQ(Get("/v2/models/mha/versions/2/config", 404)["error"],
            "version: model 'mha' has only version 1, not '2'");
}

// simple_grpc_infer_client and simple_http_infer_client: one inference,
// outputs checked; then the statistics the calls left.
TEST_F(TritonProtocolTest, InferOverBothProtocolsThenStatistics) {
  ModelInferResponse response;
  grpc::Status status =
      triton_->ModelInfer(Context().get(), AttendRequest("1"), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.outputs_size(), 1);
  EXPECT_EQ(response.id(), "1");
  EXPECT_THAT(response.outputs(0).shape(), ElementsAre(2, 3, 8));
  ExpectNear(Floats(response.raw_output_contents(0)), Expected());

  json body = {{"id", "2"}, {"inputs", json::array()}};
  for (int i = 0; i < 3; ++i) {
    body["inputs"].push_back({{"name", kNames[i]},
                              {"datatype", "FP32"},
                              {"shape", {2, 3, 8}},
                              {"data", qkv_[i]}});
  }
  body["outputs"] = {{{"name", "output"}}};
  const json answer = Post("/v2/models/attend/infer", body.dump());
  EXPECT_EQ(answer["id"], "2");
  EXPECT_EQ(answer["outputs"][0]["data"].get<std::vector<float>>(),
            Floats(response.raw_output_contents(0)));

  // A call that fails: counted as a failure of its model.
  ModelInferRequest bad = AttendRequest();
  bad.mutable_inputs(1)->set_shape(2, 4);
  bad.set_raw_input_contents(1, std::string(2 * 3 * 4 * 4, '\0'));
  status = triton_->ModelInfer(Context().get(), bad, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  const inference::ModelStatistics stats = Statistics("attend");
  EXPECT_EQ(stats.name(), "attend");
  EXPECT_EQ(stats.version(), "1");
  EXPECT_EQ(stats.inference_count(), 2);
  EXPECT_EQ(stats.execution_count(), 2);
  EXPECT_GT(stats.last_inference(), 0);
  const inference::InferStatistics& infer = stats.inference_stats();
  EXPECT_EQ(infer.success().count(), 2);
  EXPECT_EQ(infer.fail().count(), 1);
  EXPECT_GT(infer.fail().ns(), 0);
  EXPECT_EQ(infer.queue().count(), 2);
  EXPECT_EQ(infer.compute_infer().count(), 2);
  EXPECT_EQ(infer.compute_output().count(), 2);
  EXPECT_GT(infer.compute_infer().ns(), 0);
  // Each call's time is its queue, compute and output time.
  EXPECT_EQ(infer.success().ns(), infer.queue().ns() +
                                      infer.compute_infer().ns() +
                                      infer.compute_output().ns());
  // Models with no calls are listed with zero counts.
  EXPECT_EQ(Statistics("mha").inference_stats().success().count(), 0);

  inference::ModelStatisticsRequest all;
  inference::ModelStatisticsResponse every;
  ASSERT_TRUE(triton_->ModelStatistics(Context().get(), all, &every).ok());
  std::vector<std::string> names;
  for (const auto& model : every.model_stats()) names.push_back(model.name());
  EXPECT_THAT(names,
              ElementsAre("attend", "layer_norm", "mha", "multi_head_attend"));
  inference::ModelStatisticsRequest unknown;
  unknown.set_name("wrong_model_name");
  status = triton_->ModelStatistics(Context().get(), unknown, &every);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(),
            "name: model 'wrong_model_name' is not served");

  // The native RPC is the same model's call.
  v1::AttendRequest native;
  for (int i = 0; i < 3; ++i) {
    v1::Tensor* tensor = i == 0   ? native.mutable_query()
                         : i == 1 ? native.mutable_key()
                                  : native.mutable_value();
    tensor->set_dtype(v1::DATA_TYPE_FLOAT32);
    for (int64_t d : {2, 3, 8}) tensor->add_shape(d);
    tensor->set_raw_data(Bytes(qkv_[i]));
  }
  v1::AttendResponse native_response;
  ASSERT_TRUE(native_->Attend(Context().get(), native, &native_response).ok());

  const json http_stats = Get("/v2/models/attend/stats");
  ASSERT_EQ(http_stats["model_stats"].size(), 1);
  const json& attend = http_stats["model_stats"][0];
  EXPECT_EQ(attend["name"], "attend");
  EXPECT_EQ(attend["inference_count"], 3);
  EXPECT_EQ(attend["inference_stats"]["success"]["count"], 3);
  EXPECT_EQ(attend["inference_stats"]["fail"]["count"], 1);
  EXPECT_EQ(attend["inference_stats"]["compute_input"],
            json({{"count", 0}, {"ns", 0}}));
  EXPECT_EQ(Get("/v2/models/stats")["model_stats"].size(), 4);
  EXPECT_EQ(Get("/v2/models/attend/versions/1/stats")["model_stats"].size(), 1);
  EXPECT_EQ(Get("/v2/models/wrong_model_name/stats", 404)["error"],
            "name: model 'wrong_model_name' is not served");
}

// simple_grpc_shm_client: unregister everything, register an output and an
// input region, check their status, infer through them, read the output
// from shared memory, unregister.
TEST_F(TritonProtocolTest, GrpcSystemSharedMemory) {
  inference::SystemSharedMemoryUnregisterResponse unregistered;
  ASSERT_TRUE(
      triton_->SystemSharedMemoryUnregister(Context().get(), {}, &unregistered)
          .ok());
  const size_t bytes = 2 * 3 * 8 * sizeof(float);
  auto output_shm =
      SharedMemoryBuffer::Create(UniqueSharedMemoryKey("output_simple"), bytes);
  ASSERT_TRUE(output_shm.ok()) << output_shm.status();
  auto input_shm = SharedMemoryBuffer::Create(
      UniqueSharedMemoryKey("input_simple"), 3 * bytes);
  ASSERT_TRUE(input_shm.ok()) << input_shm.status();
  for (int i = 0; i < 3; ++i) {
    std::memcpy((*input_shm)->data() + i * bytes, qkv_[i].data(), bytes);
  }
  const auto register_region = [&](const std::string& name,
                                   const std::string& key, uint64_t size) {
    inference::SystemSharedMemoryRegisterRequest request;
    request.set_name(name);
    request.set_key(key);
    request.set_offset(0);
    request.set_byte_size(size);
    inference::SystemSharedMemoryRegisterResponse response;
    return triton_->SystemSharedMemoryRegister(Context().get(), request,
                                               &response);
  };
  ASSERT_TRUE(register_region("output_data", (*output_shm)->key(), bytes).ok());
  ASSERT_TRUE(
      register_region("input_data", (*input_shm)->key(), 3 * bytes).ok());

  inference::SystemSharedMemoryStatusResponse status_response;
  ASSERT_TRUE(
      triton_->SystemSharedMemoryStatus(Context().get(), {}, &status_response)
          .ok());
  ASSERT_EQ(status_response.regions_size(), 2);
  const auto& input_status = status_response.regions().at("input_data");
  EXPECT_EQ(input_status.name(), "input_data");
  EXPECT_EQ(input_status.key(), (*input_shm)->key());
  EXPECT_EQ(input_status.offset(), 0);
  EXPECT_EQ(input_status.byte_size(), 3 * bytes);
  // One registry: attnserve's own RPC sees the regions.
  v1::ListSharedMemoryResponse native_list;
  ASSERT_TRUE(
      native_->ListSharedMemory(Context().get(), {}, &native_list).ok());
  EXPECT_EQ(native_list.regions_size(), 2);

  ModelInferRequest request = AttendRequest();
  request.clear_raw_input_contents();
  for (int i = 0; i < 3; ++i) {
    auto& parameters = *request.mutable_inputs(i)->mutable_parameters();
    parameters["shared_memory_region"].set_string_param("input_data");
    parameters["shared_memory_byte_size"].set_int64_param(bytes);
    parameters["shared_memory_offset"].set_int64_param(i * bytes);
  }
  auto& output_parameters = *request.mutable_outputs(0)->mutable_parameters();
  output_parameters["shared_memory_region"].set_string_param("output_data");
  output_parameters["shared_memory_byte_size"].set_int64_param(bytes);
  ModelInferResponse response;
  grpc::Status status =
      triton_->ModelInfer(Context().get(), request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ExpectNear(Floats(std::string((*output_shm)->data(), bytes)), Expected());

  // Errors of the shared-memory calls: the native registry's.
  status = register_region("output_data", (*output_shm)->key(), bytes);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  status = register_region("more", (*output_shm)->key(), 2 * bytes);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("byte_size"));
  inference::SystemSharedMemoryStatusRequest one;
  one.set_name("no_such_region");
  status =
      triton_->SystemSharedMemoryStatus(Context().get(), one, &status_response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  inference::CudaSharedMemoryRegisterResponse cuda;
  status = triton_->CudaSharedMemoryRegister(Context().get(), {}, &cuda);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(status.error_message(),
            "CUDA shared memory is not supported: attnserve computes on CPU; "
            "register system shared memory instead");

  inference::SystemSharedMemoryUnregisterRequest input_only;
  input_only.set_name("input_data");
  ASSERT_TRUE(triton_
                  ->SystemSharedMemoryUnregister(Context().get(), input_only,
                                                 &unregistered)
                  .ok());
  status_response.Clear();
  ASSERT_TRUE(
      triton_->SystemSharedMemoryStatus(Context().get(), {}, &status_response)
          .ok());
  EXPECT_EQ(status_response.regions_size(), 1);
  ASSERT_TRUE(
      triton_->SystemSharedMemoryUnregister(Context().get(), {}, &unregistered)
          .ok());
  status_response.Clear();
  ASSERT_TRUE(
      triton_->SystemSharedMemoryStatus(Context().get(), {}, &status_response)
          .ok());
  EXPECT_EQ(status_response.regions_size(), 0);
}

// simple_http_shm_client: the same over HTTP/JSON.
TEST_F(TritonProtocolTest, HttpSystemSharedMemory) {
  Post("/v2/systemsharedmemory/unregister", "");
  const size_t bytes = 2 * 3 * 8 * sizeof(float);
  auto output_shm =
      SharedMemoryBuffer::Create(UniqueSharedMemoryKey("output_simple"), bytes);
  ASSERT_TRUE(output_shm.ok()) << output_shm.status();
  auto input_shm = SharedMemoryBuffer::Create(
      UniqueSharedMemoryKey("input_simple"), 3 * bytes);
  ASSERT_TRUE(input_shm.ok()) << input_shm.status();
  for (int i = 0; i < 3; ++i) {
    std::memcpy((*input_shm)->data() + i * bytes, qkv_[i].data(), bytes);
  }
  EXPECT_EQ(Post("/v2/systemsharedmemory/region/output_data/register",
                 json({{"key", (*output_shm)->key()},
                       {"offset", 0},
                       {"byte_size", bytes}})
                     .dump()),
            json::object());
  Post("/v2/systemsharedmemory/region/input_data/register",
       json({{"key", (*input_shm)->key()},
             {"offset", 0},
             {"byte_size", 3 * bytes}})
           .dump());
  EXPECT_EQ(Get("/v2/systemsharedmemory/status"),
            json({{{"name", "input_data"},
                   {"key", (*input_shm)->key()},
                   {"offset", 0},
                   {"byte_size", 3 * bytes}},
                  {{"name", "output_data"},
                   {"key", (*output_shm)->key()},
                   {"offset", 0},
                   {"byte_size", bytes}}}));
  EXPECT_EQ(Get("/v2/systemsharedmemory/region/output_data/status").size(), 1);

  json body = {{"inputs", json::array()}};
  for (int i = 0; i < 3; ++i) {
    body["inputs"].push_back({{"name", kNames[i]},
                              {"datatype", "FP32"},
                              {"shape", {2, 3, 8}},
                              {"parameters",
                               {{"shared_memory_region", "input_data"},
                                {"shared_memory_byte_size", bytes},
                                {"shared_memory_offset", i * bytes}}}});
  }
  body["outputs"] = {{{"name", "output"},
                      {"parameters",
                       {{"shared_memory_region", "output_data"},
                        {"shared_memory_byte_size", bytes}}}}};
  const json answer = Post("/v2/models/attend/infer", body.dump());
  EXPECT_EQ(answer["outputs"][0]["parameters"]["shared_memory_region"],
            "output_data");
  EXPECT_FALSE(answer["outputs"][0].contains("data"));
  ExpectNear(Floats(std::string((*output_shm)->data(), bytes)), Expected());

  EXPECT_THAT(
      Post("/v2/systemsharedmemory/region/input_data/register",
           json({{"key", (*input_shm)->key()}, {"byte_size", 4}}).dump(),
           400)["error"]
          .get<std::string>(),
      HasSubstr("input_data"));
  EXPECT_EQ(Post("/v2/systemsharedmemory/region/x/register",
                 json({{"key", (*input_shm)->key()}}).dump(), 400)["error"],
            "byte_size: missing");
  EXPECT_EQ(Post("/v2/systemsharedmemory/region/x/register",
                 json({{"key", (*input_shm)->key()}, {"byte_size", -1}}).dump(),
                 400)["error"],
            "byte_size: expected a non-negative integer");
  EXPECT_EQ(Get("/v2/cudasharedmemory/status", 400)["error"],
            "CUDA shared memory is not supported: attnserve computes on CPU; "
            "register system shared memory instead");
  Post("/v2/systemsharedmemory/region/input_data/unregister", "");
  EXPECT_EQ(Get("/v2/systemsharedmemory/status").size(), 1);
  Post("/v2/systemsharedmemory/unregister", "");
  EXPECT_EQ(Get("/v2/systemsharedmemory/status"), json::array());
  EXPECT_EQ(
      http_.Get("/v2/systemsharedmemory/region/output_data/status")->status,
      404);
}

// simple_grpc_model_control: index, unload, not ready, load, ready.
TEST_F(TritonProtocolTest, GrpcModelControl) {
  const auto index = [&](bool ready_only) {
    inference::RepositoryIndexRequest request;
    request.set_ready(ready_only);
    inference::RepositoryIndexResponse response;
    const grpc::Status status =
        triton_->RepositoryIndex(Context().get(), request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    std::vector<std::string> entries;
    for (const auto& model : response.models()) {
      entries.push_back(absl::StrCat(model.name(), ":", model.version(), ":",
                                     model.state(), ":", model.reason()));
    }
    return entries;
  };
  EXPECT_THAT(index(false),
              ElementsAre("attend:1:READY:", "layer_norm:1:READY:",
                          "mha:1:READY:", "multi_head_attend:1:READY:"));

  inference::RepositoryModelUnloadRequest unload;
  unload.set_model_name("mha");
  // Triton's clients always send this parameter.
  (*unload.mutable_parameters())["unload_dependents"].set_bool_param(false);
  inference::RepositoryModelUnloadResponse unloaded;
  grpc::Status status =
      triton_->RepositoryModelUnload(Context().get(), unload, &unloaded);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_FALSE(Ready("mha"));
  EXPECT_THAT(
      index(false),
      ElementsAre("attend:1:READY:", "layer_norm:1:READY:",
                  "mha::UNAVAILABLE:unloaded", "multi_head_attend:1:READY:"));
  EXPECT_EQ(index(true).size(), 3);
  ModelInferRequest on_mha = AttendRequest();
  on_mha.set_model_name("mha");
  for (int i = 0; i < 3; ++i) {
    on_mha.mutable_inputs(i)->set_shape(2, 16);
    on_mha.set_raw_input_contents(i, Bytes(RandomFloats(2 * 3 * 16, rng_)));
  }
  on_mha.mutable_outputs()->Clear();
  ModelInferResponse response;
  status = triton_->ModelInfer(Context().get(), on_mha, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  status = triton_->RepositoryModelUnload(Context().get(), unload, &unloaded);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), "model_name: 'mha' is not loaded");

  inference::RepositoryModelLoadRequest load;
  load.set_model_name("mha");
  inference::RepositoryModelLoadResponse loaded;
  status = triton_->RepositoryModelLoad(Context().get(), load, &loaded);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(Ready("mha"));
  status = triton_->ModelInfer(Context().get(), on_mha, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_THAT(response.outputs(0).shape(), ElementsAre(2, 3, 16));

  load.set_model_name("wrong_model_name");
  status = triton_->RepositoryModelLoad(Context().get(), load, &loaded);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(),
            absl::StrCat("model_name: 'wrong_model_name' is not a folder of "
                         "the model repository ",
                         repo_.root()));
  load.set_model_name("../mha");
  status = triton_->RepositoryModelLoad(Context().get(), load, &loaded);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  load.set_model_name("mha");
  (*load.mutable_parameters())["config"].set_string_param("{}");
  status = triton_->RepositoryModelLoad(Context().get(), load, &loaded);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("parameters: 'config'"));
  unload.set_model_name("attend");
  status = triton_->RepositoryModelUnload(Context().get(), unload, &unloaded);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(status.error_message(),
            "model_name: 'attend' is built in and cannot be unloaded");
}

// simple_http_model_control.
TEST_F(TritonProtocolTest, HttpModelControl) {
  const json index = Post("/v2/repository/index", "");
  ASSERT_EQ(index.size(), 4);
  EXPECT_EQ(index[2], json({{"name", "mha"},
                            {"version", "1"},
                            {"state", "READY"},
                            {"reason", ""}}));
  EXPECT_EQ(Post("/v2/repository/models/mha/unload",
                 R"({"parameters": {"unload_dependents": false}})"),
            json::object());
  EXPECT_EQ(http_.Get("/v2/models/mha/ready")->status, 503);
  EXPECT_EQ(
      Post("/v2/repository/index", R"({"ready": false})")[2],
      json(
          {{"name", "mha"}, {"state", "UNAVAILABLE"}, {"reason", "unloaded"}}));
  EXPECT_EQ(Post("/v2/repository/index", R"({"ready": true})").size(), 3);
  EXPECT_EQ(Post("/v2/repository/models/mha/load", ""), json::object());
  EXPECT_EQ(http_.Get("/v2/models/mha/ready")->status, 200);
  EXPECT_EQ(Post("/v2/repository/models/mha/unload", "[1]", 400)["error"],
            "body: expected a JSON object");
  EXPECT_EQ(
      Post("/v2/repository/models/wrong_model_name/load", "", 404)["error"],
      absl::StrCat("model_name: 'wrong_model_name' is not a folder of "
                   "the model repository ",
                   repo_.root()));
  EXPECT_EQ(http_.Get("/v2/repository/index")->status, 405);
}

// The stream of simple_grpc_sequence_stream_infer_client (without its
// sequence): requests written one after another, answers read in order;
// a bad request gets an error response and the stream goes on.
TEST_F(TritonProtocolTest, StreamInferAnswersInOrderWithErrorsPerRequest) {
  ModelInferResponse unary;
  ASSERT_TRUE(
      triton_->ModelInfer(Context().get(), AttendRequest("unary"), &unary)
          .ok());
  auto context = Context();
  auto stream = triton_->ModelStreamInfer(context.get());
  ModelInferRequest bad = AttendRequest("1");
  bad.mutable_inputs(1)->set_datatype("INT8");
  ASSERT_TRUE(stream->Write(AttendRequest("0")));
  ASSERT_TRUE(stream->Write(bad));
  ASSERT_TRUE(stream->Write(AttendRequest("2")));
  ModelInferRequest unknown = AttendRequest("3");
  unknown.set_model_name("wrong_model_name");
  ASSERT_TRUE(stream->Write(unknown));
  ASSERT_TRUE(stream->WritesDone());
  std::vector<inference::ModelStreamInferResponse> answers;
  inference::ModelStreamInferResponse answer;
  while (stream->Read(&answer)) answers.push_back(answer);
  const grpc::Status status = stream->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(answers.size(), 4);
  for (int i : {0, 2}) {
    EXPECT_EQ(answers[i].error_message(), "") << i;
    EXPECT_EQ(answers[i].infer_response().id(), absl::StrCat(i));
    ASSERT_EQ(answers[i].infer_response().raw_output_contents_size(), 1);
    EXPECT_EQ(answers[i].infer_response().raw_output_contents(0),
              unary.raw_output_contents(0));
  }
  EXPECT_EQ(answers[1].infer_response().id(), "1");
  EXPECT_EQ(answers[1].error_message(),
            "INVALID_ARGUMENT: key: datatype 'INT8' is not supported; expected "
            "FP32, BF16, FP16, BOOL or UINT8");
  EXPECT_EQ(answers[3].infer_response().id(), "3");
  EXPECT_EQ(answers[3].error_message(),
            "NOT_FOUND: model: 'wrong_model_name' not found; loaded models: "
            "mha");
  const inference::ModelStatistics stats = Statistics("attend");
  EXPECT_EQ(stats.inference_stats().success().count(), 3);
  EXPECT_EQ(stats.inference_stats().fail().count(), 1);
}

// The extensions take the server's token like every other call.
TEST(TritonProtocolAuthTest, ExtensionsNeedTheToken) {
  const std::string tokens = ::testing::TempDir() + "/triton_protocol_tokens";
  std::ofstream(tokens) << "secret\n";
  ServerOptions options;
  options.auth_token_file = tokens;
  TestServer server(options);
  auto triton = inference::GRPCInferenceService::NewStub(
      grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials()));
  inference::ModelConfigRequest config_request;
  config_request.set_name("attend");
  inference::ModelConfigResponse config;
  EXPECT_EQ(triton->ModelConfig(Context().get(), config_request, &config)
                .error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  inference::SystemSharedMemoryStatusResponse regions;
  EXPECT_EQ(triton->SystemSharedMemoryStatus(Context().get(), {}, &regions)
                .error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  auto context = Context();
  auto stream = triton->ModelStreamInfer(context.get());
  stream->Write(ModelInferRequest());
  stream->WritesDone();
  inference::ModelStreamInferResponse answer;
  EXPECT_FALSE(stream->Read(&answer));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  auto with_token = Context();
  with_token->AddMetadata("authorization", "Bearer secret");
  EXPECT_TRUE(
      triton->ModelConfig(with_token.get(), config_request, &config).ok());

  httplib::Client http("127.0.0.1", server.http_port());
  EXPECT_EQ(http.Get("/v2/models/attend/config")->status, 401);
  EXPECT_EQ(http.Post("/v2/repository/index", "", "application/json")->status,
            401);
  EXPECT_EQ(
      http.Get("/v2/models/attend/config", {{"Authorization", "Bearer secret"}})
          ->status,
      200);
}

}  // namespace
}  // namespace attnserve::testing
