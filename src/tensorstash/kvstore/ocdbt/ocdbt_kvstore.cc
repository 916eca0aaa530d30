// Reading: the manifest names the latest version's root node; a lookup walks down from it.
// Each node's keys are relative to the prefix its parents contributed (the first
// subtree_prefix_length bytes of each entry key on the way down), and each node names its data
// files relative to the base path of the file it was read from. Node heights must fall by one
// at each step, so a hostile tree cannot loop. Decoded nodes are kept in an LRU cache.
//
// Writing: values are appended to data files as they are added; Finish lays the sorted keys out
// in leaves no larger than max_decoded_node_bytes, builds interior levels over them until one
// root remains, appends all nodes to one node file, and writes manifest.ocdbt last. Interior
// entries carry full keys (subtree_prefix_length 0), which every reader accepts.
#include "tensorstash/kvstore/ocdbt/ocdbt_kvstore.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <list>
#include <unordered_map>
#include <utility>

#include "tensorstash/util/random_id.h"

namespace tensorstash {

using ocdbt::BtreeNode;
using ocdbt::DataFileId;
using ocdbt::Location;

namespace {

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

// "" or "a/b/" from "", "a/b" or "a/b/".
Result<std::string> NormalizeRoot(std::string root) {
  while (!root.empty() && root.back() == '/') root.pop_back();
  if (root.empty()) return root;
  TS_RETURN_IF_ERROR(ValidateKey(root));
  root.push_back('/');
  return root;
}

// A value held in memory (inline values).
class StringReadableFile final : public ReadableFile {
 public:
  StringReadableFile(std::string data, std::string key)
      : data_(std::move(data)), key_(std::move(key)) {}
  uint64_t size() const override { return data_.size(); }
  Status ReadAt(uint64_t offset, size_t size, void* dest) const override {
    if (offset > data_.size() || size > data_.size() - offset) {
      return DataLossError(StrCat("OCDBT key '", key_, "': read of ", size, " bytes at ", offset,
                                  " is truncated (value has ", data_.size(), ")"));
    }
    if (size > 0) std::memcpy(dest, data_.data() + offset, size);
    return OkStatus();
  }

 private:
  std::string data_;
  std::string key_;
};

// A value that is a byte range of a data file.
class SliceReadableFile final : public ReadableFile {
 public:
  SliceReadableFile(std::unique_ptr<ReadableFile> file, uint64_t offset, uint64_t length,
                    std::string key)
      : file_(std::move(file)), offset_(offset), length_(length), key_(std::move(key)) {}
  uint64_t size() const override { return length_; }
  Status ReadAt(uint64_t offset, size_t size, void* dest) const override {
    if (offset > length_ || size > length_ - offset) {
      return DataLossError(StrCat("OCDBT key '", key_, "': read of ", size, " bytes at ", offset,
                                  " is truncated (value has ", length_, ")"));
    }
    return file_->ReadAt(offset_ + offset, size, dest);
  }

