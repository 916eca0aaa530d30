#include "tensorstash/util/byte_limiter.h"

#include <algorithm>

namespace tensorstash {

void ByteLimiter::Acquire(uint64_t bytes) {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return held_ == 0 || held_ + bytes <= cap_; });
  held_ += bytes;
  peak_ = std::max(peak_, held_);
}

bool ByteLimiter::TryAcquire(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (held_ != 0 && held_ + bytes > cap_) return false;
  held_ += bytes;
  peak_ = std::max(peak_, held_);
  return true;
}

void ByteLimiter::Release(uint64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    held_ -= bytes;
  }
  cv_.notify_all();
}

uint64_t ByteLimiter::peak() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}

}  // namespace tensorstash
