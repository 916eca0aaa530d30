// A real full disk: a 64 MiB tmpfs mounted by the test (root only; skipped, with the reason, where
// the machine does not allow it), nearly filled, then a save that does not fit. The save must fail
// cleanly (ResourceExhausted naming the file), the steps saved before must restore bit for bit,
// the temporary folder must be gone, and once space is freed the same root must work again.
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/reliability_test_util.h"

namespace tensorstash {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class CheckpointFullDiskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0)
      GTEST_SKIP() << "needs root to mount a tmpfs (running as uid " << ::geteuid() << ")";
    std::string dir = ::testing::TempDir() + "tensorstash_full_disk_XXXXXX";
    ASSERT_NE(::mkdtemp(dir.data()), nullptr) << std::strerror(errno);
    mount_point_ = dir;
    if (::mount("tmpfs", mount_point_.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "size=64m") != 0) {
      const int error = errno;
      fs::remove(mount_point_);
      mount_point_.clear();
      GTEST_SKIP() << "cannot mount a tmpfs here: mount: " << std::strerror(error);
    }
    mounted_ = true;
  }
  void TearDown() override {
    kv_.reset();
    if (mounted_ && ::umount2(mount_point_.c_str(), 0) != 0) {
      ADD_FAILURE() << "umount " << mount_point_ << ": " << std::strerror(errno);
      ::umount2(mount_point_.c_str(), MNT_DETACH);
    }
    if (!mount_point_.empty()) fs::remove(mount_point_);
  }

  // Writes a file of `bytes` zeros (ignoring a short write at the end: the disk is full).
  static void Fill(const fs::path& path, uint64_t bytes) {
    std::ofstream out(path, std::ios::binary);
    const std::string block(1 << 20, '\0');
    for (uint64_t done = 0; done < bytes && out; done += block.size())
      out.write(block.data(), block.size());
  }

  std::string mount_point_;
  bool mounted_ = false;
  std::unique_ptr<FileKvStore> kv_;
};

TEST_F(CheckpointFullDiskTest, SaveThatDoesNotFitFailsCleanly) {
  const std::string root = mount_point_ + "/root";
  Result<std::unique_ptr<FileKvStore>> kv = FileKvStore::Open(root);
  TS_ASSERT_OK(kv.status());
  kv_ = *std::move(kv);
  const WriterOptions options = test::SmallFilesOptions();
  for (int64_t step : {1, 2}) {
    TS_ASSERT_OK(test::SaveReliabilityStep(kv_.get(), test::StepName(step), step, 0, options));
  }
  // Leave about 2 MiB free, then save about 6 MiB.
  const fs::space_info space = fs::space(mount_point_);
  ASSERT_GT(space.available, uint64_t{4} << 20);
  Fill(fs::path(mount_point_) / "filler", space.available - (uint64_t{2} << 20));
  const int fds = test::CountProcEntries("fd");
  constexpr int kScale = 256;  // params/w becomes 64 x 24576 float32: 6 MiB
  const Status saved =
      test::SaveReliabilityStep(kv_.get(), test::StepName(3), 3, 0, options, kScale);
  EXPECT_EQ(saved.code(), absl::StatusCode::kResourceExhausted) << saved;
  EXPECT_THAT(saved.message(), HasSubstr(std::strerror(ENOSPC))) << saved;
  EXPECT_THAT(saved.message(), HasSubstr(root + "/" + test::StepName(3))) << "names no file";

  // Earlier steps intact, nothing of step 3 left (no temporary folder either), no fd leaked.
  std::map<std::string, std::set<int>> committed = {{test::StepName(1), {0}},
                                                    {test::StepName(2), {0}}};
  for (const auto& [folder, versions] : committed) {
    int version = -1;
    TS_EXPECT_OK(
        test::RestoreReliabilityStep(kv_.get(), folder, test::Step(folder), versions, &version));
  }
  EXPECT_EQ(test::TopFolders(kv_.get(), ""),
            (std::set<std::string>{test::StepName(1), test::StepName(2)}));
  EXPECT_EQ(test::CountProcEntries("fd"), fds);

  // With space again, the same root takes the step.
  fs::remove(fs::path(mount_point_) / "filler");
  TS_ASSERT_OK(test::SaveReliabilityStep(kv_.get(), test::StepName(3), 3, 0, options, kScale));
  int version = -1;
  TS_EXPECT_OK(
      test::RestoreReliabilityStep(kv_.get(), test::StepName(3), 3, {0}, &version, kScale));
}

}  // namespace
}  // namespace tensorstash
