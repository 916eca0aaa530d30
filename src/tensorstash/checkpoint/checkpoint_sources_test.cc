// When a save lets go of the caller's buffers (CheckpointWriter::Commit's on_sources_released):
// an async save returns to training at that moment, so it must come as early as it may.
#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/testing/fault_injection_kvstore.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

// A save of one zstd array of 64 chunks under a 1-byte cap (each chunk's write runs alone),
// with copy_sources; `stable` marks the shard as immutable. Returns the data writes made
// before the sources were released, and checks the step restores.
int64_t DataWritesBeforeRelease(bool stable) {
  MemoryKvStore base;
  FaultInjectionKvStore kv(&base, /*seed=*/1);
  WriterOptions options;
  options.copy_sources = true;
  options.max_inflight_bytes = 1;
  options.io_threads = 2;
  options.sync = false;
  options.target_chunk_bytes = 1024;
  std::vector<float> values(64 * 256);
  std::iota(values.begin(), values.end(), 0.0f);
  ShardData shard{Box({0}, {64 * 256}), values.data(), 0, 1, stable};
  std::unique_ptr<CheckpointWriter> writer = CheckpointWriter::Create(&kv, "step", options).value();
  EXPECT_EQ(OkStatus(),
            writer->AddArray({"w", DType::kFloat32, {64 * 256}, Codec::kZstd}, {shard}));
  int64_t at_release = -1;
  WriteStats stats;
  EXPECT_EQ(OkStatus(),
            writer->Commit(&stats, [&] { at_release = kv.calls(Mask(KvOp::kFileWriteAt)); }));
  EXPECT_EQ(stats.chunks, 64u);
  std::unique_ptr<CheckpointReader> reader = CheckpointReader::Open(&kv, "step").value();
  std::vector<float> read(values.size());
  EXPECT_EQ(OkStatus(),
            reader->Read({"w", Box({0}, {64 * 256}), DType::kFloat32, read.data()}, nullptr));
  EXPECT_EQ(read, values);
  return at_release;
}

TEST(CheckpointSourcesTest, StableShardsAreReleasedBeforeAnyDataIsWritten) {
  // Nothing of a stable shard is copied: the writes read it where it is, and the caller's
  // other buffers (none here) are free at once.
  EXPECT_EQ(DataWritesBeforeRelease(/*stable=*/true), 0);
}

TEST(CheckpointSourcesTest, CopiedShardsAreReleasedOnceTheLastCopyIsMade) {
  // Copies are made in waves under the cap: with room for one chunk, each copy waits for the
  // write before it, so the last copy (and the release after it) comes after 63 writes; the
  // 64th may or may not have run by then.
  const int64_t at_release = DataWritesBeforeRelease(/*stable=*/false);
  EXPECT_GE(at_release, 63);
  EXPECT_LE(at_release, 64);
}

}  // namespace
}  // namespace tensorstash
