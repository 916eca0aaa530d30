// Garbage collection of a checkpoint root (`tensorstash gc URL`): what killed and failed saves
// leave behind and nothing reads, removed without touching a committed step.
//
//   CollectGarbage(kv, {.dry_run = true}) -> what would go
//
// Removed: everything StepStore::CleanUpAndList removes (the temporary and replaced folders of
// rename-based saves, step folders without COMMIT that hold only what saves write); Orbax's
// temporary folders ("<name>.orbax-checkpoint-tmp-<id>", left by an interrupted Orbax save or
// `tensorstash convert`); in steps on object stores, the commit records below the highest (but
// the step's mark, COMMIT) and every attempt the highest record does not name; on S3, multipart
// uploads under the root; retired steps (a manager's incremental bases that retention dropped)
// that no other committed step refers to any more. Nothing a committed step refers to is ever
// removed. It takes the root's lock first, like a CheckpointManager, so that no
// managed save is in flight: FailedPrecondition ("... locked by another manager ...") while one
// runs.
//
// Saves that take no lock (tensorstash.save into the root) may run at the same time: whatever
// such a save may still be writing (a temporary folder, an attempt, a step folder without
// COMMIT, an upload) is left alone while anything in it was written less than `min_age` ago
// (the newest file's mtime, object's LastModified or upload's start). A save still running
// after `min_age` may lose files to gc; it then fails at its commit, which checks every file it
// wrote (engine/publish.h, CheckWrittenFiles), and no committed step is harmed.
//
// Thread-safety: one collection per root at a time (the lock enforces it across processes).
#ifndef TENSORSTASH_MANAGER_GARBAGE_H_
#define TENSORSTASH_MANAGER_GARBAGE_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// Six hours: far longer than any save takes, short enough that a crashed save's bytes do not
// linger for days.
inline constexpr std::chrono::seconds kDefaultGarbageMinAge = std::chrono::hours(6);

struct GarbageOptions {
  bool dry_run = false;  // report, remove nothing
  // What was written less than this long ago may belong to a save in flight: left alone.
  std::chrono::seconds min_age = kDefaultGarbageMinAge;
};

struct GarbageReport {
  std::vector<std::string> removed;          // folders and objects, as keys of the store
  std::vector<std::string> aborted_uploads;  // keys of the multipart uploads aborted
  uint64_t bytes = 0;                        // the size of what was removed
  std::vector<std::string> kept_young;       // leftovers written within min_age: left alone
};

// The store's errors, or FailedPrecondition while a manager holds the root.
Result<GarbageReport> CollectGarbage(KvStore* kv, const GarbageOptions& options = {});

}  // namespace tensorstash

#endif  // TENSORSTASH_MANAGER_GARBAGE_H_
