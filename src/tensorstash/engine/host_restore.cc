#include "tensorstash/engine/host_restore.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string_view>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>

#include "tensorstash/util/staging_buffer.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

// XLA's CPU client adopts a host buffer as a device buffer without copying it when its address
// is a multiple of 64 bytes.
constexpr size_t kAlignment = 64;
// From this size a box gets memory of its own (a StagingBuffer: mapped for itself and returned to
// the system when freed). Smaller boxes are carved out of shared arenas of about kArenaBytes, each
// a StagingBuffer too.
//
// Why arenas: the profile of 4,000 arrays of 4 KiB..1 MiB restored into NumPy (whole arrays, all
// read) or onto 8 CPU devices (28,880 boxes read) spent its time in malloc and free per box and in
// page faults and the zeroing of fresh pages; an arena costs one allocation (and one unmapping)
// for thousands of boxes, and no allocator bookkeeping between them. The price: an arena's memory
// goes back to the system once every box carved from it is gone. (Huge pages for the arenas, tried:
// faster once a process has used them, but slower on the first restore of a fresh process on the VM
// the benchmark runs on, whose freed 2 MiB blocks go back to the host.)
constexpr size_t kOwnMappingFrom = size_t{4} << 20;
constexpr size_t kArenaBytes = size_t{32} << 20;

size_t Aligned(size_t size) { return (size + kAlignment - 1) / kAlignment * kAlignment; }

// A box's bytes in a StagingBuffer it keeps alive: an arena shared with other boxes, or memory
// of its own (an arena of one).
class ArenaSlice final : public HostBuffer {
 public:
  ArenaSlice(std::shared_ptr<const StagingBuffer> arena, char* data, size_t size)
      : arena_(std::move(arena)), data_(data), size_(size) {}
  char* data() const override { return data_; }
  size_t size() const override { return size_; }
  bool mapped() const override { return false; }

 private:
  std::shared_ptr<const StagingBuffer> arena_;
  char* data_;
  size_t size_;
};

// Hands out the buffers of the boxes a restore reads: small ones carved from arenas in request
// order, so that an array's boxes, and neighbouring arrays, share one.
class BufferAllocator {
 public:
  // `small_bytes`: the aligned sizes of all the small boxes that will be asked for, so that the
  // last arena is no larger than what is left.
  explicit BufferAllocator(uint64_t small_bytes) : small_left_(small_bytes) {}

  // The buffer for `size` bytes of request `r`; OutOfMemory naming the box when the memory
  // cannot be had.
  Result<std::shared_ptr<HostBuffer>> Allocate(size_t size, const HostBoxRequest& r) {
    // The allocators report failure by throwing; the core returns a Status.
    try {
      if (!IsSmall(size)) {
        // Memory of its own; never empty: the reader wants a destination even for an empty box.
        auto own = std::make_shared<const StagingBuffer>(size == 0 ? kAlignment : size);
        return std::make_shared<ArenaSlice>(own, own->data(), size);
      }
      const size_t slot = Aligned(size);
      if (arena_ == nullptr || arena_->size() - used_ < slot) {
        arena_ = std::make_shared<const StagingBuffer>(
            std::max<size_t>(slot, std::min<uint64_t>(kArenaBytes, small_left_)));
        used_ = 0;
      }
      char* data = arena_->data() + used_;
      used_ += slot;
      small_left_ -= std::min<uint64_t>(small_left_, slot);
      return std::make_shared<ArenaSlice>(arena_, data, size);
    } catch (const std::bad_alloc&) {
      return OutOfMemoryError(StrCat("out of memory: cannot allocate ", size, " bytes for box ",
                                     r.box.ToString(), " of array '", r.path, "'"));
    }
  }

  static bool IsSmall(size_t size) { return size > 0 && size < kOwnMappingFrom; }

 private:
  uint64_t small_left_;
  std::shared_ptr<const StagingBuffer> arena_;
  size_t used_ = 0;
};

