#include "tensorstash/kvstore/ocdbt/ocdbt_kvstore.h"

#include <atomic>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/testing/kvstore_conformance.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/kvstore/ocdbt/ocdbt_format.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/endian.h"

namespace tensorstash {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Deterministic bytes of `size` derived from `seed`.
std::string Bytes(size_t size, uint32_t seed) {
  std::mt19937 random(seed);
  std::string out(size, '\0');
  for (char& c : out) c = static_cast<char>(random());
  return out;
}

std::map<std::string, std::string> MakeEntries(int count) {
  std::map<std::string, std::string> entries;
  for (int i = 0; i < count; ++i) {
    const std::string key = StrCat("params.layer", i % 37, ".w/c/", i / 37, "/", i % 5);
    // A mix of inline (<= 100 bytes) and indirect values, some empty.
    const size_t size = (i % 3 == 0) ? 0 : (i % 3 == 1) ? 1 + i % 100 : 101 + (i * 7919) % 5000;
    entries[key] = Bytes(size, static_cast<uint32_t>(i));
  }
  entries["params.big/c/0"] = Bytes(3 << 20, 99);
  return entries;
}

Status WriteDb(KvStore* base, const std::string& root,
               const std::map<std::string, std::string>& entries,
               OcdbtWriter::Options options = {}) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<OcdbtWriter> writer,
                      OcdbtWriter::Create(base, root, options));
  for (const auto& [key, value] : entries) TS_RETURN_IF_ERROR(writer->Add(key, value));
  return writer->Finish();
}

void ExpectSameContent(OcdbtKvStore* store, const std::map<std::string, std::string>& entries) {
  Result<std::vector<std::string>> keys = store->List("");
  ASSERT_TRUE(keys.ok()) << keys.status();
  std::vector<std::string> expected_keys;
  for (const auto& [key, value] : entries) expected_keys.push_back(key);
  EXPECT_EQ(*keys, expected_keys);
  for (const auto& [key, value] : entries) {
    Result<std::string> got = store->Read(key);
    ASSERT_TRUE(got.ok()) << key << ": " << got.status();
    ASSERT_EQ(*got, value) << key;
    Result<uint64_t> size = store->Size(key);
    ASSERT_TRUE(size.ok());
    EXPECT_EQ(*size, value.size());
  }
}

class OcdbtRoundTripTest : public ::testing::TestWithParam<bool> {};

TEST_P(OcdbtRoundTripTest, WriteThenReadEveryKey) {
  MemoryKvStore base;
  const auto entries = MakeEntries(3000);
  OcdbtWriter::Options options;
  options.zstd = GetParam();
  options.zstd_level = 3;
  options.max_decoded_node_bytes = 4096;     // many leaves and three levels
  options.target_data_file_bytes = 1 << 20;  // several data files
  ASSERT_TRUE(WriteDb(&base, "ckpt/ocdbt", entries, options).ok());

  auto store = OcdbtKvStore::Open(&base, "ckpt/ocdbt/");
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->generation(), 1u);
  EXPECT_EQ((*store)->config().zstd, GetParam());
  ExpectSameContent(store->get(), entries);

  auto data_files = base.List("ckpt/ocdbt/d/");
  ASSERT_TRUE(data_files.ok());
  EXPECT_GT(data_files->size(), 3u);
}

INSTANTIATE_TEST_SUITE_P(Compression, OcdbtRoundTripTest, ::testing::Bool(),
                         [](const auto& param_info) { return param_info.param ? "zstd" : "none"; });

