#include "tensorstash/checkpoint/checkpoint_reader.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <utility>

#include "tensorstash/array/chunk_grid.h"
#include "tensorstash/array/convert.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/engine/object_store_commit.h"
#include "tensorstash/engine/step_committer.h"
#include "tensorstash/engine/executor.h"
#include "tensorstash/engine/read_plan.h"
#include "tensorstash/format/chunk_codec.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/prefault.h"
#include "tensorstash/util/thread_pool.h"

namespace tensorstash {
namespace {

// Mapping pays for a kernel mapping entry (vm.max_map_count is about 65,000 per process) and an
// unmap; spans smaller than this are read and copied, which is cheap at that size.
constexpr uint64_t kMinMappedSpanBytes = 1 << 20;
// A mapped box holds one mapping entry per chunk in it for as long as it lives: boxes of chunks
// smaller than this are read, so that a box does not cost many entries.
constexpr uint64_t kMinMappedChunkBytes = 16 << 10;

// Faults in the bytes of `req.dest` that `region` covers, from its first element to its last,
// before the copy into them (see prefault.h).
void PrefaultRegion(const Box& region, const ReadRequest& req) {
  if (region.empty()) return;
  const size_t item = ItemSize(req.dtype);
  const int64_t first = ByteOffsetIn(region, req.box, item);
  Box last = region;
  for (int d = 0; d < last.rank(); ++d) {
    last.origin[d] += last.shape[d] - 1;
    last.shape[d] = 1;
  }
  const int64_t end = ByteOffsetIn(last, req.box, item) + static_cast<int64_t>(item);
  PrefaultForWrite(static_cast<char*>(req.dest) + first, static_cast<size_t>(end - first));
}

// A file of another step on an object store, read at the generation the referencing index
// recorded (docs/format.md, 6.1): an object replaced since fails instead of reading other bytes.
class PinnedObjectFile final : public ReadableFile {
 public:
  PinnedObjectFile(KvStore* kv, std::string key, std::string generation, uint64_t size)
      : kv_(kv), key_(std::move(key)), generation_(std::move(generation)), size_(size) {}
  uint64_t size() const override { return size_; }
  Status ReadAt(uint64_t offset, size_t size, void* dest) const override {
    return kv_->ReadRangeAtGeneration(key_, generation_, offset, size, dest);
  }

 private:
  KvStore* kv_;
  std::string key_;
  std::string generation_;
  uint64_t size_;
};

// The folder that holds step folder `dir` ("" for a step at the top of the store).
std::string_view ParentFolder(std::string_view dir) {
  const size_t slash = dir.rfind('/');
  return slash == std::string_view::npos ? std::string_view() : dir.substr(0, slash);
}

}  // namespace

struct CheckpointReader::Impl {
  // The step folder as it was when the reader opened it (KvStore::OpenFolderView): every file is
  // read from that one version, even if an overwrite puts another in its place meanwhile.
  std::unique_ptr<KvStore> folder_view;
  KvStore* kv;
  KvStore* root_kv;  // the store the step was opened in: other steps' files are read from it
  std::string dir;
  std::string item_dir;
  ReaderOptions options;
  std::string commit_text;  // COMMIT as read
  CommitRecord commit;
  TreeFile tree;
  ChunkIndex index;
  std::map<std::string, size_t, std::less<>> array_by_path;
  std::vector<size_t> entries_begin;  // per array: first entry; entries_begin[n] = end
  std::vector<uint64_t> stored_bytes;
  std::vector<std::unique_ptr<ReadableFile>> files;
  std::vector<Status> file_errors;  // per data file: missing / truncated
  std::unique_ptr<ThreadPool> pool;

