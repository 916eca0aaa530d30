#include "tensorstash/engine/read_plan.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

namespace tensorstash {

std::vector<NeededChunk> PlanChunkPieces(const std::vector<BoxRead>& reads) {
  std::vector<NeededChunk> needed;
  std::map<std::pair<uint32_t, int64_t>, size_t> index_of;  // (array, chunk) -> in `needed`
  for (size_t r = 0; r < reads.size(); ++r) {
    const BoxRead& read = reads[r];
    if (read.box.empty()) continue;
    read.grid->ForEachChunkIntersecting(read.box, [&](int64_t chunk, const Box& chunk_box) {
      auto [it, inserted] = index_of.emplace(std::make_pair(read.array_id, chunk), needed.size());
      if (inserted) needed.push_back({read.array_id, chunk, chunk_box, {}});
      needed[it->second].pieces.push_back({r, Intersect(chunk_box, read.box)});
    });
  }
  return needed;
}

std::vector<ReadRequestPlan> PlanReadRequests(std::vector<ChunkRead> chunks, uint64_t max_gap,
                                              uint64_t max_request) {
  std::sort(chunks.begin(), chunks.end(), [](const ChunkRead& a, const ChunkRead& b) {
    return std::make_tuple(a.direct_dest == nullptr, a.file_id, a.offset) <
           std::make_tuple(b.direct_dest == nullptr, b.file_id, b.offset);
  });
  std::vector<ReadRequestPlan> plans;
  for (const ChunkRead& chunk : chunks) {
    const bool direct = chunk.direct_dest != nullptr;
    if (!plans.empty()) {
      ReadRequestPlan& last = plans.back();
      const uint64_t end = last.offset + last.length;
      bool joins = last.file_id == chunk.file_id && (last.direct_dest != nullptr) == direct &&
                   chunk.offset >= end && chunk.offset + chunk.length - last.offset <= max_request;
      if (joins && direct) {
        joins = chunk.offset == end && last.direct_dest + last.length == chunk.direct_dest;
      } else if (joins) {
        joins = chunk.offset - end <= max_gap;
      }
      if (joins) {
        last.length = chunk.offset + chunk.length - last.offset;
        last.chunks.push_back(chunk);
        continue;
      }
    }
    plans.push_back({chunk.file_id, chunk.offset, chunk.length, chunk.direct_dest, {chunk}});
  }
  return plans;
}

}  // namespace tensorstash
