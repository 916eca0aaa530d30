// FaultInjectionKvStore: a KvStore decorator that makes chosen calls fail, for tests.
//
// It forwards every call to a base store (any backend) except the ones a FaultRule picks, by
// operation kind and/or key substring, then by the n-th matching call or at random with a seed.
// A picked call fails the way a real disk does:
//   kIoError    EIO, with the code ErrnoToStatus gives it (Unknown); nothing is done.
//   kNoSpace    ENOSPC (ResourceExhausted); nothing is done.
//   kShortWrite a write persists only the first half of its bytes, then fails with ENOSPC
//               (WriteAt writes a prefix in place; Write stores a torn object under the key).
//   kSlow       the call sleeps for `delay`, then runs normally.
//   kCrash      the "machine dies": this call and every later one fail with Unavailable
//               ("simulated crash") until SimulateCrash() is called.
// Every injected message names the operation and the key, and says it was injected.
//
// Durability tracking (StartDurabilityTracking) models what a POSIX file system keeps after a
// power loss, like leveldb's FaultInjectionTestEnv: the bytes of a file are durable once the file
// is synced (WritableFile::Sync or Sync(key)); a directory entry (a created, replaced, deleted or
// renamed name) is durable once its directory is synced (SyncDirectory(dir), or Sync(key) for
// the key's parent). Write(key) makes its bytes durable at once (the file store fsyncs before
// renaming) but not its name. SimulateCrash() then rewrites the base store to hold exactly what
// was durable: files truncated or reverted to their synced bytes, names created since their
// directory's last sync gone, unsynced renames undone, unsynced deletions undone. Open files from
// before the crash fail afterwards. The model keeps a copy of every tracked file, so it is meant
// for small test stores; TryLock is forwarded and its lock files are not modelled.
//
// Thread-safe: any number of threads may call it at once, as KvStore requires.
#ifndef TENSORSTASH_TESTING_FAULT_INJECTION_KVSTORE_H_
#define TENSORSTASH_TESTING_FAULT_INJECTION_KVSTORE_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// The calls a rule can pick. WritableFile and ReadableFile calls have their own kinds.
enum class KvOp : int {
  kRead,
  kReadRange,
  kSize,
  kOpenForRead,
  kFileReadAt,
  kWrite,
  kOpenForWrite,
  kFileWriteAt,
  kFileSync,
  kFileClose,
  kList,
  kDelete,
  kDeletePrefix,
  kRenameDirectory,
  kSync,
  kSyncDirectory,
  kTryLock,
};
inline constexpr int kNumKvOps = 17;
using KvOpMask = uint32_t;
inline constexpr KvOpMask Mask(KvOp op) { return KvOpMask{1} << static_cast<int>(op); }
inline constexpr KvOpMask kAllKvOps = (KvOpMask{1} << kNumKvOps) - 1;
// Calls that change the store (or make changes durable).
inline constexpr KvOpMask kMutatingKvOps =
    Mask(KvOp::kWrite) | Mask(KvOp::kOpenForWrite) | Mask(KvOp::kFileWriteAt) |
    Mask(KvOp::kFileSync) | Mask(KvOp::kFileClose) | Mask(KvOp::kDelete) |
    Mask(KvOp::kDeletePrefix) | Mask(KvOp::kRenameDirectory) | Mask(KvOp::kSync) |
    Mask(KvOp::kSyncDirectory);
inline constexpr KvOpMask kReadingKvOps = Mask(KvOp::kRead) | Mask(KvOp::kReadRange) |
                                          Mask(KvOp::kSize) | Mask(KvOp::kOpenForRead) |
                                          Mask(KvOp::kFileReadAt) | Mask(KvOp::kList);

// "write", "file write", "rename directory", ...
std::string_view KvOpName(KvOp op);

enum class FaultKind { kIoError, kNoSpace, kShortWrite, kSlow, kCrash };

// What a crash keeps. kPosix: see the top of this file. kObjectStore: names (writes, deletes)
// are durable as soon as the call returns, as in an object store without folders; the bytes of
// a positional file still need its Sync.
enum class DurabilityModel { kPosix, kObjectStore };