TEST(OcdbtKvStoreTest, ListByPrefixAndRanges) {
  MemoryKvStore base;
  const auto entries = MakeEntries(800);
  OcdbtWriter::Options options;
  options.max_decoded_node_bytes = 4096;
  ASSERT_TRUE(WriteDb(&base, "", entries, options).ok());
  auto store = OcdbtKvStore::Open(&base, "");
  ASSERT_TRUE(store.ok()) << store.status();

  for (const std::string prefix : {"params.layer1", "params.layer1.", "params.layer36.w/c/2/",
                                   "params.big", "params.layer9.w/c/21/4", "zzz", "a", ""}) {
    std::vector<std::string> expected;
    for (const auto& [key, value] : entries) {
      if (key.compare(0, prefix.size(), prefix) == 0) expected.push_back(key);
    }
    auto keys = (*store)->List(prefix);
    ASSERT_TRUE(keys.ok());
    EXPECT_EQ(*keys, expected) << "prefix '" << prefix << "'";
  }

  const std::string& big = entries.at("params.big/c/0");
  std::string part(1000, '\0');
  ASSERT_TRUE((*store)->ReadRange("params.big/c/0", 123456, part.size(), part.data()).ok());
  EXPECT_EQ(part, big.substr(123456, 1000));
  Status past_end = (*store)->ReadRange("params.big/c/0", big.size() - 10, 20, part.data());
  EXPECT_TRUE(absl::IsDataLoss(past_end)) << past_end;

  auto file = (*store)->OpenForRead("params.big/c/0");
  ASSERT_TRUE(file.ok());
  EXPECT_EQ((*file)->size(), big.size());
  ASSERT_TRUE((*file)->ReadAt(big.size() - 1000, 1000, part.data()).ok());
  EXPECT_EQ(part, big.substr(big.size() - 1000));

  EXPECT_TRUE(absl::IsNotFound((*store)->Read("params.layer1").status()));
  EXPECT_TRUE(absl::IsNotFound((*store)->Size("nope").status()));
  EXPECT_TRUE(absl::IsFailedPrecondition((*store)->Write("k", "v")));
  EXPECT_TRUE(absl::IsFailedPrecondition((*store)->Delete("k")));
  const Status refused = (*store)->DeletePrefix("params.");
  EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("delete prefix 'params.'"));
  EXPECT_THAT(refused.message(), HasSubstr("OCDBT store is read-only"));
  EXPECT_THAT(refused.message(), HasSubstr("OcdbtWriter"));
  EXPECT_FALSE((*store)->SupportsRename());
}

TEST(OcdbtKvStoreTest, EmptyDatabase) {
  MemoryKvStore base;
  ASSERT_TRUE(WriteDb(&base, "empty", {}).ok());
  auto store = OcdbtKvStore::Open(&base, "empty");
  ASSERT_TRUE(store.ok()) << store.status();
  auto keys = (*store)->List("");
  ASSERT_TRUE(keys.ok());
  EXPECT_TRUE(keys->empty());
  EXPECT_TRUE(absl::IsNotFound((*store)->Read("a").status()));
}

