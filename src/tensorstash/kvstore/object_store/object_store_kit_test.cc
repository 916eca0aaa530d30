// The object-store kit (request slots, retries, the part uploader, the lease, the credential
// cache) against fakes and the memory store; the S3 driver built from it runs against real
// servers in kvstore/s3/s3_kvstore_server_test.cc.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/kvstore/object_store/credentials.h"
#include "tensorstash/kvstore/object_store/driver_options.h"
#include "tensorstash/kvstore/object_store/lease.h"
#include "tensorstash/kvstore/object_store/part_uploader.h"
#include "tensorstash/kvstore/object_store/pinned_file.h"
#include "tensorstash/kvstore/object_store/probe.h"
#include "tensorstash/kvstore/object_store/ranged_read.h"
#include "tensorstash/kvstore/object_store/request_slots.h"
#include "tensorstash/kvstore/object_store/retry.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/kvstore/object_store/scoped_defaults.h"
#include "tensorstash/testing/status_test_macros.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

using std::chrono::milliseconds;

// --- Retries ---

RetryPolicy FastPolicy(int attempts) {
  return RetryPolicy{.max_attempts = attempts, .initial_backoff = milliseconds(0),
                     .max_backoff = milliseconds(0)};
}

// Outcomes are ints: 503 is retryable, anything else an answer.
const RetryClassifier<int> kRetry503 = [](const Result<int>& outcome) -> std::optional<Status> {
  if (!outcome.ok()) {
    if (absl::IsUnavailable(outcome.status())) return outcome.status();
    return std::nullopt;
  }
  if (*outcome == 503) return UnavailableError("HTTP 503");
  return std::nullopt;
};

TEST(RetryTest, AnAnswerOnTheFirstAttemptIsReturnedAtOnce) {
  int sent = 0;
  int attempts = 0;
  Result<int> got = RunWithRetries<int>(
      FastPolicy(5), [&]() -> Result<int> { ++sent; return 200; }, kRetry503, &attempts);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 200);
  EXPECT_EQ(sent, 1);
  EXPECT_EQ(attempts, 1);
}

TEST(RetryTest, RetryableOutcomesAreRetriedUntilAnAnswer) {
  std::vector<Result<int>> script = {503, UnavailableError("reset"), 503, 412, 200};
  size_t next = 0;
  int attempts = 0;
  Result<int> got = RunWithRetries<int>(
      FastPolicy(8), [&]() -> Result<int> { return script[next++]; }, kRetry503, &attempts);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 412) << "412 is an answer, never retried";
  EXPECT_EQ(attempts, 4);
  EXPECT_EQ(next, 4u);
}

TEST(RetryTest, ANonRetryableFailureIsReturnedAsItIs) {
  int sent = 0;
  Result<int> got = RunWithRetries<int>(
      FastPolicy(8), [&]() -> Result<int> { ++sent; return PermissionDeniedError("no"); },
      kRetry503);
  EXPECT_TRUE(absl::IsPermissionDenied(got.status())) << got.status();
  EXPECT_EQ(sent, 1);
}

TEST(RetryTest, AfterTheLastAttemptAnAnswerIsReturnedAndAFailureIsUnavailable) {
  int sent = 0;
  int attempts = 0;
  Result<int> answer = RunWithRetries<int>(
      FastPolicy(3), [&]() -> Result<int> { ++sent; return 503; }, kRetry503, &attempts);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(*answer, 503) << "the last answer is the caller's to judge";
  EXPECT_EQ(sent, 3);
  EXPECT_EQ(attempts, 3);
  sent = 0;
  Result<int> failed = RunWithRetries<int>(
      FastPolicy(4), [&]() -> Result<int> { ++sent; return UnavailableError("connection reset"); },
      kRetry503);
  EXPECT_TRUE(absl::IsUnavailable(failed.status())) << failed.status();
  EXPECT_NE(failed.status().message().find("connection reset (after 4 attempts)"),
            std::string_view::npos)
      << failed.status();
  EXPECT_EQ(sent, 4);
}

TEST(RetryTest, AtLeastOneAttemptIsMade) {
  int sent = 0;
  Result<int> got =
      RunWithRetries<int>(FastPolicy(0), [&]() -> Result<int> { ++sent; return 200; }, kRetry503);
  EXPECT_TRUE(got.ok());
  EXPECT_EQ(sent, 1);
}

TEST(RetryTest, BackoffGrowsWithJitterUpToTheCap) {
  RetryPolicy policy{.max_attempts = 8, .initial_backoff = milliseconds(10),
                     .max_backoff = milliseconds(100)};
  for (int round = 0; round < 50; ++round) {
    const milliseconds first = policy.Backoff(1);  // cap 20
    EXPECT_GE(first.count(), 10);
    EXPECT_LE(first.count(), 20);
    const milliseconds third = policy.Backoff(3);  // cap 80
    EXPECT_GE(third.count(), 40);
    EXPECT_LE(third.count(), 80);
    const milliseconds late = policy.Backoff(30);  // capped at max_backoff
    EXPECT_GE(late.count(), 50);
    EXPECT_LE(late.count(), 100);
  }
}

