// RestoreToHost: the boxes of a whole restore in one call (dedup, map or read, batches).
#include "tensorstash/engine/host_restore.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/array/convert.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

// A step source that passes everything on to another and watches its ReadMany calls: how many
// began and ended, whether one began too early (more than one batch ahead of the caller), and,
// once asked, fails one of them.
class WatchedSource final : public StepSource {
 public:
  explicit WatchedSource(StepSource* inner) : inner_(inner) {}

  // Called by the test's on_batch when it returns: batch `handed_over` is done with.
  void BatchHandedOver() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++handed_over_;
  }
  // Waits up to 30 s for `n` ReadMany calls to have ended; whether they did.
  bool WaitForReads(int n) {
    std::unique_lock<std::mutex> lock(mutex_);
    return ended_cv_.wait_for(lock, std::chrono::seconds(30), [&] { return ended_ >= n; });
  }
  void FailRead(int n) { fail_read_ = n; }
  int ended() {
    std::lock_guard<std::mutex> lock(mutex_);
    return ended_;
  }
  bool read_too_early() const { return too_early_; }

  StepFormat format() const override { return inner_->format(); }
  const std::string& dir() const override { return inner_->dir(); }
  const TreeNode& tree() const override { return inner_->tree(); }
  const std::vector<ArrayMetadata>& arrays() const override { return inner_->arrays(); }
  uint64_t StoredBytes(size_t id) const override { return inner_->StoredBytes(id); }
  int64_t NumChunks(size_t id) const override { return inner_->NumChunks(id); }
  std::string CodecDescription(size_t id) const override { return inner_->CodecDescription(id); }
  int64_t created_unix_ms() const override { return inner_->created_unix_ms(); }
  int process_count() const override { return inner_->process_count(); }
  Status ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats,
                  const std::function<void(uint64_t, uint64_t)>& progress) override {
    int call;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      call = began_++;
      // Batch `call` may be read while the caller has batch call - 1, not earlier.
      if (call > handed_over_ + 1) too_early_ = true;
    }
    Status status = call == fail_read_ ? DataLossError("injected failure of read " +
                                                        std::to_string(call))
                                       : inner_->ReadMany(requests, stats, progress);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++ended_;
    }
    ended_cv_.notify_all();
    return status;
  }
  std::vector<Result<MappedBox>> MapMany(const std::vector<ReadRequest>& requests,
                                         const MapOptions& options) override {
    return inner_->MapMany(requests, options);
  }
  Result<std::string> ReadFile(std::string_view name) const override {
    return inner_->ReadFile(name);
  }
  Result<std::vector<BadChunk>> Verify(
      const std::function<void(uint64_t, uint64_t)>& progress) override {
    return inner_->Verify(progress);
  }
  uint64_t VerifyTotalBytes() const override { return inner_->VerifyTotalBytes(); }
  size_t VerifyTotalItems() const override { return inner_->VerifyTotalItems(); }

 private:
  StepSource* inner_;
  std::mutex mutex_;
  std::condition_variable ended_cv_;
  int began_ = 0, ended_ = 0, handed_over_ = 0;
  std::atomic<int> fail_read_{-1};
  std::atomic<bool> too_early_{false};
};

constexpr char kStep[] = "step";
constexpr uint64_t kSeed = 7;
// "big": 1024 x 1024 float32 in two row chunks of 2 MiB (mappable); "packed": the same, zstd
// (never mappable); "small": 64 x 64 float32 (two 8 KiB chunks, mapped only where a box is a
// run of them).
const std::vector<int64_t> kShape = {1024, 1024};
const std::vector<int64_t> kSmallShape = {64, 64};

class HostRestoreTest : public test::TempDirTest {
 protected:
  void SetUp() override {
    test::TempDirTest::SetUp();
    Result<std::unique_ptr<FileKvStore>> store = FileKvStore::Open(temp_dir() + "/root");
    TS_ASSERT_OK(store.status());
    kv_ = *std::move(store);
    WriterOptions options;
    options.sync = false;
    Result<std::unique_ptr<CheckpointWriter>> writer =
        CheckpointWriter::Create(kv_.get(), kStep, options);
    TS_ASSERT_OK(writer.status());
    const test::Sharding rows{{2}, {0, -1}};
    std::vector<test::HeldShards> held;
    held.reserve(3);
    ArraySpec big{"big", DType::kFloat32, kShape};
    ArraySpec packed{"packed", DType::kFloat32, kShape};
    packed.codec = Codec::kZstd;
    ArraySpec small{"small", DType::kFloat32, kSmallShape};
    for (const ArraySpec& spec : {big, packed, small}) {
      held.push_back(test::HoldAllShards(spec, kSeed, rows));
      TS_ASSERT_OK((*writer)->AddArray(spec, held.back().shards));
    }
    TS_ASSERT_OK((*writer)->Commit());
    Result<std::unique_ptr<StepSource>> source = OpenStepSource(kv_.get(), kStep);
    TS_ASSERT_OK(source.status());
    source_ = *std::move(source);
  }

