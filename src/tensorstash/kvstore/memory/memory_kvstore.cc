// MemoryKvStore: a sorted map from key to shared object, under one mutex.
//
// Objects are shared_ptrs so that open files outlive Write/Delete/RenameDirectory of their key,
// as open descriptors outlive rename and unlink. Each object has its own mutex for its bytes:
// several threads write one object at once through a WritableFile, and copying a large object
// out should not stall the whole store. Lock order: the store's mutex_, then an object's.
//
// The map is sorted, so a prefix is a contiguous range: List, DeletePrefix and RenameDirectory
// walk from lower_bound(prefix) while keys still start with it.
#include "tensorstash/kvstore/memory/memory_kvstore.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorstash/kvstore/folder_view.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/registry.h"

namespace tensorstash {

namespace {
uint64_t NextGeneration() {
  static std::atomic<uint64_t> counter{0};
  return ++counter;
}
}  // namespace

struct MemoryKvStore::Object {
  std::mutex mutex;
  std::string data;                        // Guarded by mutex.
  uint64_t generation = NextGeneration();  // Guarded by mutex; new on every change of data.
  // Guarded by mutex; set with every new generation.
  std::chrono::system_clock::time_point modified = std::chrono::system_clock::now();
};

namespace {

using Object = MemoryKvStore::Object;

Status Truncated(std::string_view key, uint64_t offset, size_t size, uint64_t object_size) {
  return DataLossError(StrCat("read of '", key, "' truncated: wanted ", size, " bytes at offset ",
                              offset, ", object has ", object_size, " bytes"));
}

// Copies [offset, offset + size) of `object` into `dest`, or DataLoss if it is not all there.
Status CopyOut(Object& object, std::string_view key, uint64_t offset, size_t size, void* dest) {
  std::lock_guard<std::mutex> lock(object.mutex);
  const uint64_t object_size = object.data.size();
  if (offset > object_size || size > object_size - offset) {
    return Truncated(key, offset, size, object_size);
  }
  if (size > 0) std::memcpy(dest, object.data.data() + offset, size);
  return OkStatus();
}

class MemoryWritableFile final : public WritableFile {
 public:
  MemoryWritableFile(std::shared_ptr<Object> object, std::string key)
      : object_(std::move(object)), key_(std::move(key)) {}

  Status WriteAt(uint64_t offset, const void* data, size_t size) override {
    TS_RETURN_IF_ERROR(CheckOpen("write"));
    std::lock_guard<std::mutex> lock(object_->mutex);
    std::string& bytes = object_->data;
    if (offset > bytes.max_size() || size > bytes.max_size() - offset) {
      return ResourceExhaustedError(StrCat("write ", size, " bytes at offset ", offset, " of '",
                                           key_, "' failed: object too large"));
    }
    const size_t end = static_cast<size_t>(offset) + size;
    // Growing zero-fills any gap, as a file hole reads back as zeros.
    if (end > bytes.size()) bytes.resize(end);
    if (size > 0) std::memcpy(bytes.data() + offset, data, size);
    object_->generation = NextGeneration();
    object_->modified = std::chrono::system_clock::now();
    return OkStatus();
  }

  Status Sync() override { return CheckOpen("sync"); }

  Status Close() override {
    TS_RETURN_IF_ERROR(CheckOpen("close"));
    closed_.store(true, std::memory_order_release);
    return OkStatus();
  }

 private:
  Status CheckOpen(std::string_view operation) const {
    if (!closed_.load(std::memory_order_acquire)) return OkStatus();
    return FailedPreconditionError(StrCat(operation, " '", key_, "' failed: file already closed"));
  }

  const std::shared_ptr<Object> object_;
  const std::string key_;
  std::atomic<bool> closed_{false};
};

class MemoryReadableFile final : public ReadableFile {
 public:
  MemoryReadableFile(std::shared_ptr<Object> object, std::string key, uint64_t size)
      : object_(std::move(object)), key_(std::move(key)), size_(size) {}

