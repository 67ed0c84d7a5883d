// attnserve_fuzz_corpus: the seed inputs of the fuzz targets, small valid
// requests of every kind built with the client's request builders
// (client/requests.h) or the Open Inference Protocol's messages and JSON,
// valid safetensors files and model folders, so that they follow the wire
// format when it changes. Every compute seed is checked to succeed through
// its handler before it is written (the deliberately bad JSON bodies, to
// fail).
//
//   attnserve_fuzz_corpus --out=DIR     writes DIR/TARGET/SEED
//   attnserve_fuzz_corpus --check=DIR   exit 1 when DIR (fuzz/corpus) is not
//                                       exactly what --out would write
//
// The seeds are deterministic (seeded values), so fuzz/corpus is the output
// of --out=fuzz/corpus.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.pb.h"
#include "client/requests.h"
#include "client/shared_memory.h"
#include "core/checksum.h"
#include "core/convert.h"
#include "core/results.h"
#include "core/safetensors.h"
#include "core/session_file.h"
#include "core/status_macros.h"
#include "fuzz/fuzz_support.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "inference/grpc_service.pb.h"
#include "nlohmann/json.hpp"
#include "proto/tensor_codec.h"
#include "server/handlers.h"
#include "server/open_inference.h"
#include "server/open_inference_json.h"

namespace attnserve::fuzz {
namespace {

namespace fs = std::filesystem;

// "TARGET/SEED" -> the seed's bytes.
using Seeds = std::map<std::string, std::string>;

[[noreturn]] void Die(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "attnserve_fuzz_corpus: %s: %s\n", what.c_str(),
               status.ToString().c_str());
  std::exit(1);
}

template <typename T>
T Must(const std::string& what, absl::StatusOr<T> value) {
  if (!value.ok()) Die(what, value.status());
  return *std::move(value);
}

// Values uniform in [-1, 1) of a floating dtype.
Tensor Values(DType dtype, Shape shape, std::mt19937& rng) {
  std::vector<float> values(NumElements(shape));
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (float& v : values) v = uniform(rng);
  return Must("values",
              Float32ToTensor(values.data(), std::move(shape), dtype));
}

// A BOOL or UINT8 mask keeping about 3 positions in 4 and the first of
// each row, or a FLOAT32 one of 0 and -inf.
Tensor Mask(DType dtype, Shape shape, std::mt19937& rng) {
  Tensor t = Must("mask", Tensor::Allocate(dtype, shape));
  const int64_t row = shape.empty() ? 1 : shape.back();
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    const bool keep = i % row == 0 || rng() % 4 != 0;
    if (dtype == DType::kFloat32) {
      t.data_as<float>()[i] =
          keep ? 0.0f : -std::numeric_limits<float>::infinity();
    } else {
      t.data_as<uint8_t>()[i] = keep ? 1 : 0;
    }
  }
  return t;
}

// Deterministic: maps (the protocol's parameters) in key order, so that
// the seeds are the same every run.
std::string Bytes(const google::protobuf::Message& message) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    if (!message.SerializeToCodedStream(&coded)) {
      Die("serialize", absl::InternalError(message.GetTypeName()));
    }
  }
  return out;
}

void Expect(const std::string& what, const absl::Status& status) {
  if (!status.ok()) Die(absl::StrCat(what, " does not succeed"), status);
}

// Seeds of the three compute targets, each also placed in shared memory
// for the shared_memory_compute target (with its RPC's tag byte).
class ComputeSeeds {
 public:
  explicit ComputeSeeds(Seeds* seeds) : seeds_(seeds) {}

  void Attend(const std::string& name, const NamedTensors& tensors,
              const OpParams& params) {
    v1::AttendRequest request =
        Must(name, BuildAttendRequest(ViewsOf(tensors), params));
    v1::AttendResponse response;
    Expect(name, HandleAttend(request, &response));
    (*seeds_)["attend/" + name] = Bytes(request);
    Share(name, 0, &request, nullptr, [&](CallControl control) {
      v1::AttendResponse shared;
      return HandleAttend(request, &shared, control);
    });
  }

  void MultiHeadAttend(const std::string& name, const NamedTensors& tensors,
                       const OpParams& params) {
    v1::MultiHeadAttendRequest request =
        Must(name, BuildMultiHeadAttendRequest(ViewsOf(tensors), params));
    v1::MultiHeadAttendResponse response;
    Expect(name, HandleMultiHeadAttend(request, &TinyModels(), &response));
    (*seeds_)["multi_head_attend/" + name] = Bytes(request);
    v1::GetModelMetadataResponse metadata;
    if (!params.model.empty()) {
      v1::GetModelMetadataRequest lookup;
      lookup.set_name(params.model);
      Expect(name, HandleGetModelMetadata(lookup, &TinyModels(), &metadata));
    }
    Share(name, 1, &request, params.model.empty() ? nullptr : &metadata,
          [&](CallControl control) {
            v1::MultiHeadAttendResponse shared;
            return HandleMultiHeadAttend(request, &TinyModels(), &shared,
                                         control);
          });
  }

  void LayerNorm(const std::string& name, const NamedTensors& tensors,
                 const OpParams& params) {
    v1::LayerNormRequest request =
        Must(name, BuildLayerNormRequest(ViewsOf(tensors), params));
    v1::LayerNormResponse response;
    Expect(name, HandleLayerNorm(request, &response));
    (*seeds_)["layer_norm/" + name] = Bytes(request);
    Share(name, 2, &request, nullptr, [&](CallControl control) {
      v1::LayerNormResponse shared;
      return HandleLayerNorm(request, &shared, control);
    });
  }

  // A shared_memory_compute seed written as it is (tag byte + request).
  template <typename Request, typename Run>
  void SharedAsIs(const std::string& name, uint8_t tag, const Request& request,
                  Run run) {
    CallSharedMemory shared_memory(&ComputeRegistry());
    Expect(name, run(CallControl{nullptr, &shared_memory}));
    (*seeds_)["shared_memory_compute/" + name] =
        std::string(1, static_cast<char>(tag)) + Bytes(request);
  }

 private:
  // Moves `request`'s tensors and results into the seed region, as a client
  // placing them in its own buffer would, and checks the call succeeds
  // against ComputeRegistry.
  template <typename Request, typename Run>
  void Share(const std::string& name, uint8_t tag, Request* request,
             const v1::GetModelMetadataResponse* model, Run run) {
    const SharedMemoryPlan plan = Must(name, PlanSharedMemory(*request, model));
    auto buffer =
        Must(name, SharedMemoryBuffer::Create(
                       UniqueSharedMemoryKey("fuzz-corpus"), kSeedRegionBytes));
    SharedMemoryPlacer placer(buffer.get(), kSeedRegion);
    Expect(name, PlaceRequest(plan, placer, request));
    SharedAsIs(name, tag, *request, run);
  }

  Seeds* seeds_;
};

