#include "fuzz/fuzz_targets.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "tensorstash/array/dtype.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/format/chunk_codec.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/format/dcp/pickle.h"
#include "tensorstash/format/dcp/torch_zip.h"
#include "tensorstash/format/index_format.h"
#include "tensorstash/format/safetensors/safetensors_header.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/kvstore/ocdbt/ocdbt_kvstore.h"
#include "tensorstash/util/endian.h"

// A property that must hold for every input; aborts (a finding) when it does not.
#define TS_FUZZ_CHECK(cond, ...)                                                          \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "fuzz check failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                       \
    }                                                                                     \
  } while (false)

namespace tensorstash {
namespace fuzz {
namespace {

std::string_view AsView(const uint8_t* data, size_t size) {
  return std::string_view(reinterpret_cast<const char*>(data), size);
}

// Largest array a step target reads whole; bigger ones are skipped (the harness's buffer, not
// the reader, would be the huge allocation).
constexpr uint64_t kMaxReadBytes = uint64_t{16} << 20;

}  // namespace

void FuzzIndex(const uint8_t* data, size_t size) {
  const std::string_view bytes = AsView(data, size);
  Result<ChunkIndex> index = DecodeIndex(bytes, "fuzz/index");
  if (!index.ok()) {
    TS_FUZZ_CHECK(!index.status().message().empty());
    return;
  }
  Result<std::string> encoded = EncodeIndex(*index);
  TS_FUZZ_CHECK(encoded.ok());
  if (*encoded == bytes) return;
  // Only the version may differ: a minor version other than 0, or a 2.0 index that uses no
  // 2.0 feature (no reference, no digest), which the encoder writes as 1.0. The content is the
  // same either way.
  const uint16_t major = GetLE16(bytes.data() + 8);
  const uint16_t minor = GetLE16(bytes.data() + 10);
  TS_FUZZ_CHECK(minor != 0 || (major == 2 && !IndexNeedsVersion2(*index)));
  Result<ChunkIndex> again = DecodeIndex(*encoded, "fuzz/index (re-encoded)");
  TS_FUZZ_CHECK(again.ok());
  TS_FUZZ_CHECK(again->files == index->files && again->entries == index->entries);
}

void FuzzTreeJson(const uint8_t* data, size_t size) {
  const std::string_view text = AsView(data, size);
  (void)TreeNodeFromJson(text);
  Result<TreeFile> tree = DecodeTreeJson(text, "fuzz/tree.json");
  if (!tree.ok()) return;
  Result<std::string> encoded = EncodeTreeJson(*tree);
  TS_FUZZ_CHECK(encoded.ok());
  Result<TreeFile> again = DecodeTreeJson(*encoded, "fuzz/tree.json (re-encoded)");
  TS_FUZZ_CHECK(again.ok());
  TS_FUZZ_CHECK(again->arrays.size() == tree->arrays.size());
  for (size_t i = 0; i < tree->arrays.size(); ++i) {
    TS_FUZZ_CHECK(again->arrays[i].path == tree->arrays[i].path);
    TS_FUZZ_CHECK(again->arrays[i].dtype == tree->arrays[i].dtype);
    TS_FUZZ_CHECK(again->arrays[i].shape() == tree->arrays[i].shape());
  }
}

void FuzzCommitRecord(const uint8_t* data, size_t size) {
  Result<CommitRecord> record = DecodeCommitRecord(AsView(data, size), "fuzz/COMMIT");
  if (!record.ok()) return;
  Result<CommitRecord> again =
      DecodeCommitRecord(EncodeCommitRecord(*record), "fuzz/COMMIT (re-encoded)");
  TS_FUZZ_CHECK(again.ok());
  TS_FUZZ_CHECK(*again == *record);
}

void FuzzChunkCodec(const uint8_t* data, size_t size) {
  if (size < 3) return;
  // Up to 256 KiB: big enough for any frame the fuzzer builds, small enough to run fast.
  const size_t raw_size =
      (data[0] | (size_t{data[1]} << 8) | (size_t{data[2]} << 16)) % ((size_t{256} << 10) + 1);
  std::vector<char> dest(raw_size);
  (void)DecodeChunk(Codec::kZstd, AsView(data + 3, size - 3), dest.data(), raw_size, "fuzz chunk");
  (void)DecodeChunk(Codec::kNone, AsView(data + 3, size - 3), dest.data(), raw_size, "fuzz chunk");
}

// The files of a bundle (see DecodeBundle), each under `prefix`/; invalid keys are skipped.
void LoadBundle(const uint8_t* data, size_t size, std::string_view prefix, MemoryKvStore* kv) {
  for (const auto& [key, value] : DecodeBundle(AsView(data, size))) {
    if (!ValidateKey(key).ok()) continue;
    (void)kv->Write(StrCat(prefix, "/", key), value);
  }
}

// Small caps and one thread: a fuzz run must stay fast and deterministic.
ReaderOptions FuzzReaderOptions() {
  ReaderOptions options;
  options.io_threads = 1;
  options.max_inflight_bytes = 1 << 20;
  return options;
}

void FuzzStep(const uint8_t* data, size_t size) {
  MemoryKvStore kv;
  LoadBundle(data, size, "step", &kv);
  Result<std::unique_ptr<CheckpointReader>> reader =
      CheckpointReader::Open(&kv, "step", FuzzReaderOptions());
  if (!reader.ok()) {
    TS_FUZZ_CHECK(!reader.status().message().empty());
    return;
  }
  for (const ArrayMetadata& array : (*reader)->arrays()) {
    const Box whole = Box::FromShape(array.shape());
    const uint64_t bytes = static_cast<uint64_t>(whole.num_elements()) * ItemSize(array.dtype);
    if (bytes > kMaxReadBytes) continue;
    std::vector<char> dest(bytes);
    (void)(*reader)->Read({array.path, whole, array.dtype, dest.data()});
  }
  (void)(*reader)->Verify();
}

void FuzzOcdbt(const uint8_t* data, size_t size) {
  MemoryKvStore kv;
  LoadBundle(data, size, "db", &kv);
  Result<std::unique_ptr<OcdbtKvStore>> store = OcdbtKvStore::Open(&kv, "db");
  if (!store.ok()) {
    TS_FUZZ_CHECK(!store.status().message().empty());
    return;
  }
  Result<std::vector<std::string>> keys = (*store)->List("");
  if (!keys.ok()) return;
  for (const std::string& key : *keys) {
    Result<uint64_t> size_of = (*store)->Size(key);
    if (!size_of.ok() || *size_of > kMaxReadBytes) continue;
    Result<std::string> value = (*store)->Read(key);
    TS_FUZZ_CHECK(!value.ok() || value->size() == *size_of);
  }
}

void FuzzForeignStep(const uint8_t* data, size_t size) {
  MemoryKvStore kv;
  LoadBundle(data, size, "step", &kv);
  Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "step", FuzzReaderOptions());
  if (!source.ok()) {
    TS_FUZZ_CHECK(!source.status().message().empty());
    return;
  }
  for (const ArrayMetadata& array : (*source)->arrays()) {
    const Box whole = Box::FromShape(array.shape());
    const uint64_t bytes = static_cast<uint64_t>(whole.num_elements()) * ItemSize(array.dtype);
    if (bytes > kMaxReadBytes) continue;
    std::vector<char> dest(bytes);
    (void)(*source)->ReadMany({{array.path, whole, array.dtype, dest.data()}}, nullptr, nullptr);
  }
  (void)(*source)->Verify(nullptr);
}

void FuzzSafetensorsHeader(const uint8_t* data, size_t size) {
  const std::string_view file(reinterpret_cast<const char*>(data), size);
  Result<uint64_t> n = ParseSafetensorsHeaderLength(file.substr(0, std::min<size_t>(size, 8)),
                                                    size, "f");
  if (!n.ok()) {
    TS_FUZZ_CHECK(!n.status().message().empty());
    return;
  }
  Result<SafetensorsHeader> header = ParseSafetensorsHeader(file.substr(8, *n), size, "f");
  if (!header.ok()) {
    TS_FUZZ_CHECK(!header.status().message().empty());
    return;
  }
  uint64_t at = header->data_start;
  for (const SafetensorsTensor& t : header->tensors) {
    TS_FUZZ_CHECK(t.begin == at && t.end >= t.begin);
    at = t.end;
  }
  TS_FUZZ_CHECK(at == size);
  std::vector<SafetensorsTensor> again = header->tensors;
  Result<std::string> encoded = EncodeSafetensorsHeader(again, header->metadata);
  if (encoded.ok()) {
    const std::string whole = *encoded + std::string(file.substr(header->data_start));
    Result<SafetensorsHeader> back =
        ParseSafetensorsHeader(std::string_view(whole).substr(8, encoded->size() - 8),
                               whole.size(), "f");
    TS_FUZZ_CHECK(back.ok());
    TS_FUZZ_CHECK(back->tensors.size() == header->tensors.size());
    for (size_t i = 0; i < back->tensors.size(); ++i) {
      TS_FUZZ_CHECK(back->tensors[i].name == again[i].name);
      TS_FUZZ_CHECK(back->tensors[i].dtype == again[i].dtype);
      TS_FUZZ_CHECK(back->tensors[i].shape == again[i].shape);
      TS_FUZZ_CHECK(back->tensors[i].end - back->tensors[i].begin ==
                    header->tensors[i].end - header->tensors[i].begin);
    }
  }
  MemoryKvStore kv;
  TS_FUZZ_CHECK(kv.Write("step/model.safetensors", file).ok());
  Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "step", FuzzReaderOptions());
  TS_FUZZ_CHECK(source.ok());
  for (const ArrayMetadata& array : (*source)->arrays()) {
    const Box whole = Box::FromShape(array.shape());
    const uint64_t bytes = static_cast<uint64_t>(whole.num_elements()) * ItemSize(array.dtype);
    if (bytes > kMaxReadBytes) continue;
    std::vector<char> dest(bytes);
    TS_FUZZ_CHECK((*source)->ReadMany({{array.path, whole, array.dtype, dest.data()}}, nullptr,
                                      nullptr).ok());
  }
}

