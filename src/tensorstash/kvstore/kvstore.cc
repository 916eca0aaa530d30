#include "tensorstash/kvstore/kvstore.h"

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "absl/strings/cord.h"
#include "tensorstash/kvstore/folder_view.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

// Keys become paths under the file backend's root, so the limits are Linux's PATH_MAX and
// NAME_MAX. Checking them here gives every backend the same answer; otherwise a key that works
// in memory would fail only once it reaches the disk.
constexpr size_t kMaxKeyLength = 4096;
constexpr size_t kMaxSegmentLength = 255;
// A rejected 4 KiB key is quoted only in part: the message has to stay readable in a log.
constexpr size_t kMaxQuotedLength = 200;

std::string Quote(std::string_view text) {
  if (text.size() > kMaxQuotedLength) {
    return StrCat("\"", EscapeBytes(text.substr(0, kMaxQuotedLength)), "\"... (", text.size(),
                  " bytes)");
  }
  return StrCat("\"", EscapeBytes(text), "\"");
}

Status Invalid(std::string_view what, std::string_view original, std::string_view problem) {
  return InvalidArgumentError(StrCat("invalid ", what, " ", Quote(original), ": ", problem));
}

// Checks `original` as a key, or as a prefix when `is_prefix` (one trailing '/' allowed).
Status CheckPath(std::string_view what, std::string_view original, bool is_prefix) {
  if (original.empty()) return Invalid(what, original, "empty");
  if (original.size() > kMaxKeyLength) {
    return Invalid(what, original, StrCat("longer than ", kMaxKeyLength, " bytes"));
  }
  if (original.find('\0') != std::string_view::npos) {
    return Invalid(what, original, "contains a NUL byte");
  }
  if (original.front() == '/') return Invalid(what, original, "must be relative (leading '/')");
  std::string_view path = original;
  if (is_prefix) {
    // "step/" names a directory; what is left must itself be a well-formed key.
    if (path.back() == '/') path.remove_suffix(1);
  } else if (path.back() == '/') {
    return Invalid(what, original, "ends in '/'");
  }
  size_t start = 0;
  while (true) {
    size_t end = path.find('/', start);
    if (end == std::string_view::npos) end = path.size();
    const std::string_view segment = path.substr(start, end - start);
    if (segment.empty()) return Invalid(what, original, "empty segment");
    if (segment == "." || segment == "..") {
      return Invalid(what, original, StrCat("'", segment, "' segment"));
    }
    if (segment.size() > kMaxSegmentLength) {
      return Invalid(what, original, StrCat("segment longer than ", kMaxSegmentLength, " bytes"));
    }
    if (end == path.size()) break;
    start = end + 1;
  }
  return OkStatus();
}

}  // namespace

Status ValidateKey(std::string_view key) { return CheckPath("key", key, /*is_prefix=*/false); }

Status ValidatePrefix(std::string_view prefix) {
  if (prefix.empty()) return OkStatus();
  return CheckPath("prefix", prefix, /*is_prefix=*/true);
}

Status ReadableFile::MapAt(uint64_t /*offset*/, size_t /*size*/, void* /*address*/) const {
  return UnimplementedError("this store's files cannot be mapped");
}

namespace {

class StoreRangeFile final : public ReadableFile {
 public:
  StoreRangeFile(KvStore* store, std::string key, uint64_t size)
      : store_(store), key_(std::move(key)), size_(size) {}
  uint64_t size() const override { return size_; }
  Status ReadAt(uint64_t offset, size_t size, void* dest) const override {
    if (offset > size_ || size > size_ - offset) {
      return DataLossError(StrCat("'", key_, "' is truncated: ", size, " bytes at offset ", offset,
                                  " reach past its end at ", size_));
    }
    return store_->ReadRange(key_, offset, size, dest);
  }

 private:
  KvStore* store_;
  std::string key_;
  uint64_t size_;
};

}  // namespace

