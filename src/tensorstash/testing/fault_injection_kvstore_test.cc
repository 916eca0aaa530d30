// FaultInjectionKvStore: the rules pick the calls they should, the errors look like a disk's and
// name the operation and key, and the crash model keeps exactly what was synced.
#include "tensorstash/testing/fault_injection_kvstore.h"

#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/testing/kvstore_conformance.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A rule; the other members keep their defaults unless set after.
FaultRule MakeRule(KvOpMask ops, FaultKind kind = FaultKind::kIoError, int64_t nth = 0,
                   std::string key_substring = "") {
  FaultRule rule;
  rule.ops = ops;
  rule.kind = kind;
  rule.nth = nth;
  rule.key_substring = std::move(key_substring);
  return rule;
}

class FaultInjectionKvStoreTest : public ::testing::TestWithParam<bool /*file backend*/> {
 protected:
  void SetUp() override {
    if (GetParam()) {
      std::string dir = ::testing::TempDir() + "fault_kvstore_XXXXXX";
      ASSERT_NE(::mkdtemp(dir.data()), nullptr) << std::strerror(errno);
      dir_ = dir;
      Result<std::unique_ptr<FileKvStore>> file = FileKvStore::Open(dir_ + "/root");
      TS_ASSERT_OK(file.status());
      base_ = *std::move(file);
    } else {
      base_ = std::make_unique<MemoryKvStore>();
    }
    store_ = std::make_unique<FaultInjectionKvStore>(base_.get(), /*seed=*/42);
  }
  void TearDown() override {
    store_.reset();
    base_.reset();
    if (!dir_.empty()) {
      std::error_code ignored;
      std::filesystem::remove_all(dir_, ignored);
    }
  }

  std::vector<std::string> Keys() {
    Result<std::vector<std::string>> keys = base_->List("");
    EXPECT_EQ(absl::OkStatus(), keys.status());
    return keys.ok() ? *keys : std::vector<std::string>();
  }
  std::string Get(std::string_view key) {
    Result<std::string> value = base_->Read(key);
    return value.ok() ? *value : StrCat("<", value.status().ToString(), ">");
  }

  std::string dir_;
  std::unique_ptr<KvStore> base_;
  std::unique_ptr<FaultInjectionKvStore> store_;
};

TEST_P(FaultInjectionKvStoreTest, PassesCallsThroughWithoutRules) {
  TS_ASSERT_OK(store_->Write("a/b", "hello"));
  Result<std::string> value = store_->Read("a/b");
  TS_ASSERT_OK(value.status());
  EXPECT_EQ(*value, "hello");
  EXPECT_EQ(store_->calls(Mask(KvOp::kWrite)), 1);
  EXPECT_EQ(store_->calls(Mask(KvOp::kRead)), 1);
  EXPECT_EQ(store_->faults_injected(), 0);
  EXPECT_THAT(store_->Describe(), HasSubstr("fault-injection:"));
}

TEST_P(FaultInjectionKvStoreTest, NthMatchingCallFailsWithEioNamingOperationAndKey) {
  store_->AddRule(MakeRule(Mask(KvOp::kWrite), FaultKind::kIoError, 2, "COMMIT"));
  TS_EXPECT_OK(store_->Write("s1/COMMIT", "1"));
  TS_EXPECT_OK(store_->Write("s2/index", "x"));  // does not match the key
  Status second = store_->Write("s2/COMMIT", "2");
  EXPECT_EQ(second.code(), ErrnoToStatus(EIO, "", "").code());
  EXPECT_THAT(second.message(), HasSubstr("write 's2/COMMIT'"));
  EXPECT_THAT(second.message(), HasSubstr(std::strerror(EIO)));
  EXPECT_THAT(second.message(), HasSubstr("injected"));
  TS_EXPECT_OK(store_->Write("s3/COMMIT", "3"));  // only the 2nd
  EXPECT_THAT(Keys(), ElementsAre("s1/COMMIT", "s2/index", "s3/COMMIT"));
  EXPECT_EQ(store_->faults_injected(), 1);
}

