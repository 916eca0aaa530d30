// DataFileSet: the data files one process writes for one checkpoint item, and where in them
// each chunk goes.
//
// Files are named "data/<process>-<seq>.dat" and rolled once they reach a target size. Chunks of
// 64 KiB or more start at 4 KiB boundaries (so later readers can use O_DIRECT). Allocate() hands
// out disjoint byte ranges; the caller writes there with Write() from any thread.
//
// Allocation goes through `lanes`, each with its own current file: buffered writes into one
// file are serialized by the filesystem (one inode lock), so a big save writes a few files at
// once to use more than one core.
//
// A save that syncs passes `writeback_bytes`: each file's writeback is then started whenever that
// many more bytes were written into it, so that the storage writes while the save still copies,
// and the final fsyncs (run side by side) find little left to do.
//
// A save that syncs also passes `direct_writes`: its files are then opened with
// WritableFile::PreferDirectWrites(), so that large chunks bypass the page cache.
//
// A save to an object store that sends small files in one request (GCS: no parts, no compose;
// KvStoreCapabilities::one_request_below) passes `one_request_below`: a lane's file is then rolled
// before a chunk would make it reach that size (unless the chunk is the file's first), and a
// rolled file is closed as soon as its last allocated byte is written, so that it goes up at once
// in one request and its bytes are not held until Finish.
//
// Thread-safety: all methods are thread-safe.
#ifndef TENSORSTASH_ENGINE_DATA_FILE_SET_H_
#define TENSORSTASH_ENGINE_DATA_FILE_SET_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tensorstash/format/index_format.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"
#include "tensorstash/util/thread_pool.h"

namespace tensorstash {

// Where chunks start in a data file. A chunk of at least kAlignChunksFrom bytes starts on a page
// (kChunkAlignment): such a chunk can be mapped on its own. A smaller one that starts an array
// starts on kSmallChunkAlignment, so that a reader can hand out views of a mapping shared by many
// small chunks that XLA's CPU client adopts without a copy (64-byte aligned). A chunk that
// continues the array of the chunk allocated just before it, right after it, is placed there
// with no padding when that is already 64-byte aligned: the array's chunks then form one run of
// bytes, which a reader maps as one (CheckpointReader::MapMany).
inline constexpr uint64_t kChunkAlignment = 4096;
inline constexpr uint64_t kAlignChunksFrom = 64 * 1024;
inline constexpr uint64_t kSmallChunkAlignment = 64;

class DataFileSet {
 public:
  // `item_dir` is the key of the item folder ("<step>.tmp-x/state").
  // `writeback_bytes` 0: writeback is left to the kernel.
  // `one_request_below` 0: files are rolled at `target_file_bytes` only and closed by Finish.
  DataFileSet(KvStore* kv, std::string item_dir, int process_index, uint64_t target_file_bytes,
              int lanes = 1, uint64_t writeback_bytes = 0, bool direct_writes = false,
              uint64_t one_request_below = 0);
  ~DataFileSet();

  struct Location {
    uint32_t file_id;
    uint64_t offset;
    // Alignment bytes before `offset` that Write fills with zeros, on object stores only: there a
    // file goes up in parts, each once all its bytes are written, so no byte may be left out.
    uint32_t padding = 0;
  };
  // Reserves `length` bytes in lane `lane % lanes`; opens the lane's next file when its current
  // one is full. `continues`: the chunk is the next one of the array whose chunk this lane
  // placed last (see kChunkAlignment). ResourceExhausted past the format's limit on data files.
  Result<Location> Allocate(uint64_t length, int lane = 0, bool continues = false);
  // Writes at `where` (its padding too). With `one_request_below`, the write that completes a
  // rolled file closes it and returns the close's error, if any (Finish returns it again).
  // `crc32c`: the bytes' CRC-32C when the caller has it; with it, `borrowed` promises that
  // `data` stays valid and unchanged until Finish returns or the set is destroyed
  // (WritableFile::WriteChunkAt: an object store then neither re-reads nor copies them).
  Status Write(const Location& where, const void* data, size_t size,
               std::optional<uint32_t> crc32c = std::nullopt, bool borrowed = false);
  // Syncs (when `sync`; the files side by side on `pool` when given) and closes every file;
  // fills `files` (names relative to the item folder, sizes as allocated). Further calls fail.
  // Must not run on a thread of `pool`.
  Status Finish(bool sync, std::vector<DataFileInfo>* files, ThreadPool* pool = nullptr);

 private:
  struct File;
  // Closes `file` (already taken out of files_ under the mutex) and records the outcome.
  Status CloseEarly(File* file, std::unique_ptr<WritableFile> handle);
  KvStore* kv_;
  std::string item_dir_;
  int process_index_;
  uint64_t target_file_bytes_;
  uint64_t writeback_bytes_;
  bool direct_writes_;
  uint64_t one_request_below_;
  std::mutex mutex_;
  bool finished_ = false;
  std::vector<std::unique_ptr<File>> files_;
  std::vector<int> lane_file_;  // per lane: index into files_ of its current file, or -1
};

}  // namespace tensorstash

#endif  // TENSORSTASH_ENGINE_DATA_FILE_SET_H_
