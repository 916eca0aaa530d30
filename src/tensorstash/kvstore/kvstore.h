// KvStore: bytes by key, the storage layer under every checkpoint.
//
// A key is a relative, '/'-separated path ("step/state/index"). Keys are checked by
// ValidateKey: empty segments, "." and "..", a leading '/', and NUL bytes are InvalidArgument.
// Backends (file/, memory/) implement this interface and register a URL scheme (registry.h);
// each instantiates the one conformance suite (kvstore_conformance.h) from its own folder.
//
// The API is synchronous; the engine supplies the parallelism. All methods are thread-safe: any
// number of threads may call one KvStore at once. A WritableFile / ReadableFile may be used by
// several threads at once for disjoint byte ranges.
#ifndef TENSORSTASH_KVSTORE_KVSTORE_H_
#define TENSORSTASH_KVSTORE_KVSTORE_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/util/status.h"

namespace tensorstash {

// Checks one key. OK, or InvalidArgument quoting the key and saying what is wrong.
Status ValidateKey(std::string_view key);
// Like ValidateKey, but also accepts "" (the whole store), as used for prefixes.
Status ValidatePrefix(std::string_view prefix);

// What a backend returns when a key names a "directory" (a prefix of other keys) rather than an
// object: NotFound, as for a missing key, but marked, so that a caller that expected an object
// there (a reader of a committed file) can say it is not a regular file rather than missing.
Status NotAnObjectError(std::string_view operation, std::string_view path);
bool IsNotAnObject(const Status& status);

// A file opened for positional writes. Created empty (truncating an existing object).
class WritableFile {
 public:
  virtual ~WritableFile() = default;
  // Writes all of `data` at `offset`, growing the object as needed. On failure (including a
  // short write that cannot be completed) returns non-OK naming the key and offset.
  virtual Status WriteAt(uint64_t offset, const void* data, size_t size) = 0;
  // As WriteAt, for bytes whose CRC-32C the caller has computed already (`crc32c`). With
  // `borrowed`, the caller also promises that `data` stays valid and unchanged until Sync or
  // Close returns (or the file is destroyed). An object store may then checksum the object by
  // combining CRCs instead of reading the bytes again, and send borrowed bytes from where they
  // are instead of copying them. A wrong `crc32c` makes the upload fail (the server checks
  // it); it never changes the bytes written. Default: WriteAt.
  virtual Status WriteChunkAt(uint64_t offset, const void* data, size_t size, uint32_t crc32c,
                              bool borrowed) {
    (void)crc32c;
    (void)borrowed;
    return WriteAt(offset, data, size);
  }
  // Makes every byte written so far durable (fsync). Memory backend: marks it synced.
  virtual Status Sync() = 0;
  // A hint: start sending the bytes written so far to storage now, without waiting for them.
  // Durability still needs Sync(); what this buys is that the storage works while later bytes
  // are written, so that Sync() has little left to do. OK without effect where a backend has
  // nothing to start (the default); an error is the backend's (e.g. EIO), naming the key.
  virtual Status StartWriteback() { return OkStatus(); }
  // A hint for a file that will be synced before anyone reads it: large writes may then bypass
  // the page cache (O_DIRECT) for the part of them that covers whole 4 KiB blocks, where the
  // backend and the file system allow it. The bytes written, what a reader sees and what Sync()
  // makes durable are unchanged; so are the errors. No effect by default.
  virtual void PreferDirectWrites() {}
  // Releases the file. Further calls are FailedPrecondition. Called by the destructor if needed.
  virtual Status Close() = 0;
};

// An exclusive lock held on one key, released when the object is destroyed. Not copyable.
class KvLock {
 public:
  KvLock() = default;
  KvLock(const KvLock&) = delete;
  KvLock& operator=(const KvLock&) = delete;
  virtual ~KvLock() = default;
};

// A file opened for positional reads.
class ReadableFile {
 public:
  virtual ~ReadableFile() = default;
  // Size of the object in bytes at the time it was opened.
  virtual uint64_t size() const = 0;
  // Reads exactly `size` bytes at `offset` into `dest`. A range that reaches past the end of
  // the object is DataLoss ("... truncated ..."), naming the key, offset and size.
  virtual Status ReadAt(uint64_t offset, size_t size, void* dest) const = 0;
  // Maps `size` bytes at `offset` (a multiple of the page size) copy-on-write at `address`
  // (page-aligned), replacing whatever was mapped there: the bytes are then read from the page
  // cache as they are touched, without a copy, and writes to them stay private. DataLoss when
  // the range reaches past the end; Unimplemented for backends without mappable files (the
  // default). The mapping outlives the file object; a file truncated in place under a mapping
  // makes its pages fault (SIGBUS), which checkpoints never do: they are only ever replaced.
  virtual Status MapAt(uint64_t offset, size_t size, void* address) const;
};

// What a backend can do, for callers that choose a protocol by it (the commit protocol: rename
// or a create-only commit record; a reader: pinned views and generation-checked reads).
struct KvStoreCapabilities {
  bool rename = false;             // RenameDirectory is atomic (SupportsRename)
  bool exchange = false;           // ExchangeDirectories is atomic
  bool conditional_write = false;  // WriteIfAbsent is atomic (create-only)
  bool generations = false;        // Stat gives generations; ReadRangeAtGeneration checks them
  bool locks = false;              // TryLock
  bool mapping = false;            // ReadableFile::MapAt
  bool pinned_views = false;       // OpenFolderView pins the folder
  // Object-store semantics (S3): a file written through OpenForWrite appears whole at Sync or
  // Close, never before; there are no directories, so a key may be an object and a prefix of
  // others at once; an open ReadableFile of an object replaced since fails (FailedPrecondition)
  // instead of reading the old bytes.
  bool object_store = false;
  // A file of fewer bytes than this that OpenForWrite writes goes up in one request at Close
  // (GCS: one upload, no parts to compose and delete); 0 where no such size applies. A writer
  // that keeps its files below it saves each in one request (engine/data_file_set.h).
  uint64_t one_request_below = 0;
};

// An object's size and generation: an opaque string that changes whenever the object is
// replaced or rewritten (file: device, inode, modification time and size; memory: a counter).
struct ObjectInfo {
  uint64_t size = 0;
  std::string generation;
  // When the object was last written (file: its mtime; S3: LastModified); the epoch where the
  // backend cannot tell.
  std::chrono::system_clock::time_point modified{};
};

// One object of a listing, with what Stat would say of it (ListWithInfo).
struct ListedObject {
  std::string key;
  ObjectInfo info;
};

// A write the store began and keeps apart from its keys until it ends or is abandoned (an S3
// multipart upload): the key it is for, the store's id of it, and when it began (nullopt where
// the store cannot tell: take it as recent).
struct PendingWrite {
  std::string key;
  std::string id;
  std::optional<std::chrono::system_clock::time_point> started;
};

// The immediate children of a prefix (ListChildren): the keys right under it and the
// "sub-folders" (prefixes ending in '/') that hold more keys. Both sorted, both with the prefix.
struct ListedChildren {
  std::vector<std::string> keys;
  std::vector<std::string> prefixes;
};

class KvStore {
 public:
  virtual ~KvStore() = default;

