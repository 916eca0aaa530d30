#include "tensorstash/checkpoint/dcp_reader.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/format/dcp/torch_zip.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/testing/status_test_macros.h"
#include "tensorstash/testing/test_files.h"

namespace tensorstash {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// The checkpoint tests/data/dcp/<name> (written by tests/tools/make_dcp_checkpoints.py) under
// "ck/" of `kv`.
void Load(MemoryKvStore* kv, const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(TS_TEST_DATA_DIR) / "dcp" / name;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    ASSERT_TRUE(
        kv->Write("ck/" + entry.path().filename().string(), ReadFileToString(entry.path()))
            .ok());
  }
}

const TreeNode* Entry(const TreeNode& tree, const std::string& key) {
  for (const auto& [k, v] : tree.entries) {
    if (k == key) return &v;
  }
  return nullptr;
}

TEST(DcpReader, RestoresATwoRankCheckpointOntoAnyBox) {
  MemoryKvStore kv;
  Load(&kv, "two_ranks");
  Result<DetectedStep> detected = DetectStepFormat(&kv, "ck");
  TS_ASSERT_OK(detected.status());
  EXPECT_EQ(detected->format, StepFormat::kDcp);
  EXPECT_EQ(StepFormatName(StepFormat::kDcp), "dcp");
  Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "ck");
  TS_ASSERT_OK(source.status());
  StepSource& s = **source;
  ASSERT_EQ(s.arrays().size(), 2u);
  EXPECT_EQ(s.arrays()[0].path, "sharded");
  EXPECT_THAT(s.arrays()[0].shape(), ElementsAre(10, 4));
  EXPECT_EQ(s.NumChunks(0), 2);
  const TreeNode* step = Entry(s.tree(), "step");
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(step->kind, TreeNode::Kind::kInt);
  EXPECT_EQ(step->int_value, "3");

  // Rows 3-7 as float64: they span both ranks' chunks.
  std::vector<double> rows(5 * 4);
  ReadStats stats;
  TS_ASSERT_OK(s.ReadMany({{"sharded", Box({3, 0}, {5, 4}), DType::kFloat64, rows.data()}},
                          &stats, nullptr));
  for (int i = 0; i < 20; ++i) EXPECT_EQ(rows[i], 12.0 + i);
  EXPECT_EQ(stats.staged_chunks, 2u);
  // One row inside rank 0's chunk reads only that chunk.
  std::vector<float> one(4);
  stats = ReadStats{};
  TS_ASSERT_OK(s.ReadMany({{"sharded", Box({1, 0}, {1, 4}), DType::kFloat32, one.data()}}, &stats,
                          nullptr));
  EXPECT_THAT(one, ElementsAre(4, 5, 6, 7));
  EXPECT_EQ(stats.staged_chunks, 1u);
  EXPECT_LE(stats.bytes_read, 1641u);
  // Past the stored shape: zeros.
  std::vector<int32_t> rep(8, -1);
  TS_ASSERT_OK(s.ReadMany({{"replicated", Box({0}, {8}), DType::kInt32, rep.data()}}, nullptr,
                          nullptr));
  EXPECT_THAT(rep, ElementsAre(0, 1, 2, 3, 4, 5, 0, 0));
  Result<std::vector<BadChunk>> bad = s.Verify(nullptr);
  TS_ASSERT_OK(bad.status());
  EXPECT_TRUE(bad->empty());
  EXPECT_EQ(s.VerifyTotalItems(), 3u);
}

