// OCDBT codecs. Every structure is an envelope -
//   magic (uint32 big-endian) | length of the whole encoding (uint64 LE) | version (varint, 0) |
//   compression (varint: 0 none, 1 zstd) | body | crc32c of all preceding bytes (uint32 LE)
// - whose body is a sequence of columns: a count, then each field for every entry in turn.
#include "tensorstash/kvstore/ocdbt/ocdbt_format.h"

#include <zstd.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/endian.h"

namespace tensorstash::ocdbt {
namespace {

constexpr size_t kHeaderFixedBytes = 4 + 8;  // magic, length
constexpr size_t kFooterBytes = 4;           // crc32c

// A cursor over untrusted bytes with a sticky error: once a read fails, status() holds a
// DataLoss naming `what` and every later read fails too.
class ByteReader {
 public:
  ByteReader(std::string_view data, std::string_view what) : data_(data), what_(what) {}

  size_t remaining() const { return data_.size() - pos_; }
  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }

  bool Fail(std::string_view message) {
    if (status_.ok()) status_ = DataLossError(StrCat(what_, ": ", message));
    return false;
  }

  bool Byte(uint8_t* out, std::string_view field) {
    if (!ok()) return false;
    if (remaining() < 1) return Fail(StrCat("truncated reading ", field));
    *out = static_cast<uint8_t>(data_[pos_++]);
    return true;
  }

  // A uleb128 of at most 64 bits (10 bytes), not above `max`.
  bool Varint(uint64_t* out, std::string_view field,
              uint64_t max = std::numeric_limits<uint64_t>::max()) {
    if (!ok()) return false;
    uint64_t value = 0;
    for (int shift = 0;; shift += 7) {
      if (remaining() < 1) return Fail(StrCat("truncated varint in ", field));
      const uint8_t byte = static_cast<uint8_t>(data_[pos_++]);
      if (shift == 63 && byte > 1) return Fail(StrCat("varint in ", field, " exceeds 64 bits"));
      value |= uint64_t{byte & 0x7fu} << shift;
      if ((byte & 0x80) == 0) break;
    }
    if (value > max) {
      return Fail(StrCat(field, " = ", value, " exceeds the limit of ", max));
    }
    *out = value;
    return true;
  }

  template <typename Int>
  bool VarintAs(Int* out, std::string_view field, uint64_t max = std::numeric_limits<Int>::max()) {
    uint64_t value;
    if (!Varint(&value, field, max)) return false;
    *out = static_cast<Int>(value);
    return true;
  }

  bool LE32(uint32_t* out, std::string_view field) {
    std::string_view bytes;
    if (!Bytes(4, &bytes, field)) return false;
    *out = GetLE32(bytes.data());
    return true;
  }
  bool LE64(uint64_t* out, std::string_view field) {
    std::string_view bytes;
    if (!Bytes(8, &bytes, field)) return false;
    *out = GetLE64(bytes.data());
    return true;
  }

  bool Bytes(uint64_t n, std::string_view* out, std::string_view field) {
    if (!ok()) return false;
    if (n > remaining()) {
      return Fail(
          StrCat("truncated reading ", field, " (", n, " bytes wanted, ", remaining(), " left)"));
    }
    *out = data_.substr(pos_, n);
    pos_ += n;
    return true;
  }

  // A count of entries that each take at least `min_bytes_each` more bytes: rejecting counts
  // the remaining bytes cannot hold bounds every allocation by the input size.
  bool Count(uint64_t* out, std::string_view field, uint64_t max, size_t min_bytes_each) {
    if (!Varint(out, field, max)) return false;
    if (min_bytes_each > 0 && *out > remaining() / min_bytes_each) {
      return Fail(StrCat(field, " = ", *out, " is more than the remaining ", remaining(),
                         " bytes can hold"));
    }
    return true;
  }

  bool ExpectEnd(std::string_view structure) {
    if (!ok()) return false;
    if (remaining() != 0) {
      return Fail(StrCat(remaining(), " unexpected trailing bytes after the ", structure));
    }
    return true;
  }

