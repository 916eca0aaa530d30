// Damaged and hostile checkpoints: every one gives a clear error (the right status code, and a
// message that names the file, array or chunk at fault) and never a crash, a hang or a huge
// allocation.
#include <sys/resource.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/format/index_format.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/endian.h"

namespace tensorstash {
namespace {

namespace fs = std::filesystem;
using test::BytesEqual;
using test::MakeBoxData;
using test::TestArray;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kStep[] = "ckpt/0000000001";
constexpr char kItem[] = "ckpt/0000000001/state";
constexpr char kCommitKey[] = "ckpt/0000000001/COMMIT";
constexpr char kTreeKey[] = "ckpt/0000000001/state/tree.json";
constexpr char kIndexKey[] = "ckpt/0000000001/state/index";

std::vector<TestArray> Arrays() {
  return {
      {{"params/w", DType::kFloat32, {64, 48}}, 1, {{4}, {0, -1}}},
      {{"params/b", DType::kInt32, {100}}, 2, {{2}, {0}}},
      {{"opt/z", DType::kFloat32, {32, 32}, Codec::kZstd}, 3, {{2}, {-1, 0}}},
      {{"step", DType::kInt64, {}}, 4, test::Replicated(0, 2)},
  };
}

long MaxRssKib() {
  struct rusage usage;
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

// A file store in a fresh folder, and its files' raw bytes, for tests that damage them by hand.
class StepFilesTest : public test::TempDirTest {
 protected:
  void SetUp() override {
    test::TempDirTest::SetUp();
    root_ = temp_dir() + "/root";
    Result<std::unique_ptr<FileKvStore>> store = FileKvStore::Open(root_);
    TS_ASSERT_OK(store.status());
    kv_ = *std::move(store);
  }
  std::string PathOf(const std::string& key) const { return root_ + "/" + key; }
  std::string ReadRaw(const std::string& key) const {
    std::ifstream in(PathOf(key), std::ios::binary);
    std::stringstream contents;
    contents << in.rdbuf();
    return contents.str();
  }
  void WriteRaw(const std::string& key, const std::string& bytes) const {
    std::ofstream out(PathOf(key), std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good()) << key;
  }

  std::string root_;
  std::unique_ptr<FileKvStore> kv_;
};

class CheckpointCorruptionTest : public StepFilesTest {
 protected:
  void SetUp() override {
    StepFilesTest::SetUp();
    WriterOptions options;
    options.sync = false;
    options.target_chunk_bytes = 1024;
    options.target_data_file_bytes = 4096;
    Result<std::unique_ptr<CheckpointWriter>> writer =
        CheckpointWriter::Create(kv_.get(), kStep, options);
    TS_ASSERT_OK(writer.status());
    std::vector<test::HeldShards> held;
    held.reserve(arrays_.size());
    for (const TestArray& a : arrays_) {
      held.push_back(test::HoldAllShards(a.spec, a.seed, a.sharding));
      TS_ASSERT_OK((*writer)->AddArray(a.spec, held.back().shards));
    }
    TS_ASSERT_OK((*writer)->Commit());
    Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv_.get(), kStep);
    TS_ASSERT_OK(reader.status());
    index_ = (*reader)->index();
    tree_ = TreeFile{(*reader)->tree(), (*reader)->arrays()};
    ASSERT_GE(index_.files.size(), 3u);
  }

  std::string FileKey(uint32_t file_id) const {
    return StrCat(kItem, "/", index_.files[file_id].name);
  }
  // Makes COMMIT agree with the current tree.json and index, so that only deeper checks can
  // catch what a test changed.
  void FixCommit() const {
    Result<CommitRecord> record = DecodeCommitRecord(ReadRaw(kCommitKey), kCommitKey);
    TS_ASSERT_OK(record.status());
    const std::string tree = ReadRaw(kTreeKey), index = ReadRaw(kIndexKey);
    CommitItem& item = record->items.at("state");
    item.tree_crc32c = Crc32c(tree);
    item.tree_size = tree.size();
    item.index_crc32c = IndexBodyCrc32c(index);
    item.index_size = index.size();
    WriteRaw(kCommitKey, EncodeCommitRecord(*record));
  }
  // Writes `index` (through the encoder, which checks little) and fixes COMMIT.
  void WriteIndex(const ChunkIndex& index) const {
    Result<std::string> bytes = EncodeIndex(index);
    TS_ASSERT_OK(bytes.status());
    WriteRaw(kIndexKey, *bytes);
    FixCommit();
  }
  // Recomputes the CRC in the footer of an index edited byte by byte.
  static void FixIndexFooter(std::string* bytes) {
    const size_t body = bytes->size() - kIndexFooterSize;
    std::string crc;
    PutLE32(&crc, Crc32c(bytes->data(), body));
    bytes->replace(body, 4, crc);
  }
  void WriteTree(const TreeFile& tree) const {
    Result<std::string> json = EncodeTreeJson(tree);
    TS_ASSERT_OK(json.status());
    WriteRaw(kTreeKey, *json);
    FixCommit();
  }

  Result<std::unique_ptr<CheckpointReader>> Open(ReaderOptions options = {}) {
    return CheckpointReader::Open(kv_.get(), kStep, options);
  }
  // The first index entry of array `path`, and a chunk of it in file `file_id` if asked.
  const IndexEntry& EntryOf(const std::string& path, int nth = 0) const {
    for (const IndexEntry& e : index_.entries) {
      if (tree_.arrays[e.array_id].path == path && nth-- == 0) return e;
    }
    ADD_FAILURE() << "no entry of " << path;
    return index_.entries[0];
  }
  std::string ChunkName(const IndexEntry& e) const {
    return tree_.arrays[e.array_id].grid.ChunkName(static_cast<int64_t>(e.chunk));
  }
  Status ReadArray(CheckpointReader* reader, const TestArray& a, std::vector<char>* out) {
    out->assign(
        static_cast<size_t>(Box::FromShape(a.spec.shape).num_elements()) * ItemSize(a.spec.dtype),
        0);
    return reader->Read({a.spec.path, Box::FromShape(a.spec.shape), a.spec.dtype, out->data()});
  }
  static void ExpectError(const Status& status, absl::StatusCode code,
                          const std::vector<std::string>& mentions) {
    EXPECT_EQ(status.code(), code) << status;
    for (const std::string& m : mentions) EXPECT_THAT(status.message(), HasSubstr(m)) << status;
  }

  const std::vector<TestArray> arrays_ = Arrays();
  ChunkIndex index_;
  TreeFile tree_;
};

TEST_F(CheckpointCorruptionTest, IntactStepReadsBack) {
  Result<std::unique_ptr<CheckpointReader>> reader = Open();
  TS_ASSERT_OK(reader.status());
  for (const TestArray& a : arrays_) {
    std::vector<char> got;
    TS_ASSERT_OK(ReadArray(reader->get(), a, &got));
    EXPECT_TRUE(BytesEqual(
        MakeBoxData(a.spec.dtype, a.spec.shape, a.seed, Box::FromShape(a.spec.shape)), got));
  }
  Result<std::vector<BadChunk>> bad = (*reader)->Verify();
  TS_ASSERT_OK(bad.status());
  EXPECT_TRUE(bad->empty());
}

TEST_F(CheckpointCorruptionTest, TruncatedDataFile) {
  const IndexEntry victim = EntryOf("params/w", 3);
  const std::string file = FileKey(victim.file_id);
  const uint64_t cut = victim.offset + victim.length / 2;
  fs::resize_file(PathOf(file), cut);

  Result<std::unique_ptr<CheckpointReader>> reader = Open();
  ExpectError(reader.status(), absl::StatusCode::kDataLoss, {file, "truncated"});

  ReaderOptions damaged;
  damaged.open_damaged = true;
  reader = Open(damaged);
  TS_ASSERT_OK(reader.status());
  Result<std::vector<BadChunk>> bad = (*reader)->Verify();
  TS_ASSERT_OK(bad.status());
  // Every chunk that reaches past the cut is reported (and only chunks of that file).
  std::set<std::pair<std::string, std::string>> reported, must;
  for (const BadChunk& b : *bad) {
    EXPECT_EQ(b.file, file);
    EXPECT_THAT(b.error, HasSubstr(file));
    reported.insert({b.array_path, b.chunk});
  }
  for (const IndexEntry& e : index_.entries) {
    if (e.file_id == victim.file_id && e.offset + e.length > cut) {
      must.insert({tree_.arrays[e.array_id].path, ChunkName(e)});
    }
  }
  ASSERT_FALSE(must.empty());
  for (const auto& chunk : must) EXPECT_EQ(reported.count(chunk), 1u) << chunk.second;

  // Reading the damaged array fails naming the file; arrays elsewhere still read.
  std::vector<char> got;
  ExpectError(ReadArray(reader->get(), arrays_[0], &got), absl::StatusCode::kDataLoss, {file});
  for (const TestArray& a : arrays_) {
    bool touches = false;
    for (const IndexEntry& e : index_.entries) {
      touches =
          touches || (tree_.arrays[e.array_id].path == a.spec.path && e.file_id == victim.file_id);
    }
    if (touches) continue;
    TS_EXPECT_OK(ReadArray(reader->get(), a, &got)) << a.spec.path;
  }
}

TEST_F(CheckpointCorruptionTest, FlippedBitInDataFile) {
  const IndexEntry victim = EntryOf("params/w", 2);
  const std::string file = FileKey(victim.file_id);
  const std::string chunk = ChunkName(victim);
  std::string bytes = ReadRaw(file);
  const uint64_t at = victim.offset + victim.length / 2;
  bytes[at] = static_cast<char>(bytes[at] ^ 0x08);
  WriteRaw(file, bytes);

  Result<std::unique_ptr<CheckpointReader>> reader = Open();
  TS_ASSERT_OK(reader.status()) << "Open reads no array data";
  std::vector<char> got;
  // The whole array (chunks read straight into place) and a sub-box (staged).
  ExpectError(ReadArray(reader->get(), arrays_[0], &got), absl::StatusCode::kDataLoss,
              {file, "params/w", chunk, "CRC"});
  const Box sub({3, 5}, {60, 40});
  std::vector<char> part(static_cast<size_t>(sub.num_elements()) * 4);
  ExpectError((*reader)->Read({"params/w", sub, DType::kFloat32, part.data()}),
              absl::StatusCode::kDataLoss, {file, "params/w", chunk});
  // Other arrays are fine.
  TS_EXPECT_OK(ReadArray(reader->get(), arrays_[1], &got));

  Result<std::vector<BadChunk>> bad = (*reader)->Verify();
  TS_ASSERT_OK(bad.status());
  ASSERT_EQ(bad->size(), 1u);
  EXPECT_EQ((*bad)[0].array_path, "params/w");
  EXPECT_EQ((*bad)[0].chunk, chunk);
  EXPECT_EQ((*bad)[0].file, file);
  EXPECT_THAT((*bad)[0].error, HasSubstr("CRC"));

  // Without checksums the read succeeds, and exactly that bit differs.
  ReaderOptions unchecked;
  unchecked.verify_checksums = false;
  reader = Open(unchecked);
  TS_ASSERT_OK(reader.status());
  TS_ASSERT_OK(ReadArray(reader->get(), arrays_[0], &got));
  const std::vector<char> want =
      MakeBoxData(DType::kFloat32, {64, 48}, arrays_[0].seed, Box::FromShape({64, 48}));
  ASSERT_EQ(got.size(), want.size());
  int differing_bits = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    differing_bits += __builtin_popcount(static_cast<unsigned char>(want[i] ^ got[i]));
  }
  EXPECT_EQ(differing_bits, 1);
}

TEST_F(CheckpointCorruptionTest, FlippedBitInCompressedChunk) {
  const IndexEntry victim = EntryOf("opt/z", 1);
  const std::string file = FileKey(victim.file_id);
  std::string bytes = ReadRaw(file);
  // Damage the frame header, where zstd notices.
  bytes[victim.offset + 4] = static_cast<char>(bytes[victim.offset + 4] ^ 0x40);
  WriteRaw(file, bytes);
  Result<std::unique_ptr<CheckpointReader>> reader = Open();
  TS_ASSERT_OK(reader.status());
  std::vector<char> got;
  ExpectError(ReadArray(reader->get(), arrays_[2], &got), absl::StatusCode::kDataLoss,
              {file, "opt/z", ChunkName(victim)});
  Result<std::vector<BadChunk>> bad = (*reader)->Verify();
  TS_ASSERT_OK(bad.status());
  ASSERT_EQ(bad->size(), 1u);
  EXPECT_EQ((*bad)[0].chunk, ChunkName(victim));
  // Without checksums, the decoder meets the damage: an error or garbage, never a crash.
  ReaderOptions unchecked;
  unchecked.verify_checksums = false;
  reader = Open(unchecked);
  TS_ASSERT_OK(reader.status());
  const Status status = ReadArray(reader->get(), arrays_[2], &got);
  EXPECT_TRUE(status.ok() || status.code() == absl::StatusCode::kDataLoss) << status;
  if (!status.ok()) {
    EXPECT_THAT(status.message(), HasSubstr("opt/z"));
  }
}

TEST_F(CheckpointCorruptionTest, MissingDataFile) {
  const IndexEntry victim = EntryOf("params/b");
  const std::string file = FileKey(victim.file_id);
  ASSERT_TRUE(fs::remove(PathOf(file)));
  ExpectError(Open().status(), absl::StatusCode::kDataLoss, {file, "missing"});
  ReaderOptions damaged;
  damaged.open_damaged = true;
  Result<std::unique_ptr<CheckpointReader>> reader = Open(damaged);
  TS_ASSERT_OK(reader.status());
  Result<std::vector<BadChunk>> bad = (*reader)->Verify();
  TS_ASSERT_OK(bad.status());
  size_t in_file = 0;
  for (const IndexEntry& e : index_.entries) in_file += e.file_id == victim.file_id;
  EXPECT_EQ(bad->size(), in_file);
  for (const BadChunk& b : *bad) {
    EXPECT_EQ(b.file, file);
    EXPECT_THAT(b.error, HasSubstr("missing"));
  }
}

TEST_F(CheckpointCorruptionTest, GarbageIndex) {
  std::string garbage(ReadRaw(kIndexKey).size(), '\0');
  for (size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<char>(test::Mix64(i));
  WriteRaw(kIndexKey, garbage);
  ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kIndexKey, "commit record"});
  FixCommit();  // now the index itself must be judged
  ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kIndexKey, "magic"});
  WriteRaw(kIndexKey, "short");
  FixCommit();
  ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kIndexKey, "truncated"});
  WriteRaw(kIndexKey, "");
  FixCommit();
  ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kIndexKey});
}

