// Unit tests of format detection and OrbaxReader on small layouts built in memory. The real
// Orbax / TensorStore / zarr-python checkpoints are tested in tests/python/test_orbax_read.py;
// these pin down the tree rebuilding, detection rules and errors without Python.
#include "tensorstash/checkpoint/orbax_reader.h"

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/format/zarr/zarr_metadata.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

// Writes a float32 array of `shape` holding 0, 1, 2, ... under `prefix`.
void WriteArray(KvStore* kv, const std::string& prefix, std::vector<int64_t> shape,
                std::vector<int64_t> chunks, int zarr_format = 3) {
  ZarrArraySpec spec;
  spec.zarr_format = zarr_format;
  spec.dtype = DType::kFloat32;
  spec.shape = shape;
  spec.chunk_shape = chunks;
  auto writer = ZarrArrayWriter::Create(kv, prefix, spec);
  ASSERT_TRUE(writer.ok()) << writer.status();
  std::vector<float> values(Box::FromShape(shape).num_elements());
  std::iota(values.begin(), values.end(), 0.0f);
  ASSERT_TRUE((*writer)->WriteBox(Box::FromShape(shape), values.data()).ok());
}

std::string Leaf(const std::vector<std::pair<std::string, int>>& keys, const std::string& type) {
  std::string key_text = "(", key_metadata;
  for (const auto& [name, key_type] : keys) {
    key_text += "'" + name + "', ";
    key_metadata += std::string(key_metadata.empty() ? "" : ", ") + "{\"key\": \"" + name +
                    "\", \"key_type\": " + std::to_string(key_type) + "}";
  }
  return "\"" + key_text + ")\": {\"key_metadata\": [" + key_metadata +
         "], \"value_metadata\": {\"value_type\": \"" + type + "\"}}";
}

TEST(DetectStepFormatTest, MarkersDecide) {
  MemoryKvStore kv;
  ASSERT_TRUE(kv.Write("native/COMMIT", "x").ok());
  ASSERT_TRUE(kv.Write("ocdbt/_METADATA", "{}").ok());
  ASSERT_TRUE(kv.Write("ocdbt/manifest.ocdbt", "x").ok());
  ASSERT_TRUE(kv.Write("folders/_METADATA", "{}").ok());
  ASSERT_TRUE(kv.Write("group/.zgroup", "{}").ok());
  ASSERT_TRUE(kv.Write("mgr/_CHECKPOINT_METADATA", "{}").ok());
  ASSERT_TRUE(kv.Write("mgr/default/_METADATA", "{}").ok());
  ASSERT_TRUE(kv.Write("two/a/_METADATA", "{}").ok());
  ASSERT_TRUE(kv.Write("two/b/_METADATA", "{}").ok());
  ASSERT_TRUE(kv.Write("half/_CHECKPOINT_METADATA", "{}").ok());
  ASSERT_TRUE(kv.Write("x.orbax-checkpoint-tmp-1/_METADATA", "{}").ok());

  EXPECT_EQ(DetectStepFormat(&kv, "native")->format, StepFormat::kNative);
  EXPECT_EQ(DetectStepFormat(&kv, "ocdbt")->format, StepFormat::kOrbaxOcdbt);
  EXPECT_EQ(DetectStepFormat(&kv, "folders")->format, StepFormat::kOrbaxFolders);
  EXPECT_EQ(DetectStepFormat(&kv, "group")->format, StepFormat::kZarrGroup);
  Result<DetectedStep> mgr = DetectStepFormat(&kv, "mgr");
  ASSERT_TRUE(mgr.ok());
  EXPECT_EQ(mgr->format, StepFormat::kOrbaxFolders);
  EXPECT_EQ(mgr->dir, "mgr/default");
  EXPECT_THAT(DetectStepFormat(&kv, "two").status().message(), HasSubstr("several items (a, b)"));
  EXPECT_TRUE(absl::IsFailedPrecondition(DetectStepFormat(&kv, "half").status()));
  EXPECT_TRUE(
      absl::IsFailedPrecondition(DetectStepFormat(&kv, "x.orbax-checkpoint-tmp-1").status()));
  EXPECT_EQ(DetectStepFormat(&kv, "absent")->format, StepFormat::kNative);
}

