// tensorstash._ext.Reader: a StepSource (a native step, an Orbax checkpoint, a zarr group;
// the format is detected) on a store opened by URL (kvstore/registry.h).
//
// Opening, reading and verifying release the GIL: they wait on storage, and other Python threads
// (a training step, another reader) can run meanwhile. A read_many progress callable is called
// from the reader's threads with the GIL taken back, at most about ten times a second plus once
// at the end.
//
// close() closes and unmaps the step's files at once, rather than whenever the garbage collector
// gets to the Reader: an open file keeps a deleted step's disk space. Arrays that map_many
// returned own their mappings and stay valid. A call running in another thread (without the
// GIL) keeps the files open until it returns.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "bindings.h"
#include "buffers.h"
#include "coordinator.h"
#include "errors.h"
#include "save_args.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/engine/host_restore.h"
#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/tiers/tiered_source.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/kvstore/http/http_kvstore.h"
#include "tensorstash/kvstore/registry.h"
#include "tensorstash/share/peer/shared_source.h"

namespace nb = nanobind;

namespace tensorstash::python {
namespace {

// (path, origin, shape, dtype name, out); out is checked by CastWritableBytes.
using RequestTuple =
    std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>, std::string, nb::object>;

// Forwards the reader's progress(done, total) to a Python callable, throttled: the reader calls
// it once per finished request, which can be thousands of times a second. Calls arrive one at a
// time (CheckpointReader::ReadMany), from threads that do not hold the GIL.
class ThrottledProgress {
 public:
  static constexpr std::chrono::milliseconds kInterval{100};

  explicit ThrottledProgress(nb::handle callable) : callable_(callable) {}

  // The reader's progress callback for the Python `progress` (None: no callback), calling it
  // through `*forward`, which this sets up. TypeError unless `progress` is callable or None.
  static std::function<void(uint64_t, uint64_t)> Forward(
      nb::handle progress, std::optional<ThrottledProgress>* forward) {
    if (progress.is_none()) return nullptr;
    if (!PyCallable_Check(progress.ptr())) {
      throw nb::type_error("progress must be callable or None");
    }
    forward->emplace(progress);
    return [forward](uint64_t done, uint64_t total) { (**forward)(done, total); };
  }

  void operator()(uint64_t done, uint64_t total) {
    const bool final = done >= total;
    const auto now = std::chrono::steady_clock::now();
    if (error_.has_value() || (!final && now - last_call_ < kInterval)) return;
    last_call_ = now;
    total_ = total;
    final_reported_ = final;
    nb::gil_scoped_acquire gil;
    try {
      callable_(done, total);
    } catch (nb::python_error& error) {
      error_.emplace(std::move(error));  // raised by Finish; no further calls
    }
  }

  // After a successful read, with the GIL held: the final call when the reader made none (an
  // empty read), then the callable's exception, if it raised one.
  void Finish() {
    if (!error_.has_value() && !final_reported_) {
      final_reported_ = true;
      callable_(total_, total_);
    }
    if (error_.has_value()) {
      nb::python_error error = std::move(*error_);
      error_.reset();
      throw error;
    }
  }

