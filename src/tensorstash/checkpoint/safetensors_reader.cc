#include "tensorstash/checkpoint/safetensors_reader.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <map>
#include <set>

#include "nlohmann/json.hpp"
#include "tensorstash/array/convert.h"
#include "tensorstash/format/safetensors/safetensors_header.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

// A run of a box's elements that lies contiguous in the file, and where it goes in the
// destination (element offsets).
struct Piece {
  uint64_t file_offset;
  uint64_t elements;
  uint64_t dest_element;
};

// Neighbouring pieces read in one request.
struct ReadGroup {
  uint64_t begin = 0;  // file offsets of the request
  uint64_t end = 0;
  std::vector<Piece> pieces;
};

// A group holds at most this many pieces, so that a box of millions of one-element rows does not
// build one list of them all.
constexpr size_t kMaxPiecesPerGroup = 1 << 16;

}  // namespace

SafetensorsReader::SafetensorsReader(KvStore* kv, std::string path, ReaderOptions options)
    : kv_(kv), path_(std::move(path)), options_(options) {}

Status SafetensorsReader::AddFile(const std::string& key,
                                  const std::vector<std::string>* expected_names) {
  TS_ASSIGN_OR_RETURN(uint64_t size, kv_.Size(key));
  char prefix[8] = {};
  if (size >= 8) TS_RETURN_IF_ERROR(kv_.ReadRange(key, 0, 8, prefix));
  TS_ASSIGN_OR_RETURN(uint64_t n,
                      ParseSafetensorsHeaderLength(std::string_view(prefix, 8), size, key));
  std::string json(n, '\0');
  TS_RETURN_IF_ERROR(kv_.ReadRange(key, 8, n, json.data()));
  TS_ASSIGN_OR_RETURN(SafetensorsHeader header, ParseSafetensorsHeader(json, size, key));
  if (expected_names != nullptr) {
    std::set<std::string_view> have;
    for (const SafetensorsTensor& t : header.tensors) have.insert(t.name);
    for (const std::string& name : *expected_names) {
      if (have.count(name) == 0) {
        return DataLossError(StrCat("safetensors folder '", path_, "': ",
                                    kSafetensorsIndexFileName, " puts tensor '", name, "' in '",
                                    key, "', which does not hold it"));
      }
    }
    if (expected_names->size() != header.tensors.size()) {
      std::set<std::string_view> listed(expected_names->begin(), expected_names->end());
      for (const SafetensorsTensor& t : header.tensors) {
        if (listed.count(t.name) == 0) {
          return DataLossError(StrCat("safetensors folder '", path_, "': tensor '", t.name,
                                      "' of '", key, "' is not in ", kSafetensorsIndexFileName,
                                      " (or is listed in another file)"));
        }
      }
    }
  }
  const size_t file = files_.size();
  files_.push_back(key);
  for (SafetensorsTensor& t : header.tensors) {
    ArrayMetadata a;
    a.path = EscapePathKey(t.name);
    a.dtype = t.dtype;
    a.grid.shape = t.shape;
    a.grid.cell_shape = t.shape;
    for (int64_t& e : a.grid.cell_shape) e = std::max<int64_t>(e, 1);
    a.grid.chunk_shape = a.grid.cell_shape;
    a.codec = Codec::kNone;
    tree_.entries.emplace_back(t.name, TreeNode::Array(static_cast<int64_t>(metadata_.size())));
    metadata_.push_back(std::move(a));
    tensors_.push_back(Tensor{file, t.begin, t.end});
  }
  return OkStatus();
}