TEST_P(FaultInjectionKvStoreTest, NoSpaceIsResourceExhausted) {
  store_->AddRule(MakeRule(Mask(KvOp::kOpenForWrite), FaultKind::kNoSpace));
  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("d/0.dat");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(file.status().message(), HasSubstr("open for write 'd/0.dat'"));
  EXPECT_THAT(file.status().message(), HasSubstr(std::strerror(ENOSPC)));
}

TEST_P(FaultInjectionKvStoreTest, FileCallsAreFaultedToo) {
  store_->AddRule(MakeRule(Mask(KvOp::kFileSync)));
  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("d/0.dat");
  TS_ASSERT_OK(file.status());
  TS_EXPECT_OK((*file)->WriteAt(0, "abc", 3));
  Status synced = (*file)->Sync();
  EXPECT_FALSE(synced.ok());
  EXPECT_THAT(synced.message(), HasSubstr("file sync 'd/0.dat'"));
  TS_EXPECT_OK((*file)->Close());

  store_->ClearRules();
  store_->AddRule(MakeRule(Mask(KvOp::kFileReadAt)));
  Result<std::unique_ptr<ReadableFile>> reader = store_->OpenForRead("d/0.dat");
  TS_ASSERT_OK(reader.status());
  char buf[3];
  Status read = (*reader)->ReadAt(0, 3, buf);
  EXPECT_THAT(read.message(), HasSubstr("file read 'd/0.dat'"));
}