TEST(OrbaxReaderTest, RebuildsTreeAndReadsBoxes) {
  MemoryKvStore kv;
  WriteArray(&kv, "step/params.w", {6, 4}, {4, 4});
  WriteArray(&kv, "step/opt.0", {5}, {2}, /*zarr_format=*/2);
  const std::string metadata =
      "{\"tree_metadata\": {" + Leaf({{"opt", 2}, {"0", 1}}, "np.ndarray") + ", " +
      Leaf({{"opt", 2}, {"1", 1}}, "None") + ", " + Leaf({{"params", 2}, {"w", 2}}, "jax.Array") +
      ", " + Leaf({{"empty", 2}}, "Dict") + "}}";
  ASSERT_TRUE(kv.Write("step/_METADATA", metadata).ok());
  Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "step");
  ASSERT_TRUE(source.ok()) << source.status();
  StepSource& s = **source;
  EXPECT_EQ(s.format(), StepFormat::kOrbaxFolders);
  ASSERT_EQ(s.arrays().size(), 2u);
  EXPECT_EQ(s.arrays()[0].path, "opt/0");
  EXPECT_EQ(s.arrays()[1].path, "params/w");
  const TreeNode& root = s.tree();
  ASSERT_EQ(root.kind, TreeNode::Kind::kDict);
  ASSERT_EQ(root.entries.size(), 3u);
  EXPECT_EQ(root.entries[0].first, "opt");
  EXPECT_EQ(root.entries[0].second.kind, TreeNode::Kind::kList);
  EXPECT_EQ(root.entries[0].second.items[1].kind, TreeNode::Kind::kNone);
  EXPECT_EQ(root.entries[2].second.kind, TreeNode::Kind::kDict);
  EXPECT_EQ(s.NumChunks(1), 2);

  // A box across chunks and past the shape, cast to float64.
  std::vector<double> out(3 * 2, -1);
  ReadStats stats;
  Status read =
      s.ReadMany({{"params/w", Box({4, 2}, {3, 2}), DType::kFloat64, out.data()}}, &stats, nullptr);
  ASSERT_TRUE(read.ok()) << read;
  EXPECT_EQ(out, (std::vector<double>{18, 19, 22, 23, 0, 0}));
  EXPECT_GT(stats.bytes_read, 0u);

  Result<std::vector<BadChunk>> bad = s.Verify(nullptr);
  ASSERT_TRUE(bad.ok());
  EXPECT_TRUE(bad->empty());
  // Damage one chunk: Verify names its array, grid position and key.
  ASSERT_TRUE(kv.Write("step/opt.0/1", "garbage").ok());
  bad = s.Verify(nullptr);
  ASSERT_TRUE(bad.ok());
  ASSERT_EQ(bad->size(), 1u);
  EXPECT_EQ((*bad)[0].array_path, "opt/0");
  EXPECT_EQ((*bad)[0].chunk, "[1]");
  EXPECT_EQ((*bad)[0].file, "step/opt.0/1");
  EXPECT_FALSE(
      s.ReadMany({{"opt/0", Box({0}, {5}), DType::kFloat32, out.data()}}, nullptr, nullptr).ok());
}

