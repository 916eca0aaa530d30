// CheckpointManager with incremental steps (ManagerOptions::incremental, docs/format.md 6.1):
// each save against the newest listed step, retention that retires a dropped step a kept one
// refers to and deletes it once none does (in the same session or a later one), overwrites that
// would break a step refused, and gc that follows the references.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/manager/checkpoint_manager.h"
#include "tensorstash/manager/garbage.h"
#include "tensorstash/manager/step_listing.h"
#include "tensorstash/manager/step_store.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using test::BytesEqual;
using test::MakeArrayData;
using test::StoreKind;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// A LoRA-like state: a frozen matrix of 8 chunks that changes only with `frozen_seed`, and a
// small adapter that changes every step.
struct State {
  std::vector<char> frozen;   // float32 64 x 64: 8 chunks of 2 KiB
  std::vector<char> adapter;  // float32 8 x 16: 1 chunk
};

State MakeState(int64_t step, uint64_t frozen_seed) {
  return {MakeArrayData(DType::kFloat32, {64, 64}, frozen_seed),
          MakeArrayData(DType::kFloat32, {8, 16}, 1000 + static_cast<uint64_t>(step))};
}

SaveRequest Request(const State& state) {
  SaveRequest request;
  request.arrays.resize(2);
  request.arrays[0].spec = {"frozen/w", DType::kFloat32, {64, 64}, Codec::kNone, 3, 2048};
  request.arrays[0].shards = {{Box::FromShape({64, 64}), state.frozen.data()}};
  request.arrays[1].spec = {"lora/a", DType::kFloat32, {8, 16}, Codec::kNone, 3, 2048};
  request.arrays[1].shards = {{Box::FromShape({8, 16}), state.adapter.data()}};
  return request;
}

ManagerOptions Incremental(int max_to_keep) {
  ManagerOptions options;
  options.incremental = true;
  options.max_to_keep = max_to_keep;
  options.writer.sync = false;
  options.writer.io_threads = 2;
  return options;
}

std::string Dir(int64_t step) { return StepStore::StepDir(step).value(); }

bool StepFolderExists(KvStore* kv, int64_t step) {
  Result<std::vector<std::string>> keys = kv->List(Dir(step) + "/");
  return keys.ok() && !keys->empty();
}

std::vector<std::string> DependsOn(KvStore* kv, int64_t step) {
  Result<CommitRecord> record = ReadStepCommitRecord(kv, Dir(step));
  EXPECT_TRUE(record.ok()) << record.status();
  return record.ok() ? record->depends_on : std::vector<std::string>{};
}

// `step` restores to MakeState(step, frozen_seed), bit for bit, and verifies clean.
void ExpectStep(KvStore* kv, int64_t step, uint64_t frozen_seed) {
  SCOPED_TRACE(StrCat("step ", step));
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv, Dir(step));
  ASSERT_TRUE(reader.ok()) << reader.status();
  const State want = MakeState(step, frozen_seed);
  std::vector<char> frozen(want.frozen.size()), adapter(want.adapter.size());
  TS_ASSERT_OK((*reader)->Read({"frozen/w", Box::FromShape({64, 64}), DType::kFloat32,
                                frozen.data()}));
  TS_ASSERT_OK(
      (*reader)->Read({"lora/a", Box::FromShape({8, 16}), DType::kFloat32, adapter.data()}));
  EXPECT_TRUE(BytesEqual(want.frozen, frozen));
  EXPECT_TRUE(BytesEqual(want.adapter, adapter));
  Result<std::vector<BadChunk>> bad = (*reader)->Verify();
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_THAT(*bad, IsEmpty());
}

class ManagerIncrementalTest : public test::TempDirTest,
                               public ::testing::WithParamInterface<StoreKind> {
 protected:
  void SetUp() override {
    test::TempDirTest::SetUp();
    Result<std::unique_ptr<KvStore>> store = test::MakeStore(GetParam(), temp_dir() + "/root");
    ASSERT_TRUE(store.ok()) << store.status();
    kv_ = *std::move(store);
  }
  void TearDown() override {
    kv_.reset();
    test::TempDirTest::TearDown();
  }

  std::unique_ptr<CheckpointManager> Open(ManagerOptions options) {
    Result<std::unique_ptr<CheckpointManager>> mgr = CheckpointManager::Open(kv_.get(), options);
    EXPECT_TRUE(mgr.ok()) << mgr.status();
    return mgr.ok() ? *std::move(mgr) : nullptr;
  }

  // Saves step `step` of a state whose frozen part is `frozen_seed`'s.
  Status SaveStep(CheckpointManager* mgr, int64_t step, uint64_t frozen_seed, bool async = false,
                  SaveStats* stats = nullptr) {
    // An async save copies the buffers before SaveAsync returns; a sync one reads them only
    // during the call.
    const State state = MakeState(step, frozen_seed);
    if (!async) return mgr->Save(step, Request(state), stats);
    return mgr->SaveAsync(step, Request(state));
  }

  std::unique_ptr<KvStore> kv_;
};

