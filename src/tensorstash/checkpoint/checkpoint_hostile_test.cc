// Hostile checkpoints beyond checkpoint_corruption_test.cc: symlinks that point out of the root,
// step names that try to leave it, and dtype names that do not exist. Each is refused with an
// error naming the file or step; where a link is planted, its target outside is a perfectly
// valid copy, so a reader that followed it would succeed: refusal shows it read nothing there.
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/reliability_test_util.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/util/crc32c.h"

namespace tensorstash {
namespace {

namespace fs = std::filesystem;
using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr char kStep[] = "0000000001";

void WriteFileOrDie(const fs::path& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

class CheckpointHostileTest : public test::TempDirTest {
 protected:
  void SetUp() override {
    test::TempDirTest::SetUp();
    root_ = fs::path(temp_dir()) / "root";
    outside_ = fs::path(temp_dir()) / "outside";
    Result<std::unique_ptr<FileKvStore>> kv = FileKvStore::Open(root_.string());
    TS_ASSERT_OK(kv.status());
    kv_ = *std::move(kv);
    WriterOptions options = test::SmallFilesOptions();
    options.sync = false;
    TS_ASSERT_OK(test::SaveReliabilityStep(kv_.get(), kStep, 1, 0, options));
    // A valid copy of the step outside the root: what a followed link would find.
    fs::create_directories(outside_);
    fs::copy(root_ / kStep, outside_ / kStep, fs::copy_options::recursive);
  }

  // Replaces `rel` (a file or folder under the root) by a symlink to its copy outside.
  void LinkOutside(const std::string& rel) {
    const fs::path inside = root_ / rel;
    ASSERT_TRUE(fs::exists(outside_ / rel)) << rel;
    fs::remove_all(inside);
    if (fs::is_directory(outside_ / rel)) {
      fs::create_directory_symlink(outside_ / rel, inside);
    } else {
      fs::create_symlink(outside_ / rel, inside);
    }
  }

  Status OpenAndRead(const std::string& step = kStep) {
    int version = -1;
    return test::RestoreReliabilityStep(kv_.get(), step, 1, {0}, &version);
  }

  std::string FirstDataFile() const {
    for (const auto& entry : fs::directory_iterator(root_ / kStep / "state" / "data")) {
      return "state/data/" + entry.path().filename().string();
    }
    return "";
  }

  fs::path root_, outside_;
  std::unique_ptr<FileKvStore> kv_;
};

TEST_F(CheckpointHostileTest, IntactStepReads) { TS_EXPECT_OK(OpenAndRead()); }

TEST_F(CheckpointHostileTest, SymlinkedStepFolderIsNotFollowed) {
  LinkOutside(kStep);
  const Status status = OpenAndRead();
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr(kStep)) << status;
  // Nor is it listed as a step.
  EXPECT_EQ(test::TopFolders(kv_.get(), "").count(kStep), 0u);
}

TEST_F(CheckpointHostileTest, SymlinkedFilesAndFoldersInsideAStepAreNotFollowed) {
  const std::string data_file = FirstDataFile();
  ASSERT_FALSE(data_file.empty());
  for (const std::string& rel :
       {std::string("COMMIT"), std::string("state"), std::string("state/index"),
        std::string("state/tree.json"), std::string("state/data"), data_file}) {
    SCOPED_TRACE(rel);
    fs::remove_all(root_ / kStep);
    fs::copy(outside_ / kStep, root_ / kStep, fs::copy_options::recursive);
    TS_ASSERT_OK(OpenAndRead());
    LinkOutside(StrCat(kStep, "/", rel));
    const Status status = OpenAndRead();
    EXPECT_FALSE(status.ok()) << "followed a symlink at " << rel;
    // The error names what was refused: the file itself, or for a folder the file under it.
    const std::string named = fs::path(rel).filename().string();
    EXPECT_THAT(status.message(), AnyOf(HasSubstr(named), HasSubstr(kStep))) << status;
  }
}

// Issue 13, item 16: a committed file replaced by a symlink, a FIFO or a directory is damage
// (DataLoss: OSError in Python), and the message says it is not a regular file, not missing.
TEST_F(CheckpointHostileTest, CommittedFilesThatAreNotRegularFilesAreDataLoss) {
  const std::string data_file = FirstDataFile();
  ASSERT_FALSE(data_file.empty());
  for (const std::string& rel :
       {data_file, std::string("state/index"), std::string("state/tree.json")}) {
    for (const std::string kind : {"symlink", "fifo", "directory"}) {
      SCOPED_TRACE(StrCat(rel, " as a ", kind));
      fs::remove_all(root_ / kStep);
      fs::copy(outside_ / kStep, root_ / kStep, fs::copy_options::recursive);
      const fs::path path = root_ / kStep / rel;
      fs::remove(path);
      if (kind == "symlink") {
        fs::create_symlink(outside_ / kStep / rel, path);
      } else if (kind == "fifo") {
        ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
      } else {
        fs::create_directories(path / "inner");
        WriteFileOrDie(path / "inner" / "x", "x");
      }
      const Status status = OpenAndRead();
      EXPECT_TRUE(absl::IsDataLoss(status)) << status;
      EXPECT_THAT(status.message(), HasSubstr("not a regular file")) << status;
      EXPECT_THAT(status.message(), HasSubstr(fs::path(rel).filename().string())) << status;
    }
  }
}

TEST_F(CheckpointHostileTest, StepNamesThatLeaveTheRootAreRefused) {
  for (const std::string& name :
       {std::string("/etc"), outside_.string() + "/" + kStep, std::string("../outside/") + kStep,
        std::string(kStep) + "/../../outside/" + kStep, std::string("./") + kStep}) {
    SCOPED_TRACE(name);
    Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv_.get(), name);
    EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument) << reader.status();
    EXPECT_THAT(reader.status().message(), HasSubstr(name));
    Result<std::unique_ptr<CheckpointWriter>> writer = CheckpointWriter::Create(kv_.get(), name);
    EXPECT_EQ(writer.status().code(), absl::StatusCode::kInvalidArgument) << writer.status();
  }
}

