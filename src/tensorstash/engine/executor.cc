#include "tensorstash/engine/executor.h"

#include <memory>
#include <optional>
#include <utility>

namespace tensorstash {

Executor::Executor(ThreadPool* pool, uint64_t cap_bytes, int max_pending, StagingPool* staging)
    : limiter_(cap_bytes),
      own_staging_(staging != nullptr ? 0 : cap_bytes),
      staging_(staging != nullptr ? staging : &own_staging_),
      group_(pool, max_pending) {}

Executor::~Executor() { (void)Wait(); }

void Executor::Flush() {
  for (std::function<Status()>& task : deferred_) group_.Run(std::move(task));
  deferred_.clear();
}

void Executor::Start(uint64_t bytes, bool with_buffer,
                     const std::function<Status(char* buffer)>& prepare,
                     std::function<Status(char* buffer)> task) {
  if (group_.failed()) return;
  // Shared: the pool takes copyable callables.
  std::shared_ptr<ByteReservation> held;
  if (prepare) {
    // The waiting tasks start when this one's bytes do not fit: they free the staging.
    if (!limiter_.TryAcquire(bytes)) {
      Flush();
      limiter_.Acquire(bytes);
    }
    held = std::make_shared<ByteReservation>(&limiter_, bytes, ByteReservation::Adopt{});
  } else {
    Flush();
    held = std::make_shared<ByteReservation>(&limiter_, bytes);
  }
  // Waiting for the bytes may have taken until a task failed: then nothing more starts.
  if (group_.failed()) return;
  StagingPool::Lease leased;
  if (with_buffer && bytes > 0) {
    std::optional<StagingPool::Lease> now = staging_->TryAcquire(bytes);
    if (!now.has_value()) {
      // The pool's buffers are held by waiting tasks (buffers may be larger than asked for, so
      // the cap of bytes can have room while the pool has none): they start, and free them.
      Flush();
      now = staging_->Acquire(bytes);
    }
    leased = std::move(*now);
  }
  auto lease = std::make_shared<StagingPool::Lease>(std::move(leased));
  if (prepare) {
    if (Status prepared = prepare(lease->data()); !prepared.ok()) {
      group_.Fail(std::move(prepared));
      return;
    }
  }
  std::function<Status()> run = [this, held = std::move(held), lease = std::move(lease),
                                 task = std::move(task)]() mutable {
    Status status = task(lease->data());
    // The failure is recorded before the bytes come back, so that a task admitted with them
    // is never started after it.
    if (!status.ok()) group_.Fail(status);
    lease.reset();
    held.reset();
    return status;
  };
  if (prepare) {
    deferred_.push_back(std::move(run));
  } else {
    group_.Run(std::move(run));
  }
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
