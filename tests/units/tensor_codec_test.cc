// Wire tensors to core tensors and back: every dtype, raw_data and
// float_data, shared-memory references, and the exact message of every
// refusal (clients see them as INVALID_ARGUMENT details).
#include "proto/tensor_codec.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/tensor.h"
#include "gtest/gtest.h"
#include "tests/wire_test_util.h"

namespace attnserve {
namespace {

using testing::MemoryRef;
using testing::WireTensor;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;

// The little-endian bytes of `values`.
template <typename T>
std::string Bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()),
                     values.size() * sizeof(T));
}

template <typename T>
void ExpectError(const absl::StatusOr<T>& result, absl::StatusCode code,
                 const std::string& message) {
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), code) << result.status();
  EXPECT_EQ(result.status().message(), message);
}

// Hands out its own buffer and records what it was asked for.
class FakeResolver : public SharedMemoryResolver {
 public:
  absl::StatusOr<char*> Resolve(const v1::SharedMemoryRef& ref,
                                uint64_t byte_size, uint64_t alignment,
                                absl::string_view field) override {
    region = ref.region();
    offset = ref.offset();
    asked_bytes = byte_size;
    asked_alignment = alignment;
    asked_field = std::string(field);
    if (ref.region() != "known") {
      return absl::NotFoundError(absl::StrCat(field, ": no region"));
    }
    memory.resize(ref.offset() + byte_size);
    return memory.data() + ref.offset();
  }

  std::string region;
  uint64_t offset = 0;
  uint64_t asked_bytes = 0;
  uint64_t asked_alignment = 0;
  std::string asked_field;
  std::string memory;
};

TEST(TensorCodecTest, DTypesMapBothWays) {
  const std::pair<v1::DataType, DType> pairs[] = {
      {v1::DATA_TYPE_FLOAT32, DType::kFloat32},
      {v1::DATA_TYPE_BFLOAT16, DType::kBFloat16},
      {v1::DATA_TYPE_FLOAT16, DType::kFloat16},
      {v1::DATA_TYPE_BOOL, DType::kBool},
      {v1::DATA_TYPE_UINT8, DType::kUInt8},
      {v1::DATA_TYPE_INT8, DType::kInt8}};
  for (const auto& [wire, core] : pairs) {
    auto decoded = DTypeFromProto(wire, "x");
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(*decoded, core);
    EXPECT_EQ(DTypeToProto(core), wire);
  }
}

TEST(TensorCodecTest, UnspecifiedAndUnknownDTypesAreRefused) {
  ExpectError(DTypeFromProto(v1::DATA_TYPE_UNSPECIFIED, "query"), kInvalid,
              "query: dtype is DATA_TYPE_UNSPECIFIED, expected one of "
              "DATA_TYPE_FLOAT32, DATA_TYPE_BFLOAT16, DATA_TYPE_FLOAT16, "
              "DATA_TYPE_BOOL, DATA_TYPE_UINT8");
  ExpectError(DTypeFromProto(99, "query"), kInvalid,
              "query: dtype 99 is not a known DataType");
  // The same messages from a whole tensor.
  v1::Tensor unknown =
      WireTensor(v1::DATA_TYPE_FLOAT32, {1}, Bytes<float>({1}));
  unknown.set_dtype(static_cast<v1::DataType>(7));
  ExpectError(DecodeTensor(unknown, "key"), kInvalid,
              "key: dtype 7 is not a known DataType");
  v1::Tensor unspecified;
  unspecified.add_shape(1);
  ExpectError(DecodeTensor(unspecified, "key"), kInvalid,
              "key: dtype is DATA_TYPE_UNSPECIFIED, expected one of "
              "DATA_TYPE_FLOAT32, DATA_TYPE_BFLOAT16, DATA_TYPE_FLOAT16, "
              "DATA_TYPE_BOOL, DATA_TYPE_UINT8");
}

// INT8 names a session cache's dtype; no tensor may have it, however its
// bytes come.
TEST(TensorCodecTest, Int8TensorsAreRefused) {
  const std::string message =
      "value: dtype DATA_TYPE_INT8 is a session cache dtype only "
      "(CreateSessionRequest.dtype or cache_dtype), not a tensor's";
  ExpectError(DecodeTensor(WireTensor(v1::DATA_TYPE_INT8, {3}, "abc"), "value"),
              kInvalid, message);
  v1::Tensor floats;
  floats.set_dtype(v1::DATA_TYPE_INT8);
  floats.add_shape(1);
  floats.add_float_data(1.0f);
  ExpectError(DecodeTensor(floats, "value"), kInvalid, message);
}

