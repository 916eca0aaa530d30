// tensorstash._ext.OrbaxWriter: OrbaxWriter (checkpoint/orbax_writer.h) on a store opened by
// URL (kvstore/registry.h).
//
// Like the Writer, it reads the caller's shard buffers during commit() and keeps a reference to
// each of them until commit() returns; commit() releases the GIL (a Python coordinator takes it
// back for each call). With a coordinator of several processes, each process's writer writes
// its own shards and process 0 publishes the checkpoint (orbax_writer.h). It takes part in
// garbage collection as the Writer does, for the coordinator it holds (gc_slots.h).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "buffers.h"
#include "coordinator.h"
#include "errors.h"
#include "gc_slots.h"
#include "save_args.h"
#include "tensorstash/checkpoint/orbax_writer.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/str_util.h"

namespace nb = nanobind;

namespace tensorstash::python {
namespace {

class PyOrbaxWriter {
 public:
  PyOrbaxWriter(std::unique_ptr<KvStore> kv, std::unique_ptr<PyCoordinator> coordinator,
                std::unique_ptr<OrbaxWriter> writer)
      : kv_(std::move(kv)), coordinator_(std::move(coordinator)), writer_(std::move(writer)) {}

  // The Python objects it holds, for the garbage collector (gc_slots.h).
  std::array<nb::handle, 1> python_objects() const {
    return {coordinator_ != nullptr ? coordinator_->object() : nb::handle()};
  }

  // Drops everything, for tp_clear; unusable afterwards. writer_ goes first: it uses the rest.
  void Clear() {
    writer_.reset();
    buffers_.clear();
    coordinator_.reset();
  }

  void AddArray(const std::string& path, const std::string& dtype,
                const std::vector<int64_t>& shape, const std::vector<ShardTuple>& shards,
                const std::string& value_type, const std::string& random_key_impl) {
    ThrowIfError(CheckUsable());
    // Initialized although every path sets it or throws: GCC cannot see that ThrowIfError
    // does not return.
    OrbaxValueType type = OrbaxValueType::kNumpyArray;
    if (value_type == "jax.Array") {
      type = OrbaxValueType::kJaxArray;
    } else if (value_type == "np.ndarray") {
      type = OrbaxValueType::kNumpyArray;
    } else {
      ThrowIfError(InvalidArgumentError(
          StrCat("value_type must be 'jax.Array' or 'np.ndarray', not '", value_type, "'")));
    }
    std::vector<ReadOnlyBytes> buffers;
    ArrayToSave array = ArrayToSaveFromPython(path, dtype, shape, shards, "none", 0, 0, &buffers);
    OrbaxArraySpec spec{array.spec.path, array.spec.dtype, array.spec.shape, type,
                        random_key_impl};
    ThrowIfError(writer_->AddArray(std::move(spec), std::move(array.shards)));
    for (ReadOnlyBytes& buffer : buffers) buffers_.push_back(std::move(buffer));
  }

  void AddFile(const std::string& name, const std::string& contents) {
    ThrowIfError(CheckUsable());
    ThrowIfError(writer_->AddFile(name, contents));
  }

  void SetTree(const std::string& tree_json) {
    ThrowIfError(CheckUsable());
    writer_->SetTree(ValueOrThrow(TreeNodeFromJson(tree_json)));
  }

  nb::dict Commit() {
    ThrowIfError(CheckUsable());
    committing_ = true;
    OrbaxWriteStats stats;
    Status status;
    {
      nb::gil_scoped_release release;
      status = writer_->Commit(&stats);
    }
    committing_ = false;
    buffers_.clear();
    ThrowIfError(status);
    nb::dict result;
    result["raw_bytes"] = stats.raw_bytes;
    result["chunks"] = stats.chunks;
    result["seconds"] = stats.seconds;
    return result;
  }

 private:
  Status CheckUsable() const {
    if (committing_) return FailedPreconditionError("commit() is running in another thread");
    if (writer_ == nullptr) return FailedPreconditionError("the writer was cleared");
    return OkStatus();
  }

