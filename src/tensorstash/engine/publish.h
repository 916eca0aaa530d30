// PublishFolder: how a finished save becomes visible on a store that can rename folders.
//
// Both writers (the native CheckpointWriter and the OrbaxWriter) build a checkpoint in a
// temporary folder and call this to put it in place. Thread-safety: one publish per
// destination at a time; the store itself may be shared.
#ifndef TENSORSTASH_ENGINE_PUBLISH_H_
#define TENSORSTASH_ENGINE_PUBLISH_H_

#include <map>
#include <string>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// Moves folder `work_dir` of `kv` to `dir`:
//  1. whatever is at `dir` (anything listed under it) is renamed aside to `aside_dir`;
//  2. `work_dir` is renamed to `dir`;
//  3. with `sync`, the parent folder of `dir` is synced, so that both renames are durable;
//  4. the folder moved aside is removed, best effort (a leftover there is never read as a
//     checkpoint, and its removal failing does not fail a publish that has committed).
// Where the store can exchange folders atomically (KvStore::ExchangeDirectories), 1 and 2 are one
// exchange (the old folder lands at `work_dir`, and is removed from there), so that `dir` is
// never missing for a reader. On success the new folder is at `dir`. On failure (at 1-3) every
// rename done so far is undone: `dir` holds what it held before, and `work_dir` still holds the new
// folder for the caller to remove; the error names the step that failed. Requires
// kv->SupportsRename().
Status PublishFolder(KvStore* kv, const std::string& work_dir, const std::string& dir,
                     const std::string& aside_dir, bool sync);

// Checks, with one listing of `work_dir`, that every file a save wrote there is still there with
// the size it was written with (`written`: path relative to `work_dir` -> size), before the save
// commits: something that removed or replaced files meanwhile (`tensorstash gc` with a --min-age
// shorter than the save, a second writer of the same folder) must make the save fail, never
// commit a step with files missing. On success returns what the listing says of each written
// file (keyed as `written`); DataLoss naming the first missing or resized file otherwise.
Result<std::map<std::string, ObjectInfo>> CheckWrittenFiles(
    KvStore* kv, const std::string& work_dir, const std::map<std::string, uint64_t>& written);

}  // namespace tensorstash

#endif  // TENSORSTASH_ENGINE_PUBLISH_H_
