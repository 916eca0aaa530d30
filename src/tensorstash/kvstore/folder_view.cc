#include "tensorstash/kvstore/folder_view.h"

#include <utility>

#include "tensorstash/util/str_util.h"

namespace tensorstash {

FolderView::FolderView(std::string folder, KvStore* target, std::string target_prefix,
                       std::unique_ptr<KvStore> owned)
    : ReadOnlyKvStore("a folder view"),
      folder_prefix_(StrCat(folder, "/")),
      owned_(std::move(owned)),
      target_(target),
      target_prefix_(std::move(target_prefix)) {}

std::string FolderView::Describe() const { return target_->Describe(); }

KvStoreCapabilities FolderView::Capabilities() const {
  KvStoreCapabilities capabilities;
  capabilities.mapping = target_->Capabilities().mapping;
  return capabilities;
}

Result<std::string> FolderView::Map(std::string_view key) const {
  TS_RETURN_IF_ERROR(ValidatePrefix(key));
  if (!key.starts_with(folder_prefix_) && StrCat(key, "/") != folder_prefix_) {
    return InvalidArgumentError(
        StrCat("key '", key, "' is outside the folder view '", folder_prefix_, "'"));
  }
  const std::string_view rest =
      key.size() > folder_prefix_.size() ? key.substr(folder_prefix_.size()) : std::string_view();
  return StrCat(target_prefix_, rest);
}

Result<std::string> FolderView::Read(std::string_view key) {
  TS_ASSIGN_OR_RETURN(std::string mapped, Map(key));
  return target_->Read(mapped);
}

Status FolderView::ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) {
  TS_ASSIGN_OR_RETURN(std::string mapped, Map(key));
  return target_->ReadRange(mapped, offset, size, dest);
}

Result<uint64_t> FolderView::Size(std::string_view key) {
  TS_ASSIGN_OR_RETURN(std::string mapped, Map(key));
  return target_->Size(mapped);
}

Result<std::unique_ptr<ReadableFile>> FolderView::OpenForRead(std::string_view key) {
  TS_ASSIGN_OR_RETURN(std::string mapped, Map(key));
  return target_->OpenForRead(mapped);
}

Result<std::vector<std::string>> FolderView::List(std::string_view prefix) {
  TS_ASSIGN_OR_RETURN(std::string mapped, Map(prefix));
  TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, target_->List(mapped));
  for (std::string& key : keys) {
    key = StrCat(folder_prefix_, std::string_view(key).substr(target_prefix_.size()));
  }
  return keys;
}

Result<std::unique_ptr<KvLock>> FolderView::TryLock(std::string_view key) {
  return Refuse("lock", key);
}

}  // namespace tensorstash