// --- Request slots ---

TEST(RequestSlotsTest, NoMoreThanTheCountAreHeldAtOnce) {
  RequestSlots slots(3);
  std::atomic<int> inside{0};
  std::atomic<int> most{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 12; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20; ++i) {
        RequestSlot slot(slots);
        const int now = ++inside;
        int seen = most.load();
        while (now > seen && !most.compare_exchange_weak(seen, now)) {
        }
        std::this_thread::yield();
        --inside;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_LE(most.load(), 3);
  EXPECT_GE(most.load(), 1);
  EXPECT_EQ(slots.Free(), 3) << "every slot came back";
}

TEST(RequestSlotsTest, ACountBelowOneIsOneSlot) {
  RequestSlots slots(0);
  EXPECT_EQ(slots.Free(), 1);
  slots.Acquire();
  EXPECT_EQ(slots.Free(), 0);
  slots.Release();
  EXPECT_EQ(slots.Free(), 1);
}

// --- The part uploader ---

// Records what the uploader asks for; part `fail_part` fails.
struct SinkLog {
  std::mutex mu;
  int begun = 0;
  std::vector<int> put_order;
  std::map<int, std::string> parts;
  std::vector<UploadedPart> completed;
  uint64_t completed_size = 0;
  std::vector<std::string> aborted;
  std::optional<std::string> whole;
  int fail_part = 0;
};

class FakeSink final : public PartSink {
 public:
  explicit FakeSink(std::shared_ptr<SinkLog> log) : log_(std::move(log)) {}
  std::string Where() const override { return "'obj' in fake://"; }
  Result<std::string> BeginUpload() override {
    std::lock_guard<std::mutex> lock(log_->mu);
    ++log_->begun;
    return std::string("upload-1");
  }
  Result<std::string> PutPart(const std::string& upload_id, int number,
                              std::string_view bytes) override {
    std::lock_guard<std::mutex> lock(log_->mu);
    EXPECT_EQ(upload_id, "upload-1");
    if (number == log_->fail_part) return UnavailableError("part refused");
    log_->put_order.push_back(number);
    log_->parts[number] = std::string(bytes);
    return StrCat("etag-", number);
  }
  Status Complete(const std::string& upload_id, const std::vector<UploadedPart>& parts,
                  uint64_t size) override {
    std::lock_guard<std::mutex> lock(log_->mu);
    EXPECT_EQ(upload_id, "upload-1");
    log_->completed = parts;
    log_->completed_size = size;
    return OkStatus();
  }
  Status Abort(const std::string& upload_id) override {
    std::lock_guard<std::mutex> lock(log_->mu);
    log_->aborted.push_back(upload_id);
    return OkStatus();
  }
  Status PutWhole(std::string_view bytes) override {
    std::lock_guard<std::mutex> lock(log_->mu);
    log_->whole = std::string(bytes);
    return OkStatus();
  }

 private:
  std::shared_ptr<SinkLog> log_;
};

std::unique_ptr<WritableFile> Uploader(const std::shared_ptr<SinkLog>& log, size_t part_size,
                                       int max_parts = 100) {
  return NewPartUploader(std::make_unique<FakeSink>(log),
                         {.part_size = part_size, .max_parts = max_parts, .buffers = nullptr});
}

TEST(PartUploaderTest, AFileOfAtMostOnePartIsOneWholePut) {
  auto log = std::make_shared<SinkLog>();
  auto file = Uploader(log, 8);
  TS_ASSERT_OK(file->WriteAt(3, "def", 3));
  TS_ASSERT_OK(file->WriteAt(0, "abc", 3));
  TS_ASSERT_OK(file->Close());
  EXPECT_EQ(log->begun, 0);
  ASSERT_TRUE(log->whole.has_value());
  EXPECT_EQ(*log->whole, "abcdef");
  EXPECT_TRUE(log->put_order.empty());
}

TEST(PartUploaderTest, OutOfOrderPartsGoUpAsTheyFillAndCompleteInOrder) {
  auto log = std::make_shared<SinkLog>();
  auto file = Uploader(log, 4);
  TS_ASSERT_OK(file->WriteAt(8, "ijkl", 4));  // part 3, full
  EXPECT_EQ(log->put_order, std::vector<int>({3})) << "a full part goes up at once";
  TS_ASSERT_OK(file->WriteAt(2, "cd", 2));  // part 1, half
  TS_ASSERT_OK(file->WriteAt(4, "efgh", 4));  // part 2, full
  EXPECT_EQ(log->put_order, std::vector<int>({3, 2}));
  TS_ASSERT_OK(file->WriteAt(0, "ab", 2));  // part 1 now full
  EXPECT_EQ(log->put_order, std::vector<int>({3, 2, 1}));
  TS_ASSERT_OK(file->WriteAt(12, "mn", 2));  // part 4, the tail: at Close
  EXPECT_EQ(log->completed.size(), 0u);
  TS_ASSERT_OK(file->Close());
  EXPECT_EQ(log->begun, 1);
  EXPECT_EQ(log->put_order, std::vector<int>({3, 2, 1, 4}));
  ASSERT_EQ(log->completed.size(), 4u);
  std::string object;
  for (size_t i = 0; i < log->completed.size(); ++i) {
    EXPECT_EQ(log->completed[i].number, static_cast<int>(i + 1));
    EXPECT_EQ(log->completed[i].token, StrCat("etag-", i + 1));
    object += log->parts[log->completed[i].number];
  }
  EXPECT_EQ(object, "abcdefghijklmn");
  EXPECT_EQ(log->completed_size, 14u);
  EXPECT_TRUE(log->aborted.empty());
  EXPECT_FALSE(log->whole.has_value());
}

TEST(PartUploaderTest, ParallelWritersFillPartsAndGapsReadAsZeros) {
  auto log = std::make_shared<SinkLog>();
  auto file = Uploader(log, 16);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const std::string bytes(16, static_cast<char>('a' + t));
      // Parts 1, 2, 3, 5 of 6 (part 4 is never written); each thread writes its part in two
      // halves, the second half first.
      const uint64_t base = (t == 3 ? 4 : t) * 16;
      if (!file->WriteAt(base + 8, bytes.data(), 8).ok()) ++failures;
      if (!file->WriteAt(base, bytes.data(), 8).ok()) ++failures;
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(log->put_order.size(), 4u);
  TS_ASSERT_OK(file->WriteAt(80, "z", 1));
  TS_ASSERT_OK(file->Sync());
  ASSERT_EQ(log->completed.size(), 6u);
  EXPECT_EQ(log->parts[4], std::string(16, '\0'));
  EXPECT_EQ(log->parts[5], std::string(16, 'd'));
  EXPECT_EQ(log->parts[6], "z");
  EXPECT_EQ(log->completed_size, 81u);
  EXPECT_TRUE(absl::IsFailedPrecondition(file->WriteAt(90, "x", 1)))
      << "no write after the object appeared";
}

// Files of one store share part buffers: a buffer that carried one file's bytes comes back as
// zeros for the next (gaps still read as zeros), and the pool lets go of its buffers once the
// last file is closed.
TEST(PartUploaderTest, PooledBuffersAreReusedAsZerosAndFreedWithTheLastFile) {
  auto pool = std::make_shared<PartBufferPool>(8, /*max_kept=*/2);
  auto log1 = std::make_shared<SinkLog>();
  auto log2 = std::make_shared<SinkLog>();
  auto open = [&](const std::shared_ptr<SinkLog>& log) {
    return NewPartUploader(std::make_unique<FakeSink>(log),
                           {.part_size = 8, .max_parts = 100, .buffers = pool});
  };
  auto keeper = open(std::make_shared<SinkLog>());  // keeps the pool in use throughout
  auto first = open(log1);
  TS_ASSERT_OK(first->WriteAt(0, "xxxxxxxxyyyyyyyyzz", 18));  // two full parts and a tail
  TS_ASSERT_OK(first->Close());
  EXPECT_EQ(pool->kept(), 1);  // one buffer served the three parts in turn
  auto second = open(log2);
  TS_ASSERT_OK(second->WriteAt(0, "ab", 2));
  TS_ASSERT_OK(second->WriteAt(6, "cd", 2));  // 2..6 never written
  TS_ASSERT_OK(second->Close());
  ASSERT_TRUE(log2->whole.has_value());
  EXPECT_EQ(*log2->whole, std::string("ab\0\0\0\0cd", 8));
  first.reset();
  second.reset();
  EXPECT_GT(pool->kept(), 0);
  keeper.reset();  // the last file of the pool: what it kept is freed
  EXPECT_EQ(pool->kept(), 0);
}

TEST(PartUploaderTest, AFailedPartFailsTheFileAndAbortsTheUpload) {
  auto log = std::make_shared<SinkLog>();
  log->fail_part = 2;
  auto file = Uploader(log, 4);
  TS_ASSERT_OK(file->WriteAt(0, "abcd", 4));
  const Status failed = file->WriteAt(4, "efgh", 4);
  EXPECT_TRUE(absl::IsUnavailable(failed)) << failed;
  const Status later = file->WriteAt(8, "ij", 2);
  EXPECT_TRUE(absl::IsUnavailable(later)) << "every later call fails: " << later;
  const Status closed = file->Close();
  EXPECT_TRUE(absl::IsUnavailable(closed)) << closed;
  EXPECT_EQ(log->aborted, std::vector<std::string>({"upload-1"}));
  EXPECT_TRUE(log->completed.empty()) << "a failed upload never completes";
  EXPECT_TRUE(absl::IsFailedPrecondition(file->Close())) << "closed already";
}

TEST(PartUploaderTest, RewritesOfASentPartAndWritesPastTheLastPartAreRefused) {
  auto log = std::make_shared<SinkLog>();
  auto file = Uploader(log, 4, /*max_parts=*/3);
  TS_ASSERT_OK(file->WriteAt(0, "abcd", 4));
  EXPECT_TRUE(absl::IsFailedPrecondition(file->WriteAt(1, "x", 1)));
  EXPECT_TRUE(absl::IsInvalidArgument(file->WriteAt(12, "x", 1)));
  TS_ASSERT_OK(file->Close());
}

// --- The lease, on the memory store ---

std::string LeaseRecord(const std::string& holder, int64_t expires_unix_ms) {
  return nlohmann::json{{"holder", holder}, {"host", "elsewhere"}, {"pid", 7},
                        {"expires_unix_ms", expires_unix_ms}}
      .dump();
}

int64_t NowMs() {
  return std::chrono::duration_cast<milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A sink that takes pieces (as GCS's): records each part's bytes, its CRC-32C as the uploader
// gave it, and whether a piece was sent from `watched` (the writer's own memory).
struct PiecesLog {
  std::mutex mu;
  std::map<int, std::string> parts;  // 0: the whole object (one request)
  std::map<int, uint32_t> crcs;
  std::map<int, bool> from_watched;
  const char* watched = nullptr;
  size_t watched_size = 0;
};

class PiecesSink final : public PartSink {
 public:
  explicit PiecesSink(std::shared_ptr<PiecesLog> log) : log_(std::move(log)) {}
  std::string Where() const override { return "'obj' in fake://"; }
  Result<std::string> BeginUpload() override { return std::string("upload-1"); }
  Result<std::string> PutPart(const std::string&, int, std::string_view) override {
    return InternalError("PutPart called on a sink that takes pieces");
  }
  Status Complete(const std::string&, const std::vector<UploadedPart>&, uint64_t) override {
    return OkStatus();
  }
  Status Abort(const std::string&) override { return OkStatus(); }
  Status PutWhole(std::string_view) override {
    return InternalError("PutWhole called on a sink that takes pieces");
  }
  bool TakesPieces() const override { return true; }
  Result<std::string> PutPartPieces(const std::string&, int number,
                                    const PartBytes& bytes) override {
    Record(number, bytes);
    return StrCat("etag-", number);
  }
  Status PutWholePieces(const PartBytes& bytes) override {
    Record(0, bytes);
    return OkStatus();
  }

 private:
  void Record(int number, const PartBytes& bytes) {
    std::lock_guard<std::mutex> lock(log_->mu);
    std::string joined;
    bool watched = false;
    for (std::string_view piece : bytes.pieces) {
      joined.append(piece);
      watched |= log_->watched != nullptr && piece.data() >= log_->watched &&
                 piece.data() < log_->watched + log_->watched_size;
    }
    EXPECT_EQ(joined.size(), bytes.size);
    log_->parts[number] = joined;
    log_->crcs[number] = bytes.crc32c;
    log_->from_watched[number] = watched;
  }
  std::shared_ptr<PiecesLog> log_;
};

std::unique_ptr<WritableFile> PiecesUploader(const std::shared_ptr<PiecesLog>& log,
                                             size_t part_size,
                                             std::shared_ptr<PartBufferPool> pool = nullptr) {
  return NewPartUploader(std::make_unique<PiecesSink>(log),
                         {.part_size = part_size, .max_parts = 100, .buffers = std::move(pool)});
}

// Borrowed bytes go out from the writer's memory, and the object's CRC-32C is combined from
// the CRCs the writers gave, gaps counted as zeros: what was given is what the server checks.
TEST(PartUploaderTest, BorrowedBytesAreSentUncopiedWithTheirCombinedCrc) {
  auto log = std::make_shared<PiecesLog>();
  const std::string chunk = "0123456789abcdef";
  log->watched = chunk.data();
  log->watched_size = chunk.size();
  auto file = PiecesUploader(log, 64);
  TS_ASSERT_OK(file->WriteChunkAt(20, chunk.data(), chunk.size(), Crc32c(chunk), true));
  TS_ASSERT_OK(file->WriteAt(0, "head", 4));  // copied; its CRC computed by the uploader
  TS_ASSERT_OK(file->Close());
  const std::string expected = std::string("head") + std::string(16, '\0') + chunk;
  ASSERT_EQ(log->parts.count(0), 1u);
  EXPECT_EQ(log->parts[0], expected);
  EXPECT_EQ(log->crcs[0], Crc32c(expected));
  EXPECT_TRUE(log->from_watched[0]) << "the borrowed bytes were copied";

  // A wrong CRC given is passed on, not silently replaced by the bytes' own: the server then
  // refuses the upload instead of storing bytes the writer did not checksum.
  auto log2 = std::make_shared<PiecesLog>();
  auto file2 = PiecesUploader(log2, 64);
  TS_ASSERT_OK(file2->WriteChunkAt(0, chunk.data(), chunk.size(), Crc32c(chunk) ^ 1, false));
  TS_ASSERT_OK(file2->Close());
  EXPECT_EQ(log2->parts[0], chunk);
  EXPECT_EQ(log2->crcs[0], Crc32c(chunk) ^ 1);
  EXPECT_FALSE(log2->from_watched[0]);
}

// Parts of a larger object: a write that spans parts is checksummed per part; a part never
// written goes as zeros with their CRC; a borrowed write that is not copied still is sent.
TEST(PartUploaderTest, PiecesAcrossPartsAndGapsHaveTheRightBytesAndCrcs) {
  auto log = std::make_shared<PiecesLog>();
  const std::string spanning = "ABCDEFGHIJKL";  // bytes 6..17: parts 1, 2 and 3 of 8 bytes
  log->watched = spanning.data();
  log->watched_size = spanning.size();
  auto file = PiecesUploader(log, 8, std::make_shared<PartBufferPool>(8, 2));
  TS_ASSERT_OK(file->WriteAt(0, "abcdef", 6));
  TS_ASSERT_OK(file->WriteChunkAt(6, spanning.data(), spanning.size(), Crc32c(spanning), true));
  TS_ASSERT_OK(file->WriteAt(40, "z", 1));  // parts 4 and 5 never written; part 6 "z"
  TS_ASSERT_OK(file->Close());
  const std::string object = std::string("abcdef") + spanning + std::string(22, '\0') + "z";
  ASSERT_EQ(log->parts.size(), 6u);
  for (int n = 1; n <= 6; ++n) {
    const std::string want = object.substr((n - 1) * 8, 8);
    EXPECT_EQ(log->parts[n], want) << "part " << n;
    EXPECT_EQ(log->crcs[n], Crc32c(want)) << "part " << n;
  }
  EXPECT_TRUE(log->from_watched[2]);
}

// A write over bytes already written into a pending part: the later bytes win, as in a file,
// with the CRC of what is sent (the part falls back to a copy).
TEST(PartUploaderTest, AnOverlappingRewriteOfBorrowedBytesWinsAndIsChecksummed) {
  auto log = std::make_shared<PiecesLog>();
  const std::string first = "aaaaaaaa";
  auto file = PiecesUploader(log, 64);
  TS_ASSERT_OK(file->WriteChunkAt(0, first.data(), first.size(), Crc32c(first), true));
  TS_ASSERT_OK(file->WriteChunkAt(2, "bbb", 3, Crc32c("bbb"), true));
  TS_ASSERT_OK(file->WriteAt(6, "cccc", 4));
  TS_ASSERT_OK(file->Close());
  EXPECT_EQ(log->parts[0], "aabbbacccc");
  EXPECT_EQ(log->crcs[0], Crc32c("aabbbacccc"));
  EXPECT_EQ(first, "aaaaaaaa") << "the writer's memory is never written";
}

TEST(LeaseTest, OneHolderAtATimeAndReleaseFreesIt) {
  MemoryKvStore kv(/*supports_rename=*/false);
  std::shared_ptr<LeaseOps> ops = KvStoreLeaseOps(&kv);
  Result<std::unique_ptr<KvLock>> first = TakeLease(ops, "run/.lock", {});
  ASSERT_TRUE(first.ok()) << first.status();
  Result<std::unique_ptr<KvLock>> second = TakeLease(ops, "run/.lock", {});
  EXPECT_TRUE(absl::IsFailedPrecondition(second.status())) << second.status();
  EXPECT_NE(second.status().message().find("locked by another manager"), std::string_view::npos)
      << second.status();
  first->reset();
  EXPECT_TRUE(absl::IsNotFound(kv.Read("run/.lock").status())) << "released: deleted";
  Result<std::unique_ptr<KvLock>> third = TakeLease(ops, "run/.lock", {});
  EXPECT_TRUE(third.ok()) << third.status();
}

TEST(LeaseTest, AnExpiredLeaseIsTakenOverAndItsHolderDoesNotDeleteTheSuccessor) {
  MemoryKvStore kv(/*supports_rename=*/false);
  std::shared_ptr<LeaseOps> ops = KvStoreLeaseOps(&kv);
  TS_ASSERT_OK(kv.Write("lock", LeaseRecord("dead-holder", NowMs() - 1000)));
  Result<std::unique_ptr<KvLock>> taken = TakeLease(ops, "lock", {});
  ASSERT_TRUE(taken.ok()) << taken.status();
  Result<std::string> now = kv.Read("lock");
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->find("dead-holder"), std::string::npos) << *now;

  // This holder stalls and is taken over: releasing it leaves the successor's lease alone.
  TS_ASSERT_OK(kv.Write("lock", LeaseRecord("successor", NowMs() + 60000)));
  taken->reset();
  Result<std::string> after = kv.Read("lock");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_NE(after->find("successor"), std::string::npos) << *after;
}

TEST(LeaseTest, AHeldLeaseIsRenewedInTheBackground) {
  MemoryKvStore kv(/*supports_rename=*/false);
  Result<std::unique_ptr<KvLock>> taken =
      TakeLease(KvStoreLeaseOps(&kv), "lock", {.duration = milliseconds(300)});
  ASSERT_TRUE(taken.ok()) << taken.status();
  auto expiry = [&]() -> int64_t {
    Result<std::string> text = kv.Read("lock");
    if (!text.ok()) return -1;
    return nlohmann::json::parse(*text).value("expires_unix_ms", int64_t{-1});
  };
  const int64_t first = expiry();
  ASSERT_GT(first, 0);
  // Renewed every 100 ms; wait (up to 10 s) for a renewal to be seen.
  int64_t later = first;
  for (int i = 0; i < 1000 && later == first; ++i) {
    std::this_thread::sleep_for(milliseconds(10));
    later = expiry();
  }
  EXPECT_GT(later, first) << "the lease was never renewed";
}

// --- The credential cache ---

struct FakeToken {
  int serial = 0;
};

class FakeFetcher final : public CredentialFetcher<FakeToken> {
 public:
  FakeFetcher(std::atomic<int>* fetches, std::atomic<bool>* fail,
              std::function<std::optional<std::chrono::system_clock::time_point>()> expiry)
      : fetches_(fetches), fail_(fail), expiry_(std::move(expiry)) {}
  Result<ExpiringCredential<FakeToken>> Fetch() override {
    if (fail_->load()) return UnavailableError("token service down");
    const int serial = ++*fetches_;
    return ExpiringCredential<FakeToken>{FakeToken{serial}, expiry_()};
  }

 private:
  std::atomic<int>* fetches_;
  std::atomic<bool>* fail_;
  std::function<std::optional<std::chrono::system_clock::time_point>()> expiry_;
};

class CredentialCacheTest : public ::testing::Test {
 protected:
  using Clock = std::chrono::system_clock;
  std::unique_ptr<CachedCredential<FakeToken>> Cache(bool expiring) {
    CachedCredential<FakeToken>::Options options;
    options.refresh_margin = std::chrono::minutes(5);
    options.refresh_grace = std::chrono::minutes(1);
    options.now = [this] { return now_; };
    auto expiry = [this, expiring]() -> std::optional<Clock::time_point> {
      if (!expiring) return std::nullopt;
      return now_ + std::chrono::minutes(10);
    };
    return std::make_unique<CachedCredential<FakeToken>>(
        std::make_unique<FakeFetcher>(&fetches_, &fail_, expiry), options);
  }
  Clock::time_point now_ = Clock::time_point(std::chrono::hours(1000));
  std::atomic<int> fetches_{0};
  std::atomic<bool> fail_{false};
};

TEST_F(CredentialCacheTest, ACredentialThatNeverExpiresIsFetchedOnce) {
  auto cache = Cache(/*expiring=*/false);
  for (int i = 0; i < 5; ++i) {
    Result<FakeToken> got = cache->Get();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->serial, 1);
    now_ += std::chrono::hours(24);
  }
  EXPECT_EQ(fetches_.load(), 1);
}

TEST_F(CredentialCacheTest, ItIsRefreshedBeforeItExpires) {
  auto cache = Cache(/*expiring=*/true);  // each lasts 10 minutes from its fetch
  EXPECT_EQ(cache->Get()->serial, 1);
  now_ += std::chrono::minutes(4);  // 6 left: kept
  EXPECT_EQ(cache->Get()->serial, 1);
  now_ += std::chrono::minutes(2);  // 4 left, under the 5-minute margin: refreshed
  EXPECT_EQ(cache->Get()->serial, 2);
  EXPECT_EQ(fetches_.load(), 2);
}

TEST_F(CredentialCacheTest, AFailedRefreshKeepsTheOldOneWhileItLastsThenFails) {
  auto cache = Cache(/*expiring=*/true);
  EXPECT_EQ(cache->Get()->serial, 1);
  fail_ = true;
  now_ += std::chrono::minutes(7);  // 3 left: refresh fails, the old one is kept
  Result<FakeToken> kept = cache->Get();
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->serial, 1);
  now_ += std::chrono::seconds(150);  // 30 s left: past the grace
  Result<FakeToken> failed = cache->Get();
  EXPECT_TRUE(absl::IsUnavailable(failed.status())) << failed.status();
  EXPECT_NE(failed.status().message().find("refreshing credentials"), std::string_view::npos)
      << failed.status();
  fail_ = false;
  EXPECT_EQ(cache->Get()->serial, 2);
}

