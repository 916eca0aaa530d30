// The KvStore conformance suite (kvstore_conformance.h): what the engine may rely on. Each
// backend instantiates it from its own folder (file/, memory/, fault/).
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/testing/kvstore_conformance.h"
#include "tensorstash/util/staging_buffer.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::string Pattern(size_t size, uint32_t seed) {
  std::string bytes(size, '\0');
  std::mt19937 random(seed);
  for (char& c : bytes) c = static_cast<char>(random());
  return bytes;
}

TEST_P(KvStoreConformanceTest, DescribeIsNotEmpty) { EXPECT_FALSE(store_->Describe().empty()); }

TEST_P(KvStoreConformanceTest, WriteThenRead) {
  Put("top", "value");
  Put("a/b/c", "nested");
  EXPECT_EQ(Get("top"), "value");
  EXPECT_EQ(Get("a/b/c"), "nested");
}

TEST_P(KvStoreConformanceTest, EmptyAndBinaryValues) {
  Put("empty", "");
  EXPECT_EQ(Get("empty"), "");
  const std::string binary = Pattern(3 << 20, 1) + std::string("\0\0\xff", 3);
  Put("binary", binary);
  EXPECT_EQ(Get("binary"), binary);
}

TEST_P(KvStoreConformanceTest, OverwriteReplacesWholeValue) {
  Put("k", "a long first value");
  Put("k", "short");
  EXPECT_EQ(Get("k"), "short");
  EXPECT_EQ(*store_->Size("k"), 5u);
}

TEST_P(KvStoreConformanceTest, LongestSegmentWorks) {
  const std::string key = "dir/" + std::string(255, 'x');
  Put(key, "v");
  EXPECT_EQ(Get(key), "v");
  EXPECT_THAT(ListOrDie("dir/"), ElementsAre(key));
}

TEST_P(KvStoreConformanceTest, ReadRangeInside) {
  Put("k", "0123456789");
  char buffer[4] = {};
  TS_ASSERT_OK(store_->ReadRange("k", 3, 4, buffer));
  EXPECT_EQ(std::string_view(buffer, 4), "3456");
  TS_ASSERT_OK(store_->ReadRange("k", 6, 4, buffer));
  EXPECT_EQ(std::string_view(buffer, 4), "6789");
  TS_EXPECT_OK(store_->ReadRange("k", 10, 0, buffer));
  TS_EXPECT_OK(store_->ReadRange("k", 0, 0, nullptr));
}

TEST_P(KvStoreConformanceTest, ReadRangePastEndIsTruncated) {
  Put("dir/k", "0123456789");
  char buffer[16] = {};
  for (const auto& [offset, size] : std::vector<std::pair<uint64_t, size_t>>{
           {8, 4}, {10, 1}, {0, 11}, {11, 0}, {uint64_t{1} << 62, 4}, {~uint64_t{0}, 1}}) {
    const Status status = store_->ReadRange("dir/k", offset, size, buffer);
    EXPECT_TRUE(absl::IsDataLoss(status)) << offset << "+" << size << ": " << status;
    EXPECT_THAT(MessageOf(status), HasSubstr("truncated"));
    EXPECT_THAT(MessageOf(status), HasSubstr("dir/k"));
  }
}

TEST_P(KvStoreConformanceTest, Size) {
  Put("a/k", std::string(1234, 'z'));
  Put("a/empty", "");
  EXPECT_EQ(*store_->Size("a/k"), 1234u);
  EXPECT_EQ(*store_->Size("a/empty"), 0u);
}

TEST_P(KvStoreConformanceTest, MissingKeysAreNotFound) {
  Put("present/x", "1");
  char buffer[1];
  for (std::string_view key : {"missing", "present/missing", "missing/deeper/key"}) {
    SCOPED_TRACE(key);
    Status status = store_->Read(key).status();
    EXPECT_TRUE(absl::IsNotFound(status)) << status;
    EXPECT_THAT(MessageOf(status), HasSubstr(key));
    EXPECT_TRUE(absl::IsNotFound(store_->ReadRange(key, 0, 1, buffer)));
    EXPECT_TRUE(absl::IsNotFound(store_->ReadRange(key, 0, 0, buffer)));
    EXPECT_TRUE(absl::IsNotFound(store_->Size(key).status()));
    EXPECT_TRUE(absl::IsNotFound(store_->OpenForRead(key).status()));
    EXPECT_TRUE(absl::IsNotFound(store_->Delete(key)));
    EXPECT_TRUE(absl::IsNotFound(store_->Sync(key)));
  }
  // A key below an object is not there either.
  EXPECT_TRUE(absl::IsNotFound(store_->Read("present/x/y").status()));
}