void AddAttendSeeds(ComputeSeeds& add, std::mt19937& rng) {
  const auto f32 = DType::kFloat32;
  NamedTensors t;
  auto reset = [&] { t.clear(); };
  OpParams p;
  t.emplace("query", Values(f32, {1, 3, 4}, rng));
  t.emplace("key", Values(f32, {1, 5, 4}, rng));
  t.emplace("value", Values(f32, {1, 5, 6}, rng));
  add.Attend("basic", t, p);
  reset();
  t.emplace("query", Values(f32, {2, 4}, rng));
  t.emplace("key", Values(f32, {3, 4}, rng));
  t.emplace("value", Values(f32, {3, 2}, rng));
  add.Attend("unbatched", t, p);
  reset();
  t.emplace("query", Values(f32, {2, 2, 3, 4}, rng));
  t.emplace("key", Values(f32, {2, 2, 5, 4}, rng));
  t.emplace("value", Values(f32, {2, 2, 5, 4}, rng));
  t.emplace("attn_mask", Mask(DType::kBool, {3, 5}, rng));
  p = OpParams{};
  p.causal = true;
  p.return_weights = true;
  add.Attend("heads_bool_mask_causal_weights", t, p);
  reset();
  t.emplace("query", Values(DType::kBFloat16, {1, 2, 8}, rng));
  t.emplace("key", Values(DType::kBFloat16, {1, 4, 8}, rng));
  t.emplace("value", Values(DType::kBFloat16, {1, 4, 8}, rng));
  p = OpParams{};
  p.return_weights = true;
  add.Attend("bf16_weights", t, p);
  reset();
  t.emplace("query", Values(DType::kFloat16, {1, 2, 4}, rng));
  t.emplace("key", Values(DType::kFloat16, {1, 3, 4}, rng));
  t.emplace("value", Values(DType::kFloat16, {1, 3, 4}, rng));
  t.emplace("attn_mask", Mask(f32, {1, 2, 3}, rng));
  p = OpParams{};
  p.scale = 0.25f;
  p.temperature = 2.0f;
  add.Attend("f16_float_mask_scale_temperature", t, p);
  reset();
  t.emplace("query", Values(f32, {2, 1, 8}, rng));
  t.emplace("key", Values(f32, {2, 6, 8}, rng));
  t.emplace("value", Values(f32, {2, 6, 8}, rng));
  t.emplace("attn_mask", Mask(DType::kUInt8, {2, 1, 6}, rng));
  p = OpParams{};
  p.compute_bf16 = true;
  add.Attend("one_token_u8_mask_compute_bf16", t, p);
  reset();
}

void AddZeroWidthSeeds(Seeds* seeds) {
  const auto f32 = DType::kFloat32;
  // Operands of width 0: no data and 0 FLOPs, yet up to 2^36 logits if the
  // kernel computed them; the targets check that the inline ones end in
  // time and that the rest stop when cancelled.
  std::mt19937 zero_rng(20261126);  // the other seeds' values stay as they were
  const auto zero_width = [&](const std::string& name, int64_t queries,
                              int64_t keys, int64_t value_dim, bool mask) {
    v1::AttendRequest request;
    for (v1::Tensor* t : {request.mutable_query(), request.mutable_key(),
                          request.mutable_value()}) {
      t->set_dtype(v1::DATA_TYPE_FLOAT32);
      for (int64_t d : {int64_t{1}, int64_t{1}, keys, int64_t{0}}) {
        t->add_shape(d);
      }
    }
    request.mutable_query()->set_shape(2, queries);
    request.mutable_value()->set_shape(3, value_dim);
    EncodeTensor(Values(f32, {1, 1, keys, value_dim}, zero_rng).view(),
                 request.mutable_value());
    if (mask) {
      request.mutable_attn_mask()->set_dtype(v1::DATA_TYPE_BOOL);
      request.mutable_attn_mask()->set_raw_data(std::string(1, '\1'));
    }
    v1::AttendResponse response;
    Expect(name, HandleAttend(request, &response));
    (*seeds)["attend/" + name] = Bytes(request);
  };
  zero_width("zero_width_262144", 262144, 262144, 0, false);
  zero_width("zero_key_width_mean_of_values", 65536, 512, 1, false);
  zero_width("zero_key_width_masked", 65536, 512, 1, true);
  zero_width("no_keys_zeros", 65536, 0, 4, false);
}

void AddMultiHeadSeeds(ComputeSeeds& add, std::mt19937& rng) {
  const auto f32 = DType::kFloat32;
  NamedTensors t;
  auto reset = [&] { t.clear(); };
  OpParams p;
  // By model.
  p = OpParams{};
  p.model = "tiny";
  t.emplace("query", Values(f32, {1, 3, 8}, rng));
  add.MultiHeadAttend("model_self", t, p);
  reset();
  t.emplace("query", Values(f32, {3, 8}, rng));
  add.MultiHeadAttend("model_unbatched", t, p);
  reset();
  t.emplace("query", Values(f32, {2, 3, 8}, rng));
  t.emplace("key", Values(f32, {2, 4, 8}, rng));
  t.emplace("value", Values(f32, {2, 4, 8}, rng));
  t.emplace("key_padding_mask", Mask(DType::kBool, {2, 4}, rng));
  p.return_weights = true;
  p.average_weights = true;
  add.MultiHeadAttend("model_padding_mask_average_weights", t, p);
  reset();
  p = OpParams{};
  p.model = "tiny_cross";
  p.return_weights = true;
  t.emplace("query", Values(f32, {1, 2, 8}, rng));
  t.emplace("key", Values(f32, {1, 3, 4}, rng));
  t.emplace("value", Values(f32, {1, 3, 6}, rng));
  t.emplace("attn_mask", Mask(DType::kBool, {1, 2, 2, 3}, rng));
  add.MultiHeadAttend("model_cross_head_mask", t, p);
  reset();

  // With inline weights.
  p = OpParams{};
  p.num_heads = 2;
  p.causal = true;
  t.emplace("query", Values(f32, {1, 3, 8}, rng));
  t.emplace("in_proj_weight", Values(f32, {24, 8}, rng));
  t.emplace("in_proj_bias", Values(f32, {24}, rng));
  t.emplace("out_proj_weight", Values(f32, {8, 8}, rng));
  t.emplace("out_proj_bias", Values(f32, {8}, rng));
  add.MultiHeadAttend("inline_fused_causal", t, p);
  reset();
  p = OpParams{};
  p.num_heads = 2;
  p.scale = 0.5f;
  p.return_weights = true;
  t.emplace("query", Values(f32, {1, 2, 6}, rng));
  t.emplace("key", Values(f32, {1, 3, 4}, rng));
  t.emplace("value", Values(f32, {1, 3, 2}, rng));
  t.emplace("q_proj_weight", Values(f32, {4, 6}, rng));
  t.emplace("k_proj_weight", Values(f32, {4, 4}, rng));
  t.emplace("v_proj_weight", Values(f32, {6, 2}, rng));
  t.emplace("q_proj_bias", Values(f32, {4}, rng));
  t.emplace("k_proj_bias", Values(f32, {4}, rng));
  t.emplace("v_proj_bias", Values(f32, {6}, rng));
  add.MultiHeadAttend("inline_separate_no_out_proj", t, p);
  reset();
  p = OpParams{};
  p.num_heads = 1;
  p.compute_bf16 = true;
  t.emplace("query", Values(DType::kBFloat16, {1, 2, 4}, rng));
  t.emplace("in_proj_weight", Values(DType::kBFloat16, {12, 4}, rng));
  t.emplace("out_proj_weight", Values(DType::kBFloat16, {4, 4}, rng));
  add.MultiHeadAttend("inline_bf16", t, p);
  reset();
}

void AddLayerNormSeeds(ComputeSeeds& add, std::mt19937& rng) {
  const auto f32 = DType::kFloat32;
  NamedTensors t;
  auto reset = [&] { t.clear(); };
  OpParams p;
  p = OpParams{};
  t.emplace("input", Values(f32, {2, 8}, rng));
  t.emplace("gamma", Values(f32, {8}, rng));
  t.emplace("beta", Values(f32, {8}, rng));
  add.LayerNorm("affine", t, p);
  reset();
  p.normalized_ndim = 2;
  p.eps = 1e-3f;
  t.emplace("input", Values(f32, {2, 3, 4}, rng));
  t.emplace("gamma", Values(f32, {3, 4}, rng));
  add.LayerNorm("two_dims_eps_gamma", t, p);
  reset();
  p = OpParams{};
  t.emplace("input", Values(DType::kBFloat16, {3, 4}, rng));
  add.LayerNorm("bf16_plain", t, p);
  reset();
  t.emplace("input", Values(DType::kFloat16, {5}, rng));
  add.LayerNorm("f16_vector", t, p);
  reset();

  // Tensors in the regions whose windows start off the page ("fuzz_odd")
  // or are tiny ("fuzz_small").
  v1::LayerNormRequest small;
  v1::Tensor* input = small.mutable_input();
  input->set_dtype(v1::DATA_TYPE_FLOAT32);
  input->add_shape(2);
  input->add_shape(8);
  input->mutable_shared_memory()->set_region("fuzz_small");
  input->mutable_shared_memory()->set_byte_size(64);
  v1::SharedMemoryRef* output =
      small.mutable_result_regions()->mutable_output();
  output->set_region("fuzz_odd");
  output->set_offset(2);
  output->set_byte_size(64);
  add.SharedAsIs("layer_norm_small_and_odd_regions", 2, small,
                 [&](CallControl control) {
                   v1::LayerNormResponse response;
                   return HandleLayerNorm(small, &response, control);
                 });
}