  Status Load();
  // A file of another step: from the store the step was opened in, at the recorded generation
  // when there is one (checked now: NotFound when gone, FailedPrecondition when replaced).
  Result<std::unique_ptr<ReadableFile>> OpenOtherStepFile(const std::string& key,
                                                          const DataFileInfo& info) const {
    if (info.generation.empty()) return root_kv->OpenForRead(key);
    TS_ASSIGN_OR_RETURN(ObjectInfo now, root_kv->Stat(key));
    if (now.generation != info.generation) {
      return FailedPreconditionError(StrCat("it was replaced (generation ", now.generation,
                                            ", the index recorded ", info.generation, ")"));
    }
    return std::unique_ptr<ReadableFile>(
        std::make_unique<PinnedObjectFile>(root_kv, key, info.generation, now.size));
  }
  // The key of a data file: under this step's item folder, or (a reference, section 6.1) under
  // the folder of the step that wrote it, a sibling of this one.
  std::string FileKey(uint32_t file_id) const {
    const DataFileInfo& f = index.files[file_id];
    if (f.step.empty()) return StrCat(item_dir, "/", f.name);
    const std::string_view parent = ParentFolder(dir);
    return parent.empty() ? StrCat(f.step, "/", f.name) : StrCat(parent, "/", f.step, "/", f.name);
  }
  std::string ChunkWhat(const IndexEntry& e) const {
    const ArrayMetadata& a = tree.arrays[e.array_id];
    return StrCat("chunk ", a.grid.ChunkName(static_cast<int64_t>(e.chunk)), " of array '", a.path,
                  "' (file '", FileKey(e.file_id), "', offset ", e.offset, ", ", e.length,
                  " bytes)");
  }
  const IndexEntry* FindEntry(size_t array_id, int64_t chunk) const {
    auto begin = index.entries.begin() + entries_begin[array_id];
    auto end = index.entries.begin() + entries_begin[array_id + 1];
    auto it = std::lower_bound(begin, end, static_cast<uint64_t>(chunk),
                               [](const IndexEntry& e, uint64_t c) { return e.chunk < c; });
    return it != end && it->chunk == static_cast<uint64_t>(chunk) ? &*it : nullptr;
  }
  Status CheckCrc(const IndexEntry& e, const char* data) const {
    if (!options.verify_checksums) return OkStatus();
    const uint32_t crc = Crc32c(data, e.length);
    if (crc != e.crc32c) {
      return DataLossError(StrCat("CRC-32C mismatch in ", ChunkWhat(e), ": stored ",
                                  Hex32(e.crc32c), ", computed ", Hex32(crc)));
    }
    return OkStatus();
  }
  // The id of the array a request names, after checking the box against it (its rank, and
  // ValidateBox for elements of `dtype`, default the stored one). NotFound for an unknown path.
  Result<size_t> CheckRequest(const ReadRequest& req, std::optional<DType> dtype) const {
    auto it = array_by_path.find(req.path);
    if (it == array_by_path.end()) {
      return NotFoundError(StrCat("no array '", req.path, "' in checkpoint '", dir, "'"));
    }
    TS_RETURN_IF_ERROR(ValidateReadRequest(req, tree.arrays[it->second], dtype));
    return it->second;
  }
  Status ReadFile(uint32_t file_id, uint64_t offset, uint64_t length, void* dest) const {
    if (!file_errors[file_id].ok()) return file_errors[file_id];
    return files[file_id]->ReadAt(offset, length, dest);
  }
  // `length` bytes at `offset` (a multiple of `page`) of a data file, mapped copy-on-write.
  // Unimplemented where the backend cannot map.
  Result<MappedBox> MapSpan(uint32_t file_id, uint64_t offset, uint64_t length,
                            uint64_t page) const {
    if (!file_errors[file_id].ok()) return file_errors[file_id];
    const size_t mapped_size = (length + page - 1) / page * page;
    // An address range first (nothing is read or allocated), then the file's pages over it.
    void* base =
        ::mmap(nullptr, mapped_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
      return ResourceExhaustedError(
          StrCat("cannot reserve ", mapped_size, " bytes of address space"));
    }
    MappedBox mapped(static_cast<char*>(base), length, mapped_size);
    TS_RETURN_IF_ERROR(files[file_id]->MapAt(offset, length, mapped.data()));
    return mapped;
  }
};

CheckpointReader::CheckpointReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CheckpointReader::~CheckpointReader() = default;

namespace {

// A file that COMMIT or the index vouches for and that cannot be opened as a regular file is
// damage to a committed step (DataLoss, OSError in Python), naming the file: missing, a
// directory, a symlink, a FIFO or a device. Other errors (EIO, EACCES) stay as the store gave
// them.
Status CommittedFileError(const Status& status, std::string_view what, std::string_view key) {
  if (IsNotAnObject(status) || absl::IsFailedPrecondition(status)) {
    return DataLossError(
        StrCat(what, " '", key, "' of a committed step is not a regular file: ", status.message()));
  }
  if (absl::IsNotFound(status)) {
    return DataLossError(StrCat(what, " '", key, "' is missing from a committed step"));
  }
  return status;
}

// COMMIT's bytes, its size checked before it is read (a hostile step must not make the reader
// allocate more than the format allows): DataLoss past kMaxCommitRecordBytes.
Result<std::string> ReadCommitText(KvStore* kv, const std::string& commit_key) {
  TS_ASSIGN_OR_RETURN(uint64_t size, kv->Size(commit_key));
  if (size > kMaxCommitRecordBytes) {
    return DataLossError(StrCat("commit record '", commit_key, "' is ", size,
                                " bytes, more than the format's limit of ", kMaxCommitRecordBytes));
  }
  return kv->Read(commit_key);
}

}  // namespace

Result<CommitRecord> ReadStepCommitRecord(KvStore* kv, const std::string& dir) {
  TS_RETURN_IF_ERROR(ValidateKey(dir));
  TS_ASSIGN_OR_RETURN(std::unique_ptr<KvStore> committed, StepCommitter(kv).OpenCommitted(dir));
  const std::string key = StrCat(dir, "/", kCommitFileName);
  TS_ASSIGN_OR_RETURN(std::string text, ReadCommitText(committed.get(), key));
  return DecodeCommitRecord(text, key);
}

Result<std::vector<std::string>> FindDependentSteps(KvStore* kv, const std::string& dir) {
  TS_RETURN_IF_ERROR(ValidateKey(dir));
  const size_t slash = dir.rfind('/');
  const std::string parent = slash == std::string::npos ? std::string() : dir.substr(0, slash + 1);
  const std::string name = dir.substr(parent.size());
  TS_ASSIGN_OR_RETURN(ListedChildren children, kv->ListChildren(parent));
  std::vector<std::string> dependents;
  for (const std::string& prefix : children.prefixes) {
    const std::string sibling = prefix.substr(0, prefix.size() - 1);
    if (sibling == dir || IsTemporaryStepName(sibling.substr(parent.size()))) continue;
    Result<CommitRecord> record = ReadStepCommitRecord(kv, sibling);
    if (absl::IsNotFound(record.status()) || absl::IsDataLoss(record.status()) ||
        IsNotAnObject(record.status()) || absl::IsFailedPrecondition(record.status())) {
      continue;
    }
    TS_RETURN_IF_ERROR(record.status());
    if (std::find(record->depends_on.begin(), record->depends_on.end(), name) ==
        record->depends_on.end()) {
      continue;
    }
    Result<uint64_t> retired = kv->Size(StrCat(sibling, "/", kRetiredFileName));
    if (retired.ok()) continue;
    if (!absl::IsNotFound(retired.status())) return retired.status();
    dependents.push_back(sibling);
  }
  return dependents;
}

Result<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(KvStore* kv, std::string dir,
                                                                 ReaderOptions options) {
  TS_RETURN_IF_ERROR(ValidateKey(dir));
  // "<step>.tmp-<nonce>" may hold a COMMIT (a save that crashed between writing COMMIT and the
  // rename into place) and "<step>.old-<nonce>" a replaced step: neither is a committed step.
  if (IsTemporaryStepName(dir)) {
    return FailedPreconditionError(
        StrCat("'", dir,
               "' is the temporary folder of a save (running, failed or crashed) or of a "
               "replaced step, not a committed step; it cannot be read"));
  }
  std::unique_ptr<Impl> impl;
  for (int attempt = 0;; ++attempt) {
    impl = std::make_unique<Impl>();
    impl->dir = dir;
    impl->root_kv = kv;
    impl->item_dir = ItemDir(impl->dir, kStateItem);
    impl->options = options;
    if (impl->options.io_threads <= 0) impl->options.io_threads = DefaultIoThreads();
    // Everything is read through a view of the folder pinned now (where the store can pin):
    // COMMIT, tree.json, the index and the data files all come from one version of the step.
    Result<std::unique_ptr<KvStore>> view = StepCommitter(kv).OpenCommitted(dir);
    Status loaded = view.status();
    if (view.ok()) {
      impl->folder_view = *std::move(view);
      impl->kv = impl->folder_view.get();
      loaded = impl->Load();
    } else if (absl::IsNotFound(loaded)) {
      loaded = NotFoundError(StrCat("no checkpoint step '", dir, "' in ", kv->Describe()));
    }
    if (loaded.ok()) break;
    // An overwrite replaces the folder while the reader opens it: the old version's files are
    // deleted after the new one is in place, so the pinned old folder can lose files under the
    // reader, or (stores that move the old folder aside first) the step can be missing for a
    // moment. When COMMIT now differs from what was read (or appeared), the step was replaced
    // under us: open it again. An unchanged COMMIT means the damage is real.
    constexpr int kMaxAttempts = 6;
    const bool may_be_replacement =
        absl::IsDataLoss(loaded) || absl::IsNotFound(loaded) || absl::IsFailedPrecondition(loaded);
    if (attempt + 1 >= kMaxAttempts || !may_be_replacement) return loaded;
    Result<std::unique_ptr<KvStore>> again = StepCommitter(kv).OpenCommitted(dir);
    Result<std::string> now = again.ok()
                                  ? ReadCommitText(again->get(), StrCat(dir, "/", kCommitFileName))
                                  : again.status();
    if (!now.ok() || *now == impl->commit_text) return loaded;
    std::this_thread::sleep_for(std::chrono::milliseconds(1 << attempt));
  }
  impl->pool = std::make_unique<ThreadPool>(impl->options.io_threads);
  return std::unique_ptr<CheckpointReader>(new CheckpointReader(std::move(impl)));
}

Status CheckpointReader::Impl::Load() {
  // COMMIT first: without it the step does not exist, whatever else is in the folder.
  const std::string commit_key = StrCat(dir, "/", kCommitFileName);
  // Sizes are checked before anything is read whole, so a hostile step cannot make the reader
  // allocate more than the format allows.
  Result<std::string> commit_read = ReadCommitText(kv, commit_key);
  if (absl::IsNotFound(commit_read.status())) {
    TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, kv->List(dir + "/"));
    if (keys.empty()) {
      return NotFoundError(StrCat("no checkpoint step '", dir, "' in ", kv->Describe()));
    }
    // On an object store, save attempts that never committed (object_store_commit.h) are not a
    // step, as a renaming store's temporary folders are not.
    const bool only_attempts = std::all_of(keys.begin(), keys.end(), [&](const std::string& key) {
      const std::string_view relative = std::string_view(key).substr(dir.size() + 1);
      return IsAttemptName(relative.substr(0, relative.find('/')));
    });
    if (only_attempts) {
      return NotFoundError(StrCat("no checkpoint step '", dir, "' in ", kv->Describe(),
                                  " (only unfinished save attempts, which `tensorstash gc` "
                                  "removes)"));
    }
    return FailedPreconditionError(
        StrCat("step '", dir,
               "' has no COMMIT record: it is incomplete (a save that is still running "
               "or that crashed) and cannot be read"));
  }
  TS_RETURN_IF_ERROR(commit_read.status());
  commit_text = *commit_read;
  TS_ASSIGN_OR_RETURN(commit, DecodeCommitRecord(commit_text, commit_key));
  auto item_it = commit.items.find(kStateItem);
  if (item_it == commit.items.end()) {
    return DataLossError(StrCat("commit record '", commit_key, "' lists no \"state\" item"));
  }
  const CommitItem& item = item_it->second;

