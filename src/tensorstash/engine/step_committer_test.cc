#include "tensorstash/engine/step_committer.h"

#include <map>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

// A memory store without rename that says it is an object store, with or without create-only
// writes: the two protocols of object stores.
class ObjectStoreView : public ForwardingKvStore {
 public:
  ObjectStoreView(KvStore* base, bool conditional) : ForwardingKvStore(base), conditional_(conditional) {}
  KvStoreCapabilities Capabilities() const override {
    KvStoreCapabilities caps = ForwardingKvStore::Capabilities();
    caps.object_store = true;
    caps.conditional_write = conditional_;
    return caps;
  }

 private:
  bool conditional_;
};

CommitRecord RecordFor(int process_count) {
  CommitRecord record;
  record.process_count = process_count;
  return record;
}

TEST(StepCommitterTest, TheProtocolFollowsTheStore) {
  MemoryKvStore renaming;
  EXPECT_EQ(StepCommitter(&renaming).protocol(), CommitProtocol::kRename);
  MemoryKvStore plain(/*supports_rename=*/false);
  ObjectStoreView records(&plain, /*conditional=*/true);
  EXPECT_EQ(StepCommitter(&records).protocol(), CommitProtocol::kRecord);
  ObjectStoreView in_place(&plain, /*conditional=*/false);
  EXPECT_EQ(StepCommitter(&in_place).protocol(), CommitProtocol::kInPlace);
  EXPECT_EQ(CommitProtocolName(CommitProtocol::kInPlace), "in place");
}

TEST(StepCommitterTest, RenameWritesAsideAndPublishesWhole) {
  MemoryKvStore kv;
  const StepCommitter committer(&kv);
  Result<std::string> work = committer.Prepare("0000000001", "00aa", {});
  TS_ASSERT_OK(work.status());
  EXPECT_EQ(*work, std::string("0000000001") + kTempMarker + "00aa");
  TS_ASSERT_OK(kv.Write(*work + "/state/data", "abc"));
  EXPECT_TRUE(absl::IsNotFound(kv.Size("0000000001/state/data").status()));
  TS_ASSERT_OK(committer.Commit("0000000001", *work, "00aa", RecordFor(1),
                                {{"state/data", 3}}, {}));
  Result<uint64_t> size = kv.Size("0000000001/state/data");
  TS_ASSERT_OK(size.status());
  EXPECT_EQ(*size, 3u);
  Result<std::unique_ptr<KvStore>> view = committer.OpenCommitted("0000000001");
  TS_ASSERT_OK(view.status());
  // A second save of the step without overwrite is refused by name.
  Result<std::string> again = committer.Prepare("0000000001", "00bb", {});
  EXPECT_TRUE(absl::IsAlreadyExists(again.status())) << again.status();
  TS_ASSERT_OK(committer.Delete("0000000001"));
  EXPECT_TRUE(absl::IsNotFound(kv.Size("0000000001/" + std::string(kCommitFileName)).status()));
}

TEST(StepCommitterTest, AFileMissingAtCommitCommitsNothing) {
  MemoryKvStore kv;
  const StepCommitter committer(&kv);
  Result<std::string> work = committer.Prepare("0000000002", "00cc", {});
  TS_ASSERT_OK(work.status());
  Status status = committer.Commit("0000000002", *work, "00cc", RecordFor(1),
                                   {{"state/data", 3}}, {});
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("state/data"));
  EXPECT_TRUE(absl::IsNotFound(kv.Size("0000000002/" + std::string(kCommitFileName)).status()));
}

TEST(StepCommitterTest, AnInterruptedOverwriteIsRolledBack) {
  MemoryKvStore kv;
  const StepCommitter committer(&kv);
  // The old step moved aside, the new one never renamed in: the old one comes back.
  const std::string old = std::string("0000000003") + kOldMarker + "00dd";
  TS_ASSERT_OK(kv.Write(old + "/" + kCommitFileName, "old"));
  TS_ASSERT_OK(committer.RollBack(old, "0000000003"));
  Result<std::string> commit = kv.Read("0000000003/" + std::string(kCommitFileName));
  TS_ASSERT_OK(commit.status());
  EXPECT_EQ(*commit, "old");
}

TEST(StepCommitterTest, RecordsWriteAttemptsAndNeverRollBack) {
  MemoryKvStore plain(/*supports_rename=*/false);
  ObjectStoreView kv(&plain, /*conditional=*/true);
  const StepCommitter committer(&kv);
  Result<std::string> work = committer.Prepare("0000000004", "00ee", {});
  TS_ASSERT_OK(work.status());
  EXPECT_EQ(*work, "0000000004/attempt-00ee");
  Status rollback = committer.RollBack("0000000004.old-00ee", "0000000004");
  EXPECT_TRUE(absl::IsFailedPrecondition(rollback)) << rollback;
}

TEST(StepCommitterTest, InPlaceOnAnObjectStoreRefusesSeveralWritersAndOverwrites) {
  MemoryKvStore plain(/*supports_rename=*/false);
  ObjectStoreView kv(&plain, /*conditional=*/false);
  const StepCommitter committer(&kv);
  Result<std::string> several = committer.Prepare("0000000005", "00ff", {.writers = 2});
  EXPECT_TRUE(absl::IsFailedPrecondition(several.status())) << several.status();
  EXPECT_THAT(several.status().message(), HasSubstr("several processes"));
  Result<std::string> work = committer.Prepare("0000000005", "00ff", {});
  TS_ASSERT_OK(work.status());
  EXPECT_EQ(*work, "0000000005");
  TS_ASSERT_OK(kv.Write("0000000005/state/data", "abcd"));
  TS_ASSERT_OK(committer.Commit("0000000005", *work, "00ff", RecordFor(1), {{"state/data", 4}},
                                {}));
  Result<std::string> overwrite = committer.Prepare("0000000005", "0100", {.overwrite = true});
  EXPECT_TRUE(absl::IsFailedPrecondition(overwrite.status())) << overwrite.status();
  EXPECT_THAT(overwrite.status().message(), HasSubstr("overwriting a step"));
}

TEST(StepCommitterTest, InPlaceOnAPlainStoreOverwritesWithCommitGoneFirst) {
  MemoryKvStore kv(/*supports_rename=*/false);
  const StepCommitter committer(&kv);
  ASSERT_EQ(committer.protocol(), CommitProtocol::kInPlace);
  TS_ASSERT_OK(kv.Write("0000000006/state/data", "abcd"));
  TS_ASSERT_OK(committer.Commit("0000000006", "0000000006", "0101", RecordFor(1),
                                {{"state/data", 4}}, {}));
  Result<std::string> work = committer.Prepare("0000000006", "0102", {.overwrite = true});
  TS_ASSERT_OK(work.status());
  EXPECT_EQ(*work, "0000000006");
  // The old step is gone before anything new is written: never half old, half new.
  EXPECT_TRUE(absl::IsNotFound(kv.Size("0000000006/" + std::string(kCommitFileName)).status()));
  EXPECT_TRUE(absl::IsNotFound(kv.Size("0000000006/state/data").status()));
}

}  // namespace
}  // namespace tensorstash