Result<std::unique_ptr<SafetensorsReader>> SafetensorsReader::Open(KvStore* kv, std::string path,
                                                                   ReaderOptions options) {
  TS_RETURN_IF_ERROR(ValidateKey(path));
  if (options.io_threads <= 0) options.io_threads = DefaultIoThreads();
  std::unique_ptr<SafetensorsReader> r(new SafetensorsReader(kv, path, options));
  const std::string index_key = StrCat(path, "/", kSafetensorsIndexFileName);
  if (path.size() > 12 && path.compare(path.size() - 12, 12, ".safetensors") == 0 && kv->Size(path).ok()) {
    TS_RETURN_IF_ERROR(r->AddFile(path, nullptr));
  } else if (Result<std::string> index = kv->Read(index_key); index.ok()) {
    if (index->size() > kSafetensorsMaxHeaderBytes) {
      return DataLossError(StrCat("'", index_key, "' is ", index->size(),
                                  " bytes, over the limit of ", kSafetensorsMaxHeaderBytes));
    }
    const nlohmann::json doc = nlohmann::json::parse(*index, nullptr, /*allow_exceptions=*/false);
    if (doc.is_discarded() || !doc.is_object() || !doc.contains("weight_map") ||
        !doc["weight_map"].is_object()) {
      return DataLossError(
          StrCat("'", index_key, "' is not JSON with a \"weight_map\" object of tensor names"));
    }
    // The files in the order of their first tensor in the map, each with its tensors.
    std::vector<std::string> order;
    std::map<std::string, std::vector<std::string>> names;
    for (const auto& [name, file] : doc["weight_map"].items()) {
      if (!file.is_string()) {
        return DataLossError(StrCat("'", index_key, "': the file of tensor '", name,
                                    "' is not a string"));
      }
      const std::string f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f.find('\\') != std::string::npos ||
          f == "." || f == ".." || !ValidateKey(StrCat(path, "/", f)).ok()) {
        return DataLossError(StrCat("'", index_key, "': tensor '", name, "' names file '",
                                    EscapeBytes(f), "', which is not a file of the folder"));
      }
      auto [it, added] = names.try_emplace(f);
      if (added) order.push_back(f);
      it->second.push_back(name);
    }
    for (const std::string& f : order) {
      TS_RETURN_IF_ERROR(r->AddFile(StrCat(path, "/", f), &names[f]));
    }
  } else if (index.status().code() != absl::StatusCode::kNotFound) {
    return index.status();
  } else if (kv->Size(StrCat(path, "/", kSafetensorsSingleFileName)).ok()) {
    TS_RETURN_IF_ERROR(r->AddFile(StrCat(path, "/", kSafetensorsSingleFileName), nullptr));
  } else {
    return NotFoundError(StrCat("'", path, "' is neither a .safetensors file nor a folder with ",
                                kSafetensorsIndexFileName, " or ", kSafetensorsSingleFileName));
  }
  // One name in two files of a folder.
  std::set<std::string_view> seen;
  for (const auto& [name, node] : r->tree_.entries) {
    if (!seen.insert(name).second) {
      return DataLossError(StrCat("safetensors folder '", path, "': tensor '", name,
                                  "' is in two files"));
    }
  }
  for (size_t i = 0; i < r->metadata_.size(); ++i) r->by_path_.emplace(r->metadata_[i].path, i);
  r->pool_ = std::make_unique<ThreadPool>(r->options_.io_threads);
  return r;
}

Result<std::string> SafetensorsReader::ReadFile(std::string_view name) const {
  return NotFoundError(StrCat("'", path_, "' is safetensors, which has no file '", name, "'"));
}

uint64_t SafetensorsReader::VerifyTotalBytes() const {
  uint64_t total = 0;
  for (const Tensor& t : tensors_) total += t.end - t.begin;
  return total;
}

