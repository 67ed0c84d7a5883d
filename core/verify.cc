#include "core/verify.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace attnserve {

absl::Status VerifyDType(const TensorView& t, absl::string_view field,
                         std::initializer_list<DType> allowed) {
  for (DType d : allowed) {
    if (t.dtype == d) return absl::OkStatus();
  }
  std::vector<absl::string_view> names;
  for (DType d : allowed) names.push_back(DTypeName(d));
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": dtype ", DTypeName(t.dtype),
                   " not supported, expected ", absl::StrJoin(names, " or ")));
}

absl::Status VerifyFloating(const TensorView& t, absl::string_view field) {
  return VerifyDType(t, field,
                     {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
}

absl::Status VerifyMask(const TensorView& t, absl::string_view field) {
  if (absl::Status s =
          VerifyDType(t, field, {DType::kBool, DType::kUInt8, DType::kFloat32});
      !s.ok()) {
    return s;
  }
  if (t.dtype != DType::kFloat32) return absl::OkStatus();
  const float* values = t.data_as<float>();
  const int64_t count = t.num_elements();
  for (int64_t i = 0; i < count; ++i) {
    const float v = values[i];
    if (!std::isfinite(v) && !(std::isinf(v) && v < 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": FLOAT32 mask values must be finite or -inf, found ", v,
          " at flat index ", i));
    }
  }
  return absl::OkStatus();
}

absl::Status VerifyRank(const TensorView& t, absl::string_view field,
                        int64_t min_rank, int64_t max_rank) {
  if (t.rank() >= min_rank && t.rank() <= max_rank) return absl::OkStatus();
  const std::string expected = min_rank == max_rank ? absl::StrCat(min_rank)
                               : max_rank > 64
                                   ? absl::StrCat(">= ", min_rank)
                                   : absl::StrCat(min_rank, " to ", max_rank);
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": rank ", t.rank(), " (shape ", ShapeString(t.shape),
                   "), expected rank ", expected));
}

absl::Status VerifyDim(const TensorView& t, absl::string_view field,
                       int64_t axis, int64_t expected, absl::string_view what) {
  const int64_t actual = t.dim(axis);
  if (actual == expected) return absl::OkStatus();
  std::string name;
  if (axis == -1) {
    name = "last dim";
  } else if (axis < 0) {
    name = absl::StrCat("dim ", t.rank() + axis);
  } else {
    name = absl::StrCat("dim ", axis);
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", name, " ", actual,
                                                 " != ", what, " ", expected));
}

absl::Status VerifyShape(const TensorView& t, absl::string_view field,
                         absl::Span<const int64_t> expected) {
  if (absl::Span<const int64_t>(t.shape) == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": shape ", ShapeString(t.shape), ", expected ",
                   ShapeString(expected)));
}

absl::Status VerifyPositiveFinite(float value, absl::string_view field) {
  if (std::isfinite(value) && value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": must be finite and > 0, got ", value));
}

absl::Status VerifyFinite(float value, absl::string_view field) {
  if (std::isfinite(value)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": must be finite, got ", value));
}

absl::Status VerifyKvHeads(int num_heads, int num_kv_heads) {
  const int kv_heads = num_kv_heads == 0 ? num_heads : num_kv_heads;
  if (kv_heads > 0 && num_heads % kv_heads == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("num_kv_heads: ", num_kv_heads,
                                                 " does not divide num_heads ",
                                                 num_heads));
}

namespace {

// The length of the UTF-8 character at the start of `s` (2 to 4 bytes), or
// 0 when it is not one: a stray continuation byte, an overlong form, a
// surrogate, past U+10FFFF, or cut short.
size_t Utf8CharLength(absl::string_view s) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char lead = byte(0);
  size_t n = 0;
  uint32_t code = 0;
  if (lead >= 0xc2 && lead <= 0xdf) {
    n = 2;
    code = lead & 0x1f;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    n = 3;
    code = lead & 0x0f;
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    n = 4;
    code = lead & 0x07;
  } else {
    return 0;
  }
  if (s.size() < n) return 0;
  for (size_t i = 1; i < n; ++i) {
    if ((byte(i) & 0xc0) != 0x80) return 0;
    code = code << 6 | (byte(i) & 0x3f);
  }
  const uint32_t smallest = n == 2 ? 0x80 : n == 3 ? 0x800 : 0x10000;
  if (code < smallest || code > 0x10ffff ||
      (code >= 0xd800 && code <= 0xdfff)) {
    return 0;
  }
  return n;
}

}  // namespace

std::string EchoString(absl::string_view s, char quote) {
  std::string out(1, quote);
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const size_t n = Utf8CharLength(s.substr(i));
      if (n > 0) {
        if (i + n > kMaxEchoBytes) break;
        out.append(s.data() + i, n);
        i += n;
        continue;
      }
    }
    if (i + 1 > kMaxEchoBytes) break;
    switch (c) {
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\\':
        out += "\\\\";
        break;
      default:
        if (c == static_cast<unsigned char>(quote)) {
          out += '\\';
          out += quote;
        } else if (c < 0x20 || c >= 0x7f) {
          out += absl::StrFormat("\\%03o", c);
        } else {
          out += static_cast<char>(c);
        }
    }
    ++i;
  }
  out += quote;
  if (i < s.size()) absl::StrAppend(&out, "... (", s.size(), " bytes)");
  return out;
}

}  // namespace attnserve
