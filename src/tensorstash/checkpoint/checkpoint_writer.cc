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
//  3. Each process writes its chunks into its own data files "state/data/<p>-<seq>.dat" and its
//     whole files, syncs them: what it wrote is its WrittenPart (steps 1-3 are WritePart).
//     Processes > 0 write their part's bytes to "state/index.part-<p>" (the coordinator's store
//     is meant for small values; a part lists every chunk), and each publishes its status
//     ("status/<p>").
//  4. Process 0 waits for every status (all of them, even after an error, so that it never
//     removes the folder while another process still writes into it). If all are OK it reads
//     the parts and commits them (CommitParts, which a caller carrying the parts itself runs on
//     the process of its choice): checks that they belong to this save, that every process
//     described the arrays alike, that every chunk of every array was written exactly once, writes
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
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <tuple>
#include <utility>

#include "tensorstash/array/chunk_grid.h"
#include "tensorstash/coordination/collectives.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
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
#include "tensorstash/util/chunk_digest.h"
#include "tensorstash/util/copy_bytes.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/endian.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/thread_pool.h"

namespace tensorstash {
namespace {

struct ArrayEntry {
  ArraySpec spec;
  std::vector<ShardData> shards;
  ChunkGrid grid;
  ChunkSource source;  // set: one whole-array shard whose chunks `source` produces
};

// A planned chunk write (engine/write_plan.h) and what executing it needs.
struct ChunkTask {
  ChunkWrite plan;
  const ShardData* shard;
  bool preallocated = false;
  DataFileSet::Location location{};
  // Incremental saves: the raw bytes' CRC-32C and digest, when compared with the base already.
  bool hashed = false;
  CrcAndDigest hash{};
};

// File ids of references while a process writes: above any id of its own files, renumbered
// after them once those are known.
constexpr uint32_t kFirstReferenceId = uint32_t{1} << 31;

// The folder that holds step folder `dir` ("" for a step at the top of the store).
std::string_view ParentFolder(std::string_view dir) {
  const size_t slash = dir.rfind('/');
  return slash == std::string_view::npos ? std::string_view() : dir.substr(0, slash);
}

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

// Written-part encoding: "TSPART\0\0", u16 major, u16 minor, u32 reserved, then the fields
// (strings as u32 length + bytes), then u32 CRC-32C of everything before it.
constexpr char kPartMagic[8] = {'T', 'S', 'P', 'A', 'R', 'T', '\0', '\0'};
constexpr uint16_t kPartMajorVersion = 1;
constexpr uint16_t kPartMinorVersion = 0;
// Bounds on what a decoded part may claim, so that a hostile length cannot make us allocate.
constexpr uint32_t kMaxPartStrings = uint32_t{1} << 24;

void PutString(std::string* out, std::string_view v) {
  PutLE32(out, static_cast<uint32_t>(v.size()));
  out->append(v);
}

// Reads the fields of a part in order; the first short read makes it fail (and stay failed).
class PartReader {
 public:
  explicit PartReader(std::string_view body) : rest_(body) {}
  bool ok() const { return ok_; }
  bool done() const { return rest_.empty(); }
  uint32_t U32() { return static_cast<uint32_t>(Fixed(4)); }
  uint64_t U64() { return Fixed(8); }
  std::string String() {
    const uint32_t n = U32();
    if (!ok_ || n > rest_.size()) {
      ok_ = false;
      return {};
    }
    std::string v(rest_.substr(0, n));
    rest_.remove_prefix(n);
    return v;
  }

