// OrbaxReader: an Orbax PyTree checkpoint item, or a zarr group of pytree arrays, as a
// StepSource.
//
// Orbax (orbax-checkpoint 0.12's PyTreeCheckpointHandler / StandardCheckpointHandler) writes an
// item folder with `_METADATA` (JSON: one entry per leaf with its key path and value type) and
// the arrays as zarr v3 or v2 arrays named by the leaf's keys joined with '.', either as keys of
// an OCDBT database rooted at the folder (`manifest.ocdbt`, `d/`, `ocdbt.process_N/`) or as one
// zarr folder per parameter. Open rebuilds the pytree from `_METADATA` (dicts and custom nodes
// become dicts, lists and tuples become lists, as Orbax restores them without a target), opens
// every array's zarr metadata and reads scalars (0-d arrays with value type "scalar") and
// strings (`_strings.json`) into the tree. The zarr-group layout (see docs/foreign_formats.md)
// has no tree: it is rebuilt from the array names, which are jax.tree_util.keystr paths.
//
// Thread-safety: after Open, const methods, ReadMany and Verify may run on several threads.
#ifndef TENSORSTASH_CHECKPOINT_ORBAX_READER_H_
#define TENSORSTASH_CHECKPOINT_ORBAX_READER_H_

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tensorstash/engine/step_source.h"
#include "tensorstash/format/zarr/zarr_array.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/ocdbt/ocdbt_kvstore.h"
#include "tensorstash/util/staging_pool.h"
#include "tensorstash/util/thread_pool.h"

namespace tensorstash {

// Counts the bytes and calls of reads passed to a base store (ReadStats of foreign reads; reads
// that run at the same time are all counted in each one's statistics).
class CountingKvStore final : public ForwardingKvStore {
 public:
  explicit CountingKvStore(KvStore* base) : ForwardingKvStore(base) {}
  Result<std::string> Read(std::string_view key) override;
  Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) override;
  uint64_t bytes() const { return bytes_.load(); }
  uint64_t requests() const { return requests_.load(); }

 private:
  std::atomic<uint64_t> bytes_{0};
  std::atomic<uint64_t> requests_{0};
};

class OrbaxReader final : public StepSource {
 public:
  // Opens folder `dir` of `kv` as `format` (kOrbaxOcdbt, kOrbaxFolders or kZarrGroup; see
  // DetectStepFormat). DataLoss naming the file for corrupt or malformed metadata (_METADATA,
  // _strings.json, manifest.ocdbt and the B+tree, zarr metadata), NotFound naming the array when
  // a leaf's zarr array is missing, FailedPrecondition for a zarr group without its
  // `write_completed` attribute (an incomplete save), Unimplemented for value types, dtypes or
  // codecs this reader lacks.
  static Result<std::unique_ptr<OrbaxReader>> Open(KvStore* kv, std::string dir, StepFormat format,
                                                   ReaderOptions options = {});
  ~OrbaxReader() override;

  StepFormat format() const override { return format_; }
  const std::string& dir() const override { return dir_; }
  const TreeNode& tree() const override { return tree_; }
  const std::vector<ArrayMetadata>& arrays() const override { return metadata_; }
  uint64_t StoredBytes(size_t id) const override;
  int64_t NumChunks(size_t id) const override;
  std::string CodecDescription(size_t id) const override;
  int64_t created_unix_ms() const override { return created_unix_ms_; }
  int process_count() const override { return process_count_; }
  Status ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats,
                  const std::function<void(uint64_t, uint64_t)>& progress) override;
  Result<std::string> ReadFile(std::string_view name) const override;
  Result<std::vector<BadChunk>> Verify(
      const std::function<void(uint64_t, uint64_t)>& progress) override;
  uint64_t VerifyTotalBytes() const override;
  size_t VerifyTotalItems() const override;

  // The zarr array behind array `id` (its prefix is the key inside the OCDBT database, or the
  // folder under the base store).
  const ZarrArray& zarr_array(size_t id) const { return *zarr_[id]; }

 private:
  struct Builder;
  OrbaxReader(KvStore* kv, std::string dir, StepFormat format, ReaderOptions options);
  Status LoadOrbax();
  Status LoadZarrGroup();
  // Turns the collected leaves into tree_, opening arrays and reading scalars.
  Status Finish(Builder& root);
  // Lists each array's stored chunks once (sizes for StoredBytes/NumChunks; a listing error
  // leaves zeros: these are for display).
  void ListStored() const;
  std::string ArrayWhat(size_t id) const;
  // InvalidArgument when `array`'s grid has more chunks than the checkpoint could have stored
  // (more than 2^20, and more than its stored bytes): hostile metadata that would make a reader
  // walk billions of chunks.
  Status CheckGridIsPlausible(const ZarrArray& array, const std::string& where);

  KvStore* const base_;
  const std::string dir_;
  const StepFormat format_;
  ReaderOptions options_;
  std::unique_ptr<OcdbtKvStore> ocdbt_;
  std::unique_ptr<CountingKvStore> counting_;  // over ocdbt_ or base_: what arrays read from
  std::string array_root_;                     // prefix of array keys in *counting_ ("" or dir/)
  TreeNode tree_;
  std::vector<ArrayMetadata> metadata_;
  std::vector<std::unique_ptr<ZarrArray>> zarr_;
  std::map<std::string, size_t, std::less<>> by_path_;  // array path -> id
  // _METADATA's store_array_data_equal_to_fill_value: every chunk was written, so a missing
  // one is DataLoss (ZarrArray::set_all_chunks_stored).
  bool all_chunks_stored_ = false;
  std::optional<uint64_t> stored_total_;  // bytes of all files under dir_, listed on demand
  int64_t created_unix_ms_ = 0;
  int process_count_ = 0;
  std::unique_ptr<ThreadPool> pool_;      // one task per chunk read or verified
  std::unique_ptr<StagingPool> staging_;  // stored chunks read whole, reused (under the cap)
  mutable std::once_flag stored_once_;
  mutable std::vector<uint64_t> stored_bytes_;
  mutable std::vector<int64_t> stored_chunks_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_CHECKPOINT_ORBAX_READER_H_
