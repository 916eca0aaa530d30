#include "tensorstash/checkpoint/dcp_reader.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/engine/executor.h"
#include "tensorstash/format/dcp/pickle.h"
#include "tensorstash/format/dcp/torch_save.h"
#include "tensorstash/format/dcp/torch_zip.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

// Chunks whose archives are at least this large are read with their tensor's bytes straight
// into the destination when it holds them contiguously (ReadChunkInto): the archive's first
// and last kDirectEdgeBytes are read apart, for its records.
constexpr uint64_t kDirectMinBytes = uint64_t{1} << 20;
constexpr uint64_t kDirectEdgeBytes = uint64_t{64} << 10;

// Nesting a bytes item may have (a pickle can make cycles; real values are shallow).
constexpr int kMaxValueDepth = 64;

Result<TreeNode> ValueNode(const PickleValue& v, int depth, const std::string& where) {
  if (depth > kMaxValueDepth) {
    return UnimplementedError(StrCat(where, ": nested deeper than ", kMaxValueDepth));
  }
  TreeNode n;
  switch (v.kind) {
    case PickleKind::kNone:
      return n;
    case PickleKind::kBool:
      n.kind = TreeNode::Kind::kBool;
      n.bool_value = v.boolean;
      return n;
    case PickleKind::kInt:
      n.kind = TreeNode::Kind::kInt;
      n.int_value = std::to_string(v.integer);
      return n;
    case PickleKind::kFloat:
      n.kind = TreeNode::Kind::kFloat;
      n.float_value = v.real;
      return n;
    case PickleKind::kStr:
      n.kind = TreeNode::Kind::kString;
      n.string_value = v.text;
      return n;
    case PickleKind::kBytes:
      n.kind = TreeNode::Kind::kBytes;
      n.string_value = v.text;
      return n;
    case PickleKind::kList:
    case PickleKind::kTuple:
      n.kind = v.kind == PickleKind::kList ? TreeNode::Kind::kList : TreeNode::Kind::kTuple;
      for (const PickleValue* item : v.items) {
        TS_ASSIGN_OR_RETURN(TreeNode child, ValueNode(*item, depth + 1, where));
        n.items.push_back(std::move(child));
      }
      return n;
    case PickleKind::kDict:
      n.kind = TreeNode::Kind::kDict;
      for (const auto& [key, value] : v.entries) {
        if (!key->Is(PickleKind::kStr)) {
          return UnimplementedError(StrCat(where, ": a dict with a ", PickleKindName(key->kind), " key"));
        }
        TS_ASSIGN_OR_RETURN(TreeNode child, ValueNode(*value, depth + 1, where));
        n.entries.emplace_back(key->text, std::move(child));
      }
      return n;
    default:
      return UnimplementedError(
          StrCat(where, ": a ",
                 v.Is(PickleKind::kObject) ? v.callee->text : std::string(PickleKindName(v.kind)),
                 " (only plain values are read from DCP bytes items)"));
  }
}

// Where `chunk` (inside req.box) starts in req.dest when its elements lie there as one C-order
// run: every dimension after the first one the chunk spans more than one index of is whole in
// req.box. nullptr otherwise.
char* ContiguousDest(const ReadRequest& req, const Box& chunk, size_t item_size) {
  bool spanning = false;
  uint64_t offset = 0;
  for (size_t d = 0; d < chunk.shape.size(); ++d) {
    if (spanning && (chunk.origin[d] != req.box.origin[d] || chunk.shape[d] != req.box.shape[d])) {
      return nullptr;
    }
    if (chunk.shape[d] > 1) spanning = true;
    offset = offset * static_cast<uint64_t>(req.box.shape[d]) +
             static_cast<uint64_t>(chunk.origin[d] - req.box.origin[d]);
  }
  return static_cast<char*>(req.dest) + offset * item_size;
}

}  // namespace

DcpReader::DcpReader(KvStore* kv, std::string path, ReaderOptions options)
    : kv_(kv), path_(std::move(path)), options_(options) {}

Status DcpReader::ReadItemRange(const DcpItemLocation& loc, uint64_t at, uint64_t length,
                                char* dest) {
  const std::string key = StrCat(path_, "/", loc.relative_path);
  auto it = file_sizes_.find(loc.relative_path);
  if (it == file_sizes_.end()) return InternalError(StrCat("unknown file ", key));
  if (loc.offset > it->second || loc.length > it->second - loc.offset) {
    return DataLossError(StrCat("DCP checkpoint '", path_, "': an item at ", loc.offset, " + ",
                                loc.length, " is past the end of ", key, " (", it->second,
                                " bytes)"));
  }
  if (at > loc.length || length > loc.length - at) {
    return InternalError(StrCat("a read of ", length, " bytes at ", at, " of an item of ",
                                loc.length, " bytes"));
  }
  if (length > 0) TS_RETURN_IF_ERROR(kv_.ReadRange(key, loc.offset + at, length, dest));
  return OkStatus();
}

