// Decode sessions, grouped-query attention and rotary embeddings through a
// live server: every step against a float64 reference over the whole
// history, the NOT_FOUND / INVALID_ARGUMENT / OUT_OF_RANGE /
// FAILED_PRECONDITION answers with their messages, eviction under
// --max_session_memory_mb, idle expiry, concurrent sessions and the
// metrics.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "inference/grpc_service.grpc.pb.h"
#include "proto/tensor_codec.h"
#include "server/handlers.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kEmbed = 16;
constexpr int kHeads = 4;
constexpr int kKvHeads = 2;
constexpr int64_t kHeadDim = 4;
constexpr int kRotaryDims = 4;

// A repository with "llama_block": grouped-query attention (4 query heads,
// 2 key/value heads), rotary embeddings on all of each head's 4 features,
// biases on q/k/v and an output projection; and "llama_block_int8", the
// same with INT8 session caches by its config. Removed with the object.
class GqaModelRepository {
 public:
  GqaModelRepository()
      : root_((fs::temp_directory_path() /
               absl::StrCat("attnserve_sessions_", ::getpid()))
                  .string()) {
    fs::remove_all(root_);
    for (const char* name : {"llama_block", "llama_block_int8"}) {
      fs::create_directories(fs::path(root_) / name);
      std::ofstream(fs::path(root_) / name / "config.pbtxt")
          << "num_heads: " << kHeads << "\nnum_kv_heads: " << kKvHeads
          << "\nrotary_dims: " << kRotaryDims << "\n"
          << (name == std::string("llama_block") ? ""
                                                 : "cache_dtype: "
                                                   "DATA_TYPE_INT8\n");
    }
    std::mt19937 rng(3);
    const auto weight = [&](Shape shape) {
      Tensor w = RandomTensor(DType::kFloat32, shape, rng);
      for (int64_t i = 0; i < w.num_elements(); ++i) {
        w.data_as<float>()[i] *= 0.25f;
      }
      return w;
    };
    weights_.emplace("q_proj_weight", weight({kHeads * kHeadDim, kEmbed}));
    weights_.emplace("k_proj_weight", weight({kKvHeads * kHeadDim, kEmbed}));
    weights_.emplace("v_proj_weight", weight({kKvHeads * kHeadDim, kEmbed}));
    weights_.emplace("q_proj_bias", weight({kHeads * kHeadDim}));
    weights_.emplace("k_proj_bias", weight({kKvHeads * kHeadDim}));
    weights_.emplace("v_proj_bias", weight({kKvHeads * kHeadDim}));
    weights_.emplace("out_proj_weight", weight({kEmbed, kHeads * kHeadDim}));
    for (const char* name : {"llama_block", "llama_block_int8"}) {
      EXPECT_TRUE(WriteSafetensors(
                      (fs::path(root_) / name / "weights.safetensors").string(),
                      ViewsOf(weights_), {})
                      .ok());
    }
  }
  ~GqaModelRepository() { fs::remove_all(root_); }
  const std::string& root() const { return root_; }

  RefMultiHeadWeights Reference() const {
    RefMultiHeadWeights w;
    w.num_heads = kHeads;
    w.num_kv_heads = kKvHeads;
    w.rotary_dims = kRotaryDims;
    for (const auto& [name, tensor] : weights_) {
      *w.Field(name) = ToRef(tensor.view());
    }
    return w;
  }

 private:
  std::string root_;
  NamedTensors weights_;
};

Tensor FromWire(const v1::Tensor& wire) {
  auto t = CopyTensor(wire, "output");
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : Tensor();
}

class SessionServerTest : public ::testing::Test {
 protected:
  static ServerOptions Options() {
    ServerOptions options;
    options.model_repository = repository_->root();
    return options;
  }
  static void SetUpTestSuite() { repository_ = new GqaModelRepository(); }
  static void TearDownTestSuite() {
    delete repository_;
    repository_ = nullptr;
  }

  // An attention session of 4 query heads, 2 key/value heads, head dim 8,
  // rotary on all 8 features.
  v1::CreateSessionRequest AttentionSession() {
    v1::CreateSessionRequest request;
    request.set_num_heads(4);
    request.set_num_kv_heads(2);
    request.set_head_dim(8);
    request.set_rotary_dims(8);
    request.set_max_length(64);
    return request;
  }

  // One attention step of `n` random tokens (batch 1, no batch dim).
  v1::SessionStepRequest AttentionStep(const std::string& id, int64_t n,
                                       Tensor* q, Tensor* k, Tensor* v) {
    *q = RandomTensor(DType::kFloat32, {4, n, 8}, rng_);
    *k = RandomTensor(DType::kFloat32, {2, n, 8}, rng_);
    *v = RandomTensor(DType::kFloat32, {2, n, 8}, rng_);
    v1::SessionStepRequest request;
    request.set_session_id(id);
    *request.mutable_query() = ToWire(q->view());
    *request.mutable_key() = ToWire(k->view());
    *request.mutable_value() = ToWire(v->view());
    return request;
  }

  static GqaModelRepository* repository_;
  std::mt19937 rng_{41};
};

GqaModelRepository* SessionServerTest::repository_ = nullptr;

TEST_F(SessionServerTest, AttentionSessionStepsMatchTheReference) {
  TestServer server(Options());
  AttnClient client = server.MakeClient();
  auto created = client.CreateSession(AttentionSession());
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->max_length(), 64);
  EXPECT_EQ(created->num_kv_heads(), 2);
  EXPECT_EQ(created->head_dim(), 8);
  EXPECT_EQ(created->value_head_dim(), 8);
  RefTensor keys, values;
  int64_t first = 0;
  for (int64_t n : {9, 1, 1, 4, 1}) {
    Tensor q, k, v;
    auto step =
        client.SessionStep(AttentionStep(created->session_id(), n, &q, &k, &v));
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_EQ(step->length(), first + n);
    const auto batched = [&](const Tensor& t) {
      RefTensor r = ToRef(t.view());
      r.shape.insert(r.shape.begin(), 1);
      return r;
    };
    keys = RefConcatRows(keys, batched(k));
    values = RefConcatRows(values, batched(v));
    RefAttentionResult ref = RefAttend(
        RefRotary(batched(q), 8, 10000.0, first),
        RefRepeatHeads(RefRotary(keys, 8, 10000.0, 0), 2),
        RefRepeatHeads(values, 2), {RefCausalKeep(first, n)}, {true}, {});
    ref.output.shape.erase(ref.output.shape.begin());
    EXPECT_TRUE(AllClose(FromWire(step->output()).view(), ref.output,
                         kFloat32Tolerance))
        << "step at " << first;
    first += n;
  }
  ASSERT_TRUE(client.DeleteSession(created->session_id()).ok());
}

TEST_F(SessionServerTest,
       ModelSessionStepsMatchCausalAttentionOverTheSequence) {
  TestServer server(Options());
  AttnClient client = server.MakeClient();
  v1::CreateSessionRequest create;
  create.set_model("llama_block");
  create.set_batch(2);
  auto created = client.CreateSession(create);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->num_heads(), kHeads);
  EXPECT_EQ(created->num_kv_heads(), kKvHeads);
  EXPECT_EQ(created->max_length(), ServerOptions().max_session_length);

  const std::vector<int64_t> steps = {6, 1, 1, 3, 1};
  int64_t total = 0;
  for (int64_t n : steps) total += n;
  Tensor x = RandomTensor(DType::kFloat32, {2, total, kEmbed}, rng_);
  const RefTensor all = ToRef(x.view());
  const RefAttentionResult ref = RefMultiHeadAttend(
      repository_->Reference(), all, all, all, {}, {}, {true, {}, {}});
  // The stateless call by model agrees (positions from 0, causal).
  v1::MultiHeadAttendRequest stateless;
  stateless.set_model("llama_block");
  stateless.set_causal(true);
  *stateless.mutable_query() = ToWire(x.view());
  auto whole = client.MultiHeadAttend(stateless);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_TRUE(AllClose(FromWire(whole->output()).view(), ref.output,
                       kFloat32Tolerance));

  int64_t first = 0;
  for (int64_t n : steps) {
    const RefTensor rows = RefRows(all, first, n);
    Tensor input = *Tensor::Allocate(DType::kFloat32, {2, n, kEmbed});
    for (size_t i = 0; i < rows.values.size(); ++i) {
      input.data_as<float>()[i] = static_cast<float>(rows.values[i]);
    }
    v1::SessionStepRequest request;
    request.set_session_id(created->session_id());
    *request.mutable_input() = ToWire(input.view());
    auto step = client.SessionStep(request);
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_TRUE(AllClose(FromWire(step->output()).view(),
                         RefRows(ref.output, first, n), kFloat32Tolerance))
        << "step at " << first;
    first += n;
  }
}

// INT8 caches through the server: an attention session of dtype INT8 and
// model sessions with cache_dtype INT8 (by request, and by the model's
// config) match the float64 reference within the INT8 tolerance; the two
// model sessions give the same bits, and not those of a FLOAT32 cache. No
// tensor may be INT8.
TEST_F(SessionServerTest, Int8CachesMatchTheReferenceWithinTheirBound) {
  TestServer server(Options());
  AttnClient client = server.MakeClient();
  v1::CreateSessionRequest attention = AttentionSession();
  attention.set_dtype(v1::DATA_TYPE_INT8);
  auto created = client.CreateSession(attention);
  ASSERT_TRUE(created.ok()) << created.status();
  RefTensor keys, values;
  int64_t first = 0;
  for (int64_t n : {9, 1, 1, 4, 1}) {
    Tensor q, k, v;
    auto step =
        client.SessionStep(AttentionStep(created->session_id(), n, &q, &k, &v));
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_EQ(step->output().dtype(), v1::DATA_TYPE_FLOAT32);
    const auto batched = [&](const Tensor& t) {
      RefTensor r = ToRef(t.view());
      r.shape.insert(r.shape.begin(), 1);
      return r;
    };
    keys = RefConcatRows(keys, batched(k));
    values = RefConcatRows(values, batched(v));
    RefAttentionResult ref = RefAttend(
        RefRotary(batched(q), 8, 10000.0, first),
        RefRepeatHeads(RefRotary(keys, 8, 10000.0, 0), 2),
        RefRepeatHeads(values, 2), {RefCausalKeep(first, n)}, {true}, {});
    ref.output.shape.erase(ref.output.shape.begin());
    EXPECT_TRUE(
        AllClose(FromWire(step->output()).view(), ref.output, kInt8Tolerance))
        << "step at " << first;
    first += n;
  }
  Tensor q, k, v;
  v1::SessionStepRequest int8_tensor =
      AttentionStep(created->session_id(), 1, &q, &k, &v);
  int8_tensor.mutable_key()->set_dtype(v1::DATA_TYPE_INT8);
  auto refused = client.SessionStep(int8_tensor);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(),
            "key: dtype DATA_TYPE_INT8 is a session cache dtype only "
            "(CreateSessionRequest.dtype or cache_dtype), not a tensor's");

  // Model sessions: FLOAT32 cache, INT8 by request, INT8 by config.
  v1::CreateSessionRequest plain, by_request, by_config;
  plain.set_model("llama_block");
  by_request.set_model("llama_block");
  by_request.set_cache_dtype(v1::DATA_TYPE_INT8);
  by_config.set_model("llama_block_int8");
  std::vector<std::string> ids;
  for (const auto* request : {&plain, &by_request, &by_config}) {
    auto made = client.CreateSession(*request);
    ASSERT_TRUE(made.ok()) << made.status();
    ids.push_back(made->session_id());
  }
  const std::vector<int64_t> steps = {6, 1, 1, 3, 1};
  Tensor x = RandomTensor(DType::kFloat32, {1, 12, kEmbed}, rng_);
  const RefTensor all = ToRef(x.view());
  const RefAttentionResult ref = RefMultiHeadAttend(
      repository_->Reference(), all, all, all, {}, {}, {true, {}, {}});
  first = 0;
  for (int64_t n : steps) {
    const RefTensor rows = RefRows(all, first, n);
    Tensor input = *Tensor::Allocate(DType::kFloat32, {1, n, kEmbed});
    for (size_t i = 0; i < rows.values.size(); ++i) {
      input.data_as<float>()[i] = static_cast<float>(rows.values[i]);
    }
    std::vector<Tensor> outputs;
    for (const std::string& id : ids) {
      v1::SessionStepRequest request;
      request.set_session_id(id);
      *request.mutable_input() = ToWire(input.view());
      auto step = client.SessionStep(request);
      ASSERT_TRUE(step.ok()) << step.status();
      outputs.push_back(FromWire(step->output()));
      EXPECT_TRUE(AllClose(outputs.back().view(), RefRows(ref.output, first, n),
                           id == ids[0] ? kFloat32Tolerance : kInt8Tolerance))
          << "step at " << first;
    }
    const size_t bytes = outputs[0].num_bytes();
    EXPECT_EQ(0, std::memcmp(outputs[1].data(), outputs[2].data(), bytes));
    EXPECT_NE(0, std::memcmp(outputs[0].data(), outputs[1].data(), bytes));
    first += n;
  }
}

