// CheckpointWriter: saves a set of sharded arrays (and a pytree around them) as one step.
//
// Each process of a job creates a writer for the same step folder, adds every array of the
// checkpoint with the shards it holds, and calls Commit. Only replica 0 of a shard is written,
// unless `split_replicated_writes` is on, in which case the chunks of a replicated shard are
// divided among its replicas so that all of them write. Chunks are written in parallel, under a
// cap on the bytes held in staging buffers. Commit returns when the step is durable and visible,
// or with an error, in which case nothing new is visible and committed steps are untouched.
// The commit protocol is explained at the top of checkpoint_writer.cc.
//
//   CheckpointWriter::Create(&kv, "0000001000", {}) -> writer
//   writer->AddArray({"params/w", DType::kFloat32, {1024, 512}}, {{box, data, replica, n}})
//   writer->Commit()
//
// A save has two phases, public for callers that carry the results between processes
// themselves (PyTorch DCP's storage writer: every rank writes, one rank commits with every
// rank's results):
//   1. WritePart, on every process together: writes this process's chunks and files and
//      returns what it wrote (a WrittenPart, which EncodeWrittenPart turns into bytes);
//   2. CommitParts, on one process, with every process's part: checks them together and makes
//      the step visible.
// Commit is exactly these two: WritePart, the parts gathered to process 0, CommitParts there,
// and its outcome agreed by every process.
//
// Thread-safety: one thread uses a writer. The shard buffers must stay valid and unchanged
// until Commit (or WritePart) returns.
#ifndef TENSORSTASH_CHECKPOINT_CHECKPOINT_WRITER_H_
#define TENSORSTASH_CHECKPOINT_CHECKPOINT_WRITER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/array/chunk_source.h"
#include "tensorstash/array/dtype.h"
#include "tensorstash/coordination/collectives.h"
#include "tensorstash/coordination/coordinator.h"
#include "tensorstash/engine/executor.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/format/index_format.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

class StagingPool;

struct WriterOptions {
  // Shards larger than this are cut into several chunks of at most this size.
  int64_t target_chunk_bytes = int64_t{8} << 20;
  // A data file is closed and the next one started once it reaches this size.
  int64_t target_data_file_bytes = int64_t{1} << 30;
  // Cap on bytes held in staging buffers (gathers of non-contiguous chunks, compression).
  uint64_t max_inflight_bytes = kDefaultMaxInflightBytes;
  // Writer threads; 0 picks a default from the number of cores.
  int io_threads = 0;
  // fsync data and metadata before the commit (turn off only for benchmarks and scratch).
  bool sync = true;
  // Divide the chunks of a replicated shard among its replicas.
  bool split_replicated_writes = true;
  // Replace an existing complete step instead of failing with AlreadyExists.
  bool overwrite = false;
  // How long to wait for the other processes at each step of the protocol.
  std::chrono::milliseconds coordination_timeout = kDefaultCoordinationTimeout;
  // A holding (the node-local tier, docs/multitier.md): the step stores only the chunks of the
  // shards given, every one of them whatever its replica_id, and need not cover the arrays. A
  // reader of such a step finds the other chunks missing (DataLoss naming the chunk);
  // TieredStepSource reads them from other holders. Single process only.
  bool holding = false;
  // Copy every chunk into a staging buffer (under max_inflight_bytes) before writing it, even
  // a contiguous one, so that the shard buffers are free as soon as the last chunk is copied
  // rather than when the last write ends (async saves). Above the cap the copy proceeds in
  // waves: it waits for earlier chunks' writes to free staging.
  bool copy_sources = false;
  // Where staging buffers come from (null: a pool of this save's own). A manager hands every
  // async save the same pool, so that the buffers of one save are reused by the next instead of
  // mapped afresh: their page faults and zeroing were most of an async save's stall.
  StagingPool* staging_pool = nullptr;
  // Record each chunk's XXH3-128 digest in the index (util/chunk_digest.h), so that later saves
  // can save against this step (`base`). The index is then version 2 (docs/format.md, 6.1),
  // which tensorstash before incremental steps does not read.
  bool record_digests = false;
  // Incremental save: the folder (a key of the same store, in the same folder as this step) of
  // a committed earlier step. A chunk whose digest, dtype, chunk box (the same grid) and codec
  // equal those of that step's chunk is not written: the index refers to where its bytes
  // already lie (in the base's files, or wherever the base itself refers: references are never
  // chained), and COMMIT lists the steps referred to (`depends_on`). Implies record_digests.
  // Chunks of a base written without digests are written again. Not with `holding`.
  std::string base;
  // The identity shortcut (ShardData::same_as_base): the commit id (WriteStats::commit_id) of
  // the save that the caller's same_as_base promises refer to. They are kept only when the base
  // opened has exactly this id; otherwise (the base was saved again since, or is another step)
  // every chunk is hashed. Empty: no promise is kept.
  std::string base_commit_id;
  // With `base`: when the base cannot be opened (removed, its record or index unreadable, a
  // data file of it missing), save every chunk in full instead of failing, and say why in
  // WriteStats::base_unreadable. The manager's incremental saves do this; a one-off save
  // against a base fails (the error names the base).
  bool full_save_if_base_unreadable = false;
};

