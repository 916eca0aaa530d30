// CheckpointManager: step folders, retention, leftovers at open, the lock, async saves.
#include "tensorstash/manager/checkpoint_manager.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"

namespace tensorstash {
namespace {

using test::BytesEqual;
using test::MakeStore;
using test::StoreKind;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// The state of one step: a float32 matrix held as two row shards, and an int64 vector. The
// values depend on `step`, so that a restore of the wrong step is caught.
struct StepState {
  std::vector<float> w;    // 6 x 5
  std::vector<int64_t> b;  // 7
};

StepState MakeState(int64_t step) {
  StepState state;
  for (int i = 0; i < 30; ++i) state.w.push_back(static_cast<float>(step * 100 + i) * 0.5f);
  for (int i = 0; i < 7; ++i) state.b.push_back(step * 1000 + i);
  return state;
}

std::vector<ArrayToSave> Describe(const StepState& state) {
  std::vector<ArrayToSave> arrays(2);
  arrays[0].spec = {"params/w", DType::kFloat32, {6, 5}};
  arrays[0].shards = {{Box({0, 0}, {3, 5}), state.w.data()},
                      {Box({3, 0}, {3, 5}), state.w.data() + 15}};
  arrays[1].spec = {"params/b", DType::kInt64, {7}};
  arrays[1].spec.codec = Codec::kZstd;
  // Two replicas of the whole vector (as two devices would hold it).
  arrays[1].shards = {{Box::FromShape({7}), state.b.data(), 0, 2},
                      {Box::FromShape({7}), state.b.data(), 1, 2}};
  return arrays;
}

SaveRequest Request(const StepState& state) {
  SaveRequest request;
  request.arrays = Describe(state);
  return request;
}

// Checks that `step` restores to MakeState(step), bit for bit.
void ExpectStep(KvStore* kv, int64_t step) {
  SCOPED_TRACE(StrCat("step ", step));
  Result<std::string> dir = CheckpointManager::StepDir(step);
  ASSERT_TRUE(dir.ok()) << dir.status();
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv, *dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const StepState want = MakeState(step);
  std::vector<float> w(30);
  std::vector<int64_t> b(7);
  TS_ASSERT_OK((*reader)->Read({"params/w", Box::FromShape({6, 5}), DType::kFloat32, w.data()}));
  TS_ASSERT_OK((*reader)->Read({"params/b", Box::FromShape({7}), DType::kInt64, b.data()}));
  EXPECT_EQ(std::memcmp(w.data(), want.w.data(), 30 * sizeof(float)), 0);
  EXPECT_EQ(b, want.b);
}

ManagerOptions Fast() {
  ManagerOptions options;
  options.writer.sync = false;
  options.writer.io_threads = 2;
  return options;
}

bool HasKeyUnder(KvStore* kv, const std::string& prefix) {
  Result<std::vector<std::string>> keys = kv->List(prefix);
  return keys.ok() && !keys->empty();
}

class CheckpointManagerTest : public test::TempDirTest,
                              public ::testing::WithParamInterface<StoreKind> {
 protected:
  void SetUp() override {
    test::TempDirTest::SetUp();
    Result<std::unique_ptr<KvStore>> store = MakeStore(GetParam(), temp_dir() + "/root");
    ASSERT_TRUE(store.ok()) << store.status();
    kv_ = *std::move(store);
  }
  void TearDown() override {
    kv_.reset();
    test::TempDirTest::TearDown();
  }

  std::unique_ptr<CheckpointManager> OpenManager(ManagerOptions options = Fast()) {
    Result<std::unique_ptr<CheckpointManager>> mgr = CheckpointManager::Open(kv_.get(), options);
    EXPECT_TRUE(mgr.ok()) << mgr.status();
    return mgr.ok() ? *std::move(mgr) : nullptr;
  }

  Status SaveStep(CheckpointManager* mgr, int64_t step) {
    const StepState state = MakeState(step);
    return mgr->Save(step, Request(state));
  }

  std::unique_ptr<KvStore> kv_;
};

class CheckpointManagerLockProcessTest : public test::TempDirTest {};

TEST(CheckpointManagerStepDirTest, PadsToTenDigits) {
  EXPECT_EQ(CheckpointManager::StepDir(0).value(), "0000000000");
  EXPECT_EQ(CheckpointManager::StepDir(1000).value(), "0000001000");
  EXPECT_EQ(CheckpointManager::StepDir(9999999999).value(), "9999999999");
  EXPECT_EQ(CheckpointManager::StepDir(10000000000).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckpointManager::StepDir(-1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointManagerOptionsTest, ShouldSaveAndBadOptions) {
  MemoryKvStore kv;
  ManagerOptions options;
  options.save_interval_steps = 100;
  auto mgr = CheckpointManager::Open(&kv, options);
  ASSERT_TRUE(mgr.ok()) << mgr.status();
  EXPECT_TRUE((*mgr)->ShouldSave(0));
  EXPECT_TRUE((*mgr)->ShouldSave(300));
  EXPECT_FALSE((*mgr)->ShouldSave(301));
  EXPECT_FALSE((*mgr)->LatestStep().has_value());
  TS_EXPECT_OK((*mgr)->Close());

  ManagerOptions every;
  auto mgr2 = CheckpointManager::Open(&kv, every);
  ASSERT_TRUE(mgr2.ok()) << mgr2.status();
  EXPECT_TRUE((*mgr2)->ShouldSave(7));
  TS_EXPECT_OK((*mgr2)->Close());

  ManagerOptions bad;
  bad.max_to_keep = -1;
  EXPECT_EQ(CheckpointManager::Open(&kv, bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(CheckpointManagerTest, SavesListAndRestoreBitForBit) {
  auto mgr = OpenManager();
  ASSERT_NE(mgr, nullptr);
  for (int64_t step : {20, 10, 30}) TS_ASSERT_OK(SaveStep(mgr.get(), step));
  EXPECT_THAT(mgr->AllSteps(), ElementsAre(10, 20, 30));
  EXPECT_EQ(mgr->LatestStep(), 30);
  for (int64_t step : {10, 20, 30}) ExpectStep(kv_.get(), step);
  // A complete step is not saved again.
  EXPECT_EQ(SaveStep(mgr.get(), 20).code(), absl::StatusCode::kAlreadyExists);
  TS_ASSERT_OK(mgr->Close());
  EXPECT_EQ(SaveStep(mgr.get(), 40).code(), absl::StatusCode::kFailedPrecondition);

  // A new manager finds the same steps.
  auto again = OpenManager();
  ASSERT_NE(again, nullptr);
  EXPECT_THAT(again->AllSteps(), ElementsAre(10, 20, 30));
}

TEST_P(CheckpointManagerTest, MaxToKeepDeletesTheOldest) {
  ManagerOptions options = Fast();
  options.max_to_keep = 2;
  auto mgr = OpenManager(options);
  ASSERT_NE(mgr, nullptr);
  for (int64_t step = 1; step <= 5; ++step) TS_ASSERT_OK(SaveStep(mgr.get(), step));
  // Unlisted at once; deleted in the background.
  EXPECT_THAT(mgr->AllSteps(), ElementsAre(4, 5));
  TS_ASSERT_OK(mgr->WaitUntilFinished());
  for (int64_t step = 1; step <= 3; ++step) {
    EXPECT_FALSE(HasKeyUnder(kv_.get(), CheckpointManager::StepDir(step).value() + "/")) << step;
  }
  ExpectStep(kv_.get(), 4);
  ExpectStep(kv_.get(), 5);
}

TEST_P(CheckpointManagerTest, KeepPeriodStepsAreKeptForever) {
  ManagerOptions options = Fast();
  options.max_to_keep = 2;
  options.keep_period = 3;
  auto mgr = OpenManager(options);
  ASSERT_NE(mgr, nullptr);
  for (int64_t step = 1; step <= 8; ++step) TS_ASSERT_OK(SaveStep(mgr.get(), step));
  EXPECT_THAT(mgr->AllSteps(), ElementsAre(3, 6, 7, 8));
  ExpectStep(kv_.get(), 3);
  ExpectStep(kv_.get(), 6);
}

TEST_P(CheckpointManagerTest, LeftoversAreIgnoredAndRemovedAtOpen) {
  {
    auto mgr = OpenManager();
    ASSERT_NE(mgr, nullptr);
    TS_ASSERT_OK(SaveStep(mgr.get(), 10));
    TS_ASSERT_OK(mgr->Close());
  }
  // A crashed save of 20 (rename stores), a step folder without COMMIT (a crashed save on a
  // store without rename), a stale ".old-" folder without COMMIT, and a file not ours.
  TS_ASSERT_OK(kv_->Write("0000000020.tmp-0123456789abcdef/state/index", "partial"));
  TS_ASSERT_OK(kv_->Write("0000000020.tmp-0123456789abcdef/COMMIT", "{}"));
  TS_ASSERT_OK(kv_->Write("0000000030/state/data/0-0.dat", "partial"));
  TS_ASSERT_OK(kv_->Write("0000000010.old-fedcba9876543210/state/index", "old"));
  TS_ASSERT_OK(kv_->Write("notes/readme.txt", "keep me"));

  auto mgr = OpenManager();
  ASSERT_NE(mgr, nullptr);
  EXPECT_THAT(mgr->AllSteps(), ElementsAre(10));
  EXPECT_EQ(mgr->LatestStep(), 10);
  EXPECT_FALSE(HasKeyUnder(kv_.get(), "0000000020.tmp-0123456789abcdef/"));
  EXPECT_FALSE(HasKeyUnder(kv_.get(), "0000000030/"));
  EXPECT_FALSE(HasKeyUnder(kv_.get(), "0000000010.old-fedcba9876543210/"));
  EXPECT_EQ(kv_->Read("notes/readme.txt").value(), "keep me");
  ExpectStep(kv_.get(), 10);
  // The step of a removed leftover can be saved.
  TS_ASSERT_OK(SaveStep(mgr.get(), 30));
  ExpectStep(kv_.get(), 30);
}

// Issue 13, item 15: a damaged COMMIT on the newest step made LatestStep return a step that
// cannot be restored. Damage that still parses (a CRC digit changed, a size changed) and damage
// that does not (torn) are both caught; the previous step is the latest and the damaged one is
// reported, left on storage and never deleted by retention.
TEST_P(CheckpointManagerTest, ADamagedCommitOnTheNewestStepIsReportedAndSkipped) {
  const std::vector<std::pair<std::string, std::string>> damages = {
      {"\"tree_crc32c\": ", "\"tree_crc32c\": 1"},
      {"\"index_size\": ", "\"index_size\": 9"},
      {"\"format\"", "\"fo"},
  };
  for (const auto& [find, replace] : damages) {
    SCOPED_TRACE(replace);
    TS_ASSERT_OK(kv_->DeletePrefix(""));
    {
      auto mgr = OpenManager();
      ASSERT_NE(mgr, nullptr);
      TS_ASSERT_OK(SaveStep(mgr.get(), 10));
      TS_ASSERT_OK(SaveStep(mgr.get(), 20));
      TS_ASSERT_OK(mgr->Close());
    }
    const std::string commit_key = "0000000020/COMMIT";
    std::string bad = kv_->Read(commit_key).value();
    const size_t at = bad.find(find);
    ASSERT_NE(at, std::string::npos) << bad;
    bad.replace(at, find.size(), replace);
    if (replace.find("fo") != std::string::npos) bad.resize(at + replace.size());
    TS_ASSERT_OK(kv_->Write(commit_key, bad));

    ManagerOptions options = Fast();
    options.max_to_keep = 1;
    auto mgr = OpenManager(options);
    ASSERT_NE(mgr, nullptr);
    EXPECT_THAT(mgr->AllSteps(), ElementsAre(10));
    EXPECT_EQ(mgr->LatestStep(), 10);
    const std::map<int64_t, std::string> damaged = mgr->DamagedSteps();
    ASSERT_EQ(damaged.size(), 1u);
    EXPECT_EQ(damaged.begin()->first, 20);
    EXPECT_THAT(damaged.begin()->second, HasSubstr("0000000020"));
    // Retention (max_to_keep=1) deletes the old good step after a new save, never the damaged one.
    TS_ASSERT_OK(SaveStep(mgr.get(), 30));
    TS_ASSERT_OK(mgr->WaitUntilFinished());
    EXPECT_THAT(mgr->AllSteps(), ElementsAre(30));
    EXPECT_EQ(kv_->Read(commit_key).value(), bad);
    TS_ASSERT_OK(mgr->Close());
  }
}

// Issue 14, part 3: the manager lists its steps with the delimiter listing (the step folders),
// never every key under the root (every data file of every step).
TEST(CheckpointManagerListingTest, OpeningListsStepFoldersNotEveryKey) {
  class Recording final : public ForwardingKvStore {
   public:
    using ForwardingKvStore::ForwardingKvStore;
    Result<std::vector<std::string>> List(std::string_view prefix) override {
      lists.emplace_back(prefix);
      return ForwardingKvStore::List(prefix);
    }
    std::vector<std::string> lists;
  };
  MemoryKvStore memory;
  {
    Recording kv(&memory);
    auto mgr = CheckpointManager::Open(&kv, Fast()).value();
    for (int64_t step : {1, 2, 3}) {
      const StepState state = MakeState(step);
      TS_ASSERT_OK(mgr->Save(step, Request(state)));
    }
    TS_ASSERT_OK(mgr->Close());
  }
  Recording kv(&memory);
  auto mgr = CheckpointManager::Open(&kv, Fast()).value();
  EXPECT_THAT(mgr->AllSteps(), ElementsAre(1, 2, 3));
  for (const std::string& prefix : kv.lists) EXPECT_NE(prefix, "") << "listed the whole root";
}

TEST_P(CheckpointManagerTest, InterruptedOverwriteIsRolledBackAtOpen) {
  if (!kv_->SupportsRename()) GTEST_SKIP() << "only stores with rename move steps aside";
  {
    auto mgr = OpenManager();
    ASSERT_NE(mgr, nullptr);
    TS_ASSERT_OK(SaveStep(mgr.get(), 7));
    TS_ASSERT_OK(mgr->Close());
  }
  // A crash between the two renames of an overwrite: the old step moved aside, the new one
  // still under its temporary name.
  TS_ASSERT_OK(kv_->RenameDirectory("0000000007", "0000000007.old-00000000000000aa"));
  TS_ASSERT_OK(kv_->Write("0000000007.tmp-00000000000000bb/COMMIT", "{}"));
  auto mgr = OpenManager();
  ASSERT_NE(mgr, nullptr);
  EXPECT_THAT(mgr->AllSteps(), ElementsAre(7));
  ExpectStep(kv_.get(), 7);
  EXPECT_FALSE(HasKeyUnder(kv_.get(), "0000000007.old-00000000000000aa/"));
  EXPECT_FALSE(HasKeyUnder(kv_.get(), "0000000007.tmp-00000000000000bb/"));
}

TEST_P(CheckpointManagerTest, SecondManagerOnTheSameRootIsRefused) {
  auto first = OpenManager();
  ASSERT_NE(first, nullptr);
  Result<std::unique_ptr<CheckpointManager>> second = CheckpointManager::Open(kv_.get(), Fast());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), HasSubstr("locked by another manager"));
  if (GetParam() == StoreKind::kFile) {
    // Another store object on the same directory (as another process would open it).
    Result<std::unique_ptr<FileKvStore>> other = FileKvStore::Open(temp_dir() + "/root");
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_EQ(CheckpointManager::Open(other->get(), Fast()).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  TS_ASSERT_OK(first->Close());
  auto third = OpenManager();
  EXPECT_NE(third, nullptr);
}

TEST_P(CheckpointManagerTest, SaveAsyncCopiesTheBuffersBeforeReturning) {
  std::atomic<int> commits{0};
  std::atomic<int64_t> last_step{-1};
  std::atomic<uint64_t> last_bytes{0};
  ManagerOptions options = Fast();
  options.max_to_keep = 2;
  options.on_commit = [&](const SaveStats& stats) {
    ++commits;
    last_step = stats.step;
    last_bytes = stats.raw_bytes;
  };
  auto mgr = OpenManager(options);
  ASSERT_NE(mgr, nullptr);
  for (int64_t step = 1; step <= 4; ++step) {
    StepState state = MakeState(step);
    TS_ASSERT_OK(mgr->SaveAsync(step, Request(state)));
    // The training loop goes on changing its state at once.
    std::fill(state.w.begin(), state.w.end(), -1.0f);
    std::fill(state.b.begin(), state.b.end(), -1);
  }
  TS_ASSERT_OK(mgr->WaitUntilFinished());
  EXPECT_EQ(commits.load(), 4);
  EXPECT_EQ(last_step.load(), 4);
  EXPECT_EQ(last_bytes.load(), 30 * sizeof(float) + 7 * sizeof(int64_t));
  EXPECT_THAT(mgr->AllSteps(), ElementsAre(3, 4));
  ExpectStep(kv_.get(), 3);
  ExpectStep(kv_.get(), 4);
  // A complete step and invalid arrays are refused at once.
  const StepState state = MakeState(4);
  EXPECT_EQ(mgr->SaveAsync(4, Request(state)).code(), absl::StatusCode::kAlreadyExists);
  SaveRequest bad = Request(state);
  bad.arrays[0].shards[1].box = Box({3, 0}, {4, 5});  // past the shape
  Status refused = mgr->SaveAsync(5, bad);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("params/w"));
  TS_EXPECT_OK(mgr->WaitUntilFinished());
  EXPECT_THAT(mgr->AllSteps(), ElementsAre(3, 4));
  TS_EXPECT_OK(mgr->Close());
}

// Stable shards (views of immutable buffers) are written by the background save from where
// they are; the request's keep_alive, their owner, is dropped once the writes are over, before
// the commit callback, and never while they may still be read.
// Issue 13, item 3: saves from two threads at once joined and reassigned the worker thread
// without a lock, which aborted the process about one run in ten. They now run one after the
// other; every step commits.
TEST_P(CheckpointManagerTest, SavesFromSeveralThreadsAtOnceAreSerialized) {
  for (int round = 0; round < 8; ++round) {
    SCOPED_TRACE(StrCat("round ", round));
    auto mgr = OpenManager();
    ASSERT_NE(mgr, nullptr);
    constexpr int kThreads = 4;
    std::vector<std::thread> threads;
    std::vector<Status> results(kThreads * 2);
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        const int64_t first = round * 100 + t * 2 + 1;
        const StepState a = MakeState(first);
        results[t * 2] = mgr->SaveAsync(first, Request(a));
        const StepState b = MakeState(first + 1);
        results[t * 2 + 1] =
            t % 2 == 0 ? mgr->Save(first + 1, Request(b)) : mgr->SaveAsync(first + 1, Request(b));
        (void)mgr->WaitUntilFinished();
      });
    }
    for (std::thread& thread : threads) thread.join();
    TS_ASSERT_OK(mgr->Close());
    for (const Status& result : results) TS_EXPECT_OK(result);
    EXPECT_EQ(mgr->AllSteps().size(), static_cast<size_t>((round + 1) * kThreads * 2));
    for (int64_t step : mgr->AllSteps()) ExpectStep(kv_.get(), step);
  }
}

TEST_P(CheckpointManagerTest, SaveAsyncWritesStableShardsInPlaceAndDropsTheirOwnerAtTheEnd) {
  struct Owner {
    Owner(StepState s, std::atomic<bool>* d) : state(std::move(s)), dropped(d) {}
    ~Owner() { *dropped = true; }
    StepState state;
    std::atomic<bool>* dropped;
  };
  std::atomic<bool> dropped{false};
  std::atomic<int> commits_after_drop{0};
  ManagerOptions options = Fast();
  options.on_commit = [&](const SaveStats&) {
    if (dropped.load()) ++commits_after_drop;
  };
  auto mgr = OpenManager(options);
  ASSERT_NE(mgr, nullptr);
  std::weak_ptr<Owner> watch;
  {
    auto owner = std::make_shared<Owner>(MakeState(7), &dropped);
    watch = owner;
    SaveRequest request = Request(owner->state);
    request.arrays[0].shards[0].stable = true;  // one stable shard beside copied ones
    for (ShardData& shard : request.arrays[1].shards) shard.stable = true;
    request.keep_alive = std::move(owner);
    TS_ASSERT_OK(mgr->SaveAsync(7, std::move(request)));
  }
  TS_ASSERT_OK(mgr->WaitUntilFinished());
  EXPECT_TRUE(watch.expired());
  EXPECT_EQ(commits_after_drop.load(), 1);
  ExpectStep(kv_.get(), 7);
  TS_EXPECT_OK(mgr->Close());
}

// The lock works between processes, and a holder that dies (SIGKILL) releases it.
TEST_F(CheckpointManagerLockProcessTest, LockIsSharedWithOtherProcessesAndFreedAtDeath) {
  const std::string root = temp_dir() + "/root";
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child only opens a manager, reports, and waits to be killed: it never returns into
    // gtest. (Earlier tests joined their threads, so fork copies a single-threaded process.)
    ::close(ready[0]);
    Result<std::unique_ptr<FileKvStore>> kv = FileKvStore::Open(root);
    if (!kv.ok()) ::_exit(2);
    Result<std::unique_ptr<CheckpointManager>> mgr = CheckpointManager::Open(kv->get(), Fast());
    const char byte = mgr.ok() ? 'y' : 'n';
    if (::write(ready[1], &byte, 1) != 1) ::_exit(3);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  ::close(ready[0]);
  ASSERT_EQ(byte, 'y');
  Result<std::unique_ptr<FileKvStore>> kv = FileKvStore::Open(root);
  ASSERT_TRUE(kv.ok()) << kv.status();
  Result<std::unique_ptr<CheckpointManager>> refused = CheckpointManager::Open(kv->get(), Fast());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  Result<std::unique_ptr<CheckpointManager>> mgr = CheckpointManager::Open(kv->get(), Fast());
  EXPECT_TRUE(mgr.ok()) << mgr.status();
}

INSTANTIATE_TEST_SUITE_P(Stores, CheckpointManagerTest,
                         ::testing::Values(StoreKind::kFile, StoreKind::kMemory,
                                           StoreKind::kMemoryNoRename),
                         [](const auto& param_info) { return test::StoreName(param_info.param); });

// A store that fails OpenForWrite while `fail` is set (a full disk).
class FlakyKvStore final : public ForwardingKvStore {
 public:
  explicit FlakyKvStore(KvStore* base) : ForwardingKvStore(base) {}
  std::atomic<bool> fail{false};

  Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view key) override {
    if (fail) return ResourceExhaustedError(StrCat("open for write '", key, "': disk full"));
    return base()->OpenForWrite(key);
  }

 private:
};

TEST(CheckpointManagerAsyncErrorTest, BackgroundErrorsSurfaceOnTheNextCallOnce) {
  MemoryKvStore base;
  FlakyKvStore kv(&base);
  auto opened = CheckpointManager::Open(&kv, Fast());
  ASSERT_TRUE(opened.ok()) << opened.status();
  CheckpointManager& mgr = **opened;

  // WaitUntilFinished returns the error, once.
  kv.fail = true;
  StepState s1 = MakeState(1);
  TS_ASSERT_OK(mgr.SaveAsync(1, Request(s1)));
  Status error = mgr.WaitUntilFinished();
  EXPECT_EQ(error.code(), absl::StatusCode::kResourceExhausted) << error;
  EXPECT_THAT(error.message(), HasSubstr("disk full"));
  TS_EXPECT_OK(mgr.WaitUntilFinished());
  EXPECT_FALSE(mgr.LatestStep().has_value());

  // The next SaveAsync returns it, and does not start its own save.
  StepState s2 = MakeState(2);
  TS_ASSERT_OK(mgr.SaveAsync(2, Request(s2)));
  StepState s3 = MakeState(3);
  EXPECT_EQ(mgr.SaveAsync(3, Request(s3)).code(), absl::StatusCode::kResourceExhausted);
  TS_EXPECT_OK(mgr.WaitUntilFinished());  // nothing was started
  EXPECT_THAT(mgr.AllSteps(), ::testing::IsEmpty());
  kv.fail = false;
  TS_ASSERT_OK(mgr.SaveAsync(3, Request(s3)));
  TS_ASSERT_OK(mgr.WaitUntilFinished());
  EXPECT_EQ(mgr.LatestStep(), 3);
  ExpectStep(&base, 3);

  // Close returns it too.
  kv.fail = true;
  StepState s4 = MakeState(4);
  TS_ASSERT_OK(mgr.SaveAsync(4, Request(s4)));
  EXPECT_EQ(mgr.Close().code(), absl::StatusCode::kResourceExhausted);
  TS_EXPECT_OK(mgr.Close());
  // A failed save leaves nothing behind.
  Result<std::vector<std::string>> keys = base.List("0000000004");
  ASSERT_TRUE(keys.ok());
  EXPECT_THAT(*keys, ::testing::IsEmpty());
}

TEST(CheckpointManagerAsyncErrorTest, SaveAsyncReturnsThePreviousError) {
  MemoryKvStore base;
  FlakyKvStore kv(&base);
  auto opened = CheckpointManager::Open(&kv, Fast());
  ASSERT_TRUE(opened.ok()) << opened.status();
  kv.fail = true;
  StepState s1 = MakeState(1);
  TS_ASSERT_OK((*opened)->SaveAsync(1, Request(s1)));
  // Waits for step 1, which failed.
  StepState s2 = MakeState(2);
  EXPECT_EQ((*opened)->SaveAsync(2, Request(s2)).code(), absl::StatusCode::kResourceExhausted);
  kv.fail = false;
  TS_ASSERT_OK((*opened)->SaveAsync(2, Request(s2)));
  TS_ASSERT_OK((*opened)->Close());
  ExpectStep(&base, 2);
}

}  // namespace
}  // namespace tensorstash
