// tensorstash._ext: the native core of the tensorstash Python package. The package's Python
// modules build on it; users do not import it directly.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "errors.h"
#include "run.h"
#include "tensorstash/array/dtype.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/checkpoint/safetensors_export.h"
#include "tensorstash/coordination/collectives.h"
#include "tensorstash/engine/host_restore.h"
#include "tensorstash/kvstore/gcs/gcs_kvstore.h"
#include "tensorstash/kvstore/registry.h"
#include "tensorstash/kvstore/s3/s3_kvstore.h"
#include "tensorstash/util/staging_buffer.h"
#include "tensorstash/version.h"

namespace nb = nanobind;

namespace tensorstash::python {

namespace {

std::vector<std::string> DTypeNames() {
  std::vector<std::string> names;
  for (int i = 0; i < kNumDTypes; ++i) names.emplace_back(DTypeName(AllDTypes()[i]));
  return names;
}

size_t ItemSizeOf(const std::string& dtype) { return ItemSize(ValueOrThrow(ParseDType(dtype))); }

// A uint8 array over memory mapped for it alone (see StagingBuffer), freed with the array.
// NumPy advises its own large allocations into transparent huge pages. The first write to a huge
// page can cost many times that of small pages (on a VM whose host has reclaimed that memory,
// 348-730 ms against 33 ms for 256 MiB, nearly all in clearing it), which made restores into
// NumPy's memory take anywhere from 63 to 215 ms for the same 256 MiB on a 2-core VM.
// The tensorstash command (cli/run.h), run in this process: `args` as argv, the program name
// first. The GIL is released: the commands do IO and print progress from other threads.
int CliMain(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  int code;
  {
    nb::gil_scoped_release release;
    code = cli::Run(static_cast<int>(args.size()), argv.data());
    std::cout.flush();
    std::fflush(stdout);
  }
  return code;
}

nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> HostBuffer(size_t nbytes) {
  auto* owned = new StagingBuffer(nbytes);  // MemoryError when memory runs out
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<StagingBuffer*>(p); });
  return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(reinterpret_cast<uint8_t*>(owned->data()),
                                                      {nbytes}, owner);
}

// The defaults of the engine's options, for the Python signatures: written once, in C++.
nb::dict Defaults() {
  const WriterOptions writer;
  const ReaderOptions reader;
  nb::dict d;
  d["chunk_bytes"] = writer.target_chunk_bytes;
  d["data_file_bytes"] = writer.target_data_file_bytes;
  d["max_inflight_bytes"] = writer.max_inflight_bytes;
  d["read_max_inflight_bytes"] = reader.max_inflight_bytes;
  d["io_threads"] = writer.io_threads;
  d["zstd_level"] = ArraySpec{}.zstd_level;
  d["host_batch_bytes"] = kDefaultHostBatchBytes;
  d["coordination_timeout_s"] =
      std::chrono::duration<double>(kDefaultCoordinationTimeout).count();
  return d;
}

}  // namespace
}  // namespace tensorstash::python

