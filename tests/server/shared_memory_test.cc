// Shared memory through a live server: registration and its errors, tensors
// and results by reference against the same calls by value, every reference
// error, authentication, regions that go away or shrink under a call, and a
// 1 GiB tensor past the message-size limit.
#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/shared_memory.h"
#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
constexpr auto kNotFound = absl::StatusCode::kNotFound;

std::unique_ptr<SharedMemoryBuffer> NewBuffer(size_t bytes) {
  auto buffer =
      SharedMemoryBuffer::Create(UniqueSharedMemoryKey("test"), bytes);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  return buffer.ok() ? *std::move(buffer) : nullptr;
}

v1::SharedMemoryRegion RegionOf(const std::string& name,
                                const SharedMemoryBuffer& buffer,
                                uint64_t offset = 0, uint64_t byte_size = 0) {
  v1::SharedMemoryRegion region;
  region.set_name(name);
  region.set_key(buffer.key());
  region.set_offset(offset);
  region.set_byte_size(byte_size > 0 ? byte_size : buffer.size() - offset);
  return region;
}

v1::AttendRequest Attend() {
  v1::AttendRequest r;
  *r.mutable_query() = RandomWireTensor(DType::kFloat32, {2, 4, 3, 16}, 1);
  *r.mutable_key() = RandomWireTensor(DType::kFloat32, {2, 4, 7, 16}, 2);
  *r.mutable_value() = RandomWireTensor(DType::kFloat32, {2, 4, 7, 8}, 3);
  r.set_return_weights(true);
  return r;
}

// Copies `tensor`'s raw_data to `offset` of `buffer` and refers to it there.
void MoveToRegion(SharedMemoryBuffer& buffer, const std::string& region,
                  uint64_t offset, v1::Tensor* tensor) {
  std::memcpy(buffer.data() + offset, tensor->raw_data().data(),
              tensor->raw_data().size());
  v1::SharedMemoryRef* ref = tensor->mutable_shared_memory();
  ref->set_region(region);
  ref->set_offset(offset);
  ref->set_byte_size(tensor->raw_data().size());
  tensor->clear_raw_data();
}

class SharedMemoryTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = new TestServer(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  SharedMemoryTest() : client_(server_->MakeClient()) {}
  ~SharedMemoryTest() override {
    EXPECT_TRUE(client_.UnregisterSharedMemory("").ok());
  }

  // The call fails with `code` and exactly `message`.
  template <typename T>
  void ExpectError(const T& result, absl::StatusCode code,
                   const std::string& message) {
    absl::Status status;
    if constexpr (std::is_same_v<T, absl::Status>) {
      status = result;
    } else {
      status = result.status();
    }
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_EQ(status.message(), message);
  }

  // An Attend request whose tensors live in region "in" of `buffer`, with
  // results in region "out" of the same buffer.
  v1::AttendRequest AttendInRegions(SharedMemoryBuffer& buffer) {
    EXPECT_TRUE(
        client_.RegisterSharedMemory(RegionOf("in", buffer, 0, 8192)).ok());
    EXPECT_TRUE(
        client_.RegisterSharedMemory(RegionOf("out", buffer, 8192)).ok());
    v1::AttendRequest r = Attend();
    MoveToRegion(buffer, "in", 0, r.mutable_query());
    MoveToRegion(buffer, "in", 2048, r.mutable_key());
    MoveToRegion(buffer, "in", 6144, r.mutable_value());
    *r.mutable_result_regions()->mutable_output() = MemoryRef("out", 0, 768);
    *r.mutable_result_regions()->mutable_weights() =
        MemoryRef("out", 1024, 4096);
    return r;
  }

  static TestServer* server_;
  AttnClient client_;
};
TestServer* SharedMemoryTest::server_ = nullptr;

TEST_F(SharedMemoryTest, RegisterListUnregister) {
  auto buffer = NewBuffer(3 * 4096);
  ASSERT_TRUE(client_.RegisterSharedMemory(RegionOf("b", *buffer, 4096)).ok());
  ASSERT_TRUE(
      client_.RegisterSharedMemory(RegionOf("a", *buffer, 0, 100)).ok());
  auto all = client_.ListSharedMemory("");
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->regions_size(), 2);
  EXPECT_EQ(all->regions(0).name(), "a");
  EXPECT_EQ(all->regions(0).key(), buffer->key());
  EXPECT_EQ(all->regions(0).byte_size(), 100u);
  EXPECT_EQ(all->regions(1).name(), "b");
  EXPECT_EQ(all->regions(1).offset(), 4096u);
  EXPECT_EQ(all->regions(1).byte_size(), 2u * 4096);
  auto one = client_.ListSharedMemory("b");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->regions_size(), 1);
  ExpectError(client_.ListSharedMemory("c"), kNotFound,
              "name: shared memory region 'c' is not registered");
  ASSERT_TRUE(client_.UnregisterSharedMemory("a").ok());
  ExpectError(client_.UnregisterSharedMemory("a"), kNotFound,
              "name: shared memory region 'a' is not registered");
  ASSERT_TRUE(client_.UnregisterSharedMemory("").ok());
  EXPECT_EQ(client_.ListSharedMemory("")->regions_size(), 0);
}

