#include "tensorstash/util/thread_pool.h"

#include <algorithm>
#include <utility>

namespace tensorstash {

int DefaultIoThreads() {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::clamp(2 * cores, 4, 32);
}

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads < 1) num_threads = 1;
  workers_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::Schedule(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

TaskGroup::~TaskGroup() { (void)Wait(); }

void TaskGroup::Run(std::function<Status()> task) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // A producer of millions of tasks (one per chunk) must not queue them all at once: each
    // queued task holds memory. It waits for room instead.
    if (max_pending_ > 0) done_cv_.wait(lock, [this] { return pending_ < max_pending_; });
    ++pending_;
  }
  pool_->Schedule([this, task = std::move(task)]() mutable {
    Status status;
    {
      // The task and what it captured are destroyed before the group counts it done: a
      // capture's destructor may touch state (a ByteLimiter, a buffer pool) that the waiting
      // thread frees as soon as Wait() returns.
      std::function<Status()> run = std::move(task);
      if (!failed()) status = run();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!status.ok() && first_error_.ok()) first_error_ = std::move(status);
    if (--pending_ == 0 || max_pending_ > 0) done_cv_.notify_all();
  });
}

void TaskGroup::Fail(Status status) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!status.ok() && first_error_.ok()) first_error_ = std::move(status);
}

bool TaskGroup::failed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return !first_error_.ok();
}

Status TaskGroup::Wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  return first_error_;
}

}  // namespace tensorstash