TEST(OrbaxReaderTest, AChunkSeveralRequestsNeedIsReadOnce) {
  MemoryKvStore kv;
  WriteArray(&kv, "step/w", {6, 4}, {4, 4});  // two chunks: rows 0-3 and 4-5
  ASSERT_TRUE(
      kv.Write("step/_METADATA", "{\"tree_metadata\": {" + Leaf({{"w", 2}}, "np.ndarray") + "}}")
          .ok());
  std::unique_ptr<StepSource> s = OpenStepSource(&kv, "step").value();
  std::vector<float> whole(24);
  ReadStats once;
  ASSERT_TRUE(
      s->ReadMany({{"w", Box({0, 0}, {6, 4}), DType::kFloat32, whole.data()}}, &once, nullptr)
          .ok());
  // Each column as its own request (a reshard onto 4 devices), one of them cast: every
  // request needs both chunks, and each chunk is still fetched once.
  std::vector<double> col0(6, -1);
  std::vector<std::vector<float>> cols(3, std::vector<float>(6, -1));
  std::vector<ReadRequest> requests = {{"w", Box({0, 0}, {6, 1}), DType::kFloat64, col0.data()}};
  for (int64_t c = 1; c < 4; ++c) {
    requests.push_back({"w", Box({0, c}, {6, 1}), DType::kFloat32, cols[c - 1].data()});
  }
  ReadStats columns;
  uint64_t done = 0, total = 0;
  Status read = s->ReadMany(requests, &columns, [&](uint64_t d, uint64_t t) {
    done = d;
    total = t;
  });
  ASSERT_TRUE(read.ok()) << read;
  EXPECT_EQ(columns.requests, once.requests);
  EXPECT_EQ(columns.bytes_read, once.bytes_read);
  EXPECT_EQ(total, 6u * 8 + 3 * 6 * 4);
  EXPECT_EQ(done, total);
  for (int64_t r = 0; r < 6; ++r) {
    EXPECT_EQ(col0[r], whole[r * 4]);
    for (int64_t c = 1; c < 4; ++c) EXPECT_EQ(cols[c - 1][r], whole[r * 4 + c]) << r << "," << c;
  }
}

TEST(OrbaxReaderTest, MalformedMetadataIsDataLoss) {
  MemoryKvStore kv;
  WriteArray(&kv, "s/a", {2}, {2});
  for (const std::string& metadata :
       {std::string("{not json"), std::string("{\"tree_metadata\": 3}"),
        "{\"tree_metadata\": {" + Leaf({{"a", 1}}, "np.ndarray") + "}}",
        "{\"tree_metadata\": {" + Leaf({{"a", 2}}, "np.ndarray") + ", " +
            Leaf({{"a", 2}, {"b", 2}}, "np.ndarray") + "}}",
        "{\"tree_metadata\": {" + Leaf({{"missing", 2}}, "np.ndarray") + "}}",
        "{\"tree_metadata\": {" + Leaf({{"x", 2}, {"2", 1}}, "None") + "}}"}) {
    ASSERT_TRUE(kv.Write("s/_METADATA", metadata).ok());
    Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "s");
    EXPECT_TRUE(absl::IsDataLoss(source.status())) << metadata << ": " << source.status();
  }
}

TEST(OrbaxReaderTest, ZarrGroupNeedsWriteCompleted) {
  MemoryKvStore kv;
  ASSERT_TRUE(kv.Write("g/.zgroup", "{\"zarr_format\": 2}").ok());
  WriteArray(&kv, "g/['params']['w']", {3}, {2}, 2);
  WriteArray(&kv, "g/['opt'][1].mu", {2}, {2}, 2);
  WriteArray(&kv, "g/['opt'][0]", {2}, {2}, 2);
  WriteArray(&kv, "g/plain name", {1}, {1}, 2);
  Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "g");
  EXPECT_TRUE(absl::IsFailedPrecondition(source.status())) << source.status();
  EXPECT_THAT(source.status().message(), HasSubstr("write_completed"));

  ASSERT_TRUE(kv.Write("g/.zattrs", "{\"write_completed\": true}").ok());
  source = OpenStepSource(&kv, "g");
  ASSERT_TRUE(source.ok()) << source.status();
  std::vector<std::string> paths;
  for (const ArrayMetadata& a : (*source)->arrays()) paths.push_back(a.path);
  EXPECT_THAT(paths, ::testing::ElementsAre("opt/0", "opt/1/mu", "params/w", "plain name"));
  EXPECT_EQ((*source)->format(), StepFormat::kZarrGroup);
}

