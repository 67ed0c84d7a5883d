#include "proto/tensor_codec.h"

#include <array>
#include <cstring>
#include <iterator>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "google/protobuf/descriptor.h"

namespace attnserve {

// The table's wire numbers are the generated enum's, and it has a row for
// every value but DATA_TYPE_UNSPECIFIED.
static_assert(DTypeInfoOf(DType::kFloat32).wire == v1::DATA_TYPE_FLOAT32);
static_assert(DTypeInfoOf(DType::kBFloat16).wire == v1::DATA_TYPE_BFLOAT16);
static_assert(DTypeInfoOf(DType::kFloat16).wire == v1::DATA_TYPE_FLOAT16);
static_assert(DTypeInfoOf(DType::kBool).wire == v1::DATA_TYPE_BOOL);
static_assert(DTypeInfoOf(DType::kUInt8).wire == v1::DATA_TYPE_UINT8);
static_assert(DTypeInfoOf(DType::kInt8).wire == v1::DATA_TYPE_INT8);
static_assert(std::size(kDTypes) + 1 == v1::DataType_ARRAYSIZE);

namespace {

// The rows of the dtypes tensors may have.
std::vector<const DTypeInfo*> TensorDTypes() {
  std::vector<const DTypeInfo*> rows;
  for (const DTypeInfo& info : kDTypes) {
    if (info.tensor) rows.push_back(&info);
  }
  return rows;
}

}  // namespace

absl::StatusOr<DType> DTypeFromProto(int dtype, absl::string_view field) {
  if (const std::optional<DType> found = FindDTypeByWire(dtype)) return *found;
  if (dtype == v1::DATA_TYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": dtype is DATA_TYPE_UNSPECIFIED, expected one of ",
        absl::StrJoin(
            TensorDTypes(), ", ", [](std::string* out, const DTypeInfo* info) {
              out->append(v1::DataType_Name(DTypeToProto(info->dtype)));
            })));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": dtype ", dtype, " is not a known DataType"));
}

v1::DataType DTypeToProto(DType dtype) {
  return static_cast<v1::DataType>(DTypeInfoOf(dtype).wire);
}

namespace {

// The most dims a wire tensor may have. Beyond it the shape is refused
// before anything reads it: a message naming a million dims would not fit
// in the status a client accepts (8 KiB of metadata), and no operation
// needs more (numpy allows 64 too).
constexpr int kMaxRank = 64;

// The memory of a shared-memory reference `ref` that must hold `byte_size`
// bytes of `dtype`: exactly (`exact`, inputs) or at least (results).
absl::StatusOr<char*> ResolveRef(const v1::SharedMemoryRef& ref,
                                 uint64_t byte_size, DType dtype, bool exact,
                                 SharedMemoryResolver* shared_memory,
                                 absl::string_view field) {
  if (shared_memory == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": shared memory references are not accepted here"));
  }
  if (exact ? ref.byte_size() != byte_size : ref.byte_size() < byte_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": shared_memory.byte_size is ", ref.byte_size(),
        exact ? ", expected " : ", needs at least ", byte_size, " bytes"));
  }
  return shared_memory->Resolve(ref, byte_size, DTypeSize(dtype), field);
}

}  // namespace

absl::StatusOr<TensorView> DecodeTensor(const v1::Tensor& tensor,
                                        absl::string_view field,
                                        SharedMemoryResolver* shared_memory) {
  TensorView view;
  ATTN_ASSIGN_OR_RETURN(view.dtype, DTypeFromProto(tensor.dtype(), field));
  if (!DTypeInfoOf(view.dtype).tensor) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": dtype ", v1::DataType_Name(tensor.dtype()),
        " is a session cache dtype only (CreateSessionRequest.dtype or "
        "cache_dtype), not a tensor's"));
  }
  if (tensor.shape_size() > kMaxRank) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": rank ", tensor.shape_size(),
                     ", expected at most ", kMaxRank, " dims"));
  }
  view.shape.assign(tensor.shape().begin(), tensor.shape().end());
  ATTN_ASSIGN_OR_RETURN(const int64_t count,
                        CheckedNumElements(view.shape, view.dtype, field));
  const uint64_t expected_bytes =
      static_cast<uint64_t>(count) * DTypeSize(view.dtype);
  const bool has_raw = !tensor.raw_data().empty();
  const bool has_floats = tensor.float_data_size() > 0;
  const bool has_shared = tensor.has_shared_memory();
  if (has_raw && has_floats) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": both raw_data and float_data are set, expected exactly one"));
  }
  if (has_shared && (has_raw || has_floats)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": both shared_memory and ", has_raw ? "raw_data" : "float_data",
        " are set, expected exactly one"));
  }
  if (has_shared) {
    ATTN_ASSIGN_OR_RETURN(
        view.data,
        ResolveRef(tensor.shared_memory(), expected_bytes, view.dtype,
                   /*exact=*/true, shared_memory,
                   absl::StrCat(field, ".shared_memory")));
    return view;
  }
  if (has_floats) {
    if (view.dtype != DType::kFloat32) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": float_data is only for DATA_TYPE_FLOAT32, dtype is ",
          v1::DataType_Name(DTypeToProto(view.dtype))));
    }
    if (tensor.float_data_size() != count) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": float_data has ", tensor.float_data_size(),
          " values, expected ", count, " for shape ", ShapeString(view.shape)));
    }
    view.data = tensor.float_data().data();
    return view;
  }
  if (tensor.raw_data().size() != expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": raw_data has ", tensor.raw_data().size(), " bytes, expected ",
        expected_bytes, " (shape ", ShapeString(view.shape), " x ",
        DTypeSize(view.dtype), " bytes of ", DTypeName(view.dtype), ")"));
  }
  view.data = tensor.raw_data().data();
  return view;
}

