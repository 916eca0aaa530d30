#include "tensorstash/util/chunk_digest.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

#include "tensorstash/util/crc32c.h"

namespace tensorstash {
namespace {

TEST(ChunkDigestTest, KnownAnswers) {
  // XXH3-128 of the empty input, as xxHash's own tests and `xxhsum -H2` give it.
  EXPECT_EQ(DigestHex(Xxh3Digest("")), "99aa06d3014798d86001c324468d497f");
  EXPECT_NE(Xxh3Digest("123456789"), Xxh3Digest("123456788"));
  EXPECT_FALSE(Xxh3Digest("").empty());
  EXPECT_TRUE(ChunkDigest{}.empty());
}

TEST(ChunkDigestTest, FusedPassEqualsTheTwoSeparateOnes) {
  std::mt19937_64 rng(7);
  std::string data((size_t{1} << 20) * 3 + 12345, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  // Sizes below, at and around the block size, and several blocks with a partial last one.
  for (size_t size : {size_t{0}, size_t{1}, size_t{4095}, size_t{256} << 10,
                      (size_t{256} << 10) + 1, size_t{1} << 20, data.size()}) {
    const CrcAndDigest both = Crc32cAndDigest(data.data(), size);
    EXPECT_EQ(both.crc32c, Crc32c(data.data(), size)) << size;
    EXPECT_EQ(both.digest, Xxh3Digest(data.data(), size)) << size;
  }
}

TEST(ChunkDigestTest, OneFlippedBitAnywhereChangesTheDigest) {
  std::string data(size_t{600} << 10, 'x');
  const ChunkDigest original = Crc32cAndDigest(data.data(), data.size()).digest;
  for (size_t at : {size_t{0}, size_t{256} << 10, data.size() - 1}) {
    std::string changed = data;
    changed[at] ^= 1;
    EXPECT_NE(Crc32cAndDigest(changed.data(), changed.size()).digest, original) << at;
  }
}

}  // namespace
}  // namespace tensorstash
