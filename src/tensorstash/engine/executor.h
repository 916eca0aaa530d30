// Executor: runs the tasks of a save or restore plan on a thread pool, with the bytes they
// hold at once under a cap.
//
// Every save and restore runs the same way: tasks in the plan's order (write a chunk, read a
// span, decode a chunk), each needing some memory while it runs (a gathered chunk, a read span,
// a decoded chunk, an encoder's output). The calling thread admits the tasks in order: it waits
// until a task's bytes fit under the cap, then hands the task to the pool. A task larger than
// the cap runs alone, so that nothing can wait forever; the peak is max(cap, largest task).
//
// Three ways to run a task:
//   Run(bytes, task)              task(buffer) on the pool, with a staging buffer of `bytes`
//                                 leased from a pool of reused buffers (null when 0).
//   RunHolding(bytes, task)       task() on the pool, holding `bytes` of the cap for memory the
//                                 task gets elsewhere (a mapping, an encoder's output).
//   RunPrepared(bytes, prep, task) prep(buffer), then task(buffer) on the pool: an async save
//                                 copies every chunk out of the caller's arrays under the cap.
//                                 The preparations wait, and then run side by side on the
//                                 calling thread and the pool's threads (at most one thread per
//                                 core): a copy is memory-bound, and one core alone does not
//                                 reach the memory's speed. They run, and then the tasks of the
//                                 prepared buffers start, when the cap is reached (the copying
//                                 then goes on in waves, as the pool frees staging), at Flush(),
//                                 at the next Run or RunHolding, or at Wait(); FinishPrepared()
//                                 runs them without starting the tasks. The copying, which the
//                                 caller waits for, so gets the cores to itself while it can.
// After a failure (a task's, a preparation's or Fail's) tasks and preparations not yet started
// are skipped and Run* return at once; Wait() returns the first error.
//
// Thread-safety: Run*, Fail and Wait are called from one thread, which must not be a thread of
// the pool (it may wait for the pool's tasks). Tasks run concurrently.
#ifndef TENSORSTASH_ENGINE_EXECUTOR_H_
#define TENSORSTASH_ENGINE_EXECUTOR_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "tensorstash/util/byte_limiter.h"
#include "tensorstash/util/staging_pool.h"
#include "tensorstash/util/status.h"
#include "tensorstash/util/thread_pool.h"

namespace tensorstash {

// The default cap of saves and restores (WriterOptions, ReaderOptions, OrbaxWriterOptions).
inline constexpr uint64_t kDefaultMaxInflightBytes = uint64_t{256} << 20;

class Executor {
 public:
  // `cap_bytes`: the most bytes tasks hold at once (0 counts as 1). With `max_pending` > 0, at
  // most that many tasks are queued or running at once (a plan of millions of tiny tasks).
  // `staging`: the pool staging buffers come from (null: one of the executor's own, under
  // `cap_bytes`); it must outlive the executor.
  Executor(ThreadPool* pool, uint64_t cap_bytes, int max_pending = 0,
           StagingPool* staging = nullptr);
  // Waits for the tasks started.
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  void Run(uint64_t bytes, std::function<Status(char* buffer)> task);
  void RunHolding(uint64_t bytes, std::function<Status()> task);
  void RunPrepared(uint64_t bytes, const std::function<Status(char* buffer)>& prepare,
                   std::function<Status(char* buffer)> task);

  // Runs the preparations of RunPrepared that wait (on this thread and the pool's), and returns
  // when they are done; their tasks still wait. Afterwards failed() tells whether one failed.
  void FinishPrepared();
  // FinishPrepared, then starts the tasks of RunPrepared that wait for their turn.
  void Flush();

  // Records an error as if a task had returned it: the calling thread's own failure.
  void Fail(Status status) { group_.Fail(std::move(status)); }
  bool failed() { return group_.failed(); }
  // Waits for every task started; the first error, or OK.
  Status Wait() {
    Flush();
    return group_.Wait();
  }

  // The most bytes held at once so far, and the most of them in staging buffers.
  uint64_t peak_bytes() const { return limiter_.peak(); }
  uint64_t peak_staging_bytes() const { return staging_->peak(); }

 private:
  void Start(uint64_t bytes, bool with_buffer, const std::function<Status(char* buffer)>& prepare,
             std::function<Status(char* buffer)> task);

  ThreadPool* pool_;
  ByteLimiter limiter_;
  StagingPool own_staging_;
  StagingPool* staging_;  // leases stay within limiter_'s reservations, so never wait here
  std::vector<std::function<Status()>> preparations_;  // not yet run
  std::vector<std::function<Status()>> deferred_;      // prepared tasks not yet started
  TaskGroup group_;  // last: destroyed (waiting for the tasks) before the above
};

}  // namespace tensorstash

#endif  // TENSORSTASH_ENGINE_EXECUTOR_H_