// An Orbax folder-layout checkpoint (use_ocdbt=False) at `dir` with one float32 array "a" of
// [4] in chunks of [2] (zarr v2: chunk keys "a/0", "a/1").
void WriteFolderCheckpoint(KvStore* kv, const std::string& dir, bool all_chunks_stored) {
  ASSERT_TRUE(kv->Write(dir + "/_METADATA",
                        "{\"tree_metadata\": {" + Leaf({{"a", 2}}, "np.ndarray") +
                            "}, \"use_ocdbt\": false, \"store_array_data_equal_to_fill_value\": " +
                            (all_chunks_stored ? "true" : "false") + "}")
                  .ok());
  WriteArray(kv, dir + "/a", {4}, {2}, /*zarr_format=*/2);
}

Status ReadA(KvStore* kv, const std::string& dir, std::vector<float>* out) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<StepSource> source, OpenStepSource(kv, dir));
  out->assign(4, -1.0f);
  TS_RETURN_IF_ERROR(
      source->ReadMany({{"a", Box({0}, {4}), DType::kFloat32, out->data()}}, nullptr, nullptr));
  Result<std::vector<BadChunk>> bad = source->Verify(nullptr);
  TS_RETURN_IF_ERROR(bad.status());
  if (!bad->empty()) return DataLossError(StrCat("verify: ", (*bad)[0].error));
  return OkStatus();
}

// Issue 13, item 5: an Orbax checkpoint that lost a chunk file restored as zeros and verified
// OK. When _METADATA says every chunk was written, a missing chunk is DataLoss naming it; a
// directory where a chunk should be is DataLoss whatever _METADATA says.
TEST(OrbaxReaderTest, AMissingChunkIsDataLossWhenEveryChunkWasWritten) {
  for (bool all_chunks_stored : {true, false}) {
    SCOPED_TRACE(all_chunks_stored);
    MemoryKvStore kv;
    WriteFolderCheckpoint(&kv, "s", all_chunks_stored);
    std::vector<float> got;
    TS_ASSERT_OK(ReadA(&kv, "s", &got));
    EXPECT_EQ(got, std::vector<float>({0, 1, 2, 3}));
    ASSERT_TRUE(kv.Delete("s/a/1").ok());
    Status read = ReadA(&kv, "s", &got);
    if (all_chunks_stored) {
      EXPECT_TRUE(absl::IsDataLoss(read)) << read;
      EXPECT_THAT(read.message(), HasSubstr("s/a/1"));
      EXPECT_THAT(read.message(), HasSubstr("missing"));
    } else {
      TS_EXPECT_OK(read);  // zarr's rule: a chunk left out holds the fill value
      EXPECT_EQ(got, std::vector<float>({0, 1, 0, 0}));
    }
    ASSERT_TRUE(kv.Write("s/a/1/inner", "x").ok());  // a directory at the chunk's key
    read = ReadA(&kv, "s", &got);
    EXPECT_TRUE(absl::IsDataLoss(read)) << read;
    EXPECT_THAT(read.message(), HasSubstr("not a regular file"));
  }
}

// Issue 13, item 9: a tiny zarr metadata file claiming 2^40 chunks made verify run forever
// while its memory grew; such a grid is refused when the checkpoint opens.
TEST(OrbaxReaderTest, AGridOfMoreChunksThanStoredBytesIsRefused) {
  MemoryKvStore kv;
  WriteFolderCheckpoint(&kv, "s", true);
  ASSERT_TRUE(kv.Write("s/a/.zarray",
                       "{\"zarr_format\": 2, \"shape\": [1099511627776], \"chunks\": [1], "
                       "\"dtype\": \"<f4\", \"compressor\": null, \"fill_value\": 0, "
                       "\"order\": \"C\", \"filters\": null}")
                  .ok());
  Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "s");
  EXPECT_TRUE(absl::IsInvalidArgument(source.status())) << source.status();
  EXPECT_THAT(source.status().message(), HasSubstr("1099511627776 chunks"));
}

// Issue 13, item 8: a zarr metadata file is sized before it is read.
TEST(OrbaxReaderTest, AnOversizedZarrMetadataFileIsRefusedBeforeItIsRead) {
  MemoryKvStore kv;
  WriteFolderCheckpoint(&kv, "s", true);
  std::string huge(kMaxZarrMetadataBytes + 1, ' ');
  ASSERT_TRUE(kv.Write("s/a/.zarray", huge).ok());
  Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "s");
  EXPECT_FALSE(source.ok());
  EXPECT_THAT(source.status().message(), HasSubstr("limit"));
}

