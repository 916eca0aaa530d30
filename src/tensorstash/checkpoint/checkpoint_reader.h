// CheckpointReader: opens one committed step and reads any box of any array from it.
//
// Open reads COMMIT, tree.json and the chunk index (never array data) and checks them against
// each other. Reads fill a caller buffer laid out over the requested box (C order), converting
// the dtype if asked and filling zeros where the box reaches past the stored shape. Only stored
// chunks that meet the box are read; neighbouring chunks of a file are fetched in one request;
// a chunk that lands on a contiguous run of the destination is read straight into it. Every
// chunk's CRC-32C is checked unless turned off; a mismatch is DataLoss naming the file, the
// array and the chunk.
//
// Thread-safety: after Open, all const methods and Read/ReadMany may be called from several
// threads at once.
#ifndef TENSORSTASH_CHECKPOINT_CHECKPOINT_READER_H_
#define TENSORSTASH_CHECKPOINT_CHECKPOINT_READER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/engine/executor.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/format/index_format.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct ReaderOptions {
  bool verify_checksums = true;
  // Cap on bytes held in staging buffers (chunks that cannot be read in place).
  uint64_t max_inflight_bytes = kDefaultMaxInflightBytes;
  // Reader threads; 0 picks a default from the number of cores.
  int io_threads = 0;
  // Neighbouring chunks separated by at most this many unused bytes are read in one request.
  uint64_t coalesce_gap_bytes = 64 << 10;
  // Upper bound of one coalesced request.
  uint64_t max_request_bytes = uint64_t{32} << 20;
  // Open even when data files are missing or truncated; reads of their chunks then fail. For
  // `verify`, which reports every damaged chunk instead of stopping at the first file.
  bool open_damaged = false;
  // Open a holding (WriterOptions::holding): an index with fewer chunks than the arrays have.
  // Reads of the chunks it lacks are DataLoss ("not in the index"). TieredStepSource sets it.
  bool open_holding = false;
  // Chunks that must be cut into pieces (another layout, a cast) are read from a mapping of the
  // data file rather than from a staging copy when every chunk of the read is uncompressed and
  // page-aligned: each byte is then copied once, from the page cache into its destination.
  // False: always staged.
  bool map_spans = true;
};

struct ReadRequest {
  std::string path;  // array path
  Box box;           // region of the array to read (may reach past its shape: zeros there)
  DType dtype;       // element type of `dest` (a cast when it differs from the stored dtype)
  void* dest;        // box.num_elements() elements of `dtype`, C order
};

// Checks one read request against the array it names, for every reader (native, Orbax): the
// box's rank and size, and with `cast_to` the cast from the stored dtype and a destination for a
// non-empty box. OK, or InvalidArgument naming the array. (MapMany passes no cast: it maps
// stored bytes and has no destination.)
Status ValidateReadRequest(const ReadRequest& request, const ArrayMetadata& array,
                           std::optional<DType> cast_to);

struct ReadStats {
  uint64_t bytes_read = 0;     // stored bytes fetched from storage
  uint64_t requests = 0;       // storage read calls
  uint64_t direct_chunks = 0;  // chunks read straight into the destination
  uint64_t staged_chunks = 0;  // chunks read through a staging buffer or a mapped span
  uint64_t mapped_spans = 0;   // of the staged spans, those mapped (ReaderOptions::map_spans)
  uint64_t peak_staging_bytes = 0;
};

struct BadChunk {
  std::string array_path;
  std::string chunk;  // grid coordinates, "[0, 3]"
  std::string file;   // data file key
  std::string error;
};

// A box of an array mapped from the data files (CheckpointReader::MapMany): its elements in C
// order, in the stored dtype, at data() (64-byte aligned). Either it owns its mapping, or it is a
// view into a mapping shared with neighbouring boxes, which stays mapped while any of them
// lives. Unmapped when the last owner is destroyed. Move-only.
class MappedBox {
 public:
  MappedBox() = default;
  // Owns the `mapped_size` bytes mapped at `data`.
  MappedBox(char* data, size_t size, size_t mapped_size)
      : data_(data), size_(size), mapped_size_(mapped_size) {}
  // `size` bytes at `data`, inside `region`, which it keeps mapped.
  MappedBox(std::shared_ptr<const MappedBox> region, char* data, size_t size)
      : data_(data), size_(size), region_(std::move(region)) {}
  MappedBox(MappedBox&& other) noexcept;
  MappedBox& operator=(MappedBox&& other) noexcept;
  MappedBox(const MappedBox&) = delete;
  MappedBox& operator=(const MappedBox&) = delete;
  ~MappedBox();

  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_size_ = 0;                   // of an owned mapping; 0 for a view
  std::shared_ptr<const MappedBox> region_;  // of a view
};

