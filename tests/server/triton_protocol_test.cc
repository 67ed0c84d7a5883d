// Triton's protocol extensions through a live server, over gRPC and
// HTTP/JSON, each test making the calls of one of Triton's published client
// examples in their order (simple_{grpc,http}_health_metadata,
// simple_{grpc,http}_infer_client, simple_{grpc,http}_shm_client,
// simple_{grpc,http}_model_control, simple_grpc_sequence_stream_infer_client,
// simple_http_sequence_sync_infer_client), with only model, input and
// output names, shapes and dtypes changed: what a Triton user's client
// sends, and what it must get back.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/shared_memory.h"
#include "core/safetensors.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "inference/grpc_service.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "proto/tensor_codec.h"
#include "server/sequences.h"
#include "server/triton_extensions.h"
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

// What a request naming a model that is not served gets, after its field.
constexpr const char* kNotServedRest =
    "model 'wrong_model_name' is not served; served models: attend, "
    "attention_session, layer_norm, mha, mha_session, multi_head_attend, "
    "rms_norm";
const std::string kNotServed = absl::StrCat("name: ", kNotServedRest);

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
                  "system_shared_memory", "statistics", "model_repository",
                  "logging", "trace", "sequence", "sequence(string_id)"));

  inference::ModelMetadataRequest metadata_request;
  metadata_request.set_name("mha");
  inference::ModelMetadataResponse metadata;
  ASSERT_TRUE(
      triton_->ModelMetadata(Context().get(), metadata_request, &metadata)
          .ok());
  ASSERT_EQ(metadata.inputs_size(), 5);
  EXPECT_FALSE(metadata.inputs(0).parameters().contains("optional"))
      << "query: required";
  EXPECT_EQ(metadata.inputs(0).parameters().at("min_rank").int64_param(), 2)
      << "query: [B, L, E] or [L, E]";
  EXPECT_TRUE(metadata.inputs(2).parameters().at("optional").bool_param())
      << "value may be left out (the key is used)";
  ASSERT_EQ(metadata.outputs_size(), 2);
  EXPECT_EQ(metadata.outputs(1).name(), "weights");

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
  // A stateless model: Triton's tools would send it sequences otherwise.
  EXPECT_FALSE(mha.has_sequence_batching());

  // Its sequences are a model of their own: the step's hidden states in,
  // its attention out.
  metadata_request.set_name("mha_session");
  metadata.Clear();
  ASSERT_TRUE(
      triton_->ModelMetadata(Context().get(), metadata_request, &metadata)
          .ok());
  ASSERT_EQ(metadata.inputs_size(), 1);
  EXPECT_EQ(metadata.inputs(0).name(), "query");
  EXPECT_THAT(metadata.inputs(0).shape(), ElementsAre(-1, -1, 16));
  ASSERT_EQ(metadata.outputs_size(), 1);
  EXPECT_EQ(metadata.outputs(0).name(), "output");
  config_request.set_name("mha_session");
  status = triton_->ModelConfig(Context().get(), config_request, &config);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_THAT(ConfigInputs(config.config()), ElementsAre("query"));
  EXPECT_TRUE(config.config().has_sequence_batching());
  EXPECT_EQ(config.config().parameters().at("num_heads").string_value(), "4");
  EXPECT_THAT(
      config.config().parameters().at("request_parameters").string_value(),
      HasSubstr("scale, temperature"));

  // The built-in models.
  config_request.set_name("attend");
  ASSERT_TRUE(
      triton_->ModelConfig(Context().get(), config_request, &config).ok());
  EXPECT_THAT(ConfigInputs(config.config()),
              ElementsAre("query", "key", "value", "attn_mask?"));
  EXPECT_EQ(config.config().platform(), "attnserve_builtin");
  // [B, H, L, d], as PyTorch lays it out; fewer or more batch dims work.
  EXPECT_THAT(config.config().input(0).dims(), ElementsAre(-1, -1, -1, -1));
  EXPECT_FALSE(config.config().has_sequence_batching());
  config_request.set_name("layer_norm");
  ASSERT_TRUE(
      triton_->ModelConfig(Context().get(), config_request, &config).ok());
  EXPECT_THAT(ConfigInputs(config.config()),
              ElementsAre("input", "gamma?", "beta?"));

  config_request.set_name("wrong_model_name");
  status = triton_->ModelConfig(Context().get(), config_request, &config);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), kNotServed);
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
                  "system_shared_memory", "statistics", "model_repository",
                  "logging", "trace", "sequence", "sequence(string_id)"}));
  const json metadata = Get("/v2/models/mha");
  EXPECT_EQ(metadata["inputs"][2]["name"], "value");
  EXPECT_EQ(metadata["inputs"][2]["parameters"],
            json({{"optional", true}, {"min_rank", 2}}));
  EXPECT_EQ(metadata["inputs"][0]["parameters"], json({{"min_rank", 2}}));

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
            kNotServed);
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
  // perf_analyzer requires the three compute counts to agree.
  EXPECT_EQ(infer.compute_input().count(), 2);
  EXPECT_GT(infer.compute_input().ns(), 0);
  EXPECT_GT(infer.compute_infer().ns(), 0);
  // Each call's time is its input, queue, compute and output time.
  EXPECT_EQ(infer.success().ns(),
            infer.compute_input().ns() + infer.queue().ns() +
                infer.compute_infer().ns() + infer.compute_output().ns());
  // Models with no calls are listed with zero counts.
  EXPECT_EQ(Statistics("mha").inference_stats().success().count(), 0);

  inference::ModelStatisticsRequest all;
  inference::ModelStatisticsResponse every;
  ASSERT_TRUE(triton_->ModelStatistics(Context().get(), all, &every).ok());
  std::vector<std::string> names;
  for (const auto& model : every.model_stats()) names.push_back(model.name());
  EXPECT_THAT(names,
              ElementsAre("attend", "attention_session", "layer_norm", "mha",
                          "mha_session", "multi_head_attend", "rms_norm"));
  inference::ModelStatisticsRequest unknown;
  unknown.set_name("wrong_model_name");
  status = triton_->ModelStatistics(Context().get(), unknown, &every);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), absl::StrCat("name: ", kNotServedRest));

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
  EXPECT_EQ(attend["inference_stats"]["compute_input"]["count"], 3);
  EXPECT_EQ(Get("/v2/models/stats")["model_stats"].size(), 7);
  EXPECT_EQ(Get("/v2/models/attend/versions/1/stats")["model_stats"].size(), 1);
  EXPECT_EQ(Get("/v2/models/wrong_model_name/stats", 404)["error"],
            absl::StrCat("name: ", kNotServedRest));
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
  // Unregistering a region that is not registered succeeds, as in Triton
  // (its shm examples unregister everything first).
  inference::SystemSharedMemoryUnregisterRequest unknown;
  unknown.set_name("no_such_region");
  EXPECT_TRUE(triton_
                  ->SystemSharedMemoryUnregister(Context().get(), unknown,
                                                 &unregistered)
                  .ok());
  // CUDA shared memory as a Triton without GPUs answers it: no regions,
  // unregister succeeds, register is refused.
  inference::CudaSharedMemoryStatusResponse cuda_status;
  status = triton_->CudaSharedMemoryStatus(Context().get(), {}, &cuda_status);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(cuda_status.regions_size(), 0);
  inference::CudaSharedMemoryStatusRequest cuda_one;
  cuda_one.set_name("gpu_region");
  status =
      triton_->CudaSharedMemoryStatus(Context().get(), cuda_one, &cuda_status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(),
            "name: no CUDA shared memory region 'gpu_region' is registered "
            "(attnserve computes on CPU and takes system shared memory only)");
  inference::CudaSharedMemoryUnregisterRequest cuda_unregister;
  inference::CudaSharedMemoryUnregisterResponse cuda_unregistered;
  EXPECT_TRUE(triton_
                  ->CudaSharedMemoryUnregister(Context().get(), cuda_unregister,
                                               &cuda_unregistered)
                  .ok());
  cuda_unregister.set_name("gpu_region");
  EXPECT_TRUE(triton_
                  ->CudaSharedMemoryUnregister(Context().get(), cuda_unregister,
                                               &cuda_unregistered)
                  .ok());
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
  // Triton's encoding of an output in shared memory: name, datatype and
  // shape only (Triton's C++ client needs binary_data_size in any
  // "parameters" of an output).
  EXPECT_EQ(
      answer["outputs"][0],
      json({{"name", "output"}, {"datatype", "FP32"}, {"shape", {2, 3, 8}}}));
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
  EXPECT_EQ(Get("/v2/cudasharedmemory/status"), json::array());
  EXPECT_EQ(Post("/v2/cudasharedmemory/unregister", ""), json::object());
  EXPECT_EQ(Post("/v2/cudasharedmemory/region/gpu/unregister", ""),
            json::object());
  EXPECT_EQ(Get("/v2/cudasharedmemory/region/gpu/status", 404)["error"],
            "name: no CUDA shared memory region 'gpu' is registered "
            "(attnserve computes on CPU and takes system shared memory only)");
  EXPECT_EQ(Post("/v2/cudasharedmemory/region/gpu/register",
                 json({{"raw_handle", {{"b64", ""}}},
                       {"device_id", 0},
                       {"byte_size", 4}})
                     .dump(),
                 400)["error"],
            "CUDA shared memory is not supported: attnserve computes on CPU; "
            "register system shared memory instead");
  // Unregistering a region that is not registered succeeds.
  EXPECT_EQ(Post("/v2/systemsharedmemory/region/no_such/unregister", ""),
            json::object());
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
  EXPECT_THAT(
      index(false),
      ElementsAre("attend:1:READY:", "attention_session:1:READY:",
                  "layer_norm:1:READY:", "mha:1:READY:", "mha_session:1:READY:",
                  "multi_head_attend:1:READY:", "rms_norm:1:READY:"));

  inference::RepositoryModelUnloadRequest unload;
  unload.set_model_name("mha");
  // Triton's clients always send this parameter.
  (*unload.mutable_parameters())["unload_dependents"].set_bool_param(false);
  inference::RepositoryModelUnloadResponse unloaded;
  grpc::Status status =
      triton_->RepositoryModelUnload(Context().get(), unload, &unloaded);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_FALSE(Ready("mha"));
  EXPECT_FALSE(Ready("mha_session")) << "a model's sequences go with it";
  EXPECT_THAT(index(false),
              ElementsAre("attend:1:READY:", "attention_session:1:READY:",
                          "layer_norm:1:READY:", "mha::UNAVAILABLE:unloaded",
                          "mha_session::UNAVAILABLE:unloaded",
                          "multi_head_attend:1:READY:", "rms_norm:1:READY:"));
  EXPECT_EQ(index(true).size(), 5);
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
  unload.set_model_name("mha_session");
  status = triton_->RepositoryModelUnload(Context().get(), unload, &unloaded);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(status.error_message(),
            "model_name: 'mha_session' is the sequences of model 'mha', which "
            "loads and unloads it");
}