TEST_P(KvStoreConformanceTest, DirectoryIsNotAnObject) {
  Put("dir/sub/k", "v");
  char buffer[1];
  for (std::string_view key : {"dir", "dir/sub"}) {
    SCOPED_TRACE(key);
    EXPECT_TRUE(absl::IsNotFound(store_->Read(key).status()));
    EXPECT_TRUE(absl::IsNotFound(store_->ReadRange(key, 0, 1, buffer)));
    EXPECT_TRUE(absl::IsNotFound(store_->Size(key).status()));
    EXPECT_TRUE(absl::IsNotFound(store_->OpenForRead(key).status()));
    EXPECT_TRUE(absl::IsNotFound(store_->Delete(key)));
    EXPECT_TRUE(absl::IsNotFound(store_->Sync(key)));
    // Nor can it become one while it holds keys (an object store has no directories).
    if (store_->Capabilities().object_store) continue;
    Status status = store_->Write(key, "x");
    EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;
    EXPECT_THAT(MessageOf(status), HasSubstr(key));
    EXPECT_TRUE(absl::IsFailedPrecondition(store_->OpenForWrite(key).status()));
  }
  EXPECT_EQ(Get("dir/sub/k"), "v");
}

TEST_P(KvStoreConformanceTest, NoKeyBelowAnObject) {
  Put("obj", "v");
  if (store_->Capabilities().object_store) {  // no directories: both are objects
    Put("obj/child", "x");
    EXPECT_EQ(Get("obj"), "v");
    EXPECT_EQ(Get("obj/child"), "x");
    return;
  }
  Status status = store_->Write("obj/child", "x");
  EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;
  EXPECT_THAT(MessageOf(status), HasSubstr("obj/child"));
  EXPECT_TRUE(absl::IsFailedPrecondition(store_->OpenForWrite("obj/a/b").status()));
  EXPECT_EQ(Get("obj"), "v");
}

TEST_P(KvStoreConformanceTest, OpenForWriteOutOfOrder) {
  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("d/e/f");
  TS_ASSERT_OK(file.status());
  TS_ASSERT_OK((*file)->WriteAt(6, "world", 5));
  TS_ASSERT_OK((*file)->WriteAt(0, "hello ", 6));
  TS_ASSERT_OK((*file)->Sync());
  TS_ASSERT_OK((*file)->Close());
  EXPECT_EQ(Get("d/e/f"), "hello world");
}

TEST_P(KvStoreConformanceTest, OpenForWriteGapReadsAsZeros) {
  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("gap");
  TS_ASSERT_OK(file.status());
  TS_ASSERT_OK((*file)->WriteAt(4, "x", 1));
  TS_ASSERT_OK((*file)->Close());
  EXPECT_EQ(Get("gap"), std::string("\0\0\0\0x", 5));
}

TEST_P(KvStoreConformanceTest, OpenForWriteIsVisibleBeforeClose) {
  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("live");
  TS_ASSERT_OK(file.status());
  if (store_->Capabilities().object_store) {  // the object appears whole, at Sync
    TS_ASSERT_OK((*file)->WriteAt(0, "abc", 3));
    EXPECT_TRUE(absl::IsNotFound(store_->Size("live").status()));
    TS_ASSERT_OK((*file)->Sync());
    EXPECT_EQ(Get("live"), "abc");
    return;
  }
  EXPECT_EQ(Get("live"), "");
  TS_ASSERT_OK((*file)->WriteAt(0, "abc", 3));
  EXPECT_EQ(Get("live"), "abc");
}

TEST_P(KvStoreConformanceTest, OpenForWriteTruncatesExisting) {
  Put("k", "old contents");
  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("k");
  TS_ASSERT_OK(file.status());
  TS_ASSERT_OK((*file)->WriteAt(0, "new", 3));
  TS_ASSERT_OK((*file)->Close());
  EXPECT_EQ(Get("k"), "new");
}

TEST_P(KvStoreConformanceTest, ClosedWritableFileIsFailedPrecondition) {
  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("k");
  TS_ASSERT_OK(file.status());
  TS_ASSERT_OK((*file)->Close());
  EXPECT_TRUE(absl::IsFailedPrecondition((*file)->WriteAt(0, "x", 1)));
  EXPECT_TRUE(absl::IsFailedPrecondition((*file)->Sync()));
  EXPECT_TRUE(absl::IsFailedPrecondition((*file)->Close()));
  // Destroying an open file closes it; the bytes stay.
  file = store_->OpenForWrite("k2");
  TS_ASSERT_OK(file.status());
  TS_ASSERT_OK((*file)->WriteAt(0, "kept", 4));
  file = absl::UnknownError("dropped");
  EXPECT_EQ(Get("k2"), "kept");
}