TEST_P(ManagerIncrementalTest, SavesAgainstTheNewestStepAndRetiresABaseAKeptStepNeeds) {
  auto mgr = Open(Incremental(2));
  ASSERT_NE(mgr, nullptr);
  SaveStats first, second;
  TS_ASSERT_OK(SaveStep(mgr.get(), 1, /*frozen_seed=*/7, false, &first));
  TS_ASSERT_OK(SaveStep(mgr.get(), 2, 7, false, &second));
  // Step 2 wrote the adapter only: the frozen matrix is a reference to step 1's file.
  EXPECT_EQ(first.raw_bytes, 64u * 64 * 4 + 8 * 16 * 4);
  EXPECT_EQ(second.raw_bytes, 8u * 16 * 4);
  EXPECT_THAT(DependsOn(kv_.get(), 2), ElementsAre("0000000001"));
  TS_ASSERT_OK(SaveStep(mgr.get(), 3, 7));
  // Saved against step 2, whose frozen chunks are references: step 3 names step 1 directly.
  EXPECT_THAT(DependsOn(kv_.get(), 3), ElementsAre("0000000001"));
  TS_ASSERT_OK(mgr->WaitUntilFinished());
  // Retention dropped step 1, which steps 2 and 3 refer to: unlisted, retired, on storage.
  EXPECT_THAT(mgr->AllSteps(), ElementsAre(2, 3));
  EXPECT_THAT(mgr->RetiredSteps(), ElementsAre(1));
  EXPECT_TRUE(kv_->Size(Dir(1) + "/" + kRetiredFileName).ok());
  TS_ASSERT_OK(SaveStep(mgr.get(), 4, 7));
  TS_ASSERT_OK(mgr->WaitUntilFinished());
  // Step 2 was dropped and nothing refers to it (steps 3 and 4 wrote their own adapters):
  // deleted; step 1 still retired.
  EXPECT_THAT(mgr->AllSteps(), ElementsAre(3, 4));
  EXPECT_FALSE(StepFolderExists(kv_.get(), 2));
  EXPECT_THAT(mgr->RetiredSteps(), ElementsAre(1));
  for (int64_t step : {3, 4}) ExpectStep(kv_.get(), step, 7);

  // The frozen matrix changes (a new phase of training): once no kept step refers to step 1,
  // the first retention deletes it, in this same session.
  TS_ASSERT_OK(SaveStep(mgr.get(), 5, 8));
  TS_ASSERT_OK(mgr->WaitUntilFinished());
  EXPECT_THAT(DependsOn(kv_.get(), 5), IsEmpty());
  EXPECT_THAT(mgr->RetiredSteps(), ElementsAre(1));  // step 4 is kept and refers to it
  TS_ASSERT_OK(SaveStep(mgr.get(), 6, 8));
  TS_ASSERT_OK(mgr->WaitUntilFinished());
  EXPECT_THAT(mgr->AllSteps(), ElementsAre(5, 6));
  EXPECT_THAT(mgr->RetiredSteps(), IsEmpty());
  for (int64_t gone : {1, 2, 3, 4}) EXPECT_FALSE(StepFolderExists(kv_.get(), gone)) << gone;
  ExpectStep(kv_.get(), 5, 8);
  ExpectStep(kv_.get(), 6, 8);
  TS_ASSERT_OK(mgr->Close());
}