// Without a repository, loading or unloading a model that is not built in
// names every model there is: the built-in ones, from their declarations.
TEST(TritonRepositoryTest, WithoutARepositoryTheBuiltInModelsAreListed) {
  const std::string expected =
      "model_name: this server has no --model_repository; its models are the "
      "built-in attend, attention_session, layer_norm, multi_head_attend, "
      "rms_norm";
  inference::RepositoryModelLoadRequest load;
  load.set_model_name("mha");
  absl::Status status = HandleRepositoryModelLoad(load, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(status.message(), expected);
  inference::RepositoryModelUnloadRequest unload;
  unload.set_model_name("mha");
  status = HandleRepositoryModelUnload(unload, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(status.message(), expected);
  // A built-in model is always loaded.
  load.set_model_name("rms_norm");
  EXPECT_TRUE(HandleRepositoryModelLoad(load, nullptr).ok());
}

// simple_http_model_control.
TEST_F(TritonProtocolTest, HttpModelControl) {
  const json index = Post("/v2/repository/index", "");
  ASSERT_EQ(index.size(), 7);
  EXPECT_EQ(index[3], json({{"name", "mha"},
                            {"version", "1"},
                            {"state", "READY"},
                            {"reason", ""}}));
  EXPECT_EQ(Post("/v2/repository/models/mha/unload",
                 R"({"parameters": {"unload_dependents": false}})"),
            json::object());
  EXPECT_EQ(http_.Get("/v2/models/mha/ready")->status, 503);
  EXPECT_EQ(
      Post("/v2/repository/index", R"({"ready": false})")[3],
      json(
          {{"name", "mha"}, {"state", "UNAVAILABLE"}, {"reason", "unloaded"}}));
  // Listed whatever their state: the index keeps its length.
  EXPECT_EQ(Post("/v2/repository/index", R"({"ready": false})").size(), 7);
  EXPECT_EQ(Post("/v2/repository/index", R"({"ready": true})").size(), 5);
  EXPECT_EQ(Post("/v2/repository/models/mha/load", ""), json::object());
  EXPECT_EQ(http_.Get("/v2/models/mha_session/ready")->status, 200);
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
            absl::StrCat("NOT_FOUND: model_name: ", kNotServedRest));
  const inference::ModelStatistics stats = Statistics("attend");
  EXPECT_EQ(stats.inference_stats().success().count(), 3);
  EXPECT_EQ(stats.inference_stats().fail().count(), 1);
}

// Sequences (Triton's sequence extension) on decode sessions.
constexpr int64_t kSeqHeads = 2;
constexpr int64_t kSeqKvHeads = 1;
constexpr int64_t kSeqDim = 8;
constexpr int64_t kEmbed = 16;  // the "mha" model's

// The float64 reference of one attention_session sequence: its keys and
// values so far, each step's queries attending to them causally.
class AttentionSequenceReference {
 public:
  // The expected output [H, n, dv] of a step of n tokens.
  std::vector<double> Step(const std::vector<float>& q,
                           const std::vector<float>& k,
                           const std::vector<float>& v, int64_t n) {
    const auto ref = [n](const std::vector<float>& x, int64_t heads) {
      return RefTensor{{1, heads, n, kSeqDim},
                       std::vector<double>(x.begin(), x.end())};
    };
    keys_ = RefConcatRows(keys_, ref(k, kSeqKvHeads));
    values_ = RefConcatRows(values_, ref(v, kSeqKvHeads));
    const int64_t group = kSeqHeads / kSeqKvHeads;
    const RefAttentionResult result =
        RefAttend(ref(q, kSeqHeads), RefRepeatHeads(keys_, group),
                  RefRepeatHeads(values_, group), {RefCausalKeep(length_, n)},
                  {true}, {});
    length_ += n;
    return result.output.values;
  }
  int64_t length() const { return length_; }

 private:
  RefTensor keys_, values_;
  int64_t length_ = 0;
};

// One step of an attention_session sequence: query [2, n, 8], key and
// value [1, n, 8] (grouped-query attention), raw FP32.
struct AttentionStep {
  int64_t n = 0;
  std::vector<float> q, k, v;
};

AttentionStep RandomStep(int64_t n, std::mt19937& rng) {
  return {n, RandomFloats(kSeqHeads * n * kSeqDim, rng),
          RandomFloats(kSeqKvHeads * n * kSeqDim, rng),
          RandomFloats(kSeqKvHeads * n * kSeqDim, rng)};
}

// A ModelInfer request of sequence `id` (an int64 or a string parameter,
// as Triton's client sends them).
ModelInferRequest SequenceRequest(const inference::InferParameter& id,
                                  bool start, bool end,
                                  const AttentionStep& step) {
  ModelInferRequest request;
  request.set_model_name("attention_session");
  auto& parameters = *request.mutable_parameters();
  parameters["sequence_id"] = id;
  parameters["sequence_start"].set_bool_param(start);
  parameters["sequence_end"].set_bool_param(end);
  const std::vector<float>* values[] = {&step.q, &step.k, &step.v};
  for (int i = 0; i < 3; ++i) {
    auto* input = request.add_inputs();
    input->set_name(kNames[i]);
    input->set_datatype("FP32");
    for (int64_t d : {i == 0 ? kSeqHeads : kSeqKvHeads, step.n, kSeqDim}) {
      input->add_shape(d);
    }
    request.add_raw_input_contents(Bytes(*values[i]));
  }
  return request;
}

inference::InferParameter IntId(int64_t id) {
  inference::InferParameter parameter;
  parameter.set_int64_param(id);
  return parameter;
}
inference::InferParameter StringId(const std::string& id) {
  inference::InferParameter parameter;
  parameter.set_string_param(id);
  return parameter;
}

// simple_grpc_sequence_stream_infer_client: two sequences, one with an
// integer id and one with a string id, interleaved on one stream: start
// (a 3-token prompt), steps, end; then a step on the ended sequence.
TEST_F(TritonProtocolTest, GrpcSequenceStreamOnAttentionSessions) {
  inference::ModelConfigRequest config_request;
  config_request.set_name("attention_session");
  inference::ModelConfigResponse config;
  ASSERT_TRUE(
      triton_->ModelConfig(Context().get(), config_request, &config).ok());
  EXPECT_THAT(ConfigInputs(config.config()),
              ElementsAre("query", "key", "value"));
  ASSERT_TRUE(config.config().has_sequence_batching());
  EXPECT_EQ(
      config.config().sequence_batching().max_sequence_idle_microseconds(),
      600'000'000u);  // --session_idle_timeout_s 600
  EXPECT_EQ(
      config.config().parameters().at("sequence_parameters").string_value(),
      "sequence_id, sequence_start, sequence_end, sequence_position, "
      "sequence_fork, max_length, rotary_dims, rotary_base, dtype");

  const std::vector<int64_t> lengths = {3, 1, 1, 2, 1};
  const inference::InferParameter ids[] = {IntId(1000), StringId("seq-1001")};
  AttentionSequenceReference references[2];
  std::vector<std::vector<double>> expected;
  auto context = Context();
  auto stream = triton_->ModelStreamInfer(context.get());
  for (size_t i = 0; i < lengths.size(); ++i) {
    for (int s = 0; s < 2; ++s) {
      const AttentionStep step = RandomStep(lengths[i], rng_);
      ModelInferRequest request =
          SequenceRequest(ids[s], i == 0, i + 1 == lengths.size(), step);
      request.set_id(absl::StrCat(s, "/", i));
      ASSERT_TRUE(stream->Write(request));
      expected.push_back(references[s].Step(step.q, step.k, step.v, step.n));
    }
  }
  // The integer sequence has ended: a step on it must start again.
  ASSERT_TRUE(stream->Write(
      SequenceRequest(ids[0], false, false, RandomStep(1, rng_))));
  ASSERT_TRUE(stream->WritesDone());
  std::vector<inference::ModelStreamInferResponse> answers;
  inference::ModelStreamInferResponse answer;
  while (stream->Read(&answer)) answers.push_back(answer);
  const grpc::Status status = stream->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(answers.size(), expected.size() + 1);
  int64_t lengths_so_far[2] = {0, 0};
  for (size_t a = 0; a < expected.size(); ++a) {
    const int s = a % 2;
    const ModelInferResponse& response = answers[a].infer_response();
    ASSERT_EQ(answers[a].error_message(), "") << a;
    EXPECT_EQ(response.id(), absl::StrCat(s, "/", a / 2));
    ASSERT_EQ(response.outputs_size(), 1);
    EXPECT_EQ(response.outputs(0).name(), "output");
    lengths_so_far[s] += lengths[a / 2];
    EXPECT_THAT(response.outputs(0).shape(),
                ElementsAre(kSeqHeads, lengths[a / 2], kSeqDim));
    EXPECT_EQ(response.parameters().at("sequence_length").int64_param(),
              lengths_so_far[s]);
    ExpectNear(Floats(response.raw_output_contents(0)), expected[a]);
  }
  EXPECT_EQ(answers.back().error_message(),
            "INVALID_ARGUMENT: sequence_id: inference request for sequence "
            "1000 to model 'attention_session' must specify the START flag on "
            "the first request of the sequence");
  EXPECT_EQ(Statistics("attention_session").inference_stats().success().count(),
            expected.size());
}

// The float64 reference of the "mha" model: its weights as the repository
// holds them.
RefMultiHeadWeights MhaReference(const TempModelRepository& repo) {
  RefMultiHeadWeights w;
  w.num_heads = 4;
  absl::StatusOr<SafetensorsFile> file =
      ReadSafetensors(repo.root() + "/mha/weights.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return w;
  for (const auto& [name, tensor] : file->tensors) {
    std::string field = name;
    std::replace(field.begin(), field.end(), '.', '_');
    *w.Field(field) = ToRef(tensor.view());
  }
  return w;
}

// simple_http_sequence_sync_infer_client on a served model: two sequences
// (integer and string ids) of hidden states, interleaved, one request
// each step; every step is causal multi-head attention of the sequence so
// far (float64 reference over the whole sequence).
TEST_F(TritonProtocolTest, HttpSequenceSyncOnAServedModel) {
  const json config = Get("/v2/models/mha_session/config");
  EXPECT_EQ(config["sequence_batching"]["max_sequence_idle_microseconds"],
            600'000'000u);
  EXPECT_EQ(config["sequence_batching"]["control_input"][0]["name"],
            "sequence_start");
  EXPECT_EQ(config["sequence_batching"]["control_input"][2]["control"][0],
            json({{"kind", "CONTROL_SEQUENCE_CORRID"},
                  {"int32_false_true", json::array()},
                  {"fp32_false_true", json::array()},
                  {"bool_false_true", json::array()},
                  {"data_type", "TYPE_UINT64"}}));
  EXPECT_FALSE(Get("/v2/models/attend/config").contains("sequence_batching"));

  const RefMultiHeadWeights weights = MhaReference(repo_);
  const std::vector<int64_t> lengths = {4, 1, 2, 1};
  const int64_t total = 8;
  const json ids[] = {1000, "seq-1001"};
  std::vector<float> hidden[2];
  RefTensor outputs[2];
  for (int s = 0; s < 2; ++s) {
    hidden[s] = RandomFloats(total * kEmbed, rng_);
    const RefTensor all{
        {1, total, kEmbed},
        std::vector<double>(hidden[s].begin(), hidden[s].end())};
    outputs[s] =
        RefMultiHeadAttend(weights, all, all, all, {}, {}, {true, {}, {}})
            .output;
  }
  int64_t first = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t n = lengths[i];
    for (int s = 0; s < 2; ++s) {
      const std::vector<float> rows(hidden[s].begin() + first * kEmbed,
                                    hidden[s].begin() + (first + n) * kEmbed);
      json body;
      body["parameters"] = {{"sequence_id", ids[s]},
                            {"sequence_start", i == 0},
                            {"sequence_end", i + 1 == lengths.size()}};
      body["inputs"] = json::array({{{"name", "query"},
                                     {"datatype", "FP32"},
                                     {"shape", {n, kEmbed}},
                                     {"data", rows}}});
      const json answer = Post("/v2/models/mha_session/infer", body.dump());
      ASSERT_TRUE(answer.contains("outputs")) << answer.dump();
      EXPECT_EQ(answer["outputs"][0]["shape"], json({n, kEmbed}));
      EXPECT_EQ(answer["parameters"]["sequence_length"], first + n);
      ExpectNear(answer["outputs"][0]["data"].get<std::vector<float>>(),
                 RefRows(outputs[s], first, n).values);
    }
    first += n;
  }
  // Both have ended.
  json step;
  step["parameters"] = {{"sequence_id", "seq-1001"}};
  step["inputs"] = json::array({{{"name", "query"},
                                 {"datatype", "FP32"},
                                 {"shape", {1, kEmbed}},
                                 {"data", RandomFloats(kEmbed, rng_)}}});
  EXPECT_EQ(
      Post("/v2/models/mha_session/infer", step.dump(), 400)["error"],
      "sequence_id: inference request for sequence \"seq-1001\" to model "
      "'mha_session' must specify the START flag on the first request of the "
      "sequence");
}

// Forks of a served model's sequence over HTTP: a parent "beam" (string
// id) with a 4-token prompt; fork 41 of all of it, fork 42 of its first 2
// tokens, each stepping its own hidden states; the parent going on. Every
// step is causal multi-head attention over that sequence's own history
// (float64 reference). Then the refusals, over HTTP.
TEST_F(TritonProtocolTest, HttpSequenceForksOnAServedModel) {
  const RefMultiHeadWeights weights = MhaReference(repo_);
  const auto body_of = [](json parameters, const std::vector<float>& rows) {
    json body;
    body["parameters"] = std::move(parameters);
    body["inputs"] = json::array(
        {{{"name", "query"},
          {"datatype", "FP32"},
          {"shape", {static_cast<int64_t>(rows.size()) / kEmbed, kEmbed}},
          {"data", rows}}});
    return body.dump();
  };
  // Appends n random tokens to `history` and sends them: the output must
  // be the last n rows of causal attention over all of `history`.
  const auto step = [&](json parameters, std::vector<float>& history,
                        int64_t n) {
    const std::vector<float> rows = RandomFloats(n * kEmbed, rng_);
    history.insert(history.end(), rows.begin(), rows.end());
    const json answer = Post("/v2/models/mha_session/infer",
                             body_of(std::move(parameters), rows));
    ASSERT_TRUE(answer.contains("outputs")) << answer.dump();
    const int64_t total = static_cast<int64_t>(history.size()) / kEmbed;
    EXPECT_EQ(answer["outputs"][0]["shape"], json({n, kEmbed}));
    EXPECT_EQ(answer["parameters"]["sequence_length"], total);
    const RefTensor all{{1, total, kEmbed},
                        std::vector<double>(history.begin(), history.end())};
    ExpectNear(answer["outputs"][0]["data"].get<std::vector<float>>(),
               RefRows(RefMultiHeadAttend(weights, all, all, all, {}, {},
                                          {true, {}, {}})
                           .output,
                       total - n, n)
                   .values);
  };
  std::vector<float> parent, all_of_it, first_two;
  step({{"sequence_id", "beam"}, {"sequence_start", true}}, parent, 4);
  all_of_it = parent;
  first_two.assign(parent.begin(), parent.begin() + 2 * kEmbed);
  step({{"sequence_id", 41},
        {"sequence_start", true},
        {"sequence_fork", "beam"}},
       all_of_it, 1);
  step({{"sequence_id", 42},
        {"sequence_start", true},
        {"sequence_fork", "beam"},
        {"sequence_position", 2}},
       first_two, 2);
  for (int round = 0; round < 2; ++round) {
    step({{"sequence_id", 41}}, all_of_it, 1);
    step({{"sequence_id", 42}}, first_two, 1);
    step({{"sequence_id", "beam"}}, parent, 1);
  }

  const std::vector<float> token = RandomFloats(kEmbed, rng_);
  const auto refused = [&](json parameters, const std::string& message) {
    EXPECT_EQ(Post("/v2/models/mha_session/infer",
                   body_of(std::move(parameters), token), 400)["error"],
              message);
  };
  refused(
      {{"sequence_id", 43}, {"sequence_start", true}, {"sequence_fork", 40}},
      "sequence_fork: inference request for sequence 43 to model 'mha_session' "
      "forks sequence 40, which has not been started or has ended; a fork "
      "continues an open sequence of its own model");
  refused({{"sequence_id", 41}, {"sequence_fork", "beam"}},
          "parameters: sequence_fork applies to the first request of a "
          "sequence only (with sequence_start true): it starts sequence_id as "
          "a fork");
  refused(
      {{"sequence_id", 43}, {"sequence_start", true}, {"sequence_fork", 1.5}},
      "parameters: sequence_fork must be a uint64 or a string, got double");
  refused({{"sequence_id", 43},
           {"sequence_start", true},
           {"sequence_fork", "beam"},
           {"sequence_position", 9}},
          "parameters: sequence_position: 9 is not in [0, 6]: a fork starts "
          "with that many tokens of sequence \"beam\" of model 'mha_session', "
          "which "
          "holds 6");
  refused({{"sequence_id", 43},
           {"sequence_start", true},
           {"sequence_fork", "beam"},
           {"max_length", 64}},
          "parameters: max_length: a fork keeps the settings of the sequence "
          "it forks (sequence_fork \"beam\")");
  // None of them started 43; the others go on and end.
  refused({{"sequence_id", 43}},
          "sequence_id: inference request for sequence 43 to model "
          "'mha_session' must "
          "specify the START flag on the first request of the sequence");
  step({{"sequence_id", 41}, {"sequence_end", true}}, all_of_it, 1);
  step({{"sequence_id", 42}, {"sequence_end", true}}, first_two, 1);
  step({{"sequence_id", "beam"}, {"sequence_end", true}}, parent, 1);
}

// Sequences run concurrently, each on its own session: four threads, four
// sequences, unary calls, every step against its own reference.
TEST_F(TritonProtocolTest, ConcurrentSequencesAreIsolated) {
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t] {
      std::mt19937 rng(100 + t);
      AttentionSequenceReference reference;
      const std::vector<int64_t> lengths = {5, 1, 1, 3, 1, 1};
      for (size_t i = 0; i < lengths.size(); ++i) {
        const AttentionStep step = RandomStep(lengths[i], rng);
        ModelInferResponse response;
        const grpc::Status status =
            triton_->ModelInfer(Context().get(),
                                SequenceRequest(IntId(2000 + t), i == 0,
                                                i + 1 == lengths.size(), step),
                                &response);
        ASSERT_TRUE(status.ok()) << status.error_message();
        ASSERT_EQ(response.raw_output_contents_size(), 1);
        ExpectNear(Floats(response.raw_output_contents(0)),
                   reference.Step(step.q, step.k, step.v, step.n));
      }
    });
  }
  for (auto& thread : threads) thread.join();
}

