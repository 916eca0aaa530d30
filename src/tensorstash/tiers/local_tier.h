// LocalTier: one process's part of the node-local tier (docs/multitier.md): frequent saves of
// its shards into a folder of the node's RAM (a tmpfs), a server that lets the other processes
// read them, and the collective steps that decide which step the job can restore and from whom.
//
//   LocalTier::Open({.dir = "/dev/shm/run1", .coordinator = &c, .server_address = "10.0.0.7"})
//   if (tier->ShouldSave(step)) tier->Save(step, request)        // collective
//   ...after a restart:
//   tier->Gather(persistent_steps) -> job                        // collective
//   job.LatestStep() -> 1200
//   tier->OpenStep(1200, job, persistent_kv) -> restore          // restore.source: read it
//   tier->FinishRestore(&restore)                                // collective
//
// Each save writes a *holding* (holdings.h) with a CheckpointManager of its own over
// "<dir>/p<index>-of-<count>" (WriterOptions::holding; overwrite, so that a write-back may
// replace a step; not synced: the tier is RAM). A save that would not fit in the folder's free
// space is skipped with a warning. Holdings of processes that are gone (other folders on this
// node) are kept for restores until this process has committed a newer step of its own.
//
// With several processes (a coordinator), Open draws the job's secret on process 0, starts a
// PeerServer on `server_address` that serves committed holdings only, to requests carrying the
// secret, and exchanges the servers' URLs. Every collective call (Open, Save, Gather,
// FinishRestore) waits at most `timeout` for each other process; DeadlineExceeded then names every
// process that did not arrive. All processes make the same collective calls in the same order.
//
// Thread-safety: one thread at a time (the training loop's).
#ifndef TENSORSTASH_TIERS_LOCAL_TIER_H_
#define TENSORSTASH_TIERS_LOCAL_TIER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/manager/checkpoint_manager.h"
#include "tensorstash/tiers/holdings.h"
#include "tensorstash/tiers/tiered_source.h"
#include "tensorstash/coordination/collectives.h"
#include "tensorstash/coordination/coordinator.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct LocalTierOptions {
  // The node's folder (the same path on every node); created with mode 0700 if missing, refused
  // (PermissionDenied) when another user owns it.
  std::string dir;
  // The run this job belongs to: its persistent root and the id made when the run started
  // (CheckpointManager::RunId), as process 0 gives it (the others' is ignored). Every holding
  // carries it. Holdings of another run (a reused local_dir) are never restored, never listed and
  // never counted by retention; when the tier opens they are removed, with a warning, from every
  // folder no live process holds.
  std::string run;
  Coordinator* coordinator = nullptr;  // null: a single process
  int64_t save_interval_steps = 1;     // ShouldSave: steps divisible by this
  int max_to_keep = 1;                 // committed local steps kept per process
  // Where the peer server listens (an IPv4 address of this host the other nodes can reach) and
  // on which port (0: any free one). Only with several processes.
  std::string server_address = "127.0.0.1";
  int server_port = 0;
  // Each collective step's wait on the other processes.
  std::chrono::milliseconds timeout = kDefaultCoordinationTimeout;
  // A peer that sends nothing for this long is given up (its chunks come from the next holder).
  std::chrono::milliseconds peer_stall_timeout = std::chrono::seconds(30);
  // The holding writer's options (chunking, threads); holding, overwrite and sync are set here.
  WriterOptions writer;
  uint64_t max_staging_bytes = 0;  // as ManagerOptions::max_staging_bytes
  // Room kept free beyond a save's bytes, for the step it replaces until retention drops it.
  uint64_t free_space_margin = uint64_t{64} << 20;
  // Warnings (a skipped save); default: written to stderr.
  std::function<void(const std::string&)> warn;
};

// What every process holds and which steps the job can restore (Gather). The same in every
// process.
struct JobHoldings {
  std::vector<Holding> holdings;
  std::vector<int64_t> persistent_steps;  // process 0's view of the persistent tier
  std::map<int64_t, SaveKey> saves;       // RestorableSaves(holdings)

  // Steps restorable from any tiers, ascending; the newest of them (nullopt: none).
  std::vector<int64_t> RestorableSteps() const;
  std::optional<int64_t> LatestStep() const;
};