TEST_F(SharedMemoryTest, RegistrationErrors) {
  auto buffer = NewBuffer(4096);
  ASSERT_TRUE(client_.RegisterSharedMemory(RegionOf("r", *buffer)).ok());
  ExpectError(client_.RegisterSharedMemory(RegionOf("r", *buffer)),
              absl::StatusCode::kAlreadyExists,
              "name: shared memory region 'r' is already registered; "
              "unregister it first");
  ExpectError(client_.RegisterSharedMemory(RegionOf("", *buffer)), kInvalid,
              "name: must be 1 to 128 characters, got 0");
  ExpectError(client_.RegisterSharedMemory(RegionOf("a/b", *buffer)), kInvalid,
              "name: only letters, digits, '_', '-' and '.' are allowed");
  v1::SharedMemoryRegion region = RegionOf("k", *buffer);
  for (const char* key : {"", "/", "../etc/passwd", "a/b", ".."}) {
    region.set_key(key);
    const absl::Status status = client_.RegisterSharedMemory(region);
    EXPECT_EQ(status.code(), kInvalid) << key;
    EXPECT_TRUE(absl::StartsWith(status.message(),
                                 "key: expected a POSIX shared memory name"))
        << status;
  }
  region.set_key("/attnserve-no-such-object");
  ExpectError(client_.RegisterSharedMemory(region), kNotFound,
              "key: cannot open shared memory object "
              "\"/attnserve-no-such-object\": No such file or directory");
  v1::SharedMemoryRegion empty = RegionOf("z", *buffer);
  empty.set_byte_size(0);
  ExpectError(client_.RegisterSharedMemory(empty), kInvalid,
              "byte_size: must be > 0");
  // Zero means "to the end" in RegionOf; ask for one byte past it.
  ExpectError(client_.RegisterSharedMemory(RegionOf("big", *buffer, 1, 4096)),
              kInvalid,
              absl::StrCat("byte_size: offset 1 + byte_size 4096 exceeds the "
                           "4096 bytes of shared memory object \"",
                           buffer->key(), "\""));
  // The registry is unchanged by the failures.
  EXPECT_EQ(client_.ListSharedMemory("")->regions_size(), 1);
}

TEST_F(SharedMemoryTest, ResultsEqualTheSameCallByValue) {
  auto by_value = client_.Attend(Attend());
  ASSERT_TRUE(by_value.ok()) << by_value.status();
  auto buffer = NewBuffer(4 * 4096);
  v1::AttendRequest r = AttendInRegions(*buffer);
  auto by_reference = client_.Attend(r);
  ASSERT_TRUE(by_reference.ok()) << by_reference.status();
  const v1::Tensor& output = by_reference->output();
  EXPECT_TRUE(output.raw_data().empty());
  EXPECT_EQ(output.shared_memory().region(), "out");
  EXPECT_EQ(output.shared_memory().offset(), 0u);
  EXPECT_EQ(output.shared_memory().byte_size(), 2u * 4 * 3 * 8 * 4);
  EXPECT_EQ(by_reference->weights().shared_memory().byte_size(),
            2u * 4 * 3 * 7 * 4);
  EXPECT_EQ(
      std::memcmp(buffer->data() + 8192, by_value->output().raw_data().data(),
                  by_value->output().raw_data().size()),
      0);
  EXPECT_EQ(std::memcmp(buffer->data() + 8192 + 1024,
                        by_value->weights().raw_data().data(),
                        by_value->weights().raw_data().size()),
            0);
}