 private:
  std::string_view data_;
  size_t pos_ = 0;
  std::string what_;
  Status status_;
};

uint32_t GetBE32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return (uint32_t{u[0]} << 24) | (uint32_t{u[1]} << 16) | (uint32_t{u[2]} << 8) | u[3];
}

// Checks the envelope and returns its body, decompressed into `*storage` when needed.
Result<std::string_view> OpenEnvelope(std::string_view encoded, uint32_t magic,
                                      std::string_view what, std::string* storage) {
  if (encoded.size() < kHeaderFixedBytes + 2 + kFooterBytes) {
    return DataLossError(StrCat(what, ": truncated: ", encoded.size(),
                                " bytes is shorter than any OCDBT header and footer"));
  }
  const uint32_t found_magic = GetBE32(encoded.data());
  if (found_magic != magic) {
    return DataLossError(
        StrCat(what, ": bad magic 0x", Hex32(found_magic), ", expected 0x", Hex32(magic)));
  }
  const uint64_t length = GetLE64(encoded.data() + 4);
  if (length != encoded.size()) {
    return DataLossError(StrCat(what, ": header says ", length, " bytes but there are ",
                                encoded.size(), " (truncated or trailing data)"));
  }
  const std::string_view covered = encoded.substr(0, encoded.size() - kFooterBytes);
  const uint32_t stored_crc = GetLE32(encoded.data() + covered.size());
  const uint32_t actual_crc = Crc32c(covered);
  if (stored_crc != actual_crc) {
    return DataLossError(StrCat(what, ": crc32c mismatch (stored ", Hex32(stored_crc),
                                ", computed ", Hex32(actual_crc), ")"));
  }
  ByteReader reader(covered.substr(kHeaderFixedBytes), what);
  uint32_t version = 0, compression = 0;
  reader.VarintAs(&version, "format version");
  reader.VarintAs(&compression, "compression format");
  if (!reader.ok()) return reader.status();
  if (version != 0) {
    return UnimplementedError(
        StrCat(what, ": OCDBT format version ", version, " is not supported (only 0)"));
  }
  std::string_view body;
  reader.Bytes(reader.remaining(), &body, "body");
  if (compression == 0) return body;
  if (compression != 1) {
    return DataLossError(StrCat(what, ": unknown compression format ", compression));
  }
  // zstd, streamed so that an untrusted frame cannot make us allocate beyond the limit.
  ZSTD_DCtx* dctx = ZSTD_createDCtx();
  if (dctx == nullptr) return InternalError("ZSTD_createDCtx failed");
  storage->clear();
  ZSTD_inBuffer in{body.data(), body.size(), 0};
  size_t ret = 1;
  std::string error;
  while (in.pos < in.size || ret != 0) {
    if (storage->size() >= kMaxDecodedBytes) {
      error = StrCat("decompresses to more than ", kMaxDecodedBytes, " bytes");
      break;
    }
    const size_t old_size = storage->size();
    const size_t grow =
        std::min<uint64_t>(std::max<size_t>(old_size, 64 * 1024), kMaxDecodedBytes - old_size);
    storage->resize(old_size + grow);
    ZSTD_outBuffer out{storage->data() + old_size, grow, 0};
    const size_t in_before = in.pos;
    ret = ZSTD_decompressStream(dctx, &out, &in);
    storage->resize(old_size + out.pos);
    if (ZSTD_isError(ret)) {
      error = StrCat("zstd: ", ZSTD_getErrorName(ret));
      break;
    }
    if (in.pos == in.size && ret != 0 && out.pos == 0 && in.pos == in_before) {
      error = "zstd frame is truncated";
      break;
    }
  }
  ZSTD_freeDCtx(dctx);
  if (!error.empty()) return DataLossError(StrCat(what, ": ", error));
  return std::string_view(*storage);
}