TEST_F(CheckpointCorruptionTest, IndexWithFlippedByte) {
  std::string bytes = ReadRaw(kIndexKey);
  const size_t at = kIndexHeaderSize + 20;
  bytes[at] = static_cast<char>(bytes[at] ^ 0x01);
  WriteRaw(kIndexKey, bytes);
  ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kIndexKey, "commit record"});
  FixCommit();
  ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kIndexKey, "CRC"});
}

TEST_F(CheckpointCorruptionTest, TreeJsonEdited) {
  std::string json = ReadRaw(kTreeKey);
  const size_t at = json.find("params/w");
  ASSERT_NE(at, std::string::npos);
  json.replace(at, 8, "params/v");  // same size: only the CRC tells
  WriteRaw(kTreeKey, json);
  ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kTreeKey, "commit record"});
  // Appended junk changes the size.
  WriteRaw(kTreeKey, ReadRaw(kTreeKey) + " ");
  ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kTreeKey});
  // Not JSON at all, with a matching COMMIT.
  WriteRaw(kTreeKey, "{\"format\": \"tensorstash/tree\", \"version\": [1, 0], \"arr");
  FixCommit();
  ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kTreeKey});
}

// A consistent-looking step whose tree.json claims an enormous array: the shape checks stop it
// before anything is sized by it.
TEST_F(CheckpointCorruptionTest, HugeShapeInTreeJson) {
  const long rss_before = MaxRssKib();
  struct Variant {
    std::string name;
    DType dtype;
    ChunkGrid grid;
  };
  const int64_t k30 = int64_t{1} << 30, k60 = int64_t{1} << 60;
  const std::vector<Variant> variants = {
      // 2^60 float32 elements in 2^30 valid chunks of 4 GiB: only the index can disagree.
      {"2^30 x 2^30 float32", DType::kFloat32, {{k30, k30}, {k30, k30}, {1, k30}}},
      // 2^60 complex128 elements: 2^64 bytes, more than int64 can count.
      {"2^60 complex128", DType::kComplex128, {{k60}, {k60}, {1 << 20}}},
      // 2^60 int8 in chunks of one element: far more chunks than allowed.
      {"2^60 int8 tiny chunks", DType::kInt8, {{k60}, {k60}, {1}}},
      // Same element count, but with the cells of the original grid.
      {"2^60 float32 small cells", DType::kFloat32, {{k30, k30}, {16, 48}, {16, 48}}},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    TreeFile tree = tree_;
    tree.arrays[0].dtype = v.dtype;
    tree.arrays[0].grid = v.grid;
    WriteTree(tree);
    const Status status = Open().status();
    ExpectError(status, absl::StatusCode::kDataLoss, {"params/w"});
    EXPECT_THAT(status.message(), Not(HasSubstr("commit record")));
  }
  EXPECT_LT(MaxRssKib() - rss_before, 256 * 1024) << "KiB of peak memory grew";
}