TEST(DcpReader, AChunkSeveralBoxesNeedIsReadOnce) {
  MemoryKvStore kv;
  Load(&kv, "two_ranks");
  Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "ck");
  TS_ASSERT_OK(source.status());
  StepSource& s = **source;
  // Rows 0-2 need rank 0's chunk, rows 3-7 both chunks, rows 8-9 rank 1's chunk, and a second
  // request for all rows needs both again: each chunk is read once.
  std::vector<float> a(3 * 4), b(5 * 4), c(2 * 4), all(10 * 4);
  ReadStats stats;
  TS_ASSERT_OK(s.ReadMany({{"sharded", Box({0, 0}, {3, 4}), DType::kFloat32, a.data()},
                           {"sharded", Box({3, 0}, {5, 4}), DType::kFloat32, b.data()},
                           {"sharded", Box({8, 0}, {2, 4}), DType::kFloat32, c.data()},
                           {"sharded", Box({0, 0}, {10, 4}), DType::kFloat32, all.data()}},
                          &stats, nullptr));
  for (int i = 0; i < 12; ++i) EXPECT_EQ(a[i], i);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(b[i], 12 + i);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(c[i], 32 + i);
  for (int i = 0; i < 40; ++i) EXPECT_EQ(all[i], i);
  EXPECT_EQ(stats.staged_chunks, 2u);
  EXPECT_EQ(stats.requests, 2u);
  EXPECT_EQ(stats.bytes_read, s.StoredBytes(0));
}

TEST(DcpReader, ArchivesHeldAtOnceStayUnderTheCap) {
  MemoryKvStore kv;
  Load(&kv, "two_ranks");
  ReaderOptions options;
  options.io_threads = 4;
  // Under one archive: each is read alone.
  options.max_inflight_bytes = 1;
  Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "ck", options);
  TS_ASSERT_OK(source.status());
  std::vector<float> all(10 * 4);
  std::vector<int32_t> rep(6);
  ReadStats stats;
  TS_ASSERT_OK((*source)->ReadMany(
      {{"sharded", Box({0, 0}, {10, 4}), DType::kFloat32, all.data()},
       {"replicated", Box({0}, {6}), DType::kInt32, rep.data()}},
      &stats, nullptr));
  for (int i = 0; i < 40; ++i) EXPECT_EQ(all[i], i);
  EXPECT_THAT(rep, ElementsAre(0, 1, 2, 3, 4, 5));
  EXPECT_EQ(stats.staged_chunks, 3u);
  // One archive at a time: the two of "sharded" are 1641 bytes each, "replicated"'s 1577, so
  // two held at once would be over 3000.
  const uint64_t largest = (*source)->StoredBytes(0) / 2;
  EXPECT_EQ(largest, 1641u);
  EXPECT_GT(stats.peak_staging_bytes, 0u);
  EXPECT_LE(stats.peak_staging_bytes, largest);
}

TEST(DcpReader, ReadsEveryDtypeAndPlainValues) {
  MemoryKvStore kv;
  Load(&kv, "single");
  Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "ck");
  TS_ASSERT_OK(source.status());
  StepSource& s = **source;
  EXPECT_EQ(s.arrays().size(), 17u);
  std::vector<int64_t> view(4);
  std::vector<uint16_t> u16(6);
  std::vector<double> scalar(1);
  std::vector<uint8_t> b(6);
  TS_ASSERT_OK(s.ReadMany({{"model.view", Box({0}, {4}), DType::kInt64, view.data()},
                           {"model.d_uint16", Box({0, 0}, {2, 3}), DType::kUint16, u16.data()},
                           {"model.scalar", Box({}, {}), DType::kFloat64, scalar.data()},
                           {"model.d_bool", Box({0, 0}, {2, 3}), DType::kBool, b.data()}},
                          nullptr, nullptr));
  EXPECT_THAT(view, ElementsAre(5, 6, 7, 8));
  EXPECT_THAT(u16, ElementsAre(0, 1, 2, 3, 4, 0));
  EXPECT_THAT(scalar, ElementsAre(2.5));
  EXPECT_THAT(b, ElementsAre(0, 1, 1, 1, 1, 0));
  const TreeNode* name = Entry(s.tree(), "name");
  ASSERT_NE(name, nullptr);
  EXPECT_EQ(name->string_value, "abc");
  const TreeNode* lst = Entry(s.tree(), "lst");
  ASSERT_NE(lst, nullptr);
  ASSERT_EQ(lst->kind, TreeNode::Kind::kList);
  ASSERT_EQ(lst->items.size(), 4u);
  EXPECT_EQ(lst->items[0].int_value, "1");
  EXPECT_EQ(lst->items[1].float_value, 2.5);
  EXPECT_EQ(lst->items[2].kind, TreeNode::Kind::kNone);
  EXPECT_TRUE(lst->items[3].bool_value);
}

