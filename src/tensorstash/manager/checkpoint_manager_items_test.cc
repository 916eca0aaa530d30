// CheckpointManager, second part: what a step holds besides its arrays (metadata, metrics,
// per-process state), best-metric retention, the staging cap of async saves, several
// processes on one root, the SIGTERM handler and the statistics.
#include <signal.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/manager/checkpoint_manager.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/testing/in_process_coordinator.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"

namespace tensorstash {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

ManagerOptions Fast() {
  ManagerOptions options;
  options.writer.sync = false;
  options.writer.io_threads = 2;
  return options;
}

// A 64 x 32 float32 matrix held as four row shards (as four devices would), valued by step.
struct State {
  explicit State(int64_t step) : values(64 * 32) {
    for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(step) + i * 0.25f;
  }
  std::vector<float> values;
};

SaveRequest RequestFor(const State& state, int64_t chunk_bytes = 0) {
  SaveRequest request;
  request.arrays.resize(1);
  request.arrays[0].spec = {"w", DType::kFloat32, {64, 32}};
  request.arrays[0].spec.target_chunk_bytes = chunk_bytes;
  for (int64_t i = 0; i < 4; ++i) {
    request.arrays[0].shards.push_back(
        {Box({i * 16, 0}, {16, 32}), state.values.data() + i * 16 * 32});
  }
  return request;
}

void ExpectValues(KvStore* kv, int64_t step, const std::vector<float>& want) {
  SCOPED_TRACE(StrCat("step ", step));
  auto reader = CheckpointReader::Open(kv, CheckpointManager::StepDir(step).value());
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::vector<float> got(want.size());
  TS_ASSERT_OK((*reader)->Read({"w", Box::FromShape({64, 32}), DType::kFloat32, got.data()}));
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0);
}

Result<std::string> ReadStepFile(KvStore* kv, int64_t step, std::string_view name) {
  TS_ASSIGN_OR_RETURN(auto reader,
                      CheckpointReader::Open(kv, CheckpointManager::StepDir(step).value()));
  return reader->ReadFile(name);
}

TEST(ManagerItemsTest, MetadataMetricsAndProcessStateAreCommittedWithTheArrays) {
  MemoryKvStore kv;
  auto mgr = CheckpointManager::Open(&kv, Fast());
  ASSERT_TRUE(mgr.ok()) << mgr.status();
  State state(7);
  SaveRequest request = RequestFor(state);
  request.metadata_json = R"({"config": {"lr": 0.1}})";
  request.metrics = {{"loss", 1.5}};
  request.process_state = std::string("iterator at 7\0binary", 20);
  SaveStats stats;
  TS_ASSERT_OK((*mgr)->Save(7, std::move(request), &stats));
  EXPECT_EQ(stats.step, 7);
  EXPECT_FALSE(stats.async);
  EXPECT_EQ(stats.raw_bytes, 64u * 32u * 4u);
  EXPECT_GT(stats.total_seconds, 0);

  EXPECT_EQ(ReadStepFile(&kv, 7, kMetadataFileName).value(), R"({"config": {"lr": 0.1}})");
  EXPECT_EQ(ReadStepFile(&kv, 7, kMetricsFileName).value(), R"({"loss":1.5})");
  EXPECT_EQ(ReadStepFile(&kv, 7, ProcessStateFileName(0)).value(),
            std::string("iterator at 7\0binary", 20));
  EXPECT_EQ(ReadStepFile(&kv, 7, "process/1").status().code(), absl::StatusCode::kNotFound);
  ExpectValues(&kv, 7, state.values);

  // A damaged file is caught by its CRC-32C, by ReadFile and by Verify.
  const std::string key = "0000000007/" + std::string(kMetadataFileName);
  std::string bytes = kv.Read(key).value();
  bytes[3] ^= 0x20;
  TS_ASSERT_OK(kv.Write(key, bytes));
  Result<std::string> damaged = ReadStepFile(&kv, 7, kMetadataFileName);
  EXPECT_EQ(damaged.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(damaged.status().message(), HasSubstr("metadata.json"));
  auto reader = CheckpointReader::Open(&kv, "0000000007");
  ASSERT_TRUE(reader.ok()) << reader.status();
  auto bad = (*reader)->Verify();
  ASSERT_TRUE(bad.ok()) << bad.status();
  ASSERT_EQ(bad->size(), 1u);
  EXPECT_EQ((*bad)[0].array_path, "");
  EXPECT_THAT((*bad)[0].file, HasSubstr("metadata.json"));
  TS_ASSERT_OK(kv.Delete(key));
  EXPECT_EQ(ReadStepFile(&kv, 7, kMetadataFileName).status().code(), absl::StatusCode::kDataLoss);
}

TEST(ManagerItemsTest, BadItemsAreRefusedBeforeAnythingIsWritten) {
  MemoryKvStore kv;
  auto mgr = CheckpointManager::Open(&kv, Fast());
  ASSERT_TRUE(mgr.ok()) << mgr.status();
  State state(1);
  SaveRequest not_json = RequestFor(state);
  not_json.metadata_json = "{\"unterminated\": ";
  Status status = (*mgr)->SaveAsync(1, std::move(not_json));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("not valid JSON"));
  SaveRequest nan = RequestFor(state);
  nan.metrics = {{"loss", std::nan("")}};
  status = (*mgr)->Save(1, std::move(nan));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("loss"));
  SaveRequest huge = RequestFor(state);
  huge.process_state = std::string(kMaxStepFileBytes + 1, 'x');
  EXPECT_EQ((*mgr)->SaveAsync(1, std::move(huge)).code(), absl::StatusCode::kInvalidArgument);
  TS_EXPECT_OK((*mgr)->WaitUntilFinished());
  EXPECT_THAT(kv.List("").value(), ::testing::IsEmpty());
}

