#include "tensorstash/util/chunk_digest.h"

#include <cstdio>

#include "tensorstash/util/crc32c.h"

// Header-only use of libxxhash: the functions are compiled into this file, so neither the
// library nor a wheel built from it needs libxxhash at run time.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace tensorstash {
namespace {

ChunkDigest FromXxh(XXH128_hash_t h) { return {h.low64, h.high64}; }

}  // namespace

std::string DigestHex(const ChunkDigest& digest) {
  char text[33];
  std::snprintf(text, sizeof(text), "%016llx%016llx",
                static_cast<unsigned long long>(digest.high),
                static_cast<unsigned long long>(digest.low));
  return std::string(text, 32);
}

ChunkDigest Xxh3Digest(const void* data, size_t size) {
  return FromXxh(XXH3_128bits(data, size));
}

CrcAndDigest Crc32cAndDigest(const void* data, size_t size) {
  // 256 KiB blocks: the CRC reads a block from memory, the hash reads it again from L2.
  constexpr size_t kBlock = size_t{256} << 10;
  CrcAndDigest out;
  if (size <= kBlock) {
    out.crc32c = Crc32c(data, size);
    out.digest = Xxh3Digest(data, size);
    return out;
  }
  XXH3_state_t state;
  XXH3_128bits_reset(&state);
  const auto* bytes = static_cast<const char*>(data);
  for (size_t done = 0; done < size; done += kBlock) {
    const size_t n = size - done < kBlock ? size - done : kBlock;
    out.crc32c = Crc32c(bytes + done, n, out.crc32c);
    XXH3_128bits_update(&state, bytes + done, n);
  }
  out.digest = FromXxh(XXH3_128bits_digest(&state));
  return out;
}

}  // namespace tensorstash