Status SafetensorsReader::ReadRegion(size_t id, const Box& region, DType dtype, char* dest,
                                     TaskGroup* group,
                                     const std::function<void(uint64_t)>& done) {
  const ArrayMetadata& a = metadata_[id];
  const Tensor& t = tensors_[id];
  const std::string& key = files_[t.file];
  const size_t item = ItemSize(a.dtype);
  const size_t dest_item = ItemSize(dtype);
  const int rank = region.rank();
  const std::vector<int64_t>& shape = a.shape();
  // Dimensions k+1.. are whole in the region, so a run of it is region[k] * those extents.
  int k = rank - 1;
  while (k > 0 && region.origin[k] == 0 && region.shape[k] == shape[k]) --k;
  std::vector<uint64_t> stride(rank, 1);
  for (int d = rank - 2; d >= 0; --d) stride[d] = stride[d + 1] * static_cast<uint64_t>(shape[d + 1]);
  const uint64_t run = rank == 0 ? 1 : static_cast<uint64_t>(region.shape[k]) * stride[k];
  const uint64_t max_piece =
      std::max<uint64_t>(1, options_.max_request_bytes / item);  // elements

  ReadGroup current;
  auto flush = [&] {
    if (current.pieces.empty()) return;
    ReadGroup g = std::move(current);
    current = ReadGroup{};
    group->Run([this, g = std::move(g), &key, dest, dtype, item, dest_item, &a,
                done]() -> Status {
      const uint64_t span = g.end - g.begin;
      if (g.pieces.size() == 1 && dtype == a.dtype) {
        TS_RETURN_IF_ERROR(kv_.ReadRange(key, g.begin, span,
                                         dest + g.pieces[0].dest_element * dest_item));
        done(span);
        return OkStatus();
      }
      std::unique_ptr<char[]> staging(new char[span]);
      TS_RETURN_IF_ERROR(kv_.ReadRange(key, g.begin, span, staging.get()));
      for (const Piece& p : g.pieces) {
        const char* src = staging.get() + (p.file_offset - g.begin);
        char* out = dest + p.dest_element * dest_item;
        if (dtype == a.dtype) {
          std::memcpy(out, src, p.elements * item);
        } else {
          TS_RETURN_IF_ERROR(ConvertElements(a.dtype, src, dtype, out, p.elements, a.path));
        }
      }
      done(span);
      return OkStatus();
    });
  };
  auto add = [&](uint64_t file_offset, uint64_t elements, uint64_t dest_element) {
    const uint64_t bytes = elements * item;
    if (!current.pieces.empty()) {
      const bool near = file_offset >= current.end &&
                        file_offset - current.end <= options_.coalesce_gap_bytes &&
                        file_offset + bytes - current.begin <= options_.max_request_bytes &&
                        current.pieces.size() < kMaxPiecesPerGroup;
      if (!near) flush();
    }
    if (current.pieces.empty()) current.begin = file_offset;
    current.end = file_offset + bytes;
    current.pieces.push_back(Piece{file_offset, elements, dest_element});
  };

  std::vector<int64_t> index(std::max(k, 0), 0);  // position in the outer dimensions
  uint64_t dest_element = 0;
  const int64_t outer = [&] {
    int64_t n = 1;
    for (int d = 0; d < k; ++d) n *= region.shape[d];
    return n;
  }();
  for (int64_t o = 0; o < outer; ++o) {
    uint64_t element = 0;
    for (int d = 0; d < k; ++d) element += static_cast<uint64_t>(region.origin[d] + index[d]) * stride[d];
    if (rank > 0) element += static_cast<uint64_t>(region.origin[k]) * stride[k];
    for (uint64_t off = 0; off < run; off += max_piece) {
      const uint64_t n = std::min(max_piece, run - off);
      add(t.begin + (element + off) * item, n, dest_element + off);
    }
    dest_element += run;
    for (int d = k - 1; d >= 0; --d) {
      if (++index[d] < region.shape[d]) break;
      index[d] = 0;
    }
  }
  flush();
  return OkStatus();
}

