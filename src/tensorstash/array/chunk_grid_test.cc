#include "tensorstash/array/chunk_grid.h"

#include <map>
#include <random>

#include "gtest/gtest.h"

namespace tensorstash {
namespace {

// Every element of the array lies in exactly one existing chunk, and ChunkExists,
// ChunkNumElements, NumStoredChunks and ForEachChunkIntersecting agree with a brute-force walk.
TEST(ChunkGridTest, ChunksTileTheArray) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int rank = 1 + static_cast<int>(rng() % 3);
    ChunkGrid grid;
    for (int d = 0; d < rank; ++d) {
      grid.shape.push_back(rng() % 10);
      grid.cell_shape.push_back(
          1 + rng() % std::max<int64_t>(1, std::min<int64_t>(6, grid.shape.back())));
      grid.chunk_shape.push_back(1 + rng() % grid.cell_shape.back());
    }
    ASSERT_TRUE(ValidateChunkGrid(grid, 4, "x").ok());
    const Box whole = Box::FromShape(grid.shape);
    std::vector<int> covered(whole.num_elements(), 0);
    int64_t existing = 0;
    for (int64_t c = 0; c < grid.NumChunks(); ++c) {
      Box chunk = grid.ChunkBox(c);
      ASSERT_EQ(grid.ChunkNumElements(c), chunk.num_elements()) << "chunk " << c;
      if (!grid.ChunkExists(c)) continue;
      ++existing;
      ASSERT_TRUE(whole.Contains(chunk));
      // The chunk lies inside one cell.
      for (int d = 0; d < rank; ++d) {
        ASSERT_EQ(chunk.origin[d] / grid.cell_shape[d],
                  (chunk.origin[d] + chunk.shape[d] - 1) / grid.cell_shape[d]);
        ASSERT_LE(chunk.shape[d], grid.chunk_shape[d]);
      }
      std::vector<int64_t> p(chunk.origin);
      for (int64_t i = 0; i < chunk.num_elements(); ++i) {
        int64_t linear = 0;
        for (int d = 0; d < rank; ++d) linear = linear * grid.shape[d] + p[d];
        ++covered[linear];
        for (int d = rank - 1; d >= 0; --d) {
          if (++p[d] < chunk.origin[d] + chunk.shape[d]) break;
          p[d] = chunk.origin[d];
        }
      }
    }
    EXPECT_EQ(existing, grid.NumStoredChunks());
    for (int count : covered) ASSERT_EQ(count, 1);

    // Random query boxes (possibly reaching past the shape).
    for (int q = 0; q < 5; ++q) {
      Box query;
      for (int d = 0; d < rank; ++d) {
        query.origin.push_back(rng() % 8);
        query.shape.push_back(rng() % 8);
      }
      std::vector<int64_t> expected, got;
      for (int64_t c = 0; c < grid.NumChunks(); ++c) {
        if (grid.ChunkExists(c) && !Intersect(grid.ChunkBox(c), query).empty())
          expected.push_back(c);
      }
      grid.ForEachChunkIntersecting(query, [&](int64_t c, const Box& box) {
        EXPECT_EQ(box, grid.ChunkBox(c));
        got.push_back(c);
      });
      ASSERT_EQ(got, expected);
    }
  }
}

TEST(ChunkGridTest, ChooseSplitsBigCellsIntoTargetSizedChunks) {
  // A 64 MiB float32 cell with an 8 MiB target: outer dimension split into 8 even pieces.
  ChunkGrid grid = ChooseChunkGrid({4096, 4096}, {4096, 4096}, 4, 8 << 20);
  EXPECT_EQ(grid.chunk_shape, (std::vector<int64_t>{512, 4096}));
  // One row bigger than the target: rows of one, and the inner dimension split.
  grid = ChooseChunkGrid({4, 1 << 22}, {4, 1 << 22}, 4, 1 << 20);
  EXPECT_EQ(grid.chunk_shape[0], 1);
  EXPECT_LE(grid.chunk_shape[1] * 4, 1 << 20);
  // Uneven: 1000 rows of 4 KiB with a 1 MiB target -> 4 chunks of 250 rows.
  grid = ChooseChunkGrid({1000, 1024}, {1000, 1024}, 4, 1 << 20);
  EXPECT_EQ(grid.chunk_shape[0], 250);
  // Small cells are left whole.
  grid = ChooseChunkGrid({10}, {3}, 4, 1 << 20);
  EXPECT_EQ(grid.chunk_shape, (std::vector<int64_t>{3}));
}

TEST(ChunkGridTest, CellShapeFromJaxStyleShards) {
  // 10 rows over 4 devices: pieces of 3,3,3,1.
  std::vector<Box> shards = {Box({0}, {3}), Box({3}, {3}), Box({6}, {3}), Box({9}, {1})};
  EXPECT_EQ(FinishCellShape({10}, ShardBoundaryGcd({10}, shards)), (std::vector<int64_t>{3}));
  // A process that holds only the last shard sees boundary 9; merged with the others, 3.
  auto last = ShardBoundaryGcd({10}, {Box({9}, {1})});
  auto first = ShardBoundaryGcd({10}, {Box({0}, {3})});
  EXPECT_EQ(FinishCellShape({10}, MergeBoundaryGcds(last, first)), (std::vector<int64_t>{3}));
  // Whole array (replicated): no boundaries -> the whole extent; a zero extent -> 1.
  EXPECT_EQ(FinishCellShape({7, 0}, ShardBoundaryGcd({7, 0}, {Box({0, 0}, {7, 0})})),
            (std::vector<int64_t>{7, 1}));
}

TEST(ChunkGridTest, ValidateEnforcesLimits) {
  ChunkGrid grid{{10}, {5}, {6}};
  EXPECT_FALSE(ValidateChunkGrid(grid, 4, "x").ok());  // chunk > cell
  grid = {{10}, {0}, {0}};
  EXPECT_FALSE(ValidateChunkGrid(grid, 4, "x").ok());
  // 2^60 elements in chunks of one: more than 2^40 chunks.
  grid = {{int64_t{1} << 60}, {1}, {1}};
  EXPECT_FALSE(ValidateChunkGrid(grid, 1, "x").ok());
  // One chunk of 2^36 bytes: over the chunk size limit.
  grid = {{int64_t{1} << 34}, {int64_t{1} << 34}, {int64_t{1} << 34}};
  EXPECT_FALSE(ValidateChunkGrid(grid, 4, "x").ok());
  grid = {{100, 3}, {50, 3}, {25, 3}};
  EXPECT_TRUE(ValidateChunkGrid(grid, 4, "x").ok());
  EXPECT_EQ(grid.NumStoredChunks(), 4);
  EXPECT_EQ(grid.ChunkName(3), "[3, 0]");
}

}  // namespace
}  // namespace tensorstash
