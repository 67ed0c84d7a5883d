// Hostile input through a live server: a table of bad (and oddly formed but
// valid) requests for every RPC, each sent as raw bytes through a generic
// stub and answered with an exact gRPC code and a message that names the
// field at fault. Families of cases are generated for every tensor field of
// every request (found by walking the proto's descriptors, so that a new
// field fails the coverage test until it has cases) times every kind of
// corruption; the rest are written one by one. After each case the server
// must still answer a valid call. The run ends with the number of cases by
// expected code.
//
// Cases marked `pending` follow decisions implemented on other branches: they
// fail here until those merge (see kPendingNanPropagation and
// kPendingParseErrors).
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/shared_memory.h"
#include "core/attention_weights.h"
#include "core/safetensors.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.pb.h"
#include "proto/tensor_codec.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

namespace fs = std::filesystem;
using google::protobuf::Message;
using Code = absl::StatusCode;

// The decisions these cases follow, when another branch implements them.
// NaN and +-inf in data tensors propagate (IEEE, as PyTorch): the call is OK
// and the affected output rows are not finite.
constexpr char kPendingNanPropagation[] = "NaN/inf in data propagate";
// Bytes that do not parse as the RPC's request: INVALID_ARGUMENT "request:
// could not parse N bytes as attnserve.v1.XRequest".
constexpr char kPendingParseErrors[] = "unparsable requests";

// The server's limits, set low so that the cases exceeding them stay small.
constexpr int kMaxMessageMb = 4;
constexpr int64_t kMaxTensorElements = int64_t{1} << 20;
constexpr int64_t kMaxRequestMemoryMb = 64;
// The registered shared-memory region the reference cases point into.
constexpr char kRegion[] = "hostile";
constexpr uint64_t kRegionBytes = 4096;
constexpr char kModel[] = "demo";
// Stand-ins for the ids of the decode sessions the suite opens, replaced
// in each request's bytes before it is sent (ids and stand-ins are 32
// bytes, so the message stays well formed): an attention session (2 query
// heads, 1 key/value head, head dim 8), a session of the model, and one
// to delete.
constexpr char kAttentionSession[] = "attention-session-placeholder-01";
constexpr char kModelSession[] = "model-session-placeholder-000001";
constexpr char kDeleteSession[] = "delete-session-placeholder-00001";
constexpr char kHandOverSession[] = "hand-over-session-placeholder-01";
constexpr int64_t kSessionMaxLength = 4096;

// ---------------------------------------------------------------------------
// Cases.

struct HostileCase {
  // The service and RPC: "attnserve.v1.AttentionService", "Attend".
  std::string service;
  std::string rpc;
  std::string name;     // what is wrong, e.g. "query_dtype_999"
  std::string field;    // the field exercised, e.g. "weights.q_proj_weight"
  std::string request;  // the bytes sent
  Code code = Code::kOk;
  // The message: exact, or with `glob` a pattern whose '*' matches any run.
  std::string message;
  bool glob = false;
  // Set when the expectation follows a decision implemented elsewhere.
  const char* pending = nullptr;
  // The call's deadline: some refusals are the deadline estimate's.
  int deadline_seconds = 60;
  // More checks of an OK response's bytes.
  std::function<void(const std::string&)> check;
  // Run after the case (e.g. unregister what it registered).
  std::function<void(AttnClient&)> cleanup;
};

void PrintTo(const HostileCase& c, std::ostream* os) {
  *os << c.rpc << " " << c.field << ": expects "
      << absl::StatusCodeToString(c.code) << " '" << absl::CEscape(c.message)
      << "'";
}

std::string TestName(const HostileCase& c) {
  std::string name =
      absl::StrCat(absl::StatusCodeToString(c.code), "_", c.rpc, "_", c.name);
  for (char& ch : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name;
}

// '*' matches any run of characters; everything else itself.
bool GlobMatch(absl::string_view pattern, absl::string_view text) {
  const std::vector<absl::string_view> parts = absl::StrSplit(pattern, '*');
  if (parts.size() == 1) return pattern == text;
  if (!absl::StartsWith(text, parts.front())) return false;
  text.remove_prefix(parts.front().size());
  for (size_t i = 1; i + 1 < parts.size(); ++i) {
    const size_t at = text.find(parts[i]);
    if (at == absl::string_view::npos) return false;
    text.remove_prefix(at + parts[i].size());
  }
  return absl::EndsWith(text, parts.back());
}

// The RPC a request message is for: "AttendRequest" -> "Attend".
// The RPC a request is of: its message's name without "Request" (or, for
// a stream's chunks, "Chunk").
std::string RpcOf(const Message& request) {
  std::string rpc = request.GetDescriptor()->name();
  for (absl::string_view suffix : {"Request", "Chunk"}) {
    if (absl::EndsWith(rpc, suffix)) {
      rpc.resize(rpc.size() - suffix.size());
      break;
    }
  }
  return rpc;
}

HostileCase Case(const Message& request, std::string name, std::string field,
                 Code code, std::string message) {
  HostileCase c;
  c.service = request.GetDescriptor()->file()->service(0)->full_name();
  c.rpc = RpcOf(request);
  c.name = std::move(name);
  c.field = std::move(field);
  c.request = request.SerializeAsString();
  c.code = code;
  c.message = std::move(message);
  return c;
}

HostileCase Ok(const Message& request, std::string name, std::string field,
               std::function<void(const std::string&)> check = nullptr) {
  HostileCase c =
      Case(request, std::move(name), std::move(field), Code::kOk, "");
  c.check = std::move(check);
  return c;
}

HostileCase Invalid(const Message& request, std::string name, std::string field,
                    std::string message) {
  return Case(request, std::move(name), std::move(field),
              Code::kInvalidArgument, std::move(message));
}

HostileCase Glob(HostileCase c) {
  c.glob = true;
  return c;
}

HostileCase Pending(HostileCase c, const char* decision) {
  c.pending = decision;
  return c;
}

// ---------------------------------------------------------------------------
// Requests.

// A BOOL mask that keeps every position.
v1::Tensor KeepAll(Shape shape) {
  return WireTensor(v1::DATA_TYPE_BOOL, shape,
                    std::string(NumElements(shape), '\1'));
}

// A FLOAT32 tensor of `values`.
v1::Tensor FloatValues(Shape shape, const std::vector<float>& values) {
  return WireTensor(v1::DATA_TYPE_FLOAT32, shape,
                    std::string(reinterpret_cast<const char*>(values.data()),
                                values.size() * sizeof(float)));
}

void SetShape(v1::Tensor* t, const std::vector<int64_t>& shape) {
  t->mutable_shape()->Assign(shape.begin(), shape.end());
}

// Attend: query [2, 3, 8], key [2, 5, 8], value [2, 5, 4], a mask [3, 5]
// that keeps everything.
v1::AttendRequest AttendBase() {
  v1::AttendRequest r;
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {2, 3, 8}, 1);
  *r.mutable_key() = RandomWireTensor(DType::kFloat32, {2, 5, 8}, 2);
  *r.mutable_value() = RandomWireTensor(DType::kFloat32, {2, 5, 4}, 3);
  *r.mutable_attn_mask() = KeepAll({3, 5});
  return r;
}

// MultiHeadAttend with separate projections of distinct widths: 2 heads,
// dk 4, dv 3; query [2, 3, 8], key [2, 5, 6], value [2, 5, 4]; output
// [2, 3, 5].
v1::MultiHeadAttendRequest MhaBase() {
  v1::MultiHeadAttendRequest r;
  v1::AttentionWeights* w = r.mutable_weights();
  w->set_num_heads(2);
  *w->mutable_q_proj_weight() = RandomWireTensor(DType::kFloat32, {8, 8}, 11);
  *w->mutable_k_proj_weight() = RandomWireTensor(DType::kFloat32, {8, 6}, 12);
  *w->mutable_v_proj_weight() = RandomWireTensor(DType::kFloat32, {6, 4}, 13);
  *w->mutable_q_proj_bias() = RandomWireTensor(DType::kFloat32, {8}, 14);
  *w->mutable_k_proj_bias() = RandomWireTensor(DType::kFloat32, {8}, 15);
  *w->mutable_v_proj_bias() = RandomWireTensor(DType::kFloat32, {6}, 16);
  *w->mutable_out_proj_weight() = RandomWireTensor(DType::kFloat32, {5, 6}, 17);
  *w->mutable_out_proj_bias() = RandomWireTensor(DType::kFloat32, {5}, 18);
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {2, 3, 8}, 19);
  *r.mutable_key() = RandomWireTensor(DType::kFloat32, {2, 5, 6}, 20);
  *r.mutable_value() = RandomWireTensor(DType::kFloat32, {2, 5, 4}, 21);
  *r.mutable_attn_mask() = KeepAll({3, 5});
  *r.mutable_key_padding_mask() = KeepAll({2, 5});
  return r;
}

// MultiHeadAttend with PyTorch's fused projection: E 8, 2 heads,
// self-attention over query [2, 3, 8]; output [2, 3, 8].
v1::MultiHeadAttendRequest MhaFusedBase() {
  v1::MultiHeadAttendRequest r;
  v1::AttentionWeights* w = r.mutable_weights();
  w->set_num_heads(2);
  *w->mutable_in_proj_weight() = RandomWireTensor(DType::kFloat32, {24, 8}, 31);
  *w->mutable_in_proj_bias() = RandomWireTensor(DType::kFloat32, {24}, 32);
  *w->mutable_out_proj_weight() = RandomWireTensor(DType::kFloat32, {8, 8}, 33);
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {2, 3, 8}, 34);
  return r;
}

// MultiHeadAttend with the server's model (E 8, 2 heads).
v1::MultiHeadAttendRequest MhaModelBase() {
  v1::MultiHeadAttendRequest r;
  r.set_model(kModel);
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {2, 3, 8}, 41);
  return r;
}

// A step of the attention session: 3 tokens at position 0 (each case
// starts the session over, so cases do not see each other's tokens).
v1::SessionStepRequest SessionStepBase() {
  v1::SessionStepRequest r;
  r.set_session_id(kAttentionSession);
  r.set_position(0);
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {2, 3, 8}, 31);
  *r.mutable_key() = RandomWireTensor(DType::kFloat32, {1, 3, 8}, 32);
  *r.mutable_value() = RandomWireTensor(DType::kFloat32, {1, 3, 8}, 33);
  return r;
}

// A step of the model session: hidden states [3, 8] at position 0.
v1::SessionStepRequest SessionModelStepBase() {
  v1::SessionStepRequest r;
  r.set_session_id(kModelSession);
  r.set_position(0);
  *r.mutable_input() = RandomWireTensor(DType::kFloat32, {3, 8}, 34);
  return r;
}

v1::LayerNormRequest LayerNormBase() {
  v1::LayerNormRequest r;
  *r.mutable_input() = RandomWireTensor(DType::kFloat32, {2, 6}, 51);
  *r.mutable_gamma() = RandomWireTensor(DType::kFloat32, {6}, 52);
  *r.mutable_beta() = RandomWireTensor(DType::kFloat32, {6}, 53);
  return r;
}

v1::RmsNormRequest RmsNormBase() {
  v1::RmsNormRequest r;
  *r.mutable_input() = RandomWireTensor(DType::kFloat32, {2, 6}, 54);
  *r.mutable_gamma() = RandomWireTensor(DType::kFloat32, {6}, 55);
  return r;
}

// The bytes of a varint.
std::string Varint(uint64_t value) {
  std::string out;
  google::protobuf::io::StringOutputStream stream(&out);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.WriteVarint64(value);
  coded.Trim();
  return out;
}

// A field the schema does not have: number 1000, length-delimited.
std::string UnknownField() {
  return Varint((1000 << 3) | 2) + Varint(5) + "hello";
}

// A length-delimited field `number` holding `bytes`.
std::string LengthDelimited(int number, const std::string& bytes) {
  return Varint((number << 3) | 2) + Varint(bytes.size()) + bytes;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}
std::string ShapeText(const v1::Tensor& t) {
  return ShapeText(std::vector<int64_t>(t.shape().begin(), t.shape().end()));
}

int64_t Elements(const v1::Tensor& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) n *= d;
  return n;
}

int ElementSize(const v1::Tensor& t) {
  switch (t.dtype()) {
    case v1::DATA_TYPE_FLOAT32:
      return 4;
    case v1::DATA_TYPE_BFLOAT16:
    case v1::DATA_TYPE_FLOAT16:
      return 2;
    default:
      return 1;
  }
}

const char* DTypeText(const v1::Tensor& t) {
  switch (t.dtype()) {
    case v1::DATA_TYPE_FLOAT32:
      return "FLOAT32";
    case v1::DATA_TYPE_BFLOAT16:
      return "BFLOAT16";
    case v1::DATA_TYPE_FLOAT16:
      return "FLOAT16";
    case v1::DATA_TYPE_BOOL:
      return "BOOL";
    default:
      return "UINT8";
  }
}

// The message at `path` (field names from `root`), created if unset.
Message* MutableAt(Message* root, const std::vector<std::string>& path) {
  Message* m = root;
  for (const std::string& name : path) {
    const google::protobuf::FieldDescriptor* field =
        m->GetDescriptor()->FindFieldByName(name);
    EXPECT_NE(field, nullptr) << name;
    m = m->GetReflection()->MutableMessage(m, field);
  }
  return m;
}

// ---------------------------------------------------------------------------
// Checks of OK responses.

// The output tensor of a serialized response of type Response, as FLOAT32
// values.
template <typename Response>
std::vector<float> OutputValues(const std::string& bytes,
                                std::vector<int64_t>* shape = nullptr) {
  Response response;
  EXPECT_TRUE(response.ParseFromString(bytes));
  auto output = CopyTensor(response.output(), "output");
  EXPECT_TRUE(output.ok()) << output.status();
  if (!output.ok()) return {};
  EXPECT_EQ(output->dtype(), DType::kFloat32);
  if (shape != nullptr) *shape = output->shape();
  const float* v = output->template data_as<float>();
  return std::vector<float>(v, v + output->num_elements());
}

template <typename Response>
std::function<void(const std::string&)> ExpectShape(
    std::vector<int64_t> expected) {
  return [expected](const std::string& bytes) {
    std::vector<int64_t> shape;
    OutputValues<Response>(bytes, &shape);
    EXPECT_EQ(ShapeText(shape), ShapeText(expected));
  };
}

// Every output value is finite.
template <typename Response>
std::function<void(const std::string&)> ExpectFinite() {
  return [](const std::string& bytes) {
    const std::vector<float> v = OutputValues<Response>(bytes);
    ASSERT_FALSE(v.empty());
    for (size_t i = 0; i < v.size(); ++i) {
      ASSERT_TRUE(std::isfinite(v[i])) << "output[" << i << "] = " << v[i];
    }
  };
}

// The first half of the output (batch 0, or row 0 of a [2, N] LayerNorm) has
// a value that is not finite; the second half, untouched by the bad input,
// is all finite.
template <typename Response>
std::function<void(const std::string&)> ExpectFirstHalfNotFinite() {
  return [](const std::string& bytes) {
    const std::vector<float> v = OutputValues<Response>(bytes);
    ASSERT_FALSE(v.empty());
    const size_t half = v.size() / 2;
    bool first_bad = false;
    for (size_t i = 0; i < half; ++i) first_bad |= !std::isfinite(v[i]);
    EXPECT_TRUE(first_bad) << "batch 0 is all finite";
    for (size_t i = half; i < v.size(); ++i) {
      ASSERT_TRUE(std::isfinite(v[i])) << "output[" << i << "] = " << v[i];
    }
  };
}

// Every output row (the last dim) has a NaN.
template <typename Response>
std::function<void(const std::string&)> ExpectNanInEveryRow() {
  return [](const std::string& bytes) {
    std::vector<int64_t> shape;
    const std::vector<float> v = OutputValues<Response>(bytes, &shape);
    ASSERT_FALSE(v.empty());
    const size_t row = shape.back();
    for (size_t r = 0; r < v.size() / row; ++r) {
      bool nan = false;
      for (size_t i = 0; i < row; ++i) nan |= std::isnan(v[r * row + i]);
      EXPECT_TRUE(nan) << "row " << r << " has no NaN";
    }
  };
}

// Attend with scale 0 (or logits that all vanish): every query's output is
// the mean of its batch's value rows.
std::function<void(const std::string&)> ExpectMeanOfValues(
    const v1::AttendRequest& request) {
  const std::string values = request.value().raw_data();
  return [values](const std::string& bytes) {
    const std::vector<float> out = OutputValues<v1::AttendResponse>(bytes);
    ASSERT_EQ(out.size(), 2u * 3 * 4);
    std::vector<float> v(values.size() / sizeof(float));
    std::memcpy(v.data(), values.data(), values.size());
    for (int b = 0; b < 2; ++b) {
      for (int c = 0; c < 4; ++c) {
        float mean = 0;
        for (int j = 0; j < 5; ++j) mean += v[(b * 5 + j) * 4 + c] / 5;
        for (int i = 0; i < 3; ++i) {
          EXPECT_NEAR(out[(b * 3 + i) * 4 + c], mean, 1e-5)
              << "batch " << b << " query " << i << " column " << c;
        }
      }
    }
  };
}

std::vector<float> RawFloats(const v1::Tensor& t) {
  std::vector<float> v(t.raw_data().size() / sizeof(float));
  std::memcpy(v.data(), t.raw_data().data(), v.size() * sizeof(float));
  return v;
}