// A session of 3 layers through the server equals one session per layer,
// bit for bit: each step names its layer, the response's length is that
// layer's, and a layer out of range is INVALID_ARGUMENT naming it.
TEST_F(SessionServerTest, MultiLayerSessionEqualsOneSessionPerLayer) {
  TestServer server(Options());
  AttnClient client = server.MakeClient();
  v1::CreateSessionRequest create = AttentionSession();
  std::vector<std::string> singles;
  for (int l = 0; l < 3; ++l) {
    auto made = client.CreateSession(create);
    ASSERT_TRUE(made.ok()) << made.status();
    singles.push_back(made->session_id());
  }
  create.set_num_layers(3);
  auto layered = client.CreateSession(create);
  ASSERT_TRUE(layered.ok()) << layered.status();
  const std::pair<int, int64_t> steps[] = {{0, 6}, {1, 6}, {2, 6}, {0, 1},
                                           {1, 1}, {2, 1}, {0, 1}, {2, 2}};
  std::vector<int64_t> lengths(3, 0);
  for (const auto& [layer, n] : steps) {
    Tensor q, k, v;
    v1::SessionStepRequest request =
        AttentionStep(layered->session_id(), n, &q, &k, &v);
    request.set_layer(layer);
    auto got = client.SessionStep(request);
    ASSERT_TRUE(got.ok()) << got.status();
    request.set_session_id(singles[layer]);
    request.clear_layer();
    auto want = client.SessionStep(request);
    ASSERT_TRUE(want.ok()) << want.status();
    lengths[layer] += n;
    EXPECT_EQ(got->length(), lengths[layer]);
    EXPECT_EQ(want->length(), lengths[layer]);
    EXPECT_EQ(got->output().raw_data(), want->output().raw_data())
        << "layer " << layer;
  }
  Tensor q, k, v;
  v1::SessionStepRequest request =
      AttentionStep(layered->session_id(), 1, &q, &k, &v);
  request.set_layer(5);
  auto refused = client.SessionStep(request);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(), "layer: 5 is out of range [0, 3)");
}

TEST_F(SessionServerTest, InlineGroupedQueryWeightsMatchTheReference) {
  TestServer server(Options());
  AttnClient client = server.MakeClient();
  Tensor x = RandomTensor(DType::kFloat32, {2, 5, kEmbed}, rng_);
  Tensor wq = RandomTensor(DType::kFloat32, {16, kEmbed}, rng_);
  Tensor wk = RandomTensor(DType::kFloat32, {4, kEmbed}, rng_);
  Tensor wv = RandomTensor(DType::kFloat32, {4, kEmbed}, rng_);
  v1::MultiHeadAttendRequest request;
  request.mutable_weights()->set_num_heads(4);
  request.mutable_weights()->set_num_kv_heads(1);
  *request.mutable_weights()->mutable_q_proj_weight() = ToWire(wq.view());
  *request.mutable_weights()->mutable_k_proj_weight() = ToWire(wk.view());
  *request.mutable_weights()->mutable_v_proj_weight() = ToWire(wv.view());
  *request.mutable_query() = ToWire(x.view());
  auto response = client.MultiHeadAttend(request);
  ASSERT_TRUE(response.ok()) << response.status();
  RefMultiHeadWeights w;
  w.num_heads = 4;
  w.num_kv_heads = 1;
  w.q_proj_weight = ToRef(wq.view());
  w.k_proj_weight = ToRef(wk.view());
  w.v_proj_weight = ToRef(wv.view());
  const RefTensor rx = ToRef(x.view());
  EXPECT_TRUE(AllClose(FromWire(response->output()).view(),
                       RefMultiHeadAttend(w, rx, rx, rx, {}, {}, {}).output,
                       kFloat32Tolerance));
  request.mutable_weights()->set_num_kv_heads(3);
  response = client.MultiHeadAttend(request);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(response.status().message(),
            "num_kv_heads: 3 does not divide num_heads 4");
}

TEST_F(SessionServerTest, BadRequestsGetCodesAndMessagesThatNameTheField) {
  TestServer server(Options());
  AttnClient client = server.MakeClient();
  v1::CreateSessionRequest create = AttentionSession();
  create.set_num_kv_heads(3);
  auto created = client.CreateSession(create);
  EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(created.status().message(),
            "num_kv_heads: 3 does not divide num_heads 4");
  create = AttentionSession();
  create.set_max_length(1 << 20);
  EXPECT_EQ(client.CreateSession(create).status().message(),
            "max_length: 1048576 is not in [0, 32768] (0: the server's "
            "--max_session_length 32768)");
  create.set_max_length(0);
  create.set_model("no_such_model");
  EXPECT_EQ(client.CreateSession(create).status().code(),
            absl::StatusCode::kNotFound);

  created = client.CreateSession(AttentionSession());
  ASSERT_TRUE(created.ok());
  const std::string id = created->session_id();
  Tensor q, k, v;
  v1::SessionStepRequest step = AttentionStep(id, 60, &q, &k, &v);
  ASSERT_TRUE(client.SessionStep(step).ok());
  step = AttentionStep(id, 5, &q, &k, &v);
  auto answer = client.SessionStep(step);
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(answer.status().message(),
            "session: 60 cached + 5 new tokens exceed its max_length 64");
  step.clear_key();
  EXPECT_EQ(client.SessionStep(step).status().message(),
            "key: missing (an attention session takes query, key and value)");
  step = AttentionStep(id, 1, &q, &k, &v);
  *step.mutable_input() = ToWire(q.view());
  EXPECT_EQ(client.SessionStep(step).status().message(),
            "input: an attention session takes query, key and value, not "
            "hidden states");

  ASSERT_TRUE(client.DeleteSession(id).ok());
  answer = client.SessionStep(AttentionStep(id, 1, &q, &k, &v));
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(answer.status().message(),
            "session_id: session \"" + id + "\" was deleted");
  EXPECT_EQ(client.DeleteSession(id).code(), absl::StatusCode::kNotFound);
}

// A refused step changes nothing, also one that asked for a rewind: its
// message says what the session holds, and the next step attends to those
// tokens at their positions.
TEST_F(SessionServerTest, RefusedRewindChangesNothing) {
  TestServer server(Options());
  AttnClient client = server.MakeClient();
  v1::CreateSessionRequest create = AttentionSession();
  create.set_max_length(4);
  auto created = client.CreateSession(create);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->session_id();
  Tensor q3, k3, v3;
  auto step = client.SessionStep(AttentionStep(id, 3, &q3, &k3, &v3));
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->length(), 3);

  Tensor q, k, v;
  v1::SessionStepRequest rewind = AttentionStep(id, 3, &q, &k, &v);
  rewind.set_position(2);
  step = client.SessionStep(rewind);
  EXPECT_EQ(step.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(step.status().message(),
            "session: position 2 + 3 new tokens exceed its max_length 4 (the "
            "session holds 3 tokens; nothing was changed)");
  rewind = AttentionStep(id, 1, &q, &k, &v);
  rewind.set_position(1);
  *rewind.mutable_key() = RandomWireTensor(DType::kFloat32, {4, 1, 8}, rng_);
  step = client.SessionStep(rewind);
  EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(step.status().message(),
            "key: shape [4, 1, 8], expected [2, 1, 8]");

  // The fourth token, at position 3, sees the three of the first step.
  Tensor q1, k1, v1;
  step = client.SessionStep(AttentionStep(id, 1, &q1, &k1, &v1));
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->length(), 4);
  const auto batched = [](const Tensor& t) {
    RefTensor r = ToRef(t.view());
    r.shape.insert(r.shape.begin(), 1);
    return r;
  };
  const RefTensor keys = RefConcatRows(batched(k3), batched(k1));
  const RefTensor values = RefConcatRows(batched(v3), batched(v1));
  RefAttentionResult ref =
      RefAttend(RefRotary(batched(q1), 8, 10000.0, 3),
                RefRepeatHeads(RefRotary(keys, 8, 10000.0, 0), 2),
                RefRepeatHeads(values, 2), {}, {}, {});
  ref.output.shape.erase(ref.output.shape.begin());
  EXPECT_TRUE(
      AllClose(FromWire(step->output()).view(), ref.output, kFloat32Tolerance));
  ASSERT_TRUE(client.DeleteSession(id).ok());
}