// The number after `series` on `server`'s metrics page (-1 when absent).
int64_t Metric(const TestServer& server, const std::string& series) {
  httplib::Client http("127.0.0.1", server.metrics_port());
  auto page = http.Get("/metrics");
  if (!page) return -1;
  const size_t at = page->body.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::strtoll(page->body.c_str() + at + series.size() + 2, nullptr, 10);
}

// The JSON body of an attention_session step over HTTP with `parameters`
// (as SequenceRequest's inputs).
json HttpSequenceStep(json parameters, const AttentionStep& step) {
  json body;
  body["parameters"] = std::move(parameters);
  const std::vector<float>* values[] = {&step.q, &step.k, &step.v};
  body["inputs"] = json::array();
  for (int i = 0; i < 3; ++i) {
    body["inputs"].push_back(
        {{"name", kNames[i]},
         {"datatype", "FP32"},
         {"shape", {i == 0 ? kSeqHeads : kSeqKvHeads, step.n, kSeqDim}},
         {"data", *values[i]}});
  }
  return body;
}

// Sequence steps from every front end (gRPC ModelInfer, ModelStreamInfer,
// HTTP) and native SessionStep calls, concurrently, all run in the step
// coalescer's passes: every step too large to run inline is counted in
// attnserve_coalesced_steps_total whichever protocol sent it, and every
// output matches float64. All front ends step the same history, and so do
// entries of native SessionSteps calls (a batched pass of their own): the
// outputs are equal bit for bit, however the passes grouped the steps.
TEST_F(TritonProtocolTest, StepsOfEveryFrontEndRunInTheCoalescersPasses) {
  // Steps of 32 tokens on 1024 and more cached ones: above the inline
  // threshold, so every one goes to the coalescer.
  constexpr int64_t kPrompt = 1024, kTokens = 32;
  constexpr int kSteps = 4;
  const int64_t passes_before = Metric(server_, "attnserve_step_passes_total");
  const int64_t steps_before =
      Metric(server_, "attnserve_coalesced_steps_total");
  ASSERT_GE(steps_before, 0);
  constexpr int kFrontEnds = 5;
  // outputs[front end][step]
  std::vector<std::vector<std::vector<float>>> outputs(
      kFrontEnds, std::vector<std::vector<float>>(kSteps + 1));
  const auto run = [&](int front_end) {
    std::mt19937 rng(300);
    AttentionSequenceReference reference;
    const int64_t id = 3000 + front_end;
    auto stream_context = Context();
    auto stream = triton_->ModelStreamInfer(stream_context.get());
    httplib::Client http("127.0.0.1", server_.http_port());
    std::string session;
    for (int i = 0; i <= kSteps; ++i) {
      const AttentionStep step = RandomStep(i == 0 ? kPrompt : kTokens, rng);
      const std::vector<double> expected =
          reference.Step(step.q, step.k, step.v, step.n);
      const ModelInferRequest request =
          SequenceRequest(IntId(id), i == 0, false, step);
      std::vector<float> output;
      if (front_end == 0) {
        ModelInferResponse response;
        const grpc::Status status =
            triton_->ModelInfer(Context().get(), request, &response);
        ASSERT_TRUE(status.ok()) << status.error_message();
        output = Floats(response.raw_output_contents(0));
      } else if (front_end == 1) {
        inference::ModelStreamInferResponse answer;
        ASSERT_TRUE(stream->Write(request));
        ASSERT_TRUE(stream->Read(&answer));
        ASSERT_EQ(answer.error_message(), "");
        output = Floats(answer.infer_response().raw_output_contents(0));
      } else if (front_end == 2) {
        auto answer = http.Post(
            "/v2/models/attention_session/infer",
            HttpSequenceStep({{"sequence_id", id}, {"sequence_start", i == 0}},
                             step)
                .dump(),
            "application/json");
        ASSERT_TRUE(answer && answer->status == 200)
            << (answer ? answer->body : "no answer");
        output = json::parse(answer->body)["outputs"][0]["data"]
                     .get<std::vector<float>>();
      } else {  // native SessionStep (3) or a SessionSteps entry (4)
        if (i == 0) {
          v1::CreateSessionRequest create;
          create.set_num_heads(kSeqHeads);
          create.set_num_kv_heads(kSeqKvHeads);
          create.set_head_dim(kSeqDim);
          v1::CreateSessionResponse created;
          ASSERT_TRUE(
              native_->CreateSession(Context().get(), create, &created).ok());
          session = created.session_id();
        }
        v1::SessionStepRequest native_step;
        native_step.set_session_id(session);
        v1::Tensor* tensors[] = {native_step.mutable_query(),
                                 native_step.mutable_key(),
                                 native_step.mutable_value()};
        for (int t = 0; t < 3; ++t) {
          tensors[t]->set_dtype(v1::DATA_TYPE_FLOAT32);
          for (const auto& d : request.inputs(t).shape()) {
            tensors[t]->add_shape(d);
          }
          tensors[t]->set_raw_data(request.raw_input_contents(t));
        }
        if (front_end == 3) {
          v1::SessionStepResponse response;
          const grpc::Status status =
              native_->SessionStep(Context().get(), native_step, &response);
          ASSERT_TRUE(status.ok()) << status.error_message();
          output = Floats(response.output().raw_data());
        } else {
          v1::SessionStepsRequest batched;
          *batched.add_steps() = native_step;
          v1::SessionStepsResponse response;
          const grpc::Status status =
              native_->SessionSteps(Context().get(), batched, &response);
          ASSERT_TRUE(status.ok()) << status.error_message();
          ASSERT_EQ(response.results(0).code(), 0)
              << response.results(0).message();
          output = Floats(response.results(0).output().raw_data());
        }
      }
      ExpectNear(output, expected);
      outputs[front_end][i] = std::move(output);
    }
    ASSERT_TRUE(stream->WritesDone());
    ASSERT_TRUE(stream->Finish().ok());
  };
  std::vector<std::thread> threads;
  for (int front_end = 0; front_end < kFrontEnds; ++front_end) {
    threads.emplace_back(run, front_end);
  }
  for (auto& thread : threads) thread.join();
  for (int front_end = 1; front_end < kFrontEnds; ++front_end) {
    for (int i = 0; i <= kSteps; ++i) {
      EXPECT_EQ(outputs[front_end][i], outputs[0][i])
          << "front end " << front_end << ", step " << i;
    }
  }
  // Each front end's continuing steps, and the native session's prompt (a
  // protocol start creates its session first, outside the passes).
  const int64_t steps = Metric(server_, "attnserve_coalesced_steps_total");
  EXPECT_EQ(steps - steps_before, 4 * kSteps + 1);
  const int64_t passes = Metric(server_, "attnserve_step_passes_total");
  EXPECT_GE(passes - passes_before, 1);
  EXPECT_LE(passes - passes_before, steps - steps_before);
}