// Attend with a huge logit multiplier (AttendBase's shapes, no mask): each
// query attends only to the key of its largest logit, so its output is
// exactly that key's value row.
std::function<void(const std::string&)> ExpectHardAttention(
    const v1::AttendRequest& request) {
  const std::vector<float> q = RawFloats(request.query());
  const std::vector<float> k = RawFloats(request.key());
  const std::vector<float> v = RawFloats(request.value());
  return [q, k, v](const std::string& bytes) {
    const std::vector<float> out = OutputValues<v1::AttendResponse>(bytes);
    ASSERT_EQ(out.size(), 2u * 3 * 4);
    for (int b = 0; b < 2; ++b) {
      for (int i = 0; i < 3; ++i) {
        int best = 0;
        float best_dot = -std::numeric_limits<float>::infinity();
        for (int j = 0; j < 5; ++j) {
          float dot = 0;
          for (int c = 0; c < 8; ++c) {
            dot += q[(b * 3 + i) * 8 + c] * k[(b * 5 + j) * 8 + c];
          }
          if (dot > best_dot) best_dot = dot, best = j;
        }
        for (int c = 0; c < 4; ++c) {
          EXPECT_EQ(out[(b * 3 + i) * 4 + c], v[(b * 5 + best) * 4 + c])
              << "batch " << b << " query " << i << " column " << c;
        }
      }
    }
  };
}

// Every output row (the last dim) equals `row`, up to rounding.
template <typename Response>
std::function<void(const std::string&)> ExpectEveryRow(std::vector<float> row) {
  return [row](const std::string& bytes) {
    const std::vector<float> out = OutputValues<Response>(bytes);
    ASSERT_FALSE(out.empty());
    ASSERT_EQ(out.size() % row.size(), 0u);
    for (size_t i = 0; i < out.size(); ++i) {
      EXPECT_NEAR(out[i], row[i % row.size()], 1e-6) << "output[" << i << "]";
    }
  };
}

// ---------------------------------------------------------------------------
// Families: every tensor field times every corruption.

struct TensorField {
  std::function<std::unique_ptr<Message>()> base;
  std::vector<std::string> path;  // from the request
  std::string name() const { return path.back(); }
  std::string dotted() const { return absl::StrJoin(path, "."); }
};

template <typename Request>
std::function<std::unique_ptr<Message>()> Factory(Request (*make)()) {
  return [make] { return std::make_unique<Request>(make()); };
}

std::vector<TensorField> TensorFields() {
  std::vector<TensorField> fields;
  for (const char* name : {"query", "key", "value", "attn_mask"}) {
    fields.push_back({Factory(&AttendBase), {name}});
  }
  for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
    const bool fused = absl::StartsWith(field.name, "in_proj");
    fields.push_back({Factory(fused ? &MhaFusedBase : &MhaBase),
                      {"weights", std::string(field.name)}});
  }
  for (const char* name :
       {"query", "key", "value", "attn_mask", "key_padding_mask"}) {
    fields.push_back({Factory(&MhaBase), {name}});
  }
  for (const char* name : {"input", "gamma", "beta"}) {
    fields.push_back({Factory(&LayerNormBase), {name}});
  }
  for (const char* name : {"input", "gamma"}) {
    fields.push_back({Factory(&RmsNormBase), {name}});
  }
  fields.push_back({Factory(&SessionModelStepBase), {"input"}});
  for (const char* name : {"query", "key", "value"}) {
    fields.push_back({Factory(&SessionStepBase), {name}});
  }
  return fields;
}

// One corruption of one field: the mutated request and what to expect.
struct Mutation {
  std::string kind;
  std::function<void(v1::Tensor*)> mutate;
  Code code;
  std::string message;
};

// The corruptions of `t` (a valid tensor of `field`), with the answers.
std::vector<Mutation> Corruptions(const std::string& field,
                                  const v1::Tensor& t) {
  const int64_t n = Elements(t);
  const int size = ElementSize(t);
  const int64_t bytes = n * size;
  const std::string shape = ShapeText(t);
  const bool floating = t.dtype() == v1::DATA_TYPE_FLOAT32;
  const auto raw = [&](int64_t have) {
    return absl::StrCat(field, ": raw_data has ", have, " bytes, expected ",
                        bytes, " (shape ", shape, " x ", size, " bytes of ",
                        DTypeText(t), ")");
  };
  const std::string shm = absl::StrCat(field, ".shared_memory");
  const auto to_region = [](v1::Tensor* x, const std::string& region,
                            uint64_t offset, uint64_t byte_size) {
    x->clear_raw_data();
    v1::SharedMemoryRef* ref = x->mutable_shared_memory();
    ref->set_region(region);
    ref->set_offset(offset);
    ref->set_byte_size(byte_size);
  };
  std::vector<int64_t> negative(t.shape().begin(), t.shape().end());
  negative[0] = -1;
  const int64_t big = int64_t{1} << 32;
  const int64_t near_max = int64_t{1} << 62;
  const uint64_t beyond = kRegionBytes - bytes + size;
  const uint64_t past_2_64 = ~uint64_t{0} - size + 1;

  std::vector<Mutation> m = {
      {"dtype_unspecified",
       [](v1::Tensor* x) { x->set_dtype(v1::DATA_TYPE_UNSPECIFIED); },
       Code::kInvalidArgument,
       absl::StrCat(field,
                    ": dtype is DATA_TYPE_UNSPECIFIED, expected one of "
                    "DATA_TYPE_FLOAT32, DATA_TYPE_BFLOAT16, DATA_TYPE_FLOAT16, "
                    "DATA_TYPE_BOOL, DATA_TYPE_UINT8")},
      {"dtype_int8", [](v1::Tensor* x) { x->set_dtype(v1::DATA_TYPE_INT8); },
       Code::kInvalidArgument,
       absl::StrCat(field,
                    ": dtype DATA_TYPE_INT8 is a session cache dtype only "
                    "(CreateSessionRequest.dtype or cache_dtype), not a "
                    "tensor's")},
      {"dtype_999",
       [](v1::Tensor* x) { x->set_dtype(static_cast<v1::DataType>(999)); },
       Code::kInvalidArgument,
       absl::StrCat(field, ": dtype 999 is not a known DataType")},
      {"dtype_minus_1",
       [](v1::Tensor* x) { x->set_dtype(static_cast<v1::DataType>(-1)); },
       Code::kInvalidArgument,
       absl::StrCat(field, ": dtype -1 is not a known DataType")},
      {"raw_data_one_byte_short",
       [](v1::Tensor* x) { x->mutable_raw_data()->pop_back(); },
       Code::kInvalidArgument, raw(bytes - 1)},
      {"raw_data_one_byte_long",
       [](v1::Tensor* x) { x->mutable_raw_data()->push_back('\0'); },
       Code::kInvalidArgument, raw(bytes + 1)},
      {"raw_data_empty", [](v1::Tensor* x) { x->clear_raw_data(); },
       Code::kInvalidArgument, raw(0)},
      {"raw_data_and_float_data",
       [](v1::Tensor* x) { x->add_float_data(1.0f); }, Code::kInvalidArgument,
       absl::StrCat(field,
                    ": both raw_data and float_data are set, expected "
                    "exactly one")},
      {"float_data_on_bool",
       [n](v1::Tensor* x) {
         x->set_dtype(v1::DATA_TYPE_BOOL);
         x->clear_raw_data();
         for (int64_t i = 0; i < n; ++i) x->add_float_data(1.0f);
       },
       Code::kInvalidArgument,
       absl::StrCat(field,
                    ": float_data is only for DATA_TYPE_FLOAT32, dtype "
                    "is DATA_TYPE_BOOL")},
      {"negative_dim", [negative](v1::Tensor* x) { SetShape(x, negative); },
       Code::kInvalidArgument,
       absl::StrCat(field, ": dim 0 is negative (-1) in shape ",
                    ShapeText(negative))},
      {"elements_overflow_int64",
       [](v1::Tensor* x) {
         SetShape(x, {big, big, 16});
       },
       Code::kInvalidArgument,
       absl::StrCat(field,
                    ": shape [4294967296, 4294967296, 16] overflows "
                    "64-bit size")},
      {"shared_memory_unknown_region",
       [=](v1::Tensor* x) { to_region(x, "nope", 0, bytes); }, Code::kNotFound,
       absl::StrCat(shm,
                    ": shared memory region 'nope' is not registered "
                    "(RegisterSharedMemory first)")},
      {"shared_memory_region_10_kb",
       [=](v1::Tensor* x) { to_region(x, std::string(10240, 'r'), 0, bytes); },
       Code::kInvalidArgument,
       absl::StrCat(shm, ".region: must be 1 to 128 characters, got 10240")},
      {"shared_memory_region_slash",
       [=](v1::Tensor* x) { to_region(x, "../hostile", 0, bytes); },
       Code::kInvalidArgument,
       absl::StrCat(shm,
                    ".region: only letters, digits, '_', '-' and '.' are "
                    "allowed")},
      {"shared_memory_out_of_bounds",
       [=](v1::Tensor* x) { to_region(x, kRegion, beyond, bytes); },
       Code::kInvalidArgument,
       absl::StrCat(shm, ": shared memory offset ", beyond, " + byte_size ",
                    bytes, " exceeds region '", kRegion, "' of ", kRegionBytes,
                    " bytes")},
      {"shared_memory_offset_past_2_64",
       [=](v1::Tensor* x) { to_region(x, kRegion, past_2_64, bytes); },
       Code::kInvalidArgument,
       absl::StrCat(shm, ": shared memory offset ", past_2_64, " + byte_size ",
                    bytes, " exceeds region '", kRegion, "' of ", kRegionBytes,
                    " bytes")},
      {"shared_memory_byte_size_short",
       [=](v1::Tensor* x) { to_region(x, kRegion, 0, bytes - 1); },
       Code::kInvalidArgument,
       absl::StrCat(shm, ": shared_memory.byte_size is ", bytes - 1,
                    ", expected ", bytes, " bytes")},
      {"shared_memory_and_raw_data",
       [=](v1::Tensor* x) {
         const std::string keep = x->raw_data();
         to_region(x, kRegion, 0, bytes);
         x->set_raw_data(keep);
       },
       Code::kInvalidArgument,
       absl::StrCat(field,
                    ": both shared_memory and raw_data are set, "
                    "expected exactly one")},
  };
  if (floating) {
    m.push_back({"dim_2_62_bytes_overflow",
                 [](v1::Tensor* x) { SetShape(x, {near_max}); },
                 Code::kInvalidArgument,
                 absl::StrCat(field,
                              ": shape [4611686018427387904] overflows "
                              "64-bit size")});
    m.push_back({"shared_memory_misaligned",
                 [=](v1::Tensor* x) { to_region(x, kRegion, 2, bytes); },
                 Code::kInvalidArgument,
                 absl::StrCat(shm,
                              ": shared memory offset 2 in region 'hostile' "
                              "is not aligned to 4 bytes (the element size)")});
    m.push_back({"float_data_one_value_short",
                 [n](v1::Tensor* x) {
                   x->clear_raw_data();
                   for (int64_t i = 0; i + 1 < n; ++i) x->add_float_data(0.5f);
                 },
                 Code::kInvalidArgument,
                 absl::StrCat(field, ": float_data has ", n - 1,
                              " values, expected ", n, " for shape ", shape)});
  } else {
    // A BOOL mask of 2^62 elements is a valid shape, far above the limit.
    m.push_back({"dim_2_62_elements",
                 [](v1::Tensor* x) { SetShape(x, {near_max}); },
                 Code::kResourceExhausted,
                 absl::StrCat("request: a tensor of 4611686018427387904 "
                              "elements exceeds --max_tensor_elements ",
                              kMaxTensorElements)});
  }
  return m;
}

void AddFieldFamilies(std::vector<HostileCase>& cases) {
  for (const TensorField& field : TensorFields()) {
    const std::unique_ptr<Message> base = field.base();
    const v1::Tensor& valid =
        *static_cast<v1::Tensor*>(MutableAt(base.get(), field.path));
    for (const Mutation& m : Corruptions(field.name(), valid)) {
      std::unique_ptr<Message> request(base->New());
      request->CopyFrom(*base);
      m.mutate(static_cast<v1::Tensor*>(MutableAt(request.get(), field.path)));
      cases.push_back(Case(*request, absl::StrCat(field.name(), "_", m.kind),
                           field.dotted(), m.code, m.message));
    }
  }
}

// NaN in every data tensor propagates; NaN and +inf in FLOAT32 masks are
// refused.
void AddNonFiniteValues(std::vector<HostileCase>& cases) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (const TensorField& field : TensorFields()) {
    const std::unique_ptr<Message> base = field.base();
    v1::Tensor* t = static_cast<v1::Tensor*>(MutableAt(base.get(), field.path));
    if (t->dtype() != v1::DATA_TYPE_FLOAT32) continue;
    std::memcpy(t->mutable_raw_data()->data(), &nan, sizeof(float));
    const std::string rpc = RpcOf(*base);
    std::function<void(const std::string&)> check;
    // Data fields whose element 0 feeds batch 0 only; weights feed all.
    const bool per_batch = field.path.size() == 1 && field.name() != "gamma" &&
                           field.name() != "beta";
    if (rpc == "SessionStep") {
      // A query's NaN stays in its head's row; a key's, value's or hidden
      // state's reaches every row (each sees token 0).
      check = field.name() == "query"
                  ? ExpectFirstHalfNotFinite<v1::SessionStepResponse>()
                  : ExpectNanInEveryRow<v1::SessionStepResponse>();
    } else if (rpc == "Attend") {
      check = ExpectFirstHalfNotFinite<v1::AttendResponse>();
    } else if (rpc == "LayerNorm") {
      check = per_batch ? ExpectFirstHalfNotFinite<v1::LayerNormResponse>()
                        : ExpectNanInEveryRow<v1::LayerNormResponse>();
    } else if (rpc == "RmsNorm") {
      check = per_batch ? ExpectFirstHalfNotFinite<v1::RmsNormResponse>()
                        : ExpectNanInEveryRow<v1::RmsNormResponse>();
    } else {
      check = per_batch
                  ? ExpectFirstHalfNotFinite<v1::MultiHeadAttendResponse>()
                  : ExpectNanInEveryRow<v1::MultiHeadAttendResponse>();
    }
    cases.push_back(Pending(
        Ok(*base, absl::StrCat(field.name(), "_nan"), field.dotted(), check),
        kPendingNanPropagation));
  }
  // +inf: a value column of batch 0 becomes infinite; a LayerNorm row NaN.
  v1::AttendRequest attend = AttendBase();
  std::memcpy(attend.mutable_value()->mutable_raw_data()->data(), &inf, 4);
  cases.push_back(Pending(Ok(attend, "value_plus_inf", "value",
                             ExpectFirstHalfNotFinite<v1::AttendResponse>()),
                          kPendingNanPropagation));
  v1::LayerNormRequest ln = LayerNormBase();
  std::memcpy(ln.mutable_input()->mutable_raw_data()->data(), &inf, 4);
  cases.push_back(Pending(Ok(ln, "input_plus_inf", "input",
                             ExpectFirstHalfNotFinite<v1::LayerNormResponse>()),
                          kPendingNanPropagation));
  v1::MultiHeadAttendRequest mha = MhaBase();
  const float minus_inf = -inf;
  std::memcpy(mha.mutable_query()->mutable_raw_data()->data(), &minus_inf, 4);
  cases.push_back(
      Pending(Ok(mha, "query_minus_inf", "query",
                 ExpectFirstHalfNotFinite<v1::MultiHeadAttendResponse>()),
              kPendingNanPropagation));

  // FLOAT32 masks: NaN and +inf are refused at their flat index (-inf
  // excludes, finite values add).
  std::vector<float> mask(15, 0.0f);
  mask[12] = nan;
  std::vector<float> plus(15, 0.0f);
  plus[3] = inf;
  std::vector<float> minus(15, 0.0f);
  minus[3] = -inf;
  v1::AttendRequest a = AttendBase();
  *a.mutable_attn_mask() = FloatValues({3, 5}, mask);
  cases.push_back(Glob(Invalid(a, "attn_mask_float_nan", "attn_mask",
                               "attn_mask: * at flat index 12")));
  *a.mutable_attn_mask() = FloatValues({3, 5}, plus);
  cases.push_back(Glob(Invalid(a, "attn_mask_float_plus_inf", "attn_mask",
                               "attn_mask: * at flat index 3")));
  *a.mutable_attn_mask() = FloatValues({3, 5}, minus);
  cases.push_back(Ok(a, "attn_mask_float_minus_inf", "attn_mask",
                     ExpectFinite<v1::AttendResponse>()));
  v1::MultiHeadAttendRequest m = MhaBase();
  *m.mutable_attn_mask() = FloatValues({3, 5}, mask);
  cases.push_back(Glob(Invalid(m, "attn_mask_float_nan", "attn_mask",
                               "attn_mask: * at flat index 12")));
  m = MhaBase();
  std::vector<float> padding(10, 0.0f);
  padding[7] = inf;
  *m.mutable_key_padding_mask() = FloatValues({2, 5}, padding);
  cases.push_back(
      Glob(Invalid(m, "key_padding_mask_float_plus_inf", "key_padding_mask",
                   "key_padding_mask: * at flat index 7")));
  padding[7] = nan;
  *m.mutable_key_padding_mask() = FloatValues({2, 5}, padding);
  cases.push_back(
      Glob(Invalid(m, "key_padding_mask_float_nan", "key_padding_mask",
                   "key_padding_mask: * at flat index 7")));
}

