#include "tensorstash/engine/write_plan.h"

#include <algorithm>
#include <tuple>

#include "tensorstash/util/str_util.h"

namespace tensorstash {

Result<std::vector<ChunkWrite>> PlanChunkWrites(const std::vector<ArrayToWrite>& arrays,
                                                bool split_replicated_writes) {
  std::vector<ChunkWrite> writes;
  for (uint32_t id = 0; id < arrays.size(); ++id) {
    const ArrayToWrite& a = arrays[id];
    for (uint32_t s = 0; s < a.shards.size(); ++s) {
      const ShardPlacement& shard = a.shards[s];
      if (shard.box.empty()) continue;
      if (!split_replicated_writes && shard.replica_id != 0) continue;
      int64_t sequence = 0;
      Status aligned;
      a.grid->ForEachChunkIntersecting(shard.box, [&](int64_t chunk, const Box& chunk_box) {
        if (!shard.box.Contains(chunk_box)) {
          aligned = InternalError(
              StrCat("array '", a.path, "': chunk ", chunk_box.ToString(), " straddles shards"));
        }
        const int writer =
            split_replicated_writes ? static_cast<int>(sequence % shard.num_replicas) : 0;
        ++sequence;
        if (writer != shard.replica_id) return;
        const uint64_t raw = static_cast<uint64_t>(chunk_box.num_elements()) * a.item_size;
        writes.push_back({id, chunk, chunk_box, s, raw, 0});
      });
      TS_RETURN_IF_ERROR(aligned);
    }
  }
  std::sort(writes.begin(), writes.end(), [](const ChunkWrite& x, const ChunkWrite& y) {
    return std::tie(x.array_id, x.chunk) < std::tie(y.array_id, y.chunk);
  });
  return writes;
}

int CountLanes(const std::vector<ChunkWrite>& writes, int io_threads, int max_lanes,
               uint64_t min_lane_bytes) {
  uint64_t total = 0;
  for (const ChunkWrite& w : writes) total += w.raw_bytes;
  const uint64_t most = static_cast<uint64_t>(std::max(1, std::min(io_threads, max_lanes)));
  return static_cast<int>(
      std::clamp<uint64_t>(total / std::max<uint64_t>(min_lane_bytes, 1), 1, most));
}

void AssignLanes(std::vector<ChunkWrite>* writes, int lanes) {
  uint64_t total = 0;
  for (const ChunkWrite& w : *writes) total += w.raw_bytes;
  uint64_t placed = 0;
  for (ChunkWrite& w : *writes) {
    w.lane = static_cast<int>(
        std::min<uint64_t>(lanes - 1, placed * lanes / std::max<uint64_t>(total, 1)));
    placed += w.raw_bytes;
  }
}

std::vector<size_t> InterleaveLanes(const std::vector<ChunkWrite>& writes, int lanes) {
  std::vector<std::vector<size_t>> by_lane(std::max(lanes, 1));
  for (size_t i = 0; i < writes.size(); ++i) by_lane[writes[i].lane].push_back(i);
  std::vector<size_t> order;
  order.reserve(writes.size());
  for (size_t i = 0; order.size() < writes.size(); ++i) {
    for (const std::vector<size_t>& lane : by_lane) {
      if (i < lane.size()) order.push_back(lane[i]);
    }
  }
  return order;
}

}  // namespace tensorstash