TEST_P(ManagerIncrementalTest, AsyncSavesAreIncrementalToo) {
  auto mgr = Open(Incremental(2));
  ASSERT_NE(mgr, nullptr);
  for (int64_t step = 1; step <= 4; ++step) {
    TS_ASSERT_OK(SaveStep(mgr.get(), step, 7, /*async=*/true));
  }
  TS_ASSERT_OK(mgr->WaitUntilFinished());
  EXPECT_THAT(mgr->AllSteps(), ElementsAre(3, 4));
  EXPECT_THAT(mgr->RetiredSteps(), ElementsAre(1));
  EXPECT_THAT(DependsOn(kv_.get(), 4), ElementsAre("0000000001"));
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv_.get(), Dir(4));
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->commit_record().items.at("state").data_bytes, 8u * 16 * 4)
      << "step 4 wrote more than its adapter";
  for (int64_t step : {3, 4}) ExpectStep(kv_.get(), step, 7);
  TS_ASSERT_OK(mgr->Close());
}

TEST_P(ManagerIncrementalTest, SameAsStepSkipsHashingOnlyWhenThatStepIsTheBase) {
  auto mgr = Open(Incremental(0));
  ASSERT_NE(mgr, nullptr);
  TS_ASSERT_OK(SaveStep(mgr.get(), 1, 7));
  // The frozen buffer is promised unchanged since step 1's save (it is not: taken at its word,
  // its chunks are step 1's without being read).
  State changed = MakeState(2, 7);
  changed.frozen[0] ^= 1;
  auto promised = [](const State& state, int64_t since) {
    SaveRequest request = Request(state);
    for (ShardData& shard : request.arrays[0].shards) shard.same_as_base = true;
    request.same_as_step = since;
    return request;
  };
  SaveStats stats;
  TS_ASSERT_OK(mgr->Save(2, promised(changed, 1), &stats));
  EXPECT_EQ(stats.unhashed_chunks, 8u);
  EXPECT_EQ(stats.referenced_chunks, 8u);
  ExpectStep(kv_.get(), 2, 7);
  // Step 3's base is step 2, not the step named: every chunk is hashed, the changed one written.
  TS_ASSERT_OK(mgr->Save(3, promised(changed, 1), &stats));
  EXPECT_EQ(stats.unhashed_chunks, 0u);
  EXPECT_EQ(stats.referenced_chunks, 7u + 1u);  // the other frozen chunks, the same adapter
  // A step this manager did not save (another session's) is never taken on a promise.
  TS_ASSERT_OK(mgr->Close());
  mgr = Open(Incremental(0));
  ASSERT_NE(mgr, nullptr);
  TS_ASSERT_OK(mgr->Save(4, promised(changed, 3), &stats));
  EXPECT_EQ(stats.unhashed_chunks, 0u);
  TS_ASSERT_OK(mgr->Close());
}

TEST_P(ManagerIncrementalTest, AnUnreadableBaseMakesTheNextSaveAFullOneSayingWhy) {
  auto mgr = Open(Incremental(0));
  ASSERT_NE(mgr, nullptr);
  TS_ASSERT_OK(SaveStep(mgr.get(), 1, 7));
  TS_ASSERT_OK(SaveStep(mgr.get(), 2, 7));
  // Step 2's own data file removed by hand: the next save is made in full.
  std::vector<std::string> keys = kv_->List(Dir(2) + "/").value();
  int removed = 0;
  for (const std::string& key : keys) {
    if (key.find("state/data/") != std::string::npos) {
      TS_ASSERT_OK(kv_->Delete(key));
      ++removed;
    }
  }
  ASSERT_GT(removed, 0);
  SaveStats stats;
  TS_ASSERT_OK(SaveStep(mgr.get(), 3, 7, false, &stats));
  EXPECT_THAT(stats.base_unreadable, HasSubstr("0000000002"));
  EXPECT_EQ(stats.referenced_chunks, 0u);
  EXPECT_EQ(stats.raw_bytes, 64u * 64 * 4 + 8 * 16 * 4);
  EXPECT_THAT(DependsOn(kv_.get(), 3), IsEmpty());
  ExpectStep(kv_.get(), 3, 7);
  // Step 3's COMMIT made unreadable: the same, asynchronously.
  TS_ASSERT_OK(kv_->Write(Dir(3) + "/" + kCommitFileName, "not a commit record"));
  TS_ASSERT_OK(SaveStep(mgr.get(), 4, 7, /*async=*/true));
  TS_ASSERT_OK(mgr->WaitUntilFinished());
  EXPECT_THAT(DependsOn(kv_.get(), 4), IsEmpty());
  ExpectStep(kv_.get(), 4, 7);
  // With a readable base again, saves are incremental.
  TS_ASSERT_OK(SaveStep(mgr.get(), 5, 7, false, &stats));
  EXPECT_EQ(stats.base_unreadable, "");
  EXPECT_THAT(DependsOn(kv_.get(), 5), ElementsAre("0000000004"));
  TS_ASSERT_OK(mgr->Close());
}