TEST(TensorCodecTest, DecodesRawDataOfEveryDTypeInPlace) {
  struct Case {
    v1::DataType wire;
    DType dtype;
    Shape shape;
    std::string raw;
  };
  const Case cases[] = {
      {v1::DATA_TYPE_FLOAT32,
       DType::kFloat32,
       {2, 2},
       Bytes<float>({1.5f, -2.0f, 0.25f, 3e38f})},
      // bfloat16 1.0 and -2.0, float16 1.0 and 65504.
      {v1::DATA_TYPE_BFLOAT16,
       DType::kBFloat16,
       {2},
       Bytes<uint16_t>({0x3f80, 0xc000})},
      {v1::DATA_TYPE_FLOAT16,
       DType::kFloat16,
       {1, 2},
       Bytes<uint16_t>({0x3c00, 0x7bff})},
      {v1::DATA_TYPE_BOOL, DType::kBool, {3}, Bytes<uint8_t>({1, 0, 1})},
      {v1::DATA_TYPE_UINT8, DType::kUInt8, {3, 1}, Bytes<uint8_t>({0, 7, 255})},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(DTypeName(c.dtype));
    const v1::Tensor wire = WireTensor(c.wire, c.shape, c.raw);
    auto view = DecodeTensor(wire, "x");
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->dtype, c.dtype);
    EXPECT_EQ(view->shape, c.shape);
    // No copy: the view reads the message's bytes.
    EXPECT_EQ(view->data, wire.raw_data().data());
    EXPECT_EQ(std::memcmp(view->data, c.raw.data(), c.raw.size()), 0);
  }
}

TEST(TensorCodecTest, ScalarsAndEmptyTensors) {
  // The view reads the message's bytes: the message must outlive it.
  const v1::Tensor scalar_wire =
      WireTensor(v1::DATA_TYPE_FLOAT32, {}, Bytes<float>({4.0f}));
  auto scalar = DecodeTensor(scalar_wire, "x");
  ASSERT_TRUE(scalar.ok()) << scalar.status();
  EXPECT_TRUE(scalar->shape.empty());
  EXPECT_EQ(*static_cast<const float*>(scalar->data), 4.0f);
  // Zero elements need zero bytes.
  const v1::Tensor empty_wire = WireTensor(v1::DATA_TYPE_BFLOAT16, {3, 0}, "");
  auto empty = DecodeTensor(empty_wire, "x");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->shape, (Shape{3, 0}));
  EXPECT_EQ(empty->num_elements(), 0);
}

TEST(TensorCodecTest, DecodesFloatDataInPlace) {
  v1::Tensor wire;
  wire.set_dtype(v1::DATA_TYPE_FLOAT32);
  wire.add_shape(3);
  for (float v : {1.0f, -0.5f, 8.0f}) wire.add_float_data(v);
  auto view = DecodeTensor(wire, "x");
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->dtype, DType::kFloat32);
  EXPECT_EQ(view->shape, (Shape{3}));
  EXPECT_EQ(view->data, wire.float_data().data());
  const float* values = static_cast<const float*>(view->data);
  EXPECT_EQ(values[0], 1.0f);
  EXPECT_EQ(values[1], -0.5f);
  EXPECT_EQ(values[2], 8.0f);
}

TEST(TensorCodecTest, FloatDataOnlyForFloat32AndWithEveryValue) {
  v1::Tensor bf16;
  bf16.set_dtype(v1::DATA_TYPE_BFLOAT16);
  bf16.add_shape(1);
  bf16.add_float_data(1.0f);
  ExpectError(DecodeTensor(bf16, "value"), kInvalid,
              "value: float_data is only for DATA_TYPE_FLOAT32, dtype is "
              "DATA_TYPE_BFLOAT16");
  v1::Tensor short_data;
  short_data.set_dtype(v1::DATA_TYPE_FLOAT32);
  short_data.add_shape(2);
  short_data.add_shape(2);
  for (float v : {1.0f, 2.0f, 3.0f}) short_data.add_float_data(v);
  ExpectError(DecodeTensor(short_data, "value"), kInvalid,
              "value: float_data has 3 values, expected 4 for shape [2, 2]");
}