 private:
  std::unique_ptr<ReadableFile> file_;
  uint64_t offset_;
  uint64_t length_;
  std::string key_;
};

}  // namespace

struct OcdbtKvStore::ValueRef {
  bool is_inline = true;
  std::string inline_value;
  DataFileId file;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct OcdbtKvStore::NodeCache {
  struct Item {
    std::shared_ptr<const BtreeNode> node;
    size_t bytes;
    std::list<std::string>::iterator lru_position;
  };
  explicit NodeCache(size_t budget) : budget_bytes(budget) {}

  std::shared_ptr<const BtreeNode> Get(const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = items.find(key);
    if (it == items.end()) return nullptr;
    lru.splice(lru.begin(), lru, it->second.lru_position);
    return it->second.node;
  }

  void Put(const std::string& key, std::shared_ptr<const BtreeNode> node) {
    const size_t bytes = node->MemoryBytes() + key.size();
    std::lock_guard<std::mutex> lock(mutex);
    if (items.count(key) != 0) return;  // another thread decoded it too
    lru.push_front(key);
    items.emplace(key, Item{std::move(node), bytes, lru.begin()});
    used_bytes += bytes;
    // Keep at least the newest node, whatever its size: lookups need it right now anyway.
    while (used_bytes > budget_bytes && lru.size() > 1) {
      auto last = items.find(lru.back());
      used_bytes -= last->second.bytes;
      items.erase(last);
      lru.pop_back();
    }
  }

  const size_t budget_bytes;
  std::mutex mutex;
  size_t used_bytes = 0;                        // guarded by mutex
  std::list<std::string> lru;                   // guarded by mutex; most recent first
  std::unordered_map<std::string, Item> items;  // guarded by mutex
};

OcdbtKvStore::OcdbtKvStore(KvStore* base, std::string root, ocdbt::Manifest manifest,
                           Options options)
    : ReadOnlyKvStore("the OCDBT store", "use OcdbtWriter to create one"),
      base_(base),
      root_(std::move(root)),
      manifest_(std::move(manifest)),
      version_(manifest_.versions.back()),
      cache_(std::make_unique<NodeCache>(options.node_cache_bytes)) {}

OcdbtKvStore::~OcdbtKvStore() = default;

Result<std::unique_ptr<OcdbtKvStore>> OcdbtKvStore::Open(KvStore* base, std::string root_prefix,
                                                         Options options) {
  if (base == nullptr) return InvalidArgumentError("OcdbtKvStore::Open: base store is null");
  TS_ASSIGN_OR_RETURN(std::string root, NormalizeRoot(std::move(root_prefix)));

  // Reads and decodes one manifest file, bounding its size before reading it.
  auto read_manifest = [&](const std::string& key) -> Result<ocdbt::Manifest> {
    TS_ASSIGN_OR_RETURN(uint64_t size, base->Size(key));
    const std::string what = StrCat("OCDBT manifest ", base->Describe(), " '", key, "'");
    if (size > ocdbt::kMaxEncodedBytes) {
      return DataLossError(StrCat(what, ": ", size, " bytes is implausibly large"));
    }
    TS_ASSIGN_OR_RETURN(std::string encoded, base->Read(key));
    return ocdbt::DecodeManifest(encoded, what);
  };

  const std::string manifest_key = StrCat(root, ocdbt::kManifestKey);
  TS_ASSIGN_OR_RETURN(ocdbt::Manifest manifest, read_manifest(manifest_key));
  if (manifest.config.manifest_kind == 1) {
    // Numbered manifests: the config lives in manifest.ocdbt, the versions in the newest
    // manifest.<16 lowercase hex digits of its latest generation>.
    TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, base->List(StrCat(root, "manifest.")));
    std::string newest;
    for (const std::string& key : keys) {
      const std::string_view name = std::string_view(key).substr(root.size());
      if (name.size() != 9 + 16 || !StartsWith(name, "manifest.")) continue;
      if (name.find_first_not_of("0123456789abcdef", 9) != std::string_view::npos) continue;
      newest = std::max(newest, key);
    }
    if (newest.empty()) {
      return DataLossError(StrCat("OCDBT database ", base->Describe(), " '", root,
                                  "' uses numbered manifests but has no manifest.<generation>"));
    }
    TS_ASSIGN_OR_RETURN(ocdbt::Manifest numbered, read_manifest(newest));
    if (numbered.config.manifest_kind != 0 || numbered.config.uuid != manifest.config.uuid) {
      return DataLossError(StrCat("OCDBT manifest '", newest,
                                  "' does not hold the versions of database '", root, "'"));
    }
    manifest = std::move(numbered);
  }
  return std::unique_ptr<OcdbtKvStore>(
      new OcdbtKvStore(base, std::move(root), std::move(manifest), options));
}

std::string OcdbtKvStore::Describe() const {
  return StrCat("ocdbt:", base_->Describe(), root_.empty() ? "" : "/", root_);
}

Result<std::string> OcdbtKvStore::DataFileKey(const DataFileId& file) const {
  const std::string path = file.FullPath();
  const Status valid = ValidateKey(path);
  if (!valid.ok()) {
    return DataLossError(StrCat("OCDBT database ", Describe(), " names data file '", path,
                                "', which is not a safe relative path: ", valid.message()));
  }
  return StrCat(root_, path);
}

Result<std::shared_ptr<const BtreeNode>> OcdbtKvStore::GetNode(const DataFileId& file,
                                                               const Location& location,
                                                               int expected_height) {
  TS_ASSIGN_OR_RETURN(std::string key, DataFileKey(file));
  const std::string cache_key =
      StrCat(key, '\0', file.base_path.size(), ':', location.offset, ':', location.length);
  std::shared_ptr<const BtreeNode> node = cache_->Get(cache_key);
  const std::string what = StrCat("OCDBT B+tree node in ", base_->Describe(), " '", key, "' at [",
                                  location.offset, ", +", location.length, ")");
  if (node == nullptr) {
    if (location.length > ocdbt::kMaxEncodedBytes) {
      return DataLossError(StrCat(what, ": implausibly large node"));
    }
    Result<uint64_t> size = base_->Size(key);
    if (absl::IsNotFound(size.status())) {
      return DataLossError(StrCat(what, ": the data file is missing"));
    }
    if (!size.ok()) return size.status();
    if (location.offset > *size || location.length > *size - location.offset) {
      return DataLossError(StrCat(what, ": past the end of the file (", *size, " bytes)"));
    }
    std::string encoded(location.length, '\0');
    TS_RETURN_IF_ERROR(base_->ReadRange(key, location.offset, encoded.size(), encoded.data()));
    TS_ASSIGN_OR_RETURN(BtreeNode decoded, ocdbt::DecodeBtreeNode(encoded, file.base_path, what));
    node = std::make_shared<const BtreeNode>(std::move(decoded));
    cache_->Put(cache_key, node);
  }
  if (node->height != expected_height) {
    return DataLossError(
        StrCat(what, ": height ", int{node->height}, " where ", expected_height, " was expected"));
  }
  return node;
}

Result<OcdbtKvStore::ValueRef> OcdbtKvStore::Lookup(std::string_view key) {
  // Keys as every store takes them (kvstore.h), although OCDBT could hold any bytes: a "../"
  // or an empty segment is the caller's mistake here too.
  TS_RETURN_IF_ERROR(ValidateKey(key));
  auto not_found = [&] {
    return NotFoundError(StrCat("key '", key, "' not found in ", Describe()));
  };
  if (version_.root.missing()) return not_found();
  DataFileId file = manifest_.files[version_.root.file];
  Location location = version_.root;
  int height = version_.root_height;
  std::string prefix;
  for (;;) {
    TS_ASSIGN_OR_RETURN(std::shared_ptr<const BtreeNode> node, GetNode(file, location, height));
    if (!StartsWith(key, prefix)) return not_found();
    const std::string_view relative = key.substr(prefix.size());
    if (height == 0) {
      auto it =
          std::lower_bound(node->leaves.begin(), node->leaves.end(), relative,
                           [](const ocdbt::LeafEntry& e, std::string_view k) { return e.key < k; });
      if (it == node->leaves.end() || it->key != relative) return not_found();
      ValueRef ref;
      ref.is_inline = it->is_inline;
      if (it->is_inline) {
        ref.inline_value = it->inline_value;
      } else {
        ref.file = node->files[it->location.file];
        ref.offset = it->location.offset;
        ref.length = it->location.length;
      }
      return ref;
    }
    // The child whose key is the last one <= relative.
    auto it = std::upper_bound(
        node->children.begin(), node->children.end(), relative,
        [](std::string_view k, const ocdbt::InteriorEntry& e) { return k < e.key; });
    if (it == node->children.begin()) return not_found();
    --it;
    prefix.append(it->key, 0, it->subtree_prefix_length);
    file = node->files[it->location.file];
    location = it->location;
    --height;
  }
}

Status OcdbtKvStore::ListNode(const DataFileId& file, const Location& location, int height,
                              const std::string& inherited, std::string_view prefix,
                              std::vector<std::string>* out) {
  TS_ASSIGN_OR_RETURN(std::shared_ptr<const BtreeNode> node, GetNode(file, location, height));
  if (height == 0) {
    // Entries are sorted: start at the first key >= prefix and stop at the first one past it,
    // so that listing one array's keys does not scan a whole leaf of other arrays' keys.
    const auto& leaves = node->leaves;
    auto first = std::lower_bound(
        leaves.begin(), leaves.end(), prefix,
        [&](const ocdbt::LeafEntry& e, std::string_view p) { return inherited + e.key < p; });
    for (auto it = first; it != leaves.end(); ++it) {
      std::string key = inherited + it->key;
      if (!StartsWith(key, prefix)) break;
      out->push_back(std::move(key));
    }
    return OkStatus();
  }
  const auto& children = node->children;
  for (size_t i = 0; i < children.size(); ++i) {
    const ocdbt::InteriorEntry& child = children[i];
    // The child holds keys in [inherited + key[i], inherited + key[i + 1]).
    if (i + 1 < children.size() && inherited + children[i + 1].key <= prefix) continue;
    const std::string lower = inherited + child.key;
    if (lower > prefix && !StartsWith(lower, prefix)) break;  // this and all later are past it
    std::string child_prefix = inherited + child.key.substr(0, child.subtree_prefix_length);
    if (!StartsWith(child_prefix, prefix) && !StartsWith(prefix, child_prefix)) continue;
    TS_RETURN_IF_ERROR(ListNode(node->files[child.location.file], child.location, height - 1,
                                child_prefix, prefix, out));
  }
  return OkStatus();
}

Result<std::string> OcdbtKvStore::Read(std::string_view key) {
  TS_ASSIGN_OR_RETURN(ValueRef ref, Lookup(key));
  if (ref.is_inline) return std::move(ref.inline_value);
  TS_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, OpenForRead(key));
  if (file->size() > std::numeric_limits<size_t>::max() / 2) {
    return ResourceExhaustedError(StrCat("OCDBT key '", key, "' is too large to read whole"));
  }
  std::string value(file->size(), '\0');
  TS_RETURN_IF_ERROR(file->ReadAt(0, value.size(), value.data()));
  return value;
}

