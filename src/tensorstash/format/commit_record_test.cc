#include "tensorstash/format/commit_record.h"

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

}  // namespace
}  // namespace tensorstash