TEST_F(SessionServerTest, SessionsOffAnswerFailedPrecondition) {
  ServerOptions options = Options();
  options.max_session_memory_mb = 0;
  TestServer server(options);
  AttnClient client = server.MakeClient();
  const absl::Status status = client.CreateSession(AttentionSession()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(status.message(),
            "decode sessions are off on this server "
            "(--max_session_memory_mb=0)");
  EXPECT_EQ(client.ForkSession("0123").status().message(), status.message());
}

std::string MetricsPage(const TestServer& server) {
  httplib::Client http("127.0.0.1", server.metrics_port());
  auto page = http.Get("/metrics");
  return page ? page->body : "";
}

// A step is costed by its session (its length, heads and dims): the cost
// sets its share of the cores and whether it runs on the calling thread,
// and the successful calls' estimates add up in attnserve_flops_total.
TEST_F(SessionServerTest, StepCallsAreCostedByTheirSession) {
  TestServer server(Options());
  AttnClient client = server.MakeClient();
  auto created = client.CreateSession(AttentionSession());
  ASSERT_TRUE(created.ok()) << created.status();
  Tensor q, k, v;
  ASSERT_TRUE(
      client.SessionStep(AttentionStep(created->session_id(), 8, &q, &k, &v))
          .ok());
  ASSERT_TRUE(
      client.SessionStep(AttentionStep(created->session_id(), 1, &q, &k, &v))
          .ok());
  v1::SessionStepsRequest steps;
  *steps.add_steps() = AttentionStep(created->session_id(), 1, &q, &k, &v);
  auto batched = client.SessionSteps(steps);
  ASSERT_TRUE(batched.ok()) << batched.status();
  ASSERT_EQ(batched->results(0).code(), 0) << batched->results(0).message();
  // 2 x heads x new tokens x keys x (dk + dv) each: keys 8, 9 and 10.
  const int64_t flops = 2 * 4 * (8 * 8 + 1 * 9 + 1 * 10) * (8 + 8);
  EXPECT_NE(MetricsPage(server).find(
                absl::StrCat("\nattnserve_flops_total ", flops, "\n")),
            std::string::npos)
      << MetricsPage(server);
}

TEST_F(SessionServerTest, MemoryLimitEvictsTheLeastRecentlyUsedSession) {
  ServerOptions options = Options();
  options.max_session_memory_mb = 1;
  TestServer server(options);
  AttnClient client = server.MakeClient();
  // 2 key/value heads x 8 x 4 bytes = 64 bytes a token for K and for V:
  // 1900 tokens (and 1901) commit 120 KiB of each, so four sessions of them
  // and their bookkeeping (160 bytes each) fit the 1 MiB, and five do not.
  std::vector<std::string> ids;
  for (int i = 0; i < 5; ++i) {
    v1::CreateSessionRequest create = AttentionSession();
    create.set_max_length(4096);
    auto created = client.CreateSession(create);
    ASSERT_TRUE(created.ok());
    ids.push_back(created->session_id());
    Tensor q, k, v;
    ASSERT_TRUE(
        client.SessionStep(AttentionStep(ids.back(), 1900, &q, &k, &v)).ok());
  }
  Tensor q, k, v;
  auto gone = client.SessionStep(AttentionStep(ids[0], 1, &q, &k, &v));
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(gone.status().message(),
            "session_id: session \"" + ids[0] +
                "\" was evicted (least recently used) to make room for other "
                "sessions; create a new one and prefill it");
  for (int i = 1; i < 5; ++i) {
    EXPECT_TRUE(client.SessionStep(AttentionStep(ids[i], 1, &q, &k, &v)).ok())
        << i;
  }
  const std::string page = MetricsPage(server);
  EXPECT_NE(page.find("attnserve_sessions_open 4\n"), std::string::npos)
      << page;
  EXPECT_NE(
      page.find("attnserve_sessions_closed_total{reason=\"evicted\"} 1\n"),
      std::string::npos);
  EXPECT_NE(page.find("attnserve_sessions_created_total 5\n"),
            std::string::npos);
  EXPECT_NE(page.find("attnserve_requests_total{rpc=\"SessionStep\",code="
                      "\"NOT_FOUND\"} 1\n"),
            std::string::npos);
}

// Rows [first, first + n) of a [heads, length, d] tensor.
Tensor TokenRows(const Tensor& t, int64_t first, int64_t n) {
  const int64_t heads = t.shape()[0], length = t.shape()[1], d = t.shape()[2];
  Tensor rows = *Tensor::Allocate(DType::kFloat32, {heads, n, d});
  for (int64_t h = 0; h < heads; ++h) {
    std::memcpy(rows.data_as<float>() + h * n * d,
                t.data_as<float>() + (h * length + first) * d,
                n * d * sizeof(float));
  }
  return rows;
}

// A fork and its parent step on their own ways through a live server, each
// answering bit for bit as a fresh session given the same history; the
// metrics count the shared prefix once; the parent deleted, the fork steps
// on.
TEST_F(SessionServerTest, ForksEqualFreshSessionsAndShareTheirPrefix) {
  TestServer server(Options());
  AttnClient client = server.MakeClient();
  v1::CreateSessionRequest create = AttentionSession();
  create.set_max_length(2048);
  auto parent = client.CreateSession(create);
  ASSERT_TRUE(parent.ok()) << parent.status();
  Tensor q, prefix_k, prefix_v;
  ASSERT_TRUE(client
                  .SessionStep(AttentionStep(parent->session_id(), 700, &q,
                                             &prefix_k, &prefix_v))
                  .ok());
  auto fork = client.ForkSession(parent->session_id());
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(fork->length(), 700);
  EXPECT_NE(fork->session_id(), parent->session_id());
  // 700 tokens x 32 bytes, 6 pages a plane, x 2 heads x (K and V): held
  // once, by neither side's own cache.
  std::string page = MetricsPage(server);
  EXPECT_NE(page.find("attnserve_session_cache_bytes 98304\n"),
            std::string::npos)
      << page;
  EXPECT_NE(page.find("attnserve_session_shared_bytes 98304\n"),
            std::string::npos);
  EXPECT_NE(page.find("attnserve_session_shared_caches 1\n"),
            std::string::npos);
  EXPECT_NE(page.find("attnserve_sessions_forked_total 1\n"),
            std::string::npos);
  EXPECT_NE(page.find("attnserve_sessions_created_total 2\n"),
            std::string::npos);

  // Each side's step, rewind included, against a fresh session given the
  // same history: `history` tokens of the prefix, then `extra` ones.
  const auto expect_like_fresh = [&](const std::string& id, int64_t history,
                                     std::optional<int64_t> position,
                                     int64_t n) {
    Tensor sq, sk, sv;
    v1::SessionStepRequest step = AttentionStep(id, n, &sq, &sk, &sv);
    if (position.has_value()) step.set_position(*position);
    auto got = client.SessionStep(step);
    ASSERT_TRUE(got.ok()) << got.status();
    auto fresh = client.CreateSession(create);
    ASSERT_TRUE(fresh.ok());
    Tensor fq, fk, fv;
    v1::SessionStepRequest prefill =
        AttentionStep(fresh->session_id(), history, &fq, &fk, &fv);
    *prefill.mutable_key() = ToWire(TokenRows(prefix_k, 0, history).view());
    *prefill.mutable_value() = ToWire(TokenRows(prefix_v, 0, history).view());
    ASSERT_TRUE(client.SessionStep(prefill).ok());
    step.set_session_id(fresh->session_id());
    step.clear_position();
    auto want = client.SessionStep(step);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got->length(), want->length());
    EXPECT_EQ(got->output().SerializeAsString(),
              want->output().SerializeAsString())
        << "the output differs from a fresh session's";
    ASSERT_TRUE(client.DeleteSession(fresh->session_id()).ok());
  };
  expect_like_fresh(fork->session_id(), 700, std::nullopt, 1);
  expect_like_fresh(parent->session_id(), 700, std::nullopt, 3);
  // Rewinds into the shared tokens: the other side is untouched.
  expect_like_fresh(parent->session_id(), 600, 600, 1);
  expect_like_fresh(fork->session_id(), 100, 100, 2);
  // A fork of the parent at a shorter prefix; then the parent goes.
  auto short_fork = client.ForkSession(parent->session_id(), 300);
  ASSERT_TRUE(short_fork.ok()) << short_fork.status();
  EXPECT_EQ(short_fork->length(), 300);
  ASSERT_TRUE(client.DeleteSession(parent->session_id()).ok());
  expect_like_fresh(short_fork->session_id(), 300, std::nullopt, 1);

  auto refused = client.ForkSession(short_fork->session_id(), 5000);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(),
            "length: 5000 is not in [0, 301] (the tokens the session holds)");
  refused = client.ForkSession(parent->session_id());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(refused.status().message(),
            "session_id: session \"" + parent->session_id() + "\" was deleted");
  ASSERT_TRUE(client.DeleteSession(fork->session_id()).ok());
  ASSERT_TRUE(client.DeleteSession(short_fork->session_id()).ok());
  page = MetricsPage(server);
  EXPECT_NE(page.find("attnserve_session_cache_bytes 0\n"), std::string::npos)
      << page;
  EXPECT_NE(page.find("attnserve_session_shared_caches 0\n"),
            std::string::npos);
}

// The address space this process has mapped (VmSize), in bytes.
size_t MappedBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmSize:", 0) == 0) {
      return std::stoull(line.substr(7)) * 1024;
    }
  }
  return 0;
}

// A hostile client's sequence: sessions of 8 heads with head dims 2^22,
// 2^18, 2^14, 2^10, 64, 4 and 1 at the default max_length, each created
// until refused. It once reserved 128 TiB of address space, which no limit
// counted; a 1 MiB LayerNorm then answered UNIMPLEMENTED and a 4 MiB one
// crashed the server. A session's reservation must now fit
// --max_session_memory_mb, and the server serves normal calls after.
TEST_F(SessionServerTest, SessionsThatReserveTooMuchAreRefusedUpFront) {
  TestServer server(Options());
  AttnClient client = server.MakeClient();
  const size_t mapped_before = MappedBytes();
  struct Expected {
    int64_t head_dim;
    const char* refusal;  // null: every session is created
  };
  const Expected expected[] = {
      {int64_t{1} << 22,
       "max_length: 32768 tokens x 1 sequences x 8 key/value heads x "
       "(4194304 + 4194304) dims of FLOAT32 reserve 8388608 MiB of cache, "
       "more than --max_session_memory_mb 4096 allows one session; at most "
       "16 tokens fit"},
      {int64_t{1} << 18,
       "max_length: 32768 tokens x 1 sequences x 8 key/value heads x "
       "(262144 + 262144) dims of FLOAT32 reserve 524288 MiB of cache, more "
       "than --max_session_memory_mb 4096 allows one session; at most 256 "
       "tokens fit"},
      {int64_t{1} << 14,
       "max_length: 32768 tokens x 1 sequences x 8 key/value heads x (16384 "
       "+ 16384) dims of FLOAT32 reserve 32768 MiB of cache, more than "
       "--max_session_memory_mb 4096 allows one session; at most 4096 tokens "
       "fit"},
      {int64_t{1} << 10, nullptr},
      {64, nullptr},
      {4, nullptr},
      {1, nullptr},
  };
  constexpr int kTries = 30;
  int created = 0;
  std::string last_id;
  for (const Expected& e : expected) {
    for (int i = 0; i < kTries; ++i) {
      v1::CreateSessionRequest create;
      create.set_num_heads(8);
      create.set_head_dim(e.head_dim);
      auto session = client.CreateSession(create);
      if (e.refusal != nullptr) {
        EXPECT_EQ(session.status().code(), absl::StatusCode::kResourceExhausted)
            << e.head_dim;
        EXPECT_EQ(session.status().message(), e.refusal);
        break;
      }
      ASSERT_TRUE(session.ok()) << e.head_dim << ": " << session.status();
      EXPECT_EQ(session->max_length(), 32768);
      last_id = session->session_id();
      ++created;
    }
  }
  EXPECT_EQ(created, 4 * kTries);
  // 30 sessions of 2 GiB and 30 each of 128, 8 and 2 MiB: what the server
  // reports and about what the process mapped, not 128 TiB.
  const size_t reserved = 30 * ((size_t{2} << 30) + (size_t{138} << 20));
  const std::string metrics = MetricsPage(server);
  EXPECT_NE(metrics.find(absl::StrCat("attnserve_session_reserved_bytes ",
                                      reserved, "\n")),
            std::string::npos)
      << metrics;
  EXPECT_LT(MappedBytes(), mapped_before + reserved + (size_t{1} << 30));

  // Normal calls are served, and correct.
  std::mt19937 rng(21);
  for (const int64_t rows : {256, 1024}) {
    Tensor x = RandomTensor(DType::kFloat32, {rows, 1024}, rng);
    v1::LayerNormRequest request;
    *request.mutable_input() = ToWire(x.view());
    auto answer = client.LayerNorm(request);
    ASSERT_TRUE(answer.ok()) << rows << ": " << answer.status();
    EXPECT_TRUE(AllClose(
        FromWire(answer->output()).view(),
        RefLayerNorm(ToRef(x.view()), std::nullopt, std::nullopt, 1e-5, 1),
        kFloat32Tolerance))
        << rows << " x 1024";
  }
  Tensor q = RandomTensor(DType::kFloat32, {8, 3, 1}, rng);
  Tensor k = RandomTensor(DType::kFloat32, {8, 3, 1}, rng);
  Tensor v = RandomTensor(DType::kFloat32, {8, 3, 1}, rng);
  v1::SessionStepRequest step;
  step.set_session_id(last_id);
  *step.mutable_query() = ToWire(q.view());
  *step.mutable_key() = ToWire(k.view());
  *step.mutable_value() = ToWire(v.view());
  auto stepped = client.SessionStep(step);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(stepped->length(), 3);
}

