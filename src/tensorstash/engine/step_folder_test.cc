// What a save may replace (step_folder.h), through the native writer, the Orbax writer and the
// manager: a folder tensorstash did not write is never deleted, with or without overwrite.
#include "tensorstash/engine/step_folder.h"

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/manager/checkpoint_manager.h"
#include "tensorstash/checkpoint/orbax_writer.h"
#include "tensorstash/testing/reliability_test_util.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"

namespace tensorstash {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr char kStep[] = "0000000001";

void WriteFile(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

Status SaveOrbax(KvStore* kv, const std::string& dir, bool overwrite, float value = 1.0f) {
  OrbaxWriterOptions options;
  options.overwrite = overwrite;
  TS_ASSIGN_OR_RETURN(std::unique_ptr<OrbaxWriter> writer, OrbaxWriter::Create(kv, dir, options));
  const float data[2] = {value, value + 1};
  TS_RETURN_IF_ERROR(writer->AddArray({"w", DType::kFloat32, {2}}, {{Box({0}, {2}), data, 0, 1}}));
  TreeNode root = TreeNode::Dict();
  root.entries.emplace_back("w", TreeNode::Array(0));
  writer->SetTree(std::move(root));
  return writer->Commit();
}

WriterOptions Options(bool overwrite) {
  WriterOptions options = test::SmallFilesOptions();
  options.sync = false;
  options.overwrite = overwrite;
  return options;
}

TEST(StepFolderTest, ClassifiesWhatAFolderHolds) {
  MemoryKvStore kv;
  EXPECT_EQ(ClassifyStepFolder(&kv, "a").value(), FolderContent::kEmpty);
  ASSERT_TRUE(kv.Write("a/notes.txt", "mine").ok());
  EXPECT_EQ(ClassifyStepFolder(&kv, "a").value(), FolderContent::kOther);
  ASSERT_TRUE(kv.Write("b/state/data/0-0.dat", "x").ok());
  ASSERT_TRUE(kv.Write("b/state/index.part-3", "x").ok());
  ASSERT_TRUE(kv.Write("b/process/2", "x").ok());
  ASSERT_TRUE(kv.Write("b/state/tree.json.tmp.0123456789abcdef", "x").ok());
  EXPECT_EQ(ClassifyStepFolder(&kv, "b").value(), FolderContent::kTensorstashLeftover);
  ASSERT_TRUE(kv.Write("b/COMMIT", "x").ok());
  EXPECT_EQ(ClassifyStepFolder(&kv, "b").value(), FolderContent::kTensorstashStep);
  ASSERT_TRUE(kv.Write("c/default/_METADATA", "{}").ok());
  ASSERT_TRUE(kv.Write("c/_CHECKPOINT_METADATA", "{}").ok());
  EXPECT_EQ(ClassifyStepFolder(&kv, "c").value(), FolderContent::kOrbaxCheckpoint);
  // Near misses of our names are not ours.
  for (const char* key : {"d/state/data/0-x.dat", "d/process/x", "d/state/other", "d/COMMIT2"}) {
    MemoryKvStore one;
    ASSERT_TRUE(one.Write(key, "x").ok());
    EXPECT_EQ(ClassifyStepFolder(&one, "d").value(), FolderContent::kOther) << key;
  }
}

TEST(StepFolderTest, LeftoverNamesNeedTheMarkerAndSixteenHexDigits) {
  EXPECT_EQ(LeftoverBase("0000000001.tmp-0123456789abcdef"), "0000000001");
  EXPECT_EQ(LeftoverBase("run/7.old-0123456789abcdef"), "run/7");
  EXPECT_FALSE(LeftoverBase("photos.old-2024"));
  EXPECT_FALSE(LeftoverBase("0000000001.tmp-0123456789ABCDEF"));
  EXPECT_FALSE(LeftoverBase("0000000001.tmp-0123456789abcdef0"));
  EXPECT_FALSE(LeftoverBase(".tmp-0123456789abcdef"));
}

class SaveDestinationTest : public test::TempDirTest {
 protected:
  void SetUp() override {
    test::TempDirTest::SetUp();
    root_ = fs::path(temp_dir()) / "root";
    kv_ = FileKvStore::Open(root_.string()).value();
  }
  fs::path root_;
  std::unique_ptr<FileKvStore> kv_;
};

// Issue 13, item 1: a folder of the user's files at the step's path was deleted by a save.
TEST_F(SaveDestinationTest, NativeSaveNeverDeletesAFolderOfUserFiles) {
  WriteFile(root_ / kStep / "thesis.tex", "years of work");
  WriteFile(root_ / kStep / "state" / "notes", "also mine");
  for (bool overwrite : {false, true}) {
    Status saved = test::SaveReliabilityStep(kv_.get(), kStep, 1, 0, Options(overwrite));
    EXPECT_TRUE(absl::IsAlreadyExists(saved)) << saved;
    EXPECT_THAT(saved.message(), HasSubstr("neither a tensorstash step nor an Orbax checkpoint"));
    EXPECT_THAT(saved.message(), HasSubstr(kStep));
  }
  EXPECT_EQ(ReadFile(root_ / kStep / "thesis.tex"), "years of work");
  EXPECT_EQ(ReadFile(root_ / kStep / "state" / "notes"), "also mine");
}

TEST_F(SaveDestinationTest, OrbaxSaveNeverDeletesAFolderOfUserFiles) {
  WriteFile(root_ / kStep / "thesis.tex", "years of work");
  for (bool overwrite : {false, true}) {
    Status saved = SaveOrbax(kv_.get(), kStep, overwrite);
    EXPECT_TRUE(absl::IsAlreadyExists(saved)) << saved;
  }
  EXPECT_EQ(ReadFile(root_ / kStep / "thesis.tex"), "years of work");
}

TEST_F(SaveDestinationTest, AnOrbaxCheckpointIsReplacedOnlyWithOverwrite) {
  TS_ASSERT_OK(SaveOrbax(kv_.get(), kStep, false));
  Status refused = test::SaveReliabilityStep(kv_.get(), kStep, 1, 0, Options(false));
  EXPECT_TRUE(absl::IsAlreadyExists(refused)) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("Orbax checkpoint"));
  EXPECT_EQ(ClassifyStepFolder(kv_.get(), kStep).value(), FolderContent::kOrbaxCheckpoint);
  TS_ASSERT_OK(test::SaveReliabilityStep(kv_.get(), kStep, 1, 0, Options(true)));
  int version = -1;
  TS_EXPECT_OK(test::RestoreReliabilityStep(kv_.get(), kStep, 1, {0}, &version));
  // And back: the Orbax writer replaces the tensorstash step with overwrite only.
  EXPECT_TRUE(absl::IsAlreadyExists(SaveOrbax(kv_.get(), kStep, false)));
  TS_EXPECT_OK(SaveOrbax(kv_.get(), kStep, true));
  EXPECT_EQ(ClassifyStepFolder(kv_.get(), kStep).value(), FolderContent::kOrbaxCheckpoint);
  EXPECT_EQ(test::TopFolders(kv_.get(), ""), std::set<std::string>({kStep}));
}

TEST_F(SaveDestinationTest, OurOwnLeftoverAndAnEmptyFolderAreReplaced) {
  // A deletion that crashed after removing COMMIT leaves files only a save writes.
  TS_ASSERT_OK(test::SaveReliabilityStep(kv_.get(), kStep, 1, 0, Options(false)));
  TS_ASSERT_OK(kv_->Delete(StrCat(kStep, "/COMMIT")));
  TS_ASSERT_OK(test::SaveReliabilityStep(kv_.get(), kStep, 1, 1, Options(false)));
  int version = -1;
  TS_EXPECT_OK(test::RestoreReliabilityStep(kv_.get(), kStep, 1, {1}, &version));
  fs::create_directories(root_ / "0000000002" / "empty");
  TS_EXPECT_OK(test::SaveReliabilityStep(kv_.get(), "0000000002", 2, 0, Options(false)));
}

TEST(SaveDestinationMemoryTest, StoresWithoutRenameRefuseUserFilesToo) {
  MemoryKvStore kv(/*supports_rename=*/false);
  ASSERT_TRUE(kv.Write("0000000001/notes.txt", "mine").ok());
  Status saved = test::SaveReliabilityStep(&kv, kStep, 1, 0, Options(true));
  EXPECT_TRUE(absl::IsAlreadyExists(saved)) << saved;
  EXPECT_EQ(kv.Read("0000000001/notes.txt").value(), "mine");
}

TEST_F(SaveDestinationTest, ManagerLeavesFoldersItDidNotWriteAlone) {
  WriteFile(root_ / "0000000005" / "notes.txt", "mine");               // a step name, not ours
  WriteFile(root_ / "photos.old-2024" / "a.jpg", "mine");              // looks like a marker
  WriteFile(root_ / "0000000005.tmp-0123456789abcdef" / "x", "ours");  // our leftover name
  {
    Result<std::unique_ptr<CheckpointManager>> manager =
        CheckpointManager::Open(kv_.get(), ManagerOptions());
    TS_ASSERT_OK(manager.status());
    EXPECT_TRUE((*manager)->AllSteps().empty());
  }
  EXPECT_EQ(ReadFile(root_ / "0000000005" / "notes.txt"), "mine");
  EXPECT_EQ(ReadFile(root_ / "photos.old-2024" / "a.jpg"), "mine");
  EXPECT_FALSE(fs::exists(root_ / "0000000005.tmp-0123456789abcdef"));
}

}  // namespace
}  // namespace tensorstash