  uint64_t size() const override { return size_; }

  Status ReadAt(uint64_t offset, size_t size, void* dest) const override {
    return CopyOut(*object_, key_, offset, size, dest);
  }

 private:
  const std::shared_ptr<Object> object_;
  const std::string key_;
  const uint64_t size_;
};

}  // namespace

struct MemoryKvStore::LockSet {
  std::mutex mutex;
  std::set<std::string, std::less<>> held;  // Guarded by mutex.
};

namespace {

class MemoryKvLock final : public KvLock {
 public:
  MemoryKvLock(std::shared_ptr<MemoryKvStore::LockSet> locks, std::string key)
      : locks_(std::move(locks)), key_(std::move(key)) {}
  ~MemoryKvLock() override;

 private:
  std::shared_ptr<MemoryKvStore::LockSet> locks_;
  std::string key_;
};

}  // namespace

MemoryKvLock::~MemoryKvLock() {
  std::lock_guard<std::mutex> lock(locks_->mutex);
  locks_->held.erase(key_);
}

Result<std::unique_ptr<KvLock>> MemoryKvStore::TryLock(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  std::lock_guard<std::mutex> lock(locks_->mutex);
  if (!locks_->held.emplace(key).second) {
    return FailedPreconditionError(StrCat(Describe(), " is locked by another manager (", key, ")"));
  }
  return std::unique_ptr<KvLock>(std::make_unique<MemoryKvLock>(locks_, std::string(key)));
}

MemoryKvStore::MemoryKvStore(bool supports_rename)
    : supports_rename_(supports_rename), locks_(std::make_shared<LockSet>()) {}

MemoryKvStore::~MemoryKvStore() = default;

std::string MemoryKvStore::Describe() const {
  return supports_rename_ ? "memory" : "memory (no rename)";
}

Result<std::shared_ptr<Object>> MemoryKvStore::FindLocked(std::string_view key,
                                                          std::string_view operation) const {
  const auto it = objects_.find(key);
  if (it != objects_.end()) return it->second;
  if (IsDirectoryLocked(key)) {
    return NotAnObjectError(operation, key);
  }
  return NotFoundError(StrCat(operation, " '", key, "' failed: no such object"));
}

bool MemoryKvStore::IsDirectoryLocked(std::string_view dir) const {
  const std::string prefix = StrCat(dir, "/");
  const auto it = objects_.lower_bound(prefix);
  return it != objects_.end() && it->first.starts_with(prefix);
}

Status MemoryKvStore::CheckCanHoldObjectLocked(std::string_view key,
                                               std::string_view operation) const {
  for (size_t slash = key.find('/'); slash != std::string_view::npos;
       slash = key.find('/', slash + 1)) {
    if (objects_.find(key.substr(0, slash)) != objects_.end()) {
      return FailedPreconditionError(StrCat(
          operation, " '", key, "' failed: a parent of the key is an object, not a directory"));
    }
  }
  if (IsDirectoryLocked(key)) {
    return FailedPreconditionError(
        StrCat(operation, " '", key, "' failed: a directory of that name exists"));
  }
  return OkStatus();
}

Result<std::string> MemoryKvStore::Read(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  std::shared_ptr<Object> object;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TS_ASSIGN_OR_RETURN(object, FindLocked(key, "read"));
  }
  std::lock_guard<std::mutex> lock(object->mutex);
  return object->data;
}

Status MemoryKvStore::ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  std::shared_ptr<Object> object;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TS_ASSIGN_OR_RETURN(object, FindLocked(key, "read range"));
  }
  return CopyOut(*object, key, offset, size, dest);
}

Result<uint64_t> MemoryKvStore::Size(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  std::shared_ptr<Object> object;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TS_ASSIGN_OR_RETURN(object, FindLocked(key, "size"));
  }
  std::lock_guard<std::mutex> lock(object->mutex);
  return static_cast<uint64_t>(object->data.size());
}