bool ReadDataFileTable(ByteReader& r, std::string_view transitive_path,
                       std::vector<DataFileId>* files) {
  uint64_t num_files;
  // Each file takes at least two bytes (suffix and base lengths).
  if (!r.Count(&num_files, "num_files", std::numeric_limits<uint32_t>::max(), 2)) return false;
  std::vector<uint16_t> prefix(num_files, 0), suffix(num_files), base(num_files);
  for (uint64_t i = 1; i < num_files; ++i) r.VarintAs(&prefix[i], "path_prefix_length");
  for (uint64_t i = 0; i < num_files; ++i) r.VarintAs(&suffix[i], "path_suffix_length");
  for (uint64_t i = 0; i < num_files; ++i) r.VarintAs(&base[i], "base_path_length");
  if (!r.ok()) return false;
  const size_t max_length = kMaxPathLength - std::min(kMaxPathLength, transitive_path.size());
  files->clear();
  files->reserve(num_files);
  std::string prev_path;
  size_t prev_base = 0;
  for (uint64_t i = 0; i < num_files; ++i) {
    if (prefix[i] > prev_path.size()) {
      return r.Fail(StrCat("data file ", i, ": path_prefix_length ", prefix[i],
                           " exceeds the previous path's length ", prev_path.size()));
    }
    const size_t path_length = size_t{prefix[i]} + suffix[i];
    if (path_length > max_length) {
      return r.Fail(StrCat("data file ", i, ": path of ", path_length, " bytes is too long (limit ",
                           max_length, ")"));
    }
    if (base[i] > path_length) {
      return r.Fail(StrCat("data file ", i, ": base_path_length ", base[i],
                           " exceeds the path length ", path_length));
    }
    if (prefix[i] > std::min<size_t>(prev_base, base[i]) && base[i] != prev_base) {
      return r.Fail(
          StrCat("data file ", i, ": common prefix ", prefix[i], " crosses a base path boundary"));
    }
    std::string_view tail;
    if (!r.Bytes(suffix[i], &tail, "path_suffix")) return false;
    std::string path = prev_path.substr(0, prefix[i]);
    path.append(tail);
    DataFileId id;
    id.base_path = StrCat(transitive_path, std::string_view(path).substr(0, base[i]));
    id.relative_path = path.substr(base[i]);
    files->push_back(std::move(id));
    prev_path = std::move(path);
    prev_base = base[i];
  }
  return true;
}

// `allow_missing`: version roots of empty trees are "missing" locations.
bool ReadLocations(ByteReader& r, size_t num_files, bool with_length, bool allow_missing,
                   std::vector<Location*> out) {
  for (Location* loc : out) r.VarintAs(&loc->file, "data_file_id");
  for (Location* loc : out) r.Varint(&loc->offset, "data_file_offset");
  if (with_length) {
    for (Location* loc : out) r.Varint(&loc->length, "data_file_length");
  }
  if (!r.ok()) return false;
  for (Location* loc : out) {
    if (allow_missing && loc->missing()) continue;
    if (loc->file >= num_files) {
      return r.Fail(StrCat("data_file_id ", loc->file, " is outside the table of ", num_files,
                           " data files"));
    }
    const uint64_t limit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    if (loc->offset > limit || loc->length > limit - loc->offset) {
      return r.Fail(StrCat("invalid offset/length ", loc->offset, "/", loc->length));
    }
  }
  return true;
}

bool ReadStatistics(ByteReader& r, std::vector<Statistics*> out) {
  for (Statistics* s : out) r.Varint(&s->num_keys, "num_keys");
  for (Statistics* s : out) r.Varint(&s->num_tree_bytes, "num_tree_bytes");
  for (Statistics* s : out) r.Varint(&s->num_indirect_value_bytes, "num_indirect_value_bytes");
  return r.ok();
}

