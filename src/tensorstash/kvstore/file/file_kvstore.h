// FileKvStore: a KvStore on a local directory tree. Key "a/b/c" is the file <root>/a/b/c.
//
// Write() is atomic and crash-safe: a reader, or the store after a crash, sees the old object or
// the new one, never a mix. It becomes durable with Sync(key). OpenForWrite() writes in place;
// its bytes are durable after WritableFile::Sync() plus Sync(key) for the directory entry.
//
// Symlinks inside the store are never followed: List() skips them, and reading or writing
// through one fails with FailedPrecondition. (The root path given to Open() may contain them.)
// Errors carry the errno-derived code from status.h and name the operation and the full path.
//
// TryLock uses flock(), so it works between processes on one machine (and on network file
// systems only where they implement flock).
//
// Thread-safe, as KvStore requires. Different processes may share a root; concurrent writers to
// one key are resolved by rename (the last one wins).
#ifndef TENSORSTASH_KVSTORE_FILE_FILE_KVSTORE_H_
#define TENSORSTASH_KVSTORE_FILE_FILE_KVSTORE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

class FileKvStore final : public KvStore {
 public:
  // Opens the store rooted at `root_dir`, creating the directory and its parents first when
  // `create`. Fails with InvalidArgument for an empty path, NotFound when the directory is
  // missing (and !create) or is not a directory, or the errno-derived code otherwise.
  static Result<std::unique_ptr<FileKvStore>> Open(std::string root_dir, bool create = true);

  ~FileKvStore() override;
  FileKvStore(const FileKvStore&) = delete;
  FileKvStore& operator=(const FileKvStore&) = delete;

  // The root directory as given to Open() (without trailing '/').
  const std::string& root_dir() const { return root_dir_; }

  std::string Describe() const override;
  Result<std::string> Read(std::string_view key) override;
  Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) override;
  Result<uint64_t> Size(std::string_view key) override;
  Result<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view key) override;
  KvStoreCapabilities Capabilities() const override;
  Status Write(std::string_view key, std::string_view value) override;
  // A temporary file put in place with renameat2(RENAME_NOREPLACE) (link(2) where unsupported).
  Status WriteIfAbsent(std::string_view key, std::string_view value) override;
  Result<ObjectInfo> Stat(std::string_view key) override;
  Status ReadRangeAtGeneration(std::string_view key, std::string_view generation, uint64_t offset,
                               size_t size, void* dest) override;
  // One readdir of the folder (List walks the whole tree below it).
  Result<ListedChildren> ListChildren(std::string_view prefix) override;
  Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view key) override;
  Result<std::vector<std::string>> List(std::string_view prefix) override;
  Status Delete(std::string_view key) override;
  Status DeletePrefix(std::string_view prefix) override;
  bool SupportsRename() const override { return true; }
  Status RenameDirectory(std::string_view from, std::string_view to) override;
  // renameat2(RENAME_EXCHANGE); Unimplemented where the file system or kernel lacks it.
  Status ExchangeDirectories(std::string_view a, std::string_view b) override;
  // Pinned: a store rooted at the folder's directory, opened now.
  Result<std::unique_ptr<KvStore>> OpenFolderView(std::string_view folder) override;
  Status Sync(std::string_view key) override;
  Status SyncDirectory(std::string_view dir) override;
  Result<std::unique_ptr<KvLock>> TryLock(std::string_view key) override;

 private:
  FileKvStore(std::string root_dir, int root_fd);

  Status WriteObject(std::string_view key, std::string_view value, bool create_only);
  // "<root>/<key>", for messages.
  std::string PathOf(std::string_view key) const;

  const std::string root_dir_;
  // Every path is resolved relative to this descriptor (opened O_RDONLY | O_DIRECTORY), so the
  // store keeps working on the same directory even if the root path is renamed under it.
  const int root_fd_;
};

// Registers the "file" scheme (and plain paths) with the store registry (registry.h): the
// registry calls this before its first open.
Status RegisterFileKvStore();

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_FILE_FILE_KVSTORE_H_
