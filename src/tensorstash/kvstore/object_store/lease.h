// The lease: a KvLock for object stores, built from the few conditional operations a store has.
// The lock is an object holding (holder, host, pid, expiry) as JSON, created only if absent and
// rewritten every third of `duration` by a background thread; destroying the lock stops the
// renewal and deletes the object if it still names this holder (never a successor's lease). A
// lease whose holder stopped renewing it (a crashed process) is taken over once it expired.
//
//   TS_ASSIGN_OR_RETURN(std::unique_ptr<KvLock> lock, TakeLease(ops, "run/.lock", {}));
//
// TakeLease fails with FailedPrecondition ("... is locked by another manager (host h, pid p,
// lease valid for n s more)") while another holds it, or when another taker of an expired lease
// won the race; with the store's errors otherwise (a store that cannot create only-if-absent
// says so through CreateIfAbsent). A lease is not a fence: the check before a renewal and the
// renewal are two requests, so a takeover between them is not detected.
//
// Thread-safety: TakeLease may be called from several threads at once; the LeaseOps must be
// thread-safe (the renewal runs on its own thread) and outlive every lease taken with them
// (hold them in the shared_ptr).
#ifndef TENSORSTASH_KVSTORE_OBJECT_STORE_LEASE_H_
#define TENSORSTASH_KVSTORE_OBJECT_STORE_LEASE_H_

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// The operations a lease needs from a store.
class LeaseOps {
 public:
  virtual ~LeaseOps() = default;
  // Creates `key` holding `value`; AlreadyExists when it exists.
  virtual Status CreateIfAbsent(std::string_view key, std::string_view value) = 0;
  // NotFound when absent.
  virtual Result<std::string> Read(std::string_view key) = 0;
  // Rewrites `key` (the renewal).
  virtual Status Replace(std::string_view key, std::string_view value) = 0;
  // OK when absent too.
  virtual Status Delete(std::string_view key) = 0;
  // "'key' in <store>", for errors.
  virtual std::string Where(std::string_view key) const = 0;
};

struct LeaseOptions {
  // How long a lease lasts without renewal; renewed every third of it.
  std::chrono::milliseconds duration = std::chrono::seconds(60);
};

Result<std::unique_ptr<KvLock>> TakeLease(std::shared_ptr<LeaseOps> ops, std::string_view key,
                                          LeaseOptions options);

// LeaseOps over any KvStore with an atomic WriteIfAbsent (Capabilities().conditional_write): the
// memory and file stores, and tests. `kv` must outlive the leases.
std::shared_ptr<LeaseOps> KvStoreLeaseOps(KvStore* kv);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_OBJECT_STORE_LEASE_H_