TEST(TensorCodecTest, RawDataMustHoldExactlyShapeTimesDTypeSize) {
  ExpectError(DecodeTensor(WireTensor(v1::DATA_TYPE_FLOAT32, {2, 2},
                                      Bytes<float>({1, 2, 3})),
                           "query"),
              kInvalid,
              "query: raw_data has 12 bytes, expected 16 (shape [2, 2] x 4 "
              "bytes of FLOAT32)");
  ExpectError(DecodeTensor(WireTensor(v1::DATA_TYPE_FLOAT16, {3},
                                      Bytes<uint16_t>({1, 2, 3, 4})),
                           "query"),
              kInvalid,
              "query: raw_data has 8 bytes, expected 6 (shape [3] x 2 bytes "
              "of FLOAT16)");
  // No data at all is the same error.
  ExpectError(
      DecodeTensor(WireTensor(v1::DATA_TYPE_BOOL, {5}, ""), "attn_mask"),
      kInvalid,
      "attn_mask: raw_data has 0 bytes, expected 5 (shape [5] x 1 "
      "bytes of BOOL)");
}

TEST(TensorCodecTest, ExactlyOneSourceOfValues) {
  v1::Tensor both = WireTensor(v1::DATA_TYPE_FLOAT32, {1}, Bytes<float>({1}));
  both.add_float_data(1.0f);
  ExpectError(DecodeTensor(both, "x"), kInvalid,
              "x: both raw_data and float_data are set, expected exactly one");
  v1::Tensor raw_and_shared =
      WireTensor(v1::DATA_TYPE_FLOAT32, {1}, Bytes<float>({1}));
  *raw_and_shared.mutable_shared_memory() = MemoryRef("known", 0, 4);
  ExpectError(DecodeTensor(raw_and_shared, "x"), kInvalid,
              "x: both shared_memory and raw_data are set, expected exactly "
              "one");
  v1::Tensor floats_and_shared;
  floats_and_shared.set_dtype(v1::DATA_TYPE_FLOAT32);
  floats_and_shared.add_shape(1);
  floats_and_shared.add_float_data(1.0f);
  *floats_and_shared.mutable_shared_memory() = MemoryRef("known", 0, 4);
  ExpectError(DecodeTensor(floats_and_shared, "x"), kInvalid,
              "x: both shared_memory and float_data are set, expected exactly "
              "one");
}

// The largest shapes whose bytes fit in int64 pass (their size is the
// byte limit's to refuse); one element more overflows, with or without an
// overflowing product.
TEST(TensorCodecTest, ShapesUpToTheInt64ByteLimitAreCounted) {
  const int64_t limit = std::numeric_limits<int64_t>::max() / 4;  // float32
  const std::vector<std::pair<std::vector<int64_t>, int64_t>> fits = {
      {{limit}, limit},
      {{3, limit / 3}, 3 * (limit / 3)},
      {{limit, 1, 0}, 0},
  };
  for (const auto& [shape, count] : fits) {
    const absl::StatusOr<int64_t> n =
        CheckedNumElements(shape, DType::kFloat32, "shape");
    ASSERT_TRUE(n.ok()) << n.status();
    EXPECT_EQ(*n, count);
  }
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{limit + 1},
                                         {3, limit / 3 + 1},
                                         {2, int64_t{1} << 62},
                                         {0, limit, 2}}) {
    const absl::StatusOr<int64_t> n =
        CheckedNumElements(shape, DType::kFloat32, "shape");
    ASSERT_FALSE(n.ok()) << ShapeString(shape);
    EXPECT_NE(n.status().message().find("overflows 64-bit size"),
              std::string::npos)
        << n.status();
  }
}

