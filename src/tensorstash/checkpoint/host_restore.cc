#include "tensorstash/checkpoint/host_restore.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <string_view>
#include <tuple>
#include <utility>

#include "tensorstash/checkpoint/checkpoint_reader.h"
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

  // Map what can be mapped, all at once (the maps run in parallel).
  if (options.map) {
    std::vector<ReadRequest> maps;
    std::vector<size_t> mapped_box;
    for (size_t b = 0; b < boxes.size(); ++b) {
      const HostBoxRequest& r = requests[boxes[b].first_request];
      if (boxes[b].nbytes == 0 || arrays[r.path]->dtype != r.dtype) continue;
      maps.push_back({r.path, r.box, r.dtype, nullptr});
      mapped_box.push_back(b);
    }
    MapOptions map_options;
    // Read from /proc only once a box could be mapped: restores with casts map nothing.
    if (!maps.empty()) {
      map_options.max_mappings =
          options.max_mappings != 0 ? options.max_mappings : DefaultMappingBudget();
    }
    map_options.shared_mapping_bytes = options.shared_mapping_bytes;
    std::vector<Result<MappedBox>> mapped = source.MapMany(maps, map_options);
    for (size_t m = 0; m < mapped.size(); ++m) {
      if (mapped[m].ok()) {
        boxes[mapped_box[m]].buffer = std::make_shared<MappedBuffer>(*std::move(mapped[m]));
        out_stats.mapped_bytes += boxes[mapped_box[m]].nbytes;
      } else if (!absl::IsUnimplemented(mapped[m].status())) {
        return mapped[m].status();  // a read would fail the same way (a bad checksum, ...)
      }
    }
  }

  // Progress counts the bytes of every box: the mapped ones (mapped and checked by now) are done.
  uint64_t total = out_stats.mapped_bytes;
  uint64_t small_bytes = 0;  // of the boxes to read, the arenas' share (aligned)
  for (const DistinctBox& box : boxes) {
    if (box.buffer != nullptr) continue;
    total += box.nbytes;
    if (BufferAllocator::IsSmall(box.nbytes)) small_bytes += Aligned(box.nbytes);
  }
  BufferAllocator allocator(small_bytes);
  uint64_t done = out_stats.mapped_bytes;  // of `total`: mapped, and in the batches read so far
  if (progress && done > 0 && done < total) progress(done, total);

  // Batches in request order; a batch ends after an array once its reads reach batch_bytes or
  // its requests batch_requests.
  size_t begin = 0;
  while (begin < requests.size()) {
    size_t end = begin;
    uint64_t batch_bytes = 0;
    std::vector<ReadRequest> reads;
    std::vector<size_t> read_box;
    while (end < requests.size() &&
           (end == begin || requests[end].path == requests[end - 1].path ||
            (batch_bytes < options.batch_bytes && end - begin < options.batch_requests))) {
      DistinctBox& box = boxes[box_of[end]];
      if (box.buffer == nullptr) {
        const HostBoxRequest& r = requests[end];
        TS_ASSIGN_OR_RETURN(box.buffer, allocator.Allocate(box.nbytes, r));
        reads.push_back({r.path, r.box, r.dtype, box.buffer->data()});
        read_box.push_back(box_of[end]);
        batch_bytes += box.nbytes;
      }
      ++end;
    }
    if (!reads.empty()) {
      ReadStats read_stats;
      std::function<void(uint64_t, uint64_t)> on_progress;
      if (progress) {
        // The reader counts stored bytes of this call; shown as bytes of its boxes.
        on_progress = [&progress, done, batch_bytes, total](uint64_t d, uint64_t t) {
          progress(std::min(total, done + (t == 0 ? batch_bytes : batch_bytes * d / t)), total);
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
      done = std::min(total, done + batch_bytes);
    }
    HostBatch batch;
    for (size_t i = begin; i < end; ++i) {
      batch.requests.push_back(i);
      batch.buffers.push_back(boxes[box_of[i]].buffer);
    }
    // Only the batch holds its buffers now: the caller frees them by dropping it.
    for (size_t i = begin; i < end; ++i) boxes[box_of[i]].buffer.reset();
    ++out_stats.batches;
    TS_RETURN_IF_ERROR(on_batch(batch));
    begin = end;
  }
  // The final call, where no read made it (nothing to read, or everything mapped).
  if (progress && out_stats.read_calls == 0) progress(total, total);
  return OkStatus();
}

}  // namespace tensorstash
