// DataFileSet: placement, early writeback, and the side-by-side syncs of Finish.
#include "tensorstash/engine/data_file_set.h"

#include <stdlib.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/fault_injection_kvstore.h"
#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/testing/status_test_macros.h"
#include "tensorstash/util/crc32c.h"

namespace tensorstash {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string Bytes(size_t size, char seed) {
  std::string s(size, '\0');
  for (size_t i = 0; i < size; ++i) s[i] = static_cast<char>(seed + i * 7);
  return s;
}

// Writes `chunks` chunks of `chunk_bytes` over `lanes` lanes from 4 threads, finishes with
// sync on a pool, and returns what Finish reported (files) or its error.
struct Written {
  std::vector<std::vector<DataFileSet::Location>> where;  // per chunk
  std::vector<std::string> data;
};

Status WriteAll(DataFileSet* files, int chunks, size_t chunk_bytes, int lanes, Written* out) {
  out->data.clear();
  out->where.assign(chunks, {});
  for (int i = 0; i < chunks; ++i) {
    out->data.push_back(Bytes(chunk_bytes, static_cast<char>(i)));
    TS_ASSIGN_OR_RETURN(DataFileSet::Location loc, files->Allocate(chunk_bytes, i % lanes));
    out->where[i].push_back(loc);
  }
  std::vector<Status> results(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < chunks; i += 4) {
        Status s = files->Write(out->where[i][0], out->data[i].data(), out->data[i].size());
        if (!s.ok() && results[t].ok()) results[t] = s;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (const Status& s : results) TS_RETURN_IF_ERROR(s);
  return OkStatus();
}

// Writes `chunks` chunks of `chunk_bytes` into files rolled every `file_bytes` over 3 lanes,
// starting writeback after every byte, finishes with parallel syncs and reads every chunk back.
void WriteSyncAndReadBack(int chunks, size_t chunk_bytes, uint64_t file_bytes, bool direct) {
  std::string dir = ::testing::TempDir() + "data_file_set_XXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr) << std::strerror(errno);
  Result<std::unique_ptr<FileKvStore>> kv = FileKvStore::Open(dir);
  TS_ASSERT_OK(kv.status());
  DataFileSet files(kv->get(), "item", /*process_index=*/0, file_bytes, /*lanes=*/3,
                    /*writeback_bytes=*/1, direct);
  Written written;
  TS_ASSERT_OK(WriteAll(&files, chunks, chunk_bytes, 3, &written));
  ThreadPool pool(4);
  std::vector<DataFileInfo> infos;
  TS_ASSERT_OK(files.Finish(/*sync=*/true, &infos, &pool));
  ASSERT_GT(infos.size(), 3u);
  for (size_t i = 0; i < written.data.size(); ++i) {
    const DataFileSet::Location& loc = written.where[i][0];
    std::string back(written.data[i].size(), '\0');
    TS_ASSERT_OK((*kv)->ReadRange(StrCat("item/", infos[loc.file_id].name), loc.offset, back.size(),
                                  back.data()));
    EXPECT_EQ(back, written.data[i]) << "chunk " << i;
  }
  // Finished: no second Finish, no more writes.
  EXPECT_TRUE(absl::IsFailedPrecondition(files.Finish(true, &infos, &pool)));
  EXPECT_FALSE(files.Write(written.where[0][0], "x", 1).ok());
  kv->reset();
  fs::remove_all(dir);
}

// An object store (as far as DataFileSet can tell) that counts the bytes written into files.
class CountingObjectStore final : public ForwardingKvStore {
 public:
  explicit CountingObjectStore(KvStore* base, uint64_t one_request_below = 0)
      : ForwardingKvStore(base), one_request_below_(one_request_below) {}
  KvStoreCapabilities Capabilities() const override {
    KvStoreCapabilities caps = ForwardingKvStore::Capabilities();
    caps.object_store = true;
    caps.one_request_below = one_request_below_;
    return caps;
  }
  Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view key) override {
    TS_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, ForwardingKvStore::OpenForWrite(key));
    return std::unique_ptr<WritableFile>(new Counting(std::move(file), this));
  }
  std::atomic<uint64_t> written{0};
  std::atomic<int> closed{0};
  struct ChunkWrite {
    uint64_t offset;
    size_t size;
    uint32_t crc;
    bool borrowed;
    bool crc_matches;  // the CRC given is the bytes' own
  };
  std::mutex mu;
  std::vector<ChunkWrite> chunk_writes;  // guarded by mu