Status OcdbtKvStore::ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, OpenForRead(key));
  return file->ReadAt(offset, size, dest);
}

Result<uint64_t> OcdbtKvStore::Size(std::string_view key) {
  TS_ASSIGN_OR_RETURN(ValueRef ref, Lookup(key));
  return ref.is_inline ? ref.inline_value.size() : ref.length;
}

Result<std::unique_ptr<ReadableFile>> OcdbtKvStore::OpenForRead(std::string_view key) {
  TS_ASSIGN_OR_RETURN(ValueRef ref, Lookup(key));
  if (ref.is_inline) {
    return std::unique_ptr<ReadableFile>(
        new StringReadableFile(std::move(ref.inline_value), std::string(key)));
  }
  TS_ASSIGN_OR_RETURN(std::string data_key, DataFileKey(ref.file));
  Result<std::unique_ptr<ReadableFile>> file = base_->OpenForRead(data_key);
  if (absl::IsNotFound(file.status())) {
    return DataLossError(StrCat("OCDBT key '", key, "' in ", Describe(), ": its data file '",
                                data_key, "' is missing"));
  }
  if (!file.ok()) return file.status();
  const uint64_t file_size = (*file)->size();
  if (ref.offset > file_size || ref.length > file_size - ref.offset) {
    return DataLossError(StrCat("OCDBT key '", key, "' in ", Describe(), ": value [", ref.offset,
                                ", +", ref.length, ") lies past the end of '", data_key, "' (",
                                file_size, " bytes)"));
  }
  return std::unique_ptr<ReadableFile>(
      new SliceReadableFile(std::move(*file), ref.offset, ref.length, std::string(key)));
}