TEST(ManagerItemsTest, StepFileNamesAreChecked) {
  TS_EXPECT_OK(ValidateStepFileName("metadata.json"));
  TS_EXPECT_OK(ValidateStepFileName("process/12"));
  for (const char* bad :
       {"COMMIT", "state/tree.json", "state", "../x", "/abs", "a//b", "a b", "x\n", ""}) {
    EXPECT_EQ(ValidateStepFileName(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(ManagerBestMetricTest, KeepsTheBestAndTheNewest) {
  for (BestMode mode : {BestMode::kMin, BestMode::kMax}) {
    SCOPED_TRACE(mode == BestMode::kMin ? "min" : "max");
    MemoryKvStore kv;
    ManagerOptions options = Fast();
    options.max_to_keep = 2;
    options.best_metric = "loss";
    options.best_mode = mode;
    {
      auto mgr = CheckpointManager::Open(&kv, options);
      ASSERT_TRUE(mgr.ok()) << mgr.status();
      // Losses by step: 1:5, 2:1, 3:4, 4:(none), 5:2, 6:9.
      const std::vector<std::pair<int64_t, std::optional<double>>> saves = {
          {1, 5}, {2, 1}, {3, 4}, {4, std::nullopt}, {5, 2}, {6, 9}};
      for (const auto& [step, loss] : saves) {
        State state(step);
        SaveRequest request = RequestFor(state);
        if (loss) request.metrics = {{"loss", *loss}, {"other", 0}};
        TS_ASSERT_OK((*mgr)->Save(step, std::move(request)));
      }
      TS_ASSERT_OK((*mgr)->WaitUntilFinished());
      if (mode == BestMode::kMin) {
        EXPECT_THAT((*mgr)->AllSteps(), ElementsAre(2, 5, 6));  // best two (1, 2) + newest
      } else {
        EXPECT_THAT((*mgr)->AllSteps(), ElementsAre(1, 6));  // best two (9, 5); 6 is newest
      }
      TS_ASSERT_OK((*mgr)->Close());
    }
    // A new manager reads the metrics back from the steps and goes on ranking by them.
    auto mgr = CheckpointManager::Open(&kv, options);
    ASSERT_TRUE(mgr.ok()) << mgr.status();
    State state(7);
    SaveRequest request = RequestFor(state);
    request.metrics = {{"loss", 3}};
    TS_ASSERT_OK((*mgr)->Save(7, std::move(request)));
    TS_ASSERT_OK((*mgr)->WaitUntilFinished());
    if (mode == BestMode::kMin) {
      EXPECT_THAT((*mgr)->AllSteps(), ElementsAre(2, 5, 7));
    } else {
      EXPECT_THAT((*mgr)->AllSteps(), ElementsAre(1, 6, 7));
    }
    Result<std::vector<std::string>> keys = kv.List("0000000003/");
    ASSERT_TRUE(keys.ok());
    EXPECT_TRUE(keys->empty());
  }
}

// With best_metric, opening a manager opens each step once: the reader that checks a step in the
// listing also gives its metric. Also for a step rolled back from an interrupted overwrite.
TEST(ManagerBestMetricTest, OpeningReadsEachStepOnce) {
  class CountingReads final : public ForwardingKvStore {
   public:
    using ForwardingKvStore::ForwardingKvStore;
    Result<std::string> Read(std::string_view key) override {
      {
        std::lock_guard<std::mutex> lock(mutex);
        ++reads[std::string(key)];
      }
      return ForwardingKvStore::Read(key);
    }
    std::mutex mutex;
    std::map<std::string, int> reads;
  };
  MemoryKvStore memory;
  ManagerOptions options = Fast();
  options.best_metric = "loss";
  {
    auto mgr = CheckpointManager::Open(&memory, options);
    ASSERT_TRUE(mgr.ok()) << mgr.status();
    for (const auto& [step, loss] :
         std::vector<std::pair<int64_t, double>>{{1, 3}, {2, 1}, {3, 2}}) {
      State state(step);
      SaveRequest request = RequestFor(state);
      request.metrics = {{"loss", loss}};
      TS_ASSERT_OK((*mgr)->Save(step, std::move(request)));
    }
    TS_ASSERT_OK((*mgr)->Close());
  }
  // An overwrite of step 3 that crashed between its two renames: the open rolls it back.
  TS_ASSERT_OK(memory.RenameDirectory("0000000003", "0000000003.old-00000000000000aa"));

  CountingReads kv(&memory);
  options.max_to_keep = 2;
  auto mgr = CheckpointManager::Open(&kv, options);
  ASSERT_TRUE(mgr.ok()) << mgr.status();
  EXPECT_THAT((*mgr)->AllSteps(), ElementsAre(1, 2, 3));
  for (const char* dir : {"0000000001", "0000000002", "0000000003"}) {
    EXPECT_EQ(kv.reads[StrCat(dir, "/", kCommitFileName)], 1) << dir;
    EXPECT_EQ(kv.reads[StrCat(dir, "/", kMetricsFileName)], 1) << dir;
  }
  // The metrics were read: a worse step 4 keeps the best two (2, 3) and itself, the newest.
  State state(4);
  SaveRequest request = RequestFor(state);
  request.metrics = {{"loss", 9}};
  TS_ASSERT_OK((*mgr)->Save(4, std::move(request)));
  TS_ASSERT_OK((*mgr)->WaitUntilFinished());
  EXPECT_THAT((*mgr)->AllSteps(), ElementsAre(2, 3, 4));
}

// A store whose file writes wait while the gate is closed (a slow disk, on demand).
class GatedKvStore final : public ForwardingKvStore {
  class GatedFile final : public WritableFile {
   public:
    GatedFile(GatedKvStore* store, std::unique_ptr<WritableFile> base)
        : store_(store), base_(std::move(base)) {}
    Status WriteAt(uint64_t offset, const void* data, size_t size) override {
      store_->WaitOpen();
      return base_->WriteAt(offset, data, size);
    }
    Status Sync() override { return base_->Sync(); }
    Status Close() override { return base_->Close(); }

   private:
    GatedKvStore* store_;
    std::unique_ptr<WritableFile> base_;
  };

 public:
  explicit GatedKvStore(KvStore* base) : ForwardingKvStore(base) {}

  void Close() {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = false;
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_ = true;
    }
    cv_.notify_all();
  }

  Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view key) override {
    TS_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, base()->OpenForWrite(key));
    return std::unique_ptr<WritableFile>(std::make_unique<GatedFile>(this, std::move(file)));
  }
  void WaitOpen() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return open_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool open_ = true;
};

TEST(ManagerStagingTest, SaveAsyncReturnsBeforeAnyDataIsWrittenWhenItFitsTheCap) {
  MemoryKvStore base;
  GatedKvStore kv(&base);
  ManagerOptions options = Fast();
  options.max_staging_bytes = 1 << 20;  // the whole state (8 KiB) fits
  std::atomic<double> blocking{-1}, total{-1};
  options.on_commit = [&](const SaveStats& stats) {
    blocking = stats.blocking_seconds;
    total = stats.total_seconds;
    EXPECT_TRUE(stats.async);
  };
  auto mgr = CheckpointManager::Open(&kv, options);
  ASSERT_TRUE(mgr.ok()) << mgr.status();
  State state(3);
  const std::vector<float> saved = state.values;
  kv.Close();
  // Returns although no data file can be opened yet: everything was copied to host memory.
  TS_ASSERT_OK((*mgr)->SaveAsync(3, RequestFor(state, 1024)));
  std::fill(state.values.begin(), state.values.end(), -7.0f);
  EXPECT_FALSE((*mgr)->LatestStep().has_value());
  kv.Open();
  TS_ASSERT_OK((*mgr)->WaitUntilFinished());
  EXPECT_EQ((*mgr)->LatestStep(), 3);
  ExpectValues(&base, 3, saved);
  EXPECT_GE(blocking.load(), 0);
  EXPECT_GE(total.load(), blocking.load());
}

TEST(ManagerStagingTest, AboveTheCapTheCopyProceedsInWaves) {
  MemoryKvStore base;
  GatedKvStore kv(&base);
  ManagerOptions options = Fast();
  options.max_staging_bytes = 2048;  // two 1 KiB chunks of the 8 KiB state
  auto mgr = CheckpointManager::Open(&kv, options);
  ASSERT_TRUE(mgr.ok()) << mgr.status();
  State state(4);
  const std::vector<float> saved = state.values;
  kv.Close();
  std::atomic<bool> returned{false};
  std::thread saver([&] {
    TS_EXPECT_OK((*mgr)->SaveAsync(4, RequestFor(state, 1024)));
    returned = true;
  });
  // With writes held back, staging fills after two chunks and the copy must wait: SaveAsync
  // cannot return while most of the state is still uncopied.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(returned.load());
  kv.Open();
  saver.join();
  EXPECT_TRUE(returned.load());
  std::fill(state.values.begin(), state.values.end(), -7.0f);
  TS_ASSERT_OK((*mgr)->WaitUntilFinished());
  ExpectValues(&base, 4, saved);
}

TEST(ManagerMultiProcessTest, ProcessesShareStepsRetentionAndOwnState) {
  constexpr int kProcesses = 3;
  MemoryKvStore kv;
  auto group = std::make_shared<InProcessCoordinatorGroup>(kProcesses);
  std::vector<std::vector<int64_t>> listed(kProcesses);
  std::vector<Status> results(kProcesses);
  std::vector<std::thread> threads;
  for (int p = 0; p < kProcesses; ++p) {
    threads.emplace_back([&, p] {
      InProcessCoordinator coordinator(group, p);
      ManagerOptions options = Fast();
      options.coordinator = &coordinator;
      options.max_to_keep = 2;
      auto mgr = CheckpointManager::Open(&kv, options);
      if (!mgr.ok()) {
        results[p] = mgr.status();
        return;
      }
      for (int64_t step = 1; step <= 4; ++step) {
        // Every process holds the whole state; they share the writing as replicas.
        State state(step);
        SaveRequest request;
        request.arrays.resize(1);
        request.arrays[0].spec = {"w", DType::kFloat32, {64, 32}};
        request.arrays[0].shards = {{Box::FromShape({64, 32}), state.values.data(), p, kProcesses}};
        request.process_state = StrCat("process ", p, " at step ", step);
        request.metadata_json = StrCat("{\"step\": ", step, "}");
        Status saved = step % 2 == 0 ? (*mgr)->SaveAsync(step, std::move(request))
                                     : (*mgr)->Save(step, std::move(request));
        if (!saved.ok()) {
          results[p] = saved;
          return;
        }
      }
      results[p] = (*mgr)->Close();
      listed[p] = (*mgr)->AllSteps();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int p = 0; p < kProcesses; ++p) {
    TS_EXPECT_OK(results[p]) << "process " << p;
    EXPECT_THAT(listed[p], ElementsAre(3, 4)) << "process " << p;
  }
  for (int64_t step : {3, 4}) {
    ExpectValues(&kv, step, State(step).values);
    for (int p = 0; p < kProcesses; ++p) {
      EXPECT_EQ(ReadStepFile(&kv, step, ProcessStateFileName(p)).value(),
                StrCat("process ", p, " at step ", step));
    }
    EXPECT_EQ(ReadStepFile(&kv, step, kMetadataFileName).value(), StrCat("{\"step\": ", step, "}"));
  }
  EXPECT_TRUE(kv.List("0000000001/").value().empty());
  EXPECT_TRUE(kv.List("0000000002/").value().empty());
}

TEST(ManagerMultiProcessTest, ASecondJobOnTheSameRootFailsInEveryProcess) {
  constexpr int kProcesses = 2;
  MemoryKvStore kv;
  auto holder = CheckpointManager::Open(&kv, Fast());
  ASSERT_TRUE(holder.ok()) << holder.status();
  auto group = std::make_shared<InProcessCoordinatorGroup>(kProcesses);
  std::vector<Status> results(kProcesses);
  std::vector<std::thread> threads;
  for (int p = 0; p < kProcesses; ++p) {
    threads.emplace_back([&, p] {
      InProcessCoordinator coordinator(group, p);
      ManagerOptions options = Fast();
      options.coordinator = &coordinator;
      results[p] = CheckpointManager::Open(&kv, options).status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int p = 0; p < kProcesses; ++p) {
    EXPECT_EQ(results[p].code(), absl::StatusCode::kFailedPrecondition) << results[p];
    EXPECT_THAT(results[p].message(), HasSubstr("locked by another manager"));
  }
}

TEST(ManagerPreemptionTest, SigtermIsCaughtAndTheHandlerRestoredAtClose) {
  struct sigaction before {};
  ASSERT_EQ(sigaction(SIGTERM, nullptr, &before), 0);
  MemoryKvStore kv;
  ManagerOptions options = Fast();
  options.handle_sigterm = true;
  auto mgr = CheckpointManager::Open(&kv, options);
  ASSERT_TRUE(mgr.ok()) << mgr.status();
  EXPECT_FALSE((*mgr)->ReachedPreemption(1));
  ASSERT_EQ(raise(SIGTERM), 0);  // without the handler this would end the test binary
  EXPECT_TRUE((*mgr)->ReachedPreemption(2));
  // The loop saves its final step and exits.
  State state(2);
  TS_ASSERT_OK((*mgr)->Save(2, RequestFor(state)));
  TS_ASSERT_OK((*mgr)->Close());
  struct sigaction after {};
  ASSERT_EQ(sigaction(SIGTERM, nullptr, &after), 0);
  EXPECT_EQ(after.sa_handler, before.sa_handler);
  // The signal belonged to that manager: a later one starts unpreempted.
  auto next = CheckpointManager::Open(&kv, options);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_FALSE((*next)->ReachedPreemption(3));
}

}  // namespace
}  // namespace tensorstash