struct ArraySpec {
  std::string path;  // array path (see format/tree.h for escaping)
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  Codec codec = Codec::kNone;
  int zstd_level = 3;
  int64_t target_chunk_bytes = 0;  // 0: WriterOptions::target_chunk_bytes
};

// One shard this process holds: the elements of `box` in C order, in the array's dtype.
struct ShardData {
  Box box;
  const void* data = nullptr;
  int replica_id = 0;    // 0 .. num_replicas - 1
  int num_replicas = 1;  // how many devices hold this same box
  // The caller promises that `data` neither changes nor goes away until Commit returns (e.g. a
  // view of an immutable jax.Array): copy_sources writes it from where it is, uncopied.
  bool stable = false;
  // The caller promises that these bytes are those the shard held when the save with commit id
  // WriterOptions::base_commit_id read it (the same immutable jax.Array's buffers, still
  // alive): a chunk the base holds with a digest is then referenced without reading its bytes.
  bool same_as_base = false;
};

struct WriteStats {
  uint64_t raw_bytes = 0;     // bytes of array data this process wrote (before the codec)
  uint64_t stored_bytes = 0;  // bytes this process wrote to data files
  uint64_t chunks = 0;        // chunks this process wrote
  uint64_t data_files = 0;    // data files this process wrote
  // Incremental saves: chunks (and their stored bytes) recorded as references to another step
  // instead of written; not counted in `chunks`, `raw_bytes` or `stored_bytes`.
  uint64_t referenced_chunks = 0;
  uint64_t referenced_bytes = 0;
  // Of referenced_chunks, those referenced on the caller's promise (ShardData::same_as_base)
  // without hashing their bytes. Not carried in a WrittenPart's bytes.
  uint64_t unhashed_chunks = 0;
  // With record_digests, after Commit succeeded: the id of the committed step's record
  // (StepCommitId), for a later save's WriterOptions::base_commit_id; empty when it could not
  // be read back (the next save then hashes every chunk). Not carried in a WrittenPart's bytes.
  std::string commit_id;
  // With full_save_if_base_unreadable: why the base could not be opened (naming it) when this
  // process saved in full instead; empty otherwise. Not carried in a WrittenPart's bytes.
  std::string base_unreadable;
  // The most bytes this process held at once in staging buffers (gathers, copies, chunks
  // pulled from a ChunkSource, codec output): at most max(max_inflight_bytes, largest chunk).
  uint64_t peak_staged_bytes = 0;
  double seconds = 0;  // wall time of Commit (of WritePart in a WrittenPart)
};

// What one process wrote of a step (CheckpointWriter::WritePart), everything the process that
// commits needs from it: which save it belongs to, its data files and chunk entries, its whole
// files, and its stats.
struct WrittenPart {
  std::string dir;        // the step folder
  std::string attempt;    // the save's id (process 0 picks it): a part of another save differs
  int process_index = 0;  // which process wrote it, of `process_count`
  int process_count = 1;
  std::vector<std::string> array_digests;  // per array in AddArray order: spec and chunk grid
  ChunkIndex index;                        // data files ("data/<process>-<seq>.dat") and chunks
  std::map<std::string, CommitFile> files;  // AddFile's files: name -> size and CRC-32C
  WriteStats stats;
};

// A part as bytes, to carry between processes: versioned and ending with a CRC-32C of the rest
// (the chunk entries in format/index_format.h's encoding inside). InvalidArgument when the
// index does not encode (format/index_format.h).
Result<std::string> EncodeWrittenPart(const WrittenPart& part);
// The inverse. InvalidArgument naming `where` for bytes that are not a written part or one of a
// newer major version; DataLoss naming `where` for a corrupt or truncated one.
Result<WrittenPart> DecodeWrittenPart(std::string_view bytes, std::string_view where);