Result<std::unique_ptr<ReadableFile>> MemoryKvStore::OpenForRead(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  std::shared_ptr<Object> object;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TS_ASSIGN_OR_RETURN(object, FindLocked(key, "open for read"));
  }
  uint64_t size;
  {
    std::lock_guard<std::mutex> lock(object->mutex);
    size = object->data.size();
  }
  return std::make_unique<MemoryReadableFile>(std::move(object), std::string(key), size);
}

Status MemoryKvStore::Write(std::string_view key, std::string_view value) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  // Copy before locking: a large value should not hold up other threads.
  auto object = std::make_shared<Object>();
  object->data.assign(value);
  std::lock_guard<std::mutex> lock(mutex_);
  TS_RETURN_IF_ERROR(CheckCanHoldObjectLocked(key, "write"));
  const auto it = objects_.find(key);
  if (it != objects_.end()) {
    it->second = std::move(object);
  } else {
    objects_.emplace(std::string(key), std::move(object));
  }
  return OkStatus();
}

Result<std::unique_ptr<WritableFile>> MemoryKvStore::OpenForWrite(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  std::shared_ptr<Object> object;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TS_RETURN_IF_ERROR(CheckCanHoldObjectLocked(key, "open for write"));
    const auto it = objects_.find(key);
    if (it != objects_.end()) {
      // Truncated in place, like O_TRUNC: whoever has it open sees it emptied.
      object = it->second;
      std::lock_guard<std::mutex> object_lock(object->mutex);
      object->data.clear();
      object->generation = NextGeneration();
      object->modified = std::chrono::system_clock::now();
    } else {
      object = std::make_shared<Object>();
      objects_.emplace(std::string(key), object);
    }
  }
  return std::make_unique<MemoryWritableFile>(std::move(object), std::string(key));
}

Result<std::vector<std::string>> MemoryKvStore::List(std::string_view prefix) {
  TS_RETURN_IF_ERROR(ValidatePrefix(prefix));
  std::vector<std::string> keys;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = objects_.lower_bound(prefix);
       it != objects_.end() && it->first.starts_with(prefix); ++it) {
    keys.push_back(it->first);
  }
  return keys;
}

Status MemoryKvStore::Delete(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = objects_.find(key);
  if (it == objects_.end()) return FindLocked(key, "delete").status();
  objects_.erase(it);
  return OkStatus();
}

Status MemoryKvStore::DeletePrefix(std::string_view prefix) {
  TS_RETURN_IF_ERROR(ValidatePrefix(prefix));
  std::lock_guard<std::mutex> lock(mutex_);
  auto end = objects_.lower_bound(prefix);
  while (end != objects_.end() && end->first.starts_with(prefix)) ++end;
  objects_.erase(objects_.lower_bound(prefix), end);
  return OkStatus();
}

Status MemoryKvStore::RenameDirectory(std::string_view from, std::string_view to) {
  TS_RETURN_IF_ERROR(ValidateKey(from));
  TS_RETURN_IF_ERROR(ValidateKey(to));
  const std::string operation = StrCat("rename directory '", from, "' to '", to, "'");
  if (!supports_rename_) {
    return UnimplementedError(
        StrCat(operation, " failed: this memory store was made without rename support"));
  }
  if (to.size() > from.size() && to.starts_with(from) && to[from.size()] == '/') {
    return InvalidArgumentError(StrCat(operation, " failed: target is inside the source"));
  }
  const std::string from_prefix = StrCat(from, "/");
  const std::string to_prefix = StrCat(to, "/");
  std::lock_guard<std::mutex> lock(mutex_);
  auto first = objects_.lower_bound(from_prefix);
  if (first == objects_.end() || !first->first.starts_with(from_prefix)) {
    return NotFoundError(StrCat(operation, " failed: no such directory"));
  }
  if (objects_.find(to) != objects_.end() || IsDirectoryLocked(to)) {
    return AlreadyExistsError(StrCat(operation, " failed: target exists"));
  }
  TS_RETURN_IF_ERROR(CheckCanHoldObjectLocked(to, operation));
  // Re-key the nodes rather than copy them, so open files keep sharing the same objects.
  std::vector<ObjectMap::node_type> moved;
  while (first != objects_.end() && first->first.starts_with(from_prefix)) {
    moved.push_back(objects_.extract(first++));
  }
  for (ObjectMap::node_type& node : moved) {
    node.key() = StrCat(to_prefix, std::string_view(node.key()).substr(from_prefix.size()));
    objects_.insert(std::move(node));
  }
  return OkStatus();
}

