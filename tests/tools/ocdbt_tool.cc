// ocdbt_tool: reads and writes OCDBT databases with OcdbtKvStore / OcdbtWriter, so that
// tests/python/test_ocdbt_interop.py can compare them with TensorStore's own driver.
//
//   ocdbt_tool list DIR [PREFIX]   keys of the latest version, one per line, sorted
//   ocdbt_tool get DIR KEY         the value of KEY, raw, to stdout
//   ocdbt_tool getmany DIR         for each key on stdin (a line each): its value's length in
//                                  decimal and a newline, then the value, raw (one process for
//                                  thousands of keys: the tests compare whole databases)
//   ocdbt_tool info DIR            the latest version and the root node's data files, as
//                                  "name value" lines (for tests that check what was covered)
//   ocdbt_tool put DIR [--zstd] [--max-inline N] [--max-node-bytes N] [--data-file-bytes N]
//                                  writes a new database from stdin lines "KEY<TAB>FILE": the
//                                  value of KEY is the content of FILE
//
// DIR is the database root (the folder holding manifest.ocdbt). Errors go to stderr with exit
// status 1 (2 for a usage error, 3 for a key that is not found).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/kvstore/ocdbt/ocdbt_kvstore.h"

using namespace tensorstash;

namespace {

int Fail(const Status& status) {
  std::fprintf(stderr, "ocdbt_tool: %s\n", status.ToString().c_str());
  return absl::IsNotFound(status) ? 3 : 1;
}

int Usage() {
  std::fprintf(
      stderr,
      "usage: ocdbt_tool list DIR [PREFIX] | get DIR KEY | getmany DIR < KEY lines | put DIR [--zstd] "
      "[--max-inline N] [--max-node-bytes N] [--data-file-bytes N] < KEY<TAB>FILE lines\n");
  return 2;
}

// Writes KEY's value to stdout, read through OpenForRead in pieces as a reader of a large chunk
// would; with_length puts its length and a newline first.
Status WriteValue(OcdbtKvStore* store, const std::string& key, bool with_length) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, store->OpenForRead(key));
  if (with_length) std::printf("%llu\n", static_cast<unsigned long long>(file->size()));
  std::vector<char> buffer(1 << 20);
  for (uint64_t done = 0; done < file->size();) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buffer.size(), file->size() - done));
    TS_RETURN_IF_ERROR(file->ReadAt(done, n, buffer.data()));
    std::fwrite(buffer.data(), 1, n, stdout);
    done += n;
  }
  return OkStatus();
}

Status Put(KvStore* base, const OcdbtWriter::Options& options) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<OcdbtWriter> writer, OcdbtWriter::Create(base, "", options));
  std::string line;
  std::vector<char> buffer(1 << 20);
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    const size_t tab = line.find('\t');
    if (tab == std::string::npos)
      return InvalidArgumentError(StrCat("no tab in line '", line, "'"));
    const std::string key = line.substr(0, tab);
    const std::string path = line.substr(tab + 1);
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (!in) return NotFoundError(StrCat("cannot open '", path, "'"));
    const uint64_t size = static_cast<uint64_t>(in.tellg());
    in.seekg(0);
    if (size <= options.max_inline_value_bytes) {
      std::string value(size, '\0');
      in.read(value.data(), static_cast<std::streamsize>(size));
      TS_RETURN_IF_ERROR(writer->Add(key, value));
      continue;
    }
    // Streamed in pieces: a large value is never held whole in memory.
    TS_ASSIGN_OR_RETURN(OcdbtWriter::ValueSink sink, writer->AddValue(key, size));
    for (uint64_t done = 0; done < size;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(buffer.size(), size - done));
      if (!in.read(buffer.data(), static_cast<std::streamsize>(n))) {
        return UnknownError(StrCat("short read of '", path, "'"));
      }
      TS_RETURN_IF_ERROR(sink.Write(done, buffer.data(), n));
      done += n;
    }
  }
  return writer->Finish();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return Usage();
  const std::string command = argv[1];
  const std::string dir = argv[2];
  Result<std::unique_ptr<FileKvStore>> base = FileKvStore::Open(dir, /*create=*/command == "put");
  if (!base.ok()) return Fail(base.status());

  if (command == "put") {
    OcdbtWriter::Options options;
    for (int i = 3; i < argc; ++i) {
      const std::string flag = argv[i];
      if (flag == "--zstd") {
        options.zstd = true;
      } else if (i + 1 < argc && flag == "--max-inline") {
        options.max_inline_value_bytes =
            static_cast<uint32_t>(std::strtoul(argv[++i], nullptr, 10));
      } else if (i + 1 < argc && flag == "--max-node-bytes") {
        options.max_decoded_node_bytes =
            static_cast<uint32_t>(std::strtoul(argv[++i], nullptr, 10));
      } else if (i + 1 < argc && flag == "--data-file-bytes") {
        options.target_data_file_bytes = std::strtoull(argv[++i], nullptr, 10);
      } else {
        return Usage();
      }
    }
    const Status status = Put(base->get(), options);
    return status.ok() ? 0 : Fail(status);
  }

  Result<std::unique_ptr<OcdbtKvStore>> store = OcdbtKvStore::Open(base->get(), "");
  if (!store.ok()) return Fail(store.status());
  if (command == "list" && argc <= 4) {
    Result<std::vector<std::string>> keys = (*store)->List(argc == 4 ? argv[3] : "");
    if (!keys.ok()) return Fail(keys.status());
    for (const std::string& key : *keys) std::printf("%s\n", key.c_str());
    return 0;
  }
  if (command == "info" && argc == 3) {
    const ocdbt::Manifest& manifest = (*store)->manifest();
    const ocdbt::VersionRef& version = (*store)->latest_version();
    std::printf(
        "generation %llu\nroot_height %d\ninline_versions %zu\nversion_nodes %zu\n"
        "zstd %d\nnum_keys %llu\n",
        static_cast<unsigned long long>(version.generation), int{version.root_height},
        manifest.versions.size(), manifest.version_nodes.size(), int{manifest.config.zstd},
        static_cast<unsigned long long>(version.statistics.num_keys));
    if (version.root.missing()) return 0;
    const ocdbt::DataFileId& file = manifest.files[version.root.file];
    std::string encoded(version.root.length, '\0');
    const Status read =
        (*base)->ReadRange(file.FullPath(), version.root.offset, encoded.size(), encoded.data());
    if (!read.ok()) return Fail(read);
    Result<ocdbt::BtreeNode> root = ocdbt::DecodeBtreeNode(encoded, file.base_path, "root");
    if (!root.ok()) return Fail(root.status());
    for (const ocdbt::DataFileId& f : root->files) {
      std::printf("root_file %s\n", f.FullPath().c_str());
    }
    return 0;
  }
  if (command == "get" && argc == 4) {
    const Status status = WriteValue(store->get(), argv[3], /*with_length=*/false);
    if (!status.ok()) return Fail(status);
    return std::fflush(stdout) == 0 ? 0 : 1;
  }
  if (command == "getmany" && argc == 3) {
    std::string key;
    while (std::getline(std::cin, key)) {
      const Status status = WriteValue(store->get(), key, /*with_length=*/true);
      if (!status.ok()) return Fail(status);
    }
    return std::fflush(stdout) == 0 ? 0 : 1;
  }
  return Usage();
}