  // What a plain read of `box` of `path` gives, as `dtype`.
  std::vector<char> Expected(const std::string& path, const Box& box, DType dtype) {
    std::vector<char> out(box.num_elements() * ItemSize(dtype));
    ReadStats stats;
    EXPECT_TRUE(source_->ReadMany({{path, box, dtype, out.data()}}, &stats, nullptr).ok());
    return out;
  }

  // Runs RestoreToHost and keeps every batch.
  Status Restore(const std::vector<HostBoxRequest>& requests, const HostRestoreOptions& options,
                 std::vector<HostBatch>* batches, HostRestoreStats* stats = nullptr) {
    return RestoreToHost(
        *source_, requests, options,
        [&](HostBatch& batch) {
          batches->push_back(std::move(batch));
          return OkStatus();
        },
        nullptr, stats);
  }

  std::unique_ptr<FileKvStore> kv_;
  std::unique_ptr<StepSource> source_;
};

TEST_F(HostRestoreTest, EveryRequestGetsItsBoxOnceAndReplicasShareOneBuffer) {
  const Box top({0, 0}, {512, 1024});
  const Box bottom({512, 0}, {512, 1024});
  const Box corner({10, 20}, {100, 30});
  const std::vector<HostBoxRequest> requests = {
      {"big", top, DType::kFloat32},                      // mappable
      {"big", top, DType::kFloat32},                      // its replica
      {"big", bottom, DType::kFloat64},                   // a cast: read
      {"packed", top, DType::kFloat32},                   // compressed: read
      {"packed", top, DType::kFloat32},                   // its replica
      {"small", corner, DType::kFloat32},                 // small: read
      {"small", Box({60, 60}, {8, 8}), DType::kFloat32},  // past the shape: zeros there
  };
  std::vector<HostBatch> batches;
  HostRestoreStats stats;
  TS_ASSERT_OK(Restore(requests, {}, &batches, &stats));
  ASSERT_EQ(batches.size(), 1u);
  const HostBatch& batch = batches[0];
  ASSERT_EQ(batch.requests.size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_EQ(batch.requests[i], i);
    const HostBoxRequest& r = requests[i];
    const std::vector<char> want = Expected(r.path, r.box, r.dtype);
    ASSERT_EQ(batch.buffers[i]->size(), want.size()) << i;
    EXPECT_EQ(std::memcmp(batch.buffers[i]->data(), want.data(), want.size()), 0) << i;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(batch.buffers[i]->data()) % 64, 0u) << i;
  }
  EXPECT_EQ(batch.buffers[0], batch.buffers[1]);
  EXPECT_EQ(batch.buffers[3], batch.buffers[4]);
  EXPECT_TRUE(batch.buffers[0]->mapped());
  EXPECT_FALSE(batch.buffers[2]->mapped());
  EXPECT_FALSE(batch.buffers[3]->mapped());
  EXPECT_FALSE(batch.buffers[5]->mapped());
  EXPECT_EQ(stats.boxes, 5u);
  EXPECT_EQ(stats.mapped_bytes, 512u * 1024 * 4);
  EXPECT_GT(stats.reads.bytes_read, 0u);
  EXPECT_EQ(stats.read_calls, 1u);
}

TEST_F(HostRestoreTest, WithoutMappingEverythingIsRead) {
  const Box top({0, 0}, {512, 1024});
  std::vector<HostBatch> batches;
  HostRestoreStats stats;
  HostRestoreOptions options;
  options.map = false;
  TS_ASSERT_OK(Restore({{"big", top, DType::kFloat32}}, options, &batches, &stats));
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_FALSE(batches[0].buffers[0]->mapped());
  EXPECT_EQ(stats.mapped_bytes, 0u);
  const std::vector<char> want = Expected("big", top, DType::kFloat32);
  EXPECT_EQ(std::memcmp(batches[0].buffers[0]->data(), want.data(), want.size()), 0);
}

