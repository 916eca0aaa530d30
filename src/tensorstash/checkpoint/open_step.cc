#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/format/orbax_names.h"

#include <algorithm>

#include "tensorstash/engine/layout.h"
#include "tensorstash/checkpoint/orbax_reader.h"
#include "tensorstash/checkpoint/dcp_reader.h"
#include "tensorstash/checkpoint/safetensors_reader.h"
#include "tensorstash/format/safetensors/safetensors_header.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

// Orbax writes a step or item into "<name>.orbax-checkpoint-tmp-<n>" and renames it when done.

bool Exists(KvStore* kv, const std::string& key) { return kv->Size(key).ok(); }

// The native CheckpointReader as a StepSource.
class NativeStepSource final : public StepSource {
 public:
  explicit NativeStepSource(std::unique_ptr<CheckpointReader> reader)
      : reader_(std::move(reader)) {}

  StepFormat format() const override { return StepFormat::kNative; }
  const std::string& dir() const override { return reader_->dir(); }
  const TreeNode& tree() const override { return reader_->tree(); }
  const std::vector<ArrayMetadata>& arrays() const override { return reader_->arrays(); }
  uint64_t StoredBytes(size_t id) const override { return reader_->StoredBytes(id); }
  int64_t NumChunks(size_t id) const override {
    return reader_->arrays()[id].grid.NumStoredChunks();
  }
  std::string CodecDescription(size_t id) const override {
    return std::string(CodecName(reader_->arrays()[id].codec));
  }
  int64_t created_unix_ms() const override { return reader_->commit_record().created_unix_ms; }
  int process_count() const override { return reader_->commit_record().process_count; }
  Status ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats,
                  const std::function<void(uint64_t, uint64_t)>& progress) override {
    return reader_->ReadMany(requests, stats, progress);
  }
  Result<std::string> ReadFile(std::string_view name) const override {
    return reader_->ReadFile(name);
  }
  Result<std::vector<BadChunk>> Verify(
      const std::function<void(uint64_t, uint64_t)>& progress) override {
    return reader_->Verify(progress);
  }
  uint64_t VerifyTotalBytes() const override {
    uint64_t total = 0;
    for (const IndexEntry& e : reader_->index().entries) total += e.length;
    return total;
  }
  size_t VerifyTotalItems() const override {
    return reader_->index().entries.size() + reader_->commit_record().files.size();
  }
  CheckpointReader* native() override { return reader_.get(); }
  std::vector<Result<MappedBox>> MapMany(const std::vector<ReadRequest>& requests,
                                         const MapOptions& options) override {
    return reader_->MapMany(requests, options);
  }

 private:
  std::unique_ptr<CheckpointReader> reader_;
};

}  // namespace


Result<DetectedStep> DetectStepFormat(KvStore* kv, const std::string& dir) {
  TS_RETURN_IF_ERROR(ValidateKey(dir));
  DetectedStep step{StepFormat::kNative, dir};
  if (Exists(kv, StrCat(dir, "/", kCommitFileName))) return step;
  // A safetensors file named directly.
  if (dir.size() > 12 && dir.compare(dir.size() - 12, 12, ".safetensors") == 0 &&
      Exists(kv, dir)) {
    step.format = StepFormat::kSafetensors;
    return step;
  }
  if (dir.find(kOrbaxTmpMarker) != std::string::npos) {
    return FailedPreconditionError(
        StrCat("'", dir,
               "' is the temporary folder of an Orbax save (running, failed or crashed), "
               "not a finished checkpoint; it cannot be read"));
  }
  if (Exists(kv, StrCat(dir, "/", kOrbaxMetadataFileName))) {
    step.format = Exists(kv, StrCat(dir, "/", kOcdbtManifestFileName)) ? StepFormat::kOrbaxOcdbt
                                                                       : StepFormat::kOrbaxFolders;
    return step;
  }
  if (Exists(kv, StrCat(dir, "/.zgroup")) || Exists(kv, StrCat(dir, "/zarr.json"))) {
    step.format = StepFormat::kZarrGroup;
    return step;
  }
  // A Hugging Face folder of safetensors files (looked for after the formats above, so that
  // opening those costs no extra request on an object store).
  if (Exists(kv, StrCat(dir, "/", kSafetensorsIndexFileName)) ||
      Exists(kv, StrCat(dir, "/", kSafetensorsSingleFileName))) {
    step.format = StepFormat::kSafetensors;
    return step;
  }
  // A PyTorch DCP checkpoint (FileSystemWriter writes .metadata last, once every rank's files
  // are written).
  if (Exists(kv, StrCat(dir, "/", kDcpMetadataFileName))) {
    step.format = StepFormat::kDcp;
    return step;
  }
  // An Orbax CheckpointManager step: items in subfolders ("default", "state", ...).
  Result<std::vector<std::string>> keys = kv->List(StrCat(dir, "/"));
  if (!keys.ok()) return step;  // the native reader reports the missing folder
  std::vector<std::string> items;
  bool orbax_step = false;
  for (const std::string& key : *keys) {
    const std::string_view rest = std::string_view(key).substr(dir.size() + 1);
    if (rest == kOrbaxCheckpointMetadataFileName) orbax_step = true;
    const size_t slash = rest.find('/');
    if (slash != std::string_view::npos && rest.substr(slash + 1) == kOrbaxMetadataFileName) {
      items.emplace_back(rest.substr(0, slash));
    }
  }
  if (items.empty()) {
    if (orbax_step && !keys->empty()) {
      return FailedPreconditionError(
          StrCat("'", dir,
                 "' is an Orbax checkpoint without _METADATA: an incomplete save, or an "
                 "item type other than a PyTree; it cannot be read"));
    }
    return step;
  }
  std::string item;
  if (items.size() == 1) {
    item = items[0];
  } else if (std::find(items.begin(), items.end(), "default") != items.end()) {
    item = "default";
  } else {
    return InvalidArgumentError(StrCat("'", dir, "' is an Orbax step with several items (",
                                       StrJoin(items, ", "), "); open one of them, e.g. '", dir,
                                       "/", items[0], "'"));
  }
  TS_ASSIGN_OR_RETURN(step, DetectStepFormat(kv, StrCat(dir, "/", item)));
  return step;
}

Result<std::unique_ptr<StepSource>> OpenStepSource(KvStore* kv, const std::string& dir,
                                                   ReaderOptions options) {
  TS_ASSIGN_OR_RETURN(DetectedStep step, DetectStepFormat(kv, dir));
  if (step.format == StepFormat::kNative) {
    TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                        CheckpointReader::Open(kv, step.dir, options));
    return std::unique_ptr<StepSource>(new NativeStepSource(std::move(reader)));
  }
  if (step.format == StepFormat::kSafetensors) {
    TS_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> reader,
                        SafetensorsReader::Open(kv, step.dir, options));
    return std::unique_ptr<StepSource>(std::move(reader));
  }
  if (step.format == StepFormat::kDcp) {
    TS_ASSIGN_OR_RETURN(std::unique_ptr<DcpReader> reader, DcpReader::Open(kv, step.dir, options));
    return std::unique_ptr<StepSource>(std::move(reader));
  }
  TS_ASSIGN_OR_RETURN(std::unique_ptr<OrbaxReader> reader,
                      OrbaxReader::Open(kv, step.dir, step.format, options));
  return std::unique_ptr<StepSource>(std::move(reader));
}

}  // namespace tensorstash
