// tensorstash._ext.Reader: CheckpointReader on a FileKvStore.
//
// Opening, reading and verifying release the GIL: they wait on storage, and other Python threads
// (a training step, another reader) can run meanwhile.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.h"
#include "buffers.h"
#include "errors.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/kvstore/file/file_kvstore.h"

namespace nb = nanobind;

namespace tensorstash::python {
namespace {

// (path, origin, shape, dtype name, out); out is checked by CastWritableBytes.
using RequestTuple =
    std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>, std::string, nb::object>;

class Reader {
 public:
  Reader(std::unique_ptr<FileKvStore> kv, std::unique_ptr<CheckpointReader> reader)
      : kv_(std::move(kv)), reader_(std::move(reader)) {}

  std::string TreeJson() const { return ValueOrThrow(TreeNodeToJson(reader_->tree())); }

  nb::list Arrays() const {
    nb::list result;
    for (size_t i = 0; i < reader_->arrays().size(); ++i) {
      const ArrayMetadata& a = reader_->arrays()[i];
      nb::dict entry;
      entry["path"] = a.path;
      entry["dtype"] = std::string(DTypeName(a.dtype));
      entry["shape"] = ShapeTuple(a.shape());
      entry["chunk_shape"] = ShapeTuple(a.grid.chunk_shape);
      entry["cell_shape"] = ShapeTuple(a.grid.cell_shape);
      entry["codec"] = std::string(CodecName(a.codec));
      entry["stored_bytes"] = reader_->StoredBytes(i);
      entry["num_chunks"] = a.grid.NumStoredChunks();
      result.append(std::move(entry));
    }
    return result;
  }

  int64_t created_unix_ms() const { return reader_->commit_record().created_unix_ms; }
  int process_count() const { return reader_->commit_record().process_count; }

  nb::dict ReadMany(const std::vector<RequestTuple>& requests) {
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
    {
      nb::gil_scoped_release release;
      status = reader_->ReadMany(reads, &stats);
    }
    ThrowIfError(status);
    nb::dict result;
    result["bytes_read"] = stats.bytes_read;
    result["requests"] = stats.requests;
    result["direct_chunks"] = stats.direct_chunks;
    result["staged_chunks"] = stats.staged_chunks;
    result["peak_staging_bytes"] = stats.peak_staging_bytes;
    return result;
  }

  nb::list Verify() {
    std::vector<BadChunk> bad = ValueOrThrow([&] {
      nb::gil_scoped_release release;
      return reader_->Verify();
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
  // Declared before reader_, which uses it, so that it is destroyed after it.
  std::unique_ptr<FileKvStore> kv_;
  std::unique_ptr<CheckpointReader> reader_;
};

void InitReader(Reader* self, const std::string& root, const std::string& step,
                bool verify_checksums, int64_t max_inflight_bytes, int io_threads) {
  if (max_inflight_bytes <= 0) {
    ThrowIfError(InvalidArgumentError(
        StrCat("max_inflight_bytes must be > 0, not ", max_inflight_bytes)));
  }
  ReaderOptions options;
  options.verify_checksums = verify_checksums;
  options.max_inflight_bytes = static_cast<uint64_t>(max_inflight_bytes);
  options.io_threads = io_threads;
  std::unique_ptr<FileKvStore> kv;
  Result<std::unique_ptr<CheckpointReader>> reader = [&] {
    nb::gil_scoped_release release;
    Result<std::unique_ptr<FileKvStore>> store = FileKvStore::Open(root, /*create=*/false);
    if (!store.ok()) return Result<std::unique_ptr<CheckpointReader>>(store.status());
    kv = std::move(store).value();
    return CheckpointReader::Open(kv.get(), step, options);
  }();
  new (self) Reader(std::move(kv), ValueOrThrow(std::move(reader)));
}

}  // namespace

void DefineReader(nb::module_& m) {
  nb::class_<Reader>(m, "Reader", "Reads any box of any array of one committed step of `root`.")
      .def("__init__", &InitReader, nb::arg("root"), nb::arg("step"), nb::kw_only(),
           nb::arg("verify_checksums") = true,
           nb::arg("max_inflight_bytes") = int64_t{256} << 20, nb::arg("io_threads") = 0)
      .def("tree_json", &Reader::TreeJson,
           "The step's tree as a node in the \"tree\" schema of docs/format.md.")
      .def("arrays", &Reader::Arrays, nb::sig("def arrays(self) -> list[dict[str, typing.Any]]"),
           "One dict per array: path, dtype, shape, chunk_shape, cell_shape, codec, "
           "stored_bytes, num_chunks.")
      .def_prop_ro("created_unix_ms", &Reader::created_unix_ms)
      .def_prop_ro("process_count", &Reader::process_count)
      .def("read_many", &Reader::ReadMany, nb::arg("requests"),
           nb::sig("def read_many(self, requests: list[tuple[str, collections.abc.Sequence[int], "
                   "collections.abc.Sequence[int], str, numpy.typing.NDArray[numpy.uint8]]]) "
                   "-> dict[str, int]"),
           "Fills each request's out (a writable C-contiguous CPU uint8 array of exactly the "
           "box's bytes in dtype) with the box of the array, converting the dtype if needed and "
           "zero-filling past the stored shape. Returns the read statistics.")
      .def("verify", &Reader::Verify, nb::sig("def verify(self) -> list[dict[str, str]]"),
           "Reads every stored chunk and checks its CRC-32C; returns the bad chunks as dicts "
           "(array_path, chunk, file, error).");
}

}  // namespace tensorstash::python