  std::unique_ptr<KvStore> kv_;
  std::unique_ptr<PyCoordinator> coordinator_;
  std::vector<ReadOnlyBytes> buffers_;
  std::unique_ptr<OrbaxWriter> writer_;  // after the buffers and the store it reads and writes
  bool committing_ = false;
};

void InitOrbaxWriter(PyOrbaxWriter* self, const std::string& root, const std::string& step,
                     const std::string& item, bool overwrite, bool sync, int io_threads,
                     int zstd_level, const std::vector<std::vector<std::string>>& json_items,
                     nb::object coordinator) {
  OrbaxWriterOptions options;
  options.item = item;
  for (const std::vector<std::string>& json_item : json_items) {
    if (json_item.size() != 3) {
      throw nb::value_error("json_items: each is (item name, file name, JSON text)");
    }
    options.json_items.push_back({json_item[0], json_item[1], json_item[2]});
  }
  options.overwrite = overwrite;
  options.sync = sync;
  options.io_threads = io_threads;
  options.zstd_level = zstd_level;
  SaveTarget target = OpenSaveTarget(root, std::move(coordinator));
  std::unique_ptr<OrbaxWriter> writer = ValueOrThrow(
      OrbaxWriter::Create(target.kv.get(), step, options, target.coordinator.get()));
  new (self)
      PyOrbaxWriter(std::move(target.kv), std::move(target.coordinator), std::move(writer));
}

}  // namespace

void DefineOrbaxWriter(nb::module_& m) {
  nb::class_<PyOrbaxWriter>(m, "OrbaxWriter",
                            "Saves arrays and a pytree as an Orbax checkpoint (OCDBT + zarr3) "
                            "at folder `step` of `root`; with a coordinator of several "
                            "processes, each process's shards.",
                            nb::type_slots(GcSlots<PyOrbaxWriter>()))
      .def("__init__", &InitOrbaxWriter, nb::arg("root"), nb::arg("step"), nb::kw_only(),
           nb::arg("item") = "", nb::arg("overwrite") = false, nb::arg("sync") = true,
           nb::arg("io_threads") = 0, nb::arg("zstd_level") = ArraySpec{}.zstd_level,
           nb::arg("json_items") = std::vector<std::vector<std::string>>{},
           nb::arg("coordinator").none() = nb::none())
      .def("add_array", &PyOrbaxWriter::AddArray, nb::arg("path"), nb::arg("dtype"),
           nb::arg("shape"), nb::arg("shards"), nb::kw_only(), nb::arg("value_type"),
           nb::arg("random_key_impl") = "",
           nb::sig("def add_array(self, path: str, dtype: str, "
                   "shape: collections.abc.Sequence[int], "
                   "shards: list[tuple[collections.abc.Sequence[int], "
                   "collections.abc.Sequence[int], numpy.typing.NDArray[numpy.uint8], int, int]], "
                   "*, value_type: str, random_key_impl: str = '') -> None"),
           "Adds an array and its shards, as Writer.add_array; value_type is 'jax.Array' or "
           "'np.ndarray' (what Orbax restores it as without a target). random_key_impl: the "
           "array is the key data of PRNG keys of that JAX implementation, recorded as Orbax "
           "records it (jax.Array only).")
      .def("add_file", &PyOrbaxWriter::AddFile, nb::arg("name"), nb::arg("contents"),
           "Adds a file to the item folder (e.g. '_sharding').")
      .def("set_tree", &PyOrbaxWriter::SetTree, nb::arg("tree_json"),
           "Replaces the default tree with a node in the \"tree\" schema of docs/format.md.")
      .def("commit", &PyOrbaxWriter::Commit, nb::sig("def commit(self) -> dict[str, int | float]"),
           "Writes the checkpoint and renames it into place; returns raw_bytes, chunks and "
           "seconds. May be called once.");
}

}  // namespace tensorstash::python