bool ReadConfig(ByteReader& r, Config* config) {
  std::string_view uuid;
  if (!r.Bytes(16, &uuid, "uuid")) return false;
  std::copy(uuid.begin(), uuid.end(), config->uuid.begin());
  if (!r.Byte(&config->manifest_kind, "manifest_kind")) return false;
  if (config->manifest_kind > 1) {
    return r.Fail(StrCat("unknown manifest_kind ", int{config->manifest_kind}));
  }
  r.VarintAs(&config->max_inline_value_bytes, "max_inline_value_bytes");
  r.VarintAs(&config->max_decoded_node_bytes, "max_decoded_node_bytes");
  if (!r.Byte(&config->version_tree_arity_log2, "version_tree_arity_log2")) return false;
  if (config->version_tree_arity_log2 < 1 || config->version_tree_arity_log2 > 16) {
    return r.Fail(StrCat("version_tree_arity_log2 ", int{config->version_tree_arity_log2},
                         " is outside [1, 16]"));
  }
  uint32_t method;
  if (!r.VarintAs(&method, "compression_method")) return false;
  if (method == 0) {
    config->zstd = false;
  } else if (method == 1) {
    config->zstd = true;
    uint32_t level;
    if (!r.LE32(&level, "zstd level")) return false;
    config->zstd_level = static_cast<int32_t>(level);
    if (config->zstd_level < ZSTD_minCLevel() || config->zstd_level > ZSTD_maxCLevel()) {
      return r.Fail(StrCat("zstd level ", config->zstd_level, " is out of range"));
    }
  } else {
    return r.Fail(StrCat("unknown compression_method ", method));
  }
  return true;
}

bool ReadVersions(ByteReader& r, const Config& config, size_t num_files,
                  std::vector<VersionRef>* versions) {
  const uint64_t max_versions = uint64_t{1} << config.version_tree_arity_log2;
  uint64_t n;
  // Each version takes at least 14 bytes (8 of them the commit time).
  if (!r.Count(&n, "num_versions", max_versions, 14)) return false;
  if (n == 0) return r.Fail("a manifest without versions");
  versions->resize(n);
  for (auto& v : *versions) r.Varint(&v.generation, "generation_number");
  for (auto& v : *versions) r.Byte(&v.root_height, "root_height");
  std::vector<Location*> locations;
  std::vector<Statistics*> stats;
  for (auto& v : *versions) {
    locations.push_back(&v.root);
    stats.push_back(&v.statistics);
  }
  if (!ReadLocations(r, num_files, true, true, locations)) return false;
  if (!ReadStatistics(r, stats)) return false;
  for (auto& v : *versions) r.LE64(&v.commit_time_ns, "commit_time");
  if (!r.ok()) return false;
  for (size_t i = 0; i < n; ++i) {
    const VersionRef& v = (*versions)[i];
    if (v.generation == 0) return r.Fail(StrCat("generation_number[", i, "] is 0"));
    if (i > 0 && v.generation <= (*versions)[i - 1].generation) {
      return r.Fail(StrCat("generation numbers are not increasing at ", i));
    }
    if (v.root.missing() && v.root_height != 0) {
      return r.Fail(
          StrCat("empty generation ", v.generation, " has root_height ", int{v.root_height}));
    }
  }
  if (n > (versions->back().generation - 1) % max_versions + 1) {
    return r.Fail(StrCat(n, " inline versions are too many for last generation ",
                         versions->back().generation));
  }
  return true;
}