TEST(OcdbtKvStoreTest, ConcurrentReaders) {
  MemoryKvStore base;
  const auto entries = MakeEntries(1000);
  OcdbtWriter::Options options;
  options.max_decoded_node_bytes = 4096;
  ASSERT_TRUE(WriteDb(&base, "", entries, options).ok());
  OcdbtKvStore::Options store_options;
  store_options.node_cache_bytes = 16 << 10;  // small: entries are evicted while others read
  auto store = OcdbtKvStore::Open(&base, "", store_options);
  ASSERT_TRUE(store.ok());
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      int i = 0;
      for (const auto& [key, value] : entries) {
        if (++i % 4 != t) continue;
        auto got = (*store)->Read(key);
        if (!got.ok() || *got != value) ++mismatches;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(OcdbtWriterTest, RejectsBadUse) {
  MemoryKvStore base;
  auto writer = OcdbtWriter::Create(&base, "db");
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Add("a", "1").ok());
  EXPECT_TRUE(absl::IsInvalidArgument((*writer)->Add("a", "2")));
  EXPECT_TRUE(absl::IsInvalidArgument((*writer)->Add("", "2")));
  EXPECT_TRUE(absl::IsInvalidArgument((*writer)->Add(std::string(70000, 'k'), "2")));
  auto sink = (*writer)->AddValue("b", 500);
  ASSERT_TRUE(sink.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(sink->Write(490, "0123456789ab", 12)));
  ASSERT_TRUE(sink->Write(250, std::string(250, 'y').data(), 250).ok());
  ASSERT_TRUE(sink->Write(0, std::string(250, 'x').data(), 250).ok());
  ASSERT_TRUE((*writer)->Finish().ok());
  EXPECT_TRUE(absl::IsFailedPrecondition((*writer)->Finish()));
  EXPECT_TRUE(absl::IsAlreadyExists(OcdbtWriter::Create(&base, "db").status()));

  auto store = OcdbtKvStore::Open(&base, "db");
  ASSERT_TRUE(store.ok());
  EXPECT_EQ(*(*store)->Read("b"), std::string(250, 'x') + std::string(250, 'y'));
  EXPECT_EQ(*(*store)->Read("a"), "1");
}

// A database that merges two others (as Orbax's multi-process layout does): its entries point
// into their data files under base paths, and reading it gives every value of both.
TEST(OcdbtWriterTest, ReferencesIntoOtherDatabasesUnderItsRoot) {
  MemoryKvStore base;
  const std::string big0(300, 'a');
  const std::string big1(400, 'b');
  for (int p = 0; p < 2; ++p) {
    auto writer = OcdbtWriter::Create(&base, "db/ocdbt.process_" + std::to_string(p)).value();
    ASSERT_TRUE(writer->Add("k" + std::to_string(p), p == 0 ? big0 : big1).ok());
    ASSERT_TRUE(writer->Add("small" + std::to_string(p), "tiny").ok());
    ASSERT_TRUE(writer->Finish().ok());
  }
  auto merged = OcdbtWriter::Create(&base, "db").value();
  for (int p = 0; p < 2; ++p) {
    const std::string sub = "ocdbt.process_" + std::to_string(p);
    auto db = OcdbtKvStore::Open(&base, "db/" + sub).value();
    const std::vector<OcdbtKvStore::Entry> entries = db->Entries().value();
    ASSERT_EQ(entries.size(), 2u);
    EXPECT_FALSE(entries[0].is_inline);
    EXPECT_EQ(entries[0].length, p == 0 ? 300u : 400u);
    EXPECT_TRUE(entries[1].is_inline);
    for (const OcdbtKvStore::Entry& e : entries) {
      ASSERT_TRUE((e.is_inline ? merged->Add(e.key, e.inline_value)
                               : merged->AddReference(
                                     e.key, {sub + "/" + e.file.base_path, e.file.relative_path},
                                     e.offset, e.length))
                      .ok());
    }
  }
  // A key twice, and paths that would leave the root, are refused.
  EXPECT_TRUE(absl::IsInvalidArgument(merged->AddReference("k0", {"x/", "d/1"}, 0, 1)));
  EXPECT_TRUE(absl::IsInvalidArgument(merged->AddReference("n", {"../", "d/1"}, 0, 1)));
  EXPECT_TRUE(absl::IsInvalidArgument(merged->AddReference("n", {"", ""}, 0, 1)));
  ASSERT_TRUE(merged->Finish().ok());

  auto store = OcdbtKvStore::Open(&base, "db").value();
  EXPECT_THAT(store->List("").value(),
              ::testing::ElementsAre("k0", "k1", "small0", "small1"));
  EXPECT_EQ(store->Read("k0").value(), big0);
  EXPECT_EQ(store->Read("k1").value(), big1);
  EXPECT_EQ(store->Read("small1").value(), "tiny");
  // The merged leaves name the other databases' files; its own d/ holds only its B+tree.
  const std::vector<OcdbtKvStore::Entry> entries = store->Entries().value();
  EXPECT_EQ(entries[1].file.base_path, "ocdbt.process_1/");
  EXPECT_EQ(base.List("db/d/").value().size(), 1u);
}

// Orbax's merged multi-process layout: the top-level tree's interior node points at the root of
// a per-process database with base path "proc/", and everything below resolves under "proc/".
TEST(OcdbtKvStoreTest, BasePathsAreTransitive) {
  MemoryKvStore base;
  const auto entries = MakeEntries(600);
  OcdbtWriter::Options options;
  options.max_decoded_node_bytes = 4096;
  ASSERT_TRUE(WriteDb(&base, "db/proc", entries, options).ok());
  auto sub = ocdbt::DecodeManifest(*base.Read("db/proc/manifest.ocdbt"), "sub");
  ASSERT_TRUE(sub.ok());
  const ocdbt::VersionRef& sub_root = sub->versions.back();
  ASSERT_GE(sub_root.root_height, 1);  // so that nodes below the root are reached through it

  ocdbt::BtreeNode top;
  top.height = static_cast<uint8_t>(sub_root.root_height + 1);
  top.files.push_back({"proc/", sub->files[sub_root.root.file].relative_path});
  ocdbt::InteriorEntry child;
  child.key = entries.begin()->first;
  child.location = sub_root.root;
  child.location.file = 0;
  top.children.push_back(child);
  auto encoded = ocdbt::EncodeBtreeNode(top, ocdbt::Config());
  ASSERT_TRUE(encoded.ok());
  ASSERT_TRUE(base.Write("db/d/top", *encoded).ok());
  ocdbt::Manifest manifest;
  manifest.files.push_back({"", "d/top"});
  ocdbt::VersionRef version;
  version.generation = 1;
  version.root_height = top.height;
  version.root = ocdbt::Location{0, 0, encoded->size()};
  manifest.versions.push_back(version);
  ASSERT_TRUE(base.Write("db/manifest.ocdbt", *ocdbt::EncodeManifest(manifest)).ok());

  auto store = OcdbtKvStore::Open(&base, "db");
  ASSERT_TRUE(store.ok()) << store.status();
  ExpectSameContent(store->get(), entries);
}

// ---------------------------------------------------------------------------------------------
// Hostile input. Each case must give a Status (never a crash or a huge allocation) whose code
// and message say what is wrong and where.

class OcdbtHostileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::map<std::string, std::string> entries;
    entries["small"] = "tiny";
    entries["large"] = Bytes(5000, 1);
    ASSERT_TRUE(WriteDb(&base_, "db", entries).ok());
    manifest_ = *base_.Read("db/manifest.ocdbt");
    auto decoded = ocdbt::DecodeManifest(manifest_, "test");
    ASSERT_TRUE(decoded.ok());
    node_key_ = "db/" + decoded->files[0].FullPath();
  }

  Status OpenStatus() { return OcdbtKvStore::Open(&base_, "db").status(); }
  // Opens the store and reads "large" and "small"; the first error.
  Status ReadStatus() {
    auto store = OcdbtKvStore::Open(&base_, "db");
    if (!store.ok()) return store.status();
    for (const char* key : {"small", "large"}) {
      auto value = (*store)->Read(key);
      if (!value.ok()) return value.status();
    }
    return (*store)->List("").status();
  }
  // Replaces the manifest with one for a single version whose root is `node` (stored in a
  // fresh data file "d/forged"), with `files` as the manifest's data file table.
  void ForgeRoot(const ocdbt::BtreeNode& node) {
    ocdbt::Config config;
    auto encoded = ocdbt::EncodeBtreeNode(node, config);
    ASSERT_TRUE(encoded.ok());
    ForgeRootBytes(*encoded, node.height);
  }
  void ForgeRootBytes(const std::string& node_bytes, int height) {
    ASSERT_TRUE(base_.Write("db/d/forged", node_bytes).ok());
    ocdbt::Manifest manifest;
    manifest.files.push_back({"", "d/forged"});
    ocdbt::VersionRef version;
    version.generation = 1;
    version.root_height = static_cast<uint8_t>(height);
    version.root = ocdbt::Location{0, 0, node_bytes.size()};
    manifest.versions.push_back(version);
    ASSERT_TRUE(base_.Write("db/manifest.ocdbt", *ocdbt::EncodeManifest(manifest)).ok());
  }

  MemoryKvStore base_;
  std::string manifest_;
  std::string node_key_;
};