TEST_F(HostRestoreTest, BoxesPastTheMappingBudgetAreRead) {
  // Both halves of "big" could be mapped; the budget allows one, the other is read.
  const Box top({0, 0}, {512, 1024});
  const Box bottom({512, 0}, {512, 1024});
  std::vector<HostBatch> batches;
  HostRestoreStats stats;
  HostRestoreOptions options;
  options.max_mappings = 1;
  options.shared_mapping_bytes = 1;  // a mapping for each
  TS_ASSERT_OK(Restore({{"big", top, DType::kFloat32}, {"big", bottom, DType::kFloat32}}, options,
                       &batches, &stats));
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_TRUE(batches[0].buffers[0]->mapped());
  EXPECT_FALSE(batches[0].buffers[1]->mapped());
  EXPECT_EQ(stats.mapped_bytes, 512u * 1024 * 4);
  EXPECT_EQ(stats.reads.bytes_read, 512u * 1024 * 4);
  for (size_t i = 0; i < 2; ++i) {
    const std::vector<char> want = Expected("big", i == 0 ? top : bottom, DType::kFloat32);
    EXPECT_EQ(std::memcmp(batches[0].buffers[i]->data(), want.data(), want.size()), 0) << i;
  }
}

TEST_F(HostRestoreTest, SmallBoxesShareArenasYetEachOutlivesTheOthers) {
  // Boxes under 4 MiB are carved from shared arenas: each 64-byte aligned, none overlapping,
  // and each valid for as long as it is held, whatever became of the others and their batches.
  std::vector<HostBoxRequest> requests;
  for (int64_t row = 0; row < 64; row += 8) {
    requests.push_back({"small", Box({row, 0}, {8, 64 - row}), DType::kFloat32});
  }
  requests.push_back({"big", Box({0, 0}, {3, 5}), DType::kFloat64});  // another array, a cast
  HostRestoreOptions options;
  options.batch_bytes = 1;  // "small" in one batch, "big" in another
  std::vector<HostBatch> batches;
  TS_ASSERT_OK(Restore(requests, options, &batches));
  ASSERT_EQ(batches.size(), 2u);
  std::vector<std::shared_ptr<HostBuffer>> held;
  for (const HostBatch& batch : batches) {
    for (const std::shared_ptr<HostBuffer>& buffer : batch.buffers) held.push_back(buffer);
  }
  ASSERT_EQ(held.size(), requests.size());
  for (size_t i = 0; i < held.size(); ++i) {
    EXPECT_FALSE(held[i]->mapped()) << i;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(held[i]->data()) % 64, 0u) << i;
    for (size_t j = 0; j < i; ++j) {  // [data, data + size) of the two do not meet
      const bool apart = held[i]->data() + held[i]->size() <= held[j]->data() ||
                         held[j]->data() + held[j]->size() <= held[i]->data();
      EXPECT_TRUE(apart) << i << " overlaps " << j;
    }
  }
  // Keep two boxes (one of each batch) only; they must still hold their bytes.
  std::shared_ptr<HostBuffer> first = held.front();
  std::shared_ptr<HostBuffer> last = held.back();
  held.clear();
  batches.clear();
  for (const auto& [buffer, r] : {std::pair{first, requests.front()}, {last, requests.back()}}) {
    const std::vector<char> want = Expected(r.path, r.box, r.dtype);
    ASSERT_EQ(buffer->size(), want.size());
    EXPECT_EQ(std::memcmp(buffer->data(), want.data(), want.size()), 0) << r.path;
  }
}

TEST_F(HostRestoreTest, BatchesEndAfterAnArrayOnceTheyHoldBatchBytes) {
  HostRestoreOptions options;
  options.map = false;
  options.batch_bytes = 1;  // every array its own batch
  const std::vector<HostBoxRequest> requests = {
      {"small", Box({0, 0}, {32, 64}), DType::kFloat32},
      {"small", Box({32, 0}, {32, 64}), DType::kFloat32},  // same array: same batch
      {"big", Box({0, 0}, {4, 4}), DType::kFloat32},
      {"packed", Box({0, 0}, {4, 4}), DType::kFloat32},
  };
  std::vector<HostBatch> batches;
  HostRestoreStats stats;
  TS_ASSERT_OK(Restore(requests, options, &batches, &stats));
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[0].requests, (std::vector<size_t>{0, 1}));
  EXPECT_EQ(batches[1].requests, (std::vector<size_t>{2}));
  EXPECT_EQ(batches[2].requests, (std::vector<size_t>{3}));
  EXPECT_EQ(stats.batches, 3u);
  // The engine keeps nothing of a batch once handed over: the caller frees it.
  EXPECT_EQ(batches[0].buffers[0].use_count(), 1);
}