// ---------------------------------------------------------------------------
// Cases written one by one.

void AddAttendCases(std::vector<HostileCase>& cases) {
  const v1::AttendRequest base = AttendBase();
  cases.push_back(Ok(base, "valid", "", ExpectFinite<v1::AttendResponse>()));
  for (const char* name : {"query", "key", "value"}) {
    v1::AttendRequest r = base;
    r.GetReflection()->ClearField(&r, r.GetDescriptor()->FindFieldByName(name));
    cases.push_back(Invalid(r, absl::StrCat(name, "_missing"), name,
                            absl::StrCat(name, ": missing")));
  }
  v1::AttendRequest r = base;
  r.clear_attn_mask();
  cases.push_back(Ok(r, "no_mask", "attn_mask"));

  r = base;
  *r.mutable_query() = RandomWireTensor(DType::kFloat16, {2, 3, 8}, 1);
  *r.mutable_key() = RandomWireTensor(DType::kFloat16, {2, 5, 8}, 2);
  *r.mutable_value() = RandomWireTensor(DType::kFloat16, {2, 5, 4}, 3);
  cases.push_back(Ok(r, "float16", "query"));
  r = base;
  *r.mutable_query() = RandomWireTensor(DType::kBool, {2, 3, 8}, 1);
  cases.push_back(Invalid(r, "query_dtype_bool", "query",
                          "query: dtype BOOL not supported, expected FLOAT32 "
                          "or BFLOAT16 or FLOAT16"));
  r = base;
  *r.mutable_key() = RandomWireTensor(DType::kFloat16, {2, 5, 8}, 2);
  cases.push_back(Invalid(r, "key_dtype_differs", "key",
                          "key: dtype FLOAT16 != query dtype FLOAT32"));
  r = base;
  *r.mutable_value() = RandomWireTensor(DType::kBFloat16, {2, 5, 4}, 3);
  cases.push_back(Invalid(r, "value_dtype_differs", "value",
                          "value: dtype BFLOAT16 != query dtype FLOAT32"));

  // Ranks and dims.
  r = base;
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {8}, 1);
  cases.push_back(Invalid(r, "query_rank_1", "query",
                          "query: rank 1 (shape [8]), expected rank >= 2"));
  r = base;
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {}, 1);
  cases.push_back(Invalid(r, "query_scalar", "query",
                          "query: rank 0 (shape []), expected rank >= 2"));
  r = base;
  *r.mutable_key() = RandomWireTensor(DType::kFloat32, {5, 8}, 2);
  cases.push_back(
      Invalid(r, "key_rank_2", "key",
              "key: rank 2 != query rank 3 (shapes [5, 8] and [2, 3, 8])"));
  r = base;
  *r.mutable_value() = RandomWireTensor(DType::kFloat32, {1, 2, 5, 4}, 3);
  cases.push_back(Invalid(
      r, "value_rank_4", "value",
      "value: rank 4 != query rank 3 (shapes [1, 2, 5, 4] and [2, 3, 8])"));
  r = base;
  *r.mutable_key() = RandomWireTensor(DType::kFloat32, {3, 5, 8}, 2);
  cases.push_back(
      Invalid(r, "key_leading_dim", "key", "key: dim 0 3 != query dim 0 2"));
  r = base;
  *r.mutable_value() = RandomWireTensor(DType::kFloat32, {1, 5, 4}, 3);
  cases.push_back(Invalid(r, "value_leading_dim", "value",
                          "value: dim 0 1 != query dim 0 2"));
  r = base;
  *r.mutable_key() = RandomWireTensor(DType::kFloat32, {2, 5, 6}, 2);
  cases.push_back(
      Invalid(r, "key_last_dim", "key", "key: last dim 6 != query last dim 8"));
  r = base;
  *r.mutable_value() = RandomWireTensor(DType::kFloat32, {2, 4, 4}, 3);
  cases.push_back(
      Invalid(r, "value_length", "value", "value: dim 1 4 != key dim 1 5"));
  // 65 dims: more than any tensor may have.
  r = base;
  {
    std::vector<int64_t> shape(63, 1);
    shape.push_back(3);
    shape.push_back(8);
    SetShape(r.mutable_query(), shape);
    cases.push_back(Invalid(r, "query_rank_65", "query",
                            "query: rank 65, expected at most 64 dims"));
  }
  r = base;
  {
    // A million dims: the message must not echo them.
    std::vector<int64_t> shape(1000000, 1);
    SetShape(r.mutable_key(), shape);
    cases.push_back(Invalid(r, "key_rank_1000000", "key",
                            "key: rank 1000000, expected at most 64 dims"));
  }
  r = base;
  {
    // 64 dims are fine (batch dims of 1).
    std::vector<int64_t> q(62, 1), k(62, 1), v(62, 1);
    q.insert(q.end(), {3, 8});
    k.insert(k.end(), {5, 8});
    v.insert(v.end(), {5, 4});
    SetShape(r.mutable_query(), q);
    SetShape(r.mutable_key(), k);
    SetShape(r.mutable_value(), v);
    r.mutable_query()->set_raw_data(r.query().raw_data().substr(0, 96));
    r.mutable_key()->set_raw_data(r.key().raw_data().substr(0, 160));
    r.mutable_value()->set_raw_data(r.value().raw_data().substr(0, 80));
    r.clear_attn_mask();
    cases.push_back(Ok(r, "rank_64", "query"));
  }

  // Masks.
  r = base;
  *r.mutable_attn_mask() = KeepAll({3, 4});
  cases.push_back(Invalid(r, "attn_mask_shape", "attn_mask",
                          "attn_mask: shape [3, 4] does not broadcast to "
                          "[2, 3, 5] (dim 1 is 4, expected 1 or 5)"));
  r = base;
  *r.mutable_attn_mask() = KeepAll({1, 2, 3, 5});
  cases.push_back(Invalid(r, "attn_mask_rank", "attn_mask",
                          "attn_mask: rank 4 (shape [1, 2, 3, 5]) exceeds the "
                          "rank of the logits [2, 3, 5]"));
  r = base;
  *r.mutable_attn_mask() = RandomWireTensor(DType::kFloat16, {3, 5}, 4);
  cases.push_back(Invalid(r, "attn_mask_float16", "attn_mask",
                          "attn_mask: dtype FLOAT16 not supported, expected "
                          "BOOL or UINT8 or FLOAT32"));
  r = base;
  *r.mutable_attn_mask() = RandomWireTensor(DType::kBFloat16, {3, 5}, 4);
  cases.push_back(Invalid(r, "attn_mask_bfloat16", "attn_mask",
                          "attn_mask: dtype BFLOAT16 not supported, expected "
                          "BOOL or UINT8 or FLOAT32"));
  r = base;
  *r.mutable_attn_mask() = KeepAll({});
  cases.push_back(Ok(r, "attn_mask_scalar_broadcasts", "attn_mask"));
  r = base;
  r.mutable_attn_mask()->set_raw_data(std::string(15, '\xff'));
  cases.push_back(Ok(r, "attn_mask_bool_0xff_keeps", "attn_mask",
                     ExpectFinite<v1::AttendResponse>()));
  r = base;
  r.mutable_attn_mask()->set_dtype(v1::DATA_TYPE_UINT8);
  r.mutable_attn_mask()->set_raw_data(std::string(15, '\0'));
  // Nothing kept: zeros, never NaN.
  cases.push_back(Ok(r, "attn_mask_uint8_excludes_all", "attn_mask",
                     ExpectFinite<v1::AttendResponse>()));

  // scale and temperature.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  v1::AttendRequest plain = base;
  plain.clear_attn_mask();
  const struct {
    const char* name;
    float value;
    const char* text;
  } non_finite[] = {
      {"nan", nan, "nan"}, {"inf", inf, "inf"}, {"minus_inf", -inf, "-inf"}};
  for (const auto& v : non_finite) {
    r = plain;
    r.set_scale(v.value);
    cases.push_back(
        Invalid(r, absl::StrCat("scale_", v.name), "scale",
                absl::StrCat("scale: must be finite, got ", v.text)));
    r = plain;
    r.set_temperature(v.value);
    cases.push_back(Invalid(
        r, absl::StrCat("temperature_", v.name), "temperature",
        absl::StrCat("temperature: must be finite and > 0, got ", v.text)));
  }
  r = plain;
  r.set_temperature(0.0f);
  cases.push_back(Invalid(r, "temperature_0", "temperature",
                          "temperature: must be finite and > 0, got 0"));
  r = plain;
  r.set_temperature(-0.0f);
  cases.push_back(Invalid(r, "temperature_minus_0", "temperature",
                          "temperature: must be finite and > 0, got -0"));
  r = plain;
  r.set_temperature(-2.0f);
  cases.push_back(Invalid(r, "temperature_negative", "temperature",
                          "temperature: must be finite and > 0, got -2"));
  // Well defined and finite: uniform attention, or attention reversed.
  r = plain;
  r.set_scale(0.0f);
  cases.push_back(Ok(r, "scale_0_uniform", "scale", ExpectMeanOfValues(r)));
  r = plain;
  r.set_scale(-1.0f);
  cases.push_back(
      Ok(r, "scale_negative", "scale", ExpectFinite<v1::AttendResponse>()));
  // Logits below 1e-37 in magnitude: uniform as well.
  r = plain;
  r.set_temperature(1e38f);
  cases.push_back(
      Ok(r, "temperature_1e38_uniform", "temperature", ExpectMeanOfValues(r)));
  r = plain;
  r.set_scale(1e-38f);
  cases.push_back(Ok(r, "scale_1e_38_uniform", "scale", ExpectMeanOfValues(r)));
  // Multipliers up to ~1e38 on logits of at most 8 in magnitude: finite
  // logits, one-hot attention (as the limit of a vanishing temperature).
  r = plain;
  r.set_temperature(1e-38f);
  cases.push_back(Ok(r, "temperature_1e_38_one_hot", "temperature",
                     ExpectHardAttention(r)));
  r = plain;
  r.set_temperature(1e-20f);
  cases.push_back(Ok(r, "temperature_1e_20_one_hot", "temperature",
                     ExpectHardAttention(r)));
  r = plain;
  r.set_scale(1e38f);
  cases.push_back(Ok(r, "scale_1e38_one_hot", "scale", ExpectHardAttention(r)));
  // scale / temperature overflows float32: no logit could be finite.
  r = plain;
  r.set_scale(1e38f);
  r.set_temperature(1e-38f);
  cases.push_back(Invalid(
      r, "multiplier_overflows", "temperature",
      "temperature: scale 1e+38 / temperature 1e-38 overflows float32"));
  r = plain;
  r.set_temperature(1e-45f);
  cases.push_back(
      Invalid(r, "temperature_denormal_min", "temperature",
              "temperature: scale 0.353553 / temperature 1.4013e-45 overflows "
              "float32"));

  // Results in shared memory.
  r = base;
  r.mutable_result_regions()->mutable_output()->set_region("nope");
  r.mutable_result_regions()->mutable_output()->set_byte_size(96);
  cases.push_back(Case(r, "result_output_unknown_region",
                       "result_regions.output", Code::kNotFound,
                       "result_regions.output: shared memory region 'nope' "
                       "is not registered (RegisterSharedMemory first)"));
  r = base;
  r.mutable_result_regions()->mutable_output()->set_region(kRegion);
  r.mutable_result_regions()->mutable_output()->set_byte_size(95);
  cases.push_back(Invalid(r, "result_output_too_small", "result_regions.output",
                          "result_regions.output: shared_memory.byte_size is "
                          "95, needs at least 96 bytes"));
  r = base;
  r.mutable_result_regions()->mutable_output()->set_region(kRegion);
  r.mutable_result_regions()->mutable_output()->set_offset(4064);
  r.mutable_result_regions()->mutable_output()->set_byte_size(96);
  cases.push_back(
      Invalid(r, "result_output_out_of_bounds", "result_regions.output",
              "result_regions.output: shared memory offset 4064 + "
              "byte_size 96 exceeds region 'hostile' of 4096 bytes"));
  r = base;
  r.mutable_result_regions()->mutable_output()->set_region(kRegion);
  r.mutable_result_regions()->mutable_output()->set_offset(6);
  r.mutable_result_regions()->mutable_output()->set_byte_size(96);
  cases.push_back(Invalid(r, "result_output_misaligned",
                          "result_regions.output",
                          "result_regions.output: shared memory offset 6 in "
                          "region 'hostile' is not aligned to 4 bytes (the "
                          "element size)"));
  r = base;
  r.set_return_weights(true);
  r.mutable_result_regions()->mutable_weights()->set_region("nope");
  r.mutable_result_regions()->mutable_weights()->set_byte_size(120);
  cases.push_back(Case(r, "result_weights_unknown_region",
                       "result_regions.weights", Code::kNotFound,
                       "result_regions.weights: shared memory region 'nope' "
                       "is not registered (RegisterSharedMemory first)"));
  r = base;
  r.mutable_result_regions()->mutable_output()->set_region(kRegion);
  r.mutable_result_regions()->mutable_output()->set_offset(1024);
  r.mutable_result_regions()->mutable_output()->set_byte_size(96);
  cases.push_back(Ok(r, "result_output_in_region", "result_regions.output"));
  {
    // A tensor read from the region (whatever bytes it holds).
    r = base;
    r.mutable_query()->clear_raw_data();
    v1::SharedMemoryRef* ref = r.mutable_query()->mutable_shared_memory();
    ref->set_region(kRegion);
    ref->set_offset(0);
    ref->set_byte_size(192);
    cases.push_back(Ok(r, "query_in_region", "query.shared_memory"));
  }

  // Limits.
  r = base;
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {1, 4096, 2}, 1);
  *r.mutable_key() = RandomWireTensor(DType::kFloat32, {1, 4096, 2}, 2);
  *r.mutable_value() = RandomWireTensor(DType::kFloat32, {1, 4096, 2}, 3);
  r.clear_attn_mask();
  r.set_return_weights(true);
  cases.push_back(Case(r, "weights_above_memory_limit", "return_weights",
                       Code::kResourceExhausted,
                       absl::StrCat("request: needs about 64 MiB for results "
                                    "and intermediates, above "
                                    "--max_request_memory_mb ",
                                    kMaxRequestMemoryMb)));
  r = base;
  SetShape(r.mutable_key(), {2, 1 << 20, 8});
  cases.push_back(Case(r, "key_above_element_limit", "key",
                       Code::kResourceExhausted,
                       "request: a tensor of 16777216 elements exceeds "
                       "--max_tensor_elements 1048576"));

  // Oddly formed but valid bytes.
  HostileCase unknown =
      Ok(base, "unknown_field", "", ExpectFinite<v1::AttendResponse>());
  unknown.request += UnknownField();
  cases.push_back(unknown);
  {
    // An unknown field inside a tensor.
    v1::AttendRequest q = base;
    v1::Tensor query = q.query();
    q.clear_query();
    HostileCase nested = Ok(q, "unknown_field_in_tensor", "query");
    nested.request += LengthDelimited(
        1, query.SerializeAsString() + Varint((15 << 3) | 0) + Varint(7));
    cases.push_back(nested);
  }
  {
    // Shape sent unpacked (one varint per dim), which parsers must accept.
    v1::AttendRequest q = base;
    v1::Tensor query = q.query();
    query.clear_shape();
    q.clear_query();
    std::string unpacked;
    for (int64_t d : {2, 3, 8}) unpacked += Varint((2 << 3) | 0) + Varint(d);
    HostileCase c = Ok(q, "shape_unpacked", "query",
                       ExpectShape<v1::AttendResponse>({2, 3, 4}));
    c.request += LengthDelimited(1, query.SerializeAsString() + unpacked);
    cases.push_back(c);
  }
  {
    // dtype sent twice: the last one counts.
    v1::AttendRequest q = base;
    HostileCase c = Ok(q, "dtype_twice_last_wins", "query");
    v1::Tensor first;
    first.set_dtype(v1::DATA_TYPE_BOOL);
    c.request = LengthDelimited(1, first.SerializeAsString()) + c.request;
    cases.push_back(c);
  }

  // Bytes that are no AttendRequest.
  for (const auto& [name, bytes] :
       std::vector<std::pair<std::string, std::string>>{
           {"bytes_invalid_wire_type", "\x0f"},
           {"bytes_truncated_length", std::string("\x0a\x05"
                                                  "ab",
                                                  4)},
           {"bytes_truncated_request",
            base.SerializeAsString().substr(0, base.ByteSizeLong() / 2)},
           {"bytes_overlong_varint", std::string(11, '\xff')}}) {
    HostileCase c = Invalid(base, name, "", "");
    c.request = bytes;
    c.message = absl::StrCat("request: could not parse ", bytes.size(),
                             " bytes as attnserve.v1.AttendRequest");
    cases.push_back(Pending(c, kPendingParseErrors));
  }
  {
    // A known field with another wire type is an unknown field (protobuf).
    v1::AttendRequest q = base;
    q.clear_query();
    HostileCase c = Invalid(q, "query_as_varint", "query", "query: missing");
    c.request = Varint((1 << 3) | 0) + Varint(3) + c.request;
    cases.push_back(c);
  }
  {
    HostileCase c = Case(base, "message_above_limit", "",
                         Code::kResourceExhausted, "*larger than max*");
    v1::LayerNormRequest big;
    *big.mutable_input() =
        RandomWireTensor(DType::kFloat32, {(kMaxMessageMb << 20) / 4 + 16}, 5);
    c.rpc = "LayerNorm";
    c.request = big.SerializeAsString();
    cases.push_back(Glob(c));
  }
}

