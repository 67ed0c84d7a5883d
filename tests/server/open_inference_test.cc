// The Open Inference Protocol (KServe v2) through a live server, over gRPC
// (inference.GRPCInferenceService) and HTTP/JSON: results equal the native
// RPCs' bit for bit, errors carry the native codes and name the field.
#include "server/open_inference.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/shared_memory.h"
#include "core/convert.h"
#include "core/verify.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "inference/grpc_service.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "proto/tensor_codec.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;
using ::testing::HasSubstr;
using json = nlohmann::json;

// A boolean mask that keeps about a third of the positions.
v1::Tensor Mask(Shape shape, std::mt19937& rng) {
  std::string keep(NumElements(shape), '\0');
  for (char& c : keep) c = rng() % 3 == 0 ? 1 : 0;
  return WireTensor(v1::DATA_TYPE_BOOL, shape, std::move(keep));
}

std::string Datatype(v1::DataType dtype) {
  return std::string(ProtocolDatatype(dtype));
}

// Adds `tensor` as input `name` in raw_input_contents.
void AddRaw(const std::string& name, const v1::Tensor& tensor,
            ModelInferRequest* request) {
  auto* input = request->add_inputs();
  input->set_name(name);
  input->set_datatype(Datatype(tensor.dtype()));
  input->mutable_shape()->CopyFrom(tensor.shape());
  request->add_raw_input_contents(tensor.raw_data());
}

// The output `name` of a response, as raw bytes; fails the test if absent.
std::string RawOutput(const ModelInferResponse& response,
                      const std::string& name) {
  for (int i = 0; i < response.outputs_size(); ++i) {
    if (response.outputs(i).name() == name) {
      return response.raw_output_contents(i);
    }
  }
  ADD_FAILURE() << "no output " << name;
  return "";
}

std::unique_ptr<grpc::ClientContext> Context(const std::string& token = "") {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::seconds(60));
  if (!token.empty()) context->AddMetadata("authorization", "Bearer " + token);
  return context;
}

class OpenInferenceTest : public ::testing::Test {
 protected:
  static ServerOptions Options(const TempModelRepository& repo) {
    ServerOptions options;
    options.model_repository = repo.root();
    return options;
  }

  OpenInferenceTest()
      : repo_("open_inference"),
        server_(Options(repo_)),
        channel_(grpc::CreateChannel(server_.target(),
                                     grpc::InsecureChannelCredentials())),
        native_(v1::AttentionService::NewStub(channel_)),
        protocol_(inference::GRPCInferenceService::NewStub(channel_)),
        http_("127.0.0.1", server_.http_port()) {
    http_.set_read_timeout(60);
  }

  grpc::Status Infer(const ModelInferRequest& request,
                     ModelInferResponse* response) {
    return protocol_->ModelInfer(Context().get(), request, response);
  }

  // POSTs `body` to the model's infer endpoint.
  httplib::Result Post(const std::string& model, const std::string& body,
                       const httplib::Headers& headers = {}) {
    return http_.Post(absl::StrCat("/v2/models/", model, "/infer").c_str(),
                      headers, body, "application/json");
  }

  std::mt19937 rng_{17};
  TempModelRepository repo_;
  TestServer server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> native_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> protocol_;
  httplib::Client http_;
};

