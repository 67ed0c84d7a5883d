#include "client/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace attnserve {
namespace {

constexpr uint64_t kAlignment = 64;

uint64_t Aligned(uint64_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

// Product of dims [begin, end) of `tensor`'s shape.
uint64_t Elements(const v1::Tensor& tensor, int begin, int end) {
  uint64_t count = 1;
  for (int i = begin; i < end; ++i) {
    count *= static_cast<uint64_t>(std::max<int64_t>(0, tensor.shape(i)));
  }
  return count;
}

// Bytes of every tensor in `message`, each aligned.
uint64_t TensorBytes(const google::protobuf::Message& message) {
  uint64_t total = 0;
  const google::protobuf::Reflection* reflection = message.GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(message, &fields);
  for (const google::protobuf::FieldDescriptor* field : fields) {
    if (field->type() != google::protobuf::FieldDescriptor::TYPE_MESSAGE ||
        field->is_repeated()) {
      continue;
    }
    const google::protobuf::Message& child =
        reflection->GetMessage(message, field);
    if (field->message_type() == v1::Tensor::descriptor()) {
      total += Aligned(static_cast<const v1::Tensor&>(child).raw_data().size());
    } else {
      total += TensorBytes(child);
    }
  }
  return total;
}

absl::Status NeedRank(const v1::Tensor& tensor, int rank,
                      absl::string_view field) {
  if (tensor.shape_size() >= rank) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": needs at least ", rank, " dims"));
}

SharedMemoryPlan Finish(const google::protobuf::Message& request,
                        uint64_t output_elements, uint64_t weights_elements) {
  SharedMemoryPlan plan;
  plan.output_bytes = Aligned(output_elements * 4);
  plan.weights_bytes = Aligned(weights_elements * 4);
  plan.total_bytes =
      TensorBytes(request) + plan.output_bytes + plan.weights_bytes;
  return plan;
}

absl::Status PlaceTensors(SharedMemoryPlacer& placer,
                          google::protobuf::Message* message) {
  const google::protobuf::Reflection* reflection = message->GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(*message, &fields);
  for (const google::protobuf::FieldDescriptor* field : fields) {
    if (field->type() != google::protobuf::FieldDescriptor::TYPE_MESSAGE ||
        field->is_repeated()) {
      continue;
    }
    google::protobuf::Message* child =
        reflection->MutableMessage(message, field);
    if (field->message_type() != v1::Tensor::descriptor()) {
      ATTN_RETURN_IF_ERROR(PlaceTensors(placer, child));
      continue;
    }
    auto* tensor = static_cast<v1::Tensor*>(child);
    ATTN_ASSIGN_OR_RETURN(TensorView view,
                          DecodeTensor(*tensor, field->name()));
    ATTN_RETURN_IF_ERROR(placer.Place(view, tensor));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemoryBuffer>> SharedMemoryBuffer::Create(
    const std::string& key, size_t byte_size) {
  const int fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot create shared memory object ", key, ": ",
                     std::strerror(errno)));
  }
  void* data = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(byte_size)) == 0) {
    data = mmap(nullptr, byte_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  const int error = errno;
  close(fd);
  if (data == MAP_FAILED) {
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot size or map shared memory object ", key, " (",
                     byte_size, " bytes): ", std::strerror(error)));
  }
  return std::unique_ptr<SharedMemoryBuffer>(
      new SharedMemoryBuffer(key, static_cast<char*>(data), byte_size));
}

SharedMemoryBuffer::~SharedMemoryBuffer() {
  munmap(data_, size_);
  shm_unlink(key_.c_str());
}

std::string UniqueSharedMemoryKey(const std::string& suffix) {
  static std::atomic<int> counter{0};
  return absl::StrCat("/attnserve-", getpid(), "-", counter.fetch_add(1), "-",
                      suffix);
}

absl::Status SharedMemoryPlacer::Place(const TensorView& view,
                                       v1::Tensor* out) {
  const uint64_t bytes = view.num_elements() * DTypeSize(view.dtype);
  ATTN_ASSIGN_OR_RETURN(v1::SharedMemoryRef ref, Reserve(bytes));
  if (bytes > 0) std::memcpy(buffer_->data() + ref.offset(), view.data, bytes);
  out->clear_raw_data();
  out->clear_float_data();
  *out->mutable_shared_memory() = std::move(ref);
  return absl::OkStatus();
}

absl::StatusOr<v1::SharedMemoryRef> SharedMemoryPlacer::Reserve(
    uint64_t byte_size) {
  if (Aligned(byte_size) > buffer_->size() - used_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shared memory buffer ", buffer_->key(), " of ", buffer_->size(),
        " bytes has no room for ", byte_size, " more"));
  }
  v1::SharedMemoryRef ref;
  ref.set_region(region_);
  ref.set_offset(used_);
  ref.set_byte_size(byte_size);
  used_ += Aligned(byte_size);
  return ref;
}

