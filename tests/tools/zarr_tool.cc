// zarr_tool: reads and writes zarr arrays in a folder with ZarrArray / ZarrArrayWriter, so that
// tests/python/test_zarr_interop.py can compare tensorstash with TensorStore and zarr-python.
//
//   zarr_tool read DIR PREFIX OUT_FILE
//       Prints one JSON line (zarr_format, dtype, shape, chunk_shape, inner_chunk_shape, sharded)
//       and writes the whole array's raw bytes (C order, little-endian) to OUT_FILE.
//   zarr_tool write DIR PREFIX IN_FILE --dtype T --shape 5,7 [--chunks 4,6] [--inner 2,3]
//                   [--compressor zstd|gzip|blosc|none] [--level N] [--format 3|2]
//                   [--unsharded] [--separator ./]
//       Writes IN_FILE (raw C-order little-endian elements of the whole array) as a zarr array.
//
// Shapes are comma-separated; "" is rank 0. Exit code 1 on any error, with the message on stderr.
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "tensorstash/format/zarr/zarr_array.h"
#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/util/str_util.h"
#include "tensorstash/util/thread_pool.h"

namespace ts = tensorstash;

namespace {

int Fail(const std::string& message) {
  std::cerr << "zarr_tool: " << message << "\n";
  return 1;
}

std::string ShapeJson(const std::vector<int64_t>& shape) {
  return ts::StrCat("[", ts::StrJoin(shape, ", "), "]");
}

bool ParseShape(const std::string& text, std::vector<int64_t>* out) {
  out->clear();
  if (text.empty()) return true;
  for (std::string_view part : ts::StrSplit(text, ',')) {
    int64_t v;
    if (!ts::ParseInt(part, &v)) return false;
    out->push_back(v);
  }
  return true;
}

int Read(const std::string& dir, const std::string& prefix, const std::string& out_path) {
  auto kv = ts::FileKvStore::Open(dir, /*create=*/false);
  if (!kv.ok()) return Fail(kv.status().ToString());
  auto array = ts::ZarrArray::Open(kv->get(), prefix);
  if (!array.ok()) return Fail(array.status().ToString());
  const ts::ZarrArray& a = **array;
  const ts::Box box = ts::Box::FromShape(a.shape());
  std::string data(static_cast<size_t>(box.num_elements()) * ts::ItemSize(a.dtype()), '\0');
  ts::ThreadPool pool(4);
  ts::Status status = a.Read(box, a.dtype(), data.data(), &pool);
  if (!status.ok()) return Fail(status.ToString());
  std::ofstream out(out_path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  out.close();
  if (!out) return Fail("cannot write " + out_path);
  std::cout << "{\"zarr_format\": " << a.zarr_format() << ", \"dtype\": \""
            << ts::DTypeName(a.dtype()) << "\", \"shape\": " << ShapeJson(a.shape())
            << ", \"chunk_shape\": " << ShapeJson(a.chunk_shape())
            << ", \"inner_chunk_shape\": " << ShapeJson(a.inner_chunk_shape())
            << ", \"sharded\": " << (a.sharded() ? "true" : "false") << "}\n";
  return 0;
}

int Write(int argc, char** argv) {
  if (argc < 5) return Fail("usage: zarr_tool write DIR PREFIX IN_FILE --dtype T --shape S ...");
  const std::string dir = argv[2], prefix = argv[3], in_path = argv[4];
  ts::ZarrArraySpec spec;
  bool have_dtype = false, have_shape = false;
  for (int i = 5; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--unsharded") {
      spec.sharded = false;
      continue;
    }
    if (i + 1 >= argc) return Fail("missing value for " + flag);
    const std::string value = argv[++i];
    if (flag == "--dtype") {
      auto dtype = ts::ParseDType(value);
      if (!dtype.ok()) return Fail(dtype.status().ToString());
      spec.dtype = *dtype;
      have_dtype = true;
    } else if (flag == "--shape") {
      if (!ParseShape(value, &spec.shape)) return Fail("bad --shape " + value);
      have_shape = true;
    } else if (flag == "--chunks") {
      if (!ParseShape(value, &spec.chunk_shape)) return Fail("bad --chunks " + value);
    } else if (flag == "--inner") {
      if (!ParseShape(value, &spec.inner_chunk_shape)) return Fail("bad --inner " + value);
    } else if (flag == "--compressor") {
      if (value == "zstd")
        spec.compressor = ts::ZarrCompressor::kZstd;
      else if (value == "gzip")
        spec.compressor = ts::ZarrCompressor::kGzip;
      else if (value == "blosc")
        spec.compressor = ts::ZarrCompressor::kBlosc;
      else if (value == "none")
        spec.compressor = ts::ZarrCompressor::kNone;
      else
        return Fail("unknown --compressor " + value);
    } else if (flag == "--level") {
      if (!ts::ParseInt(value, &spec.level)) return Fail("bad --level " + value);
    } else if (flag == "--format") {
      if (!ts::ParseInt(value, &spec.zarr_format)) return Fail("bad --format " + value);
    } else if (flag == "--separator") {
      if (value.size() != 1) return Fail("bad --separator " + value);
      spec.dimension_separator = value[0];
    } else {
      return Fail("unknown flag " + flag);
    }
  }
  if (!have_dtype || !have_shape) return Fail("--dtype and --shape are required");
  std::ifstream in(in_path, std::ios::binary);
  if (!in) return Fail("cannot open " + in_path);
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const ts::Box box = ts::Box::FromShape(spec.shape);
  ts::Status valid = ts::ValidateBox(box, ts::ItemSize(spec.dtype), "--shape");
  if (!valid.ok()) return Fail(valid.ToString());
  if (data.size() != static_cast<size_t>(box.num_elements()) * ts::ItemSize(spec.dtype)) {
    return Fail(ts::StrCat(in_path, " has ", data.size(), " bytes; the array needs ",
                           box.num_elements() * static_cast<int64_t>(ts::ItemSize(spec.dtype))));
  }
  auto kv = ts::FileKvStore::Open(dir, /*create=*/true);
  if (!kv.ok()) return Fail(kv.status().ToString());
  auto writer = ts::ZarrArrayWriter::Create(kv->get(), prefix, spec);
  if (!writer.ok()) return Fail(writer.status().ToString());
  ts::ThreadPool pool(4);
  ts::Status status = (*writer)->WriteBox(box, data.data(), &pool);
  if (!status.ok()) return Fail(status.ToString());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "read" && argc == 5) return Read(argv[2], argv[3], argv[4]);
  if (command == "write") return Write(argc, argv);
  return Fail(
      "usage: zarr_tool read DIR PREFIX OUT_FILE | zarr_tool write DIR PREFIX IN_FILE "
      "--dtype T --shape S [--chunks C] [--inner I] [--compressor zstd|gzip|blosc|none] "
      "[--level N] [--format 3|2] [--unsharded] [--separator ./]");
}
