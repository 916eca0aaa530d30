// OcdbtKvStore and OcdbtWriter: TensorStore's OCDBT key-value database (the container of
// Orbax's default checkpoint format) read as a KvStore, and written fresh.
//
// An OCDBT database lives under a prefix of a base KvStore: `manifest.ocdbt` names the root of a
// B+tree whose nodes and out-of-line values lie in data files (normally `d/<32 hex>`). Orbax
// writes one database per process under `ocdbt.process_N/` and merges them into the top-level
// one, whose tree then points into the per-process data files; both are read here the same way.
// docs/foreign_formats.md lists what is supported and the limits.
//
// Thread-safety: OcdbtKvStore is immutable after Open apart from its node cache (guarded by a
// mutex); any number of threads may read at once. OcdbtWriter's Add/AddValue may be called from
// several threads; Finish must be called once, after they all return. The base KvStore must
// outlive both objects.
#ifndef TENSORSTASH_KVSTORE_OCDBT_OCDBT_KVSTORE_H_
#define TENSORSTASH_KVSTORE_OCDBT_OCDBT_KVSTORE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/kvstore/ocdbt/ocdbt_format.h"
#include "tensorstash/kvstore/read_only_kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// A read-only view of the latest version of an OCDBT database.
//
// Keys are the database's keys (arbitrary byte strings, up to 64 KiB): unlike other stores,
// reads do not apply ValidateKey, so that every key List returns can be read back. Every stored
// structure is verified (magic, length, crc32c, bounds) when first read; corruption is DataLoss
// naming the base key of the file and what is wrong. Data file paths that would leave the
// database root ("..", absolute, empty segments) are DataLoss too.
// The write methods return FailedPrecondition (ReadOnlyKvStore): use OcdbtWriter to create a
// database.
class OcdbtKvStore final : public ReadOnlyKvStore {
 public:
  struct Options {
    // Decoded B+tree nodes kept in memory (least recently used ones are dropped first).
    size_t node_cache_bytes = size_t{64} << 20;
  };

  // Opens the database whose manifest is `root_prefix`/manifest.ocdbt in `base` ("" = the base
  // root). Reads and checks the manifest (following a numbered manifest to the newest
  // manifest.<16 hex>) and takes its latest version. NotFound if there is no manifest; DataLoss
  // (naming the file) if it is corrupt; Unimplemented for a newer format version.
  static Result<std::unique_ptr<OcdbtKvStore>> Open(KvStore* base, std::string root_prefix,
                                                    Options options);
  static Result<std::unique_ptr<OcdbtKvStore>> Open(KvStore* base, std::string root_prefix) {
    return Open(base, std::move(root_prefix), Options());
  }

  ~OcdbtKvStore() override;

  // The latest version's generation number and the manifest's configuration.
  uint64_t generation() const { return version_.generation; }
  const ocdbt::Config& config() const { return manifest_.config; }
  // The manifest as decoded (for tools and tests); latest_version() is its last inline version.
  const ocdbt::Manifest& manifest() const { return manifest_; }
  const ocdbt::VersionRef& latest_version() const { return version_; }

  std::string Describe() const override;
  // NotFound for an absent key. DataLoss when a node or value on the way is corrupt or missing.
  Result<std::string> Read(std::string_view key) override;
  Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) override;
  Result<uint64_t> Size(std::string_view key) override;
  Result<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view key) override;
  // Every key starting with `prefix`, sorted bytewise. Visits only the subtrees that can hold
  // such keys.
  Result<std::vector<std::string>> List(std::string_view prefix) override;

  // A key of the latest version and where its value lies: inline, or `length` bytes at
  // `offset` of `file` (its path relative to the database root, base_path included).
  struct Entry {
    std::string key;
    bool is_inline = true;
    std::string inline_value;
    ocdbt::DataFileId file;
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  // Every entry, sorted by key, without reading the out-of-line values: what a database that
  // merges this one refers to (OcdbtWriter::AddReference). Errors as List and Read.
  Result<std::vector<Entry>> Entries();

  // Where a value lives; defined in the .cc.
  struct ValueRef;
  struct NodeCache;

 private:
  OcdbtKvStore(KvStore* base, std::string root, ocdbt::Manifest manifest, Options options);

  // Finds `key` in the latest version: its value, or NotFound.
  Result<ValueRef> Lookup(std::string_view key);
  Status ListNode(const ocdbt::DataFileId& file, const ocdbt::Location& location, int height,
                  const std::string& inherited_prefix, std::string_view prefix,
                  std::vector<std::string>* out);
  // The decoded node at `location` of `file`, from the cache or read and checked now.
  Result<std::shared_ptr<const ocdbt::BtreeNode>> GetNode(const ocdbt::DataFileId& file,
                                                          const ocdbt::Location& location,
                                                          int expected_height);
  // The base key of a data file, or DataLoss if its path leaves the database root.
  Result<std::string> DataFileKey(const ocdbt::DataFileId& file) const;

  KvStore* const base_;
  const std::string root_;  // "" or ends in '/'
  const ocdbt::Manifest manifest_;
  ocdbt::VersionRef version_;  // the latest
  std::unique_ptr<NodeCache> cache_;
};