class MappedBuffer final : public HostBuffer {
 public:
  explicit MappedBuffer(MappedBox box) : box_(std::move(box)) {}
  char* data() const override { return box_.data(); }
  size_t size() const override { return box_.size(); }
  bool mapped() const override { return true; }

 private:
  MappedBox box_;
};

// One distinct box: the requests that asked for it, and its buffer once there is one.
struct DistinctBox {
  size_t first_request;
  uint64_t nbytes;
  std::shared_ptr<HostBuffer> buffer;
};

using BoxKey = std::tuple<std::string_view, std::vector<int64_t>, std::vector<int64_t>, int>;

// A quarter of the kernel mapping entries this process has left (vm.max_map_count less the
// lines of /proc/self/maps); 1,000 where /proc cannot say.
uint64_t DefaultMappingBudget() {
  uint64_t limit = 0;
  if (std::FILE* f = std::fopen("/proc/sys/vm/max_map_count", "r")) {
    unsigned long long value = 0;
    if (std::fscanf(f, "%llu", &value) == 1) limit = value;
    std::fclose(f);
  }
  std::FILE* maps = std::fopen("/proc/self/maps", "r");
  if (limit == 0 || maps == nullptr) {
    if (maps != nullptr) std::fclose(maps);
    return 1000;
  }
  uint64_t used = 0;
  char buffer[1 << 16];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), maps)) > 0;) {
    used += static_cast<uint64_t>(std::count(buffer, buffer + n, '\n'));
  }
  std::fclose(maps);
  return used >= limit ? 0 : (limit - used) / 4;
}

}  // namespace

