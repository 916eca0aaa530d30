// `tensorstash convert SRC DST`: rewrite a checkpoint in the other format. With --materialize,
// a tensorstash step into a self-contained tensorstash step (an incremental step's borrowed
// chunks copied in: docs/format.md 6.1).
//
// Both directions stream: each chunk is read from the source (StepSource: native, Orbax, a zarr
// group) when the writer writes it (a ChunkSource, array/chunk_source.h), so memory stays at a
// few chunks (the writer's max_inflight_bytes). DST appears whole or not at all, and an
// existing DST is refused unless --overwrite. Ctrl-C (or SIGTERM) makes the next read of the
// source fail, so that the writer removes its temporary folder before the command exits (130);
// a second signal ends it at once.
#include <signal.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "common.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/checkpoint/materialize.h"
#include "tensorstash/checkpoint/orbax_writer.h"
#include "tensorstash/checkpoint/safetensors_export.h"
#include "tensorstash/engine/step_folder.h"
#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/format/orbax_names.h"
#include "tensorstash/format/safetensors/safetensors_header.h"
#include "tensorstash/kvstore/registry.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash::cli {
namespace {

// Set by SIGINT/SIGTERM while a convert runs (InterruptGuard).
volatile sig_atomic_t g_interrupted = 0;

void OnInterrupt(int signal) { g_interrupted = signal; }

// While alive, the first SIGINT or SIGTERM only sets g_interrupted (SA_RESETHAND: the second
// one acts as usual); the handlers before are put back when it goes.
class InterruptGuard {
 public:
  InterruptGuard() {
    g_interrupted = 0;
    struct sigaction action = {};
    action.sa_handler = OnInterrupt;
    action.sa_flags = SA_RESETHAND;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~InterruptGuard() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;

 private:
  struct sigaction old_int_ = {};
  struct sigaction old_term_ = {};
};

Status Interrupted() {
  return CancelledError(StrCat("interrupted by signal ", static_cast<int>(g_interrupted),
                               ": nothing was written (the partial copy was removed)"));
}

// One array of a checkpoint being converted.
struct SourceArray {
  std::string path;  // array path (format/tree.h)
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<int64_t> chunk_shape;  // how the source stores it: the unit the writer asks for
  Codec codec = Codec::kNone;        // the source's, where it has one (native steps)
  int zstd_level = 3;
  int64_t chunk_bytes = 0;           // the source's chunk size in bytes (0: the writer's default)
};

// A checkpoint to convert from: its tree (array leaves index arrays()) and reads of any box.
// Read may be called from several threads at once.
class ConvertSource {
 public:
  virtual ~ConvertSource() = default;
  virtual const TreeNode& tree() const = 0;
  virtual const std::vector<SourceArray>& arrays() const = 0;
  // Fills `dest` (C order over `box`, the array's dtype) with array `id`'s values.
  virtual Status Read(size_t id, const Box& box, void* dest) = 0;
};

// Any step the readers understand (StepSource: native, Orbax, zarr group), as a ConvertSource.
class StepConvertSource final : public ConvertSource {
 public:
  // Opens the step at `location` (whose store it keeps).
  static Result<std::unique_ptr<StepConvertSource>> Open(StepLocation location) {
    auto source = std::unique_ptr<StepConvertSource>(new StepConvertSource());
    source->location_ = std::move(location);
    TS_ASSIGN_OR_RETURN(source->step_,
                        OpenStepSource(source->location_.kv.get(), source->location_.key));
    for (const ArrayMetadata& a : source->step_->arrays()) {
      int64_t chunk_elements = 1;
      for (int64_t c : a.grid.chunk_shape) chunk_elements *= std::max<int64_t>(c, 1);
      source->arrays_.push_back({a.path, a.dtype, a.shape(), a.grid.chunk_shape, a.codec,
                                 a.zstd_level > 0 ? a.zstd_level : 3,
                                 chunk_elements * static_cast<int64_t>(ItemSize(a.dtype))});
    }
    return source;
  }
  const TreeNode& tree() const override { return step_->tree(); }
  const std::vector<SourceArray>& arrays() const override { return arrays_; }
  StepFormat format() const { return step_->format(); }
  StepSource* step() const { return step_.get(); }
  const StepLocation& location() const { return location_; }
  Status Read(size_t id, const Box& box, void* dest) override {
    if (g_interrupted != 0) return Interrupted();
    return step_->ReadMany({{arrays_[id].path, box, arrays_[id].dtype, dest}}, nullptr, nullptr);
  }

