#include "tensorstash/manager/step_listing.h"

#include <nlohmann/json.hpp>

#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/format/orbax_names.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

constexpr uint64_t kMaxSmallJsonBytes = 1 << 20;

// A small JSON document (sized before it is read); a discarded value when absent or unreadable.
nlohmann::json ReadSmallJson(KvStore* kv, const std::string& key) {
  Result<uint64_t> size = kv->Size(key);
  if (!size.ok() || *size > kMaxSmallJsonBytes) return nlohmann::json::value_t::discarded;
  Result<std::string> text = kv->Read(key);
  if (!text.ok()) return nlohmann::json::value_t::discarded;
  return nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
}

void DescribeForeign(KvStore* kv, StepListing* row) {
  // A foreign step: Orbax (an item with _METADATA) or a zarr group with write_completed.
  Result<DetectedStep> detected = DetectStepFormat(kv, row->name);
  if (!detected.ok() || detected->format == StepFormat::kNative) return;
  row->status = std::string(StepFormatName(detected->format));
  if (detected->format == StepFormat::kZarrGroup) {
    const nlohmann::json attrs = ReadSmallJson(kv, StrCat(detected->dir, "/.zattrs"));
    if (!attrs.is_object() || !attrs.contains("write_completed") ||
        attrs["write_completed"] != true) {
      row->status = "incomplete";
    }
  }
  const nlohmann::json meta =
      ReadSmallJson(kv, StrCat(row->name, "/", kOrbaxCheckpointMetadataFileName));
  if (meta.is_object() && meta.contains("commit_timestamp_nsecs") &&
      meta["commit_timestamp_nsecs"].is_number_integer()) {
    row->created_unix_ms = meta["commit_timestamp_nsecs"].get<int64_t>() / 1000000;
  }
}

}  // namespace

Result<std::vector<StepListing>> ListCheckpointRoot(KvStore* kv) {
  TS_ASSIGN_OR_RETURN(ListedChildren top, kv->ListChildren(""));
  std::vector<StepListing> rows;
  for (const std::string& prefix : top.prefixes) {
    StepListing row;
    row.name = prefix.substr(0, prefix.size() - 1);
    row.status = "incomplete";
    bool has_commit = false;
    bool retired = false;
    if (Result<std::vector<std::string>> keys = kv->List(prefix); keys.ok()) {
      for (const std::string& key : *keys) {
        if (Result<uint64_t> size = kv->Size(key); size.ok()) row.bytes += *size;
        const std::string_view relative = std::string_view(key).substr(prefix.size());
        if (relative == kCommitFileName) has_commit = true;
        if (relative == kRetiredFileName) retired = true;
      }
    }
    if (IsTemporaryStepName(row.name) || row.name.find(kOrbaxTmpMarker) != std::string::npos) {
      row.status = "temporary";
    } else if (!has_commit) {
      DescribeForeign(kv, &row);
    } else if (retired) {
      // Dropped by a manager's retention, kept for the data other steps refer to: not opened
      // (its own references may name steps deleted since).
      row.status = "retired";
    } else {
      // Complete only when it opens: COMMIT (sized before it is read), tree.json and the index
      // all check, as a restore and the manager require.
      Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv, row.name);
      if (reader.ok()) {
        row.status = "complete";
        row.created_unix_ms = (*reader)->commit_record().created_unix_ms;
        row.depends_on = (*reader)->commit_record().depends_on;
        const ChunkIndex& index = (*reader)->index();
        for (const IndexEntry& e : index.entries) {
          if (!index.files[e.file_id].step.empty()) row.borrowed_bytes += e.length;
        }
      } else {
        row.status = "damaged";
        row.problem = std::string(reader.status().message());
      }
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

}  // namespace tensorstash
