// The commit protocol.
//
// Every process runs the same steps; the coordinator's key-value store carries what they must
// agree on, under keys "tensorstash/<dir>/<operation id>/...", through the collectives of
// coordination/collectives.h (each wait bounded by `coordination_timeout`).
//
//  1. Process 0 prepares the step: it refuses a complete step unless `overwrite`, and anything
//     at <dir> that tensorstash did not write (step_folder.h), removes tensorstash's own
//     leftovers of the same name, and picks the folder to write into. With a backend
//     that can rename (POSIX) that is a temporary "<dir>.tmp-<nonce>"; without rename it is <dir>
//     itself (any old COMMIT removed first, so the step is invisible while it is rewritten). It
//     publishes the folder (or its error) as "workdir".
//  2. Each process publishes, per array, the gcd of its shard boundaries and a digest of the
//     array's spec ("cells/<p>"). Every process checks that all digests agree (else every
//     process fails with InvalidArgument) and merges the gcds into the same chunk grid per array.
//  3. Each process writes its chunks into its own data files "state/data/<p>-<seq>.dat", syncs
//     them, writes its index part "state/index.part-<p>" (processes > 0), and publishes its
//     status ("status/<p>").
//  4. Process 0 waits for every status (all of them, even after an error, so that it never
//     removes the folder while another process still writes into it). If all are OK it merges
//     the index parts, checks that every chunk of every array was written exactly once, writes
//     state/index and state/tree.json, syncs them, and writes COMMIT last (with the CRC-32C of
//     both files). With rename it then renames the temporary folder to <dir> and syncs the
//     parent folder: the step appears whole, or not at all. It publishes the outcome
//     ("result"), and removes the folder on failure.
//  5. Processes > 0 wait for "result" and return it.
// A crash at any point leaves either the previous state or a folder without COMMIT (or a
// ".tmp-" folder), which readers refuse and `tensorstash ls` shows as incomplete.

#include "tensorstash/checkpoint/checkpoint_writer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "tensorstash/array/chunk_grid.h"
#include "tensorstash/coordination/collectives.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/engine/object_store_commit.h"
#include "tensorstash/engine/step_folder.h"
#include "tensorstash/coordination/single_process_coordinator.h"
#include "tensorstash/engine/data_file_set.h"
#include "tensorstash/engine/executor.h"
#include "tensorstash/engine/publish.h"
#include "tensorstash/engine/step_committer.h"
#include "tensorstash/engine/write_plan.h"
#include "tensorstash/format/chunk_codec.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/format/index_format.h"
#include "tensorstash/util/copy_bytes.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/thread_pool.h"

