#include "tensorstash/array/chunk_grid.h"

#include <algorithm>
#include <numeric>

namespace tensorstash {
namespace {

// Limits from docs/format.md.
constexpr int64_t kMaxChunksPerArray = int64_t{1} << 40;
constexpr int64_t kMaxChunkBytes = int64_t{1} << 32;

int64_t CeilDiv(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// Start and extent of chunk k along one dimension.
void ChunkRange(int64_t n, int64_t s, int64_t c, int64_t k, int64_t* start, int64_t* extent) {
  const int64_t per_cell = CeilDiv(s, c);
  const int64_t cell = k / per_cell, j = k % per_cell;
  const int64_t cell_start = cell * s;
  *start = cell_start + j * c;
  const int64_t end = std::min({*start + c, cell_start + s, n});
  *extent = std::max<int64_t>(0, end - *start);
}

}  // namespace

int64_t ChunkGrid::GridExtent(int d) const {
  return CeilDiv(shape[d], cell_shape[d]) * CeilDiv(cell_shape[d], chunk_shape[d]);
}

int64_t ChunkGrid::NumChunks() const {
  int64_t n = 1;
  for (int d = 0; d < rank(); ++d) n *= GridExtent(d);
  return n;
}

int64_t ChunkGrid::NumStoredChunks() const {
  int64_t n = 1;
  for (int d = 0; d < rank(); ++d) {
    const int64_t s = cell_shape[d], c = chunk_shape[d];
    const int64_t full_cells = shape[d] / s, rest = shape[d] % s;
    n *= full_cells * CeilDiv(s, c) + (rest > 0 ? CeilDiv(rest, c) : 0);
  }
  return n;
}

Box ChunkGrid::ChunkBox(int64_t linear_index) const {
  Box box;
  box.origin.resize(rank());
  box.shape.resize(rank());
  for (int d = rank() - 1; d >= 0; --d) {
    const int64_t extent = GridExtent(d);
    const int64_t k = linear_index % extent;
    linear_index /= extent;
    ChunkRange(shape[d], cell_shape[d], chunk_shape[d], k, &box.origin[d], &box.shape[d]);
  }
  return box;
}

int64_t ChunkGrid::ChunkNumElements(int64_t linear_index) const {
  int64_t elements = 1;
  for (int d = rank() - 1; d >= 0; --d) {
    const int64_t extent = GridExtent(d);
    const int64_t k = linear_index % extent;
    linear_index /= extent;
    int64_t origin, size;
    ChunkRange(shape[d], cell_shape[d], chunk_shape[d], k, &origin, &size);
    elements *= size;
  }
  return elements;
}

std::string ChunkGrid::ChunkName(int64_t linear_index) const {
  std::vector<int64_t> coords(rank());
  for (int d = rank() - 1; d >= 0; --d) {
    coords[d] = linear_index % GridExtent(d);
    linear_index /= GridExtent(d);
  }
  return StrCat("[", StrJoin(coords, ", "), "]");
}

void ChunkGrid::ForEachChunkIntersecting(const Box& box,
                                         const std::function<void(int64_t, const Box&)>& fn) const {
  const int r = rank();
  // Per dimension: the grid indices (and their ranges) that meet [lo, hi).
  struct Span {
    int64_t k, start, extent;
  };
  std::vector<std::vector<Span>> spans(r);
  for (int d = 0; d < r; ++d) {
    const int64_t lo = std::max<int64_t>(box.origin[d], 0);
    const int64_t hi = std::min(box.origin[d] + box.shape[d], shape[d]);
    if (lo >= hi) return;
    const int64_t s = cell_shape[d], c = chunk_shape[d], per_cell = CeilDiv(s, c);
    for (int64_t cell = lo / s; cell * s < hi; ++cell) {
      const int64_t cell_start = cell * s;
      const int64_t j_lo = std::max<int64_t>(0, (lo - cell_start) / c);
      const int64_t j_hi =
          std::min(per_cell - 1, (std::min(hi, cell_start + s) - 1 - cell_start) / c);
      for (int64_t j = j_lo; j <= j_hi; ++j) {
        Span span;
        span.k = cell * per_cell + j;
        ChunkRange(shape[d], s, c, span.k, &span.start, &span.extent);
        if (span.extent > 0) spans[d].push_back(span);
      }
    }
    if (spans[d].empty()) return;
  }
  std::vector<size_t> pos(r, 0);
  Box chunk;
  chunk.origin.resize(r);
  chunk.shape.resize(r);
  for (;;) {
    int64_t linear = 0;
    for (int d = 0; d < r; ++d) {
      const Span& span = spans[d][pos[d]];
      linear = linear * GridExtent(d) + span.k;
      chunk.origin[d] = span.start;
      chunk.shape[d] = span.extent;
    }
    fn(linear, chunk);
    int d = r - 1;
    while (d >= 0) {
      if (++pos[d] < spans[d].size()) break;
      pos[d] = 0;
      --d;
    }
    if (d < 0) break;
  }
}

Status ValidateChunkGrid(const ChunkGrid& grid, size_t item_size, std::string_view what) {
  const int r = grid.rank();
  if (r > kMaxRank) {
    return InvalidArgumentError(StrCat(what, ": rank ", r, " exceeds the limit of ", kMaxRank));
  }
  if (static_cast<int>(grid.cell_shape.size()) != r ||
      static_cast<int>(grid.chunk_shape.size()) != r) {
    return InvalidArgumentError(
        StrCat(what, ": shape, cell_shape and chunk_shape must have the same rank"));
  }
  TS_RETURN_IF_ERROR(ValidateBox(Box::FromShape(grid.shape), item_size, what));
  int64_t chunks = 1, chunk_elements = 1;
  for (int d = 0; d < r; ++d) {
    const int64_t s = grid.cell_shape[d], c = grid.chunk_shape[d];
    if (s < 1 || c < 1 || c > s || s > std::max<int64_t>(grid.shape[d], 1)) {
      return InvalidArgumentError(StrCat(what, ": dimension ", d, " has cell extent ", s,
                                         " and chunk extent ", c,
                                         " (need 1 <= chunk <= cell <= max(extent, 1))"));
    }
    // GridExtent's product cannot overflow here: cells <= extent and chunks per cell <= cell.
    int64_t extent;
    if (__builtin_mul_overflow(CeilDiv(grid.shape[d], s), CeilDiv(s, c), &extent) ||
        __builtin_mul_overflow(chunks, extent, &chunks) || chunks > kMaxChunksPerArray) {
      return InvalidArgumentError(StrCat(what, ": more than 2^40 chunks"));
    }
    if (__builtin_mul_overflow(chunk_elements, c, &chunk_elements) ||
        chunk_elements > kMaxChunkBytes) {
      return InvalidArgumentError(StrCat(what, ": a chunk exceeds 2^32 bytes"));
    }
  }
  if (chunk_elements * static_cast<int64_t>(item_size) > kMaxChunkBytes) {
    return InvalidArgumentError(StrCat(what, ": a chunk exceeds 2^32 bytes"));
  }
  return OkStatus();
}

ChunkGrid ChooseChunkGrid(const std::vector<int64_t>& shape, const std::vector<int64_t>& cell_shape,
                          size_t item_size, int64_t target_chunk_bytes) {
  ChunkGrid grid;
  grid.shape = shape;
  grid.cell_shape = cell_shape;
  grid.chunk_shape = cell_shape;
  const int r = static_cast<int>(shape.size());
  target_chunk_bytes = std::clamp<int64_t>(target_chunk_bytes, 1, kMaxChunkBytes);
  auto bytes_from = [&](int d) {  // bytes of one slab of extent 1 in dim d, dims > d full
    int64_t b = static_cast<int64_t>(item_size);
    for (int k = d + 1; k < r; ++k) b *= grid.chunk_shape[k];
    return b;
  };
  for (int d = 0; d < r; ++d) {
    const int64_t slab = bytes_from(d);
    const int64_t full = slab * grid.chunk_shape[d];
    if (full <= target_chunk_bytes) break;
    if (slab <= target_chunk_bytes) {
      // Split this dimension into as few even pieces as fit the target.
      const int64_t s = grid.cell_shape[d];
      const int64_t pieces = CeilDiv(s, std::max<int64_t>(1, target_chunk_bytes / slab));
      grid.chunk_shape[d] = CeilDiv(s, pieces);
      break;
    }
    grid.chunk_shape[d] = 1;
  }
  return grid;
}

std::vector<int64_t> ShardBoundaryGcd(const std::vector<int64_t>& shape,
                                      const std::vector<Box>& shards) {
  const int r = static_cast<int>(shape.size());
  std::vector<int64_t> gcd(r, 0);
  for (const Box& shard : shards) {
    for (int d = 0; d < r; ++d) {
      for (int64_t boundary : {shard.origin[d], shard.origin[d] + shard.shape[d]}) {
        if (boundary > 0 && boundary < shape[d]) gcd[d] = std::gcd(gcd[d], boundary);
      }
    }
  }
  return gcd;
}

std::vector<int64_t> MergeBoundaryGcds(const std::vector<int64_t>& a,
                                       const std::vector<int64_t>& b) {
  std::vector<int64_t> out(a.size());
  for (size_t d = 0; d < a.size(); ++d) out[d] = std::gcd(a[d], b[d]);
  return out;
}

std::vector<int64_t> FinishCellShape(const std::vector<int64_t>& shape,
                                     const std::vector<int64_t>& boundary_gcd) {
  std::vector<int64_t> cell(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    cell[d] = boundary_gcd[d] > 0 ? boundary_gcd[d] : std::max<int64_t>(shape[d], 1);
  }
  return cell;
}

}  // namespace tensorstash
