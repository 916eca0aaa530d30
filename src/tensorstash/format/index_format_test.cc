#include "tensorstash/format/index_format.h"

#include <algorithm>
#include <functional>
#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/endian.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

ChunkIndex SampleIndex() {
  ChunkIndex index;
  index.files = {{"data/0-0.dat", 10000, "", ""}, {"data/1-0.dat", 500, "", ""}};
  index.entries = {{1, 0, 3, 0, 100, 0xdeadbeef, {}},
                   {0, 0, 0, 4096, 5000, 7, {}},
                   {0, 1, 1, 0, 500, 9, {}},
                   {1, 0, 0, 100, 50, 1, {}}};
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
  bytes[8] = 3;  // major version
  Result<ChunkIndex> decoded = DecodeIndex(Reseal(bytes), "idx");
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(decoded.status().message()), HasSubstr("version 3.0"));
  EXPECT_THAT(std::string(decoded.status().message()), HasSubstr("upgrade tensorstash"));
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

// An incremental step's index: one file of its own, one of an earlier step, digests.
ChunkIndex IncrementalIndex() {
  ChunkIndex index = SampleIndex();
  index.files[1] = {"state/data/0-0.dat", 500, "0000000900", ""};
  for (size_t i = 0; i < index.entries.size(); ++i) {
    index.entries[i].digest = {0x1111 * (i + 1), 0x2222 * (i + 1)};
  }
  return index;
}

TEST(IndexFormatTest, WithoutReferencesOrDigestsTheIndexStaysVersion1) {
  const std::string bytes = EncodeIndex(SampleIndex()).value();
  EXPECT_FALSE(IndexNeedsVersion2(SampleIndex()));
  EXPECT_EQ(GetLE16(bytes.data() + 8), 1);
  EXPECT_EQ(GetLE16(bytes.data() + 10), 0);
  // 32 + two file records + 4 entries of 40 + 16: the 1.0 layout, byte for byte.
  EXPECT_EQ(bytes.size(), 32u + 2 * (10 + 12) + 4 * 40 + 16);
}

TEST(IndexFormatTest, Version2RoundTripsReferencesAndDigests) {
  const ChunkIndex index = IncrementalIndex();
  ASSERT_TRUE(IndexNeedsVersion2(index));
  const std::string bytes = EncodeIndex(index).value();
  EXPECT_EQ(GetLE16(bytes.data() + 8), 2);
  EXPECT_EQ(bytes.size(),
            32u + (10 + 12 + 4) + (10 + 18 + 4 + 10) + 4 * kIndexEntrySizeV2 + 16);
  ChunkIndex decoded = DecodeIndex(bytes, "idx").value();
  EXPECT_EQ(decoded.files, index.files);
  ASSERT_EQ(decoded.entries.size(), 4u);
  // Sorted by (array, chunk): array 0 chunk 0 was the second entry given.
  EXPECT_EQ(decoded.entries[0].digest, (ChunkDigest{0x2222, 0x4444}));
  EXPECT_EQ(EncodeIndex(decoded).value(), bytes);
  // A digest alone (a full save that records them) also needs version 2.
  ChunkIndex digests_only = SampleIndex();
  digests_only.entries[2].digest = {1, 2};
  EXPECT_TRUE(IndexNeedsVersion2(digests_only));
  EXPECT_EQ(DecodeIndex(EncodeIndex(digests_only).value(), "idx").value().entries[1].digest,
            (ChunkDigest{1, 2}));
  // On an object store the name goes through the attempt and a generation pins the object.
  ChunkIndex pinned = IncrementalIndex();
  pinned.files[1].name = "attempt-0123456789abcdef/state/data/0-0.dat";
  pinned.files[1].generation = "\"etag-1\"";
  EXPECT_EQ(DecodeIndex(EncodeIndex(pinned).value(), "idx").value().files, pinned.files);
}

TEST(IndexFormatTest, Version2EveryFlippedBitAndTruncationIsDetected) {
  const std::string bytes = EncodeIndex(IncrementalIndex()).value();
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string bad = bytes;
    bad[i] ^= 0x10;
    EXPECT_FALSE(DecodeIndex(bad, "idx").ok()) << "byte " << i;
  }
  for (size_t n = 0; n < bytes.size(); ++n) EXPECT_FALSE(DecodeIndex(bytes.substr(0, n), "idx").ok());
}

