// How an Orbax checkpoint is written.
//
//  1. Commit checks the tree: every leaf gets its Orbax parameter name (the keys from the root
//     joined by '.', list and tuple positions in decimal) and must not collide with another;
//     every array is referenced by exactly one leaf; every array's shards tile it on one grid.
//  2. It refuses an existing checkpoint at `dir` (unless `overwrite`) and anything there that is
//     not a checkpoint (step_folder.h), and writes into the temporary folder
//     `<dir>.orbax-checkpoint-tmp-<nonce>` (the suffix Orbax uses, so that Orbax's
//     CheckpointManager skips a leftover of a crash).
//  3. An OcdbtWriter receives the zarr arrays: ZarrArrayWriter writes `<name>/zarr.json` and the
//     chunks through a KvStore whose Write adds the key to the database (OcdbtSink below).
//     Chunks are encoded and added in parallel on a thread pool; OCDBT values go straight to
//     its data files. OcdbtWriter::Finish writes the B+tree and manifest.ocdbt, synced.
//  4. `_METADATA` (and the caller's files, `array_metadatas/process_0` for jax.Array leaves) go
//     into the item folder and `_CHECKPOINT_METADATA` into the top folder; each is synced.
//  5. PublishFolder (engine/publish.h) renames the temporary folder to `dir` and syncs the
//     parent folder. With `overwrite` an existing `dir` is first renamed aside and removed only
//     after the new one is in place; a failure puts the old one back.
// Any failure removes the temporary folder: nothing new is visible.
//
// Several processes (CommitMultiProcess), every step a collective of coordination/collectives.h
// under keys "tensorstash/orbax/<dir>/<operation id>/":
//  1. Every process checks the tree (the same in each) and they agree on the outcome.
//  2. Process 0 checks the destination and broadcasts the temporary folder's name.
//  3. The processes gather every array's spec and largest local shard: all must describe the
//     arrays alike, and each array's chunk shape is the largest shard any process holds; each
//     checks that its shards lie on that grid. Each then writes the chunks it owns (replica 0 of
//     each box, as PlanChunkWrites deals them) into its own database `ocdbt.process_<p>` of the
//     item folder; process 0 also writes every zarr.json and the scalars. Each publishes how
//     many chunks of each array it wrote, and the sum of their linear indices.
//  4. Process 0 gathers every status (AgreeOnStatus). If all are OK it checks that each array's
//     chunks were written exactly once (count and index sum; a key written twice also fails the
//     merge), writes the item's own database, whose leaves refer to the values in the
//     processes' data files (OcdbtWriter::AddReference, base path "ocdbt.process_<p>/"), then
//     the metadata files, and publishes the folder as in step 5 above; otherwise, or on any
//     failure, it removes the temporary folder. Every process returns that verdict.

#include "tensorstash/checkpoint/orbax_writer.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "tensorstash/array/chunk_grid.h"
#include "tensorstash/coordination/collectives.h"
#include "tensorstash/engine/step_folder.h"
#include "tensorstash/engine/executor.h"
#include "tensorstash/engine/publish.h"
#include "tensorstash/engine/step_committer.h"
#include "tensorstash/engine/write_plan.h"
#include "tensorstash/format/orbax_metadata.h"
#include "tensorstash/format/orbax_names.h"
#include "tensorstash/format/zarr/zarr_array.h"
#include "tensorstash/kvstore/ocdbt/ocdbt_kvstore.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/str_util.h"
#include "tensorstash/util/thread_pool.h"

namespace tensorstash {
namespace {

using Json = nlohmann::ordered_json;

constexpr std::string_view kStandardHandler =
    "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler";

// Each process's own database in a multi-process save, as Orbax names them.
constexpr std::string_view kOrbaxProcessDatabasePrefix = "ocdbt.process_";

constexpr std::string_view kJsonHandler =
    "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler";

// `dir` + kOrbaxTmpMarker + "-<tag><random id>": a temporary name as Orbax makes them, which
// Orbax's CheckpointManager and our format detection and listing skip.
std::string TmpFolderName(std::string_view dir, std::string_view tag = "") {
  return StrCat(dir, kOrbaxTmpMarker, "-", tag, RandomHexId());
}

// A KvStore that adds every written key to an OcdbtWriter: how ZarrArrayWriter's output lands
// in the database. It is write-once: nothing can be read back or deleted.
class OcdbtSink final : public KvStore {
 public:
  explicit OcdbtSink(OcdbtWriter* writer) : writer_(writer) {}
  std::string Describe() const override { return "ocdbt (being written)"; }
  Result<std::string> Read(std::string_view key) override { return Missing(key); }
  Status ReadRange(std::string_view key, uint64_t, size_t, void*) override { return Missing(key); }
  Result<uint64_t> Size(std::string_view key) override { return Missing(key); }
  Result<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view key) override {
    return Missing(key);
  }
  Status Write(std::string_view key, std::string_view value) override {
    // A process other than 0 of a multi-process save: process 0 writes every zarr.json.
    if (dropped_.count(key) != 0) return OkStatus();
    return writer_->Add(key, value);
  }
  void Drop(std::string key) { dropped_.insert(std::move(key)); }
  Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view) override {
    return Unsupported();
  }
  Result<std::vector<std::string>> List(std::string_view) override {
    return std::vector<std::string>();
  }
  // ZarrArrayWriter deletes the chunks it leaves out (all fill value); none were added.
  Status Delete(std::string_view key) override { return Missing(key); }
  Status DeletePrefix(std::string_view) override { return OkStatus(); }
  bool SupportsRename() const override { return false; }
  Status RenameDirectory(std::string_view, std::string_view) override { return Unsupported(); }
  Status Sync(std::string_view) override { return OkStatus(); }
  Status SyncDirectory(std::string_view) override { return OkStatus(); }

 private:
  static Status Missing(std::string_view key) {
    return NotFoundError(StrCat("'", key, "' is not readable while the database is written"));
  }
  static Status Unsupported() {
    return FailedPreconditionError("the OCDBT database being written only takes whole values");
  }
  OcdbtWriter* writer_;
  std::set<std::string, std::less<>> dropped_;  // filled before the first Write
};

// The chunks of one array a process writes in a multi-process save: how many, and the sum of
// their linear indices (modulo 2^64). Process 0 checks that the processes' add up to the grid.
struct ChunksWritten {
  uint64_t count = 0;
  uint64_t index_sum = 0;
};