Result<std::vector<std::string>> OcdbtKvStore::List(std::string_view prefix) {
  TS_RETURN_IF_ERROR(ValidatePrefix(prefix));
  std::vector<std::string> keys;
  if (version_.root.missing()) return keys;
  TS_RETURN_IF_ERROR(ListNode(manifest_.files[version_.root.file], version_.root,
                              version_.root_height, "", prefix, &keys));
  return keys;
}

Result<std::vector<OcdbtKvStore::Entry>> OcdbtKvStore::Entries() {
  TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, List(""));
  std::vector<Entry> entries;
  entries.reserve(keys.size());
  for (std::string& key : keys) {
    TS_ASSIGN_OR_RETURN(ValueRef ref, Lookup(key));
    Entry entry;
    entry.key = std::move(key);
    entry.is_inline = ref.is_inline;
    entry.inline_value = std::move(ref.inline_value);
    entry.file = std::move(ref.file);
    entry.offset = ref.offset;
    entry.length = ref.length;
    entries.push_back(std::move(entry));
  }
  return entries;
}

// ---------------------------------------------------------------------------------------------
// OcdbtWriter

Status OcdbtWriter::ValueSink::Write(uint64_t offset_in_value, const void* data, size_t size) {
  if (offset_in_value > size_ || size > size_ - offset_in_value) {
    return InvalidArgumentError(StrCat("OCDBT value '", key_, "': write of ", size, " bytes at ",
                                       offset_in_value, " exceeds its size ", size_));
  }
  Status status = file_->WriteAt(base_ + offset_in_value, data, size);
  if (!status.ok()) {
    status = Annotate(status, StrCat("OCDBT value '", key_, "'"));
    writer_->RecordError(status);
  }
  return status;
}