// How CheckpointReader::MapMany may map.
struct MapOptions {
  // Kernel mapping entries the call may add (vm.max_map_count bounds them per process): a
  // shared mapping costs one, a box mapped chunk by chunk one per chunk and one more. Boxes past
  // the budget are Unimplemented (read them). With mappings_made set, the budget of all the
  // calls that share it: a call adds at most max_mappings - *mappings_made.
  uint64_t max_mappings = UINT64_MAX;
  // Boxes stored as runs of one data file share a mapping of up to this many bytes with the
  // boxes stored near them (a larger run gets one of its own).
  uint64_t shared_mapping_bytes = uint64_t{64} << 20;
  // Where set, the entries made by earlier calls; MapMany adds those it made, so that a caller
  // mapping in several calls (or through several readers) keeps one budget.
  uint64_t* mappings_made = nullptr;
};

class CheckpointReader {
 public:
  // Opens the step folder `dir` of `kv`. NotFound if it does not exist; FailedPrecondition if it
  // has no COMMIT (an incomplete or crashed save); DataLoss if COMMIT, tree.json or the index is
  // corrupt or inconsistent (missing or truncated data files included); Unimplemented for a
  // newer format version.
  static Result<std::unique_ptr<CheckpointReader>> Open(KvStore* kv, std::string dir,
                                                        ReaderOptions options = {});
  ~CheckpointReader();

  const std::string& dir() const;
  const CommitRecord& commit_record() const;
  const TreeNode& tree() const;
  const std::vector<ArrayMetadata>& arrays() const;
  // NotFound naming the path when there is no such array.
  Result<const ArrayMetadata*> FindArray(std::string_view path) const;
  // Bytes stored for array `array_id` (sum of its chunks' stored lengths).
  uint64_t StoredBytes(size_t array_id) const;
  const ChunkIndex& index() const;

  // Reads one request. InvalidArgument for an unknown path (NotFound), a rank mismatch, a
  // negative origin or an unsupported cast; DataLoss for corrupt chunks. On error the
  // destination holds unspecified data.
  Status Read(const ReadRequest& request, ReadStats* stats = nullptr);
  // Reads several requests in parallel under one byte cap; first error wins.
  // `progress(done_bytes, total_bytes)` (stored bytes) is called from the reader threads, one
  // call at a time, as requests complete.
  Status ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats = nullptr,
                  const std::function<void(uint64_t, uint64_t)>& progress = nullptr);

  // Maps each request's box (its dtype must be the stored one; `dest` is ignored) from the data
  // files instead of reading it, in parallel: copy-on-write pages of the page cache, so neither
  // a copy nor the zeroing of fresh memory (on restores into host memory, the larger cost of
  // the two). A box can be mapped when it lies inside the shape, every stored chunk that meets
  // it lies inside it, is stored uncompressed and is a contiguous run of the box, and the
  // store's files can be mapped (FileKvStore); and either
  //   - the box is one run of bytes of one data file starting 64-byte aligned (its chunks one
  //     after another, in the box's order: a chunk read whole, or an array saved in row
  //     shards): then it is a view into one mapping shared with the boxes stored near it, any
  //     size; or
  //   - every chunk is at least 16 KiB and starts on a page boundary both in the box and in its
  //     file: then the box gets a mapping of its own, chunk by chunk.
  // Checksums are checked as for a read. Per request: Unimplemented when it cannot be mapped
  // (read it instead), or the error a read would give.
  std::vector<Result<MappedBox>> MapMany(const std::vector<ReadRequest>& requests,
                                         const MapOptions& options = {});

  // Reads a whole file committed with the step (CheckpointWriter::AddFile), e.g.
  // "metadata.json", and checks its size and CRC-32C against COMMIT. NotFound when COMMIT lists
  // no such file; DataLoss when it is missing, truncated or altered.
  Result<std::string> ReadFile(std::string_view name) const;

  // Reads every stored chunk and checks its CRC-32C (and that it decodes), and every committed
  // file (ReadFile). Returns the bad chunks and files (empty when all are good; a bad file has
  // an empty array_path); a non-OK status only when verification itself could not
  // run. `progress(done_bytes, total_bytes)` is called from time to time.
  Result<std::vector<BadChunk>> Verify(
      const std::function<void(uint64_t, uint64_t)>& progress = nullptr);

 private:
  struct Impl;
  explicit CheckpointReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_CHECKPOINT_CHECKPOINT_READER_H_