// A JSON array of unsigned integers into `out`; false for anything else.
bool UnsignedList(const nlohmann::json& j, std::vector<uint64_t>* out) {
  if (!j.is_array()) return false;
  out->clear();
  for (const nlohmann::json& e : j) {
    if (!e.is_number_unsigned()) return false;
    out->push_back(e.get<uint64_t>());
  }
  return true;
}

// One leaf of the tree as Orbax records it.
struct Leaf {
  std::vector<OrbaxKey> keys;
  std::string name;  // Orbax's parameter name
  const TreeNode* node = nullptr;  // kArray, kInt, kFloat, kBool, kString, or None / an empty
                                   // container

  bool has_data() const { return IsScalar() || node->kind == TreeNode::Kind::kArray; }
  bool IsScalar() const {
    return node->kind == TreeNode::Kind::kInt || node->kind == TreeNode::Kind::kFloat ||
           node->kind == TreeNode::Kind::kBool;
  }
};

// Orbax's value type of a leaf without data (empty_values.py in orbax-checkpoint).
const char* EmptyValueType(const TreeNode& node) {
  switch (node.kind) {
    case TreeNode::Kind::kDict:
      return kOrbaxEmptyDictType;
    case TreeNode::Kind::kList:
      return kOrbaxEmptyListType;
    case TreeNode::Kind::kTuple:
      return kOrbaxEmptyTupleType;
    default:
      return kOrbaxNoneType;
  }
}

Status CollectLeaves(const TreeNode& node, std::vector<OrbaxKey>* keys,
                     std::vector<Leaf>* out, int depth) {
  if (depth > kMaxTreeDepth) {
    return InvalidArgumentError(StrCat("the tree is nested deeper than ", kMaxTreeDepth));
  }
  const auto where = [&] {
    std::string path;
    for (const auto& k : *keys) path += (path.empty() ? "" : "/") + EscapePathKey(k.name);
    return path.empty() ? std::string("the root") : StrCat("'", path, "'");
  };
  // A leaf named by its keys joined with '.', as Orbax names parameters.
  const auto add_leaf = [&] {
    Leaf leaf;
    leaf.keys = *keys;
    for (const auto& k : *keys) leaf.name += (leaf.name.empty() ? "" : ".") + k.name;
    leaf.node = &node;
    out->push_back(std::move(leaf));
    return OkStatus();
  };
  const bool empty_container =
      (node.kind == TreeNode::Kind::kDict && node.entries.empty()) ||
      ((node.kind == TreeNode::Kind::kList || node.kind == TreeNode::Kind::kTuple) &&
       node.items.empty());
  if ((node.kind == TreeNode::Kind::kNone || empty_container) && !keys->empty()) {
    // Orbax records None and empty containers as leaves without data ("skip_deserialize").
    return add_leaf();
  }
  switch (node.kind) {
    case TreeNode::Kind::kNone:
      return OkStatus();
    case TreeNode::Kind::kDict:
      for (const auto& [key, child] : node.entries) {
        // Orbax keeps a '/' in a key as it is (Haiku's "mlp/~/linear_0"): the parameter
        // name, and the OCDBT keys under it, hold it unescaped.
        if (key.empty()) {
          return InvalidArgumentError(StrCat("an empty key under ", where(),
                                             " cannot be part of an Orbax parameter name"));
        }
        keys->push_back({key, OrbaxKeyType::kDict});
        TS_RETURN_IF_ERROR(CollectLeaves(child, keys, out, depth + 1));
        keys->pop_back();
      }
      return OkStatus();
    case TreeNode::Kind::kList:
    case TreeNode::Kind::kTuple:
      for (size_t i = 0; i < node.items.size(); ++i) {
        keys->push_back({std::to_string(i), OrbaxKeyType::kSequence});
        TS_RETURN_IF_ERROR(CollectLeaves(node.items[i], keys, out, depth + 1));
        keys->pop_back();
      }
      return OkStatus();
    case TreeNode::Kind::kString:
      // Orbax's StringHandler: the value goes into _strings.json under the parameter name.
      if (keys->empty()) {
        return InvalidArgumentError("the tree's root is a leaf; Orbax saves dicts and lists");
      }
      return add_leaf();
    case TreeNode::Kind::kBytes:
      return UnimplementedError(StrCat("the bytes leaf at ", where(),
                                       " cannot be written to an Orbax checkpoint (Orbax has "
                                       "no handler for bytes)"));
    case TreeNode::Kind::kArray:
    case TreeNode::Kind::kInt:
    case TreeNode::Kind::kFloat:
    case TreeNode::Kind::kBool: {
      if (keys->empty()) {
        return InvalidArgumentError("the tree's root is a leaf; Orbax saves dicts and lists");
      }
      return add_leaf();
    }
  }
  return InternalError("unknown tree node kind");
}

int64_t NowNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

struct OrbaxWriter::Impl {
  struct ArrayEntry {
    OrbaxArraySpec spec;
    // Replica 0 only in one process; every shard with several (the plan picks the writer);
    // unused with `source`.
    std::vector<ShardData> shards;
    std::vector<int64_t> chunk_shape;
    ChunkSource source;
  };

  KvStore* kv;
  std::string dir;
  OrbaxWriterOptions options;
  Coordinator* coordinator = nullptr;  // set when the job has several processes
  std::vector<ArrayEntry> arrays;
  std::vector<std::pair<std::string, std::string>> files;
  std::optional<TreeNode> tree;
  bool committed = false;

