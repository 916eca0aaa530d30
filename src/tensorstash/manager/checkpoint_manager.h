// CheckpointManager: the steps of one training run under one store root, as a training loop
// uses them: save every N steps (synchronously or in the background), keep the last few, find
// the newest complete step after a restart.
//
// Steps live in folders named by the step number zero-padded to 10 digits ("0000001000"), so
// that name order is step order (docs/format.md, "Layout"). A step is complete once its COMMIT
// exists; nothing else is ever listed.
//
//   CheckpointManager::Open(&kv, {.max_to_keep = 3, .save_interval_steps = 100}) -> mgr
//   if (mgr->ShouldSave(step)) mgr->SaveAsync(step, {.arrays = ..., .metadata_json = ...})
//                                                     // returns once copied to host
//   ...
//   mgr->LatestStep() -> 1200; CheckpointReader::Open(&kv, mgr->StepDir(1200).value())
//   mgr->Close()
//
// One manager per root: Open takes the lock "LOCK" at the root (KvStore::TryLock), so a second
// manager, in this process or another on the same machine, is refused with FailedPrecondition
// until the first is closed or its process dies. Holding the lock is what makes it safe for
// Open to remove the leftovers of crashed saves and for the manager to cache the step list.
// In a job of several processes (ManagerOptions::coordinator) process 0 holds the lock.
//
// Errors of a background save are kept until the next SaveAsync, Save, WaitUntilFinished or
// Close, which returns them; they are never dropped (except by the destructor, which cannot
// return them: call Close).
//
// Thread-safety: the methods are meant for one thread (the training loop), but any method may be
// called from several threads: Save, SaveAsync, WaitUntilFinished and Close called at once run
// one after the other (a second SaveAsync waits for the first to commit). AllSteps, LatestStep,
// ShouldSave and StepDir may also be called from the commit callback; the others may not.
#ifndef TENSORSTASH_MANAGER_CHECKPOINT_MANAGER_H_
#define TENSORSTASH_MANAGER_CHECKPOINT_MANAGER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/manager/retention.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// What a save reports (to on_commit, and through Save's `stats`).
struct SaveStats {
  int64_t step = 0;
  bool async = false;
  uint64_t raw_bytes = 0;       // array bytes this process wrote (before the codec)
  uint64_t stored_bytes = 0;    // bytes this process wrote to data files
  double blocking_seconds = 0;  // how long the caller was blocked (Save: until the commit)
  double total_seconds = 0;     // from the call until the step was committed
  // Incremental saves: chunks recorded as references to earlier steps, and of those the ones
  // taken on the caller's promise without hashing (SaveRequest::same_as_step).
  uint64_t referenced_chunks = 0;
  uint64_t unhashed_chunks = 0;
  // Incremental saves: why the base (named) could not be opened, when this process saved the
  // step in full instead (WriterOptions::full_save_if_base_unreadable); empty otherwise.
  std::string base_unreadable;
};

struct ManagerOptions {
  // Retention (retention.h, StepsToDelete): keep at most this many complete steps (besides those
  // kept by keep_period): the newest ones, or with best_metric the best ones (and the newest);
  // 0 keeps all.
  int max_to_keep = 0;
  // Steps divisible by this are never deleted; 0: none are kept that way.
  int64_t keep_period = 0;
  // ShouldSave(step) is true for steps divisible by this; 0 or 1: every step.
  int64_t save_interval_steps = 0;
  // With a metric name, retention keeps the max_to_keep steps whose SaveRequest::metrics value
  // of it is best (lowest for kMin, highest for kMax; a step without it ranks last), plus the
  // newest step, so that a restart still resumes from the latest state.
  std::string best_metric;
  BestMode best_mode = BestMode::kMin;
  // Cap on the host memory that SaveAsync holds for its copies of the shards; 0: a quarter of
  // physical memory. Above the cap the copy proceeds in waves (SaveAsync returns once the last
  // wave is copied, so it blocks longer, but memory stays bounded). The copies' buffers are kept
  // for the next SaveAsync (up to the cap, until Close): copying into memory already mapped
  // is what makes a save block no longer than a memcpy of the shards.
  uint64_t max_staging_bytes = 0;
  // Installs a SIGTERM handler while the manager is open, so that a preempted job is not
  // killed at once but sees ReachedPreemption() turn true, saves, and exits. The previous
  // handler is restored by Close.
  bool handle_sigterm = false;
  // The job's processes (null: a single process). Every process opens a manager on the same
  // root with the same options and calls Save/SaveAsync/ReachedPreemption in the same order;
  // process 0 takes the lock, cleans up and deletes; the others follow its step list.
  Coordinator* coordinator = nullptr;
  // Incremental steps (docs/format.md 6.1): every step records its chunks' digests, and each
  // save is made against the newest listed step below it (writer.base): a chunk that did not
  // change is recorded as a reference to where its bytes already lie instead of being written
  // again. A base that cannot be opened (removed or damaged by hand) makes the save a full one
  // (SaveStats::base_unreadable says why). Retention then keeps on storage, unlisted
  // ("retired", RetiredSteps), each dropped
  // step that a kept step still refers to, and deletes it once none does (in this session or
  // a later one). Not with writer.holding.
  bool incremental = false;
  // Options of the writer of every save (`overwrite` among them). An overwrite of a step whose
  // data other steps refer to is refused (FailedPrecondition naming them).
  WriterOptions writer;
  // Called after each successful commit, on the thread that ran it: the caller's for Save, the
  // background thread for SaveAsync. Must not call Save/SaveAsync/WaitUntilFinished/Close.
  std::function<void(const SaveStats& stats)> on_commit;
};

