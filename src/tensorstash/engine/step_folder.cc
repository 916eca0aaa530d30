#include "tensorstash/engine/step_folder.h"

#include <cstring>
#include <vector>

#include "tensorstash/engine/layout.h"
#include "tensorstash/engine/object_store_commit.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/format/orbax_names.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

bool AllDigits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

bool ConsumePrefix(std::string_view* s, std::string_view prefix) {
  if (!s->starts_with(prefix)) return false;
  s->remove_prefix(prefix.size());
  return true;
}

// "<digits>-<digits>.dat"
bool IsDataFileName(std::string_view name) {
  if (!name.ends_with(".dat")) return false;
  name.remove_suffix(4);
  const size_t dash = name.find('-');
  return dash != std::string_view::npos && AllDigits(name.substr(0, dash)) &&
         AllDigits(name.substr(dash + 1));
}

}  // namespace

bool IsTensorstashStepKey(std::string_view key) {
  // The file store writes whole objects to "<key>.tmp.<16 hex>" first (docs/format.md).
  if (const size_t tmp = key.rfind(".tmp.");
      tmp != std::string_view::npos && IsHexId(key.substr(tmp + 5))) {
    key = key.substr(0, tmp);
  }
  if (key == kCommitFileName || key == kMetadataFileName || key == kMetricsFileName ||
      key == kRetiredFileName) {
    return true;
  }
  // Steps on object stores: numbered commit records, and attempts holding a step's files.
  if (ParseCommitRecordName(key)) return true;
  if (const size_t slash = key.find('/');
      slash != std::string_view::npos && IsAttemptName(key.substr(0, slash))) {
    const std::string_view inside = key.substr(slash + 1);
    return inside != kCommitFileName && IsTensorstashStepKey(inside);
  }
  std::string_view rest = key;
  if (ConsumePrefix(&rest, kProcessStateFolder) && ConsumePrefix(&rest, "/"))
    return AllDigits(rest);
  rest = key;
  if (!ConsumePrefix(&rest, kStateItem) || !ConsumePrefix(&rest, "/")) return false;
  if (rest == kTreeFileName || rest == kIndexFileName) return true;
  if (ConsumePrefix(&rest, "index.part-")) return AllDigits(rest);
  if (ConsumePrefix(&rest, "data/")) return IsDataFileName(rest);
  return false;
}

Result<FolderContent> ClassifyStepFolder(KvStore* kv, std::string_view dir) {
  const std::string prefix = StrCat(dir, "/");
  TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, kv->List(prefix));
  if (keys.empty()) return FolderContent::kEmpty;
  bool all_ours = true;
  bool orbax = false;
  for (const std::string& key : keys) {
    const std::string_view relative = std::string_view(key).substr(prefix.size());
    if (relative == kCommitFileName) return FolderContent::kTensorstashStep;
    if (!IsTensorstashStepKey(relative)) all_ours = false;
    const size_t slash = relative.find('/');
    const std::string_view top = relative.substr(0, slash);
    const std::string_view below =
        slash == std::string_view::npos ? std::string_view() : relative.substr(slash + 1);
    if ((slash == std::string_view::npos &&
         (top == kOrbaxMetadataFileName || top == kOrbaxCheckpointMetadataFileName ||
          top == kOcdbtManifestFileName)) ||
        below == kOrbaxMetadataFileName) {
      orbax = true;
    }
  }
  if (all_ours) return FolderContent::kTensorstashLeftover;
  return orbax ? FolderContent::kOrbaxCheckpoint : FolderContent::kOther;
}

Result<FolderContent> CheckSaveDestination(KvStore* kv, std::string_view dir, bool overwrite) {
  TS_ASSIGN_OR_RETURN(FolderContent content, ClassifyStepFolder(kv, dir));
  switch (content) {
    case FolderContent::kEmpty:
    case FolderContent::kTensorstashLeftover:
      return content;
    case FolderContent::kTensorstashStep:
      if (overwrite) return content;
      return AlreadyExistsError(StrCat("step '", dir, "' already exists in ", kv->Describe(),
                                       " and is complete; pass overwrite to replace it"));
    case FolderContent::kOrbaxCheckpoint:
      if (overwrite) return content;
      return AlreadyExistsError(StrCat("'", dir, "' in ", kv->Describe(),
                                       " holds an Orbax checkpoint; pass overwrite to replace it"));
    case FolderContent::kOther:
      break;
  }
  return AlreadyExistsError(StrCat(
      "'", dir, "' in ", kv->Describe(),
      " already exists and is neither a tensorstash step nor "
      "an Orbax checkpoint; tensorstash does not delete it (with or without overwrite): choose "
      "another path or remove it yourself"));
}

std::optional<std::string_view> LeftoverBase(std::string_view name) {
  constexpr size_t kIdDigits = 16;
  for (const char* marker : {kTempMarker, kOldMarker}) {
    const size_t length = std::strlen(marker) + kIdDigits;
    if (name.size() <= length) continue;
    const std::string_view base = name.substr(0, name.size() - length);
    const std::string_view tail = name.substr(base.size());
    if (tail.starts_with(marker) && IsHexId(tail.substr(std::strlen(marker)), kIdDigits)) {
      return base;
    }
  }
  return std::nullopt;
}

}  // namespace tensorstash
