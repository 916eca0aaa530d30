#include "tensorstash/engine/executor.h"

#include <memory>
#include <utility>

namespace tensorstash {

Executor::Executor(ThreadPool* pool, uint64_t cap_bytes, int max_pending)
    : limiter_(cap_bytes), staging_(cap_bytes), group_(pool, max_pending) {}

Executor::~Executor() { (void)group_.Wait(); }

void Executor::Start(uint64_t bytes, bool with_buffer,
                     const std::function<Status(char* buffer)>& prepare,
                     std::function<Status(char* buffer)> task) {
  if (group_.failed()) return;
  // Shared: the pool takes copyable callables.
  auto held = std::make_shared<ByteReservation>(&limiter_, bytes);
  // Waiting for the bytes may have taken until a task failed: then nothing more starts.
  if (group_.failed()) return;
  auto lease = std::make_shared<StagingPool::Lease>(
      with_buffer && bytes > 0 ? staging_.Acquire(bytes) : StagingPool::Lease());
  if (prepare) {
    if (Status prepared = prepare(lease->data()); !prepared.ok()) {
      group_.Fail(std::move(prepared));
      return;
    }
  }
  group_.Run(
      [this, held = std::move(held), lease = std::move(lease), task = std::move(task)]() mutable {
        Status status = task(lease->data());
        // The failure is recorded before the bytes come back, so that a task admitted with them
        // is never started after it.
        if (!status.ok()) group_.Fail(status);
        lease.reset();
        held.reset();
        return status;
      });
}

void Executor::Run(uint64_t bytes, std::function<Status(char* buffer)> task) {
  Start(bytes, /*with_buffer=*/true, nullptr, std::move(task));
}

void Executor::RunHolding(uint64_t bytes, std::function<Status()> task) {
  Start(bytes, /*with_buffer=*/false, nullptr, [task = std::move(task)](char*) { return task(); });
}

void Executor::RunPrepared(uint64_t bytes, const std::function<Status(char* buffer)>& prepare,
                           std::function<Status(char* buffer)> task) {
  Start(bytes, /*with_buffer=*/true, prepare, std::move(task));
}

}  // namespace tensorstash
