// Read planning: turning the chunks a restore needs into as few storage requests as sensible.
//
// Two kinds of request come out. A *direct* request reads a run of chunks that lie back to back
// in one data file and back to back in one destination buffer straight into that buffer. A
// *staged* request reads a span of a file (chunks plus gaps of at most `max_gap` bytes) into a
// staging buffer, from which each chunk is checked, decoded and copied into place.
//
// Thread-safety: pure function.
#ifndef TENSORSTASH_ENGINE_READ_PLAN_H_
#define TENSORSTASH_ENGINE_READ_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tensorstash {

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