TEST_F(CheckpointCorruptionTest, CommitNamesMissingFiles) {
  fs::rename(PathOf(kTreeKey), PathOf(StrCat(kTreeKey, ".moved")));
  ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kTreeKey, "missing"});
  fs::rename(PathOf(StrCat(kTreeKey, ".moved")), PathOf(kTreeKey));
  TS_ASSERT_OK(Open().status());
  fs::remove(PathOf(kIndexKey));
  ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kIndexKey, "missing"});
}

TEST_F(CheckpointCorruptionTest, CommitGarbage) {
  for (const std::string& commit :
       {std::string(""), std::string("{"), std::string("null"), std::string("[1, 2]"),
        std::string("{\"format\": \"tensorstash/commit\", \"version\": [1, 0]}"),
        std::string("{\"format\": \"tensorstash/commit\", \"version\": [1, 0], "
                    "\"created_unix_ms\": \"x\", \"process_count\": 1, \"items\": {}}"),
        std::string("{\"format\": \"tensorstash/commit\", \"version\": [1, 0], "
                    "\"created_unix_ms\": 0, \"process_count\": 1, \"items\": {}}"),
        std::string("{\"format\": \"tensorstash/commit\", \"version\": [1, 0], "
                    "\"created_unix_ms\": 0, \"process_count\": 1, \"items\": "
                    "{\"state\": {\"tree_crc32c\": -1}}}"),
        std::string(3 << 20, ' ')}) {
    SCOPED_TRACE(commit.substr(0, 80));
    WriteRaw(kCommitKey, commit);
    ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kCommitKey});
  }
}

