#include "tensorstash/format/index_format.h"

#include <algorithm>
#include <cstring>
#include <tuple>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/endian.h"

namespace tensorstash {
namespace {

bool EntryLess(const IndexEntry& a, const IndexEntry& b) {
  return std::tie(a.array_id, a.chunk) < std::tie(b.array_id, b.chunk);
}

Status Corrupt(std::string_view where, std::string_view what) {
  return DataLossError(StrCat("corrupt chunk index '", where, "': ", what));
}

// The step and name of a file of another step (DataFileInfo): a step folder that is a valid key
// and not a save's temporary or replaced folder, and a name under that step's "state/data/"
// (possibly inside one "attempt-" folder of an object store). Empty when they are good.
std::string BadReference(const DataFileInfo& file) {
  if (!ValidateKey(file.step).ok()) return "the step it names is not a valid key";
  if (file.step.find(".tmp-") != std::string::npos || file.step.find(".old-") != std::string::npos) {
    return "the step it names is a temporary folder";
  }
  if (!ValidateKey(file.name).ok()) return "its name is not a valid key";
  std::string_view rest = file.name;
  if (rest.rfind("attempt-", 0) == 0) rest.remove_prefix(std::min(rest.find('/') + 1, rest.size()));
  if (rest.rfind("state/data/", 0) != 0 || rest.size() == 11) {
    return "its name is not a data file of a step (\"state/data/...\")";
  }
  if (file.generation.size() > kMaxGenerationSize) return "its generation is too long";
  return {};
}

}  // namespace

bool IndexNeedsVersion2(const ChunkIndex& index) {
  for (const DataFileInfo& f : index.files) {
    if (!f.step.empty() || !f.generation.empty()) return true;
  }
  for (const IndexEntry& e : index.entries) {
    if (!e.digest.empty()) return true;
  }
  return false;
}

Result<std::string> EncodeIndex(ChunkIndex index) {
  std::sort(index.entries.begin(), index.entries.end(), EntryLess);
  for (size_t i = 1; i < index.entries.size(); ++i) {
    if (!EntryLess(index.entries[i - 1], index.entries[i])) {
      return InvalidArgumentError(StrCat("chunk ", index.entries[i].chunk, " of array ",
                                         index.entries[i].array_id, " was written twice"));
    }
  }
  // Version 1.0, byte for byte as before references existed, whenever it can say everything.
  const bool v2 = IndexNeedsVersion2(index);
  std::string out;
  out.append(kIndexMagic, sizeof(kIndexMagic));
  PutLE16(&out, v2 ? 2 : 1);
  PutLE16(&out, 0);
  PutLE32(&out, 0);  // flags
  PutLE32(&out, static_cast<uint32_t>(index.files.size()));
  PutLE32(&out, 0);  // reserved
  PutLE64(&out, index.entries.size());
  for (const DataFileInfo& file : index.files) {
    if (file.name.size() > kMaxDataFileNameSize) {
      return InvalidArgumentError(StrCat("data file name too long: ", file.name));
    }
    PutLE16(&out, static_cast<uint16_t>(file.name.size()));
    out.append(file.name);
    PutLE64(&out, file.size);
    if (!v2) continue;
    if (!file.step.empty()) {
      if (std::string bad = BadReference(file); !bad.empty()) {
        return InvalidArgumentError(StrCat("data file '", file.name, "' of step '", file.step,
                                           "': ", bad));
      }
    } else if (!file.generation.empty()) {
      return InvalidArgumentError(
          StrCat("data file '", file.name, "': a generation is recorded for other steps' files only"));
    }
    PutLE16(&out, static_cast<uint16_t>(file.step.size()));
    out.append(file.step);
    PutLE16(&out, static_cast<uint16_t>(file.generation.size()));
    out.append(file.generation);
  }
  for (const IndexEntry& e : index.entries) {
    if (e.file_id >= index.files.size()) {
      return InvalidArgumentError(
          StrCat("entry names data file ", e.file_id, " of ", index.files.size()));
    }
    PutLE32(&out, e.array_id);
    PutLE32(&out, e.file_id);
    PutLE64(&out, e.chunk);
    PutLE64(&out, e.offset);
    PutLE64(&out, e.length);
    PutLE32(&out, e.crc32c);
    PutLE32(&out, 0);  // reserved
    if (v2) {
      PutLE64(&out, e.digest.low);
      PutLE64(&out, e.digest.high);
    }
  }
  PutLE32(&out, Crc32c(out));
  PutLE32(&out, 0);  // reserved
  out.append(kIndexFooterMagic, sizeof(kIndexFooterMagic));
  return out;
}

uint32_t IndexBodyCrc32c(std::string_view bytes) {
  if (bytes.size() < kIndexFooterSize) return 0;
  return Crc32c(bytes.data(), bytes.size() - kIndexFooterSize);
}

Result<ChunkIndex> DecodeIndex(std::string_view bytes, std::string_view where) {
  if (bytes.size() < kIndexHeaderSize + kIndexFooterSize) {
    return Corrupt(where, StrCat("only ", bytes.size(), " bytes (truncated)"));
  }
  if (std::memcmp(bytes.data(), kIndexMagic, sizeof(kIndexMagic)) != 0) {
    return Corrupt(where, "bad magic (not a tensorstash index)");
  }
  const uint16_t major = GetLE16(bytes.data() + 8);
  const uint16_t minor = GetLE16(bytes.data() + 10);
  if (major != 1 && major != 2) {
    return UnimplementedError(StrCat("chunk index '", where, "' has format version ", major, ".",
                                     minor, "; this tensorstash reads versions 1.x and 2.x only "
                                     "(upgrade tensorstash)"));
  }
  const bool v2 = major == 2;
  const size_t entry_size = v2 ? kIndexEntrySizeV2 : kIndexEntrySize;
  const char* footer = bytes.data() + bytes.size() - kIndexFooterSize;
  if (std::memcmp(footer + 8, kIndexFooterMagic, sizeof(kIndexFooterMagic)) != 0) {
    return Corrupt(where, "bad footer magic (truncated?)");
  }
  if (GetLE32(footer + 4) != 0) return Corrupt(where, "reserved footer bytes are not zero");
  const size_t body_size = bytes.size() - kIndexFooterSize;
  const uint32_t stored_crc = GetLE32(footer);
  const uint32_t actual_crc = Crc32c(bytes.data(), body_size);
  if (stored_crc != actual_crc) {
    return Corrupt(where, StrCat("CRC-32C mismatch (stored ", Hex32(stored_crc), ", computed ",
                                 Hex32(actual_crc), ")"));
  }
  if (GetLE32(bytes.data() + 12) != 0 || GetLE32(bytes.data() + 20) != 0) {
    return Corrupt(where, "reserved header fields are not zero");
  }
  const uint32_t num_files = GetLE32(bytes.data() + 16);
  const uint64_t num_entries = GetLE64(bytes.data() + 24);
  if (num_files > kMaxDataFiles) {
    return Corrupt(where, StrCat("claims ", num_files, " data files"));
  }
  ChunkIndex index;
  size_t pos = kIndexHeaderSize;
  index.files.reserve(num_files);
  for (uint32_t i = 0; i < num_files; ++i) {
    if (body_size - pos < 2) return Corrupt(where, "data file table truncated");
    const uint16_t name_size = GetLE16(bytes.data() + pos);
    pos += 2;
    if (name_size > kMaxDataFileNameSize || body_size - pos < name_size + 8u) {
      return Corrupt(where, StrCat("data file ", i, " entry truncated or too long"));
    }
    DataFileInfo file;
    file.name.assign(bytes.data() + pos, name_size);
    pos += name_size;
    file.size = GetLE64(bytes.data() + pos);
    pos += 8;
    if (v2) {
      // The step, then the generation, each a u16 length and its bytes.
      for (std::string* field : {&file.step, &file.generation}) {
        if (body_size - pos < 2) return Corrupt(where, StrCat("data file ", i, " entry truncated"));
        const uint16_t size = GetLE16(bytes.data() + pos);
        pos += 2;
        if (body_size - pos < size) {
          return Corrupt(where, StrCat("data file ", i, " entry truncated or too long"));
        }
        field->assign(bytes.data() + pos, size);
        pos += size;
      }
    }
    if (file.step.empty()) {
      if (!ValidateKey(file.name).ok() || file.name.rfind("data/", 0) != 0) {
        return Corrupt(where, StrCat("data file ", i, " has an invalid name"));
      }
      if (!file.generation.empty()) {
        return Corrupt(where, StrCat("data file ", i, " of this step has a generation"));
      }
    } else if (std::string bad = BadReference(file); !bad.empty()) {
      return Corrupt(where, StrCat("data file ", i, " (of step '", file.step, "'): ", bad));
    }
    for (const DataFileInfo& earlier : index.files) {
      // Two ids for one file would let chunks alias each other past the overlap check.
      if (earlier.name == file.name && earlier.step == file.step) {
        return Corrupt(where, StrCat("data file '", file.name, "'",
                                     file.step.empty() ? "" : StrCat(" of step '", file.step, "'"),
                                     " listed twice"));
      }
    }
    index.files.push_back(std::move(file));
  }
  uint64_t entry_bytes;
  if (__builtin_mul_overflow(num_entries, uint64_t{entry_size}, &entry_bytes) ||
      entry_bytes != body_size - pos) {
    return Corrupt(where, StrCat("claims ", num_entries, " entries but holds ", (body_size - pos),
                                 " bytes of entries"));
  }
  index.entries.resize(num_entries);
  for (uint64_t i = 0; i < num_entries; ++i, pos += entry_size) {
    const char* p = bytes.data() + pos;
    IndexEntry& e = index.entries[i];
    e.array_id = GetLE32(p);
    e.file_id = GetLE32(p + 4);
    e.chunk = GetLE64(p + 8);
    e.offset = GetLE64(p + 16);
    e.length = GetLE64(p + 24);
    e.crc32c = GetLE32(p + 32);
    if (GetLE32(p + 36) != 0) return Corrupt(where, StrCat("entry ", i, ": reserved bits set"));
    if (v2) e.digest = {GetLE64(p + 40), GetLE64(p + 48)};
    if (e.file_id >= num_files) {
      return Corrupt(where, StrCat("entry ", i, " names data file ", e.file_id, " of ", num_files));
    }
    uint64_t end;
    if (__builtin_add_overflow(e.offset, e.length, &end) || end > index.files[e.file_id].size) {
      return Corrupt(where, StrCat("entry ", i, " (array ", e.array_id, ", chunk ", e.chunk,
                                   ") reaches past the end of ", index.files[e.file_id].name));
    }
    if (i > 0 && !EntryLess(index.entries[i - 1], e)) {
      return Corrupt(where, StrCat("entry ", i, " (array ", e.array_id, ", chunk ", e.chunk,
                                   ") is duplicated or out of order"));
    }
  }
  // No two entries may share bytes: a hostile index could alias chunks.
  std::vector<const IndexEntry*> by_position;
  by_position.reserve(index.entries.size());
  for (const IndexEntry& e : index.entries) {
    if (e.length > 0) by_position.push_back(&e);
  }
  std::sort(by_position.begin(), by_position.end(), [](const IndexEntry* a, const IndexEntry* b) {
    return std::tie(a->file_id, a->offset) < std::tie(b->file_id, b->offset);
  });
  for (size_t i = 1; i < by_position.size(); ++i) {
    const IndexEntry& a = *by_position[i - 1];
    const IndexEntry& b = *by_position[i];
    if (a.file_id == b.file_id && a.offset + a.length > b.offset) {
      return Corrupt(where, StrCat("chunks (array ", a.array_id, ", chunk ", a.chunk,
                                   ") and (array ", b.array_id, ", chunk ", b.chunk,
                                   ") overlap in ", index.files[a.file_id].name));
    }
  }
  return index;
}

}  // namespace tensorstash
