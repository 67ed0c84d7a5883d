#include "core/checksum.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#elif defined(__aarch64__)
#include <arm_acle.h>
#include <sys/auxv.h>
#endif

namespace attnserve {
namespace {

constexpr uint32_t kPolynomial = 0x82f63b78;  // CRC-32C, reflected

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) {
      crc = (crc >> 1) ^ ((crc & 1) != 0 ? kPolynomial : 0);
    }
    table[i] = crc;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kTable = MakeTable();

uint32_t Portable(const unsigned char* p, size_t n, uint32_t crc) {
  for (size_t i = 0; i < n; ++i) crc = (crc >> 8) ^ kTable[(crc ^ p[i]) & 0xff];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Hardware(const unsigned char* p,
                                                    size_t n, uint32_t crc) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}
bool HasHardware() { return __builtin_cpu_supports("sse4.2"); }
#elif defined(__aarch64__)
__attribute__((target("+crc"))) uint32_t Hardware(const unsigned char* p,
                                                  size_t n, uint32_t crc) {
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    crc = __crc32cd(crc, word);
  }
  for (; n > 0; --n, ++p) crc = __crc32cb(crc, *p);
  return crc;
}
bool HasHardware() { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
#else
uint32_t Hardware(const unsigned char* p, size_t n, uint32_t crc) {
  return Portable(p, n, crc);
}
bool HasHardware() { return false; }
#endif

}  // namespace

uint32_t Crc32c(absl::string_view bytes, uint32_t crc) {
  static const bool hardware = HasHardware();
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  crc = ~crc;
  crc = hardware ? Hardware(p, bytes.size(), crc)
                 : Portable(p, bytes.size(), crc);
  return ~crc;
}

uint32_t Crc32cPortable(absl::string_view bytes, uint32_t crc) {
  return ~Portable(reinterpret_cast<const unsigned char*>(bytes.data()),
                   bytes.size(), ~crc);
}

}  // namespace attnserve
