// Shared reads, the pure part: which process reads each stored chunk that several processes of a
// job need (docs/proposals/shared-reads.md).
//
// Every process of a restore needs some boxes of some arrays. The processes exchange those boxes
// (never per-chunk lists: a box list stays small however the step is chunked), and each of them
// runs PlanSharedReads on the same input, so every process computes the same plan and no plan
// is sent. A stored chunk that two or more processes need is read from storage by one of them,
// which hands it to the others; a chunk that one process needs is read by that process.
//
// The rule, deterministic: each process starts with the bytes of the chunks only it needs. The
// shared chunks needed by the same processes form a group; the groups, largest (in bytes)
// first, ties by their first chunk, are each cut, in (array, chunk) order, into runs, one per
// needer at most, whose bytes bring the needers that take one to one level (water-filling:
// the least loaded first, ties by process index; a needer already above the level takes none;
// a chunk goes to the run that holds its middle byte). Runs, not single chunks, so that what
// a process reads lies back to back in the data files: one request for several chunks, and a
// storage's read-ahead past a chunk reads what the same process reads next.
//
// Box lists travel encoded (EncodeNeeds/DecodeNeeds: varints, the ranks known from the step).
// Processes that need the same boxes (data-parallel replicas) have the same encoding, which the
// exchange (needs_exchange.h) sends once; the planner likewise takes each distinct list once,
// with the processes that hold it.
//
// Thread-safety: value types and pure functions.
#ifndef TENSORSTASH_SHARE_SHARED_READ_PLAN_H_
#define TENSORSTASH_SHARE_SHARED_READ_PLAN_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/array/chunk_grid.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// One array of the step as stored.
struct SharedArray {
  std::string path;  // for messages
  ChunkGrid grid;
  // Stored bytes of each chunk, by linear chunk index (grid.NumChunks() entries; 0 for a chunk
  // that does not exist). What a read of the chunk costs, compressed or not.
  std::vector<uint64_t> chunk_bytes;
};

// The boxes one process needs: boxes[a] for array a of the step (every array has an entry,
// possibly empty). A box may reach past the array's shape (a restore pads with zeros there): only
// its part inside the array needs stored chunks.
struct ProcessNeeds {
  std::vector<std::vector<Box>> boxes;
  bool operator==(const ProcessNeeds&) const = default;
};

// The compact form of `needs`, for the coordinator: a version byte, then per array the box count
// and each box's origin and shape as varints.
std::string EncodeNeeds(const ProcessNeeds& needs);
// The inverse, checked against the step's arrays: one entry per array, boxes of the array's rank,
// non-negative, within int64. InvalidArgument naming `process` (and the array) otherwise.
Result<ProcessNeeds> DecodeNeeds(std::string_view encoded, const std::vector<SharedArray>& arrays,
                                 int process);

// The planner's input: the distinct box lists, and for each process which one it needs.
struct JobNeeds {
  std::vector<ProcessNeeds> distinct;
  std::vector<int> list_of_process;  // by process index: an index into `distinct`
  int process_count() const { return static_cast<int>(list_of_process.size()); }
};

// Groups per-process needs into JobNeeds (identical lists once, in order of first appearance).
JobNeeds GroupNeeds(const std::vector<ProcessNeeds>& per_process);

// A stored chunk that two or more processes need.
struct SharedChunk {
  uint32_t array = 0;
  int64_t chunk = 0;     // linear chunk index in the array's grid
  uint64_t bytes = 0;    // stored bytes
  int32_t reader = -1;   // the process that reads it from storage and serves it
  uint32_t needers = 0;  // processes that need it, the reader included
};

// What one process does in a plan.
struct ProcessShare {
  std::vector<SharedChunk> serves;    // shared chunks it reads from storage and serves
  std::vector<SharedChunk> receives;  // shared chunks it gets from their reader
  std::vector<std::pair<uint32_t, int64_t>> alone;  // (array, chunk) only it needs: it reads them
};

class SharedReadPlan {
 public:
  int process_count() const { return static_cast<int>(storage_bytes_.size()); }
  // Every shared chunk, ordered by (array, chunk).
  const std::vector<SharedChunk>& shared() const { return shared_; }
  // The shared chunk (array, chunk), or nullptr when fewer than two processes need it.
  const SharedChunk* Find(uint32_t array, int64_t chunk) const;
  // Bytes process p reads from storage under the plan (its own chunks and those it serves).
  uint64_t storage_bytes(int p) const { return storage_bytes_[p]; }
  // Bytes the job reads from storage (each needed chunk once).
  uint64_t total_storage_bytes() const;
  // Bytes the job would read with every process reading what it needs itself.
  uint64_t unshared_storage_bytes() const { return unshared_bytes_; }
  // Process p's part (0 <= p < process_count()), from `needs` (the input of PlanSharedReads).
  ProcessShare ForProcess(const JobNeeds& needs, const std::vector<SharedArray>& arrays,
                          int p) const;

 private:
  friend Result<SharedReadPlan> PlanSharedReads(const std::vector<SharedArray>&, const JobNeeds&);
  std::vector<SharedChunk> shared_;
  std::vector<size_t> array_begin_;  // shared_ index of each array's first chunk, and the end
  std::vector<uint64_t> storage_bytes_;
  uint64_t unshared_bytes_ = 0;
};

// The plan for `needs` over `arrays` (the rule above). InvalidArgument when a list has the wrong
// number of arrays or a box of the wrong rank, when an array's chunk_bytes does not match its
// grid, or when list_of_process names no list.
Result<SharedReadPlan> PlanSharedReads(const std::vector<SharedArray>& arrays,
                                       const JobNeeds& needs);

}  // namespace tensorstash

#endif  // TENSORSTASH_SHARE_SHARED_READ_PLAN_H_
