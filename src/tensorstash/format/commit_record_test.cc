#include "tensorstash/format/commit_record.h"

#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace tensorstash {
namespace {

TEST(CommitRecordTest, RoundTrip) {
  CommitRecord record;
  record.created_unix_ms = 1700000000123;
  record.process_count = 4;
  record.items["state"] = {0xffffffffu, 10, 3, 20, uint64_t{1} << 40, 7};
  EXPECT_EQ(DecodeCommitRecord(EncodeCommitRecord(record), "COMMIT").value(), record);
}

TEST(CommitRecordTest, TornOrForeignOrNewerRecordsAreRefused) {
  CommitRecord record;
  record.items["state"] = {};
  const std::string text = EncodeCommitRecord(record);
  for (size_t n = 0; n + 1 < text.size(); n += 7) {
    Result<CommitRecord> r = DecodeCommitRecord(text.substr(0, n), "s/COMMIT");
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(std::string(r.status().message()).find("s/COMMIT"), std::string::npos);
  }
  EXPECT_FALSE(DecodeCommitRecord("{\"format\": \"other\"}", "c").ok());
  std::string newer = text;
  newer.replace(newer.find("[\n  1,"), 6, "[\n  9,");
  EXPECT_EQ(DecodeCommitRecord(newer, "c").status().code(), absl::StatusCode::kUnimplemented);
  std::string bad_item = text;
  bad_item.replace(bad_item.find("\"state\""), 7, "\"../x\"");
  EXPECT_FALSE(DecodeCommitRecord(bad_item, "c").ok());
}

TEST(CommitRecordTest, DependsOnIsVersion1_3AndChecked) {
  CommitRecord record;
  record.items["state"] = {};
  EXPECT_EQ(EncodeCommitRecord(record).find("depends_on"), std::string::npos);
  record.depends_on = {"0000000900", "0000000950"};
  const std::string text = EncodeCommitRecord(record);
  EXPECT_NE(text.find("\"version\": [\n  1,\n  3\n ]"), std::string::npos) << text;
  EXPECT_EQ(DecodeCommitRecord(text, "c").value(), record);
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\"0000000900\"", "\"../up\""},
           {"\"0000000900\"", "7"},
           {"\"0000000900\"", "\"0000000950\""},  // twice
           {"\"0000000900\"", "\"0000000999\""}}) {  // unsorted
    std::string edited = text;
    edited.replace(edited.find(from), from.size(), to);
    Result<CommitRecord> r = DecodeCommitRecord(edited, "s/COMMIT");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << to;
  }
}

// Found by fuzz/commit_record_fuzzer: a float where an integer belongs was converted with
// undefined behaviour. Every such value is now refused.
TEST(CommitRecordTest, IntegersMustBeIntegersInRange) {
  CommitRecord record;
  record.items["state"] = {};
  const std::string text = EncodeCommitRecord(record);
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\"created_unix_ms\": 0", "\"created_unix_ms\": 1e300"},
           {"\"created_unix_ms\": 0", "\"created_unix_ms\": 18446744073709551615"},
           {"\"created_unix_ms\": 0", "\"created_unix_ms\": \"0\""},
           {"\"process_count\": 1", "\"process_count\": 1.5"},
           {"\"process_count\": 1", "\"process_count\": 4294967297"},
           {"\"process_count\": 1", "\"process_count\": 0"}}) {
    std::string edited = text;
    ASSERT_NE(edited.find(from), std::string::npos) << from;
    edited.replace(edited.find(from), from.size(), to);
    Result<CommitRecord> r = DecodeCommitRecord(edited, "s/COMMIT");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << to;
    EXPECT_NE(std::string(r.status().message()).find("s/COMMIT"), std::string::npos) << to;
  }
}

}  // namespace
}  // namespace tensorstash