// One seed generator's draws, in this order, make the seeds' values: a new
// seed goes at the end of its kind.
void AddComputeSeeds(Seeds* seeds) {
  std::mt19937 rng(20261122);
  ComputeSeeds add(seeds);
  AddAttendSeeds(add, rng);
  AddZeroWidthSeeds(seeds);
  AddMultiHeadSeeds(add, rng);
  AddLayerNormSeeds(add, rng);
}

void AddMetadataSeeds(Seeds* seeds) {
  auto get_metadata = [](const std::string& name) {
    v1::GetModelMetadataRequest r;
    r.set_name(name);
    return Record(1, Bytes(r));
  };
  auto register_region = [](const std::string& name, const std::string& key,
                            uint64_t offset, uint64_t byte_size) {
    v1::RegisterSharedMemoryRequest r;
    r.mutable_region()->set_name(name);
    r.mutable_region()->set_key(key);
    r.mutable_region()->set_offset(offset);
    r.mutable_region()->set_byte_size(byte_size);
    return Record(2, Bytes(r));
  };
  auto unregister = [](const std::string& name) {
    v1::UnregisterSharedMemoryRequest r;
    r.set_name(name);
    return Record(3, Bytes(r));
  };
  auto list = [](const std::string& name) {
    v1::ListSharedMemoryRequest r;
    r.set_name(name);
    return Record(4, Bytes(r));
  };
  const std::string list_models = Record(0, "");
  (*seeds)["metadata_rpcs/models"] = list_models + get_metadata("tiny") +
                                     get_metadata("tiny_cross") +
                                     get_metadata("missing");
  (*seeds)["metadata_rpcs/register_list_unregister"] =
      register_region("a", "@0", 0, 4096) + list("") + list("a") +
      unregister("a") + list("");
  (*seeds)["metadata_rpcs/register_twice_over_limit_unregister_all"] =
      register_region("b", "@1", 100, 1000) + register_region("b", "@1", 0, 8) +
      register_region("c", "@0", 0, uint64_t{2} << 20) +
      register_region("d", "@0", 60000, 10000) + unregister("");
  (*seeds)["metadata_rpcs/bad_names_and_keys"] =
      register_region("", "@0", 0, 8) + register_region("x", "/../etc", 0, 8) +
      register_region("y", "attnserve-fuzz-no-such-object", 0, 8) +
      register_region("z", "@0", 0, 0) + unregister("nothing") + list("nil");
  (*seeds)["metadata_rpcs/server_without_models_or_shared_memory"] =
      Record(0x80, "") + get_metadata("tiny").replace(0, 1, "\x81") +
      register_region("a", "@0", 0, 8).replace(0, 1, "\x82") +
      Record(0x83, "") + Record(0x84, "");
}

void AddSafetensorsAndModelSeeds(Seeds* seeds) {
  std::mt19937 rng(20261123);
  const auto f32 = DType::kFloat32;
  auto serialize = [](const NamedTensors& t,
                      const std::map<std::string, std::string>& metadata) {
    return Must("safetensors", SerializeSafetensors(ViewsOf(t), metadata));
  };
  NamedTensors all;
  all.emplace("f32", Values(f32, {2, 3}, rng));
  all.emplace("bf16", Values(DType::kBFloat16, {4}, rng));
  all.emplace("f16", Values(DType::kFloat16, {1, 2, 2}, rng));
  all.emplace("bool", Mask(DType::kBool, {3}, rng));
  all.emplace("u8", Mask(DType::kUInt8, {2, 2}, rng));
  all.emplace("scalar", Values(f32, {}, rng));
  all.emplace("empty", Values(f32, {0, 3}, rng));
  (*seeds)["safetensors/every_dtype"] =
      serialize(all, {{"format", "pt"}, {"op", "attend"}});
  (*seeds)["safetensors/no_tensors"] = serialize({}, {});

  // Model folders: config.pbtxt and weights.safetensors in one input.
  auto model = [&](const std::string& name, const std::string& config,
                   const NamedTensors& weights) {
    const std::string bytes = serialize(weights, {});
    Must(name, ParseModel("/models/" + name, config, bytes));
    std::string input;
    input.push_back(static_cast<char>(config.size() & 0xff));
    input.push_back(static_cast<char>(config.size() >> 8));
    (*seeds)["model_loader/" + name] = input + config + bytes;
    (*seeds)["safetensors/" + name] = bytes;
  };
  NamedTensors fused;
  fused.emplace("in_proj_weight", Values(f32, {24, 8}, rng));
  fused.emplace("in_proj_bias", Values(f32, {24}, rng));
  fused.emplace("out_proj.weight", Values(f32, {8, 8}, rng));
  fused.emplace("out_proj.bias", Values(f32, {8}, rng));
  model("state_dict", "num_heads: 2\n", fused);
  NamedTensors separate;
  separate.emplace("q_proj_weight", Values(f32, {8, 8}, rng));
  separate.emplace("k_proj_weight", Values(f32, {8, 4}, rng));
  separate.emplace("v_proj_weight", Values(f32, {4, 6}, rng));
  separate.emplace("in_proj_bias", Values(f32, {20}, rng));
  separate.emplace("out_proj_weight", Values(f32, {5, 4}, rng));
  model("separate_bf16_defaults",
        "# kdim 4, vdim 6\nnum_heads: 2\ncompute_dtype: DATA_TYPE_BFLOAT16\n"
        "default_scale: 0.5\ndefault_causal: true\n"
        "description: \"cross-attention\"\n",
        separate);
  NamedTensors bf16;
  bf16.emplace("in_proj_weight", Values(DType::kBFloat16, {12, 4}, rng));
  bf16.emplace("out_proj_bias", Values(f32, {4}, rng));
  bf16.emplace("out_proj_weight", Values(DType::kFloat16, {4, 4}, rng));
  model("mixed_dtypes", "num_heads: 4 compute_dtype: DATA_TYPE_FLOAT32", bf16);
}

using inference::ModelInferRequest;

// Adds input `name` with `tensor`'s values in raw_input_contents.
void AddRawInput(const std::string& name, const Tensor& tensor,
                 ModelInferRequest* request) {
  v1::Tensor wire;
  EncodeTensor(tensor.view(), &wire);
  auto* input = request->add_inputs();
  input->set_name(name);
  input->set_datatype(std::string(ProtocolDatatype(wire.dtype())));
  input->mutable_shape()->CopyFrom(wire.shape());
  request->add_raw_input_contents(wire.raw_data());
}

// Adds input `name` with `tensor`'s values in the typed contents: FP32 as
// fp32_contents, BOOL as bool_contents, UINT8 as uint_contents.
void AddTypedInput(const std::string& name, const Tensor& tensor,
                   ModelInferRequest* request) {
  auto* input = request->add_inputs();
  input->set_name(name);
  input->set_datatype(
      std::string(ProtocolDatatype(DTypeToProto(tensor.dtype()))));
  input->mutable_shape()->Assign(tensor.shape().begin(), tensor.shape().end());
  auto* contents = input->mutable_contents();
  for (int64_t i = 0; i < tensor.num_elements(); ++i) {
    switch (tensor.dtype()) {
      case DType::kFloat32:
        contents->add_fp32_contents(tensor.data_as<float>()[i]);
        break;
      case DType::kBool:
        contents->add_bool_contents(tensor.data_as<uint8_t>()[i] != 0);
        break;
      default:
        contents->add_uint_contents(tensor.data_as<uint8_t>()[i]);
        break;
    }
  }
}

