// ByteLimiter: bounds the bytes in flight (staging buffers) during a save or a restore.
//
// Acquire(n) blocks until the bytes held plus n fit under the cap. A single request larger than
// the cap is admitted alone (when nothing else is held) so that it cannot deadlock; the peak is
// then max(cap, largest request). Thread-safe.
#ifndef TENSORSTASH_UTIL_BYTE_LIMITER_H_
#define TENSORSTASH_UTIL_BYTE_LIMITER_H_

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace tensorstash {

class ByteLimiter {
 public:
  explicit ByteLimiter(uint64_t cap_bytes) : cap_(cap_bytes == 0 ? 1 : cap_bytes) {}

  void Acquire(uint64_t bytes);
  // Acquire if it would not wait; false (nothing held) if it would.
  bool TryAcquire(uint64_t bytes);
  void Release(uint64_t bytes);

  uint64_t cap() const { return cap_; }
  // The most bytes held at once so far (for tests and reports).
  uint64_t peak() const;

 private:
  const uint64_t cap_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  uint64_t held_ = 0;
  uint64_t peak_ = 0;
};

// Holds bytes of a ByteLimiter for its lifetime.
class ByteReservation {
 public:
  ByteReservation(ByteLimiter* limiter, uint64_t bytes) : limiter_(limiter), bytes_(bytes) {
    if (bytes_ > 0) limiter_->Acquire(bytes_);
  }
  // Takes over `bytes` the caller already acquired.
  struct Adopt {};
  ByteReservation(ByteLimiter* limiter, uint64_t bytes, Adopt) : limiter_(limiter), bytes_(bytes) {}
  ~ByteReservation() {
    if (bytes_ > 0) limiter_->Release(bytes_);
  }
  ByteReservation(const ByteReservation&) = delete;
  ByteReservation& operator=(const ByteReservation&) = delete;

 private:
  ByteLimiter* limiter_;
  uint64_t bytes_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_UTIL_BYTE_LIMITER_H_