  // tree.json and the index must have exactly the size and CRC-32C that COMMIT recorded.
  auto read_checked = [&](std::string_view name, uint64_t expected_size, uint32_t crc,
                          uint32_t (*crc_of)(std::string_view)) -> Result<std::string> {
    const std::string key = StrCat(item_dir, "/", name);
    Result<uint64_t> size = kv->Size(key);
    if (!size.ok()) return CommittedFileError(size.status(), "file", key);
    if (*size != expected_size) {
      return DataLossError(StrCat("'", key, "' has ", *size, " bytes but its commit record says ",
                                  expected_size, ": the file is damaged or was replaced"));
    }
    TS_ASSIGN_OR_RETURN(std::string bytes, kv->Read(key));
    if (bytes.size() != expected_size || crc_of(bytes) != crc) {
      return DataLossError(StrCat("'", key,
                                  "' does not match the CRC-32C in its commit record: "
                                  "the file is damaged or was replaced"));
    }
    return bytes;
  };
  TS_ASSIGN_OR_RETURN(std::string tree_json,
                      read_checked(kTreeFileName, item.tree_size, item.tree_crc32c,
                                   [](std::string_view b) { return Crc32c(b); }));
  TS_ASSIGN_OR_RETURN(tree, DecodeTreeJson(tree_json, StrCat(item_dir, "/", kTreeFileName)));
  TS_ASSIGN_OR_RETURN(std::string index_bytes, read_checked(kIndexFileName, item.index_size,
                                                            item.index_crc32c, IndexBodyCrc32c));
  TS_ASSIGN_OR_RETURN(index, DecodeIndex(index_bytes, StrCat(item_dir, "/", kIndexFileName)));
  if (item.num_arrays != tree.arrays.size()) {
    return DataLossError(StrCat("commit record '", commit_key, "' counts ", item.num_arrays,
                                " arrays but tree.json holds ", tree.arrays.size()));
  }