TEST(IndexFormatTest, HostileReferencesAreRejected) {
  // Encoded by hand (the encoder refuses them too), then decoded.
  auto encode_unchecked = [](const ChunkIndex& index) {
    std::string out(kIndexMagic, sizeof(kIndexMagic));
    PutLE16(&out, 2);
    PutLE16(&out, 0);
    PutLE32(&out, 0);
    PutLE32(&out, static_cast<uint32_t>(index.files.size()));
    PutLE32(&out, 0);
    PutLE64(&out, index.entries.size());
    for (const DataFileInfo& f : index.files) {
      for (const std::string* s : {&f.name}) {
        PutLE16(&out, static_cast<uint16_t>(s->size()));
        out += *s;
      }
      PutLE64(&out, f.size);
      for (const std::string* s : {&f.step, &f.generation}) {
        PutLE16(&out, static_cast<uint16_t>(s->size()));
        out += *s;
      }
    }
    for (const IndexEntry& e : index.entries) {
      PutLE32(&out, e.array_id);
      PutLE32(&out, e.file_id);
      PutLE64(&out, e.chunk);
      PutLE64(&out, e.offset);
      PutLE64(&out, e.length);
      PutLE32(&out, e.crc32c);
      PutLE32(&out, 0);
      PutLE64(&out, e.digest.low);
      PutLE64(&out, e.digest.high);
    }
    PutLE32(&out, Crc32c(out));
    PutLE32(&out, 0);
    out.append(kIndexFooterMagic, sizeof(kIndexFooterMagic));
    return out;
  };
  ChunkIndex sorted = IncrementalIndex();
  std::sort(sorted.entries.begin(), sorted.entries.end(), [](const auto& a, const auto& b) {
    return std::tie(a.array_id, a.chunk) < std::tie(b.array_id, b.chunk);
  });
  ASSERT_TRUE(DecodeIndex(encode_unchecked(sorted), "idx").ok());
  auto expect_rejected = [&](const std::function<void(ChunkIndex*)>& edit, const char* needle) {
    ChunkIndex index = sorted;
    edit(&index);
    if (std::string_view(needle) != "listed twice") EXPECT_FALSE(EncodeIndex(index).ok()) << needle;
    Result<ChunkIndex> decoded = DecodeIndex(encode_unchecked(index), "state/index");
    ASSERT_FALSE(decoded.ok()) << needle;
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss) << decoded.status();
    EXPECT_THAT(std::string(decoded.status().message()), HasSubstr(needle));
    EXPECT_THAT(std::string(decoded.status().message()), HasSubstr("state/index"));
  };
  expect_rejected([](ChunkIndex* i) { i->files[1].step = "../outside"; }, "not a valid key");
  expect_rejected([](ChunkIndex* i) { i->files[1].step = "/abs"; }, "not a valid key");
  expect_rejected([](ChunkIndex* i) { i->files[1].step = "0000000900.tmp-0123456789abcdef"; },
                  "temporary");
  expect_rejected([](ChunkIndex* i) { i->files[1].name = "COMMIT"; }, "not a data file");
  expect_rejected([](ChunkIndex* i) { i->files[1].name = "state/index"; }, "not a data file");
  expect_rejected([](ChunkIndex* i) { i->files[1].name = "state/data/"; }, "not a valid key");
  expect_rejected([](ChunkIndex* i) { i->files[1].name = "attempt-x/metadata.json"; },
                  "not a data file");
  expect_rejected([](ChunkIndex* i) { i->files[1].name = "state/../state/data/0-0.dat"; },
                  "not a valid key");
  expect_rejected([](ChunkIndex* i) { i->files[1].generation = std::string(300, 'g'); },
                  "generation");
  expect_rejected([](ChunkIndex* i) { i->files[0].generation = "g"; }, "generation");
  expect_rejected(
      [](ChunkIndex* i) { i->files.push_back(i->files[1]); }, "listed twice");
}

}  // namespace
}  // namespace tensorstash
