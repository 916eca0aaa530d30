// StagingPool: staging buffers under a byte cap, reused instead of mapped afresh.
//
// A restore or an async save stages many chunks of similar sizes. A fresh StagingBuffer per
// chunk costs a page fault and a page zeroing for every 4 KiB of it: the profile of a restore
// into CPU memory showed more time in the kernel clearing pages than in copying the data. The
// pool keeps returned buffers and hands them out again.
//
// Acquire(n) blocks until the bytes leased plus n fit under the cap (a single request larger than
// the cap is admitted alone, like ByteLimiter), then leases a free buffer of at least n bytes
// (the smallest one that fits) or maps a new one. Memory held, leased plus free, stays within
// max(cap, largest request): free buffers are unmapped to make room before a new one is mapped.
// Everything is unmapped when the pool is destroyed; leases must end before that.
//
// Thread-safety: Acquire and the end of a lease may happen on any threads at once.
#ifndef TENSORSTASH_UTIL_STAGING_POOL_H_
#define TENSORSTASH_UTIL_STAGING_POOL_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "tensorstash/util/staging_buffer.h"

namespace tensorstash {

class StagingPool {
 public:
  // A buffer of at least the requested size, returned to the pool when destroyed. Its first
  // size() bytes are the caller's to use (contents unspecified).
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();

    char* data() const { return buffer_.data(); }
    size_t size() const { return size_; }

   private:
    friend class StagingPool;
    Lease(StagingPool* pool, StagingBuffer buffer, size_t size)
        : pool_(pool), buffer_(std::move(buffer)), size_(size) {}
    void Return();
    StagingPool* pool_ = nullptr;
    StagingBuffer buffer_;
    size_t size_ = 0;
  };

  explicit StagingPool(uint64_t cap_bytes) : cap_(cap_bytes == 0 ? 1 : cap_bytes) {}
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // Blocks until `size` bytes fit under the cap; aborts like operator new if memory runs out.
  Lease Acquire(size_t size);
  // As Acquire, but nullopt at once where Acquire would wait (leases held by others must come
  // back first: the buffers leased may be larger than the sizes asked for).
  std::optional<Lease> TryAcquire(size_t size);

  uint64_t cap() const { return cap_; }
  // The most bytes leased at once so far (for tests and reports).
  uint64_t peak() const;
  // Buffers mapped so far (for tests: reuse keeps this low).
  uint64_t buffers_created() const;
  // Bytes of memory held now, leased and free (for tests: never above the cap).
  uint64_t held_bytes() const;

 private:
  std::optional<Lease> Take(size_t size, bool wait);
  void Return(StagingBuffer buffer);

  const uint64_t cap_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  uint64_t leased_ = 0;      // capacity of the buffers out on lease
  uint64_t free_bytes_ = 0;  // capacity of the buffers in free_
  uint64_t peak_ = 0;
  uint64_t created_ = 0;
  std::vector<StagingBuffer> free_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_UTIL_STAGING_POOL_H_