namespace {
// Visits every node reachable from `v` within `depth` levels; returns how many were visited.
size_t WalkPickle(const PickleValue* v, int depth) {
  TS_FUZZ_CHECK(v != nullptr);
  TS_FUZZ_CHECK(PickleKindName(v->kind) != "?");
  if (depth == 0) return 1;
  size_t n = 1;
  for (const PickleValue* item : v->items) n += WalkPickle(item, depth - 1);
  for (const auto& [key, value] : v->entries) {
    n += WalkPickle(key, depth - 1) + WalkPickle(value, depth - 1);
  }
  if (v->kind == PickleKind::kObject) {
    TS_FUZZ_CHECK(v->callee != nullptr && v->callee->kind == PickleKind::kGlobal);
    TS_FUZZ_CHECK(v->args != nullptr && v->args->kind == PickleKind::kTuple);
    n += WalkPickle(v->args, depth - 1);
    if (v->state != nullptr) n += WalkPickle(v->state, depth - 1);
  }
  if (v->kind == PickleKind::kPersistentId) n += WalkPickle(v->args, depth - 1);
  return n;
}
}  // namespace

void FuzzDcpPickle(const uint8_t* data, size_t size) {
  Result<PickleTree> tree = DecodePickle(AsView(data, size), DcpPickleGlobals(), "f");
  if (!tree.ok()) {
    TS_FUZZ_CHECK(tree.status().code() == absl::StatusCode::kInvalidArgument);
    TS_FUZZ_CHECK(!tree.status().message().empty());
    return;
  }
  TS_FUZZ_CHECK(tree->node_count() <= size);
  // Depth 3 keeps the walk linear-ish on hostile shapes while touching every kind of link.
  WalkPickle(&tree->root(), 3);
}