 private:
  uint64_t Fixed(size_t n) {
    if (!ok_ || rest_.size() < n) {
      ok_ = false;
      return 0;
    }
    const uint64_t v = n == 4 ? GetLE32(rest_.data()) : GetLE64(rest_.data());
    rest_.remove_prefix(n);
    return v;
  }
  std::string_view rest_;
  bool ok_ = true;
};

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

Result<std::string> EncodeWrittenPart(const WrittenPart& part) {
  TS_ASSIGN_OR_RETURN(std::string index, EncodeIndex(part.index));
  std::string out(kPartMagic, sizeof(kPartMagic));
  PutLE16(&out, kPartMajorVersion);
  PutLE16(&out, kPartMinorVersion);
  PutLE32(&out, 0);  // reserved
  PutString(&out, part.dir);
  PutString(&out, part.attempt);
  PutLE32(&out, static_cast<uint32_t>(part.process_index));
  PutLE32(&out, static_cast<uint32_t>(part.process_count));
  PutLE32(&out, static_cast<uint32_t>(part.array_digests.size()));
  for (const std::string& d : part.array_digests) PutString(&out, d);
  PutLE32(&out, static_cast<uint32_t>(part.files.size()));
  for (const auto& [name, f] : part.files) {
    PutString(&out, name);
    PutLE64(&out, f.size);
    PutLE32(&out, f.crc32c);
  }
  const WriteStats& st = part.stats;
  for (uint64_t v : {st.raw_bytes, st.stored_bytes, st.chunks, st.data_files,
                     st.peak_staged_bytes, static_cast<uint64_t>(st.seconds * 1e6)}) {
    PutLE64(&out, v);
  }
  PutString(&out, index);
  PutLE32(&out, Crc32c(out));
  return out;
}

Result<WrittenPart> DecodeWrittenPart(std::string_view bytes, std::string_view where) {
  constexpr size_t kHeader = sizeof(kPartMagic) + 8;
  if (bytes.size() < kHeader + 4 || bytes.substr(0, sizeof(kPartMagic)) !=
                                        std::string_view(kPartMagic, sizeof(kPartMagic))) {
    return InvalidArgumentError(StrCat(where, ": not a written part of a tensorstash save (",
                                       bytes.size(), " bytes without its magic)"));
  }
  const uint16_t major = GetLE16(bytes.data() + 8);
  if (major != kPartMajorVersion) {
    return InvalidArgumentError(StrCat(where, ": written part of version ", major,
                                       ", this build reads version ", kPartMajorVersion));
  }
  const std::string_view body = bytes.substr(0, bytes.size() - 4);
  if (GetLE32(bytes.data() + body.size()) != Crc32c(body)) {
    return DataLossError(StrCat(where, ": the written part is corrupt (CRC-32C mismatch)"));
  }
  auto corrupt = [&](std::string_view what) {
    return DataLossError(StrCat(where, ": the written part is corrupt: ", what));
  };
  PartReader r(body.substr(kHeader));
  WrittenPart part;
  part.dir = r.String();
  part.attempt = r.String();
  part.process_index = static_cast<int>(r.U32());
  part.process_count = static_cast<int>(r.U32());
  const uint32_t arrays = r.U32();
  if (!r.ok() || arrays > kMaxPartStrings) return corrupt("bad array count");
  for (uint32_t i = 0; i < arrays && r.ok(); ++i) part.array_digests.push_back(r.String());
  const uint32_t files = r.U32();
  if (!r.ok() || files > kMaxPartStrings) return corrupt("bad file count");
  for (uint32_t i = 0; i < files && r.ok(); ++i) {
    std::string name = r.String();
    CommitFile f;
    f.size = r.U64();
    f.crc32c = r.U32();
    if (r.ok() && !part.files.emplace(std::move(name), f).second) {
      return corrupt("a file is listed twice");
    }
  }
  WriteStats& st = part.stats;
  for (uint64_t* v : {&st.raw_bytes, &st.stored_bytes, &st.chunks, &st.data_files,
                      &st.peak_staged_bytes}) {
    *v = r.U64();
  }
  st.seconds = static_cast<double>(r.U64()) / 1e6;
  const std::string index = r.String();
  if (!r.ok() || !r.done()) return corrupt("its fields do not fill it exactly");
  if (part.process_count < 1 || part.process_index < 0 ||
      part.process_index >= part.process_count) {
    return corrupt(StrCat("process ", part.process_index, " of ", part.process_count));
  }
  TS_ASSIGN_OR_RETURN(part.index, DecodeIndex(index, StrCat(where, " (its chunk index)")));
  return part;
}

std::string StepCommitId(const CommitRecord& record) {
  return DigestHex(Xxh3Digest(EncodeCommitRecord(record)));
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
  std::string nonce;                    // the save's id, process 0's (WrittenPart::attempt)
  std::vector<std::string> part_digests;  // per array: spec and grid (WrittenPart)
  bool part_written = false;              // WritePart succeeded
  // Incremental saves (options.base): the base step, and per array of this save the id of the
  // base's array it may reference (-1: none: absent, or stored differently).
  std::unique_ptr<CheckpointReader> base_reader;
  std::vector<int64_t> base_array;
  // The base opened is the step the shards' same_as_base promises refer to (base_commit_id).
  bool base_promises_hold = false;
  bool parts_committed = false;           // CommitParts was called

  // The start both Commit and WritePart make: the only one a writer gets (FailedPrecondition
  // for a second), then Begin.
  Status StartOnce(const std::function<void()>& on_released);
  Status Begin();
  Status AgreeOnGrids();
  Status WriteOwnPart(WrittenPart* part);
  Status WriteLocal(ChunkIndex* local, WriteStats* stats);
  Status OpenBase();
  // An overwrite must not replace a committed step whose data other steps refer to
  // (incremental steps): FailedPrecondition naming them. OK when nothing is overwritten.
  Status CheckNoDependents() const;
  // Compares the chunks of `writes` that the base may hold with the base's (hashing them on
  // `pool`): each equal one becomes an entry of `references` (file ids from kFirstReferenceId,
  // files in `reference_files`) and leaves `writes`. Fills `hashes` for the chunks that stay
  // and were hashed, keyed by their position in the new `writes`.
  Status MatchBase(std::vector<ChunkWrite>* writes, ThreadPool* pool,
                   std::vector<IndexEntry>* references, std::vector<DataFileInfo>* reference_files,
                   std::vector<std::optional<CrcAndDigest>>* hashes, WriteStats* stats);
  Status GatherChunk(const ChunkTask& task, char* out) const;
  // `raw_outlives_files`: `raw` stays valid and unchanged until `files` is finished or
  // destroyed (the caller's shard buffer), so the file may send it from there uncopied.
  Status WriteChunk(const ChunkTask& task, std::string_view raw, bool raw_outlives_files,
                    DataFileSet* files, std::mutex* mutex, std::vector<IndexEntry>* entries,
                    WriteStats* stats);
  Status WriteFiles(std::map<std::string, CommitFile>* written);
  Status PutPart(const WrittenPart& part);
  Status TakeParts(std::vector<WrittenPart>* parts);
  Status CheckAndCommitParts(std::vector<WrittenPart> parts);
  // CheckAndCommitParts, and on failure the attempt's folder removed, unless the commit's
  // outcome is unknown (the attempt may have become the step: gc decides later).
  Status CommitPartsOrCleanUp(std::vector<WrittenPart> parts);
  Status MergeAndCommit(ChunkIndex merged, std::map<std::string, CommitFile> committed_files);
  void ReleaseSources() {
    if (on_sources_released) std::exchange(on_sources_released, nullptr)();
  }
  // Whatever path Commit or WritePart takes, the caller learns that its buffers are free
  // before it returns.
  struct ReleaseOnExit {
    Impl* impl;
    ~ReleaseOnExit() { impl->ReleaseSources(); }
  };
  void RemoveWorkDir();
};

Status CheckpointWriter::Impl::StartOnce(const std::function<void()>& on_released) {
  if (on_released) on_sources_released = on_released;
  if (commit_started) return FailedPreconditionError("Commit or WritePart was already called");
  commit_started = true;
  return Begin();
}

Status CheckpointWriter::Impl::CommitPartsOrCleanUp(std::vector<WrittenPart> parts) {
  Status result = CheckAndCommitParts(std::move(parts));
  if (!result.ok() && !commit_outcome_unknown) RemoveWorkDir();
  return result;
}

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
  if (!options.base.empty()) {
    // References name the base relative to the folder both steps are in (docs/format.md, 6.1),
    // so that a root can be moved or copied whole.
    TS_RETURN_IF_ERROR(Annotate(ValidateKey(options.base), "base step"));
    if (options.base == dir || ParentFolder(options.base) != ParentFolder(dir) ||
        IsTemporaryStepName(options.base)) {
      return InvalidArgumentError(
          StrCat("base step '", options.base, "' of step '", dir,
                 "': an incremental save's base must be another committed step in the same "
                 "folder"));
    }
    if (options.holding) {
      return InvalidArgumentError("a holding (node-local step) cannot be saved against a base");
    }
    options.record_digests = true;
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
  impl_->arrays.push_back({std::move(spec), std::move(shards), {}, {}});
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

Status CheckpointWriter::AddArrayFromSource(ArraySpec spec, ChunkSource source) {
  if (!source) return InvalidArgumentError(StrCat("array '", spec.path, "': no chunk source"));
  const size_t before = impl_->arrays.size();
  // One shard, the whole array, replica 0 of 1; its bytes come from `source`, never `data`
  // (marked stable: copy_sources has nothing of the caller's to copy).
  ShardData whole{Box::FromShape(spec.shape), nullptr, 0, 1, /*stable=*/true};
  // The shard check wants data for a non-empty box; the source stands for it.
  static const char kNoData = 0;
  whole.data = &kNoData;
  TS_RETURN_IF_ERROR(AddArray(std::move(spec), {whole}));
  if (impl_->arrays.size() == before) return InternalError("array not added");
  impl_->arrays.back().source = std::move(source);
  impl_->arrays.back().shards[0].data = nullptr;
  return OkStatus();
}

Status CheckpointWriter::Impl::Begin() {
  Coordinator& c = *coordinator;
  const auto timeout = options.coordination_timeout;
  key_prefix = StrCat("tensorstash/", dir, "/", c.NextOperationId(), "/");

  // 1. Process 0 prepares the folder and names the save ("<nonce>\n<work dir>").
  Result<std::string> prepared = std::string();
  if (c.process_index() == 0) {
    nonce = RandomHexId();
    if (Status replaceable = CheckNoDependents(); !replaceable.ok()) {
      prepared = replaceable;
    } else {
      prepared = StepCommitter(kv).Prepare(
          dir, nonce, {.overwrite = options.overwrite, .writers = c.process_count()});
    }
    if (prepared.ok()) prepared = StrCat(nonce, "\n", *prepared);
  }
  TS_ASSIGN_OR_RETURN(std::string named, Broadcast(c, key_prefix + "workdir", std::move(prepared),
                                                   /*root=*/0, timeout,
                                                   "process 0 could not prepare the step"));
  const size_t newline = named.find('\n');
  if (newline == std::string::npos) {
    return InternalError(StrCat("process 0 sent a malformed step folder for '", dir, "'"));
  }
  nonce = named.substr(0, newline);
  work_dir = named.substr(newline + 1);

  // 2. Agree on chunk grids.
  TS_RETURN_IF_ERROR(AgreeOnGrids());
  part_digests.clear();
  for (const ArrayEntry& a : arrays) {
    const int64_t target =
        a.spec.target_chunk_bytes > 0 ? a.spec.target_chunk_bytes : options.target_chunk_bytes;
    part_digests.push_back(StrCat(ArrayDigest(a.spec, target), ":",
                                  StrJoin(a.grid.cell_shape, ","), ":",
                                  StrJoin(a.grid.chunk_shape, ",")));
  }
  return OkStatus();
}

Status CheckpointWriter::Impl::WriteOwnPart(WrittenPart* part) {
  // 3. This process's chunks, then its whole files.
  Status written = WriteLocal(&part->index, &part->stats);
  ReleaseSources();
  TS_RETURN_IF_ERROR(written);
  TS_RETURN_IF_ERROR(WriteFiles(&part->files));
  part->dir = dir;
  part->attempt = nonce;
  part->process_index = coordinator->process_index();
  part->process_count = coordinator->process_count();
  part->array_digests = part_digests;
  return OkStatus();
}

Status CheckpointWriter::Commit(WriteStats* stats,
                                const std::function<void()>& on_sources_released) {
  Impl& s = *impl_;
  Impl::ReleaseOnExit release_on_exit{&s};
  const auto start = std::chrono::steady_clock::now();
  Coordinator& c = *s.coordinator;

  // Phase 1 (steps 1-3): every process writes its part; processes > 0 hand it to process 0
  // through the step's folder.
  TS_RETURN_IF_ERROR(s.StartOnce(on_sources_released));
  WrittenPart part;
  Status written = s.WriteOwnPart(&part);
  if (written.ok() && c.process_index() > 0) written = s.PutPart(part);
  WriteStats local_stats = part.stats;

  // Phase 2 (steps 4-5): every status reaches process 0 (all of them, even after an error: the
  // folder may only be removed once no process writes into it any more), which commits the
  // parts or cleans up, and every process learns the outcome.
  auto commit_or_clean_up = [&](const Status& all_written) -> Status {
    std::vector<WrittenPart> parts;
    Status result = all_written.ok() ? s.TakeParts(&parts) : all_written;
    if (!result.ok()) {
      s.RemoveWorkDir();  // nothing was committed
      return result;
    }
    parts.push_back(std::move(part));
    return s.CommitPartsOrCleanUp(std::move(parts));
  };
  const Status verdict = AgreeOnStatus(c, s.key_prefix, written, s.options.coordination_timeout,
                                       commit_or_clean_up);
  // A process that failed reports its own error, the others the first error of any process.
  const Status result = written.ok() ? verdict : written;
  if (result.ok() && s.options.record_digests) {
    // The record as readers see it (process 0 wrote it; the committer may have added to it).
    // Not found again: the next save against this step hashes every chunk, nothing worse.
    Result<CommitRecord> record = ReadStepCommitRecord(s.kv, s.dir);
    if (record.ok()) local_stats.commit_id = StepCommitId(*record);
  }
  local_stats.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (stats != nullptr) *stats = local_stats;
  return result;
}

Result<WrittenPart> CheckpointWriter::WritePart(const std::function<void()>& on_sources_released) {
  Impl& s = *impl_;
  Impl::ReleaseOnExit release_on_exit{&s};
  const auto start = std::chrono::steady_clock::now();
  TS_RETURN_IF_ERROR(s.StartOnce(on_sources_released));
  WrittenPart part;
  TS_RETURN_IF_ERROR(s.WriteOwnPart(&part));
  part.stats.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  s.part_written = true;
  return part;
}

Status CheckpointWriter::CommitParts(std::vector<WrittenPart> parts) {
  Impl& s = *impl_;
  if (!s.part_written) {
    return FailedPreconditionError(
        StrCat("CommitParts of step '", s.dir, "' needs this writer's own WritePart first"));
  }
  if (s.parts_committed) return FailedPreconditionError("CommitParts was already called");
  s.parts_committed = true;
  return s.CommitPartsOrCleanUp(std::move(parts));
}

Status CheckpointWriter::Impl::PutPart(const WrittenPart& part) {
  TS_ASSIGN_OR_RETURN(std::string bytes, EncodeWrittenPart(part));
  const std::string key = StrCat(ItemDir(work_dir, kStateItem), "/", kIndexFileName, ".part-",
                                 part.process_index);
  TS_RETURN_IF_ERROR(kv->Write(key, bytes));
  if (options.sync) TS_RETURN_IF_ERROR(kv->Sync(key));
  return OkStatus();
}

Status CheckpointWriter::Impl::TakeParts(std::vector<WrittenPart>* parts) {
  const std::string item_dir = ItemDir(work_dir, kStateItem);
  for (int p = 1; p < coordinator->process_count(); ++p) {
    const std::string key = StrCat(item_dir, "/", kIndexFileName, ".part-", p);
    TS_ASSIGN_OR_RETURN(std::string bytes, kv->Read(key));
    TS_ASSIGN_OR_RETURN(WrittenPart part, DecodeWrittenPart(bytes, key));
    parts->push_back(std::move(part));
    TS_RETURN_IF_ERROR(kv->Delete(key));
  }
  return OkStatus();
}

Status CheckpointWriter::Impl::CheckAndCommitParts(std::vector<WrittenPart> parts) {
  const int n = coordinator->process_count();
  std::sort(parts.begin(), parts.end(), [](const WrittenPart& a, const WrittenPart& b) {
    return a.process_index < b.process_index;
  });
  std::vector<bool> seen(static_cast<size_t>(n), false);
  for (const WrittenPart& part : parts) {
    const int p = part.process_index;
    if (part.dir != dir || part.attempt != nonce) {
      return InvalidArgumentError(StrCat("the part of process ", p,
                                         " belongs to another save (step '", part.dir,
                                         "', attempt ", part.attempt, "), not to step '", dir,
                                         "', attempt ", nonce));
    }
    if (part.process_count != n || p < 0 || p >= n) {
      return InvalidArgumentError(StrCat("the part of process ", p, " of ", part.process_count,
                                         " does not fit a save by ", n, " processes"));
    }
    if (seen[static_cast<size_t>(p)]) {
      return InvalidArgumentError(StrCat("two parts come from process ", p));
    }
    seen[static_cast<size_t>(p)] = true;
  }
  for (int p = 0; p < n; ++p) {
    if (!seen[static_cast<size_t>(p)]) {
      return InvalidArgumentError(StrCat("no part from process ", p, " of ", n,
                                         ": the step is committed with every process's part"));
    }
  }
  ChunkIndex merged;
  std::map<std::string, CommitFile> committed_files;
  std::map<std::pair<std::string, std::string>, uint32_t> reference_ids;
  for (WrittenPart& part : parts) {
    const int p = part.process_index;
    if (part.array_digests.size() != arrays.size()) {
      return InvalidArgumentError(StrCat("process ", p, " described ", part.array_digests.size(),
                                         " arrays, this one ", arrays.size(),
                                         "; every process must add the same arrays in the "
                                         "same order"));
    }
    for (size_t i = 0; i < arrays.size(); ++i) {
      if (part.array_digests[i] != part_digests[i]) {
        return InvalidArgumentError(
            StrCat("array '", arrays[i].spec.path, "' (number ", i, ") is described differently ",
                   "by process ", p, " and by process ", coordinator->process_index(),
                   " (path, dtype, shape, codec, chunk size or grid)"));
      }
    }
    const std::string own_files = StrCat("data/", p, "-");
    for (const DataFileInfo& f : part.index.files) {
      if (f.step.empty() && f.name.rfind(own_files, 0) != 0) {
        return InvalidArgumentError(StrCat("the part of process ", p, " names data file '",
                                           f.name, "', which is not one of its own"));
      }
    }
    // A file of another step that several processes refer to is listed once.
    std::vector<uint32_t> file_ids;
    for (DataFileInfo& f : part.index.files) {
      if (!f.step.empty()) {
        auto [it, added] = reference_ids.try_emplace({f.step, f.name},
                                                     static_cast<uint32_t>(merged.files.size()));
        file_ids.push_back(it->second);
        if (!added) continue;
      } else {
        file_ids.push_back(static_cast<uint32_t>(merged.files.size()));
      }
      merged.files.push_back(std::move(f));
    }
    for (IndexEntry e : part.index.entries) {
      if (e.array_id >= arrays.size() ||
          e.chunk >= static_cast<uint64_t>(arrays[e.array_id].grid.NumChunks())) {
        return InvalidArgumentError(StrCat("the part of process ", p, " has chunk ", e.chunk,
                                           " of array number ", e.array_id,
                                           ", which the step does not have"));
      }
      if (e.file_id >= file_ids.size()) {
        return InvalidArgumentError(StrCat("the part of process ", p, " names data file ",
                                           e.file_id, " of ", file_ids.size()));
      }
      e.file_id = file_ids[e.file_id];
      merged.entries.push_back(e);
    }
    for (auto& [name, f] : part.files) {
      if (!committed_files.emplace(name, f).second) {
        return InvalidArgumentError(StrCat("file '", name, "' was added by process ", p,
                                           " and by another process; names must be unique"));
      }
    }
  }
  return MergeAndCommit(std::move(merged), std::move(committed_files));
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

// On a store that sends a file below some size in one request (GCS: one upload instead of parts
// uploaded, composed and deleted, N + 2 + N requests for N parts), a save keeps its data files
// below that size when the job's files then stay few: the commit record on an object store lists
// every object (1 MiB at most), so each process may write kOneRequestFilesPerJob / processes
// such files. Larger saves roll their files at target_data_file_bytes, as on other stores.
// Returns the size to stay below, or 0.
constexpr uint64_t kOneRequestFilesPerJob = 4096;

static uint64_t OneRequestFileBytes(const KvStore& kv, const std::vector<ChunkTask>& tasks,
                             int process_count) {
  const uint64_t one_request = kv.Capabilities().one_request_below;
  if (one_request < 4) return 0;
  uint64_t bytes = 0;
  for (const ChunkTask& task : tasks) bytes += task.plan.raw_bytes;
  // Chunks do not tile a file exactly: count on files three quarters full.
  const uint64_t files = bytes / (one_request / 4 * 3) + 1;
  const uint64_t allowed =
      std::max<uint64_t>(1, kOneRequestFilesPerJob / static_cast<uint64_t>(std::max(1, process_count)));
  return files <= allowed ? one_request : 0;
}

Status CheckpointWriter::Impl::CheckNoDependents() const {
  if (!options.overwrite || options.holding) return OkStatus();
  Result<uint64_t> commit = kv->Size(StrCat(dir, "/", kCommitFileName));
  if (absl::IsNotFound(commit.status())) return OkStatus();  // nothing committed to replace
  TS_ASSIGN_OR_RETURN(std::vector<std::string> dependents, FindDependentSteps(kv, dir));
  if (dependents.empty()) return OkStatus();
  return FailedPreconditionError(StrCat(
      "step '", dir, "' cannot be overwritten: step(s) '", StrJoin(dependents, "', '"),
      "' refer to its data (incremental steps, docs/format.md 6.1); replacing it would make "
      "them unreadable. Delete them first, or save under another step"));
}

Status CheckpointWriter::Impl::OpenBase() {
  ReaderOptions reader_options;
  reader_options.io_threads = 1;  // only the metadata is read
  Result<std::unique_ptr<CheckpointReader>> opened =
      CheckpointReader::Open(kv, options.base, reader_options);
  TS_RETURN_IF_ERROR(Annotate(opened.status(), StrCat("opening base step '", options.base,
                                                      "' of step '", dir, "'")));
  base_reader = *std::move(opened);
  base_promises_hold = !options.base_commit_id.empty() &&
                       StepCommitId(base_reader->commit_record()) == options.base_commit_id;
  const std::vector<ArrayMetadata>& base_arrays = base_reader->arrays();
  base_array.assign(arrays.size(), -1);
  for (size_t i = 0; i < arrays.size(); ++i) {
    const ArrayEntry& a = arrays[i];
    Result<const ArrayMetadata*> found = base_reader->FindArray(a.spec.path);
    if (!found.ok()) continue;
    const ArrayMetadata& b = **found;
    // The same grid means the same chunk numbers for the same boxes.
    if (b.dtype == a.spec.dtype && b.codec == a.spec.codec && b.grid.shape == a.grid.shape &&
        b.grid.cell_shape == a.grid.cell_shape && b.grid.chunk_shape == a.grid.chunk_shape) {
      base_array[i] = &b - base_arrays.data();
    }
  }
  return OkStatus();
}

Status CheckpointWriter::Impl::MatchBase(std::vector<ChunkWrite>* writes, ThreadPool* pool,
                                         std::vector<IndexEntry>* references,
                                         std::vector<DataFileInfo>* reference_files,
                                         std::vector<std::optional<CrcAndDigest>>* hashes,
                                         WriteStats* stats) {
  const ChunkIndex& base_index = base_reader->index();
  const CommitRecord& base_commit = base_reader->commit_record();
  // The base's chunk of each write, when it has a digest to compare with.
  std::vector<const IndexEntry*> candidate(writes->size(), nullptr);
  for (size_t w = 0; w < writes->size(); ++w) {
    const ChunkWrite& write = (*writes)[w];
    const int64_t b = base_array[write.array_id];
    if (b < 0 || arrays[write.array_id].source) continue;
    const IndexEntry key{static_cast<uint32_t>(b), 0, static_cast<uint64_t>(write.chunk),
                         0, 0, 0, {}};
    auto it = std::lower_bound(base_index.entries.begin(), base_index.entries.end(), key,
                               [](const IndexEntry& x, const IndexEntry& y) {
                                 return std::tie(x.array_id, x.chunk) < std::tie(y.array_id, y.chunk);
                               });
    if (it != base_index.entries.end() && it->array_id == key.array_id && it->chunk == key.chunk &&
        !it->digest.empty()) {
      candidate[w] = &*it;
    }
  }
  // A chunk of a shard the caller promises unchanged since the base was saved from it is the
  // base's chunk, without reading its bytes (the same box of the same immutable buffers).
  std::vector<bool> promised(writes->size(), false);
  if (base_promises_hold) {
    for (size_t w = 0; w < writes->size(); ++w) {
      const ChunkWrite& write = (*writes)[w];
      promised[w] = candidate[w] != nullptr &&
                    arrays[write.array_id].shards[write.shard].same_as_base;
    }
  }
  // Hash the candidates side by side, from where their bytes are (a chunk that is not one run
  // of its shard is gathered first, into a buffer of the task's own).
  std::vector<std::optional<CrcAndDigest>> hashed(writes->size());
  {
    TaskGroup group(pool);
    for (size_t w = 0; w < writes->size(); ++w) {
      if (candidate[w] == nullptr || promised[w]) continue;
      group.Run([&, w]() -> Status {
        const ChunkWrite& write = (*writes)[w];
        const ArrayEntry& a = arrays[write.array_id];
        const ShardData& shard = a.shards[write.shard];
        const size_t item = ItemSize(a.spec.dtype);
        const size_t size = static_cast<size_t>(write.chunk_box.num_elements()) * item;
        if (IsContiguousIn(write.chunk_box, shard.box)) {
          hashed[w] = Crc32cAndDigest(
              static_cast<const char*>(shard.data) + ByteOffsetIn(write.chunk_box, shard.box, item),
              size);
          return OkStatus();
        }
        std::string gathered(size, '\0');
        TS_RETURN_IF_ERROR(CopyBox(write.chunk_box, a.spec.dtype, shard.data, shard.box,
                                   a.spec.dtype, gathered.data(), write.chunk_box, a.spec.path));
        hashed[w] = Crc32cAndDigest(gathered.data(), gathered.size());
        return OkStatus();
      });
    }
    TS_RETURN_IF_ERROR(group.Wait());
  }
  // The base's file of an entry, as this step names it: a file of the base's own (on an object
  // store inside its attempt, at its committed generation), or the file the base refers to.
  std::map<std::pair<std::string, std::string>, uint32_t> reference_ids;
  const std::string base_name = options.base.substr(
      ParentFolder(options.base).empty() ? 0 : ParentFolder(options.base).size() + 1);
  auto reference_id = [&](uint32_t base_file) -> Result<uint32_t> {
    DataFileInfo f = base_index.files[base_file];
    if (f.step.empty()) {
      const std::string in_step = StrCat(kStateItem, "/", f.name);
      f.step = base_name;
      if (!base_commit.attempt.empty()) {
        auto object = base_commit.objects.find(in_step);
        if (object == base_commit.objects.end()) {
          return DataLossError(StrCat("base step '", options.base, "': its commit record lists no "
                                      "object '", in_step, "'"));
        }
        f.generation = object->second.generation;
        f.name = StrCat(base_commit.attempt, "/", in_step);
      } else {
        f.name = in_step;
      }
    }
    auto [it, added] = reference_ids.try_emplace(
        {f.step, f.name}, kFirstReferenceId + static_cast<uint32_t>(reference_files->size()));
    if (added) reference_files->push_back(std::move(f));
    return it->second;
  };
  std::vector<ChunkWrite> kept;
  kept.reserve(writes->size());
  hashes->clear();
  for (size_t w = 0; w < writes->size(); ++w) {
    ChunkWrite& write = (*writes)[w];
    const IndexEntry* base = candidate[w];
    if (base != nullptr && (promised[w] || hashed[w]->digest == base->digest)) {
      TS_ASSIGN_OR_RETURN(uint32_t file_id, reference_id(base->file_id));
      references->push_back({write.array_id, file_id, static_cast<uint64_t>(write.chunk),
                             base->offset, base->length, base->crc32c, base->digest});
      if (promised[w]) ++stats->unhashed_chunks;
      ++stats->referenced_chunks;
      stats->referenced_bytes += base->length;
      continue;
    }
    kept.push_back(std::move(write));
    hashes->push_back(hashed[w]);
  }
  *writes = std::move(kept);
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
  std::vector<IndexEntry> references;        // incremental: chunks the base holds
  std::vector<DataFileInfo> reference_files;  // and the files they lie in
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
    // An incremental save leaves out the chunks the base holds already, before any place in a
    // file is given out: its files hold only what changed.
    std::vector<std::optional<CrcAndDigest>> hashes;
    Status base_opened = options.base.empty() ? OkStatus() : OpenBase();
    if (!base_opened.ok() && options.full_save_if_base_unreadable) {
      stats->base_unreadable = std::string(base_opened.message());
      base_reader.reset();
    } else if (!options.base.empty()) {
      TS_RETURN_IF_ERROR(base_opened);
      ThreadPool hash_pool(options.io_threads);
      TS_RETURN_IF_ERROR(
          MatchBase(&writes, &hash_pool, &references, &reference_files, &hashes, stats));
    }
    lanes = CountLanes(writes, options.io_threads, kMaxLanes, kMinLaneBytes);
    AssignLanes(&writes, lanes);
    lane_order = InterleaveLanes(writes, lanes);
    tasks.reserve(writes.size());
    for (size_t w = 0; w < writes.size(); ++w) {
      const ShardData* shard = &arrays[writes[w].array_id].shards[writes[w].shard];
      tasks.push_back({std::move(writes[w]), shard});
      if (w < hashes.size() && hashes[w].has_value()) {
        tasks.back().hashed = true;
        tasks.back().hash = *hashes[w];
      }
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
                    options.sync ? kWritebackBytes : 0, /*direct_writes=*/options.sync,
                    OneRequestFileBytes(*kv, tasks, c.process_count()));
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
      auto write = [&, task, raw_size](const char* raw, bool raw_outlives_files = false) {
        return WriteChunk(*task, std::string_view(raw, raw_size), raw_outlives_files, &files,
                          &mutex, &entries, stats);
      };
      if (a.source) {
        // Pulled from the array's source into staging (under the cap), then written.
        const ArrayEntry* entry = &a;
        run.Run(raw_size + encoded, [entry, task, write](char* staged) {
          TS_RETURN_IF_ERROR(
              Annotate(entry->source(task->plan.chunk_box, staged),
                       StrCat("reading chunk ", entry->grid.ChunkName(task->plan.chunk),
                              " of array '", entry->spec.path, "' from its source")));
          return write(staged);
        });
      } else if (copied(task)) {
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
        // Straight from the caller's buffer to the file. The buffer outlives `files`: it is
        // not released before this function returns (not copied: no copy_sources, or a
        // stable shard, kept until Commit returns).
        const char* raw =
            static_cast<const char*>(task->shard->data) +
            ByteOffsetIn(task->plan.chunk_box, task->shard->box, ItemSize(a.spec.dtype));
        run.RunHolding(encoded, [write, raw] { return write(raw, /*raw_outlives_files=*/true); });
      } else {
        run.Run(raw_size + encoded, [&, task, write](char* gathered) {
          TS_RETURN_IF_ERROR(GatherChunk(*task, gathered));
          return write(gathered);
        });
      }
    }
    // After a failure the copying stopped early: what runs still reads staging only.
    if (options.copy_sources) ReleaseSources();
    const Status ran = run.Wait();
    stats->peak_staged_bytes = run.peak_bytes();
    TS_RETURN_IF_ERROR(ran);
  }
  TS_RETURN_IF_ERROR(files.Finish(options.sync, &local->files, &pool));
  stats->data_files = local->files.size();
  // The referenced files follow this process's own in its part's file table.
  const uint32_t own_files = static_cast<uint32_t>(local->files.size());
  for (IndexEntry& e : references) {
    e.file_id = own_files + (e.file_id - kFirstReferenceId);
    entries.push_back(e);
  }
  for (DataFileInfo& f : reference_files) local->files.push_back(std::move(f));
  local->entries = std::move(entries);
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
                                          bool raw_outlives_files, DataFileSet* files,
                                          std::mutex* mutex, std::vector<IndexEntry>* entries,
                                          WriteStats* stats) {
  const ArrayEntry& a = arrays[task.plan.array_id];
  // With digests, one pass over the raw bytes gives both (uncompressed: the CRC is of them);
  // a chunk compared with the base already was hashed then.
  ChunkDigest digest;
  std::optional<uint32_t> raw_crc;
  if (task.hashed) {
    digest = task.hash.digest;
    raw_crc = task.hash.crc32c;
  } else if (options.record_digests && a.spec.codec == Codec::kNone) {
    const CrcAndDigest both = Crc32cAndDigest(raw.data(), raw.size());
    digest = both.digest;
    raw_crc = both.crc32c;
  } else if (options.record_digests) {
    digest = Xxh3Digest(raw);
  }
  std::string encoded;
  std::string_view stored = raw;
  if (a.spec.codec != Codec::kNone) {
    TS_RETURN_IF_ERROR(EncodeChunk(a.spec.codec, a.spec.zstd_level, stored, &encoded));
    stored = encoded;
  }
  const uint32_t crc =
      a.spec.codec == Codec::kNone && raw_crc.has_value() ? *raw_crc : Crc32c(stored);
  DataFileSet::Location location = task.location;
  if (!task.preallocated) {
    TS_ASSIGN_OR_RETURN(location, files->Allocate(stored.size(), task.plan.lane));
  }
  // The CRC goes with the bytes: an object store combines it into the object's checksum
  // instead of reading the bytes again.
  const bool borrowed = raw_outlives_files && stored.data() == raw.data();
  TS_RETURN_IF_ERROR(Annotate(files->Write(location, stored.data(), stored.size(), crc, borrowed),
                              StrCat("writing chunk ", a.grid.ChunkName(task.plan.chunk),
                                     " of array '", a.spec.path, "'")));
  std::lock_guard<std::mutex> lock(*mutex);
  entries->push_back({task.plan.array_id, location.file_id, static_cast<uint64_t>(task.plan.chunk),
                      location.offset, stored.size(), crc, digest});
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

Status CheckpointWriter::Impl::MergeAndCommit(ChunkIndex merged,
                                              std::map<std::string, CommitFile> committed_files) {
  Coordinator& c = *coordinator;
  const std::string item_dir = ItemDir(work_dir, kStateItem);
  if (merged.files.size() > kMaxDataFiles) {
    return ResourceExhaustedError(StrCat("the processes wrote ", merged.files.size(),
                                         " data files, more than the format's limit of ",
                                         kMaxDataFiles, "; raise target_data_file_bytes"));
  }
  // Every chunk of every array must have been written exactly once.
  std::sort(merged.entries.begin(), merged.entries.end(),
            [](const IndexEntry& a, const IndexEntry& b) {
              return std::pair(a.array_id, a.chunk) < std::pair(b.array_id, b.chunk);
            });
  std::vector<int64_t> counts(arrays.size(), 0);
  for (size_t i = 0; i < merged.entries.size(); ++i) {
    const IndexEntry& e = merged.entries[i];
    if (i > 0 && merged.entries[i - 1].array_id == e.array_id &&
        merged.entries[i - 1].chunk == e.chunk) {
      return InvalidArgumentError(StrCat("array '", arrays[e.array_id].spec.path, "': chunk ",
                                         arrays[e.array_id].grid.ChunkName(
                                             static_cast<int64_t>(e.chunk)),
                                         " was written twice"));
    }
    ++counts[e.array_id];
  }
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
  // The step's own files only: what it borrows from other steps is theirs.
  std::set<std::string> depends_on;
  for (const DataFileInfo& f : merged.files) {
    if (f.step.empty()) {
      item.data_bytes += f.size;
    } else {
      depends_on.insert(f.step);
    }
  }
  record.depends_on.assign(depends_on.begin(), depends_on.end());
  item.num_arrays = arrays.size();
  // Every file this save wrote, with its size: the commit names only what it found there.
  std::map<std::string, uint64_t> written;
  const std::string item_folder = item_dir.substr(work_dir.size() + 1);
  for (const DataFileInfo& f : merged.files) {
    if (f.step.empty()) written[StrCat(item_folder, "/", f.name)] = f.size;
  }
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