 private:
  nb::handle callable_;
  std::chrono::steady_clock::time_point last_call_{};
  uint64_t total_ = 0;
  bool final_reported_ = false;
  std::optional<nb::python_error> error_;  // written with the GIL held
};

// (path, origin, shape, dtype name) of a box to map.
using MapRequestTuple =
    std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>, std::string>;

// Drops a Python coordinator with the GIL held (a Reader's step may be dropped without it).
struct DropWithGil {
  void operator()(PyCoordinator* coordinator) const {
    nb::gil_scoped_acquire gil;
    delete coordinator;
  }
};

// What an open Reader reads from; closing the Reader drops it.
struct OpenStep {
  std::unique_ptr<KvStore> kv;  // declared first: `source` uses it, and is destroyed first
  // A shared reader's coordinator (SharedStepSource::Share uses it), destroyed after `source`.
  std::unique_ptr<PyCoordinator, DropWithGil> coordinator;
  std::shared_ptr<StepSource> source;
  // Where restore_to_host keeps every box it hands over (a multi-tier restore's write-back
  // saves them: MultiTierManager::FinishRestore); null: nothing is kept.
  std::shared_ptr<KeptBoxes> keep;
};

// A tree node as the Python objects json.loads makes of its JSON (the "tree" schema of
// docs/format.md), built directly: for a step of thousands of arrays, encoding the node as
// JSON text and parsing that again in Python took longer than opening the step. Recurses as
// deep as the tree (at most kMaxTreeDepth levels, which DecodeTreeJson checked).
nb::object TreeNodeToPython(const TreeNode& node) {
  using Kind = TreeNode::Kind;
  nb::dict out;
  const std::string_view kind =
      node.keys.empty() ? TreeNodeKindName(node.kind) : std::string_view("typed_dict");
  out["kind"] = nb::str(kind.data(), kind.size());
  switch (node.kind) {
    case Kind::kNone:
      break;
    case Kind::kDict: {
      nb::list entries;
      for (const auto& [key, child] : node.entries) {
        nb::list entry;
        entry.append(nb::str(key.data(), key.size()));
        entry.append(TreeNodeToPython(child));
        entries.append(std::move(entry));
      }
      out["entries"] = std::move(entries);
      if (!node.keys.empty()) {
        nb::list keys;
        for (const TreeNode& key : node.keys) keys.append(TreeNodeToPython(key));
        out["keys"] = std::move(keys);
      }
      break;
    }
    case Kind::kList:
    case Kind::kTuple: {
      nb::list items;
      for (const TreeNode& child : node.items) items.append(TreeNodeToPython(child));
      out["items"] = std::move(items);
      break;
    }
    case Kind::kArray:
      out["array"] = node.array_id;
      // The recorded sharding as its JSON text (docs/format.md 4.2), for the front to parse.
      if (!node.sharding.empty()) out["sharding"] = node.sharding;
      break;
    case Kind::kInt:
      out["value"] = node.int_value;
      break;
    case Kind::kFloat:
      out["value"] = TreeFloatText(node.float_value);
      break;
    case Kind::kBool:
      out["value"] = node.bool_value;
      break;
    case Kind::kString:
      out["value"] = nb::str(node.string_value.data(), node.string_value.size());
      break;
    case Kind::kBytes:
      out["base64"] = absl::Base64Escape(node.string_value);
      break;
  }
  return out;
}

class Reader {
 public:
  explicit Reader(std::shared_ptr<OpenStep> step) : step_(std::move(step)) {}

  // Each call holds the step for its whole duration, so that a close() from another thread
  // while the call runs without the GIL does not destroy what it uses.
  std::shared_ptr<OpenStep> Step() const {
    if (step_ == nullptr) ThrowIfError(FailedPreconditionError("the reader is closed"));
    return step_;
  }

  bool closed() const { return step_ == nullptr; }

  // Closes the files (unless a call in another thread still uses them: then when it ends).
  void Close() {
    std::shared_ptr<OpenStep> step = std::move(step_);
    nb::gil_scoped_release release;  // closing may wait for the reader's IO threads
    step.reset();
  }

  std::string TreeJson() const { return ValueOrThrow(TreeNodeToJson(Step()->source->tree())); }
  nb::object Tree() const { return TreeNodeToPython(Step()->source->tree()); }

  nb::list Arrays() const {
    const std::shared_ptr<OpenStep> step = Step();
    const StepSource* reader = step->source.get();
    // The keys and dtype names are made once, not once per array: a step may have 100,000.
    const nb::str path("path"), dtype("dtype"), shape("shape"), chunk_shape("chunk_shape"),
        cell_shape("cell_shape"), codec("codec"), stored_bytes("stored_bytes"),
        num_chunks("num_chunks");
    std::map<DType, nb::str> dtype_names;
    nb::list result;
    for (size_t i = 0; i < reader->arrays().size(); ++i) {
      const ArrayMetadata& a = reader->arrays()[i];
      auto name = dtype_names.find(a.dtype);
      if (name == dtype_names.end()) {
        const std::string_view text = DTypeName(a.dtype);
        name = dtype_names.emplace(a.dtype, nb::str(text.data(), text.size())).first;
      }
      nb::dict entry;
      entry[path] = nb::str(a.path.data(), a.path.size());
      entry[dtype] = name->second;
      entry[shape] = ShapeTuple(a.shape());
      entry[chunk_shape] = ShapeTuple(a.grid.chunk_shape);
      entry[cell_shape] = ShapeTuple(a.grid.cell_shape);
      entry[codec] = reader->CodecDescription(i);
      entry[stored_bytes] = reader->StoredBytes(i);
      entry[num_chunks] = reader->NumChunks(i);
      result.append(std::move(entry));
    }
    return result;
  }

