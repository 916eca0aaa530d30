// COMMIT: the record that makes a step exist. Written last; a step folder without it is never
// read (docs/format.md, "COMMIT").
//
// It is a small JSON object that names the format version, when and by how many processes the
// step was written, and for each item the CRC-32C and size of its tree.json and index, so that a
// reader detects a swapped or damaged metadata file before it trusts it; likewise for the whole
// files committed with the step ("files": metadata.json, process/<index>, ...).
//
// Thread-safety: value type and pure functions.
#ifndef TENSORSTASH_FORMAT_COMMIT_RECORD_H_
#define TENSORSTASH_FORMAT_COMMIT_RECORD_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/util/status.h"

namespace tensorstash {

inline constexpr int kCommitMajorVersion = 1;
// 1.1 adds "files"; 1.2 adds "attempt" and "objects" (steps on object stores); 1.3 adds
// "depends_on" (incremental steps). A record is written with the lowest minor version that
// holds what it says.
inline constexpr int kCommitMinorVersion = 3;
inline constexpr char kCommitFileName[] = "COMMIT";
inline constexpr uint64_t kMaxCommitRecordBytes = 1 << 20;

struct CommitItem {
  uint32_t tree_crc32c = 0;
  uint64_t tree_size = 0;
  uint32_t index_crc32c = 0;
  uint64_t index_size = 0;
  uint64_t data_bytes = 0;  // sum of the data files' sizes
  uint64_t num_arrays = 0;
  bool operator==(const CommitItem&) const = default;
};

// A whole file committed with the step (metadata, per-process state): its checks.
struct CommitFile {
  uint64_t size = 0;
  uint32_t crc32c = 0;
  bool operator==(const CommitFile&) const = default;
};

// An object of a step on an object store, as committed: its size and ETag (the store's
// generation), so that a reader detects an object replaced after the commit.
struct CommitObject {
  uint64_t size = 0;
  std::string generation;
  bool operator==(const CommitObject&) const = default;
};

struct CommitRecord {
  int64_t created_unix_ms = 0;
  int process_count = 1;
  std::map<std::string, CommitItem> items;  // item name ("state") -> its checks
  std::map<std::string, CommitFile> files;  // path inside the step folder -> its checks
  // Steps on object stores (docs/format.md, "Steps on object stores"): the folder inside the
  // step that holds this commit's files ("attempt-<16 hex>"), and every object in it, by path
  // relative to it. Empty for steps written in place or renamed into place.
  std::string attempt;
  std::map<std::string, CommitObject> objects;
  // Incremental steps (1.3): the steps whose data files this step's index names, as the index
  // names them (folders relative to the folder holding this step), sorted, no duplicates.
  // Empty for a self-contained step.
  std::vector<std::string> depends_on;
  bool operator==(const CommitRecord&) const = default;
};

std::string EncodeCommitRecord(const CommitRecord& record);
// Parses a COMMIT read from `where`. Malformed -> DataLoss naming `where`; a newer major version
// -> Unimplemented saying which versions this reader supports.
Result<CommitRecord> DecodeCommitRecord(std::string_view text, std::string_view where);

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_COMMIT_RECORD_H_