namespace tensorstash {
namespace {

struct ArrayEntry {
  ArraySpec spec;
  std::vector<ShardData> shards;
  ChunkGrid grid;
};

// A planned chunk write (engine/write_plan.h) and what executing it needs.
struct ChunkTask {
  ChunkWrite plan;
  const ShardData* shard;
  bool preallocated = false;
  DataFileSet::Location location{};
};

// The most data files one process writes at once.
constexpr int kMaxLanes = 4;

// Gcd vectors of all arrays, one process's view: "g,g,g;g,g;..." (one group per array).
std::string EncodeGcds(const std::vector<std::vector<int64_t>>& gcds) {
  std::vector<std::string> groups;
  for (const auto& g : gcds) groups.push_back(StrJoin(g, ","));
  return StrCat(gcds.size(), ":", StrJoin(groups, ";"));
}
Status MergeGcds(std::string_view text, std::vector<std::vector<int64_t>>* gcds, int from) {
  auto bad = [&] {
    return InvalidArgumentError(
        StrCat("process ", from,
               " described a different set of arrays; every process must add the "
               "same arrays in the same order"));
  };
  const size_t colon = text.find(':');
  size_t count = 0;
  if (colon == std::string_view::npos || !ParseInt(text.substr(0, colon), &count) ||
      count != gcds->size()) {
    return bad();
  }
  if (count == 0) return OkStatus();
  std::vector<std::string_view> groups = StrSplit(text.substr(colon + 1), ';');
  if (groups.size() != count) return bad();
  for (size_t a = 0; a < count; ++a) {
    std::vector<int64_t> other;
    if (!groups[a].empty()) {
      for (std::string_view v : StrSplit(groups[a], ',')) {
        int64_t x;
        if (!ParseInt(v, &x)) return bad();
        other.push_back(x);
      }
    }
    if (other.size() != (*gcds)[a].size()) return bad();
    (*gcds)[a] = MergeBoundaryGcds((*gcds)[a], other);
  }
  return OkStatus();
}

// A digest of everything about an array that every process must agree on: what tree.json will
// say about it, and the chunk size target that shapes its grid. Processes that disagree would
// write chunks that do not fit the committed metadata.
std::string ArrayDigest(const ArraySpec& spec, int64_t target_chunk_bytes) {
  return Hex32(
      Crc32c(StrCat(spec.path, '\0', DTypeName(spec.dtype), '\0', StrJoin(spec.shape, ","), '\0',
                    CodecName(spec.codec), '\0', spec.codec == Codec::kZstd ? spec.zstd_level : 0,
                    '\0', target_chunk_bytes)));
}

// Adds another process's "files/<p>" listing ("<size> <crc> <name>" lines) to `files`.
Status MergeFileListing(std::string_view listing, int from,
                        std::map<std::string, CommitFile>* files) {
  for (std::string_view line : StrSplit(listing, '\n')) {
    if (line.empty()) continue;
    const size_t a = line.find(' ');
    const size_t b = a == std::string_view::npos ? a : line.find(' ', a + 1);
    CommitFile f;
    uint64_t crc = 0;
    if (b == std::string_view::npos || !ParseInt(line.substr(0, a), &f.size) ||
        !ParseInt(line.substr(a + 1, b - a - 1), &crc) || crc > UINT32_MAX) {
      return InternalError(StrCat("malformed file listing from process ", from));
    }
    f.crc32c = static_cast<uint32_t>(crc);
    const std::string name(line.substr(b + 1));
    if (!files->emplace(name, f).second) {
      return InvalidArgumentError(StrCat("file '", name, "' was added by process ", from,
                                         " and by another process; names must be unique"));
    }
  }
  return OkStatus();
}

}  // namespace

Status ValidateStepFileName(std::string_view name) {
  auto bad = [&](std::string_view why) {
    return InvalidArgumentError(StrCat("invalid step file name '", name, "': ", why));
  };
  TS_RETURN_IF_ERROR(Annotate(ValidateKey(name), StrCat("step file name '", name, "'")));
  for (char ch : name) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                    (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-' || ch == '/';
    if (!ok) return bad("only letters, digits, '.', '_', '-' and '/' are allowed");
  }
  if (name == kCommitFileName) return bad("reserved for the commit record");
  if (name == kStateItem || name.rfind(StrCat(kStateItem, "/"), 0) == 0) {
    return bad("the \"state\" folder holds the arrays");
  }
  return OkStatus();
}

struct CheckpointWriter::Impl {
  KvStore* kv;
  std::string dir;
  WriterOptions options;
  Coordinator* coordinator;
  SingleProcessCoordinator own_coordinator;
  std::vector<ArrayEntry> arrays;
  std::set<std::string, std::less<>> array_paths;  // of `arrays`: duplicates found in O(log n)
  std::optional<TreeNode> tree;
  std::map<std::string, std::string> step_files;  // AddFile: name -> contents
  bool commit_started = false;
  std::function<void()> on_sources_released;  // called once (ReleaseSources)

  std::string key_prefix;               // for coordinator keys of this commit
  std::string work_dir;                 // where files are written (temporary folder, or dir)
  bool commit_outcome_unknown = false;  // object stores: the record may exist (CommitAttempt)
  std::string nonce;