absl::StatusOr<char*> SharedMemoryPlacer::Resolve(
    const v1::SharedMemoryRef& ref, uint64_t byte_size, uint64_t,
    absl::string_view field) {
  if (ref.region() != region_ || ref.offset() > buffer_->size() ||
      byte_size > buffer_->size() - ref.offset()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": the server answered with bytes outside region '",
                     region_, "'"));
  }
  return buffer_->data() + ref.offset();
}

absl::StatusOr<SharedMemoryPlan> PlanSharedMemory(
    const v1::AttendRequest& request) {
  ATTN_RETURN_IF_ERROR(NeedRank(request.query(), 2, "query"));
  ATTN_RETURN_IF_ERROR(NeedRank(request.key(), 2, "key"));
  ATTN_RETURN_IF_ERROR(NeedRank(request.value(), 2, "value"));
  const int rank = request.query().shape_size();
  const uint64_t rows = Elements(request.query(), 0, rank - 1);
  const int key_rank = request.key().shape_size();
  const int value_rank = request.value().shape_size();
  return Finish(request,
                rows * Elements(request.value(), value_rank - 1, value_rank),
                request.return_weights()
                    ? rows * Elements(request.key(), key_rank - 2, key_rank - 1)
                    : 0);
}

absl::StatusOr<SharedMemoryPlan> PlanSharedMemory(
    const v1::MultiHeadAttendRequest& request,
    const v1::GetModelMetadataResponse* model) {
  ATTN_RETURN_IF_ERROR(NeedRank(request.query(), 2, "query"));
  const v1::Tensor& query = request.query();
  const v1::Tensor& key = request.has_key() ? request.key() : query;
  ATTN_RETURN_IF_ERROR(NeedRank(key, 2, "key"));
  const int rank = query.shape_size();
  const uint64_t rows = Elements(query, 0, rank - 1);
  const uint64_t keys =
      Elements(key, key.shape_size() - 2, key.shape_size() - 1);
  int64_t output_dim = 0;
  int64_t num_heads = 0;
  if (model != nullptr) {
    output_dim = model->output_dim();
    num_heads = model->num_heads();
  } else {
    const v1::AttentionWeights& w = request.weights();
    num_heads = w.num_heads();
    const v1::Tensor& rows_of = w.has_out_proj_weight() ? w.out_proj_weight()
                                : w.has_v_proj_weight() ? w.v_proj_weight()
                                                        : w.in_proj_weight();
    ATTN_RETURN_IF_ERROR(NeedRank(rows_of, 2, "weights"));
    output_dim = rows_of.shape(0);
    if (!w.has_out_proj_weight() && !w.has_v_proj_weight()) output_dim /= 3;
  }
  uint64_t weights = 0;
  if (request.return_weights()) {
    weights = rows * keys *
              (request.average_weights() ? 1 : std::max<int64_t>(1, num_heads));
  }
  return Finish(request, rows * std::max<int64_t>(0, output_dim), weights);
}

absl::StatusOr<SharedMemoryPlan> PlanSharedMemory(
    const v1::LayerNormRequest& request) {
  return Finish(request,
                Elements(request.input(), 0, request.input().shape_size()), 0);
}

absl::StatusOr<SharedMemoryPlan> PlanSharedMemory(
    const v1::RmsNormRequest& request) {
  return Finish(request,
                Elements(request.input(), 0, request.input().shape_size()), 0);
}

absl::StatusOr<SharedMemoryPlan> PlanSharedMemory(
    const google::protobuf::Message& request,
    const v1::GetModelMetadataResponse* model) {
  if (auto* attend = dynamic_cast<const v1::AttendRequest*>(&request)) {
    return PlanSharedMemory(*attend);
  }
  if (auto* mha = dynamic_cast<const v1::MultiHeadAttendRequest*>(&request)) {
    return PlanSharedMemory(*mha, model);
  }
  if (auto* norm = dynamic_cast<const v1::LayerNormRequest*>(&request)) {
    return PlanSharedMemory(*norm);
  }
  if (auto* norm = dynamic_cast<const v1::RmsNormRequest*>(&request)) {
    return PlanSharedMemory(*norm);
  }
  return absl::InvalidArgumentError(
      absl::StrCat(request.GetTypeName(), " carries no tensors"));
}

absl::Status PlaceRequest(const SharedMemoryPlan& plan,
                          SharedMemoryPlacer& placer,
                          google::protobuf::Message* request) {
  ATTN_RETURN_IF_ERROR(PlaceTensors(placer, request));
  const google::protobuf::FieldDescriptor* field =
      request->GetDescriptor()->FindFieldByName("result_regions");
  if (field == nullptr) {
    return absl::InvalidArgumentError("request has no result_regions");
  }
  auto* regions = static_cast<v1::ResultRegions*>(
      request->GetReflection()->MutableMessage(request, field));
  ATTN_ASSIGN_OR_RETURN(*regions->mutable_output(),
                        placer.Reserve(plan.output_bytes));
  if (plan.weights_bytes > 0) {
    ATTN_ASSIGN_OR_RETURN(*regions->mutable_weights(),
                          placer.Reserve(plan.weights_bytes));
  }
  return absl::OkStatus();
}

}  // namespace attnserve