// Adds input `name` of `shape` read from `region` at `offset`.
void AddSharedInput(const std::string& name, const std::string& datatype,
                    const Shape& shape, const std::string& region,
                    int64_t offset, int64_t byte_size,
                    ModelInferRequest* request) {
  auto* input = request->add_inputs();
  input->set_name(name);
  input->set_datatype(datatype);
  input->mutable_shape()->Assign(shape.begin(), shape.end());
  auto* parameters = input->mutable_parameters();
  (*parameters)["shared_memory_region"].set_string_param(region);
  (*parameters)["shared_memory_offset"].set_int64_param(offset);
  (*parameters)["shared_memory_byte_size"].set_int64_param(byte_size);
}

// Asks for output `name`, written to `region` at `offset` unless empty.
void AddOutput(const std::string& name, ModelInferRequest* request,
               const std::string& region = "", uint64_t offset = 0,
               uint64_t byte_size = 0) {
  auto* output = request->add_outputs();
  output->set_name(name);
  if (region.empty()) return;
  auto* parameters = output->mutable_parameters();
  (*parameters)["shared_memory_region"].set_string_param(region);
  (*parameters)["shared_memory_offset"].set_uint64_param(offset);
  (*parameters)["shared_memory_byte_size"].set_uint64_param(byte_size);
}

// The status of `request` through translation and the native handler, with
// ComputeRegistry's regions; an error for calls the targets would not
// compute to the end (beyond the limits, or not inline).
absl::Status InferStatus(ModelInferRequest request) {
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<NativeInferCall> call,
                        NativeInferCall::FromRequest(&request, &TinyModels()));
  const ServerOptions& limits = FuzzServerOptions();
  ATTN_RETURN_IF_ERROR(VerifyWithinLimits(call->cost(),
                                          limits.max_tensor_elements,
                                          limits.max_request_memory_mb << 20));
  if (!RunsInline(call->cost())) {
    return absl::OutOfRangeError("not computed to the end by the targets");
  }
  RefillSharedMemory();
  CallSharedMemory shared_memory(&ComputeRegistry());
  return call->Run(CallControl{nullptr, &shared_memory});
}

// A ModelInfer seed, checked against the status it must get.
void AddInferSeed(Seeds* seeds, const std::string& name,
                  const ModelInferRequest& request) {
  Expect(name, InferStatus(request));
  (*seeds)["open_inference/" + name] = Bytes(request);
}

void SetBoolParameter(ModelInferRequest* r, const std::string& name, bool v) {
  (*r->mutable_parameters())[name].set_bool_param(v);
}
void SetDoubleParameter(ModelInferRequest* r, const std::string& name,
                        double v) {
  (*r->mutable_parameters())[name].set_double_param(v);
}
void SetIntParameter(ModelInferRequest* r, const std::string& name, int64_t v) {
  (*r->mutable_parameters())[name].set_int64_param(v);
}

// The attend model's requests.
void AddProtocolAttendSeeds(Seeds* seeds, std::mt19937& rng) {
  const auto f32 = DType::kFloat32;
  ModelInferRequest r;
  r.set_model_name("attend");
  AddRawInput("query", Values(f32, {1, 3, 4}, rng), &r);
  AddRawInput("key", Values(f32, {1, 5, 4}, rng), &r);
  AddRawInput("value", Values(f32, {1, 5, 6}, rng), &r);
  AddInferSeed(seeds, "attend_raw", r);

  r = ModelInferRequest();
  r.set_model_name("attend");
  r.set_id("typed");
  AddTypedInput("query", Values(f32, {2, 3, 4}, rng), &r);
  AddTypedInput("key", Values(f32, {2, 5, 4}, rng), &r);
  AddTypedInput("value", Values(f32, {2, 5, 4}, rng), &r);
  AddTypedInput("attn_mask", Mask(DType::kBool, {3, 5}, rng), &r);
  SetDoubleParameter(&r, "scale", 0.5);
  AddOutput("output", &r);
  AddOutput("weights", &r);
  AddInferSeed(seeds, "attend_typed_fp32_bool_mask_weights", r);

  r = ModelInferRequest();
  r.set_model_name("attend");
  r.set_model_version("1");
  AddTypedInput("query", Values(f32, {1, 1, 8}, rng), &r);
  AddTypedInput("key", Values(f32, {1, 6, 8}, rng), &r);
  AddTypedInput("value", Values(f32, {1, 6, 8}, rng), &r);
  AddTypedInput("attn_mask", Mask(DType::kUInt8, {1, 1, 6}, rng), &r);
  SetBoolParameter(&r, "return_weights", true);
  SetDoubleParameter(&r, "temperature", 2.0);
  SetBoolParameter(&r, "compute_bf16", true);
  AddInferSeed(seeds, "attend_typed_uint8_mask_temperature", r);

  r = ModelInferRequest();
  r.set_model_name("attend");
  AddRawInput("query", Values(DType::kFloat16, {2, 2, 4}, rng), &r);
  AddRawInput("key", Values(DType::kFloat16, {2, 3, 4}, rng), &r);
  AddRawInput("value", Values(DType::kFloat16, {2, 3, 4}, rng), &r);
  AddRawInput("attn_mask", Mask(DType::kBool, {2, 2, 3}, rng), &r);
  SetBoolParameter(&r, "causal", false);
  AddInferSeed(seeds, "attend_raw_fp16_bool_mask", r);
}

// The other models' requests, and tensors in shared memory.
void AddProtocolModelSeeds(Seeds* seeds, std::mt19937& rng) {
  const auto f32 = DType::kFloat32;
  ModelInferRequest r;
  r.set_model_name("layer_norm");
  AddRawInput("input", Values(f32, {2, 3, 4}, rng), &r);
  AddRawInput("gamma", Values(f32, {3, 4}, rng), &r);
  AddRawInput("beta", Values(f32, {3, 4}, rng), &r);
  SetDoubleParameter(&r, "eps", 1e-3);
  SetIntParameter(&r, "normalized_ndim", 2);
  AddInferSeed(seeds, "layer_norm_params", r);

  r = ModelInferRequest();
  r.set_model_name("layer_norm");
  AddRawInput("input", Values(DType::kBFloat16, {3, 8}, rng), &r);
  AddInferSeed(seeds, "layer_norm_bf16", r);

  r = ModelInferRequest();
  r.set_model_name("multi_head_attend");
  AddRawInput("query", Values(f32, {1, 3, 8}, rng), &r);
  AddRawInput("in_proj_weight", Values(f32, {24, 8}, rng), &r);
  AddRawInput("in_proj_bias", Values(f32, {24}, rng), &r);
  AddRawInput("out_proj_weight", Values(f32, {8, 8}, rng), &r);
  AddRawInput("out_proj_bias", Values(f32, {8}, rng), &r);
  SetIntParameter(&r, "num_heads", 2);
  SetBoolParameter(&r, "causal", true);
  AddInferSeed(seeds, "multi_head_attend_inline_num_heads", r);

  r = ModelInferRequest();
  r.set_model_name("tiny");
  r.set_model_version("1");
  r.set_id("served");
  AddRawInput("query", Values(f32, {2, 3, 8}, rng), &r);
  AddRawInput("key", Values(f32, {2, 4, 8}, rng), &r);
  AddRawInput("value", Values(f32, {2, 4, 8}, rng), &r);
  AddRawInput("key_padding_mask", Mask(DType::kBool, {2, 4}, rng), &r);
  SetBoolParameter(&r, "average_weights", true);
  AddOutput("weights", &r);
  AddInferSeed(seeds, "served_model_padding_mask_weights", r);

  r = ModelInferRequest();
  r.set_model_name("tiny_cross");
  AddRawInput("query", Values(DType::kBFloat16, {1, 2, 8}, rng), &r);
  AddRawInput("key", Values(DType::kBFloat16, {1, 3, 4}, rng), &r);
  AddRawInput("value", Values(DType::kBFloat16, {1, 3, 6}, rng), &r);
  AddInferSeed(seeds, "served_model_cross_bf16", r);

  // Values read from and results written to ComputeRegistry's regions.
  r = ModelInferRequest();
  r.set_model_name("attend");
  AddSharedInput("query", "FP32", {1, 2, 4}, kSeedRegion, 0, 32, &r);
  AddSharedInput("key", "FP32", {1, 3, 4}, kSeedRegion, 64, 48, &r);
  AddSharedInput("value", "FP32", {1, 3, 4}, kSeedRegion, 128, 48, &r);
  AddOutput("output", &r, kSeedRegion, 256, 32);
  AddOutput("weights", &r, "fuzz_odd", 2, 24);
  AddInferSeed(seeds, "shared_memory_inputs_and_outputs", r);
}