TEST_P(ManagerIncrementalTest, ARetiredStepStaysUnlistedAcrossSessionsAndGoesWhenUnneeded) {
  {
    auto mgr = Open(Incremental(2));
    ASSERT_NE(mgr, nullptr);
    for (int64_t step = 1; step <= 3; ++step) TS_ASSERT_OK(SaveStep(mgr.get(), step, 7));
    TS_ASSERT_OK(mgr->Close());
  }
  {
    // Reopened (even as a manager that does not save incrementally): step 1 is not listed, nor
    // is it ever a base; it is still needed by steps 2 and 3.
    ManagerOptions plain = Incremental(2);
    plain.incremental = false;
    auto mgr = Open(plain);
    ASSERT_NE(mgr, nullptr);
    EXPECT_THAT(mgr->AllSteps(), ElementsAre(2, 3));
    EXPECT_THAT(mgr->RetiredSteps(), ElementsAre(1));
    EXPECT_EQ(mgr->LatestStep(), 3);
    TS_ASSERT_OK(SaveStep(mgr.get(), 4, 7));
    TS_ASSERT_OK(mgr->WaitUntilFinished());
    EXPECT_THAT(mgr->RetiredSteps(), ElementsAre(1));  // step 3 is kept and refers to it
    TS_ASSERT_OK(SaveStep(mgr.get(), 5, 7));
    TS_ASSERT_OK(mgr->WaitUntilFinished());
    // Steps 4 and 5 are full steps: nothing kept refers to step 1 any more.
    EXPECT_THAT(mgr->AllSteps(), ElementsAre(4, 5));
    EXPECT_THAT(mgr->RetiredSteps(), IsEmpty());
    EXPECT_FALSE(StepFolderExists(kv_.get(), 1));
    for (int64_t step : {4, 5}) ExpectStep(kv_.get(), step, 7);
    TS_ASSERT_OK(mgr->Close());
  }
}

TEST_P(ManagerIncrementalTest, ARetiredStepNobodyNeedsIsDeletedAtTheFirstRetentionAfterOpen) {
  {
    auto mgr = Open(Incremental(2));
    ASSERT_NE(mgr, nullptr);
    for (int64_t step = 1; step <= 3; ++step) TS_ASSERT_OK(SaveStep(mgr.get(), step, 7));
    TS_ASSERT_OK(mgr->Close());
  }
  // Its dependents deleted by hand: the retired step is needed by nothing.
  StepStore steps(kv_.get());
  TS_ASSERT_OK(steps.DeleteStep(2));
  TS_ASSERT_OK(steps.DeleteStep(3));
  auto mgr = Open(Incremental(2));
  ASSERT_NE(mgr, nullptr);
  EXPECT_THAT(mgr->AllSteps(), IsEmpty());
  EXPECT_THAT(mgr->RetiredSteps(), ElementsAre(1));
  TS_ASSERT_OK(SaveStep(mgr.get(), 4, 7));  // a full step: nothing is listed to save against
  TS_ASSERT_OK(mgr->WaitUntilFinished());
  EXPECT_THAT(DependsOn(kv_.get(), 4), IsEmpty());
  EXPECT_THAT(mgr->RetiredSteps(), IsEmpty());
  EXPECT_FALSE(StepFolderExists(kv_.get(), 1));
  ExpectStep(kv_.get(), 4, 7);
  TS_ASSERT_OK(mgr->Close());
}