TEST_F(OcdbtHostileTest, IntactDatabaseReads) { EXPECT_TRUE(ReadStatus().ok()); }

TEST_F(OcdbtHostileTest, MissingManifestIsNotFound) {
  EXPECT_TRUE(absl::IsNotFound(OcdbtKvStore::Open(&base_, "elsewhere").status()));
}

TEST_F(OcdbtHostileTest, TruncatedManifest) {
  for (size_t keep : {size_t{0}, size_t{10}, manifest_.size() / 2, manifest_.size() - 1}) {
    ASSERT_TRUE(base_.Write("db/manifest.ocdbt", manifest_.substr(0, keep)).ok());
    Status status = OpenStatus();
    EXPECT_TRUE(absl::IsDataLoss(status)) << keep << ": " << status;
    EXPECT_THAT(status.message(), HasSubstr("db/manifest.ocdbt"));
  }
}

TEST_F(OcdbtHostileTest, BadMagic) {
  std::string bad = manifest_;
  bad[0] = 'X';
  ASSERT_TRUE(base_.Write("db/manifest.ocdbt", bad).ok());
  EXPECT_THAT(OpenStatus().message(), HasSubstr("bad magic"));
  EXPECT_TRUE(absl::IsDataLoss(OpenStatus()));
}

TEST_F(OcdbtHostileTest, ManifestCrcMismatch) {
  std::string bad = manifest_;
  bad[bad.size() - 10] ^= 0x40;
  ASSERT_TRUE(base_.Write("db/manifest.ocdbt", bad).ok());
  EXPECT_TRUE(absl::IsDataLoss(OpenStatus()));
  EXPECT_THAT(OpenStatus().message(), HasSubstr("crc32c mismatch"));
}