// tree.json with a dtype or codec name that does not exist, under a matching COMMIT.
TEST_F(CheckpointHostileTest, UnknownDtypeAndCodecNamesAreRefused) {
  const std::string tree_key = StrCat(kStep, "/state/tree.json");
  const std::string original = *kv_->Read(tree_key);
  for (const auto& [from, to] :
       std::vector<std::pair<std::string, std::string>>{{"\"float32\"", "\"float128\""},
                                                        {"\"bfloat16\"", "\"\""},
                                                        {"\"zstd\"", "\"lz4\""},
                                                        {"\"int64\"", "\"int64 \""}}) {
    SCOPED_TRACE(to);
    std::string json = original;
    const size_t at = json.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    json.replace(at, from.size(), to);
    TS_ASSERT_OK(kv_->Write(tree_key, json));
    Result<CommitRecord> commit =
        DecodeCommitRecord(*kv_->Read(StrCat(kStep, "/COMMIT")), "COMMIT");
    TS_ASSERT_OK(commit.status());
    commit->items["state"].tree_size = json.size();
    commit->items["state"].tree_crc32c = Crc32c(json);
    TS_ASSERT_OK(kv_->Write(StrCat(kStep, "/COMMIT"), EncodeCommitRecord(*commit)));
    const Status status = OpenAndRead();
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_THAT(status.message(), HasSubstr("tree.json")) << status;
    const std::string bare = to.substr(1, to.size() - 2);
    if (!bare.empty()) {
      EXPECT_THAT(status.message(), HasSubstr(bare)) << status;
    }
  }
}

}  // namespace
}  // namespace tensorstash