TEST_P(ManagerIncrementalTest, OverwritingAStepOthersReferToIsRefusedNamingThem) {
  ManagerOptions options = Incremental(0);
  options.writer.overwrite = true;
  auto mgr = Open(options);
  ASSERT_NE(mgr, nullptr);
  TS_ASSERT_OK(SaveStep(mgr.get(), 1, 7));
  TS_ASSERT_OK(SaveStep(mgr.get(), 2, 7));
  TS_ASSERT_OK(SaveStep(mgr.get(), 3, 7));
  Status refused = SaveStep(mgr.get(), 1, 9);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("0000000002"));
  EXPECT_THAT(refused.message(), HasSubstr("0000000003"));
  // Step 3 is the newest: nothing refers to it, so it may be replaced.
  TS_ASSERT_OK(SaveStep(mgr.get(), 3, 7));
  for (int64_t step : {1, 2, 3}) ExpectStep(kv_.get(), step, 7);
  TS_ASSERT_OK(mgr->Close());

  // The writer refuses it alike, outside any manager.
  const State state = MakeState(1, 9);
  WriterOptions writer_options;
  writer_options.overwrite = true;
  writer_options.sync = false;
  auto writer = CheckpointWriter::Create(kv_.get(), Dir(1), writer_options).value();
  SaveRequest request = Request(state);
  for (ArrayToSave& array : request.arrays) {
    TS_ASSERT_OK(writer->AddArray(array.spec, array.shards));
  }
  refused = writer->Commit();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("0000000002"));
  for (int64_t step : {1, 2, 3}) ExpectStep(kv_.get(), step, 7);
}

TEST_P(ManagerIncrementalTest, ARetiredStepIsSavedAgainOnlyWhenNothingRefersToIt) {
  auto mgr = Open(Incremental(1));
  ASSERT_NE(mgr, nullptr);
  TS_ASSERT_OK(SaveStep(mgr.get(), 1, 7));
  TS_ASSERT_OK(SaveStep(mgr.get(), 2, 7));
  TS_ASSERT_OK(mgr->WaitUntilFinished());
  EXPECT_THAT(mgr->RetiredSteps(), ElementsAre(1));
  Status refused = SaveStep(mgr.get(), 1, 9);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("step(s) 2"));
  ExpectStep(kv_.get(), 2, 7);
  TS_ASSERT_OK(mgr->Close());
  // Without step 2, step 1 may be saved again: the retired folder goes first.
  TS_ASSERT_OK(StepStore(kv_.get()).DeleteStep(2));
  mgr = Open(Incremental(0));
  ASSERT_NE(mgr, nullptr);
  TS_ASSERT_OK(SaveStep(mgr.get(), 1, 9));
  EXPECT_THAT(mgr->AllSteps(), ElementsAre(1));
  EXPECT_THAT(mgr->RetiredSteps(), IsEmpty());
  EXPECT_FALSE(kv_->Size(Dir(1) + "/" + kRetiredFileName).ok());
  ExpectStep(kv_.get(), 1, 9);
  TS_ASSERT_OK(mgr->Close());
}

TEST_P(ManagerIncrementalTest, GcKeepsWhatStepsReferToAndRemovesUnneededRetiredSteps) {
  {
    auto mgr = Open(Incremental(2));
    ASSERT_NE(mgr, nullptr);
    for (int64_t step = 1; step <= 3; ++step) TS_ASSERT_OK(SaveStep(mgr.get(), step, 7));
    TS_ASSERT_OK(mgr->Close());
  }
  Result<std::vector<StepListing>> listed = ListCheckpointRoot(kv_.get());
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 3u);
  EXPECT_EQ((*listed)[0].status, "retired");
  EXPECT_EQ((*listed)[1].status, "complete");
  // Step 2 borrows the frozen matrix from step 1, and owns the rest.
  EXPECT_EQ((*listed)[1].borrowed_bytes, 64u * 64 * 4);
  EXPECT_THAT((*listed)[1].depends_on, ElementsAre("0000000001"));
  EXPECT_GT((*listed)[1].bytes, 8u * 16 * 4);
  EXPECT_LT((*listed)[1].bytes, 64u * 64 * 4);
  // Steps 2 and 3 refer to step 1: gc removes nothing of it.
  Result<GarbageReport> report = CollectGarbage(kv_.get(), {.min_age = std::chrono::seconds(0)});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_THAT(report->removed, IsEmpty());
  for (int64_t step : {2, 3}) ExpectStep(kv_.get(), step, 7);
  // Step 3 deleted by hand: step 2 still needs step 1.
  TS_ASSERT_OK(StepStore(kv_.get()).DeleteStep(3));
  report = CollectGarbage(kv_.get(), {.min_age = std::chrono::seconds(0)});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_THAT(report->removed, IsEmpty());
  ExpectStep(kv_.get(), 2, 7);
  // And step 2: step 1 is needed by nothing. A dry run says so and removes nothing.
  TS_ASSERT_OK(StepStore(kv_.get()).DeleteStep(2));
  report = CollectGarbage(kv_.get(), {.dry_run = true, .min_age = std::chrono::seconds(0)});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_THAT(report->removed, ElementsAre("0000000001/"));
  EXPECT_GT(report->bytes, 64u * 64 * 4);
  EXPECT_TRUE(StepFolderExists(kv_.get(), 1));
  report = CollectGarbage(kv_.get(), {.min_age = std::chrono::seconds(0)});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_THAT(report->removed, ElementsAre("0000000001/"));
  EXPECT_FALSE(StepFolderExists(kv_.get(), 1));
}