  // The index must describe exactly the chunks of the arrays in tree.json.
  const size_t n = tree.arrays.size();
  const std::string index_key = StrCat(item_dir, "/", kIndexFileName);
  entries_begin.assign(n + 1, 0);
  stored_bytes.assign(n, 0);
  std::vector<int64_t> counts(n, 0);
  for (const IndexEntry& e : index.entries) {
    if (e.array_id >= n) {
      return DataLossError(StrCat("chunk index '", index_key, "' names array ", e.array_id,
                                  " but tree.json has ", n));
    }
    const ArrayMetadata& a = tree.arrays[e.array_id];
    const int64_t elements = e.chunk < static_cast<uint64_t>(a.grid.NumChunks())
                                 ? a.grid.ChunkNumElements(static_cast<int64_t>(e.chunk))
                                 : 0;
    if (elements == 0) {  // beyond the grid, or a chunk that does not exist
      return DataLossError(StrCat("chunk index '", index_key, "' lists chunk ", e.chunk,
                                  " that array '", a.path, "' does not have"));
    }
    const uint64_t raw = static_cast<uint64_t>(elements) * ItemSize(a.dtype);
    if ((a.codec == Codec::kNone && e.length != raw) || e.length > MaxEncodedSize(a.codec, raw)) {
      return DataLossError(StrCat("chunk index '", index_key, "': ", ChunkWhat(e),
                                  " has the wrong stored size for ", raw, " raw bytes"));
    }
    ++counts[e.array_id];
    stored_bytes[e.array_id] += e.length;
  }
  for (size_t i = 0; i < n; ++i) {
    const int64_t expected = tree.arrays[i].grid.NumStoredChunks();
    if (counts[i] > expected || (counts[i] < expected && !options.open_holding)) {
      return DataLossError(StrCat("chunk index '", index_key, "' holds ", counts[i],
                                  " chunks of array '", tree.arrays[i].path, "', which has ",
                                  tree.arrays[i].grid.NumStoredChunks()));
    }
    entries_begin[i + 1] = entries_begin[i] + counts[i];
    array_by_path[tree.arrays[i].path] = i;
  }

  // An incremental step names the steps it reads from in COMMIT: the index may name no other.
  std::set<std::string, std::less<>> referenced;
  for (const DataFileInfo& f : index.files) {
    if (!f.step.empty()) referenced.insert(f.step);
  }
  const std::set<std::string, std::less<>> depends_on(commit.depends_on.begin(),
                                                      commit.depends_on.end());
  if (referenced != depends_on) {
    return DataLossError(StrCat("chunk index '", index_key, "' reads data files of steps [",
                                StrJoin(referenced, ", "), "] but its commit record '", commit_key,
                                "' depends on [", StrJoin(commit.depends_on, ", "), "]"));
  }
  const std::string_view parent = ParentFolder(dir);
  for (const std::string& step : referenced) {
    if ((parent.empty() ? step : StrCat(parent, "/", step)) == dir) {
      return DataLossError(StrCat("chunk index '", index_key, "' names step '", dir,
                                  "' itself as another step"));
    }
  }

  // Open every data file now: a missing or truncated file is found before any read.
  files.resize(index.files.size());
  file_errors.resize(index.files.size());
  for (uint32_t f = 0; f < index.files.size(); ++f) {
    const std::string key = FileKey(f);
    const DataFileInfo& info = index.files[f];
    Result<std::unique_ptr<ReadableFile>> file =
        info.step.empty() ? kv->OpenForRead(key) : OpenOtherStepFile(key, info);
    if (!file.ok() && !info.step.empty()) {
      // A file of the step this one was saved against: that step (or the file) was deleted or
      // damaged by hand, since retention and gc keep every step a kept step depends on.
      file_errors[f] = DataLossError(StrCat(
          "data file '", info.name, "' of step '", info.step, "' ('", key,
          "'), which step '", dir, "' references, cannot be opened: ", file.status().message()));
    } else if (!file.ok()) {
      file_errors[f] = CommittedFileError(file.status(), "data file", key);
    } else if ((*file)->size() < index.files[f].size) {
      file_errors[f] = DataLossError(StrCat("data file '", key, "' is truncated: ", (*file)->size(),
                                            " bytes, the index says ", index.files[f].size));
    } else {
      files[f] = std::move(*file);
    }
    if (!file_errors[f].ok() && !options.open_damaged) return file_errors[f];
  }
  return OkStatus();
}

const std::string& CheckpointReader::dir() const { return impl_->dir; }
const CommitRecord& CheckpointReader::commit_record() const { return impl_->commit; }
const TreeNode& CheckpointReader::tree() const { return impl_->tree.root; }
const std::vector<ArrayMetadata>& CheckpointReader::arrays() const { return impl_->tree.arrays; }
const ChunkIndex& CheckpointReader::index() const { return impl_->index; }
std::string CheckpointReader::DataFileKey(uint32_t file_id) const {
  return impl_->FileKey(file_id);
}
uint64_t CheckpointReader::StoredBytes(size_t array_id) const {
  return impl_->stored_bytes.at(array_id);
}