Result<std::unique_ptr<DcpReader>> DcpReader::Open(KvStore* kv, std::string path,
                                                   ReaderOptions options) {
  if (options.io_threads <= 0) options.io_threads = DefaultIoThreads();
  std::unique_ptr<DcpReader> r(new DcpReader(kv, std::move(path), options));
  TS_ASSIGN_OR_RETURN(std::string pickle,
                      r->kv_.Read(StrCat(r->path_, "/", kDcpMetadataFileName)));
  TS_ASSIGN_OR_RETURN(r->meta_, ParseDcpMetadata(pickle, r->path_));
  auto note_file = [&](const DcpItemLocation& loc) -> Status {
    if (r->file_sizes_.count(loc.relative_path)) return OkStatus();
    TS_ASSIGN_OR_RETURN(uint64_t size, r->kv_.Size(StrCat(r->path_, "/", loc.relative_path)));
    r->file_sizes_[loc.relative_path] = size;
    return OkStatus();
  };
  for (const DcpTensor& t : r->meta_.tensors) {
    for (const DcpChunk& c : t.chunks) TS_RETURN_IF_ERROR(note_file(c.location));
    ArrayMetadata a;
    a.path = EscapePathKey(t.fqn);
    a.dtype = t.dtype;
    a.grid.shape = t.shape;
    a.grid.cell_shape = t.shape;
    for (int64_t& e : a.grid.cell_shape) e = std::max<int64_t>(e, 1);
    a.grid.chunk_shape = a.grid.cell_shape;
    a.codec = Codec::kNone;
    r->tree_.entries.emplace_back(t.fqn, TreeNode::Array(static_cast<int64_t>(r->metadata_.size())));
    r->by_path_.emplace(a.path, r->metadata_.size());
    r->metadata_.push_back(std::move(a));
  }
  for (const DcpBytesItem& item : r->meta_.bytes_items) {
    TS_RETURN_IF_ERROR(note_file(item.location));
    const std::string where = StrCat("DCP checkpoint '", r->path_, "': bytes item '", item.fqn, "'");
    std::string archive(item.location.length, '\0');
    TS_RETURN_IF_ERROR(r->ReadItem(item.location, archive.data()));
    TS_ASSIGN_OR_RETURN(std::vector<ZipEntry> entries,
                        ReadStoredZip(archive, where, options.verify_checksums));
    const ZipEntry* pkl = FindTorchZipEntry(entries, "data.pkl");
    if (pkl == nullptr) return DataLossError(StrCat(where, ": no data.pkl in its archive"));
    TS_ASSIGN_OR_RETURN(PickleTree value,
                        DecodePickle(std::string_view(archive).substr(pkl->data_offset, pkl->size),
                                     DcpPickleGlobals(), where));
    TS_ASSIGN_OR_RETURN(TreeNode node, ValueNode(value.root(), 0, where));
    r->tree_.entries.emplace_back(item.fqn, std::move(node));
  }
  r->pool_ = std::make_unique<ThreadPool>(r->options_.io_threads);
  return r;
}

uint64_t DcpReader::StoredBytes(size_t id) const {
  uint64_t n = 0;
  for (const DcpChunk& c : meta_.tensors[id].chunks) n += c.location.length;
  return n;
}

uint64_t DcpReader::VerifyTotalBytes() const {
  uint64_t n = 0;
  for (size_t i = 0; i < meta_.tensors.size(); ++i) n += StoredBytes(i);
  return n;
}

size_t DcpReader::VerifyTotalItems() const {
  size_t n = 0;
  for (const DcpTensor& t : meta_.tensors) n += t.chunks.size();
  return n;
}

Result<std::string> DcpReader::ReadFile(std::string_view name) const {
  return NotFoundError(StrCat("'", path_, "' is a DCP checkpoint, which has no file '", name, "'"));
}

Result<uint64_t> DcpReader::ReadChunk(size_t id, size_t c, bool check_crc, char* archive) {
  const DcpTensor& t = meta_.tensors[id];
  const DcpChunk& chunk = t.chunks[c];
  TS_RETURN_IF_ERROR(ReadItem(chunk.location, archive));
  const std::string what = StrCat("'", path_, "/", chunk.location.relative_path, "' at ",
                                  chunk.location.offset, " (tensor '", t.fqn, "')");
  TS_ASSIGN_OR_RETURN(
      TorchSavedTensor saved,
      ReadTorchSavedTensor(std::string_view(archive, chunk.location.length), what, check_crc));
  if (saved.dtype != t.dtype || saved.shape != chunk.sizes) {
    return DataLossError(StrCat("DCP item ", what, " holds a ", DTypeName(saved.dtype),
                                " tensor of another shape or dtype than the metadata's ",
                                DTypeName(t.dtype), " chunk"));
  }
  return saved.data_offset;
}

