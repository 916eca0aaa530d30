// Garbage collection of a checkpoint root (`tensorstash gc URL`): what killed and failed saves
// leave behind and nothing reads, removed without touching a committed step.
//
//   CollectGarbage(kv, {.dry_run = true}) -> what would go
//
// Removed: everything StepStore::CleanUpAndList removes (the temporary and replaced folders of
// rename-based saves, step folders without COMMIT that hold only what saves write); in steps on
// object stores, the commit records below the highest (but the step's mark, COMMIT) and every
// attempt the highest record does not name; on S3, multipart uploads under the root started
// more than `upload_min_age` ago. It takes the root's lock first, like a CheckpointManager, so
// that no managed save is in flight: FailedPrecondition ("... locked by another manager ...")
// while one runs. Saves that bypass the manager (tensorstash.save into a managed root) must not
// run at the same time.
//
// Thread-safety: one collection per root at a time (the lock enforces it across processes).
#ifndef TENSORSTASH_CHECKPOINT_GARBAGE_H_
#define TENSORSTASH_CHECKPOINT_GARBAGE_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct GarbageOptions {
  bool dry_run = false;  // report, remove nothing
  std::chrono::seconds upload_min_age = std::chrono::hours(1);
};

struct GarbageReport {
  std::vector<std::string> removed;          // folders and objects, as keys of the store
  std::vector<std::string> aborted_uploads;  // keys of the multipart uploads aborted
  uint64_t bytes = 0;                        // the size of what was removed
};

// The store's errors, or FailedPrecondition while a manager holds the root.
Result<GarbageReport> CollectGarbage(KvStore* kv, const GarbageOptions& options = {});

}  // namespace tensorstash

#endif  // TENSORSTASH_CHECKPOINT_GARBAGE_H_