TEST_F(CheckpointCorruptionTest, NewerFormatVersions) {
  // COMMIT.
  const std::string commit = ReadRaw(kCommitKey);
  std::string newer = commit;
  const size_t version = newer.find("\"version\"");
  ASSERT_NE(version, std::string::npos);
  const size_t one = newer.find('1', version);
  newer[one] = '2';
  WriteRaw(kCommitKey, newer);
  Status status = Open().status();
  ExpectError(status, absl::StatusCode::kUnimplemented, {kCommitKey, "version 2", "upgrade"});
  WriteRaw(kCommitKey, commit);
  TS_ASSERT_OK(Open().status());

  // tree.json.
  const std::string tree = ReadRaw(kTreeKey);
  std::string newer_tree = tree;
  const size_t tree_version = newer_tree.find("\"version\"");
  ASSERT_NE(tree_version, std::string::npos);
  newer_tree[newer_tree.find('1', tree_version)] = '3';
  WriteRaw(kTreeKey, newer_tree);
  FixCommit();
  ExpectError(Open().status(), absl::StatusCode::kUnimplemented,
              {kTreeKey, "version 3", "upgrade"});
  WriteRaw(kTreeKey, tree);
  FixCommit();
  TS_ASSERT_OK(Open().status());

  // index: major version at bytes 8-9 (the footer CRC fixed too, so only the version differs).
  // This reader reads 1.x and 2.x (incremental steps, docs/format.md 6.1); 3 is newer.
  std::string index = ReadRaw(kIndexKey);
  index[8] = 3;
  index[9] = 0;
  FixIndexFooter(&index);
  WriteRaw(kIndexKey, index);
  FixCommit();
  ExpectError(Open().status(), absl::StatusCode::kUnimplemented,
              {kIndexKey, "version 3", "upgrade"});
}