void AddMultiHeadCases(std::vector<HostileCase>& cases) {
  const v1::MultiHeadAttendRequest base = MhaBase();
  const v1::MultiHeadAttendRequest fused = MhaFusedBase();
  cases.push_back(Ok(base, "valid_separate", "",
                     ExpectShape<v1::MultiHeadAttendResponse>({2, 3, 5})));
  cases.push_back(Ok(fused, "valid_fused", "",
                     ExpectShape<v1::MultiHeadAttendResponse>({2, 3, 8})));
  cases.push_back(Ok(MhaModelBase(), "valid_model", "model",
                     ExpectShape<v1::MultiHeadAttendResponse>({2, 3, 8})));

  v1::MultiHeadAttendRequest r = base;
  r.clear_weights();
  cases.push_back(Invalid(r, "no_weights_source", "weights",
                          "weights: missing, expected either `model` or "
                          "`weights`"));
  r = base;
  r.clear_query();
  cases.push_back(Invalid(r, "query_missing", "query", "query: missing"));

  // num_heads.
  for (const auto& [name, heads] : std::vector<std::pair<std::string, int>>{
           {"num_heads_0", 0},
           {"num_heads_minus_1", -1},
           {"num_heads_int_min", std::numeric_limits<int>::min()}}) {
    r = base;
    r.mutable_weights()->set_num_heads(heads);
    cases.push_back(
        Invalid(r, name, "weights.num_heads",
                absl::StrCat("num_heads: must be > 0, got ", heads)));
  }
  r = base;
  r.mutable_weights()->set_num_heads(3);
  cases.push_back(Invalid(r, "num_heads_not_dividing", "weights.num_heads",
                          "q_proj_weight: dim 0 (8) is not divisible by "
                          "num_heads 3"));
  r = base;
  r.mutable_weights()->set_num_heads(std::numeric_limits<int>::max());
  cases.push_back(Invalid(r, "num_heads_int_max", "weights.num_heads",
                          "q_proj_weight: dim 0 (8) is not divisible by "
                          "num_heads 2147483647"));
  // Its cost must not be estimated from 2^31 heads of weights.
  r.set_return_weights(true);
  cases.push_back(Invalid(r, "num_heads_int_max_return_weights",
                          "weights.num_heads",
                          "q_proj_weight: dim 0 (8) is not divisible by "
                          "num_heads 2147483647"));
  r = fused;
  r.mutable_weights()->set_num_heads(3);
  cases.push_back(Invalid(r, "num_heads_not_dividing_fused",
                          "weights.num_heads",
                          "in_proj_weight: embed dim (dim 1) 8 is not "
                          "divisible by num_heads 3"));
  r = fused;
  r.mutable_weights()->set_num_heads(8);
  cases.push_back(Ok(r, "num_heads_equal_to_embed", "weights.num_heads"));

  // Weight sources that conflict.
  r = base;
  *r.mutable_weights()->mutable_in_proj_weight() =
      RandomWireTensor(DType::kFloat32, {24, 8}, 31);
  cases.push_back(
      Invalid(r, "in_proj_and_separate_weights", "weights.in_proj_weight",
              "in_proj_weight: give either in_proj_weight or "
              "q_proj_weight/k_proj_weight/v_proj_weight, not both"));
  r = base;
  *r.mutable_weights()->mutable_in_proj_bias() =
      RandomWireTensor(DType::kFloat32, {22}, 32);
  cases.push_back(Invalid(r, "in_proj_bias_and_separate_biases",
                          "weights.in_proj_bias",
                          "in_proj_bias: give either in_proj_bias or "
                          "q_proj_bias/k_proj_bias/v_proj_bias, not both"));
  r = fused;
  *r.mutable_weights()->mutable_k_proj_bias() =
      RandomWireTensor(DType::kFloat32, {8}, 15);
  cases.push_back(Invalid(r, "separate_bias_with_in_proj",
                          "weights.k_proj_bias",
                          "k_proj_bias: with in_proj_weight, give the bias as "
                          "in_proj_bias"));
  {
    // `weights` then `model` on the wire: one oneof, the last member wins
    // (protobuf); the model's output is [2, 3, 8], the inline one's [2, 3, 5].
    v1::AttentionWeights self_attention = fused.weights();
    *self_attention.mutable_out_proj_weight() =
        RandomWireTensor(DType::kFloat32, {5, 8}, 33);
    v1::MultiHeadAttendRequest inline_weights = MhaModelBase();
    *inline_weights.mutable_weights() = self_attention;
    HostileCase c = Ok(inline_weights, "weights_then_model_uses_model", "model",
                       ExpectShape<v1::MultiHeadAttendResponse>({2, 3, 8}));
    c.request += LengthDelimited(1, kModel);
    cases.push_back(c);
    v1::MultiHeadAttendRequest model = MhaModelBase();
    HostileCase d = Ok(model, "model_then_weights_uses_weights", "weights",
                       ExpectShape<v1::MultiHeadAttendResponse>({2, 3, 5}));
    d.request += LengthDelimited(2, self_attention.SerializeAsString());
    cases.push_back(d);
  }

  // Projection shapes.
  r = base;
  r.mutable_weights()->clear_k_proj_weight();
  cases.push_back(Invalid(r, "k_proj_weight_missing", "weights.k_proj_weight",
                          "k_proj_weight: missing (give q_proj_weight, "
                          "k_proj_weight and v_proj_weight, or "
                          "in_proj_weight)"));
  r = base;
  *r.mutable_weights()->mutable_q_proj_weight() =
      RandomWireTensor(DType::kFloat32, {2, 4, 8}, 11);
  cases.push_back(Invalid(r, "q_proj_weight_rank_3", "weights.q_proj_weight",
                          "q_proj_weight: rank 3 (shape [2, 4, 8]), expected "
                          "rank 2"));
  r = base;
  *r.mutable_weights()->mutable_k_proj_weight() =
      RandomWireTensor(DType::kFloat32, {6, 6}, 12);
  *r.mutable_weights()->mutable_k_proj_bias() =
      RandomWireTensor(DType::kFloat32, {6}, 15);
  cases.push_back(Invalid(r, "k_proj_weight_rows", "weights.k_proj_weight",
                          "k_proj_weight: dim 0 6 != q_proj_weight dim 0 8"));
  r = base;
  *r.mutable_weights()->mutable_v_proj_weight() =
      RandomWireTensor(DType::kBool, {6, 4}, 13);
  cases.push_back(Invalid(r, "v_proj_weight_bool", "weights.v_proj_weight",
                          "v_proj_weight: dtype BOOL not supported, expected "
                          "FLOAT32 or BFLOAT16 or FLOAT16"));
  r = base;
  *r.mutable_weights()->mutable_out_proj_weight() =
      RandomWireTensor(DType::kFloat32, {5, 7}, 17);
  cases.push_back(Invalid(r, "out_proj_weight_columns",
                          "weights.out_proj_weight",
                          "out_proj_weight: dim 1 7 != v_proj_weight rows "
                          "(H*dv) = 6"));
  r = fused;
  *r.mutable_weights()->mutable_in_proj_weight() =
      RandomWireTensor(DType::kFloat32, {25, 8}, 31);
  cases.push_back(Invalid(r, "in_proj_weight_rows", "weights.in_proj_weight",
                          "in_proj_weight: dim 0 25 != 3 x dim 1 = 24"));
  r = fused;
  *r.mutable_weights()->mutable_in_proj_weight() =
      RandomWireTensor(DType::kFloat32, {24}, 31);
  cases.push_back(Invalid(r, "in_proj_weight_rank_1", "weights.in_proj_weight",
                          "in_proj_weight: rank 1 (shape [24]), expected rank "
                          "2"));

  // Bias lengths.
  const struct {
    const char* field;
    std::vector<int64_t> shape;
    const char* expected;
    bool fused;
  } biases[] = {
      {"q_proj_bias", {7}, "[8]", false},
      {"k_proj_bias", {9}, "[8]", false},
      {"v_proj_bias", {5}, "[6]", false},
      {"q_proj_bias", {1, 8}, "[8]", false},
      {"out_proj_bias", {4}, "[5]", false},
      {"in_proj_bias", {23}, "[24]", true},
      {"in_proj_bias", {}, "[24]", true},
  };
  for (const auto& b : biases) {
    r = b.fused ? fused : base;
    *static_cast<v1::Tensor*>(MutableAt(&r, {"weights", b.field})) =
        RandomWireTensor(DType::kFloat32, b.shape, 9);
    cases.push_back(Invalid(
        r, absl::StrCat(b.field, "_shape_", absl::StrJoin(b.shape, "x")),
        absl::StrCat("weights.", b.field),
        absl::StrCat(b.field, ": shape ", ShapeText(b.shape), ", expected ",
                     b.expected)));
  }
  r = base;
  r.mutable_weights()->clear_q_proj_bias();
  r.mutable_weights()->clear_k_proj_bias();
  r.mutable_weights()->clear_v_proj_bias();
  *r.mutable_weights()->mutable_in_proj_bias() =
      RandomWireTensor(DType::kFloat32, {20}, 32);
  cases.push_back(Invalid(r, "in_proj_bias_shared_length",
                          "weights.in_proj_bias",
                          "in_proj_bias: shape [20], expected [22]"));
  r = base;
  r.mutable_weights()->clear_out_proj_weight();
  cases.push_back(Invalid(r, "out_proj_bias_without_weight",
                          "weights.out_proj_bias",
                          "out_proj_bias: given without out_proj_weight"));
  r = base;
  *r.mutable_weights()->mutable_q_proj_bias() =
      RandomWireTensor(DType::kUInt8, {8}, 14);
  cases.push_back(Invalid(r, "q_proj_bias_uint8", "weights.q_proj_bias",
                          "q_proj_bias: dtype UINT8 not supported, expected "
                          "FLOAT32 or BFLOAT16 or FLOAT16"));

  // Inputs.
  r = base;
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {2, 3, 7}, 19);
  cases.push_back(Invalid(r, "query_width", "query",
                          "query: last dim 7 != q_proj_weight dim 1 8"));
  r = base;
  *r.mutable_key() = RandomWireTensor(DType::kFloat32, {2, 5, 5}, 20);
  cases.push_back(Invalid(r, "key_width", "key",
                          "key: last dim 5 != k_proj_weight dim 1 6"));
  r = base;
  r.clear_value();
  cases.push_back(Invalid(r, "value_defaults_to_key", "value",
                          "value: last dim 6 != v_proj_weight dim 1 4"));
  r = base;
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {1, 2, 3, 8}, 19);
  cases.push_back(Invalid(r, "query_rank_4", "query",
                          "query: rank 4 (shape [1, 2, 3, 8]), expected rank "
                          "2 to 3"));
  r = base;
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {8}, 19);
  cases.push_back(Invalid(r, "query_rank_1", "query",
                          "query: rank 1 (shape [8]), expected rank 2 to 3"));
  r = base;
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {3, 8}, 19);
  cases.push_back(Invalid(r, "query_unbatched_key_batched", "key",
                          "key: rank 3 != query rank 2 (shapes [2, 5, 6] and "
                          "[3, 8])"));
  r = base;
  *r.mutable_key() = RandomWireTensor(DType::kFloat32, {3, 5, 6}, 20);
  cases.push_back(
      Invalid(r, "key_batch", "key", "key: dim 0 3 != query dim 0 2"));
  r = base;
  *r.mutable_value() = RandomWireTensor(DType::kFloat32, {2, 4, 4}, 21);
  cases.push_back(
      Invalid(r, "value_length", "value", "value: dim 1 4 != key dim 1 5"));
  r = base;
  *r.mutable_key() = RandomWireTensor(DType::kFloat16, {2, 5, 6}, 20);
  cases.push_back(Invalid(r, "key_dtype_differs", "key",
                          "key: dtype FLOAT16 != query dtype FLOAT32"));
  r = base;
  *r.mutable_query() = RandomWireTensor(DType::kUInt8, {2, 3, 8}, 19);
  cases.push_back(Invalid(r, "query_uint8", "query",
                          "query: dtype UINT8 not supported, expected FLOAT32 "
                          "or BFLOAT16 or FLOAT16"));
  r = base;
  *r.mutable_attn_mask() = KeepAll({3, 4});
  cases.push_back(Invalid(r, "attn_mask_shape", "attn_mask",
                          "attn_mask: shape [3, 4], expected [3, 5], "
                          "[2, 3, 5] or [2, 2, 3, 5]"));
  r = base;
  *r.mutable_attn_mask() = KeepAll({2, 2, 3, 5});
  cases.push_back(Ok(r, "attn_mask_per_head", "attn_mask"));
  r = base;
  *r.mutable_key_padding_mask() = KeepAll({2, 4});
  cases.push_back(Invalid(r, "key_padding_mask_shape", "key_padding_mask",
                          "key_padding_mask: shape [2, 4], expected [2, 5]"));
  r = base;
  *r.mutable_key_padding_mask() = RandomWireTensor(DType::kFloat16, {2, 5}, 4);
  cases.push_back(Invalid(r, "key_padding_mask_float16", "key_padding_mask",
                          "key_padding_mask: dtype FLOAT16 not supported, "
                          "expected BOOL or UINT8 or FLOAT32"));
  r = base;
  r.mutable_key_padding_mask()->set_raw_data(std::string(10, '\0'));
  cases.push_back(Ok(r, "key_padding_mask_excludes_all", "key_padding_mask",
                     ExpectFinite<v1::MultiHeadAttendResponse>()));

  // scale and temperature.
  r = base;
  r.set_scale(std::numeric_limits<float>::quiet_NaN());
  cases.push_back(
      Invalid(r, "scale_nan", "scale", "scale: must be finite, got nan"));
  r = base;
  r.set_temperature(0.0f);
  cases.push_back(Invalid(r, "temperature_0", "temperature",
                          "temperature: must be finite and > 0, got 0"));
  r = base;
  r.set_temperature(-std::numeric_limits<float>::infinity());
  cases.push_back(Invalid(r, "temperature_minus_inf", "temperature",
                          "temperature: must be finite and > 0, got -inf"));
  r = base;
  r.set_scale(0.0f);
  cases.push_back(
      Ok(r, "scale_0", "scale", ExpectFinite<v1::MultiHeadAttendResponse>()));
  r = base;
  r.set_temperature(1e38f);
  cases.push_back(Ok(r, "temperature_1e38", "temperature",
                     ExpectFinite<v1::MultiHeadAttendResponse>()));
  r = base;
  r.set_scale(3e38f);
  r.set_temperature(0.5f);
  cases.push_back(
      Invalid(r, "multiplier_overflows", "temperature",
              "temperature: scale 3e+38 / temperature 0.5 overflows float32"));
  r = MhaModelBase();
  r.set_temperature(std::numeric_limits<float>::quiet_NaN());
  cases.push_back(Invalid(r, "model_temperature_nan", "temperature",
                          "temperature: must be finite and > 0, got nan"));

  // Models.
  r = MhaModelBase();
  r.set_model("nope");
  cases.push_back(Case(r, "model_unknown", "model", Code::kNotFound,
                       "model: 'nope' not found; loaded models: demo"));
  r.set_model("");
  cases.push_back(Invalid(r, "model_empty", "model",
                          "model: empty, expected the name of a loaded model "
                          "(ListModels)"));
  r.set_model(std::string(10240, 'a'));
  cases.push_back(Invalid(r, "model_10_kb", "model",
                          "model: 10240 bytes, longer than the 255 a model "
                          "name may have"));
  r.set_model(std::string(256, 'a'));
  cases.push_back(Invalid(r, "model_256_bytes", "model",
                          "model: 256 bytes, longer than the 255 a model "
                          "name may have"));
  r.set_model(std::string(255, 'a'));
  // Echoed up to 128 bytes, with its length.
  cases.push_back(Case(r, "model_255_bytes", "model", Code::kNotFound,
                       absl::StrCat("model: '", std::string(128, 'a'),
                                    "'... (255 bytes) not found; loaded "
                                    "models: demo")));
  r.set_model("../demo");
  cases.push_back(Invalid(r, "model_dot_dot_slash", "model",
                          "model: '../demo' contains '/'; a model name is the "
                          "name of a folder in the model repository"));
  r.set_model("..");
  cases.push_back(Invalid(r, "model_dot_dot", "model",
                          "model: '..' is not the name of a folder in the "
                          "model repository"));
  r.set_model("/etc/passwd");
  cases.push_back(Invalid(r, "model_absolute_path", "model",
                          "model: '/etc/passwd' contains '/'; a model name is "
                          "the name of a folder in the model repository"));
  r.set_model(std::string("de\0mo", 5));
  cases.push_back(Invalid(r, "model_nul_byte", "model",
                          "model: 'de\\000mo' contains a NUL byte"));
  r.set_model("demo");
  r.set_compute_bf16(true);  // a model's compute dtype is its own
  cases.push_back(Ok(r, "model_with_compute_bf16", "model"));
  r = MhaModelBase();
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {2, 3, 6}, 41);
  cases.push_back(Invalid(r, "model_query_width", "query",
                          "query: last dim 6 != in_proj_weight dim 1 8"));
  {
    // Not UTF-8: no string of a proto3 message.
    HostileCase c = Invalid(MhaModelBase(), "model_not_utf8", "model", "");
    v1::MultiHeadAttendRequest q = MhaModelBase();
    q.clear_model();
    c.request = q.SerializeAsString() + LengthDelimited(1, "\xff\xfe");
    c.message = absl::StrCat("request: could not parse ", c.request.size(),
                             " bytes as attnserve.v1.MultiHeadAttendRequest");
    cases.push_back(Pending(c, kPendingParseErrors));
  }

  // Results in shared memory.
  r = base;
  r.set_return_weights(true);
  r.mutable_result_regions()->mutable_weights()->set_region(kRegion);
  r.mutable_result_regions()->mutable_weights()->set_byte_size(4);
  cases.push_back(Invalid(r, "result_weights_too_small",
                          "result_regions.weights",
                          "result_regions.weights: shared_memory.byte_size is "
                          "4, needs at least 240 bytes"));
  r = base;
  r.mutable_result_regions()->mutable_output()->set_region("nope");
  r.mutable_result_regions()->mutable_output()->set_byte_size(120);
  cases.push_back(Case(r, "result_output_unknown_region",
                       "result_regions.output", Code::kNotFound,
                       "result_regions.output: shared memory region 'nope' "
                       "is not registered (RegisterSharedMemory first)"));

  HostileCase unknown = Ok(base, "unknown_field", "");
  unknown.request += UnknownField();
  cases.push_back(unknown);
  HostileCase truncated = Invalid(base, "bytes_truncated_request", "", "");
  truncated.request.resize(truncated.request.size() - 3);
  truncated.message =
      absl::StrCat("request: could not parse ", truncated.request.size(),
                   " bytes as attnserve.v1.MultiHeadAttendRequest");
  cases.push_back(Pending(truncated, kPendingParseErrors));
}