Result<const ArrayMetadata*> CheckpointReader::FindArray(std::string_view path) const {
  auto it = impl_->array_by_path.find(path);
  if (it == impl_->array_by_path.end()) {
    return NotFoundError(StrCat("no array '", path, "' in checkpoint '", impl_->dir, "'"));
  }
  return &impl_->tree.arrays[it->second];
}

Status CheckpointReader::Read(const ReadRequest& request, ReadStats* stats) {
  return ReadMany({request}, stats);
}

Result<std::string> CheckpointReader::ReadFile(std::string_view name) const {
  const Impl& s = *impl_;
  auto it = s.commit.files.find(std::string(name));
  if (it == s.commit.files.end()) {
    return NotFoundError(StrCat("step '", s.dir, "' has no committed file '", name, "'"));
  }
  const std::string key = StrCat(s.dir, "/", name);
  const CommitFile& expected = it->second;
  // The size is checked before the file is read whole: COMMIT bounds the allocation.
  Result<uint64_t> size = s.kv->Size(key);
  if (!size.ok()) return CommittedFileError(size.status(), "file", key);
  if (*size != expected.size) {
    return DataLossError(StrCat("'", key, "' has ", *size, " bytes but its commit record says ",
                                expected.size, ": the file is damaged or was replaced"));
  }
  TS_ASSIGN_OR_RETURN(std::string bytes, s.kv->Read(key));
  if (bytes.size() != expected.size || Crc32c(bytes) != expected.crc32c) {
    return DataLossError(StrCat("'", key,
                                "' does not match the CRC-32C in its commit record: "
                                "the file is damaged or was replaced"));
  }
  return bytes;
}

Status CheckpointReader::ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats,
                                  const std::function<void(uint64_t, uint64_t)>& progress) {
  Impl& s = *impl_;
  // 1. Which stored chunks the requests need, each once (engine/read_plan.h).
  std::vector<BoxRead> box_reads(requests.size());
  for (size_t r = 0; r < requests.size(); ++r) {
    const ReadRequest& req = requests[r];
    TS_ASSIGN_OR_RETURN(const size_t array_id, s.CheckRequest(req, req.dtype));
    const ArrayMetadata* a = &s.tree.arrays[array_id];
    box_reads[r] = {static_cast<uint32_t>(array_id), &a->grid, req.box};
    if (!req.box.empty() && !Box::FromShape(a->shape()).Contains(req.box)) {
      // Zeros where the box reaches past the stored shape.
      std::memset(req.dest, 0, req.box.num_elements() * ItemSize(req.dtype));
    }
  }
  const std::vector<NeededChunk> needed = PlanChunkPieces(box_reads);
  // A chunk that lands whole, uncompressed and unconverted, as one run of its only
  // destination is read straight there (direct); the others are staged, checked, decoded and
  // copied into each piece. A ChunkRead's tag indexes `needed` and `entries`.
  std::vector<const IndexEntry*> entries(needed.size());
  std::vector<ChunkRead> direct_reads, staged_reads;
  uint64_t max_decode_room = 0;
  auto raw_bytes = [&](size_t i) {
    return needed[i].chunk_box.num_elements() * ItemSize(s.tree.arrays[needed[i].array_id].dtype);
  };
  for (size_t i = 0; i < needed.size(); ++i) {
    const NeededChunk& n = needed[i];
    const ArrayMetadata& a = s.tree.arrays[n.array_id];
    const IndexEntry* entry = s.FindEntry(n.array_id, n.chunk);
    if (entry == nullptr) {
      return DataLossError(StrCat("chunk ", a.grid.ChunkName(n.chunk), " of array '", a.path,
                                  "' is not in the index"));
    }
    entries[i] = entry;
    const ReadRequest& req = requests[n.pieces.front().read];
    if (n.pieces.size() == 1 && a.codec == Codec::kNone && a.dtype == req.dtype &&
        n.pieces.front().region == n.chunk_box && IsContiguousIn(n.chunk_box, req.box)) {
      char* dest =
          static_cast<char*>(req.dest) + ByteOffsetIn(n.chunk_box, req.box, ItemSize(req.dtype));
      direct_reads.push_back({entry->file_id, entry->offset, entry->length, dest, i});
      continue;
    }
    if (a.codec != Codec::kNone)
      max_decode_room = std::max<uint64_t>(max_decode_room, raw_bytes(i));
    staged_reads.push_back({entry->file_id, entry->offset, entry->length, nullptr, i});
  }

  // 2. Storage requests. Staged ones hold their span plus room to decode one chunk under the
  // byte cap, so they are coalesced only up to what fits in it (otherwise one coalesced span
  // could blow through the cap; a single chunk still goes alone).
  const uint64_t cap = std::max<uint64_t>(1, s.options.max_inflight_bytes);
  const uint64_t staged_limit = std::min<uint64_t>(
      s.options.max_request_bytes, cap > max_decode_room ? cap - max_decode_room : 1);
  std::vector<ReadRequestPlan> plans = PlanReadRequests(
      std::move(direct_reads), s.options.coalesce_gap_bytes, s.options.max_request_bytes);
  for (ReadRequestPlan& plan :
       PlanReadRequests(std::move(staged_reads), s.options.coalesce_gap_bytes, staged_limit)) {
    plans.push_back(std::move(plan));
  }
  // Mapped spans: see ReaderOptions::map_spans. Only when every staged span qualifies, so that
  // mapped and staged bytes never add up past the cap (mappings count against it as well: their
  // pages are resident while the pieces are copied out).
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  // A backend without mappable files (KvStoreCapabilities::mapping) reads instead.
  bool map_spans = s.options.map_spans && s.kv->Capabilities().mapping;
  for (const ReadRequestPlan& plan : plans) {
    if (!map_spans) break;
    if (plan.direct_dest != nullptr) continue;
    map_spans = plan.length >= kMinMappedSpanBytes && s.file_errors[plan.file_id].ok();
    for (const ChunkRead& c : plan.chunks) {
      if (s.tree.arrays[needed[c.tag].array_id].codec != Codec::kNone) map_spans = false;
    }
  }

  // 3. Execution under the byte cap (engine/executor.h).
  ReadStats local;
  std::mutex stats_mutex;
  uint64_t total_bytes = 0;
  for (const ReadRequestPlan& plan : plans) total_bytes += plan.length;
  // Called with stats_mutex held, so that calls never overlap.
  auto report_progress = [&] {
    if (progress) progress(local.bytes_read, total_bytes);
  };
  // Each chunk of a staged span at `span`: checked, decoded into `decoded` when compressed,
  // and copied piece by piece into the destinations.
  auto scatter = [&](const ReadRequestPlan& plan, const char* span, char* decoded,
                     bool mapped) -> Status {
    for (const ChunkRead& c : plan.chunks) {
      const NeededChunk& n = needed[c.tag];
      const IndexEntry& e = *entries[c.tag];
      const ArrayMetadata& a = s.tree.arrays[e.array_id];
      const char* stored = span + (e.offset - plan.offset);
      TS_RETURN_IF_ERROR(s.CheckCrc(e, stored));
      const char* raw = stored;
      if (a.codec != Codec::kNone) {
        TS_RETURN_IF_ERROR(DecodeChunk(a.codec, std::string_view(stored, e.length), decoded,
                                       raw_bytes(c.tag), s.ChunkWhat(e)));
        raw = decoded;
      }
      for (const ChunkPiece& p : n.pieces) {
        const ReadRequest& req = requests[p.read];
        PrefaultRegion(p.region, req);
        TS_RETURN_IF_ERROR(CopyBox(p.region, a.dtype, raw, n.chunk_box, req.dtype, req.dest,
                                   req.box, StrCat("array '", a.path, "'")));
      }
    }
    std::lock_guard<std::mutex> lock(stats_mutex);
    local.bytes_read += plan.length;
    ++local.requests;
    local.staged_chunks += plan.chunks.size();
    local.mapped_spans += mapped ? 1 : 0;
    report_progress();
    return OkStatus();
  };
  Executor run(s.pool.get(), cap);
  for (const ReadRequestPlan& each : plans) {
    if (run.failed()) break;
    const ReadRequestPlan* plan = &each;
    if (plan->direct_dest != nullptr) {
      run.RunHolding(0, [&, plan]() -> Status {
        PrefaultForWrite(plan->direct_dest, plan->length);
        TS_RETURN_IF_ERROR(
            s.ReadFile(plan->file_id, plan->offset, plan->length, plan->direct_dest));
        for (const ChunkRead& c : plan->chunks) {
          TS_RETURN_IF_ERROR(s.CheckCrc(*entries[c.tag], c.direct_dest));
        }
        std::lock_guard<std::mutex> lock(stats_mutex);
        local.bytes_read += plan->length;
        ++local.requests;
        local.direct_chunks += plan->chunks.size();
        report_progress();
        return OkStatus();
      });
      continue;
    }
    if (map_spans) {
      run.RunHolding(plan->length, [&, plan]() -> Status {
        // From the page the span starts in: chunks continuing an array need not start on one.
        const uint64_t skip = plan->offset % page;
        Result<MappedBox> mapped =
            s.MapSpan(plan->file_id, plan->offset - skip, plan->length + skip, page);
        if (!mapped.ok()) return mapped.status();
        return scatter(*plan, mapped->data() + skip, nullptr, /*mapped=*/true);
      });
      continue;
    }
    // The span, plus room to decode the largest chunk when the codec needs it: one buffer for
    // both (two would deadlock when every thread holds its first and waits).
    uint64_t decode_room = 0;
    for (const ChunkRead& c : plan->chunks) {
      if (s.tree.arrays[needed[c.tag].array_id].codec != Codec::kNone) {
        decode_room = std::max<uint64_t>(decode_room, raw_bytes(c.tag));
      }
    }
    run.Run(plan->length + decode_room, [&, plan](char* span) -> Status {
      TS_RETURN_IF_ERROR(s.ReadFile(plan->file_id, plan->offset, plan->length, span));
      return scatter(*plan, span, span + plan->length, /*mapped=*/false);
    });
  }
  Status status = run.Wait();
  local.peak_staging_bytes = run.peak_staging_bytes();
  if (stats != nullptr) *stats = local;
  return status;
}