// Writes a new single-version OCDBT database under a prefix of a base KvStore, readable by
// TensorStore's `ocdbt` driver. Values go straight to data files under `d/` as they are added
// (small ones, up to max_inline_value_bytes, are kept inline in the leaves); Finish writes the
// B+tree and, last, manifest.ocdbt, so the database does not exist until Finish succeeds.
class OcdbtWriter {
 public:
  struct Options {
    bool zstd = false;  // compress the manifest and B+tree nodes (values are stored as given)
    int zstd_level = 0;
    uint32_t max_inline_value_bytes = 100;
    uint32_t max_decoded_node_bytes = 8 * 1024 * 1024;    // leaves and interior nodes split above
    uint64_t target_data_file_bytes = uint64_t{1} << 30;  // a new d/ file is started past it
  };

  // A reserved place for one value: write its bytes at offsets [0, size) in any order, from any
  // number of threads (disjoint ranges). Must be fully written before Finish.
  class ValueSink {
   public:
    Status Write(uint64_t offset_in_value, const void* data, size_t size);
    uint64_t size() const { return size_; }

   private:
    friend class OcdbtWriter;
    ValueSink(OcdbtWriter* writer, WritableFile* file, uint64_t base, uint64_t size,
              std::string key)
        : writer_(writer), file_(file), base_(base), size_(size), key_(std::move(key)) {}
    OcdbtWriter* writer_;  // records a failed write, so that Finish refuses to publish
    WritableFile* file_;
    uint64_t base_;
    uint64_t size_;
    std::string key_;
  };

  // AlreadyExists if `root_prefix`/manifest.ocdbt exists; InvalidArgument for bad options.
  static Result<std::unique_ptr<OcdbtWriter>> Create(KvStore* base, std::string root_prefix,
                                                     Options options);
  static Result<std::unique_ptr<OcdbtWriter>> Create(KvStore* base, std::string root_prefix) {
    return Create(base, std::move(root_prefix), Options());
  }
  ~OcdbtWriter();

  // Adds `key` with `value` (written to a data file now, or kept inline when small).
  // InvalidArgument for an empty, over-long (> 65535 bytes) or already added key.
  Status Add(std::string_view key, std::string_view value);
  // Adds `key` with a value of `size` bytes that the caller writes through the returned sink.
  Result<ValueSink> AddValue(std::string_view key, uint64_t size);
  // Adds `key` whose value already lies in a data file of another database under this one's
  // root: `length` bytes at `offset` of `file`, a path relative to this root (e.g.
  // {"ocdbt.process_1/", "d/<32 hex>"}). Nothing is copied or checked there: how a database
  // merges per-process ones (Orbax's multi-process layout). InvalidArgument as Add, and for a
  // file path that is empty, absolute or holds "..".
  Status AddReference(std::string_view key, const ocdbt::DataFileId& file, uint64_t offset,
                      uint64_t length);
  // Syncs the data files, writes the B+tree nodes and then manifest.ocdbt, and syncs them.
  // FailedPrecondition if called twice.
  Status Finish();

 private:
  struct Entry {
    bool is_inline = false;
    std::string inline_value;
    uint32_t file = 0;  // index into data_files_
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  struct DataFile {
    std::string base_path;      // "" for this writer's own files
    std::string relative_path;  // "d/<32 hex>"
    std::unique_ptr<WritableFile> file;  // null for another database's file (AddReference)
    uint64_t size = 0;
  };

  OcdbtWriter(KvStore* base, std::string root, Options options);
  Status CheckNewKey(std::string_view key) const;  // requires mutex_
  void RecordError(const Status& status);
  // The data file to append `size` bytes to, starting a new one if needed. Requires mutex_.
  Result<uint32_t> FileForLocked(uint64_t size);

  KvStore* const base_;
  const std::string root_;
  const Options options_;
  std::mutex mutex_;
  std::map<std::string, Entry, std::less<>> entries_;  // guarded by mutex_
  std::vector<DataFile> data_files_;                   // guarded by mutex_
  int64_t open_file_ = -1;  // the own file values are appended to; guarded by mutex_
  std::map<std::string, uint32_t, std::less<>> referenced_files_;  // by full path; mutex_
  bool finished_ = false;                              // guarded by mutex_
  Status first_error_;                                 // guarded by mutex_
};

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_OCDBT_OCDBT_KVSTORE_H_
