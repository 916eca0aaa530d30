// File and folder names of Orbax checkpoints (docs/foreign_formats.md, "Orbax checkpoints"),
// shared by the Orbax reader and writer, format detection and the step-folder checks.
#ifndef TENSORSTASH_FORMAT_ORBAX_NAMES_H_
#define TENSORSTASH_FORMAT_ORBAX_NAMES_H_

namespace tensorstash {

// The PyTree item's metadata: its tree, and per leaf how it is stored.
inline constexpr char kOrbaxMetadataFileName[] = "_METADATA";
// A CheckpointManager step's own metadata, beside its item folders.
inline constexpr char kOrbaxCheckpointMetadataFileName[] = "_CHECKPOINT_METADATA";
// The OCDBT database's manifest, at the top of an item saved with use_ocdbt=True.
inline constexpr char kOcdbtManifestFileName[] = "manifest.ocdbt";
// Written last by Orbax where folders cannot be renamed (GCS; tensorstash: object stores).
inline constexpr char kOrbaxCommitSuccessFileName[] = "commit_success.txt";
// Orbax writes into "<dir>.orbax-checkpoint-tmp-<id>" and renames it into place.
inline constexpr char kOrbaxTmpMarker[] = ".orbax-checkpoint-tmp";

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_ORBAX_NAMES_H_