TEST_F(CredentialCacheTest, AFailedFirstFetchIsNotKept) {
  auto cache = Cache(/*expiring=*/false);
  fail_ = true;
  EXPECT_TRUE(absl::IsUnavailable(cache->Get().status()));
  fail_ = false;
  Result<FakeToken> got = cache->Get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->serial, 1);
}

TEST_F(CredentialCacheTest, ThreadsAskingAtOnceShareOneFetch) {
  auto cache = Cache(/*expiring=*/true);
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      Result<FakeToken> got = cache->Get();
      if (!got.ok() || got->serial != 1) ++wrong;
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(fetches_.load(), 1);
}

// A ranged answer is accepted only with exactly the bytes asked for.
TEST(RangedReadTest, AcceptsExactlyTheRangeAskedFor) {
  const auto check = [](RangedAnswer answer, uint64_t offset, size_t size) {
    return CheckRangedAnswer(answer, offset, size, "reading 'k' in gs://b", "gs://b");
  };
  EXPECT_TRUE(check({.status = 206, .content_range = "bytes 1-3/5", .received = 3}, 1, 3).ok());
  EXPECT_TRUE(check({.status = 206, .received = 3}, 1, 3).ok());      // no Content-Range
  EXPECT_TRUE(check({.status = 200, .received = 3}, 0, 3).ok());      // the whole object
  EXPECT_TRUE(check({.status = 200, .received = 7}, 0, 0).ok());      // no range asked
  // gcp-storage-emulator's answer to a start past the end: 206, "bytes 10-4/5", no bytes.
  Status past = check({.status = 206, .content_range = "bytes 10-4/5", .received = 0}, 10, 4);
  EXPECT_TRUE(absl::IsDataLoss(past)) << past;
  EXPECT_NE(past.message().find("bytes 10-4/5"), std::string_view::npos) << past;
  EXPECT_TRUE(absl::IsDataLoss(
      check({.status = 206, .content_range = "bytes 2-4/9", .received = 3}, 1, 3)));  // shifted
  EXPECT_TRUE(absl::IsDataLoss(
      check({.status = 206, .content_range = "bytes x-4/9", .received = 3}, 1, 3)));
  EXPECT_TRUE(absl::IsDataLoss(
      check({.status = 206, .content_range = "bytes 1-3/3", .received = 2}, 1, 3)));  // short
  EXPECT_TRUE(absl::IsDataLoss(check({.status = 206, .received = 2}, 1, 3)));  // truncated
  EXPECT_TRUE(absl::IsDataLoss(check({.status = 206, .received = 3, .overflow = true}, 0, 3)));
  EXPECT_TRUE(absl::IsUnimplemented(check({.status = 200, .received = 3}, 1, 3)));
  EXPECT_TRUE(absl::IsUnimplemented(check({.status = 200, .received = 3, .overflow = true}, 0, 3)));
}

