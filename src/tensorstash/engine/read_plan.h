// Read planning: which stored chunks a restore needs, and as few storage requests as sensible.
//
// PlanChunkPieces finds the chunks that a set of box reads touches. A chunk that several reads
// need (resharding onto another layout, replicas on several devices) is listed once, with the
// piece of each read it fills, so that it is fetched and decoded once.
//
// PlanReadRequests groups chunks into storage requests. Two kinds of request come out. A *direct*
// request reads a run of chunks that lie back to back in one data file and back to back in one
// destination buffer straight into that buffer. A *staged* request reads a span of a file (chunks
// plus gaps of at most `max_gap` bytes) into a staging buffer, from which each chunk is checked,
// decoded and copied into place.
//
// Thread-safety: pure functions.
#ifndef TENSORSTASH_ENGINE_READ_PLAN_H_
#define TENSORSTASH_ENGINE_READ_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/array/chunk_grid.h"

namespace tensorstash {

struct BoxRead {
  uint32_t array_id = 0;
  const ChunkGrid* grid = nullptr;  // how the array is cut into stored chunks
  Box box;                          // may reach past the array's shape (those parts: no chunk)
};

struct ChunkPiece {
  size_t read = 0;  // index into the reads planned
  Box region;       // the chunk's box intersected with the read's box
};

struct NeededChunk {
  uint32_t array_id = 0;
  int64_t chunk = 0;  // linear index in the array's grid
  Box chunk_box;
  std::vector<ChunkPiece> pieces;  // in read order
};

// The chunks `reads` need, each once, in the order first needed (read by read, chunks in
// linear order).
std::vector<NeededChunk> PlanChunkPieces(const std::vector<BoxRead>& reads);

struct ChunkRead {
  uint32_t file_id = 0;
  uint64_t offset = 0;          // in the data file
  uint64_t length = 0;          // stored bytes
  char* direct_dest = nullptr;  // non-null: the chunk's bytes go exactly here
  size_t tag = 0;               // caller's reference (which chunk of which request)
};

struct ReadRequestPlan {
  uint32_t file_id = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  char* direct_dest = nullptr;    // non-null for a direct request
  std::vector<ChunkRead> chunks;  // in file order
};

// Groups `chunks` into requests: direct chunks merge while file and destination are both
// contiguous; staged chunks merge while the gap is at most `max_gap`; no request grows past
// `max_request` bytes (a single larger chunk stays one request).
std::vector<ReadRequestPlan> PlanReadRequests(std::vector<ChunkRead> chunks, uint64_t max_gap,
                                              uint64_t max_request);

}  // namespace tensorstash

#endif  // TENSORSTASH_ENGINE_READ_PLAN_H_