TEST_F(CheckpointCorruptionTest, StepWithoutCommitIsIncomplete) {
  ASSERT_TRUE(fs::remove(PathOf(kCommitKey)));
  ExpectError(Open().status(), absl::StatusCode::kFailedPrecondition, {kStep, "incomplete"});
}

TEST_F(CheckpointCorruptionTest, TemporaryFolderIsNotAStep) {
  // A complete-looking copy under a temporary name (a crash between COMMIT and the rename).
  for (const std::string name :
       {"ckpt/0000000001.tmp-0123456789abcdef", "ckpt/0000000001.old-0123456789abcdef"}) {
    fs::copy(PathOf(kStep), PathOf(name), fs::copy_options::recursive);
    Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv_.get(), name);
    ExpectError(reader.status(), absl::StatusCode::kFailedPrecondition, {name});
  }
}

TEST_F(CheckpointCorruptionTest, StepThatDoesNotExist) {
  Result<std::unique_ptr<CheckpointReader>> reader =
      CheckpointReader::Open(kv_.get(), "ckpt/0000000002");
  ExpectError(reader.status(), absl::StatusCode::kNotFound, {"ckpt/0000000002"});
  reader = CheckpointReader::Open(kv_.get(), "elsewhere");
  ExpectError(reader.status(), absl::StatusCode::kNotFound, {"elsewhere"});
  reader = CheckpointReader::Open(kv_.get(), "../ckpt");
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CheckpointCorruptionTest, DeeplyNestedTreeJson) {
  constexpr size_t kDepth = 1000000;
  std::string json =
      "{\"format\": \"tensorstash/tree\", \"version\": [1, 0], \"arrays\": [], "
      "\"tree\": ";
  json.append(kDepth, '[');
  json.append(kDepth, ']');
  json += "}";
  WriteRaw(kTreeKey, json);
  FixCommit();
  ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kTreeKey, "deep"});
  // Nested tree nodes (objects), just past the allowed depth and far past it.
  for (size_t depth : {size_t{kMaxTreeDepth + 16}, size_t{100000}}) {
    std::string nodes =
        "{\"format\": \"tensorstash/tree\", \"version\": [1, 0], "
        "\"arrays\": [], \"tree\": ";
    for (size_t i = 0; i < depth; ++i) nodes += "{\"kind\": \"list\", \"items\": [";
    nodes += "{\"kind\": \"none\"}";
    for (size_t i = 0; i < depth; ++i) nodes += "]}";
    nodes += "}";
    WriteRaw(kTreeKey, nodes);
    FixCommit();
    ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kTreeKey, "deep"});
  }
}