TEST_F(HostRestoreTest, ProgressCountsTheBytesReadAndEndsAtTheTotal) {
  const std::vector<HostBoxRequest> requests = {
      {"packed", Box({0, 0}, {1024, 1024}), DType::kFloat32},
      {"small", Box({0, 0}, {64, 32}), DType::kFloat32},  // not a run of the file: read
  };
  uint64_t last_done = 0, last_total = 0;
  bool backwards = false;
  TS_ASSERT_OK(RestoreToHost(
      *source_, requests, {}, [](HostBatch&) { return OkStatus(); },
      [&](uint64_t done, uint64_t total) {
        backwards |= done < last_done;
        last_done = done;
        last_total = total;
      }));
  EXPECT_FALSE(backwards);
  EXPECT_EQ(last_total, (1024u * 1024 + 64 * 32) * 4);
  EXPECT_EQ(last_done, last_total);
}

TEST_F(HostRestoreTest, AnErrorFromOnBatchStopsTheRestore) {
  HostRestoreOptions options;
  options.batch_bytes = 1;
  int calls = 0;
  Status status = RestoreToHost(*source_,
                                {{"small", Box({0, 0}, {1, 1}), DType::kFloat32},
                                 {"big", Box({0, 0}, {1, 1}), DType::kFloat32}},
                                options, [&](HostBatch&) {
                                  ++calls;
                                  return CancelledError("enough");
                                });
  EXPECT_TRUE(absl::IsCancelled(status)) << status;
  EXPECT_EQ(calls, 1);
}

// Options under which every array is read (not mapped) in a batch of its own.
HostRestoreOptions ReadOneArrayPerBatch() {
  HostRestoreOptions options;
  options.map = false;
  options.batch_bytes = 1;
  return options;
}

// Four arrays, each its own batch under ReadOneArrayPerBatch().
std::vector<HostBoxRequest> FourBatches() {
  return {{"small", Box({0, 0}, {64, 64}), DType::kFloat32},
          {"big", Box({0, 0}, {256, 1024}), DType::kFloat32},
          {"packed", Box({0, 0}, {256, 1024}), DType::kFloat32},
          {"small", Box({0, 0}, {32, 32}), DType::kFloat64}};
}

TEST_F(HostRestoreTest, TheNextBatchIsReadWhileOnBatchHasThisOne) {
  WatchedSource source(source_.get());
  const HostRestoreOptions options = ReadOneArrayPerBatch();
  const std::vector<HostBoxRequest> requests = FourBatches();
  std::vector<HostBatch> batches;
  std::vector<bool> next_read_during;  // per batch: the next batch's read ended inside on_batch
  TS_ASSERT_OK(RestoreToHost(source, requests, options, [&](HostBatch& batch) {
    const int k = static_cast<int>(batches.size());
    if (k + 1 < static_cast<int>(requests.size())) {
      next_read_during.push_back(source.WaitForReads(k + 2));
    }
    batches.push_back(std::move(batch));
    source.BatchHandedOver();
    return OkStatus();
  }));
  EXPECT_EQ(next_read_during, std::vector<bool>(requests.size() - 1, true));
  EXPECT_FALSE(source.read_too_early()) << "a batch was read more than one batch ahead";
  ASSERT_EQ(batches.size(), requests.size());
  for (size_t k = 0; k < batches.size(); ++k) {
    ASSERT_EQ(batches[k].requests, std::vector<size_t>{k});
    const HostBoxRequest& r = requests[k];
    const std::vector<char> want = Expected(r.path, r.box, r.dtype);
    ASSERT_EQ(batches[k].buffers[0]->size(), want.size()) << k;
    EXPECT_EQ(std::memcmp(batches[k].buffers[0]->data(), want.data(), want.size()), 0) << k;
  }
}

TEST_F(HostRestoreTest, AReadErrorAheadIsReturnedOnceTheBatchBeforeIsHandedOver) {
  WatchedSource source(source_.get());
  source.FailRead(2);
  const HostRestoreOptions options = ReadOneArrayPerBatch();
  int calls = 0;
  Status status = RestoreToHost(source, FourBatches(), options, [&](HostBatch&) {
    ++calls;
    source.BatchHandedOver();
    return OkStatus();
  });
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("read 2"));
  EXPECT_EQ(calls, 2);  // batches 0 and 1; nothing after the failed one is handed over or read
  EXPECT_EQ(source.ended(), 3);
}

TEST_F(HostRestoreTest, AnExceptionFromOnBatchLeavesOnceTheReadAheadHasEnded) {
  // The core does not throw, but a front's on_batch might; the thread reading ahead must be
  // joined on the way out (a joinable std::thread destroyed would end the process).
  WatchedSource source(source_.get());
  int calls = 0;
  EXPECT_THROW(RestoreToHost(source, FourBatches(), ReadOneArrayPerBatch(),
                             [&](HostBatch&) -> Status {
                               ++calls;
                               throw std::runtime_error("thrown by on_batch");
                             }),
               std::runtime_error);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(source.ended(), 2);  // batch 0, and batch 1 read ahead and then dropped
}

