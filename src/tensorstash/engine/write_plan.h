// Write planning: which chunks one process writes, from which shard, and in which data-file lane.
//
// Every process holds some shards of each array (a shard may be held by several devices: its
// replicas). Each stored chunk lies inside one shard (the grid is built so: array/chunk_grid.h).
// A chunk held by several replicas is written by one of them: with `split_replicated_writes`
// the chunks of a replicated shard are dealt out among its replicas in turn (each writes a
// share, so replicated data costs no process more than its part); without it, replica 0 writes
// them all.
//
// Big saves write a few data files at once ("lanes"): a filesystem serializes buffered writes
// into one file. Lanes take contiguous shares of the bytes in (array, chunk) order, so that the
// chunks of an array lie side by side in a file and readers fetch neighbours in one request;
// the lanes then run side by side, taking chunks from each in turn.
//
// Thread-safety: pure functions.
#ifndef TENSORSTASH_ENGINE_WRITE_PLAN_H_
#define TENSORSTASH_ENGINE_WRITE_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/array/chunk_grid.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct ShardPlacement {
  Box box;
  int replica_id = 0;    // 0 .. num_replicas - 1
  int num_replicas = 1;  // devices (in all processes) that hold this box
};

struct ArrayToWrite {
  std::string_view path;  // for errors
  const ChunkGrid* grid = nullptr;
  size_t item_size = 0;
  std::vector<ShardPlacement> shards;  // this process's shards
};

struct ChunkWrite {
  uint32_t array_id = 0;  // index into the arrays planned
  int64_t chunk = 0;      // linear chunk index in the array's grid
  Box chunk_box;
  uint32_t shard = 0;  // index into the array's shards: where the chunk's data is
  uint64_t raw_bytes = 0;
  int lane = 0;
};

// The chunks this process writes, in (array, chunk) order. Internal when a chunk straddles the
// boundary of a shard (the grid does not fit the shards).
Result<std::vector<ChunkWrite>> PlanChunkWrites(const std::vector<ArrayToWrite>& arrays,
                                                bool split_replicated_writes);

// How many data files to write at once: one per `min_lane_bytes` of the save, at most
// min(io_threads, max_lanes), at least 1.
int CountLanes(const std::vector<ChunkWrite>& writes, int io_threads, int max_lanes,
               uint64_t min_lane_bytes);

// Sets each write's lane: contiguous shares of the bytes, in order.
void AssignLanes(std::vector<ChunkWrite>* writes, int lanes);

// The order to run the writes in: the lanes interleaved, one chunk of each in turn.
std::vector<size_t> InterleaveLanes(const std::vector<ChunkWrite>& writes, int lanes);

}  // namespace tensorstash

#endif  // TENSORSTASH_ENGINE_WRITE_PLAN_H_
