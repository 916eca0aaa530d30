// ForwardingKvStore: a KvStore that passes every call to another one. Decorators (fault
// injection, recording, throttling) derive from it and override only the calls they change.
//
// Thread-safety: as the base store. The base must outlive the decorator.
#ifndef TENSORSTASH_KVSTORE_FORWARDING_KVSTORE_H_
#define TENSORSTASH_KVSTORE_FORWARDING_KVSTORE_H_

#include <memory>
#include <string>
#include <vector>

#include "tensorstash/kvstore/kvstore.h"

namespace tensorstash {

class ForwardingKvStore : public KvStore {
 public:
  explicit ForwardingKvStore(KvStore* base) : base_(base) {}

  std::string Describe() const override { return base_->Describe(); }
  // The base's, less what is not forwarded (ExchangeDirectories, OpenFolderView: a decorator
  // forwards them only if it models them).
  KvStoreCapabilities Capabilities() const override {
    KvStoreCapabilities capabilities = base_->Capabilities();
    capabilities.exchange = false;
    capabilities.pinned_views = false;
    return capabilities;
  }
  Result<ListedChildren> ListChildren(std::string_view prefix) override {
    return base_->ListChildren(prefix);
  }
  Result<ObjectInfo> Stat(std::string_view key) override { return base_->Stat(key); }
  Result<std::vector<ListedObject>> ListWithInfo(std::string_view prefix) override {
    return base_->ListWithInfo(prefix);
  }
  Status ReadRangeAtGeneration(std::string_view key, std::string_view generation, uint64_t offset,
                               size_t size, void* dest) override {
    return base_->ReadRangeAtGeneration(key, generation, offset, size, dest);
  }
  Status WriteIfAbsent(std::string_view key, std::string_view value) override {
    return base_->WriteIfAbsent(key, value);
  }
  Result<std::string> Read(std::string_view key) override { return base_->Read(key); }
  Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) override {
    return base_->ReadRange(key, offset, size, dest);
  }
  Result<uint64_t> Size(std::string_view key) override { return base_->Size(key); }
  Result<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view key) override {
    return base_->OpenForRead(key);
  }
  Status Write(std::string_view key, std::string_view value) override {
    return base_->Write(key, value);
  }
  Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view key) override {
    return base_->OpenForWrite(key);
  }
  Result<std::vector<std::string>> List(std::string_view prefix) override {
    return base_->List(prefix);
  }
  Result<std::vector<PendingWrite>> ListPendingWrites(std::string_view prefix) override {
    return base_->ListPendingWrites(prefix);
  }
  Status AbortPendingWrite(const PendingWrite& write) override {
    return base_->AbortPendingWrite(write);
  }
  Status Delete(std::string_view key) override { return base_->Delete(key); }
  Status DeletePrefix(std::string_view prefix) override { return base_->DeletePrefix(prefix); }
  bool SupportsRename() const override { return base_->SupportsRename(); }
  Status RenameDirectory(std::string_view from, std::string_view to) override {
    return base_->RenameDirectory(from, to);
  }
  Status Sync(std::string_view key) override { return base_->Sync(key); }
  Status SyncDirectory(std::string_view dir) override { return base_->SyncDirectory(dir); }
  Result<std::unique_ptr<KvLock>> TryLock(std::string_view key) override {
    return base_->TryLock(key);
  }

 protected:
  KvStore* base() const { return base_; }

 private:
  KvStore* base_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_FORWARDING_KVSTORE_H_