  Status CommitImpl(OrbaxWriteStats* stats,
                    const std::function<void(uint64_t, uint64_t)>& progress);
  // Steps 2-5 in one process.
  Status WriteChecked(const std::vector<Leaf>& leaves, OrbaxWriteStats* stats,
                      const std::function<void(uint64_t, uint64_t)>& progress);
  // Step 1: the leaves of the tree, checked.
  Status CollectCheckedLeaves(std::vector<Leaf>* leaves);
  // The multi-process commit (see the top of this file).
  Status CommitMultiProcess(OrbaxWriteStats* stats,
                            const std::function<void(uint64_t, uint64_t)>& progress);
  // Step 2 on process 0 of a multi-process save: the temporary folder to write into.
  Result<std::string> PrepareFolder();
  // Agrees on every array's chunk shape with the other processes (the largest shard shape
  // any of them holds) and checks that this process's shards lie on that grid.
  Status AgreeOnGrids(const std::string& key_prefix);
  // Step 3 alone: the arrays (and, with `scalars`, the scalar leaves) into the database at
  // `db_dir`. `zarr_metadata`: also each array's zarr.json. `written`, when given, gets per
  // array the chunks this process writes: how many, and the sum of their linear indices.
  Status WriteDatabase(const std::string& db_dir, const std::vector<Leaf>& leaves, bool scalars,
                       bool zarr_metadata, std::vector<ChunksWritten>* written,
                       OrbaxWriteStats* stats,
                       const std::function<void(uint64_t, uint64_t)>& progress);
  // Step 4: _METADATA and the other files of folder `tmp`.
  Status WriteMetadata(const std::string& tmp, const std::vector<Leaf>& leaves);
  // Process 0's merge: one database at `item_dir` over the processes' ones.
  Status MergeDatabases(const std::string& item_dir, int processes);
  // Object stores: the checkpoint written at `dir` itself, then Orbax's commit marker.
  Status WriteInPlace(const std::vector<Leaf>& leaves, OrbaxWriteStats* stats,
                      const std::function<void(uint64_t, uint64_t)>& progress);
  Status WriteInto(const std::string& tmp, const std::vector<Leaf>& leaves, OrbaxWriteStats* stats,
                   const std::function<void(uint64_t, uint64_t)>& progress);
  Status WriteFile(const std::string& key, const std::string& contents) {
    TS_RETURN_IF_ERROR(kv->Write(key, contents));
    return options.sync ? kv->Sync(key) : OkStatus();
  }
};

OrbaxWriter::OrbaxWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OrbaxWriter::~OrbaxWriter() = default;

Result<std::unique_ptr<OrbaxWriter>> OrbaxWriter::Create(KvStore* kv, std::string dir,
                                                         OrbaxWriterOptions options,
                                                         Coordinator* coordinator) {
  TS_RETURN_IF_ERROR(ValidateKey(dir));
  if (!options.item.empty()) {
    TS_RETURN_IF_ERROR(ValidateKey(options.item));
    if (options.item.find('/') != std::string::npos || options.item.starts_with("_")) {
      return InvalidArgumentError(StrCat("Orbax item name '", options.item,
                                         "' must be one folder name not starting with '_'"));
    }
  }
  std::set<std::string> item_names = {options.item};
  for (const OrbaxWriterOptions::JsonItem& json_item : options.json_items) {
    if (options.item.empty()) {
      return InvalidArgumentError(StrCat("the JSON item '", json_item.name,
                                         "' needs an item (a CheckpointManager step folder)"));
    }
    for (const std::string& name : {json_item.name, json_item.file}) {
      TS_RETURN_IF_ERROR(ValidateKey(name));
      if (name.find('/') != std::string::npos || name.starts_with("_")) {
        return InvalidArgumentError(StrCat("Orbax JSON item '", name,
                                           "' must be one folder name not starting with '_'"));
      }
    }
    if (!item_names.insert(json_item.name).second) {
      return InvalidArgumentError(StrCat("Orbax item '", json_item.name, "' is given twice"));
    }
  }
  if (options.zstd_level < -131072 || options.zstd_level > 22) {
    return InvalidArgumentError(StrCat("zstd level ", options.zstd_level, " is out of range"));
  }
  auto impl = std::make_unique<Impl>();
  impl->kv = kv;
  impl->dir = std::move(dir);
  impl->options = std::move(options);
  if (coordinator != nullptr && coordinator->process_count() > 1) impl->coordinator = coordinator;
  return std::unique_ptr<OrbaxWriter>(new OrbaxWriter(std::move(impl)));
}

// Orbax keeps a PRNG key's implementation in the array metadata of jax.Array leaves only.
static Status CheckRandomKeyImpl(const OrbaxArraySpec& spec, const std::string& what) {
  if (!spec.random_key_impl.empty() && spec.value_type != OrbaxValueType::kJaxArray) {
    return InvalidArgumentError(StrCat(what, ": PRNG key data (random_key_impl '",
                                       spec.random_key_impl, "') must be a jax.Array leaf"));
  }
  return OkStatus();
}

Status OrbaxWriter::AddArray(OrbaxArraySpec spec, std::vector<ShardData> shards) {
  const std::string what = StrCat("array '", spec.path, "'");
  TS_RETURN_IF_ERROR(Annotate(CheckedNumElements(spec.shape, what).status(), what));
  TS_RETURN_IF_ERROR(CheckRandomKeyImpl(spec, what));
  const int rank = static_cast<int>(spec.shape.size());
  Impl::ArrayEntry entry;
  entry.chunk_shape.assign(rank, 0);
  for (ShardData& shard : shards) {
    if (shard.box.rank() != rank) {
      return InvalidArgumentError(StrCat(what, ": shard ", shard.box.ToString(), " has rank ",
                                         shard.box.rank(), ", the array ", rank));
    }
    TS_RETURN_IF_ERROR(ValidateBox(shard.box, ItemSize(spec.dtype), what));
    if (!Box::FromShape(spec.shape).Contains(shard.box)) {
      return InvalidArgumentError(StrCat(what, ": shard ", shard.box.ToString(),
                                         " reaches past the shape [", StrJoin(spec.shape, ", "),
                                         "]"));
    }
    if (shard.replica_id < 0 || shard.replica_id >= shard.num_replicas) {
      return InvalidArgumentError(StrCat(what, ": replica id ", shard.replica_id,
                                         " out of range for ", shard.num_replicas, " replicas"));
    }
    const bool multi_process = impl_->coordinator != nullptr;
    if (shard.replica_id != 0 && !multi_process) continue;
    if (shard.data == nullptr && !shard.box.empty()) {
      return InvalidArgumentError(StrCat(what, ": shard ", shard.box.ToString(), " has no data"));
    }
    for (int d = 0; d < rank; ++d) {
      entry.chunk_shape[d] = std::max(entry.chunk_shape[d], shard.box.shape[d]);
    }
    entry.shards.push_back(std::move(shard));
  }
  if (impl_->coordinator != nullptr) {
    // The grid is agreed on with the other processes and checked at Commit.
    entry.spec = std::move(spec);
    impl_->arrays.push_back(std::move(entry));
    return OkStatus();
  }
  for (int64_t& c : entry.chunk_shape) c = std::max<int64_t>(c, 1);
  // The shards must tile the array on the grid of chunk_shape: each one exactly one cell (cut
  // by the array's end), every cell once.
  std::set<std::vector<int64_t>> cells;
  int64_t num_cells = 1;
  for (int d = 0; d < rank; ++d) {
    num_cells *= (spec.shape[d] + entry.chunk_shape[d] - 1) / entry.chunk_shape[d];
  }
  for (const ShardData& shard : entry.shards) {
    if (shard.box.empty()) continue;
    std::vector<int64_t> cell(rank);
    for (int d = 0; d < rank; ++d) {
      const int64_t c = entry.chunk_shape[d];
      const int64_t o = shard.box.origin[d];
      if (o % c != 0 || shard.box.shape[d] != std::min(c, spec.shape[d] - o)) {
        return InvalidArgumentError(
            StrCat(what, ": shard ", shard.box.ToString(), " is not a cell of the regular grid [",
                   StrJoin(entry.chunk_shape, ", "), "] (Orbax stores one zarr chunk per shard)"));
      }
      cell[d] = o / c;
    }
    cells.insert(std::move(cell));
  }
  if (static_cast<int64_t>(cells.size()) != num_cells) {
    return InvalidArgumentError(StrCat(
        what, ": the shards cover ", cells.size(), " of the ", num_cells, " cells of the grid [",
        StrJoin(entry.chunk_shape, ", "), "]; a single-process writer needs all of them"));
  }
  entry.spec = std::move(spec);
  impl_->arrays.push_back(std::move(entry));
  return OkStatus();
}

