#include "tensorstash/checkpoint/safetensors_export.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>

#include "nlohmann/json.hpp"
#include "tensorstash/format/safetensors/safetensors_header.h"
#include "tensorstash/util/byte_limiter.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/staging_buffer.h"
#include "tensorstash/util/str_util.h"
#include "tensorstash/util/thread_pool.h"

namespace tensorstash {
namespace {

void CollectNames(const TreeNode& node, const std::string& name, const std::string& path,
                  std::vector<std::tuple<std::string, std::string, size_t>>* out,
                  std::vector<std::string>* skipped) {
  auto join = [](const std::string& a, const std::string& b, char sep) {
    return a.empty() ? b : StrCat(a, std::string(1, sep), b);
  };
  switch (node.kind) {
    case TreeNode::Kind::kDict:
      for (const auto& [key, child] : node.entries) {
        CollectNames(child, join(name, key, '.'), join(path, EscapePathKey(key), '/'), out,
                     skipped);
      }
      return;
    case TreeNode::Kind::kList:
    case TreeNode::Kind::kTuple:
      for (size_t i = 0; i < node.items.size(); ++i) {
        CollectNames(node.items[i], join(name, std::to_string(i), '.'),
                     join(path, std::to_string(i), '/'), out, skipped);
      }
      return;
    case TreeNode::Kind::kArray:
      out->emplace_back(name, path, static_cast<size_t>(node.array_id));
      return;
    case TreeNode::Kind::kNone:
      return;
    default:
      if (skipped != nullptr) skipped->push_back(path);
      return;
  }
}

struct OutFile {
  std::string name;  // model-0000k-of-0000n.safetensors
  std::vector<SafetensorsTensor> tensors;
  std::vector<size_t> ids;  // array id of each tensor
  uint64_t data_bytes = 0;
};

std::string ShardName(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", k, n);
  return buf;
}

}  // namespace

Result<std::vector<std::pair<std::string, size_t>>> SafetensorsNames(
    const TreeNode& tree, std::vector<std::string>* skipped) {
  std::vector<std::tuple<std::string, std::string, size_t>> all;
  CollectNames(tree, "", "", &all, skipped);
  std::map<std::string_view, std::string_view> seen;  // name -> tree path
  std::vector<std::pair<std::string, size_t>> out;
  for (const auto& [name, path, id] : all) {
    auto [it, added] = seen.emplace(name, path);
    if (!added) {
      return InvalidArgumentError(StrCat("arrays '", it->second, "' and '", path,
                                         "' both become safetensors name '", name,
                                         "' (tree keys joined with '.'); rename one"));
    }
    if (name.empty()) {
      return InvalidArgumentError(
          "the tree is a single array without a key; safetensors needs a name per tensor");
    }
    out.emplace_back(name, id);
  }
  return out;
}

Result<SafetensorsExportResult> ExportSafetensors(
    StepSource* source, KvStore* kv, const std::string& dst,
    const SafetensorsExportOptions& options,
    const std::function<void(uint64_t, uint64_t)>& progress) {
  TS_RETURN_IF_ERROR(ValidateKey(dst));
  SafetensorsExportResult result;
  TS_ASSIGN_OR_RETURN(auto names, SafetensorsNames(source->tree(), &result.skipped));
  const std::vector<ArrayMetadata>& arrays = source->arrays();

  // Plan the files (everything checked before anything is written).
  std::vector<OutFile> files;
  for (const auto& [name, id] : names) {
    if (id >= arrays.size()) return InternalError(StrCat("array id ", id, " out of range"));
    const ArrayMetadata& a = arrays[id];
    TS_RETURN_IF_ERROR(SafetensorsDTypeName(a.dtype, StrCat("tensor '", name, "'")).status());
    TS_ASSIGN_OR_RETURN(int64_t count, CheckedNumElements(a.shape(), name));
    const uint64_t bytes = static_cast<uint64_t>(count) * ItemSize(a.dtype);
    if (files.empty() ||
        (!files.back().tensors.empty() &&
         files.back().data_bytes + bytes > options.max_shard_bytes)) {
      files.emplace_back();
    }
    SafetensorsTensor t;
    t.name = name;
    t.dtype = a.dtype;
    t.shape = a.shape();
    files.back().tensors.push_back(std::move(t));
    files.back().ids.push_back(id);
    files.back().data_bytes += bytes;
    result.total_bytes += bytes;
  }
  if (files.empty()) files.emplace_back();  // an empty tree still makes a loadable folder
  std::vector<std::string> headers;
  for (size_t k = 0; k < files.size(); ++k) {
    files[k].name = ShardName(k + 1, files.size());
    TS_ASSIGN_OR_RETURN(std::string header,
                        EncodeSafetensorsHeader(files[k].tensors, {{"format", "pt"}}));
    headers.push_back(std::move(header));
  }

  // Where to write: a temporary sibling folder renamed into place, or `dst` itself.
  TS_ASSIGN_OR_RETURN(std::vector<std::string> existing, kv->List(StrCat(dst, "/")));
  if (!existing.empty()) {
    return AlreadyExistsError(StrCat("export destination '", dst, "' is not empty (",
                                     existing.size(), " files, e.g. '", existing[0], "')"));
  }
  const bool rename = kv->SupportsRename();
  const std::string dir = rename ? StrCat(dst, ".tmp-export-", RandomHexId(8)) : dst;
  auto cleanup = [&] {
    if (rename) (void)kv->DeletePrefix(StrCat(dir, "/"));
  };

  const int threads = options.io_threads > 0 ? options.io_threads : DefaultIoThreads();
  constexpr uint64_t kPage = 4096;
  ThreadPool pool(threads);
  ByteLimiter limiter(options.max_inflight_bytes);
  std::mutex mutex;
  uint64_t done = 0;
  Status status;
  for (size_t k = 0; k < files.size() && status.ok(); ++k) {
    const OutFile& f = files[k];
    const std::string key = StrCat(dir, "/", f.name);
    Result<std::unique_ptr<WritableFile>> opened = kv->OpenForWrite(key);
    if (!opened.ok()) {
      status = opened.status();
      break;
    }
    std::unique_ptr<WritableFile> file = std::move(*opened);
    file->PreferDirectWrites();
    status = file->WriteAt(0, headers[k].data(), headers[k].size());
    TaskGroup group(&pool, 4 * threads);
    for (size_t i = 0; i < f.tensors.size() && status.ok(); ++i) {
      const SafetensorsTensor& t = f.tensors[i];
      const ArrayMetadata& a = arrays[f.ids[i]];
      // Pieces are row-major slabs of at most piece_bytes: whole rows of the first dimension
      // when a row fits, else slabs of a deeper dimension (a [2, 3e9] tensor must not need a
      // 12 GB buffer). inner[d] is the bytes of one step along dimension d - 1, i.e. of the
      // block of dimensions d.. .
      const uint64_t total = t.end - t.begin;
      const size_t rank = t.shape.size();
      uint64_t count = 1;
      for (int64_t extent : t.shape) count *= static_cast<uint64_t>(extent);
      if (total == 0 || count == 0) continue;
      std::vector<uint64_t> inner(rank + 1, total / count);
      for (size_t d = rank; d-- > 0;) inner[d] = inner[d + 1] * static_cast<uint64_t>(t.shape[d]);
      size_t split = 0;  // the dimension pieces cut; dimensions before it have extent 1
      while (split + 1 < rank && inner[split + 1] > options.piece_bytes) ++split;
      const uint64_t step_bytes = rank == 0 ? total : inner[split + 1];
      const int64_t extent = rank == 0 ? 1 : t.shape[split];
      const int64_t per_piece = std::max<int64_t>(
          1, static_cast<int64_t>(std::min<uint64_t>(options.piece_bytes / step_bytes, extent)));
      uint64_t outer_count = 1;
      for (size_t d = 0; d < split && d < rank; ++d) outer_count *= static_cast<uint64_t>(t.shape[d]);
      for (uint64_t outer = 0; outer < outer_count && status.ok(); ++outer)
      for (int64_t r0 = 0; r0 < extent; r0 += per_piece) {
        const int64_t n = std::min(per_piece, extent - r0);
        const uint64_t bytes = static_cast<uint64_t>(n) * step_bytes;
        const uint64_t offset = t.begin + outer * (rank == 0 ? total : inner[split]) +
                                static_cast<uint64_t>(r0) * step_bytes;
        Box box = Box::FromShape(t.shape);
        if (rank > 0) {
          uint64_t rest = outer;  // the index of each dimension before `split`, row-major
          for (size_t d = split; d-- > 0;) {
            box.origin[d] = static_cast<int64_t>(rest % static_cast<uint64_t>(t.shape[d]));
            box.shape[d] = 1;
            rest /= static_cast<uint64_t>(t.shape[d]);
          }
          box.origin[split] = r0;
          box.shape[split] = n;
        }
        // Taken in the task, not here: a task the group skips after an error must not keep
        // bytes that the next piece would wait for.
        const uint64_t held = std::min(bytes, limiter.cap());
        group.Run([&, box = std::move(box), bytes, offset, held, path = a.path,
                   dtype = a.dtype]() -> Status {
          limiter.Acquire(held);
          // The piece lies in memory at the same offset within a 4 KiB page as in the file, so
          // that the file store's direct (O_DIRECT) writes take its whole blocks from where
          // they are: a safetensors header of any length leaves the tensors unaligned in the
          // file, and an aligned buffer then went through a bounce copy (memmove was a fifth
          // of an export's CPU time). A StagingBuffer, not new[]: the freed pieces are kept
          // and refilled (memory the process has costs a quarter of fresh memory to fill, and
          // fresh pages were a fifth of the export's samples), fresh ones are huge pages.
          StagingBuffer buffer;
          try {
            buffer = StagingBuffer(bytes + kPage);
          } catch (const std::bad_alloc&) {
            limiter.Release(held);
            return ResourceExhaustedError(StrCat("safetensors export: no memory for a piece of ",
                                                 bytes, " bytes of '", path, "'"));
          }
          const uint64_t at = reinterpret_cast<uintptr_t>(buffer.data()) % kPage;
          char* data = buffer.data() + (offset % kPage + kPage - at) % kPage;
          ReadRequest req{path, box, dtype, data};
          Status s = source->ReadMany({req}, nullptr, nullptr);
          if (s.ok()) s = file->WriteAt(offset, data, bytes);
          buffer = StagingBuffer();
          limiter.Release(held);
          if (s.ok() && progress) {
            std::lock_guard<std::mutex> lock(mutex);
            done += bytes;
            progress(done, result.total_bytes);
          }
          return s;
        });
      }
    }
    Status waited = group.Wait();
    if (status.ok()) status = waited;
    if (status.ok()) status = file->Sync();
    Status closed = file->Close();
    if (status.ok()) status = closed;
    if (status.ok()) status = kv->Sync(key);
    result.files.push_back(f.name);
  }
  if (!status.ok()) {
    cleanup();
    return status;
  }

  // The index, last: only a folder whose every file is complete and durable gets one.
  nlohmann::ordered_json index;
  index["metadata"]["total_size"] = result.total_bytes;
  nlohmann::ordered_json& map = index["weight_map"];
  map = nlohmann::ordered_json::object();
  for (const OutFile& f : files) {
    for (const SafetensorsTensor& t : f.tensors) map[t.name] = f.name;
    result.tensors += f.tensors.size();
  }
  const std::string index_key = StrCat(dir, "/", kSafetensorsIndexFileName);
  status = kv->Write(index_key, index.dump(2) + "\n");
  if (status.ok()) status = kv->Sync(index_key);
  if (status.ok()) status = kv->SyncDirectory(dir);
  if (status.ok() && rename) {
    (void)kv->DeletePrefix(StrCat(dst, "/"));  // an empty destination folder the user made
    status = kv->RenameDirectory(dir, dst);
  }
  if (!status.ok()) {
    cleanup();
    return status;
  }
  return result;
}

}  // namespace tensorstash
