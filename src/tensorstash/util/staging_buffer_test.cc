#include "tensorstash/util/staging_buffer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <utility>

namespace tensorstash {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// Each test starts with nothing kept (other tests of the binary free buffers too).
class StagingBufferTest : public ::testing::Test {
 protected:
  void SetUp() override { ReleaseKeptStagingBuffers(); }
};

TEST_F(StagingBufferTest, AFreedBufferIsHandedOutAgainForTheSameSize) {
  char* first = nullptr;
  {
    StagingBuffer a(4 * kMiB);
    first = a.data();
    std::memset(a.data(), 1, a.size());
  }
  EXPECT_EQ(StagingBufferKeptBytes(), 4 * kMiB);
  StagingBuffer b(4 * kMiB - 100);  // rounds to the same length
  EXPECT_EQ(b.data(), first);
  EXPECT_EQ(b.size(), 4 * kMiB - 100);
  EXPECT_EQ(StagingBufferKeptBytes(), 0u);
  std::memset(b.data(), 2, b.size());  // all of it writable
}

TEST_F(StagingBufferTest, ASmallerBufferIsCutFromAKeptOneAndTheRestStaysKept) {
  char* first = nullptr;
  {
    StagingBuffer a(8 * kMiB);
    first = a.data();
  }
  ASSERT_EQ(StagingBufferKeptBytes(), 8 * kMiB);
  StagingBuffer b(3 * kMiB);
  std::memset(b.data(), 3, b.size());
  EXPECT_EQ(b.data(), first);
  EXPECT_EQ(StagingBufferKeptBytes(), 5 * kMiB);
  StagingBuffer c(5 * kMiB);
  std::memset(c.data(), 4, c.size());
  EXPECT_EQ(c.data(), first + 3 * kMiB);
  EXPECT_EQ(StagingBufferKeptBytes(), 0u);
}

TEST_F(StagingBufferTest, AMissUnmapsKeptBuffersBeforeMappingANewOne) {
  {
    StagingBuffer a(2 * kMiB), b(3 * kMiB), c(2 * kMiB);
  }  // freed c, b, a: kept in that order
  ASSERT_EQ(StagingBufferKeptBytes(), 7 * kMiB);
  // Larger than anything kept: kept buffers of at least its size are given back first (the
  // oldest first), so kept plus live memory does not grow.
  StagingBuffer b(4 * kMiB);
  std::memset(b.data(), 5, b.size());
  EXPECT_EQ(StagingBufferKeptBytes(), 2 * kMiB);
  ReleaseKeptStagingBuffers();
  EXPECT_EQ(StagingBufferKeptBytes(), 0u);
}

TEST_F(StagingBufferTest, SmallBuffersAreNotKept) {
  auto small = std::make_unique<StagingBuffer>(512 * 1024);  // mapped, but below the reuse size
  auto tiny = std::make_unique<StagingBuffer>(1000);         // from the heap
  const uint64_t kept = StagingBufferKeptBytes();
  small.reset();
  tiny.reset();
  EXPECT_EQ(StagingBufferKeptBytes(), kept);
}

TEST_F(StagingBufferTest, MovedBuffersKeepTheirMapping) {
  StagingBuffer a(2 * kMiB);
  char* data = a.data();
  StagingBuffer b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.data(), data);
  StagingBuffer c;
  c = std::move(b);
  EXPECT_EQ(c.data(), data);
  std::memset(c.data(), 4, c.size());
}

}  // namespace
}  // namespace tensorstash