TEST_F(SharedMemoryTest, EveryOperationThroughTheClient) {
  for (const std::string& path : GoldenFiles()) {
    auto file = ReadSafetensors(path);
    ASSERT_TRUE(file.ok()) << file.status();
    auto by_value = RunGoldenThroughClient(client_, *file);
    auto by_reference =
        RunGoldenThroughClient(client_, *file, /*shared_memory=*/true);
    ASSERT_TRUE(by_value.ok()) << path << ": " << by_value.status();
    ASSERT_TRUE(by_reference.ok()) << path << ": " << by_reference.status();
    ASSERT_EQ(by_value->size(), by_reference->size()) << path;
    for (const auto& [name, tensor] : *by_value) {
      const Tensor& other = by_reference->at(name);
      ASSERT_EQ(tensor.shape(), other.shape()) << path << " " << name;
      EXPECT_EQ(std::memcmp(tensor.data(), other.data(), tensor.num_bytes()), 0)
          << path << " " << name;
    }
  }
  // The client removed its regions.
  EXPECT_EQ(client_.ListSharedMemory("")->regions_size(), 0);
}

TEST_F(SharedMemoryTest, ReferenceErrors) {
  auto buffer = NewBuffer(4 * 4096);
  const v1::AttendRequest good = AttendInRegions(*buffer);
  ASSERT_TRUE(client_.Attend(good).ok());

  v1::AttendRequest r = good;
  r.mutable_key()->mutable_shared_memory()->set_region("nope");
  ExpectError(client_.Attend(r), kNotFound,
              "key.shared_memory: shared memory region 'nope' is not "
              "registered (RegisterSharedMemory first)");
  r = good;
  r.mutable_value()->mutable_shared_memory()->set_offset(6500);
  ExpectError(client_.Attend(r), kInvalid,
              "value.shared_memory: shared memory offset 6500 + byte_size "
              "1792 exceeds region 'in' of 8192 bytes");
  r = good;
  r.mutable_value()->mutable_shared_memory()->set_offset(~uint64_t{0});
  ExpectError(client_.Attend(r), kInvalid,
              "value.shared_memory: shared memory offset 18446744073709551615 "
              "+ byte_size 1792 exceeds region 'in' of 8192 bytes");
  r = good;
  r.mutable_query()->mutable_shared_memory()->set_byte_size(1000);
  ExpectError(client_.Attend(r), kInvalid,
              "query.shared_memory: shared_memory.byte_size is 1000, "
              "expected 1536 bytes");
  r = good;
  r.mutable_query()->mutable_shared_memory()->set_offset(2);
  ExpectError(client_.Attend(r), kInvalid,
              "query.shared_memory: shared memory offset 2 in region 'in' is "
              "not aligned to 4 bytes (the element size)");
  r = good;
  r.mutable_query()->set_raw_data(std::string(1536, '\0'));
  ExpectError(client_.Attend(r), kInvalid,
              "query: both shared_memory and raw_data are set, expected "
              "exactly one");
  r = good;
  r.mutable_result_regions()->mutable_output()->set_byte_size(700);
  ExpectError(client_.Attend(r), kInvalid,
              "result_regions.output: shared_memory.byte_size is 700, needs "
              "at least 768 bytes");
  r = good;
  r.mutable_result_regions()->mutable_weights()->set_region("gone");
  ExpectError(client_.Attend(r), kNotFound,
              "result_regions.weights: shared memory region 'gone' is not "
              "registered (RegisterSharedMemory first)");
  r = good;
  r.mutable_result_regions()->mutable_weights()->set_offset(8000);
  ExpectError(client_.Attend(r), kInvalid,
              "result_regions.weights: shared memory offset 8000 + byte_size "
              "672 exceeds region 'out' of 8192 bytes");
  // Inline MHA weights and LayerNorm inputs take references too, and refuse
  // the same way.
  v1::LayerNormRequest norm;
  *norm.mutable_input() = RandomWireTensor(DType::kFloat32, {2, 8}, 4);
  *norm.mutable_gamma() = RandomWireTensor(DType::kFloat32, {8}, 5);
  MoveToRegion(*buffer, "in", 0, norm.mutable_gamma());
  norm.mutable_gamma()->mutable_shared_memory()->set_region("x");
  ExpectError(client_.LayerNorm(norm), kNotFound,
              "gamma.shared_memory: shared memory region 'x' is not "
              "registered (RegisterSharedMemory first)");
  // Still serving.
  EXPECT_TRUE(client_.Attend(good).ok());
}