// What a restore reads besides the arrays.
struct RestoredExtras {
  std::optional<std::string> per_process;  // this process's value saved with the step
  std::optional<std::string> metadata;     // metadata.json
  ProcessValues ring_values;               // those of ValueRing(this process): a write-back's
  std::string save_id;                     // of the restored save ("persistent-<step>": none)
};

// One step opened for a restore (OpenStep).
struct TieredRestore {
  int64_t step = 0;
  std::optional<SaveKey> save;  // the local save restored; nullopt: the persistent step
  std::shared_ptr<TieredStepSource> source;  // shared with a reader of the bindings
  RestoredExtras extras;
  // Whether every chunk read was checked against its CRC (ReaderOptions::verify_checksums). A
  // write-back only ever stores checked bytes: written back with fresh CRCs, unchecked ones
  // would pass for good in every later restore.
  bool verified = true;
};

class LocalTier {
 public:
  // Creates the folder, opens this process's holding manager (removing leftovers of crashed
  // saves) and, with several processes, starts the peer server (collective). Errors: as
  // CheckpointManager::Open, PermissionDenied (above), PeerServer::Start's, DeadlineExceeded.
  static Result<std::unique_ptr<LocalTier>> Open(LocalTierOptions options);
  ~LocalTier();  // Close, its error dropped
  LocalTier(const LocalTier&) = delete;
  LocalTier& operator=(const LocalTier&) = delete;

  int process_index() const;
  int process_count() const;
  const std::string& dir() const;
  // The peer server's URL ("" with a single process).
  std::string url() const;

  bool ShouldSave(int64_t step) const;
  // Reports `text` through LocalTierOptions::warn, or on stderr without one.
  void Warn(const std::string& text) const;

  // Collective: process 0 draws the save's id, the processes exchange their per-process values
  // (`request.process_state`) along ValueRing, then SaveHolding. Returns false when the save was
  // skipped for lack of room (and warned about), true once saved (async: once copied to host).
  Result<bool> Save(int64_t step, SaveRequest request, bool async);
  // Saves this process's holding of `step` with the given save id and values (a write-back after
  // a restore uses the restored ones). Not collective. As Save otherwise; request.process_state
  // is replaced by the packed values.
  Result<bool> SaveHolding(int64_t step, SaveRequest request, std::string_view save_id,
                           const ProcessValues& values, bool async);
  // Waits for the save in flight (and its retention); returns its error once, here, at the next
  // SaveHolding or at Close, whichever comes first.
  Status WaitUntilFinished();
  // Waits as WaitUntilFinished, but keeps an error for it (or SaveHolding, or Close) to return:
  // for callers that need the tier's folders settled, not its outcome (a listing).
  void Settle();

  // Steps this node holds a committed holding of (any process's folder), ascending.
  std::vector<int64_t> LocalSteps() const;

  // Collective: every process's holdings and process 0's `persistent_steps`.
  Result<JobHoldings> Gather(const std::vector<int64_t>& persistent_steps);

  // Opens `step` over its holders, cheapest first: this node's holdings of the chosen save, the
  // peers' (starting after this process, so that requests spread), then `persistent` (if it has
  // the step; may be null), and reads the extras (this process's value from a holding that
  // carries it, else from the persistent step). NotFound when no tier holds all of the step;
  // DataLoss when this process's value, or the step's metadata, is held but no holder gives it
  // intact (the step does not restore whole: an older one may). Every process must then call
  // FinishRestore, whether this succeeded or not.
  Result<TieredRestore> OpenStep(int64_t step, const JobHoldings& job, KvStore* persistent,
                                 ReaderOptions options = {});
  // Collective: every process says how its restore ended (`error`: "" when it read everything),
  // and waits until every process has (so that no holding changes while another reads it).
  // Returns every process's word, by process index: all empty when the job restored the step.
  // Only then, and with `restore` not null, are this node's holdings of later steps and of other
  // saves of the step removed: they belong to a run now abandoned. After a failure anywhere
  // nothing is removed, and every process knows who failed and why (so that all of them can
  // give up, or all try another step, together).
  Result<std::vector<std::string>> FinishRestore(const TieredRestore* restore,
                                                 std::string error = "");

  // Waits for a save in flight, then stops the server and releases the folder. Returns the
  // save's error.
  Status Close();

 private:
  struct Impl;
  explicit LocalTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_TIERS_LOCAL_TIER_H_