TEST_F(OcdbtHostileTest, NodeCrcMismatchNamesTheFile) {
  std::string node = *base_.Read(node_key_);
  node[node.size() / 2] ^= 1;
  ASSERT_TRUE(base_.Write(node_key_, node).ok());
  Status status = ReadStatus();
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr(node_key_));
  EXPECT_THAT(status.message(), HasSubstr("crc32c"));
}

TEST_F(OcdbtHostileTest, TruncatedNodeFile) {
  std::string node = *base_.Read(node_key_);
  ASSERT_TRUE(base_.Write(node_key_, node.substr(0, node.size() - 3)).ok());
  Status status = ReadStatus();
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("past the end"));
}

TEST_F(OcdbtHostileTest, MissingValueFile) {
  auto files = base_.List("db/d/");
  ASSERT_TRUE(files.ok());
  for (const std::string& key : *files) {
    if (key != node_key_) {
      ASSERT_TRUE(base_.Delete(key).ok());
    }
  }
  auto store = OcdbtKvStore::Open(&base_, "db");
  ASSERT_TRUE(store.ok());
  EXPECT_EQ(*(*store)->Read("small"), "tiny");
  Status status = (*store)->Read("large").status();
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("missing"));
}

TEST_F(OcdbtHostileTest, DataFilePathsMustStayInsideTheRoot) {
  for (const char* path : {"../outside", "d/../../x", "/etc/passwd", "d//x", "d/./x"}) {
    ocdbt::BtreeNode leaf;
    leaf.files.push_back({"", path});
    ocdbt::LeafEntry entry;
    entry.key = "large";
    entry.is_inline = false;
    entry.location = {0, 0, 10};
    leaf.leaves.push_back(entry);
    ForgeRoot(leaf);
    auto store = OcdbtKvStore::Open(&base_, "db");
    ASSERT_TRUE(store.ok());
    Status status = (*store)->Read("large").status();
    EXPECT_TRUE(absl::IsDataLoss(status)) << path << ": " << status;
    EXPECT_THAT(status.message(), HasSubstr("not a safe relative path"));
  }
  // The same check applies to a B+tree node's own file, named by the manifest.
  ocdbt::Manifest manifest = *ocdbt::DecodeManifest(manifest_, "test");
  manifest.files[0].relative_path = "../" + manifest.files[0].relative_path;
  ASSERT_TRUE(base_.Write("db/manifest.ocdbt", *ocdbt::EncodeManifest(manifest)).ok());
  EXPECT_THAT(ReadStatus().message(), HasSubstr("not a safe relative path"));
}