// Whether the metrics page has `gauge` at `value`.
bool HasGauge(const std::string& page, absl::string_view gauge, size_t value) {
  return page.find(absl::StrCat("\n", gauge, " ", value, "\n")) !=
         std::string::npos;
}

// Everything a session makes the server hold counts in
// --max_session_memory_mb: its per-layer bookkeeping, a layer count past
// any model's is refused before anything is allocated, and a model a
// reload replaced is counted (once) while sessions keep it alive.
TEST_F(SessionServerTest, BookkeepingAndReplacedModelsAreCounted) {
  ServerOptions options = Options();
  options.max_session_memory_mb = 8;
  TestServer server(options);
  AttnClient client = server.MakeClient();
  v1::CreateSessionRequest deep;
  deep.set_num_heads(1);
  deep.set_head_dim(1);
  deep.set_max_length(1);
  deep.set_num_layers(524287);
  auto refused = client.CreateSession(deep);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(),
            "num_layers: 524287 is more than the 1024 layers a session may "
            "hold");
  // 1024 layers x 2 pages of cache fill the 8 MiB; their bookkeeping
  // (1024 x 48 bytes) does not fit beside it.
  deep.set_num_layers(1024);
  refused = client.CreateSession(deep);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.status().message(),
            "num_layers: 1024 layers reserve 8388608 bytes of cache and 49152 "
            "of bookkeeping (lengths and block tables, 48 bytes a layer), "
            "8437760 in all, more than --max_session_memory_mb 8 allows one "
            "session; at most 1018 layers fit");
  deep.set_num_layers(1018);
  auto fits = client.CreateSession(deep);
  ASSERT_TRUE(fits.ok()) << fits.status();
  std::string page = MetricsPage(server);
  EXPECT_TRUE(HasGauge(page, "attnserve_session_bookkeeping_bytes", 49152))
      << page;
  ASSERT_TRUE(client.DeleteSession(fits->session_id()).ok());

  v1::CreateSessionRequest model;
  model.set_model("llama_block");
  model.set_max_length(64);
  auto old_session = client.CreateSession(model);
  ASSERT_TRUE(old_session.ok()) << old_session.status();
  page = MetricsPage(server);
  EXPECT_TRUE(HasGauge(page, "attnserve_session_superseded_models", 0));
  EXPECT_TRUE(HasGauge(page, "attnserve_session_memory_bytes", 48)) << page;
  // The reload replaces the model: the session and its fork keep the old
  // weights, (16 + 8 + 8) rows of 16 and a bias and 16 rows of 16 and a
  // bias, at 4 bytes, counted once from the fork on; a session on the new
  // model adds none.
  ASSERT_TRUE(server.ReloadModels().ok());
  auto fork = client.ForkSession(old_session->session_id());
  ASSERT_TRUE(fork.ok()) << fork.status();
  auto new_session = client.CreateSession(model);
  ASSERT_TRUE(new_session.ok()) << new_session.status();
  page = MetricsPage(server);
  EXPECT_TRUE(HasGauge(page, "attnserve_session_superseded_models", 1)) << page;
  EXPECT_TRUE(HasGauge(page, "attnserve_session_superseded_model_bytes", 3264));
  EXPECT_TRUE(HasGauge(page, "attnserve_session_memory_bytes", 3264 + 3 * 48));
  ASSERT_TRUE(client.DeleteSession(old_session->session_id()).ok());
  EXPECT_TRUE(HasGauge(MetricsPage(server),
                       "attnserve_session_superseded_model_bytes", 3264));
  ASSERT_TRUE(client.DeleteSession(fork->session_id()).ok());
  page = MetricsPage(server);
  EXPECT_TRUE(HasGauge(page, "attnserve_session_superseded_models", 0));
  EXPECT_TRUE(HasGauge(page, "attnserve_session_memory_bytes", 48)) << page;
}

// With the address space or memory the process may use nearly exhausted
// (RLIMIT_AS), a session whose cache cannot be mapped and a result that
// cannot be allocated each fail their call with RESOURCE_EXHAUSTED.
TEST(AllocationFailureTest, FailsTheCallNotTheServer) {
#ifdef ATTNSERVE_SANITIZED
  // Their shadow memory is terabytes of address space, and their
  // allocators abort instead of failing an allocation.
  GTEST_SKIP() << "RLIMIT_AS under a sanitizer limits its shadow memory";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        v1::LayerNormRequest layer_norm;
        layer_norm.mutable_input()->set_dtype(v1::DATA_TYPE_FLOAT32);
        layer_norm.mutable_input()->add_shape(int64_t{1} << 27);
        layer_norm.mutable_input()->set_raw_data(std::string(512 << 20, '\0'));
        SessionStore::Options options;
        options.max_bytes = size_t{4} << 30;
        SessionStore sessions(options);
        rlimit limit{};
        limit.rlim_cur = limit.rlim_max = MappedBytes() + (size_t{256} << 20);
        if (setrlimit(RLIMIT_AS, &limit) != 0) std::_Exit(2);
        v1::CreateSessionRequest create;
        create.set_num_heads(8);
        create.set_head_dim(1024);
        v1::CreateSessionResponse created;
        const absl::Status session =
            HandleCreateSession(create, nullptr, &sessions, 32768, &created);
        std::fprintf(stderr, "CreateSession: %s\n", session.ToString().c_str());
        v1::LayerNormResponse normalized;
        const absl::Status result = HandleLayerNorm(layer_norm, &normalized);
        std::fprintf(stderr, "LayerNorm: %s\n", result.ToString().c_str());
        std::_Exit(session.code() == absl::StatusCode::kResourceExhausted &&
                           result.code() == absl::StatusCode::kResourceExhausted
                       ? 0
                       : 1);
      },
      ::testing::ExitedWithCode(0),
      "CreateSession: RESOURCE_EXHAUSTED: session cache: cannot reserve "
      "2147483648 bytes for keys and values: Cannot allocate memory\n"
      "LayerNorm: RESOURCE_EXHAUSTED: output: cannot allocate 512 MiB for "
      "the result now; retry later");
}

