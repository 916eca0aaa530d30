// The zip archive torch.save writes (PyTorch's "zip file format"), as DCP's FileSystemWriter
// stores each item of a `.distcp` file: with the default torch_save serialization every tensor
// item and every bytes item is one whole torch.save archive at the item's (offset, length), the
// offsets inside the archive relative to its first byte. torch.save stores every entry
// uncompressed ("stored"), so an entry's bytes are a plain range of the archive: `<prefix>/data.pkl`
// (the pickled description), `<prefix>/data/<key>` (a storage's raw bytes), `<prefix>/byteorder`.
//
// The central directory is read (zip64 too: torch switches to it past 4 GiB); each entry's
// local header is checked against it, and each entry's CRC-32 (zlib's crc32) against its bytes.
//
// Thread-safety: pure functions.
#ifndef TENSORSTASH_FORMAT_DCP_TORCH_ZIP_H_
#define TENSORSTASH_FORMAT_DCP_TORCH_ZIP_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/util/status.h"

namespace tensorstash {

struct ZipEntry {
  std::string name;
  uint64_t data_offset = 0;  // of the entry's bytes, from the archive's first byte
  uint64_t size = 0;
  uint32_t crc32 = 0;
  bool covers_hole = false;  // its bytes cover ReadStoredZip's `hole` (their CRC: not checked)
};

// Bytes [begin, end) of an archive that were not read (empty when begin >= end): a reader that
// reads a large entry straight into its destination reads only the archive's records around it.
struct ZipHole {
  uint64_t begin = 0;
  uint64_t end = 0;
};

// The entries of the stored zip archive `archive` (its whole bytes), in central-directory order,
// each checked: local header matching, bytes inside the archive, CRC-32 matching when
// `check_crc`. DataLoss naming `what` (and the entry) for a malformed or truncated archive or a
// CRC mismatch; Unimplemented for a compressed or encrypted entry or a multi-disk archive.
// With a `hole`, no byte inside it is looked at: OutOfRange when a record (the end records, the
// central directory, a local header) or an entry's bytes reach into it, except one entry whose
// bytes cover it whole (covers_hole; its CRC is the caller's to check once it has the bytes).
Result<std::vector<ZipEntry>> ReadStoredZip(std::string_view archive, std::string_view what,
                                            bool check_crc = true, ZipHole hole = {});

// The entry named `<prefix>/<suffix>` (one top-level folder, any name, as torch.save writes);
// null if there is none.
const ZipEntry* FindTorchZipEntry(const std::vector<ZipEntry>& entries, std::string_view suffix);

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_DCP_TORCH_ZIP_H_