TEST_P(KvStoreConformanceTest, StartWritebackKeepsTheBytesAndTheFileOpen) {
  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("wb");
  TS_ASSERT_OK(file.status());
  const std::string first = Pattern(3 << 20, 1);
  const std::string second = Pattern(1 << 20, 2);
  TS_ASSERT_OK((*file)->WriteAt(0, first.data(), first.size()));
  TS_ASSERT_OK((*file)->StartWriteback());
  TS_ASSERT_OK((*file)->StartWriteback());  // nothing new to start: still OK
  TS_ASSERT_OK((*file)->WriteAt(first.size(), second.data(), second.size()));
  TS_ASSERT_OK((*file)->StartWriteback());
  TS_ASSERT_OK((*file)->Sync());
  TS_ASSERT_OK((*file)->Close());
  EXPECT_EQ(Get("wb"), first + second);
}

// Writes of every shape after PreferDirectWrites(), from several threads: large ones that start
// on a block boundary or not, end on one or not, from aligned memory or not, and small ones
// sharing blocks with them. Every byte must be as written.
TEST_P(KvStoreConformanceTest, PreferDirectWritesKeepsEveryByte) {
  constexpr size_t kMiB = size_t{1} << 20;
  struct Piece {
    size_t offset, size, source;  // source: offset into `from` (0: page-aligned in `aligned`)
  };
  const std::vector<Piece> pieces = {
      {0, 2 * kMiB, 1},                       // aligned start and end, unaligned source
      {2 * kMiB, 100, 5},                     // small, shares a block with the next
      {2 * kMiB + 100, kMiB + 3000, 7},       // unaligned start and end
      {3 * kMiB + 3100, 50, 0},               // small, in the previous piece's last block
      {3 * kMiB + 3150, 946, 3},              // fills that block up to the boundary
      {3 * kMiB + 4096, 5 * kMiB + 17, 0},    // aligned start, unaligned end, aligned source
      {8 * kMiB + 4113, 2 * kMiB - 4113, 9},  // unaligned start, aligned end
      {10 * kMiB, kMiB / 2, 11},              // below the direct threshold
      {10 * kMiB + kMiB / 2, 6 * kMiB, 0},    // large, aligned everything
  };
  const size_t total = 16 * kMiB + kMiB / 2;
  const std::string expected = Pattern(total, 12);
  // Sources: `from` holds the expected bytes at an odd shift; `aligned`, page-aligned ones.
  const std::string from = std::string(13, 'x') + expected;
  StagingBuffer aligned(total);
  std::memcpy(aligned.data(), expected.data(), total);

  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("direct");
  TS_ASSERT_OK(file.status());
  WritableFile* writable = file->get();
  writable->PreferDirectWrites();
  writable->PreferDirectWrites();  // twice: no effect
  std::vector<std::thread> threads;
  std::vector<Status> results(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    threads.emplace_back([&, i] {
      const Piece& p = pieces[i];
      const char* source = p.source == 0 ? aligned.data() + p.offset : from.data() + 13 + p.offset;
      results[i] = writable->WriteAt(p.offset, source, p.size);
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const Status& status : results) TS_EXPECT_OK(status);
  TS_ASSERT_OK(writable->Sync());
  TS_ASSERT_OK(writable->Close());
  const std::string got = Get("direct");
  ASSERT_EQ(got.size(), expected.size());
  EXPECT_TRUE(got == expected) << "first difference at byte "
                               << std::mismatch(got.begin(), got.end(), expected.begin()).first -
                                      got.begin();
}

TEST_P(KvStoreConformanceTest, ConcurrentWriteAtFromSeveralThreads) {
  constexpr size_t kChunk = 64 << 10;
  constexpr int kThreads = 8;
  constexpr int kChunksPerThread = 8;
  const std::string expected = Pattern(kChunk * kThreads * kChunksPerThread, 7);
  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("chunks/all");
  TS_ASSERT_OK(file.status());
  WritableFile* writable = file->get();
  std::vector<std::thread> threads;
  std::vector<Status> results(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Thread t writes chunks t, t + kThreads, ..., last first.
      for (int i = kChunksPerThread - 1; i >= 0; --i) {
        const size_t offset = (static_cast<size_t>(i) * kThreads + t) * kChunk;
        Status status = writable->WriteAt(offset, expected.data() + offset, kChunk);
        if (!status.ok()) results[t] = status;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const Status& status : results) TS_EXPECT_OK(status);
  TS_ASSERT_OK(writable->Sync());
  TS_ASSERT_OK(writable->Close());
  EXPECT_TRUE(Get("chunks/all") == expected);
  TS_EXPECT_OK(store_->Sync("chunks/all"));
}

TEST_P(KvStoreConformanceTest, ConcurrentWritesIntoNewDirectories) {
  constexpr int kThreads = 8;
  std::vector<std::thread> threads;
  std::vector<Status> results(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        const std::string key = "new/dir" + std::to_string(i) + "/k" + std::to_string(t);
        Status status = store_->Write(key, key);
        if (status.ok()) status = store_->Sync(key);
        if (status.ok()) status = store_->Read(key).status();
        if (!status.ok()) results[t] = status;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const Status& status : results) TS_EXPECT_OK(status);
  EXPECT_EQ(ListOrDie("new/").size(), 20u * kThreads);
}

TEST_P(KvStoreConformanceTest, OpenForReadAndReadAt) {
  const std::string value = Pattern(100000, 3);
  Put("r/k", value);
  Result<std::unique_ptr<ReadableFile>> file = store_->OpenForRead("r/k");
  TS_ASSERT_OK(file.status());
  EXPECT_EQ((*file)->size(), value.size());
  std::string buffer(1000, '\0');
  TS_ASSERT_OK((*file)->ReadAt(5000, 1000, buffer.data()));
  EXPECT_EQ(buffer, value.substr(5000, 1000));
  TS_ASSERT_OK((*file)->ReadAt(value.size() - 1000, 1000, buffer.data()));
  EXPECT_EQ(buffer, value.substr(value.size() - 1000));
  TS_EXPECT_OK((*file)->ReadAt(value.size(), 0, buffer.data()));

  Status status = (*file)->ReadAt(value.size() - 10, 11, buffer.data());
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_THAT(MessageOf(status), HasSubstr("truncated"));
  EXPECT_THAT(MessageOf(status), HasSubstr("r/k"));

  // Several threads may read one file at once.
  const std::vector<int> mismatches = ConcurrentReadMismatches(**file, value);
  EXPECT_THAT(mismatches, ElementsAre(0, 0, 0, 0));
}

TEST_P(KvStoreConformanceTest, ReadableFileKeepsOldObjectAfterWrite) {
  Put("k", "first");
  Result<std::unique_ptr<ReadableFile>> file = store_->OpenForRead("k");
  TS_ASSERT_OK(file.status());
  Put("k", "second!");
  char buffer[5];
  if (store_->Capabilities().object_store) {  // the old version is gone: an error, not new bytes
    EXPECT_TRUE(absl::IsFailedPrecondition((*file)->ReadAt(0, 5, buffer)));
    EXPECT_EQ(Get("k"), "second!");
    return;
  }
  TS_ASSERT_OK((*file)->ReadAt(0, 5, buffer));
  EXPECT_EQ(std::string_view(buffer, 5), "first");
  EXPECT_EQ(Get("k"), "second!");
}

TEST_P(KvStoreConformanceTest, ListEverythingSorted) {
  PutTree();
  EXPECT_THAT(ListOrDie(""), ElementsAre("a/b1", "a/b2/x", "a/b2/y/z", "a/c", "ab", "b"));
}

TEST_P(KvStoreConformanceTest, ListDirectoryPrefix) {
  PutTree();
  EXPECT_THAT(ListOrDie("a/"), ElementsAre("a/b1", "a/b2/x", "a/b2/y/z", "a/c"));
  EXPECT_THAT(ListOrDie("a/b2/"), ElementsAre("a/b2/x", "a/b2/y/z"));
  EXPECT_THAT(ListOrDie("a/b2/y/"), ElementsAre("a/b2/y/z"));
}

TEST_P(KvStoreConformanceTest, ListPrefixThatIsNotADirectoryBoundary) {
  PutTree();
  EXPECT_THAT(ListOrDie("a"), ElementsAre("a/b1", "a/b2/x", "a/b2/y/z", "a/c", "ab"));
  EXPECT_THAT(ListOrDie("a/b"), ElementsAre("a/b1", "a/b2/x", "a/b2/y/z"));
  EXPECT_THAT(ListOrDie("a/b2"), ElementsAre("a/b2/x", "a/b2/y/z"));
  EXPECT_THAT(ListOrDie("a/b2/y/z"), ElementsAre("a/b2/y/z"));
  EXPECT_THAT(ListOrDie("a/c"), ElementsAre("a/c"));
}

TEST_P(KvStoreConformanceTest, ListNothingMatches) {
  PutTree();
  EXPECT_THAT(ListOrDie("zz"), IsEmpty());
  EXPECT_THAT(ListOrDie("zz/"), IsEmpty());
  EXPECT_THAT(ListOrDie("a/b1/"), IsEmpty());  // An object, not a directory.
  EXPECT_THAT(ListOrDie("a/q/r/"), IsEmpty());
}

TEST_P(KvStoreConformanceTest, ListShowsObjectsBeingWritten) {
  PutTree();
  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("a/open");
  TS_ASSERT_OK(file.status());
  if (store_->Capabilities().object_store) {  // listed once it is whole
    EXPECT_THAT(ListOrDie("a/o"), IsEmpty());
    TS_ASSERT_OK((*file)->Close());
  }
  EXPECT_THAT(ListOrDie("a/o"), ElementsAre("a/open"));
}

TEST_P(KvStoreConformanceTest, Delete) {
  PutTree();
  TS_ASSERT_OK(store_->Delete("a/b1"));
  EXPECT_TRUE(absl::IsNotFound(store_->Read("a/b1").status()));
  EXPECT_TRUE(absl::IsNotFound(store_->Delete("a/b1")));
  TS_ASSERT_OK(store_->Delete("b"));
  EXPECT_THAT(ListOrDie(""), ElementsAre("a/b2/x", "a/b2/y/z", "a/c", "ab"));
}

TEST_P(KvStoreConformanceTest, DeletePrefixThatIsNotADirectoryBoundary) {
  PutTree();
  TS_ASSERT_OK(store_->DeletePrefix("a/b"));
  EXPECT_THAT(ListOrDie(""), ElementsAre("a/c", "ab", "b"));
  TS_ASSERT_OK(store_->DeletePrefix("a"));
  EXPECT_THAT(ListOrDie(""), ElementsAre("b"));
}

TEST_P(KvStoreConformanceTest, DeletePrefixDirectory) {
  PutTree();
  TS_ASSERT_OK(store_->DeletePrefix("a/b2/"));
  EXPECT_THAT(ListOrDie(""), ElementsAre("a/b1", "a/c", "ab", "b"));
  TS_ASSERT_OK(store_->DeletePrefix("a/"));
  EXPECT_THAT(ListOrDie(""), ElementsAre("ab", "b"));
  // "a" is gone, so it can now hold an object.
  Put("a", "object");
  EXPECT_EQ(Get("a"), "object");
}

TEST_P(KvStoreConformanceTest, DeletePrefixDoesNotTouchAnObjectNamedLikeTheDirectory) {
  PutTree();
  TS_ASSERT_OK(store_->DeletePrefix("a/b1/"));
  TS_ASSERT_OK(store_->DeletePrefix("b/"));
  EXPECT_THAT(ListOrDie(""), ElementsAre("a/b1", "a/b2/x", "a/b2/y/z", "a/c", "ab", "b"));
}

TEST_P(KvStoreConformanceTest, DeletePrefixMissingIsOk) {
  PutTree();
  TS_EXPECT_OK(store_->DeletePrefix("missing/"));
  TS_EXPECT_OK(store_->DeletePrefix("missing"));
  TS_EXPECT_OK(store_->DeletePrefix("a/q/r/"));
  EXPECT_EQ(ListOrDie("").size(), 6u);
}

TEST_P(KvStoreConformanceTest, DeletePrefixEverything) {
  PutTree();
  TS_ASSERT_OK(store_->DeletePrefix(""));
  EXPECT_THAT(ListOrDie(""), IsEmpty());
  Put("again", "v");
  EXPECT_THAT(ListOrDie(""), ElementsAre("again"));
}

TEST_P(KvStoreConformanceTest, RenameDirectory) {
  Put("steps/tmp.1/x", "x");
  Put("steps/tmp.1/y/z", "z");
  Put("steps/tmp.10/other", "o");
  if (!store_->SupportsRename()) {
    Status status = store_->RenameDirectory("steps/tmp.1", "steps/1");
    EXPECT_TRUE(absl::IsUnimplemented(status)) << status;
    EXPECT_THAT(ListOrDie(""),
                ElementsAre("steps/tmp.1/x", "steps/tmp.1/y/z", "steps/tmp.10/other"));
    return;
  }
  TS_ASSERT_OK(store_->RenameDirectory("steps/tmp.1", "steps/1"));
  EXPECT_THAT(ListOrDie(""), ElementsAre("steps/1/x", "steps/1/y/z", "steps/tmp.10/other"));
  EXPECT_EQ(Get("steps/1/y/z"), "z");
  EXPECT_TRUE(absl::IsNotFound(store_->Read("steps/tmp.1/x").status()));
  // The target's parents are created.
  TS_ASSERT_OK(store_->RenameDirectory("steps/1", "archive/2024/1"));
  EXPECT_THAT(ListOrDie("archive/"), ElementsAre("archive/2024/1/x", "archive/2024/1/y/z"));
  TS_EXPECT_OK(store_->SyncDirectory("archive/2024"));
}

TEST_P(KvStoreConformanceTest, ExchangeDirectoriesSwapsOrIsUnimplemented) {
  Put("a/x", "from a");
  Put("b/y/z", "from b");
  Status status = store_->ExchangeDirectories("a", "b");
  if (absl::IsUnimplemented(status)) {
    EXPECT_THAT(ListOrDie(""), ElementsAre("a/x", "b/y/z"));
    return;
  }
  TS_ASSERT_OK(status);
  EXPECT_THAT(ListOrDie(""), ElementsAre("a/y/z", "b/x"));
  EXPECT_EQ(Get("b/x"), "from a");
  EXPECT_TRUE(absl::IsNotFound(store_->ExchangeDirectories("a", "missing")));
}

TEST_P(KvStoreConformanceTest, FolderViewReadsTheFolderAndRefusesWrites) {
  Put("step/COMMIT", "c1");
  Put("step/state/index", "i1");
  Put("other/x", "x");
  Result<std::unique_ptr<KvStore>> view = store_->OpenFolderView("step");
  TS_ASSERT_OK(view.status());
  EXPECT_EQ((*view)->Read("step/COMMIT").value(), "c1");
  EXPECT_EQ((*view)->Size("step/state/index").value(), 2u);
  EXPECT_THAT((*view)->List("step/").value(), ElementsAre("step/COMMIT", "step/state/index"));
  EXPECT_TRUE(absl::IsInvalidArgument((*view)->Read("other/x").status()));
  EXPECT_TRUE(absl::IsFailedPrecondition((*view)->Write("step/new", "n")));
  EXPECT_TRUE(absl::IsFailedPrecondition((*view)->DeletePrefix("step/")));
  const Status refused = (*view)->Write("step/new", "n");
  EXPECT_THAT(MessageOf(refused), HasSubstr("write 'step/new' failed: a folder view is read-only"));
  EXPECT_TRUE(absl::IsFailedPrecondition((*view)->TryLock("step/LOCK").status()));
  // A pinning store keeps showing the folder it opened after another one takes its name.
  if (!store_->SupportsRename()) return;
  Put("new/COMMIT", "c2");
  Put("new/state/index", "i2");
  TS_ASSERT_OK(store_->RenameDirectory("step", "old"));
  TS_ASSERT_OK(store_->RenameDirectory("new", "step"));
  const std::string seen = (*view)->Read("step/COMMIT").value();
  EXPECT_TRUE(seen == "c1" || seen == "c2") << seen;  // "c1" where the store pins
}

TEST_P(KvStoreConformanceTest, CapabilitiesAgreeWithTheStore) {
  const KvStoreCapabilities capabilities = store_->Capabilities();
  EXPECT_EQ(capabilities.rename, store_->SupportsRename());
  Put("a/x", "1");
  Put("b/y", "2");
  if (capabilities.exchange) {
    TS_EXPECT_OK(store_->ExchangeDirectories("a", "b"));
  }
  if (capabilities.conditional_write) {
    TS_EXPECT_OK(store_->WriteIfAbsent("c", "3"));
  }
  if (capabilities.generations) {
    TS_EXPECT_OK(store_->Stat("b/x").status().ok() ? OkStatus() : store_->Stat("a/x").status());
  }
}

TEST_P(KvStoreConformanceTest, ListChildrenGivesKeysAndSubfoldersOneLevelDown) {
  Put("root/COMMIT", "c");
  Put("root/0001/state/index", "i");
  Put("root/0001/COMMIT", "c");
  Put("root/0002/x", "x");
  Put("root.other/y", "y");
  Result<ListedChildren> children = store_->ListChildren("root/");
  TS_ASSERT_OK(children.status());
  EXPECT_THAT(children->keys, ElementsAre("root/COMMIT"));
  EXPECT_THAT(children->prefixes, ElementsAre("root/0001/", "root/0002/"));
  children = store_->ListChildren("");
  TS_ASSERT_OK(children.status());
  EXPECT_THAT(children->keys, IsEmpty());
  EXPECT_THAT(children->prefixes, ElementsAre("root.other/", "root/"));
  EXPECT_THAT(store_->ListChildren("missing/").value().keys, IsEmpty());
}

TEST_P(KvStoreConformanceTest, StatGenerationsChangeWhenAnObjectIsReplaced) {
  if (!store_->Capabilities().generations) {
    EXPECT_TRUE(absl::IsUnimplemented(store_->Stat("k").status()));
    return;
  }
  EXPECT_TRUE(absl::IsNotFound(store_->Stat("k").status()));
  Put("k", "first");
  const ObjectInfo first = store_->Stat("k").value();
  EXPECT_EQ(first.size, 5u);
  EXPECT_FALSE(first.generation.empty());
  EXPECT_EQ(store_->Stat("k").value().generation, first.generation);  // stable while unchanged
  char buf[3] = {};
  TS_EXPECT_OK(store_->ReadRangeAtGeneration("k", first.generation, 1, 3, buf));
  EXPECT_EQ(std::string(buf, 3), "irs");
  EXPECT_TRUE(absl::IsDataLoss(store_->ReadRangeAtGeneration("k", first.generation, 3, 5, buf)));
  Put("k", "other");  // the same size, replaced
  const ObjectInfo second = store_->Stat("k").value();
  EXPECT_NE(second.generation, first.generation);
  const Status stale = store_->ReadRangeAtGeneration("k", first.generation, 0, 3, buf);
  EXPECT_TRUE(absl::IsFailedPrecondition(stale)) << stale;
  EXPECT_THAT(stale.message(), HasSubstr("k"));
  TS_ASSERT_OK(store_->Delete("k"));
  EXPECT_TRUE(absl::IsNotFound(store_->ReadRangeAtGeneration("k", second.generation, 0, 1, buf)));
}

TEST_P(KvStoreConformanceTest, WriteIfAbsentCreatesOnlyOnce) {
  if (!store_->Capabilities().conditional_write) {
    EXPECT_TRUE(absl::IsUnimplemented(store_->WriteIfAbsent("k", "v")));
    return;
  }
  TS_ASSERT_OK(store_->WriteIfAbsent("dir/k", "first"));
  const Status again = store_->WriteIfAbsent("dir/k", "second");
  EXPECT_TRUE(absl::IsAlreadyExists(again)) << again;
  EXPECT_EQ(Get("dir/k"), "first");
  EXPECT_THAT(ListOrDie("dir/"), ElementsAre("dir/k"));  // no temporary left behind
  // Of several writers at once, exactly one wins.
  constexpr int kWriters = 8;
  std::atomic<int> won{0};
  std::vector<std::thread> writers;
  for (int i = 0; i < kWriters; ++i) {
    writers.emplace_back([&, i] {
      if (store_->WriteIfAbsent("race", StrCat("writer ", i)).ok()) ++won;
    });
  }
  for (std::thread& writer : writers) writer.join();
  EXPECT_EQ(won.load(), 1);
  EXPECT_THAT(Get("race"), HasSubstr("writer "));
}

TEST_P(KvStoreConformanceTest, RenameDirectoryErrors) {
  Put("u/1", "u");
  Put("v/1", "v");
  Put("obj", "o");
  if (!store_->SupportsRename()) {
    EXPECT_TRUE(absl::IsUnimplemented(store_->RenameDirectory("u", "w")));
    return;
  }
  Status status = store_->RenameDirectory("u", "v");
  EXPECT_TRUE(absl::IsAlreadyExists(status)) << status;
  EXPECT_THAT(MessageOf(status), HasSubstr("v"));
  EXPECT_TRUE(absl::IsAlreadyExists(store_->RenameDirectory("u", "obj")));
  EXPECT_TRUE(absl::IsAlreadyExists(store_->RenameDirectory("u", "u")));
  status = store_->RenameDirectory("missing", "w");
  EXPECT_TRUE(absl::IsNotFound(status)) << status;
  EXPECT_THAT(MessageOf(status), HasSubstr("missing"));
  EXPECT_TRUE(absl::IsNotFound(store_->RenameDirectory("obj", "w")));
  EXPECT_TRUE(absl::IsInvalidArgument(store_->RenameDirectory("u", "u/inner")));
  EXPECT_TRUE(absl::IsFailedPrecondition(store_->RenameDirectory("u", "obj/inner")));
  EXPECT_THAT(ListOrDie(""), ElementsAre("obj", "u/1", "v/1"));
  EXPECT_EQ(Get("v/1"), "v");
}

TEST_P(KvStoreConformanceTest, OpenFilesSurviveRename) {
  if (!store_->SupportsRename()) GTEST_SKIP() << "store has no RenameDirectory";
  Result<std::unique_ptr<WritableFile>> file = store_->OpenForWrite("tmp/data");
  TS_ASSERT_OK(file.status());
  TS_ASSERT_OK((*file)->WriteAt(0, "before", 6));
  TS_ASSERT_OK(store_->RenameDirectory("tmp", "final"));
  TS_ASSERT_OK((*file)->WriteAt(6, "+after", 6));
  TS_ASSERT_OK((*file)->Close());
  EXPECT_EQ(Get("final/data"), "before+after");
}

TEST_P(KvStoreConformanceTest, Sync) {
  Put("s/k", "v");
  TS_EXPECT_OK(store_->Sync("s/k"));
  TS_EXPECT_OK(store_->SyncDirectory(""));
  TS_EXPECT_OK(store_->SyncDirectory("s"));
  TS_EXPECT_OK(store_->SyncDirectory("s/"));
  EXPECT_TRUE(absl::IsNotFound(store_->Sync("s/missing")));
  EXPECT_TRUE(absl::IsNotFound(store_->SyncDirectory("never")));
  EXPECT_TRUE(absl::IsNotFound(store_->SyncDirectory("never/")));
}

std::vector<std::string> InvalidKeys() {
  return {"",
          "/abs",
          "a//b",
          "a/./b",
          "./a",
          "../x",
          "a/..",
          "..",
          ".",
          std::string("a\0b", 3),
          "a/",
          "/",
          std::string(4097, 'k'),
          "a/" + std::string(256, 's')};
}

// Invalid prefixes: the invalid keys, less "" and a trailing '/', which name directories.
std::vector<std::string> InvalidPrefixes() {
  return {"/abs",
          "a//b",
          "a/./b",
          "./a",
          "../x",
          "a/..",
          "..",
          ".",
          "/",
          "a//",
          "../",
          "a/../",
          std::string("a\0b", 3),
          std::string(4097, 'k')};
}

TEST_P(KvStoreConformanceTest, InvalidKeysAreRejectedByEveryMethod) {
  Put("valid/k", "v");
  char buffer[1];
  for (const std::string& key : InvalidKeys()) {
    SCOPED_TRACE(testing::PrintToString(key));
    EXPECT_TRUE(absl::IsInvalidArgument(ValidateKey(key)));
    const Status status = store_->Read(key).status();
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
    EXPECT_TRUE(absl::IsInvalidArgument(store_->ReadRange(key, 0, 1, buffer)));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->Size(key).status()));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->OpenForRead(key).status()));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->Write(key, "x")));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->OpenForWrite(key).status()));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->Delete(key)));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->Sync(key)));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->RenameDirectory(key, "valid2")));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->RenameDirectory("valid", key)));
  }
  for (const std::string& prefix : InvalidPrefixes()) {
    SCOPED_TRACE(testing::PrintToString(prefix));
    EXPECT_TRUE(absl::IsInvalidArgument(ValidatePrefix(prefix)));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->List(prefix).status()));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->DeletePrefix(prefix)));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->SyncDirectory(prefix)));
  }
  // Nothing was created or removed.
  EXPECT_THAT(ListOrDie(""), ElementsAre("valid/k"));
}