  int64_t created_unix_ms() const { return Step()->source->created_unix_ms(); }
  int process_count() const { return Step()->source->process_count(); }
  std::string format() const { return std::string(StepFormatName(Step()->source->format())); }
  std::string dir() const { return Step()->source->dir(); }

  // The multi-tier source behind a reader opened by Reader.tiered, else null.
  TieredStepSource* Tiered() const { return dynamic_cast<TieredStepSource*>(Step()->source.get()); }

  nb::object TierStats() const {
    const TieredStepSource* tiered = Tiered();
    if (tiered == nullptr) return nb::none();
    const tensorstash::TierStats& stats = tiered->tier_stats();
    nb::dict bytes, seconds;
    for (int t = 0; t < kNumTiers; ++t) {
      const std::string name(TierName(static_cast<Tier>(t)));
      bytes[name.c_str()] = stats.bytes[t];
      seconds[name.c_str()] = stats.seconds[t];
    }
    nb::dict result;
    result["bytes"] = bytes;
    result["seconds"] = seconds;
    result["failures"] = stats.failures;
    result["local_failed"] = stats.local_failed;
    nb::list holders, open_errors;
    for (const auto& [tier, name] : tiered->holders()) {
      holders.append(nb::make_tuple(std::string(TierName(tier)), name));
    }
    for (const std::string& e : tiered->open_errors()) open_errors.append(e);
    result["holders"] = holders;
    result["open_errors"] = open_errors;
    return result;
  }

  // The source behind a reader opened with sharing (Reader.shared, Manager.open_step), else
  // null.
  SharedStepSource* Shared() const { return dynamic_cast<SharedStepSource*>(Step()->source.get()); }

  void Share(const std::vector<MapRequestTuple>& requests) {
    const std::shared_ptr<OpenStep> step = Step();
    SharedStepSource* shared = Shared();
    if (shared == nullptr) return;
    std::vector<ReadRequest> reads;
    reads.reserve(requests.size());
    for (const auto& [path, origin, shape, dtype_name] : requests) {
      reads.push_back({path, Box(origin, shape), ValueOrThrow(ParseDType(dtype_name)), nullptr});
    }
    nb::gil_scoped_release release;  // the coordinator takes it back for each call
    ThrowIfError(shared->Share(reads));
  }

  nb::object FinishShare() {
    const std::shared_ptr<OpenStep> step = Step();
    SharedStepSource* shared = Shared();
    if (shared == nullptr) return nb::none();
    Status finished;
    {
      nb::gil_scoped_release release;
      finished = shared->Finish();
    }
    const ShareStats stats = shared->share_stats();
    nb::dict result;
    result["active"] = stats.active;
    result["storage_bytes"] = stats.storage_bytes;
    result["storage_seconds"] = stats.storage_seconds;
    result["peer_bytes"] = stats.peer_bytes;
    result["peer_seconds"] = stats.peer_seconds;
    result["served_chunks"] = stats.served_chunks;
    result["received_chunks"] = stats.received_chunks;
    result["fallback_chunks"] = stats.fallback_chunks;
    result["fallbacks"] = stats.fallbacks;
    result["finish_error"] = finished.ok() ? std::string() : std::string(finished.message());
    return result;
  }

  nb::dict HeldChunks(size_t holder) const {
    const TieredStepSource* tiered = Tiered();
    if (tiered == nullptr) ThrowIfError(FailedPreconditionError("not a multi-tier reader"));
    if (holder >= tiered->holders().size()) {
      ThrowIfError(InvalidArgumentError(StrCat("no holder ", holder)));
    }
    nb::dict result;
    const std::vector<std::vector<int64_t>>& held = tiered->held_chunks(holder);
    for (size_t i = 0; i < held.size(); ++i) {
      result[tiered->arrays()[i].path.c_str()] = held[i];
    }
    return result;
  }