bool ReadVersionNodes(ByteReader& r, const Config& config, size_t num_files,
                      std::vector<VersionNodeRef>* nodes) {
  const uint64_t max_height = 63 / config.version_tree_arity_log2 - 1;
  uint64_t n;
  if (!r.Count(&n, "num_version_nodes", max_height, 13)) return false;
  nodes->resize(n);
  for (auto& v : *nodes) r.Varint(&v.generation, "generation_number");
  std::vector<Location*> locations;
  for (auto& v : *nodes) locations.push_back(&v.location);
  if (!ReadLocations(r, num_files, true, false, locations)) return false;
  for (auto& v : *nodes) r.Varint(&v.num_generations, "num_generations");
  for (auto& v : *nodes) r.LE64(&v.commit_time, "commit_time");
  for (auto& v : *nodes) r.Byte(&v.height, "entry_height");
  if (!r.ok()) return false;
  for (size_t i = 0; i < n; ++i) {
    const VersionNodeRef& v = (*nodes)[i];
    if (v.height == 0 || v.height > max_height) {
      return r.Fail(
          StrCat("version node height ", int{v.height}, " is outside [1, ", max_height, "]"));
    }
    if (v.generation == 0) return r.Fail("version node generation_number is 0");
    if (i > 0 &&
        (v.generation <= (*nodes)[i - 1].generation || v.height >= (*nodes)[i - 1].height)) {
      return r.Fail(StrCat("version nodes are out of order at ", i));
    }
  }
  return true;
}

// The key columns shared by leaf and interior nodes; fills (*keys)[i] with full node keys.
bool ReadKeys(ByteReader& r, size_t n, std::vector<std::string*> keys,
              std::vector<uint16_t>* subtree_prefix) {
  std::vector<uint16_t> prefix(n, 0), suffix(n);
  for (size_t i = 1; i < n; ++i) r.VarintAs(&prefix[i], "key_prefix_length");
  for (size_t i = 0; i < n; ++i) r.VarintAs(&suffix[i], "key_suffix_length");
  if (subtree_prefix != nullptr) {
    subtree_prefix->resize(n);
    for (size_t i = 0; i < n; ++i) r.VarintAs(&(*subtree_prefix)[i], "subtree_prefix_length");
  }
  if (!r.ok()) return false;
  // Keys are rebuilt from shared prefixes, so a small node could describe huge keys; bound the
  // total so that memory stays proportional to the limit, not to n * 64 KiB.
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const size_t prev_length = i == 0 ? 0 : keys[i - 1]->size();
    if (prefix[i] > prev_length) {
      return r.Fail(StrCat("key ", i, ": prefix length ", prefix[i],
                           " exceeds the previous key's length ", prev_length));
    }
    const size_t length = size_t{prefix[i]} + suffix[i];
    if (length > kMaxKeyLength) {
      return r.Fail(StrCat("key ", i, " is ", length, " bytes, over the limit ", kMaxKeyLength));
    }
    total += length;
    if (total > kMaxDecodedBytes) {
      return r.Fail(StrCat("keys total more than ", kMaxDecodedBytes, " bytes"));
    }
    if (subtree_prefix != nullptr && (*subtree_prefix)[i] > length) {
      return r.Fail(StrCat("key ", i, ": subtree prefix length ", (*subtree_prefix)[i],
                           " exceeds the key length ", length));
    }
    std::string_view tail;
    if (!r.Bytes(suffix[i], &tail, "key_suffix")) return false;
    std::string& key = *keys[i];
    if (i > 0) key.assign(*keys[i - 1], 0, prefix[i]);
    key.append(tail);
    if (i > 0 && !(key > *keys[i - 1])) {
      return r.Fail(StrCat("keys are not strictly increasing at entry ", i));
    }
  }
  return true;
}

// Encoding helpers.

