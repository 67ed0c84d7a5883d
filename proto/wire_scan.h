// Reading a serialized message's framing without decoding it: for limits
// that must hold before a message is parsed (parsing is what costs memory).
//
// Thread-safety: free functions without shared state.
#ifndef ATTNSERVE_PROTO_WIRE_SCAN_H_
#define ATTNSERVE_PROTO_WIRE_SCAN_H_

#include <cstdint>

#include "google/protobuf/io/zero_copy_stream.h"

namespace attnserve {

// How many times field `number` occurs at the top level of the serialized
// message read from `in` (any wire type), counted without decoding anything
// (a few ms for 16 million entries). Bytes that are not a message end the
// count; the parse then says why. A message that parses has at most this
// many entries of the field.
int64_t CountTopLevelField(google::protobuf::io::ZeroCopyInputStream* in,
                           int number);

}  // namespace attnserve

#endif  // ATTNSERVE_PROTO_WIRE_SCAN_H_
