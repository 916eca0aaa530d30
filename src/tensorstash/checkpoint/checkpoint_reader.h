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
#include "tensorstash/engine/step_source.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/format/index_format.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// The commit record of committed step `dir` alone (its index and data files are neither read nor
// opened): what a manager needs to know which steps a step depends on. NotFound when `dir` is
// not a committed step; DataLoss for a record that is corrupt or too large.
Result<CommitRecord> ReadStepCommitRecord(KvStore* kv, const std::string& dir);

// The committed steps next to `dir` (in the folder that holds it) whose commit record lists it
// in depends_on: incremental steps that refer to its data (docs/format.md 6.1), as keys of `kv`,
// sorted. Skipped: folders without COMMIT, temporaries, retired steps (a manager's, layout.h)
// and steps whose record is damaged (DataLoss). The store's other errors.
Result<std::vector<std::string>> FindDependentSteps(KvStore* kv, const std::string& dir);

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
  // The store key of data file `file_id` of the index (this step's, or another step's that it
  // references), as the reader opens it.
  std::string DataFileKey(uint32_t file_id) const;

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
