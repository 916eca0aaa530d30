// ReadOnlyKvStore: the base of stores that can only be read (FolderView, OcdbtKvStore). It
// refuses every call that would change the store in one way: FailedPrecondition, with a message
// naming the operation, the key and the kind of store ("write 'step/x' failed: a folder view is
// read-only"), so that the refusals of every read-only store read alike.
//
// Thread-safety: the refusals touch no state; the rest is the derived store's.
#ifndef TENSORSTASH_KVSTORE_READ_ONLY_KVSTORE_H_
#define TENSORSTASH_KVSTORE_READ_ONLY_KVSTORE_H_

#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "tensorstash/kvstore/kvstore.h"

namespace tensorstash {

class ReadOnlyKvStore : public KvStore {
 public:
  // Writes, deletes, renames and syncs: FailedPrecondition (see Refuse). WriteIfAbsent and
  // TryLock keep KvStore's defaults (Unimplemented); a derived store may refuse them itself.
  Status Write(std::string_view key, std::string_view value) final;
  Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view key) final;
  Status Delete(std::string_view key) final;
  Status DeletePrefix(std::string_view prefix) final;
  bool SupportsRename() const final { return false; }
  Status RenameDirectory(std::string_view from, std::string_view to) final;
  Status Sync(std::string_view key) final;
  Status SyncDirectory(std::string_view dir) final;

 protected:
  // `kind` names the store in refusals ("a folder view"); `remedy`, if not empty, is added in
  // parentheses ("use OcdbtWriter to create one").
  explicit ReadOnlyKvStore(std::string kind, std::string remedy = "")
      : kind_(std::move(kind)), remedy_(std::move(remedy)) {}

  // FailedPrecondition: "<operation> '<key>' failed: <kind> is read-only[ (<remedy>)]".
  Status Refuse(std::string_view operation, std::string_view key) const;

 private:
  const std::string kind_;
  const std::string remedy_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_READ_ONLY_KVSTORE_H_
