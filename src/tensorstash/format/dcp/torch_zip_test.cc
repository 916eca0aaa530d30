#include "tensorstash/format/dcp/torch_zip.h"

#include <zlib.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/status_test_macros.h"
#include "tensorstash/testing/test_files.h"
#include "tensorstash/util/endian.h"

namespace tensorstash {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

uint32_t Crc(std::string_view s) {
  return static_cast<uint32_t>(
      crc32(0, reinterpret_cast<const Bytef*>(s.data()), static_cast<uInt>(s.size())));
}

// A stored zip as torch.save (miniz) writes it; with `zip64`, every size and offset goes through
// the zip64 extra field and end records, as torch writes archives past 4 GiB.
std::string MakeZip(const std::vector<std::pair<std::string, std::string>>& files, bool zip64,
                    uint16_t method = 0, uint16_t flags = 0) {
  std::string out;
  std::string dir;
  for (const auto& [name, data] : files) {
    uint64_t local = out.size();
    PutLE32(&out, 0x04034b50);
    PutLE16(&out, zip64 ? 45 : 20);
    PutLE16(&out, flags);
    PutLE16(&out, method);
    PutLE32(&out, 0);
    PutLE32(&out, Crc(data));
    PutLE32(&out, static_cast<uint32_t>(data.size()));
    PutLE32(&out, static_cast<uint32_t>(data.size()));
    PutLE16(&out, static_cast<uint16_t>(name.size()));
    PutLE16(&out, 4);  // an extra field of padding, as torch aligns its data
    out += name;
    PutLE16(&out, 0x4246);
    PutLE16(&out, 0);
    out += data;
    PutLE32(&dir, 0x02014b50);
    PutLE16(&dir, 45);
    PutLE16(&dir, zip64 ? 45 : 20);
    PutLE16(&dir, flags);
    PutLE16(&dir, method);
    PutLE32(&dir, 0);
    PutLE32(&dir, Crc(data));
    PutLE32(&dir, zip64 ? 0xffffffff : static_cast<uint32_t>(data.size()));
    PutLE32(&dir, zip64 ? 0xffffffff : static_cast<uint32_t>(data.size()));
    PutLE16(&dir, static_cast<uint16_t>(name.size()));
    PutLE16(&dir, zip64 ? 28 : 0);
    PutLE16(&dir, 0);
    PutLE16(&dir, 0);
    PutLE16(&dir, 0);
    PutLE32(&dir, 0);
    PutLE32(&dir, zip64 ? 0xffffffff : static_cast<uint32_t>(local));
    dir += name;
    if (zip64) {
      PutLE16(&dir, 0x0001);
      PutLE16(&dir, 24);
      PutLE64(&dir, data.size());
      PutLE64(&dir, data.size());
      PutLE64(&dir, local);
    }
  }
  uint64_t dir_offset = out.size();
  out += dir;
  if (zip64) {
    uint64_t rec = out.size();
    PutLE32(&out, 0x06064b50);
    PutLE64(&out, 44);
    PutLE16(&out, 45);
    PutLE16(&out, 45);
    PutLE32(&out, 0);
    PutLE32(&out, 0);
    PutLE64(&out, files.size());
    PutLE64(&out, files.size());
    PutLE64(&out, dir.size());
    PutLE64(&out, dir_offset);
    PutLE32(&out, 0x07064b50);
    PutLE32(&out, 0);
    PutLE64(&out, rec);
    PutLE32(&out, 1);
  }
  PutLE32(&out, 0x06054b50);
  PutLE16(&out, 0);
  PutLE16(&out, 0);
  PutLE16(&out, zip64 ? 0xffff : static_cast<uint16_t>(files.size()));
  PutLE16(&out, zip64 ? 0xffff : static_cast<uint16_t>(files.size()));
  PutLE32(&out, zip64 ? 0xffffffff : static_cast<uint32_t>(dir.size()));
  PutLE32(&out, zip64 ? 0xffffffff : static_cast<uint32_t>(dir_offset));
  PutLE16(&out, 0);
  return out;
}

const std::vector<std::pair<std::string, std::string>> kFiles = {
    {"archive/data.pkl", "pickle"}, {"archive/data/0", std::string("\x01\x02\x00\x04", 4)},
    {"archive/byteorder", "little"}};

TEST(TorchZip, ReadsARealDcpItem) {
  // The first item of rank 0's file: rank 0's shard of "sharded" (rows 0-4 of
  // arange(40).reshape(10, 4), float32), offset 0, length 1641 in the .metadata.
  std::string file =
      ReadFileToString(std::string(TS_TEST_DATA_DIR) + "/dcp/two_ranks/__0_0.distcp");
  ASSERT_EQ(file.size(), 1641u);
  Result<std::vector<ZipEntry>> entries = ReadStoredZip(file, "__0_0.distcp");
  TS_ASSERT_OK(entries.status());
  const ZipEntry* pkl = FindTorchZipEntry(*entries, "data.pkl");
  const ZipEntry* data = FindTorchZipEntry(*entries, "data/0");
  const ZipEntry* order = FindTorchZipEntry(*entries, "byteorder");
  ASSERT_NE(pkl, nullptr);
  ASSERT_NE(data, nullptr);
  ASSERT_NE(order, nullptr);
  EXPECT_EQ(file.substr(order->data_offset, order->size), "little");
  ASSERT_EQ(data->size, 20 * sizeof(float));
  EXPECT_EQ(data->data_offset % 64, 0u);  // torch aligns storages
  for (int i = 0; i < 20; ++i) {
    float v;
    std::memcpy(&v, file.data() + data->data_offset + 4 * i, 4);
    EXPECT_EQ(v, static_cast<float>(i));
  }
  EXPECT_EQ(FindTorchZipEntry(*entries, "data/1"), nullptr);
}

TEST(TorchZip, ReadsZip32AndZip64) {
  for (bool zip64 : {false, true}) {
    std::string zip = MakeZip(kFiles, zip64);
    Result<std::vector<ZipEntry>> entries = ReadStoredZip(zip, "x");
    TS_ASSERT_OK(entries.status()) << zip64;
    ASSERT_EQ(entries->size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ((*entries)[i].name, kFiles[i].first);
      EXPECT_EQ(zip.substr((*entries)[i].data_offset, (*entries)[i].size), kFiles[i].second);
    }
  }
}

TEST(TorchZip, ACorruptByteIsACrcError) {
  std::string zip = MakeZip(kFiles, false);
  Result<std::vector<ZipEntry>> entries = ReadStoredZip(zip, "x");
  TS_ASSERT_OK(entries.status());
  zip[(*entries)[1].data_offset + 2] ^= 1;
  Result<std::vector<ZipEntry>> bad = ReadStoredZip(zip, "rank0.distcp");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(bad.status().message(),
              AllOf(HasSubstr("rank0.distcp"), HasSubstr("archive/data/0"), HasSubstr("CRC-32")));
  TS_EXPECT_OK(ReadStoredZip(zip, "x", /*check_crc=*/false).status());
}

TEST(TorchZip, RefusesCompressedAndEncryptedEntries) {
  Result<std::vector<ZipEntry>> r = ReadStoredZip(MakeZip(kFiles, false, /*method=*/8), "x");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(r.status().message(), AllOf(HasSubstr("archive/data.pkl"), HasSubstr("compressed")));
  r = ReadStoredZip(MakeZip(kFiles, false, 0, /*flags=*/1), "x");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(r.status().message(), HasSubstr("encrypted"));
}

TEST(TorchZip, EveryTruncationAndStrayByteIsAnErrorNotACrash) {
  for (bool zip64 : {false, true}) {
    std::string zip = MakeZip(kFiles, zip64);
    for (size_t n = 0; n < zip.size(); ++n) {
      Result<std::vector<ZipEntry>> r = ReadStoredZip(std::string_view(zip).substr(0, n), "x");
      EXPECT_FALSE(r.ok()) << n;
    }
    // Every single-byte change: an error or a consistent listing, never a crash or a range
    // outside the archive.
    for (size_t i = 0; i < zip.size(); ++i) {
      for (uint8_t x : {0x01, 0x80, 0xff}) {
        std::string bad = zip;
        bad[i] = static_cast<char>(bad[i] ^ x);
        Result<std::vector<ZipEntry>> r = ReadStoredZip(bad, "x");
        if (!r.ok()) continue;
        for (const ZipEntry& e : *r) {
          EXPECT_LE(e.data_offset + e.size, bad.size());
        }
      }
    }
  }
}

TEST(TorchZip, HostileDirectoryFields) {
  std::string zip = MakeZip(kFiles, false);
  size_t end = zip.size() - 22;
  {  // A count far past what the directory holds.
    std::string bad = zip;
    bad[end + 10] = '\xfe';
    bad[end + 11] = '\xff';
    Result<std::vector<ZipEntry>> r = ReadStoredZip(bad, "x");
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("central directory entry 3 of 65534"));
  }
  {  // The directory offset past the end.
    std::string bad = zip;
    bad[end + 19] = '\x7f';
    Result<std::vector<ZipEntry>> r = ReadStoredZip(bad, "x");
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("past the end"));
  }
  {  // Zip64 markers without the zip64 records.
    std::string bad = zip;
    bad[end + 10] = '\xff';
    bad[end + 11] = '\xff';
    Result<std::vector<ZipEntry>> r = ReadStoredZip(bad, "x");
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("zip64"));
  }
  {  // Zip64 sizes of 2^63.
    std::string big = MakeZip(kFiles, true);
    size_t first = big.find(std::string("\x01\x00\x18\x00", 4));
    ASSERT_NE(first, std::string::npos);
    big[first + 4 + 7] = '\x40';
    big[first + 4 + 15] = '\x40';
    Result<std::vector<ZipEntry>> r = ReadStoredZip(big, "x");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(r.status().message(), HasSubstr("past the end"));
  }
  EXPECT_FALSE(ReadStoredZip("", "x").ok());
  EXPECT_FALSE(ReadStoredZip(std::string(100000, 'P'), "x").ok());
}

TEST(TorchZip, FindsOnlyTopFolderEntries) {
  std::vector<ZipEntry> entries(3);
  entries[0].name = "data.pkl";
  entries[1].name = "a/b/data.pkl";
  entries[2].name = "/data.pkl";
  EXPECT_EQ(FindTorchZipEntry(entries, "data.pkl"), nullptr);
  entries[1].name = "mymodel/data.pkl";
  EXPECT_EQ(FindTorchZipEntry(entries, "data.pkl"), &entries[1]);
}

}  // namespace
}  // namespace tensorstash