size_t CommonPrefix(std::string_view a, std::string_view b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

void PutDataFileTable(std::string* out, const std::vector<DataFileId>& files) {
  PutVarint(out, files.size());
  std::vector<size_t> prefix(files.size(), 0);
  for (size_t i = 1; i < files.size(); ++i) {
    const DataFileId& prev = files[i - 1];
    const DataFileId& cur = files[i];
    size_t p = CommonPrefix(prev.base_path, cur.base_path);
    if (p == prev.base_path.size() && p == cur.base_path.size()) {
      p += CommonPrefix(prev.relative_path, cur.relative_path);
    }
    prefix[i] = p;
    PutVarint(out, p);
  }
  for (size_t i = 0; i < files.size(); ++i) PutVarint(out, files[i].FullPath().size() - prefix[i]);
  for (const DataFileId& f : files) PutVarint(out, f.base_path.size());
  for (size_t i = 0; i < files.size(); ++i) out->append(files[i].FullPath().substr(prefix[i]));
}

void PutKeys(std::string* out, const std::vector<const std::string*>& keys,
             const std::vector<uint16_t>* subtree_prefix) {
  std::vector<size_t> prefix(keys.size(), 0);
  for (size_t i = 1; i < keys.size(); ++i) {
    prefix[i] = CommonPrefix(*keys[i - 1], *keys[i]);
    PutVarint(out, prefix[i]);
  }
  for (size_t i = 0; i < keys.size(); ++i) PutVarint(out, keys[i]->size() - prefix[i]);
  if (subtree_prefix != nullptr) {
    for (uint16_t s : *subtree_prefix) PutVarint(out, s);
  }
  for (size_t i = 0; i < keys.size(); ++i) out->append(*keys[i], prefix[i]);
}

void PutStatistics(std::string* out, const std::vector<const Statistics*>& stats) {
  for (const Statistics* s : stats) PutVarint(out, s->num_keys);
  for (const Statistics* s : stats) PutVarint(out, s->num_tree_bytes);
  for (const Statistics* s : stats) PutVarint(out, s->num_indirect_value_bytes);
}

}  // namespace

size_t BtreeNode::MemoryBytes() const {
  size_t bytes = sizeof(*this);
  for (const DataFileId& f : files)
    bytes += sizeof(f) + f.base_path.size() + f.relative_path.size();
  for (const LeafEntry& e : leaves) bytes += sizeof(e) + e.key.size() + e.inline_value.size();
  for (const InteriorEntry& e : children) bytes += sizeof(e) + e.key.size();
  return bytes;
}

void PutVarint(std::string* out, uint64_t value) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

Result<std::string> EncodeEnvelope(uint32_t magic, std::string_view body, bool zstd,
                                   int zstd_level) {
  std::string out(kHeaderFixedBytes, '\0');
  out[0] = static_cast<char>(magic >> 24);
  out[1] = static_cast<char>(magic >> 16);
  out[2] = static_cast<char>(magic >> 8);
  out[3] = static_cast<char>(magic);
  PutVarint(&out, 0);  // format version
  PutVarint(&out, zstd ? 1 : 0);
  if (zstd) {
    const size_t start = out.size();
    out.resize(start + ZSTD_compressBound(body.size()));
    const size_t n =
        ZSTD_compress(out.data() + start, out.size() - start, body.data(), body.size(), zstd_level);
    if (ZSTD_isError(n)) {
      return InternalError(StrCat("zstd compression failed: ", ZSTD_getErrorName(n)));
    }
    out.resize(start + n);
  } else {
    out.append(body);
  }
  const uint64_t length = out.size() + kFooterBytes;
  std::string length_bytes;
  PutLE64(&length_bytes, length);
  out.replace(4, 8, length_bytes);
  PutLE32(&out, Crc32c(out));
  return out;
}

Result<Manifest> DecodeManifest(std::string_view encoded, std::string_view what) {
  std::string storage;
  TS_ASSIGN_OR_RETURN(std::string_view body, OpenEnvelope(encoded, kManifestMagic, what, &storage));
  ByteReader r(body, what);
  Manifest manifest;
  if (!ReadConfig(r, &manifest.config)) return r.status();
  if (manifest.config.manifest_kind == 0) {
    if (!ReadDataFileTable(r, "", &manifest.files) ||
        !ReadVersions(r, manifest.config, manifest.files.size(), &manifest.versions) ||
        !ReadVersionNodes(r, manifest.config, manifest.files.size(), &manifest.version_nodes)) {
      return r.status();
    }
    // The generations in version nodes precede those stored inline.
    if (!manifest.version_nodes.empty() &&
        manifest.version_nodes.back().generation >= manifest.versions.front().generation) {
      r.Fail("version nodes reference generations newer than the inline versions");
    }
  }
  if (!r.ExpectEnd("manifest")) return r.status();
  return manifest;
}