 private:
  class Counting final : public WritableFile {
   public:
    Counting(std::unique_ptr<WritableFile> base, CountingObjectStore* store)
        : base_(std::move(base)), store_(store) {}
    Status WriteAt(uint64_t offset, const void* data, size_t size) override {
      store_->written += size;
      return base_->WriteAt(offset, data, size);
    }
    Status WriteChunkAt(uint64_t offset, const void* data, size_t size, uint32_t crc32c,
                        bool borrowed) override {
      store_->written += size;
      std::lock_guard<std::mutex> lock(store_->mu);
      store_->chunk_writes.push_back({offset, size, crc32c, borrowed,
                                      crc32c == Crc32c(data, size)});
      return base_->WriteChunkAt(offset, data, size, crc32c, borrowed);
    }
    Status Sync() override { return base_->Sync(); }
    Status Close() override {
      ++store_->closed;
      return base_->Close();
    }

   private:
    std::unique_ptr<WritableFile> base_;
    CountingObjectStore* store_;
  };
  const uint64_t one_request_below_;
};

// On an object store a file goes up in parts, each once all its bytes are written: the
// alignment padding between chunks is written too (zeros), so that no part waits for Sync.
TEST(DataFileSetTest, OnObjectStoresEveryByteOfAFileIsWrittenPaddingIncluded) {
  MemoryKvStore memory;
  CountingObjectStore kv(&memory);
  DataFileSet files(&kv, "item", /*process_index=*/0, /*target_file_bytes=*/uint64_t{1} << 30,
                    /*lanes=*/1, /*writeback_bytes=*/0, /*direct_writes=*/false);
  Written written;
  TS_ASSERT_OK(WriteAll(&files, /*chunks=*/9, /*chunk_bytes=*/70001, /*lanes=*/1, &written));
  ThreadPool pool(2);
  std::vector<DataFileInfo> infos;
  TS_ASSERT_OK(files.Finish(/*sync=*/true, &infos, &pool));
  ASSERT_EQ(infos.size(), 1u);
  EXPECT_EQ(kv.written.load(), infos[0].size);
  EXPECT_GT(infos[0].size, 9u * 70001);  // there was padding
  Result<std::string> bytes = memory.Read(StrCat("item/", infos[0].name));
  TS_ASSERT_OK(bytes.status());
  const uint64_t second = written.where[1][0].offset;
  EXPECT_EQ(bytes->substr(70001, second - 70001), std::string(second - 70001, '\0'));
}

// A chunk written with its CRC reaches the file through WriteChunkAt with that CRC and the
// caller's promise (borrowed or not); its padding too, as borrowed zeros with their own CRC.
// Without a CRC, plain writes.
TEST(DataFileSetTest, AChunksCrcAndBorrowingReachTheFile) {
  MemoryKvStore memory;
  CountingObjectStore kv(&memory);
  DataFileSet files(&kv, "item", /*process_index=*/0, /*target_file_bytes=*/uint64_t{1} << 30);
  const std::string first(70001, 'a');
  const std::string second(70001, 'b');
  Result<DataFileSet::Location> at1 = files.Allocate(first.size());
  Result<DataFileSet::Location> at2 = files.Allocate(second.size());
  Result<DataFileSet::Location> at3 = files.Allocate(3);
  TS_ASSERT_OK(at1.status());
  TS_ASSERT_OK(at2.status());
  TS_ASSERT_OK(at3.status());
  ASSERT_GT(at2->padding, 0u);
  TS_ASSERT_OK(files.Write(*at1, first.data(), first.size(), Crc32c(first), /*borrowed=*/false));
  TS_ASSERT_OK(files.Write(*at2, second.data(), second.size(), Crc32c(second), /*borrowed=*/true));
  TS_ASSERT_OK(files.Write(*at3, "xyz", 3));
  {
    std::lock_guard<std::mutex> lock(kv.mu);
    ASSERT_EQ(kv.chunk_writes.size(), 3u);
    EXPECT_EQ(kv.chunk_writes[0].offset, 0u);
    EXPECT_FALSE(kv.chunk_writes[0].borrowed);
    EXPECT_EQ(kv.chunk_writes[1].offset, at2->offset - at2->padding);  // the padding
    EXPECT_EQ(kv.chunk_writes[1].size, at2->padding);
    EXPECT_TRUE(kv.chunk_writes[1].borrowed);
    EXPECT_EQ(kv.chunk_writes[2].offset, at2->offset);
    EXPECT_TRUE(kv.chunk_writes[2].borrowed);
    for (const auto& w : kv.chunk_writes) EXPECT_TRUE(w.crc_matches) << w.offset;
  }
  std::vector<DataFileInfo> infos;
  TS_ASSERT_OK(files.Finish(/*sync=*/false, &infos));
  ASSERT_EQ(infos.size(), 1u);
  EXPECT_EQ(kv.written.load(), infos[0].size);
}