// The identity of a committed step's record: XXH3-128 of its encoding, 32 hex digits. A step
// saved again under the same name gets another (its creation time, index CRC and sizes differ).
std::string StepCommitId(const CommitRecord& record);

// The largest file AddFile takes (metadata and per-process state are meant to be small).
inline constexpr uint64_t kMaxStepFileBytes = uint64_t{64} << 20;

// OK when `name` may be the name of a file added with AddFile: a relative key of letters,
// digits, '.', '_', '-' and '/', not "COMMIT" and not under "state/"; else InvalidArgument.
Status ValidateStepFileName(std::string_view name);

class CheckpointWriter {
 public:
  // `dir` is the step folder's key in `kv` (e.g. "run1/0000001000"). `coordinator` may be null
  // for a single-process job; it must outlive the writer. Fails with InvalidArgument for a bad
  // key or options.
  static Result<std::unique_ptr<CheckpointWriter>> Create(KvStore* kv, std::string dir,
                                                          WriterOptions options = {},
                                                          Coordinator* coordinator = nullptr);
  ~CheckpointWriter();

  // Adds an array and this process's shards of it (possibly none). Every process must add the
  // same arrays in the same order. InvalidArgument naming the array for a bad path, shape,
  // shard box outside the shape, null data, or replica ids out of range.
  Status AddArray(ArraySpec spec, std::vector<ShardData> shards);
  // Adds an array held whole by this process whose chunks' bytes `source` produces when each
  // chunk is written (array/chunk_source.h), so that the array is never in memory whole: at most
  // max_inflight_bytes of chunks are staged at once. The other processes of the job add the
  // array with no shards. The chunk grid follows spec.target_chunk_bytes (or the option).
  // InvalidArgument naming the array as above, or for an empty `source`.
  Status AddArrayFromSource(ArraySpec spec, ChunkSource source);

  // Adds a whole file of this process to the step, at `name` inside the step folder (e.g.
  // "metadata.json", "process/3"). COMMIT records its size and CRC-32C, so it is committed
  // with the arrays and checked when read (CheckpointReader::ReadFile). Names must be unique
  // across all processes; a collision fails the commit. InvalidArgument for a bad name (not a
  // relative key, or under "state/", or "COMMIT") or one larger than kMaxStepFileBytes.
  Status AddFile(std::string name, std::string contents);

  // Replaces the default tree (nested dicts built from the array paths). Array leaves refer to
  // arrays by the order of AddArray calls. Checked at Commit.
  void SetTree(TreeNode root);

  // Writes this process's chunks, then runs the commit protocol with the other processes.
  // On success the step is complete and durable (with `sync`). On failure returns the first
  // error of any process (every process returns an error), and the step is not visible.
  // AlreadyExists when the step is already complete and !overwrite. May be called once.
  // `on_sources_released`, when set, is called exactly once, before Commit returns, as soon as
  // the shard buffers not marked `stable` will not be read again (with copy_sources: once every
  // such chunk is copied;
  // otherwise once every chunk is written; on failure: when the failure is known).
  Status Commit(WriteStats* stats = nullptr,
                const std::function<void()>& on_sources_released = nullptr);

  // Phase 1 of a save (Commit's first half), called by every process of the job together: they
  // agree on the folder (process 0 prepares it) and the chunk grids through the coordinator,
  // then each writes its own chunks and files and returns what it wrote. Nothing is visible
  // until CommitParts. Errors: as Commit's, for this process (the others may succeed; the
  // folder written into is left for the next save of the step, or gc, to remove). May be called
  // once, instead of Commit. `on_sources_released`: as Commit's, before WritePart returns.
  Result<WrittenPart> WritePart(const std::function<void()>& on_sources_released = nullptr);

  // Phase 2, on one process whose writer ran WritePart, with every process's part (its own
  // included, in any order): checks them together, then writes the step's index and tree and
  // commits it (engine/step_committer.h). Call it only once every process's WritePart has
  // returned. InvalidArgument naming the process for a part of another save or step, a missing
  // or repeated process, or arrays described differently (naming the array); naming the array
  // for chunks no part wrote (the shards do not cover it) or wrote twice; naming the file for a
  // file added by two processes. On any failure nothing becomes visible and the folder written
  // into is removed (unless the store could not say whether the commit happened).
  // AlreadyExists as Commit. May be called once.
  Status CommitParts(std::vector<WrittenPart> parts);

 private:
  struct Impl;
  explicit CheckpointWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_CHECKPOINT_CHECKPOINT_WRITER_H_