// Issue 13, item 8: a chunk file is sized before it is read; one larger than any encoding of
// its elements (a hostile sparse file, say) is DataLoss without reading it.
TEST(OrbaxReaderTest, AChunkFileLargerThanAnyEncodingIsRefusedBeforeItIsRead) {
  MemoryKvStore kv;
  WriteFolderCheckpoint(&kv, "s", true);
  ASSERT_TRUE(kv.Write("s/a/1", std::string(1 << 20, 'x')).ok());
  std::vector<float> got;
  Status read = ReadA(&kv, "s", &got);
  EXPECT_TRUE(absl::IsDataLoss(read)) << read;
  EXPECT_THAT(read.message(), HasSubstr("more than any encoding"));
}

// Issue 13, item 12: restoring an Orbax checkpoint of 20k leaves took 15 s, one listing of the
// store per array to count its stored chunks. One listing serves every array now.
TEST(OrbaxReaderTest, StoredChunksOfAllArraysComeFromOneListing) {
  class CountingLists final : public ForwardingKvStore {
   public:
    using ForwardingKvStore::ForwardingKvStore;
    Result<std::vector<std::string>> List(std::string_view prefix) override {
      ++lists;
      return ForwardingKvStore::List(prefix);
    }
    int lists = 0;
  };
  MemoryKvStore memory;
  std::string leaves;
  constexpr int kArrays = 40;
  for (int i = 0; i < kArrays; ++i) {
    leaves += (i ? ", " : "") + Leaf({{StrCat("a", i), 2}}, "np.ndarray");
    WriteArray(&memory, StrCat("s/a", i), {4}, {2}, /*zarr_format=*/2);
  }
  ASSERT_TRUE(memory.Write("s/_METADATA", "{\"tree_metadata\": {" + leaves + "}}").ok());
  CountingLists kv(&memory);
  Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "s");
  TS_ASSERT_OK(source.status());
  const int lists_at_open = kv.lists;
  for (int i = 0; i < kArrays; ++i) {
    EXPECT_EQ((*source)->NumChunks(i), 2);
    EXPECT_EQ((*source)->StoredBytes(i), (*source)->StoredBytes(0));
    EXPECT_GT((*source)->StoredBytes(i), 0u);
  }
  EXPECT_LE(kv.lists - lists_at_open, 1);
}

// Issue 13, item 14: a zarr-group array name that is not UTF-8 surfaced in Python as a
// UnicodeDecodeError; it is DataLoss naming the bytes.
TEST(OrbaxReaderTest, ZarrGroupArrayNamesMustBeUtf8) {
  MemoryKvStore kv;
  ASSERT_TRUE(kv.Write("g/.zgroup", "{\"zarr_format\": 2}").ok());
  ASSERT_TRUE(kv.Write("g/.zattrs", "{\"write_completed\": true}").ok());
  WriteArray(&kv, "g/ok", {4}, {2}, /*zarr_format=*/2);
  WriteArray(&kv, "g/bad\xff\xfe", {4}, {2}, /*zarr_format=*/2);
  Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "g");
  EXPECT_TRUE(absl::IsDataLoss(source.status())) << source.status();
  EXPECT_THAT(source.status().message(), HasSubstr("bad\\xff\\xfe"));
  EXPECT_THAT(source.status().message(), HasSubstr("UTF-8"));
}

TEST(StrUtilTest, IsValidUtf8) {
  EXPECT_TRUE(IsValidUtf8("plain ascii"));
  EXPECT_TRUE(IsValidUtf8("\xc3\xa9t\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"));
  EXPECT_FALSE(IsValidUtf8("\xff"));
  EXPECT_FALSE(IsValidUtf8("\xc3"));              // truncated
  EXPECT_FALSE(IsValidUtf8("\xc0\xaf"));          // overlong '/'
  EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));      // a surrogate (U+D800)
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // past U+10FFFF
}

}  // namespace
}  // namespace tensorstash