TEST_F(SessionServerTest, IdleSessionsExpire) {
  ServerOptions options = Options();
  options.session_idle_timeout_s = 1;
  TestServer server(options);
  AttnClient client = server.MakeClient();
  auto created = client.CreateSession(AttentionSession());
  ASSERT_TRUE(created.ok());
  Tensor q, k, v;
  ASSERT_TRUE(
      client.SessionStep(AttentionStep(created->session_id(), 3, &q, &k, &v))
          .ok());
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (MetricsPage(server).find("attnserve_sessions_open 0\n") ==
             std::string::npos &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  auto gone =
      client.SessionStep(AttentionStep(created->session_id(), 1, &q, &k, &v));
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(gone.status().message(),
            "session_id: session \"" + created->session_id() +
                "\" expired after 1s idle; create a new one and prefill it");
  EXPECT_NE(MetricsPage(server).find(
                "attnserve_sessions_closed_total{reason=\"expired\"} 1\n"),
            std::string::npos);
}

TEST_F(SessionServerTest, ConcurrentSessionsEachMatchTheReference) {
  TestServer server(Options());
  constexpr int kClients = 4;
  std::vector<std::thread> threads;
  std::vector<int> failures(kClients, 0);
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937 rng(100 + c);
      AttnClient client = server.MakeClient();
      v1::CreateSessionRequest create;
      create.set_num_heads(2);
      create.set_head_dim(8);
      auto created = client.CreateSession(create);
      if (!created.ok()) {
        ++failures[c];
        return;
      }
      RefTensor keys, values;
      for (int64_t first = 0; first < 24; ++first) {
        const int64_t n = 1;
        Tensor q = RandomTensor(DType::kFloat32, {1, 2, n, 8}, rng);
        Tensor k = RandomTensor(DType::kFloat32, {1, 2, n, 8}, rng);
        Tensor v = RandomTensor(DType::kFloat32, {1, 2, n, 8}, rng);
        v1::SessionStepRequest request;
        request.set_session_id(created->session_id());
        *request.mutable_query() = ToWire(q.view());
        *request.mutable_key() = ToWire(k.view());
        *request.mutable_value() = ToWire(v.view());
        auto step = client.SessionStep(request);
        keys = RefConcatRows(keys, ToRef(k.view()));
        values = RefConcatRows(values, ToRef(v.view()));
        const RefAttentionResult ref =
            RefAttend(ToRef(q.view()), keys, values, {}, {}, {});
        if (!step.ok() || !AllClose(FromWire(step->output()).view(), ref.output,
                                    kFloat32Tolerance)) {
          ++failures[c];
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int c = 0; c < kClients; ++c)
    EXPECT_EQ(failures[c], 0) << "client " << c;
}

// The reference output of a step of session (4 query heads, 2 key/value
// heads, head dim 8, rotary on 8) whose history is `keys` and `values` (the
// step's rows included) and whose step starts at `first`.
RefTensor ReferenceStep(const Tensor& q, const RefTensor& keys,
                        const RefTensor& values, int64_t first) {
  const auto batched = [](RefTensor r) {
    r.shape.insert(r.shape.begin(), 1);
    return r;
  };
  RefAttentionResult ref =
      RefAttend(RefRotary(batched(ToRef(q.view())), 8, 10000.0, first),
                RefRepeatHeads(RefRotary(batched(keys), 8, 10000.0, 0), 2),
                RefRepeatHeads(batched(values), 2),
                {RefCausalKeep(first, q.shape()[1])}, {true}, {});
  ref.output.shape.erase(ref.output.shape.begin());
  return ref.output;
}

// Sessions stepped in SessionSteps calls give, bit for bit, what the same
// steps of twin sessions give one call each, and both match float64; each
// session's history grows as if it were stepped alone.
TEST_F(SessionServerTest, BatchedStepsEqualTheSameStepsOneByOne) {
  TestServer server(Options());
  AttnClient client = server.MakeClient();
  constexpr int kSessions = 5;
  std::vector<std::string> batched_ids, single_ids;
  for (int s = 0; s < 2 * kSessions; ++s) {
    auto created = client.CreateSession(AttentionSession());
    ASSERT_TRUE(created.ok()) << created.status();
    (s < kSessions ? batched_ids : single_ids).push_back(created->session_id());
  }
  std::vector<RefTensor> keys(kSessions), values(kSessions);
  std::vector<int64_t> first(kSessions, 0);
  // A prompt of a different length per session, then single tokens.
  for (int round = 0; round < 4; ++round) {
    v1::SessionStepsRequest request;
    std::vector<Tensor> queries(kSessions);
    std::vector<v1::SessionStepResponse> singles(kSessions);
    for (int s = 0; s < kSessions; ++s) {
      const int64_t n = round == 0 ? 1 + 3 * s : 1;
      Tensor k, v;
      v1::SessionStepRequest step =
          AttentionStep(batched_ids[s], n, &queries[s], &k, &v);
      *request.add_steps() = step;
      step.set_session_id(single_ids[s]);
      auto single = client.SessionStep(step);
      ASSERT_TRUE(single.ok()) << single.status();
      singles[s] = *single;
      keys[s] = RefConcatRows(keys[s], ToRef(k.view()));
      values[s] = RefConcatRows(values[s], ToRef(v.view()));
    }
    auto batched = client.SessionSteps(request);
    ASSERT_TRUE(batched.ok()) << batched.status();
    ASSERT_EQ(batched->results_size(), kSessions);
    for (int s = 0; s < kSessions; ++s) {
      const v1::SessionStepResult& result = batched->results(s);
      ASSERT_EQ(result.code(), 0) << result.message();
      EXPECT_EQ(result.message(), "");
      EXPECT_EQ(result.length(), singles[s].length());
      EXPECT_EQ(result.length(), first[s] + queries[s].shape()[1]);
      EXPECT_EQ(result.output().raw_data(), singles[s].output().raw_data())
          << "session " << s << " round " << round;
      EXPECT_EQ(result.output().shape_size(), 3);
      EXPECT_TRUE(
          AllClose(FromWire(result.output()).view(),
                   ReferenceStep(queries[s], keys[s], values[s], first[s]),
                   kFloat32Tolerance))
          << "session " << s << " round " << round;
      first[s] = result.length();
    }
  }
}

// A step that fails (unknown session, wrong shapes, a session named twice)
// fails alone: the others' results are those of their own calls.
TEST_F(SessionServerTest, BatchedStepErrorsFailOnlyTheirStep) {
  TestServer server(Options());
  AttnClient client = server.MakeClient();
  std::vector<std::string> ids;
  for (int s = 0; s < 4; ++s) {
    auto created = client.CreateSession(AttentionSession());
    ASSERT_TRUE(created.ok()) << created.status();
    ids.push_back(created->session_id());
  }
  Tensor q, k, v, q0, q2;
  v1::SessionStepsRequest request;
  *request.add_steps() = AttentionStep(ids[0], 2, &q0, &k, &v);
  RefTensor k0 = ToRef(k.view()), v0 = ToRef(v.view());
  *request.add_steps() = AttentionStep("no-such-session", 1, &q, &k, &v);
  v1::SessionStepRequest bad = AttentionStep(ids[1], 1, &q, &k, &v);
  const Tensor narrow = RandomTensor(DType::kFloat32, {2, 1, 4}, rng_);
  *bad.mutable_key() = ToWire(narrow.view());
  *request.add_steps() = bad;
  *request.add_steps() = AttentionStep(ids[2], 3, &q2, &k, &v);
  RefTensor k2 = ToRef(k.view()), v2 = ToRef(v.view());
  *request.add_steps() = AttentionStep(ids[0], 1, &q, &k, &v);
  v1::SessionStepRequest no_key = AttentionStep(ids[3], 1, &q, &k, &v);
  no_key.clear_key();
  *request.add_steps() = no_key;

  auto response = client.SessionSteps(request);
  ASSERT_TRUE(response.ok()) << response.status();
  ASSERT_EQ(response->results_size(), 6);
  const auto code = [&](int i) {
    return static_cast<absl::StatusCode>(response->results(i).code());
  };
  EXPECT_EQ(code(0), absl::StatusCode::kOk);
  EXPECT_EQ(response->results(0).length(), 2);
  EXPECT_TRUE(AllClose(FromWire(response->results(0).output()).view(),
                       ReferenceStep(q0, k0, v0, 0), kFloat32Tolerance));
  EXPECT_EQ(code(1), absl::StatusCode::kNotFound);
  EXPECT_EQ(response->results(1).message(),
            "session_id: no session \"no-such-session\" (expired, evicted, "
            "deleted, or opened on another replica); create a new one and "
            "prefill it");
  EXPECT_FALSE(response->results(1).has_output());
  EXPECT_EQ(code(2), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(response->results(2).message(),
            client.SessionStep(bad).status().message());
  EXPECT_EQ(code(3), absl::StatusCode::kOk);
  EXPECT_TRUE(AllClose(FromWire(response->results(3).output()).view(),
                       ReferenceStep(q2, k2, v2, 0), kFloat32Tolerance));
  EXPECT_EQ(code(4), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(response->results(4).message(),
            "steps[4]: session_id: also in steps[0]; a call steps each "
            "session at most once");
  EXPECT_EQ(code(5), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(response->results(5).message(),
            "key: missing (an attention session takes query, key and value)");
  // The failed steps changed nothing: session 1 and 3 are still empty.
  v1::SessionStepRequest next = AttentionStep(ids[1], 1, &q, &k, &v);
  auto step = client.SessionStep(next);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->length(), 1);
}

TEST_F(SessionServerTest, BatchedStepsAreLimitedPerCall) {
  ServerOptions options = Options();
  options.max_steps_per_call = 2;
  TestServer server(options);
  AttnClient client = server.MakeClient();
  auto empty = client.SessionSteps(v1::SessionStepsRequest());
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(empty.status().message(), "steps: empty, expected at least one");
  Tensor q, k, v;
  v1::SessionStepsRequest request;
  for (int s = 0; s < 3; ++s) {
    auto created = client.CreateSession(AttentionSession());
    ASSERT_TRUE(created.ok()) << created.status();
    *request.add_steps() = AttentionStep(created->session_id(), 1, &q, &k, &v);
  }
  auto refused = client.SessionSteps(request);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.status().message(),
            "steps: 3 steps, more than the 2 one call may carry "
            "(--max_steps_per_call); split the call");
  request.mutable_steps()->RemoveLast();
  auto answered = client.SessionSteps(request);
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_EQ(answered->results(0).code(), 0);
  EXPECT_EQ(answered->results(1).code(), 0);

  ServerOptions off = Options();
  off.max_session_memory_mb = 0;
  TestServer no_sessions(off);
  EXPECT_EQ(no_sessions.MakeClient().SessionSteps(request).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// One client's steps for the coalescing test: a 512-token prompt, then
// single tokens, of a session of 8 heads of 64 dims (large enough that its
// steps are not computed inline).
struct ClientSteps {
  std::vector<Tensor> q, k, v;
};
ClientSteps MakeClientSteps(int seed) {
  std::mt19937 rng(seed);
  ClientSteps steps;
  for (int64_t n : {512, 1, 1, 1, 1, 1, 1}) {
    steps.q.push_back(RandomTensor(DType::kFloat32, {8, n, 64}, rng));
    steps.k.push_back(RandomTensor(DType::kFloat32, {8, n, 64}, rng));
    steps.v.push_back(RandomTensor(DType::kFloat32, {8, n, 64}, rng));
  }
  return steps;
}

// Runs `steps` on a new session through `client`; the outputs' bytes.
std::vector<std::string> RunClientSteps(AttnClient& client,
                                        const ClientSteps& steps,
                                        absl::Status* status) {
  v1::CreateSessionRequest create;
  create.set_num_heads(8);
  create.set_head_dim(64);
  create.set_max_length(1024);
  auto created = client.CreateSession(create);
  if (!created.ok()) {
    *status = created.status();
    return {};
  }
  std::vector<std::string> outputs;
  for (size_t i = 0; i < steps.q.size(); ++i) {
    v1::SessionStepRequest request;
    request.set_session_id(created->session_id());
    *request.mutable_query() = ToWire(steps.q[i].view());
    *request.mutable_key() = ToWire(steps.k[i].view());
    *request.mutable_value() = ToWire(steps.v[i].view());
    auto step = client.SessionStep(request);
    if (!step.ok()) {
      *status = step.status();
      return outputs;
    }
    outputs.push_back(step->output().raw_data());
  }
  *status = client.DeleteSession(created->session_id());
  return outputs;
}

// Concurrent SessionStep calls on distinct sessions (run in shared passes
// by the step coalescer) give, bit for bit, what the same calls give one at
// a time on a server without coalescing, and match float64; clients whose
// calls fail (past their deadline, an unknown session, wrong shapes) do
// not disturb the others.
TEST_F(SessionServerTest, CoalescedStepsEqualSerialStepsAndTheReference) {
  constexpr int kClients = 8;
  std::vector<ClientSteps> inputs;
  for (int c = 0; c < kClients; ++c) inputs.push_back(MakeClientSteps(500 + c));

  ServerOptions serial_options = Options();
  serial_options.coalesce_steps_us = 0;
  std::vector<std::vector<std::string>> serial(kClients);
  {
    TestServer server(serial_options);
    AttnClient client = server.MakeClient();
    for (int c = 0; c < kClients; ++c) {
      absl::Status status;
      serial[c] = RunClientSteps(client, inputs[c], &status);
      ASSERT_TRUE(status.ok()) << status;
    }
  }

  ServerOptions options = Options();
  options.coalesce_steps_us = 2000;
  TestServer server(options);
  std::vector<std::vector<std::string>> coalesced(kClients);
  std::vector<absl::Status> statuses(kClients);
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      AttnClient client = server.MakeClient();
      coalesced[c] = RunClientSteps(client, inputs[c], &statuses[c]);
    });
  }
  // Failing clients among them.
  threads.emplace_back([&] {
    ClientOptions hurried;
    hurried.target = server.target();
    hurried.timeout = absl::Microseconds(300);
    AttnClient client(hurried);
    for (int i = 0; i < 20; ++i) {
      absl::Status status;
      RunClientSteps(client, inputs[0], &status);
    }
  });
  threads.emplace_back([&] {
    AttnClient client = server.MakeClient();
    for (int i = 0; i < 20; ++i) {
      v1::SessionStepRequest request;
      request.set_session_id("no-such-session");
      *request.mutable_query() = ToWire(inputs[1].q[1].view());
      *request.mutable_key() = ToWire(inputs[1].k[1].view());
      *request.mutable_value() = ToWire(inputs[1].v[1].view());
      EXPECT_EQ(client.SessionStep(request).status().code(),
                absl::StatusCode::kNotFound);
    }
  });
  for (std::thread& t : threads) t.join();

  for (int c = 0; c < kClients; ++c) {
    ASSERT_TRUE(statuses[c].ok()) << "client " << c << ": " << statuses[c];
    ASSERT_EQ(coalesced[c].size(), inputs[c].q.size());
    RefTensor keys, values;
    int64_t first = 0;
    for (size_t i = 0; i < inputs[c].q.size(); ++i) {
      EXPECT_EQ(coalesced[c][i], serial[c][i])
          << "client " << c << " step " << i;
      keys = RefConcatRows(keys, ToRef(inputs[c].k[i].view()));
      values = RefConcatRows(values, ToRef(inputs[c].v[i].view()));
      const int64_t n = inputs[c].q[i].shape()[1];
      const RefAttentionResult ref =
          RefAttend(ToRef(inputs[c].q[i].view()), keys, values,
                    {RefCausalKeep(first, n)}, {true}, {});
      v1::Tensor wire;
      wire.set_dtype(v1::DATA_TYPE_FLOAT32);
      for (int64_t d : inputs[c].q[i].shape()) wire.add_shape(d);
      wire.set_raw_data(coalesced[c][i]);
      EXPECT_TRUE(
          AllClose(FromWire(wire).view(), ref.output, kFloat32Tolerance))
          << "client " << c << " step " << i;
      first += n;
    }
  }
}

}  // namespace
// The number after `series` on the metrics page (-1 when absent).
int64_t MetricValue(const std::string& page, const std::string& series) {
  const size_t at = page.find(series + " ");
  if (at == std::string::npos) return -1;
  return std::strtoll(page.c_str() + at + series.size() + 1, nullptr, 10);
}

// Concurrent 990-token steps on forks of one session, each due in 400 ms,
// more than the server computes in time: each is answered (OK, or
// DEADLINE_EXCEEDED) no later than 100 ms past its deadline by the server's
// own clock (600 ms under the sanitizers). (200 such steps were once answered
// up to 0.6 s past their deadline, intermittently, after waiting through a pass
// of a second; the coalescer now keeps passes short, see ConcurrencyTest.)
TEST_F(SessionServerTest, CoalescedStepsAreAnsweredByTheirDeadline) {
  ServerOptions options = Options();
  options.threads = 1;
  options.coalesce_steps_us = 2000;
  TestServer server(options);
  AttnClient client = server.MakeClient();
  v1::CreateSessionRequest create;
  create.set_num_heads(2);
  create.set_num_kv_heads(1);
  create.set_head_dim(16);
  create.set_max_length(1024);
  auto created = client.CreateSession(create);
  ASSERT_TRUE(created.ok()) << created.status();
  const auto step = [&](const std::string& id, int64_t n) {
    v1::SessionStepRequest request;
    request.set_session_id(id);
    *request.mutable_query() =
        ToWire(RandomTensor(DType::kFloat32, {2, n, 16}, rng_).view());
    *request.mutable_key() =
        ToWire(RandomTensor(DType::kFloat32, {1, n, 16}, rng_).view());
    *request.mutable_value() =
        ToWire(RandomTensor(DType::kFloat32, {1, n, 16}, rng_).view());
    return request;
  };
  ASSERT_TRUE(client.SessionStep(step(created->session_id(), 32)).ok());
  constexpr int kSteps = 64;
  std::vector<v1::SessionStepRequest> requests;
  for (int i = 0; i < kSteps + 8; ++i) {
    auto fork = client.ForkSession(created->session_id());
    ASSERT_TRUE(fork.ok()) << fork.status();
    requests.push_back(step(fork->session_id(), 990));
  }
  // The server learns its rate from steps alone, as from any call.
  for (int i = kSteps; i < kSteps + 8; ++i) {
    ASSERT_TRUE(client.SessionStep(requests[i]).ok());
  }
  std::vector<absl::StatusCode> codes(kSteps);
  std::vector<std::thread> threads;
  for (int i = 0; i < kSteps; ++i) {
    threads.emplace_back([&, i] {
      ClientOptions hurried;
      hurried.target = server.target();
      hurried.timeout = absl::Milliseconds(400);
      AttnClient own(hurried);
      codes[i] = own.SessionStep(requests[i]).status().code();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_TRUE(codes[i] == absl::StatusCode::kOk ||
                codes[i] == absl::StatusCode::kDeadlineExceeded)
        << "step " << i << ": " << static_cast<int>(codes[i]);
  }
  // A client gives up at its deadline; the server may answer later, and
  // counts the call as it answers it.
  const std::string series =
      "attnserve_request_duration_seconds_bucket{rpc=\"SessionStep\",le=";
  std::string page;
  int64_t total = 0;
  for (int i = 0; i < 200 && total < kSteps + 9; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    page = server.server().RenderMetrics();
    total = MetricValue(page, series + "\"+Inf\"}");
  }
  ASSERT_EQ(total, kSteps + 9) << page;
#ifdef ATTNSERVE_SANITIZED
  // A pass runs several times slower under the sanitizers, and a step
  // already in one when the machine stalls is answered when it ends.
  const std::string bound = "\"1\"}";
#else
  const std::string bound = "\"0.5\"}";
#endif
  EXPECT_EQ(MetricValue(page, series + bound), total) << page;
}

}  // namespace attnserve::testing

namespace attnserve::testing {
namespace {

// Durable sessions through live servers sharing --session_dir: a drain
// saves every session; another server takes each up on its next step (or
// fork), which answers bit for bit as a server that never stopped; a
// corrupt file answers DATA_LOSS naming it.
class DurableSessionTest : public SessionServerTest {
 protected:
  DurableSessionTest()
      : dir_(fs::temp_directory_path() /
             absl::StrCat("attnserve_session_dir_", ::getpid())) {
    fs::remove_all(dir_);
  }
  ~DurableSessionTest() override { fs::remove_all(dir_); }

  ServerOptions WithDirectory() {
    ServerOptions options = Options();
    options.session_dir = dir_.string();
    return options;
  }
  // The next step of each session: attention inputs (max_length 2048) or a
  // model session's hidden states, drawn from `seed`.
  static v1::SessionStepRequest NextStep(const std::string& id, bool model,
                                         int64_t n, unsigned seed) {
    std::mt19937 rng(seed);
    v1::SessionStepRequest request;
    request.set_session_id(id);
    if (model) {
      *request.mutable_input() =
          ToWire(RandomTensor(DType::kFloat32, {n, kEmbed}, rng).view());
      return request;
    }
    *request.mutable_query() =
        ToWire(RandomTensor(DType::kFloat32, {4, n, 8}, rng).view());
    *request.mutable_key() =
        ToWire(RandomTensor(DType::kFloat32, {2, n, 8}, rng).view());
    *request.mutable_value() =
        ToWire(RandomTensor(DType::kFloat32, {2, n, 8}, rng).view());
    return request;
  }
  // Creates the two sessions (attention; model with an INT8 cache) on
  // `client`; their ids.
  static std::vector<std::string> CreateBoth(AttnClient& client) {
    v1::CreateSessionRequest attention;
    attention.set_num_heads(4);
    attention.set_num_kv_heads(2);
    attention.set_head_dim(8);
    attention.set_rotary_dims(8);
    attention.set_max_length(2048);
    v1::CreateSessionRequest model;
    model.set_model("llama_block_int8");
    std::vector<std::string> ids;
    for (const auto& request : {attention, model}) {
      auto created = client.CreateSession(request);
      EXPECT_TRUE(created.ok()) << created.status();
      ids.push_back(created.ok() ? created->session_id() : "");
    }
    return ids;
  }

  // Runs session(i) for i in [0, count), each on a thread of its own and
  // returning what went wrong ("" for nothing); expects nothing did.
  static void ExpectEverySessionSucceeds(
      int count, const std::function<std::string(int)>& session) {
    std::vector<std::string> failures(count);
    std::vector<std::thread> threads;
    for (int i = 0; i < count; ++i) {
      threads.emplace_back([&, i] { failures[i] = session(i); });
    }
    for (std::thread& thread : threads) thread.join();
    for (int i = 0; i < count; ++i) {
      EXPECT_EQ(failures[i], "") << "session " << i;
    }
  }
  // "" when both steps succeeded with bitwise equal outputs; else what
  // differs, after `what`.
  static std::string SameStep(
      absl::string_view what,
      const absl::StatusOr<v1::SessionStepResponse>& got,
      const absl::StatusOr<v1::SessionStepResponse>& want) {
    if (!got.ok()) return absl::StrCat(what, ": ", got.status().ToString());
    if (!want.ok()) {
      return absl::StrCat(what, " (reference): ", want.status().ToString());
    }
    if (got->output().SerializeAsString() !=
        want->output().SerializeAsString()) {
      return absl::StrCat(what, ": output differs");
    }
    return "";
  }

  fs::path dir_;
};

TEST_F(DurableSessionTest, ADrainedServersSessionsStepOnAnotherAlike) {
  TestServer reference(Options());
  AttnClient reference_client = reference.MakeClient();
  const std::vector<std::string> reference_ids = CreateBoth(reference_client);
  std::vector<std::string> ids;
  {
    TestServer first(WithDirectory());
    AttnClient client = first.MakeClient();
    ids = CreateBoth(client);
    for (int s = 0; s < 2; ++s) {
      // A prefill across a block boundary, then single tokens.
      for (auto [n, seed] : {std::pair{600, 1u}, {1, 2u}, {1, 3u}}) {
        ASSERT_TRUE(client.SessionStep(NextStep(ids[s], s == 1, n, seed)).ok());
        ASSERT_TRUE(
            reference_client
                .SessionStep(NextStep(reference_ids[s], s == 1, n, seed))
                .ok());
      }
    }
    first.server().Shutdown(absl::Seconds(5));
  }
  for (const std::string& id : ids) {
    EXPECT_TRUE(fs::exists(dir_ / (id + ".session"))) << id;
  }
  TestServer second(WithDirectory());
  AttnClient client = second.MakeClient();
  for (int s = 0; s < 2; ++s) {
    for (unsigned seed : {10u, 11u, 12u}) {
      auto got = client.SessionStep(NextStep(ids[s], s == 1, 1, seed));
      auto want = reference_client.SessionStep(
          NextStep(reference_ids[s], s == 1, 1, seed));
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(got->length(), want->length());
      EXPECT_EQ(got->output().SerializeAsString(),
                want->output().SerializeAsString())
          << "session " << s << " step " << seed;
    }
    EXPECT_FALSE(fs::exists(dir_ / (ids[s] + ".session")));
  }
  const std::string page = MetricsPage(second);
  EXPECT_NE(page.find("attnserve_session_files_total{event=\"restored\"} 2\n"),
            std::string::npos)
      << page;
  // A fork takes its parent up first; a deleted saved session is gone.
  second.server().Shutdown(absl::Seconds(5));
  TestServer third(WithDirectory());
  AttnClient third_client = third.MakeClient();
  auto forked = third_client.ForkSession(ids[0], 300);
  ASSERT_TRUE(forked.ok()) << forked.status();
  EXPECT_EQ(forked->length(), 300);
  EXPECT_TRUE(third_client.DeleteSession(ids[1]).ok());
  auto gone = third_client.SessionStep(NextStep(ids[1], true, 1, 20));
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
}

// Forks of both kinds of session, saved by a drain as full copies, share
// their prefix again when another server takes them up, and step as forks
// on a server that never stopped.
TEST_F(DurableSessionTest, ForksOfADrainedServerShareTheirPrefixAgain) {
  constexpr int kForks = 3;
  TestServer reference(Options());
  AttnClient reference_client = reference.MakeClient();
  // Per kind of session: the forks' ids here and on the reference.
  std::vector<std::vector<std::string>> forks(2), reference_forks(2);
  const auto fork_each = [&](AttnClient& client, const std::string& parent,
                             bool model, std::vector<std::string>& ids) {
    ASSERT_TRUE(client.SessionStep(NextStep(parent, model, 600, 1)).ok());
    for (int f = 0; f < kForks; ++f) {
      auto fork = client.ForkSession(parent, std::nullopt);
      ASSERT_TRUE(fork.ok()) << fork.status();
      ids.push_back(fork->session_id());
      ASSERT_TRUE(
          client.SessionStep(NextStep(ids.back(), model, 1, 2 + f)).ok());
    }
    ASSERT_TRUE(client.DeleteSession(parent).ok());
  };
  const std::vector<std::string> reference_parents =
      CreateBoth(reference_client);
  {
    TestServer first(WithDirectory());
    AttnClient client = first.MakeClient();
    const std::vector<std::string> parents = CreateBoth(client);
    for (int s = 0; s < 2; ++s) {
      fork_each(client, parents[s], s == 1, forks[s]);
      fork_each(reference_client, reference_parents[s], s == 1,
                reference_forks[s]);
    }
    first.server().Shutdown(absl::Seconds(5));
  }
  // Each kind's prefix is on disk once: a base file per kind, linked.
  std::set<std::pair<dev_t, ino_t>> bases;
  for (int s = 0; s < 2; ++s) {
    for (const std::string& id : forks[s]) {
      struct stat base;
      ASSERT_EQ(::stat((dir_ / (id + ".base")).c_str(), &base), 0) << id;
      EXPECT_EQ(base.st_nlink, static_cast<nlink_t>(kForks));
      bases.emplace(base.st_dev, base.st_ino);
    }
  }
  EXPECT_EQ(bases.size(), 2u);
  TestServer second(WithDirectory());
  AttnClient client = second.MakeClient();
  for (unsigned seed : {10u, 11u}) {
    for (int s = 0; s < 2; ++s) {
      for (int f = 0; f < kForks; ++f) {
        EXPECT_EQ(
            SameStep(absl::StrCat("kind ", s, " fork ", f, " seed ", seed),
                     client.SessionStep(NextStep(forks[s][f], s == 1, 1, seed)),
                     reference_client.SessionStep(
                         NextStep(reference_forks[s][f], s == 1, 1, seed))),
            "");
      }
    }
  }
  const std::string page = MetricsPage(second);
  EXPECT_NE(page.find("attnserve_session_files_total{event=\"restored\"} 6\n"),
            std::string::npos)
      << page;
  EXPECT_NE(page.find("attnserve_session_files_total{event=\"reshared\"} 4\n"),
            std::string::npos)
      << page;
  EXPECT_NE(page.find("attnserve_session_shared_caches 2\n"), std::string::npos)
      << page;
}

// A client moves both kinds of session between two servers that share
// nothing: exported from one, imported into the other (one stream cut
// short and resumed), they step there as they would have here.
TEST_F(DurableSessionTest, ExportedSessionsImportIntoAnotherServerAlike) {
  TestServer reference(Options());
  AttnClient reference_client = reference.MakeClient();
  const std::vector<std::string> reference_ids = CreateBoth(reference_client);
  TestServer source(Options());
  TestServer target(Options());
  AttnClient from = source.MakeClient();
  AttnClient to = target.MakeClient();
  const std::vector<std::string> ids = CreateBoth(from);
  for (int s = 0; s < 2; ++s) {
    for (auto [n, seed] : {std::pair{600, 1u}, {1, 2u}}) {
      ASSERT_TRUE(from.SessionStep(NextStep(ids[s], s == 1, n, seed)).ok());
      ASSERT_TRUE(reference_client
                      .SessionStep(NextStep(reference_ids[s], s == 1, n, seed))
                      .ok());
    }
    std::string file;
    ASSERT_TRUE(from.ExportSession(ids[s],
                                   [&](absl::string_view data) {
                                     file.append(data.data(), data.size());
                                     return absl::OkStatus();
                                   })
                    .ok());
    if (s == 0) {
      // The first half alone, then the rest resumed by the client.
      const std::string half = file.substr(0, file.size() / 2);
      auto partial = to.ImportSession(half, "", 4096);
      EXPECT_EQ(partial.status().code(), absl::StatusCode::kUnavailable);
      auto early = to.SessionStep(NextStep(ids[s], false, 1, 9));
      EXPECT_EQ(early.status().code(), absl::StatusCode::kUnavailable)
          << early.status();
    }
    auto imported = to.ImportSession(file, ids[s], 65536);
    ASSERT_TRUE(imported.ok()) << imported.status();
    EXPECT_EQ(imported->session_id(), ids[s]);
    EXPECT_EQ(imported->received(), file.size());
    EXPECT_EQ(imported->lengths(0), 601);
    // The same id again is refused while it is open there.
    auto again = to.ImportSession(file);
    EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
    for (unsigned seed : {10u, 11u}) {
      auto got = to.SessionStep(NextStep(ids[s], s == 1, 1, seed));
      auto want = reference_client.SessionStep(
          NextStep(reference_ids[s], s == 1, 1, seed));
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(got->output().SerializeAsString(),
                want->output().SerializeAsString())
          << "session " << s << " step " << seed;
    }
  }
  // An export resumed after its session stepped is refused, naming why.
  grpc::ClientContext context;
  auto channel =
      grpc::CreateChannel(source.target(), grpc::InsecureChannelCredentials());
  auto stub = v1::AttentionService::NewStub(channel);
  v1::ExportSessionRequest request;
  request.set_session_id(ids[0]);
  request.set_version(1);
  request.set_offset(10);
  auto reader = stub->ExportSession(&context, request);
  v1::ExportSessionChunk chunk;
  EXPECT_FALSE(reader->Read(&chunk));
  const grpc::Status stale = reader->Finish();
  EXPECT_EQ(stale.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_NE(stale.error_message().find("export it again"), std::string::npos)
      << stale.error_message();
  const std::string page = MetricsPage(target);
  EXPECT_NE(page.find("attnserve_session_files_total{event=\"imported\"} 2\n"),
            std::string::npos)
      << page;
}

// A load balancer moving a session's calls between two live replicas (and
// back): each replica asked for it has the other hand it over.
TEST_F(DurableSessionTest, LiveReplicasHandSessionsOverOnDemand) {
  TestServer reference(Options());
  AttnClient reference_client = reference.MakeClient();
  const std::vector<std::string> reference_ids = CreateBoth(reference_client);
  TestServer a(WithDirectory());
  TestServer b(WithDirectory());
  AttnClient clients[2] = {a.MakeClient(), b.MakeClient()};
  const std::vector<std::string> ids = CreateBoth(clients[0]);
  for (int s = 0; s < 2; ++s) {
    ASSERT_TRUE(clients[0].SessionStep(NextStep(ids[s], s == 1, 600, 1)).ok());
    ASSERT_TRUE(
        reference_client.SessionStep(NextStep(reference_ids[s], s == 1, 600, 1))
            .ok());
  }
  const int turns[] = {1, 1, 0, 1, 0};
  for (unsigned t = 0; t < 5; ++t) {
    for (int s = 0; s < 2; ++s) {
      auto got = clients[turns[t]].SessionStep(NextStep(ids[s], s == 1, 1, t));
      auto want = reference_client.SessionStep(
          NextStep(reference_ids[s], s == 1, 1, t));
      ASSERT_TRUE(got.ok()) << "turn " << t << ": " << got.status();
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(got->output().SerializeAsString(),
                want->output().SerializeAsString())
          << "session " << s << " turn " << t;
    }
  }
  // Asked directly (an operator moving a session): saved and freed where
  // it was, NOT_FOUND there afterwards and for a session never held,
  // FAILED_PRECONDITION without a directory.
  ASSERT_TRUE(clients[0].HandOverSession(ids[0]).ok());
  EXPECT_TRUE(fs::exists(dir_ / (ids[0] + ".session")));
  EXPECT_EQ(clients[0].HandOverSession(ids[0]).code(),
            absl::StatusCode::kNotFound);
  const absl::Status no_directory =
      reference_client.HandOverSession(reference_ids[0]);
  EXPECT_EQ(no_directory.code(), absl::StatusCode::kFailedPrecondition)
      << no_directory;
  EXPECT_NE(no_directory.message().find("--session_dir"), std::string::npos);
}

// Open Inference sequences live on as sessions do: a sequence's session id
// comes from its model and sequence id, so a drained replica's sequences
// continue on another, live replicas hand them over, and a start replaces
// a sequence open on another replica. Every output is bit for bit that of
// a server whose sequences never moved.
TEST_F(DurableSessionTest, OpenInferenceSequencesLiveOnAcrossReplicas) {
  // A step of sequence `id` on attention_session: query [4, n, 8], key
  // and value [2, n, 8] drawn from `seed`.
  const auto request = [](const inference::InferParameter& id, bool start,
                          bool end, int64_t n, unsigned seed) {
    const v1::SessionStepRequest step = NextStep("", false, n, seed);
    inference::ModelInferRequest infer;
    infer.set_model_name("attention_session");
    auto& parameters = *infer.mutable_parameters();
    parameters["sequence_id"] = id;
    parameters["sequence_start"].set_bool_param(start);
    parameters["sequence_end"].set_bool_param(end);
    if (start) parameters["max_length"].set_int64_param(2048);
    const v1::Tensor* tensors[] = {&step.query(), &step.key(), &step.value()};
    const char* names[] = {"query", "key", "value"};
    for (int i = 0; i < 3; ++i) {
      auto* input = infer.add_inputs();
      input->set_name(names[i]);
      input->set_datatype("FP32");
      for (int64_t d : tensors[i]->shape()) input->add_shape(d);
      infer.add_raw_input_contents(tensors[i]->raw_data());
    }
    return infer;
  };
  std::string session_id;  // the last answer's sequence_session_id
  const auto infer = [&session_id](const TestServer& server,
                                   const inference::ModelInferRequest& r)
      -> absl::StatusOr<std::string> {
    auto stub = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
        server.target(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    inference::ModelInferResponse response;
    const grpc::Status status = stub->ModelInfer(&context, r, &response);
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          status.error_message());
    }
    const auto id = response.parameters().find("sequence_session_id");
    session_id =
        id == response.parameters().end() ? "" : id->second.string_param();
    return response.raw_output_contents(0);
  };
  inference::InferParameter ids[2];
  ids[0].set_int64_param(7);
  ids[1].set_string_param("conversation-7");
  TestServer reference(Options());
  std::optional<TestServer> a(std::in_place, WithDirectory());
  TestServer b(WithDirectory());
  unsigned seed = 1;
  // One step of each sequence on `server` (and the reference): equal.
  const auto step_both = [&](const TestServer& server, bool start, bool end,
                             int64_t n, const char* what) {
    for (int s = 0; s < 2; ++s) {
      const auto r = request(ids[s], start, end, n, seed++);
      auto got = infer(server, r);
      auto want = infer(reference, r);
      ASSERT_TRUE(got.ok())
          << what << ", sequence " << s << ": " << got.status();
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(*got, *want) << what << ", sequence " << s;
    }
  };
  step_both(*a, true, false, 600, "start on a");
  step_both(*a, false, false, 1, "step on a");
  step_both(b, false, false, 1, "handed over to b");
  step_both(*a, false, false, 2, "handed back to a");
  // An operator moves the string sequence by its session's id.
  EXPECT_EQ(session_id.size(), 40u) << session_id;
  ASSERT_TRUE(a->MakeClient().HandOverSession(session_id).ok());
  EXPECT_TRUE(fs::exists(dir_ / (session_id + ".session")));
  a->server().Shutdown(absl::Seconds(5));
  a.reset();
  step_both(b, false, false, 1, "taken up by b after a drained");
  // A start of sequence 7 on a new replica replaces the one open on b.
  a.emplace(WithDirectory());
  {
    const auto r = request(ids[0], true, false, 3, seed++);
    auto got = infer(*a, r);
    auto want = infer(reference, r);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, *want);
  }
  step_both(b, false, false, 1, "back on b after the restart");
  {
    // A start whose first step fails leaves the open sequence as it was.
    inference::ModelInferRequest bad = request(ids[1], true, false, 1, seed);
    bad.mutable_inputs(1)->set_shape(1, 2);
    bad.set_raw_input_contents(
        1, bad.raw_input_contents(1) + bad.raw_input_contents(1));
    const absl::Status refused = infer(*a, bad).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  }
  step_both(b, false, false, 1, "on b after a failed start on a");
  step_both(*a, false, true, 1, "ended on a");
  EXPECT_EQ(session_id, "");
  // Ended: Triton's answer where it ended; where it was handed over from,
  // NOT_FOUND saying where it went (that replica cannot tell an end from
  // an expiry elsewhere); both ask for a new start.
  for (int s = 0; s < 2; ++s) {
    const absl::Status ended =
        infer(*a, request(ids[s], false, false, 1, seed)).status();
    EXPECT_EQ(ended.code(), absl::StatusCode::kInvalidArgument) << ended;
    EXPECT_NE(ended.message().find("must specify the START flag"),
              std::string::npos)
        << ended;
    const absl::Status moved =
        infer(b, request(ids[s], false, false, 1, seed)).status();
    EXPECT_EQ(moved.code(), absl::StatusCode::kNotFound) << moved;
    EXPECT_NE(moved.message().find("was saved to the session directory"),
              std::string::npos)
        << moved;
    EXPECT_NE(moved.message().find("sequence_start"), std::string::npos)
        << moved;
  }
  EXPECT_TRUE(!fs::exists(dir_ / "quarantine") ||
              fs::is_empty(dir_ / "quarantine"));
}

// Many sessions moving between two live replicas at once, each step on the
// replica the other holds it on: every step is answered, bitwise as on a
// server that never moved them. (Lookups on gRPC's threads once waited for
// hand-overs there: the replicas' threads all waited on each other until the
// hand-over's deadline, and the steps failed UNAVAILABLE.)
TEST_F(DurableSessionTest, ConcurrentHandOversBetweenReplicasAllSucceed) {
  TestServer reference(Options());
  TestServer a(WithDirectory());
  TestServer b(WithDirectory());
  ExpectEverySessionSucceeds(12, [&](int i) -> std::string {
    AttnClient clients[2] = {a.MakeClient(), b.MakeClient()};
    AttnClient reference_client = reference.MakeClient();
    const std::string id = CreateBoth(clients[0])[0];
    const std::string reference_id = CreateBoth(reference_client)[0];
    for (int t = 0; t < 8; ++t) {
      const unsigned seed = 100 * i + t;
      const int64_t n = t == 0 ? 40 : 1;
      const std::string failure = SameStep(
          absl::StrCat("step ", t),
          clients[t % 2].SessionStep(NextStep(id, false, n, seed)),
          reference_client.SessionStep(NextStep(reference_id, false, n, seed)));
      if (!failure.empty()) return failure;
    }
    return "";
  });
}

// Forks, deletes and exports of sessions the other replica holds take them
// up on a worker (forks and deletes recorded as calls under their RPC's
// name), not on gRPC's threads: replicas asking each other for sessions at
// once all succeed, and the sessions answer as a server's whose sessions
// never moved.
TEST_F(DurableSessionTest, ForksDeletesAndExportsAcrossReplicasRunOnWorkers) {
  constexpr int kSessions = 8;
  TestServer reference(Options());
  TestServer a(WithDirectory());
  TestServer b(WithDirectory());
  ExpectEverySessionSucceeds(kSessions, [&](int i) -> std::string {
    AttnClient clients[2] = {a.MakeClient(), b.MakeClient()};
    AttnClient reference_client = reference.MakeClient();
    // Half the sessions start on each replica, so that each asks the other
    // for sessions at once.
    AttnClient& home = clients[i % 2];
    AttnClient& other = clients[1 - i % 2];
    const std::string id = CreateBoth(home)[0];
    const std::string reference_id = CreateBoth(reference_client)[0];
    const unsigned seed = 10 * i;
    std::string failure = SameStep(
        "prefill", home.SessionStep(NextStep(id, false, 40, seed)),
        reference_client.SessionStep(NextStep(reference_id, false, 40, seed)));
    if (!failure.empty()) return failure;
    auto fork = other.ForkSession(id);
    auto reference_fork = reference_client.ForkSession(reference_id);
    if (!fork.ok()) return absl::StrCat("fork: ", fork.status().ToString());
    if (!reference_fork.ok()) return "the reference's fork failed";
    failure = SameStep(
        "fork's step",
        home.SessionStep(NextStep(fork->session_id(), false, 1, seed + 1)),
        reference_client.SessionStep(
            NextStep(reference_fork->session_id(), false, 1, seed + 1)));
    if (!failure.empty()) return failure;
    const absl::Status deleted = other.DeleteSession(fork->session_id());
    if (!deleted.ok()) return absl::StrCat("delete: ", deleted.ToString());
    const auto gone =
        home.SessionStep(NextStep(fork->session_id(), false, 1, seed));
    if (gone.status().code() != absl::StatusCode::kNotFound) {
      return absl::StrCat("step after delete: ", gone.status().ToString());
    }
    // An export takes the session up alike (the fork moved the parent to
    // the other replica); its file loads into a server without the
    // directory and steps as the reference.
    std::string file;
    const absl::Status exported =
        home.ExportSession(id, [&](absl::string_view piece) {
          file.append(piece.data(), piece.size());
          return absl::OkStatus();
        });
    if (!exported.ok()) return absl::StrCat("export: ", exported.ToString());
    AttnClient lone = reference.MakeClient();
    auto imported = lone.ImportSession(file);
    if (!imported.ok()) {
      return absl::StrCat("import: ", imported.status().ToString());
    }
    return SameStep("import's step",
                    lone.SessionStep(NextStep(id, false, 1, seed + 2)),
                    reference_client.SessionStep(
                        NextStep(reference_id, false, 1, seed + 2)));
  });
  // Each replica took up half the parents to fork them, and half the forks
  // to delete them: those calls were queued to a worker and recorded.
  for (TestServer* server : {&a, &b}) {
    const std::string page = server->server().RenderMetrics();
    for (const char* rpc : {"ForkSession", "DeleteSession"}) {
      EXPECT_EQ(
          MetricValue(page, absl::StrCat("attnserve_requests_total{rpc=\"", rpc,
                                         "\",code=\"OK\"}")),
          kSessions / 2)
          << rpc << "\n"
          << page;
    }
  }
}

// An export cut short resumes on another replica the session has moved to
// (a drained or killed replica's stream, a load balancer's new pick): the
// version is the file's fingerprint, the same wherever the session is.
// Once the session steps, the same resume is ABORTED.
TEST_F(DurableSessionTest, AnExportCutShortResumesOnAnotherReplica) {
  TestServer a(WithDirectory());
  TestServer b(WithDirectory());
  AttnClient client = a.MakeClient();
  v1::CreateSessionRequest create;
  create.set_num_heads(8);
  create.set_head_dim(64);
  create.set_max_length(4096);
  auto created = client.CreateSession(create);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->session_id();
  std::mt19937 rng(5);
  v1::SessionStepRequest prefill;
  prefill.set_session_id(id);
  for (auto* field : {prefill.mutable_query(), prefill.mutable_key(),
                      prefill.mutable_value()}) {
    *field = ToWire(RandomTensor(DType::kFloat32, {8, 1500, 64}, rng).view());
  }
  ASSERT_TRUE(client.SessionStep(prefill).ok());
  // The whole file, for comparison, and its first chunk alone from `a`.
  std::string whole;
  ASSERT_TRUE(client
                  .ExportSession(id,
                                 [&](absl::string_view piece) {
                                   whole.append(piece.data(), piece.size());
                                   return absl::OkStatus();
                                 })
                  .ok());
  const auto first_chunk = [&](const TestServer& server,
                               const v1::ExportSessionRequest& request,
                               v1::ExportSessionChunk* chunk) {
    grpc::ClientContext context;
    auto stub = v1::AttentionService::NewStub(grpc::CreateChannel(
        server.target(), grpc::InsecureChannelCredentials()));
    auto reader = stub->ExportSession(&context, request);
    if (!reader->Read(chunk)) return reader->Finish();
    context.TryCancel();
    static_cast<void>(reader->Finish());
    return grpc::Status::OK;
  };
  v1::ExportSessionRequest request;
  request.set_session_id(id);
  v1::ExportSessionChunk chunk;
  ASSERT_TRUE(first_chunk(a, request, &chunk).ok());
  ASSERT_LT(chunk.data().size(), whole.size());
  ASSERT_NE(chunk.version(), 0u);
  std::string file = chunk.data();
  // Resumed on `b`, which takes the session over from `a` first.
  request.set_offset(file.size());
  request.set_version(chunk.version());
  grpc::ClientContext context;
  auto stub = v1::AttentionService::NewStub(
      grpc::CreateChannel(b.target(), grpc::InsecureChannelCredentials()));
  auto reader = stub->ExportSession(&context, request);
  while (reader->Read(&chunk)) {
    ASSERT_EQ(chunk.offset(), file.size());
    file += chunk.data();
  }
  const grpc::Status resumed = reader->Finish();
  ASSERT_TRUE(resumed.ok()) << resumed.error_message();
  EXPECT_TRUE(file == whole) << "the resumed file differs";
  // After a step, the old version is refused wherever it is asked.
  AttnClient on_b = b.MakeClient();
  v1::SessionStepRequest next = prefill;
  for (auto* field :
       {next.mutable_query(), next.mutable_key(), next.mutable_value()}) {
    *field = ToWire(RandomTensor(DType::kFloat32, {8, 1, 64}, rng).view());
  }
  ASSERT_TRUE(on_b.SessionStep(next).ok());
  request.set_offset(0);
  const grpc::Status stale = first_chunk(a, request, &chunk);
  EXPECT_EQ(stale.error_code(), grpc::StatusCode::ABORTED)
      << stale.error_message();
  EXPECT_NE(stale.error_message().find("changed since the export began"),
            std::string::npos)
      << stale.error_message();
}

// Sessions whose holder record names a replica that never answers (a lost
// node: here a socket that takes connections and says nothing): the first
// step waits for the hand-over's deadline outside its compute slot (the one
// slot serves other calls meanwhile), then the replica is taken for down,
// and the next session it held is not asked of it again (each would have
// waited for the whole deadline).
TEST_F(DurableSessionTest, AReplicaThatNeverAnswersIsAskedOnceAWhile) {
  const int silent = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  ASSERT_EQ(
      ::bind(silent, reinterpret_cast<sockaddr*>(&address), sizeof(address)),
      0);
  ASSERT_EQ(::listen(silent, 16), 0);
  ASSERT_EQ(
      ::getsockname(silent, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const std::string holder =
      absl::StrCat("127.0.0.1:", ntohs(address.sin_port));
  // One compute slot: the wait for the silent replica does not hold it.
  ServerOptions options = WithDirectory();
  options.max_inflight = 1;
  TestServer server(options);
  AttnClient client = server.MakeClient();
  const std::vector<std::string> ids = {"5110e47a", "5110e47b"};
  for (const std::string& id : ids) {
    std::ofstream(dir_ / (id + ".held")) << holder;
  }
  std::vector<absl::Duration> took;
  std::atomic<bool> first_answered{false};
  std::thread computes([&] {
    absl::SleepFor(absl::Milliseconds(300));
    std::mt19937 rng(5);
    Tensor x = RandomTensor(DType::kFloat32, {512, 1024}, rng);
    v1::LayerNormRequest request;
    *request.mutable_input() = ToWire(x.view());
    auto answer = server.MakeClient().LayerNorm(request);
    EXPECT_TRUE(answer.ok()) << answer.status();
    EXPECT_FALSE(first_answered.load()) << "computed only after the wait";
  });
  for (const std::string& id : ids) {
    const absl::Time start = absl::Now();
    const auto step = client.SessionStep(NextStep(id, false, 1, 1));
    took.push_back(absl::Now() - start);
    first_answered = true;
    EXPECT_EQ(step.status().code(), absl::StatusCode::kNotFound)
        << step.status();
  }
  computes.join();
  ::close(silent);
  EXPECT_GE(took[0], absl::Seconds(4)) << "the hand-over's deadline is 5 s";
  EXPECT_LT(took[1], absl::Seconds(2)) << "asked the silent replica again";
}

TEST_F(DurableSessionTest, ACorruptFileAnswersDataLossAndIsQuarantined) {
  std::string id;
  {
    TestServer first(WithDirectory());
    AttnClient client = first.MakeClient();
    id = CreateBoth(client)[0];
    ASSERT_TRUE(client.SessionStep(NextStep(id, false, 20, 1)).ok());
  }
  const fs::path file = dir_ / (id + ".session");
  ASSERT_TRUE(fs::exists(file));
  {
    std::fstream bytes(file, std::ios::in | std::ios::out | std::ios::binary);
    bytes.seekp(static_cast<std::streamoff>(fs::file_size(file) - 40));
    bytes.put('\x55');
  }
  TestServer second(WithDirectory());
  AttnClient client = second.MakeClient();
  auto step = client.SessionStep(NextStep(id, false, 1, 2));
  EXPECT_EQ(step.status().code(), absl::StatusCode::kDataLoss) << step.status();
  EXPECT_NE(step.status().message().find(id + ".session"), std::string::npos)
      << step.status();
  EXPECT_FALSE(fs::exists(file));
  EXPECT_FALSE(fs::is_empty(dir_ / "quarantine"));
}

TEST_F(DurableSessionTest, AnUnusableSessionDirStopsStartUp) {
  std::ofstream(dir_) << "a file";
  auto server = AttnServer::Start(WithDirectory());
  ASSERT_FALSE(server.ok());
  EXPECT_NE(server.status().message().find("--session_dir"), std::string::npos)
      << server.status();
  fs::remove(dir_);
}

}  // namespace
}  // namespace attnserve::testing