TEST_P(FaultInjectionKvStoreTest, ShortWriteAtPersistsOnlyAPrefix) {
  store_->AddRule(MakeRule(Mask(KvOp::kFileWriteAt), FaultKind::kShortWrite));
  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("f");
  TS_ASSERT_OK(file.status());
  Status wrote = (*file)->WriteAt(0, "abcdefgh", 8);
  EXPECT_EQ(wrote.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(wrote.message(), HasSubstr("file write 'f'"));
  EXPECT_THAT(wrote.message(), HasSubstr("short write"));
  TS_EXPECT_OK((*file)->Close());
  EXPECT_EQ(Get("f"), "abcd");
}

TEST_P(FaultInjectionKvStoreTest, ShortWriteOfAnObjectLeavesItTorn) {
  store_->AddRule(MakeRule(Mask(KvOp::kWrite), FaultKind::kShortWrite));
  Status wrote = store_->Write("COMMIT", "0123456789");
  EXPECT_EQ(wrote.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Get("COMMIT"), "01234");
}

TEST_P(FaultInjectionKvStoreTest, RandomFaultsAreReproducibleFromTheSeed) {
  auto pattern = [&](uint64_t seed) {
    FaultInjectionKvStore store(base_.get(), seed);
    FaultRule rule = MakeRule(Mask(KvOp::kSize));
    rule.probability = 0.5;
    store.AddRule(rule);
    std::string bits;
    for (int i = 0; i < 200; ++i)
      bits += store.Size("missing").status().code() == absl::StatusCode::kNotFound ? '.' : 'X';
    return bits;
  };
  const std::string a = pattern(7);
  EXPECT_EQ(a, pattern(7));
  EXPECT_NE(a, pattern(8));
  EXPECT_NE(a.find('X'), std::string::npos);
  EXPECT_NE(a.find('.'), std::string::npos);
}

TEST_P(FaultInjectionKvStoreTest, MaxFaultsLimitsTheHits) {
  FaultRule rule = MakeRule(Mask(KvOp::kWrite));
  rule.max_faults = 2;
  store_->AddRule(rule);
  EXPECT_FALSE(store_->Write("a", "1").ok());
  EXPECT_FALSE(store_->Write("b", "1").ok());
  TS_EXPECT_OK(store_->Write("c", "1"));
  EXPECT_EQ(store_->faults_injected(), 2);
}

TEST_P(FaultInjectionKvStoreTest, SlowCallSucceedsAndIsLogged) {
  FaultRule rule = MakeRule(Mask(KvOp::kWrite), FaultKind::kSlow);
  rule.delay = std::chrono::milliseconds(1);
  store_->AddRule(rule);
  TS_EXPECT_OK(store_->Write("a", "1"));
  EXPECT_EQ(Get("a"), "1");
  ASSERT_EQ(store_->fault_log().size(), 1u);
  EXPECT_THAT(store_->fault_log()[0], HasSubstr("write 'a' delayed"));
}

TEST_P(FaultInjectionKvStoreTest, CrashRuleTakesTheStoreDownUntilSimulateCrash) {
  TS_ASSERT_OK(store_->StartDurabilityTracking());
  store_->AddRule(MakeRule(Mask(KvOp::kWrite), FaultKind::kCrash, 2));
  TS_EXPECT_OK(store_->Write("a", "1"));
  Status crashed = store_->Write("b", "2");
  EXPECT_EQ(crashed.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(crashed.message(), HasSubstr("write 'b' failed: simulated crash"));
  EXPECT_TRUE(store_->crashed());
  Status later = store_->List("").status();
  EXPECT_EQ(later.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(later.message(), HasSubstr("list"));
  TS_ASSERT_OK(store_->SimulateCrash());
  EXPECT_FALSE(store_->crashed());
  // "a" was written but its name never synced: gone.
  EXPECT_THAT(Keys(), ElementsAre());
}

TEST_P(FaultInjectionKvStoreTest, SimulateCrashNeedsTracking) {
  EXPECT_EQ(store_->SimulateCrash().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_P(FaultInjectionKvStoreTest, CrashKeepsWhatWasThereBeforeTracking) {
  TS_ASSERT_OK(base_->Write("old/x", "kept"));
  TS_ASSERT_OK(store_->StartDurabilityTracking());
  TS_ASSERT_OK(store_->SimulateCrash());
  EXPECT_THAT(Keys(), ElementsAre("old/x"));
  EXPECT_EQ(Get("old/x"), "kept");
}

TEST_P(FaultInjectionKvStoreTest, CrashDropsUnsyncedBytesAndNames) {
  TS_ASSERT_OK(store_->StartDurabilityTracking());
  // Synced name and bytes: kept.
  TS_ASSERT_OK(store_->Write("d/synced", "S"));
  TS_ASSERT_OK(store_->Sync("d/synced"));
  // Bytes durable at once (Write); the name becomes durable with the SyncDirectory("d") below.
  TS_ASSERT_OK(store_->Write("d/unsynced", "U"));
  // A positional file: the first half synced, the second not; its name synced by the directory.
  {
    Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("d/data");
    TS_ASSERT_OK(file.status());
    TS_ASSERT_OK((*file)->WriteAt(0, "1234", 4));
    TS_ASSERT_OK((*file)->Sync());
    TS_ASSERT_OK((*file)->WriteAt(4, "5678", 4));
    TS_ASSERT_OK((*file)->Close());
  }
  TS_ASSERT_OK(store_->SyncDirectory("d"));
  // The directory "d" itself was created after the root was last synced: sync the root too.
  TS_ASSERT_OK(store_->SyncDirectory(""));
  // A file whose bytes were never synced: present (its name was synced below) but empty.
  {
    Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("d/nobytes");
    TS_ASSERT_OK(file.status());
    TS_ASSERT_OK((*file)->WriteAt(0, "zz", 2));
    TS_ASSERT_OK((*file)->Close());
  }
  TS_ASSERT_OK(store_->SyncDirectory("d"));
  TS_ASSERT_OK(store_->Write("d/late", "L"));  // after the last sync of d
  TS_ASSERT_OK(store_->SimulateCrash());
  EXPECT_THAT(Keys(), ElementsAre("d/data", "d/nobytes", "d/synced", "d/unsynced"));
  EXPECT_EQ(Get("d/synced"), "S");
  EXPECT_EQ(Get("d/data"), "1234");
  EXPECT_EQ(Get("d/nobytes"), "");
  EXPECT_EQ(Get("d/unsynced"), "U");  // d was synced after it was written
}

TEST_P(FaultInjectionKvStoreTest, NewDirectoryIsLostUntilItsParentIsSynced) {
  TS_ASSERT_OK(store_->StartDurabilityTracking());
  TS_ASSERT_OK(store_->Write("new/dir/file", "x"));
  TS_ASSERT_OK(store_->Sync("new/dir/file"));  // syncs new/dir, but not new or the root
  TS_ASSERT_OK(store_->SimulateCrash());
  EXPECT_THAT(Keys(), ElementsAre());

  TS_ASSERT_OK(store_->Write("new/dir/file", "x"));
  TS_ASSERT_OK(store_->Sync("new/dir/file"));
  TS_ASSERT_OK(store_->SyncDirectory("new"));
  TS_ASSERT_OK(store_->SyncDirectory(""));
  TS_ASSERT_OK(store_->SimulateCrash());
  EXPECT_THAT(Keys(), ElementsAre("new/dir/file"));
}

TEST_P(FaultInjectionKvStoreTest, UnsyncedReplaceRevertsToTheOldObject) {
  TS_ASSERT_OK(base_->Write("k", "old"));
  TS_ASSERT_OK(store_->StartDurabilityTracking());
  TS_ASSERT_OK(store_->Write("k", "new"));
  TS_ASSERT_OK(store_->SimulateCrash());
  EXPECT_EQ(Get("k"), "old");
  TS_ASSERT_OK(store_->Write("k", "new"));
  TS_ASSERT_OK(store_->Sync("k"));
  TS_ASSERT_OK(store_->SimulateCrash());
  EXPECT_EQ(Get("k"), "new");
}

TEST_P(FaultInjectionKvStoreTest, RenameIsUndoneUntilTheParentIsSynced) {
  if (!base_->SupportsRename()) GTEST_SKIP();
  TS_ASSERT_OK(base_->Write("tmp/a", "A"));
  TS_ASSERT_OK(store_->StartDurabilityTracking());
  TS_ASSERT_OK(store_->RenameDirectory("tmp", "step"));
  TS_ASSERT_OK(store_->SimulateCrash());
  EXPECT_THAT(Keys(), ElementsAre("tmp/a"));
  TS_ASSERT_OK(store_->RenameDirectory("tmp", "step"));
  TS_ASSERT_OK(store_->SyncDirectory(""));
  TS_ASSERT_OK(store_->SimulateCrash());
  EXPECT_THAT(Keys(), ElementsAre("step/a"));
}

TEST_P(FaultInjectionKvStoreTest, RenamedDirectoryKeepsWhatWasSyncedInside) {
  if (!base_->SupportsRename()) GTEST_SKIP();
  TS_ASSERT_OK(store_->StartDurabilityTracking());
  TS_ASSERT_OK(store_->Write("tmp/COMMIT", "c"));
  TS_ASSERT_OK(store_->Write("tmp/extra", "e"));
  TS_ASSERT_OK(store_->Sync("tmp/COMMIT"));  // both names of tmp are now durable in tmp
  TS_ASSERT_OK(store_->RenameDirectory("tmp", "step"));
  TS_ASSERT_OK(store_->SyncDirectory(""));
  TS_ASSERT_OK(store_->SimulateCrash());
  EXPECT_THAT(Keys(), ElementsAre("step/COMMIT", "step/extra"));
}

TEST_P(FaultInjectionKvStoreTest, UnsyncedDeletesComeBack) {
  TS_ASSERT_OK(base_->Write("a/keep", "0"));  // so that "a" stays a directory in every backend
  TS_ASSERT_OK(base_->Write("a/x", "1"));
  TS_ASSERT_OK(base_->Write("b/y", "2"));
  TS_ASSERT_OK(store_->StartDurabilityTracking());
  TS_ASSERT_OK(store_->Delete("a/x"));
  TS_ASSERT_OK(store_->DeletePrefix("b/"));
  TS_ASSERT_OK(store_->SimulateCrash());
  EXPECT_THAT(Keys(), ElementsAre("a/keep", "a/x", "b/y"));
  TS_ASSERT_OK(store_->Delete("a/x"));
  TS_ASSERT_OK(store_->DeletePrefix("b/"));
  TS_ASSERT_OK(store_->SyncDirectory("a"));
  TS_ASSERT_OK(store_->SyncDirectory(""));
  TS_ASSERT_OK(store_->SimulateCrash());
  EXPECT_THAT(Keys(), ElementsAre("a/keep"));
}

TEST_P(FaultInjectionKvStoreTest, ObjectStoreModelKeepsNamesButNotUnsyncedBytes) {
  TS_ASSERT_OK(base_->Write("gone", "1"));
  TS_ASSERT_OK(store_->StartDurabilityTracking(DurabilityModel::kObjectStore));
  TS_ASSERT_OK(store_->Write("a/b", "written"));
  TS_ASSERT_OK(store_->Delete("gone"));
  {
    Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("a/data");
    TS_ASSERT_OK(file.status());
    TS_ASSERT_OK((*file)->WriteAt(0, "xy", 2));
    TS_ASSERT_OK((*file)->Close());
  }
  TS_ASSERT_OK(store_->SimulateCrash());
  EXPECT_THAT(Keys(), ElementsAre("a/b", "a/data"));
  EXPECT_EQ(Get("a/b"), "written");
  EXPECT_EQ(Get("a/data"), "");
}

TEST_P(FaultInjectionKvStoreTest, FilesOpenedBeforeACrashFailAfterIt) {
  TS_ASSERT_OK(store_->StartDurabilityTracking());
  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("f");
  TS_ASSERT_OK(file.status());
  TS_ASSERT_OK(store_->SimulateCrash());
  Status wrote = (*file)->WriteAt(0, "x", 1);
  EXPECT_EQ(wrote.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(wrote.message(), HasSubstr("file write 'f'"));
  (void)(*file)->Close();
}

INSTANTIATE_TEST_SUITE_P(Backends, FaultInjectionKvStoreTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& param_info) {
                           return param_info.param ? "File" : "Memory";
                         });

}  // namespace
// The conformance suite (kvstore_conformance.h) through the fault-injecting decorator without
// rules, tracking durability: it must not change what the store does.
TS_INSTANTIATE_KVSTORE_CONFORMANCE(
    FaultInjection,
    std::vector<KvStoreBackend>(
        {{"FaultInjectionFile",
          [](const std::string& scratch_dir) -> std::unique_ptr<KvStore> {
            Result<std::unique_ptr<FileKvStore>> store = FileKvStore::Open(scratch_dir + "/root");
            if (!store.ok()) {
              ADD_FAILURE() << store.status();
              return nullptr;
            }
            auto fault = std::make_unique<FaultInjectionKvStore>(*std::move(store));
            if (Status s = fault->StartDurabilityTracking(); !s.ok()) ADD_FAILURE() << s;
            return fault;
          }},
         {"FaultInjectionMemory", [](const std::string&) -> std::unique_ptr<KvStore> {
            auto fault = std::make_unique<FaultInjectionKvStore>(std::make_unique<MemoryKvStore>());
            if (Status s = fault->StartDurabilityTracking(); !s.ok()) ADD_FAILURE() << s;
            return fault;
          }}}));

}  // namespace tensorstash