Result<bool> DcpReader::ReadChunkInto(size_t id, size_t c, bool check_crc, char* archive,
                                      char* dest) {
  const DcpTensor& t = meta_.tensors[id];
  const DcpChunk& chunk = t.chunks[c];
  const DcpItemLocation& loc = chunk.location;
  const uint64_t length = loc.length;
  if (length < kDirectMinBytes) return false;
  // The head and the tail of the archive: the zip records and data.pkl, which torch.save writes
  // before and after the storage's bytes; the bytes between (the hole) go straight to `dest`.
  const uint64_t edge = kDirectEdgeBytes;
  TS_RETURN_IF_ERROR(ReadItemRange(loc, 0, edge, archive));
  TS_RETURN_IF_ERROR(ReadItemRange(loc, length - edge, edge, archive + length - edge));
  const std::string what = StrCat("'", path_, "/", loc.relative_path, "' at ", loc.offset,
                                  " (tensor '", t.fqn, "')");
  Result<TorchSavedTensor> saved = ReadTorchSavedTensor(
      std::string_view(archive, length), what, check_crc, ZipHole{edge, length - edge});
  if (absl::IsOutOfRange(saved.status())) return false;  // laid out otherwise: read it whole
  TS_RETURN_IF_ERROR(saved.status());
  if (saved->dtype != t.dtype || saved->shape != chunk.sizes) {
    return DataLossError(StrCat("DCP item ", what, " holds a ", DTypeName(saved->dtype),
                                " tensor of another shape or dtype than the metadata's ",
                                DTypeName(t.dtype), " chunk"));
  }
  if (!saved->whole_entry) return false;
  // Only a storage entry that covers the hole (starts in the head, ends in the tail) is read
  // this way. The zip parser refuses any other entry in the hole, but a hole of bytes no entry
  // claims, with the tensor's entry in the head or the tail, passes it: copying the edges into
  // `dest` would then write past the tensor's bytes. Such an archive is read whole instead.
  const uint64_t begin = saved->data_offset, end = begin + saved->data_length;
  if (begin > edge || end < length - edge || end > length) return false;
  std::memcpy(dest, archive + begin, edge - begin);
  TS_RETURN_IF_ERROR(ReadItemRange(loc, edge, length - 2 * edge, dest + (edge - begin)));
  std::memcpy(dest + (length - edge - begin), archive + length - edge, end - (length - edge));
  if (check_crc) {
    const uint32_t actual = Crc32(dest, saved->data_length);
    if (actual != saved->data_crc32) {
      return DataLossError(StrCat("zip archive ", what, ": the tensor's storage entry has CRC-32 ",
                                  actual, ", its header says ", saved->data_crc32));
    }
  }
  return true;
}