TEST_F(SharedMemoryTest, NonZeroRegionOffset) {
  auto buffer = NewBuffer(3 * 4096);
  // A region that starts inside a page, 8 bytes in.
  ASSERT_TRUE(
      client_.RegisterSharedMemory(RegionOf("mid", *buffer, 4096 + 8)).ok());
  v1::LayerNormRequest norm;
  *norm.mutable_input() = RandomWireTensor(DType::kFloat32, {4, 16}, 6);
  auto by_value = client_.LayerNorm(norm);
  ASSERT_TRUE(by_value.ok());
  std::memcpy(buffer->data() + 4096 + 8 + 64, norm.input().raw_data().data(),
              256);
  norm.mutable_input()->clear_raw_data();
  *norm.mutable_input()->mutable_shared_memory() = MemoryRef("mid", 64, 256);
  *norm.mutable_result_regions()->mutable_output() = MemoryRef("mid", 512, 256);
  auto by_reference = client_.LayerNorm(norm);
  ASSERT_TRUE(by_reference.ok()) << by_reference.status();
  EXPECT_EQ(std::memcmp(buffer->data() + 4096 + 8 + 512,
                        by_value->output().raw_data().data(), 256),
            0);
}

TEST_F(SharedMemoryTest, ShrunkObjectIsRefused) {
  auto buffer = NewBuffer(4 * 4096);
  v1::AttendRequest r = AttendInRegions(*buffer);
  const int fd = shm_open(buffer->key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  ExpectError(
      client_.Attend(r), absl::StatusCode::kFailedPrecondition,
      absl::StrCat("shared memory region 'in': its object \"", buffer->key(),
                   "\" is now 4096 bytes, smaller than offset 0 + "
                   "byte_size 8192; register the region again after "
                   "resizing it"));
}

TEST(SharedMemoryServerTest, LimitOffAndAuthentication) {
  auto buffer = NewBuffer(2 << 20);
  ServerOptions small;
  small.max_shared_memory_mb = 1;
  TestServer limited(small);
  AttnClient client = limited.MakeClient();
  const absl::Status status =
      client.RegisterSharedMemory(RegionOf("big", *buffer));
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(),
            "byte_size: 2097152 more bytes would exceed the 1 MiB of shared "
            "memory this server maps (--max_shared_memory_mb; 0 bytes "
            "registered)");
  EXPECT_TRUE(
      client.RegisterSharedMemory(RegionOf("fits", *buffer, 0, 1 << 20)).ok());

  ServerOptions off;
  off.max_shared_memory_mb = 0;
  TestServer no_shm(off);
  AttnClient no_shm_client = no_shm.MakeClient();
  for (const absl::Status& refused :
       {no_shm_client.RegisterSharedMemory(RegionOf("r", *buffer)),
        no_shm_client.ListSharedMemory("").status()}) {
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(refused.message(),
              "shared memory is off on this server (--max_shared_memory_mb=0)");
  }
  v1::AttendRequest r = Attend();
  r.mutable_query()->clear_raw_data();
  *r.mutable_query()->mutable_shared_memory() = MemoryRef("r", 0, 1536);
  auto call = no_shm_client.Attend(r);
  EXPECT_EQ(call.status().code(), kInvalid);
  EXPECT_EQ(call.status().message(),
            "query.shared_memory: this server has no shared memory");

  // Registration needs the token compute calls need.
  const std::string tokens = ::testing::TempDir() + "/shm_tokens";
  std::ofstream(tokens) << "secret\n";
  ServerOptions secured;
  secured.auth_token_file = tokens;
  TestServer with_auth(secured);
  AttnClient anonymous = with_auth.MakeClient();
  EXPECT_EQ(anonymous.RegisterSharedMemory(RegionOf("r", *buffer)).code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(anonymous.ListSharedMemory("").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(anonymous.UnregisterSharedMemory("").code(),
            absl::StatusCode::kUnauthenticated);
  ClientOptions with_token;
  with_token.target = with_auth.target();
  with_token.token = "secret";
  EXPECT_TRUE(
      AttnClient(with_token).RegisterSharedMemory(RegionOf("r", *buffer)).ok());
}

// Whether this process maps the object `key` (/dev/shm/NAME).
bool Mapped(const std::string& key) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("/dev/shm" + key) != std::string::npos) return true;
  }
  return false;
}

TEST(SharedMemoryServerTest, RegionsAreUnmappedAtShutdown) {
  // An object this process never maps itself, so that only the server's
  // mapping shows in /proc/self/maps.
  const std::string key = UniqueSharedMemoryKey("unmapped");
  const int fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  v1::SharedMemoryRegion region;
  region.set_name("r");
  region.set_key(key);
  region.set_byte_size(4096);
  {
    TestServer server;
    AttnClient client = server.MakeClient();
    ASSERT_TRUE(client.RegisterSharedMemory(region).ok());
    EXPECT_TRUE(Mapped(key));
    ASSERT_TRUE(client.UnregisterSharedMemory("r").ok());
    EXPECT_FALSE(Mapped(key));
    ASSERT_TRUE(client.RegisterSharedMemory(region).ok());
    EXPECT_TRUE(Mapped(key));
  }
  EXPECT_FALSE(Mapped(key));
  shm_unlink(key.c_str());
}