void AddLayerNormCases(std::vector<HostileCase>& cases) {
  const v1::LayerNormRequest base = LayerNormBase();
  cases.push_back(Ok(base, "valid", "", ExpectFinite<v1::LayerNormResponse>()));
  v1::LayerNormRequest r = base;
  r.clear_input();
  cases.push_back(Invalid(r, "input_missing", "input", "input: missing"));
  r = base;
  r.clear_gamma();
  r.clear_beta();
  cases.push_back(Ok(r, "no_gamma_no_beta", "gamma"));
  r = base;
  *r.mutable_input() = RandomWireTensor(DType::kBool, {2, 6}, 51);
  cases.push_back(Invalid(r, "input_bool", "input",
                          "input: dtype BOOL not supported, expected FLOAT32 "
                          "or BFLOAT16 or FLOAT16"));
  r = base;
  *r.mutable_gamma() = RandomWireTensor(DType::kUInt8, {6}, 52);
  cases.push_back(Invalid(r, "gamma_uint8", "gamma",
                          "gamma: dtype UINT8 not supported, expected FLOAT32 "
                          "or BFLOAT16 or FLOAT16"));
  r = base;
  *r.mutable_gamma() = RandomWireTensor(DType::kFloat32, {5}, 52);
  cases.push_back(
      Invalid(r, "gamma_shape", "gamma", "gamma: shape [5], expected [6]"));
  r = base;
  *r.mutable_beta() = RandomWireTensor(DType::kFloat32, {1, 6}, 53);
  cases.push_back(
      Invalid(r, "beta_shape", "beta", "beta: shape [1, 6], expected [6]"));
  r = base;
  *r.mutable_input() = RandomWireTensor(DType::kFloat32, {}, 51);
  r.clear_gamma();
  r.clear_beta();
  cases.push_back(Invalid(r, "input_scalar", "input",
                          "normalized_ndim: 1 is not in [1, rank of input 0] "
                          "(input shape [])"));
  r = base;
  *r.mutable_input() = RandomWireTensor(DType::kBFloat16, {2, 6}, 51);
  *r.mutable_gamma() = RandomWireTensor(DType::kBFloat16, {6}, 52);
  *r.mutable_beta() = RandomWireTensor(DType::kFloat16, {6}, 53);
  cases.push_back(Ok(r, "mixed_float_dtypes", "input"));

  // normalized_ndim.
  for (const auto& [name, ndim] : std::vector<std::pair<std::string, int>>{
           {"normalized_ndim_minus_1", -1},
           {"normalized_ndim_int_min", std::numeric_limits<int>::min()}}) {
    r = base;
    r.set_normalized_ndim(ndim);
    cases.push_back(Invalid(
        r, name, "normalized_ndim",
        absl::StrCat("normalized_ndim: must be >= 0 (0 means 1), got ", ndim)));
  }
  for (const auto& [name, ndim] : std::vector<std::pair<std::string, int>>{
           {"normalized_ndim_3", 3},
           {"normalized_ndim_int_max", std::numeric_limits<int>::max()}}) {
    r = base;
    r.set_normalized_ndim(ndim);
    cases.push_back(Invalid(
        r, name, "normalized_ndim",
        absl::StrCat("normalized_ndim: ", ndim,
                     " is not in [1, rank of input 2] (input shape [2, 6])")));
  }
  r = base;
  r.set_normalized_ndim(2);
  cases.push_back(Invalid(r, "normalized_ndim_2_gamma", "normalized_ndim",
                          "gamma: shape [6], expected [2, 6]"));
  r = base;
  r.set_normalized_ndim(0);
  cases.push_back(Ok(r, "normalized_ndim_0_means_1", "normalized_ndim"));

  // eps.
  const float inf = std::numeric_limits<float>::infinity();
  const struct {
    const char* name;
    float value;
    const char* text;
  } bad_eps[] = {{"eps_0", 0.0f, "0"},
                 {"eps_minus_0", -0.0f, "-0"},
                 {"eps_negative", -1e-5f, "-1e-05"},
                 {"eps_nan", std::numeric_limits<float>::quiet_NaN(), "nan"},
                 {"eps_inf", inf, "inf"},
                 {"eps_minus_inf", -inf, "-inf"}};
  for (const auto& e : bad_eps) {
    r = base;
    r.set_eps(e.value);
    cases.push_back(
        Invalid(r, e.name, "eps",
                absl::StrCat("eps: must be finite and > 0, got ", e.text)));
  }
  // Tiny and huge eps are well defined, also on a constant row (variance 0).
  v1::LayerNormRequest constant = base;
  *constant.mutable_input() = FloatValues(
      {2, 6}, {0.1f, 0.1f, 0.1f, 0.1f, 0.1f, 0.1f, 1, 2, 3, 4, 5, 6});
  for (const auto& [name, eps] : std::vector<std::pair<std::string, float>>{
           {"eps_1e_38_constant_row", 1e-38f},
           {"eps_denormal_min_constant_row", 1e-45f},
           {"eps_1e38", 1e38f},
           {"eps_float_max", std::numeric_limits<float>::max()}}) {
    r = constant;
    r.set_eps(eps);
    cases.push_back(Ok(r, name, "eps", ExpectFinite<v1::LayerNormResponse>()));
  }

  r = base;
  r.mutable_result_regions()->mutable_output()->set_region(kRegion);
  r.mutable_result_regions()->mutable_output()->set_offset(2);
  r.mutable_result_regions()->mutable_output()->set_byte_size(48);
  cases.push_back(Invalid(r, "result_output_misaligned",
                          "result_regions.output",
                          "result_regions.output: shared memory offset 2 "
                          "in region 'hostile' is not aligned to 4 bytes (the "
                          "element size)"));
  r = base;
  SetShape(r.mutable_input(), {1 << 11, 1 << 10});
  cases.push_back(Case(r, "input_above_element_limit", "input",
                       Code::kResourceExhausted,
                       "request: a tensor of 2097152 elements exceeds "
                       "--max_tensor_elements 1048576"));
  r = base;
  SetShape(r.mutable_input(), {int64_t{1} << 60});
  cases.push_back(Case(r, "input_dim_2_60", "input", Code::kResourceExhausted,
                       "request: a tensor of 1152921504606846976 elements "
                       "exceeds --max_tensor_elements 1048576"));

  HostileCase unknown = Ok(base, "unknown_field", "");
  unknown.request += UnknownField();
  cases.push_back(unknown);
  HostileCase garbage = Invalid(base, "bytes_random", "", "");
  garbage.request = std::string("\x12\x07\x08\x01\xff\xff", 6);
  garbage.message = absl::StrCat(
      "request: could not parse 6 bytes as "
      "attnserve.v1.LayerNormRequest");
  cases.push_back(Pending(garbage, kPendingParseErrors));
}

// RmsNorm shares LayerNorm's validation (AddLayerNormCases covers it in
// full); these pin what is its own: no beta, and its default eps.
void AddRmsNormCases(std::vector<HostileCase>& cases) {
  const v1::RmsNormRequest base = RmsNormBase();
  cases.push_back(Ok(base, "valid", "", ExpectFinite<v1::RmsNormResponse>()));
  v1::RmsNormRequest r = base;
  r.clear_input();
  cases.push_back(Invalid(r, "input_missing", "input", "input: missing"));
  r = base;
  r.clear_gamma();
  cases.push_back(Ok(r, "no_gamma", "gamma"));
  r = base;
  *r.mutable_gamma() = RandomWireTensor(DType::kFloat32, {2, 6}, 55);
  cases.push_back(
      Invalid(r, "gamma_shape", "gamma", "gamma: shape [2, 6], expected [6]"));
  r = base;
  r.set_normalized_ndim(-1);
  cases.push_back(Invalid(r, "normalized_ndim_minus_1", "normalized_ndim",
                          "normalized_ndim: must be >= 0 (0 means 1), got -1"));
  r = base;
  r.set_eps(0.0f);
  cases.push_back(
      Invalid(r, "eps_0", "eps", "eps: must be finite and > 0, got 0"));
  // All zeros: the default eps (float32's machine epsilon) keeps them 0.
  r = base;
  *r.mutable_input() = FloatValues({2, 6}, std::vector<float>(12, 0.0f));
  cases.push_back(
      Ok(r, "zeros_default_eps", "eps", ExpectFinite<v1::RmsNormResponse>()));
  r = base;
  SetShape(r.mutable_input(), {1 << 11, 1 << 10});
  cases.push_back(Case(r, "input_above_element_limit", "input",
                       Code::kResourceExhausted,
                       "request: a tensor of 2097152 elements exceeds "
                       "--max_tensor_elements 1048576"));
  HostileCase garbage = Invalid(base, "bytes_random", "", "");
  garbage.request = std::string("\x12\x07\x08\x01\xff\xff", 6);
  garbage.message = absl::StrCat(
      "request: could not parse 6 bytes as attnserve.v1.RmsNormRequest");
  cases.push_back(Pending(garbage, kPendingParseErrors));
}

// Zero-sized dims are accepted by every RPC: empty dims give empty results,
// no key gives zeros (a fully masked row), a key dim of 0 uniform weights.
void AddEmptyDimCases(std::vector<HostileCase>& cases) {
  v1::AttendRequest a = AttendBase();
  SetShape(a.mutable_query(), {0, 3, 8});
  SetShape(a.mutable_key(), {0, 5, 8});
  SetShape(a.mutable_value(), {0, 5, 4});
  for (auto* t : {a.mutable_query(), a.mutable_key(), a.mutable_value()}) {
    t->clear_raw_data();
  }
  cases.push_back(Ok(a, "empty_batch", "query",
                     ExpectShape<v1::AttendResponse>({0, 3, 4})));
  a = AttendBase();
  SetShape(a.mutable_query(), {2, 0, 8});
  a.mutable_query()->clear_raw_data();
  SetShape(a.mutable_attn_mask(), {0, 5});
  a.mutable_attn_mask()->clear_raw_data();
  cases.push_back(Ok(a, "no_queries", "attn_mask",
                     ExpectShape<v1::AttendResponse>({2, 0, 4})));
  a = AttendBase();
  SetShape(a.mutable_key(), {2, 0, 8});
  SetShape(a.mutable_value(), {2, 0, 4});
  SetShape(a.mutable_attn_mask(), {3, 0});
  for (auto* t : {a.mutable_key(), a.mutable_value(), a.mutable_attn_mask()}) {
    t->clear_raw_data();
  }
  a.set_return_weights(true);
  cases.push_back(Ok(a, "no_keys_gives_zeros", "key",
                     ExpectEveryRow<v1::AttendResponse>({0, 0, 0, 0})));
  a = AttendBase();
  a.clear_attn_mask();
  SetShape(a.mutable_query(), {2, 3, 0});
  SetShape(a.mutable_key(), {2, 5, 0});
  a.mutable_query()->clear_raw_data();
  a.mutable_key()->clear_raw_data();
  cases.push_back(Ok(a, "key_dim_0_uniform", "query", ExpectMeanOfValues(a)));
  a = AttendBase();
  SetShape(a.mutable_value(), {2, 5, 0});
  a.mutable_value()->clear_raw_data();
  cases.push_back(Ok(a, "value_dim_0", "value",
                     ExpectShape<v1::AttendResponse>({2, 3, 0})));
  a = AttendBase();
  SetShape(a.mutable_key(), {0, 5, 8});
  a.mutable_key()->clear_raw_data();
  cases.push_back(Invalid(a, "key_empty_batch_differs", "key",
                          "key: dim 0 0 != query dim 0 2"));
  a = AttendBase();
  SetShape(a.mutable_attn_mask(), {0, 5});
  a.mutable_attn_mask()->clear_raw_data();
  cases.push_back(Invalid(a, "attn_mask_empty", "attn_mask",
                          "attn_mask: shape [0, 5] does not broadcast to "
                          "[2, 3, 5] (dim 0 is 0, expected 1 or 3)"));

  const std::vector<float> out_bias =
      RawFloats(MhaBase().weights().out_proj_bias());
  v1::MultiHeadAttendRequest m = MhaBase();
  for (auto* t : {m.mutable_query(), m.mutable_key(), m.mutable_value(),
                  m.mutable_key_padding_mask()}) {
    t->set_shape(0, 0);
    t->clear_raw_data();
  }
  cases.push_back(Ok(m, "empty_batch", "query",
                     ExpectShape<v1::MultiHeadAttendResponse>({0, 3, 5})));
  m = MhaBase();
  SetShape(m.mutable_key(), {2, 0, 6});
  SetShape(m.mutable_value(), {2, 0, 4});
  SetShape(m.mutable_attn_mask(), {3, 0});
  SetShape(m.mutable_key_padding_mask(), {2, 0});
  for (auto* t : {m.mutable_key(), m.mutable_value(), m.mutable_attn_mask(),
                  m.mutable_key_padding_mask()}) {
    t->clear_raw_data();
  }
  m.set_return_weights(true);
  // No key: zero heads, projected to out_proj_bias.
  cases.push_back(Ok(m, "no_keys_gives_out_proj_bias", "key",
                     ExpectEveryRow<v1::MultiHeadAttendResponse>(out_bias)));
  m = MhaBase();
  {
    v1::AttentionWeights* w = m.mutable_weights();
    for (auto* t : {w->mutable_q_proj_weight(), w->mutable_k_proj_weight(),
                    w->mutable_v_proj_weight(), w->mutable_q_proj_bias(),
                    w->mutable_k_proj_bias(), w->mutable_v_proj_bias()}) {
      t->set_shape(0, 0);
      t->clear_raw_data();
    }
    SetShape(w->mutable_out_proj_weight(), {5, 0});
    w->mutable_out_proj_weight()->clear_raw_data();
  }
  // Heads of width 0: uniform weights over nothing, out_proj_bias again.
  cases.push_back(Ok(m, "head_dims_0", "weights.q_proj_weight",
                     ExpectEveryRow<v1::MultiHeadAttendResponse>(out_bias)));
  m = MhaFusedBase();
  m.mutable_weights()->clear_out_proj_weight();
  SetShape(m.mutable_weights()->mutable_in_proj_weight(), {0, 0});
  SetShape(m.mutable_weights()->mutable_in_proj_bias(), {0});
  SetShape(m.mutable_query(), {2, 3, 0});
  for (auto* t :
       {m.mutable_weights()->mutable_in_proj_weight(),
        m.mutable_weights()->mutable_in_proj_bias(), m.mutable_query()}) {
    t->clear_raw_data();
  }
  cases.push_back(Ok(m, "embed_dim_0", "weights.in_proj_weight",
                     ExpectShape<v1::MultiHeadAttendResponse>({2, 3, 0})));
  m = MhaBase();
  SetShape(m.mutable_weights()->mutable_q_proj_weight(), {0, 8});
  m.mutable_weights()->mutable_q_proj_weight()->clear_raw_data();
  cases.push_back(Invalid(m, "q_proj_weight_empty_bias_not",
                          "weights.q_proj_bias",
                          "q_proj_bias: shape [8], expected [0]"));

  v1::LayerNormRequest l = LayerNormBase();
  SetShape(l.mutable_input(), {0, 6});
  l.mutable_input()->clear_raw_data();
  cases.push_back(
      Ok(l, "no_rows", "input", ExpectShape<v1::LayerNormResponse>({0, 6})));
  l = LayerNormBase();
  SetShape(l.mutable_input(), {2, 0});
  SetShape(l.mutable_gamma(), {0});
  SetShape(l.mutable_beta(), {0});
  for (auto* t : {l.mutable_input(), l.mutable_gamma(), l.mutable_beta()}) {
    t->clear_raw_data();
  }
  cases.push_back(
      Ok(l, "no_columns", "gamma", ExpectShape<v1::LayerNormResponse>({2, 0})));
  l = LayerNormBase();
  SetShape(l.mutable_gamma(), {0});
  l.mutable_gamma()->clear_raw_data();
  cases.push_back(
      Invalid(l, "gamma_empty", "gamma", "gamma: shape [0], expected [6]"));
}