void FuzzTorchZip(const uint8_t* data, size_t size) {
  Result<std::vector<ZipEntry>> entries = ReadStoredZip(AsView(data, size), "f");
  if (!entries.ok()) {
    TS_FUZZ_CHECK(!entries.status().message().empty());
    return;
  }
  for (const ZipEntry& e : *entries) {
    TS_FUZZ_CHECK(e.data_offset <= size && e.size <= size - e.data_offset);
  }
  (void)FindTorchZipEntry(*entries, "data.pkl");
}

std::string EncodeBundle(const std::map<std::string, std::string>& files) {
  std::string out;
  for (const auto& [key, value] : files) {
    PutLE16(&out, static_cast<uint16_t>(key.size()));
    out.append(key);
    PutLE32(&out, static_cast<uint32_t>(value.size()));
    out.append(value);
  }
  return out;
}

std::map<std::string, std::string> DecodeBundle(std::string_view bytes) {
  std::map<std::string, std::string> files;
  while (bytes.size() >= 2) {
    const size_t key_size = GetLE16(bytes.data());
    if (bytes.size() - 2 < key_size + 4) break;
    std::string key(bytes.substr(2, key_size));
    const size_t value_size = GetLE32(bytes.data() + 2 + key_size);
    bytes.remove_prefix(2 + key_size + 4);
    if (bytes.size() < value_size) break;
    files[std::move(key)] = std::string(bytes.substr(0, value_size));
    bytes.remove_prefix(value_size);
  }
  return files;
}

}  // namespace fuzz
}  // namespace tensorstash
