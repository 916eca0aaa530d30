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
};

struct PartUploaderOptions {
  size_t part_size = size_t{16} << 20;  // at least 1
  int max_parts = 10000;
};

std::unique_ptr<WritableFile> NewPartUploader(std::unique_ptr<PartSink> sink,
                                              PartUploaderOptions options);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_OBJECT_STORE_PART_UPLOADER_H_