  nb::dict ReadMany(const std::vector<RequestTuple>& requests, nb::object progress) {
    const std::shared_ptr<OpenStep> step = Step();
    std::vector<ReadRequest> reads;
    // References to the destinations, so that they outlive the read even if another thread
    // drops the caller's list while the GIL is released.
    std::vector<WritableBytes> outs;
    char empty_dest = 0;  // the reader wants a destination even for an empty box
    for (size_t i = 0; i < requests.size(); ++i) {
      const auto& [path, origin, shape, dtype_name, object] = requests[i];
      const std::string what = StrCat("read request ", i, " (array '", path, "')");
      const DType dtype = ValueOrThrow(ParseDType(dtype_name));
      WritableBytes out = CastWritableBytes(object, what);
      Box box(origin, shape);
      ThrowIfError(CheckBufferSize(box, dtype, out.nbytes(), what));
      void* dest = out.nbytes() > 0 ? static_cast<void*>(out.data()) : &empty_dest;
      reads.push_back({path, std::move(box), dtype, dest});
      outs.push_back(std::move(out));
    }
    ReadStats stats;
    Status status;
    std::optional<ThrottledProgress> forward;
    const std::function<void(uint64_t, uint64_t)> on_progress =
        ThrottledProgress::Forward(progress, &forward);
    {
      nb::gil_scoped_release release;
      status = step->source->ReadMany(reads, &stats, on_progress);
    }
    ThrowIfError(status);
    if (forward.has_value()) forward->Finish();
    nb::dict result;
    result["bytes_read"] = stats.bytes_read;
    result["requests"] = stats.requests;
    result["direct_chunks"] = stats.direct_chunks;
    result["staged_chunks"] = stats.staged_chunks;
    result["peak_staging_bytes"] = stats.peak_staging_bytes;
    return result;
  }

  // One entry per request: a NumPy uint8 array over the box's bytes mapped from the data files
  // (owning the mapping), or None where the box cannot be mapped (the caller reads it instead).
  nb::list MapMany(const std::vector<MapRequestTuple>& requests) {
    const std::shared_ptr<OpenStep> step = Step();
    std::vector<ReadRequest> maps;
    for (const auto& [path, origin, shape, dtype_name] : requests) {
      maps.push_back({path, Box(origin, shape), ValueOrThrow(ParseDType(dtype_name)), nullptr});
    }
    std::vector<Result<MappedBox>> mapped;
    {
      nb::gil_scoped_release release;
      mapped = step->source->MapMany(maps, {});
    }
    nb::list result;
    for (size_t i = 0; i < requests.size(); ++i) {
      if (i >= mapped.size() || absl::IsUnimplemented(mapped[i].status())) {
        result.append(nb::none());
        continue;
      }
      ThrowIfError(mapped[i].status());
      auto* owned = new MappedBox(*std::move(mapped[i]));
      nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<MappedBox*>(p); });
      const size_t size = owned->size();
      result.append(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(
                        reinterpret_cast<uint8_t*>(owned->data()), {size}, owner)
                        .cast());
    }
    return result;
  }