TEST_F(CheckpointCorruptionTest, DeeplyNestedCommit) {
  std::string commit(400000, '[');
  commit.append(400000, ']');
  WriteRaw(kCommitKey, commit);
  ExpectError(Open().status(), absl::StatusCode::kDataLoss, {kCommitKey});
}

// Index entries a hostile writer could craft; each one is refused before any read.
TEST_F(CheckpointCorruptionTest, HostileIndexEntries) {
  const IndexEntry& w0 = EntryOf("params/w", 0);
  const IndexEntry& w1 = EntryOf("params/w", 1);
  ASSERT_EQ(w0.file_id, w1.file_id);
  struct Variant {
    std::string name;
    std::function<void(ChunkIndex*)> edit;
    std::vector<std::string> mentions;
  };
  auto entry_of = [&](ChunkIndex* index, const IndexEntry& like) -> IndexEntry& {
    for (IndexEntry& e : index->entries) {
      if (e.array_id == like.array_id && e.chunk == like.chunk) return e;
    }
    return index->entries[0];
  };
  const std::vector<Variant> variants = {
      {"offset + length overflows",
       [&](ChunkIndex* index) {
         entry_of(index, w0).offset = std::numeric_limits<uint64_t>::max() - 3;
       },
       {"reaches past the end"}},
      {"huge length",
       [&](ChunkIndex* index) { entry_of(index, w0).length = uint64_t{1} << 62; },
       {"reaches past the end"}},
      {"overlapping chunks",
       [&](ChunkIndex* index) { entry_of(index, w1).offset = w0.offset + 4; },
       {"overlap"}},
      {"file name with ..",
       [&](ChunkIndex* index) { index->files[0].name = "data/../../../etc/passwd"; },
       {"invalid name"}},
      {"file name outside data/",
       [&](ChunkIndex* index) { index->files[0].name = "COMMIT"; },
       {"invalid name"}},
      {"absolute file name",
       [&](ChunkIndex* index) { index->files[0].name = "/etc/passwd"; },
       {"invalid name"}},
      {"file name with NUL",
       [&](ChunkIndex* index) { index->files[0].name = std::string("data/a\0b", 8); },
       {"invalid name"}},
      {"file id out of range", [&](ChunkIndex* index) { index->files.pop_back(); }, {""}},
      {"wrong length for an uncompressed chunk",
       [&](ChunkIndex* index) { entry_of(index, w0).length -= 1; },
       {"params/w"}},
      {"chunk the array does not have",
       [&](ChunkIndex* index) { index->entries.back().chunk = uint64_t{1} << 40; },
       {"does not have"}},
      {"unknown array",
       [&](ChunkIndex* index) { index->entries.back().array_id = 77; },
       {"array 77"}},
      {"missing chunk",
       [&](ChunkIndex* index) { index->entries.erase(index->entries.begin() + 1); },
       {"params/w"}},
      {"data file larger than written",
       [&](ChunkIndex* index) { index->files[w0.file_id].size += 1; },
       {"truncated"}},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    ChunkIndex index = index_;
    v.edit(&index);
    Result<std::string> bytes = EncodeIndex(index);
    if (!bytes.ok()) {
      // The encoder itself refuses some (a file id out of range); write a copy by hand then.
      ASSERT_EQ(v.name, "file id out of range") << bytes.status();
      std::string raw = ReadRaw(kIndexKey);
      // Entries start after the header and the file table; make entry 0 name file 200.
      size_t pos = kIndexHeaderSize;
      for (const DataFileInfo& f : index_.files) pos += 2 + f.name.size() + 8;
      raw[pos + 4] = static_cast<char>(200);
      FixIndexFooter(&raw);
      WriteRaw(kIndexKey, raw);
      FixCommit();
    } else {
      WriteRaw(kIndexKey, *bytes);
      FixCommit();
    }
    const Status status = Open().status();
    ExpectError(status, absl::StatusCode::kDataLoss, v.mentions);
    EXPECT_THAT(status.message(), HasSubstr("index")) << status;
  }
}