TEST_P(ManagerIncrementalTest, ADroppedBaseIsDeletedAfterTheStepsThatReferToIt) {
  // Steps 1 (full), 2 and 3 (against 1 and 2). A manager keeping one step drops 1 and 2 once 4
  // is saved in full: 2 and 3 go, then 1 (each before what it refers to), nothing is retired.
  {
    auto mgr = Open(Incremental(0));
    ASSERT_NE(mgr, nullptr);
    for (int64_t step = 1; step <= 3; ++step) TS_ASSERT_OK(SaveStep(mgr.get(), step, 7));
    TS_ASSERT_OK(mgr->Close());
  }
  ManagerOptions options = Incremental(1);
  options.incremental = false;
  auto mgr = Open(options);
  ASSERT_NE(mgr, nullptr);
  TS_ASSERT_OK(SaveStep(mgr.get(), 4, 8));
  TS_ASSERT_OK(mgr->WaitUntilFinished());
  EXPECT_THAT(mgr->AllSteps(), ElementsAre(4));
  EXPECT_THAT(mgr->RetiredSteps(), IsEmpty());
  for (int64_t gone : {1, 2, 3}) EXPECT_FALSE(StepFolderExists(kv_.get(), gone)) << gone;
  ExpectStep(kv_.get(), 4, 8);
  TS_ASSERT_OK(mgr->Close());
}

INSTANTIATE_TEST_SUITE_P(Stores, ManagerIncrementalTest,
                         ::testing::Values(StoreKind::kFile, StoreKind::kMemory,
                                           StoreKind::kMemoryNoRename),
                         [](const auto& param_info) { return test::StoreName(param_info.param); });

// A store that SIGKILLs its own process at its `kill_at`-th mutating call, before making it: a
// death at an exact point of a save or of retention (0: never). Counts the calls.
class KillingKvStore final : public ForwardingKvStore {
 public:
  KillingKvStore(KvStore* base, int64_t kill_at) : ForwardingKvStore(base), kill_at_(kill_at) {}
  int64_t calls() const { return calls_.load(); }

  Status Write(std::string_view key, std::string_view value) override {
    Tick();
    return base()->Write(key, value);
  }
  Status WriteIfAbsent(std::string_view key, std::string_view value) override {
    Tick();
    return base()->WriteIfAbsent(key, value);
  }
  Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view key) override {
    Tick();
    return base()->OpenForWrite(key);
  }
  Status Delete(std::string_view key) override {
    Tick();
    return base()->Delete(key);
  }
  Status DeletePrefix(std::string_view prefix) override {
    Tick();
    return base()->DeletePrefix(prefix);
  }
  Status RenameDirectory(std::string_view from, std::string_view to) override {
    Tick();
    return base()->RenameDirectory(from, to);
  }
  Status Sync(std::string_view key) override {
    Tick();
    return base()->Sync(key);
  }

 private:
  void Tick() {
    if (++calls_ == kill_at_) ::kill(::getpid(), SIGKILL);
  }
  const int64_t kill_at_;
  std::atomic<int64_t> calls_{0};
};

// The frozen part of the crash workload's step `step`.
uint64_t CrashFrozenSeed(int64_t step) { return step <= 3 ? 7 : 8; }

// Steps 1-5 of a LoRA-like run keeping 2 steps, saved incrementally (1-3 synchronously, 4-5 in
// the background); the frozen part changes at step 4. Retention retires step 1 (after 3),
// deletes step 2 (after 4), then deletes step 3 and, after it, step 1 (after 5).
Status CrashWorkload(KvStore* kv) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointManager> mgr,
                      CheckpointManager::Open(kv, Incremental(2)));
  for (int64_t step = 1; step <= 5; ++step) {
    const State state = MakeState(step, CrashFrozenSeed(step));
    if (step <= 3) {
      TS_RETURN_IF_ERROR(mgr->Save(step, Request(state)));
    } else {
      TS_RETURN_IF_ERROR(mgr->SaveAsync(step, Request(state)));
    }
  }
  return mgr->Close();
}

