// OrbaxWriter: writes a checkpoint folder in Orbax's default format (OCDBT + zarr v3), which
// orbax-checkpoint restores (StandardCheckpointer, PyTreeCheckpointer, CheckpointManager).
//
// The folder holds `_METADATA` (Orbax's tree metadata: one entry per leaf, with its key path and
// value type), `_CHECKPOINT_METADATA`, any extra files the caller adds (the Python front adds
// `_sharding`), and one OCDBT database (`manifest.ocdbt`, `d/`) in which each leaf is a zarr v3
// array under its Orbax parameter name (the tree keys joined by '.'): `<name>/zarr.json`,
// `<name>/c/...`. Chunks are one shard each (sharding_indexed, zstd), as Orbax writes them.
// With `item` set the folder is a CheckpointManager step and the item lives in `<dir>/<item>/`.
// docs/foreign_formats.md ("## Orbax checkpoints", "### Writing") lists what is written and the
// limits.
//
//   OrbaxWriter::Create(&kv, "ckpt/100", {}) -> writer
//   writer->AddArray({"params/w", DType::kFloat32, {1024, 512}, OrbaxValueType::kJaxArray},
//                    {{box, data, replica, n}})
//   writer->Commit()
//
// Commit writes everything into a temporary folder `<dir>.orbax-checkpoint-tmp-<nonce>` (which
// Orbax's CheckpointManager ignores) and renames it to `<dir>` last, so a checkpoint is visible
// whole or not at all; on failure the temporary folder is removed.
//
// In one process every array's shards must cover it (replica 0 of each box is written).
//
// Several processes (a coordinator, coordination/coordinator.h): as Orbax writes them, each
// process writes the chunks it owns into its own OCDBT database `ocdbt.process_<p>/` of the item
// folder (a box held by several replicas is written by replica 0: one chunk per shard), and
// process 0 then checks that every chunk was written exactly once, writes a root database
// whose entries point into the processes' data files, the metadata, and renames the temporary
// folder into place: the checkpoint is visible whole or not at all, and every process's Commit
// returns the same outcome. Needs a store that can rename folders (Unimplemented otherwise).
//
// Thread-safety: one thread uses a writer. Shard buffers must stay valid and unchanged until
// Commit returns; chunk sources are called from several threads at once during Commit.
#ifndef TENSORSTASH_CHECKPOINT_ORBAX_WRITER_H_
#define TENSORSTASH_CHECKPOINT_ORBAX_WRITER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/array/chunk_source.h"
#include "tensorstash/array/dtype.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/coordination/coordinator.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// What Orbax restores a leaf as, when restored without a target ("value_type" in _METADATA).
enum class OrbaxValueType : uint8_t {
  kNumpyArray,  // "np.ndarray"
  kJaxArray,    // "jax.Array" (needs a `_sharding` entry to be restored without a target)
};

struct OrbaxArraySpec {
  std::string path;  // array path as in format/tree.h; used for the default tree and messages
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  OrbaxValueType value_type = OrbaxValueType::kNumpyArray;
  // Non-empty: the array is the key data of typed PRNG keys of this JAX implementation
  // ("threefry2x32", ...), recorded as Orbax does (`ext_metadata.random_key_impl` in
  // array_metadatas/process_0) so that Orbax restores keys. kJaxArray only (Orbax records array
  // metadata for jax.Array leaves only): InvalidArgument otherwise. (Initialized, so that
  // callers that list only the fields above get no missing-initializer warning.)
  std::string random_key_impl = {};
};

