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

#include "tensorstash/util/status.h"

namespace tensorstash {

inline constexpr int kCommitMajorVersion = 1;
// 1.1 adds "files"; a record without files is written as 1.0.
inline constexpr int kCommitMinorVersion = 1;
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

struct CommitRecord {
  int64_t created_unix_ms = 0;
  int process_count = 1;
  std::map<std::string, CommitItem> items;  // item name ("state") -> its checks
  std::map<std::string, CommitFile> files;  // path inside the step folder -> its checks
  bool operator==(const CommitRecord&) const = default;
};

std::string EncodeCommitRecord(const CommitRecord& record);
// Parses a COMMIT read from `where`. Malformed -> DataLoss naming `where`; a newer major version
// -> Unimplemented saying which versions this reader supports.
Result<CommitRecord> DecodeCommitRecord(std::string_view text, std::string_view where);

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_COMMIT_RECORD_H_