OcdbtWriter::OcdbtWriter(KvStore* base, std::string root, Options options)
    : base_(base), root_(std::move(root)), options_(options) {}

OcdbtWriter::~OcdbtWriter() = default;

void OcdbtWriter::RecordError(const Status& status) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (first_error_.ok()) first_error_ = status;
}

Result<std::unique_ptr<OcdbtWriter>> OcdbtWriter::Create(KvStore* base, std::string root_prefix,
                                                         Options options) {
  if (base == nullptr) return InvalidArgumentError("OcdbtWriter::Create: base store is null");
  TS_ASSIGN_OR_RETURN(std::string root, NormalizeRoot(std::move(root_prefix)));
  if (options.max_inline_value_bytes > ocdbt::kMaxInlineValueLength) {
    return InvalidArgumentError(StrCat("max_inline_value_bytes ", options.max_inline_value_bytes,
                                       " exceeds ", ocdbt::kMaxInlineValueLength));
  }
  if (options.max_decoded_node_bytes < 4096 ||
      options.max_decoded_node_bytes > ocdbt::kMaxDecodedBytes) {
    return InvalidArgumentError(StrCat("max_decoded_node_bytes ", options.max_decoded_node_bytes,
                                       " is outside [4096, ", ocdbt::kMaxDecodedBytes, "]"));
  }
  const std::string manifest_key = StrCat(root, ocdbt::kManifestKey);
  Result<uint64_t> existing = base->Size(manifest_key);
  if (existing.ok()) {
    return AlreadyExistsError(
        StrCat("an OCDBT database already exists at ", base->Describe(), " '", manifest_key, "'"));
  }
  if (!absl::IsNotFound(existing.status())) return existing.status();
  return std::unique_ptr<OcdbtWriter>(new OcdbtWriter(base, std::move(root), options));
}

