// StepStore: the steps of one checkpoint root on one store - their names, listing, commit
// detection, the root's lock, crash cleanup and deletion. A CheckpointManager composes one (and
// a tiered manager two: a node-local one and a persistent one) with a retention policy
// (retention.h) and a background worker (background_worker.h).
//
// Layout (docs/format.md, section 2): steps are folders named by the step number zero-padded to
// 10 digits; "LOCK" at the root is held by the manager using it.
//
// Thread-safety: StepDir and ParseStepName anywhere; the rest from one thread at a time.
#ifndef TENSORSTASH_MANAGER_STEP_STORE_H_
#define TENSORSTASH_MANAGER_STEP_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

class CheckpointReader;

class StepStore {
 public:
  static constexpr int kStepDigits = 10;
  // The lock at the root, held by the manager using it.
  static constexpr char kLockKey[] = "LOCK";

  // `kv` must outlive the step store.
  explicit StepStore(KvStore* kv) : kv_(kv) {}

  // The folder of `step`: its number zero-padded to 10 digits. InvalidArgument for a negative
  // step or one of more than 10 digits.
  static Result<std::string> StepDir(int64_t step);
  // The step of a folder name of exactly 10 digits; nullopt for any other name.
  static std::optional<int64_t> ParseStepName(std::string_view name);

  // Takes the root's LOCK, held until ReleaseLock or destruction: FailedPrecondition ("... is
  // locked by another manager ...") when another manager holds it; the store's error otherwise.
  Status Lock();
  void ReleaseLock() { lock_.reset(); }

  struct StepListing {
    std::set<int64_t> complete;              // steps that open (COMMIT, tree.json, index check)
    std::map<int64_t, std::string> damaged;  // steps with a COMMIT that do not open, and why
    // Committed steps marked RETIRED (Retire): not listed, not opened; kept for the data that
    // other steps refer to.
    std::set<int64_t> retired;
  };
  // Cleans up after crashes and lists the steps. Removes only what tensorstash wrote and nothing
  // reads ("<step>.tmp-<16 hex>" and "<step>.old-<16 hex>" folders of 10-digit steps, and step
  // folders without COMMIT holding only files a save writes: step_folder.h), after rolling back
  // an overwrite that crashed between its two renames. Must run with the lock held (no save in
  // flight). Anything else in the root is left alone.
  //
  // Each complete step is opened once, to check it; `on_open` (optional) is called with the
  // reader of every complete step that opens, so that a caller who needs something from each
  // step (the manager's metrics) does not open it again. A step restored from an interrupted
  // overwrite is listed without that check and is opened only when `on_open` is given.
  using OpenedStep = std::function<void(int64_t step, const CheckpointReader& reader)>;
  // `may_clean` (optional) is asked before a folder is removed or rolled back: false leaves it
  // as it is (gc leaves alone what a save that takes no lock may still be writing; garbage.h).
  using MayClean = std::function<Result<bool>(const std::string& folder)>;
  Result<StepListing> CleanUpAndList(const OpenedStep& on_open = nullptr,
                                     const MayClean& may_clean = nullptr);

  // Marks committed `step` RETIRED (layout.h, kRetiredFileName), durably: CleanUpAndList no
  // longer lists it, and nothing but the marker changes (its data stays for the steps that
  // refer to it). The store's errors.
  Status Retire(int64_t step);
  // Whether `step`'s folder holds the RETIRED mark. The store's errors.
  Result<bool> IsRetired(int64_t step);

  // Deletes `step`: COMMIT first, so that a crash halfway leaves an incomplete folder (removed by
  // the next CleanUpAndList), never a step that claims to be complete with files missing.
  Status DeleteStep(int64_t step);

  KvStore* kv() const { return kv_; }

 private:
  KvStore* const kv_;
  std::unique_ptr<KvLock> lock_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_MANAGER_STEP_STORE_H_
