// The binary chunk index of one checkpoint item: which bytes of which data file hold each chunk.
//
// Layout (docs/format.md, "index"): a 32-byte header, a table of data files, fixed-size entries
// sorted by (array, chunk), and a 16-byte footer with a CRC-32C of everything before it.
// All integers are little-endian. EncodeIndex and DecodeIndex are exact inverses.
//
// Version 1.0 has 40-byte entries and names only the step's own data files. Version 2.0
// (incremental steps, section 6.1) adds to each file record the step whose file it is (a file of
// another step: a reference) and the object's generation, and to each entry the chunk's
// XXH3-128 digest (56-byte entries). EncodeIndex writes 1.0 whenever the index holds no
// reference and no digest, so that a step saved without them reads with any 1.x reader.
//
// Thread-safety: pure functions.
#ifndef TENSORSTASH_FORMAT_INDEX_FORMAT_H_
#define TENSORSTASH_FORMAT_INDEX_FORMAT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/util/chunk_digest.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

inline constexpr char kIndexMagic[8] = {'T', 'S', 'I', 'N', 'D', 'E', 'X', '\0'};
inline constexpr char kIndexFooterMagic[8] = {'T', 'S', 'I', 'X', 'E', 'N', 'D', '\0'};
// The newest version this build reads and writes; it reads 1.x too.
inline constexpr uint16_t kIndexMajorVersion = 2;
inline constexpr uint16_t kIndexMinorVersion = 0;
inline constexpr size_t kIndexHeaderSize = 32;
inline constexpr size_t kIndexEntrySize = 40;     // version 1
inline constexpr size_t kIndexEntrySizeV2 = 56;   // version 2: + the digest
inline constexpr size_t kMaxGenerationSize = 255;
inline constexpr size_t kIndexFooterSize = 16;
inline constexpr uint32_t kMaxDataFiles = 1 << 20;
inline constexpr size_t kMaxDataFileNameSize = 1024;

struct DataFileInfo {
  // The step's own file (`step` empty): key relative to the item folder,
  // "data/<process>-<seq>.dat". A file of another step: key relative to that step's folder,
  // "state/data/0-0.dat" or, on an object store, "attempt-<16 hex>/state/data/0-0.dat".
  std::string name;
  uint64_t size = 0;  // bytes the writer wrote; a shorter file is truncated
  // Empty: a file of this step. Otherwise the folder of the step that wrote the file, relative
  // to the folder that holds this step's folder (a sibling: "0000000900").
  std::string step;
  // The object's generation where the store has them (reads are pinned to it); else empty.
  std::string generation;
  bool operator==(const DataFileInfo&) const = default;
};

struct IndexEntry {
  uint32_t array_id = 0;  // position in tree.json's "arrays"
  uint32_t file_id = 0;   // position in the data file table
  uint64_t chunk = 0;     // linear chunk index in the array's ChunkGrid
  uint64_t offset = 0;    // byte offset in the data file
  uint64_t length = 0;    // stored bytes (after the codec)
  uint32_t crc32c = 0;    // CRC-32C of the stored bytes
  ChunkDigest digest;     // XXH3-128 of the raw (unencoded) bytes; empty when not recorded
  bool operator==(const IndexEntry&) const = default;
};

struct ChunkIndex {
  std::vector<DataFileInfo> files;
  std::vector<IndexEntry> entries;  // sorted by (array_id, chunk), no duplicates
};

// True when `index` needs version 2 (a file of another step, or a digest).
bool IndexNeedsVersion2(const ChunkIndex& index);

// Serializes `index`, as version 1.0 unless IndexNeedsVersion2. Entries are sorted by the
// encoder; InvalidArgument when two entries name the same (array, chunk), a file_id is out of
// range, or a file of another step has an invalid step or name.
Result<std::string> EncodeIndex(ChunkIndex index);

// The CRC-32C of an encoded index less its footer: what COMMIT records for the index (the CRC
// of a whole index is the same constant for every index, since it ends with its own CRC).
// Returns 0 for input shorter than the footer.
uint32_t IndexBodyCrc32c(std::string_view bytes);

// Parses and checks an encoded index read from `where` (named in errors). Checks magic, CRC,
// sizes, version (a newer major version is Unimplemented and says which versions this reader
// supports), file names (and for files of other steps, the step and the name's form), sort
// order and duplicates, file_id range, and that each entry's
// [offset, offset + length) lies inside its file's recorded size and overlaps no other entry.
// Every violation is DataLoss naming `where` and the offending entry.
Result<ChunkIndex> DecodeIndex(std::string_view bytes, std::string_view where);

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_INDEX_FORMAT_H_
