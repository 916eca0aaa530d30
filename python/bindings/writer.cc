// tensorstash._ext.Writer: CheckpointWriter on a store opened by URL (kvstore/registry.h).
//
// Shards are saved without a copy: the writer reads the caller's arrays during commit() (or
// write_part()), so the Writer keeps a reference to each of them until it returns. The save's
// two phases are bound too (checkpoint_writer.h): write_part() on every process gives the bytes
// of what it wrote, commit_parts() on one process commits every process's bytes (PyTorch DCP's
// storage writer is built on them). commit() and write_part() release the GIL; a
// Python coordinator takes it back for each call. The Writer takes part in garbage collection
// because a coordinator can refer back to it (e.g. through the traceback of an exception it
// keeps), a cycle that runs through C++ members the collector cannot otherwise see.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.h"
#include "buffers.h"
#include "coordinator.h"
#include "errors.h"
#include "gc_slots.h"
#include "save_args.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/checkpoint/materialize.h"
#include "tensorstash/kvstore/registry.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/str_util.h"

namespace nb = nanobind;

namespace tensorstash::python {
namespace {

class Writer {
 public:
  Writer(std::unique_ptr<KvStore> kv, std::unique_ptr<PyCoordinator> coordinator,
         std::unique_ptr<CheckpointWriter> writer)
      : kv_(std::move(kv)), coordinator_(std::move(coordinator)), writer_(std::move(writer)) {}

  // The Python objects it holds, for the garbage collector (gc_slots.h).
  std::array<nb::handle, 1> python_objects() const {
    return {coordinator_ != nullptr ? coordinator_->object() : nb::handle()};
  }

  // Drops everything, for tp_clear; the Writer is unusable afterwards. writer_ goes first, as it
  // uses the others.
  void Clear() {
    writer_.reset();
    shard_arrays_.clear();
    coordinator_.reset();
  }

  void AddArray(const std::string& path, const std::string& dtype,
                const std::vector<int64_t>& shape, const std::vector<ShardTuple>& shards,
                const std::string& codec, int zstd_level, int64_t target_chunk_bytes,
                bool same_as_base) {
    ThrowIfError(CheckUsable());
    std::vector<ReadOnlyBytes> buffers;
    ArrayToSave array = ArrayToSaveFromPython(path, dtype, shape, shards, codec, zstd_level,
                                              target_chunk_bytes, &buffers);
    for (ShardData& shard : array.shards) shard.same_as_base = same_as_base;
    ThrowIfError(writer_->AddArray(std::move(array.spec), std::move(array.shards)));
    for (ReadOnlyBytes& buffer : buffers) shard_arrays_.push_back(std::move(buffer));
  }

  void SetTree(const std::string& tree_json) {
    ThrowIfError(CheckUsable());
    writer_->SetTree(ValueOrThrow(TreeNodeFromJson(tree_json)));
  }

  nb::dict Commit() {
    ThrowIfError(CheckUsable());
    committing_ = true;
    WriteStats stats;
    Status status;
    {
      nb::gil_scoped_release release;
      status = writer_->Commit(&stats);
    }
    committing_ = false;
    shard_arrays_.clear();  // The writer is done with them, whatever the outcome.
    ThrowIfError(status);
    return StatsDict(stats);
  }

  nb::bytes WritePart() {
    ThrowIfError(CheckUsable());
    committing_ = true;
    Result<std::string> bytes = std::string();
    {
      nb::gil_scoped_release release;
      Result<WrittenPart> part = writer_->WritePart();
      bytes = part.ok() ? EncodeWrittenPart(*part) : Result<std::string>(part.status());
    }
    committing_ = false;
    shard_arrays_.clear();  // Written (or failed): the writer reads them no more.
    ThrowIfError(bytes.status());
    return nb::bytes(bytes->data(), bytes->size());
  }