void AddOpenInferenceSeeds(Seeds* seeds) {
  std::mt19937 rng(20261124);
  AddProtocolAttendSeeds(seeds, rng);
  AddProtocolModelSeeds(seeds, rng);
}

using json = nlohmann::json;

// `count` values that are multiples of 0.01 in [-1, 1], short in JSON.
std::vector<double> JsonValues(int64_t count, std::mt19937& rng) {
  std::vector<double> values(count);
  std::uniform_int_distribution<int> hundredths(-100, 100);
  for (double& v : values) v = hundredths(rng) / 100.0;
  return values;
}

// A JSON input with flat data.
json JsonInput(const std::string& name, const std::string& datatype,
               const Shape& shape, json data) {
  return {{"name", name},
          {"datatype", datatype},
          {"shape", shape},
          {"data", std::move(data)}};
}

json FlatFloats(const std::string& name, const std::string& datatype,
                const Shape& shape, std::mt19937& rng) {
  return JsonInput(name, datatype, shape, JsonValues(NumElements(shape), rng));
}

// Row-major nested arrays of `shape`, e.g. [[1, 2], [3, 4]].
json Nest(const std::vector<json>& flat, const Shape& shape, size_t dim,
          size_t* next) {
  if (dim == shape.size()) return flat[(*next)++];
  json array = json::array();
  for (int64_t i = 0; i < shape[dim]; ++i) {
    array.push_back(Nest(flat, shape, dim + 1, next));
  }
  return array;
}

json NestedFloats(const std::string& name, const Shape& shape,
                  std::mt19937& rng) {
  const std::vector<double> values = JsonValues(NumElements(shape), rng);
  size_t next = 0;
  return JsonInput(name, "FP32", shape,
                   Nest({values.begin(), values.end()}, shape, 0, &next));
}

json NestedMask(const std::string& name, const Shape& shape,
                std::mt19937& rng) {
  std::vector<json> flat;
  for (int64_t i = 0; i < NumElements(shape); ++i) {
    flat.push_back(i % shape.back() == 0 || rng() % 4 != 0);
  }
  size_t next = 0;
  return JsonInput(name, "BOOL", shape, Nest(flat, shape, 0, &next));
}

// An input whose values follow the JSON part (binary tensor extension).
json BinaryInput(const std::string& name, const Shape& shape, size_t bytes) {
  return {{"name", name},
          {"datatype", "FP32"},
          {"shape", shape},
          {"parameters", {{"binary_data_size", bytes}}}};
}

std::string RawFloats(const Shape& shape, std::mt19937& rng) {
  const std::vector<double> values = JsonValues(NumElements(shape), rng);
  std::string raw;
  for (double v : values) {
    const float f = static_cast<float>(v);
    raw.append(reinterpret_cast<const char*>(&f), sizeof(f));
  }
  return raw;
}

// The index of `model` in kHttpInferModels.
int ModelIndex(const std::string& model) {
  int index = 0;
  while (kHttpInferModels[index] != model) ++index;
  return index;
}

// The status of an HTTP infer call: InferRequestFromJson, then as
// InferStatus.
absl::Status HttpInferStatus(const std::string& input) {
  const std::optional<HttpInferCall> call = ReadHttpInferCall(
      reinterpret_cast<const uint8_t*>(input.data()), input.size());
  ModelInferRequest request;
  request.set_model_name(call->model);
  JsonOutputOptions options;
  ATTN_RETURN_IF_ERROR(
      InferRequestFromJson(call->body, call->json_length, &request, &options));
  return InferStatus(std::move(request));
}

// A ModelInfer seed over HTTP; valid calls (`ok`) must succeed, the others
// fail.
void AddJsonSeed(Seeds* seeds, const std::string& name, bool ok,
                 const std::string& model, const std::string& body,
                 std::optional<uint16_t> json_length = std::nullopt) {
  const std::string input =
      HttpInferInput(ModelIndex(model), json_length, body);
  const absl::Status status = HttpInferStatus(input);
  if (ok) Expect(name, status);
  if (!ok && status.ok()) {
    Die(name, absl::InternalError("a bad seed that succeeds"));
  }
  (*seeds)["open_inference_json/" + name] = input;
}

std::string Text(const json& body) { return body.dump(); }

// Valid calls of every model and tensor form.
void AddJsonCallSeeds(Seeds* seeds, std::mt19937& rng) {
  AddJsonSeed(seeds, "attend_plain", true, "attend",
              Text({{"inputs",
                     {FlatFloats("query", "FP32", {1, 2, 4}, rng),
                      FlatFloats("key", "FP32", {1, 3, 4}, rng),
                      FlatFloats("value", "FP32", {1, 3, 4}, rng)}}}));
  AddJsonSeed(seeds, "attend_nested_mask_binary_weights", true, "attend",
              Text({{"id", "nested"},
                    {"parameters", {{"scale", 0.5}, {"causal", false}}},
                    {"inputs",
                     {NestedFloats("query", {2, 2, 4}, rng),
                      NestedFloats("key", {2, 3, 4}, rng),
                      NestedFloats("value", {2, 3, 2}, rng),
                      NestedMask("attn_mask", {2, 3}, rng)}},
                    {"outputs",
                     {{{"name", "output"}},
                      {{"name", "weights"},
                       {"parameters", {{"binary_data", true}}}}}}}));
  AddJsonSeed(seeds, "layer_norm_half_params_binary_output", true, "layer_norm",
              Text({{"parameters",
                     {{"eps", 1e-5},
                      {"normalized_ndim", 1},
                      {"binary_data_output", true}}},
                    {"inputs",
                     {FlatFloats("input", "FP16", {2, 4}, rng),
                      FlatFloats("gamma", "FP32", {4}, rng),
                      FlatFloats("beta", "BF16", {4}, rng)}}}));
  {
    const std::string query = RawFloats({1, 2, 8}, rng);
    const std::string key = RawFloats({1, 3, 8}, rng);
    const std::string json_part =
        Text({{"inputs",
               {BinaryInput("query", {1, 2, 8}, query.size()),
                BinaryInput("key", {1, 3, 8}, key.size()),
                FlatFloats("value", "FP32", {1, 3, 8}, rng)}},
              {"outputs", {{{"name", "output"}}}}});
    AddJsonSeed(seeds, "served_model_binary_inputs", true, "tiny",
                json_part + query + key, json_part.size());
  }
  AddJsonSeed(seeds, "served_model_cross_bf16", true, "tiny_cross",
              Text({{"inputs",
                     {FlatFloats("query", "BF16", {1, 2, 8}, rng),
                      FlatFloats("key", "BF16", {1, 3, 4}, rng),
                      FlatFloats("value", "BF16", {1, 3, 6}, rng)}}}));
  AddJsonSeed(
      seeds, "multi_head_attend_inline_uint8_mask", true, "multi_head_attend",
      Text({{"parameters", {{"num_heads", 1}, {"compute_bf16", true}}},
            {"inputs",
             {FlatFloats("query", "FP32", {1, 2, 4}, rng),
              FlatFloats("in_proj_weight", "FP32", {12, 4}, rng),
              FlatFloats("out_proj_weight", "FP32", {4, 4}, rng),
              JsonInput("attn_mask", "UINT8", {2, 2}, {1, 0, 1, 1})}}}));
  AddJsonSeed(seeds, "shared_memory", true, "attend",
              Text({{"inputs",
                     {{{"name", "query"},
                       {"datatype", "FP32"},
                       {"shape", {1, 2, 4}},
                       {"parameters",
                        {{"shared_memory_region", kSeedRegion},
                         {"shared_memory_byte_size", 32}}}},
                      FlatFloats("key", "FP32", {1, 3, 4}, rng),
                      FlatFloats("value", "FP32", {1, 3, 4}, rng)}},
                    {"outputs",
                     {{{"name", "output"},
                       {"parameters",
                        {{"shared_memory_region", kSeedRegion},
                         {"shared_memory_offset", 128},
                         {"shared_memory_byte_size", 32}}}}}}}));
}

