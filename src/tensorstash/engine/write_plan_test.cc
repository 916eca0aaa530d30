// Write planning: which chunks a process writes (replicas share the work), lanes and their order.
#include "tensorstash/engine/write_plan.h"

#include <set>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

// 8 x 4 int32 in 8 row chunks of 1 x 4 (16 bytes each), cells of 4 rows.
const ChunkGrid kGrid{{8, 4}, {4, 4}, {1, 4}};

ArrayToWrite Array(std::vector<ShardPlacement> shards) {
  return {"a", &kGrid, 4, std::move(shards)};
}

std::vector<int64_t> Chunks(const std::vector<ChunkWrite>& writes) {
  std::vector<int64_t> out;
  for (const ChunkWrite& w : writes) out.push_back(w.chunk);
  return out;
}

TEST(WritePlanTest, ReplicasDealOutTheChunksOfAShardInTurn) {
  const Box top({0, 0}, {4, 4});
  std::set<int64_t> all;
  for (int replica = 0; replica < 2; ++replica) {
    Result<std::vector<ChunkWrite>> writes =
        PlanChunkWrites({Array({{top, replica, 2}})}, /*split_replicated_writes=*/true);
    TS_ASSERT_OK(writes.status());
    EXPECT_EQ(Chunks(*writes),
              replica == 0 ? std::vector<int64_t>({0, 2}) : std::vector<int64_t>({1, 3}));
    for (const ChunkWrite& w : *writes) {
      EXPECT_TRUE(all.insert(w.chunk).second) << "chunk written twice: " << w.chunk;
      EXPECT_EQ(w.raw_bytes, 16u);
      EXPECT_EQ(w.chunk_box.shape, (std::vector<int64_t>{1, 4}));
    }
  }
  EXPECT_EQ(all.size(), 4u);
}

TEST(WritePlanTest, WithoutSplittingReplicaZeroWritesEverything) {
  const Box top({0, 0}, {4, 4});
  Result<std::vector<ChunkWrite>> first = PlanChunkWrites({Array({{top, 0, 2}})}, false);
  Result<std::vector<ChunkWrite>> second = PlanChunkWrites({Array({{top, 1, 2}})}, false);
  TS_ASSERT_OK(first.status());
  TS_ASSERT_OK(second.status());
  EXPECT_EQ(Chunks(*first), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_TRUE(second->empty());
}

TEST(WritePlanTest, WritesComeInArrayAndChunkOrderAndNameTheirShard) {
  // Shards given bottom first; empty shards are skipped.
  Result<std::vector<ChunkWrite>> writes = PlanChunkWrites(
      {Array(
           {{Box({4, 0}, {4, 4}), 0, 1}, {Box({0, 0}, {0, 4}), 0, 1}, {Box({0, 0}, {4, 4}), 0, 1}}),
       Array({{Box({0, 0}, {8, 4}), 0, 1}})},
      true);
  TS_ASSERT_OK(writes.status());
  ASSERT_EQ(writes->size(), 16u);
  for (size_t i = 0; i < 16; ++i) {
    EXPECT_EQ((*writes)[i].array_id, i < 8 ? 0u : 1u);
    EXPECT_EQ((*writes)[i].chunk, static_cast<int64_t>(i % 8));
  }
  EXPECT_EQ((*writes)[0].shard, 2u);  // rows 0..3 come from the third shard
  EXPECT_EQ((*writes)[4].shard, 0u);
}

TEST(WritePlanTest, AChunkStraddlingShardsIsAnInternalError) {
  const ChunkGrid coarse{{8, 4}, {8, 4}, {8, 4}};  // one chunk over two shards
  Result<std::vector<ChunkWrite>> writes =
      PlanChunkWrites({{"w", &coarse, 4, {{Box({0, 0}, {4, 4}), 0, 1}}}}, true);
  EXPECT_TRUE(absl::IsInternal(writes.status())) << writes.status();
  EXPECT_THAT(std::string(writes.status().message()), HasSubstr("'w'"));
}

TEST(WritePlanTest, LanesTakeContiguousSharesAndRunInTurn) {
  std::vector<ChunkWrite> writes(8);
  for (size_t i = 0; i < writes.size(); ++i) {
    writes[i].chunk = static_cast<int64_t>(i);
    writes[i].raw_bytes = 100;
  }
  EXPECT_EQ(CountLanes(writes, 8, 4, 1000), 1);  // 800 bytes: too few for a second lane
  EXPECT_EQ(CountLanes(writes, 8, 4, 200), 4);   // capped by max_lanes
  EXPECT_EQ(CountLanes(writes, 2, 4, 100), 2);   // capped by the threads
  EXPECT_EQ(CountLanes(writes, 0, 4, 100), 1);
  EXPECT_EQ(CountLanes({}, 8, 4, 100), 1);
  AssignLanes(&writes, 4);
  std::vector<int> lanes;
  for (const ChunkWrite& w : writes) lanes.push_back(w.lane);
  EXPECT_EQ(lanes, (std::vector<int>{0, 0, 1, 1, 2, 2, 3, 3}));
  EXPECT_EQ(InterleaveLanes(writes, 4), (std::vector<size_t>{0, 2, 4, 6, 1, 3, 5, 7}));
}

}  // namespace
}  // namespace tensorstash
