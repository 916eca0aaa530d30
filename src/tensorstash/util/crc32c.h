// CRC-32C (Castagnoli), the checksum stored with every chunk and every index; and CRC-32 (the
// IEEE polynomial, reflected), the checksum of zip archives (torch.save files, DCP's chunks).
//
// Backed by ISA-L's crc32_iscsi and crc32_gzip_refl (hardware-accelerated). Thread-safe.
#ifndef TENSORSTASH_UTIL_CRC32C_H_
#define TENSORSTASH_UTIL_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tensorstash {

// Returns the CRC-32C of `data[0, size)`, continuing from `crc` (the CRC of the bytes before;
// 0 to start). Crc32c("123456789") == 0xE3069283.
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);
inline uint32_t Crc32c(std::string_view data, uint32_t crc = 0) {
  return Crc32c(data.data(), data.size(), crc);
}

// Returns the CRC-32 of zip, gzip and zlib's crc32 of `data[0, size)`, continuing from `crc`
// (0 to start). Crc32("123456789") == 0xCBF43926. (zlib's own crc32, without the carry-less
// multiplication ISA-L uses, was a fifth of a DCP restore's CPU time.)
uint32_t Crc32(const void* data, size_t size, uint32_t crc = 0);

// Returns the CRC-32C of A followed by B, from `crc_a` = Crc32c(A), `crc_b` = Crc32c(B) and
// `size_b` = B's length, without the bytes (a composed object's checksum from its parts').
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t size_b);

}  // namespace tensorstash

#endif  // TENSORSTASH_UTIL_CRC32C_H_