  // What this store can do. The default: nothing optional (SupportsRename() for rename).
  virtual KvStoreCapabilities Capabilities() const;

  // A short description for messages, e.g. "file:/data/ckpt" or "memory".
  virtual std::string Describe() const = 0;

  // Reads the whole object. NotFound if it does not exist.
  virtual Result<std::string> Read(std::string_view key) = 0;
  // Reads exactly `size` bytes at `offset` into `dest` (DataLoss if the object is shorter).
  virtual Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) = 0;
  // Size in bytes; NotFound if the object does not exist.
  virtual Result<uint64_t> Size(std::string_view key) = 0;
  virtual Result<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view key) = 0;

  // Replaces the object with `value`. Parent "directories" are created as needed. The write is
  // not durable until Sync(key). File backend: written to a temporary name and renamed, so a
  // reader never sees a torn object.
  virtual Status Write(std::string_view key, std::string_view value) = 0;
  // Creates (or truncates) an object for positional writes.
  virtual Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view key) = 0;

  // Keys that start with `prefix`, sorted. A prefix that names a "directory" should end in '/'.
  virtual Result<std::vector<std::string>> List(std::string_view prefix) = 0;
  // The immediate children of `prefix` (which should be "" or end in '/'): listing with the
  // delimiter '/', as object stores do, so that a caller that wants the step folders of a root
  // does not list every data file of every step. The default groups List(prefix).
  virtual Result<ListedChildren> ListChildren(std::string_view prefix);

  // Size and generation of the object; NotFound if it does not exist. Unimplemented by default.
  virtual Result<ObjectInfo> Stat(std::string_view key);
  // The objects under `prefix`, sorted by key, each with its size, generation and time: for a
  // caller that needs all of them at once (a commit that checks every object it names, gc
  // weighing how old a folder is), in one listing where the store has one that carries them
  // (S3's ListObjectsV2). The default lists, then Stats each key (Size where Stat is
  // Unimplemented: no generation, no time); an object deleted in between is left out.
  virtual Result<std::vector<ListedObject>> ListWithInfo(std::string_view prefix);
  // Reads exactly `size` bytes at `offset` of the object at `key` if its generation is still
  // `generation` (from Stat), all from that one version; FailedPrecondition naming the key when
  // the object was replaced (a different generation), NotFound when it is gone, DataLoss when
  // the range reaches past its end. Unimplemented by default.
  virtual Status ReadRangeAtGeneration(std::string_view key, std::string_view generation,
                                       uint64_t offset, size_t size, void* dest);
  // Creates the object with `value` only if no object `key` exists: AlreadyExists otherwise,
  // and the existing object is left as it was. Atomic where Capabilities().conditional_write:
  // of two writers at once exactly one succeeds, and a reader never sees a torn object. Not
  // durable until Sync(key). Unimplemented by default.
  virtual Status WriteIfAbsent(std::string_view key, std::string_view value);
  // Deletes one object; NotFound if absent.
  // The writes begun under `prefix` and neither finished nor abandoned (the leftovers of killed
  // saves, for `tensorstash gc`). Empty for stores that keep none apart (file, memory).
  virtual Result<std::vector<PendingWrite>> ListPendingWrites(std::string_view prefix);
  // Abandons `write`, deleting what it stored; OK when it is already gone. Unimplemented for
  // stores that keep no pending writes.
  virtual Status AbortPendingWrite(const PendingWrite& write);

  virtual Status Delete(std::string_view key) = 0;
  // Deletes every key under `prefix` (and, for the file backend, the emptied directories,
  // including the directory named by `prefix` itself when it ends in '/'). Missing is OK.
  virtual Status DeletePrefix(std::string_view prefix) = 0;

  // Whether RenameDirectory is available and atomic.
  virtual bool SupportsRename() const = 0;
  // Atomically moves every key under `from` + "/" to `to` + "/". `to` must not exist
  // (AlreadyExists otherwise). Unimplemented when !SupportsRename().
  virtual Status RenameDirectory(std::string_view from, std::string_view to) = 0;

  // Atomically swaps the keys under `a` + "/" and `b` + "/" (both must exist): readers see the
  // old folder or the new one at either name, never neither. Publishing a replacement this way
  // leaves no moment without a step at its name. Unimplemented by default and where the store
  // or file system cannot (callers then fall back to two RenameDirectory calls); decorators do
  // not forward it unless they model it.
  virtual Status ExchangeDirectories(std::string_view a, std::string_view b);

  // A read-only view of folder `folder` for a reader that must see one version of it whole while
  // it may be replaced (an overwrite renames or exchanges a new folder into its place). Keys of
  // the view are the store's own ("<folder>/..."); writes through it are FailedPrecondition.
  // File backend: every key resolves under the folder's directory as opened by this call, so a
  // folder moved in later is not seen, and a file deleted from the old one later is NotFound.
  // Memory backend: the objects under the folder now. Default: the live folder, unpinned.
  // NotFound when a pinning backend finds no such folder.
  virtual Result<std::unique_ptr<KvStore>> OpenFolderView(std::string_view folder);

  // Makes the object durable: fsync of the file and of its parent directory.
  virtual Status Sync(std::string_view key) = 0;
  // Makes the directory entry list of `dir` durable (fsync of the directory; "" = the root).
  virtual Status SyncDirectory(std::string_view dir) = 0;

  // Takes an exclusive lock named by `key` without waiting; the lock is held until the returned
  // object is destroyed. FailedPrecondition ("... is locked by another manager ...") when it is
  // already held, by this process or (file backend) another one on the same machine. File
  // backend: flock() on the file `key`, created empty if missing and left in place; the kernel
  // releases it when the holder dies, so a crash never leaves a stale lock. Memory backend: a
  // set of held keys. The default (for decorators and stores without locks) is Unimplemented.
  virtual Result<std::unique_ptr<KvLock>> TryLock(std::string_view key);
};

// A file of `size` bytes whose reads are `store`->ReadRange(key, ...), after a bounds check (a
// range past `size` is DataLoss naming the key): for stores without files of their own (a
// peer over HTTP). `store` must outlive the file.
std::unique_ptr<ReadableFile> RangeReadableFile(KvStore* store, std::string key, uint64_t size);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_KVSTORE_H_
