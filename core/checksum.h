// CRC-32C (Castagnoli), the checksum of session files' records: with the
// CPU's CRC32 instruction where it has one (x86-64 SSE4.2, aarch64 CRC),
// chosen at run time, else table-driven.
//
// Thread-safety: a pure function.
#ifndef ATTNSERVE_CORE_CHECKSUM_H_
#define ATTNSERVE_CORE_CHECKSUM_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace attnserve {

// The CRC-32C of `bytes`, continuing from `crc` (the CRC of the bytes
// before them; 0 to start): Crc32c(b, Crc32c(a)) == Crc32c(a + b).
uint32_t Crc32c(absl::string_view bytes, uint32_t crc = 0);
// The same, always table-driven (what CPUs without the instruction run;
// tests compare the two).
uint32_t Crc32cPortable(absl::string_view bytes, uint32_t crc = 0);

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_CHECKSUM_H_