Status RestoreToHost(StepSource& source, const std::vector<HostBoxRequest>& requests,
                     const HostRestoreOptions& options,
                     const std::function<Status(HostBatch&)>& on_batch,
                     const std::function<void(uint64_t, uint64_t)>& progress,
                     HostRestoreStats* stats) {
  HostRestoreStats local_stats;
  HostRestoreStats& out_stats = stats != nullptr ? *stats : local_stats;
  out_stats = {};

  // Check every request before anything is read or allocated.
  std::map<std::string_view, const ArrayMetadata*> arrays;
  for (const ArrayMetadata& a : source.arrays()) arrays.emplace(a.path, &a);
  std::vector<size_t> box_of(requests.size());  // request -> index into `boxes`
  std::vector<DistinctBox> boxes;
  std::map<BoxKey, size_t> box_index;
  char placeholder = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const HostBoxRequest& r = requests[i];
    auto array = arrays.find(r.path);
    if (array == arrays.end()) {
      return NotFoundError(StrCat("no array '", r.path, "' in checkpoint '", source.dir(), "'"));
    }
    TS_RETURN_IF_ERROR(
        ValidateReadRequest({r.path, r.box, r.dtype, &placeholder}, *array->second, r.dtype));
    BoxKey key{r.path, r.box.origin, r.box.shape, static_cast<int>(r.dtype)};
    auto [it, inserted] = box_index.emplace(std::move(key), boxes.size());
    if (inserted) {
      boxes.push_back({i, static_cast<uint64_t>(r.box.num_elements()) * ItemSize(r.dtype), {}});
    }
    box_of[i] = it->second;
  }
  out_stats.boxes = boxes.size();

  // Batches in request order: a batch ends after an array once its boxes reach batch_bytes or
  // its requests batch_requests. `total` counts each box once per batch that asks for it (a box
  // asked for again in a later batch is mapped or read again).
  struct PlannedBatch {
    size_t begin, end;          // its requests
    std::vector<size_t> boxes;  // its distinct boxes, in request order
  };
  std::vector<PlannedBatch> batches;
  uint64_t total = 0;
  {
    std::vector<size_t> last_batch_of(boxes.size(), SIZE_MAX);
    for (size_t begin = 0; begin < requests.size();) {
      PlannedBatch batch{begin, begin, {}};
      uint64_t batch_bytes = 0;
      size_t& end = batch.end;
      while (end < requests.size() &&
             (end == begin || requests[end].path == requests[end - 1].path ||
              (batch_bytes < options.batch_bytes && end - begin < options.batch_requests))) {
        if (last_batch_of[box_of[end]] != batches.size()) {
          last_batch_of[box_of[end]] = batches.size();
          batch.boxes.push_back(box_of[end]);
          batch_bytes += boxes[box_of[end]].nbytes;
        }
        ++end;
      }
      total += batch_bytes;
      begin = end;
      batches.push_back(std::move(batch));
    }
  }

  // Progress, one call at a time. While on_batch runs, the next batch's progress is kept and
  // reported once it returns: a front's on_batch may hold a lock (Python's GIL) that its progress
  // callable needs, and a reader thread waiting for it would stall the reading ahead.
  std::mutex progress_mutex;
  bool handing_over = false;
  uint64_t progress_kept = 0;  // 0: nothing kept
  bool final_reported = false;
  auto call_progress = [&](uint64_t done) {  // under progress_mutex
    final_reported = done >= total;
    progress(done, total);
  };
  auto report = [&](uint64_t done) {
    if (!progress) return;
    std::lock_guard<std::mutex> lock(progress_mutex);
    if (handing_over) {
      progress_kept = std::max(progress_kept, done);
    } else {
      call_progress(done);
    }
  };
  auto set_handing_over = [&](bool on) {
    if (!progress) return;
    std::lock_guard<std::mutex> lock(progress_mutex);
    handing_over = on;
    if (!on && progress_kept != 0) call_progress(std::exchange(progress_kept, 0));
  };

  // Mapping entries are one budget for the whole restore.
  bool budget_known = options.max_mappings != 0;
  uint64_t mapping_limit = options.max_mappings;
  uint64_t mappings_made = 0;
  uint64_t done = 0;  // of `total`: in the batches prepared so far

  // Maps what it can of batch k's boxes and reads the rest, into `batch`. Batches are prepared
  // one at a time, in order (the next one on a helper thread while the caller has this one).
  auto prepare = [&](size_t k, HostBatch& batch) -> Status {
    const auto& [begin, end, distinct] = batches[k];
    uint64_t mapped_now = 0;
    if (options.map) {
      std::vector<ReadRequest> maps;
      std::vector<size_t> mapped_box;
      for (size_t b : distinct) {
        const HostBoxRequest& r = requests[boxes[b].first_request];
        if (boxes[b].nbytes == 0 || arrays.at(r.path)->dtype != r.dtype) continue;
        maps.push_back({r.path, r.box, r.dtype, nullptr});
        mapped_box.push_back(b);
      }
      if (!maps.empty()) {
        // Read from /proc only once a box could be mapped: restores with casts map nothing.
        if (!budget_known) {
          mapping_limit = DefaultMappingBudget();
          budget_known = true;
        }
        MapOptions map_options;
        map_options.max_mappings = mapping_limit;
        map_options.shared_mapping_bytes = options.shared_mapping_bytes;
        map_options.mappings_made = &mappings_made;
        std::vector<Result<MappedBox>> mapped = source.MapMany(maps, map_options);
        for (size_t m = 0; m < mapped.size(); ++m) {
          if (mapped[m].ok()) {
            boxes[mapped_box[m]].buffer = std::make_shared<MappedBuffer>(*std::move(mapped[m]));
            mapped_now += boxes[mapped_box[m]].nbytes;
          } else if (!absl::IsUnimplemented(mapped[m].status())) {
            return mapped[m].status();  // a read would fail the same way (a bad checksum, ...)
          }
        }
      }
    }
    out_stats.mapped_bytes += mapped_now;
    done += mapped_now;
    if (mapped_now > 0 && done < total) report(done);

    uint64_t small_bytes = 0;  // of the boxes to read, the arenas' share (aligned)
    for (size_t b : distinct) {
      if (boxes[b].buffer == nullptr && BufferAllocator::IsSmall(boxes[b].nbytes)) {
        small_bytes += Aligned(boxes[b].nbytes);
      }
    }
    BufferAllocator allocator(small_bytes);
    std::vector<ReadRequest> reads;
    uint64_t read_bytes = 0;
    for (size_t b : distinct) {
      DistinctBox& box = boxes[b];
      if (box.buffer != nullptr) continue;
      const HostBoxRequest& r = requests[box.first_request];
      TS_ASSIGN_OR_RETURN(box.buffer, allocator.Allocate(box.nbytes, r));
      reads.push_back({r.path, r.box, r.dtype, box.buffer->data()});
      read_bytes += box.nbytes;
    }
    if (!reads.empty()) {
      ReadStats read_stats;
      std::function<void(uint64_t, uint64_t)> on_progress;
      if (progress) {
        // The reader counts stored bytes of this call; shown as bytes of its boxes.
        on_progress = [&report, start = done, read_bytes, total](uint64_t d, uint64_t t) {
          report(std::min(total, start + (t == 0 ? read_bytes : read_bytes * d / t)));
        };
      }
      TS_RETURN_IF_ERROR(source.ReadMany(reads, &read_stats, on_progress));
      ReadStats& sum = out_stats.reads;
      sum.bytes_read += read_stats.bytes_read;
      sum.requests += read_stats.requests;
      sum.direct_chunks += read_stats.direct_chunks;
      sum.staged_chunks += read_stats.staged_chunks;
      sum.mapped_spans += read_stats.mapped_spans;
      sum.peak_staging_bytes = std::max(sum.peak_staging_bytes, read_stats.peak_staging_bytes);
      ++out_stats.read_calls;
      done = std::min(total, done + read_bytes);
    }
    for (size_t i = begin; i < end; ++i) {
      batch.requests.push_back(i);
      batch.buffers.push_back(boxes[box_of[i]].buffer);
    }
    // Only the batch holds its buffers now: the caller frees them by dropping it.
    for (size_t b : distinct) boxes[b].buffer.reset();
    return OkStatus();
  };

  // The first batch is prepared on the calling thread; each next one on a helper thread while
  // on_batch has the one before, so that reading overlaps with what the caller does with a batch
  // (copies to devices). Buffers of at most two batches are alive at once.
  HostBatch current;
  Status status = batches.empty() ? OkStatus() : prepare(0, current);
  for (size_t k = 0; status.ok() && k < batches.size(); ++k) {
    HostBatch next;
    Status next_status;
    // Declared after what it writes: on the way out of an exception from on_batch (a front's
    // callable may throw), it is joined before those are destroyed.
    std::jthread ahead;
    const bool more = k + 1 < batches.size();
    if (more) {
      try {
        ahead = std::jthread([&, k] {
          // An exception must not leave the thread (it would end the process).
          try {
            next_status = prepare(k + 1, next);
          } catch (const std::bad_alloc&) {
            next_status = OutOfMemoryError("out of memory while reading the next batch of boxes");
          }
        });
      } catch (const std::system_error&) {
        // No thread to be had: the next batch is prepared after this one is handed over.
      }
    }
    set_handing_over(true);
    ++out_stats.batches;
    status = on_batch(current);
    set_handing_over(false);
    current = HostBatch{};  // this batch's buffers are the caller's now, or dropped
    if (ahead.joinable()) {
      ahead.join();
    } else if (more && status.ok()) {
      next_status = prepare(k + 1, next);
    }
    if (status.ok()) status = next_status;
    current = std::move(next);
  }
  TS_RETURN_IF_ERROR(status);
  // The final call, where none was made (nothing to read, or the last report was kept short).
  if (progress && !final_reported) progress(total, total);
  return OkStatus();
}

}  // namespace tensorstash
