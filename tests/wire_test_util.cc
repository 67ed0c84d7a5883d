#include "tests/wire_test_util.h"

#include <utility>

#include "proto/tensor_codec.h"

namespace attnserve::testing {

v1::Tensor ToWire(const TensorView& view) {
  v1::Tensor wire;
  EncodeTensor(view, &wire);
  return wire;
}

v1::Tensor RandomWireTensor(DType dtype, Shape shape, std::mt19937& rng,
                            double keep) {
  return ToWire(RandomTensor(dtype, std::move(shape), rng, keep).view());
}

v1::Tensor RandomWireTensor(DType dtype, Shape shape, uint32_t seed) {
  std::mt19937 rng(seed);
  return RandomWireTensor(dtype, std::move(shape), rng);
}

v1::Tensor WireTensor(v1::DataType dtype, const Shape& shape, std::string raw) {
  v1::Tensor wire;
  wire.set_dtype(dtype);
  wire.mutable_shape()->Assign(shape.begin(), shape.end());
  wire.set_raw_data(std::move(raw));
  return wire;
}

v1::SharedMemoryRef MemoryRef(const std::string& region, uint64_t offset,
                              uint64_t byte_size) {
  v1::SharedMemoryRef ref;
  ref.set_region(region);
  ref.set_offset(offset);
  ref.set_byte_size(byte_size);
  return ref;
}

}  // namespace attnserve::testing