KvStoreCapabilities MemoryKvStore::Capabilities() const {
  KvStoreCapabilities capabilities;
  capabilities.rename = supports_rename_;
  capabilities.exchange = supports_rename_;
  capabilities.conditional_write = true;
  capabilities.generations = true;
  capabilities.locks = true;
  capabilities.pinned_views = true;
  return capabilities;
}

Result<ObjectInfo> MemoryKvStore::Stat(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  std::shared_ptr<Object> object;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TS_ASSIGN_OR_RETURN(object, FindLocked(key, "stat"));
  }
  std::lock_guard<std::mutex> lock(object->mutex);
  return ObjectInfo{static_cast<uint64_t>(object->data.size()), StrCat(object->generation),
                    object->modified};
}

Status MemoryKvStore::ReadRangeAtGeneration(std::string_view key, std::string_view generation,
                                            uint64_t offset, size_t size, void* dest) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  std::shared_ptr<Object> object;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TS_ASSIGN_OR_RETURN(object, FindLocked(key, "read range"));
  }
  {
    std::lock_guard<std::mutex> lock(object->mutex);
    if (StrCat(object->generation) != generation) {
      return FailedPreconditionError(StrCat("read of '", key,
                                            "' failed: the object was replaced "
                                            "(generation ",
                                            object->generation, ", expected ", generation, ")"));
    }
  }
  // (A rewrite between the check and the copy is possible only through an open WritableFile,
  // which no reader of committed objects races.)
  return CopyOut(*object, key, offset, size, dest);
}

Status MemoryKvStore::WriteIfAbsent(std::string_view key, std::string_view value) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  auto object = std::make_shared<Object>();
  object->data.assign(value);
  std::lock_guard<std::mutex> lock(mutex_);
  TS_RETURN_IF_ERROR(CheckCanHoldObjectLocked(key, "create-only write"));
  if (!objects_.emplace(std::string(key), std::move(object)).second) {
    return AlreadyExistsError(StrCat("create-only write of '", key, "' failed: it exists"));
  }
  return OkStatus();
}

Status MemoryKvStore::ExchangeDirectories(std::string_view a, std::string_view b) {
  TS_RETURN_IF_ERROR(ValidateKey(a));
  TS_RETURN_IF_ERROR(ValidateKey(b));
  const std::string operation = StrCat("exchange directories '", a, "' and '", b, "'");
  if (!supports_rename_) {
    return UnimplementedError(
        StrCat(operation, " failed: this memory store was made without rename support"));
  }
  const std::string a_prefix = StrCat(a, "/");
  const std::string b_prefix = StrCat(b, "/");
  if (a_prefix.starts_with(b_prefix) || b_prefix.starts_with(a_prefix)) {
    return InvalidArgumentError(StrCat(operation, " failed: one is inside the other"));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!IsDirectoryLocked(a) || !IsDirectoryLocked(b)) {
    return NotFoundError(StrCat(operation, " failed: no such directory"));
  }
  // Re-key the nodes rather than copy them, so open files keep sharing the same objects.
  std::vector<ObjectMap::node_type> from_a, from_b;
  for (auto it = objects_.lower_bound(a_prefix);
       it != objects_.end() && it->first.starts_with(a_prefix);) {
    from_a.push_back(objects_.extract(it++));
  }
  for (auto it = objects_.lower_bound(b_prefix);
       it != objects_.end() && it->first.starts_with(b_prefix);) {
    from_b.push_back(objects_.extract(it++));
  }
  for (ObjectMap::node_type& node : from_a) {
    node.key() = StrCat(b_prefix, std::string_view(node.key()).substr(a_prefix.size()));
    objects_.insert(std::move(node));
  }
  for (ObjectMap::node_type& node : from_b) {
    node.key() = StrCat(a_prefix, std::string_view(node.key()).substr(b_prefix.size()));
    objects_.insert(std::move(node));
  }
  return OkStatus();
}