TEST(PinnedFileTest, ReadsAtTheGenerationOfOpenAndRefusesPastTheEnd) {
  std::vector<std::string> generations;
  std::unique_ptr<ReadableFile> file = NewPinnedFile(
      {.size = 10, .generation = "g7", .modified = {}}, "'k' in gs://b",
      [&](uint64_t offset, size_t size, void* dest, const std::string& generation) {
        generations.push_back(generation);
        std::memset(dest, static_cast<int>('a' + offset), size);
        return OkStatus();
      });
  EXPECT_EQ(file->size(), 10u);
  char bytes[4] = {};
  EXPECT_TRUE(file->ReadAt(2, 4, bytes).ok());
  EXPECT_EQ(std::string_view(bytes, 4), "cccc");
  EXPECT_TRUE(file->ReadAt(10, 0, bytes).ok());
  Status past = file->ReadAt(8, 4, bytes);
  EXPECT_TRUE(absl::IsDataLoss(past)) << past;
  EXPECT_NE(past.message().find("'k' in gs://b"), std::string_view::npos) << past;
  EXPECT_EQ(generations, std::vector<std::string>({"g7"}));
}

TEST(ProbeOnceTest, ProbesOncePerKeyAndForgetsFailures) {
  int probes = 0;
  const ProbeKey key{"s3", "http://probe-test", RandomHexId()};
  Result<ProbeFindings> failed = ProbeOnce(key, [&]() -> Result<ProbeFindings> {
    ++probes;
    return UnavailableError("down");
  });
  EXPECT_TRUE(absl::IsUnavailable(failed.status()));
  for (int i = 0; i < 3; ++i) {
    Result<ProbeFindings> found = ProbeOnce(key, [&]() -> Result<ProbeFindings> {
      ++probes;
      return ProbeFindings{.conditional_write = false, .generations = true, .finding = "ignored"};
    });
    ASSERT_TRUE(found.ok()) << found.status();
    EXPECT_FALSE(found->conditional_write);
    EXPECT_EQ(found->finding, "ignored");
  }
  EXPECT_EQ(probes, 2);
}

