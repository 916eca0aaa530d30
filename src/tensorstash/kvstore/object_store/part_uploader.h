// The part uploader: a WritableFile for object stores that upload large objects in parts
// (S3's multipart upload, GCS's XML multipart or compose). The object is cut on a fixed grid of
// `part_size` bytes; a part goes up as soon as all its bytes are written (in any order, from any
// thread, so parts written by several threads go up in parallel), the rest at Sync or Close,
// which completes the upload: the object appears then, whole, never before. Bytes never written
// below the end read as zeros. A file no larger than one part, with no part sent yet, is one
// PutWhole instead of an upload.
//
// The driver says how, through a PartSink. Memory stays at the parts being filled.
//
// A sink that takes pieces (PartSink::TakesPieces: GCS) gets each part as the writes' pieces in
// order, with the part's CRC-32C combined from the CRCs the writers gave (WriteChunkAt), so the
// bytes are not read again to checksum them; bytes written with WriteChunkAt's `borrowed` are
// not copied either: the sink sends them from the writer's memory. Gaps go as zeros. Writes
// that overlap bytes already written into the same pending part fall back to a copy of that
// part.
//
// Errors: WriteAt is InvalidArgument past the last part (max_parts x part_size),
// FailedPrecondition after Sync/Close or into a part already sent (an object store cannot
// rewrite it), and the sink's error when a part fails, which also fails every later call. A
// failed upload is aborted (PartSink::Abort, best effort) so that its parts do not linger; Sync
// and Close return the first failure. A second Sync or Close waits for the first's outcome and
// returns it (Close after Close is FailedPrecondition).
//
// Thread-safety: WriteAt may be called from several threads at once (on disjoint ranges).
#ifndef TENSORSTASH_KVSTORE_OBJECT_STORE_PART_UPLOADER_H_
#define TENSORSTASH_KVSTORE_OBJECT_STORE_PART_UPLOADER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct UploadedPart {
  int number = 0;     // 1-based
  std::string token;  // what the store answered for it (S3: the part's ETag)
};

// The bytes of one part (or of the whole object) for a sink that takes pieces: `pieces` one
// after the other make its `size` bytes, whose CRC-32C is `crc32c`. Valid during the call only.
struct PartBytes {
  std::vector<std::string_view> pieces;
  uint64_t size = 0;
  uint32_t crc32c = 0;
};

// What a driver implements for one object being written. Calls may come from several threads
// (PutPart concurrently; BeginUpload once, before any PutPart; Complete or Abort last).
class PartSink {
 public:
  virtual ~PartSink() = default;
  // "'key' in s3://bucket/prefix", for errors.
  virtual std::string Where() const = 0;
  // Starts an upload; returns its id.
  virtual Result<std::string> BeginUpload() = 0;
  // Sends part `number` (1-based) of the upload; returns its token.
  virtual Result<std::string> PutPart(const std::string& upload_id, int number,
                                      std::string_view bytes) = 0;
  // Makes the object of `parts` (in order) appear; `size` is its length in bytes. A create-only
  // sink refuses (AlreadyExists) when the object exists.
  virtual Status Complete(const std::string& upload_id, const std::vector<UploadedPart>& parts,
                          uint64_t size) = 0;
  // Drops the upload and its parts. Best effort: its error is not reported to the writer.
  virtual Status Abort(const std::string& upload_id) = 0;
  // Writes the whole object in one request (no upload was begun). Create-only as Complete.
  virtual Status PutWhole(std::string_view bytes) = 0;
  // Whether the uploader calls PutPartPieces and PutWholePieces instead of PutPart and
  // PutWhole (see above). Those are then the ones that must be implemented; by default they
  // are Unimplemented.
  virtual bool TakesPieces() const { return false; }
  virtual Result<std::string> PutPartPieces(const std::string& upload_id, int number,
                                            const PartBytes& bytes);
  virtual Status PutWholePieces(const PartBytes& bytes);
};

// Part buffers kept for reuse by the uploaders of one store, so that a save of many files does
// not map, fault in and zero fresh memory for every part (a quarter of a gs:// save's client CPU
// went to page faults on part buffers). Buffers are kept only while an uploader of the pool is
// open, at most `max_kept` of them: the memory goes back once the last file of a save is closed.
// Thread-safe.
class PartBufferPool {
 public:
  PartBufferPool(size_t buffer_bytes, int max_kept);
  ~PartBufferPool();
  // A buffer of buffer_bytes, all zeros: a kept one, or a new one.
  std::unique_ptr<char[]> Take();
  // Keeps `buffer` (of buffer_bytes) for a later Take, or frees it.
  void Give(std::unique_ptr<char[]> buffer);
  // An uploader that takes from the pool opened / closed; the last close frees what is kept.
  void Opened();
  void Closed();
  size_t buffer_bytes() const { return buffer_bytes_; }
  int kept();  // buffers kept now (tests)

 private:
  const size_t buffer_bytes_;
  const int max_kept_;
  std::mutex mu_;
  int open_ = 0;                               // guarded by mu_
  std::vector<std::unique_ptr<char[]>> kept_;  // guarded by mu_
};

struct PartUploaderOptions {
  size_t part_size = size_t{16} << 20;  // at least 1
  int max_parts = 10000;
  // Where part buffers come from (null: fresh memory for each part). Its buffer_bytes must
  // equal part_size.
  std::shared_ptr<PartBufferPool> buffers;
};

std::unique_ptr<WritableFile> NewPartUploader(std::unique_ptr<PartSink> sink,
                                              PartUploaderOptions options);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_OBJECT_STORE_PART_UPLOADER_H_
