// What a save finds where it is about to write a step, and whether it may replace it.
//
// A save never deletes what it did not write: a folder of the user's files, or the working
// directory, is refused whatever the options. It removes an empty folder and tensorstash's own
// leftovers (a crashed save or deletion, recognised by its file names), and, when asked to
// overwrite, replaces a complete tensorstash step or an Orbax checkpoint.
//
// Thread-safety: stateless functions; safe to call from any thread.
#ifndef TENSORSTASH_ENGINE_STEP_FOLDER_H_
#define TENSORSTASH_ENGINE_STEP_FOLDER_H_

#include <optional>
#include <string>
#include <string_view>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

enum class FolderContent {
  kEmpty,                // no keys under the folder (missing, or only empty subfolders)
  kTensorstashStep,      // has a COMMIT
  kTensorstashLeftover,  // no COMMIT, and every key is one a tensorstash save writes
  kOrbaxCheckpoint,      // an Orbax item or CheckpointManager step (_METADATA and friends)
  kOther,                // anything else: never deleted by tensorstash
};

// Lists folder `dir` of `kv` and says what it holds. Non-OK only when listing fails.
Result<FolderContent> ClassifyStepFolder(KvStore* kv, std::string_view dir);

// True when `relative_key` (a key inside a step folder) is one a tensorstash save or
// manager writes there (docs/format.md, "Layout"), or a file store's temporary of one.
bool IsTensorstashStepKey(std::string_view relative_key);

// Whether a save may write a step at `dir`, given what is there: OK (returning the content)
// when it is empty, a tensorstash leftover, or with `overwrite` a complete tensorstash step or
// an Orbax checkpoint; AlreadyExists naming `dir` and what it holds otherwise.
Result<FolderContent> CheckSaveDestination(KvStore* kv, std::string_view dir, bool overwrite);

// For "<base><marker><16 hex digits>" with `marker` one of layout.h's ".tmp-" and ".old-":
// <base>; else nullopt. Folders named so are a save's work in progress or a step moved aside.
std::optional<std::string_view> LeftoverBase(std::string_view name);

}  // namespace tensorstash

#endif  // TENSORSTASH_ENGINE_STEP_FOLDER_H_
