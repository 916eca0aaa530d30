#include "tensorstash/engine/executor.h"

#include <memory>
#include <utility>

namespace tensorstash {

Executor::Executor(ThreadPool* pool, uint64_t cap_bytes, int max_pending)
    : limiter_(cap_bytes), staging_(cap_bytes), group_(pool, max_pending) {}

Executor::~Executor() { (void)group_.Wait(); }

void Executor::Run(uint64_t bytes, std::function<Status(char* buffer)> task) {
  if (group_.failed()) return;
  // Shared: the pool takes copyable callables. Both return when the task ends; the lease first,
  // so that the bytes are back in the pool when the limiter lets the next task in.
  auto held = std::make_shared<ByteReservation>(&limiter_, bytes);
  auto lease = std::make_shared<StagingPool::Lease>(bytes > 0 ? staging_.Acquire(bytes)
                                                              : StagingPool::Lease());
  group_.Run([held = std::move(held), lease = std::move(lease), task = std::move(task)]() mutable {
    Status status = task(lease->data());
    lease.reset();
    held.reset();
    return status;
  });
}

void Executor::RunHolding(uint64_t bytes, std::function<Status()> task) {
  if (group_.failed()) return;
  auto held = std::make_shared<ByteReservation>(&limiter_, bytes);
  group_.Run([held = std::move(held), task = std::move(task)]() mutable {
    Status status = task();
    held.reset();
    return status;
  });
}

void Executor::RunPrepared(uint64_t bytes, const std::function<Status(char* buffer)>& prepare,
                           std::function<Status(char* buffer)> task) {
  if (group_.failed()) return;
  auto held = std::make_shared<ByteReservation>(&limiter_, bytes);
  auto lease = std::make_shared<StagingPool::Lease>(bytes > 0 ? staging_.Acquire(bytes)
                                                              : StagingPool::Lease());
  if (Status prepared = prepare(lease->data()); !prepared.ok()) {
    group_.Fail(std::move(prepared));
    return;
  }
  group_.Run([held = std::move(held), lease = std::move(lease), task = std::move(task)]() mutable {
    Status status = task(lease->data());
    lease.reset();
    held.reset();
    return status;
  });
}

}  // namespace tensorstash