Result<BtreeNode> DecodeBtreeNode(std::string_view encoded, std::string_view transitive_path,
                                  std::string_view what) {
  std::string storage;
  TS_ASSIGN_OR_RETURN(std::string_view body,
                      OpenEnvelope(encoded, kBtreeNodeMagic, what, &storage));
  ByteReader r(body, what);
  BtreeNode node;
  if (!r.Byte(&node.height, "height") || !ReadDataFileTable(r, transitive_path, &node.files)) {
    return r.status();
  }
  uint64_t n;
  // Each entry takes at least 3 bytes (suffix length, value length and kind, or more).
  if (!r.Count(&n, "num_entries", kMaxNodeArity, 3)) return r.status();
  if (n == 0) {
    r.Fail("empty B+tree node");
    return r.status();
  }
  std::vector<std::string*> keys;
  if (node.height == 0) {
    node.leaves.resize(n);
    for (LeafEntry& e : node.leaves) keys.push_back(&e.key);
    if (!ReadKeys(r, n, keys, nullptr)) return r.status();
    std::vector<uint64_t> lengths(n);
    for (uint64_t& length : lengths) r.Varint(&length, "value_length");
    std::vector<Location*> indirect;
    for (size_t i = 0; i < n; ++i) {
      uint8_t kind = 0;
      if (!r.Byte(&kind, "value_kind")) return r.status();
      if (kind > 1) {
        r.Fail(StrCat("value_kind[", i, "] = ", int{kind}, " is not 0 or 1"));
        return r.status();
      }
      LeafEntry& e = node.leaves[i];
      e.is_inline = kind == 0;
      if (e.is_inline && lengths[i] > kMaxInlineValueLength) {
        r.Fail(StrCat("inline value ", i, " of ", lengths[i], " bytes exceeds the limit ",
                      kMaxInlineValueLength));
        return r.status();
      }
      if (!e.is_inline) {
        e.location.length = lengths[i];
        indirect.push_back(&e.location);
      }
    }
    // Indirect values are (file, offset); their length was the value_length column.
    for (Location* loc : indirect) {
      if (!r.VarintAs(&loc->file, "data_file_id")) return r.status();
      if (loc->file >= node.files.size()) {
        r.Fail(StrCat("data_file_id ", loc->file, " is outside the table of ", node.files.size(),
                      " data files"));
        return r.status();
      }
    }
    for (Location* loc : indirect) {
      r.Varint(&loc->offset, "data_file_offset");
      const uint64_t limit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
      if (r.ok() && (loc->offset > limit || loc->length > limit - loc->offset)) {
        r.Fail(StrCat("invalid value offset/length ", loc->offset, "/", loc->length));
      }
    }
    for (size_t i = 0; i < n && r.ok(); ++i) {
      LeafEntry& e = node.leaves[i];
      if (!e.is_inline) continue;
      std::string_view value;
      if (r.Bytes(lengths[i], &value, "inline value")) e.inline_value.assign(value);
    }
  } else {
    node.children.resize(n);
    for (InteriorEntry& e : node.children) keys.push_back(&e.key);
    std::vector<uint16_t> subtree_prefix;
    if (!ReadKeys(r, n, keys, &subtree_prefix)) return r.status();
    std::vector<Location*> locations;
    std::vector<Statistics*> stats;
    for (size_t i = 0; i < n; ++i) {
      InteriorEntry& e = node.children[i];
      e.subtree_prefix_length = subtree_prefix[i];
      locations.push_back(&e.location);
      stats.push_back(&e.statistics);
    }
    if (ReadLocations(r, node.files.size(), true, false, locations)) ReadStatistics(r, stats);
  }
  if (!r.ExpectEnd("B+tree node")) return r.status();
  return node;
}