Result<std::unique_ptr<KvStore>> MemoryKvStore::OpenFolderView(std::string_view folder) {
  TS_RETURN_IF_ERROR(ValidateKey(folder));
  const std::string prefix = StrCat(folder, "/");
  auto snapshot = std::make_unique<MemoryKvStore>(supports_rename_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = objects_.lower_bound(prefix);
         it != objects_.end() && it->first.starts_with(prefix); ++it) {
      snapshot->objects_.emplace(it->first, it->second);
    }
  }
  if (snapshot->objects_.empty()) {
    return NotFoundError(StrCat("open folder '", folder, "' failed: no such directory"));
  }
  KvStore* target = snapshot.get();
  return std::unique_ptr<KvStore>(
      std::make_unique<FolderView>(std::string(folder), target, prefix, std::move(snapshot)));
}

Status MemoryKvStore::Sync(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  std::lock_guard<std::mutex> lock(mutex_);
  return FindLocked(key, "sync").status();
}

Status MemoryKvStore::SyncDirectory(std::string_view dir) {
  TS_RETURN_IF_ERROR(ValidatePrefix(dir));
  if (!dir.empty() && dir.back() == '/') dir.remove_suffix(1);
  if (dir.empty()) return OkStatus();
  std::lock_guard<std::mutex> lock(mutex_);
  if (IsDirectoryLocked(dir)) return OkStatus();
  return NotFoundError(StrCat("sync directory '", dir, "' failed: no such directory"));
}

Status RegisterMemoryKvStore() {
  // A handle on a named store: every open of "memory://<name>" shares one store.
  class NamedStore final : public ForwardingKvStore {
   public:
    explicit NamedStore(std::shared_ptr<MemoryKvStore> store)
        : ForwardingKvStore(store.get()), store_(std::move(store)) {}
    KvStoreCapabilities Capabilities() const override { return store_->Capabilities(); }
    Status ExchangeDirectories(std::string_view a, std::string_view b) override {
      return store_->ExchangeDirectories(a, b);
    }
    Result<std::unique_ptr<KvStore>> OpenFolderView(std::string_view folder) override {
      return store_->OpenFolderView(folder);
    }

   private:
    std::shared_ptr<MemoryKvStore> store_;
  };
  return RegisterKvStoreScheme(
      "memory",
      [](std::string_view name,
         const OpenStoreOptions& options) -> Result<std::unique_ptr<KvStore>> {
        TS_RETURN_IF_ERROR(CheckDriverOptions("memory", name, options, {}));
        static std::mutex mutex;
        static auto* stores =
            new std::map<std::string, std::shared_ptr<MemoryKvStore>, std::less<>>();
        std::lock_guard<std::mutex> lock(mutex);
        auto it = stores->find(name);
        if (it == stores->end()) {
          if (!options.create) {
            return NotFoundError(StrCat("no memory store 'memory://", name, "' in this process"));
          }
          it = stores->emplace(std::string(name), std::make_shared<MemoryKvStore>()).first;
        }
        return std::unique_ptr<KvStore>(std::make_unique<NamedStore>(it->second));
      });
}

namespace {
const KvStoreDriverRegistration kRegistered(&RegisterMemoryKvStore);
}  // namespace

}  // namespace tensorstash