TEST(TensorCodecTest, ShapeErrors) {
  ExpectError(
      DecodeTensor(WireTensor(v1::DATA_TYPE_FLOAT32, {3, -2}, ""), "key"),
      kInvalid, "key: dim 1 is negative (-2) in shape [3, -2]");
  const int64_t big = int64_t{1} << 31;
  ExpectError(
      DecodeTensor(WireTensor(v1::DATA_TYPE_FLOAT32, {big, big, 2}, ""), "key"),
      kInvalid, "key: shape [2147483648, 2147483648, 2] overflows 64-bit size");
  // Also when a zero dim makes the tensor empty: the operations multiply
  // the other dims among themselves.
  ExpectError(
      DecodeTensor(WireTensor(v1::DATA_TYPE_FLOAT32, {0, big, big, 2}, ""),
                   "input"),
      kInvalid,
      "input: shape [0, 2147483648, 2147483648, 2] overflows 64-bit size");
  auto empty =
      DecodeTensor(WireTensor(v1::DATA_TYPE_FLOAT32, {big, 0, 2}, ""), "x");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->num_elements(), 0);
}

TEST(TensorCodecTest, SharedMemoryReferences) {
  v1::Tensor wire;
  wire.set_dtype(v1::DATA_TYPE_FLOAT16);
  wire.add_shape(2);
  wire.add_shape(3);
  *wire.mutable_shared_memory() = MemoryRef("known", 64, 12);
  ExpectError(DecodeTensor(wire, "query"), kInvalid,
              "query.shared_memory: shared memory references are not "
              "accepted here");
  FakeResolver resolver;
  auto view = DecodeTensor(wire, "query", &resolver);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->dtype, DType::kFloat16);
  EXPECT_EQ(view->shape, (Shape{2, 3}));
  EXPECT_EQ(view->data, resolver.memory.data() + 64);
  EXPECT_EQ(resolver.offset, 64u);
  EXPECT_EQ(resolver.asked_bytes, 12u);
  EXPECT_EQ(resolver.asked_alignment, 2u);
  EXPECT_EQ(resolver.asked_field, "query.shared_memory");
  // Inputs take exactly their size.
  wire.mutable_shared_memory()->set_byte_size(16);
  ExpectError(DecodeTensor(wire, "query", &resolver), kInvalid,
              "query.shared_memory: shared_memory.byte_size is 16, expected "
              "12 bytes");
  // The resolver's own errors come through unchanged.
  *wire.mutable_shared_memory() = MemoryRef("gone", 0, 12);
  ExpectError(DecodeTensor(wire, "query", &resolver),
              absl::StatusCode::kNotFound, "query.shared_memory: no region");
}