void AddModelRpcCases(std::vector<HostileCase>& cases) {
  v1::ListModelsRequest list;
  cases.push_back(Ok(list, "valid", "", [](const std::string& bytes) {
    v1::ListModelsResponse response;
    ASSERT_TRUE(response.ParseFromString(bytes));
    ASSERT_EQ(response.models_size(), 1);
    EXPECT_EQ(response.models(0).name(), kModel);
  }));
  HostileCase list_unknown = Ok(list, "unknown_field", "");
  list_unknown.request = UnknownField();
  cases.push_back(list_unknown);
  HostileCase list_garbage = Invalid(list, "bytes_invalid_wire_type", "", "");
  list_garbage.request = "\x0f";
  list_garbage.message =
      "request: could not parse 1 bytes as attnserve.v1.ListModelsRequest";
  cases.push_back(Pending(list_garbage, kPendingParseErrors));

  v1::GetModelMetadataRequest meta;
  meta.set_name(kModel);
  cases.push_back(Ok(meta, "valid", "name"));
  HostileCase meta_unknown = Ok(meta, "unknown_field", "name");
  meta_unknown.request += UnknownField();
  cases.push_back(meta_unknown);
  meta.set_name("nope");
  cases.push_back(Case(meta, "name_unknown", "name", Code::kNotFound,
                       "model: 'nope' not found; loaded models: demo"));
  meta.set_name("");
  cases.push_back(Invalid(meta, "name_empty", "name",
                          "name: empty, expected the name of a loaded model "
                          "(ListModels)"));
  meta.set_name(std::string(10240, 'x'));
  cases.push_back(Invalid(meta, "name_10_kb", "name",
                          "name: 10240 bytes, longer than the 255 a model "
                          "name may have"));
  meta.set_name("../../etc");
  cases.push_back(Invalid(meta, "name_dot_dot_slash", "name",
                          "name: '../../etc' contains '/'; a model name is "
                          "the name of a folder in the model repository"));
  meta.set_name(".");
  cases.push_back(Invalid(meta, "name_dot", "name",
                          "name: '.' is not the name of a folder in the model "
                          "repository"));
  meta.set_name(std::string("demo\0", 5));
  cases.push_back(Invalid(meta, "name_nul_byte", "name",
                          "name: 'demo\\000' contains a NUL byte"));
}

void AddSharedMemoryRpcCases(std::vector<HostileCase>& cases,
                             const std::string& key) {
  const auto region = [&](std::string name, std::string region_key,
                          uint64_t offset, uint64_t byte_size) {
    v1::RegisterSharedMemoryRequest r;
    r.mutable_region()->set_name(std::move(name));
    r.mutable_region()->set_key(std::move(region_key));
    r.mutable_region()->set_offset(offset);
    r.mutable_region()->set_byte_size(byte_size);
    return r;
  };
  const auto unregister = [](std::string name) {
    return [name](AttnClient& client) {
      EXPECT_TRUE(client.UnregisterSharedMemory(name).ok());
    };
  };
  HostileCase ok = Ok(region("extra", key, 0, 64), "valid", "region");
  ok.cleanup = unregister("extra");
  cases.push_back(ok);
  HostileCase unknown =
      Ok(region("extra2", key, 64, 64), "unknown_field", "region");
  unknown.request += UnknownField();
  unknown.cleanup = unregister("extra2");
  cases.push_back(unknown);
  cases.push_back(Invalid(v1::RegisterSharedMemoryRequest(), "empty_request",
                          "region.name",
                          "name: must be 1 to 128 characters, got 0"));
  cases.push_back(Invalid(region(std::string(129, 'n'), key, 0, 64),
                          "name_129_chars", "region.name",
                          "name: must be 1 to 128 characters, got 129"));
  cases.push_back(Invalid(region(std::string(10240, 'n'), key, 0, 64),
                          "name_10_kb", "region.name",
                          "name: must be 1 to 128 characters, got 10240"));
  cases.push_back(Invalid(region("a/b", key, 0, 64), "name_slash",
                          "region.name",
                          "name: only letters, digits, '_', '-' and '.' are "
                          "allowed"));
  cases.push_back(Invalid(region(std::string("a\0b", 3), key, 0, 64),
                          "name_nul_byte", "region.name",
                          "name: only letters, digits, '_', '-' and '.' are "
                          "allowed"));
  const std::string key_message =
      "key: expected a POSIX shared memory name such as \"/my_region\" (one "
      "name under /dev/shm, no other '/', at most 250 characters), got \"";
  cases.push_back(Invalid(region("k", "", 0, 64), "key_empty", "region.key",
                          key_message + "\""));
  cases.push_back(Invalid(region("k", "../../etc/passwd", 0, 64),
                          "key_dot_dot_slash", "region.key",
                          key_message + "../../etc/passwd\""));
  cases.push_back(Invalid(region("k", "/..", 0, 64), "key_dot_dot",
                          "region.key", key_message + "..\""));
  cases.push_back(Invalid(region("k", std::string("/a\0b", 4), 0, 64),
                          "key_nul_byte", "region.key",
                          key_message + "a\\000b\""));
  cases.push_back(Invalid(
      region("k", "/" + std::string(300, 'k'), 0, 64), "key_300_chars",
      "region.key", key_message + std::string(128, 'k') + "\"... (300 bytes)"));
  const std::string missing = absl::StrCat(key, "-missing");
  cases.push_back(Case(region("k", missing, 0, 64), "key_missing_object",
                       "region.key", Code::kNotFound,
                       absl::StrCat("key: cannot open shared memory object \"",
                                    missing, "\": No such file or directory")));
  cases.push_back(Invalid(region("k", key, 0, 0), "byte_size_0",
                          "region.byte_size", "byte_size: must be > 0"));
  cases.push_back(Invalid(region("k", key, 0, kRegionBytes + 1),
                          "byte_size_past_object", "region.byte_size",
                          absl::StrCat("byte_size: offset 0 + byte_size 4097 "
                                       "exceeds the 4096 bytes of shared "
                                       "memory object \"",
                                       key, "\"")));
  cases.push_back(Invalid(
      region("k", key, uint64_t{1} << 63, 64), "offset_2_63", "region.offset",
      "offset: offset 9223372036854775808 + byte_size 64 is "
      "too large"));
  cases.push_back(Case(region("k", key, 64, ~uint64_t{0}),
                       "byte_size_2_64_minus_1", "region.byte_size",
                       Code::kResourceExhausted,
                       "byte_size: 18446744073709551615 more bytes would "
                       "exceed the 4096 MiB of shared memory this server maps "
                       "(--max_shared_memory_mb; 4096 bytes registered)"));
  cases.push_back(Invalid(region("k", key, 1 << 20, 64), "offset_past_object",
                          "region.offset",
                          absl::StrCat("byte_size: offset 1048576 + byte_size "
                                       "64 exceeds the 4096 bytes of shared "
                                       "memory object \"",
                                       key, "\"")));
  cases.push_back(Case(region(kRegion, key, 0, 64), "name_in_use",
                       "region.name", Code::kAlreadyExists,
                       "name: shared memory region 'hostile' is already "
                       "registered; unregister it first"));

  v1::UnregisterSharedMemoryRequest un;
  un.set_name("nope");
  cases.push_back(Case(un, "name_unknown", "name", Code::kNotFound,
                       "name: shared memory region 'nope' is not registered"));
  un.set_name(std::string(10240, 'n'));
  cases.push_back(Invalid(un, "name_10_kb", "name",
                          "name: must be 1 to 128 characters, got 10240"));
  un.set_name("../x");
  cases.push_back(Invalid(un, "name_slash", "name",
                          "name: only letters, digits, '_', '-' and '.' are "
                          "allowed"));
  HostileCase un_unknown = Ok(un, "unknown_field_unregisters_all", "name");
  un_unknown.request = UnknownField();  // name empty: unregisters every region
  un_unknown.code = Code::kOk;
  // Unregistering everything would take the region the other cases use; only
  // the unknown field is sent, so register it again after.
  un_unknown.cleanup = [key](AttnClient& client) {
    v1::SharedMemoryRegion r;
    r.set_name(kRegion);
    r.set_key(key);
    r.set_byte_size(kRegionBytes);
    EXPECT_TRUE(client.RegisterSharedMemory(r).ok());
  };
  cases.push_back(un_unknown);

  v1::ListSharedMemoryRequest ls;
  cases.push_back(Ok(ls, "all", "name", [](const std::string& bytes) {
    v1::ListSharedMemoryResponse response;
    ASSERT_TRUE(response.ParseFromString(bytes));
    ASSERT_EQ(response.regions_size(), 1);
    EXPECT_EQ(response.regions(0).name(), kRegion);
  }));
  ls.set_name("nope");
  cases.push_back(Case(ls, "name_unknown", "name", Code::kNotFound,
                       "name: shared memory region 'nope' is not registered"));
  ls.set_name(std::string(10240, 'n'));
  cases.push_back(Invalid(ls, "name_10_kb", "name",
                          "name: must be 1 to 128 characters, got 10240"));
  HostileCase ls_unknown =
      Ok(v1::ListSharedMemoryRequest(), "unknown_field", "");
  ls_unknown.request = UnknownField();
  cases.push_back(ls_unknown);
  HostileCase ls_garbage =
      Invalid(v1::ListSharedMemoryRequest(), "bytes_truncated", "", "");
  ls_garbage.request = std::string("\x0a\x09nope", 6);
  ls_garbage.message =
      "request: could not parse 6 bytes as "
      "attnserve.v1.ListSharedMemoryRequest";
  cases.push_back(Pending(ls_garbage, kPendingParseErrors));
}

void AddSessionCases(std::vector<HostileCase>& cases) {
  const auto attention = [] {
    v1::CreateSessionRequest r;
    r.set_num_heads(2);
    r.set_head_dim(8);
    return r;
  };
  cases.push_back(Ok(attention(), "valid_attention", ""));
  v1::CreateSessionRequest int8 = attention();
  int8.set_dtype(v1::DATA_TYPE_INT8);
  cases.push_back(Ok(int8, "valid_int8_cache", "dtype"));
  v1::CreateSessionRequest create = attention();
  create.set_model(kModel);
  cases.push_back(Ok(create, "valid_model", "model"));
  create.set_model("nope");
  cases.push_back(Case(create, "model_unknown", "model", Code::kNotFound,
                       "model: 'nope' not found; loaded models: demo"));
  create.set_model("../x");
  cases.push_back(Invalid(create, "model_slash", "model",
                          "model: '../x' contains '/'; a model name is the "
                          "name of a folder in the model repository"));
  const auto invalid = [&](const char* name, const char* field, auto&& edit,
                           std::string message) {
    v1::CreateSessionRequest r = attention();
    edit(r);
    cases.push_back(Invalid(r, name, field, std::move(message)));
  };
  invalid(
      "num_heads_0", "num_heads", [](auto& r) { r.set_num_heads(0); },
      "num_heads: must be > 0, got 0");
  invalid(
      "num_kv_heads_3_of_2", "num_kv_heads",
      [](auto& r) { r.set_num_kv_heads(3); },
      "num_kv_heads: 3 does not divide num_heads 2");
  invalid(
      "head_dim_0", "head_dim", [](auto& r) { r.set_head_dim(0); },
      "head_dim: must be > 0, got 0");
  invalid(
      "value_head_dim_negative", "value_head_dim",
      [](auto& r) { r.set_value_head_dim(-1); },
      "value_head_dim: must be >= 0, got -1");
  invalid(
      "dtype_float16", "dtype",
      [](auto& r) { r.set_dtype(v1::DATA_TYPE_FLOAT16); },
      "dtype: FLOAT16 not supported for a session cache, expected "
      "FLOAT32, BFLOAT16 or INT8");
  invalid(
      "cache_dtype_bfloat16", "cache_dtype",
      [](auto& r) { r.set_cache_dtype(v1::DATA_TYPE_BFLOAT16); },
      "cache_dtype: BFLOAT16 not supported with compute dtype FLOAT32, "
      "expected FLOAT32 or INT8");
  invalid(
      "cache_dtype_float32_of_int8", "cache_dtype",
      [](auto& r) {
        r.set_dtype(v1::DATA_TYPE_INT8);
        r.set_cache_dtype(v1::DATA_TYPE_FLOAT32);
      },
      "cache_dtype: FLOAT32 contradicts dtype INT8 (an INT8 cache)");
  invalid(
      "cache_dtype_99", "cache_dtype",
      [](auto& r) { r.set_cache_dtype(static_cast<v1::DataType>(99)); },
      "cache_dtype: dtype 99 is not a known DataType");
  invalid(
      "rotary_dims_odd", "rotary_dims", [](auto& r) { r.set_rotary_dims(3); },
      "rotary_dims: must be even and >= 0 (the halves rotate in pairs), "
      "got 3");
  invalid(
      "rotary_dims_past_head_dim", "rotary_dims",
      [](auto& r) { r.set_rotary_dims(16); }, "rotary_dims: 16 > head dim 8");
  invalid(
      "rotary_base_below_1", "rotary_base",
      [](auto& r) {
        r.set_rotary_dims(2);
        r.set_rotary_base(0.5f);
      },
      "rotary_dims: base must be finite and > 1, got 0.5");
  invalid(
      "max_length_negative", "max_length",
      [](auto& r) { r.set_max_length(-1); },
      "max_length: -1 is not in [0, 32768] (0: the server's "
      "--max_session_length 32768)");
  invalid(
      "max_length_2_40", "max_length",
      [](auto& r) { r.set_max_length(int64_t{1} << 40); },
      "max_length: 1099511627776 is not in [0, 32768] (0: the server's "
      "--max_session_length 32768)");
  invalid(
      "batch_negative", "batch", [](auto& r) { r.set_batch(-1); },
      "batch: must be >= 0 (0 means 1), got -1");
  invalid(
      "num_layers_negative", "num_layers",
      [](auto& r) { r.set_num_layers(-1); },
      "num_layers: must be >= 0 (0 means 1), got -1");
  v1::CreateSessionRequest huge = attention();
  huge.set_head_dim(int64_t{1} << 50);
  huge.set_batch(int64_t{1} << 20);
  cases.push_back(Glob(Invalid(huge, "cache_bytes_overflow", "max_length",
                               "max_length: shape * overflows 64-bit size")));

  cases.push_back(Ok(SessionStepBase(), "valid_attention", "",
                     ExpectShape<v1::SessionStepResponse>({2, 3, 8})));
  cases.push_back(Ok(SessionModelStepBase(), "valid_model", "input",
                     ExpectShape<v1::SessionStepResponse>({3, 8})));
  v1::SessionStepRequest step = SessionStepBase();
  step.set_session_id("nope");
  cases.push_back(Case(step, "session_unknown", "session_id", Code::kNotFound,
                       "session_id: no session \"nope\" (expired, evicted, "
                       "deleted, or opened on another replica); create a new "
                       "one and prefill it"));
  step.set_session_id("");
  cases.push_back(Invalid(step, "session_id_empty", "session_id",
                          "session_id: empty, expected the id CreateSession "
                          "returned"));
  step.set_session_id(std::string(10240, 'x'));
  cases.push_back(Invalid(step, "session_id_10_kb", "session_id",
                          "session_id: 10240 bytes, longer than any session "
                          "id (32 hex digits)"));
  step = SessionStepBase();
  step.clear_key();
  cases.push_back(Invalid(step, "key_missing", "key",
                          "key: missing (an attention session takes query, "
                          "key and value)"));
  step = SessionStepBase();
  *step.mutable_input() = RandomWireTensor(DType::kFloat32, {3, 8}, 35);
  cases.push_back(Invalid(step, "input_on_attention_session", "input",
                          "input: an attention session takes query, key and "
                          "value, not hidden states"));
  step = SessionModelStepBase();
  *step.mutable_query() = RandomWireTensor(DType::kFloat32, {2, 3, 8}, 36);
  cases.push_back(Invalid(step, "query_on_model_session", "query",
                          "query: a model session takes `input` (hidden "
                          "states), not query/key/value"));
  step = SessionModelStepBase();
  *step.mutable_input() = RandomWireTensor(DType::kFloat32, {3, 5}, 37);
  cases.push_back(Invalid(step, "input_width", "input",
                          "input: last dim 5 != the model's 8"));
  step = SessionStepBase();
  *step.mutable_query() = RandomWireTensor(DType::kFloat32, {3, 3, 8}, 38);
  cases.push_back(Invalid(step, "query_heads", "query",
                          "query: shape [3, 3, 8], expected [2, 3, 8]"));
  step = SessionStepBase();
  *step.mutable_key() = RandomWireTensor(DType::kFloat32, {1, 2, 8}, 39);
  cases.push_back(Invalid(step, "key_tokens", "key",
                          "key: shape [1, 2, 8], expected [1, 3, 8]"));
  step = SessionStepBase();
  *step.mutable_query() = RandomWireTensor(DType::kFloat32, {6, 8}, 40);
  cases.push_back(Invalid(step, "query_rank_2", "query",
                          "query: rank 2, expected 4 (or 3 without the batch "
                          "dim)"));
  step = SessionStepBase();
  *step.mutable_value() = RandomWireTensor(DType::kBFloat16, {1, 3, 8}, 41);
  cases.push_back(Glob(Invalid(step, "value_dtype", "value", "value: *")));
  step = SessionStepBase();
  step.set_position(-1);
  cases.push_back(Glob(Invalid(step, "position_negative", "position",
                               "position: -1 is not in [0, *] (the tokens "
                               "cached)")));
  step = SessionStepBase();
  *step.mutable_query() = RandomWireTensor(DType::kFloat32, {2, 5000, 8}, 42);
  *step.mutable_key() = RandomWireTensor(DType::kFloat32, {1, 5000, 8}, 43);
  *step.mutable_value() = RandomWireTensor(DType::kFloat32, {1, 5000, 8}, 44);
  // At position 0: a rewind when earlier cases left tokens in the session
  // ("session: position 0 + 5000 new tokens exceed its max_length 4096 (the
  // session holds 3 tokens; nothing was changed)"), else "0 cached + ...".
  cases.push_back(Glob(Case(step, "past_max_length", "query", Code::kOutOfRange,
                            "session: * 5000 new tokens exceed its "
                            "max_length 4096*")));
  step = SessionStepBase();
  step.set_layer(1);
  cases.push_back(Invalid(step, "layer_1_of_1", "layer",
                          "layer: 1 is out of range [0, 1)"));
  step.set_layer(-2147483647 - 1);
  cases.push_back(Invalid(step, "layer_int32_min", "layer",
                          "layer: -2147483648 is out of range [0, 1)"));
  step = SessionStepBase();
  step.set_temperature(0);
  cases.push_back(
      Glob(Invalid(step, "temperature_0", "temperature", "temperature: *")));
  step = SessionStepBase();
  step.set_scale(std::numeric_limits<float>::infinity());
  cases.push_back(Glob(Invalid(step, "scale_inf", "scale", "scale: *")));

  v1::DeleteSessionRequest remove;
  remove.set_session_id("nope");
  cases.push_back(Case(remove, "session_unknown", "session_id", Code::kNotFound,
                       "session_id: no session \"nope\" (expired, evicted, "
                       "deleted, or opened on another replica); create a new "
                       "one and prefill it"));
  remove.set_session_id("");
  cases.push_back(Invalid(remove, "session_id_empty", "session_id",
                          "session_id: empty, expected the id CreateSession "
                          "returned"));
  remove.set_session_id(kDeleteSession);
  cases.push_back(Ok(remove, "valid", "session_id"));

  v1::HandOverSessionRequest hand_over;
  hand_over.set_session_id("nope");
  cases.push_back(Case(hand_over, "session_unknown", "session_id",
                       Code::kNotFound,
                       "session_id: no session \"nope\" (expired, evicted, "
                       "deleted, or opened on another replica); create a new "
                       "one and prefill it"));
  hand_over.set_session_id("");
  cases.push_back(Invalid(hand_over, "session_id_empty", "session_id",
                          "session_id: empty, expected the id CreateSession "
                          "returned"));
  hand_over.set_session_id(kHandOverSession);
  cases.push_back(Ok(hand_over, "valid", "session_id"));

  v1::ForkSessionRequest fork;
  fork.set_session_id(kAttentionSession);
  fork.set_length(0);
  cases.push_back(Ok(fork, "valid", "length", [](const std::string& bytes) {
    v1::ForkSessionResponse response;
    ASSERT_TRUE(response.ParseFromString(bytes));
    EXPECT_EQ(response.length(), 0);
    EXPECT_EQ(response.session_id().size(), 32u);
  }));
  fork.set_length(-1);
  cases.push_back(Glob(Invalid(fork, "length_negative", "length",
                               "length: -1 is not in [0, *] (the tokens the "
                               "session holds)")));
  fork.set_length(int64_t{1} << 62);
  cases.push_back(Glob(Invalid(fork, "length_2_62", "length",
                               "length: 4611686018427387904 is not in [0, *] "
                               "(the tokens the session holds)")));
  fork.clear_length();
  fork.set_session_id("nope");
  cases.push_back(Case(fork, "session_unknown", "session_id", Code::kNotFound,
                       "session_id: no session \"nope\" (expired, evicted, "
                       "deleted, or opened on another replica); create a new "
                       "one and prefill it"));
  fork.set_session_id("");
  cases.push_back(Invalid(fork, "session_id_empty", "session_id",
                          "session_id: empty, expected the id CreateSession "
                          "returned"));
  fork.set_session_id(std::string(10240, 'x'));
  cases.push_back(Invalid(fork, "session_id_10_kb", "session_id",
                          "session_id: 10240 bytes, longer than any session "
                          "id (32 hex digits)"));
}