Status OrbaxWriter::AddArray(OrbaxArraySpec spec, std::vector<int64_t> chunk_shape,
                             ChunkSource source) {
  const std::string what = StrCat("array '", spec.path, "'");
  TS_RETURN_IF_ERROR(Annotate(CheckedNumElements(spec.shape, what).status(), what));
  if (chunk_shape.size() != spec.shape.size()) {
    return InvalidArgumentError(StrCat(what, ": chunk shape [", StrJoin(chunk_shape, ", "),
                                       "] does not match the rank ", spec.shape.size()));
  }
  for (int64_t c : chunk_shape) {
    if (c < 1) {
      return InvalidArgumentError(
          StrCat(what, ": chunk shape [", StrJoin(chunk_shape, ", "), "] has an extent below 1"));
    }
  }
  if (source == nullptr) return InvalidArgumentError(StrCat(what, ": no chunk source"));
  if (impl_->coordinator != nullptr) {
    return UnimplementedError(StrCat(what, ": arrays from a chunk source are written by a "
                                           "single process"));
  }
  TS_RETURN_IF_ERROR(CheckRandomKeyImpl(spec, what));
  Impl::ArrayEntry entry;
  entry.spec = std::move(spec);
  entry.chunk_shape = std::move(chunk_shape);
  entry.source = std::move(source);
  impl_->arrays.push_back(std::move(entry));
  return OkStatus();
}

Status OrbaxWriter::AddFile(std::string name, std::string contents) {
  TS_RETURN_IF_ERROR(ValidateKey(name));
  if (name == kOrbaxMetadataFileName || name == kOrbaxCheckpointMetadataFileName ||
      name == kOcdbtManifestFileName || name.starts_with("d/") ||
      name.starts_with("array_metadatas/") || name.starts_with("ocdbt.process_")) {
    return InvalidArgumentError(StrCat("'", name, "' is written by the Orbax writer itself"));
  }
  impl_->files.emplace_back(std::move(name), std::move(contents));
  return OkStatus();
}

void OrbaxWriter::SetTree(TreeNode root) { impl_->tree = std::move(root); }

Status OrbaxWriter::Commit(OrbaxWriteStats* stats,
                           const std::function<void(uint64_t, uint64_t)>& progress) {
  if (impl_->committed) return FailedPreconditionError("Commit was already called");
  impl_->committed = true;
  const auto start = std::chrono::steady_clock::now();
  OrbaxWriteStats local;
  Status status = impl_->CommitImpl(&local, progress);
  local.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (stats != nullptr) *stats = local;
  return Annotate(status, StrCat("writing Orbax checkpoint '", impl_->dir, "'"));
}

Status OrbaxWriter::Impl::CommitImpl(OrbaxWriteStats* stats,
                                     const std::function<void(uint64_t, uint64_t)>& progress) {
  if (coordinator != nullptr) return CommitMultiProcess(stats, progress);
  std::vector<Leaf> leaves;
  TS_RETURN_IF_ERROR(CollectCheckedLeaves(&leaves));
  return WriteChecked(leaves, stats, progress);
}

Status OrbaxWriter::Impl::CollectCheckedLeaves(std::vector<Leaf>* out) {
  std::vector<Leaf>& leaves = *out;
  // 1. The tree and its leaves.
  if (!tree.has_value()) {
    std::vector<ArrayMetadata> paths(arrays.size());
    for (size_t i = 0; i < arrays.size(); ++i) paths[i].path = arrays[i].spec.path;
    TS_ASSIGN_OR_RETURN(TreeNode built, TreeFromArrayPaths(paths));
    tree = std::move(built);
  }
  std::vector<OrbaxKey> keys;
  TS_RETURN_IF_ERROR(CollectLeaves(*tree, &keys, &leaves, 0));
  if (leaves.empty()) return InvalidArgumentError("the tree is empty; Orbax needs a leaf");
  std::map<std::string, const Leaf*> names;
  std::vector<int> references(arrays.size(), 0);
  for (const Leaf& leaf : leaves) {
    TS_RETURN_IF_ERROR(Annotate(ValidateKey(leaf.name), "Orbax parameter name"));
    auto [it, inserted] = names.emplace(leaf.name, &leaf);
    if (!inserted) {
      return InvalidArgumentError(StrCat("leaves ", OrbaxEntryName(it->second->keys), " and ",
                                         OrbaxEntryName(leaf.keys), " have the same Orbax name '",
                                         leaf.name, "'"));
    }
    if (leaf.node->kind == TreeNode::Kind::kString &&
        leaf.name.find_first_of("/~") != std::string::npos) {
      // Orbax finds a string at the JSON pointer "/<name>" of _strings.json, which reads '/'
      // as a level and '~' as an escape.
      return UnimplementedError(StrCat("the string leaf '", leaf.name,
                                       "' has a '/' or '~' in its Orbax name, which Orbax's "
                                       "_strings.json cannot hold"));
    }
    if (leaf.node->kind == TreeNode::Kind::kArray) {
      const int64_t id = leaf.node->array_id;
      if (id < 0 || id >= static_cast<int64_t>(arrays.size())) {
        return InvalidArgumentError(
            StrCat("leaf '", leaf.name, "' refers to array ", id, " of ", arrays.size()));
      }
      ++references[id];
    } else if (leaf.node->kind == TreeNode::Kind::kInt) {
      int64_t v;
      if (!ParseInt(leaf.node->int_value, &v)) {
        return InvalidArgumentError(StrCat("int leaf '", leaf.name, "' (", leaf.node->int_value,
                                           ") does not fit in int64"));
      }
    }
  }
  for (size_t i = 0; i < arrays.size(); ++i) {
    if (references[i] != 1) {
      return InvalidArgumentError(StrCat("array '", arrays[i].spec.path, "' is referenced by ",
                                         references[i], " leaves of the tree instead of one"));
    }
  }
  return OkStatus();
}