TEST(TensorCodecTest, EncodeRoundTripsEveryDType) {
  const std::vector<std::pair<DType, std::string>> cases = {
      {DType::kFloat32, Bytes<float>({1.5f, -2.0f, 0.0f, 7.0f, 1e-3f, 9.0f})},
      {DType::kBFloat16, Bytes<uint16_t>({0x3f80, 0xc000, 1, 2, 3, 4})},
      {DType::kFloat16, Bytes<uint16_t>({0x3c00, 0x7bff, 5, 6, 7, 8})},
      {DType::kBool, Bytes<uint8_t>({1, 0, 1, 1, 0, 0})},
      {DType::kUInt8, Bytes<uint8_t>({0, 7, 255, 3, 4, 5})},
  };
  for (const auto& [dtype, bytes] : cases) {
    SCOPED_TRACE(DTypeName(dtype));
    const TensorView view{dtype, {2, 3}, bytes.data()};
    v1::Tensor wire;
    EncodeTensor(view, &wire);
    EXPECT_EQ(wire.dtype(), DTypeToProto(dtype));
    EXPECT_EQ(std::vector<int64_t>(wire.shape().begin(), wire.shape().end()),
              (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(wire.raw_data(), bytes);
    EXPECT_EQ(wire.float_data_size(), 0);
    auto copy = CopyTensor(wire, "x");
    ASSERT_TRUE(copy.ok()) << copy.status();
    EXPECT_EQ(copy->dtype(), dtype);
    EXPECT_EQ(copy->shape(), (Shape{2, 3}));
    // A copy, not a view of the message.
    EXPECT_NE(copy->data(), static_cast<const void*>(wire.raw_data().data()));
    EXPECT_EQ(
        std::string(static_cast<const char*>(copy->data()), copy->num_bytes()),
        bytes);
  }
}

TEST(TensorCodecTest, CopyTensorReportsDecodeErrors) {
  ExpectError(CopyTensor(WireTensor(v1::DATA_TYPE_UINT8, {4}, "abc"), "output"),
              kInvalid,
              "output: raw_data has 3 bytes, expected 4 (shape [4] x 1 bytes "
              "of UINT8)");
}

TEST(WireResultsTest, ResultsGoIntoTheResponsesRawData) {
  v1::Tensor output, weights;
  WireResults results(&output, &weights);
  auto out = results.Allocate("output", DType::kBFloat16, {2, 5});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(output.dtype(), v1::DATA_TYPE_BFLOAT16);
  EXPECT_EQ(std::vector<int64_t>(output.shape().begin(), output.shape().end()),
            (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(output.raw_data().size(), 20u);
  EXPECT_EQ(*out, static_cast<void*>(output.mutable_raw_data()->data()));
  auto w = results.Allocate("weights", DType::kFloat32, {5, 5});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(weights.raw_data().size(), 100u);
  EXPECT_FALSE(output.has_shared_memory());
}

TEST(WireResultsTest, UnknownOrMissingResultsAreInternalErrors) {
  v1::Tensor output;
  WireResults results(&output, /*weights=*/nullptr);
  ExpectError(results.Allocate("weights", DType::kFloat32, {1}),
              absl::StatusCode::kInternal, "no wire tensor for result weights");
  ExpectError(results.Allocate("other", DType::kFloat32, {1}),
              absl::StatusCode::kInternal, "no wire tensor for result other");
}

TEST(WireResultsTest, ResultsTooLargeAreRefusedBeforeAllocation) {
  v1::Tensor output;
  WireResults results(&output, nullptr);
  ExpectError(results.Allocate("output", DType::kFloat32, {1 << 20, 1 << 10}),
              absl::StatusCode::kResourceExhausted,
              "a FLOAT32 tensor of shape [1048576, 1024] needs 4294967296 "
              "bytes, above the limit of 2147483648 bytes per tensor");
  EXPECT_TRUE(output.raw_data().empty());
}

TEST(WireResultsTest, ResultRegionsPutResultsInSharedMemory) {
  v1::ResultRegions regions;
  *regions.mutable_output() = MemoryRef("known", 128, 64);
  v1::Tensor output, weights;
  FakeResolver resolver;
  WireResults results(&output, &weights, &regions, &resolver);
  auto out = results.Allocate("output", DType::kFloat32, {2, 4});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, static_cast<void*>(resolver.memory.data() + 128));
  EXPECT_EQ(resolver.asked_bytes, 32u);
  EXPECT_EQ(resolver.asked_alignment, 4u);
  EXPECT_EQ(resolver.asked_field, "result_regions.output");
  // The response names the region and the bytes written, and carries none.
  EXPECT_TRUE(output.raw_data().empty());
  EXPECT_EQ(output.shared_memory().region(), "known");
  EXPECT_EQ(output.shared_memory().offset(), 128u);
  EXPECT_EQ(output.shared_memory().byte_size(), 32u);
  EXPECT_EQ(output.dtype(), v1::DATA_TYPE_FLOAT32);
  // Weights without a region of their own go into raw_data.
  auto w = results.Allocate("weights", DType::kFloat32, {2, 2});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(weights.raw_data().size(), 16u);
  EXPECT_FALSE(weights.has_shared_memory());
}

TEST(WireResultsTest, ResultRegionErrors) {
  v1::ResultRegions regions;
  *regions.mutable_output() = MemoryRef("known", 0, 8);
  v1::Tensor output;
  FakeResolver resolver;
  // Results need at least their size.
  WireResults small(&output, nullptr, &regions, &resolver);
  ExpectError(small.Allocate("output", DType::kFloat32, {4}), kInvalid,
              "result_regions.output: shared_memory.byte_size is 8, needs at "
              "least 16 bytes");
  // More room than needed is fine; the response says what was written.
  auto fits = small.Allocate("output", DType::kFloat32, {1});
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(output.shared_memory().byte_size(), 4u);
  WireResults no_resolver(&output, nullptr, &regions, nullptr);
  ExpectError(no_resolver.Allocate("output", DType::kFloat32, {1}), kInvalid,
              "result_regions.output: shared memory references are not "
              "accepted here");
}

}  // namespace
}  // namespace attnserve
