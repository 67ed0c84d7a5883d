#include "proto/wire_scan.h"

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace attnserve {

int64_t CountTopLevelField(google::protobuf::io::ZeroCopyInputStream* in,
                           int number) {
  google::protobuf::io::CodedInputStream coded(in);
  using google::protobuf::internal::WireFormatLite;
  int64_t count = 0;
  for (uint32_t tag = coded.ReadTag(); tag != 0; tag = coded.ReadTag()) {
    if (WireFormatLite::GetTagFieldNumber(tag) == number) ++count;
    if (!WireFormatLite::SkipField(&coded, tag)) break;
  }
  return count;
}

}  // namespace attnserve