// One array of a save and this process's shards of it (as in CheckpointWriter::AddArray).
struct ArrayToSave {
  ArraySpec spec;
  std::vector<ShardData> shards;
};

// Everything a step holds; all of it is committed together (a step is complete only when all
// of it is).
struct SaveRequest {
  std::vector<ArrayToSave> arrays;
  // The pytree around the arrays; default: nested dicts built from the array paths.
  std::optional<TreeNode> tree;
  // JSON text stored as "metadata.json" (written by process 0); empty: none.
  std::string metadata_json;
  // This process's own state (e.g. its data-iterator position), stored as "process/<index>".
  std::optional<std::string> process_state;
  // Stored as "metrics.json" (process 0) and used by best_metric retention.
  std::map<std::string, double> metrics;
  // Destroyed once the save no longer reads any shard buffer (at its end, committed or not):
  // e.g. the owner of the buffers of shards marked `stable`, which an async save reads while
  // the caller goes on.
  std::shared_ptr<void> keep_alive;
  // Incremental managers: the step whose save (by this manager, in this session) read the
  // shards marked ShardData::same_as_base, unchanged since. The promise is kept only when that
  // step is this save's base and its record is the one that save committed; otherwise every
  // chunk is hashed.
  std::optional<int64_t> same_as_step;
};

// The names of the files a manager's steps hold besides the arrays (kMetadataFileName,
// kMetricsFileName, ProcessStateFileName) are in layout.h.

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

  // Complete steps, ascending: folders whose COMMIT, tree.json and index check (the step opens).
  // A save in flight is not listed until it commits.
  std::vector<int64_t> AllSteps() const;
  // Steps that have a COMMIT but do not open (a damaged COMMIT, tree.json or index), found by
  // process 0 when the manager opened, each with the error that opening it gave. They are not
  // listed (LatestStep is the newest step that opens), never deleted by retention, and left on
  // storage for inspection. Empty on processes other than 0.
  std::map<int64_t, std::string> DamagedSteps() const;
  // Committed steps that retention dropped but that stay on storage, unlisted, because a
  // listed step refers to their data (incremental steps); each is deleted by the first
  // retention after no listed step does. Ascending; empty on processes other than 0.
  std::vector<int64_t> RetiredSteps() const;
  // The newest complete step, or nullopt when there is none.
  std::optional<int64_t> LatestStep() const;
  // Whether `step` is due for a save under save_interval_steps.
  bool ShouldSave(int64_t step) const;

  // The id of the run that writes into this root: the text of the root's RUN_ID, written with a
  // new random id by the first call ever on the root (the lock makes that one writer). The
  // node-local tier tags its holdings with it, so that a reused local_dir never restores
  // another run's state (local_tier.h). Process 0 only (FailedPrecondition elsewhere); the
  // store's errors.
  Result<std::string> RunId();

  // Saves `step` and returns when it is complete and durable; steps that retention drops are
  // unlisted at once and deleted in the background. Waits for a save in flight first and
  // returns its error, if any, without saving. The shard buffers are only read during the call.
  // AlreadyExists when the step is complete (and !overwrite); InvalidArgument for bad arrays,
  // metadata that is not JSON, or bad metrics; writer errors as CheckpointWriter::Commit. On
  // failure nothing new is visible.
  Status Save(int64_t step, SaveRequest request, SaveStats* stats = nullptr);

  // Copies the shards into host memory owned by the manager (in waves above
  // max_staging_bytes), then returns; the write, the commit, retention and the callback run on
  // a background thread, so the buffers may change as soon as this returns. Shards marked
  // ShardData::stable are not copied but written from where they are, in the background;
  // request.keep_alive should own them (it is dropped when the save ends). At most one save
  // is in flight: this first waits for the previous one and, if it failed, returns that error
  // without starting this save. Errors found before the copy (bad step, step already complete,
  // invalid arrays or metadata) are returned at once; later ones by the next call.
  Status SaveAsync(int64_t step, SaveRequest request);

  // Whether the job should save now and stop: true once a SIGTERM arrived (handle_sigterm).
  // With several processes this is collective (every process calls it for the same steps) and
  // true in all of them when any one was signalled, so that they all save the same step.
  bool ReachedPreemption(int64_t step);

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

#endif  // TENSORSTASH_MANAGER_CHECKPOINT_MANAGER_H_
