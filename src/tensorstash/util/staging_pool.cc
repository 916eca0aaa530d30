#include "tensorstash/util/staging_pool.h"

#include <algorithm>
#include <optional>
#include <utility>

namespace tensorstash {

StagingPool::Lease::Lease(Lease&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      buffer_(std::move(other.buffer_)),
      size_(std::exchange(other.size_, 0)) {}

StagingPool::Lease& StagingPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Return();
    pool_ = std::exchange(other.pool_, nullptr);
    buffer_ = std::move(other.buffer_);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

StagingPool::Lease::~Lease() { Return(); }

void StagingPool::Lease::Return() {
  if (pool_ != nullptr) std::exchange(pool_, nullptr)->Return(std::move(buffer_));
  size_ = 0;
}

StagingPool::Lease StagingPool::Acquire(size_t size) {
  std::optional<Lease> lease = Take(size, /*wait=*/true);
  return std::move(*lease);
}

std::optional<StagingPool::Lease> StagingPool::TryAcquire(size_t size) {
  return Take(size, /*wait=*/false);
}

std::optional<StagingPool::Lease> StagingPool::Take(size_t size, bool wait) {
  std::vector<StagingBuffer> unmap;  // freed after the lock is dropped
  StagingBuffer buffer;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    auto fits = [&] { return leased_ == 0 || leased_ + size <= cap_; };
    if (!wait && !fits()) return std::nullopt;
    cv_.wait(lock, fits);
    // The smallest free buffer that fits, unless it would push the leased bytes past the cap.
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->size() >= size && (best == free_.end() || it->size() < best->size())) best = it;
    }
    if (best != free_.end() && (leased_ == 0 || leased_ + best->size() <= cap_)) {
      buffer = std::move(*best);
      free_.erase(best);
      free_bytes_ -= buffer.size();
    } else {
      // Make room for a new buffer: unmap free ones, largest first, until it fits.
      std::sort(free_.begin(), free_.end(),
                [](const StagingBuffer& a, const StagingBuffer& b) { return a.size() < b.size(); });
      while (!free_.empty() && leased_ + free_bytes_ + size > cap_) {
        free_bytes_ -= free_.back().size();
        unmap.push_back(std::move(free_.back()));
        free_.pop_back();
      }
      ++created_;
    }
    leased_ += buffer.size() > 0 ? buffer.size() : size;
    peak_ = std::max(peak_, leased_);
  }
  unmap.clear();
  if (buffer.data() == nullptr && size > 0) buffer = StagingBuffer(size);
  return Lease(this, std::move(buffer), size);
}

void StagingPool::Return(StagingBuffer buffer) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t capacity = buffer.size();
    leased_ -= capacity;
    if (capacity > 0) {
      free_bytes_ += capacity;
      free_.push_back(std::move(buffer));
    }
    // Notified under the lock: a waiter may destroy the pool as soon as it sees leased_ == 0.
    cv_.notify_all();
  }
}

uint64_t StagingPool::peak() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}

uint64_t StagingPool::buffers_created() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return created_;
}

uint64_t StagingPool::held_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return leased_ + free_bytes_;
}

}  // namespace tensorstash
