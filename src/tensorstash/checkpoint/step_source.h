// StepSource: one checkpoint step (or item) as the fronts read it, whatever its format.
//
// The Python Reader and the CLI's inspect and verify open a folder with OpenStepSource, which
// detects the format (DetectStepFormat) and returns the native CheckpointReader behind this
// interface, or an OrbaxReader (orbax_reader.h) for Orbax checkpoints and zarr groups. Every
// source offers the same things: the pytree (format/tree.h schema) and its arrays' metadata,
// box reads with dtype casts and zeros past the stored shape, and a full verification.
// docs/foreign_formats.md ("## Orbax checkpoints") describes detection and the foreign layouts.
//
// Thread-safety: after Open, const methods and ReadMany may be called from several threads.
#ifndef TENSORSTASH_CHECKPOINT_STEP_SOURCE_H_
#define TENSORSTASH_CHECKPOINT_STEP_SOURCE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

enum class StepFormat {
  kNative,        // a tensorstash step (COMMIT, state/tree.json, index)
  kOrbaxOcdbt,    // Orbax PyTree item, arrays as zarr v2/v3 keys inside an OCDBT database
  kOrbaxFolders,  // Orbax PyTree item, one zarr folder per parameter (use_ocdbt=False)
  kZarrGroup,     // a zarr group of arrays named by pytree key path, `write_completed` attribute
};

// "tensorstash", "orbax-ocdbt", "orbax-zarr-folders", "zarr-group".
std::string_view StepFormatName(StepFormat format);

struct DetectedStep {
  StepFormat format = StepFormat::kNative;
  // The folder to open: `dir` itself, or the item folder found inside an Orbax
  // CheckpointManager step ("<step>/default", "<step>/state", ...).
  std::string dir;
};

// Looks at the marker files of folder `dir` of `kv` (reads no array data):
//   COMMIT -> native; _METADATA -> Orbax (with manifest.ocdbt: OCDBT); .zgroup or a zarr.json
//   group -> zarr group; else the one subfolder holding _METADATA (an Orbax manager step).
// A folder with none of them is reported as native, so that the native reader gives its usual
// error (NotFound, or FailedPrecondition for a step without COMMIT). FailedPrecondition for an
// Orbax temporary folder (".orbax-checkpoint-tmp") or an Orbax step without _METADATA;
// InvalidArgument naming the items when a manager step holds several items and none is
// "default".
Result<DetectedStep> DetectStepFormat(KvStore* kv, const std::string& dir);

class StepSource {
 public:
  virtual ~StepSource() = default;

  virtual StepFormat format() const = 0;
  // The folder read (after detection), relative to the KvStore.
  virtual const std::string& dir() const = 0;
  virtual const TreeNode& tree() const = 0;
  // One entry per array leaf, in the order of the tree's array ids. For zarr arrays
  // grid.chunk_shape and grid.cell_shape are both the stored chunk (shard) shape.
  virtual const std::vector<ArrayMetadata>& arrays() const = 0;
  // Stored bytes and stored chunk count of array `id` (for zarr: listed on first use).
  virtual uint64_t StoredBytes(size_t id) const = 0;
  virtual int64_t NumChunks(size_t id) const = 0;
  // "none", "zstd" for native arrays; a short description of the zarr codec chain otherwise.
  virtual std::string CodecDescription(size_t id) const = 0;
  // Creation time (0 when the format does not record it) and writer process count (0 likewise).
  virtual int64_t created_unix_ms() const = 0;
  virtual int process_count() const = 0;

  // As CheckpointReader::ReadMany: the first error wins; on error destinations hold unspecified
  // data. Errors name the array path (and, for stored data, the chunk key).
  virtual Status ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats,
                          const std::function<void(uint64_t, uint64_t)>& progress) = 0;
  // As CheckpointReader::MapMany, where the source can map (native steps, and a tiered step's
  // local holdings); the default answers Unimplemented for every request (read them instead).
  virtual std::vector<Result<MappedBox>> MapMany(const std::vector<ReadRequest>& requests,
                                                 const MapOptions& options);
  // A whole file committed with a native step; NotFound for foreign formats.
  virtual Result<std::string> ReadFile(std::string_view name) const = 0;
  // Reads and decodes every stored chunk; returns the bad ones (empty when all are good).
  // Non-OK only when verification could not run. progress(done, total) in bytes.
  virtual Result<std::vector<BadChunk>> Verify(
      const std::function<void(uint64_t, uint64_t)>& progress) = 0;
  // Bytes and items (chunks, files) that Verify checks, for progress and summaries.
  virtual uint64_t VerifyTotalBytes() const = 0;
  virtual size_t VerifyTotalItems() const = 0;

  // The native reader behind a kNative source, else nullptr.
  virtual CheckpointReader* native() { return nullptr; }
};

// Detects the format of `dir` and opens it. Errors as DetectStepFormat, then as the format's
// reader (CheckpointReader::Open, OrbaxReader::Open). `kv` must outlive the source.
Result<std::unique_ptr<StepSource>> OpenStepSource(KvStore* kv, const std::string& dir,
                                                   ReaderOptions options = {});

}  // namespace tensorstash

#endif  // TENSORSTASH_CHECKPOINT_STEP_SOURCE_H_