Status OrbaxWriter::Impl::WriteChecked(const std::vector<Leaf>& leaves, OrbaxWriteStats* stats,
                                       const std::function<void(uint64_t, uint64_t)>& progress) {
  // 2. The destination, and the temporary folder.
  // Orbax's layout has no commit record: where the store cannot rename folders (an object
  // store), it is written in place as Orbax writes it (engine/step_committer.h).
  if (StepCommitter(kv).protocol() != CommitProtocol::kRename) {
    if (!kv->Capabilities().object_store) {
      return UnimplementedError(StrCat(kv->Describe(),
                                       " cannot rename folders, which the Orbax "
                                       "writer needs to publish a checkpoint whole"));
    }
    return WriteInPlace(leaves, stats, progress);
  }
  // Never replaces what tensorstash did not write, nor a complete checkpoint without
  // `overwrite` (step_folder.h).
  TS_ASSIGN_OR_RETURN(FolderContent content, CheckSaveDestination(kv, dir, options.overwrite));
  if (content == FolderContent::kTensorstashLeftover)
    TS_RETURN_IF_ERROR(kv->DeletePrefix(dir + "/"));
  const std::string tmp = TmpFolderName(dir);
  TS_RETURN_IF_ERROR(kv->DeletePrefix(tmp + "/"));
  Status status = WriteInto(tmp, leaves, stats, progress);

  // 5. Into place: the old checkpoint (overwrite) is moved aside and removed once the new one is
  // in place and durable; on failure nothing new is visible and the old one is as it was.
  if (status.ok()) {
    status = PublishFolder(kv, tmp, dir, TmpFolderName(dir, "old-"), options.sync);
  }
  if (!status.ok()) (void)kv->DeletePrefix(tmp + "/");
  return status;
}

Status OrbaxWriter::Impl::WriteInPlace(const std::vector<Leaf>& leaves, OrbaxWriteStats* stats,
                                       const std::function<void(uint64_t, uint64_t)>& progress) {
  // Orbax's own way on object stores (as on GCS): the checkpoint is written where it will be
  // read, _CHECKPOINT_METADATA last, then the marker commit_success.txt. Nothing can be replaced
  // in place without a moment with neither version, so an existing checkpoint is never touched.
  TS_ASSIGN_OR_RETURN(FolderContent content, ClassifyStepFolder(kv, dir));
  if (options.overwrite &&
      (content == FolderContent::kOrbaxCheckpoint || content == FolderContent::kTensorstashStep)) {
    return FailedPreconditionError(
        StrCat("'", dir, "' in ", kv->Describe(),
               " holds a checkpoint, and an Orbax checkpoint cannot replace it in place on an "
               "object store; delete it first, or save in the native format (which can)"));
  }
  TS_ASSIGN_OR_RETURN(content, CheckSaveDestination(kv, dir, /*overwrite=*/false));
  if (content == FolderContent::kTensorstashLeftover) {
    // Possibly a native save's attempt in progress (object_store_commit.h), never deleted here.
    return FailedPreconditionError(
        StrCat("'", dir, "' in ", kv->Describe(),
               " holds the files of an unfinished save; run `tensorstash gc` on its root first"));
  }
  TS_RETURN_IF_ERROR(WriteInto(dir, leaves, stats, progress));
  Status marked =
      kv->Write(StrCat(dir, "/", kOrbaxCommitSuccessFileName),
                StrCat("Checkpoint commit was successful to ", kv->Describe(), "/", dir));
  if (!marked.ok()) (void)kv->DeletePrefix(dir + "/");
  return marked;
}

Status OrbaxWriter::Impl::WriteInto(const std::string& tmp, const std::vector<Leaf>& leaves,
                                    OrbaxWriteStats* stats,
                                    const std::function<void(uint64_t, uint64_t)>& progress) {
  const std::string item_dir = options.item.empty() ? tmp : StrCat(tmp, "/", options.item);
  Status status = WriteDatabase(item_dir, leaves, /*scalars=*/true, /*zarr_metadata=*/true,
                                nullptr, stats, progress);
  if (status.ok()) status = WriteMetadata(tmp, leaves);
  if (!status.ok()) (void)kv->DeletePrefix(tmp + "/");
  return status;
}

