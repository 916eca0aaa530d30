// RestoreToHost: every box a restore needs, from one step, into host memory, in one call.
//
// A front (the Python package) hands over the boxes of all its target leaves at once: for each
// device shard of each leaf, the array's path, the box and the dtype it wants. The engine then
//   - reads each distinct box once (replicas on several devices ask for the same box);
//   - maps a box copy-on-write from the data files instead of reading it, where it is in the
//     stored dtype and its chunks allow it (CheckpointReader::MapMany: boxes stored as runs of a
//     file share mappings, whatever their size);
//   - reads the rest into fresh host buffers (64-byte aligned, so that XLA's CPU client adopts
//     them without a copy; boxes under 4 MiB share arenas of 32 MiB, each arena freed once all
//     its boxes are), all of a batch in parallel under the reader's byte budget;
//   - hands the buffers over batch by batch, each batch about `batch_bytes` of boxes and at
//     most about `batch_requests` requests, every request of an array in the same batch, so that
//     the caller can pass a batch on (to devices) and drop it while the next is mapped and read
//     (on a helper thread): reading overlaps with the copies to devices, and host memory stays
//     near two batches. (Give the requests of an array one after another: a box asked for again
//     in a later batch is read again.)
// The defaults below are the only place these numbers are written; the Python package takes
// them from here.
//
// Thread-safety: several calls may run on one StepSource at once (its reads are thread-safe).
// `on_batch` is called from the calling thread, one batch at a time, while the next batch is
// read on a helper thread; `progress` from the calling thread, the helper or the reader's IO
// threads, one call at a time and never while `on_batch` runs (what the next batch reports
// meanwhile is reported once on_batch returns), so that on_batch may hold a lock the progress
// callable takes.
#ifndef TENSORSTASH_ENGINE_HOST_RESTORE_H_
#define TENSORSTASH_ENGINE_HOST_RESTORE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/array/dtype.h"
#include "tensorstash/engine/step_source.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// Reads are handed over in batches of about this many bytes: two of them (the one handed over and
// the next, read meanwhile) hold what one batch of 512 MiB held before reads overlapped. Smaller
// batches would overlap more of a restore, but each costs a pause of the reading: 1 GiB mapped
// onto 8 CPU devices took about 10% longer in batches of 128 MiB than of 512 (noisy, fresh
// processes, medians of 5).
inline constexpr uint64_t kDefaultHostBatchBytes = uint64_t{256} << 20;
// and of at most about this many requests: what a request costs besides its bytes (the
// reader's plan, the buffer's bookkeeping, the front's objects for it) is a few KiB, which
// 100,000 tiny arrays on 8 devices in one batch made 3.4 GB at once.
inline constexpr uint64_t kDefaultHostBatchRequests = 16384;

struct HostBoxRequest {
  std::string path;  // array path
  Box box;           // may reach past the stored shape: zeros there
  DType dtype;       // a cast when it differs from the stored dtype
};

// The bytes of one box, C order: memory of its own, or a copy-on-write mapping of the data
// files. Freed (unmapped) when destroyed.
class HostBuffer {
 public:
  virtual ~HostBuffer() = default;
  virtual char* data() const = 0;
  virtual size_t size() const = 0;
  virtual bool mapped() const = 0;
};

struct HostRestoreOptions {
  bool map = true;  // false: read every box
  // At most this many kernel mapping entries per restore (MapOptions::max_mappings); boxes past
  // them are read. Mappings live as long as the boxes in them, and a process has vm.max_map_count
  // entries for everything (the allocator, JAX, earlier restores): 0 takes a quarter of those
  // still free.
  uint64_t max_mappings = 0;
  // Boxes stored near each other share mappings of up to this many bytes (MapOptions).
  uint64_t shared_mapping_bytes = MapOptions{}.shared_mapping_bytes;
  uint64_t batch_bytes = kDefaultHostBatchBytes;
  uint64_t batch_requests = kDefaultHostBatchRequests;
};

struct HostRestoreStats {
  uint64_t mapped_bytes = 0;  // bytes of the boxes mapped instead of read
  uint64_t boxes = 0;         // distinct boxes
  uint64_t batches = 0;
  uint64_t read_calls = 0;  // reads of batches (a batch that is all mapped reads nothing)
  ReadStats reads;          // of all batches (peak_staging_bytes: the highest of one batch)
};

// One batch: for each request index in it, its buffer (requests for the same box share one).
struct HostBatch {
  std::vector<size_t> requests;
  std::vector<std::shared_ptr<HostBuffer>> buffers;  // parallel to `requests`
};

// Restores `requests` from `source`, calling `on_batch` once per batch, in request order (a batch
// may be moved from). Every request is in exactly one batch. `progress(done, total)` counts bytes
// of the distinct boxes of each batch, mapped or read; the last call has done == total.
// OK once every batch has been handed over. Otherwise the first error in request order:
// InvalidArgument or NotFound naming the array for a bad request (before anything is read), a
// read's error (DataLoss naming the chunk, ...) once the batches before it are handed over, or
// the error `on_batch` returned, after which the batch being read ahead is finished and dropped
// and nothing further is read. Batches handed over before an error stay valid. An exception
// thrown by `on_batch` leaves the same way, once the read ahead has ended.
Status RestoreToHost(StepSource& source, const std::vector<HostBoxRequest>& requests,
                     const HostRestoreOptions& options,
                     const std::function<Status(HostBatch&)>& on_batch,
                     const std::function<void(uint64_t, uint64_t)>& progress = nullptr,
                     HostRestoreStats* stats = nullptr);

}  // namespace tensorstash

#endif  // TENSORSTASH_ENGINE_HOST_RESTORE_H_