// A rewind (sequence_position) drops the cached tokens from there on.
TEST_F(TritonProtocolTest, SequencePositionRewinds) {
  AttentionStep prompt = RandomStep(3, rng_);
  ModelInferResponse response;
  ASSERT_TRUE(triton_
                  ->ModelInfer(Context().get(),
                               SequenceRequest(IntId(5), true, false, prompt),
                               &response)
                  .ok());
  // Back to position 1: the new token sees the prompt's first token only.
  const AttentionStep step = RandomStep(1, rng_);
  ModelInferRequest rewind = SequenceRequest(IntId(5), false, true, step);
  (*rewind.mutable_parameters())["sequence_position"].set_int64_param(1);
  const grpc::Status status =
      triton_->ModelInfer(Context().get(), rewind, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.parameters().at("sequence_length").int64_param(), 2);
  AttentionSequenceReference reference;
  const auto first_row = [](const std::vector<float>& x, int64_t heads) {
    std::vector<float> rows;
    for (int64_t h = 0; h < heads; ++h) {
      rows.insert(rows.end(), x.begin() + h * 3 * kSeqDim,
                  x.begin() + (h * 3 + 1) * kSeqDim);
    }
    return rows;
  };
  reference.Step(first_row(prompt.q, kSeqHeads),
                 first_row(prompt.k, kSeqKvHeads),
                 first_row(prompt.v, kSeqKvHeads), 1);
  ExpectNear(Floats(response.raw_output_contents(0)),
             reference.Step(step.q, step.k, step.v, 1));
}

// A start of sequence `id` forking sequence `parent`, of its first
// `position` tokens when set.
ModelInferRequest ForkRequest(const inference::InferParameter& id,
                              const inference::InferParameter& parent,
                              const AttentionStep& step,
                              std::optional<int64_t> position = std::nullopt,
                              bool end = false) {
  ModelInferRequest request = SequenceRequest(id, true, end, step);
  (*request.mutable_parameters())["sequence_fork"] = parent;
  if (position.has_value()) {
    (*request.mutable_parameters())["sequence_position"].set_int64_param(
        *position);
  }
  return request;
}

// A value of the server's /metrics page; -1 when it is missing.
int64_t Metric(int port, const std::string& name) {
  httplib::Client client("127.0.0.1", port);
  const auto result = client.Get("/metrics");
  if (!result || result->status != 200) {
    ADD_FAILURE() << "GET /metrics: no answer";
    return -1;
  }
  const std::string line = absl::StrCat("\n", name, " ");
  const size_t at = result->body.find(line);
  if (at == std::string::npos) return -1;
  return std::stoll(result->body.substr(at + line.size()));
}