// Bad calls, each refused at a different step.
void AddJsonRefusalSeeds(Seeds* seeds, std::mt19937& rng) {
  AddJsonSeed(
      seeds, "bad_truncated_json", false, "attend",
      R"({"inputs": [{"name": "query", "datatype": "FP32", "shape": [1)");
  AddJsonSeed(seeds, "bad_count_for_shape", false, "attend",
              Text({{"inputs",
                     {JsonInput("query", "FP32", {2, 3}, {1, 2, 3, 4, 5})}}}));
  {
    const std::string json_part =
        Text({{"inputs", {BinaryInput("query", {1, 1, 8}, 32)}}});
    AddJsonSeed(seeds, "bad_binary_size_beyond_body", false, "tiny",
                json_part + RawFloats({1, 1, 4}, rng), json_part.size());
    AddJsonSeed(seeds, "bad_binary_left_over", false, "tiny",
                json_part + RawFloats({1, 1, 8}, rng) + "tail",
                json_part.size());
  }
  AddJsonSeed(
      seeds, "bad_nesting", false, "attend",
      R"({"inputs": )" + std::string(100, '[') + std::string(100, ']') + "}");
  AddJsonSeed(seeds, "bad_datatype", false, "layer_norm",
              Text({{"inputs", {JsonInput("input", "INT64", {2}, {1, 2})}}}));
  AddJsonSeed(seeds, "bad_utf8", false, "layer_norm", "{\"id\": \"caf\xe9\"}");
  AddJsonSeed(
      seeds, "bad_unknown_model", false, "missing",
      Text({{"inputs", {FlatFloats("query", "FP32", {1, 2, 8}, rng)}}}));
}

void AddOpenInferenceJsonSeeds(Seeds* seeds) {
  std::mt19937 rng(20261125);
  AddJsonCallSeeds(seeds, rng);
  AddJsonRefusalSeeds(seeds, rng);
}

// Requests as clients send them, one connection each: framings, pipelining
// and a few refusals.
void AddHttpSeeds(Seeds* seeds) {
  const std::string get = "GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n";
  const std::string body = R"({"inputs": []})";
  const std::map<std::string, std::string> requests = {
      {"get", get},
      {"pipelined", get + get},
      {"content_length",
       absl::StrCat("POST /v2/models/attend/infer HTTP/1.1\r\nHost: x\r\n"
                    "Content-Length: ",
                    body.size(), "\r\n\r\n", body, get)},
      {"chunked",
       absl::StrCat("POST /v2/models/attend/infer HTTP/1.1\r\nHost: x\r\n"
                    "Transfer-Encoding: chunked\r\n\r\n5;a=b\r\n",
                    body.substr(0, 5), "\r\n", absl::Hex(body.size() - 5),
                    "\r\n", body.substr(5), "\r\n0\r\nT: 1\r\n\r\n", get)},
      {"bodiless_post",
       "POST /v2/repository/index HTTP/1.1\r\nHost: x\r\n\r\n" + get},
      {"http10", "GET /v2 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" + get},
      {"duplicate_length",
       "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
       "Content-Length: 41\r\n\r\n" +
           get},
      {"obs_fold",
       "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n 41\r\n\r\n" + get},
      {"expect",
       "POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
       "Content-Length: 2\r\n\r\n{}"},
  };
  for (const auto& [name, request] : requests) {
    // The first byte picks the size of the pieces the bytes arrive in.
    (*seeds)["http_parser/" + name] = "\x03" + request;
  }
}

// The records in order: the elements of a braced list are evaluated left to
// right, where the operands of + are not (GCC and clang order them
// differently, and the records draw from one random generator).
std::string Join(std::initializer_list<std::string> records) {
  std::string joined;
  for (const std::string& record : records) joined += record;
  return joined;
}

// Seeds of the call_sequence target: series of session, shared-memory and
// compute calls (see call_sequence_fuzzer.cc for the records).

std::string CreateRecord(int heads, int64_t head_dim, int64_t max_length,
                         const std::string& model = "") {
  v1::CreateSessionRequest r;
  if (!model.empty()) r.set_model(model);
  r.set_num_heads(heads);
  r.set_head_dim(head_dim);
  r.set_max_length(max_length);
  return Record(kCreate, Bytes(r));
}

// A step of `n` tokens of session `index` (2 heads, head dim 4).
std::string StepRecord(uint8_t index, int64_t n, int64_t position,
                       std::mt19937& rng) {
  const auto f32 = DType::kFloat32;
  v1::SessionStepRequest r;
  EncodeTensor(Values(f32, {2, n, 4}, rng).view(), r.mutable_query());
  EncodeTensor(Values(f32, {2, n, 4}, rng).view(), r.mutable_key());
  EncodeTensor(Values(f32, {2, n, 4}, rng).view(), r.mutable_value());
  if (position >= 0) r.set_position(position);
  return Record(kStep, std::string(1, static_cast<char>(index)) + Bytes(r));
}
std::string StepRecord(uint8_t index, int64_t n, std::mt19937& rng) {
  return StepRecord(index, n, -1, rng);
}

std::string DeleteRecord(uint8_t index) {
  return Record(kDelete, std::string(1, static_cast<char>(index)));
}

std::string ForkRecord(uint8_t index, int64_t length = -1) {
  v1::ForkSessionRequest r;
  if (length >= 0) r.set_length(length);
  return Record(kFork, std::string(1, static_cast<char>(index)) + Bytes(r));
}

// Sessions stepped, rewound, deleted, expired and evicted.
void AddSessionSequenceSeeds(Seeds* seeds, std::mt19937& rng) {
  const auto f32 = DType::kFloat32;
  (*seeds)["call_sequence/attention_session_steps_rewind_delete"] =
      Join({CreateRecord(2, 4, 16), StepRecord(0, 3, rng),
            StepRecord(0, 1, rng), StepRecord(0, 2, 1, rng),
            StepRecord(0, 13, rng), DeleteRecord(0), StepRecord(0, 1, rng)});

  v1::SessionStepRequest model_step;
  EncodeTensor(Values(f32, {1, 3, 8}, rng).view(), model_step.mutable_input());
  (*seeds)["call_sequence/model_session_and_expiry"] =
      CreateRecord(0, 0, 32, "tiny") +
      Record(kStep, std::string(1, '\0') + Bytes(model_step)) +
      Record(kExpire, std::string(1, '\x05')) +
      Record(kStep, std::string(1, '\0') + Bytes(model_step)) +
      Record(kExpire, std::string(1, '\x0b')) +
      Record(kStep, std::string(1, '\0') + Bytes(model_step));

  // Reservations: refused past the 1 MiB budget, evicted past 2 MiB in all,
  // by count past 4 sessions.
  (*seeds)["call_sequence/reservations_refused_and_evicted"] =
      CreateRecord(8, int64_t{1} << 22, 0) + CreateRecord(8, 1024, 64) +
      CreateRecord(2, 1024, 64) + CreateRecord(2, 1024, 64) +
      CreateRecord(2, 1024, 64) + CreateRecord(2, 4, 16) +
      CreateRecord(2, 4, 16) + CreateRecord(2, 4, 16) +
      Join({CreateRecord(2, 4, 16), StepRecord(0, 2, rng),
            StepRecord(7, 2, rng), DeleteRecord(3)});
}