// Entries duplicated or out of order can only be written by hand (the encoder sorts).
TEST_F(CheckpointCorruptionTest, DuplicateAndUnsortedIndexEntries) {
  const std::string original = ReadRaw(kIndexKey);
  size_t entries = kIndexHeaderSize;
  for (const DataFileInfo& f : index_.files) entries += 2 + f.name.size() + 8;
  for (const bool swap : {false, true}) {
    SCOPED_TRACE(swap ? "swapped" : "duplicated");
    std::string raw = original;
    const std::string first = raw.substr(entries, kIndexEntrySize);
    const std::string second = raw.substr(entries + kIndexEntrySize, kIndexEntrySize);
    raw.replace(entries + kIndexEntrySize, kIndexEntrySize, first);
    if (swap) raw.replace(entries, kIndexEntrySize, second);
    FixIndexFooter(&raw);
    WriteRaw(kIndexKey, raw);
    FixCommit();
    ExpectError(Open().status(), absl::StatusCode::kDataLoss,
                {kIndexKey, "duplicated or out of order"});
  }
}

// Chunks of most of a MiB read into sub-boxes that cut every dimension come back exact, and a
// flipped byte anywhere in such a chunk (its first, middle or last byte) fails a read that needs
// only a small part of it: the whole chunk is checked, not only the bytes copied out.
class LargeChunkScatterTest : public StepFilesTest {
 protected:
  void SetUp() override {
    StepFilesTest::SetUp();
    WriterOptions options;
    options.sync = false;
    options.target_chunk_bytes = 64 << 20;  // each shard one chunk: 2 x 0.79 MiB
    Result<std::unique_ptr<CheckpointWriter>> writer =
        CheckpointWriter::Create(kv_.get(), kStep, options);
    TS_ASSERT_OK(writer.status());
    test::HeldShards held = test::HoldAllShards(spec_, 7, test::Sharding{{2}, {0, -1, -1}});
    TS_ASSERT_OK((*writer)->AddArray(spec_, held.shards));
    TS_ASSERT_OK((*writer)->Commit());
  }
  Status ReadBox(const Box& box, std::vector<char>* out, bool verify = true) {
    ReaderOptions options;
    options.verify_checksums = verify;
    Result<std::unique_ptr<CheckpointReader>> reader =
        CheckpointReader::Open(kv_.get(), kStep, options);
    if (!reader.ok()) return reader.status();
    out->assign(static_cast<size_t>(box.num_elements()) * 4, 0);
    return (*reader)->Read({"big", box, DType::kFloat32, out->data()});
  }