  // RestoreToHost (engine/host_restore.h): every box at once; on_batch(list of (request
  // index, uint8 array)) with the GIL held, once per batch; requests for the same box share one
  // array. An exception of on_batch or progress stops the restore and is raised.
  nb::dict RestoreToHost(const std::vector<MapRequestTuple>& requests, nb::object on_batch,
                         bool map, int64_t batch_bytes, nb::object progress) {
    const std::shared_ptr<OpenStep> step = Step();
    if (!PyCallable_Check(on_batch.ptr())) throw nb::type_error("on_batch must be callable");
    if (batch_bytes <= 0) {
      ThrowIfError(InvalidArgumentError(StrCat("batch_bytes must be > 0, not ", batch_bytes)));
    }
    std::vector<HostBoxRequest> boxes;
    boxes.reserve(requests.size());
    for (const auto& [path, origin, shape, dtype_name] : requests) {
      boxes.push_back({path, Box(origin, shape), ValueOrThrow(ParseDType(dtype_name))});
    }
    HostRestoreOptions options;
    options.map = map;
    options.batch_bytes = static_cast<uint64_t>(batch_bytes);
    std::optional<ThrottledProgress> forward;
    const std::function<void(uint64_t, uint64_t)> on_progress =
        ThrottledProgress::Forward(progress, &forward);
    std::optional<nb::python_error> batch_error;
    auto hand_over = [&](HostBatch& batch) -> Status {
      nb::gil_scoped_acquire gil;
      try {
        nb::list items;
        std::map<const HostBuffer*, nb::object> arrays;  // one array per distinct buffer
        if (step->keep != nullptr) {
          std::lock_guard<std::mutex> lock(step->keep->mutex);
          for (size_t i = 0; i < batch.requests.size(); ++i) {
            step->keep->boxes.push_back({boxes[batch.requests[i]], batch.buffers[i]});
          }
        }
        for (size_t i = 0; i < batch.requests.size(); ++i) {
          std::shared_ptr<HostBuffer>& buffer = batch.buffers[i];
          nb::object& array = arrays[buffer.get()];
          if (!array.is_valid()) {
            auto* owned = new std::shared_ptr<HostBuffer>(std::move(buffer));
            nb::capsule owner(owned, [](void* p) noexcept {
              delete static_cast<std::shared_ptr<HostBuffer>*>(p);
            });
            array = nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(
                        reinterpret_cast<uint8_t*>((*owned)->data()), {(*owned)->size()}, owner)
                        .cast();
          }
          items.append(nb::make_tuple(batch.requests[i], array));
        }
        batch.buffers.clear();
        on_batch(items);
      } catch (nb::python_error& error) {
        batch_error.emplace(std::move(error));
        return CancelledError("on_batch raised");
      }
      return OkStatus();
    };
    HostRestoreStats stats;
    Status status;
    {
      nb::gil_scoped_release release;
      status =
          tensorstash::RestoreToHost(*step->source, boxes, options, hand_over, on_progress, &stats);
    }
    if (batch_error.has_value()) throw std::move(*batch_error);
    ThrowIfError(status);
    if (forward.has_value()) forward->Finish();
    nb::dict result;
    result["bytes_read"] = stats.reads.bytes_read;
    result["requests"] = stats.reads.requests;
    result["direct_chunks"] = stats.reads.direct_chunks;
    result["staged_chunks"] = stats.reads.staged_chunks;
    result["peak_staging_bytes"] = stats.reads.peak_staging_bytes;
    result["mapped_bytes"] = stats.mapped_bytes;
    result["boxes"] = stats.boxes;
    result["batches"] = stats.batches;
    result["read_calls"] = stats.read_calls;
    return result;
  }

  nb::bytes ReadFile(const std::string& name) const {
    const std::shared_ptr<OpenStep> step = Step();
    std::string contents = ValueOrThrow([&] {
      nb::gil_scoped_release release;
      return step->source->ReadFile(name);
    }());
    return nb::bytes(contents.data(), contents.size());
  }

  nb::list Verify() {
    const std::shared_ptr<OpenStep> step = Step();
    std::vector<BadChunk> bad = ValueOrThrow([&] {
      nb::gil_scoped_release release;
      return step->source->Verify(nullptr);
    }());
    nb::list result;
    for (const BadChunk& chunk : bad) {
      nb::dict entry;
      entry["array_path"] = chunk.array_path;
      entry["chunk"] = chunk.chunk;
      entry["file"] = chunk.file;
      entry["error"] = chunk.error;
      result.append(std::move(entry));
    }
    return result;
  }

 private:
  std::shared_ptr<OpenStep> step_;  // null once closed; read and written with the GIL held
};

void InitReader(Reader* self, const std::string& root, const std::string& step,
                bool verify_checksums, int64_t max_inflight_bytes, int io_threads, bool map_spans) {
  const ReaderOptions options =
      ReadOptionsFromPython(verify_checksums, max_inflight_bytes, io_threads, map_spans);
  auto open = std::make_shared<OpenStep>();
  Status status = [&] {
    nb::gil_scoped_release release;
    Result<std::unique_ptr<KvStore>> store = OpenKvStore(root, {.create = false});
    if (!store.ok()) return store.status();
    open->kv = std::move(store).value();
    Result<std::unique_ptr<StepSource>> source = OpenStepSource(open->kv.get(), step, options);
    if (!source.ok()) return source.status();
    open->source = std::move(source).value();
    return OkStatus();
  }();
  ThrowIfError(status);
  new (self) Reader(std::move(open));
}

// (tier, location, dir, secret): tier "local" (location: a folder), "peer" (an http:// URL
// served by a PeerServer, with the job's secret) or "persistent" (any store URL or path).
using HolderTuple = std::tuple<std::string, std::string, std::string, std::string>;

