// MultiTierManager: a CheckpointManager over persistent storage composed with a LocalTier in the
// node's RAM (docs/multitier.md): each tier saves on its own interval, the latest step is the
// newest one any mix of tiers can restore, and a restore reads every chunk from the cheapest
// holder with an intact copy. The C++ counterpart of tensorstash.CheckpointManager(local_dir=...).
//
//   MultiTierManager::Open(&persistent_kv, {.persistent = {.save_interval_steps = 500,
//                                                          .coordinator = &c},
//                                           .local = {.dir = "/dev/shm/run1",
//                                                     .save_interval_steps = 10}}) -> mgr
//   if (auto step = mgr->LatestStep(); step.ok() && *step) {          // collective
//     auto restore = mgr->OpenRestore(**step);                        // collective
//     RestoreToHost(*restore->source, requests, ...);                 // host_restore.h
//     restore->extras.per_process                                     // this process's value
//     mgr->FinishRestore(&*restore, &restored_shards)                 // collective
//   }
//   for (...) mgr->Save(step, request);                              // collective when due
//
// Every process calls the collective methods (Save of a due step, LatestStep, OpenRestore,
// FinishRestore) in the same order; each wait is bounded by local.timeout.
//
// Thread-safety: one thread at a time (the training loop's).
#ifndef TENSORSTASH_TIERS_MULTI_TIER_MANAGER_H_
#define TENSORSTASH_TIERS_MULTI_TIER_MANAGER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "tensorstash/manager/checkpoint_manager.h"
#include "tensorstash/tiers/local_tier.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct MultiTierOptions {
  ManagerOptions persistent;
  // Its coordinator, when null, is persistent.coordinator.
  LocalTierOptions local;
};

class MultiTierManager {
 public:
  // Opens the persistent manager on `persistent` (which must outlive the manager), then the local
  // tier (collective), whose run (when options.local.run is empty) is the persistent store and
  // its RunId. The errors of CheckpointManager::Open, RunId and LocalTier::Open.
  static Result<std::unique_ptr<MultiTierManager>> Open(KvStore* persistent,
                                                        MultiTierOptions options);
  ~MultiTierManager();

  // Whether `step` is due on either tier.
  bool ShouldSave(int64_t step) const;
  // Saves `step` on each tier it is due on (`force`: on both): the local tier first (its copy to
  // host memory is the stall a local save costs), then the persistent one. Returns whether
  // anything was saved. The errors of CheckpointManager::Save/SaveAsync; those of
  // LocalTier::Save when only the local tier was due (else they are warnings: the persistent
  // save, which is collective, goes on).
  Result<bool> Save(int64_t step, SaveRequest request, bool async = false, bool force = false);

  // Collective: the newest step the persistent tier or the local tiers together restore.
  Result<std::optional<int64_t>> LatestStep();
  // Collective: opens `step` over its holders (LocalTier::OpenStep). Call FinishRestore after
  // reading, whether this succeeded or not.
  Result<TieredRestore> OpenRestore(int64_t step);
  // Collective: waits for every process to have read. Aborted naming them when other processes
  // failed (`restore` not null; nothing is dropped or written then). After a successful restore
  // in every process drops abandoned holdings and, when anything came from elsewhere than this node (or a
  // local chunk was damaged), saves `write_back` (this process's restored shards, as stored;
  // null: none) as its holding of the step again, so that the next lost node is covered too;
  // never after a restore without checksums (TieredRestore::verified).
  Status FinishRestore(const TieredRestore* restore, SaveRequest* write_back);

  CheckpointManager& persistent();
  LocalTier& local();

  // Closes both tiers; the first error.
  Status Close();

 private:
  MultiTierManager(std::unique_ptr<CheckpointManager> persistent, std::unique_ptr<LocalTier> local,
                   KvStore* persistent_kv);
  std::unique_ptr<CheckpointManager> persistent_;
  std::unique_ptr<LocalTier> local_;
  KvStore* persistent_kv_;
  std::optional<JobHoldings> job_;  // what the last LatestStep/OpenRestore gathered
};

}  // namespace tensorstash

#endif  // TENSORSTASH_TIERS_MULTI_TIER_MANAGER_H_
