// The content identity of a chunk: XXH3-128 of its bytes, computed in the same pass as the
// CRC-32C that the format stores with every chunk.
//
// Incremental steps (docs/format.md, section 6.1) reference a chunk of an earlier step instead of
// writing it again when the two have equal digests (and equal encoding). A CRC-32C is 32 bits:
// among the millions of chunks of a large run, two different chunks sharing one is likely
// enough that it cannot stand for equality. XXH3-128 is a non-cryptographic 128-bit hash,
// collision-resistant against accidents (not against an adversary who writes the checkpoint,
// who could write any bytes anyway), and fast enough to cost little beside the CRC
// (bench/micro_bench.cc, BM_Crc32cAndDigest).
//
// Thread-safety: pure functions.
#ifndef TENSORSTASH_UTIL_CHUNK_DIGEST_H_
#define TENSORSTASH_UTIL_CHUNK_DIGEST_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tensorstash {

struct ChunkDigest {
  uint64_t low = 0;   // XXH128_hash_t.low64
  uint64_t high = 0;  // XXH128_hash_t.high64
  bool operator==(const ChunkDigest&) const = default;
  // All zeros: "not known" in an index entry (a real digest is zero with probability 2^-128).
  bool empty() const { return low == 0 && high == 0; }
};

// 32 lowercase hex digits, high half first (as xxhsum prints XXH128).
std::string DigestHex(const ChunkDigest& digest);

// XXH3-128 (seed 0) of `data[0, size)`.
ChunkDigest Xxh3Digest(const void* data, size_t size);
inline ChunkDigest Xxh3Digest(std::string_view data) {
  return Xxh3Digest(data.data(), data.size());
}

struct CrcAndDigest {
  uint32_t crc32c = 0;
  ChunkDigest digest;
};

// Both of `data[0, size)` in one pass over blocks that stay in the L2 cache, so that the bytes
// are read from memory once: equal to {Crc32c(data, size), Xxh3Digest(data, size)}.
CrcAndDigest Crc32cAndDigest(const void* data, size_t size);

}  // namespace tensorstash

#endif  // TENSORSTASH_UTIL_CHUNK_DIGEST_H_
