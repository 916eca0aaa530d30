// ThreadPool and TaskGroup: the parallelism under the writer and the reader.
//
// A ThreadPool owns N worker threads that run scheduled closures in FIFO order. A TaskGroup
// collects the Status of a batch of closures run on a pool and waits for all of them; the first
// error wins and later tasks of the group are skipped once an error is seen.
//
// Thread-safety: Schedule and TaskGroup::Run may be called from any thread, including from a
// task. Wait() must not be called from a task of the same pool (it would block a worker).
#ifndef TENSORSTASH_UTIL_THREAD_POOL_H_
#define TENSORSTASH_UTIL_THREAD_POOL_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "tensorstash/util/status.h"

namespace tensorstash {

// The default number of IO threads for a save or a restore: twice the cores (IO waits as
// well as copies), between 4 and 32.
int DefaultIoThreads();

class ThreadPool {
 public:
  // Starts `num_threads` workers (at least 1).
  explicit ThreadPool(int num_threads);
  // Runs every task already scheduled, then joins the workers.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(std::function<void()> task);
  int num_threads() const { return static_cast<int>(workers_.size()); }

 private:
  void WorkerLoop();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

class TaskGroup {
 public:
  // With `max_pending` > 0, Run waits while that many tasks of the group are queued or running,
  // so that a producer of very many tasks holds a bounded number at once. Run must then not be
  // called from a task of the same pool (it could wait for itself).
  explicit TaskGroup(ThreadPool* pool, int max_pending = 0)
      : pool_(pool), max_pending_(max_pending) {}
  // Waits for outstanding tasks.
  ~TaskGroup();

  // Schedules `task`; it is skipped (not run) when an earlier task of the group failed.
  void Run(std::function<Status()> task);
  // Waits for every task run so far; returns the first error, or OK.
  Status Wait();
  // Records an error as if a task had returned it (used by producers feeding the group).
  void Fail(Status status);
  bool failed();

 private:
  ThreadPool* pool_;
  const int max_pending_;
  std::mutex mutex_;
  std::condition_variable done_cv_;
  int pending_ = 0;
  Status first_error_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_UTIL_THREAD_POOL_H_