TEST(ProbeOnceTest, TheSchemeEndpointAndBucketEachMakeAKey) {
  const std::string bucket = RandomHexId();
  const std::vector<ProbeKey> keys = {{"s3", "http://probe-test", bucket},
                                      {"gs", "http://probe-test", bucket},
                                      {"gs", "http://other-probe-test", bucket},
                                      {"gs", "http://probe-test", bucket + "x"}};
  for (size_t i = 0; i < keys.size(); ++i) {
    Result<ProbeFindings> found = ProbeOnce(keys[i], [&]() -> Result<ProbeFindings> {
      return ProbeFindings{.conditional_write = true, .generations = true, .finding = StrCat(i)};
    });
    ASSERT_TRUE(found.ok()) << found.status();
    EXPECT_EQ(found->finding, StrCat(i)) << keys[i].scheme << " " << keys[i].endpoint;
  }
}

// A probe hanging on one server must not hold up the stores of another: the probe of `slow`
// waits until the probe of `fast` has run, which can only happen when no lock is shared.
TEST(ProbeOnceTest, ProbesOfDifferentKeysRunAtTheSameTime) {
  const ProbeKey slow{"gs", "http://slow-probe-test", RandomHexId()};
  const ProbeKey fast{"gs", "http://fast-probe-test", RandomHexId()};
  std::mutex mu;
  std::condition_variable cv;
  bool slow_started = false;
  bool fast_done = false;
  bool give_up = false;  // set when the test has failed, so that the slow probe ends
  std::thread slow_thread([&] {
    Result<ProbeFindings> found = ProbeOnce(slow, [&]() -> Result<ProbeFindings> {
      std::unique_lock<std::mutex> lock(mu);
      slow_started = true;
      cv.notify_all();
      cv.wait(lock, [&] { return fast_done || give_up; });
      return ProbeFindings{};
    });
    EXPECT_TRUE(found.ok()) << found.status();
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return slow_started; });
  }
  std::thread fast_thread([&] {
    Result<ProbeFindings> found = ProbeOnce(fast, [] { return Result<ProbeFindings>(ProbeFindings{}); });
    EXPECT_TRUE(found.ok()) << found.status();
    std::lock_guard<std::mutex> lock(mu);
    fast_done = true;
    cv.notify_all();
  });
  {
    // Not a timing assertion: the bound only turns a deadlock (one lock across all probes)
    // into a failure instead of a hung test.
    std::unique_lock<std::mutex> lock(mu);
    const bool done = cv.wait_for(lock, std::chrono::seconds(60), [&] { return fast_done; });
    EXPECT_TRUE(done) << "the probe of one key waited for the probe of another";
    give_up = true;
    cv.notify_all();
  }
  slow_thread.join();
  fast_thread.join();
}