Status OrbaxWriter::Impl::WriteDatabase(const std::string& db_dir, const std::vector<Leaf>& leaves,
                                        bool scalars, bool zarr_metadata,
                                        std::vector<ChunksWritten>* written, OrbaxWriteStats* stats,
                                        const std::function<void(uint64_t, uint64_t)>& progress) {
  // 3. The arrays, into one OCDBT database.
  OcdbtWriter::Options ocdbt_options;
  ocdbt_options.target_data_file_bytes = options.target_data_file_bytes;
  TS_ASSIGN_OR_RETURN(std::unique_ptr<OcdbtWriter> ocdbt,
                      OcdbtWriter::Create(kv, db_dir, ocdbt_options));
  OcdbtSink sink(ocdbt.get());
  if (!zarr_metadata) {
    for (const Leaf& leaf : leaves) sink.Drop(StrCat(leaf.name, "/zarr.json"));
  }
  if (written != nullptr) written->assign(arrays.size(), ChunksWritten{});
  ZarrArraySpec zarr;
  zarr.level = options.zstd_level;

  uint64_t total = 0;
  for (const ArrayEntry& a : arrays) {
    total +=
        static_cast<uint64_t>(Box::FromShape(a.spec.shape).num_elements()) * ItemSize(a.spec.dtype);
  }
  std::atomic<uint64_t> done{0};
  std::atomic<uint64_t> chunks{0};
  std::mutex progress_mutex;
  const auto report = [&](uint64_t bytes) {
    const uint64_t now = done.fetch_add(bytes) + bytes;
    if (progress) {
      std::lock_guard<std::mutex> lock(progress_mutex);
      progress(now, total);
    }
  };

  ThreadPool pool(options.io_threads > 0 ? options.io_threads : DefaultIoThreads());
  std::vector<std::unique_ptr<ZarrArrayWriter>> writers;
  Status status;
  {
    // engine/executor.h: one task per zarr chunk, the chunks being gathered and encoded under
    // max_inflight_bytes.
    Executor run(&pool, options.max_inflight_bytes);
    for (const Leaf& leaf : leaves) {
      if (run.failed()) break;
      if (leaf.node->kind != TreeNode::Kind::kArray) continue;
      const ArrayEntry& a = arrays[leaf.node->array_id];
      zarr.dtype = a.spec.dtype;
      zarr.shape = a.spec.shape;
      zarr.chunk_shape = a.chunk_shape;
      Result<std::unique_ptr<ZarrArrayWriter>> writer =
          ZarrArrayWriter::Create(&sink, leaf.name, zarr);
      if (!writer.ok()) {
        run.Fail(writer.status());
        break;
      }
      const ZarrArrayWriter* w = writer->get();
      writers.push_back(*std::move(writer));
      const size_t item = ItemSize(a.spec.dtype);
      // The zarr grid is a chunk grid whose cells are its chunks.
      const ChunkGrid grid{a.spec.shape, a.chunk_shape, a.chunk_shape};
      if (a.source == nullptr) {
        // Write planning as for the native format (engine/write_plan.h): the shards tile the
        // grid (AddArray checked it), so each chunk is one shard, encoded from where it is.
        // With several processes, the chunks of a replicated shard are dealt out among its
        // replicas as the native writer deals them (one chunk per shard here: replica 0's).
        const bool split = coordinator != nullptr;
        ArrayToWrite to_write{a.spec.path, &grid, item, {}};
        for (const ShardData& shard : a.shards) {
          to_write.shards.push_back(split ? ShardPlacement{shard.box, shard.replica_id,
                                                           shard.num_replicas}
                                          : ShardPlacement{shard.box, 0, 1});
        }
        Result<std::vector<ChunkWrite>> planned = PlanChunkWrites({to_write}, split);
        if (!planned.ok()) {
          run.Fail(planned.status());
          break;
        }
        if (written != nullptr) {
          uint64_t sum = 0;  // modulo 2^64, as the check computes it
          for (const ChunkWrite& chunk : *planned) sum += static_cast<uint64_t>(chunk.chunk);
          (*written)[leaf.node->array_id] = {planned->size(), sum};
        }
        for (const ChunkWrite& chunk : *planned) {
          run.RunHolding(chunk.raw_bytes,
                         [w, data = a.shards[chunk.shard].data, box = chunk.chunk_box,
                          bytes = chunk.raw_bytes, &report, &chunks]() -> Status {
                           TS_RETURN_IF_ERROR(w->WriteBox(box, data));
                           chunks.fetch_add(1);
                           report(bytes);
                           return OkStatus();
                         });
        }
        continue;
      }
      // Chunks from the source, into staging.
      grid.ForEachChunkIntersecting(Box::FromShape(a.spec.shape), [&](int64_t, const Box& box) {
        if (run.failed()) return;
        std::vector<int64_t> cell(box.rank());
        for (int d = 0; d < box.rank(); ++d) cell[d] = box.origin[d] / a.chunk_shape[d];
        const uint64_t bytes = static_cast<uint64_t>(box.num_elements()) * item;
        run.Run(
            bytes,
            [w, &a, cell = std::move(cell), box, bytes, &report, &chunks](char* buffer) -> Status {
              TS_RETURN_IF_ERROR(
                  Annotate(a.source(box, buffer),
                           StrCat("reading ", box.ToString(), " of array '", a.spec.path, "'")));
              TS_RETURN_IF_ERROR(w->WriteChunk(cell, buffer));
              chunks.fetch_add(1);
              report(bytes);
              return OkStatus();
            });
      });
    }
    status = run.Wait();
  }
  // Scalars: 0-d arrays, as Orbax's ScalarHandler stores np.asarray(value).
  for (const Leaf& leaf : leaves) {
    if (!status.ok() || !scalars) break;
    const TreeNode& n = *leaf.node;
    if (!leaf.IsScalar()) continue;
    int64_t i = 0;
    double f = n.float_value;
    uint8_t b = n.bool_value ? 1 : 0;
    const void* value = &b;
    zarr.dtype = DType::kBool;
    if (n.kind == TreeNode::Kind::kInt) {
      ParseInt(n.int_value, &i);
      zarr.dtype = DType::kInt64;
      value = &i;
    } else if (n.kind == TreeNode::Kind::kFloat) {
      zarr.dtype = DType::kFloat64;
      value = &f;
    }
    zarr.shape.clear();
    zarr.chunk_shape.clear();
    Result<std::unique_ptr<ZarrArrayWriter>> writer =
        ZarrArrayWriter::Create(&sink, leaf.name, zarr);
    status = writer.ok() ? (*writer)->WriteChunk({}, value) : writer.status();
  }
  if (status.ok()) status = ocdbt->Finish();
  stats->raw_bytes = done.load();
  stats->chunks = chunks.load();
  return status;
}