TEST_P(KvStoreConformanceTest, InvalidKeyMessageQuotesTheKey) {
  Status status = store_->Read("a//b").status();
  EXPECT_THAT(MessageOf(status), HasSubstr("\"a//b\""));
  EXPECT_THAT(MessageOf(status), HasSubstr("empty segment"));
  status = store_->Read(std::string("a\0b", 3)).status();
  EXPECT_THAT(MessageOf(status), HasSubstr("\"a\\x00b\""));
}

TEST_P(KvStoreConformanceTest, ValidPrefixesAndKeys) {
  for (std::string_view prefix : {"", "a", "a/", "a/b", "a/b/", "a.b/..c", "...", ".hidden/"}) {
    TS_EXPECT_OK(ValidatePrefix(prefix)) << prefix;
    TS_EXPECT_OK(store_->List(prefix).status()) << prefix;
  }
  for (std::string_view key : {"a", "a/b", "...", ".hidden", "a/.b", "a b/c\td"}) {
    TS_EXPECT_OK(ValidateKey(key)) << key;
  }
}

TEST_P(KvStoreConformanceTest, TryLockIsExclusiveUntilReleased) {
  Result<std::unique_ptr<KvLock>> first = store_->TryLock("LOCK");
  TS_ASSERT_OK(first.status());
  Result<std::unique_ptr<KvLock>> second = store_->TryLock("LOCK");
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), HasSubstr("locked by another manager"));
  // Another key is independent.
  Result<std::unique_ptr<KvLock>> other = store_->TryLock("run1/LOCK");
  TS_EXPECT_OK(other.status());

  first->reset();
  Result<std::unique_ptr<KvLock>> again = store_->TryLock("LOCK");
  TS_EXPECT_OK(again.status());
}

TEST_P(KvStoreConformanceTest, TryLockRejectsInvalidKeys) {
  EXPECT_EQ(store_->TryLock("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->TryLock("a/../b").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tensorstash
