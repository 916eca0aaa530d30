// MemoryKvStore: a KvStore kept in memory, for tests and for staging small checkpoints.
//
// It behaves like FileKvStore where tests can observe it: a key cannot be both an object and a
// "directory" (a prefix of other keys followed by '/'); a WritableFile writes into the stored
// object, so readers see its bytes at once; OpenForWrite truncates an existing object in place,
// while Write replaces it (open readers and writers keep the old one, as with rename). Nothing
// is lost on a "crash", so Sync and SyncDirectory only check that their target exists.
//
// Thread-safe, as KvStore requires. RenameDirectory is atomic: it happens under the store's lock.
#ifndef TENSORSTASH_KVSTORE_MEMORY_MEMORY_KVSTORE_H_
#define TENSORSTASH_KVSTORE_MEMORY_MEMORY_KVSTORE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

class MemoryKvStore final : public KvStore {
 public:
  // With `supports_rename` false, SupportsRename() is false and RenameDirectory is
  // Unimplemented, like an object store; tests use it to exercise the engine's other commit path.
  explicit MemoryKvStore(bool supports_rename = true);
  ~MemoryKvStore() override;
  MemoryKvStore(const MemoryKvStore&) = delete;
  MemoryKvStore& operator=(const MemoryKvStore&) = delete;

  std::string Describe() const override;
  Result<std::string> Read(std::string_view key) override;
  Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) override;
  Result<uint64_t> Size(std::string_view key) override;
  Result<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view key) override;
  KvStoreCapabilities Capabilities() const override;
  Status Write(std::string_view key, std::string_view value) override;
  Status WriteIfAbsent(std::string_view key, std::string_view value) override;
  Result<ObjectInfo> Stat(std::string_view key) override;
  Status ReadRangeAtGeneration(std::string_view key, std::string_view generation, uint64_t offset,
                               size_t size, void* dest) override;
  Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view key) override;
  Result<std::vector<std::string>> List(std::string_view prefix) override;
  Status Delete(std::string_view key) override;
  Status DeletePrefix(std::string_view prefix) override;
  bool SupportsRename() const override { return supports_rename_; }
  Status RenameDirectory(std::string_view from, std::string_view to) override;
  // Atomic under the store's lock (Unimplemented without rename support).
  Status ExchangeDirectories(std::string_view a, std::string_view b) override;
  // Pinned: the objects under the folder now, shared (open files see the same bytes).
  Result<std::unique_ptr<KvStore>> OpenFolderView(std::string_view folder) override;
  Status Sync(std::string_view key) override;
  Status SyncDirectory(std::string_view dir) override;
  // Locks live only in this object; the key is not stored as an object.
  Result<std::unique_ptr<KvLock>> TryLock(std::string_view key) override;

  // One stored object; open files share it (defined in the .cc).
  struct Object;
  // The keys of held locks (defined in the .cc).
  struct LockSet;

 private:
  using ObjectMap = std::map<std::string, std::shared_ptr<Object>, std::less<>>;

  // The object at `key`, or NotFound naming `operation`. Requires mutex_.
  Result<std::shared_ptr<Object>> FindLocked(std::string_view key,
                                             std::string_view operation) const;
  // FailedPrecondition if `key` cannot hold an object: a prefix of it is an object, or it is a
  // directory of other keys. Requires mutex_.
  Status CheckCanHoldObjectLocked(std::string_view key, std::string_view operation) const;
  // Whether some key starts with `dir` + "/". Requires mutex_.
  bool IsDirectoryLocked(std::string_view dir) const;

  const bool supports_rename_;
  mutable std::mutex mutex_;
  ObjectMap objects_;  // Guarded by mutex_.
  // Shared with the lock objects, which may outlive the store.
  std::shared_ptr<LockSet> locks_;
};

// Registers the "memory" scheme with the store registry (registry.h): "memory://<name>" is a
// store shared by every open of that name in the process, kept until the process ends. The
// registry calls this before its first open.
Status RegisterMemoryKvStore();

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_MEMORY_MEMORY_KVSTORE_H_
