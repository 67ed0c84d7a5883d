#include "server/call_records.h"

#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.pb.h"
#include "core/tensor.h"
#include "core/verify.h"

namespace attnserve {

int64_t MessageSubject::Bytes() const {
  return static_cast<int64_t>(
      request_->ByteSizeLong() +
      (response_ != nullptr ? response_->ByteSizeLong() : 0));
}

std::string MessageSubject::Describe() const {
  std::string out;
  const google::protobuf::Reflection* reflection = request_->GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(*request_, &fields);
  for (const google::protobuf::FieldDescriptor* field : fields) {
    if (field->name() == "model" || field->name() == "model_name") {
      absl::StrAppend(&out, out.empty() ? "" : " ", "model=",
                      EchoString(reflection->GetString(*request_, field)));
    } else if (field->name() == "session_id") {
      absl::StrAppend(&out, out.empty() ? "" : " ", "session=",
                      EchoString(reflection->GetString(*request_, field)));
    } else if (field->name() == "steps" && field->is_repeated()) {
      absl::StrAppend(&out, out.empty() ? "" : " ", field->name(), "=",
                      reflection->FieldSize(*request_, field));
    } else if (field->message_type() == v1::Tensor::descriptor() &&
               !field->is_repeated()) {
      const auto& tensor = static_cast<const v1::Tensor&>(
          reflection->GetMessage(*request_, field));
      absl::StrAppend(
          &out, out.empty() ? "" : " ", field->name(), "=",
          ShapeString(Shape(tensor.shape().begin(), tensor.shape().end())));
    }
  }
  return out;
}

void CallRecords::Record(const EngineCall& call, const absl::Status& status,
                         const CallTimes& times, double flops) const {
  const std::string code = absl::StatusCodeToString(status.code());
  const int64_t bytes =
      status.ok() && call.subject != nullptr ? call.subject->Bytes() : 0;
  metrics_->RecordCall(call.label, code, times.total, times.queue + times.input,
                       times.compute, flops, bytes);
  if (call.subject != nullptr) {
    statistics_.Record(call.subject->Model(), status,
                       {.total = times.total,
                        .input = times.input,
                        .queue = times.queue,
                        .compute = times.compute});
  }
  if (log_settings_.info()) {
    std::string described =
        call.subject != nullptr ? call.subject->Describe() : "";
    if (!described.empty()) described += ' ';
    std::fprintf(
        stderr, "access rpc=%s %sstatus=%s us=%lld\n", call.label.c_str(),
        described.c_str(), code.c_str(),
        static_cast<long long>(absl::ToInt64Microseconds(times.total)));
  }
}

}  // namespace attnserve