  nb::dict CommitParts(const std::vector<nb::bytes>& encoded) {
    ThrowIfError(CheckUsable());
    std::vector<WrittenPart> parts;
    WriteStats total;
    for (size_t i = 0; i < encoded.size(); ++i) {
      WrittenPart part = ValueOrThrow(DecodeWrittenPart(
          std::string_view(encoded[i].c_str(), encoded[i].size()), StrCat("part ", i)));
      total.raw_bytes += part.stats.raw_bytes;
      total.stored_bytes += part.stats.stored_bytes;
      total.chunks += part.stats.chunks;
      total.data_files += part.stats.data_files;
      total.seconds = std::max(total.seconds, part.stats.seconds);
      parts.push_back(std::move(part));
    }
    committing_ = true;
    Status status;
    {
      nb::gil_scoped_release release;
      status = writer_->CommitParts(std::move(parts));
    }
    committing_ = false;
    ThrowIfError(status);
    return StatsDict(total);
  }

 private:
  static nb::dict StatsDict(const WriteStats& stats) {
    nb::dict result;
    result["raw_bytes"] = stats.raw_bytes;
    result["stored_bytes"] = stats.stored_bytes;
    result["chunks"] = stats.chunks;
    result["data_files"] = stats.data_files;
    result["referenced_chunks"] = stats.referenced_chunks;
    result["referenced_bytes"] = stats.referenced_bytes;
    result["unhashed_chunks"] = stats.unhashed_chunks;
    result["commit_id"] = stats.commit_id;
    result["seconds"] = stats.seconds;
    return result;
  }

  Status CheckUsable() const {
    // commit() runs without the GIL, so another Python thread could reach the writer meanwhile;
    // CheckpointWriter is used by one thread at a time.
    if (committing_) return FailedPreconditionError("commit() is running in another thread");
    if (writer_ == nullptr) return FailedPreconditionError("the writer was cleared");
    return OkStatus();
  }