// Kills a process running CrashWorkload at points spread over all of its mutating calls (saves,
// commits, RETIRED marks, deletions), then checks the root: every listed step restores bit for
// bit, and the run goes on (two more steps) with nothing left behind but listed and retired
// steps that a listed step needs.
TEST(ManagerIncrementalCrashTest, SigkillDuringSavesAndRetentionLosesNoListedStep) {
  const std::string scratch =
      ::testing::TempDir() + "tensorstash_inc_crash_" + std::to_string(::getpid());
  std::filesystem::remove_all(scratch);
  int64_t total = 0;
  {
    auto file = FileKvStore::Open(scratch + "/count").value();
    KillingKvStore counting(file.get(), 0);
    TS_ASSERT_OK(CrashWorkload(&counting));
    total = counting.calls();
  }
  ASSERT_GT(total, 20);
  // About 40 deaths: each costs a fork, a short run and a check.
  const int64_t stride = std::max<int64_t>(1, total / 40);
  int killed = 0;
  for (int64_t kill_at = 1; kill_at <= total; kill_at += stride) {
    SCOPED_TRACE(StrCat("killed at mutating call ", kill_at, " of ", total));
    const std::string root = StrCat(scratch, "/kill-", kill_at);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      // Never returns into gtest: dies by SIGKILL, or exits.
      Result<std::unique_ptr<FileKvStore>> file = FileKvStore::Open(root);
      if (!file.ok()) ::_exit(2);
      KillingKvStore kv(file->get(), kill_at);
      ::_exit(CrashWorkload(&kv).ok() ? 0 : 1);
    }
    int wstatus = 0;
    ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
    ASSERT_TRUE(WIFSIGNALED(wstatus) || (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0))
        << "the workload failed without being killed";
    killed += WIFSIGNALED(wstatus) ? 1 : 0;

    auto file = FileKvStore::Open(root).value();
    auto mgr = CheckpointManager::Open(file.get(), Incremental(2));
    ASSERT_TRUE(mgr.ok()) << mgr.status();
    EXPECT_THAT((*mgr)->DamagedSteps(), IsEmpty());
    for (int64_t step : (*mgr)->AllSteps()) ExpectStep(file.get(), step, CrashFrozenSeed(step));
    for (int64_t step : {6, 7}) {
      const State state = MakeState(step, 8);
      TS_ASSERT_OK((*mgr)->Save(step, Request(state)));
    }
    TS_ASSERT_OK((*mgr)->WaitUntilFinished());
    EXPECT_THAT((*mgr)->AllSteps(), ElementsAre(6, 7));
    for (int64_t step : {6, 7}) ExpectStep(file.get(), step, 8);
    // On storage: the listed steps and the retired ones they need, nothing else.
    std::set<int64_t> needed;
    for (int64_t step : {6, 7}) {
      for (const std::string& base : DependsOn(file.get(), step)) {
        const int64_t base_step = StepStore::ParseStepName(base).value();
        if (base_step != 6) needed.insert(base_step);
      }
    }
    const std::vector<int64_t> retired = (*mgr)->RetiredSteps();
    EXPECT_EQ(std::set<int64_t>(retired.begin(), retired.end()), needed);
    std::set<std::string> folders;
    for (const auto& entry : std::filesystem::directory_iterator(root)) {
      if (entry.is_directory()) folders.insert(entry.path().filename().string());
    }
    std::set<std::string> want = {Dir(6), Dir(7)};
    for (int64_t step : needed) want.insert(Dir(step));
    EXPECT_EQ(folders, want);
    TS_ASSERT_OK((*mgr)->Close());
    std::filesystem::remove_all(root);
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_GT(killed, 30);
  std::filesystem::remove_all(scratch);
}

TEST(ManagerIncrementalOptionsTest, HoldingsCannotBeIncremental) {
  MemoryKvStore kv;
  ManagerOptions options;
  options.incremental = true;
  options.writer.holding = true;
  EXPECT_EQ(CheckpointManager::Open(&kv, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tensorstash