Status DcpReader::ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats,
                           const std::function<void(uint64_t, uint64_t)>& progress) {
  // 1. The chunks the requests touch, each once, with the parts of it each request needs, in
  // the order the requests first need them.
  struct Piece {
    size_t request;
    Box part;
  };
  struct Needed {
    size_t id;
    size_t chunk;
    std::vector<Piece> pieces;
  };
  std::vector<Needed> needed;
  std::map<std::pair<size_t, size_t>, size_t> index;  // (tensor, chunk) -> needed
  uint64_t total = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const ReadRequest& req = requests[i];
    auto it = by_path_.find(req.path);
    if (it == by_path_.end()) {
      return NotFoundError(StrCat("'", path_, "' has no tensor '", req.path, "'"));
    }
    const size_t id = it->second;
    const ArrayMetadata& a = metadata_[id];
    TS_RETURN_IF_ERROR(ValidateReadRequest(req, a, req.dtype));
    const Box region = Intersect(req.box, Box::FromShape(a.shape()));
    if (region != req.box) {
      std::memset(req.dest, 0, static_cast<size_t>(req.box.num_elements()) * ItemSize(req.dtype));
    }
    if (region.empty()) continue;
    const DcpTensor& t = meta_.tensors[id];
    for (size_t c = 0; c < t.chunks.size(); ++c) {
      Box chunk_box;
      chunk_box.origin = t.chunks[c].offsets;
      chunk_box.shape = t.chunks[c].sizes;
      Box part = Intersect(region, chunk_box);
      if (part.empty()) continue;
      total += static_cast<uint64_t>(part.num_elements()) * ItemSize(req.dtype);
      auto [at, added] = index.try_emplace({id, c}, needed.size());
      if (added) needed.push_back(Needed{id, c, {}});
      needed[at->second].pieces.push_back(Piece{i, std::move(part)});
    }
  }

  // 2. One task per chunk: its archive read whole into staging (a DCP chunk is one rank's
  // shard, often far larger than what one box needs of it), checked, and copied out into every
  // box that needs it; or, where one box needs the whole chunk and holds it as one run, its
  // tensor's bytes read straight there (ReadChunkInto). The archives held at once stay under
  // the cap (engine/executor.h).
  const uint64_t bytes0 = kv_.bytes(), requests0 = kv_.requests();
  std::mutex mutex;
  uint64_t done = 0;
  uint64_t direct = 0;
  Status status;
  uint64_t peak_staging = 0;
  {
    Executor run(pool_.get(), options_.max_inflight_bytes);
    for (const Needed& each : needed) {
      if (run.failed()) break;
      const Needed* n = &each;
      run.Run(meta_.tensors[n->id].chunks[n->chunk].location.length,
              [&, n](char* archive) -> Status {
                const ArrayMetadata& a = metadata_[n->id];
                const DcpChunk& chunk = meta_.tensors[n->id].chunks[n->chunk];
                Box chunk_box;
                chunk_box.origin = chunk.offsets;
                chunk_box.shape = chunk.sizes;
                bool read_into = false;
                if (n->pieces.size() == 1 && n->pieces[0].part == chunk_box &&
                    requests[n->pieces[0].request].dtype == a.dtype) {
                  if (char* dest = ContiguousDest(requests[n->pieces[0].request], chunk_box,
                                                  ItemSize(a.dtype))) {
                    TS_ASSIGN_OR_RETURN(read_into, ReadChunkInto(n->id, n->chunk,
                                                                 options_.verify_checksums,
                                                                 archive, dest));
                  }
                }
                uint64_t copied = 0;
                if (read_into) {
                  copied = static_cast<uint64_t>(chunk_box.num_elements()) * ItemSize(a.dtype);
                } else {
                  TS_ASSIGN_OR_RETURN(uint64_t data_offset,
                                      ReadChunk(n->id, n->chunk, options_.verify_checksums,
                                                archive));
                  for (const Piece& p : n->pieces) {
                    const ReadRequest& req = requests[p.request];
                    TS_RETURN_IF_ERROR(CopyBox(p.part, a.dtype, archive + data_offset, chunk_box,
                                               req.dtype, req.dest, req.box, a.path));
                    copied += static_cast<uint64_t>(p.part.num_elements()) * ItemSize(req.dtype);
                  }
                }
                std::lock_guard<std::mutex> lock(mutex);
                if (read_into) ++direct;
                done += copied;
                if (progress) progress(done, total);
                return OkStatus();
              });
    }
    status = run.Wait();
    peak_staging = run.peak_staging_bytes();
  }
  TS_RETURN_IF_ERROR(status);
  if (stats != nullptr) {
    stats->bytes_read += kv_.bytes() - bytes0;
    stats->requests += kv_.requests() - requests0;
    stats->direct_chunks += direct;
    stats->staged_chunks += needed.size() - direct;
    stats->peak_staging_bytes = std::max(stats->peak_staging_bytes, peak_staging);
  }
  return OkStatus();
}

Result<std::vector<BadChunk>> DcpReader::Verify(
    const std::function<void(uint64_t, uint64_t)>& progress) {
  std::vector<std::pair<std::pair<size_t, size_t>, BadChunk>> found;  // (tensor, chunk), what
  std::mutex mutex;
  const uint64_t total = VerifyTotalBytes();
  uint64_t done = 0;
  {
    Executor run(pool_.get(), options_.max_inflight_bytes, /*max_pending=*/256);
    for (size_t id = 0; id < meta_.tensors.size(); ++id) {
      const DcpTensor& t = meta_.tensors[id];
      for (size_t c = 0; c < t.chunks.size(); ++c) {
        run.Run(t.chunks[c].location.length, [&, id, c](char* archive) -> Status {
          const DcpChunk& chunk = meta_.tensors[id].chunks[c];
          Result<uint64_t> read = ReadChunk(id, c, /*check_crc=*/true, archive);
          std::lock_guard<std::mutex> lock(mutex);
          if (!read.ok()) {
            std::string coords = "[";
            for (size_t d = 0; d < chunk.offsets.size(); ++d) {
              coords += StrCat(d ? ", " : "", chunk.offsets[d]);
            }
            found.push_back({{id, c},
                             BadChunk{metadata_[id].path, coords + "]",
                                      StrCat(path_, "/", chunk.location.relative_path),
                                      std::string(read.status().message())}});
          }
          done += chunk.location.length;
          if (progress) progress(done, total);
          return OkStatus();
        });
      }
    }
    TS_RETURN_IF_ERROR(run.Wait());
  }
  // In the metadata's order, whatever order the tasks ended in.
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<BadChunk> bad;
  for (auto& [where, chunk] : found) bad.push_back(std::move(chunk));
  return bad;
}

}  // namespace tensorstash