TEST(ProbeOnceTest, ThreadsAskingForOneKeyAtOnceShareOneProbe) {
  const ProbeKey key{"s3", "http://shared-probe-test", RandomHexId()};
  std::atomic<int> probes{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      Result<ProbeFindings> found = ProbeOnce(key, [&]() -> Result<ProbeFindings> {
        ++probes;
        std::this_thread::yield();
        return ProbeFindings{};
      });
      EXPECT_TRUE(found.ok()) << found.status();
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(probes.load(), 1);
}

TEST(ScopedDefaultsTest, TheLongestPrefixWins) {
  ScopedDefaults<std::string> defaults;
  EXPECT_EQ(defaults.For("gs://b/run"), "");
  defaults.Set("", "all");
  defaults.Set("gs://b/", "bucket");
  defaults.Set("gs://b/run", "run");
  EXPECT_EQ(defaults.For("gs://b/run/7"), "run");
  EXPECT_EQ(defaults.For("gs://b/run"), "run");
  EXPECT_EQ(defaults.For("gs://b/runner"), "bucket");
  EXPECT_EQ(defaults.For("gs://b"), "bucket");
  EXPECT_EQ(defaults.For("gs://bb"), "all");
  defaults.Set("gs://b", "replaced");
  EXPECT_EQ(defaults.For("gs://b/x"), "replaced");
}

TEST(DriverOptionsTest, ParsesBoolsAndCountsAndNamesTheBadOne) {
  EXPECT_EQ(ParseBoolOption("anonymous", "true", "gs://b").value(), true);
  EXPECT_EQ(ParseBoolOption("anonymous", "0", "gs://b").value(), false);
  Result<bool> bad = ParseBoolOption("anonymous", "yes", "gs://b");
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status()));
  EXPECT_NE(bad.status().message().find("'anonymous' is 'yes'"), std::string_view::npos);
  EXPECT_EQ(ParseCountOption("part_size", "1048576", 1, 1u << 30, "gs://b").value(), 1048576u);
  for (std::string_view value : {"0", "-1", "", "12x", "2000000000"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(
        ParseCountOption("part_size", value, 1, 1u << 30, "gs://b").status()))
        << value;
  }
}

}  // namespace
}  // namespace tensorstash
