#include "tensorstash/kvstore/object_store/retry.h"

#include <algorithm>
#include <cstdint>
#include <random>

namespace tensorstash {

std::chrono::milliseconds RetryPolicy::Backoff(int attempt) const {
  thread_local std::mt19937_64 rng(std::random_device{}());
  const int64_t cap = std::max<int64_t>(
      0, std::min<int64_t>(max_backoff.count(),
                           initial_backoff.count() << std::clamp(attempt, 0, 20)));
  std::uniform_int_distribution<int64_t> jitter(cap / 2, cap);
  return std::chrono::milliseconds(jitter(rng));
}

}  // namespace tensorstash