Status OrbaxWriter::Impl::WriteMetadata(const std::string& tmp, const std::vector<Leaf>& leaves) {
  const std::string item_dir = options.item.empty() ? tmp : StrCat(tmp, "/", options.item);
  Status status;
  // 4. The metadata files.
  OrbaxMetadata metadata;
  Json array_metadatas = Json::array();
  Json strings = Json::object();
  metadata.tree.reserve(leaves.size());
  for (const Leaf& leaf : leaves) {
    OrbaxTreeEntry entry;
    entry.name = OrbaxEntryName(leaf.keys);
    entry.keys = leaf.keys;
    entry.skip_deserialize = false;
    if (leaf.node->kind == TreeNode::Kind::kString) {
      entry.value_type = kOrbaxStringType;
      strings[leaf.name] = leaf.node->string_value;
    } else if (!leaf.has_data()) {
      entry.value_type = EmptyValueType(*leaf.node);
      entry.skip_deserialize = true;
    } else if (leaf.IsScalar()) {
      entry.value_type = kOrbaxScalarType;
    } else {
      const ArrayEntry& a = arrays[leaf.node->array_id];
      if (a.spec.value_type == OrbaxValueType::kJaxArray) {
        entry.value_type = kOrbaxJaxArrayType;
        entry.write_shape = a.chunk_shape;
        Json ext_metadata = nullptr;
        if (!a.spec.random_key_impl.empty()) {
          ext_metadata = Json{{"random_key_impl", a.spec.random_key_impl}};
        }
        array_metadatas.push_back(Json{{"array_metadata", Json{{"param_name", leaf.name},
                                                               {"write_shape", a.chunk_shape},
                                                               {"chunk_shape", a.chunk_shape},
                                                               {"ext_metadata", ext_metadata}}}});
      } else {
        entry.value_type = kOrbaxNumpyArrayType;
      }
    }
    metadata.tree.push_back(std::move(entry));
  }
  metadata.use_ocdbt = true;
  metadata.use_zarr3 = true;
  // Chunks equal to the fill value are left out, so Orbax must not treat them as missing data.
  metadata.store_array_data_equal_to_fill_value = false;
  status = WriteFile(StrCat(item_dir, "/", kOrbaxMetadataFileName), EncodeOrbaxMetadata(metadata));
  if (status.ok() && !array_metadatas.empty()) {
    status = WriteFile(item_dir + "/array_metadatas/process_0",
                       Json{{"array_metadatas", std::move(array_metadatas)}}.dump());
  }
  if (status.ok() && !strings.empty()) {
    status = WriteFile(StrCat(item_dir, "/_strings.json"), strings.dump());
  }
  for (const auto& [name, contents] : files) {
    if (status.ok()) status = WriteFile(StrCat(item_dir, "/", name), contents);
  }
  for (const OrbaxWriterOptions::JsonItem& json_item : options.json_items) {
    if (status.ok()) {
      status = WriteFile(StrCat(tmp, "/", json_item.name, "/", json_item.file), json_item.json);
    }
  }
  if (status.ok()) {
    const int64_t now = NowNanos();
    Json handlers =
        options.item.empty() ? Json(kStandardHandler) : Json{{options.item, kStandardHandler}};
    for (const OrbaxWriterOptions::JsonItem& json_item : options.json_items) {
      handlers[json_item.name] = kJsonHandler;
    }
    Json checkpoint_metadata = {
        {"item_handlers", std::move(handlers)},  {"metrics", Json::object()},
        {"performance_metrics", Json::object()}, {"init_timestamp_nsecs", now},
        {"commit_timestamp_nsecs", now},         {"custom_metadata", Json::object()}};
    status =
        WriteFile(StrCat(tmp, "/", kOrbaxCheckpointMetadataFileName), checkpoint_metadata.dump());
  }
  if (status.ok() && options.sync) {
    status = kv->SyncDirectory(item_dir);
    if (status.ok() && item_dir != tmp) status = kv->SyncDirectory(tmp);
  }
  return status;
}

Result<std::string> OrbaxWriter::Impl::PrepareFolder() {
  // As CommitImpl does in one process; a store that cannot rename is refused before (there,
  // Orbax's in-place commit would let readers see a merge in progress).
  TS_ASSIGN_OR_RETURN(FolderContent content, CheckSaveDestination(kv, dir, options.overwrite));
  if (content == FolderContent::kTensorstashLeftover)
    TS_RETURN_IF_ERROR(kv->DeletePrefix(dir + "/"));
  std::string tmp = TmpFolderName(dir);
  TS_RETURN_IF_ERROR(kv->DeletePrefix(tmp + "/"));
  return tmp;
}

Status OrbaxWriter::Impl::AgreeOnGrids(const std::string& key_prefix) {
  // Each process's view of every array, as JSON: what must match ("spec"), and the largest
  // shard it holds ("chunk": a process may hold only shards cut by the array's end, or none).
  nlohmann::json mine = nlohmann::json::array();
  for (const ArrayEntry& a : arrays) {
    mine.push_back({{"spec",
                     {{"dtype", DTypeName(a.spec.dtype)},
                      {"shape", a.spec.shape},
                      {"value_type", static_cast<int>(a.spec.value_type)},
                      {"random_key_impl", a.spec.random_key_impl}}},
                    {"chunk", a.chunk_shape}});
  }
  TS_ASSIGN_OR_RETURN(std::vector<std::string> all,
                      AllGather(*coordinator, key_prefix + "grids/", mine.dump(),
                                kDefaultCoordinationTimeout));
  std::vector<std::vector<int64_t>> agreed(arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i) agreed[i] = arrays[i].chunk_shape;
  for (size_t p = 0; p < all.size(); ++p) {
    const nlohmann::json theirs = nlohmann::json::parse(all[p], nullptr, /*allow_exceptions=*/false);
    if (!theirs.is_array()) {
      return InternalError(StrCat("process ", p, " sent a malformed list of arrays: ", all[p]));
    }
    if (theirs.size() != arrays.size()) {
      return InvalidArgumentError(StrCat("process ", p, " saves ", theirs.size(),
                                         " arrays, process ", coordinator->process_index(),
                                         " ", arrays.size(), ": every process must save the "
                                         "same tree"));
    }
    for (size_t i = 0; i < arrays.size(); ++i) {
      const nlohmann::json& entry = theirs[i];
      std::vector<uint64_t> extents;
      if (!entry.is_object() || !entry.contains("spec") || !entry.contains("chunk") ||
          !UnsignedList(entry["chunk"], &extents)) {
        return InternalError(StrCat("process ", p, " sent a malformed entry for array '",
                                    arrays[i].spec.path, "': ", entry.dump()));
      }
      if (entry["spec"] != mine[i]["spec"]) {
        return InvalidArgumentError(StrCat("array '", arrays[i].spec.path, "' differs between "
                                           "process ", p, " (", entry["spec"].dump(),
                                           ") and process ", coordinator->process_index(), " (",
                                           mine[i]["spec"].dump(), ")"));
      }
      for (size_t d = 0; d < agreed[i].size() && d < extents.size(); ++d) {
        agreed[i][d] = std::max<int64_t>(agreed[i][d], static_cast<int64_t>(extents[d]));
      }
    }
  }
  for (size_t i = 0; i < arrays.size(); ++i) {
    ArrayEntry& a = arrays[i];
    a.chunk_shape = std::move(agreed[i]);
    for (int64_t& c : a.chunk_shape) c = std::max<int64_t>(c, 1);
    for (const ShardData& shard : a.shards) {
      if (shard.box.empty()) continue;
      for (int d = 0; d < shard.box.rank(); ++d) {
        const int64_t c = a.chunk_shape[d];
        const int64_t o = shard.box.origin[d];
        if (o % c != 0 || shard.box.shape[d] != std::min(c, a.spec.shape[d] - o)) {
          return InvalidArgumentError(StrCat(
              "array '", a.spec.path, "': shard ", shard.box.ToString(), " of process ",
              coordinator->process_index(), " is not a cell of the regular grid [",
              StrJoin(a.chunk_shape, ", "), "] (Orbax stores one zarr chunk per shard)"));
        }
      }
    }
  }
  return OkStatus();
}

