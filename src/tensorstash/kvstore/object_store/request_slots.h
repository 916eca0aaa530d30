// RequestSlots: a counting semaphore, the cap on requests an object-store driver has in flight.
// Acquire waits (without limit) until a slot is free; it never fails. A count below 1 is taken
// as 1, so that a misconfigured store is slow rather than stuck.
//
// Thread-safety: every method may be called from several threads at once.
#ifndef TENSORSTASH_KVSTORE_OBJECT_STORE_REQUEST_SLOTS_H_
#define TENSORSTASH_KVSTORE_OBJECT_STORE_REQUEST_SLOTS_H_

#include <algorithm>
#include <condition_variable>
#include <mutex>

namespace tensorstash {

class RequestSlots {
 public:
  explicit RequestSlots(int count) : free_(std::max(1, count)) {}
  RequestSlots(const RequestSlots&) = delete;
  RequestSlots& operator=(const RequestSlots&) = delete;

  void Acquire() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return free_ > 0; });
    --free_;
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++free_;
    }
    cv_.notify_one();
  }
  // The slots free now (for tests and diagnostics).
  int Free() const {
    std::lock_guard<std::mutex> lock(mu_);
    return free_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int free_;
};

// Holds one slot for its lifetime.
class RequestSlot {
 public:
  explicit RequestSlot(RequestSlots& slots) : slots_(slots) { slots_.Acquire(); }
  ~RequestSlot() { slots_.Release(); }
  RequestSlot(const RequestSlot&) = delete;
  RequestSlot& operator=(const RequestSlot&) = delete;

 private:
  RequestSlots& slots_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_OBJECT_STORE_REQUEST_SLOTS_H_
