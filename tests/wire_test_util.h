// Wire tensors and shared-memory references for the suites of the wire codec
// and of the server: random tensors as a client sends them, raw bytes as a
// hostile client may send them. They need only the messages and the core.
#ifndef ATTNSERVE_TESTS_WIRE_TEST_UTIL_H_
#define ATTNSERVE_TESTS_WIRE_TEST_UTIL_H_

#include <cstdint>
#include <random>
#include <string>

#include "attnserve/v1/attention.pb.h"
#include "core/tensor.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {

// `view` as a client sends it: raw_data.
v1::Tensor ToWire(const TensorView& view);

// RandomTensor's values (floating types uniform in [-1, 1), BOOL/UINT8 1
// with probability `keep`) as a wire tensor; by `seed`, the same tensor every
// time.
v1::Tensor RandomWireTensor(DType dtype, Shape shape, std::mt19937& rng,
                            double keep = 0.7);
v1::Tensor RandomWireTensor(DType dtype, Shape shape, uint32_t seed);

// A wire tensor of `dtype`, `shape` and `raw` as they are, whether or not
// they agree: for the checks of the codec.
v1::Tensor WireTensor(v1::DataType dtype, const Shape& shape, std::string raw);

// A reference to `byte_size` bytes at `offset` of the region `region`.
v1::SharedMemoryRef MemoryRef(const std::string& region, uint64_t offset,
                              uint64_t byte_size);

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_WIRE_TEST_UTIL_H_