namespace {

Status NotMappable(std::string_view path, std::string_view why) {
  return UnimplementedError(StrCat("array '", path, "': the box cannot be mapped (", why, ")"));
}

// Views into a shared mapping start on this boundary, so that XLA's CPU client adopts them as
// device buffers without a copy (as it does the 64-byte aligned buffers of host_restore.cc).
constexpr uint64_t kViewAlignment = 64;
// Runs of one file at most this far apart share a mapping: the bytes between them are mapped
// too, but never touched, so they cost address space only.
constexpr uint64_t kSharedMappingGapBytes = uint64_t{1} << 20;

// Where the stored chunks of a box lie: each (chunk, its byte offset in the box).
struct BoxParts {
  size_t array_id = 0;
  uint64_t bytes = 0;
  std::vector<std::pair<const IndexEntry*, uint64_t>> parts;
  // Whether the box is the bytes [run_offset, run_offset + bytes) of one data file.
  bool run = false;
  uint32_t file_id = 0;
  uint64_t run_offset = 0;
};

}  // namespace

std::vector<Result<MappedBox>> CheckpointReader::MapMany(const std::vector<ReadRequest>& requests,
                                                         const MapOptions& options) {
  Impl& s = *impl_;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  // The chunks of a box, if it can be mapped at all.
  auto parts_of = [&](const ReadRequest& req) -> Result<BoxParts> {
    BoxParts box;
    TS_ASSIGN_OR_RETURN(box.array_id, s.CheckRequest(req, std::nullopt));
    const ArrayMetadata* a = &s.tree.arrays[box.array_id];
    if (req.dtype != a->dtype) return NotMappable(a->path, "a dtype conversion");
    if (a->codec != Codec::kNone) return NotMappable(a->path, "compressed");
    if (req.box.empty()) return NotMappable(a->path, "empty");
    if (!Box::FromShape(a->shape()).Contains(req.box))
      return NotMappable(a->path, "past the shape");
    const size_t item = ItemSize(a->dtype);
    box.bytes = req.box.num_elements() * item;
    Status bad;
    a->grid.ForEachChunkIntersecting(req.box, [&](int64_t chunk, const Box& chunk_box) {
      if (!bad.ok()) return;
      const IndexEntry* e = s.FindEntry(box.array_id, chunk);
      if (e == nullptr) {
        bad = DataLossError(StrCat("chunk ", a->grid.ChunkName(chunk), " of array '", a->path,
                                   "' is not in the index"));
        return;
      }
      if (!s.file_errors[e->file_id].ok()) {
        bad = s.file_errors[e->file_id];
        return;
      }
      if (!(Intersect(chunk_box, req.box) == chunk_box) || !IsContiguousIn(chunk_box, req.box) ||
          e->length != chunk_box.num_elements() * item) {
        bad = NotMappable(a->path, "a chunk is not a contiguous run of the box");
        return;
      }
      box.parts.emplace_back(e, ByteOffsetIn(chunk_box, req.box, item));
    });
    TS_RETURN_IF_ERROR(bad);
    // The chunks tile the box; it is one run of a file when each chunk sits in the file where its
    // bytes sit in the box.
    const IndexEntry& first = *box.parts.front().first;
    const uint64_t first_in_box = box.parts.front().second;
    box.file_id = first.file_id;
    box.run_offset = first.offset - std::min(first.offset, first_in_box);
    box.run = first.offset >= first_in_box;
    for (const auto& [e, offset] : box.parts) {
      box.run = box.run && e->file_id == box.file_id && e->offset == box.run_offset + offset;
    }
    return box;
  };
  // A box mapped chunk by chunk into memory of its own (boxes that are not runs).
  auto map_chunks = [&](const BoxParts& box) -> Result<MappedBox> {
    const ArrayMetadata* a = &s.tree.arrays[box.array_id];
    for (const auto& [e, offset] : box.parts) {
      if (e->length < kMinMappedChunkBytes) return NotMappable(a->path, "small chunks");
      if (offset % page != 0 || e->offset % page != 0 ||
          (e->length % page != 0 && offset + e->length != box.bytes)) {
        return NotMappable(a->path, "a chunk off page boundaries");
      }
    }
    // Anonymous memory first, for the whole box; each chunk's pages then replace their part.
    const size_t mapped_size = (box.bytes + page - 1) / page * page;
    // A mapping the system refuses (ENOMEM past vm.max_map_count, ...) is not an error: the box
    // is read instead, and a read reports what is really wrong with the file.
    void* base = ::mmap(nullptr, mapped_size, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) return NotMappable(a->path, "no address space");
    MappedBox mapped(static_cast<char*>(base), box.bytes, mapped_size);
    for (const auto& [e, offset] : box.parts) {
      if (!s.files[e->file_id]->MapAt(e->offset, e->length, mapped.data() + offset).ok()) {
        return NotMappable(a->path, "the system refused the mapping");
      }
      TS_RETURN_IF_ERROR(s.CheckCrc(*e, mapped.data() + offset));
    }
    return mapped;
  };

  std::vector<Result<MappedBox>> results;
  results.reserve(requests.size());
  std::vector<BoxParts> boxes(requests.size());
  std::vector<size_t> runs, others;  // requests to map shared, and on their own
  const bool mappable = s.kv->Capabilities().mapping;
  // What a box not mapped below answers; copies share it (no message made per box).
  const Status not_mapped =
      UnimplementedError(mappable ? "the box cannot be mapped (over the mapping budget)"
                                  : "the box cannot be mapped (the store cannot map)");
  for (size_t i = 0; i < requests.size(); ++i) {
    Result<BoxParts> parts = parts_of(requests[i]);
    if (!parts.ok()) {
      results.emplace_back(parts.status());
      continue;
    }
    boxes[i] = *std::move(parts);
    results.emplace_back(not_mapped);
    if (!mappable) continue;
    (boxes[i].run && boxes[i].run_offset % kViewAlignment == 0 ? runs : others).push_back(i);
  }

  // Runs of the same file, by offset, grouped into shared mappings: [begin, end) of `runs`.
  std::sort(runs.begin(), runs.end(), [&](size_t x, size_t y) {
    return std::tie(boxes[x].file_id, boxes[x].run_offset) <
           std::tie(boxes[y].file_id, boxes[y].run_offset);
  });
  struct Shared {
    size_t begin, end;
    uint32_t file_id;
    uint64_t offset, length;  // of the mapping: page-aligned offset, up to the last run's end
  };
  std::vector<Shared> shared;
  uint64_t mappings = 0;  // made by this call, of what the earlier calls left of the budget
  const uint64_t made_before = options.mappings_made != nullptr ? *options.mappings_made : 0;
  const uint64_t budget = options.max_mappings - std::min(options.max_mappings, made_before);
  for (size_t k = 0; k < runs.size(); ++k) {
    const BoxParts& box = boxes[runs[k]];
    const uint64_t end = box.run_offset + box.bytes;
    if (!shared.empty()) {
      Shared& last = shared.back();
      const uint64_t last_end = last.offset + last.length;
      if (last.file_id == box.file_id && box.run_offset <= last_end + kSharedMappingGapBytes &&
          std::max(end, last_end) - last.offset <= options.shared_mapping_bytes) {
        last.length = std::max(end, last_end) - last.offset;
        last.end = k + 1;
        continue;
      }
    }
    if (mappings >= budget) break;
    ++mappings;
    const uint64_t offset = box.run_offset / page * page;
    shared.push_back({k, k + 1, box.file_id, offset, end - offset});
  }

  // Mappings hold no staging: nothing to cap.
  Executor run(s.pool.get(), s.options.max_inflight_bytes);
  for (const Shared& group : shared) {
    run.RunHolding(0, [&, group] {
      Result<MappedBox> region = s.MapSpan(group.file_id, group.offset, group.length, page);
      if (!region.ok()) {
        for (size_t k = group.begin; k < group.end; ++k) {
          results[runs[k]] = NotMappable(requests[runs[k]].path, "the system refused the mapping");
        }
        return OkStatus();
      }
      // Shared by the views: the last one alive unmaps it.
      auto owner = std::make_shared<const MappedBox>(*std::move(region));
      for (size_t k = group.begin; k < group.end; ++k) {
        const BoxParts& box = boxes[runs[k]];
        char* data = owner->data() + (box.run_offset - group.offset);
        Status checked;
        for (const auto& [e, offset] : box.parts) {
          checked = s.CheckCrc(*e, data + offset);
          if (!checked.ok()) break;
        }
        results[runs[k]] = checked.ok() ? Result<MappedBox>(MappedBox(owner, data, box.bytes))
                                        : Result<MappedBox>(checked);
      }
      return OkStatus();
    });
  }
  for (size_t i : others) {
    const uint64_t cost = boxes[i].parts.size() + 1;
    if (mappings + cost > budget) break;
    mappings += cost;
    run.RunHolding(0, [&, i] {
      results[i] = map_chunks(boxes[i]);
      return OkStatus();
    });
  }
  (void)run.Wait();  // every task returns OK: the results carry the errors
  if (options.mappings_made != nullptr) *options.mappings_made += mappings;
  return results;
}