Result<std::string> EncodeManifest(const Manifest& manifest) {
  const Config& c = manifest.config;
  std::string body(reinterpret_cast<const char*>(c.uuid.data()), c.uuid.size());
  body.push_back(static_cast<char>(c.manifest_kind));
  PutVarint(&body, c.max_inline_value_bytes);
  PutVarint(&body, c.max_decoded_node_bytes);
  body.push_back(static_cast<char>(c.version_tree_arity_log2));
  PutVarint(&body, c.zstd ? 1 : 0);
  if (c.zstd) PutLE32(&body, static_cast<uint32_t>(c.zstd_level));
  if (c.manifest_kind == 0) {
    PutDataFileTable(&body, manifest.files);
    const auto& v = manifest.versions;
    PutVarint(&body, v.size());
    for (const auto& e : v) PutVarint(&body, e.generation);
    for (const auto& e : v) body.push_back(static_cast<char>(e.root_height));
    for (const auto& e : v) PutVarint(&body, e.root.file);
    for (const auto& e : v) PutVarint(&body, e.root.offset);
    for (const auto& e : v) PutVarint(&body, e.root.length);
    std::vector<const Statistics*> stats;
    for (const auto& e : v) stats.push_back(&e.statistics);
    PutStatistics(&body, stats);
    for (const auto& e : v) PutLE64(&body, e.commit_time_ns);
    const auto& nodes = manifest.version_nodes;
    PutVarint(&body, nodes.size());
    for (const auto& e : nodes) PutVarint(&body, e.generation);
    for (const auto& e : nodes) PutVarint(&body, e.location.file);
    for (const auto& e : nodes) PutVarint(&body, e.location.offset);
    for (const auto& e : nodes) PutVarint(&body, e.location.length);
    for (const auto& e : nodes) PutVarint(&body, e.num_generations);
    for (const auto& e : nodes) PutLE64(&body, e.commit_time);
    for (const auto& e : nodes) body.push_back(static_cast<char>(e.height));
  }
  return EncodeEnvelope(kManifestMagic, body, c.zstd, c.zstd_level);
}

Result<std::string> EncodeBtreeNode(const BtreeNode& node, const Config& config) {
  std::string body(1, static_cast<char>(node.height));
  PutDataFileTable(&body, node.files);
  std::vector<const std::string*> keys;
  if (node.height == 0) {
    PutVarint(&body, node.leaves.size());
    for (const LeafEntry& e : node.leaves) keys.push_back(&e.key);
    PutKeys(&body, keys, nullptr);
    for (const LeafEntry& e : node.leaves) PutVarint(&body, e.value_length());
    for (const LeafEntry& e : node.leaves) body.push_back(e.is_inline ? 0 : 1);
    for (const LeafEntry& e : node.leaves) {
      if (!e.is_inline) PutVarint(&body, e.location.file);
    }
    for (const LeafEntry& e : node.leaves) {
      if (!e.is_inline) PutVarint(&body, e.location.offset);
    }
    for (const LeafEntry& e : node.leaves) {
      if (e.is_inline) body.append(e.inline_value);
    }
  } else {
    PutVarint(&body, node.children.size());
    std::vector<uint16_t> subtree_prefix;
    std::vector<const Statistics*> stats;
    for (const InteriorEntry& e : node.children) {
      keys.push_back(&e.key);
      subtree_prefix.push_back(e.subtree_prefix_length);
      stats.push_back(&e.statistics);
    }
    PutKeys(&body, keys, &subtree_prefix);
    for (const InteriorEntry& e : node.children) PutVarint(&body, e.location.file);
    for (const InteriorEntry& e : node.children) PutVarint(&body, e.location.offset);
    for (const InteriorEntry& e : node.children) PutVarint(&body, e.location.length);
    PutStatistics(&body, stats);
  }
  return EncodeEnvelope(kBtreeNodeMagic, body, config.zstd, config.zstd_level);
}

}  // namespace tensorstash::ocdbt