 private:
  StepConvertSource() = default;
  StepLocation location_;
  std::unique_ptr<StepSource> step_;
  std::vector<SourceArray> arrays_;
};

enum class Format { kNative, kOrbax };

// SRC opened, and its format (the library's detection, step_source.h): an Orbax CheckpointManager
// step with `item` names that item's folder.
Result<std::pair<StepLocation, Format>> OpenSource(const std::string& path,
                                                   const std::string& item) {
  TS_ASSIGN_OR_RETURN(StepLocation location, OpenStepPath(path));
  if (!item.empty()) {
    const std::string item_key = StrCat(location.key, "/", item);
    if (location.kv->Size(StrCat(item_key, "/", kOrbaxMetadataFileName)).ok())
      location.key = item_key;
  }
  TS_ASSIGN_OR_RETURN(DetectedStep detected, DetectStepFormat(location.kv.get(), location.key));
  const Format format = detected.format == StepFormat::kNative ? Format::kNative : Format::kOrbax;
  return std::make_pair(std::move(location), format);
}

// DST's parent store (created if missing) and DST's name in it.
Result<StepLocation> OpenDestination(const std::string& path) {
  TS_ASSIGN_OR_RETURN(StepUrl url, SplitStepUrl(path));
  StepLocation location;
  TS_ASSIGN_OR_RETURN(location.kv, OpenKvStore(url.root, {.create = true}));
  location.key = url.step;
  return location;
}

uint64_t TotalBytes(const ConvertSource& source) {
  uint64_t total = 0;
  for (const SourceArray& a : source.arrays()) {
    total += static_cast<uint64_t>(Box::FromShape(a.shape).num_elements()) * ItemSize(a.dtype);
  }
  return total;
}

Status WriteOrbax(ConvertSource* source, StepLocation* dst, bool overwrite,
                  const std::string& item) {
  OrbaxWriterOptions options;
  options.overwrite = overwrite;
  options.item = item;
  TS_ASSIGN_OR_RETURN(std::unique_ptr<OrbaxWriter> writer,
                      OrbaxWriter::Create(dst->kv.get(), dst->key, options));
  const std::vector<SourceArray>& arrays = source->arrays();
  for (size_t id = 0; id < arrays.size(); ++id) {
    const SourceArray& a = arrays[id];
    std::vector<int64_t> chunk = a.chunk_shape;
    for (int64_t& c : chunk) c = std::max<int64_t>(c, 1);
    TS_RETURN_IF_ERROR(writer->AddArray(
        {a.path, a.dtype, a.shape, OrbaxValueType::kNumpyArray}, std::move(chunk),
        [source, id](const Box& box, void* dest) { return source->Read(id, box, dest); }));
  }
  writer->SetTree(source->tree());
  ProgressBar bar("convert", TotalBytes(*source));
  return writer->Commit(nullptr, [&](uint64_t done, uint64_t) { bar.Update(done); });
}

// The bytes free (to an unprivileged user) on the filesystem of DST when it is a local path
// (or file:// URL), from its nearest existing folder; nothing for another store.
std::optional<uint64_t> FreeBytesAt(std::string_view dst) {
  if (dst.rfind("file://", 0) == 0) {
    dst.remove_prefix(7);
  } else if (dst.find("://") != std::string_view::npos) {
    return std::nullopt;
  }
  std::error_code error;
  std::filesystem::path at = std::filesystem::absolute(std::filesystem::path(dst), error);
  if (error) return std::nullopt;
  while (!std::filesystem::exists(at, error) && at.has_parent_path() && at != at.root_path()) {
    at = at.parent_path();
  }
  struct statvfs fs;
  if (::statvfs(at.c_str(), &fs) != 0) return std::nullopt;
  return static_cast<uint64_t>(fs.f_bavail) * static_cast<uint64_t>(fs.f_frsize);
}

// What the arrays of `total` bytes need at `dst_dir`, checked against the space free at a local
// DST, so that a hostile shape of fill values fails at once instead of filling the disk.
Status CheckFreeSpace(uint64_t total, std::optional<uint64_t> free_at_dst,
                      const std::string& dst_dir) {
  if (free_at_dst.has_value() && total > *free_at_dst) {
    return ResourceExhaustedError(StrCat("the source's arrays claim ", total,
                                         " bytes, more than the ", *free_at_dst,
                                         " bytes free at '", dst_dir, "'"));
  }
  return OkStatus();
}

Status WriteNative(ConvertSource* source, StepLocation* dst, bool overwrite,
                   std::optional<uint64_t> free_at_dst) {
  WriterOptions options;
  options.overwrite = overwrite;
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                      CheckpointWriter::Create(dst->kv.get(), dst->key, options));
  // Each chunk is read from the source when the writer writes it (a chunk source): at most
  // max_inflight_bytes of the checkpoint is in memory at once, however large it is. What the
  // metadata claims is checked first against the space free at a local DST, so that a hostile
  // shape of fill values fails at once instead of filling the disk.
  const uint64_t total = TotalBytes(*source);
  TS_RETURN_IF_ERROR(CheckFreeSpace(total, free_at_dst, dst->key));
  ProgressBar bar("convert", total);
  std::mutex progress_mutex;  // chunks are read from several threads
  uint64_t done = 0;
  const std::vector<SourceArray>& arrays = source->arrays();
  for (size_t id = 0; id < arrays.size(); ++id) {
    const SourceArray& a = arrays[id];
    ArraySpec spec;
    spec.path = a.path;
    spec.dtype = a.dtype;
    spec.shape = a.shape;
    ChunkSource read = [&, id](const Box& box, void* dest) {
      TS_RETURN_IF_ERROR(source->Read(id, box, dest));
      std::lock_guard<std::mutex> lock(progress_mutex);
      done += static_cast<uint64_t>(box.num_elements()) * ItemSize(arrays[id].dtype);
      bar.Update(done);
      return OkStatus();
    };
    TS_RETURN_IF_ERROR(writer->AddArrayFromSource(std::move(spec), std::move(read)));
  }
  writer->SetTree(source->tree());
  return writer->Commit();
}

// `--to safetensors`: a Hugging Face folder (checkpoint/safetensors_export.h). --overwrite
// replaces only a folder that is a safetensors export (it has the index). Where the store
// renames folders, the new export is written beside the old one, which is deleted only once
// the new one is whole; on object stores (no rename) the old one is deleted first.
int RunExportSafetensors(const std::string& src, const std::string& dst, const std::string& item,
                         bool overwrite, uint64_t max_shard_bytes) {
  Result<std::pair<StepLocation, Format>> opened_source = OpenSource(src, item);
  if (!opened_source.ok()) return Fail(opened_source.status());
  StepLocation location = std::move(opened_source->first);
  Result<std::unique_ptr<StepSource>> step = OpenStepSource(location.kv.get(), location.key);
  if (!step.ok()) return Fail(step.status());
  Result<StepLocation> destination = OpenDestination(dst);
  if (!destination.ok()) return Fail(destination.status());
  KvStore* kv = destination->kv.get();
  const std::string& key = destination->key;
  std::string target = key;  // where the export is written; a sibling when replacing
  Result<std::vector<std::string>> there = kv->List(StrCat(key, "/"));
  if (there.ok() && !there->empty()) {
    if (!overwrite) {
      return Fail(AlreadyExistsError(StrCat("'", dst, "' exists; pass --overwrite to replace it")));
    }
    if (!kv->Size(StrCat(key, "/", kSafetensorsIndexFileName)).ok()) {
      return Fail(FailedPreconditionError(
          StrCat("'", dst, "' is not a safetensors folder (no ", kSafetensorsIndexFileName,
                 "); it is not replaced")));
    }
    if (kv->SupportsRename()) {
      target = StrCat(key, ".replacing-", RandomHexId(8));
    } else if (Status s = kv->DeletePrefix(StrCat(key, "/")); !s.ok()) {
      return Fail(s);
    }
  }
  SafetensorsExportOptions options;
  if (max_shard_bytes > 0) options.max_shard_bytes = max_shard_bytes;
  uint64_t total = 0;
  for (const ArrayMetadata& a : (*step)->arrays()) {
    total += static_cast<uint64_t>(Box::FromShape(a.shape()).num_elements()) * ItemSize(a.dtype);
  }
  const auto start = std::chrono::steady_clock::now();
  ProgressBar bar("export", total);
  Result<SafetensorsExportResult> result =
      ExportSafetensors(step->get(), kv, target, options,
                        [&](uint64_t done, uint64_t) { bar.Update(done); });
  if (!result.ok()) {
    if (target != key) (void)kv->DeletePrefix(StrCat(target, "/"));
    return Fail(result.status());
  }
  if (target != key) {
    if (Status s = kv->DeletePrefix(StrCat(key, "/")); !s.ok()) return Fail(s);
    if (Status s = kv->RenameDirectory(target, key); !s.ok()) {
      return Fail(Annotate(s, StrCat("the new export is whole at '", target,
                                     "'; it could not be renamed to '", key, "'")));
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("exported %zu tensors (%s) from %s to safetensors at %s (%zu files) in %.2f s\n",
              result->tensors, HumanBytes(result->total_bytes).c_str(),
              std::string(StepFormatName((*step)->format())).c_str(), dst.c_str(),
              result->files.size(), seconds);
  if (!result->skipped.empty()) {
    std::printf("not exported (not arrays; safetensors holds tensors only): %s\n",
                StrJoin(result->skipped, ", ").c_str());
  }
  return 0;
}

int RunConvert(const std::string& src, const std::string& dst, const std::string& to,
               const std::string& item, bool overwrite, bool materialize) {
  Result<std::pair<StepLocation, Format>> opened_source = OpenSource(src, item);
  if (!opened_source.ok()) return Fail(opened_source.status());
  const Format from = opened_source->second;
  if (materialize && (from != Format::kNative || (!to.empty() && to != "native"))) {
    return Fail(InvalidArgumentError(StrCat(
        "--materialize copies a tensorstash step into a self-contained tensorstash step; '", src,
        "' is not one, or --to names another format")));
  }
  Format target = from == Format::kNative ? Format::kOrbax : Format::kNative;
  if (to == "orbax") target = Format::kOrbax;
  if (to == "native" || materialize) target = Format::kNative;
  // An existing DST is refused by the writers unless --overwrite (and never deleted when it is
  // not a checkpoint: step_folder.h).
  Result<std::unique_ptr<StepConvertSource>> opened =
      StepConvertSource::Open(std::move(opened_source->first));
  if (!opened.ok()) return Fail(opened.status());
  const StepFormat opened_step_format = (*opened)->format();
  std::unique_ptr<ConvertSource> source = *std::move(opened);
  Result<StepLocation> destination = OpenDestination(dst);
  if (!destination.ok()) return Fail(destination.status());
  if (!overwrite) {
    // The writers refuse it too; this says so in the CLI's words.
    Result<FolderContent> there = ClassifyStepFolder(destination->kv.get(), destination->key);
    if (there.ok() &&
        (*there == FolderContent::kTensorstashStep || *there == FolderContent::kOrbaxCheckpoint)) {
      return Fail(AlreadyExistsError(StrCat("'", dst, "' exists; pass --overwrite to replace it")));
    }
  }
  const auto start = std::chrono::steady_clock::now();
  Status status;
  {
    InterruptGuard guard;
    if (materialize) {
      // A self-contained copy (checkpoint/materialize.h): each array keeps its codec and
      // chunks, and the step's committed files (metadata, metrics, per-process state) come too.
      const StepLocation& from = static_cast<StepConvertSource*>(source.get())->location();
      status = CheckFreeSpace(TotalBytes(*source), FreeBytesAt(dst), destination->key);
      ProgressBar bar("convert", TotalBytes(*source));
      WriterOptions options;
      options.overwrite = overwrite;
      if (status.ok()) {
        status = MaterializeStep(from.kv.get(), from.key, destination->kv.get(),
                                 destination->key, options,
                                 [&](uint64_t done, uint64_t) -> Status {
                                   if (g_interrupted != 0) return Interrupted();
                                   bar.Update(done);
                                   return OkStatus();
                                 });
      }
    } else {
      status = target == Format::kOrbax
                   ? WriteOrbax(source.get(), &*destination, overwrite, item)
                   : WriteNative(source.get(), &*destination, overwrite, FreeBytesAt(dst));
    }
    if (status.ok() && g_interrupted != 0) status = OkStatus();  // it finished all the same
  }
  if (absl::IsCancelled(status) && g_interrupted != 0) {
    Fail(status);
    return 128 + static_cast<int>(g_interrupted);
  }
  if (!status.ok()) return Fail(status);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("converted %zu arrays (%s) from %s to %s at %s in %.2f s\n", source->arrays().size(),
              HumanBytes(TotalBytes(*source)).c_str(),
              std::string(StepFormatName(opened_step_format)).c_str(),
              target == Format::kNative ? "tensorstash" : "Orbax", dst.c_str(), seconds);
  return 0;
}

}  // namespace

void AddConvertCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand(
      "convert",
      "Rewrite a checkpoint in another format: tensorstash step <-> Orbax (OCDBT + zarr3); "
      "safetensors (a file or a Hugging Face folder) -> either; any -> a Hugging Face "
      "safetensors folder (--to safetensors)");
  struct Args {
    std::string src, dst, to, item;
    bool overwrite = false;
    bool materialize = false;
    uint64_t max_shard_bytes = 0;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("SRC", args->src, "A tensorstash step folder or an Orbax checkpoint folder")
      ->required();
  cmd->add_option("DST", args->dst, "The folder to create")->required();
  cmd->add_option("--to", args->to, "Target format (default: the other one)")
      ->check(CLI::IsMember({"orbax", "native", "safetensors"}));
  cmd->add_option("--max-shard-bytes", args->max_shard_bytes,
                  "With --to safetensors: tensor bytes per file (default 5 GiB)");
  cmd->add_option("--item", args->item,
                  "Orbax CheckpointManager item: write DST as a step holding this item (e.g. "
                  "default), or read SRC's item");
  cmd->add_flag("--overwrite", args->overwrite, "Replace DST if it exists");
  cmd->add_flag("--materialize", args->materialize,
                "SRC is a tensorstash step (an incremental one, say): write DST as a "
                "self-contained tensorstash step holding every byte, with the same arrays, "
                "codecs, chunk sizes and committed files, that restores without SRC's bases");
  cmd->callback([args, exit_code] {
    *exit_code = args->to == "safetensors"
                     ? RunExportSafetensors(args->src, args->dst, args->item, args->overwrite,
                                            args->max_shard_bytes)
                     : RunConvert(args->src, args->dst, args->to, args->item, args->overwrite,
                                  args->materialize);
  });
}

}  // namespace tensorstash::cli