TEST_F(OcdbtHostileTest, ValueOutsideItsDataFile) {
  const std::string data_key = [&] {
    const std::vector<std::string> keys = *base_.List("db/d/");
    for (const std::string& key : keys) {
      if (key != node_key_) return key;
    }
    return std::string();
  }();
  ASSERT_FALSE(data_key.empty());
  for (const auto& [offset, length] : std::vector<std::pair<uint64_t, uint64_t>>{
           {0, 5001}, {4999, 2}, {uint64_t{1} << 62, 10}, {0, uint64_t{1} << 62}}) {
    ocdbt::BtreeNode leaf;
    leaf.files.push_back({"", data_key.substr(3)});
    ocdbt::LeafEntry entry;
    entry.key = "large";
    entry.is_inline = false;
    entry.location = {0, offset, length};
    leaf.leaves.push_back(entry);
    ForgeRoot(leaf);
    auto store = OcdbtKvStore::Open(&base_, "db");
    ASSERT_TRUE(store.ok());
    Status status = (*store)->Read("large").status();
    EXPECT_TRUE(absl::IsDataLoss(status)) << offset << "+" << length << ": " << status;
    EXPECT_THAT(status.message(), HasSubstr("past the end"));
  }
}

TEST_F(OcdbtHostileTest, CycleIsCaughtByHeight) {
  // An interior node whose only child is itself: the child must have height 0, and has 1.
  ocdbt::BtreeNode node;
  node.height = 1;
  node.files.push_back({"", "d/forged"});
  ocdbt::InteriorEntry child;
  child.key = "";
  // The node's encoded length is not known before encoding it; it does not change with the
  // length value as long as the varint width stays the same.
  child.location = {0, 0, 100};
  node.children.push_back(child);
  std::string encoded = *ocdbt::EncodeBtreeNode(node, ocdbt::Config());
  node.children[0].location.length = encoded.size();
  encoded = *ocdbt::EncodeBtreeNode(node, ocdbt::Config());
  ForgeRootBytes(encoded, 1);
  Status status = ReadStatus();
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("height 1 where 0 was expected"));
}

TEST_F(OcdbtHostileTest, AbsurdCountsAndVarints) {
  auto node_with_body = [](const std::string& body) {
    return *ocdbt::EncodeEnvelope(ocdbt::kBtreeNodeMagic, body, false, 0);
  };
  std::string huge_count(1, '\0');   // height 0
  ocdbt::PutVarint(&huge_count, 0);  // no data files
  ocdbt::PutVarint(&huge_count, uint64_t{1} << 40);
  std::string long_varint(1, '\0');
  long_varint.append(11, '\xff');
  std::string huge_files(1, '\0');
  ocdbt::PutVarint(&huge_files, uint64_t{1} << 31);
  std::string long_key(1, '\0');  // one key with a 70000-byte suffix
  ocdbt::PutVarint(&long_key, 0);
  ocdbt::PutVarint(&long_key, 1);
  ocdbt::PutVarint(&long_key, 70000);
  std::string inline_too_big(1, '\0');  // one inline value claiming 2^40 bytes
  ocdbt::PutVarint(&inline_too_big, 0);
  ocdbt::PutVarint(&inline_too_big, 1);
  ocdbt::PutVarint(&inline_too_big, 1);
  inline_too_big += "k";
  ocdbt::PutVarint(&inline_too_big, uint64_t{1} << 40);
  inline_too_big.push_back('\0');
  const std::vector<std::pair<std::string, std::string>> cases = {
      {huge_count, "num_entries"},      {long_varint, "varint"},
      {huge_files, "num_files"},        {long_key, "key_suffix_length"},
      {inline_too_big, "inline value"}, {std::string(), "truncated reading height"},
  };
  for (const auto& [body, expected] : cases) {
    ForgeRootBytes(node_with_body(body), 0);
    Status status = ReadStatus();
    EXPECT_TRUE(absl::IsDataLoss(status)) << expected << ": " << status;
    EXPECT_THAT(status.message(), HasSubstr(expected));
  }
  // A body that claims to be zstd but is not.
  std::string not_zstd = "\x0c\xdb\x20\xde";
  PutLE64(&not_zstd, 4 + 8 + 2 + 8 + 4);
  not_zstd += std::string("\x00\x01", 2) + "garbage!";
  PutLE32(&not_zstd, Crc32c(not_zstd));
  ForgeRootBytes(not_zstd, 0);
  Status status = ReadStatus();
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("zstd"));
}

