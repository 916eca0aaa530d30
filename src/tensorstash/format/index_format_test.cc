#include "tensorstash/format/index_format.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/endian.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

ChunkIndex SampleIndex() {
  ChunkIndex index;
  index.files = {{"data/0-0.dat", 10000}, {"data/1-0.dat", 500}};
  index.entries = {{1, 0, 3, 0, 100, 0xdeadbeef},
                   {0, 0, 0, 4096, 5000, 7},
                   {0, 1, 1, 0, 500, 9},
                   {1, 0, 0, 100, 50, 1}};
  return index;
}

// Re-seals a hand-edited index with a valid CRC, so only the edit is under test.
std::string Reseal(std::string bytes) {
  const size_t body = bytes.size() - kIndexFooterSize;
  std::string crc;
  PutLE32(&crc, Crc32c(bytes.data(), body));
  bytes.replace(body, 4, crc);
  return bytes;
}

TEST(IndexFormatTest, RoundTripSortsEntries) {
  std::string bytes = EncodeIndex(SampleIndex()).value();
  ChunkIndex decoded = DecodeIndex(bytes, "idx").value();
  EXPECT_EQ(decoded.files, SampleIndex().files);
  ASSERT_EQ(decoded.entries.size(), 4u);
  EXPECT_EQ(decoded.entries[0].chunk, 0u);
  EXPECT_EQ(decoded.entries[0].array_id, 0u);
  EXPECT_EQ(decoded.entries[3].crc32c, 0xdeadbeefu);
  EXPECT_EQ(EncodeIndex(decoded).value(), bytes);
}

TEST(IndexFormatTest, EmptyIndex) {
  std::string bytes = EncodeIndex({}).value();
  EXPECT_EQ(bytes.size(), kIndexHeaderSize + kIndexFooterSize);
  EXPECT_TRUE(DecodeIndex(bytes, "idx").ok());
}

TEST(IndexFormatTest, EveryFlippedBitAndEveryTruncationIsDetected) {
  const std::string bytes = EncodeIndex(SampleIndex()).value();
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; bit += 3) {
      std::string bad = bytes;
      bad[i] ^= static_cast<char>(1 << bit);
      Result<ChunkIndex> decoded = DecodeIndex(bad, "state/index");
      ASSERT_FALSE(decoded.ok()) << "byte " << i << " bit " << bit;
      EXPECT_THAT(std::string(decoded.status().message()), HasSubstr("state/index"));
    }
  }
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(DecodeIndex(bytes.substr(0, n), "idx").ok()) << n;
  }
  EXPECT_FALSE(DecodeIndex(std::string(1000, 'x'), "idx").ok());
}

TEST(IndexFormatTest, NewerMajorVersionIsUnimplemented) {
  std::string bytes = EncodeIndex(SampleIndex()).value();
  bytes[8] = 2;  // major version
  Result<ChunkIndex> decoded = DecodeIndex(Reseal(bytes), "idx");
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(decoded.status().message()), HasSubstr("version 2.0"));
  // A newer minor version reads fine.
  bytes = EncodeIndex(SampleIndex()).value();
  bytes[10] = 5;
  EXPECT_TRUE(DecodeIndex(Reseal(bytes), "idx").ok());
}

TEST(IndexFormatTest, HostileEntriesAreRejected) {
  auto expect_rejected = [](ChunkIndex index, const char* needle) {
    // Encode without the encoder's own checks getting in the way: build valid, then edit.
    Result<std::string> bytes = EncodeIndex(index);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    Result<ChunkIndex> decoded = DecodeIndex(*bytes, "idx");
    ASSERT_FALSE(decoded.ok()) << needle;
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(decoded.status().message()), HasSubstr(needle));
  };
  ChunkIndex index = SampleIndex();
  index.entries[0].offset = UINT64_MAX - 10;  // offset + length overflows
  expect_rejected(index, "past the end");
  index = SampleIndex();
  index.entries[1].offset = 90;  // overlaps the chunks at [0, 100) and [100, 150)
  index.entries[1].length = 20;
  expect_rejected(index, "overlap");
  index = SampleIndex();
  index.files[0].name = "data/../../etc/passwd";
  expect_rejected(index, "invalid name");
  index = SampleIndex();
  index.files[0].name = "elsewhere/0.dat";
  expect_rejected(index, "invalid name");
  index = SampleIndex();
  index.entries.push_back(index.entries[0]);
  EXPECT_FALSE(EncodeIndex(index).ok());  // written twice
}

}  // namespace
}  // namespace tensorstash
