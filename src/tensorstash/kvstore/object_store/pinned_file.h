// A ReadableFile on an object store whose reads all come from the version of the object seen
// when it was opened (S3: its ETag, GCS: its generation). An object replaced since is the
// driver's FailedPrecondition for the read; a read past the size seen at open is DataLoss.
//
// Thread-safety: ReadAt may be called from several threads at once when `read` may.
#ifndef TENSORSTASH_KVSTORE_OBJECT_STORE_PINNED_FILE_H_
#define TENSORSTASH_KVSTORE_OBJECT_STORE_PINNED_FILE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tensorstash/kvstore/kvstore.h"

namespace tensorstash {

// Reads [offset, offset + size) (size > 0) of the object at `generation` into `dest`.
using PinnedRead = std::function<Status(uint64_t offset, size_t size, void* dest,
                                        const std::string& generation)>;

// `info` is what Stat gave at open; `where` ("'k' in s3://b") names it in errors.
std::unique_ptr<ReadableFile> NewPinnedFile(ObjectInfo info, std::string where, PinnedRead read);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_OBJECT_STORE_PINNED_FILE_H_