void AddSharedMemorySequenceSeeds(Seeds* seeds, std::mt19937& rng) {
  const auto f32 = DType::kFloat32;
  // A region registered, written by the client, read and written by a step
  // and by an attention call, then unregistered and used again.
  v1::RegisterSharedMemoryRequest reg;
  reg.mutable_region()->set_name("r");
  reg.mutable_region()->set_key("@0");
  reg.mutable_region()->set_byte_size(4096);
  v1::UnregisterSharedMemoryRequest unreg;
  unreg.set_name("r");
  const auto in_region = [](v1::Tensor* t, uint64_t offset, uint64_t bytes) {
    t->clear_raw_data();
    t->mutable_shared_memory()->set_region("r");
    t->mutable_shared_memory()->set_offset(offset);
    t->mutable_shared_memory()->set_byte_size(bytes);
  };
  v1::SessionStepRequest shared_step;
  for (v1::Tensor* t : {shared_step.mutable_query(), shared_step.mutable_key(),
                        shared_step.mutable_value()}) {
    t->set_dtype(v1::DATA_TYPE_FLOAT32);
    for (int64_t d : {2, 2, 4}) t->add_shape(d);
  }
  in_region(shared_step.mutable_query(), 0, 64);
  in_region(shared_step.mutable_key(), 64, 64);
  in_region(shared_step.mutable_value(), 128, 64);
  v1::SharedMemoryRef* step_output =
      shared_step.mutable_result_regions()->mutable_output();
  step_output->set_region("r");
  step_output->set_offset(1024);
  step_output->set_byte_size(64);
  v1::AttendRequest shared_attend;
  for (v1::Tensor* t :
       {shared_attend.mutable_query(), shared_attend.mutable_key(),
        shared_attend.mutable_value()}) {
    t->set_dtype(v1::DATA_TYPE_FLOAT32);
    for (int64_t d : {2, 4}) t->add_shape(d);
  }
  in_region(shared_attend.mutable_query(), 0, 32);
  in_region(shared_attend.mutable_key(), 32, 32);
  in_region(shared_attend.mutable_value(), 64, 32);
  std::string written(192, '\0');
  const Tensor values = Values(f32, {48}, rng);
  std::memcpy(written.data(), values.data(), written.size());
  (*seeds)["call_sequence/shared_memory_step_compute_unregister"] =
      Record(kRegister, Bytes(reg)) + CreateRecord(2, 4, 16) +
      Record(kWrite, std::string(2, '\0') + written) +
      Record(kStep, std::string(1, '\0') + Bytes(shared_step)) +
      Record(kCompute, std::string(1, '\0') + Bytes(shared_attend)) +
      Record(kUnregister, Bytes(unreg)) +
      Record(kStep, std::string(1, '\0') + Bytes(shared_step)) +
      Record(kRegister, Bytes(reg)) + Record(kRegister, Bytes(reg));
}

// Steps among other calls, batched, counted before parsing, and forked.
void AddStepSequenceSeeds(Seeds* seeds, std::mt19937& rng) {
  const auto f32 = DType::kFloat32;
  // Calls of no FLOPs among the sessions' steps.
  v1::AttendRequest zero;
  for (v1::Tensor* t :
       {zero.mutable_query(), zero.mutable_key(), zero.mutable_value()}) {
    t->set_dtype(v1::DATA_TYPE_FLOAT32);
    for (int64_t d : {1, 1, 262144, 0}) t->add_shape(d);
  }
  (*seeds)["call_sequence/zero_width_compute_between_steps"] =
      Join({CreateRecord(2, 4, 16), StepRecord(0, 1, rng),
            Record(kCompute, std::string(1, '\0') + Bytes(zero)),
            StepRecord(0, 1, rng)});

  // Three sessions stepped in one call, one of them named twice.
  v1::SessionStepsRequest batched;
  for (int i = 0; i < 4; ++i) {
    v1::SessionStepRequest* r = batched.add_steps();
    EncodeTensor(Values(f32, {2, 1, 4}, rng).view(), r->mutable_query());
    EncodeTensor(Values(f32, {2, 1, 4}, rng).view(), r->mutable_key());
    EncodeTensor(Values(f32, {2, 1, 4}, rng).view(), r->mutable_value());
  }
  (*seeds)["call_sequence/batched_steps"] = Join(
      {CreateRecord(2, 4, 16), CreateRecord(2, 4, 16), CreateRecord(2, 4, 16),
       StepRecord(0, 2, rng),
       Record(kSteps, std::string("\x04\x00\x01\x02\x00", 5) + Bytes(batched)),
       DeleteRecord(1),
       Record(kSteps, std::string("\x03\x00\x01\x02", 4) + Bytes(batched))});

  // Steps counted on the bytes before they are parsed: 257 empty ones (one
  // more than the limit) are refused unparsed; fields numbered as steps but
  // not messages count without parsing as steps.
  std::string empty_steps;
  for (int i = 0; i < 257; ++i) empty_steps += std::string("\x0a\x00", 2);
  (*seeds)["call_sequence/steps_counted_before_parsing"] =
      Join({CreateRecord(2, 4, 16),
            Record(kSteps, std::string(1, '\0') + empty_steps),
            Record(kSteps, std::string("\x01\x00", 2) + "\x08\x01\x08\x02" +
                               Bytes(batched))});

  // Forks across a block boundary, stepped and rewound into the shared
  // tokens on both sides, a fork of a fork, the parent deleted first.
  (*seeds)["call_sequence/forks_share_and_copy_on_write"] = Join(
      {CreateRecord(2, 4, 1024), StepRecord(0, 600, rng), ForkRecord(0),
       StepRecord(1, 1, rng), StepRecord(0, 2, 100, rng), ForkRecord(1, 550),
       StepRecord(2, 3, 520, rng), DeleteRecord(0), StepRecord(1, 1, 10, rng),
       StepRecord(2, 1, rng), ForkRecord(0, 100000)});
}

// Session files of small sessions: every cache dtype, several layers, an
// empty one.
// A journal of two full blocks of a small session, a rewind record into
// the second and the second again.
// A session of one head of dim 2 (max_length 1100) holding `tokens`
// random tokens.
std::unique_ptr<DecodeSession> FilledSession(int64_t tokens,
                                             std::mt19937& rng) {
  DecodeSessionConfig config;
  config.num_heads = 1;
  config.key_dim = 2;
  config.max_length = 1100;
  std::unique_ptr<DecodeSession> session =
      Must("session", DecodeSession::Create(config));
  const Tensor q = Values(DType::kFloat32, {1, tokens, 2}, rng);
  DecodeStepInputs in;
  in.query = q.view();
  in.key = q.view();
  in.value = q.view();
  TensorResults results;
  const absl::Status stepped = session->Step(in, {}, results);
  if (!stepped.ok()) Die("session step", stepped);
  return session;
}