Status SafetensorsReader::ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats,
                                   const std::function<void(uint64_t, uint64_t)>& progress) {
  const auto& by_path = by_path_;
  uint64_t total = 0;
  std::vector<size_t> ids;
  for (const ReadRequest& req : requests) {
    auto it = by_path.find(req.path);
    if (it == by_path.end()) {
      return NotFoundError(StrCat("'", path_, "' has no tensor '", req.path, "'"));
    }
    TS_RETURN_IF_ERROR(ValidateReadRequest(req, metadata_[it->second], req.dtype));
    ids.push_back(it->second);
    total += static_cast<uint64_t>(
                 Intersect(req.box, Box::FromShape(metadata_[it->second].shape())).num_elements()) *
             ItemSize(metadata_[it->second].dtype);
  }
  const uint64_t bytes0 = kv_.bytes(), requests0 = kv_.requests();
  std::mutex mutex;
  uint64_t done_bytes = 0;
  auto done = [&](uint64_t n) {
    if (!progress) return;
    std::lock_guard<std::mutex> lock(mutex);
    done_bytes += n;
    progress(std::min(done_bytes, total), total);
  };
  // Boxes reaching past the stored shape: the stored part is read into a buffer over it, then
  // copied into the zeroed destination.
  struct Partial {
    size_t request;
    Box region;
    std::unique_ptr<char[]> buffer;
  };
  std::vector<Partial> partials;
  TaskGroup group(pool_.get());
  for (size_t i = 0; i < requests.size(); ++i) {
    const ReadRequest& req = requests[i];
    const ArrayMetadata& a = metadata_[ids[i]];
    const Box region = Intersect(req.box, Box::FromShape(a.shape()));
    if (region != req.box) {
      std::memset(req.dest, 0, static_cast<size_t>(req.box.num_elements()) * ItemSize(req.dtype));
      if (region.empty()) continue;
      Partial p{i, region,
                std::unique_ptr<char[]>(
                    new char[static_cast<size_t>(region.num_elements()) * ItemSize(a.dtype)])};
      TS_RETURN_IF_ERROR(ReadRegion(ids[i], region, a.dtype, p.buffer.get(), &group, done));
      partials.push_back(std::move(p));
    } else if (!region.empty()) {
      TS_RETURN_IF_ERROR(ReadRegion(ids[i], region, req.dtype, static_cast<char*>(req.dest),
                                    &group, done));
    }
  }
  Status status = group.Wait();
  if (!status.ok()) {
    return Status(status.code(), StrCat("reading safetensors '", path_, "': ", status.message()));
  }
  for (const Partial& p : partials) {
    const ReadRequest& req = requests[p.request];
    const ArrayMetadata& a = metadata_[ids[p.request]];
    TS_RETURN_IF_ERROR(CopyBox(p.region, a.dtype, p.buffer.get(), p.region, req.dtype, req.dest,
                               req.box, a.path));
  }
  if (stats != nullptr) {
    stats->bytes_read += kv_.bytes() - bytes0;
    stats->requests += kv_.requests() - requests0;
    stats->direct_chunks += requests.size();
  }
  return OkStatus();
}

Result<std::vector<BadChunk>> SafetensorsReader::Verify(
    const std::function<void(uint64_t, uint64_t)>& progress) {
  // No checksums to check: every tensor's bytes are read, so that a file shorter than its
  // header says or an unreadable range shows up.
  std::vector<BadChunk> bad;
  std::mutex mutex;
  const uint64_t total = VerifyTotalBytes();
  uint64_t done = 0;
  TaskGroup group(pool_.get(), 2 * pool_->num_threads());
  for (size_t id = 0; id < tensors_.size(); ++id) {
    group.Run([&, id]() -> Status {
      const Tensor& t = tensors_[id];
      const uint64_t piece = std::max<uint64_t>(1, options_.max_request_bytes);
      std::unique_ptr<char[]> buffer(new char[std::min(piece, std::max<uint64_t>(1, t.end - t.begin))]);
      for (uint64_t off = t.begin; off < t.end; off += piece) {
        const uint64_t n = std::min(piece, t.end - off);
        Status s = kv_.ReadRange(files_[t.file], off, n, buffer.get());
        std::lock_guard<std::mutex> lock(mutex);
        if (!s.ok()) {
          bad.push_back(BadChunk{metadata_[id].path, "[whole tensor]", files_[t.file],
                                 std::string(s.message())});
          return OkStatus();
        }
        done += n;
        if (progress) progress(done, total);
      }
      return OkStatus();
    });
  }
  TS_RETURN_IF_ERROR(group.Wait());
  std::sort(bad.begin(), bad.end(),
            [](const BadChunk& a, const BadChunk& b) { return a.array_path < b.array_path; });
  return bad;
}

}  // namespace tensorstash
