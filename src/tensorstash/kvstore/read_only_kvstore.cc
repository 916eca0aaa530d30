#include "tensorstash/kvstore/read_only_kvstore.h"

#include "tensorstash/util/str_util.h"

namespace tensorstash {

Status ReadOnlyKvStore::Refuse(std::string_view operation, std::string_view key) const {
  return FailedPreconditionError(StrCat(operation, " '", key, "' failed: ", kind_, " is read-only",
                                        remedy_.empty() ? "" : StrCat(" (", remedy_, ")")));
}

Status ReadOnlyKvStore::Write(std::string_view key, std::string_view) {
  return Refuse("write", key);
}
Result<std::unique_ptr<WritableFile>> ReadOnlyKvStore::OpenForWrite(std::string_view key) {
  return Refuse("open for write", key);
}
Status ReadOnlyKvStore::Delete(std::string_view key) { return Refuse("delete", key); }
Status ReadOnlyKvStore::DeletePrefix(std::string_view prefix) {
  return Refuse("delete prefix", prefix);
}
Status ReadOnlyKvStore::RenameDirectory(std::string_view from, std::string_view to) {
  // "rename directory 'a' to 'b' failed: ..."
  return Refuse("rename directory", StrCat(from, "' to '", to));
}
Status ReadOnlyKvStore::Sync(std::string_view key) { return Refuse("sync", key); }
Status ReadOnlyKvStore::SyncDirectory(std::string_view dir) {
  return Refuse("sync directory", dir);
}

}  // namespace tensorstash