Status OcdbtWriter::CheckNewKey(std::string_view key) const {
  if (finished_) return FailedPreconditionError("OcdbtWriter: Add after Finish");
  if (key.empty()) return InvalidArgumentError("OCDBT keys must not be empty");
  if (key.size() > ocdbt::kMaxKeyLength) {
    return InvalidArgumentError(
        StrCat("OCDBT key of ", key.size(), " bytes exceeds the limit ", ocdbt::kMaxKeyLength));
  }
  if (entries_.count(key) != 0) {
    return InvalidArgumentError(StrCat("OCDBT key '", key, "' was already added"));
  }
  return OkStatus();
}

Result<uint32_t> OcdbtWriter::FileForLocked(uint64_t size) {
  if (open_file_ < 0 ||
      (data_files_[open_file_].size > 0 &&
       data_files_[open_file_].size + size > options_.target_data_file_bytes)) {
    DataFile file;
    file.relative_path = StrCat("d/", RandomHexId(32));
    TS_ASSIGN_OR_RETURN(file.file, base_->OpenForWrite(StrCat(root_, file.relative_path)));
    data_files_.push_back(std::move(file));
    open_file_ = static_cast<int64_t>(data_files_.size() - 1);
  }
  return static_cast<uint32_t>(open_file_);
}