std::string Journal(std::mt19937& rng) {
  const std::unique_ptr<DecodeSession> session = FilledSession(1030, rng);
  std::string bytes =
      Must("journal header",
           SessionJournalHeader(*session, "0123456789abcdef0123456789abcdef"));
  std::string rows;
  for (int64_t block : {0, 1, -1, 1}) {
    if (block < 0) {
      bytes += SessionBlockFields(0, kCacheBlockKeys, 0, "");
      continue;
    }
    rows.clear();
    const absl::Status read =
        session->CopyRows(0, block * kCacheBlockKeys, kCacheBlockKeys, rows)
            .status();
    if (!read.ok()) Die("journal block", read);
    bytes +=
        SessionBlockFields(0, block * kCacheBlockKeys, kCacheBlockKeys, rows);
    bytes += rows;
  }
  return bytes;
}

// A file of version 3 of a fork's 600 tokens whose first block is in its
// base file, followed by that base file (the target's input format).
std::string FileWithBase(std::mt19937& rng) {
  const std::unique_ptr<DecodeSession> session = FilledSession(600, rng);
  const auto write = [&](const SessionFileShape& shape) {
    std::string bytes;
    const absl::Status written = WriteSessionFile(
        *session, "0123456789abcdef",
        [&](absl::string_view piece) {
          bytes.append(piece.data(), piece.size());
          return absl::OkStatus();
        },
        /*unconfirmed=*/false, shape);
    if (!written.ok()) Die("session file", written);
    return bytes;
  };
  SessionFileShape prefix;
  prefix.prefix = std::vector<int64_t>{kCacheBlockKeys};
  const std::string base = write(prefix);
  SessionFileShape named;
  named.base = SessionFileBase{{kCacheBlockKeys}, base.size(), Crc32c(base)};
  return write(named) + base;
}

// A journal of a fork of 1030 tokens naming a base file of its first block,
// holding its second block, followed by that base file.
std::string JournalWithBase(std::mt19937& rng) {
  const std::unique_ptr<DecodeSession> session = FilledSession(1030, rng);
  std::string base;
  SessionFileShape prefix;
  prefix.prefix = std::vector<int64_t>{kCacheBlockKeys};
  const absl::Status written = WriteSessionFile(
      *session, "0123456789abcdef",
      [&](absl::string_view piece) {
        base.append(piece.data(), piece.size());
        return absl::OkStatus();
      },
      /*unconfirmed=*/false, prefix);
  if (!written.ok()) Die("base file", written);
  const SessionFileBase named{{kCacheBlockKeys}, base.size(), Crc32c(base)};
  std::string bytes =
      Must("journal header",
           SessionJournalHeader(*session, "0123456789abcdef", &named));
  std::string rows;
  const absl::Status read =
      session->CopyRows(0, kCacheBlockKeys, kCacheBlockKeys, rows).status();
  if (!read.ok()) Die("journal block", read);
  bytes += SessionBlockFields(0, kCacheBlockKeys, kCacheBlockKeys, rows);
  return bytes + rows + base;
}

void AddSessionFileSeeds(Seeds* seeds) {
  std::mt19937 rng(20261127);
  const auto file = [&](DType cache, int64_t layers,
                        std::vector<int64_t> lengths) {
    DecodeSessionConfig config;
    config.num_heads = 2;
    config.num_kv_heads = 1;
    config.key_dim = 4;
    config.value_dim = 2;
    config.cache_dtype = cache;
    config.dtype = cache == DType::kBFloat16 ? cache : DType::kFloat32;
    config.rotary.dims = 2;
    config.max_length = 64;
    config.num_layers = layers;
    std::unique_ptr<DecodeSession> session =
        Must("session", DecodeSession::Create(config));
    for (int64_t layer = 0; layer < layers; ++layer) {
      const int64_t n = lengths[static_cast<size_t>(layer)];
      if (n == 0) continue;
      DecodeStepInputs in;
      in.layer = layer;
      const Tensor q = Values(config.dtype, {2, n, 4}, rng);
      const Tensor k = Values(config.dtype, {1, n, 4}, rng);
      const Tensor v = Values(config.dtype, {1, n, 2}, rng);
      in.query = q.view();
      in.key = k.view();
      in.value = v.view();
      TensorResults results;
      const absl::Status stepped = session->Step(in, {}, results);
      if (!stepped.ok()) Die("session step", stepped);
    }
    std::string bytes;
    const absl::Status written =
        WriteSessionFile(*session, "0123456789abcdef0123456789abcdef",
                         [&](absl::string_view piece) {
                           bytes.append(piece.data(), piece.size());
                           return absl::OkStatus();
                         });
    if (!written.ok()) Die("session file", written);
    return bytes;
  };
  (*seeds)["session_file/float32_one_layer"] = file(DType::kFloat32, 1, {5});
  (*seeds)["session_file/bfloat16_two_layers"] =
      file(DType::kBFloat16, 2, {3, 1});
  (*seeds)["session_file/int8_three_layers"] = file(DType::kInt8, 3, {2, 0, 4});
  (*seeds)["session_file/empty"] = file(DType::kFloat32, 1, {0});
  (*seeds)["session_file/journal"] = Journal(rng);
  (*seeds)["session_file/with_base"] = FileWithBase(rng);
  (*seeds)["session_file/journal_with_base"] = JournalWithBase(rng);
}

void AddCallSequenceSeeds(Seeds* seeds) {
  std::mt19937 rng(20261125);
  AddSessionSequenceSeeds(seeds, rng);
  AddSharedMemorySequenceSeeds(seeds, rng);
  AddStepSequenceSeeds(seeds, rng);
}

Seeds AllSeeds() {
  Seeds seeds;
  AddHttpSeeds(&seeds);
  AddComputeSeeds(&seeds);
  AddMetadataSeeds(&seeds);
  AddSafetensorsAndModelSeeds(&seeds);
  AddOpenInferenceSeeds(&seeds);
  AddOpenInferenceJsonSeeds(&seeds);
  AddCallSequenceSeeds(&seeds);
  AddSessionFileSeeds(&seeds);
  return seeds;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

int Write(const fs::path& out, const Seeds& seeds) {
  for (const auto& [name, bytes] : seeds) {
    fs::create_directories((out / name).parent_path());
    std::ofstream(out / name, std::ios::binary | std::ios::trunc) << bytes;
  }
  std::printf("attnserve_fuzz_corpus: %zu seeds written to %s\n", seeds.size(),
              out.c_str());
  return 0;
}

int Check(const fs::path& dir, const Seeds& seeds) {
  int problems = 0;
  std::set<std::string> present;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) {
      present.insert(fs::relative(entry.path(), dir).generic_string());
    }
  }
  for (const auto& [name, bytes] : seeds) {
    if (present.count(name) == 0) {
      std::fprintf(stderr, "missing: %s\n", name.c_str());
      ++problems;
    } else if (ReadFile(dir / name) != bytes) {
      std::fprintf(stderr, "stale: %s\n", name.c_str());
      ++problems;
    }
  }
  for (const std::string& name : present) {
    if (seeds.count(name) == 0) {
      std::fprintf(stderr, "not generated: %s\n", name.c_str());
      ++problems;
    }
  }
  if (problems > 0) {
    std::fprintf(stderr,
                 "attnserve_fuzz_corpus: %s differs from the generated seeds; "
                 "regenerate with attnserve_fuzz_corpus --out=%s\n",
                 dir.c_str(), dir.c_str());
    return 1;
  }
  std::printf("attnserve_fuzz_corpus: %zu seeds up to date in %s\n",
              seeds.size(), dir.c_str());
  return 0;
}

}  // namespace
}  // namespace attnserve::fuzz

int main(int argc, char** argv) {
  const std::string arg = argc == 2 ? argv[1] : "";
  if (absl::StartsWith(arg, "--out=")) {
    return attnserve::fuzz::Write(arg.substr(6), attnserve::fuzz::AllSeeds());
  }
  if (absl::StartsWith(arg, "--check=")) {
    return attnserve::fuzz::Check(arg.substr(8), attnserve::fuzz::AllSeeds());
  }
  std::fprintf(stderr,
               "usage: attnserve_fuzz_corpus --out=DIR | --check=DIR\n");
  return 2;
}
