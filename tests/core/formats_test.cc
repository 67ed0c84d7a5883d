// The dtype table, safetensors reading and writing, and the float
// conversions.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>

#include "core/convert.h"
#include "core/dtype.h"
#include "core/safetensors.h"
#include "gtest/gtest.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {
namespace {

// The names other software gives each dtype: files and requests from
// numpy, safetensors and Open Inference Protocol clients depend on them.
TEST(DTypeTableTest, NamesEveryDTypeInEveryFormat) {
  struct Row {
    DType dtype;
    size_t size;
    const char* name;
    int wire;
    const char* protocol;
    const char* safetensors;
    const char* numpy;
    bool tensor;
  };
  const Row rows[] = {
      {DType::kFloat32, 4, "FLOAT32", 1, "FP32", "F32", "float32", true},
      {DType::kBFloat16, 2, "BFLOAT16", 2, "BF16", "BF16", "bfloat16", true},
      {DType::kFloat16, 2, "FLOAT16", 3, "FP16", "F16", "float16", true},
      {DType::kBool, 1, "BOOL", 4, "BOOL", "BOOL", "bool", true},
      {DType::kUInt8, 1, "UINT8", 5, "UINT8", "U8", "uint8", true},
      // A session cache's dtype only.
      {DType::kInt8, 1, "INT8", 6, "INT8", "I8", "int8", false},
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(row.name);
    EXPECT_EQ(DTypeSize(row.dtype), row.size);
    EXPECT_EQ(DTypeName(row.dtype), row.name);
    EXPECT_EQ(DTypeInfoOf(row.dtype).wire, row.wire);
    EXPECT_EQ(FindDTypeByWire(row.wire), row.dtype);
    // The codecs' lookup by name finds tensor dtypes only.
    const std::optional<DType> named =
        row.tensor ? std::optional<DType>(row.dtype) : std::nullopt;
    EXPECT_EQ(FindDType(&DTypeInfo::name, row.name), named);
    EXPECT_EQ(FindDType(&DTypeInfo::protocol, row.protocol), named);
    EXPECT_EQ(FindDType(&DTypeInfo::safetensors, row.safetensors), named);
    EXPECT_EQ(FindDType(&DTypeInfo::numpy, row.numpy), named);
    EXPECT_EQ(DTypeInfoOf(row.dtype).tensor, row.tensor);
  }
  EXPECT_EQ(FindDTypeByWire(0), std::nullopt);
  EXPECT_EQ(FindDTypeByWire(7), std::nullopt);
  // Names are case-sensitive: "fp32" is no protocol datatype.
  EXPECT_EQ(FindDType(&DTypeInfo::protocol, "fp32"), std::nullopt);
  EXPECT_EQ(FindDType(&DTypeInfo::numpy, "float64"), std::nullopt);
  // The codecs' lists of what they accept leave INT8 out.
  EXPECT_EQ(DTypeNameList(&DTypeInfo::protocol, " or "),
            "FP32, BF16, FP16, BOOL or UINT8");
  EXPECT_EQ(DTypeNameList(&DTypeInfo::safetensors), "F32, BF16, F16, BOOL, U8");
}

TEST(SafetensorsTest, RoundTripsEveryDType) {
  std::mt19937 rng(2);
  std::map<std::string, Tensor> tensors;
  tensors.emplace("a", RandomTensor(DType::kFloat32, {2, 3}, rng));
  tensors.emplace("b", RandomTensor(DType::kBFloat16, {4}, rng));
  tensors.emplace("c", RandomTensor(DType::kFloat16, {1, 1, 5}, rng));
  tensors.emplace("d", RandomTensor(DType::kBool, {7}, rng));
  tensors.emplace("e", RandomTensor(DType::kUInt8, {0, 3}, rng));
  tensors.emplace("f", RandomTensor(DType::kFloat32, {}, rng));
  const std::string path = (std::filesystem::temp_directory_path() /
                            "attnserve_roundtrip.safetensors")
                               .string();
  std::map<std::string, TensorView> views;
  for (const auto& [name, t] : tensors) views.emplace(name, t.view());
  ASSERT_TRUE(WriteSafetensors(path, views, {{"op", "attend"}}).ok());
  auto file = ReadSafetensors(path);
  std::filesystem::remove(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata.at("op"), "attend");
  ASSERT_EQ(file->tensors.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    const Tensor* got = file->Find(name);
    ASSERT_NE(got, nullptr) << name;
    EXPECT_EQ(got->dtype(), t.dtype()) << name;
    EXPECT_EQ(got->shape(), t.shape()) << name;
    EXPECT_EQ(std::memcmp(got->data(), t.data(), t.num_bytes()), 0) << name;
  }
}

std::string WithHeader(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json + data;
}

void ExpectParseError(const std::string& bytes, const std::string& message) {
  auto file = ParseSafetensors(bytes, "f");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(file.status().message(), message);
}

TEST(SafetensorsTest, RejectsMalformedFiles) {
  ExpectParseError("abc", "f: 3 bytes is too short for a safetensors file");
  ExpectParseError(WithHeader("{", ""), "f: header is not a JSON object");
  std::string huge(8, '\xff');
  ExpectParseError(
      huge + "{}",
      "f: header length 18446744073709551615 exceeds the file (10 bytes)");
  ExpectParseError(
      WithHeader(R"({"x":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})",
                 std::string(8, '\0')),
      "f: tensor 'x': dtype F64 not supported (F32, BF16, F16, BOOL, U8)");
  ExpectParseError(
      WithHeader(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})",
                 std::string(4, '\0')),
      "f: tensor 'x': 4 bytes, expected 8 for shape [2] of F32");
  ExpectParseError(
      WithHeader(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,40]}})",
                 std::string(4, '\0')),
      "f: tensor 'x': data_offsets [0, 40] outside the data section of 4 "
      "bytes");
  ExpectParseError(
      WithHeader(R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})",
                 ""),
      "f: tensor 'x': x: dim 0 is negative (-1) in shape [-1]");
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  auto file = ReadSafetensors("/nonexistent/x.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
}

TEST(ConvertTest, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(BFloat16ToFloat(0x3f80), 1.0f);
  // 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: ties go to even.
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(NAN))));
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(-INFINITY)), -INFINITY);
}

TEST(ConvertTest, Float16CoversNormalsSubnormalsAndOverflow) {
  EXPECT_EQ(FloatToFloat16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFloat16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToFloat16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFloat16(70000.0f), 0x7c00);
  EXPECT_EQ(FloatToFloat16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToFloat16(std::ldexp(1.0f, -26)), 0x0000);
  EXPECT_EQ(Float16ToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(Float16ToFloat(0x3555), 0.333251953125f);
  EXPECT_TRUE(std::isnan(Float16ToFloat(FloatToFloat16(NAN))));
  // Every finite half survives a round trip through float.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    if ((bits & 0x7c00) == 0x7c00) continue;
    ASSERT_EQ(FloatToFloat16(Float16ToFloat(uint16_t(bits))), bits) << bits;
  }
}

}  // namespace
}  // namespace attnserve::testing