void EncodeTensor(const TensorView& view, v1::Tensor* out) {
  out->set_dtype(DTypeToProto(view.dtype));
  out->mutable_shape()->Assign(view.shape.begin(), view.shape.end());
  out->set_raw_data(static_cast<const char*>(view.data),
                    view.num_elements() * DTypeSize(view.dtype));
}

absl::StatusOr<void*> WireResults::DoAllocate(absl::string_view name,
                                              DType dtype, const Shape& shape) {
  v1::Tensor* tensor = name == "output"    ? output_
                       : name == "weights" ? weights_
                                           : nullptr;
  if (tensor == nullptr) {
    return absl::InternalError(
        absl::StrCat("no wire tensor for result ", name));
  }
  tensor->set_dtype(DTypeToProto(dtype));
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  const uint64_t byte_size = NumElements(shape) * DTypeSize(dtype);
  const v1::SharedMemoryRef* region = nullptr;
  if (regions_ != nullptr) {
    if (name == "output" && regions_->has_output())
      region = &regions_->output();
    if (name == "weights" && regions_->has_weights()) {
      region = &regions_->weights();
    }
  }
  if (region != nullptr) {
    ATTN_ASSIGN_OR_RETURN(
        char* data,
        ResolveRef(*region, byte_size, dtype, /*exact=*/false, shared_memory_,
                   absl::StrCat("result_regions.", name)));
    v1::SharedMemoryRef* written = tensor->mutable_shared_memory();
    *written = *region;
    written->set_byte_size(byte_size);
    return data;
  }
  std::string* bytes = tensor->mutable_raw_data();
  try {
    bytes->resize(byte_size);
  } catch (const std::bad_alloc&) {
    // Memory the estimate allowed but the process does not have now: this
    // call fails, the server goes on.
    return absl::ResourceExhaustedError(
        absl::StrCat(name, ": cannot allocate ", byte_size >> 20,
                     " MiB for the result now; retry later"));
  }
  return bytes->data();
}

absl::StatusOr<Tensor> CopyTensor(const v1::Tensor& tensor,
                                  absl::string_view field,
                                  SharedMemoryResolver* shared_memory) {
  ATTN_ASSIGN_OR_RETURN(TensorView view,
                        DecodeTensor(tensor, field, shared_memory));
  ATTN_ASSIGN_OR_RETURN(Tensor copy, Tensor::Allocate(view.dtype, view.shape));
  if (copy.num_bytes() > 0)
    std::memcpy(copy.data(), view.data, copy.num_bytes());
  return copy;
}

namespace {

// The AttentionWeights field `field` names. The table and the proto share
// the names; tests check every one resolves. Entries of the table are
// looked up once, not by name on every call.
const google::protobuf::FieldDescriptor& WeightFieldDescriptor(
    const MultiHeadWeightField& field) {
  const google::protobuf::Descriptor* message =
      v1::AttentionWeights::descriptor();
  static const auto* const kByTableIndex = [message] {
    auto* descriptors = new std::array<const google::protobuf::FieldDescriptor*,
                                       kMultiHeadWeightFields.size()>();
    for (size_t i = 0; i < kMultiHeadWeightFields.size(); ++i) {
      (*descriptors)[i] =
          message->FindFieldByName(std::string(kMultiHeadWeightFields[i].name));
    }
    return descriptors;
  }();
  const MultiHeadWeightField* first = kMultiHeadWeightFields.data();
  if (&field >= first && &field < first + kMultiHeadWeightFields.size()) {
    return *(*kByTableIndex)[&field - first];
  }
  return *message->FindFieldByName(std::string(field.name));
}

}  // namespace

const v1::Tensor* FindWeightTensor(const v1::AttentionWeights& weights,
                                   const MultiHeadWeightField& field) {
  const google::protobuf::FieldDescriptor& descriptor =
      WeightFieldDescriptor(field);
  const google::protobuf::Reflection* reflection = weights.GetReflection();
  if (!reflection->HasField(weights, &descriptor)) return nullptr;
  // Generated messages hold generated submessages: the cast is exact.
  return static_cast<const v1::Tensor*>(
      &reflection->GetMessage(weights, &descriptor));
}

v1::Tensor* MutableWeightTensor(v1::AttentionWeights* weights,
                                const MultiHeadWeightField& field) {
  return static_cast<v1::Tensor*>(weights->GetReflection()->MutableMessage(
      weights, &WeightFieldDescriptor(field)));
}

absl::StatusOr<MultiHeadWeights> DecodeAttentionWeights(
    const v1::AttentionWeights& weights, SharedMemoryResolver* shared_memory) {
  MultiHeadWeights decoded;
  decoded.num_heads = weights.num_heads();
  decoded.num_kv_heads = weights.num_kv_heads();
  for (const MultiHeadWeightField& field : kMultiHeadWeightFields) {
    const v1::Tensor* tensor = FindWeightTensor(weights, field);
    if (tensor == nullptr) continue;
    ATTN_ASSIGN_OR_RETURN(decoded.*field.member,
                          DecodeTensor(*tensor, field.name, shared_memory));
  }
  return decoded;
}

}  // namespace attnserve
