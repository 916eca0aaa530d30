// The folders under a checkpoint root as `tensorstash ls` lists them: tensorstash steps
// (complete, damaged, incomplete), temporaries of a save, and steps of foreign formats (Orbax,
// zarr groups), with size and creation time. Library logic, so that every front lists alike.
//
// Thread-safety: a pure function of the store's contents.
#ifndef TENSORSTASH_MANAGER_STEP_LISTING_H_
#define TENSORSTASH_MANAGER_STEP_LISTING_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct StepListing {
  std::string name;  // the folder's name under the root
  // "complete" (the step opens), "retired" (a committed step a manager's retention dropped,
  // kept on storage for the data of incremental steps that refer to it), "damaged" (it has a COMMIT but does not open: `problem` says
  // why), "incomplete" (no COMMIT, or a zarr group without write_completed), "temporary" (a
  // save's work folder or a step moved aside), or a foreign format's name (StepFormatName:
  // "orbax-ocdbt", "orbax-zarr-folders", "zarr-group").
  std::string status;
  uint64_t bytes = 0;           // of every file under the folder: what the step owns
  // Complete incremental steps (docs/format.md 6.1): the stored bytes of its chunks that lie in
  // other steps' files, and those steps.
  uint64_t borrowed_bytes = 0;
  std::vector<std::string> depends_on;
  int64_t created_unix_ms = 0;  // 0 when not recorded
  std::string problem;
};

// One entry per top-level folder of `kv`, by name. Loose files are not steps. Non-OK only when
// the root cannot be listed; a folder that cannot be read is listed with the status it earned.
Result<std::vector<StepListing>> ListCheckpointRoot(KvStore* kv);

}  // namespace tensorstash

#endif  // TENSORSTASH_MANAGER_STEP_LISTING_H_
