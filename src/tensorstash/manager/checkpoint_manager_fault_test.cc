// CheckpointManager under injected faults and simulated crashes (issue "Reliability"): the
// error reaches the caller, the manager keeps working once the fault is gone, every step it
// lists restores bit for bit, no thread or descriptor is leaked, and nothing incomplete is ever
// listed, also after a crash and a reopen.
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/manager/checkpoint_manager.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/testing/reliability_test_util.h"
#include "tensorstash/testing/fault_injection_kvstore.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

uint64_t Seed() {
  const char* env = std::getenv("TS_FAULT_SEED");
  const uint64_t seed = env != nullptr ? std::strtoull(env, nullptr, 10) : std::random_device()();
  std::printf("manager fault test seed: %llu (TS_FAULT_SEED=%llu replays it)\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  return seed;
}

// The state of `step` (version 0 of the reliability step), held for one save.
struct HeldState {
  std::vector<test::HeldShards> held;
  SaveRequest request;
};
std::unique_ptr<HeldState> StateOf(int64_t step) {
  auto state = std::make_unique<HeldState>();
  const std::vector<test::TestArray> arrays = test::ReliabilityStepArrays(step, 0);
  state->held.reserve(arrays.size());
  for (const test::TestArray& a : arrays) {
    state->held.push_back(test::HoldAllShards(a.spec, a.seed, a.sharding));
    state->request.arrays.push_back({a.spec, state->held.back().shards});
  }
  state->request.metadata_json = StrCat("{\"step\": ", step, "}");
  state->request.process_state = StrCat("iterator at ", step);
  return state;
}

ManagerOptions Options() {
  ManagerOptions options;
  options.writer = test::SmallFilesOptions();
  options.max_to_keep = 3;
  return options;
}

void ExpectListedStepsRestore(KvStore* kv, const std::vector<int64_t>& steps) {
  for (int64_t step : steps) {
    int found = -1;
    TS_EXPECT_OK(test::RestoreReliabilityStep(kv, CheckpointManager::StepDir(step).value(), step,
                                              {0}, &found))
        << "listed step " << step;
  }
}

TEST(ManagerFaultTest, KeepsWorkingAfterRandomFaults) {
  const uint64_t seed = Seed();
  std::mt19937_64 random(seed);
  for (int round = 0; round < 12; ++round) {
    SCOPED_TRACE(StrCat("round ", round, " seed ", seed));
    const int fds = test::CountProcEntries("fd");
    const int threads = test::CountThreads();
    MemoryKvStore base;
    FaultInjectionKvStore kv(&base, random());
    auto mgr = CheckpointManager::Open(&kv, Options());
    ASSERT_TRUE(mgr.ok()) << mgr.status();
    FaultRule rule;
    rule.ops = kMutatingKvOps;
    rule.kind = random() % 2 == 0 ? FaultKind::kIoError : FaultKind::kNoSpace;
    rule.probability = 0.02;
    kv.AddRule(rule);
    int failures = 0;
    for (int64_t step = 1; step <= 8; ++step) {
      std::unique_ptr<HeldState> state = StateOf(step);
      Status status = step % 2 == 0 ? (*mgr)->SaveAsync(step, std::move(state->request))
                                    : (*mgr)->Save(step, std::move(state->request));
      if (step % 2 == 0) {
        // The async save's own error comes with the wait (or the next call).
        Status waited = (*mgr)->WaitUntilFinished();
        if (status.ok()) status = waited;
      }
      if (!status.ok()) {
        ++failures;
        EXPECT_THAT(status.message(), HasSubstr("injected")) << status;
      }
    }
    kv.ClearRules();
    // Once the disk behaves again, saves succeed and every listed step restores.
    std::unique_ptr<HeldState> state = StateOf(100);
    TS_ASSERT_OK((*mgr)->Save(100, std::move(state->request)));
    TS_ASSERT_OK((*mgr)->WaitUntilFinished());
    const std::vector<int64_t> listed = (*mgr)->AllSteps();
    EXPECT_EQ(listed.back(), 100);
    ExpectListedStepsRestore(&kv, listed);
    TS_ASSERT_OK((*mgr)->Close());
    // A new manager lists what the old one listed, plus any step whose retention deletion
    // failed (it is whole, and goes at the next retention), and no leftovers remain.
    auto again = CheckpointManager::Open(&kv, Options());
    ASSERT_TRUE(again.ok()) << again.status();
    for (int64_t step : listed) {
      EXPECT_THAT((*again)->AllSteps(), ::testing::Contains(step));
    }
    ExpectListedStepsRestore(&kv, (*again)->AllSteps());
    for (const std::string& folder : test::TopFolders(&kv, "")) {
      EXPECT_FALSE(IsTemporaryStepName(folder)) << folder;
    }
    // The failed saves (sync and async) and retention left no thread or descriptor behind.
    TS_ASSERT_OK((*again)->Close());
    EXPECT_EQ(test::CountProcEntries("fd"), fds) << "file descriptors leaked";
    EXPECT_LE(test::CountThreadsSettled(threads), threads) << "threads leaked";
    std::printf("round %d: %d of 8 saves failed\n", round, failures);
  }
}

TEST(ManagerFaultTest, ACrashNeverLosesACommittedStepNorListsAPartialOne) {
  const uint64_t seed = Seed();
  std::mt19937_64 random(seed);
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE(StrCat("round ", round, " seed ", seed));
    MemoryKvStore base;
    FaultInjectionKvStore kv(&base, random());
    TS_ASSERT_OK(kv.StartDurabilityTracking());
    std::vector<int64_t> committed;  // steps whose save returned OK
    {
      ManagerOptions options = Options();
      options.on_commit = [&](const SaveStats& stats) { committed.push_back(stats.step); };
      auto mgr = CheckpointManager::Open(&kv, options);
      ASSERT_TRUE(mgr.ok()) << mgr.status();
      FaultRule crash;
      crash.ops = kMutatingKvOps;
      crash.kind = FaultKind::kCrash;
      crash.nth = 1 + static_cast<int64_t>(random() % 400);  // a save makes about 60 such calls
      kv.AddRule(crash);
      for (int64_t step = 1; step <= 8 && !kv.crashed(); ++step) {
        std::unique_ptr<HeldState> state = StateOf(step);
        Status status = (*mgr)->SaveAsync(step, std::move(state->request));
        if (status.ok()) status = (*mgr)->WaitUntilFinished();
      }
      (void)(*mgr)->Close();
      kv.ClearRules();
    }
    TS_ASSERT_OK(kv.SimulateCrash());
    auto mgr = CheckpointManager::Open(&kv, Options());
    ASSERT_TRUE(mgr.ok()) << mgr.status();
    const std::vector<int64_t> listed = (*mgr)->AllSteps();
    // The newest committed steps survive the crash (older ones may have gone by retention).
    if (!committed.empty()) {
      EXPECT_THAT(listed, ::testing::Contains(committed.back()));
    }
    ExpectListedStepsRestore(&kv, listed);
    for (const std::string& folder : test::TopFolders(&kv, "")) {
      EXPECT_FALSE(IsTemporaryStepName(folder)) << folder;
    }
    // And it goes on saving.
    std::unique_ptr<HeldState> state = StateOf(50);
    TS_ASSERT_OK((*mgr)->Save(50, std::move(state->request)));
    TS_ASSERT_OK((*mgr)->Close());
  }
}

}  // namespace
}  // namespace tensorstash