Result<std::vector<BadChunk>> CheckpointReader::Verify(
    const std::function<void(uint64_t, uint64_t)>& progress) {
  Impl& s = *impl_;
  std::vector<ChunkRead> reads;
  uint64_t total = 0;
  for (size_t i = 0; i < s.index.entries.size(); ++i) {
    const IndexEntry& e = s.index.entries[i];
    reads.push_back({e.file_id, e.offset, e.length, nullptr, i});
    total += e.length;
  }
  // Spans are staged under the byte cap: coalesce only up to what fits in it.
  std::vector<ReadRequestPlan> plans =
      PlanReadRequests(std::move(reads), s.options.coalesce_gap_bytes,
                       std::min<uint64_t>(s.options.max_request_bytes,
                                          std::max<uint64_t>(1, s.options.max_inflight_bytes)));
  std::mutex mutex;
  std::vector<BadChunk> bad;
  uint64_t done = 0;
  auto report = [&](const IndexEntry& e, const Status& error) {
    const ArrayMetadata& a = s.tree.arrays[e.array_id];
    bad.push_back({a.path, a.grid.ChunkName(static_cast<int64_t>(e.chunk)), s.FileKey(e.file_id),
                   std::string(error.message())});
  };
  {
    Executor run(s.pool.get(), s.options.max_inflight_bytes);
    auto raw_bytes = [&](const IndexEntry& e) -> uint64_t {
      const ArrayMetadata& a = s.tree.arrays[e.array_id];
      if (a.codec == Codec::kNone) return 0;
      return a.grid.ChunkBox(static_cast<int64_t>(e.chunk)).num_elements() * ItemSize(a.dtype);
    };
    for (const ReadRequestPlan& each : plans) {
      // The span, and room to decode its largest compressed chunk, under the cap.
      uint64_t decode_room = 0;
      for (const ChunkRead& c : each.chunks) {
        decode_room = std::max(decode_room, raw_bytes(s.index.entries[c.tag]));
      }
      run.Run(each.length + decode_room, [&, plan_ptr = &each](char* span) -> Status {
        const ReadRequestPlan& plan = *plan_ptr;
        Status read = s.ReadFile(plan.file_id, plan.offset, plan.length, span);
        std::vector<std::pair<const IndexEntry*, Status>> results;
        for (const ChunkRead& c : plan.chunks) {
          const IndexEntry& e = s.index.entries[c.tag];
          Status status = read;
          if (status.ok()) {
            const uint32_t crc = Crc32c(span + (e.offset - plan.offset), e.length);
            if (crc != e.crc32c) {
              status = DataLossError(StrCat("CRC-32C mismatch in ", s.ChunkWhat(e), ": stored ",
                                            Hex32(e.crc32c), ", computed ", Hex32(crc)));
            }
          }
          const ArrayMetadata& a = s.tree.arrays[e.array_id];
          if (status.ok() && a.codec != Codec::kNone) {
            status =
                DecodeChunk(a.codec, std::string_view(span + (e.offset - plan.offset), e.length),
                            span + plan.length, raw_bytes(e), s.ChunkWhat(e));
          }
          if (!status.ok()) results.emplace_back(&e, status);
        }
        std::lock_guard<std::mutex> lock(mutex);
        for (auto& [e, status] : results) report(*e, status);
        done += plan.length;
        if (progress) progress(done, total);
        return OkStatus();
      });
    }
    TS_RETURN_IF_ERROR(run.Wait());
  }
  for (const auto& [name, file] : s.commit.files) {
    if (Result<std::string> read = ReadFile(name); !read.ok()) {
      bad.push_back({"", "", StrCat(s.dir, "/", name), std::string(read.status().message())});
    }
  }
  std::sort(bad.begin(), bad.end(), [](const BadChunk& a, const BadChunk& b) {
    return std::tie(a.array_path, a.chunk) < std::tie(b.array_path, b.chunk);
  });
  return bad;
}

}  // namespace tensorstash