// The registry itself: a region held by a call outlives its unregistration,
// and a region whose object shrinks under a read fails the call instead of
// crashing the process.
TEST(SharedMemoryRegistryTest, HeldRegionOutlivesUnregister) {
  auto buffer = NewBuffer(8192);
  std::memset(buffer->data(), 7, 8192);
  SharedMemoryRegistry registry(1 << 20);
  ASSERT_TRUE(registry.Register({"r", buffer->key(), 0, 8192}).ok());
  CallSharedMemory call(&registry);
  auto data = call.Resolve(MemoryRef("r", 0, 8192), 8192, 4, "input");
  ASSERT_TRUE(data.ok()) << data.status();
  ASSERT_TRUE(registry.Unregister("r").ok());
  EXPECT_EQ(registry.registered_bytes(), 0u);
  EXPECT_EQ((*data)[8191], 7);  // still mapped for the call
  EXPECT_TRUE(call.VerifyIntact().ok());
}

TEST(SharedMemoryRegistryTest, TruncatedUnderAReadFailsTheCall) {
  auto buffer = NewBuffer(4 * 4096);
  std::memset(buffer->data(), 1, 4 * 4096);
  SharedMemoryRegistry registry(1 << 20);
  ASSERT_TRUE(registry.Register({"r", buffer->key(), 0, 4 * 4096}).ok());
  CallSharedMemory call(&registry);
  auto data = call.Resolve(MemoryRef("r", 0, 4 * 4096), 4 * 4096, 4, "input");
  ASSERT_TRUE(data.ok()) << data.status();
  const int fd = shm_open(buffer->key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 0), 0);
  close(fd);
  // Without the guard this read is a SIGBUS; with it, zeros and a failed
  // call.
  volatile char* last_page = *data + 3 * 4096;
  EXPECT_EQ(last_page[5], 0);
  const absl::Status intact = call.VerifyIntact();
  EXPECT_EQ(intact.code(), absl::StatusCode::kFailedPrecondition) << intact;
}

TEST_F(SharedMemoryTest, GibibyteInputPastTheMessageLimit) {
  // [2^18, 1024] FLOAT32: 1 GiB in, 1 GiB out, with a 256 MiB message limit.
  constexpr int64_t kRows = int64_t{1} << 18, kCols = 1024;
  constexpr uint64_t kBytes = uint64_t{kRows} * kCols * 4;
  auto buffer = NewBuffer(2 * kBytes);
  ASSERT_NE(buffer, nullptr);
  float* input = reinterpret_cast<float*>(buffer->data());
  for (int64_t i = 0; i < kRows * kCols; ++i) {
    input[i] = static_cast<float>((i * 7919) % 1024) / 512.0f - 1.0f;
  }
  ASSERT_TRUE(client_.RegisterSharedMemory(RegionOf("big", *buffer)).ok());
  v1::LayerNormRequest norm;
  norm.mutable_input()->set_dtype(v1::DATA_TYPE_FLOAT32);
  norm.mutable_input()->add_shape(kRows);
  norm.mutable_input()->add_shape(kCols);
  *norm.mutable_input()->mutable_shared_memory() = MemoryRef("big", 0, kBytes);
  *norm.mutable_result_regions()->mutable_output() =
      MemoryRef("big", kBytes, kBytes);
  auto response = client_.LayerNorm(norm);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->output().shared_memory().byte_size(), kBytes);
  // Rows spread over the whole tensor, against a double-precision reference.
  const float* output = reinterpret_cast<const float*>(buffer->data() + kBytes);
  for (int64_t row : {int64_t{0}, kRows / 3, kRows - 1}) {
    const float* x = input + row * kCols;
    double mean = 0, var = 0;
    for (int64_t j = 0; j < kCols; ++j) mean += x[j];
    mean /= kCols;
    for (int64_t j = 0; j < kCols; ++j) var += (x[j] - mean) * (x[j] - mean);
    var /= kCols;
    for (int64_t j = 0; j < kCols; j += 97) {
      const double want = (x[j] - mean) / std::sqrt(var + 1e-5);
      EXPECT_NEAR(output[row * kCols + j], want, 1e-4) << row << " " << j;
    }
  }
}

}  // namespace
}  // namespace attnserve::testing
