// Saves and restores under injected storage faults (FaultInjectionKvStore), each test repeated
// over many random fault points. Seeded and reproducible: the seed is printed, and
// TS_FAULT_SEED=<n> replays one. What must hold after every fault:
//  - the error reaches the caller, naming the operation and the key that failed;
//  - no partial step opens as complete; every committed step restores bit for bit;
//  - no file descriptor or thread is leaked;
//  - crash mode: after a simulated power loss at any point of a save (sync on), every step whose
//    Commit returned OK is intact, and nothing incomplete opens.
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/reliability_test_util.h"
#include "tensorstash/testing/fault_injection_kvstore.h"

namespace tensorstash {
namespace {

using test::StoreKind;
using ::testing::HasSubstr;

uint64_t TestSeed() {
  if (const char* env = std::getenv("TS_FAULT_SEED")) return std::strtoull(env, nullptr, 10);
  return std::random_device()();
}

// Every kind of call, in the order of KvOp.
std::vector<KvOp> AllOps() {
  std::vector<KvOp> ops;
  for (int i = 0; i < kNumKvOps; ++i) ops.push_back(static_cast<KvOp>(i));
  return ops;
}

// How many calls of each kind a save makes (measured on one fault-free save).
std::map<KvOp, int64_t> CallProfile(FaultInjectionKvStore& kv, const std::function<void()>& run) {
  std::map<KvOp, int64_t> before;
  for (KvOp op : AllOps()) before[op] = kv.calls(Mask(op));
  run();
  std::map<KvOp, int64_t> profile;
  for (KvOp op : AllOps()) {
    const int64_t n = kv.calls(Mask(op)) - before[op];
    if (n > 0) profile[op] = n;
  }
  return profile;
}

class CheckpointFaultTest : public test::TempDirTest,
                            public ::testing::WithParamInterface<StoreKind> {
 protected:
  void SetUp() override {
    test::TempDirTest::SetUp();
    Result<std::unique_ptr<KvStore>> base = test::MakeStore(GetParam(), temp_dir() + "/root");
    TS_ASSERT_OK(base.status());
    base_ = *std::move(base);
    seed_ = TestSeed();
    std::cout << "[ seed     ] TS_FAULT_SEED=" << seed_ << "\n";
    RecordProperty("seed", std::to_string(seed_));
    rng_.seed(seed_);
    kv_ = std::make_unique<FaultInjectionKvStore>(base_.get(), seed_);
  }
  void TearDown() override {
    kv_.reset();
    base_.reset();
    test::TempDirTest::TearDown();
  }

  bool rename() const { return GetParam() != StoreKind::kMemoryNoRename; }

  // Every step of committed_ restores as the version recorded for it.
  void ExpectCommittedStepsIntact() {
    for (const auto& [folder, versions] : committed_) {
      int version = -1;
      Status restored =
          test::RestoreReliabilityStep(kv_.get(), folder, Step(folder), versions, &version);
      EXPECT_EQ(OkStatus(), restored) << "committed step " << folder;
    }
    test::ExpectNothingIncompleteOpens(kv_.get(), "", committed_);
  }

  static int64_t Step(const std::string& folder) { return std::stoll(folder); }

  std::unique_ptr<KvStore> base_;
  std::unique_ptr<FaultInjectionKvStore> kv_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  std::map<std::string, std::set<int>> committed_;  // step folder -> the version it holds
};

TEST_P(CheckpointFaultTest, InjectedSaveErrorsReachTheCallerAndHarmNothingCommitted) {
  const WriterOptions options = test::SmallFilesOptions();
  for (int64_t step : {1, 2}) {
    TS_ASSERT_OK(test::SaveReliabilityStep(kv_.get(), test::StepName(step), step, 0, options));
    committed_[test::StepName(step)] = {0};
  }
  std::map<KvOp, int64_t> profile = CallProfile(*kv_, [&] {
    TS_EXPECT_OK(test::SaveReliabilityStep(kv_.get(), test::StepName(3), 3, 0, options));
  });
  committed_[test::StepName(3)] = {0};
  ASSERT_FALSE(profile.empty());
  std::vector<std::pair<KvOp, int64_t>> ops(profile.begin(), profile.end());

  const int fds = test::CountProcEntries("fd");
  const int threads = test::CountThreads();
  int failed_saves = 0;
  int visible_after_failure = 0;
  for (int iteration = 0; iteration < 150; ++iteration) {
    const auto [op, count] = ops[rng_() % ops.size()];
    const FaultKind kind = std::vector<FaultKind>{FaultKind::kIoError, FaultKind::kNoSpace,
                                                  FaultKind::kShortWrite}[rng_() % 3];
    FaultRule rule;
    rule.ops = Mask(op);
    rule.kind = kind;
    rule.nth = 1 + static_cast<int64_t>(rng_() % static_cast<uint64_t>(count));
    // A quarter of the saves overwrite a committed step.
    const bool overwrite = rng_() % 4 == 0;
    const int64_t step = overwrite ? 1 + static_cast<int64_t>(rng_() % 3) : 100 + iteration;
    const std::string folder = test::StepName(step);
    const int version = iteration + 1;
    SCOPED_TRACE(StrCat("seed ", seed_, " iteration ", iteration, ": ", KvOpName(op), " call ",
                        rule.nth, " of ", count, ", kind ", static_cast<int>(kind), ", step ", step,
                        overwrite ? " (overwrite)" : ""));
    const size_t logged = kv_->fault_log().size();
    kv_->AddRule(rule);
    WriterOptions save_options = options;
    save_options.overwrite = overwrite;
    const Status saved = test::SaveReliabilityStep(kv_.get(), folder, step, version, save_options);
    kv_->ClearRules();
    const std::vector<std::string> log = kv_->fault_log();
    if (saved.ok()) {
      // The fault missed this save, or hit a best-effort call (removing a replaced step).
      committed_[folder] = {version};
    } else {
      ++failed_saves;
      ASSERT_EQ(log.size(), logged + 1) << "save failed without an injected fault: " << saved;
      EXPECT_THAT(log.back(), HasSubstr(StrCat(KvOpName(op), " '")));
      // The injected message names the operation and the key; the caller gets it.
      EXPECT_THAT(saved.message(), HasSubstr(log.back())) << saved;
      // The step holds its old version or (when the fault hit after the rename, e.g. the
      // parent's fsync) the new one, whole; or, for a new step or an overwrite without rename
      // (which removes the old step first), nothing.
      std::set<int> allowed = {version};
      if (committed_.count(folder) != 0) {
        allowed.insert(committed_[folder].begin(), committed_[folder].end());
      }
      int found = -1;
      const Status restored =
          test::RestoreReliabilityStep(kv_.get(), folder, step, allowed, &found);
      if (restored.ok()) {
        if (found == version) ++visible_after_failure;
        committed_[folder] = {found};
      } else {
        EXPECT_TRUE(absl::IsNotFound(restored) || absl::IsFailedPrecondition(restored)) << restored;
        if (committed_.count(folder) != 0 && rename()) {
          ADD_FAILURE() << "a failed overwrite lost committed step " << folder << ": " << restored;
        }
        committed_.erase(folder);
      }
    }
    ExpectCommittedStepsIntact();
    EXPECT_EQ(test::CountProcEntries("fd"), fds) << "file descriptors leaked";
    EXPECT_LE(test::CountThreadsSettled(threads), threads) << "threads leaked";
    if (HasFailure()) break;
  }
  EXPECT_GT(failed_saves, 10) << "too few faults hit a save to test anything";
  // Reported: the writer's contract says a failed Commit leaves nothing new visible, but a
  // failure after the rename (the parent's fsync) leaves the new step in place.
  std::cout << "[ note     ] " << visible_after_failure
            << " failed saves left their new step visible (failure after the rename)\n";
}

TEST_P(CheckpointFaultTest, InjectedRestoreErrorsReachTheCallerAndNeverGiveWrongData) {
  const WriterOptions options = test::SmallFilesOptions();
  TS_ASSERT_OK(test::SaveReliabilityStep(kv_.get(), test::StepName(7), 7, 3, options));
  int version = -1;
  std::map<KvOp, int64_t> profile = CallProfile(*kv_, [&] {
    TS_EXPECT_OK(test::RestoreReliabilityStep(kv_.get(), test::StepName(7), 7, {3}, &version));
  });
  std::vector<std::pair<KvOp, int64_t>> ops(profile.begin(), profile.end());
  ASSERT_FALSE(ops.empty());
  const int fds = test::CountProcEntries("fd");
  const int threads = test::CountThreads();
  int failed = 0;
  for (int iteration = 0; iteration < 100; ++iteration) {
    const auto [op, count] = ops[rng_() % ops.size()];
    FaultRule rule;
    rule.ops = Mask(op);
    rule.kind = rng_() % 2 == 0 ? FaultKind::kIoError : FaultKind::kShortWrite;
    rule.nth = 1 + static_cast<int64_t>(rng_() % static_cast<uint64_t>(count));
    SCOPED_TRACE(StrCat("seed ", seed_, " iteration ", iteration, ": ", KvOpName(op), " call ",
                        rule.nth, " of ", count));
    const size_t logged = kv_->fault_log().size();
    kv_->AddRule(rule);
    const Status restored =
        test::RestoreReliabilityStep(kv_.get(), test::StepName(7), 7, {3}, &version);
    kv_->ClearRules();
    if (!restored.ok()) {
      ++failed;
      const std::vector<std::string> log = kv_->fault_log();
      ASSERT_EQ(log.size(), logged + 1) << restored;
      EXPECT_THAT(restored.message(), HasSubstr(log.back()));
    }
    EXPECT_EQ(test::CountProcEntries("fd"), fds) << "file descriptors leaked";
    EXPECT_LE(test::CountThreadsSettled(threads), threads) << "threads leaked";
    if (HasFailure()) break;
  }
  EXPECT_GT(failed, 10);
  // And the step is untouched by all of it.
  TS_EXPECT_OK(test::RestoreReliabilityStep(kv_.get(), test::StepName(7), 7, {3}, &version));
}

TEST_P(CheckpointFaultTest, CrashAtAnyPointOfASaveKeepsEveryCommittedStep) {
  // A store without rename stands for an object store: its names are durable at once.
  TS_ASSERT_OK(kv_->StartDurabilityTracking(rename() ? DurabilityModel::kPosix
                                                     : DurabilityModel::kObjectStore));
  const WriterOptions options = test::SmallFilesOptions();
  for (int64_t step : {1, 2}) {
    TS_ASSERT_OK(test::SaveReliabilityStep(kv_.get(), test::StepName(step), step, 0, options));
    committed_[test::StepName(step)] = {0};
  }
  // A save that Commit reports as done survives a crash right after it.
  TS_ASSERT_OK(kv_->SimulateCrash());
  ExpectCommittedStepsIntact();
  std::map<KvOp, int64_t> profile = CallProfile(*kv_, [&] {
    TS_EXPECT_OK(test::SaveReliabilityStep(kv_.get(), test::StepName(3), 3, 0, options));
  });
  committed_[test::StepName(3)] = {0};
  int64_t total = 0;
  for (const auto& [op, n] : profile) total += n;

  int crashed_saves = 0;
  for (int iteration = 0; iteration < 50; ++iteration) {
    const bool overwrite = rng_() % 3 == 0;
    const int64_t step = overwrite ? 1 + static_cast<int64_t>(rng_() % 3) : 100 + iteration;
    const std::string folder = test::StepName(step);
    const int version = iteration + 1;
    FaultRule rule;
    rule.kind = FaultKind::kCrash;
    // Sometimes past the end of the save: then it completes and the crash comes after.
    rule.nth = 1 + static_cast<int64_t>(rng_() % static_cast<uint64_t>(total + total / 8));
    SCOPED_TRACE(StrCat("seed ", seed_, " iteration ", iteration, ": crash at call ", rule.nth,
                        " of about ", total, ", step ", step, overwrite ? " (overwrite)" : ""));
    kv_->AddRule(rule);
    WriterOptions save_options = options;
    save_options.overwrite = overwrite;
    const Status saved = test::SaveReliabilityStep(kv_.get(), folder, step, version, save_options);
    kv_->ClearRules();
    if (kv_->crashed()) ++crashed_saves;
    if (!saved.ok()) {
      EXPECT_EQ(saved.code(), absl::StatusCode::kUnavailable) << saved;
      EXPECT_THAT(saved.message(), HasSubstr("simulated crash"));
    }
    TS_ASSERT_OK(kv_->SimulateCrash());

    if (saved.ok()) {
      committed_[folder] = {version};
    } else {
      // Cut short: the step holds its old version, or the new one if the crash came after the
      // commit point, or (new step) nothing.
      std::set<int> allowed = {version};
      if (committed_.count(folder) != 0)
        allowed.insert(committed_[folder].begin(), committed_[folder].end());
      int found = -1;
      Status restored = test::RestoreReliabilityStep(kv_.get(), folder, step, allowed, &found);
      if (restored.ok()) {
        committed_[folder] = {found};
      } else if (committed_.count(folder) != 0 && rename()) {
        // A crash between an overwrite's two renames hides the old step until the next save of
        // it puts it back (docs/format.md, section 13).
        EXPECT_TRUE(absl::IsNotFound(restored) || absl::IsFailedPrecondition(restored)) << restored;
        Status again = test::SaveReliabilityStep(kv_.get(), folder, step, version, options);
        EXPECT_TRUE(absl::IsAlreadyExists(again)) << again;
      } else {
        EXPECT_TRUE(absl::IsNotFound(restored) || absl::IsFailedPrecondition(restored)) << restored;
        committed_.erase(folder);
      }
    }
    ExpectCommittedStepsIntact();
    if (HasFailure()) break;
  }
  EXPECT_GT(crashed_saves, 20);
}

// Known writer bugs (checkpoint_writer.cc, reported to the lead), as deterministic tests to
// enable once fixed.

// Leftover cleanup asks Size("<step>.old-*/COMMIT") to tell an interrupted overwrite's old step
// from garbage; an I/O error there is taken for "no COMMIT", and the only copy of the committed
// step is deleted.
TEST_P(CheckpointFaultTest, IoErrorWhileCheckingLeftoversNeverDeletesACommittedStep) {
  if (!rename()) GTEST_SKIP() << "only stores with rename have .old- folders";
  const WriterOptions options = test::SmallFilesOptions();
  const std::string folder = test::StepName(5);
  TS_ASSERT_OK(test::SaveReliabilityStep(kv_.get(), folder, 5, 0, options));
  // As a crash between an overwrite's two renames leaves it.
  TS_ASSERT_OK(kv_->RenameDirectory(folder, folder + ".old-0123456789abcdef"));
  FaultRule rule;
  rule.ops = Mask(KvOp::kSize);
  rule.key_substring = ".old-";
  kv_->AddRule(rule);
  const Status saved = test::SaveReliabilityStep(kv_.get(), folder, 5, 1, options);
  kv_->ClearRules();
  // Either the save fails with the injected error, keeping the .old- folder, or it puts the
  // old step back first and refuses to replace it (AlreadyExists). Never does the committed
  // version 0 disappear.
  EXPECT_FALSE(saved.ok()) << "a save without overwrite replaced committed step " << folder;
  int found = -1;
  const Status in_place = test::RestoreReliabilityStep(kv_.get(), folder, 5, {0}, &found);
  const bool aside = test::TopFolders(kv_.get(), "").count(folder + ".old-0123456789abcdef") != 0;
  EXPECT_TRUE(in_place.ok() || aside)
      << "committed step lost: " << in_place << "; save said: " << saved;
}

// The writer's contract: a failed Commit leaves nothing new visible, even when the parent
// folder's fsync fails after the rename (the rename is undone).
TEST_P(CheckpointFaultTest, FailedCommitLeavesNothingNewVisible) {
  if (!rename()) GTEST_SKIP() << "the rename path";
  const WriterOptions options = test::SmallFilesOptions();
  std::map<KvOp, int64_t> profile = CallProfile(*kv_, [&] {
    TS_EXPECT_OK(test::SaveReliabilityStep(kv_.get(), test::StepName(1), 1, 0, options));
  });
  FaultRule rule;
  rule.ops = Mask(KvOp::kSyncDirectory);
  rule.nth = profile[KvOp::kSyncDirectory];  // the last one: the parent, after the rename
  kv_->AddRule(rule);
  const Status saved = test::SaveReliabilityStep(kv_.get(), test::StepName(2), 2, 0, options);
  ASSERT_FALSE(saved.ok());
  const Status opened = CheckpointReader::Open(kv_.get(), test::StepName(2)).status();
  EXPECT_FALSE(opened.ok()) << "Commit failed (" << saved << ") but the step opens";
}

INSTANTIATE_TEST_SUITE_P(Backends, CheckpointFaultTest,
                         ::testing::Values(StoreKind::kFile, StoreKind::kMemory,
                                           StoreKind::kMemoryNoRename),
                         [](const ::testing::TestParamInfo<StoreKind>& param_info) {
                           return test::StoreName(param_info.param);
                         });

}  // namespace
}  // namespace tensorstash
