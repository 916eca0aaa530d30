#include "tensorstash/engine/read_plan.h"

#include "gtest/gtest.h"

namespace tensorstash {
namespace {

TEST(ReadPlanTest, StagedChunksCoalesceAcrossSmallGaps) {
  std::vector<ChunkRead> chunks = {
      {0, 100, 50, nullptr, 0},  {0, 0, 100, nullptr, 1}, {0, 160, 40, nullptr, 2},  // gap 10
      {0, 1000, 10, nullptr, 3},                                                     // gap 800
      {1, 200, 10, nullptr, 4},                                                      // other file
  };
  auto plans = PlanReadRequests(chunks, /*max_gap=*/64, /*max_request=*/1 << 20);
  ASSERT_EQ(plans.size(), 3u);
  EXPECT_EQ(plans[0].offset, 0u);
  EXPECT_EQ(plans[0].length, 200u);
  EXPECT_EQ(plans[0].chunks.size(), 3u);
  EXPECT_EQ(plans[1].offset, 1000u);
  EXPECT_EQ(plans[2].file_id, 1u);
}

TEST(ReadPlanTest, DirectChunksMergeOnlyWhenDestinationIsContiguous) {
  char dest[400];
  std::vector<ChunkRead> chunks = {
      {0, 0, 100, dest, 0},
      {0, 100, 100, dest + 100, 1},  // contiguous in file and destination: merges
      {0, 200, 100, dest + 300, 2},  // file-contiguous but the destination jumps: new request
      {0, 300, 100, nullptr, 3},     // staged: never merges with direct
  };
  auto plans = PlanReadRequests(chunks, 64, 1 << 20);
  ASSERT_EQ(plans.size(), 3u);
  EXPECT_EQ(plans[0].direct_dest, dest);
  EXPECT_EQ(plans[0].length, 200u);
  EXPECT_EQ(plans[1].direct_dest, dest + 300);
  EXPECT_EQ(plans[2].direct_dest, nullptr);
}

TEST(ReadPlanTest, RequestsStayUnderTheSizeCap) {
  std::vector<ChunkRead> chunks;
  for (int i = 0; i < 10; ++i)
    chunks.push_back({0, static_cast<uint64_t>(i) * 100, 100, nullptr, static_cast<size_t>(i)});
  auto plans = PlanReadRequests(chunks, 0, 300);
  ASSERT_EQ(plans.size(), 4u);
  for (const auto& plan : plans) EXPECT_LE(plan.length, 300u);
  // A single chunk larger than the cap is still one request.
  plans = PlanReadRequests({{0, 0, 1000, nullptr, 0}}, 0, 300);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].length, 1000u);
}

TEST(ReadPlanTest, AChunkSeveralReadsNeedIsListedOnceWithEachPiece) {
  // A [4, 4] array in chunks of [2, 4]: chunk 0 holds rows 0-1, chunk 1 rows 2-3.
  const ChunkGrid grid{{4, 4}, {2, 4}, {2, 4}};
  const std::vector<BoxRead> reads = {
      {0, &grid, Box({0, 0}, {4, 2})},  // left half: both chunks
      {0, &grid, Box({1, 2}, {2, 2})},  // rows 1-2, right half: both chunks
      {1, &grid, Box({0, 0}, {2, 4})},  // another array: its own chunk 0
      {0, &grid, Box({0, 0}, {0, 4})},  // empty: needs nothing
  };
  const std::vector<NeededChunk> needed = PlanChunkPieces(reads);
  ASSERT_EQ(needed.size(), 3u);
  EXPECT_EQ(needed[0].array_id, 0u);
  EXPECT_EQ(needed[0].chunk, 0);
  EXPECT_EQ(needed[0].chunk_box, Box({0, 0}, {2, 4}));
  ASSERT_EQ(needed[0].pieces.size(), 2u);
  EXPECT_EQ(needed[0].pieces[0].read, 0u);
  EXPECT_EQ(needed[0].pieces[0].region, Box({0, 0}, {2, 2}));
  EXPECT_EQ(needed[0].pieces[1].read, 1u);
  EXPECT_EQ(needed[0].pieces[1].region, Box({1, 2}, {1, 2}));
  EXPECT_EQ(needed[1].chunk, 1);
  ASSERT_EQ(needed[1].pieces.size(), 2u);
  EXPECT_EQ(needed[1].pieces[1].region, Box({2, 2}, {1, 2}));
  EXPECT_EQ(needed[2].array_id, 1u);
  EXPECT_EQ(needed[2].pieces.size(), 1u);
}

TEST(ReadPlanTest, BoxesPastTheShapeNeedOnlyTheChunksThatExist) {
  const ChunkGrid grid{{3}, {3}, {2}};
  const std::vector<NeededChunk> needed = PlanChunkPieces({{0, &grid, Box({1}, {5})}});
  ASSERT_EQ(needed.size(), 2u);
  EXPECT_EQ(needed[0].pieces[0].region, Box({1}, {1}));
  EXPECT_EQ(needed[1].chunk_box, Box({2}, {1}));
  EXPECT_EQ(needed[1].pieces[0].region, Box({2}, {1}));
}

}  // namespace
}  // namespace tensorstash