NB_MODULE(_ext, m) {
  namespace py = tensorstash::python;
  m.doc() = "Native core of tensorstash: checkpoint writer, reader and manager.";
  m.attr("__version__") = tensorstash::kVersion;
  m.def("cli_main", &py::CliMain, nb::arg("args"),
        "Runs the tensorstash command with `args` (the program name first); its exit code.");
  m.def("dtype_names", &py::DTypeNames,
        "The element type names a checkpoint can store, as NumPy and ml_dtypes spell them.");
  m.def("defaults", &py::Defaults,
        "The engine's defaults: chunk_bytes, data_file_bytes, max_inflight_bytes (writes), "
        "read_max_inflight_bytes, io_threads, zstd_level, host_batch_bytes (restores hand "
        "buffers over in batches of about this size), coordination_timeout_s (seconds each "
        "collective step waits for the other processes).");
  m.def("item_size", &py::ItemSizeOf, nb::arg("dtype"),
        "Bytes per element of `dtype`; ValueError for an unknown name.");
  m.def("host_buffer", &py::HostBuffer, nb::arg("nbytes"),
        "A writable uint8 array of `nbytes` bytes (contents unspecified) in memory of its own, "
        "page-aligned when large, and never advised into transparent huge pages.");
  m.def("kept_freed_bytes", &tensorstash::StagingBufferKeptBytes,
        "Bytes of freed host buffers the engine keeps for reuse (TENSORSTASH_KEEP_FREED_BYTES "
        "caps them; util/staging_buffer.h).");
  m.def("release_kept_buffers", &tensorstash::ReleaseKeptStagingBuffers,
        "Gives the freed host buffers the engine keeps for reuse back to the system now.");
  m.def(
      "split_step_url",
      [](const std::string& url) {
        tensorstash::StepUrl split = py::ValueOrThrow(tensorstash::SplitStepUrl(url));
        return std::make_pair(split.root, split.step);
      },
      nb::arg("url"),
      "A step folder's path or store URL -> (the root's URL or absolute path, the step's "
      "name). ValueError when nothing is left for the step.");
  m.def(
      "has_url_scheme", [](const std::string& text) { return tensorstash::HasUrlScheme(text); },
      nb::arg("text"), "Whether `text` starts with '<scheme>://'.");
  m.def(
      "configure_s3",
      [](std::optional<std::string> endpoint, std::optional<std::string> region,
         std::optional<bool> path_style, std::optional<std::string> profile,
         std::optional<std::string> access_key_id, std::optional<std::string> secret_access_key,
         std::optional<std::string> session_token, bool anonymous,
         std::optional<std::string> prefix) {
        tensorstash::S3Defaults defaults;
        defaults.url_prefix = prefix.value_or("");
        defaults.settings.endpoint = std::move(endpoint);
        defaults.settings.region = std::move(region);
        defaults.settings.path_style = path_style;
        defaults.settings.profile = std::move(profile);
        if (anonymous) {
          defaults.credentials = tensorstash::AnonymousCredentials();
        } else if (access_key_id || secret_access_key) {
          if (!access_key_id || !secret_access_key) {
            throw nb::value_error(
                "configure_s3: give both access_key_id and secret_access_key, or neither");
          }
          defaults.credentials = tensorstash::StaticCredentials(
              {*access_key_id, *secret_access_key, session_token.value_or("")});
        }
        py::ThrowIfError(tensorstash::SetS3Defaults(std::move(defaults)));
      },
      nb::arg("endpoint") = nb::none(), nb::arg("region") = nb::none(),
      nb::arg("path_style") = nb::none(), nb::arg("profile") = nb::none(),
      nb::arg("access_key_id") = nb::none(), nb::arg("secret_access_key") = nb::none(),
      nb::arg("session_token") = nb::none(), nb::arg("anonymous") = false,
      nb::arg("prefix") = nb::none(),
      "Settings for s3:// URLs (kvstore/s3/s3_kvstore.h, SetS3Defaults); None keeps the "
      "environment's. With `prefix` (\"s3://bucket[/path]\"), only for URLs at or under it (the "
      "longest prefix wins). ValueError for settings that do not resolve or a prefix that is "
      "not an s3:// URL.");
  m.def(
      "export_safetensors",
      [](const std::string& src_root, const std::string& src_step, const std::string& dst_root,
         const std::string& dst_step, uint64_t max_shard_bytes, uint64_t max_inflight_bytes,
         int io_threads) {
        tensorstash::SafetensorsExportOptions options;
        options.max_shard_bytes = max_shard_bytes;
        if (max_inflight_bytes > 0) options.max_inflight_bytes = max_inflight_bytes;
        options.io_threads = io_threads;
        tensorstash::Result<tensorstash::SafetensorsExportResult> result = [&] {
          nb::gil_scoped_release release;
          return [&]() -> tensorstash::Result<tensorstash::SafetensorsExportResult> {
            TS_ASSIGN_OR_RETURN(std::unique_ptr<tensorstash::KvStore> src,
                                tensorstash::OpenKvStore(src_root, {.create = false}));
            TS_ASSIGN_OR_RETURN(std::unique_ptr<tensorstash::StepSource> source,
                                tensorstash::OpenStepSource(src.get(), src_step));
            TS_ASSIGN_OR_RETURN(std::unique_ptr<tensorstash::KvStore> dst,
                                tensorstash::OpenKvStore(dst_root, {.create = true}));
            return tensorstash::ExportSafetensors(source.get(), dst.get(), dst_step, options);
          }();
        }();
        tensorstash::SafetensorsExportResult r = py::ValueOrThrow(std::move(result));
        nb::dict out;
        out["files"] = r.files;
        out["total_bytes"] = r.total_bytes;
        out["tensors"] = r.tensors;
        out["skipped"] = r.skipped;
        return out;
      },
      nb::arg("src_root"), nb::arg("src_step"), nb::arg("dst_root"), nb::arg("dst_step"),
      nb::arg("max_shard_bytes"), nb::arg("max_inflight_bytes") = 0, nb::arg("io_threads") = 0,
      "Exports the step at src_root/src_step to a Hugging Face safetensors folder "
      "dst_root/dst_step (checkpoint/safetensors_export.h); a dict of files, total_bytes, "
      "tensors and skipped (non-array leaf paths).");
  m.def(
      "configure_gcs",
      [](std::optional<std::string> endpoint, std::optional<std::string> token, bool anonymous,
         std::optional<std::string> user_project, std::optional<std::string> prefix,
         std::optional<std::string> credentials_file, bool allow_http_token) {
        tensorstash::GcsDefaults defaults;
        defaults.allow_http_token = allow_http_token;
        defaults.url_prefix = prefix.value_or("");
        defaults.endpoint = endpoint.value_or("");
        defaults.credentials.anonymous = anonymous;
        defaults.credentials.token = std::move(token);
        defaults.credentials.credentials_file = std::move(credentials_file);
        defaults.user_project = user_project.value_or("");
        py::ThrowIfError(tensorstash::SetGcsDefaults(std::move(defaults)));
      },
      nb::arg("endpoint") = nb::none(), nb::arg("token") = nb::none(),
      nb::arg("anonymous") = false, nb::arg("user_project") = nb::none(),
      nb::arg("prefix") = nb::none(), nb::arg("credentials_file") = nb::none(),
      nb::arg("allow_http_token") = false,
      "Settings for gs:// URLs (kvstore/gcs/gcs_kvstore.h, SetGcsDefaults); None keeps the "
      "environment's. With `prefix` (\"gs://bucket[/path]\"), only for URLs at or under it (the "
      "longest prefix wins). ValueError for more than one of credentials_file, token and "
      "anonymous, a malformed credentials file, or a prefix that is not a gs:// URL; "
      "PermissionError for a credentials file that cannot be read.");
  m.def(
      "store_list",
      [](const std::string& url) {
        tensorstash::Result<tensorstash::ListedChildren> listed = [&] {
          nb::gil_scoped_release release;
          return [&]() -> tensorstash::Result<tensorstash::ListedChildren> {
            TS_ASSIGN_OR_RETURN(std::unique_ptr<tensorstash::KvStore> store,
                                tensorstash::OpenKvStore(url, {.create = false}));
            return store->ListChildren("");
          }();
        }();
        py::ThrowIfError(listed.status());
        std::vector<std::string> folders;
        for (std::string& prefix : listed->prefixes) {
          while (prefix.ends_with('/')) prefix.pop_back();
          folders.push_back(std::move(prefix));
        }
        return std::make_pair(std::move(listed->keys), std::move(folders));
      },
      nb::arg("url"),
      "(files, folders): the names of the files and folders right under the store URL `url` "
      "(kvstore ListChildren), each sorted; both empty for a prefix that holds nothing. For "
      "code that walks a root on an object store as it walks a local folder. OSError when the "
      "store cannot be opened or listed.");
  m.def(
      "store_read",
      [](const std::string& url, const std::string& key) -> std::optional<nb::bytes> {
        tensorstash::Result<std::string> value = [&] {
          nb::gil_scoped_release release;
          return [&]() -> tensorstash::Result<std::string> {
            TS_ASSIGN_OR_RETURN(std::unique_ptr<tensorstash::KvStore> store,
                                tensorstash::OpenKvStore(url, {.create = false}));
            return store->Read(key);
          }();
        }();
        if (absl::IsNotFound(value.status())) return std::nullopt;
        py::ThrowIfError(value.status());
        return nb::bytes(value->data(), value->size());
      },
      nb::arg("url"), nb::arg("key"),
      "The bytes of the file `key` under the store URL `url`, or None when there is none. "
      "OSError when the store cannot be opened or read.");
  m.def("store_schemes", &tensorstash::RegisteredKvStoreSchemes,
        "The URL schemes stores can be opened with (plain paths are local folders).");
  py::DefineWriter(m);
  py::DefineReader(m);
  py::DefineManager(m);
  py::DefineOrbaxWriter(m);
  py::DefineJson(m);
  py::DefinePeerServer(m);
  py::DefineHoldings(m);
}
