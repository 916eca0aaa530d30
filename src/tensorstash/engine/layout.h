// Names of the files and folders of a step, shared by the writer, the reader and the CLI
// (docs/format.md, "Layout").
#ifndef TENSORSTASH_ENGINE_LAYOUT_H_
#define TENSORSTASH_ENGINE_LAYOUT_H_

#include <string>
#include <string_view>

#include "tensorstash/util/str_util.h"

namespace tensorstash {

inline constexpr char kStateItem[] = "state";
inline constexpr char kTreeFileName[] = "tree.json";
inline constexpr char kIndexFileName[] = "index";
// A step folder being written (or left by a crash) is named "<step>.tmp-<nonce>"; a step being
// replaced is moved aside to "<step>.old-<nonce>" (hex nonces, no dots).
inline constexpr char kTempMarker[] = ".tmp-";
inline constexpr char kOldMarker[] = ".old-";
// The files a manager's steps hold besides the arrays (CheckpointReader::ReadFile).
inline constexpr char kMetadataFileName[] = "metadata.json";
inline constexpr char kMetricsFileName[] = "metrics.json";
inline constexpr char kProcessStateFolder[] = "process";
// A manager's mark on a committed step that retention dropped while a kept step still refers
// to its data (incremental steps, docs/format.md 6.1): the step is no longer listed, and is
// deleted once no kept step depends on it.
inline constexpr char kRetiredFileName[] = "RETIRED";
// "process/<index>": one process's own state (e.g. its data-iterator position).
inline std::string ProcessStateFileName(int process_index) {
  return StrCat(kProcessStateFolder, "/", process_index);
}

inline std::string ItemDir(std::string_view step_dir, std::string_view item) {
  return StrCat(step_dir, "/", item);
}
// True for folder names that are never complete steps.
inline bool IsTemporaryStepName(std::string_view name) {
  return name.find(kTempMarker) != std::string_view::npos ||
         name.find(kOldMarker) != std::string_view::npos;
}
// The parent key of `key` ("" for a top-level key).
inline std::string ParentKey(std::string_view key) {
  const size_t slash = key.rfind('/');
  return slash == std::string_view::npos ? std::string() : std::string(key.substr(0, slash));
}

}  // namespace tensorstash

#endif  // TENSORSTASH_ENGINE_LAYOUT_H_