// Beam search through the protocol: a parent sequence with a prompt; two
// forks of it (every token, and its first two) stepping different
// tokens; a one-shot fork of a fork (start and end); the parent going on.
// Each against the float64 reference of its own history.
TEST_F(TritonProtocolTest, GrpcSequenceForks) {
  const auto infer = [&](const ModelInferRequest& request,
                         AttentionSequenceReference& reference,
                         const AttentionStep& step) {
    ModelInferResponse response;
    const grpc::Status status =
        triton_->ModelInfer(Context().get(), request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_EQ(response.raw_output_contents_size(), 1);
    EXPECT_THAT(response.outputs(0).shape(),
                ElementsAre(kSeqHeads, step.n, kSeqDim));
    ExpectNear(Floats(response.raw_output_contents(0)),
               reference.Step(step.q, step.k, step.v, step.n));
    EXPECT_EQ(response.parameters().at("sequence_length").int64_param(),
              reference.length());
  };
  const int metrics = server_.metrics_port();
  const inference::InferParameter parent = IntId(30);
  const inference::InferParameter beam_a = StringId("beam-a");
  const inference::InferParameter beam_b = IntId(31);
  AttentionSequenceReference parent_ref;
  AttentionStep step = RandomStep(2, rng_);
  infer(SequenceRequest(parent, true, false, step), parent_ref, step);
  AttentionSequenceReference b_ref = parent_ref;  // its first 2 tokens
  step = RandomStep(3, rng_);
  infer(SequenceRequest(parent, false, false, step), parent_ref, step);

  AttentionSequenceReference a_ref = parent_ref;  // every token (5)
  step = RandomStep(1, rng_);
  infer(ForkRequest(beam_a, parent, step), a_ref, step);
  step = RandomStep(2, rng_);
  infer(ForkRequest(beam_b, parent, step, /*position=*/2), b_ref, step);
  EXPECT_EQ(Metric(metrics, "attnserve_sessions_forked_total"), 2);
  EXPECT_EQ(Metric(metrics, "attnserve_sessions_open"), 3);

  for (int round = 0; round < 2; ++round) {
    for (auto [id, reference] : {std::pair{&beam_a, &a_ref},
                                 {&beam_b, &b_ref},
                                 {&parent, &parent_ref}}) {
      step = RandomStep(1, rng_);
      infer(SequenceRequest(*id, false, false, step), *reference, step);
    }
  }
  // A fork of a fork, started and ended in one request: scores one more
  // token after beam-a without keeping it.
  AttentionSequenceReference c_ref = a_ref;
  step = RandomStep(1, rng_);
  infer(ForkRequest(IntId(32), beam_a, step, std::nullopt, /*end=*/true), c_ref,
        step);
  EXPECT_EQ(Metric(metrics, "attnserve_sessions_forked_total"), 3);
  EXPECT_EQ(Metric(metrics, "attnserve_sessions_open"), 3);
  for (auto [id, reference] : {std::pair{&beam_a, &a_ref},
                               {&beam_b, &b_ref},
                               {&parent, &parent_ref}}) {
    step = RandomStep(1, rng_);
    infer(SequenceRequest(*id, false, true, step), *reference, step);
  }
  EXPECT_EQ(Metric(metrics, "attnserve_sessions_open"), 0);
}

// A fork that fails changes nothing: a fork whose first step fails is
// freed, leaving the sequence open under its id as it was, and the parent
// as it was; a fork onto an open id that succeeds replaces that sequence.
TEST_F(TritonProtocolTest, FailedSequenceForkChangesNothing) {
  const auto infer = [&](const ModelInferRequest& request,
                         AttentionSequenceReference& reference,
                         const AttentionStep& step) {
    ModelInferResponse response;
    const grpc::Status status =
        triton_->ModelInfer(Context().get(), request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_EQ(response.raw_output_contents_size(), 1);
    ExpectNear(Floats(response.raw_output_contents(0)),
               reference.Step(step.q, step.k, step.v, step.n));
  };
  const int metrics = server_.metrics_port();
  AttentionSequenceReference parent_ref, open_ref;
  AttentionStep step = RandomStep(2, rng_);
  infer(SequenceRequest(IntId(60), true, false, step), parent_ref, step);
  step = RandomStep(3, rng_);
  infer(SequenceRequest(IntId(61), true, false, step), open_ref, step);

  // Forked, then the first step is refused: two key heads where the
  // parent's session has one.
  ModelInferRequest bad =
      ForkRequest(IntId(61), IntId(60), RandomStep(1, rng_));
  bad.mutable_inputs(1)->set_shape(0, 2);
  bad.set_raw_input_contents(1, Bytes(RandomFloats(2 * kSeqDim, rng_)));
  ModelInferResponse response;
  grpc::Status status = triton_->ModelInfer(Context().get(), bad, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "key: shape [2, 1, 8], expected [1, 1, 8]");
  EXPECT_EQ(Metric(metrics, "attnserve_sessions_forked_total"), 1);
  EXPECT_EQ(Metric(metrics, "attnserve_sessions_open"), 2);
  // Refused before forking: past the parent's length.
  status = triton_->ModelInfer(
      Context().get(), ForkRequest(IntId(62), IntId(60), step, 3), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  status = triton_->ModelInfer(Context().get(),
                               SequenceRequest(IntId(62), false, false, step),
                               &response);
  EXPECT_EQ(status.error_message(),
            "sequence_id: inference request for sequence 62 to model "
            "'attention_session' must specify the START flag on the first "
            "request of the sequence");
  EXPECT_EQ(Metric(metrics, "attnserve_sessions_open"), 2);
  for (auto [id, reference] :
       {std::pair{IntId(60), &parent_ref}, {IntId(61), &open_ref}}) {
    step = RandomStep(1, rng_);
    infer(SequenceRequest(id, false, false, step), *reference, step);
  }

  // A fork onto open sequence 61 replaces it (its session freed).
  AttentionSequenceReference fork_ref = parent_ref;
  step = RandomStep(1, rng_);
  infer(ForkRequest(IntId(61), IntId(60), step), fork_ref, step);
  EXPECT_EQ(Metric(metrics, "attnserve_sessions_open"), 2);
  step = RandomStep(1, rng_);
  infer(SequenceRequest(IntId(61), false, true, step), fork_ref, step);
  step = RandomStep(1, rng_);
  infer(SequenceRequest(IntId(60), false, true, step), parent_ref, step);
  EXPECT_EQ(Metric(metrics, "attnserve_sessions_open"), 0);
}

// Every misuse of the sequence parameters, with its message.
TEST_F(TritonProtocolTest, SequenceErrors) {
  const AttentionStep step = RandomStep(1, rng_);
  const auto infer = [&](ModelInferRequest request) {
    ModelInferResponse response;
    return triton_->ModelInfer(Context().get(), request, &response);
  };
  const auto expect = [&](ModelInferRequest request, grpc::StatusCode code,
                          const std::string& message) {
    const grpc::Status status = infer(std::move(request));
    EXPECT_EQ(status.error_code(), code) << message;
    EXPECT_EQ(status.error_message(), message);
  };
  const auto with = [&](ModelInferRequest request, const std::string& name,
                        inference::InferParameter value) {
    (*request.mutable_parameters())[name] = std::move(value);
    return request;
  };
  const auto bool_param = [](bool b) {
    inference::InferParameter p;
    p.set_bool_param(b);
    return p;
  };
  expect(SequenceRequest(IntId(7), false, false, step),
         grpc::StatusCode::INVALID_ARGUMENT,
         "sequence_id: inference request for sequence 7 to model "
         "'attention_session' must specify the START flag on the first "
         "request of the sequence");
  ModelInferRequest on_attend = AttendRequest();
  expect(with(on_attend, "sequence_id", IntId(7)),
         grpc::StatusCode::INVALID_ARGUMENT,
         "parameters: sequence_id: model 'attend' keeps no state between "
         "requests; sequences run on attention_session and on the sequence "
         "model of each served model");
  // Id 0 is no sequence: its flags alone mean nothing.
  EXPECT_TRUE(infer(with(on_attend, "sequence_id", IntId(0))).ok());
  expect(with(on_attend, "sequence_end", bool_param(true)),
         grpc::StatusCode::INVALID_ARGUMENT,
         "parameters: sequence_end needs a sequence_id (a non-zero uint64 or a "
         "non-empty string)");
  expect(with(SequenceRequest(IntId(7), true, false, step), "sequence_id",
              bool_param(true)),
         grpc::StatusCode::INVALID_ARGUMENT,
         "parameters: sequence_id must be a uint64 or a string, got bool");
  expect(with(SequenceRequest(IntId(7), true, false, step), "sequence_id",
              IntId(-3)),
         grpc::StatusCode::INVALID_ARGUMENT,
         "parameters: sequence_id must not be negative, got -3");
  // sequence_fork takes ids as sequence_id does, on a start only.
  expect(with(SequenceRequest(IntId(7), true, false, step), "sequence_fork",
              bool_param(true)),
         grpc::StatusCode::INVALID_ARGUMENT,
         "parameters: sequence_fork must be a uint64 or a string, got bool");
  expect(with(SequenceRequest(IntId(7), true, false, step), "sequence_fork",
              IntId(-3)),
         grpc::StatusCode::INVALID_ARGUMENT,
         "parameters: sequence_fork must not be negative, got -3");
  // 0 forks nothing, as sequence_id 0 is no sequence: a plain start.
  EXPECT_TRUE(infer(with(SequenceRequest(IntId(10), true, true, step),
                         "sequence_fork", IntId(0)))
                  .ok());
  expect(with(SequenceRequest(IntId(7), false, false, step), "sequence_fork",
              IntId(8)),
         grpc::StatusCode::INVALID_ARGUMENT,
         "parameters: sequence_fork applies to the first request of a "
         "sequence only (with sequence_start true): it starts sequence_id as "
         "a fork");
  expect(with(on_attend, "sequence_fork", StringId("8")),
         grpc::StatusCode::INVALID_ARGUMENT,
         "parameters: sequence_fork needs a sequence_id (a non-zero uint64 or "
         "a non-empty string)");
  expect(ForkRequest(StringId("s"), StringId("s"), step),
         grpc::StatusCode::INVALID_ARGUMENT,
         "parameters: sequence_fork: sequence \"s\" cannot fork itself; to go "
         "back in a sequence, step it with sequence_position");
  expect(with(ForkRequest(IntId(7), IntId(8), step), "max_length", IntId(16)),
         grpc::StatusCode::INVALID_ARGUMENT,
         "parameters: max_length: a fork keeps the settings of the sequence it "
         "forks (sequence_fork 8)");
  expect(ForkRequest(IntId(7), IntId(8), step),
         grpc::StatusCode::INVALID_ARGUMENT,
         "sequence_fork: inference request for sequence 7 to model "
         "'attention_session' forks sequence 8, which has not been started or "
         "has ended; a fork continues an open sequence of its own model");
  // 8 and "8" are different sequences, of a fork as of a step.
  ASSERT_TRUE(infer(SequenceRequest(StringId("8"), true, false, step)).ok());
  expect(ForkRequest(IntId(7), IntId(8), step),
         grpc::StatusCode::INVALID_ARGUMENT,
         "sequence_fork: inference request for sequence 7 to model "
         "'attention_session' forks sequence 8, which has not been started or "
         "has ended; a fork continues an open sequence of its own model");
  // A sequence of another model.
  ModelInferRequest mha_start;
  mha_start.set_model_name("mha_session");
  (*mha_start.mutable_parameters())["sequence_id"] = IntId(50);
  (*mha_start.mutable_parameters())["sequence_start"] = bool_param(true);
  auto* hidden = mha_start.add_inputs();
  hidden->set_name("query");
  hidden->set_datatype("FP32");
  hidden->add_shape(1);
  hidden->add_shape(kEmbed);
  mha_start.add_raw_input_contents(Bytes(RandomFloats(kEmbed, rng_)));
  ASSERT_TRUE(infer(mha_start).ok());
  expect(ForkRequest(IntId(7), IntId(50), step),
         grpc::StatusCode::INVALID_ARGUMENT,
         "sequence_fork: inference request for sequence 7 to model "
         "'attention_session' forks sequence 50, which is a sequence of model "
         "'mha_session'; a fork continues a sequence of its own model");
  // Past what the parent holds ("8" holds 1 token).
  expect(ForkRequest(IntId(7), StringId("8"), step, /*position=*/2),
         grpc::StatusCode::INVALID_ARGUMENT,
         "parameters: sequence_position: 2 is not in [0, 1]: a fork starts "
         "with that many tokens of sequence \"8\" of model "
         "'attention_session', which holds 1");
  ModelInferRequest no_sequence = SequenceRequest(IntId(7), true, false, step);
  no_sequence.mutable_parameters()->clear();
  expect(no_sequence, grpc::StatusCode::INVALID_ARGUMENT,
         "parameters: model 'attention_session' answers requests of a "
         "sequence only: set sequence_id (and sequence_start on the first "
         "request)");
  expect(with(SequenceRequest(IntId(7), false, false, step), "max_length",
              IntId(16)),
         grpc::StatusCode::INVALID_ARGUMENT,
         "parameters: max_length applies to the first request of a sequence "
         "only (with sequence_start true)");
  ModelInferRequest on_mha = SequenceRequest(IntId(7), true, false, step);
  on_mha.set_model_name("mha_session");
  expect(with(on_mha, "rotary_dims", IntId(4)),
         grpc::StatusCode::INVALID_ARGUMENT,
         "parameters: rotary_dims: model 'mha_session' has its own; only "
         "sequences of "
         "attention_session take it");
  expect(on_mha, grpc::StatusCode::INVALID_ARGUMENT,
         "inputs: unknown input 'key' in a sequence of model 'mha_session'; "
         "expected "
         "query (the step's hidden states [B, n, E] or [n, E]; keys and values "
         "are projected from them)");
  // A failed start leaves no sequence.
  ModelInferRequest too_long =
      with(SequenceRequest(IntId(9), true, false, RandomStep(5, rng_)),
           "max_length", IntId(4));
  EXPECT_EQ(infer(too_long).error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(infer(SequenceRequest(IntId(9), false, false, step)).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

// A SessionSteps entry over the server's tensor limit fails alone, in its
// result; the good entries around it step as usual.
TEST_F(TritonProtocolTest, SessionStepsEntryOverTheLimitsFailsAlone) {
  v1::CreateSessionRequest create;
  create.set_num_heads(2);
  create.set_num_kv_heads(1);
  create.set_head_dim(8);
  create.set_max_length(16);
  std::string ids[3];
  for (std::string& id : ids) {
    v1::CreateSessionResponse created;
    ASSERT_TRUE(native_->CreateSession(Context().get(), create, &created).ok());
    id = created.session_id();
  }
  const auto step = [&](const std::string& id, int64_t n) {
    v1::SessionStepRequest request;
    request.set_session_id(id);
    for (auto [tensor, heads] : {std::pair{request.mutable_query(), 2},
                                 {request.mutable_key(), 1},
                                 {request.mutable_value(), 1}}) {
      tensor->set_dtype(v1::DATA_TYPE_FLOAT32);
      for (int64_t d : {int64_t{1}, int64_t{heads}, n, int64_t{8}}) {
        tensor->add_shape(d);
      }
      if (n == 1) tensor->set_raw_data(Bytes(RandomFloats(heads * 8, rng_)));
    }
    return request;
  };
  v1::SessionStepsRequest request;
  *request.add_steps() = step(ids[0], 1);
  *request.add_steps() = step(ids[1], int64_t{1} << 40);  // and no data
  *request.add_steps() = step(ids[2], 1);
  v1::SessionStepsResponse response;
  const grpc::Status status =
      native_->SessionSteps(Context().get(), request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.results_size(), 3);
  EXPECT_EQ(response.results(0).code(), 0) << response.results(0).message();
  EXPECT_EQ(response.results(0).length(), 1);
  EXPECT_EQ(response.results(1).code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(response.results(1).message(),
              ::testing::StartsWith(
                  "steps[1]: a tensor of 17592186044416 elements exceeds "
                  "--max_tensor_elements "));
  EXPECT_EQ(response.results(2).code(), 0) << response.results(2).message();
}

// String sequence ids are bounded in bytes, as the table of them is in
// count: 1 MiB ids once held memory past their sequences' end.
TEST_F(TritonProtocolTest, LongSequenceIdsAreRefused) {
  const AttentionStep step = RandomStep(1, rng_);
  ModelInferResponse response;
  const std::string longest(kMaxSequenceIdBytes, 's');
  EXPECT_TRUE(
      triton_
          ->ModelInfer(Context().get(),
                       SequenceRequest(StringId(longest), true, true, step),
                       &response)
          .ok());
  const grpc::Status status = triton_->ModelInfer(
      Context().get(),
      SequenceRequest(StringId(std::string(1 << 20, 's')), true, false, step),
      &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "parameters: sequence_id: a string id of 1048576 bytes; a "
            "sequence id has at most 256");
  const grpc::Status fork = triton_->ModelInfer(
      Context().get(),
      ForkRequest(IntId(5), StringId(std::string(300, 'p')), step), &response);
  EXPECT_EQ(fork.error_message(),
            "parameters: sequence_fork: a string id of 300 bytes; a sequence "
            "id has at most 256");
}

// A sequence whose session the store evicted is gone, saying so, to every
// request naming it until a start begins it again (a request that fails
// changes nothing).
TEST(TritonSequenceTest, EvictedSequenceIsGone) {
  ServerOptions options;
  options.max_sessions = 1;
  TestServer server(options);
  auto triton = inference::GRPCInferenceService::NewStub(
      grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials()));
  std::mt19937 rng(5);
  const AttentionStep step = RandomStep(1, rng);
  ModelInferResponse response;
  ASSERT_TRUE(triton
                  ->ModelInfer(Context().get(),
                               SequenceRequest(IntId(1), true, false, step),
                               &response)
                  .ok());
  ASSERT_TRUE(
      triton
          ->ModelInfer(Context().get(),
                       SequenceRequest(StringId("b"), true, false, step),
                       &response)
          .ok());
  grpc::Status status = triton->ModelInfer(
      Context().get(), SequenceRequest(IntId(1), false, false, step),
      &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(),
              ::testing::StartsWith(
                  "sequence_id: sequence 1 of model 'attention_session' is "
                  "gone (session_id: session \""));
  EXPECT_THAT(status.error_message(),
              ::testing::EndsWith(
                  "was evicted (least recently used) to make room for other "
                  "sessions); send its first request again with "
                  "sequence_start"));
  const std::string gone = status.error_message();
  for (int i = 0; i < 2; ++i) {
    status = triton->ModelInfer(Context().get(),
                                SequenceRequest(IntId(1), false, false, step),
                                &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(status.error_message(), gone);
  }
  // The other sequence goes on.
  EXPECT_TRUE(
      triton
          ->ModelInfer(Context().get(),
                       SequenceRequest(StringId("b"), false, true, step),
                       &response)
          .ok());
  // A start begins it again.
  EXPECT_TRUE(triton
                  ->ModelInfer(Context().get(),
                               SequenceRequest(IntId(1), true, false, step),
                               &response)
                  .ok());
}

// A fork of a sequence whose session the store evicted is NOT_FOUND,
// saying so, over gRPC and HTTP; nothing is started, and the parent stays
// gone for every later request naming it.
TEST(TritonSequenceTest, ForkOfAnEvictedSequenceIsGone) {
  ServerOptions options;
  options.max_sessions = 1;
  TestServer server(options);
  auto triton = inference::GRPCInferenceService::NewStub(
      grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials()));
  httplib::Client http("127.0.0.1", server.http_port());
  std::mt19937 rng(6);
  const AttentionStep step = RandomStep(1, rng);
  const auto infer = [&](const ModelInferRequest& request) {
    ModelInferResponse response;
    return triton->ModelInfer(Context().get(), request, &response);
  };
  const auto expect_gone = [](int code, const std::string& message,
                              const std::string& parent) {
    EXPECT_EQ(code, grpc::StatusCode::NOT_FOUND) << message;
    EXPECT_THAT(message, ::testing::StartsWith(absl::StrCat(
                             "sequence_fork: sequence ", parent,
                             " of model 'attention_session' is gone "
                             "(session_id: session \"")));
    EXPECT_THAT(message,
                ::testing::EndsWith(
                    "was evicted (least recently used) to make room for "
                    "other sessions); send its first request again with "
                    "sequence_start"));
  };
  ASSERT_TRUE(infer(SequenceRequest(IntId(1), true, false, step)).ok());
  ASSERT_TRUE(infer(SequenceRequest(IntId(2), true, false, step)).ok());
  ASSERT_TRUE(infer(SequenceRequest(StringId("b"), true, false, step)).ok());
  // 1 and 2 were evicted to make room.
  const grpc::Status status = infer(ForkRequest(IntId(3), IntId(1), step));
  expect_gone(status.error_code(), status.error_message(), "1");
  const json body = HttpSequenceStep(
      {{"sequence_id", 3}, {"sequence_start", true}, {"sequence_fork", 2}},
      step);
  const auto answer = http.Post("/v2/models/attention_session/infer",
                                body.dump(), "application/json");
  ASSERT_TRUE(answer);
  EXPECT_EQ(answer->status, 404);
  expect_gone(grpc::StatusCode::NOT_FOUND,
              json::parse(answer->body)["error"].get<std::string>(), "2");
  // Still gone: a failed fork used nothing up.
  const grpc::Status again = infer(ForkRequest(IntId(3), IntId(1), step));
  expect_gone(again.error_code(), again.error_message(), "1");
  const grpc::Status step_on_parent =
      infer(SequenceRequest(IntId(1), false, false, step));
  EXPECT_EQ(step_on_parent.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(infer(SequenceRequest(IntId(3), false, false, step)).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(infer(SequenceRequest(StringId("b"), false, true, step)).ok());
}

// The logging extension: log_info turns the access log off and on at
// once; what the server cannot change is reported and refused otherwise.
TEST_F(TritonProtocolTest, LogSettingsOverBothProtocols) {
  inference::LogSettingsRequest request;
  inference::LogSettingsResponse response;
  ASSERT_TRUE(triton_->LogSettings(Context().get(), request, &response).ok());
  const auto& settings = response.settings();
  EXPECT_TRUE(settings.at("log_info").bool_param());
  EXPECT_TRUE(settings.at("log_warnings").bool_param());
  EXPECT_TRUE(settings.at("log_errors").bool_param());
  EXPECT_EQ(settings.at("log_verbose_level").uint32_param(), 0u);
  EXPECT_EQ(settings.at("log_file").string_param(), "");
  EXPECT_EQ(settings.at("log_format").string_param(), "default");

  (*request.mutable_settings())["log_info"].set_bool_param(false);
  ASSERT_TRUE(triton_->LogSettings(Context().get(), request, &response).ok());
  EXPECT_FALSE(response.settings().at("log_info").bool_param());
  ModelInferResponse infer;
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(
      triton_->ModelInfer(Context().get(), AttendRequest(), &infer).ok());
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              ::testing::Not(HasSubstr("access rpc=ModelInfer")));
  EXPECT_EQ(Get("/v2/logging"), json({{"log_file", ""},
                                      {"log_info", false},
                                      {"log_warnings", true},
                                      {"log_errors", true},
                                      {"log_verbose_level", 0},
                                      {"log_format", "default"}}));
  EXPECT_EQ(Post("/v2/logging", R"({"log_info": true})")["log_info"], true);
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(
      triton_->ModelInfer(Context().get(), AttendRequest(), &infer).ok());
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("access rpc=ModelInfer/Attend model='attend'"));

  using Value = inference::LogSettingsRequest::SettingValue;
  const auto refused = [&](const char* name, Value value,
                           const std::string& message) {
    inference::LogSettingsRequest bad;
    (*bad.mutable_settings())[name] = std::move(value);
    const grpc::Status status =
        triton_->LogSettings(Context().get(), bad, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << name;
    EXPECT_EQ(status.error_message(), message);
  };
  Value one, no, path, yes, on;
  one.set_uint32_param(1);
  no.set_bool_param(false);
  path.set_string_param("/tmp/log");
  yes.set_string_param("yes");
  on.set_bool_param(true);
  refused("log_verbose_level", one,
          "settings: log_verbose_level: attnserve has no verbose log; only 0");
  refused("log_warnings", no,
          "settings: log_warnings: set by --log_level when the server starts; "
          "it cannot change while the server runs");
  refused("log_file", path,
          "settings: log_file: attnserve logs to stderr only; only \"\"");
  refused("log_info", yes, "settings: log_info must be a bool");
  refused("log_colour", on,
          "settings: unknown log setting 'log_colour'; expected one of "
          "log_file, log_info, log_warnings, log_errors, log_verbose_level, "
          "log_format");
  // Accepted when it asks for what is.
  EXPECT_EQ(Post("/v2/logging",
                 R"({"log_warnings": true, "log_format": "default",
                     "log_verbose_level": 0})")["log_info"],
            true);
  EXPECT_EQ(
      Post("/v2/logging", R"({"log_verbose_level": 2})", 400)["error"],
      "settings: log_verbose_level: attnserve has no verbose log; only 0");
  EXPECT_EQ(http_.Put("/v2/logging", "{}", "application/json")->status, 405);
}

// The trace extension: settings stored and reported, globally and per
// model; attnserve traces nothing, so only trace_level OFF is accepted.
TEST_F(TritonProtocolTest, TraceSettingsOverBothProtocols) {
  using Settings =
      std::vector<std::pair<std::string, std::vector<std::string>>>;
  const auto trace = [&](const std::string& model, const Settings& settings,
                         inference::TraceSettingResponse* response) {
    inference::TraceSettingRequest request;
    request.set_model_name(model);
    for (const auto& [name, values] : settings) {
      (*request.mutable_settings())[name].mutable_value()->Assign(
          values.begin(), values.end());
    }
    return triton_->TraceSetting(Context().get(), request, response);
  };
  const auto value = [](const inference::TraceSettingResponse& response,
                        const std::string& name) {
    const auto& values = response.settings().at(name).value();
    return std::vector<std::string>(values.begin(), values.end());
  };
  inference::TraceSettingResponse response;
  ASSERT_TRUE(trace("", {}, &response).ok());
  EXPECT_THAT(value(response, "trace_level"), ElementsAre("OFF"));
  EXPECT_THAT(value(response, "trace_rate"), ElementsAre("1000"));
  EXPECT_THAT(value(response, "trace_count"), ElementsAre("-1"));
  EXPECT_THAT(value(response, "log_frequency"), ElementsAre("0"));
  EXPECT_THAT(value(response, "trace_mode"), ElementsAre("triton"));

  ASSERT_TRUE(trace("", {{"trace_rate", {"100"}}}, &response).ok());
  EXPECT_THAT(value(response, "trace_rate"), ElementsAre("100"));
  // A model's settings: the global ones, overlaid with its own.
  ASSERT_TRUE(trace("mha", {{"trace_count", {"5"}}}, &response).ok());
  EXPECT_THAT(value(response, "trace_rate"), ElementsAre("100"));
  EXPECT_THAT(value(response, "trace_count"), ElementsAre("5"));
  ASSERT_TRUE(trace("", {}, &response).ok());
  EXPECT_THAT(value(response, "trace_count"), ElementsAre("-1"));
  // No value clears the model's own setting.
  ASSERT_TRUE(trace("mha", {{"trace_count", {}}}, &response).ok());
  EXPECT_THAT(value(response, "trace_count"), ElementsAre("-1"));

  grpc::Status status = trace("", {{"trace_level", {"TIMESTAMPS"}}}, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "settings: trace_level: attnserve does not trace requests; only "
            "OFF is accepted, got 'TIMESTAMPS'");
  status = trace("", {{"trace_rate", {"0"}}}, &response);
  EXPECT_EQ(status.error_message(),
            "settings: trace_rate: expected an integer >= 1, got '0'");
  status = trace("", {{"trace_mode", {"opentelemetry"}}}, &response);
  EXPECT_EQ(status.error_message(),
            "settings: trace_mode: only 'triton' is accepted, got "
            "'opentelemetry'");
  status = trace("wrong_model_name", {}, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(),
            absl::StrCat("model_name: ", kNotServedRest));

  EXPECT_EQ(Get("/v2/trace/setting"), json({{"trace_file", ""},
                                            {"trace_level", {"OFF"}},
                                            {"trace_rate", "100"},
                                            {"trace_count", "-1"},
                                            {"log_frequency", "0"},
                                            {"trace_mode", "triton"}}));
  EXPECT_EQ(Post("/v2/models/mha/trace/setting",
                 R"({"trace_rate": "10"})")["trace_rate"],
            "10");
  EXPECT_EQ(Post("/v2/models/mha/trace/setting",
                 R"({"trace_rate": null})")["trace_rate"],
            "100");
  EXPECT_EQ(Post("/v2/trace/setting", R"({"trace_level": ["TENSORS"]})",
                 400)["error"],
            "settings: trace_level: attnserve does not trace requests; only "
            "OFF is accepted, got 'TENSORS'");
  EXPECT_EQ(Get("/v2/models/wrong_model_name/trace/setting", 404)["error"],
            absl::StrCat("model_name: ", kNotServedRest));
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

// The requests of Triton's C++ client library and perf_analyzer (r25.12),
// as they send them: model metadata and configuration, server metadata,
// statistics before and after a window, every gRPC ModelInfer carrying
// triton_enable_empty_final_response, every output requested by name.
// perf_analyzer stops with "Server side statistics compute counts must be
// the same" unless compute_input, compute_infer and compute_output grow
// alike.
TEST_F(TritonProtocolTest, TritonCppClientRequests) {
  const inference::ModelStatistics before = Statistics("attend");
  ModelInferRequest request = AttendRequest("pa");
  request.mutable_outputs()->Clear();
  request.add_outputs()->set_name("output");
  request.add_outputs()->set_name("weights");
  (*request.mutable_parameters())["triton_enable_empty_final_response"]
      .set_bool_param(true);
  ModelInferResponse response;
  for (int i = 0; i < 3; ++i) {
    const grpc::Status status =
        triton_->ModelInfer(Context().get(), request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  ASSERT_EQ(response.outputs_size(), 2);
  ExpectNear(Floats(response.raw_output_contents(0)), Expected());
  const inference::InferStatistics after =
      Statistics("attend").inference_stats();
  const inference::InferStatistics& was = before.inference_stats();
  EXPECT_EQ(after.compute_input().count() - was.compute_input().count(), 3);
  EXPECT_EQ(after.compute_infer().count() - was.compute_infer().count(), 3);
  EXPECT_EQ(after.compute_output().count() - was.compute_output().count(), 3);
  EXPECT_EQ(after.queue().count() - was.queue().count(), 3);

  // Over a stream (perf_analyzer --streaming): each response is final.
  auto context = Context();
  auto stream = triton_->ModelStreamInfer(context.get());
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->WritesDone());
  inference::ModelStreamInferResponse answer;
  ASSERT_TRUE(stream->Read(&answer));
  EXPECT_EQ(answer.error_message(), "");
  EXPECT_TRUE(answer.infer_response()
                  .parameters()
                  .at("triton_final_response")
                  .bool_param());
  EXPECT_TRUE(stream->Finish().ok());

  // Triton's own parameters are Triton's to check; attnserve's are still
  // checked by name.
  ModelInferRequest wrong_type = request;
  (*wrong_type.mutable_parameters())["triton_enable_empty_final_response"]
      .set_string_param("yes");
  grpc::Status status =
      triton_->ModelInfer(Context().get(), wrong_type, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "parameters: triton_enable_empty_final_response must be a bool, "
            "got string");
  ModelInferRequest other_triton = request;
  (*other_triton.mutable_parameters())["triton_future_flag"].set_int64_param(1);
  (*other_triton.mutable_inputs(0)->mutable_parameters())["triton_hint"]
      .set_bool_param(true);
  EXPECT_TRUE(
      triton_->ModelInfer(Context().get(), other_triton, &response).ok());
  ModelInferRequest misspelled = request;
  (*misspelled.mutable_parameters())["casual"].set_bool_param(true);
  status = triton_->ModelInfer(Context().get(), misspelled, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "parameters: unknown parameter 'casual' for model 'attend'; "
            "expected one of causal, scale, temperature, return_weights, "
            "compute_bf16, enable_gqa");
}

// perf_analyzer --shared-memory system over gRPC: every output in a region,
// and one (empty) raw_output_contents entry per output, as Triton answers.
TEST_F(TritonProtocolTest, GrpcOutputsInSharedMemoryKeepTheirEntries) {
  const size_t bytes = 2 * 3 * 8 * sizeof(float);
  const size_t weight_bytes = 2 * 3 * 3 * sizeof(float);
  auto shm = SharedMemoryBuffer::Create(UniqueSharedMemoryKey("pa_outputs"),
                                        bytes + weight_bytes);
  ASSERT_TRUE(shm.ok()) << shm.status();
  inference::SystemSharedMemoryRegisterRequest region;
  region.set_name("outputs");
  region.set_key((*shm)->key());
  region.set_byte_size(bytes + weight_bytes);
  inference::SystemSharedMemoryRegisterResponse registered;
  ASSERT_TRUE(
      triton_->SystemSharedMemoryRegister(Context().get(), region, &registered)
          .ok());
  ModelInferRequest request = AttendRequest();
  request.mutable_outputs()->Clear();
  for (auto [name, offset, size] :
       {std::tuple{"output", size_t{0}, bytes},
        std::tuple{"weights", bytes, weight_bytes}}) {
    auto* output = request.add_outputs();
    output->set_name(name);
    auto& parameters = *output->mutable_parameters();
    parameters["shared_memory_region"].set_string_param("outputs");
    parameters["shared_memory_byte_size"].set_int64_param(size);
    if (offset > 0) parameters["shared_memory_offset"].set_int64_param(offset);
  }
  ModelInferResponse response;
  const grpc::Status status =
      triton_->ModelInfer(Context().get(), request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.outputs_size(), 2);
  ASSERT_EQ(response.raw_output_contents_size(), 2);
  EXPECT_EQ(response.raw_output_contents(1), "");
  ExpectNear(Floats(std::string((*shm)->data(), bytes)), Expected());
}

// A request that names no output gets every output of its model (the
// protocol's rule; Triton's examples read "weights" so); a parameter
// return_weights still decides for itself.
TEST_F(TritonProtocolTest, RequestWithoutOutputsGetsEveryOutput) {
  ModelInferRequest request = AttendRequest();
  request.mutable_outputs()->Clear();
  ModelInferResponse response;
  grpc::Status status =
      triton_->ModelInfer(Context().get(), request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.outputs_size(), 2);
  EXPECT_EQ(response.outputs(0).name(), "output");
  EXPECT_EQ(response.outputs(1).name(), "weights");
  EXPECT_THAT(response.outputs(1).shape(), ElementsAre(2, 3, 3));
  ExpectNear(Floats(response.raw_output_contents(0)), Expected());
  const Shape shape = {2, 3, 8};
  const auto ref = [&](const std::vector<float>& x) {
    return RefTensor{shape, std::vector<double>(x.begin(), x.end())};
  };
  ExpectNear(Floats(response.raw_output_contents(1)),
             RefAttend(ref(qkv_[0]), ref(qkv_[1]), ref(qkv_[2]), {}, {}, {})
                 .weights.values);

  (*request.mutable_parameters())["return_weights"].set_bool_param(false);
  status = triton_->ModelInfer(Context().get(), request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.outputs_size(), 1);
  EXPECT_EQ(response.outputs(0).name(), "output");

  json body = {{"inputs", json::array()}};
  for (int i = 0; i < 3; ++i) {
    body["inputs"].push_back({{"name", kNames[i]},
                              {"datatype", "FP32"},
                              {"shape", {2, 3, 8}},
                              {"data", qkv_[i]}});
  }
  const json answer = Post("/v2/models/attend/infer", body.dump());
  ASSERT_EQ(answer["outputs"].size(), 2);
  EXPECT_EQ(answer["outputs"][1]["name"], "weights");
}

// A served model is stateless under its name; its sequences are the model
// "<name>_session", whose metadata lists only what a step takes.
TEST_F(TritonProtocolTest, SequencesOfAServedModelHaveTheirOwnModel) {
  ModelInferRequest request;
  request.set_model_name("mha");
  (*request.mutable_parameters())["sequence_id"].set_uint64_param(5);
  (*request.mutable_parameters())["sequence_start"].set_bool_param(true);
  auto* hidden = request.add_inputs();
  hidden->set_name("query");
  hidden->set_datatype("FP32");
  hidden->add_shape(2);
  hidden->add_shape(16);
  request.add_raw_input_contents(Bytes(RandomFloats(2 * 16, rng_)));
  ModelInferResponse response;
  grpc::Status status =
      triton_->ModelInfer(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "parameters: sequence_id: model 'mha' keeps no state between "
            "requests; its sequences are model 'mha_session'");
  request.set_model_name("mha_session");
  status = triton_->ModelInfer(Context().get(), request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.outputs_size(), 1);
  EXPECT_THAT(response.outputs(0).shape(), ElementsAre(2, 16));
  request.mutable_parameters()->clear();
  status = triton_->ModelInfer(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "parameters: model 'mha_session' answers requests of a sequence "
            "only: set sequence_id (and sequence_start on the first request)");
  request.set_model_name("attend");
  (*request.mutable_parameters())["sequence_id"].set_uint64_param(5);
  status = triton_->ModelInfer(Context().get(), request, &response);
  EXPECT_EQ(status.error_message(),
            "parameters: sequence_id: model 'attend' keeps no state between "
            "requests; sequences run on attention_session and on the "
            "sequence model of each served model");
}

// JSON's NaN and Infinity as Triton's parser takes them (rapidjson's
// kParseNanAndInfFlag), in data and in parameters: Triton's Python client
// writes them.
TEST_F(TritonProtocolTest, HttpJsonTakesNanAndInfinity) {
  const std::string body = R"({
    "inputs": [
      {"name": "input", "datatype": "FP32", "shape": [2, 4],
       "data": [1, 2, 3, 4, NaN, Infinity, -Infinity, 0]}],
    "outputs": [{"name": "output"}]})";
  const json answer = Post("/v2/models/layer_norm/infer", body);
  const json& data = answer["outputs"][0]["data"];
  ASSERT_EQ(data.size(), 8);
  EXPECT_NEAR(data[0].get<double>(), -1.3416354, 1e-6);
  EXPECT_NEAR(data[3].get<double>(), 1.3416354, 1e-6);
  // A row with a non-finite value normalizes to NaN (null in JSON).
  for (int i = 4; i < 8; ++i) EXPECT_TRUE(data[i].is_null()) << i;
  for (const char* token : {"-NaN", "Inf", "-Inf"}) {
    const std::string one = absl::StrCat(
        R"({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2],)",
        R"( "data": [1, )", token, R"(]}]})");
    EXPECT_TRUE(
        Post("/v2/models/layer_norm/infer", one)["outputs"][0]["data"][0]
            .is_null())
        << token;
  }
  // As a parameter: a double, checked by the operation (eps must be
  // finite).
  const json refused =
      Post("/v2/models/layer_norm/infer",
           R"({"parameters": {"eps": Infinity}, "inputs": [{"name": "input",
          "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]})",
           400);
  EXPECT_EQ(refused["error"],
            "parameters: eps = inf is not a finite float32 value");
  // In strings they stay text, and other spellings are not JSON.
  EXPECT_EQ(Post("/v2/models/layer_norm/infer",
                 R"({"inputs": [{"name": "NaN", "datatype": "FP32",
                     "shape": [1], "data": [1]}]})",
                 400)["error"],
            "inputs: unknown input 'NaN' for model 'layer_norm'; expected "
            "one of input, gamma, beta");
  EXPECT_THAT(Post("/v2/models/layer_norm/infer",
                   R"({"inputs": [{"name": "input", "datatype": "FP32",
                       "shape": [1], "data": [nan]}]})",
                   400)["error"]
                  .get<std::string>(),
              HasSubstr("body: not valid JSON"));
  EXPECT_EQ(Post("/v2/models/layer_norm/infer",
                 R"({"inputs": [{"name": "input", "datatype": "BOOL",
                     "shape": [1], "data": [NaN]}]})",
                 400)["error"],
            "inputs[0] (input): data[0]: expected true or false, got number");
}

}  // namespace
}  // namespace attnserve::testing