Status OrbaxWriter::Impl::MergeDatabases(const std::string& item_dir, int processes) {
  // What TensorStore's merge gives Orbax: a database at the item folder whose leaves point
  // into the processes' data files (base path "ocdbt.process_<p>/"); their files stay.
  OcdbtWriter::Options ocdbt_options;
  ocdbt_options.target_data_file_bytes = options.target_data_file_bytes;
  TS_ASSIGN_OR_RETURN(std::unique_ptr<OcdbtWriter> merged,
                      OcdbtWriter::Create(kv, item_dir, ocdbt_options));
  for (int p = 0; p < processes; ++p) {
    const std::string sub = StrCat(kOrbaxProcessDatabasePrefix, p);
    TS_ASSIGN_OR_RETURN(std::unique_ptr<OcdbtKvStore> db,
                        OcdbtKvStore::Open(kv, StrCat(item_dir, "/", sub)));
    TS_ASSIGN_OR_RETURN(std::vector<OcdbtKvStore::Entry> entries, db->Entries());
    for (const OcdbtKvStore::Entry& e : entries) {
      // A key two processes wrote (a chunk written twice) is InvalidArgument here.
      Status added = e.is_inline
                         ? merged->Add(e.key, e.inline_value)
                         : merged->AddReference(
                               e.key, {StrCat(sub, "/", e.file.base_path), e.file.relative_path},
                               e.offset, e.length);
      TS_RETURN_IF_ERROR(Annotate(added, StrCat("merging the database of process ", p)));
    }
  }
  return merged->Finish();
}

Status OrbaxWriter::Impl::CommitMultiProcess(
    OrbaxWriteStats* stats, const std::function<void(uint64_t, uint64_t)>& progress) {
  Coordinator& c = *coordinator;
  const auto timeout = kDefaultCoordinationTimeout;
  const int me = c.process_index();
  const int n = c.process_count();
  const std::string key_prefix = StrCat("tensorstash/orbax/", dir, "/", c.NextOperationId(), "/");

  // 1. Every process checks the tree (the same in each); all fail if one does.
  std::vector<Leaf> leaves;
  Status checked = CollectCheckedLeaves(&leaves);
  if (checked.ok() && StepCommitter(kv).protocol() != CommitProtocol::kRename) {
    checked = UnimplementedError(StrCat(kv->Describe(), " cannot rename folders; an Orbax "
                                        "checkpoint of several processes is published by one"));
  }
  const Status all_checked = AgreeOnStatus(c, key_prefix + "checked/", checked, timeout);
  TS_RETURN_IF_ERROR(checked);
  TS_RETURN_IF_ERROR(all_checked);

  // 2. Process 0 picks the temporary folder.
  Result<std::string> prepared = std::string();
  if (me == 0) prepared = PrepareFolder();
  TS_ASSIGN_OR_RETURN(const std::string tmp,
                      Broadcast(c, key_prefix + "folder", prepared, /*root=*/0, timeout,
                                "process 0 could not prepare the checkpoint folder"));
  const std::string item_dir = options.item.empty() ? tmp : StrCat(tmp, "/", options.item);

  // 3. The grids, then each process's own database "ocdbt.process_<p>" (process 0's also holds
  // the scalars and every zarr.json), and what each wrote.
  Status written = AgreeOnGrids(key_prefix);
  std::vector<ChunksWritten> chunks_written;
  if (written.ok()) {
    written = WriteDatabase(StrCat(item_dir, "/", kOrbaxProcessDatabasePrefix, me), leaves,
                            /*scalars=*/me == 0, /*zarr_metadata=*/me == 0, &chunks_written,
                            stats, progress);
  }
  // Per array [count, sum of linear indices], as JSON; "" after a failure.
  nlohmann::json report = nlohmann::json::array();
  for (const ChunksWritten& w : chunks_written) report.push_back({w.count, w.index_sum});
  Result<std::vector<std::string>> reports =
      AllGather(c, key_prefix + "written/", written.ok() ? report.dump() : "", timeout);
  if (written.ok() && !reports.ok()) written = reports.status();

  // 4-5. Process 0 checks that every chunk was written once, merges the databases, writes the
  // metadata and renames the folder into place; or removes it.
  const auto commit_or_clean_up = [&](const Status& all_written) -> Status {
    Status status = all_written;
    for (size_t i = 0; status.ok() && i < arrays.size(); ++i) {
      uint64_t count = 0;
      uint64_t sum = 0;
      for (size_t p = 0; p < reports->size(); ++p) {
        const nlohmann::json theirs =
            nlohmann::json::parse((*reports)[p], nullptr, /*allow_exceptions=*/false);
        std::vector<uint64_t> fields;
        if (!theirs.is_array() || theirs.size() != arrays.size() ||
            !UnsignedList(theirs[i], &fields) || fields.size() != 2) {
          status = InternalError(StrCat("process ", p, " sent a malformed report of the chunks "
                                        "it wrote: ", (*reports)[p]));
          break;
        }
        count += fields[0];
        sum += fields[1];  // modulo 2^64
      }
      if (!status.ok()) break;
      const ArrayEntry& a = arrays[i];
      uint64_t cells = 1;
      for (size_t d = 0; d < a.chunk_shape.size(); ++d) {
        cells *= static_cast<uint64_t>((a.spec.shape[d] + a.chunk_shape[d] - 1) / a.chunk_shape[d]);
      }
      const uint64_t expected_sum = cells % 2 == 0 ? (cells / 2) * (cells - 1)
                                                   : cells * ((cells - 1) / 2);
      if (count != cells || sum != expected_sum) {
        status = InvalidArgumentError(StrCat(
            "array '", a.spec.path, "': the processes wrote ", count, " chunks of the ", cells,
            " of the grid [", StrJoin(a.chunk_shape, ", "), "]; their shards must cover it, each "
            "box held by replicas 0..n-1"));
      }
    }
    if (status.ok()) status = MergeDatabases(item_dir, n);
    if (status.ok()) status = WriteMetadata(tmp, leaves);
    if (status.ok()) status = PublishFolder(kv, tmp, dir, TmpFolderName(dir, "old-"), options.sync);
    if (!status.ok()) (void)kv->DeletePrefix(tmp + "/");
    return status;
  };
  const Status verdict =
      AgreeOnStatus(c, key_prefix, written, timeout, commit_or_clean_up);
  return written.ok() ? verdict : written;
}

}  // namespace tensorstash
