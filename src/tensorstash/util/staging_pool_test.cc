#include "tensorstash/util/staging_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

namespace tensorstash {
namespace {

TEST(StagingPoolTest, ReusesAReturnedBufferInsteadOfMappingANewOne) {
  StagingPool pool(1 << 20);
  for (int i = 0; i < 10; ++i) {
    StagingPool::Lease lease = pool.Acquire(300 << 10);
    ASSERT_NE(lease.data(), nullptr);
    EXPECT_EQ(lease.size(), size_t{300} << 10);
    std::memset(lease.data(), i, lease.size());  // the whole size is usable
  }
  EXPECT_EQ(pool.buffers_created(), 1u);
  EXPECT_EQ(pool.held_bytes(), uint64_t{300} << 10);  // kept for the next lease
}

TEST(StagingPoolTest, ASmallerRequestTakesTheSmallestFreeBufferThatFits) {
  StagingPool pool(4 << 20);
  {
    StagingPool::Lease big = pool.Acquire(2 << 20);
    StagingPool::Lease small = pool.Acquire(1 << 20);
  }
  StagingPool::Lease lease = pool.Acquire(512 << 10);
  EXPECT_EQ(pool.buffers_created(), 2u);
  EXPECT_EQ(lease.size(), size_t{512} << 10);
  StagingPool::Lease second = pool.Acquire(1536 << 10);  // only the 2 MiB one fits
  EXPECT_EQ(pool.buffers_created(), 2u);
  EXPECT_EQ(pool.peak(), uint64_t{3} << 20);
}

TEST(StagingPoolTest, FreeBuffersAreUnmappedToKeepMemoryUnderTheCap) {
  StagingPool pool(1 << 20);
  { StagingPool::Lease a = pool.Acquire(600 << 10); }
  // 600 KiB free cannot hold 700 KiB: it is unmapped before the new buffer is mapped.
  StagingPool::Lease b = pool.Acquire(700 << 10);
  EXPECT_EQ(pool.buffers_created(), 2u);
  EXPECT_EQ(pool.held_bytes(), uint64_t{700} << 10);
}

TEST(StagingPoolTest, ARequestLargerThanTheCapIsAdmittedAlone) {
  StagingPool pool(1 << 20);
  { StagingPool::Lease small = pool.Acquire(100 << 10); }
  StagingPool::Lease big = pool.Acquire(3 << 20);
  EXPECT_EQ(big.size(), size_t{3} << 20);
  EXPECT_EQ(pool.held_bytes(), uint64_t{3} << 20);  // the free small one went
}

TEST(StagingPoolTest, ZeroBytesIsAnEmptyLease) {
  StagingPool pool(1 << 20);
  StagingPool::Lease lease = pool.Acquire(0);
  EXPECT_EQ(lease.size(), 0u);
  EXPECT_EQ(pool.held_bytes(), 0u);
}

TEST(StagingPoolTest, ALeaseMovedAwayIsReturnedOnce) {
  StagingPool pool(1 << 20);
  StagingPool::Lease a = pool.Acquire(400 << 10);
  StagingPool::Lease b = std::move(a);
  EXPECT_EQ(pool.held_bytes(), uint64_t{400} << 10);
  b = StagingPool::Lease();
  EXPECT_EQ(pool.held_bytes(), uint64_t{400} << 10);  // free, kept
  StagingPool::Lease c = pool.Acquire(1 << 20);       // leased 0 + free 400 KiB + 1 MiB > cap
  EXPECT_EQ(pool.held_bytes(), uint64_t{1} << 20);
}

TEST(StagingPoolTest, ThreadsNeverLeaseOrHoldMoreThanTheCap) {
  constexpr uint64_t kCap = 2 << 20;
  StagingPool pool(kCap);
  std::atomic<bool> over{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const size_t size = (size_t{256} << 10) * (1 + (t + i) % 4);
        StagingPool::Lease lease = pool.Acquire(size);
        std::memset(lease.data(), t, lease.size());
        if (pool.held_bytes() > kCap) over = true;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_FALSE(over.load());
  EXPECT_LE(pool.peak(), kCap);
  EXPECT_LT(pool.buffers_created(), 1200u);  // reuse happened
}

}  // namespace
}  // namespace tensorstash