std::unique_ptr<ReadableFile> RangeReadableFile(KvStore* store, std::string key, uint64_t size) {
  return std::make_unique<StoreRangeFile>(store, std::move(key), size);
}

Result<std::unique_ptr<KvLock>> KvStore::TryLock(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  return UnimplementedError(StrCat(Describe(), " does not support locks (key '", key, "')"));
}

namespace {
constexpr char kNotAnObjectPayload[] = "tensorstash/kvstore/not-an-object";
}  // namespace

Status NotAnObjectError(std::string_view operation, std::string_view path) {
  Status status =
      NotFoundError(StrCat(operation, " '", path, "' failed: is a directory, not an object"));
  status.SetPayload(kNotAnObjectPayload, absl::Cord("1"));
  return status;
}

bool IsNotAnObject(const Status& status) {
  return absl::IsNotFound(status) && status.GetPayload(kNotAnObjectPayload).has_value();
}

Status KvStore::ExchangeDirectories(std::string_view a, std::string_view b) {
  return UnimplementedError(
      StrCat(Describe(), " cannot exchange folders ('", a, "' and '", b, "')"));
}

Result<std::unique_ptr<KvStore>> KvStore::OpenFolderView(std::string_view folder) {
  TS_RETURN_IF_ERROR(ValidateKey(folder));
  return std::unique_ptr<KvStore>(
      std::make_unique<FolderView>(std::string(folder), this, StrCat(folder, "/")));
}

KvStoreCapabilities KvStore::Capabilities() const {
  KvStoreCapabilities capabilities;
  capabilities.rename = SupportsRename();
  return capabilities;
}

Result<ListedChildren> KvStore::ListChildren(std::string_view prefix) {
  TS_RETURN_IF_ERROR(ValidatePrefix(prefix));
  TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, List(prefix));
  ListedChildren children;
  for (std::string& key : keys) {
    const size_t slash = key.find('/', prefix.size());
    if (slash == std::string::npos) {
      children.keys.push_back(std::move(key));
    } else if (children.prefixes.empty() ||
               children.prefixes.back() != std::string_view(key).substr(0, slash + 1)) {
      children.prefixes.push_back(key.substr(0, slash + 1));
    }
  }
  return children;
}

Result<std::vector<ListedObject>> KvStore::ListWithInfo(std::string_view prefix) {
  TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, List(prefix));
  std::vector<ListedObject> out;
  out.reserve(keys.size());
  for (std::string& key : keys) {
    Result<ObjectInfo> info = Stat(key);
    if (absl::IsUnimplemented(info.status())) {
      Result<uint64_t> size = Size(key);
      info = size.ok() ? Result<ObjectInfo>(ObjectInfo{*size, "", {}})
                       : Result<ObjectInfo>(size.status());
    }
    if (absl::IsNotFound(info.status())) continue;  // deleted since the listing
    TS_RETURN_IF_ERROR(info.status());
    out.push_back({std::move(key), *std::move(info)});
  }
  return out;
}

Result<ObjectInfo> KvStore::Stat(std::string_view key) {
  return UnimplementedError(StrCat(Describe(), " has no object generations (stat of '", key, "')"));
}

Status KvStore::ReadRangeAtGeneration(std::string_view key, std::string_view, uint64_t, size_t,
                                      void*) {
  return UnimplementedError(
      StrCat(Describe(), " cannot read at a generation (read of '", key, "')"));
}

Status KvStore::WriteIfAbsent(std::string_view key, std::string_view) {
  return UnimplementedError(StrCat(Describe(), " has no create-only write (write of '", key, "')"));
}

Result<std::vector<PendingWrite>> KvStore::ListPendingWrites(std::string_view /*prefix*/) {
  return std::vector<PendingWrite>{};
}

Status KvStore::AbortPendingWrite(const PendingWrite& write) {
  return UnimplementedError(
      StrCat(Describe(), " keeps no pending writes; there is none to abort for '", write.key, "'"));
}

}  // namespace tensorstash