  // Declared before writer_, which uses them, so that they are destroyed after it.
  std::unique_ptr<KvStore> kv_;
  std::unique_ptr<PyCoordinator> coordinator_;
  std::vector<ReadOnlyBytes> shard_arrays_;
  std::unique_ptr<CheckpointWriter> writer_;
  bool committing_ = false;  // read and written with the GIL held
};

void InitWriter(Writer* self, const std::string& root, const std::string& step,
                int64_t target_chunk_bytes, int64_t target_data_file_bytes,
                int64_t max_inflight_bytes, int io_threads, bool sync, bool overwrite,
                bool split_replicated_writes, nb::object coordinator,
                double coordination_timeout_s, const std::string& base, bool record_digests,
                const std::string& base_commit_id) {
  WriterOptions options =
      WriterOptionsFromPython(target_chunk_bytes, target_data_file_bytes, max_inflight_bytes,
                              io_threads, sync, overwrite, coordination_timeout_s);
  options.split_replicated_writes = split_replicated_writes;
  options.base = base;
  options.record_digests = record_digests;
  options.base_commit_id = base_commit_id;
  SaveTarget target = OpenSaveTarget(root, std::move(coordinator));
  std::unique_ptr<CheckpointWriter> writer = ValueOrThrow(
      CheckpointWriter::Create(target.kv.get(), step, options, target.coordinator.get()));
  new (self) Writer(std::move(target.kv), std::move(target.coordinator), std::move(writer));
}

}  // namespace

void DefineWriter(nb::module_& m) {
  m.def(
      "materialize",
      [](const std::string& src, const std::string& dst, bool overwrite, bool sync) {
        const StepUrl from = ValueOrThrow(SplitStepUrl(src));
        const StepUrl to = ValueOrThrow(SplitStepUrl(dst));
        Status status;
        {
          nb::gil_scoped_release release;
          status = [&]() -> Status {
            TS_ASSIGN_OR_RETURN(std::unique_ptr<KvStore> src_kv, OpenKvStore(from.root));
            TS_ASSIGN_OR_RETURN(std::unique_ptr<KvStore> dst_kv,
                                OpenKvStore(to.root, {.create = true}));
            WriterOptions options;
            options.overwrite = overwrite;
            options.sync = sync;
            return MaterializeStep(src_kv.get(), from.step, dst_kv.get(), to.step, options);
          }();
        }
        ThrowIfError(status);
      },
      nb::arg("src"), nb::arg("dst"), nb::kw_only(), nb::arg("overwrite") = false,
      nb::arg("sync") = true,
      "Copies step `src` to a self-contained step `dst` (checkpoint/materialize.h).");
  nb::class_<Writer>(m, "Writer",
                     "Saves sharded arrays (and a pytree around them) as one step of `root`.",
                     nb::type_slots(GcSlots<Writer>()))
      .def("__init__", &InitWriter, nb::arg("root"), nb::arg("step"), nb::kw_only(),
           nb::arg("target_chunk_bytes") = WriterOptions{}.target_chunk_bytes,
           nb::arg("target_data_file_bytes") = WriterOptions{}.target_data_file_bytes,
           nb::arg("max_inflight_bytes") = int64_t(WriterOptions{}.max_inflight_bytes),
           nb::arg("io_threads") = 0, nb::arg("sync") = true, nb::arg("overwrite") = false,
           nb::arg("split_replicated_writes") = true, nb::arg("coordinator").none() = nb::none(),
           nb::arg("coordination_timeout_s") = kDefaultCoordinationTimeoutSeconds,
           nb::arg("base") = "", nb::arg("record_digests") = false,
           nb::arg("base_commit_id") = "")
      .def("add_array", &Writer::AddArray, nb::arg("path"), nb::arg("dtype"), nb::arg("shape"),
           nb::arg("shards"), nb::kw_only(), nb::arg("codec") = "none",
           nb::arg("zstd_level") = ArraySpec{}.zstd_level, nb::arg("target_chunk_bytes") = 0,
           nb::arg("same_as_base") = false,
           nb::sig("def add_array(self, path: str, dtype: str, "
                   "shape: collections.abc.Sequence[int], "
                   "shards: list[tuple[collections.abc.Sequence[int], "
                   "collections.abc.Sequence[int], numpy.typing.NDArray[numpy.uint8], int, int]], "
                   "*, codec: str = 'none', zstd_level: int = 3, target_chunk_bytes: int = 0, "
                   "same_as_base: bool = False) -> None"),
           "Adds an array and this process's shards of it: (origin, shape, data, replica_id, "
           "num_replicas), data a C-contiguous CPU uint8 array of the shard's bytes in C order. "
           "The arrays are read during commit() and must not change before it returns. "
           "`same_as_base`: the caller promises the shards are the buffers the save with commit "
           "id `base_commit_id` read, unchanged (ShardData::same_as_base).")
      .def("set_tree", &Writer::SetTree, nb::arg("tree_json"),
           "Replaces the default tree with a node in the \"tree\" schema of docs/format.md.")
      .def("commit", &Writer::Commit, nb::sig("def commit(self) -> dict[str, int | float]"),
           "Writes the chunks and commits the step; returns raw_bytes, stored_bytes, chunks, "
           "data_files, referenced_chunks, referenced_bytes, unhashed_chunks, commit_id (with "
           "record_digests; else '') and seconds. May be called once.")
      .def("write_part", &Writer::WritePart, nb::sig("def write_part(self) -> bytes"),
           "Phase 1 of a save, instead of commit(), on every process together: writes this "
           "process's chunks and files and returns what it wrote, as bytes to carry to the "
           "process that commits. Nothing is visible before commit_parts(). May be called once.")
      .def("commit_parts", &Writer::CommitParts, nb::arg("parts"),
           nb::sig("def commit_parts(self, parts: list[bytes]) -> dict[str, int | float]"),
           "Phase 2, on one process whose writer ran write_part(), once every process's "
           "write_part() has returned: commits the step with every process's bytes (any order). "
           "Returns the totals of raw_bytes, stored_bytes, chunks, data_files, and the longest "
           "seconds. ValueError naming the process for a missing, repeated or foreign part, or "
           "an array not covered; on failure nothing is visible.");
}

}  // namespace tensorstash::python
