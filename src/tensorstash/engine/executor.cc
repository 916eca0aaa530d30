#include "tensorstash/engine/executor.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

namespace tensorstash {

Executor::Executor(ThreadPool* pool, uint64_t cap_bytes, int max_pending, StagingPool* staging)
    : pool_(pool),
      limiter_(cap_bytes),
      own_staging_(staging != nullptr ? 0 : cap_bytes),
      staging_(staging != nullptr ? staging : &own_staging_),
      group_(pool, max_pending) {}

Executor::~Executor() { (void)Wait(); }

namespace {

// One batch of preparations, shared by the threads that run them: each takes the next one not
// yet taken, so a thread of the pool that comes late (busy with an earlier wave's writes) finds
// nothing left and leaves.
class PreparationBatch {
 public:
  PreparationBatch(std::vector<std::function<Status()>> preparations, TaskGroup* group)
      : preparations_(std::move(preparations)), group_(group) {}

  void Work() {
    for (;;) {
      const size_t i = next_.fetch_add(1);
      if (i >= preparations_.size()) return;
      // After a failure the rest are skipped: their tasks never start, so nothing reads them.
      if (!group_->failed()) {
        if (Status status = preparations_[i](); !status.ok()) group_->Fail(std::move(status));
      }
      std::lock_guard<std::mutex> lock(mutex_);
      if (++done_ == preparations_.size()) done_cv_.notify_all();
    }
  }

  void WaitUntilDone() {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return done_ == preparations_.size(); });
  }

 private:
  const std::vector<std::function<Status()>> preparations_;
  TaskGroup* const group_;
  std::atomic<size_t> next_{0};
  std::mutex mutex_;
  std::condition_variable done_cv_;
  size_t done_ = 0;
};

}  // namespace

void Executor::FinishPrepared() {
  if (preparations_.empty()) return;
  const size_t count = preparations_.size();
  auto batch = std::make_shared<PreparationBatch>(std::move(preparations_), &group_);
  preparations_.clear();
  // This thread works too: helpers for the other cores, no more than the pool has threads.
  const size_t cores = std::max(1u, std::thread::hardware_concurrency());
  const size_t helpers =
      std::min({cores - 1, static_cast<size_t>(pool_->num_threads()), count - 1});
  for (size_t i = 0; i < helpers; ++i) pool_->Schedule([batch] { batch->Work(); });
  batch->Work();
  batch->WaitUntilDone();
}

void Executor::Flush() {
  FinishPrepared();
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
    preparations_.push_back([prepare, buffer = lease->data()] { return prepare(buffer); });
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