Reader OpenTieredReader(const std::vector<HolderTuple>& holders, bool verify_checksums,
                        int64_t max_inflight_bytes, int io_threads, double stall_timeout_s) {
  ReaderOptions options;
  options.verify_checksums = verify_checksums;
  options.max_inflight_bytes = static_cast<uint64_t>(std::max<int64_t>(1, max_inflight_bytes));
  options.io_threads = io_threads;
  auto open = std::make_shared<OpenStep>();
  Status status = [&] {
    nb::gil_scoped_release release;
    std::vector<StepHolder> steps;
    for (const auto& [tier_name, location, dir, secret] : holders) {
      StepHolder holder;
      holder.dir = dir;
      Result<std::unique_ptr<KvStore>> kv = InvalidArgumentError(
          StrCat("unknown tier '", tier_name, "' (local, peer or persistent)"));
      if (tier_name == "local") {
        holder.tier = Tier::kLocal;
        kv = OpenKvStore(location, {.create = false});
      } else if (tier_name == "peer") {
        holder.tier = Tier::kPeer;
        HttpKvStoreOptions http;
        http.stall_timeout = std::chrono::milliseconds(static_cast<int64_t>(stall_timeout_s * 1e3));
        Result<std::unique_ptr<HttpKvStore>> peer = HttpKvStore::Open(location, secret, http);
        kv = peer.ok() ? Result<std::unique_ptr<KvStore>>(*std::move(peer))
                       : Result<std::unique_ptr<KvStore>>(peer.status());
      } else if (tier_name == "persistent") {
        holder.tier = Tier::kPersistent;
        kv = OpenKvStore(location, {.create = false});
      }
      if (!kv.ok()) return kv.status();
      holder.kv = *std::move(kv);
      steps.push_back(std::move(holder));
    }
    Result<std::unique_ptr<TieredStepSource>> source =
        TieredStepSource::Open(std::move(steps), options);
    if (!source.ok()) return source.status();
    open->source = *std::move(source);
    return OkStatus();
  }();
  ThrowIfError(status);
  return Reader(std::move(open));
}

}  // namespace

ReaderOptions ReadOptionsFromPython(bool verify_checksums, int64_t max_inflight_bytes,
                                    int io_threads, bool map_spans) {
  ReaderOptions options;
  options.max_inflight_bytes = InflightBytesFromPython(max_inflight_bytes);
  options.verify_checksums = verify_checksums;
  options.io_threads = io_threads;
  options.map_spans = map_spans;
  return options;
}

nb::object SharedReader(std::unique_ptr<KvStore> owned, KvStore* kv, const std::string& dir,
                        const ReaderOptions& options, nb::object coordinator,
                        const std::string& key_prefix, double timeout_s) {
  auto open = std::make_shared<OpenStep>();
  open->coordinator.reset(ValueOrThrow(PyCoordinator::Create(std::move(coordinator))).release());
  ShareOptions share;
  share.key_prefix = key_prefix;
  share.timeout = std::chrono::milliseconds(static_cast<int64_t>(std::max(0.001, timeout_s) * 1e3));
  open->kv = std::move(owned);
  Result<std::unique_ptr<StepSource>> source = [&]() -> Result<std::unique_ptr<StepSource>> {
    nb::gil_scoped_release release;
    // Only native steps share (their index has each chunk's bytes and CRC); any other format
    // is read as without sharing.
    TS_ASSIGN_OR_RETURN(DetectedStep detected, DetectStepFormat(kv, dir));
    if (detected.format != StepFormat::kNative) return OpenStepSource(kv, dir, options);
    TS_ASSIGN_OR_RETURN(std::unique_ptr<SharedStepSource> shared,
                        SharedStepSource::Open(kv, detected.dir, options,
                                               open->coordinator.get(), share));
    return std::unique_ptr<StepSource>(std::move(shared));
  }();
  open->source = ValueOrThrow(std::move(source));
  return nb::cast(Reader(std::move(open)));
}

nb::object ReaderFromSource(std::unique_ptr<KvStore> kv, std::shared_ptr<StepSource> source,
                            std::shared_ptr<KeptBoxes> keep) {
  auto open = std::make_shared<OpenStep>();
  open->kv = std::move(kv);
  open->source = std::move(source);
  open->keep = std::move(keep);
  return nb::cast(Reader(std::move(open)));
}

