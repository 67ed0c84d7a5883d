// Small input checks shared by the operations. Each returns OK or an
// INVALID_ARGUMENT status whose message starts with the field name and says
// what was expected and what was found, e.g.
// "key: last dim 32 != query last dim 64".
//
// Thread-safety: free functions without shared state.
#ifndef ATTNSERVE_CORE_VERIFY_H_
#define ATTNSERVE_CORE_VERIFY_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/tensor.h"

namespace attnserve {

// dtype is one of `allowed`.
absl::Status VerifyDType(const TensorView& t, absl::string_view field,
                         std::initializer_list<DType> allowed);
// FLOAT32, BFLOAT16 or FLOAT16.
absl::Status VerifyFloating(const TensorView& t, absl::string_view field);
// A mask: BOOL or UINT8 (keep where nonzero) or FLOAT32 (added to logits),
// whose FLOAT32 values are finite or -inf.
absl::Status VerifyMask(const TensorView& t, absl::string_view field);
// min_rank <= rank <= max_rank.
absl::Status VerifyRank(const TensorView& t, absl::string_view field,
                        int64_t min_rank, int64_t max_rank);
// Dim `axis` (negative counts from the end) equals `expected`; `what`
// describes where the expected value comes from, e.g. "query last dim".
absl::Status VerifyDim(const TensorView& t, absl::string_view field,
                       int64_t axis, int64_t expected, absl::string_view what);
// The shape is exactly `expected`.
absl::Status VerifyShape(const TensorView& t, absl::string_view field,
                         absl::Span<const int64_t> expected);
// `value` is finite and > 0.
absl::Status VerifyPositiveFinite(float value, absl::string_view field);
// `value` is finite.
absl::Status VerifyFinite(float value, absl::string_view field);
// Grouped-query attention: `num_kv_heads` is 0 (meaning num_heads) or a
// positive divisor of `num_heads`.
absl::Status VerifyKvHeads(int num_heads, int num_kv_heads);

// The bytes of a client's string that a message echoes, at most.
inline constexpr size_t kMaxEchoBytes = 128;

// How every status message quotes a string a client sent (a name, a
// version, an id, a datatype): between `quote`s, its first kMaxEchoBytes
// bytes (not splitting a UTF-8 character), with backslashes, quotes,
// control characters and bytes that are not UTF-8 escaped as absl::CEscape
// does ('\n', '\'', '\000'), then, when it is longer, "... (N bytes)":
//   EchoString("demo")            -> 'demo'
//   EchoString(20000 x "9")       -> '999...9'... (20000 bytes)  (128 9s)
// Whatever a client sends, the message stays within ~600 bytes: a longer
// one would exceed the 8 KiB of metadata a gRPC client accepts by default,
// which then reports RESOURCE_EXHAUSTED instead of the error.
std::string EchoString(absl::string_view s, char quote = '\'');

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_VERIFY_H_