// ---------------------------------------------------------------------------
// Resource families: calls whose cost is not their FLOPs, sessions that
// reserve more than the budget, and the client strings messages echo.

// A FLOAT32 tensor of `shape` that has no elements.
v1::Tensor ZeroWidth(const std::vector<int64_t>& shape) {
  v1::Tensor t;
  t.set_dtype(v1::DATA_TYPE_FLOAT32);
  SetShape(&t, shape);
  return t;
}

// Calls of (nearly) no FLOPs and much work: each ends with an answer or a
// clear refusal within its deadline, and the server serves the next call
// at once (a [1, 1, 262144, 0] Attend once computed 27 s past its 3 s
// deadline, on gRPC's thread, where nothing could stop it).
// ExportSession and ImportSession: one request or chunk a call, as a
// unary client sends it.
void AddTransferCases(std::vector<HostileCase>& cases) {
  v1::ExportSessionRequest out;
  out.set_session_id("nope");
  cases.push_back(Case(out, "session_unknown", "session_id", Code::kNotFound,
                       "session_id: no session \"nope\" (expired, evicted, "
                       "deleted, or opened on another replica); create a new "
                       "one and prefill it"));
  out.set_session_id("");
  cases.push_back(Invalid(out, "session_id_empty", "session_id",
                          "session_id: empty, expected the id CreateSession "
                          "returned"));
  out.set_session_id(kAttentionSession);
  out.set_offset(uint64_t{1} << 40);
  cases.push_back(Glob(Case(out, "offset_past_end", "offset", Code::kOutOfRange,
                            "offset: 1099511627776, past the file's * bytes")));
  out.set_offset(0);
  out.set_version(1);
  cases.push_back(Glob(Case(out, "version_stale", "version", Code::kAborted,
                            "version: session \"*\" changed since the export "
                            "began (a step or a rewind: version 1, "
                            "now *); export it again from offset 0")));
  out.set_version(0);
  cases.push_back(Ok(out, "valid", "session_id", [](const std::string& bytes) {
    v1::ExportSessionChunk chunk;
    ASSERT_TRUE(chunk.ParseFromString(bytes));
    EXPECT_EQ(chunk.offset(), 0u);
    EXPECT_EQ(chunk.size(), chunk.data().size());
    EXPECT_EQ(chunk.data().substr(0, 8), "ATTNSESS");
  }));

  v1::ImportSessionChunk in;
  in.set_data("ATTNSESS");
  cases.push_back(Ok(in, "valid", "data", [](const std::string& bytes) {
    v1::ImportSessionResponse response;
    ASSERT_TRUE(response.ParseFromString(bytes));
    EXPECT_EQ(response.received(), 8u);
    EXPECT_EQ(response.size(), 0u);
  }));
  in.set_data("NOT A SESSION FILE");
  cases.push_back(Case(in, "not_a_session_file", "data", Code::kDataLoss,
                       "session file 'import': not a session file (no "
                       "ATTNSESS magic)"));
  std::string huge_header("ATTNSESS\x02\0\0\0\xff\xff\xff\x7f", 16);
  in.set_data(huge_header);
  cases.push_back(Case(in, "header_huge", "data", Code::kDataLoss,
                       "session file 'import': a header of 2147483647 bytes; "
                       "a header takes at most 65536"));
  in.set_data("x");
  in.set_offset(5);
  cases.push_back(Case(in, "offset_ahead", "offset", Code::kFailedPrecondition,
                       "offset: 5; the import has taken 0 bytes of the file: "
                       "send it from offset 0"));
  in.set_offset(0);
  in.set_session_id("0123abcd");
  cases.push_back(Case(
      in, "resume_unknown", "session_id", Code::kNotFound,
      "session_id: no import of session \"0123abcd\" is under way here (it "
      "completed, was dropped after 10m idle, or began on another replica); "
      "import it again from offset 0"));
}

void AddWorkCases(std::vector<HostileCase>& cases) {
  for (const int64_t len : {int64_t{262144}, int64_t{1048576}}) {
    v1::AttendRequest a;
    *a.mutable_query() = ZeroWidth({1, 1, len, 0});
    *a.mutable_key() = ZeroWidth({1, 1, len, 0});
    *a.mutable_value() = ZeroWidth({1, 1, len, 0});
    HostileCase c = Ok(a, absl::StrCat("zero_width_", len), "query",
                       ExpectShape<v1::AttendResponse>({1, 1, len, 0}));
    c.deadline_seconds = 3;
    cases.push_back(std::move(c));
  }
  // Keys of width 0: each row is the mean of the values.
  v1::AttendRequest a;
  *a.mutable_query() = ZeroWidth({1, 1, 262144, 0});
  *a.mutable_key() = ZeroWidth({1, 1, 4096, 0});
  *a.mutable_value() = FloatValues({1, 1, 4096, 1}, std::vector(4096, 0.5f));
  HostileCase mean = Ok(a, "zero_key_width_262144_queries", "key",
                        ExpectEveryRow<v1::AttendResponse>({0.5f}));
  mean.deadline_seconds = 3;
  cases.push_back(std::move(mean));
  // With a mask every one of the 2^38 logits is computed: the server's
  // estimate refuses the call up front.
  const int64_t long_len = int64_t{1} << 19;
  *a.mutable_query() = ZeroWidth({1, 1, long_len, 0});
  *a.mutable_key() = ZeroWidth({1, 1, long_len, 0});
  *a.mutable_value() =
      FloatValues({1, 1, long_len, 1}, std::vector(long_len, 0.5f));
  *a.mutable_attn_mask() = KeepAll({});
  HostileCase masked =
      Glob(Case(a, "zero_key_width_masked_2_38_logits", "attn_mask",
                Code::kDeadlineExceeded,
                "call needs about * ms at this server's measured rate; the "
                "deadline is in * ms"));
  masked.deadline_seconds = 2;
  cases.push_back(std::move(masked));
  // No keys: zeros written, 0 FLOPs.
  a.clear_attn_mask();
  *a.mutable_key() = ZeroWidth({1, 1, 0, 0});
  *a.mutable_value() = ZeroWidth({1, 1, 0, 1});
  HostileCase zeros = Ok(a, "no_keys_2_19_queries", "value",
                         ExpectEveryRow<v1::AttendResponse>({0.0f}));
  zeros.deadline_seconds = 3;
  cases.push_back(std::move(zeros));

  // Multi-head attention with heads of width 0 over 32768 tokens: every
  // row is out_proj_bias.
  v1::MultiHeadAttendRequest m;
  v1::AttentionWeights* w = m.mutable_weights();
  w->set_num_heads(2);
  *w->mutable_q_proj_weight() = ZeroWidth({0, 8});
  *w->mutable_k_proj_weight() = ZeroWidth({0, 8});
  *w->mutable_v_proj_weight() = ZeroWidth({0, 8});
  *w->mutable_out_proj_weight() = ZeroWidth({5, 0});
  *w->mutable_out_proj_bias() = RandomWireTensor(DType::kFloat32, {5}, 18);
  *m.mutable_query() = RandomWireTensor(DType::kFloat32, {1, 32768, 8}, 61);
  HostileCase heads = Ok(m, "head_dims_0_32768_tokens", "weights.q_proj_weight",
                         ExpectEveryRow<v1::MultiHeadAttendResponse>(
                             RawFloats(w->out_proj_bias())));
  heads.deadline_seconds = 5;
  cases.push_back(std::move(heads));
}

// Sessions whose cache could never fit --max_session_memory_mb (4096, the
// default) are refused before anything is reserved: 8 TiB a call once
// filled the address space.
void AddSessionReservationCases(std::vector<HostileCase>& cases) {
  const auto refused = [&](const char* name, int64_t head_dim, int64_t batch,
                           std::string message) {
    v1::CreateSessionRequest r;
    r.set_num_heads(8);
    r.set_head_dim(head_dim);
    r.set_batch(batch);
    cases.push_back(Case(r, name, "max_length", Code::kResourceExhausted,
                         std::move(message)));
  };
  refused("head_dim_2_22", int64_t{1} << 22, 0,
          "max_length: 32768 tokens x 1 sequences x 8 key/value heads x "
          "(4194304 + 4194304) dims of FLOAT32 reserve 8388608 MiB of cache, "
          "more than --max_session_memory_mb 4096 allows one session; at "
          "most 16 tokens fit");
  refused("head_dim_2_14", int64_t{1} << 14, 0,
          "max_length: 32768 tokens x 1 sequences x 8 key/value heads x "
          "(16384 + 16384) dims of FLOAT32 reserve 32768 MiB of cache, more "
          "than --max_session_memory_mb 4096 allows one session; at most "
          "4096 tokens fit");
  refused("batch_1024", 64, 1024,
          "max_length: 32768 tokens x 1024 sequences x 8 key/value heads x "
          "(64 + 64) dims of FLOAT32 reserve 131072 MiB of cache, more than "
          "--max_session_memory_mb 4096 allows one session; at most 1024 "
          "tokens fit");
  refused("head_dim_2_40", int64_t{1} << 40, 0,
          "max_length: 32768 tokens x 1 sequences x 8 key/value heads x "
          "(1099511627776 + 1099511627776) dims of FLOAT32 reserve "
          "2199023255552 MiB of cache, more than --max_session_memory_mb "
          "4096 allows one session; not one token fits: use smaller dims");
}

// What a message echoes of a client's string: its first 128 bytes, then
// its length (see EchoString).
std::string Cut(char c, size_t n) {
  return absl::StrCat("'", std::string(128, c), "'... (", n, " bytes)");
}

// Every echoed client string, on both services, cut to 128 bytes: a
// 20,000-byte version made a 20,048-byte NOT_FOUND that clients received
// as RESOURCE_EXHAUSTED "received initial metadata size exceeds limit".
void AddEchoCases(std::vector<HostileCase>& cases) {
  const std::string v20k(20000, '9');
  const std::string n8k(8000, 'n');
  const std::string not_found =
      absl::StrCat("model: ", Cut('n', 200), " not found; loaded models: demo");

  v1::GetModelMetadataRequest metadata;
  metadata.set_name(std::string(200, 'n'));
  cases.push_back(Case(metadata, "name_200_bytes_echo", "name", Code::kNotFound,
                       not_found));
  v1::CreateSessionRequest create;
  create.set_model(std::string(200, 'n'));
  cases.push_back(Case(create, "model_200_bytes_echo", "model", Code::kNotFound,
                       not_found));
  v1::SessionStepRequest step;
  step.set_session_id("s\n\"x");
  cases.push_back(Case(step, "session_id_newline_quote_echo", "session_id",
                       Code::kNotFound,
                       "session_id: no session \"s\\n\\\"x\" (expired, "
                       "evicted, deleted, or opened on another replica); "
                       "create a new one and prefill it"));
  v1::RegisterSharedMemoryRequest region;
  region.mutable_region()->set_name("r");
  region.mutable_region()->set_key(n8k);
  region.mutable_region()->set_byte_size(64);
  cases.push_back(Invalid(
      region, "key_8000_bytes_echo", "region.key",
      absl::StrCat("key: expected a POSIX shared memory name such as "
                   "\"/my_region\" (one name under /dev/shm, no other '/', "
                   "at most 250 characters), got \"",
                   std::string(128, 'n'), "\"... (8000 bytes)")));

  // The Open Inference Protocol's service.
  const std::string only_version =
      absl::StrCat(" has only version 1, not ", Cut('9', 20000));
  inference::ModelMetadataRequest oip_metadata;
  oip_metadata.set_name("demo");
  oip_metadata.set_version(v20k);
  cases.push_back(Case(oip_metadata, "version_20000_bytes", "version",
                       Code::kNotFound,
                       absl::StrCat("version: model 'demo'", only_version)));
  oip_metadata.set_name(n8k);
  cases.push_back(
      Case(oip_metadata, "name_and_version_long", "name", Code::kNotFound,
           absl::StrCat("version: model ", Cut('n', 8000), only_version)));
  inference::ModelReadyRequest ready;
  ready.set_name("demo");
  ready.set_version(v20k);
  // A version not served is not ready: an answer, not an error.
  cases.push_back(
      Ok(ready, "version_20000_bytes", "version", [](const std::string& bytes) {
        inference::ModelReadyResponse response;
        ASSERT_TRUE(response.ParseFromString(bytes));
        EXPECT_FALSE(response.ready());
      }));
  inference::ModelInferRequest infer;
  infer.set_model_name("layer_norm");
  auto* input = infer.add_inputs();
  input->set_name("input");
  input->set_datatype("FP32");
  input->add_shape(2);
  input->add_shape(4);
  infer.add_raw_input_contents(std::string(32, '\0'));
  const auto infer_case = [&](const char* name, const char* field, auto&& edit,
                              Code code, std::string message) {
    inference::ModelInferRequest r = infer;
    edit(r);
    cases.push_back(Case(r, name, field, code, std::move(message)));
  };
  infer_case(
      "model_version_20000_bytes", "model_version",
      [&](auto& r) { r.set_model_version(v20k); }, Code::kNotFound,
      absl::StrCat("model_version: model 'layer_norm'", only_version));
  infer_case(
      "model_name_200_bytes", "model_name",
      [&](auto& r) { r.set_model_name(std::string(200, 'n')); },
      Code::kNotFound,
      absl::StrCat("model_name: model ", Cut('n', 200),
                   " is not served; served models: attend, attention_session, "
                   "demo, demo_session, layer_norm, multi_head_attend, "
                   "rms_norm"));
  infer_case(
      "input_name_8000_bytes", "inputs.name",
      [&](auto& r) { r.mutable_inputs(0)->set_name(n8k); },
      Code::kInvalidArgument,
      absl::StrCat("inputs: unknown input ", Cut('n', 8000),
                   " for model 'layer_norm'; expected one of input, gamma, "
                   "beta"));
  infer_case(
      "input_datatype_8000_bytes", "inputs.datatype",
      [&](auto& r) { r.mutable_inputs(0)->set_datatype(n8k); },
      Code::kInvalidArgument,
      absl::StrCat("input: datatype ", Cut('n', 8000),
                   " is not supported; expected FP32, BF16, FP16, BOOL or "
                   "UINT8"));
  infer_case(
      "input_parameter_8000_bytes", "inputs.parameters",
      [&](auto& r) {
        (*r.mutable_inputs(0)->mutable_parameters())[n8k].set_bool_param(true);
      },
      Code::kInvalidArgument,
      absl::StrCat("input: unknown parameter ", Cut('n', 8000),
                   "; expected shared_memory_region, shared_memory_offset or "
                   "shared_memory_byte_size"));
  infer_case(
      "output_name_8000_bytes", "outputs.name",
      [&](auto& r) { r.add_outputs()->set_name(n8k); }, Code::kInvalidArgument,
      absl::StrCat("outputs: unknown output ", Cut('n', 8000),
                   " for model 'layer_norm'; expected one of output"));
  infer_case(
      "output_parameter_8000_bytes", "outputs.parameters",
      [&](auto& r) {
        auto* output = r.add_outputs();
        output->set_name("output");
        (*output->mutable_parameters())[n8k].set_int64_param(1);
      },
      Code::kInvalidArgument,
      absl::StrCat("output: unknown parameter ", Cut('n', 8000),
                   "; expected shared_memory_region, shared_memory_offset or "
                   "shared_memory_byte_size"));
  infer_case(
      "parameter_8000_bytes", "parameters",
      [&](auto& r) { (*r.mutable_parameters())[n8k].set_bool_param(true); },
      Code::kInvalidArgument,
      absl::StrCat("parameters: unknown parameter ", Cut('n', 8000),
                   " for model 'layer_norm'; expected one of eps, "
                   "normalized_ndim, rms_norm"));
}

