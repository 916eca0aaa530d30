// Leftovers of interrupted saves, interrupted overwrites, and saves big enough to use several
// data files at once.
#include <cstring>

#include "gtest/gtest.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"

namespace tensorstash {
namespace {

// Saves one int32 array of `n` elements whose values are `base + i`.
Status SaveStep(KvStore* kv, const std::string& dir, int64_t n, int32_t base,
                bool overwrite = false) {
  std::vector<int32_t> data(n);
  for (int64_t i = 0; i < n; ++i) data[i] = base + static_cast<int32_t>(i);
  WriterOptions options;
  options.overwrite = overwrite;
  TS_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Create(kv, dir, options));
  TS_RETURN_IF_ERROR(
      writer->AddArray({"x", DType::kInt32, {n}}, {{Box::FromShape({n}), data.data()}}));
  return writer->Commit();
}

Result<int32_t> FirstValue(KvStore* kv, const std::string& dir) {
  TS_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(kv, dir));
  int32_t value = 0;
  TS_RETURN_IF_ERROR(reader->Read({"x", Box({0}, {1}), DType::kInt32, &value}));
  return value;
}

TEST(CheckpointLeftoversTest, TemporaryFoldersOfAStepAreRemovedByItsNextSave) {
  MemoryKvStore kv;
  ASSERT_TRUE(kv.Write("0001.tmp-00000000deaddead/state/data/0-0.dat", "partial").ok());
  ASSERT_TRUE(kv.Write("0001.tmp-00000000beefbeef/COMMIT", "{}").ok());
  ASSERT_TRUE(kv.Write("0002.tmp-00000000cafecafe/state/index", "other step's").ok());
  ASSERT_TRUE(kv.Write("0001.5.tmp-00000000f00df00d/state/index", "step 0001.5's").ok());
  // Not ours: the id is not 16 hex digits (docs/format.md, "Layout").
  ASSERT_TRUE(kv.Write("0001.tmp-mine/notes", "the user's").ok());
  ASSERT_TRUE(SaveStep(&kv, "0001", 10, 5).ok());
  auto keys = kv.List("").value();
  for (const std::string& key : keys) {
    if (key != "0001.tmp-mine/notes") {
      EXPECT_EQ(key.find("0001.tmp-"), std::string::npos) << key;
    }
  }
  EXPECT_TRUE(
      kv.Size("0001.5.tmp-00000000f00df00d/state/index").ok());  // step "0001.5" is another step
  EXPECT_TRUE(kv.Size("0002.tmp-00000000cafecafe/state/index")
                  .ok());  // another step's folder is left alone
  EXPECT_TRUE(kv.Size("0001.tmp-mine/notes").ok());
  EXPECT_EQ(FirstValue(&kv, "0001").value(), 5);
}

TEST(CheckpointLeftoversTest, AnOverwriteInterruptedBetweenItsRenamesIsUndone) {
  MemoryKvStore kv;
  ASSERT_TRUE(SaveStep(&kv, "0007", 10, 100).ok());
  // A crash after the old step was moved aside and before the new one was moved in.
  ASSERT_TRUE(kv.RenameDirectory("0007", "0007.old-0000000000001234").ok());
  ASSERT_TRUE(SaveStep(&kv, "new", 10, 200).ok());
  ASSERT_TRUE(kv.RenameDirectory("new", "0007.tmp-0000000000001234").ok());
  // The next save of the step restores the old one first: without overwrite it is refused...
  Status refused = SaveStep(&kv, "0007", 10, 300);
  EXPECT_TRUE(absl::IsAlreadyExists(refused)) << refused;
  EXPECT_EQ(FirstValue(&kv, "0007").value(), 100);
  EXPECT_TRUE(kv.List("0007.").value().empty());
  // ...and with overwrite it is replaced.
  ASSERT_TRUE(SaveStep(&kv, "0007", 10, 300, /*overwrite=*/true).ok());
  EXPECT_EQ(FirstValue(&kv, "0007").value(), 300);
}

TEST(CheckpointLeftoversTest, AnIndexSwappedForAnotherOfTheSameSizeIsCaught) {
  MemoryKvStore kv;
  ASSERT_TRUE(SaveStep(&kv, "a", 1000, 1).ok());
  ASSERT_TRUE(SaveStep(&kv, "b", 1000, 2).ok());
  const std::string index_b = kv.Read("b/state/index").value();
  ASSERT_EQ(index_b.size(), kv.Read("a/state/index").value().size());
  ASSERT_NE(index_b, kv.Read("a/state/index").value());
  ASSERT_TRUE(kv.Write("a/state/index", index_b).ok());
  auto reader = CheckpointReader::Open(&kv, "a");
  ASSERT_FALSE(reader.ok());
  EXPECT_TRUE(absl::IsDataLoss(reader.status()));
  EXPECT_NE(std::string(reader.status().message()).find("a/state/index"), std::string::npos);
}

TEST(CheckpointLeftoversTest, BigSavesWriteSeveralDataFilesAtOnceAndReadBack) {
  MemoryKvStore kv;
  const int64_t n = int64_t{48} << 20;  // 192 MiB of int32: three lanes
  ASSERT_TRUE(SaveStep(&kv, "big", n, 7).ok());
  auto reader = CheckpointReader::Open(&kv, "big").value();
  EXPECT_GE(reader->index().files.size(), 2u);
  std::vector<int32_t> out(n);
  ASSERT_TRUE(reader->Read({"x", Box::FromShape({n}), DType::kInt32, out.data()}).ok());
  for (int64_t i = 0; i < n; i += 4099) ASSERT_EQ(out[i], 7 + static_cast<int32_t>(i)) << i;
  EXPECT_EQ(out[n - 1], 7 + static_cast<int32_t>(n - 1));
}

}  // namespace
}  // namespace tensorstash
