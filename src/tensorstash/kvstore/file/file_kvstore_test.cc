// FileKvStore behaviour beyond the conformance suite: what is on disk, symlinks, permissions.
#include "tensorstash/kvstore/file/file_kvstore.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/kvstore_conformance.h"

namespace tensorstash {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

void WriteFile(const fs::path& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary);
  out << contents;
}

class FileKvStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string dir = ::testing::TempDir() + "file_kvstore_XXXXXX";
    ASSERT_NE(::mkdtemp(dir.data()), nullptr) << std::strerror(errno);
    scratch_ = dir;
    root_ = scratch_ / "root";
    Result<std::unique_ptr<FileKvStore>> store = FileKvStore::Open(root_.string());
    ASSERT_EQ(absl::OkStatus(), store.status());
    store_ = *std::move(store);
  }

  void TearDown() override {
    store_.reset();
    std::error_code ignored;
    // Undo any chmod of a test that failed half-way, so the tree can be removed.
    for (auto it = fs::recursive_directory_iterator(scratch_, ignored);
         it != fs::recursive_directory_iterator(); it.increment(ignored)) {
      if (!it->is_symlink(ignored))
        fs::permissions(it->path(), fs::perms::owner_all, fs::perm_options::add, ignored);
    }
    fs::remove_all(scratch_, ignored);
  }

  // Every file and directory name under the root, relative to it.
  std::vector<std::string> Tree() {
    std::vector<std::string> names;
    for (const fs::directory_entry& entry : fs::recursive_directory_iterator(root_)) {
      names.push_back(fs::relative(entry.path(), root_).string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  fs::path scratch_;
  fs::path root_;
  std::unique_ptr<FileKvStore> store_;
};

TEST_F(FileKvStoreTest, OpenCreatesNestedRoot) {
  const fs::path nested = scratch_ / "x" / "y" / "z";
  Result<std::unique_ptr<FileKvStore>> store = FileKvStore::Open(nested.string() + "/");
  ASSERT_EQ(absl::OkStatus(), store.status());
  EXPECT_TRUE(fs::is_directory(nested));
  EXPECT_EQ((*store)->root_dir(), nested.string());
  EXPECT_EQ((*store)->Describe(), "file:" + nested.string());
}

TEST_F(FileKvStoreTest, OpenWithoutCreateNeedsADirectory) {
  const fs::path missing = scratch_ / "missing";
  Status status = FileKvStore::Open(missing.string(), /*create=*/false).status();
  EXPECT_TRUE(absl::IsNotFound(status)) << status;
  EXPECT_THAT(MessageOf(status), HasSubstr(missing.string()));
  EXPECT_FALSE(fs::exists(missing));

  WriteFile(scratch_ / "file", "x");
  EXPECT_FALSE(FileKvStore::Open((scratch_ / "file").string(), /*create=*/false).ok());
  EXPECT_FALSE(FileKvStore::Open((scratch_ / "file").string(), /*create=*/true).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(FileKvStore::Open("").status()));
}

TEST_F(FileKvStoreTest, ObjectsArePlainFiles) {
  ASSERT_EQ(absl::OkStatus(), store_->Write("a/b/c", "contents"));
  EXPECT_EQ(ReadFile(root_ / "a" / "b" / "c"), "contents");
  WriteFile(root_ / "a" / "outside-writer", "made by hand");
  EXPECT_EQ(*store_->Read("a/outside-writer"), "made by hand");
}

TEST_F(FileKvStoreTest, WriteLeavesNoTempFiles) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) {
        // Every thread overwrites the same keys too.
        EXPECT_EQ(absl::OkStatus(), store_->Write("d/k" + std::to_string(i), std::to_string(t)));
        EXPECT_EQ(absl::OkStatus(),
                  store_->Write("d/t" + std::to_string(t) + "/k" + std::to_string(i), "v"));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  ASSERT_EQ(absl::OkStatus(), store_->Write("dir/inside", "v"));
  // A failed write cleans up too.
  EXPECT_TRUE(absl::IsFailedPrecondition(store_->Write("dir", "v")));
  for (const std::string& name : Tree()) EXPECT_THAT(name, testing::Not(HasSubstr(".tmp.")));
  EXPECT_EQ(store_->List("d/")->size(), 25u + 4 * 25u);
}

TEST_F(FileKvStoreTest, SymlinkOutsideRootIsNotFollowed) {
  const fs::path outside = scratch_ / "outside";
  fs::create_directory(outside);
  WriteFile(outside / "secret", "secret");
  fs::create_symlink(outside / "secret", root_ / "link_file");
  fs::create_directory_symlink(outside, root_ / "link_dir");
  ASSERT_EQ(absl::OkStatus(), store_->Write("real", "v"));

  char buffer[6];
  for (std::string_view key : {"link_file", "link_dir/secret"}) {
    SCOPED_TRACE(key);
    Result<std::string> read = store_->Read(key);
    EXPECT_TRUE(absl::IsFailedPrecondition(read.status())) << read.status();
    EXPECT_THAT(MessageOf(read.status()), HasSubstr("symlink"));
    EXPECT_THAT(MessageOf(read.status()), HasSubstr(key));
    EXPECT_FALSE(store_->ReadRange(key, 0, 6, buffer).ok());
    EXPECT_FALSE(store_->Size(key).ok());
    EXPECT_FALSE(store_->OpenForRead(key).ok());
    EXPECT_FALSE(store_->Sync(key).ok());
  }
  // Nothing through the links is listed, written or deleted.
  EXPECT_THAT(*store_->List(""), ElementsAre("real"));
  EXPECT_THAT(*store_->List("link_dir/"), IsEmpty());
  EXPECT_TRUE(absl::IsFailedPrecondition(store_->Write("link_dir/new", "x")));
  EXPECT_FALSE(store_->OpenForWrite("link_dir/new2").ok());
  EXPECT_FALSE(store_->OpenForWrite("link_file").ok());
  EXPECT_FALSE(store_->Delete("link_dir/secret").ok());
  // To the store the link is not a directory, so nothing is under it to delete.
  EXPECT_EQ(absl::OkStatus(), store_->DeletePrefix("link_dir/"));
  EXPECT_TRUE(fs::is_symlink(root_ / "link_dir"));
  EXPECT_TRUE(absl::IsNotFound(store_->RenameDirectory("link_dir", "moved")));
  EXPECT_FALSE(store_->SyncDirectory("link_dir").ok());
  EXPECT_EQ(ReadFile(outside / "secret"), "secret");
  EXPECT_FALSE(fs::exists(outside / "new"));
  EXPECT_FALSE(fs::exists(outside / "new2"));

  // Write replaces the link itself, never its target.
  ASSERT_EQ(absl::OkStatus(), store_->Write("link_file", "mine"));
  EXPECT_EQ(*store_->Read("link_file"), "mine");
  EXPECT_EQ(ReadFile(outside / "secret"), "secret");

  // Deleting everything removes the remaining link, not what it points to.
  ASSERT_EQ(absl::OkStatus(), store_->DeletePrefix(""));
  EXPECT_THAT(Tree(), IsEmpty());
  EXPECT_EQ(ReadFile(outside / "secret"), "secret");
}

TEST_F(FileKvStoreTest, SpecialFilesAreNotObjects) {
  ASSERT_EQ(0, ::mkfifo((root_ / "fifo").c_str(), 0600)) << std::strerror(errno);
  EXPECT_THAT(*store_->List(""), IsEmpty());
  // The fifo has no writer: opening it must not block.
  EXPECT_TRUE(absl::IsFailedPrecondition(store_->Read("fifo").status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(store_->Size("fifo").status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(store_->OpenForRead("fifo").status()));
  ASSERT_EQ(absl::OkStatus(), store_->DeletePrefix(""));
  EXPECT_FALSE(fs::exists(root_ / "fifo"));
}

TEST_F(FileKvStoreTest, DeletePrefixRemovesEmptiedDirectories) {
  for (const char* key : {"a/b/c", "a/b/d/e", "a/bx/f", "a/g", "h"}) {
    ASSERT_EQ(absl::OkStatus(), store_->Write(key, "v"));
  }
  ASSERT_EQ(absl::OkStatus(), store_->DeletePrefix("a/b/"));
  EXPECT_THAT(Tree(), ElementsAre("a", "a/bx", "a/bx/f", "a/g", "h"));
  ASSERT_EQ(absl::OkStatus(), store_->DeletePrefix("a/b"));
  EXPECT_THAT(Tree(), ElementsAre("a", "a/g", "h"));
  ASSERT_EQ(absl::OkStatus(), store_->DeletePrefix("a/"));
  EXPECT_THAT(Tree(), ElementsAre("h"));
  ASSERT_EQ(absl::OkStatus(), store_->DeletePrefix(""));
  EXPECT_THAT(Tree(), IsEmpty());
  EXPECT_TRUE(fs::is_directory(root_));
}

TEST_F(FileKvStoreTest, LeftoverTempFileIsAnOrdinaryObject) {
  // What a crash between create and rename leaves behind.
  fs::create_directories(root_ / "step");
  WriteFile(root_ / "step" / "index.tmp.0123456789abcdef", "partial");
  EXPECT_THAT(*store_->List("step/"), ElementsAre("step/index.tmp.0123456789abcdef"));
  ASSERT_EQ(absl::OkStatus(), store_->DeletePrefix("step/"));
  EXPECT_FALSE(fs::exists(root_ / "step"));
}

TEST_F(FileKvStoreTest, KeepsWorkingWhenRootIsRenamed) {
  ASSERT_EQ(absl::OkStatus(), store_->Write("k", "v"));
  fs::rename(root_, scratch_ / "moved");
  EXPECT_EQ(*store_->Read("k"), "v");
  ASSERT_EQ(absl::OkStatus(), store_->Write("k2", "v2"));
  EXPECT_EQ(ReadFile(scratch_ / "moved" / "k2"), "v2");
}

// How many of the file's pages are in the page cache (mincore over a mapping of it).
size_t PagesCached(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0) << std::strerror(errno);
  const size_t size = fs::file_size(path);
  void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  EXPECT_NE(mapped, MAP_FAILED) << std::strerror(errno);
  if (mapped == MAP_FAILED) return 0;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((size + page - 1) / page);
  EXPECT_EQ(::mincore(mapped, size, resident.data()), 0) << std::strerror(errno);
  ::munmap(mapped, size);
  size_t cached = 0;
  for (unsigned char r : resident) cached += r & 1;
  return cached;
}

TEST_F(FileKvStoreTest, PreferDirectWritesBypassesThePageCache) {
  // Only where this file system takes O_DIRECT at all.
  const fs::path probe = scratch_ / "probe";
  const int probe_fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
  if (probe_fd < 0) GTEST_SKIP() << "no O_DIRECT on " << scratch_ << ": " << std::strerror(errno);
  ::close(probe_fd);

  const size_t size = size_t{4} << 20;
  std::string bytes(size + 1, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 + i / 4096);
  for (const bool direct : {true, false}) {
    const std::string key = direct ? "direct" : "buffered";
    Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite(key);
    ASSERT_EQ(absl::OkStatus(), file.status());
    if (direct) (*file)->PreferDirectWrites();
    // From an odd address (a bounce copy), the whole blocks of 4 MiB, and one byte past them.
    ASSERT_EQ(absl::OkStatus(), (*file)->WriteAt(0, bytes.data() + 1, size));
    ASSERT_EQ(absl::OkStatus(), (*file)->WriteAt(size, bytes.data(), 1));
    ASSERT_EQ(absl::OkStatus(), (*file)->Sync());
    ASSERT_EQ(absl::OkStatus(), (*file)->Close());
  }
  const size_t pages = size / static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  EXPECT_EQ(PagesCached(root_ / "buffered"), pages + 1);
  EXPECT_EQ(PagesCached(root_ / "direct"), 1u);  // just the last byte's page
  EXPECT_TRUE(ReadFile(root_ / "direct") == bytes.substr(1, size) + bytes.substr(0, 1));
}

TEST_F(FileKvStoreTest, PermissionDeniedWhenNotRoot) {
  if (::geteuid() == 0) {
    GTEST_SKIP() << "running as root, which ignores permission bits";
  }
  ASSERT_EQ(absl::OkStatus(), store_->Write("ro/x", "v"));
  fs::permissions(root_ / "ro", fs::perms::owner_read | fs::perms::owner_exec);
  Status status = store_->Write("ro/y", "v");
  EXPECT_TRUE(absl::IsPermissionDenied(status)) << status;
  EXPECT_THAT(MessageOf(status), HasSubstr("ro/y"));
  EXPECT_TRUE(absl::IsPermissionDenied(store_->OpenForWrite("ro/z").status()));
  EXPECT_TRUE(absl::IsPermissionDenied(store_->Delete("ro/x")));
  fs::permissions(root_ / "ro" / "x", fs::perms::none);
  status = store_->Read("ro/x").status();
  EXPECT_TRUE(absl::IsPermissionDenied(status)) << status;
  EXPECT_THAT(MessageOf(status), HasSubstr("ro/x"));
  fs::permissions(root_ / "ro", fs::perms::owner_all);
}

TEST_F(FileKvStoreTest, StartWritebackOfAClosedFileIsFailedPrecondition) {
  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("a/b");
  ASSERT_EQ(absl::OkStatus(), file.status());
  ASSERT_EQ(absl::OkStatus(), (*file)->WriteAt(0, "abc", 3));
  ASSERT_EQ(absl::OkStatus(), (*file)->StartWriteback());
  ASSERT_EQ(absl::OkStatus(), (*file)->Close());
  Status started = (*file)->StartWriteback();
  EXPECT_TRUE(absl::IsFailedPrecondition(started)) << started;
  EXPECT_THAT(std::string(started.message()), HasSubstr("a/b"));
  EXPECT_EQ(ReadFile(root_ / "a" / "b"), "abc");
}

}  // namespace
// The conformance suite (kvstore_conformance.h) on this backend.
TS_INSTANTIATE_KVSTORE_CONFORMANCE(
    File,
    std::vector<KvStoreBackend>({{"File",
                                  [](const std::string& scratch_dir) -> std::unique_ptr<KvStore> {
                                    Result<std::unique_ptr<FileKvStore>> store =
                                        FileKvStore::Open(scratch_dir + "/root");
                                    if (!store.ok()) {
                                      ADD_FAILURE() << store.status();
                                      return nullptr;
                                    }
                                    return *std::move(store);
                                  }}}));

TS_INSTANTIATE_KVSTORE_READ_CONFORMANCE(
    File, std::vector<ReadableKvStoreBackend>(
              {{"File",
                [](const std::string& scratch_dir,
                   const std::map<std::string, std::string>& contents) -> std::unique_ptr<KvStore> {
                  Result<std::unique_ptr<FileKvStore>> store =
                      FileKvStore::Open(scratch_dir + "/root");
                  if (!store.ok()) {
                    ADD_FAILURE() << store.status();
                    return nullptr;
                  }
                  for (const auto& [key, value] : contents) {
                    if (Status written = (*store)->Write(key, value); !written.ok()) {
                      ADD_FAILURE() << written;
                      return nullptr;
                    }
                  }
                  return *std::move(store);
                }}}));

}  // namespace tensorstash