struct FaultRule {
  KvOpMask ops = kAllKvOps;
  std::string key_substring;  // "" matches every key
  FaultKind kind = FaultKind::kIoError;
  // Which matching calls are hit: only the nth (1-based) when nth > 0; otherwise each one with
  // `probability` (drawn from the store's seeded generator).
  int64_t nth = 0;
  double probability = 1.0;
  int64_t max_faults = -1;              // stop after this many hits; -1: no limit
  std::chrono::milliseconds delay{20};  // kSlow
};

class FaultInjectionKvStore final : public ForwardingKvStore {
 public:
  // `base` must outlive the decorator. `seed` drives probabilistic rules.
  explicit FaultInjectionKvStore(KvStore* base, uint64_t seed = 0);
  // Owns `base`.
  explicit FaultInjectionKvStore(std::unique_ptr<KvStore> base, uint64_t seed = 0);
  ~FaultInjectionKvStore() override;

  void AddRule(FaultRule rule);
  void ClearRules();

  // Calls seen so far (counted whether or not they were hit), for one kind or a set of kinds.
  int64_t calls(KvOpMask ops) const;
  int64_t faults_injected() const;
  // The messages of every injected fault, in order.
  std::vector<std::string> fault_log() const;
  // True after a kCrash rule fired, until SimulateCrash().
  bool crashed() const;

  // Takes the base store's current contents as durable and starts modelling durability (see
  // the top of this file). Reads every object of the base.
  Status StartDurabilityTracking(DurabilityModel model = DurabilityModel::kPosix);
  // Rewrites the base to its durable state and "reopens": clears the crashed state, keeps the
  // rules and counters, and keeps tracking from the new state. FailedPrecondition unless
  // tracking was started.
  Status SimulateCrash();

  std::string Describe() const override;
  Result<std::string> Read(std::string_view key) override;
  Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) override;
  Result<uint64_t> Size(std::string_view key) override;
  Result<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view key) override;
  Status Write(std::string_view key, std::string_view value) override;
  Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view key) override;
  Result<std::vector<std::string>> List(std::string_view prefix) override;
  // Through List, so that its faults apply.
  Result<ListedChildren> ListChildren(std::string_view prefix) override {
    return KvStore::ListChildren(prefix);
  }
  // Not modelled (faults, the crash model): Unimplemented rather than bypassing them.
  Status WriteIfAbsent(std::string_view key, std::string_view) override {
    return UnimplementedError(
        StrCat("the fault injector does not model create-only writes ('", key, "')"));
  }
  KvStoreCapabilities Capabilities() const override {
    KvStoreCapabilities capabilities = ForwardingKvStore::Capabilities();
    capabilities.conditional_write = false;
    return capabilities;
  }
  Status Delete(std::string_view key) override;
  Status DeletePrefix(std::string_view prefix) override;
  Status RenameDirectory(std::string_view from, std::string_view to) override;
  Status Sync(std::string_view key) override;
  Status SyncDirectory(std::string_view dir) override;
  Result<std::unique_ptr<KvLock>> TryLock(std::string_view key) override;

  // What a call should do, decided under the lock (defined in the .cc).
  struct Decision;
  // The durability model (defined in the .cc).
  struct Model;

 private:
  friend class FaultWritableFile;
  friend class FaultReadableFile;

  // Counts the call and applies the rules. A non-OK status in the decision is returned as is.
  Decision Decide(KvOp op, std::string_view key);

  std::unique_ptr<KvStore> owned_base_;
  mutable std::mutex mutex_;
  std::mt19937_64 rng_;                               // Guarded by mutex_.
  std::vector<std::pair<FaultRule, int64_t>> rules_;  // rule, matches so far; mutex_.
  std::vector<int64_t> rule_hits_;                    // Guarded by mutex_.
  int64_t calls_[kNumKvOps] = {};                     // Guarded by mutex_.
  std::vector<std::string> fault_log_;                // Guarded by mutex_.
  bool crashed_ = false;                              // Guarded by mutex_.
  uint64_t generation_ = 0;                           // bumped by SimulateCrash; mutex_.
  std::unique_ptr<Model> model_;                      // null unless tracking; guarded by mutex_.
};

}  // namespace tensorstash

#endif  // TENSORSTASH_TESTING_FAULT_INJECTION_KVSTORE_H_