// On a store that sends small files in one request, every file stays below that size (but for a
// chunk that is larger on its own), and a file is closed (sent) as soon as it is rolled and
// wholly written, not at Finish: its bytes are not held until the end of the save.
TEST(DataFileSetTest, FilesStayBelowOneRequestAndCloseOnceWritten) {
  MemoryKvStore memory;
  constexpr uint64_t kOneRequest = 200000;
  CountingObjectStore kv(&memory, kOneRequest);
  DataFileSet files(&kv, "item", /*process_index=*/0, /*target_file_bytes=*/uint64_t{1} << 30,
                    /*lanes=*/2, /*writeback_bytes=*/0, /*direct_writes=*/false, kOneRequest);
  // Two chunks of 70001 bytes fit (the second on a page: 73728 + 70001); a third would not.
  Written written;
  TS_ASSERT_OK(WriteAll(&files, /*chunks=*/11, /*chunk_bytes=*/70001, /*lanes=*/2, &written));
  // Lane 0 took 6 chunks (3 files), lane 1 took 5 (3 files): the 4 rolled files are closed.
  EXPECT_EQ(kv.closed.load(), 4);
  Result<DataFileSet::Location> allocated = files.Allocate(kOneRequest * 2, 0);
  TS_ASSERT_OK(allocated.status());
  const DataFileSet::Location big = *allocated;
  const std::string big_bytes = Bytes(kOneRequest * 2, 'b');
  TS_ASSERT_OK(files.Write(big, big_bytes.data(), big_bytes.size()));
  EXPECT_EQ(big.offset, 0u);  // a chunk larger than one request starts a file of its own
  EXPECT_EQ(kv.closed.load(), 5);  // lane 0's last file was rolled (and written) by it
  std::vector<DataFileInfo> infos;
  TS_ASSERT_OK(files.Finish(/*sync=*/true, &infos));
  ASSERT_EQ(infos.size(), 7u);
  EXPECT_EQ(kv.closed.load(), 7);
  for (const DataFileInfo& info : infos) {
    if (info.size != kOneRequest * 2) {
      EXPECT_LT(info.size, kOneRequest) << info.name;
    }
  }
  for (size_t i = 0; i < written.data.size(); ++i) {
    const DataFileSet::Location& loc = written.where[i][0];
    Result<std::string> bytes = memory.Read(StrCat("item/", infos[loc.file_id].name));
    TS_ASSERT_OK(bytes.status());
    EXPECT_EQ(bytes->substr(loc.offset, written.data[i].size()), written.data[i]) << "chunk " << i;
  }
  Result<std::string> bytes = memory.Read(StrCat("item/", infos[big.file_id].name));
  TS_ASSERT_OK(bytes.status());
  EXPECT_EQ(*bytes, big_bytes);
}