  Status AgreeOnGrids();
  Status WriteLocal(ChunkIndex* local, WriteStats* stats);
  Status GatherChunk(const ChunkTask& task, char* out) const;
  Status WriteChunk(const ChunkTask& task, std::string_view raw, DataFileSet* files,
                    std::mutex* mutex, std::vector<IndexEntry>* entries, WriteStats* stats);
  Status WriteFiles(std::map<std::string, CommitFile>* written);
  Status MergeAndCommit(ChunkIndex local, std::map<std::string, CommitFile> committed_files);
  void ReleaseSources() {
    if (on_sources_released) std::exchange(on_sources_released, nullptr)();
  }
  void RemoveWorkDir();
};

CheckpointWriter::CheckpointWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CheckpointWriter::~CheckpointWriter() = default;

Result<std::unique_ptr<CheckpointWriter>> CheckpointWriter::Create(KvStore* kv, std::string dir,
                                                                   WriterOptions options,
                                                                   Coordinator* coordinator) {
  TS_RETURN_IF_ERROR(ValidateKey(dir));
  if (IsTemporaryStepName(dir)) {
    return InvalidArgumentError(
        StrCat("step folder '", dir, "' uses a name reserved for temporary folders"));
  }
  if (options.target_chunk_bytes <= 0 || options.target_data_file_bytes <= 0) {
    return InvalidArgumentError("target_chunk_bytes and target_data_file_bytes must be > 0");
  }
  if (options.holding && coordinator != nullptr && coordinator->process_count() > 1) {
    return InvalidArgumentError("a holding (node-local step) is written by one process alone");
  }
  auto impl = std::make_unique<Impl>();
  impl->kv = kv;
  impl->dir = std::move(dir);
  impl->options = options;
  impl->coordinator = coordinator != nullptr ? coordinator : &impl->own_coordinator;
  if (impl->options.io_threads <= 0) impl->options.io_threads = DefaultIoThreads();
  return std::unique_ptr<CheckpointWriter>(new CheckpointWriter(std::move(impl)));
}

Status CheckpointWriter::AddArray(ArraySpec spec, std::vector<ShardData> shards) {
  const std::string what = StrCat("array '", spec.path, "'");
  if (impl_->commit_started) return FailedPreconditionError("Commit was already called");
  TS_RETURN_IF_ERROR(SplitArrayPath(spec.path).status());
  if (static_cast<int>(spec.dtype) >= kNumDTypes) {
    return InvalidArgumentError(StrCat(what, ": invalid dtype"));
  }
  const size_t item = ItemSize(spec.dtype);
  TS_RETURN_IF_ERROR(ValidateBox(Box::FromShape(spec.shape), item, what));
  const Box whole = Box::FromShape(spec.shape);
  for (size_t i = 0; i < shards.size(); ++i) {
    const ShardData& shard = shards[i];
    const std::string shard_what = StrCat(what, " shard ", i);
    TS_RETURN_IF_ERROR(ValidateBox(shard.box, item, shard_what));
    if (!whole.Contains(shard.box)) {
      return InvalidArgumentError(StrCat(shard_what, " box ", shard.box.ToString(),
                                         " lies outside the shape ", whole.ToString()));
    }
    if (shard.data == nullptr && !shard.box.empty()) {
      return InvalidArgumentError(StrCat(shard_what, " has no data"));
    }
    if (shard.num_replicas < 1 || shard.replica_id < 0 || shard.replica_id >= shard.num_replicas) {
      return InvalidArgumentError(
          StrCat(shard_what, ": replica id ", shard.replica_id, " of ", shard.num_replicas));
    }
  }
  if (!impl_->array_paths.insert(spec.path).second) {
    return InvalidArgumentError(StrCat(what, " was added twice"));
  }
  impl_->arrays.push_back({std::move(spec), std::move(shards), {}});
  return OkStatus();
}

void CheckpointWriter::SetTree(TreeNode root) { impl_->tree = std::move(root); }

Status CheckpointWriter::AddFile(std::string name, std::string contents) {
  if (impl_->commit_started) return FailedPreconditionError("Commit was already called");
  TS_RETURN_IF_ERROR(ValidateStepFileName(name));
  if (contents.size() > kMaxStepFileBytes) {
    return InvalidArgumentError(StrCat("file '", name, "' has ", contents.size(),
                                       " bytes, more than the limit of ", kMaxStepFileBytes));
  }
  if (!impl_->step_files.emplace(name, std::move(contents)).second) {
    return InvalidArgumentError(StrCat("file '", name, "' was added twice"));
  }
  return OkStatus();
}

Status CheckpointWriter::Commit(WriteStats* stats,
                                const std::function<void()>& on_sources_released) {
  Impl& s = *impl_;
  if (on_sources_released) s.on_sources_released = on_sources_released;
  // Whatever path Commit takes, the caller learns that its buffers are free before it returns.
  struct ReleaseOnExit {
    Impl* impl;
    ~ReleaseOnExit() { impl->ReleaseSources(); }
  } release_on_exit{&s};
  if (s.commit_started) return FailedPreconditionError("Commit was already called");
  s.commit_started = true;
  const auto start = std::chrono::steady_clock::now();
  WriteStats local_stats;
  Coordinator& c = *s.coordinator;
  const auto timeout = s.options.coordination_timeout;
  s.key_prefix = StrCat("tensorstash/", s.dir, "/", c.NextOperationId(), "/");

  // 1. Process 0 prepares the folder.
  Result<std::string> prepared = std::string();
  if (c.process_index() == 0) {
    s.nonce = RandomHexId();
    prepared = StepCommitter(s.kv).Prepare(
        s.dir, s.nonce, {.overwrite = s.options.overwrite, .writers = c.process_count()});
  }
  TS_ASSIGN_OR_RETURN(s.work_dir, Broadcast(c, s.key_prefix + "workdir", std::move(prepared),
                                            /*root=*/0, timeout,
                                            "process 0 could not prepare the step"));

  // 2-3. Agree on chunk grids, write this process's chunks.
  TS_RETURN_IF_ERROR(s.AgreeOnGrids());
  ChunkIndex local;
  Status written = s.WriteLocal(&local, &local_stats);
  s.ReleaseSources();
  // Then this process's whole files; their checks travel to process 0 under "files/<p>", set
  // before the status, so that process 0 reads them without waiting once every status is OK.
  std::map<std::string, CommitFile> committed_files;
  if (written.ok()) written = s.WriteFiles(&committed_files);
  std::string listing;
  for (const auto& [name, f] : committed_files) {
    listing += StrCat(f.size, " ", f.crc32c, " ", name, "\n");
  }
  const std::string files_prefix = StrCat(s.key_prefix, "files/");
  TS_RETURN_IF_ERROR(PublishValue(c, files_prefix, listing));

  // 4-5. Every status reaches process 0 (all of them, even after an error: the folder may only
  // be removed once no process writes into it any more), which commits or cleans up, and every
  // process learns the outcome.
  auto commit_or_clean_up = [&](const Status& all_written) -> Status {
    Status result = all_written;
    if (result.ok()) {
      std::vector<int> others;
      for (int p = 1; p < c.process_count(); ++p) others.push_back(p);
      Result<std::map<int, std::string>> listings = CollectValues(c, files_prefix, others, timeout);
      result = listings.status();
      for (int p : others) {
        if (result.ok()) result = MergeFileListing((*listings)[p], p, &committed_files);
      }
    }
    if (result.ok()) result = s.MergeAndCommit(std::move(local), std::move(committed_files));
    // A commit whose outcome is unknown may have made the attempt the step: it stays (gc).
    if (!result.ok() && !s.commit_outcome_unknown) s.RemoveWorkDir();
    return result;
  };
  const Status verdict = AgreeOnStatus(c, s.key_prefix, written, timeout, commit_or_clean_up);
  // A process that failed reports its own error, the others the first error of any process.
  const Status result = written.ok() ? verdict : written;
  local_stats.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (stats != nullptr) *stats = local_stats;
  return result;
}

Status CheckpointWriter::Impl::AgreeOnGrids() {
  std::vector<std::vector<int64_t>> gcds;
  std::vector<std::string> digests;
  gcds.reserve(arrays.size());
  auto target_of = [&](const ArrayEntry& a) {
    return a.spec.target_chunk_bytes > 0 ? a.spec.target_chunk_bytes : options.target_chunk_bytes;
  };
  for (const ArrayEntry& a : arrays) {
    std::vector<Box> boxes;
    for (const ShardData& shard : a.shards) boxes.push_back(shard.box);
    gcds.push_back(ShardBoundaryGcd(a.spec.shape, boxes));
    digests.push_back(ArrayDigest(a.spec, target_of(a)));
  }
  Coordinator& c = *coordinator;
  if (c.process_count() > 1) {
    // "<gcds>#<digest>,<digest>,...": the digests make processes that describe an array
    // differently (path, dtype, shape, codec, chunk size) fail here, each of them.
    TS_ASSIGN_OR_RETURN(std::vector<std::string> cells,
                        AllGather(c, StrCat(key_prefix, "cells/"),
                                  StrCat(EncodeGcds(gcds), "#", StrJoin(digests, ",")),
                                  options.coordination_timeout));
    for (int p = 0; p < c.process_count(); ++p) {
      if (p == c.process_index()) continue;
      const std::string& other = cells[p];
      const size_t hash = other.find('#');
      const std::string_view other_gcds = std::string_view(other).substr(0, hash);
      TS_RETURN_IF_ERROR(MergeGcds(other_gcds, &gcds, p));
      const std::vector<std::string_view> other_digests =
          hash == std::string::npos || arrays.empty()
              ? std::vector<std::string_view>()
              : StrSplit(std::string_view(other).substr(hash + 1), ',');
      if (other_digests.size() != digests.size()) {
        return InvalidArgumentError(
            StrCat("process ", p,
                   " described a different set of arrays; every process must add the "
                   "same arrays in the same order"));
      }
      for (size_t i = 0; i < digests.size(); ++i) {
        if (other_digests[i] != digests[i]) {
          return InvalidArgumentError(
              StrCat("array '", arrays[i].spec.path, "' (number ", i,
                     ") is described differently by "
                     "process ",
                     c.process_index(), " and process ", p,
                     " (path, dtype, shape, codec or "
                     "chunk size); every process must add the same arrays in the same order"));
        }
      }
    }
  }
  for (size_t i = 0; i < arrays.size(); ++i) {
    ArrayEntry& a = arrays[i];
    const int64_t target = target_of(a);
    a.grid = ChooseChunkGrid(a.spec.shape, FinishCellShape(a.spec.shape, gcds[i]),
                             ItemSize(a.spec.dtype), target);
    TS_RETURN_IF_ERROR(
        ValidateChunkGrid(a.grid, ItemSize(a.spec.dtype), StrCat("array '", a.spec.path, "'")));
  }
  return OkStatus();
}

Status CheckpointWriter::Impl::WriteLocal(ChunkIndex* local, WriteStats* stats) {
  Coordinator& c = *coordinator;
  // Plan (engine/write_plan.h): which chunks this process writes, from which shard, in which
  // lane. Big saves write a few files at once (lanes): the filesystem serializes buffered writes
  // into one file. Each lane gets at least kMinLaneBytes so small saves stay in one file.
  constexpr uint64_t kMinLaneBytes = uint64_t{64} << 20;
  std::vector<ChunkTask> tasks;
  std::vector<size_t> lane_order;  // the lanes side by side: a task of each in turn
  int lanes = 1;
  {
    std::vector<ArrayToWrite> to_write(arrays.size());
    for (size_t id = 0; id < arrays.size(); ++id) {
      const ArrayEntry& a = arrays[id];
      to_write[id] = {a.spec.path, &a.grid, ItemSize(a.spec.dtype), {}};
      for (const ShardData& shard : a.shards) {
        to_write[id].shards.push_back({shard.box, shard.replica_id, shard.num_replicas});
      }
      if (options.holding) {
        // A holding keeps every box this process has, whichever replicas of the job's it is:
        // the shards of one box here are numbered as its only replicas.
        std::vector<ShardPlacement>& placed = to_write[id].shards;
        for (size_t i = 0; i < placed.size(); ++i) {
          int count = 0, rank = 0;
          for (size_t j = 0; j < placed.size(); ++j) {
            if (placed[j].box == placed[i].box) {
              rank += j < i ? 1 : 0;
              ++count;
            }
          }
          placed[i].replica_id = rank;
          placed[i].num_replicas = count;
        }
      }
    }
    TS_ASSIGN_OR_RETURN(std::vector<ChunkWrite> writes,
                        PlanChunkWrites(to_write, options.split_replicated_writes));
    lanes = CountLanes(writes, options.io_threads, kMaxLanes, kMinLaneBytes);
    AssignLanes(&writes, lanes);
    lane_order = InterleaveLanes(writes, lanes);
    tasks.reserve(writes.size());
    for (ChunkWrite& w : writes) {
      const ShardData* shard = &arrays[w.array_id].shards[w.shard];
      tasks.push_back({std::move(w), shard});
    }
  }
  // A synced save starts each file's writeback every few MiB: the storage then writes while
  // the save copies, instead of all at once in the final fsync (a 512 MiB save on 4 files here:
  // 430-470 -> 280-290 ms). It also writes large chunks around the page cache
  // (WritableFile::PreferDirectWrites): they go to storage anyway, and filling fresh page-cache
  // memory costs more than that here.
  constexpr uint64_t kWritebackBytes = uint64_t{8} << 20;
  DataFileSet files(kv, ItemDir(work_dir, kStateItem), c.process_index(),
                    static_cast<uint64_t>(options.target_data_file_bytes), lanes,
                    options.sync ? kWritebackBytes : 0, /*direct_writes=*/options.sync);
  // Uncompressed chunks get their places up front, in array and chunk order, each lane taking
  // a contiguous share of the bytes, so that the chunks of an array lie side by side and
  // readers can fetch neighbours in one request.
  // A chunk that follows the chunk before it of the same array is placed right after it where
  // it can be (DataFileSet::Allocate), so that a whole array can be mapped as one run.
  std::vector<const ChunkWrite*> last_in_lane(static_cast<size_t>(lanes), nullptr);
  for (ChunkTask& task : tasks) {
    if (arrays[task.plan.array_id].spec.codec != Codec::kNone) continue;
    const ChunkWrite*& last = last_in_lane[static_cast<size_t>(task.plan.lane)];
    const bool continues = last != nullptr && last->array_id == task.plan.array_id &&
                           last->chunk + 1 == task.plan.chunk;
    TS_ASSIGN_OR_RETURN(task.location,
                        files.Allocate(task.plan.raw_bytes, task.plan.lane, continues));
    task.preallocated = true;
    last = &task.plan;
  }
  ThreadPool pool(options.io_threads);
  std::mutex mutex;
  std::vector<IndexEntry> entries;
  entries.reserve(tasks.size());
  {
    // engine/executor.h: the chunks in lane order, their staging under max_inflight_bytes.
    Executor run(&pool, options.max_inflight_bytes, /*max_pending=*/0, options.staging_pool);
    // With copy_sources, the caller's buffers are free once the last copy is made: an async
    // save returns to training then, without waiting for the writes of stable shards (written
    // from where they are) to be admitted under the cap.
    auto copied = [&](const ChunkTask* task) {
      return options.copy_sources && !task->shard->stable;
    };
    size_t copies_left = 0;
    for (const ChunkTask& task : tasks) copies_left += copied(&task) ? 1 : 0;
    if (options.copy_sources && copies_left == 0) ReleaseSources();
    // The lanes side by side (`tasks` are in the order of the plan's writes).
    for (size_t i : lane_order) {
      const ChunkTask* task = &tasks[i];
      if (run.failed()) break;
      const ArrayEntry& a = arrays[task->plan.array_id];
      const uint64_t raw_size = task->plan.chunk_box.num_elements() * ItemSize(a.spec.dtype);
      // The encoder's output is held too, so that a write never waits for staging that only
      // the admitting thread could free.
      const uint64_t encoded =
          a.spec.codec == Codec::kNone ? 0 : MaxEncodedSize(a.spec.codec, raw_size);
      const bool contiguous = IsContiguousIn(task->plan.chunk_box, task->shard->box);
      auto write = [&, task, raw_size](const char* raw) {
        return WriteChunk(*task, std::string_view(raw, raw_size), &files, &mutex, &entries, stats);
      };
      if (copied(task)) {
        // Copied by this thread and the pool's, in waves when the cap is reached (waiting for
        // writes to free staging), and written by the pool.
        run.RunPrepared(
            raw_size + encoded, [&, task](char* staged) { return GatherChunk(*task, staged); },
            write);
        if (--copies_left == 0) {
          run.FinishPrepared();
          ReleaseSources();  // the caller goes on; now the writes of the copies start
          run.Flush();
        }
      } else if (contiguous) {
        // Straight from the caller's buffer to the file.
        const char* raw =
            static_cast<const char*>(task->shard->data) +
            ByteOffsetIn(task->plan.chunk_box, task->shard->box, ItemSize(a.spec.dtype));
        run.RunHolding(encoded, [write, raw] { return write(raw); });
      } else {
        run.Run(raw_size + encoded, [&, task, write](char* gathered) {
          TS_RETURN_IF_ERROR(GatherChunk(*task, gathered));
          return write(gathered);
        });
      }
    }
    // After a failure the copying stopped early: what runs still reads staging only.
    if (options.copy_sources) ReleaseSources();
    TS_RETURN_IF_ERROR(run.Wait());
  }
  TS_RETURN_IF_ERROR(files.Finish(options.sync, &local->files, &pool));
  stats->data_files = local->files.size();
  local->entries = std::move(entries);
  if (c.process_index() > 0) {
    // Process 0 merges the other processes' parts.
    TS_ASSIGN_OR_RETURN(std::string part, EncodeIndex(*local));
    const std::string key =
        StrCat(ItemDir(work_dir, kStateItem), "/", kIndexFileName, ".part-", c.process_index());
    TS_RETURN_IF_ERROR(kv->Write(key, part));
    if (options.sync) TS_RETURN_IF_ERROR(kv->Sync(key));
  }
  return OkStatus();
}

Status CheckpointWriter::Impl::GatherChunk(const ChunkTask& task, char* out) const {
  const ArrayEntry& a = arrays[task.plan.array_id];
  const ShardData& shard = *task.shard;
  const size_t item = ItemSize(a.spec.dtype);
  if (IsContiguousIn(task.plan.chunk_box, shard.box)) {
    CopyBytes(
        out,
        static_cast<const char*>(shard.data) + ByteOffsetIn(task.plan.chunk_box, shard.box, item),
        task.plan.chunk_box.num_elements() * item);
    return OkStatus();
  }
  return CopyBox(task.plan.chunk_box, a.spec.dtype, shard.data, shard.box, a.spec.dtype, out,
                 task.plan.chunk_box, a.spec.path);
}

Status CheckpointWriter::Impl::WriteChunk(const ChunkTask& task, std::string_view raw,
                                          DataFileSet* files, std::mutex* mutex,
                                          std::vector<IndexEntry>* entries, WriteStats* stats) {
  const ArrayEntry& a = arrays[task.plan.array_id];
  std::string encoded;
  std::string_view stored = raw;
  if (a.spec.codec != Codec::kNone) {
    TS_RETURN_IF_ERROR(EncodeChunk(a.spec.codec, a.spec.zstd_level, stored, &encoded));
    stored = encoded;
  }
  const uint32_t crc = Crc32c(stored);
  DataFileSet::Location location = task.location;
  if (!task.preallocated) {
    TS_ASSIGN_OR_RETURN(location, files->Allocate(stored.size(), task.plan.lane));
  }
  TS_RETURN_IF_ERROR(Annotate(files->Write(location, stored.data(), stored.size()),
                              StrCat("writing chunk ", a.grid.ChunkName(task.plan.chunk),
                                     " of array '", a.spec.path, "'")));
  std::lock_guard<std::mutex> lock(*mutex);
  entries->push_back({task.plan.array_id, location.file_id, static_cast<uint64_t>(task.plan.chunk),
                      location.offset, stored.size(), crc});
  stats->raw_bytes += raw.size();
  stats->stored_bytes += stored.size();
  ++stats->chunks;
  return OkStatus();
}

Status CheckpointWriter::Impl::WriteFiles(std::map<std::string, CommitFile>* written) {
  for (const auto& [name, contents] : step_files) {
    const std::string key = StrCat(work_dir, "/", name);
    TS_RETURN_IF_ERROR(kv->Write(key, contents));
    if (options.sync) TS_RETURN_IF_ERROR(kv->Sync(key));
    (*written)[name] = {contents.size(), Crc32c(contents)};
  }
  return OkStatus();
}

Status CheckpointWriter::Impl::MergeAndCommit(ChunkIndex local,
                                              std::map<std::string, CommitFile> committed_files) {
  Coordinator& c = *coordinator;
  const std::string item_dir = ItemDir(work_dir, kStateItem);
  ChunkIndex merged = std::move(local);
  for (int p = 1; p < c.process_count(); ++p) {
    const std::string key = StrCat(item_dir, "/", kIndexFileName, ".part-", p);
    TS_ASSIGN_OR_RETURN(std::string bytes, kv->Read(key));
    TS_ASSIGN_OR_RETURN(ChunkIndex part, DecodeIndex(bytes, key));
    const uint32_t base = static_cast<uint32_t>(merged.files.size());
    for (DataFileInfo& f : part.files) merged.files.push_back(std::move(f));
    for (IndexEntry e : part.entries) {
      e.file_id += base;
      merged.entries.push_back(e);
    }
    TS_RETURN_IF_ERROR(kv->Delete(key));
  }

  if (merged.files.size() > kMaxDataFiles) {
    return ResourceExhaustedError(StrCat("the processes wrote ", merged.files.size(),
                                         " data files, more than the format's limit of ",
                                         kMaxDataFiles, "; raise target_data_file_bytes"));
  }
  // Every chunk of every array must have been written exactly once.
  std::vector<int64_t> counts(arrays.size(), 0);
  for (const IndexEntry& e : merged.entries) ++counts[e.array_id];
  for (size_t i = 0; i < arrays.size(); ++i) {
    const int64_t expected = arrays[i].grid.NumStoredChunks();
    if (counts[i] < expected && !options.holding) {
      return InvalidArgumentError(
          StrCat("array '", arrays[i].spec.path, "': only ", counts[i], " of ", expected,
                 " chunks were written; the shards given by all processes do not cover the array"));
    }
  }
  TS_ASSIGN_OR_RETURN(std::string index_bytes, EncodeIndex(merged));

  TreeFile tree_file;
  for (const ArrayEntry& a : arrays) {
    tree_file.arrays.push_back({a.spec.path, a.spec.dtype, a.grid, a.spec.codec,
                                a.spec.codec == Codec::kZstd ? a.spec.zstd_level : 0});
  }
  if (tree.has_value()) {
    tree_file.root = *tree;
  } else {
    TS_ASSIGN_OR_RETURN(tree_file.root, TreeFromArrayPaths(tree_file.arrays));
  }
  TS_ASSIGN_OR_RETURN(std::string tree_json, EncodeTreeJson(tree_file));
  // A caller-supplied tree is checked by the same rules a reader applies. The decoder reports
  // DataLoss (it is meant for stored bytes); here the caller's input is wrong.
  if (Status checked = DecodeTreeJson(tree_json, "tree being written").status(); !checked.ok()) {
    return InvalidArgumentError(StrCat("invalid tree: ", checked.message()));
  }

  const std::string index_key = StrCat(item_dir, "/", kIndexFileName);
  const std::string tree_key = StrCat(item_dir, "/", kTreeFileName);
  TS_RETURN_IF_ERROR(kv->Write(index_key, index_bytes));
  TS_RETURN_IF_ERROR(kv->Write(tree_key, tree_json));
  if (options.sync) {
    TS_RETURN_IF_ERROR(kv->Sync(index_key));
    TS_RETURN_IF_ERROR(kv->Sync(tree_key));
  }

  CommitRecord record;
  record.created_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
  record.process_count = c.process_count();
  CommitItem& item = record.items[kStateItem];
  item.tree_crc32c = Crc32c(tree_json);
  item.tree_size = tree_json.size();
  // The index ends with its own CRC, so the CRC of the whole file is the same constant for
  // every index; COMMIT records the CRC of the body (the file less its footer) instead.
  item.index_crc32c = IndexBodyCrc32c(index_bytes);
  item.index_size = index_bytes.size();
  for (const DataFileInfo& f : merged.files) item.data_bytes += f.size;
  item.num_arrays = arrays.size();
  // Every file this save wrote, with its size: the commit names only what it found there.
  std::map<std::string, uint64_t> written;
  const std::string item_folder = item_dir.substr(work_dir.size() + 1);
  for (const DataFileInfo& f : merged.files) written[StrCat(item_folder, "/", f.name)] = f.size;
  written[StrCat(item_folder, "/", kIndexFileName)] = index_bytes.size();
  written[StrCat(item_folder, "/", kTreeFileName)] = tree_json.size();
  for (const auto& [name, f] : committed_files) written[name] = f.size;
  record.files = std::move(committed_files);
  return StepCommitter(kv).Commit(dir, work_dir, nonce, std::move(record), written,
                                  {.overwrite = options.overwrite, .sync = options.sync},
                                  &commit_outcome_unknown);
}

void CheckpointWriter::Impl::RemoveWorkDir() {
  if (work_dir.empty()) return;
  // Best effort: a leftover is harmless (never read) and removed by later saves.
  (void)kv->DeletePrefix(work_dir + "/");
}

}  // namespace tensorstash
