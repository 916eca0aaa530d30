// CheckpointManager: the steps of one training run under one store root, as a training loop
// uses them: save every N steps (synchronously or in the background), keep the last few, find
// the newest complete step after a restart.
//
// Steps live in folders named by the step number zero-padded to 10 digits ("0000001000"), so
// that name order is step order (docs/format.md, "Layout"). A step is complete once its COMMIT
// exists; nothing else is ever listed.
//
//   CheckpointManager::Open(&kv, {.max_to_keep = 3, .save_interval_steps = 100}) -> mgr
//   if (mgr->ShouldSave(step)) mgr->SaveAsync(step, arrays)  // returns once copied to host
//   ...
//   mgr->LatestStep() -> 1200; CheckpointReader::Open(&kv, mgr->StepDir(1200).value())
//   mgr->Close()
//
// One manager per root: Open takes the lock "LOCK" at the root (KvStore::TryLock), so a second
// manager, in this process or another on the same machine, is refused with FailedPrecondition
// until the first is closed or its process dies. Holding the lock is what makes it safe for
// Open to remove the leftovers of crashed saves and for the manager to cache the step list.
//
// Errors of a background save are kept until the next SaveAsync, Save, WaitUntilFinished or
// Close, which returns them; they are never dropped (except by the destructor, which cannot
// return them: call Close).
//
// Thread-safety: the methods are meant for one thread (the training loop); AllSteps, LatestStep,
// ShouldSave and StepDir may also be called from other threads and from the commit callback.
#ifndef TENSORSTASH_CHECKPOINT_CHECKPOINT_MANAGER_H_
#define TENSORSTASH_CHECKPOINT_CHECKPOINT_MANAGER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct ManagerOptions {
  // Keep at most this many of the newest complete steps (besides those kept by keep_period);
  // 0 keeps all.
  int max_to_keep = 0;
  // Steps divisible by this are never deleted; 0: none are kept that way.
  int64_t keep_period = 0;
  // ShouldSave(step) is true for steps divisible by this; 0 or 1: every step.
  int64_t save_interval_steps = 0;
  // Options of the writer of every save (`overwrite` among them).
  WriterOptions writer;
  // Called after each successful save (and its retention), on the thread that ran the save: the
  // caller's for Save, the background thread for SaveAsync. Must not call Save/SaveAsync/
  // WaitUntilFinished/Close.
  std::function<void(int64_t step, const WriteStats& stats)> on_commit;
};

// One array of a save and this process's shards of it (as in CheckpointWriter::AddArray).
struct ArrayToSave {
  ArraySpec spec;
  std::vector<ShardData> shards;
};

class CheckpointManager {
 public:
  // Opens the manager of the steps under the root of `kv` (which must outlive it). Takes the
  // lock, then removes the leftovers of crashed saves: every top-level folder whose name
  // contains ".tmp-" or ".old-", and step folders without COMMIT. An interrupted overwrite (a
  // step without COMMIT next to a complete "<step>.old-" folder) is rolled back instead, as the
  // writer would (docs/format.md section 13). FailedPrecondition when another manager holds the
  // lock; Unimplemented when the store has no locks; InvalidArgument for bad options.
  static Result<std::unique_ptr<CheckpointManager>> Open(KvStore* kv, ManagerOptions options = {});

  // Waits for a save in flight (its error is lost: call Close first to see it) and releases the
  // lock.
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  // The folder key of `step`: 10 digits, zero-padded. InvalidArgument for a negative step or one
  // of more than 10 digits.
  static Result<std::string> StepDir(int64_t step);

  // Complete steps, ascending. A save in flight is not listed until it commits.
  std::vector<int64_t> AllSteps() const;
  // The newest complete step, or nullopt when there is none.
  std::optional<int64_t> LatestStep() const;
  // Whether `step` is due for a save under save_interval_steps.
  bool ShouldSave(int64_t step) const;

  // Saves `step` and returns when it is complete and durable, after applying retention. Waits
  // for a save in flight first and returns its error, if any, without saving. The shard buffers
  // are only read during the call. AlreadyExists when the step is complete (and !overwrite);
  // writer errors as CheckpointWriter::Commit; on failure nothing new is visible.
  Status Save(int64_t step, const std::vector<ArrayToSave>& arrays, WriteStats* stats = nullptr);

  // Copies every shard into host memory owned by the manager, then returns; the write, the
  // commit, retention and the callback run on a background thread, so the buffers may change
  // as soon as this returns. At most one save is in flight: this first waits for the previous
  // one and, if it failed, returns that error without starting this save. Errors found before
  // the copy (bad step, step already complete, invalid arrays) are returned at once.
  Status SaveAsync(int64_t step, std::vector<ArrayToSave> arrays);

  // Waits for the save in flight; returns its error (once), else OK.
  Status WaitUntilFinished();

  // WaitUntilFinished, then releases the lock. Later calls other than the step queries are
  // FailedPrecondition.
  Status Close();

 private:
  struct Impl;
  explicit CheckpointManager(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_CHECKPOINT_CHECKPOINT_MANAGER_H_