void DefineReader(nb::module_& m) {
  nb::class_<Reader>(m, "Reader",
                     "Reads any box of any array of one committed step of `root`: a tensorstash "
                     "step, an Orbax checkpoint (OCDBT or per-parameter zarr folders; an Orbax "
                     "manager step opens its item) or a zarr group; the format is detected.")
      .def("__init__", &InitReader, nb::arg("root"), nb::arg("step"), nb::kw_only(),
           nb::arg("verify_checksums") = true,
           nb::arg("max_inflight_bytes") = int64_t(ReaderOptions{}.max_inflight_bytes),
           nb::arg("io_threads") = 0, nb::arg("map_spans") = true)
      .def_static("tiered", &OpenTieredReader, nb::arg("holders"), nb::kw_only(),
                  nb::arg("verify_checksums") = true,
                  nb::arg("max_inflight_bytes") = int64_t(ReaderOptions{}.max_inflight_bytes),
                  nb::arg("io_threads") = 0, nb::arg("stall_timeout_s") = 10.0,
                  "A reader of one step held by several holders, cheapest first: [(tier, "
                  "location, dir, secret)] with tier \"local\" (a folder), \"peer\" (a "
                  "PeerServer's URL and the job's secret) or \"persistent\" (a store URL or "
                  "path). Each chunk is read from the first holder with an intact copy "
                  "(tiers/tiered_source.h). Holders that do not open are left out "
                  "(tier_stats()[\"open_errors\"]); FileNotFoundError when none opens.")
      .def_static(
          "shared",
          [](const std::string& root, const std::string& step, nb::object coordinator,
             const std::string& key_prefix, double timeout_s, bool verify_checksums,
             int64_t max_inflight_bytes, int io_threads) {
            const ReaderOptions options =
                ReadOptionsFromPython(verify_checksums, max_inflight_bytes, io_threads, false);
            std::unique_ptr<KvStore> kv = ValueOrThrow([&] {
              nb::gil_scoped_release release;
              return OpenKvStore(root, {.create = false});
            }());
            KvStore* base = kv.get();
            return SharedReader(std::move(kv), base, step, options, std::move(coordinator),
                                key_prefix, timeout_s);
          },
          nb::arg("root"), nb::arg("step"), nb::arg("coordinator"), nb::kw_only(),
          nb::arg("key_prefix"), nb::arg("timeout_s") = 60.0, nb::arg("verify_checksums") = true,
          nb::arg("max_inflight_bytes") = int64_t(ReaderOptions{}.max_inflight_bytes),
          nb::arg("io_threads") = 0,
          "A reader of a native step whose chunks needed by several processes of the job are "
          "read from storage by one of them and sent to the others over the peer transport "
          "(share/peer/shared_source.h): call share(requests) on every process with all the "
          "boxes it will read, then read, then finish_share(). key_prefix: the coordinator keys "
          "of this restore, the same on every process and unique per restore.")
      .def("share", &Reader::Share, nb::arg("requests"),
           nb::sig("def share(self, requests: list[tuple[str, typing.Sequence[int], "
                   "typing.Sequence[int], str]]) -> None"),
           "For a shared reader: agrees with the other processes which of them reads each "
           "shared chunk and starts serving this process's (every process, once, with every "
           "(path, origin, shape, dtype) it will read); nothing for other readers.")
      .def("finish_share", &Reader::FinishShare,
           "For a shared reader: waits (at most the timeout) until the processes it serves "
           "have what they need, stops serving, and returns {active, storage_bytes, "
           "storage_seconds, peer_bytes, peer_seconds, served_chunks, received_chunks, "
           "fallback_chunks, fallbacks: [text], finish_error: text}; None for other readers.")
      .def("tier_stats", &Reader::TierStats,
           "For a tiered reader: {bytes: {tier: n}, seconds: {tier: s}, failures: [text], "
           "local_failed: bool, holders: [(tier, name)], open_errors: [text]} since it "
           "opened; None for other readers.")
      .def("held_chunks", &Reader::HeldChunks, nb::arg("holder") = 0,
           "For a tiered reader: {array path: [chunk numbers]} that holder `holder` stores.")
      .def("close", &Reader::Close,
           "Closes the step's files now (arrays from map_many stay valid). Later calls raise "
           "ValueError; closing again does nothing.")
      .def_prop_ro("closed", &Reader::closed, "Whether close() was called.")
      .def("tree_json", &Reader::TreeJson,
           "The step's tree as a node in the \"tree\" schema of docs/format.md, as JSON text.")
      .def("tree", &Reader::Tree, nb::sig("def tree(self) -> dict[str, typing.Any]"),
           "The step's tree node as json.loads(tree_json()) would give it, built directly.")
      .def("arrays", &Reader::Arrays, nb::sig("def arrays(self) -> list[dict[str, typing.Any]]"),
           "One dict per array: path, dtype, shape, chunk_shape, cell_shape, codec, "
           "stored_bytes, num_chunks.")
      .def_prop_ro("created_unix_ms", &Reader::created_unix_ms)
      .def_prop_ro("process_count", &Reader::process_count)
      .def_prop_ro("format", &Reader::format,
                   "The detected format: \"tensorstash\", \"orbax-ocdbt\", "
                   "\"orbax-zarr-folders\" or \"zarr-group\".")
      .def_prop_ro("dir", &Reader::dir,
                   "The folder read, relative to root (an Orbax manager "
                   "step's item folder when one was found inside `step`).")
      .def("read_many", &Reader::ReadMany, nb::arg("requests"), nb::kw_only(),
           nb::arg("progress").none() = nb::none(),
           nb::sig("def read_many(self, requests: list[tuple[str, collections.abc.Sequence[int], "
                   "collections.abc.Sequence[int], str, numpy.typing.NDArray[numpy.uint8]]], *, "
                   "progress: collections.abc.Callable[[int, int], None] | None = None) "
                   "-> dict[str, int]"),
           "Fills each request's out (a writable C-contiguous CPU uint8 array of exactly the "
           "box's bytes in dtype) with the box of the array, converting the dtype if needed and "
           "zero-filling past the stored shape. Returns the read statistics. progress(done, "
           "total), in stored bytes, is called from the reading threads (with the GIL) at most "
           "about ten times a second, and finally with done == total once the read succeeded; "
           "an exception it raises stops the calls and is raised once the read is over.")
      .def("map_many", &Reader::MapMany, nb::arg("requests"),
           nb::sig("def map_many(self, requests: list[tuple[str, collections.abc.Sequence[int], "
                   "collections.abc.Sequence[int], str]]) -> "
                   "list[numpy.typing.NDArray[numpy.uint8] | None]"),
           "For each (path, origin, shape, dtype): the box's bytes (C order, stored dtype) as a "
           "uint8 array mapped copy-on-write from the data files, its checksums checked, or "
           "None where the box cannot be mapped (compressed, small or unaligned chunks, a cast, "
           "a foreign format): read those. Raises as read_many for unknown arrays and damage.")
      .def("restore_to_host", &Reader::RestoreToHost, nb::arg("requests"), nb::arg("on_batch"),
           nb::kw_only(), nb::arg("map") = true,
           nb::arg("batch_bytes") = int64_t(kDefaultHostBatchBytes),
           nb::arg("progress").none() = nb::none(),
           nb::sig("def restore_to_host(self, requests: list[tuple[str, typing.Sequence[int], "
                   "typing.Sequence[int], str]], on_batch: typing.Callable[[list[tuple[int, "
                   "numpy.ndarray]]], None], *, map: bool = True, batch_bytes: int = ..., "
                   "progress: typing.Callable[[int, int], None] | None = None) -> dict[str, int]"),
           "Reads (or maps) the boxes of (path, origin, shape, dtype) requests, all at once, "
           "and calls on_batch with [(request index, uint8 array of the box's bytes)] once per "
           "batch of about batch_bytes; requests for the same box share one array. Boxes in the "
           "stored dtype are mapped where their chunks allow it (unless map=False): runs of a "
           "data file share mappings (CheckpointReader::MapMany). Returns bytes_read, "
           "requests, direct_chunks, staged_chunks, peak_staging_bytes (as read_many, over all batches), mapped_bytes, boxes (distinct), "
           "batches and read_calls (batches that read anything).")
      .def("read_file", &Reader::ReadFile, nb::arg("name"),
           "The bytes of a file committed with the step (e.g. \"metadata.json\"), checked "
           "against the size and CRC-32C in COMMIT; of an Orbax checkpoint, one of Orbax's own "
           "files in its folder (\"_sharding\", \"array_metadatas/process_0\"), as stored. "
           "FileNotFoundError when the step has no such file, OSError when it is missing, "
           "truncated or altered, ValueError for a name outside the step's folder.")
      .def("verify", &Reader::Verify, nb::sig("def verify(self) -> list[dict[str, str]]"),
           "Reads every stored chunk and checks its CRC-32C (foreign formats: decodes it, with the "
           "checks that format has); returns the bad chunks as dicts "
           "(array_path, chunk, file, error).");
}

}  // namespace tensorstash::python
