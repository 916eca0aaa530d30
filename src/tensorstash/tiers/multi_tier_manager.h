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
//     RestoreToHost(*restore->source, requests, ..., keep boxes);     // host_restore.h
//     restore->extras.per_process                                     // this process's value
//     auto write_back = WriteBackRequest(*restore->source, boxes)     // the host buffers read
//     mgr->FinishRestore(&*restore, &*write_back)                     // collective
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
#include <vector>

#include "tensorstash/engine/host_restore.h"
#include "tensorstash/engine/step_source.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/manager/checkpoint_manager.h"
#include "tensorstash/tiers/local_tier.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct MultiTierOptions {
  ManagerOptions persistent;
  // Its coordinator, when null, is persistent.coordinator.
  LocalTierOptions local;
  // How the local tier's run (when local.run is empty) names the persistent store, before its
  // RunId; empty: the store's Describe(). The Python front passes the root as its user gave it,
  // the name holdings written by earlier versions carry, so that an upgrade between two
  // restarts keeps the node's holdings (a different run's holdings are deleted at open).
  std::string persistent_name;
};

// One box a restore read into host memory (RestoreToHost's HostBatch), kept for the write-back.
struct RestoredBox {
  HostBoxRequest request;
  std::shared_ptr<HostBuffer> buffer;
};

// The write-back of a restore of `source` from the host buffers it filled (`boxes`, which the
// request keeps alive): each array's distinct boxes as its shards, the step's tree, each array
// with `codec`, `zstd_level` and the stored chunk grid. No copy is made: the engine's buffers are saved as they are.
// nullopt when the boxes are not the arrays as stored (a box of an array the step lacks, in
// another dtype, or reaching past the stored shape); whether every array was restored whole is
// the caller's to know (a target of a part of the tree, or truncated).
std::optional<SaveRequest> WriteBackRequest(const StepSource& source,
                                            std::vector<RestoredBox> boxes, Codec codec,
                                            int zstd_level);

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
  // anything was saved; `stats` (may be null) gets a synchronous persistent save's. The errors of
  // CheckpointManager::Save/SaveAsync; those of LocalTier::Save when only the local tier was due
  // (else they are warnings: the persistent save, which is collective, goes on).
  Result<bool> Save(int64_t step, SaveRequest request, bool async = false, bool force = false,
                    SaveStats* stats = nullptr);

  // Collective: the newest step the persistent tier or the local tiers together restore.
  Result<std::optional<int64_t>> LatestStep();
  // Collective: every step the tiers together restore, ascending (a restore's candidates).
  Result<std::vector<int64_t>> RestorableSteps();
  // Collective: opens `step` over its holders (LocalTier::OpenStep), the persistent store given
  // to Open among them. Call FinishRestore after reading, whether this succeeded or not.
  Result<TieredRestore> OpenRestore(int64_t step, ReaderOptions options = {});
  // Collective: every process says how its restore ended (`error`: "" when it read everything;
  // `restore` null after a failure here, which returns OK once the others heard it) and waits for
  // the others. `words` (may be null) gets every process's word, by index. Aborted naming them
  // when any process failed (nothing is dropped or written then). After a successful restore in every process drops abandoned holdings and,
  // when anything came from elsewhere than this node (or a local chunk was damaged), saves
  // `write_back` (this process's restored shards as stored, WriteBackRequest; null: none) as its
  // holding of the step again, so that the next lost node is covered too; never after a restore
  // without checksums (TieredRestore::verified). `wrote_back` (may be null): whether it did.
  Status FinishRestore(const TieredRestore* restore, SaveRequest* write_back,
                       std::string error = "", std::vector<std::string>* words = nullptr,
                       bool* wrote_back = nullptr);

  CheckpointManager& persistent();
  LocalTier& local();

  // Closes both tiers; the first error.
  Status Close();

 private:
  MultiTierManager(std::unique_ptr<CheckpointManager> persistent, std::unique_ptr<LocalTier> local,
                   KvStore* persistent_kv);
  // Collective: waits for the local tier's work in flight, then gathers the job's holdings and
  // the persistent steps into job_.
  Status GatherJob();
  std::unique_ptr<CheckpointManager> persistent_;
  std::unique_ptr<LocalTier> local_;
  KvStore* persistent_kv_;
  std::optional<JobHoldings> job_;  // what the last LatestStep/OpenRestore gathered
};

}  // namespace tensorstash

#endif  // TENSORSTASH_TIERS_MULTI_TIER_MANAGER_H_
