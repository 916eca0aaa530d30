#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "tensorstash/util/base64.h"
#include "tensorstash/util/byte_limiter.h"
#include "tensorstash/util/copy_bytes.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/status.h"
#include "tensorstash/util/str_util.h"
#include "tensorstash/util/thread_pool.h"

namespace tensorstash {
namespace {

TEST(Crc32Test, StandardCheckValueAndChainingAsZlibs) {
  EXPECT_EQ(Crc32("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(Crc32("", 0), 0u);
  // Continued over a split at every length, equal to the whole (zlib's crc32 convention).
  std::string data(1000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 131 + (i >> 3));
  const uint32_t whole = Crc32(data.data(), data.size());
  for (size_t cut : {size_t{0}, size_t{1}, size_t{15}, size_t{64}, size_t{500}, size_t{999}}) {
    EXPECT_EQ(Crc32(data.data() + cut, data.size() - cut, Crc32(data.data(), cut)), whole) << cut;
  }
}

TEST(Crc32cTest, StandardCheckValueAndChaining) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
  EXPECT_EQ(Crc32c(std::string_view("56789"), Crc32c("1234")), 0xE3069283u);
  std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(zeros), 0x8A9136AAu);  // RFC 3720 test vector
}

// The CRC of A+B from the CRCs of A and B, at every split of a message and for long B.
TEST(Crc32cTest, CombineEqualsTheCrcOfTheConcatenation) {
  std::string text;
  for (int i = 0; i < 300; ++i) text += static_cast<char>(i * 37 + 11);
  for (size_t split = 0; split <= text.size(); split += 7) {
    const std::string_view a = std::string_view(text).substr(0, split);
    const std::string_view b = std::string_view(text).substr(split);
    EXPECT_EQ(Crc32cCombine(Crc32c(a), Crc32c(b), b.size()), Crc32c(text)) << split;
  }
  const std::string big(size_t{3} << 20, 'x');
  EXPECT_EQ(Crc32cCombine(Crc32c("head"), Crc32c(big), big.size()), Crc32c("head" + big));
  EXPECT_EQ(Crc32cCombine(0x12345678u, Crc32c(""), 0), 0x12345678u);
}

TEST(Base64Test, EncodesAndDecodesRfc4648Vectors) {
  const std::pair<std::string_view, std::string_view> vectors[] = {
      {"", ""},         {"f", "Zg=="},         {"fo", "Zm8="},        {"foo", "Zm9v"},
      {"foob", "Zm9vYg=="}, {"fooba", "Zm9vYmE="}, {"foobar", "Zm9vYmFy"}};
  for (const auto& [plain, encoded] : vectors) {
    EXPECT_EQ(Base64Encode(plain), encoded);
    Result<std::string> decoded = Base64Decode(encoded);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(*decoded, plain);
  }
  EXPECT_EQ(Base64UrlEncode("foob"), "Zm9vYg");
  EXPECT_EQ(Base64UrlEncode("\xfb\xff"), "-_8");
  EXPECT_EQ(Base64Encode("\xfb\xff"), "+/8=");
  for (std::string_view bad : {"Zm9", "Zm9v!A==", "Z===", "Zg=a", "=Zg="}) {
    EXPECT_FALSE(Base64Decode(bad).ok()) << bad;
  }
  // S3's x-amz-checksum-crc32c and GCS's crc32c of "123456789" (0xE3069283).
  EXPECT_EQ(Crc32cBase64(Crc32c("123456789")), "4waSgw==");
  EXPECT_EQ(Crc32cBase64(0), "AAAAAA==");
}

// Every size around the streaming threshold and the 16 KiB groups, at every alignment of source
// and destination within a cache line and a page: the bytes equal memcpy's, and nothing beside
// the destination range is written.
TEST(CopyBytesTest, EqualsMemcpyAtEverySizeAndAlignment) {
  const size_t group = 4 * 4096;
  const size_t sizes[] = {0, 1, 63, 4096, kStreamingCopyBytes - 1, kStreamingCopyBytes,
                          kStreamingCopyBytes + 1, kStreamingCopyBytes + group - 1,
                          kStreamingCopyBytes + group + 4095, (size_t{3} << 20) + 17};
  const size_t offsets[] = {0, 1, 16, 63, 64, 4000, 4095};
  const size_t max_size = (size_t{3} << 20) + 17;
  std::string src(max_size + 8192, '\0');
  for (size_t i = 0; i < src.size(); ++i) {
    src[i] = static_cast<char>((i * 131 + i / 7) % 90);  // never 0x5a, the canary
  }
  std::string dst(max_size + 8192 + 128, '\0');
  for (auto* copy : {&CopyBytes, &CopyBytesWithoutAvx2}) {
    for (size_t size : sizes) {
      for (size_t src_off : offsets) {
        for (size_t dst_off : {size_t{0}, size_t{32}, size_t{4033}}) {
          std::fill(dst.begin(), dst.end(), '\x5a');
          copy(dst.data() + 64 + dst_off, src.data() + src_off, size);
          ASSERT_EQ(dst.compare(64 + dst_off, size, src, src_off, size), 0)
              << "size " << size << " src offset " << src_off << " dst offset " << dst_off;
          const size_t end = 64 + dst_off + size;
          ASSERT_EQ(dst.find_first_not_of('\x5a'),
                    size == 0 ? std::string::npos : 64 + dst_off)
              << "written before the destination";
          ASSERT_EQ(dst.find_first_not_of('\x5a', end), std::string::npos)
              << "written after the destination, size " << size;
        }
      }
    }
  }
}

TEST(StatusTest, ErrnoMappingNamesThePath) {
  Status s = ErrnoToStatus(ENOENT, "open", "/x/y");
  EXPECT_TRUE(absl::IsNotFound(s));
  EXPECT_NE(std::string(s.message()).find("/x/y"), std::string::npos);
  EXPECT_TRUE(absl::IsResourceExhausted(ErrnoToStatus(ENOSPC, "write", "f")));
  EXPECT_EQ(Annotate(InvalidArgumentError("bad"), "array 'w'").message(), "array 'w': bad");
  EXPECT_TRUE(Annotate(OkStatus(), "x").ok());
}

TEST(StrUtilTest, CatJoinSplitParse) {
  std::string_view view = "v";
  EXPECT_EQ(StrCat("a", 1, view, '-', uint64_t{7}, std::string("s")), "a1v-7s");
  EXPECT_EQ(StrJoin(std::vector<int>{1, 2, 3}, ", "), "1, 2, 3");
  EXPECT_EQ(StrSplit("a,,b", ',').size(), 3u);
  int64_t x;
  EXPECT_TRUE(ParseInt("-42", &x));
  EXPECT_EQ(x, -42);
  EXPECT_FALSE(ParseInt("4x", &x));
  EXPECT_FALSE(ParseInt("", &x));
  EXPECT_EQ(Hex32(0xab), "000000ab");
}

TEST(StrUtilTest, EscapeBytes) {
  EXPECT_EQ(EscapeBytes("plain/key.0"), "plain/key.0");
  EXPECT_EQ(EscapeBytes(std::string_view("a\0b\n\x7f\xff", 6)), "a\\x00b\\x0a\\x7f\\xff");
  EXPECT_EQ(EscapeBytes("say \"hi\" \\ bye"), "say \\\"hi\\\" \\\\ bye");
}

TEST(ThreadPoolTest, TaskGroupReturnsFirstErrorAndSkipsTheRest) {
  ThreadPool pool(4);
  std::atomic<int> ran{0};
  TaskGroup group(&pool);
  group.Run([&] {
    ++ran;
    return DataLossError("first");
  });
  group.Wait().IgnoreError();
  for (int i = 0; i < 100; ++i)
    group.Run([&] {
      ++ran;
      return OkStatus();
    });
  Status status = group.Wait();
  EXPECT_EQ(status.message(), "first");
  EXPECT_EQ(ran.load(), 1);  // later tasks of a failed group are skipped
}

TEST(ThreadPoolTest, RunsEverything) {
  ThreadPool pool(3);
  std::atomic<int> sum{0};
  TaskGroup group(&pool);
  for (int i = 1; i <= 1000; ++i)
    group.Run([&, i] {
      sum += i;
      return OkStatus();
    });
  EXPECT_TRUE(group.Wait().ok());
  EXPECT_EQ(sum.load(), 500500);
}

TEST(ByteLimiterTest, CapIsNeverExceededAndOversizeRequestsRunAlone) {
  ByteLimiter limiter(100);
  ThreadPool pool(8);
  std::atomic<uint64_t> held{0}, max_held{0};
  TaskGroup group(&pool);
  for (int i = 0; i < 200; ++i) {
    const uint64_t bytes = (i % 7 == 0) ? 250 : 30;  // some larger than the cap
    group.Run([&, bytes] {
      ByteReservation reservation(&limiter, bytes);
      const uint64_t now = held += bytes;
      uint64_t prev = max_held.load();
      while (now > prev && !max_held.compare_exchange_weak(prev, now)) {
      }
      if (bytes > 100 && now != bytes) return InternalError("oversize request did not run alone");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      held -= bytes;
      return OkStatus();
    });
  }
  ASSERT_TRUE(group.Wait().ok());
  EXPECT_LE(max_held.load(), 250u);
  EXPECT_LE(limiter.peak(), 250u);
}

// Issue 13, item 9: one task per chunk queued without limit held gigabytes for a grid of
// millions of tiny chunks. With max_pending, Run waits until a queued task finishes.
TEST(TaskGroupTest, MaxPendingBoundsTheTasksQueuedAtOnce) {
  ThreadPool pool(2);
  std::atomic<int> queued{0}, running_max{0}, running{0};
  {
    TaskGroup group(&pool, /*max_pending=*/3);
    for (int i = 0; i < 200; ++i) {
      group.Run([&]() -> Status {
        const int now = ++running;
        int seen = running_max.load();
        while (now > seen && !running_max.compare_exchange_weak(seen, now)) {
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        --running;
        --queued;
        return OkStatus();
      });
      // Counted after Run returned: at most max_pending tasks can be outstanding then.
      EXPECT_LE(++queued, 3);
    }
    ASSERT_TRUE(group.Wait().ok());
  }
  EXPECT_EQ(queued.load(), 0);
  EXPECT_LE(running_max.load(), 2);
}

}  // namespace
}  // namespace tensorstash