// Where chunks go: large ones on a page, small ones on 64 bytes, and a chunk that continues the
// array of the chunk before it right after that chunk when it can, so that the array is one run.
TEST(DataFileSetTest, ChunksAreAlignedUnlessTheyContinueTheirArrayOnA64ByteBoundary) {
  MemoryKvStore kv;
  DataFileSet files(&kv, "item", /*process_index=*/0, /*target_file_bytes=*/uint64_t{1} << 30);
  auto at = [&](uint64_t length, bool continues) {
    Result<DataFileSet::Location> where = files.Allocate(length, 0, continues);
    EXPECT_TRUE(where.ok()) << where.status();
    return where.ok() ? where->offset : ~uint64_t{0};
  };
  EXPECT_EQ(at(100, false), 0u);                  // [0, 100)
  EXPECT_EQ(at(100, false), 128u);                // a new array: on 64 bytes
  EXPECT_EQ(at(128, true), 256u);                 // 228 is not on 64 bytes: padded all the same
  EXPECT_EQ(at(128, true), 384u);                 // right after: one run with the chunk before
  EXPECT_EQ(at(kAlignChunksFrom, true), 512u);    // large, yet continuing: still right after
  EXPECT_EQ(at(kAlignChunksFrom + 1, false), 4096u * 17);  // large, a new array: on a page
  EXPECT_EQ(at(64, true), 4096u * 33 + 64);       // after an odd end: padded to 64 bytes
  EXPECT_EQ(at(kAlignChunksFrom, true), 4096u * 33 + 128);  // continuing on 64 bytes
  EXPECT_EQ(at(1, false), 4096u * 49 + 128);      // small, a new array
  EXPECT_EQ(at(kAlignChunksFrom, true), 4096u * 50);  // continuing after an odd end: on a page
}

TEST(DataFileSetTest, WritebackAndParallelSyncKeepEveryByte) {
  // Files rolled every 256 KiB: many files, many writeback starts.
  WriteSyncAndReadBack(24, 100 << 10, 256 << 10, /*direct=*/false);
}

TEST(DataFileSetTest, DirectWritesKeepEveryByte) {
  // Chunks of 1 MiB + 300 bytes: each is written around the page cache but for its last,
  // partial block (the conformance suite covers blocks shared with other writes).
  WriteSyncAndReadBack(12, (1 << 20) + 300, 3 << 20, /*direct=*/true);
}

TEST(DataFileSetTest, ParallelSyncSurvivesACrashAndReportsAFailedSync) {
  MemoryKvStore memory;
  FaultInjectionKvStore kv(&memory);
  TS_ASSERT_OK(kv.StartDurabilityTracking());
  {
    DataFileSet files(&kv, "item", 0, 64 << 10, 2, /*writeback_bytes=*/4096);
    Written written;
    TS_ASSERT_OK(WriteAll(&files, 8, 48 << 10, 2, &written));
    ThreadPool pool(3);
    std::vector<DataFileInfo> infos;
    TS_ASSERT_OK(files.Finish(true, &infos, &pool));
    // Finish made the files and "item/data" durable; the folders above are the caller's.
    TS_ASSERT_OK(kv.SyncDirectory("item"));
    TS_ASSERT_OK(kv.SyncDirectory(""));
    TS_ASSERT_OK(kv.SimulateCrash());
    // Every synced byte survived the crash.
    for (size_t i = 0; i < written.data.size(); ++i) {
      const DataFileSet::Location& loc = written.where[i][0];
      std::string back(written.data[i].size(), '\0');
      TS_ASSERT_OK(kv.ReadRange(StrCat("item/", infos[loc.file_id].name), loc.offset, back.size(),
                                back.data()));
      EXPECT_EQ(back, written.data[i]) << "chunk " << i;
    }
  }
  // One file's sync fails: Finish says so, naming that file.
  FaultRule rule;
  rule.ops = Mask(KvOp::kFileSync);
  rule.key_substring = "0-1.dat";
  kv.AddRule(rule);
  DataFileSet files(&kv, "again", 0, 64 << 10, 2, 4096);
  Written written;
  TS_ASSERT_OK(WriteAll(&files, 8, 48 << 10, 2, &written));
  ThreadPool pool(3);
  std::vector<DataFileInfo> infos;
  Status finished = files.Finish(true, &infos, &pool);
  EXPECT_FALSE(finished.ok());
  EXPECT_THAT(std::string(finished.message()), HasSubstr("0-1.dat"));
}

}  // namespace
}  // namespace tensorstash