Status OcdbtWriter::AddReference(std::string_view key, const ocdbt::DataFileId& file,
                                 uint64_t offset, uint64_t length) {
  const std::string path = file.FullPath();
  // The file must stay under this database's root, as a reader requires (DataFileKey).
  if (path.empty() || path.front() == '/' || !ValidateKey(path).ok()) {
    return InvalidArgumentError(
        StrCat("OCDBT key '", key, "': '", path, "' is not a data file path under the root"));
  }
  if (offset > std::numeric_limits<uint64_t>::max() - length) {
    return InvalidArgumentError(StrCat("OCDBT key '", key, "': value range overflows"));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  TS_RETURN_IF_ERROR(CheckNewKey(key));
  auto [it, added] = referenced_files_.emplace(path, static_cast<uint32_t>(data_files_.size()));
  if (added) {
    DataFile referenced;
    referenced.base_path = file.base_path;
    referenced.relative_path = file.relative_path;
    data_files_.push_back(std::move(referenced));
  }
  Entry entry;
  entry.is_inline = false;
  entry.file = it->second;
  entry.offset = offset;
  entry.length = length;
  entries_.emplace(std::string(key), entry);
  return OkStatus();
}

Status OcdbtWriter::Add(std::string_view key, std::string_view value) {
  if (value.size() <= options_.max_inline_value_bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    TS_RETURN_IF_ERROR(CheckNewKey(key));
    Entry entry;
    entry.is_inline = true;
    entry.inline_value.assign(value);
    entries_.emplace(std::string(key), std::move(entry));
    return OkStatus();
  }
  TS_ASSIGN_OR_RETURN(ValueSink sink, AddValue(key, value.size()));
  return sink.Write(0, value.data(), value.size());
}

Result<OcdbtWriter::ValueSink> OcdbtWriter::AddValue(std::string_view key, uint64_t size) {
  std::lock_guard<std::mutex> lock(mutex_);
  TS_RETURN_IF_ERROR(CheckNewKey(key));
  TS_ASSIGN_OR_RETURN(uint32_t index, FileForLocked(size));
  DataFile& file = data_files_[index];
  Entry entry;
  entry.is_inline = false;
  entry.file = index;
  entry.offset = file.size;
  entry.length = size;
  file.size += size;
  entries_.emplace(std::string(key), entry);
  return ValueSink(this, file.file.get(), entry.offset, size, std::string(key));
}

namespace {

// Upper bounds of what an entry adds to an encoded node, for deciding where to split.
size_t LeafEntryBytes(std::string_view key, size_t inline_bytes) {
  return key.size() + inline_bytes + 4 * 10;
}
size_t InteriorEntryBytes(std::string_view key) { return key.size() + 9 * 10; }

// A finished node as its parent sees it.
struct ChildRef {
  std::string first_key;
  uint64_t offset = 0;
  uint64_t length = 0;
  ocdbt::Statistics statistics;
};

// Appends encoded nodes to the node data file.
class NodeFileWriter {
 public:
  NodeFileWriter(WritableFile* file, const ocdbt::Config& config) : file_(file), config_(config) {}
  Result<ChildRef> Append(const BtreeNode& node, std::string first_key,
                          ocdbt::Statistics statistics) {
    TS_ASSIGN_OR_RETURN(std::string encoded, ocdbt::EncodeBtreeNode(node, config_));
    TS_RETURN_IF_ERROR(file_->WriteAt(offset_, encoded.data(), encoded.size()));
    ChildRef ref;
    ref.first_key = std::move(first_key);
    ref.offset = offset_;
    ref.length = encoded.size();
    statistics.num_tree_bytes += encoded.size();
    ref.statistics = statistics;
    offset_ += encoded.size();
    return ref;
  }

 private:
  WritableFile* file_;
  const ocdbt::Config& config_;
  uint64_t offset_ = 0;
};

}  // namespace

Status OcdbtWriter::Finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (finished_) return FailedPreconditionError("OcdbtWriter::Finish called twice");
  finished_ = true;
  if (!first_error_.ok()) {
    return Annotate(first_error_, "OcdbtWriter::Finish: an earlier value write failed");
  }
  for (DataFile& file : data_files_) {
    if (file.file == nullptr) continue;  // another database's, written and synced there
    TS_RETURN_IF_ERROR(file.file->Sync());
    TS_RETURN_IF_ERROR(file.file->Close());
    TS_RETURN_IF_ERROR(base_->Sync(StrCat(root_, file.relative_path)));
  }

  ocdbt::Config config;
  const std::string uuid_hex = RandomHexId(32);
  for (size_t i = 0; i < 16; ++i) {
    config.uuid[i] = static_cast<uint8_t>(std::stoi(uuid_hex.substr(2 * i, 2), nullptr, 16));
  }
  config.max_inline_value_bytes = options_.max_inline_value_bytes;
  config.max_decoded_node_bytes = options_.max_decoded_node_bytes;
  config.zstd = options_.zstd;
  config.zstd_level = options_.zstd_level;

  const std::string node_path = StrCat("d/", RandomHexId(32));
  TS_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> node_file,
                      base_->OpenForWrite(StrCat(root_, node_path)));
  NodeFileWriter nodes(node_file.get(), config);
  const size_t budget = options_.max_decoded_node_bytes;

  // Leaves, each naming only the value files it uses.
  std::vector<ChildRef> level;
  {
    BtreeNode leaf;
    std::vector<int64_t> local_index(data_files_.size(), -1);
    std::vector<uint32_t> used_files;
    ocdbt::Statistics stats;
    size_t bytes = 0;
    auto flush = [&]() -> Status {
      if (leaf.leaves.empty()) return OkStatus();
      stats.num_keys = leaf.leaves.size();
      std::string first_key = leaf.leaves.front().key;
      TS_ASSIGN_OR_RETURN(ChildRef ref, nodes.Append(leaf, std::move(first_key), stats));
      level.push_back(std::move(ref));
      for (uint32_t global : used_files) local_index[global] = -1;
      used_files.clear();
      leaf = BtreeNode();
      stats = ocdbt::Statistics();
      bytes = 0;
      return OkStatus();
    };
    for (auto& [key, entry] : entries_) {
      size_t add = LeafEntryBytes(key, entry.is_inline ? entry.inline_value.size() : 0);
      if (!entry.is_inline && local_index[entry.file] < 0) {
        add += data_files_[entry.file].base_path.size() +
               data_files_[entry.file].relative_path.size() + 3 * 10;
      }
      if (!leaf.leaves.empty() &&
          (bytes + add > budget || leaf.leaves.size() >= ocdbt::kMaxNodeArity)) {
        TS_RETURN_IF_ERROR(flush());
        add = LeafEntryBytes(key, entry.is_inline ? entry.inline_value.size() : 0) +
              (entry.is_inline ? 0
                               : data_files_[entry.file].base_path.size() +
                                     data_files_[entry.file].relative_path.size() + 3 * 10);
      }
      bytes += add;
      ocdbt::LeafEntry e;
      e.key = key;
      e.is_inline = entry.is_inline;
      if (entry.is_inline) {
        e.inline_value = entry.inline_value;
      } else {
        if (local_index[entry.file] < 0) {
          local_index[entry.file] = static_cast<int64_t>(leaf.files.size());
          leaf.files.push_back(DataFileId{data_files_[entry.file].base_path,
                                          data_files_[entry.file].relative_path});
          used_files.push_back(entry.file);
        }
        e.location.file = static_cast<uint32_t>(local_index[entry.file]);
        e.location.offset = entry.offset;
        e.location.length = entry.length;
        stats.num_indirect_value_bytes += entry.length;
      }
      leaf.leaves.push_back(std::move(e));
    }
    TS_RETURN_IF_ERROR(flush());
  }

  // Interior levels until a single root remains. All nodes live in the node file (index 0).
  int root_height = 0;
  while (level.size() > 1) {
    std::vector<ChildRef> parents;
    BtreeNode node;
    node.height = static_cast<uint8_t>(root_height + 1);
    node.files.push_back(DataFileId{"", node_path});
    ocdbt::Statistics stats;
    size_t bytes = node_path.size() + 16;
    auto flush = [&]() -> Status {
      if (node.children.empty()) return OkStatus();
      std::string first_key = node.children.front().key;
      TS_ASSIGN_OR_RETURN(ChildRef ref, nodes.Append(node, std::move(first_key), stats));
      parents.push_back(std::move(ref));
      node.children.clear();
      stats = ocdbt::Statistics();
      bytes = node_path.size() + 16;
      return OkStatus();
    };
    for (ChildRef& child : level) {
      const size_t add = InteriorEntryBytes(child.first_key);
      if (!node.children.empty() &&
          (bytes + add > budget || node.children.size() >= ocdbt::kMaxNodeArity)) {
        TS_RETURN_IF_ERROR(flush());
      }
      bytes += add;
      ocdbt::InteriorEntry e;
      e.key = std::move(child.first_key);
      e.subtree_prefix_length = 0;
      e.location = Location{0, child.offset, child.length};
      e.statistics = child.statistics;
      stats.num_keys += child.statistics.num_keys;
      stats.num_tree_bytes += child.statistics.num_tree_bytes;
      stats.num_indirect_value_bytes += child.statistics.num_indirect_value_bytes;
      node.children.push_back(std::move(e));
    }
    TS_RETURN_IF_ERROR(flush());
    if (parents.size() >= level.size()) {
      return InternalError("OcdbtWriter: interior level did not shrink (node budget too small)");
    }
    level = std::move(parents);
    ++root_height;
    if (root_height > 255) return InternalError("OcdbtWriter: B+tree too tall");
  }
  TS_RETURN_IF_ERROR(node_file->Sync());
  TS_RETURN_IF_ERROR(node_file->Close());
  TS_RETURN_IF_ERROR(base_->Sync(StrCat(root_, node_path)));

  ocdbt::Manifest manifest;
  manifest.config = config;
  manifest.files.push_back(DataFileId{"", node_path});
  ocdbt::VersionRef version;
  version.generation = 1;
  version.commit_time_ns =
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count());
  if (level.empty()) {
    version.root.offset = ~uint64_t{0};  // an empty tree
    version.root.length = ~uint64_t{0};
  } else {
    version.root_height = static_cast<uint8_t>(root_height);
    version.root = Location{0, level[0].offset, level[0].length};
    version.statistics = level[0].statistics;
  }
  manifest.versions.push_back(version);
  TS_ASSIGN_OR_RETURN(std::string encoded, ocdbt::EncodeManifest(manifest));
  const std::string manifest_key = StrCat(root_, ocdbt::kManifestKey);
  TS_RETURN_IF_ERROR(base_->Write(manifest_key, encoded));
  return base_->Sync(manifest_key);
}

}  // namespace tensorstash
