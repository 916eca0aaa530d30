// RestoreToHost: the boxes of a whole restore in one call (dedup, map or read, batches).
#include "tensorstash/checkpoint/host_restore.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/array/convert.h"
#include "tensorstash/checkpoint/checkpoint_test_util.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/checkpoint/step_source.h"
#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/util/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

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