TEST_F(OcdbtHostileTest, RandomCorruptionNeverCrashes) {
  const std::string node = *base_.Read(node_key_);
  std::mt19937 random(7);
  int failures = 0;
  for (int round = 0; round < 1500; ++round) {
    const bool in_manifest = round % 2 == 0;
    std::string bytes = in_manifest ? manifest_ : node;
    const int flips = 1 + static_cast<int>(random() % 4);
    for (int f = 0; f < flips; ++f) bytes[random() % bytes.size()] = static_cast<char>(random());
    if (random() % 5 == 0) bytes.resize(random() % bytes.size());
    ASSERT_TRUE(base_.Write(in_manifest ? "db/manifest.ocdbt" : node_key_, bytes).ok());
    const Status status = ReadStatus();
    if (!status.ok()) ++failures;
    ASSERT_TRUE(
        base_.Write(in_manifest ? "db/manifest.ocdbt" : node_key_, in_manifest ? manifest_ : node)
            .ok());
  }
  // The crc catches nearly every corruption.
  EXPECT_GT(failures, 1400);
}

// Corruption with the length and crc32c repaired afterwards, so that the parsers themselves
// meet the damaged bytes.
TEST_F(OcdbtHostileTest, RandomCorruptionBehindAValidChecksum) {
  const std::string node = *base_.Read(node_key_);
  std::mt19937 random(11);
  int failures = 0;
  for (int round = 0; round < 3000; ++round) {
    const bool in_manifest = round % 2 == 0;
    std::string bytes = in_manifest ? manifest_ : node;
    const int flips = 1 + static_cast<int>(random() % 3);
    for (int f = 0; f < flips; ++f) {
      bytes[14 + random() % (bytes.size() - 18)] = static_cast<char>(random());
    }
    if (random() % 4 == 0) bytes.resize(18 + random() % (bytes.size() - 18));
    bytes.resize(bytes.size() - 4);
    const uint64_t length = bytes.size() + 4;
    bytes.replace(4, 8, std::string(reinterpret_cast<const char*>(&length), 8));
    PutLE32(&bytes, Crc32c(bytes));
    ASSERT_TRUE(base_.Write(in_manifest ? "db/manifest.ocdbt" : node_key_, bytes).ok());
    const Status status = ReadStatus();
    if (!status.ok()) {
      ++failures;
      EXPECT_TRUE(absl::IsDataLoss(status) || absl::IsNotFound(status)) << status;
    }
    ASSERT_TRUE(
        base_.Write(in_manifest ? "db/manifest.ocdbt" : node_key_, in_manifest ? manifest_ : node)
            .ok());
  }
  EXPECT_GT(failures, 1000);
}

}  // namespace
// The read conformance suite (kvstore_conformance.h): a database written by OcdbtWriter into
// a memory store, read through OcdbtKvStore. The store owns both.
class OwnedOcdbtStore : public ForwardingKvStore {
 public:
  OwnedOcdbtStore(std::unique_ptr<KvStore> base, std::unique_ptr<OcdbtKvStore> db)
      : ForwardingKvStore(db.get()), base_store_(std::move(base)), db_(std::move(db)) {}

 private:
  std::unique_ptr<KvStore> base_store_;
  std::unique_ptr<OcdbtKvStore> db_;
};

TS_INSTANTIATE_KVSTORE_READ_CONFORMANCE(
    Ocdbt,
    std::vector<ReadableKvStoreBackend>(
        {{"Ocdbt",
          [](const std::string&,
             const std::map<std::string, std::string>& contents) -> std::unique_ptr<KvStore> {
            auto base = std::make_unique<MemoryKvStore>();
            if (Status written = WriteDb(base.get(), "db", contents); !written.ok()) {
              ADD_FAILURE() << written;
              return nullptr;
            }
            Result<std::unique_ptr<OcdbtKvStore>> db = OcdbtKvStore::Open(base.get(), "db");
            if (!db.ok()) {
              ADD_FAILURE() << db.status();
              return nullptr;
            }
            return std::make_unique<OwnedOcdbtStore>(std::move(base), *std::move(db));
          }}}));

}  // namespace tensorstash