struct OrbaxWriterOptions {
  // "": `dir` is the item folder (what StandardCheckpointer writes). Otherwise `dir` is a
  // CheckpointManager step folder and the item is written to `dir/<item>` (e.g. "default").
  std::string item;
  int zstd_level = 3;  // zarr chunks (Orbax: 3)
  int io_threads = 0;  // 0: DefaultIoThreads()
  // The most bytes of chunks being gathered and encoded at once (one larger chunk alone).
  uint64_t max_inflight_bytes = kDefaultMaxInflightBytes;
  bool sync = true;  // fsync before the rename
  bool overwrite = false;
  uint64_t target_data_file_bytes = uint64_t{1} << 30;  // OCDBT data files
  // JSON items written beside `item` in the step folder, as Orbax's JsonCheckpointHandler
  // writes them (`<dir>/<name>/<file>` holding `json`, the item listed in _CHECKPOINT_METADATA),
  // committed with the arrays. Needs `item`; names as for `item`, each once. The manager writes
  // its metrics as {"metrics", "metrics", ...}, which Orbax's best_fn reads.
  struct JsonItem {
    std::string name;
    std::string file;
    std::string json;
  };
  std::vector<JsonItem> json_items = {};
};

struct OrbaxWriteStats {
  uint64_t raw_bytes = 0;  // array bytes written (before compression)
  uint64_t chunks = 0;     // zarr chunks written
  double seconds = 0;
};

class OrbaxWriter {
 public:
  // `dir` is the checkpoint folder's key in `kv` (e.g. "run1/100"). InvalidArgument for a bad
  // key or item name. Nothing is written before Commit.
  // With a `coordinator` of several processes, every process creates a writer with the same
  // arguments, adds the same arrays (each its own shards) and tree, and calls Commit (see
  // "Several processes" above). The coordinator must outlive the writer.
  static Result<std::unique_ptr<OrbaxWriter>> Create(KvStore* kv, std::string dir,
                                                     OrbaxWriterOptions options = {},
                                                     Coordinator* coordinator = nullptr);
  ~OrbaxWriter();

  // Adds an array with the shards of it this process holds. The shards (replica 0 of each box)
  // must cover the array and lie on one regular grid: every shard has the same shape except
  // where it is cut by the array's end (what a jax.Array's sharding gives). That shape is the
  // zarr chunk shape. InvalidArgument naming the array otherwise (checked here or at Commit).
  Status AddArray(OrbaxArraySpec spec, std::vector<ShardData> shards);
  // Adds an array whose chunks of `chunk_shape` (each >= 1) are produced by `source`
  // (array/chunk_source.h) during Commit, a few at a time, so that converting a large checkpoint holds little memory.
  Status AddArray(OrbaxArraySpec spec, std::vector<int64_t> chunk_shape, ChunkSource source);

  // Adds a file to the item folder (e.g. "_sharding"). InvalidArgument for a name that is not a
  // plain relative key or that the writer writes itself.
  Status AddFile(std::string name, std::string contents);

  // Replaces the default tree (nested dicts built from the array paths). Array leaves refer to
  // arrays by the order of AddArray calls. Int, float and bool leaves are stored as Orbax
  // stores Python scalars (0-d int64, float64, bool arrays, value type "scalar"). None, empty
  // dicts, lists and tuples are recorded in _METADATA as Orbax records them, without data.
  // Strings are stored as Orbax's StringHandler stores them (value type "string", the value in
  // `_strings.json` under the parameter name; Unimplemented for a name with '/' or '~', which
  // Orbax reads as a JSON pointer); bytes are Unimplemented. Keys may hold '/', kept in the
  // parameter name as Orbax keeps it. Checked at Commit.
  void SetTree(TreeNode root);

  // Writes the checkpoint and renames it into place. AlreadyExists when `dir` exists and not
  // `overwrite`; InvalidArgument for a bad tree (leaves whose Orbax names collide, empty keys,
  // arrays not referenced exactly once), bad shards; the storage or source error
  // otherwise. On failure nothing new is visible at `dir` (with `overwrite`, an old checkpoint
  // there is only removed once the new one is complete). `progress(done, total)` (array bytes)
  // is called from the writing threads, one call at a time. May be called once.
  Status Commit(OrbaxWriteStats* stats = nullptr,
                const std::function<void(uint64_t, uint64_t)>& progress = nullptr);

 private:
  struct Impl;
  explicit OrbaxWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_CHECKPOINT_ORBAX_WRITER_H_
