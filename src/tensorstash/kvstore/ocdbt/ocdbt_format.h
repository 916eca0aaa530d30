// The OCDBT on-disk structures (TensorStore's "Optionally-Cooperative Distributed B+Tree") and
// their binary codecs: the manifest, B+tree nodes and data file tables. docs/foreign_formats.md
// summarises the layout; TensorStore's format documentation is the authority.
//
// Every decoder treats its input as hostile: each count is checked against the bytes that remain
// before anything is allocated, lengths are checked against fixed limits, and every failure is a
// DataLoss status that begins with `what` (normally the file and offset). Nothing here throws or
// does I/O. Pure functions; thread-safe.
#ifndef TENSORSTASH_KVSTORE_OCDBT_OCDBT_FORMAT_H_
#define TENSORSTASH_KVSTORE_OCDBT_OCDBT_FORMAT_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/util/status.h"

namespace tensorstash::ocdbt {

inline constexpr uint32_t kManifestMagic = 0x0cdb3a2a;
inline constexpr uint32_t kVersionTreeNodeMagic = 0x0cdb1234;
inline constexpr uint32_t kBtreeNodeMagic = 0x0cdb20de;
inline constexpr char kManifestKey[] = "manifest.ocdbt";

// Limits. The first three are the format's own; the last two bound what a reader allocates for
// one manifest or node (TensorStore writes nodes of a few MiB at most).
inline constexpr size_t kMaxKeyLength = 65535;
inline constexpr size_t kMaxPathLength = 65535;
inline constexpr size_t kMaxNodeArity = 1024 * 1024;
inline constexpr size_t kMaxInlineValueLength = 1024 * 1024;
inline constexpr uint64_t kMaxEncodedBytes = uint64_t{256} << 20;
inline constexpr uint64_t kMaxDecodedBytes = uint64_t{256} << 20;

// A data file named by a node: the file is <db root>/<base_path><relative_path>. When a node is
// read from a file, its own base_path becomes the prefix of every base_path inside it (the
// "transitive path"); Orbax's merged multi-process checkpoints use this to point at
// "ocdbt.process_N/d/...". Decoders store base_path with the transitive path already prepended.
struct DataFileId {
  std::string base_path;
  std::string relative_path;
  std::string FullPath() const { return base_path + relative_path; }
  friend bool operator==(const DataFileId&, const DataFileId&) = default;
};

// A byte range of a data file; `file` indexes the enclosing node's (or manifest's) file table.
struct Location {
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  // An empty tree's root is "missing": offset and length both all-ones.
  bool missing() const { return offset == ~uint64_t{0} && length == ~uint64_t{0}; }
};

struct Statistics {
  uint64_t num_keys = 0;
  uint64_t num_tree_bytes = 0;
  uint64_t num_indirect_value_bytes = 0;
};

struct Config {
  std::array<uint8_t, 16> uuid{};
  uint8_t manifest_kind = 0;  // 0: single file, 1: numbered manifests
  uint32_t max_inline_value_bytes = 100;
  uint32_t max_decoded_node_bytes = 8 * 1024 * 1024;
  uint8_t version_tree_arity_log2 = 4;
  bool zstd = false;  // compression of manifests and nodes
  int32_t zstd_level = 0;
};

// One version (generation) of the database: the root of its B+tree.
struct VersionRef {
  uint64_t generation = 0;
  uint8_t root_height = 0;
  Location root;
  Statistics statistics;
  uint64_t commit_time_ns = 0;
};

// A reference from the manifest to a version tree node holding older versions.
struct VersionNodeRef {
  uint64_t generation = 0;
  Location location;
  uint64_t num_generations = 0;
  uint64_t commit_time = 0;
  uint8_t height = 0;
};

struct Manifest {
  Config config;
  // The rest is present only when config.manifest_kind == 0.
  std::vector<DataFileId> files;
  std::vector<VersionRef> versions;  // oldest first; the latest is versions.back()
  std::vector<VersionNodeRef> version_nodes;
};

// A key/value entry of a leaf. `key` is relative to the prefix its node inherits from the path
// above it (see BtreeNode).
struct LeafEntry {
  std::string key;
  bool is_inline = true;
  std::string inline_value;  // when is_inline
  Location location;         // when !is_inline; location.length is the value's size
  uint64_t value_length() const { return is_inline ? inline_value.size() : location.length; }
};

// A child of an interior node. Every key in the child's subtree is >= prefix + key and starts
// with prefix + key[0, subtree_prefix_length); the child's keys are relative to the latter.
struct InteriorEntry {
  std::string key;
  uint16_t subtree_prefix_length = 0;
  Location location;
  Statistics statistics;
};

struct BtreeNode {
  uint8_t height = 0;  // 0 for leaves
  std::vector<DataFileId> files;
  std::vector<LeafEntry> leaves;        // height == 0; keys strictly increasing
  std::vector<InteriorEntry> children;  // height > 0; keys strictly increasing
  // Approximate bytes of memory held, for caches.
  size_t MemoryBytes() const;
};

// Decodes an encoded manifest (header, optional zstd body, crc32c footer).
Result<Manifest> DecodeManifest(std::string_view encoded, std::string_view what);
// Decodes an encoded B+tree node read from a file whose base path (transitive path included)
// is `transitive_path`.
Result<BtreeNode> DecodeBtreeNode(std::string_view encoded, std::string_view transitive_path,
                                  std::string_view what);

// Encoders, for the writer. Inputs must be valid (sorted unique keys, in-range file indices,
// base paths empty); the result is compressed when config.zstd.
Result<std::string> EncodeManifest(const Manifest& manifest);
Result<std::string> EncodeBtreeNode(const BtreeNode& node, const Config& config);

// Appends the uleb128 encoding of `value` (exposed for tests that forge hostile inputs).
void PutVarint(std::string* out, uint64_t value);
// Wraps `body` in a header and crc32c footer, compressing it with zstd at `zstd_level` when
// `zstd` (exposed for tests).
Result<std::string> EncodeEnvelope(uint32_t magic, std::string_view body, bool zstd,
                                   int zstd_level);

}  // namespace tensorstash::ocdbt

#endif  // TENSORSTASH_KVSTORE_OCDBT_OCDBT_FORMAT_H_
