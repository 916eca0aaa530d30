// ChunkGrid: how an array is cut into stored chunks, independently of how devices held it.
//
// The grid has two levels (docs/format.md, "Chunk grid"). The array's shape is cut into *cells*
// of `cell_shape` (the last cell in a dimension may be clipped); a cell is the largest box that
// one writer shard is guaranteed to cover entirely. Each cell is cut into *chunks* of
// `chunk_shape` (chunk_shape <= cell_shape, the last chunk in a cell may be clipped). A chunk
// therefore never straddles two shards, yet a big shard becomes many chunks that are written and
// read in parallel.
//
// Chunks are numbered along each dimension k = cell * chunks_per_cell + j, and linearly in
// row-major order over the per-dimension counts. When the last cell of a dimension is clipped,
// its trailing chunks may start past the array's end: those chunks do not exist (are never
// stored). A dimension of extent 0 has no cells and so no chunks.
//
// Thread-safety: value type.
#ifndef TENSORSTASH_ARRAY_CHUNK_GRID_H_
#define TENSORSTASH_ARRAY_CHUNK_GRID_H_

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct ChunkGrid {
  std::vector<int64_t> shape;        // the array's shape
  std::vector<int64_t> cell_shape;   // >= 1 per dimension
  std::vector<int64_t> chunk_shape;  // 1 <= chunk_shape[d] <= cell_shape[d]

  int rank() const { return static_cast<int>(shape.size()); }
  // Chunks along dimension d: ceil(shape/cell) * ceil(cell/chunk).
  int64_t GridExtent(int d) const;
  // Total chunk count (the product of GridExtent), including chunks that do not exist.
  int64_t NumChunks() const;
  // Chunks that exist (non-empty): what a complete index holds for the array.
  int64_t NumStoredChunks() const;
  // True when chunk `linear_index` exists (is non-empty).
  bool ChunkExists(int64_t linear_index) const { return ChunkNumElements(linear_index) != 0; }
  // ChunkBox(linear_index).num_elements() without making the box: opening a step checks the
  // size of every chunk in its index (32,000 for 4,000 arrays on 8 devices).
  int64_t ChunkNumElements(int64_t linear_index) const;
  // The region chunk `linear_index` covers (assumes 0 <= linear_index < NumChunks()).
  Box ChunkBox(int64_t linear_index) const;
  // Calls `fn(linear_index, chunk_box)` for every chunk that intersects `box`, in increasing
  // linear order.
  void ForEachChunkIntersecting(const Box& box,
                                const std::function<void(int64_t, const Box&)>& fn) const;
  // "[1, 0]"-style grid coordinates of a chunk, for messages.
  std::string ChunkName(int64_t linear_index) const;

  bool operator==(const ChunkGrid&) const = default;
};

// Checks ranks, extents (cell >= 1, 1 <= chunk <= cell), and that the chunk count and the bytes
// of one chunk (at `item_size`) stay within the format's limits. InvalidArgument naming `what`.
Status ValidateChunkGrid(const ChunkGrid& grid, size_t item_size, std::string_view what);

// Chooses chunk_shape for the given shape and cells so that a chunk holds at most
// `target_chunk_bytes` (but at least one element): outer dimensions are split first, and the
// chunks of a cell are made as even as possible.
ChunkGrid ChooseChunkGrid(const std::vector<int64_t>& shape, const std::vector<int64_t>& cell_shape,
                          size_t item_size, int64_t target_chunk_bytes);

// Cell shapes from shard boxes, in two steps so that processes can pool what they see.
// ShardBoundaryGcd: per dimension, the greatest common divisor of every shard boundary strictly
// inside the array, 0 where there is none. MergeBoundaryGcds combines two such vectors (gcd per
// dimension; 0 is neutral). FinishCellShape turns the result into a cell shape (0 -> the extent,
// and 1 for a zero extent).
std::vector<int64_t> ShardBoundaryGcd(const std::vector<int64_t>& shape,
                                      const std::vector<Box>& shards);
std::vector<int64_t> MergeBoundaryGcds(const std::vector<int64_t>& a,
                                       const std::vector<int64_t>& b);
std::vector<int64_t> FinishCellShape(const std::vector<int64_t>& shape,
                                     const std::vector<int64_t>& boundary_gcd);

}  // namespace tensorstash

#endif  // TENSORSTASH_ARRAY_CHUNK_GRID_H_
