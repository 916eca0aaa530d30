// FolderView: the read-only KvStore that KvStore::OpenFolderView returns. Keys are the parent
// store's ("<folder>/..."); each is served by `target` under `target_prefix` + the rest of the
// key. Backends build it over a store pinned to the folder (the file backend: a store rooted at
// the folder's directory descriptor), or over themselves (the default: no pinning).
//
// Thread-safety: as the target store.
#ifndef TENSORSTASH_KVSTORE_FOLDER_VIEW_H_
#define TENSORSTASH_KVSTORE_FOLDER_VIEW_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/kvstore/read_only_kvstore.h"

namespace tensorstash {

class FolderView final : public ReadOnlyKvStore {
 public:
  // `owned` (may be null) is kept alive with the view; `target` may be it, or a store that
  // outlives the view.
  FolderView(std::string folder, KvStore* target, std::string target_prefix,
             std::unique_ptr<KvStore> owned = nullptr);

  std::string Describe() const override;
  Result<std::string> Read(std::string_view key) override;
  Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) override;
  Result<uint64_t> Size(std::string_view key) override;
  Result<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view key) override;
  Result<std::vector<std::string>> List(std::string_view prefix) override;
  // What a read-only view can do: map its target's files.
  KvStoreCapabilities Capabilities() const override;
  // Writes, deletes, renames and syncs are refused by ReadOnlyKvStore (FailedPrecondition: "a
  // folder view is read-only"); so are locks, here.
  Result<std::unique_ptr<KvLock>> TryLock(std::string_view key) override;

 private:
  // The target's key for `key`, or InvalidArgument when `key` is not under the folder.
  Result<std::string> Map(std::string_view key) const;

  const std::string folder_prefix_;  // "<folder>/"
  std::unique_ptr<KvStore> owned_;
  KvStore* const target_;
  const std::string target_prefix_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_FOLDER_VIEW_H_