TEST_F(HostRestoreTest, ProgressIsNotCalledWhileOnBatchRunsAndEndsAtTheTotal) {
  WatchedSource source(source_.get());
  const HostRestoreOptions options = ReadOneArrayPerBatch();
  const std::vector<HostBoxRequest> requests = FourBatches();
  std::atomic<bool> in_on_batch{false}, called_inside{false};
  uint64_t last_done = 0, last_total = 0;
  bool backwards = false;
  int calls = 0;
  TS_ASSERT_OK(RestoreToHost(
      source, requests, options,
      [&](HostBatch&) {
        in_on_batch = true;
        source.WaitForReads(std::min<int>(++calls + 1, static_cast<int>(requests.size())));
        in_on_batch = false;
        source.BatchHandedOver();
        return OkStatus();
      },
      [&](uint64_t done, uint64_t total) {
        called_inside = called_inside || in_on_batch;
        backwards |= done < last_done;
        last_done = done;
        last_total = total;
      }));
  EXPECT_FALSE(called_inside) << "progress was called while on_batch ran";
  EXPECT_FALSE(backwards);
  uint64_t total = 0;
  for (const HostBoxRequest& r : requests) total += r.box.num_elements() * ItemSize(r.dtype);
  EXPECT_EQ(last_total, total);
  EXPECT_EQ(last_done, total);
}

TEST_F(HostRestoreTest, TheMappingBudgetIsOneForAllBatches) {
  // "big"'s top half and "small" whole are each one run of a data file: one mapping each.
  const std::vector<HostBoxRequest> requests = {
      {"big", Box({0, 0}, {512, 1024}), DType::kFloat32},
      {"small", Box({0, 0}, {64, 64}), DType::kFloat32}};
  for (uint64_t budget : {1, 2}) {
    HostRestoreOptions options;
    options.batch_bytes = 1;  // two batches
    options.max_mappings = budget;
    std::vector<HostBatch> batches;
    TS_ASSERT_OK(Restore(requests, options, &batches));
    ASSERT_EQ(batches.size(), 2u);
    EXPECT_TRUE(batches[0].buffers[0]->mapped()) << budget;
    EXPECT_EQ(batches[1].buffers[0]->mapped(), budget == 2) << budget;
    const std::vector<char> want = Expected("small", requests[1].box, DType::kFloat32);
    EXPECT_EQ(std::memcmp(batches[1].buffers[0]->data(), want.data(), want.size()), 0);
  }
}

TEST_F(HostRestoreTest, BadRequestsFailBeforeAnythingIsReadAndNameTheArray) {
  int calls = 0;
  auto count = [&](HostBatch&) {
    ++calls;
    return OkStatus();
  };
  const Box ok({0, 0}, {1, 1});
  Status missing = RestoreToHost(
      *source_, {{"small", ok, DType::kFloat32}, {"nope", ok, DType::kFloat32}}, {}, count);
  EXPECT_TRUE(absl::IsNotFound(missing)) << missing;
  EXPECT_THAT(std::string(missing.message()), HasSubstr("'nope'"));
  Status rank = RestoreToHost(*source_, {{"small", Box({0}, {1}), DType::kFloat32}}, {}, count);
  EXPECT_TRUE(absl::IsInvalidArgument(rank)) << rank;
  EXPECT_THAT(std::string(rank.message()), HasSubstr("'small'"));
  // An absurd box is refused before any memory is allocated for it.
  Status absurd = RestoreToHost(
      *source_, {{"small", Box({0, 0}, {int64_t{1} << 40, int64_t{1} << 40}), DType::kFloat32}}, {},
      count);
  EXPECT_TRUE(absl::IsInvalidArgument(absurd)) << absurd;
  Status cast = RestoreToHost(*source_, {{"small", ok, DType::kBool}}, {}, count);
  EXPECT_FALSE(cast.ok());
  EXPECT_EQ(calls, 0);
}

TEST_F(HostRestoreTest, EmptyRequestsAndEmptyBoxes) {
  std::vector<HostBatch> batches;
  TS_ASSERT_OK(Restore({}, {}, &batches));
  EXPECT_TRUE(batches.empty());
  TS_ASSERT_OK(Restore({{"small", Box({0, 0}, {0, 64}), DType::kFloat32}}, {}, &batches));
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].buffers[0]->size(), 0u);
}

}  // namespace
}  // namespace tensorstash