TEST_F(OpenInferenceTest, AttendEqualsTheNativeRpc) {
  const v1::Tensor q = RandomWireTensor(DType::kFloat32, {2, 5, 8}, rng_);
  const v1::Tensor k = RandomWireTensor(DType::kFloat32, {2, 7, 8}, rng_);
  const v1::Tensor v = RandomWireTensor(DType::kFloat32, {2, 7, 4}, rng_);
  const v1::Tensor mask = Mask({5, 7}, rng_);
  struct Case {
    std::string name;
    std::function<void(v1::AttendRequest*, ModelInferRequest*)> set;
  };
  // A request that names no output gets every output: the weights too.
  const std::vector<Case> cases = {
      {"plain, every output",
       [](v1::AttendRequest* n, auto*) { n->set_return_weights(true); }},
      {"causal, output only",
       [](v1::AttendRequest* n, ModelInferRequest* p) {
         n->set_causal(true);
         (*p->mutable_parameters())["causal"].set_bool_param(true);
         p->add_outputs()->set_name("output");
       }},
      {"scale and temperature, every output",
       [](v1::AttendRequest* n, ModelInferRequest* p) {
         n->set_scale(0.3f);
         n->set_temperature(2);
         n->set_return_weights(true);
         (*p->mutable_parameters())["scale"].set_double_param(0.3);
         (*p->mutable_parameters())["temperature"].set_int64_param(2);
       }},
      {"weights by parameter",
       [](v1::AttendRequest* n, ModelInferRequest* p) {
         n->set_return_weights(true);
         (*p->mutable_parameters())["return_weights"].set_bool_param(true);
       }},
      {"weights by requested output, with a mask",
       [&mask](v1::AttendRequest* n, ModelInferRequest* p) {
         n->set_return_weights(true);
         *n->mutable_attn_mask() = mask;
         AddRaw("attn_mask", mask, p);
         p->add_outputs()->set_name("output");
         p->add_outputs()->set_name("weights");
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::AttendRequest native;
    *native.mutable_query() = q;
    *native.mutable_key() = k;
    *native.mutable_value() = v;
    ModelInferRequest request;
    request.set_model_name("attend");
    AddRaw("query", q, &request);
    AddRaw("key", k, &request);
    AddRaw("value", v, &request);
    c.set(&native, &request);
    v1::AttendResponse expected;
    ASSERT_TRUE(native_->Attend(Context().get(), native, &expected).ok());
    ModelInferResponse response;
    const grpc::Status status = Infer(request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.model_name(), "attend");
    EXPECT_EQ(response.model_version(), "1");
    EXPECT_EQ(RawOutput(response, "output"), expected.output().raw_data());
    EXPECT_EQ(response.outputs(0).datatype(), "FP32");
    EXPECT_THAT(response.outputs(0).shape(), ::testing::ElementsAre(2, 5, 4));
    EXPECT_EQ(response.outputs_size(), expected.has_weights() ? 2 : 1);
    if (expected.has_weights()) {
      EXPECT_EQ(RawOutput(response, "weights"), expected.weights().raw_data());
    }
  }
}

TEST_F(OpenInferenceTest, LayerNormAndMultiHeadEqualTheNativeRpcs) {
  // LayerNorm with gamma, beta and eps.
  v1::LayerNormRequest layer_norm;
  *layer_norm.mutable_input() =
      RandomWireTensor(DType::kFloat32, {3, 16}, rng_);
  *layer_norm.mutable_gamma() = RandomWireTensor(DType::kFloat32, {16}, rng_);
  *layer_norm.mutable_beta() = RandomWireTensor(DType::kFloat32, {16}, rng_);
  layer_norm.set_eps(1e-3f);
  ModelInferRequest request;
  request.set_model_name("layer_norm");
  request.set_id("ln-1");
  AddRaw("input", layer_norm.input(), &request);
  AddRaw("gamma", layer_norm.gamma(), &request);
  AddRaw("beta", layer_norm.beta(), &request);
  (*request.mutable_parameters())["eps"].set_double_param(1e-3);
  v1::LayerNormResponse expected_norm;
  ASSERT_TRUE(
      native_->LayerNorm(Context().get(), layer_norm, &expected_norm).ok());
  ModelInferResponse response;
  ASSERT_TRUE(Infer(request, &response).ok());
  EXPECT_EQ(response.id(), "ln-1");
  EXPECT_EQ(RawOutput(response, "output"), expected_norm.output().raw_data());

  // MultiHeadAttend with inline weights (fused in_proj) and with the served
  // model "mha".
  const v1::Tensor x = RandomWireTensor(DType::kFloat32, {2, 6, 16}, rng_);
  v1::MultiHeadAttendRequest inline_weights;
  auto* w = inline_weights.mutable_weights();
  w->set_num_heads(4);
  *w->mutable_in_proj_weight() =
      RandomWireTensor(DType::kFloat32, {48, 16}, rng_);
  *w->mutable_in_proj_bias() = RandomWireTensor(DType::kFloat32, {48}, rng_);
  *w->mutable_out_proj_weight() =
      RandomWireTensor(DType::kFloat32, {16, 16}, rng_);
  v1::MultiHeadAttendRequest served;
  served.set_model("mha");
  for (v1::MultiHeadAttendRequest* native : {&inline_weights, &served}) {
    SCOPED_TRACE(native->has_weights() ? "inline" : "served");
    *native->mutable_query() = x;
    *native->mutable_key() = x;
    *native->mutable_value() = x;
    native->set_causal(true);
    native->set_return_weights(true);
    ModelInferRequest infer;
    infer.set_model_name(native->has_weights() ? "multi_head_attend" : "mha");
    for (const char* name : {"query", "key", "value"}) AddRaw(name, x, &infer);
    if (native->has_weights()) {
      AddRaw("in_proj_weight", w->in_proj_weight(), &infer);
      AddRaw("in_proj_bias", w->in_proj_bias(), &infer);
      AddRaw("out_proj_weight", w->out_proj_weight(), &infer);
      (*infer.mutable_parameters())["num_heads"].set_int64_param(4);
    }
    (*infer.mutable_parameters())["causal"].set_bool_param(true);
    infer.add_outputs()->set_name("weights");
    v1::MultiHeadAttendResponse expected;
    ASSERT_TRUE(
        native_->MultiHeadAttend(Context().get(), *native, &expected).ok());
    ModelInferResponse answer;
    const grpc::Status status = Infer(infer, &answer);
    ASSERT_TRUE(status.ok()) << status.error_message();
    // Only the requested output comes back.
    ASSERT_EQ(answer.outputs_size(), 1);
    EXPECT_EQ(RawOutput(answer, "weights"), expected.weights().raw_data());
  }
}

TEST_F(OpenInferenceTest, RmsNormThroughBothApisMatchesTheReference) {
  v1::LayerNormRequest native;
  *native.mutable_input() = RandomWireTensor(DType::kFloat32, {3, 4096}, rng_);
  *native.mutable_gamma() = RandomWireTensor(DType::kFloat32, {4096}, rng_);
  native.set_rms_norm(true);
  v1::LayerNormResponse expected;
  ASSERT_TRUE(native_->LayerNorm(Context().get(), native, &expected).ok());
  auto output = CopyTensor(expected.output(), "output");
  auto input = CopyTensor(native.input(), "input");
  auto gamma = CopyTensor(native.gamma(), "gamma");
  ASSERT_TRUE(output.ok() && input.ok() && gamma.ok());
  // eps unset: float32's machine epsilon, as torch.nn.RMSNorm(eps=None).
  EXPECT_TRUE(AllClose(
      output->view(),
      RefRmsNorm(ToRef(input->view()), ToRef(gamma->view()), 0x1p-23, 1),
      ToleranceFor(DType::kFloat32)));

  ModelInferRequest request;
  request.set_model_name("layer_norm");
  AddRaw("input", native.input(), &request);
  AddRaw("gamma", native.gamma(), &request);
  (*request.mutable_parameters())["rms_norm"].set_bool_param(true);
  ModelInferResponse response;
  ASSERT_TRUE(Infer(request, &response).ok());
  EXPECT_EQ(RawOutput(response, "output"), expected.output().raw_data());

  // The operation of its own: the RmsNorm RPC and the model "rms_norm" give
  // the same bits.
  v1::RmsNormRequest rms;
  *rms.mutable_input() = native.input();
  *rms.mutable_gamma() = native.gamma();
  v1::RmsNormResponse rms_answer;
  const grpc::Status rms_status =
      native_->RmsNorm(Context().get(), rms, &rms_answer);
  ASSERT_TRUE(rms_status.ok()) << rms_status.error_message();
  EXPECT_EQ(rms_answer.output().raw_data(), expected.output().raw_data());
  ModelInferRequest by_model;
  by_model.set_model_name("rms_norm");
  AddRaw("input", native.input(), &by_model);
  AddRaw("gamma", native.gamma(), &by_model);
  ASSERT_TRUE(Infer(by_model, &response).ok());
  EXPECT_EQ(RawOutput(response, "output"), expected.output().raw_data());
  // It has no shift to give, and no rms_norm switch.
  AddRaw("beta", native.gamma(), &by_model);
  grpc::Status refused_input = Infer(by_model, &response);
  EXPECT_EQ(refused_input.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(refused_input.error_message(),
            "inputs: unknown input 'beta' for model 'rms_norm'; expected one "
            "of input, gamma");

  // A shift is refused, naming it.
  *native.mutable_beta() = native.gamma();
  const grpc::Status refused =
      native_->LayerNorm(Context().get(), native, &expected);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(refused.error_message(),
            "beta: RMSNorm has no shift (torch.nn.RMSNorm); leave beta unset");
}

TEST_F(OpenInferenceTest, GroupedQueryAttendEqualsRepeatedHeads) {
  // 8 query heads over 2 key/value heads, against the same call with each
  // key/value head repeated 4 times (torch.repeat_interleave).
  const v1::Tensor q = RandomWireTensor(DType::kFloat32, {1, 8, 3, 16}, rng_);
  const v1::Tensor k = RandomWireTensor(DType::kFloat32, {1, 2, 5, 16}, rng_);
  const v1::Tensor v = RandomWireTensor(DType::kFloat32, {1, 2, 5, 16}, rng_);
  const auto repeat = [](const v1::Tensor& t) {
    v1::Tensor out = t;
    out.set_shape(1, 8);
    out.clear_raw_data();
    const size_t head = t.raw_data().size() / 2;
    for (int h = 0; h < 8; ++h) {
      out.mutable_raw_data()->append(t.raw_data(), (h / 4) * head, head);
    }
    return out;
  };
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    v1::AttendRequest repeated;
    *repeated.mutable_query() = q;
    *repeated.mutable_key() = repeat(k);
    *repeated.mutable_value() = repeat(v);
    repeated.set_causal(causal);
    v1::AttendResponse expected;
    ASSERT_TRUE(native_->Attend(Context().get(), repeated, &expected).ok());
    auto expected_output = CopyTensor(expected.output(), "output");
    ASSERT_TRUE(expected_output.ok());
    const RefTensor expected_ref = ToRef(expected_output->view());

    v1::AttendRequest grouped = repeated;
    *grouped.mutable_key() = k;
    *grouped.mutable_value() = v;
    grouped.set_enable_gqa(true);
    v1::AttendResponse native_answer;
    const grpc::Status status =
        native_->Attend(Context().get(), grouped, &native_answer);
    ASSERT_TRUE(status.ok()) << status.error_message();
    auto native_output = CopyTensor(native_answer.output(), "output");
    ASSERT_TRUE(native_output.ok());
    EXPECT_TRUE(AllClose(native_output->view(), expected_ref,
                         ToleranceFor(DType::kFloat32)));

    ModelInferRequest request;
    request.set_model_name("attend");
    AddRaw("query", q, &request);
    AddRaw("key", k, &request);
    AddRaw("value", v, &request);
    (*request.mutable_parameters())["enable_gqa"].set_bool_param(true);
    (*request.mutable_parameters())["causal"].set_bool_param(causal);
    request.add_outputs()->set_name("output");
    ModelInferResponse response;
    ASSERT_TRUE(Infer(request, &response).ok());
    EXPECT_EQ(RawOutput(response, "output"), native_answer.output().raw_data());
  }
}

TEST_F(OpenInferenceTest, TypedContentsAndHalfPrecisionEqualRaw) {
  const v1::Tensor q = RandomWireTensor(DType::kFloat32, {4, 8}, rng_);
  const v1::Tensor mask = Mask({4, 4}, rng_);
  ModelInferRequest raw;
  raw.set_model_name("attend");
  for (const char* name : {"query", "key", "value"}) AddRaw(name, q, &raw);
  AddRaw("attn_mask", mask, &raw);
  ModelInferResponse raw_answer;
  ASSERT_TRUE(Infer(raw, &raw_answer).ok());

  // The same values as fp32_contents and bool_contents, and the mask as
  // UINT8 in uint_contents.
  for (const char* mask_type : {"BOOL", "UINT8"}) {
    SCOPED_TRACE(mask_type);
    ModelInferRequest typed;
    typed.set_model_name("attend");
    for (const char* name : {"query", "key", "value"}) {
      auto* input = typed.add_inputs();
      input->set_name(name);
      input->set_datatype("FP32");
      input->mutable_shape()->CopyFrom(q.shape());
      std::vector<float> values(32);
      std::memcpy(values.data(), q.raw_data().data(), 128);
      input->mutable_contents()->mutable_fp32_contents()->Assign(values.begin(),
                                                                 values.end());
    }
    auto* input = typed.add_inputs();
    input->set_name("attn_mask");
    input->set_datatype(mask_type);
    input->mutable_shape()->CopyFrom(mask.shape());
    for (char c : mask.raw_data()) {
      if (std::string(mask_type) == "BOOL") {
        input->mutable_contents()->add_bool_contents(c != 0);
      } else {
        input->mutable_contents()->add_uint_contents(c);
      }
    }
    ModelInferResponse typed_answer;
    const grpc::Status status = Infer(typed, &typed_answer);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(RawOutput(typed_answer, "output"),
              RawOutput(raw_answer, "output"));
  }

  // BF16 and FP16 inputs (raw only) compute as the native RPC does.
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const v1::Tensor half = RandomWireTensor(dtype, {3, 8}, rng_);
    v1::AttendRequest native;
    *native.mutable_query() = half;
    *native.mutable_key() = half;
    *native.mutable_value() = half;
    v1::AttendResponse expected;
    ASSERT_TRUE(native_->Attend(Context().get(), native, &expected).ok());
    ModelInferRequest request;
    request.set_model_name("attend");
    for (const char* name : {"query", "key", "value"}) {
      AddRaw(name, half, &request);
    }
    ModelInferResponse answer;
    ASSERT_TRUE(Infer(request, &answer).ok());
    EXPECT_EQ(answer.outputs(0).datatype(),
              Datatype(expected.output().dtype()));
    EXPECT_EQ(RawOutput(answer, "output"), expected.output().raw_data());
  }
}

TEST_F(OpenInferenceTest, SharedMemoryInputsAndOutputs) {
  const v1::Tensor q = RandomWireTensor(DType::kFloat32, {4, 8}, rng_);
  const size_t bytes = q.raw_data().size();  // 128
  auto shm = SharedMemoryBuffer::Create(UniqueSharedMemoryKey("oip"), 4096);
  ASSERT_TRUE(shm.ok()) << shm.status();
  // query at 0, key at 128, value at 256; the output goes to 1024.
  for (int i = 0; i < 3; ++i) {
    std::memcpy((*shm)->data() + i * bytes, q.raw_data().data(), bytes);
  }
  v1::RegisterSharedMemoryRequest region;
  region.mutable_region()->set_name("r");
  region.mutable_region()->set_key((*shm)->key());
  region.mutable_region()->set_byte_size(4096);
  v1::RegisterSharedMemoryResponse registered;
  ASSERT_TRUE(
      native_->RegisterSharedMemory(Context().get(), region, &registered).ok());

  ModelInferRequest request;
  request.set_model_name("attend");
  const auto place =
      [](google::protobuf::Map<std::string, inference::InferParameter>* p,
         uint64_t offset, uint64_t size) {
        (*p)["shared_memory_region"].set_string_param("r");
        (*p)["shared_memory_offset"].set_uint64_param(offset);
        (*p)["shared_memory_byte_size"].set_int64_param(size);
      };
  const char* names[] = {"query", "key", "value"};
  for (int i = 0; i < 3; ++i) {
    auto* input = request.add_inputs();
    input->set_name(names[i]);
    input->set_datatype("FP32");
    input->mutable_shape()->CopyFrom(q.shape());
    place(input->mutable_parameters(), i * bytes, bytes);
  }
  auto* output = request.add_outputs();
  output->set_name("output");
  place(output->mutable_parameters(), 1024, bytes);
  ModelInferResponse response;
  const grpc::Status status = Infer(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.outputs_size(), 1);
  // The response points at the region; the result is there.
  EXPECT_EQ(response.outputs(0)
                .parameters()
                .at("shared_memory_region")
                .string_param(),
            "r");
  EXPECT_EQ(response.raw_output_contents(0), "");
  v1::AttendRequest native;
  *native.mutable_query() = q;
  *native.mutable_key() = q;
  *native.mutable_value() = q;
  v1::AttendResponse expected;
  ASSERT_TRUE(native_->Attend(Context().get(), native, &expected).ok());
  EXPECT_EQ(std::string((*shm)->data() + 1024, bytes),
            expected.output().raw_data());
}

TEST_F(OpenInferenceTest, BadRequestsNameTheField) {
  const v1::Tensor q = RandomWireTensor(DType::kFloat32, {2, 8}, rng_);
  const v1::Tensor k32 = RandomWireTensor(DType::kFloat32, {2, 4}, rng_);
  const auto attend = [&] {
    ModelInferRequest request;
    request.set_model_name("attend");
    for (const char* name : {"query", "key", "value"})
      AddRaw(name, q, &request);
    return request;
  };
  struct Case {
    std::string name;
    std::function<void(ModelInferRequest*)> edit;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"unknown model", [](auto* r) { r->set_model_name("nope"); },
       grpc::StatusCode::NOT_FOUND, "model 'nope' is not served"},
      {"unknown model, before its inputs are checked",
       [](auto* r) {
         r->set_model_name("nope");
         r->mutable_inputs(0)->set_name("input");
       },
       grpc::StatusCode::NOT_FOUND, "model 'nope' is not served"},
      {"no model", [](auto* r) { r->clear_model_name(); },
       grpc::StatusCode::INVALID_ARGUMENT, "model_name: missing"},
      {"other version", [](auto* r) { r->set_model_version("2"); },
       grpc::StatusCode::NOT_FOUND,
       "model_version: model 'attend' has only version 1, not '2'"},
      {"unknown input",
       [](auto* r) { r->mutable_inputs(2)->set_name("values"); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "inputs: unknown input 'values' for model 'attend'; expected one of "
       "query, key, value, attn_mask"},
      {"input twice", [](auto* r) { r->mutable_inputs(2)->set_name("key"); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "inputs: 'key' given more than once"},
      {"unknown datatype",
       [](auto* r) { r->mutable_inputs(1)->set_datatype("INT64"); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "key: datatype 'INT64' is not supported; expected FP32, BF16, FP16, "
       "BOOL or UINT8"},
      {"shape mismatch, as the native RPC says it",
       [&k32](auto* r) {
         r->mutable_inputs(1)->mutable_shape()->CopyFrom(k32.shape());
         *r->mutable_raw_input_contents(1) = k32.raw_data();
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "key: last dim 4 != query last dim 8"},
      {"unknown parameter",
       [](auto* r) {
         (*r->mutable_parameters())["causl"].set_bool_param(true);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "parameters: unknown parameter 'causl' for model 'attend'; expected "
       "one of causal, scale, temperature, return_weights, compute_bf16"},
      {"parameter of the wrong kind",
       [](auto* r) {
         (*r->mutable_parameters())["causal"].set_string_param("yes");
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "parameters: causal must be a bool, got string"},
      {"scale out of float range",
       [](auto* r) {
         (*r->mutable_parameters())["scale"].set_double_param(1e300);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "parameters: scale = 1e+300 is not a finite float32 value"},
      {"unknown output", [](auto* r) { r->add_outputs()->set_name("attn"); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "outputs: unknown output 'attn' for model 'attend'; expected one of "
       "output, weights"},
      {"raw entries missing",
       [](auto* r) { r->mutable_raw_input_contents()->RemoveLast(); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "raw_input_contents: 2 entries, fewer than the inputs not in shared "
       "memory (none left for 'value')"},
      {"raw and typed mixed",
       [](auto* r) {
         r->mutable_inputs(0)->mutable_contents()->add_fp32_contents(1);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "query: typed contents in a request with raw_input_contents; send "
       "every input one way"},
      {"shared memory that is not registered",
       [](auto* r) {
         auto* params = r->mutable_inputs(0)->mutable_parameters();
         (*params)["shared_memory_region"].set_string_param("nowhere");
         (*params)["shared_memory_byte_size"].set_int64_param(64);
         r->mutable_raw_input_contents()->RemoveLast();
       },
       grpc::StatusCode::NOT_FOUND, "nowhere"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ModelInferRequest request = attend();
    c.edit(&request);
    ModelInferResponse response;
    const grpc::Status status = Infer(request, &response);
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(c.message));
  }
  // FP16 has no typed contents field.
  ModelInferRequest half;
  half.set_model_name("attend");
  auto* input = half.add_inputs();
  input->set_name("query");
  input->set_datatype("FP16");
  input->add_shape(1);
  input->mutable_contents()->add_fp32_contents(1);
  ModelInferResponse response;
  const grpc::Status status = Infer(half, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "query: FP16 values travel only in raw_input_contents (the "
            "protocol has no FP16 contents field)");
}

// How a message echoes `n` copies of `c`: its first 128 bytes, quoted,
// and its length.
std::string Cut(char c, size_t n) {
  return absl::StrCat("'", std::string(128, c), "'... (", n, " bytes)");
}

// Every client string a status message echoes is cut to its first 128
// bytes, with its length: a 20,048-byte NOT_FOUND for a 20,000-byte version
// once reached clients as RESOURCE_EXHAUSTED "received initial metadata
// size exceeds limit". One case per field, on both services.
TEST_F(OpenInferenceTest, EchoedStringsAreCutTo128Bytes) {
  const std::string v20k(20000, '9');
  const std::string n8k(8000, 'n');
  const std::string echo_v = Cut('9', 20000);
  const std::string echo_n = Cut('n', 8000);
  // The native API's, and the protocol's (which lists its models).
  const std::string not_found =
      absl::StrCat("model: ", Cut('n', 200), " not found; loaded models: mha");
  const auto not_served = [](const char* field) {
    return absl::StrCat(field, ": model ", Cut('n', 200),
                        " is not served; served models: attend, "
                        "attention_session, layer_norm, mha, mha_session, "
                        "multi_head_attend, rms_norm");
  };
  const v1::Tensor q = RandomWireTensor(DType::kFloat32, {2, 8}, rng_);
  const auto attend = [&] {
    ModelInferRequest request;
    request.set_model_name("attend");
    for (const char* name : {"query", "key", "value"})
      AddRaw(name, q, &request);
    return request;
  };
  const auto metadata = [&](const std::string& name,
                            const std::string& version) {
    inference::ModelMetadataRequest request;
    request.set_name(name);
    request.set_version(version);
    inference::ModelMetadataResponse response;
    return protocol_->ModelMetadata(Context().get(), request, &response);
  };
  const auto ready = [&](const std::string& name, const std::string& version) {
    inference::ModelReadyRequest request;
    request.set_name(name);
    request.set_version(version);
    inference::ModelReadyResponse response;
    grpc::Status status =
        protocol_->ModelReady(Context().get(), request, &response);
    EXPECT_FALSE(response.ready()) << name.substr(0, 16);
    return status;
  };
  const auto infer = [&](std::function<void(ModelInferRequest*)> edit) {
    ModelInferRequest request = attend();
    edit(&request);
    ModelInferResponse response;
    return Infer(request, &response);
  };
  struct Case {
    std::string field;
    std::function<grpc::Status()> call;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"ModelMetadata version", [&] { return metadata("attend", v20k); },
       grpc::StatusCode::NOT_FOUND,
       absl::StrCat("version: model 'attend' has only version 1, not ",
                    echo_v)},
      {"ModelMetadata name and version", [&] { return metadata(n8k, v20k); },
       grpc::StatusCode::NOT_FOUND,
       absl::StrCat("version: model ", echo_n, " has only version 1, not ",
                    echo_v)},
      {"ModelMetadata name",
       [&] { return metadata(std::string(200, 'n'), ""); },
       grpc::StatusCode::NOT_FOUND, not_served("name")},
      // Models and versions not served are not ready: OK, ready false.
      {"ModelReady version", [&] { return ready("attend", v20k); },
       grpc::StatusCode::OK, ""},
      {"ModelReady name and version", [&] { return ready(n8k, v20k); },
       grpc::StatusCode::OK, ""},
      {"ModelInfer model_version",
       [&] { return infer([&](auto* r) { r->set_model_version(v20k); }); },
       grpc::StatusCode::NOT_FOUND,
       absl::StrCat("model_version: model 'attend' has only version 1, not ",
                    echo_v)},
      {"ModelInfer model_name",
       [&] {
         return infer(
             [&](auto* r) { r->set_model_name(std::string(200, 'n')); });
       },
       grpc::StatusCode::NOT_FOUND, not_served("model_name")},
      {"ModelInfer input name",
       [&] {
         return infer([&](auto* r) { r->mutable_inputs(2)->set_name(n8k); });
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       absl::StrCat("inputs: unknown input ", echo_n,
                    " for model 'attend'; expected one of query, key, value, "
                    "attn_mask")},
      {"ModelInfer input datatype",
       [&] {
         return infer(
             [&](auto* r) { r->mutable_inputs(1)->set_datatype(n8k); });
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       absl::StrCat(
           "key: datatype ", echo_n,
           " is not supported; expected FP32, BF16, FP16, BOOL or UINT8")},
      {"ModelInfer input parameter name",
       [&] {
         return infer([&](auto* r) {
           (*r->mutable_inputs(0)->mutable_parameters())[n8k].set_bool_param(
               true);
         });
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       absl::StrCat("query: unknown parameter ", echo_n,
                    "; expected shared_memory_region, shared_memory_offset or "
                    "shared_memory_byte_size")},
      {"ModelInfer output name",
       [&] { return infer([&](auto* r) { r->add_outputs()->set_name(n8k); }); },
       grpc::StatusCode::INVALID_ARGUMENT,
       absl::StrCat("outputs: unknown output ", echo_n,
                    " for model 'attend'; expected one of output, weights")},
      {"ModelInfer output parameter name",
       [&] {
         return infer([&](auto* r) {
           auto* output = r->add_outputs();
           output->set_name("output");
           (*output->mutable_parameters())[n8k].set_int64_param(1);
         });
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       absl::StrCat("output: unknown parameter ", echo_n,
                    "; expected shared_memory_region, shared_memory_offset or "
                    "shared_memory_byte_size")},
      {"ModelInfer request parameter name",
       [&] {
         return infer([&](auto* r) {
           (*r->mutable_parameters())[n8k].set_bool_param(true);
         });
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       absl::StrCat(
           "parameters: unknown parameter ", echo_n,
           " for model 'attend'; expected one of causal, scale, temperature, "
           "return_weights, compute_bf16, enable_gqa")},
      {"GetModelMetadata name",
       [&] {
         v1::GetModelMetadataRequest request;
         request.set_name(std::string(200, 'n'));
         v1::GetModelMetadataResponse response;
         return native_->GetModelMetadata(Context().get(), request, &response);
       },
       grpc::StatusCode::NOT_FOUND, not_found},
      {"MultiHeadAttend model",
       [&] {
         v1::MultiHeadAttendRequest request;
         request.set_model(std::string(200, 'n'));
         v1::MultiHeadAttendResponse response;
         return native_->MultiHeadAttend(Context().get(), request, &response);
       },
       grpc::StatusCode::NOT_FOUND, not_found},
      {"CreateSession model",
       [&] {
         v1::CreateSessionRequest request;
         request.set_model(std::string(200, 'n'));
         v1::CreateSessionResponse response;
         return native_->CreateSession(Context().get(), request, &response);
       },
       grpc::StatusCode::NOT_FOUND, not_found},
      {"SessionStep session_id",
       [&] {
         v1::SessionStepRequest request;
         request.set_session_id(absl::StrCat(std::string(100, 's'), "\n\""));
         v1::SessionStepResponse response;
         return native_->SessionStep(Context().get(), request, &response);
       },
       grpc::StatusCode::NOT_FOUND,
       absl::StrCat("session_id: no session \"", std::string(100, 's'),
                    "\\n\\\"\" (expired, evicted, deleted, or opened on "
                    "another replica); create a new one and prefill it")},
      {"RegisterSharedMemory key",
       [&] {
         v1::RegisterSharedMemoryRequest request;
         request.mutable_region()->set_name("r");
         request.mutable_region()->set_key(n8k);
         request.mutable_region()->set_byte_size(64);
         v1::RegisterSharedMemoryResponse response;
         return native_->RegisterSharedMemory(Context().get(), request,
                                              &response);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       absl::StrCat("key: expected a POSIX shared memory name such as "
                    "\"/my_region\" (one name under /dev/shm, no other '/', "
                    "at most 250 characters), got \"",
                    std::string(128, 'n'), "\"... (8000 bytes)")},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    const grpc::Status status = c.call();
    EXPECT_EQ(status.error_code(), c.code);
    EXPECT_EQ(status.error_message(), c.message);
    EXPECT_LE(status.error_message().size(), 600u);
  }
}

// How a message quotes what a client sent: escaped, cut at 128 bytes on a
// character boundary, with the length when cut.
TEST(EchoStringTest, QuotesEscapesAndCuts) {
  EXPECT_EQ(EchoString("demo"), "'demo'");
  EXPECT_EQ(EchoString(""), "''");
  EXPECT_EQ(EchoString("it's"), "'it\\'s'");
  EXPECT_EQ(EchoString("say \"hi\"", '"'), "\"say \\\"hi\\\"\"");
  EXPECT_EQ(EchoString(std::string("a\0b\n\x7f\\", 6)),
            "'a\\000b\\n\\177\\\\'");
  // UTF-8 stays, bytes that are not UTF-8 are escaped.
  EXPECT_EQ(EchoString("mod\xc3\xa8le"), "'mod\xc3\xa8le'");
  EXPECT_EQ(EchoString("\xc3(\xff\xed\xa0\x80"),
            "'\\303(\\377\\355\\240\\200'");
  EXPECT_EQ(EchoString(std::string(128, 'x')),
            absl::StrCat("'", std::string(128, 'x'), "'"));
  EXPECT_EQ(EchoString(std::string(129, 'x')), Cut('x', 129));
  // A 2-byte character across byte 128 is left out whole.
  EXPECT_EQ(EchoString(absl::StrCat(std::string(127, 'x'), "\xc3\xa8")),
            absl::StrCat("'", std::string(127, 'x'), "'... (129 bytes)"));
  // The longest echo: 128 bytes that each escape to 4.
  const std::string worst = EchoString(std::string(100000, '\x01'));
  EXPECT_EQ(worst.size(),
            2 + 128 * 4 + std::string("... (100000 bytes)").size());
}

TEST_F(OpenInferenceTest, MetadataAndReadiness) {
  inference::ServerLiveResponse live;
  ASSERT_TRUE(protocol_->ServerLive(Context().get(), {}, &live).ok());
  EXPECT_TRUE(live.live());
  inference::ServerReadyResponse ready;
  ASSERT_TRUE(protocol_->ServerReady(Context().get(), {}, &ready).ok());
  EXPECT_TRUE(ready.ready());
  inference::ServerMetadataResponse server;
  ASSERT_TRUE(protocol_->ServerMetadata(Context().get(), {}, &server).ok());
  EXPECT_EQ(server.name(), "attnserve");
  EXPECT_FALSE(server.version().empty());

  const auto metadata = [&](const std::string& name) {
    inference::ModelMetadataRequest request;
    request.set_name(name);
    inference::ModelMetadataResponse response;
    const grpc::Status status =
        protocol_->ModelMetadata(Context().get(), request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    std::vector<std::string> names;
    for (const auto& t : response.inputs()) names.push_back(t.name());
    names.push_back("->");
    for (const auto& t : response.outputs()) names.push_back(t.name());
    return names;
  };
  using ::testing::ElementsAre;
  EXPECT_THAT(metadata("attend"),
              ElementsAre("query", "key", "value", "attn_mask", "->", "output",
                          "weights"));
  EXPECT_THAT(metadata("layer_norm"),
              ElementsAre("input", "gamma", "beta", "->", "output"));
  EXPECT_THAT(metadata("rms_norm"),
              ElementsAre("input", "gamma", "->", "output"));
  EXPECT_THAT(metadata("multi_head_attend"),
              ::testing::IsSupersetOf({"in_proj_weight", "out_proj_bias",
                                       "key_padding_mask", "weights"}));
  EXPECT_THAT(metadata("mha"),
              ElementsAre("query", "key", "value", "attn_mask",
                          "key_padding_mask", "->", "output", "weights"));

  for (const char* name :
       {"attend", "multi_head_attend", "layer_norm", "rms_norm", "mha"}) {
    inference::ModelReadyRequest request;
    request.set_name(name);
    inference::ModelReadyResponse response;
    ASSERT_TRUE(
        protocol_->ModelReady(Context().get(), request, &response).ok());
    EXPECT_TRUE(response.ready()) << name;
  }
  // A model not served is not ready: an answer, as Triton gives it.
  inference::ModelReadyRequest unknown;
  unknown.set_name("nope");
  inference::ModelReadyResponse response;
  response.set_ready(true);
  EXPECT_TRUE(protocol_->ModelReady(Context().get(), unknown, &response).ok());
  EXPECT_FALSE(response.ready());
}

// The JSON "data" of output `name` in an HTTP infer response.
std::vector<float> JsonOutput(const json& body, const std::string& name) {
  for (const json& output : body["outputs"]) {
    if (output["name"] == name) return output["data"].get<std::vector<float>>();
  }
  ADD_FAILURE() << "no output " << name << " in " << body.dump();
  return {};
}

// Sends `request` on a new connection and returns everything the server
// writes back until it closes the connection (or 10 s pass).
std::string RawHttp(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval timeout{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  std::string reply;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) ==
          0 &&
      send(fd, request.data(), request.size(), 0) ==
          static_cast<ssize_t>(request.size())) {
    char buffer[4096];
    ssize_t n;
    while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0)
      reply.append(buffer, n);
  }
  close(fd);
  return reply;
}

std::vector<float> Floats(const std::string& raw) {
  std::vector<float> values(raw.size() / sizeof(float));
  std::memcpy(values.data(), raw.data(), raw.size());
  return values;
}

json JsonInput(const std::string& name, const v1::Tensor& tensor) {
  return {{"name", name},
          {"datatype", "FP32"},
          {"shape",
           std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end())},
          {"data", Floats(tensor.raw_data())}};
}

TEST_F(OpenInferenceTest, HttpEqualsGrpc) {
  EXPECT_EQ(http_.Get("/v2/health/live")->status, 200);
  auto ready = http_.Get("/v2/health/ready");
  EXPECT_EQ(ready->status, 200);
  EXPECT_EQ(json::parse(ready->body)["ready"], true);
  EXPECT_EQ(json::parse(http_.Get("/v2")->body)["name"], "attnserve");
  const json mha = json::parse(http_.Get("/v2/models/mha")->body);
  EXPECT_EQ(mha["inputs"][0]["name"], "query");
  EXPECT_EQ(mha["inputs"][0]["shape"], json({-1, -1, 16}));
  EXPECT_EQ(http_.Get("/v2/models/mha/versions/1/ready")->status, 200);
  auto missing = http_.Get("/v2/models/nope/ready");
  EXPECT_EQ(missing->status, 503);
  EXPECT_EQ(json::parse(missing->body),
            json({{"name", "nope"}, {"ready", false}}));

  const v1::Tensor q = RandomWireTensor(DType::kFloat32, {3, 8}, rng_);
  ModelInferRequest request;
  request.set_model_name("attend");
  for (const char* name : {"query", "key", "value"}) AddRaw(name, q, &request);
  (*request.mutable_parameters())["causal"].set_bool_param(true);
  request.add_outputs()->set_name("output");
  request.add_outputs()->set_name("weights");
  ModelInferResponse expected;
  ASSERT_TRUE(Infer(request, &expected).ok());

  json body = {
      {"id", "h1"},
      {"parameters", {{"causal", true}}},
      {"inputs",
       {JsonInput("query", q), JsonInput("key", q), JsonInput("value", q)}},
      {"outputs", {{{"name", "output"}}, {{"name", "weights"}}}}};
  auto answer = Post("attend", body.dump());
  ASSERT_EQ(answer->status, 200) << answer->body;
  const json parsed = json::parse(answer->body);
  EXPECT_EQ(parsed["id"], "h1");
  EXPECT_EQ(parsed["outputs"][0]["shape"], json({3, 8}));
  EXPECT_EQ(JsonOutput(parsed, "output"),
            Floats(RawOutput(expected, "output")));
  EXPECT_EQ(JsonOutput(parsed, "weights"),
            Floats(RawOutput(expected, "weights")));

  // Triton's binary tensor extension, both ways: inputs after the JSON,
  // outputs after the JSON.
  json header = {
      {"parameters", {{"causal", true}, {"binary_data_output", true}}},
      {"inputs", json::array()}};
  header["outputs"] = json::array(
      {json{{"name", "output"}},
       json{{"name", "weights"}, {"parameters", json{{"binary_data", true}}}}});
  std::string binary;
  for (const char* name : {"query", "key", "value"}) {
    header["inputs"].push_back(
        {{"name", name},
         {"datatype", "FP32"},
         {"shape", {3, 8}},
         {"parameters", {{"binary_data_size", q.raw_data().size()}}}});
    binary += q.raw_data();
  }
  const std::string header_text = header.dump();
  auto binary_answer = Post("attend", header_text + binary,
                            {{"Inference-Header-Content-Length",
                              std::to_string(header_text.size())}});
  ASSERT_EQ(binary_answer->status, 200) << binary_answer->body;
  const size_t json_length = std::stoul(
      binary_answer->get_header_value("Inference-Header-Content-Length"));
  const json binary_json =
      json::parse(binary_answer->body.substr(0, json_length));
  EXPECT_EQ(binary_json["outputs"][0]["parameters"]["binary_data_size"], 96);
  EXPECT_EQ(binary_json["outputs"][1]["parameters"]["binary_data_size"],
            9 * 4);  // weights [3, 3]
  EXPECT_EQ(binary_answer->body.substr(json_length),
            RawOutput(expected, "output") + RawOutput(expected, "weights"));
}

TEST_F(OpenInferenceTest, HttpErrorsAreJsonWithTheMatchingStatus) {
  struct Case {
    std::string body;
    int status;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"{\"inputs\": [", 400, "body: not valid JSON"},
      {"[1, 2]", 400, "body: expected a JSON object"},
      {std::string(200, '[') + std::string(200, ']'), 400,
       "body: JSON nested deeper than 80 levels"},
      {R"({"inputs": [{"name": "query", "datatype": "FP32", "shape": [2, 3], "data": [1, 2]}]})",
       400, "inputs[0] (query): 2 values, shape [2, 3] needs 6"},
      {R"({"inputs": [{"name": "query", "datatype": "FP32", "shape": [1], "data": ["x"]}]})",
       400, "inputs[0] (query): data[0]: expected a number, got string"},
      {R"({"inputs": [{"name": "query", "datatype": "INT8", "shape": [1], "data": [1]}]})",
       400, "query: datatype 'INT8' is not supported"},
      {R"({"inputs": [{"name": "q", "datatype": "FP32", "shape": [1], "data": [1]}]})",
       400, "inputs: unknown input 'q' for model 'attend'"},
      {R"({"inputs": {}})", 400, "inputs: expected an array, got object"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body.substr(0, 80));
    auto answer = Post("attend", c.body);
    ASSERT_TRUE(answer);
    EXPECT_EQ(answer->status, c.status);
    EXPECT_THAT(json::parse(answer->body)["error"].get<std::string>(),
                HasSubstr(c.message));
  }
  // A header value with a control byte is refused by the framing: 400,
  // and the connection closes.
  const std::string control =
      RawHttp(server_.http_port(),
              "GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              "Authorization: Bearer a\x01\r\n\r\n");
  EXPECT_THAT(control, ::testing::StartsWith("HTTP/1.1 400 "));
  EXPECT_THAT(control, HasSubstr("control characters"));
  // A chunked body is decoded (tests/server/http_framing_test.cc covers
  // framing).
  EXPECT_THAT(RawHttp(server_.http_port(),
                      "POST /v2/models/attend/infer HTTP/1.1\r\n"
                      "Host: 127.0.0.1\r\nConnection: close\r\n"
                      "Content-Type: application/json\r\n"
                      "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"),
              ::testing::StartsWith("HTTP/1.1 400 "));
  // A body that says it is gzip but is not; an encoding not offered.
  auto gzip =
      http_.Post("/v2/models/attend/infer", {{"Content-Encoding", "gzip"}},
                 "xx", "application/json");
  ASSERT_TRUE(gzip);
  EXPECT_EQ(gzip->status, 400);
  EXPECT_THAT(json::parse(gzip->body)["error"].get<std::string>(),
              HasSubstr("not a complete gzip or deflate stream"));
  auto brotli =
      http_.Post("/v2/models/attend/infer", {{"Content-Encoding", "br"}}, "xx",
                 "application/json");
  ASSERT_TRUE(brotli);
  EXPECT_EQ(brotli->status, 415);
  EXPECT_EQ(http_.Get("/v2/health/live")->status, 200);
  // Triton clients' priority and timeout are accepted.
  auto hinted = Post("layer_norm",
                     R"({"parameters": {"priority": 1, "timeout": 100},
                         "inputs": [{"name": "input", "datatype": "FP32",
                                     "shape": [1, 2], "data": [1, 2]}]})");
  EXPECT_EQ(hinted->status, 200) << hinted->body;
  auto unknown_model = Post("nope", R"({"inputs": []})");
  EXPECT_EQ(unknown_model->status, 404);
  auto no_route = http_.Get("/v2/nothing/here");
  EXPECT_EQ(no_route->status, 404);
  EXPECT_THAT(json::parse(no_route->body)["error"].get<std::string>(),
              HasSubstr("no such endpoint: GET /v2/nothing/here"));
}

TEST(OpenInferenceLimitsTest, OversizedBodyIs413AndCallsAreCounted) {
  ServerOptions options;
  options.max_message_mb = 1;
  TestServer server(options);
  httplib::Client http("127.0.0.1", server.http_port());
  const std::string big(2 << 20, ' ');
  auto answer = http.Post("/v2/models/attend/infer", big, "application/json");
  ASSERT_TRUE(answer);
  EXPECT_EQ(answer->status, 413);
  EXPECT_THAT(json::parse(answer->body)["error"].get<std::string>(),
              HasSubstr("exceed the server's limit of 1048576"));
  // JSON numbers shorter than the float32s they become: 600 KB of "0,"
  // is 1.2 MB of tensor.
  std::string zeros = R"({"inputs": [{"name": "input", "datatype": "FP32", )"
                      R"("shape": [300000], "data": [0)";
  for (int i = 1; i < 300000; ++i) zeros += ",0";
  zeros += "]}]}";
  auto converted =
      http.Post("/v2/models/layer_norm/infer", zeros, "application/json");
  ASSERT_TRUE(converted);
  EXPECT_EQ(converted->status, 413);
  EXPECT_THAT(json::parse(converted->body)["error"].get<std::string>(),
              HasSubstr("once converted from JSON exceed"));
  // An HTTP call runs as a ModelInfer call: counted in the metrics.
  auto ok = http.Post(
      "/v2/models/layer_norm/infer",
      R"({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]})",
      "application/json");
  ASSERT_EQ(ok->status, 200) << ok->body;
  httplib::Client metrics("127.0.0.1", server.metrics_port());
  EXPECT_THAT(metrics.Get("/metrics")->body,
              HasSubstr("attnserve_requests_total{rpc=\"ModelInfer/"
                        "LayerNorm\",code=\"OK\"} 1\n"));
}

TEST(OpenInferenceAuthTest, TokenNeededExceptForHealth) {
  const std::string tokens =
      absl::StrCat(std::filesystem::temp_directory_path().string(),
                   "/attnserve_oip_", ::getpid(), ".tokens");
  std::ofstream(tokens) << "s3cret\n";
  ServerOptions options;
  options.auth_token_file = tokens;
  TestServer server(options);
  auto protocol = inference::GRPCInferenceService::NewStub(
      grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials()));
  inference::ServerLiveResponse live;
  EXPECT_TRUE(protocol->ServerLive(Context().get(), {}, &live).ok());
  ModelInferRequest request;
  request.set_model_name("attend");
  ModelInferResponse response;
  EXPECT_EQ(
      protocol->ModelInfer(Context().get(), request, &response).error_code(),
      grpc::StatusCode::UNAUTHENTICATED);
  inference::ServerMetadataResponse metadata;
  EXPECT_TRUE(
      protocol->ServerMetadata(Context("s3cret").get(), {}, &metadata).ok());

  httplib::Client http("127.0.0.1", server.http_port());
  EXPECT_EQ(http.Get("/v2/health/ready")->status, 200);
  const std::string body =
      R"({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]})";
  EXPECT_EQ(http.Post("/v2/models/layer_norm/infer", body, "application/json")
                ->status,
            401);
  EXPECT_EQ(
      http.Post("/v2/models/layer_norm/infer",
                {{"Authorization", "Bearer s3cret"}}, body, "application/json")
          ->status,
      200);
  std::filesystem::remove(tokens);
}

TEST(OpenInferenceDrainTest, NotReadyOnceTheServerDrains) {
  TestServer server;
  httplib::Client http("127.0.0.1", server.http_port());
  ASSERT_EQ(http.Get("/v2/health/ready")->status, 200);
  std::thread drain(
      [&] { server.server().Drain(absl::Seconds(2), absl::Seconds(3)); });
  // During the lame duck the server still serves but says it is not ready.
  bool not_ready = false;
  for (int i = 0; i < 100 && !not_ready; ++i) {
    auto ready = http.Get("/v2/health/ready");
    not_ready = ready && ready->status == 503;
    if (!not_ready) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(not_ready);
  drain.join();
}

}  // namespace
}  // namespace attnserve::testing
