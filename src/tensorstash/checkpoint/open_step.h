// Opening one checkpoint step (or item) whatever its format: DetectStepFormat looks at the
// folder's marker files, OpenStepSource returns the native CheckpointReader or an OrbaxReader
// (orbax_reader.h) behind the engine's StepSource interface (engine/step_source.h).
// docs/foreign_formats.md ("## Orbax checkpoints") describes detection and the foreign layouts.
#ifndef TENSORSTASH_CHECKPOINT_OPEN_STEP_H_
#define TENSORSTASH_CHECKPOINT_OPEN_STEP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/engine/step_source.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct DetectedStep {
  StepFormat format = StepFormat::kNative;
  // The folder to open: `dir` itself, or the item folder found inside an Orbax
  // CheckpointManager step ("<step>/default", "<step>/state", ...).
  std::string dir;
};

// Looks at the marker files of folder `dir` of `kv` (reads no array data):
//   COMMIT -> native; `dir` a .safetensors file, or a folder with model.safetensors.index.json
//   or model.safetensors -> safetensors; _METADATA -> Orbax (with manifest.ocdbt: OCDBT); .zgroup or a zarr.json
//   group -> zarr group; .metadata -> PyTorch DCP; else the one subfolder holding _METADATA (an
//   Orbax manager step).
// A folder with none of them is reported as native, so that the native reader gives its usual
// error (NotFound, or FailedPrecondition for a step without COMMIT). FailedPrecondition for an
// Orbax temporary folder (".orbax-checkpoint-tmp") or an Orbax step without _METADATA;
// InvalidArgument naming the items when a manager step holds several items and none is
// "default".
Result<DetectedStep> DetectStepFormat(KvStore* kv, const std::string& dir);

// Detects the format of `dir` and opens it. Errors as DetectStepFormat, then as the format's
// reader (CheckpointReader::Open, OrbaxReader::Open). `kv` must outlive the source.
Result<std::unique_ptr<StepSource>> OpenStepSource(KvStore* kv, const std::string& dir,
                                                   ReaderOptions options = {});

}  // namespace tensorstash

#endif  // TENSORSTASH_CHECKPOINT_OPEN_STEP_H_