TEST(DcpReader, ACorruptOrTruncatedChunkIsFoundAndNamed) {
  MemoryKvStore kv;
  Load(&kv, "two_ranks");
  std::string file = *kv.Read("ck/__1_0.distcp");
  // Rank 1's file: "step" (bytes item) at 0, "sharded" rows 5-9 at 1261 (+1641), "replicated"
  // at 2902. Flip a byte of the sharded chunk's tensor data.
  Result<std::vector<ZipEntry>> entries = ReadStoredZip(std::string_view(file).substr(1261, 1641), "x");
  TS_ASSERT_OK(entries.status());
  const ZipEntry* data = FindTorchZipEntry(*entries, "data/0");
  ASSERT_NE(data, nullptr);
  file[1261 + data->data_offset + 5] ^= 0x10;
  ASSERT_TRUE(kv.Write("ck/__1_0.distcp", file).ok());
  Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "ck");
  TS_ASSERT_OK(source.status());
  std::vector<float> rows(40);
  Status st = (*source)->ReadMany({{"sharded", Box({0, 0}, {10, 4}), DType::kFloat32, rows.data()}},
                                  nullptr, nullptr);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(st.message(), HasSubstr("__1_0.distcp"));
  EXPECT_THAT(st.message(), HasSubstr("sharded"));
  // Rank 0's chunk still reads.
  TS_EXPECT_OK((*source)->ReadMany({{"sharded", Box({0, 0}, {5, 4}), DType::kFloat32, rows.data()}},
                                   nullptr, nullptr));
  Result<std::vector<BadChunk>> bad = (*source)->Verify(nullptr);
  TS_ASSERT_OK(bad.status());
  ASSERT_EQ(bad->size(), 1u);
  EXPECT_EQ((*bad)[0].array_path, "sharded");
  EXPECT_EQ((*bad)[0].chunk, "[5, 0]");

  // A truncated file (torchtitan#4011: DCP itself loads one while .metadata exists). The bytes
  // item "step" at its start is whole, so it opens; the chunks past the end are errors.
  ASSERT_TRUE(kv.Write("ck/__1_0.distcp", file.substr(0, 2000)).ok());
  Result<std::unique_ptr<StepSource>> truncated = OpenStepSource(&kv, "ck");
  TS_ASSERT_OK(truncated.status());
  st = (*truncated)->ReadMany({{"sharded", Box({0, 0}, {10, 4}), DType::kFloat32, rows.data()}},
                              nullptr, nullptr);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(st.message(), HasSubstr("past the end of ck/__1_0.distcp"));
  bad = (*truncated)->Verify(nullptr);
  TS_ASSERT_OK(bad.status());
  EXPECT_EQ(bad->size(), 2u);  // sharded [5, 0] and replicated [0]
}

TEST(DcpReader, AHostileMetadataIsRefusedAtOpen) {
  MemoryKvStore kv;
  Load(&kv, "two_ranks");
  static constexpr char kEvil[] = "\x80\x02" "cos\nsystem\n" "X\x02\x00\x00\x00" "ls\x85R.";
  ASSERT_TRUE(kv.Write("ck/.metadata", std::string(kEvil, sizeof(kEvil) - 1)).ok());
  Result<std::unique_ptr<StepSource>> source = OpenStepSource(&kv, "ck");
  ASSERT_FALSE(source.ok());
  EXPECT_EQ(source.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(source.status().message(), HasSubstr("os.system"));
}

}  // namespace
}  // namespace tensorstash
