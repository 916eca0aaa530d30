#include "tensorstash/format/dcp/torch_zip.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/endian.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEndSig = 0x06054b50;
constexpr uint32_t kZip64EndSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr size_t kEndSize = 22;
constexpr size_t kZip64EndSize = 56;
constexpr size_t kZip64LocatorSize = 20;
constexpr size_t kCentralSize = 46;
constexpr size_t kLocalSize = 30;

}  // namespace

Result<std::vector<ZipEntry>> ReadStoredZip(std::string_view archive, std::string_view what,
                                            bool check_crc, ZipHole hole) {
  auto fail = [&](const auto&... parts) {
    return DataLossError(StrCat("zip archive ", what, ": ", parts...));
  };
  const uint64_t size = archive.size();
  const char* base = archive.data();
  // Whether [at, at + n) (inside the archive) misses the hole.
  const bool has_hole = hole.begin < hole.end;
  auto readable = [&](uint64_t at, uint64_t n) {
    return !has_hole || at + n <= hole.begin || at >= hole.end;
  };
  auto unread = [&](const auto&... parts) {
    return OutOfRangeError(StrCat("zip archive ", what, ": ", parts..., " lies in bytes not read"));
  };
  // The end record: the last signature within the comment's reach (torch writes no comment).
  if (size < kEndSize) return fail("shorter than a zip end record (", size, " bytes)");
  uint64_t end = size - kEndSize;
  uint64_t lowest = size - kEndSize > 0xffff ? size - kEndSize - 0xffff : 0;
  while (true) {
    if (!readable(end, kEndSize)) return unread("the end record");
    if (GetLE32(base + end) == kEndSig && end + kEndSize + GetLE16(base + end + 20) == size) break;
    if (end == lowest) return fail("no zip end record");
    --end;
  }
  // (Zip64 writers may put 0xffff in the disk numbers; the zip64 record has the real ones.)
  auto disk = [&](uint64_t at) { uint16_t d = GetLE16(base + at); return d == 0xffff ? 0 : d; };
  if (disk(end + 4) != 0 || disk(end + 6) != 0) {
    return UnimplementedError(StrCat("zip archive ", what, ": a multi-disk archive"));
  }
  uint64_t count = GetLE16(base + end + 10);
  uint64_t dir_size = GetLE32(base + end + 12);
  uint64_t dir_offset = GetLE32(base + end + 16);
  if (count == 0xffff || dir_size == 0xffffffff || dir_offset == 0xffffffff) {
    if (end >= kZip64LocatorSize && !readable(end - kZip64LocatorSize, kZip64LocatorSize)) {
      return unread("the zip64 end locator");
    }
    if (end < kZip64LocatorSize || GetLE32(base + end - kZip64LocatorSize) != kZip64LocatorSig) {
      return fail("zip64 fields without a zip64 end locator");
    }
    uint64_t rec = GetLE64(base + end - kZip64LocatorSize + 8);
    if (rec <= size && size - rec >= kZip64EndSize && !readable(rec, kZip64EndSize)) {
      return unread("the zip64 end record");
    }
    if (rec > size || size - rec < kZip64EndSize || GetLE32(base + rec) != kZip64EndSig) {
      return fail("the zip64 end record is not at offset ", rec);
    }
    if (GetLE32(base + rec + 16) != 0 || GetLE32(base + rec + 20) != 0) {
      return UnimplementedError(StrCat("zip archive ", what, ": a multi-disk archive"));
    }
    count = GetLE64(base + rec + 32);
    dir_size = GetLE64(base + rec + 40);
    dir_offset = GetLE64(base + rec + 48);
  }
  if (dir_offset > size || dir_size > size - dir_offset) {
    return fail("the central directory (", dir_offset, " + ", dir_size, ") is past the end (",
                size, " bytes)");
  }
  if (!readable(dir_offset, dir_size)) return unread("the central directory");
  std::vector<ZipEntry> entries;
  bool hole_covered = false;
  uint64_t pos = dir_offset;
  const uint64_t dir_end = dir_offset + dir_size;
  // Each entry takes at least kCentralSize bytes of the directory: a hostile count allocates
  // nothing before the bytes that back it are seen.
  for (uint64_t i = 0; i < count; ++i) {
    if (dir_end - pos < kCentralSize || GetLE32(base + pos) != kCentralSig) {
      return fail("central directory entry ", i, " of ", count, " is malformed at offset ", pos);
    }
    const char* h = base + pos;
    uint16_t flags = GetLE16(h + 8);
    uint16_t method = GetLE16(h + 10);
    uint32_t crc = GetLE32(h + 16);
    uint64_t csize = GetLE32(h + 20);
    uint64_t usize = GetLE32(h + 24);
    uint64_t name_len = GetLE16(h + 28);
    uint64_t extra_len = GetLE16(h + 30);
    uint64_t comment_len = GetLE16(h + 32);
    uint64_t local = GetLE32(h + 42);
    if (dir_end - pos - kCentralSize < name_len + extra_len + comment_len) {
      return fail("central directory entry ", i, " runs past the directory");
    }
    ZipEntry e;
    e.name.assign(h + kCentralSize, name_len);
    // The zip64 extra field holds, in order, the fields whose 32-bit value is all ones.
    std::string_view extra(h + kCentralSize + name_len, extra_len);
    while (extra.size() >= 4) {
      uint16_t id = GetLE16(extra.data());
      uint16_t len = GetLE16(extra.data() + 2);
      if (len > extra.size() - 4) return fail("entry '", e.name, "': a truncated extra field");
      std::string_view body = extra.substr(4, len);
      if (id == 0x0001) {
        for (uint64_t* field : {&usize, &csize, &local}) {
          if (*field != 0xffffffff) continue;
          if (body.size() < 8) return fail("entry '", e.name, "': a short zip64 extra field");
          *field = GetLE64(body.data());
          body.remove_prefix(8);
        }
      }
      extra.remove_prefix(4 + len);
    }
    if (flags & 0x41) {
      return UnimplementedError(
          StrCat("zip archive ", what, ": entry '", e.name, "' is encrypted"));
    }
    if (method != 0) {
      return UnimplementedError(StrCat("zip archive ", what, ": entry '", e.name,
                                       "' is compressed (method ", method,
                                       "); torch.save stores entries uncompressed"));
    }
    if (csize != usize) {
      return fail("stored entry '", e.name, "' has sizes ", csize, " and ", usize);
    }
    if (local <= size && size - local >= kLocalSize && !readable(local, kLocalSize)) {
      return unread("the local header of entry '", e.name, "'");
    }
    if (local > size || size - local < kLocalSize || GetLE32(base + local) != kLocalSig) {
      return fail("entry '", e.name, "': no local header at offset ", local);
    }
    uint64_t lname = GetLE16(base + local + 26);
    uint64_t lextra = GetLE16(base + local + 28);
    uint64_t data = local + kLocalSize + lname + lextra;
    if (data > size || usize > size - data) {
      return fail("entry '", e.name, "' (", usize, " bytes at ", data, ") is past the end (",
                  size, " bytes)");
    }
    if (!readable(local, kLocalSize + lname)) {
      return unread("the local header of entry '", e.name, "'");
    }
    if (!readable(data, usize)) {
      if (hole_covered || data > hole.begin || data + usize < hole.end) {
        return unread("part of entry '", e.name, "'");
      }
      hole_covered = e.covers_hole = true;
    }
    if (std::string_view(base + local + kLocalSize, lname) != e.name) {
      return fail("entry '", e.name, "': the local header names another entry");
    }
    if (GetLE16(base + local + 8) != method) {
      return fail("entry '", e.name, "': the local header's method differs");
    }
    e.data_offset = data;
    e.size = usize;
    e.crc32 = crc;
    if (check_crc && !e.covers_hole) {
      uint32_t actual = Crc32(archive.data() + data, usize);
      if (actual != crc) {
        return fail("entry '", e.name, "' has CRC-32 ", actual, ", its header says ", crc);
      }
    }
    entries.push_back(std::move(e));
    pos += kCentralSize + name_len + extra_len + comment_len;
  }
  return entries;
}

const ZipEntry* FindTorchZipEntry(const std::vector<ZipEntry>& entries, std::string_view suffix) {
  for (const ZipEntry& e : entries) {
    size_t slash = e.name.find('/');
    if (slash == std::string::npos || slash == 0) continue;
    if (std::string_view(e.name).substr(slash + 1) == suffix) return &e;
  }
  return nullptr;
}

}  // namespace tensorstash
