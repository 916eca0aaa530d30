// gc beside saves that take no lock (issue 36, item 2): a commit names only what it found there,
// and gc leaves alone what was written within its min_age.
#include "tensorstash/manager/garbage.h"

#include <chrono>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/engine/step_committer.h"
#include "tensorstash/engine/object_store_commit.h"
#include "tensorstash/testing/reliability_test_util.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;
using test::StoreKind;

// What a gc racing a save does at its worst moment: when the save writes its tree.json (after
// every data file, before the commit), everything under the save's data folders is removed.
class RemoveDataBeforeTreeKvStore : public ForwardingKvStore {
 public:
  explicit RemoveDataBeforeTreeKvStore(KvStore* base) : ForwardingKvStore(base) {}
  // An object store over a memory store without rename, or the base's own capabilities.
  bool as_object_store = false;

  KvStoreCapabilities Capabilities() const override {
    KvStoreCapabilities capabilities = ForwardingKvStore::Capabilities();
    if (as_object_store) capabilities.object_store = true;
    return capabilities;
  }
  Status Write(std::string_view key, std::string_view value) override {
    if (armed && key.ends_with("state/tree.json")) {
      armed = false;
      const std::string item(key.substr(0, key.size() - std::string_view("tree.json").size()));
      TS_RETURN_IF_ERROR(DeletePrefix(item + "data/"));
    }
    return ForwardingKvStore::Write(key, value);
  }
  bool armed = false;
};

class CommitChecksTest : public test::TempDirTest,
                         public ::testing::WithParamInterface<StoreKind> {};

TEST_P(CommitChecksTest, ASaveWhoseFilesWereRemovedFailsAndTheOldVersionStays) {
  Result<std::unique_ptr<KvStore>> base = test::MakeStore(GetParam(), temp_dir());
  TS_ASSERT_OK(base.status());
  RemoveDataBeforeTreeKvStore kv(base->get());
  kv.as_object_store = GetParam() == StoreKind::kMemoryNoRename;
  ASSERT_EQ((StepCommitter(&kv).protocol() == CommitProtocol::kRecord), kv.as_object_store);
  WriterOptions options = test::SmallFilesOptions();
  TS_ASSERT_OK(test::SaveReliabilityStep(&kv, "0000000001", 1, 1, options));

  // An overwrite whose data files vanish before the commit: DataLoss naming a file, and the
  // step keeps its first version, whole.
  kv.armed = true;
  options.overwrite = true;
  Status overwritten = test::SaveReliabilityStep(&kv, "0000000001", 1, 2, options);
  EXPECT_TRUE(absl::IsDataLoss(overwritten)) << overwritten;
  EXPECT_THAT(overwritten.message(), HasSubstr("data/"));
  EXPECT_THAT(overwritten.message(), HasSubstr("nothing was committed"));
  int version = 0;
  TS_EXPECT_OK(test::RestoreReliabilityStep(&kv, "0000000001", 1, {1}, &version));

  // A new step the same way: not committed at all.
  kv.armed = true;
  Status saved = test::SaveReliabilityStep(&kv, "0000000002", 2, 1, options);
  EXPECT_TRUE(absl::IsDataLoss(saved)) << saved;
  Result<std::unique_ptr<CheckpointReader>> opened = CheckpointReader::Open(&kv, "0000000002");
  EXPECT_FALSE(opened.ok());

  // Untouched, both save.
  TS_EXPECT_OK(test::SaveReliabilityStep(&kv, "0000000002", 2, 1, options));
  TS_EXPECT_OK(test::RestoreReliabilityStep(&kv, "0000000002", 2, {1}, &version));
}

INSTANTIATE_TEST_SUITE_P(Stores, CommitChecksTest,
                         ::testing::Values(StoreKind::kFile, StoreKind::kMemory,
                                           StoreKind::kMemoryNoRename),
                         [](const auto& info) { return test::StoreName(info.param); });

// A leftover of each kind gc removes, written now: all are left alone by default and removed
// with min_age 0; a committed step is never touched.
class GarbageAgeTest : public test::TempDirTest,
                       public ::testing::WithParamInterface<StoreKind> {};

TEST_P(GarbageAgeTest, WhatWasJustWrittenIsLeftAloneUntilItIsOld) {
  Result<std::unique_ptr<KvStore>> base = test::MakeStore(GetParam(), temp_dir());
  TS_ASSERT_OK(base.status());
  RemoveDataBeforeTreeKvStore kv(base->get());
  kv.as_object_store = GetParam() == StoreKind::kMemoryNoRename;
  WriterOptions options = test::SmallFilesOptions();
  TS_ASSERT_OK(test::SaveReliabilityStep(&kv, "0000000001", 1, 1, options));
  std::set<std::string> leftovers;
  if ((StepCommitter(&kv).protocol() == CommitProtocol::kRecord)) {
    // An attempt no record names (an overwrite in flight), a step never committed.
    TS_ASSERT_OK(kv.Write("0000000001/attempt-00000000000000aa/state/data/0-0.dat", "x"));
    TS_ASSERT_OK(kv.Write("0000000002/attempt-00000000000000bb/state/data/0-0.dat", "y"));
    leftovers = {"0000000001/attempt-00000000000000aa/", "0000000002/"};
  } else {
    // A save's temporary folder, and Orbax's.
    TS_ASSERT_OK(kv.Write("0000000002.tmp-00000000000000cc/state/data/0-0.dat", "y"));
    leftovers = {"0000000002.tmp-00000000000000cc/"};
  }
  TS_ASSERT_OK(kv.Write("x.orbax-checkpoint-tmp-1234/d/0", "z"));
  leftovers.insert("x.orbax-checkpoint-tmp-1234/");

  Result<GarbageReport> young = CollectGarbage(&kv);  // the default: six hours
  TS_ASSERT_OK(young.status());
  EXPECT_THAT(young->removed, ::testing::IsEmpty());
  EXPECT_EQ(std::set<std::string>(young->kept_young.begin(), young->kept_young.end()), leftovers);
  for (const std::string& prefix : leftovers) {
    Result<std::vector<std::string>> keys = kv.List(prefix);
    TS_ASSERT_OK(keys.status());
    EXPECT_FALSE(keys->empty()) << prefix << " was removed";
  }

  Result<GarbageReport> old = CollectGarbage(&kv, {.min_age = std::chrono::seconds(0)});
  TS_ASSERT_OK(old.status());
  for (const std::string& prefix : leftovers) {
    Result<std::vector<std::string>> keys = kv.List(prefix);
    TS_ASSERT_OK(keys.status());
    EXPECT_TRUE(keys->empty()) << prefix << " was left";
  }
  int version = 0;
  TS_EXPECT_OK(test::RestoreReliabilityStep(&kv, "0000000001", 1, {1}, &version));
}

INSTANTIATE_TEST_SUITE_P(Stores, GarbageAgeTest,
                         ::testing::Values(StoreKind::kFile, StoreKind::kMemory,
                                           StoreKind::kMemoryNoRename),
                         [](const auto& info) { return test::StoreName(info.param); });

}  // namespace
}  // namespace tensorstash