std::string RegionKey() {
  static const std::string key = UniqueSharedMemoryKey("hostile");
  return key;
}

// Every SessionStep case again as the only step of a SessionSteps call: the
// call answers OK and the step's result carries the case's code and message,
// but for the refusals of the whole call (the request limits checked
// before it starts, the deadline estimate), which it answers itself.
void AddBatchedStepCases(std::vector<HostileCase>& cases) {
  std::vector<HostileCase> batched;
  for (const HostileCase& c : cases) {
    if (c.rpc != "SessionStep") continue;
    v1::SessionStepsRequest request;
    EXPECT_TRUE(request.add_steps()->ParseFromString(c.request));
    HostileCase b = c;
    b.rpc = "SessionSteps";
    b.field = c.field.empty() ? "steps" : absl::StrCat("steps.", c.field);
    b.request = request.SerializeAsString();
    const bool whole_call = c.code == Code::kDeadlineExceeded ||
                            absl::StartsWith(c.message, "request:");
    if (c.code == Code::kOk || !whole_call) {
      if (c.code != Code::kOk) {
        b.name =
            absl::StrCat(c.name, "_step_", absl::StatusCodeToString(c.code));
      }
      b.code = Code::kOk;
      b.message = "";
      b.glob = false;
      b.check = [code = c.code, message = c.message, glob = c.glob,
                 check = c.check](const std::string& bytes) {
        v1::SessionStepsResponse response;
        ASSERT_TRUE(response.ParseFromString(bytes));
        ASSERT_EQ(response.results_size(), 1);
        const v1::SessionStepResult& result = response.results(0);
        EXPECT_EQ(static_cast<Code>(result.code()), code) << result.message();
        if (glob) {
          EXPECT_TRUE(GlobMatch(message, result.message()))
              << "message: " << result.message() << "\npattern: " << message;
        } else {
          EXPECT_EQ(result.message(), message);
        }
        if (code == Code::kOk && check) {
          v1::SessionStepResponse single;
          *single.mutable_output() = result.output();
          single.set_length(result.length());
          check(single.SerializeAsString());
        }
      };
    }
    batched.push_back(std::move(b));
  }
  // The call's own refusals, and a session named twice.
  cases.push_back(Invalid(v1::SessionStepsRequest(), "steps_empty", "steps",
                          "steps: empty, expected at least one"));
  v1::SessionStepsRequest many;
  for (int i = 0; i < 257; ++i) *many.add_steps() = SessionStepBase();
  cases.push_back(Case(many, "steps_257", "steps", Code::kResourceExhausted,
                       "steps: 257 steps, more than the 256 one call may "
                       "carry (--max_steps_per_call); split the call"));
  // Refused from its bytes, before a million step messages are decoded.
  HostileCase million =
      Case(v1::SessionStepsRequest(), "steps_1000000_empty", "steps",
           Code::kResourceExhausted,
           "steps: 1000000 steps, more than the 256 one call "
           "may carry (--max_steps_per_call); split the call");
  for (int i = 0; i < 1000000; ++i) million.request.append("\x0a\x00", 2);
  cases.push_back(std::move(million));
  v1::SessionStepsRequest twice;
  *twice.add_steps() = SessionStepBase();
  *twice.add_steps() = SessionStepBase();
  cases.push_back(
      Ok(twice, "session_twice", "steps", [](const std::string& bytes) {
        v1::SessionStepsResponse response;
        ASSERT_TRUE(response.ParseFromString(bytes));
        ASSERT_EQ(response.results_size(), 2);
        EXPECT_EQ(response.results(0).code(), 0);
        EXPECT_EQ(static_cast<Code>(response.results(1).code()),
                  Code::kInvalidArgument);
        EXPECT_EQ(response.results(1).message(),
                  "steps[1]: session_id: also in steps[0]; a call steps each "
                  "session at most once");
      }));
  for (HostileCase& b : batched) cases.push_back(std::move(b));
}

const std::vector<HostileCase>& Table() {
  static const auto* const table = [] {
    auto* cases = new std::vector<HostileCase>();
    AddFieldFamilies(*cases);
    AddNonFiniteValues(*cases);
    AddAttendCases(*cases);
    AddMultiHeadCases(*cases);
    AddLayerNormCases(*cases);
    AddRmsNormCases(*cases);
    AddEmptyDimCases(*cases);
    AddModelRpcCases(*cases);
    AddSharedMemoryRpcCases(*cases, RegionKey());
    AddSessionCases(*cases);
    AddTransferCases(*cases);
    AddWorkCases(*cases);
    AddSessionReservationCases(*cases);
    AddEchoCases(*cases);
    AddBatchedStepCases(*cases);
    return cases;
  }();
  return *table;
}

// ---------------------------------------------------------------------------
// The server, and the summary.

// A model repository with one model, "demo": E 8, 2 heads, PyTorch names.
class DemoRepository {
 public:
  DemoRepository()
      : root_((fs::temp_directory_path() /
               absl::StrCat("attnserve_hostile_", ::getpid()))
                  .string()) {
    fs::remove_all(root_);
    const fs::path dir = fs::path(root_) / kModel;
    fs::create_directories(dir);
    std::ofstream(dir / "config.pbtxt") << "num_heads: 2\n";
    std::mt19937 rng(7);
    NamedTensors t;
    t.emplace("in_proj_weight", RandomTensor(DType::kFloat32, {24, 8}, rng));
    t.emplace("in_proj_bias", RandomTensor(DType::kFloat32, {24}, rng));
    t.emplace("out_proj.weight", RandomTensor(DType::kFloat32, {8, 8}, rng));
    t.emplace("out_proj.bias", RandomTensor(DType::kFloat32, {8}, rng));
    EXPECT_TRUE(
        WriteSafetensors((dir / "weights.safetensors").string(), ViewsOf(t), {})
            .ok());
  }
  ~DemoRepository() { fs::remove_all(root_); }
  const std::string& root() const { return root_; }

 private:
  std::string root_;
};

// Cases run, by expected code, and the pending ones that failed.
std::map<std::string, int>& CountByCode() {
  static auto* counts = new std::map<std::string, int>();
  return *counts;
}
std::vector<std::string>& PendingFailures() {
  static auto* names = new std::vector<std::string>();
  return *names;
}

class Summary : public ::testing::Environment {
 public:
  void TearDown() override {
    if (CountByCode().empty()) return;
    std::vector<std::string> parts;
    for (const auto& [code, count] : CountByCode()) {
      parts.push_back(absl::StrCat(code, " ", count));
    }
    std::printf("hostile-input cases: %s\n",
                absl::StrJoin(parts, ", ").c_str());
    if (!PendingFailures().empty()) {
      std::printf("failing until other branches merge (%zu): %s\n",
                  PendingFailures().size(),
                  absl::StrJoin(PendingFailures(), ", ").c_str());
    }
  }
};
[[maybe_unused]] ::testing::Environment* const summary =
    ::testing::AddGlobalTestEnvironment(new Summary);

class HostileInputTest : public ::testing::TestWithParam<HostileCase> {
 protected:
  static void SetUpTestSuite() {
    repository_ = new DemoRepository();
    ServerOptions options;
    options.model_repository = repository_->root();
    options.max_message_mb = kMaxMessageMb;
    options.max_tensor_elements = kMaxTensorElements;
    options.max_request_memory_mb = kMaxRequestMemoryMb;
    options.metrics_port = -1;
    options.http_port = -1;
    options.log_level = "error";
    // HandOverSession saves its session here.
    options.session_dir =
        (fs::temp_directory_path() /
         absl::StrCat("attnserve_hostile_sessions_", ::getpid()))
            .string();
    server_ = new TestServer(options);
    auto buffer = SharedMemoryBuffer::Create(RegionKey(), kRegionBytes);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    buffer_ = buffer->release();
    AttnClient client = server_->MakeClient();
    v1::SharedMemoryRegion region;
    region.set_name(kRegion);
    region.set_key(RegionKey());
    region.set_byte_size(kRegionBytes);
    ASSERT_TRUE(client.RegisterSharedMemory(region).ok());
    v1::CreateSessionRequest attention;
    attention.set_num_heads(2);
    attention.set_num_kv_heads(1);
    attention.set_head_dim(8);
    attention.set_max_length(kSessionMaxLength);
    v1::CreateSessionRequest model;
    model.set_model(kModel);
    model.set_max_length(kSessionMaxLength);
    session_ids_ = new std::map<std::string, std::string>();
    for (const auto& [placeholder, request] :
         {std::pair{kAttentionSession, attention},
          std::pair{kModelSession, model}, std::pair{kDeleteSession, attention},
          std::pair{kHandOverSession, attention}}) {
      auto created = client.CreateSession(request);
      ASSERT_TRUE(created.ok()) << created.status();
      ASSERT_EQ(created->session_id().size(), std::string(placeholder).size());
      (*session_ids_)[placeholder] = created->session_id();
    }
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    channel_ = new std::shared_ptr<grpc::Channel>(grpc::CreateCustomChannel(
        server_->target(), grpc::InsecureChannelCredentials(), args));
  }
  static void TearDownTestSuite() {
    {
      AttnClient client = server_->MakeClient();
      EXPECT_TRUE(client.UnregisterSharedMemory("").ok());
    }
    delete channel_;
    delete session_ids_;
    delete server_;
    fs::remove_all(fs::temp_directory_path() /
                   absl::StrCat("attnserve_hostile_sessions_", ::getpid()));
    delete buffer_;
    delete repository_;
  }

  // Sends `bytes` to `service`'s `rpc`; the response's bytes go to
  // `response`.
  static grpc::Status Call(const std::string& service, const std::string& rpc,
                           const std::string& bytes, std::string* response,
                           int deadline_seconds = 60) {
    grpc::GenericStub stub(*channel_);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(deadline_seconds));
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1), reply;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&context, absl::StrCat("/", service, "/", rpc),
                   grpc::StubOptions(), &request, &reply,
                   [&done](grpc::Status status) { done.set_value(status); });
    grpc::Status status = done.get_future().get();
    response->clear();
    std::vector<grpc::Slice> slices;
    if (status.ok() && reply.Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) {
        response->append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    return status;
  }

  static DemoRepository* repository_;
  static TestServer* server_;
  static SharedMemoryBuffer* buffer_;
  static std::shared_ptr<grpc::Channel>* channel_;
  // Stand-in -> the id of the session opened for it.
  static std::map<std::string, std::string>* session_ids_;
};
DemoRepository* HostileInputTest::repository_ = nullptr;
TestServer* HostileInputTest::server_ = nullptr;
SharedMemoryBuffer* HostileInputTest::buffer_ = nullptr;
std::shared_ptr<grpc::Channel>* HostileInputTest::channel_ = nullptr;
std::map<std::string, std::string>* HostileInputTest::session_ids_ = nullptr;

TEST_P(HostileInputTest, AnswersWithCodeAndMessage) {
  const HostileCase& c = GetParam();
  ++CountByCode()[absl::StatusCodeToString(c.code)];
  if (c.pending != nullptr) {
    std::printf("(follows \"%s\", implemented on another branch)\n", c.pending);
  }
  std::string response;
  const grpc::Status status =
      Call(c.service, c.rpc, absl::StrReplaceAll(c.request, *session_ids_),
           &response, c.deadline_seconds);
  const auto code = static_cast<Code>(status.error_code());
  const std::string& message = status.error_message();
  EXPECT_NE(code, Code::kInternal) << message;
  EXPECT_NE(code, Code::kUnknown) << message;
  EXPECT_EQ(code, c.code) << absl::CEscape(message.substr(0, 2000));
  if (c.glob) {
    EXPECT_TRUE(GlobMatch(c.message, message))
        << "message: " << absl::CEscape(message.substr(0, 2000))
        << "\npattern: " << c.message;
  } else {
    EXPECT_EQ(message.substr(0, 2000), c.message);
  }
  if (code == Code::kOk && c.code == Code::kOk && c.check) c.check(response);
  if (c.pending != nullptr && HasFailure()) {
    PendingFailures().push_back(TestName(c));
  }
  if (c.cleanup) {
    AttnClient client = server_->MakeClient();
    c.cleanup(client);
  }
  // The server still serves.
  std::string ok;
  const grpc::Status after = Call("attnserve.v1.AttentionService", "Attend",
                                  AttendBase().SerializeAsString(), &ok);
  EXPECT_TRUE(after.ok()) << "server stopped serving: "
                          << after.error_message();
}

INSTANTIATE_TEST_SUITE_P(Table, HostileInputTest, ::testing::ValuesIn(Table()),
                         [](const ::testing::TestParamInfo<HostileCase>& info) {
                           return TestName(info.param);
                         });

// The tensor fields (paths) of `message`, recursively, e.g.
// "weights.q_proj_weight".
void CollectTensorFields(const google::protobuf::Descriptor* message,
                         const std::string& prefix,
                         std::set<std::string>* out) {
  for (int i = 0; i < message->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = message->field(i);
    if (field->message_type() == nullptr) continue;
    const std::string path = prefix + field->name();
    if (field->message_type() == v1::Tensor::descriptor()) {
      out->insert(path);
    } else if (field->message_type()->file() == message->file() &&
               field->message_type() != v1::SharedMemoryRegion::descriptor()) {
      CollectTensorFields(field->message_type(), path + ".", out);
    }
  }
}

TEST(HostileInputTableTest, CoversEveryRpcAndTensorField) {
  const std::vector<HostileCase>& table = Table();
  EXPECT_GE(table.size(), 150u);
  std::set<std::string> names;
  std::map<std::string, std::set<std::string>> fields_by_rpc;
  std::map<std::string, std::set<Code>> codes_by_rpc;
  for (const HostileCase& c : table) {
    EXPECT_TRUE(names.insert(TestName(c)).second) << TestName(c);
    EXPECT_NE(c.code, Code::kInternal) << TestName(c);
    EXPECT_NE(c.code, Code::kUnknown) << TestName(c);
    fields_by_rpc[c.rpc].insert(c.field);
    codes_by_rpc[c.rpc].insert(c.code);
  }
  const google::protobuf::ServiceDescriptor* service =
      v1::AttendRequest::descriptor()->file()->FindServiceByName(
          "AttentionService");
  ASSERT_NE(service, nullptr);
  for (int i = 0; i < service->method_count(); ++i) {
    const google::protobuf::MethodDescriptor* method = service->method(i);
    const std::string rpc = method->name();
    // Every RPC has a valid call and a refused one.
    EXPECT_TRUE(codes_by_rpc[rpc].count(Code::kOk)) << rpc;
    EXPECT_GE(codes_by_rpc[rpc].size(), 2u) << rpc;
    std::set<std::string> tensors;
    CollectTensorFields(method->input_type(), "", &tensors);
    for (const std::string& tensor : tensors) {
      // Every tensor field meets every corruption of the families.
      int family_cases = 0;
      for (const HostileCase& c : table) {
        family_cases += c.rpc == rpc && c.field == tensor;
      }
      EXPECT_GE(family_cases, 17) << rpc << " " << tensor;
    }
  }
}

}  // namespace
}  // namespace attnserve::testing