  const ArraySpec spec_{"big", DType::kFloat32, {6, 96, 700}};
};

TEST_F(LargeChunkScatterTest, SubBoxesAcrossSlabsReadExactly) {
  for (const Box& box : {Box::FromShape({6, 96, 700}), Box({1, 5, 3}, {4, 80, 650}),
                         Box({2, 0, 699}, {3, 96, 1}), Box({3, 95, 0}, {1, 1, 700})}) {
    std::vector<char> got;
    TS_ASSERT_OK(ReadBox(box, &got)) << box.ToString();
    EXPECT_TRUE(BytesEqual(got, MakeBoxData(DType::kFloat32, spec_.shape, 7, box)))
        << box.ToString();
  }
}

TEST_F(LargeChunkScatterTest, AFlipInAnySlabOfALargeChunkIsCaught) {
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv_.get(), kStep);
  TS_ASSERT_OK(reader.status());
  const ChunkIndex index = (*reader)->index();
  ASSERT_EQ(index.entries.size(), 2u);
  const IndexEntry victim = index.entries[1];  // rows 3..5
  const std::string file = StrCat(kItem, "/", index.files[victim.file_id].name);
  const std::string intact = ReadRaw(file);
  for (const uint64_t at : {uint64_t{0}, victim.length / 2, victim.length - 1}) {
    std::string bytes = intact;
    bytes[victim.offset + at] = static_cast<char>(bytes[victim.offset + at] ^ 0x20);
    WriteRaw(file, bytes);
    std::vector<char> got;
    // A box that needs only part of the damaged chunk: the whole chunk is still checked.
    const Status status = ReadBox(Box({4, 10, 10}, {1, 20, 20}), &got);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << "byte " << at << ": " << status;
    EXPECT_THAT(status.message(), HasSubstr("CRC-32C mismatch")) << status;
    EXPECT_THAT(status.message(), HasSubstr(file)) << status;
    // Unchecked, the same read succeeds: the check, not the copy, failed it.
    TS_EXPECT_OK(ReadBox(Box({4, 10, 10}, {1, 20, 20}), &got, /*verify=*/false));
  }
}

}  // namespace
}  // namespace tensorstash
