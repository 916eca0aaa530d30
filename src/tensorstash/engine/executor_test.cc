#include "tensorstash/engine/executor.h"
#include "tensorstash/util/staging_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

// Tracks the bytes tasks hold while they run.
struct Held {
  std::atomic<uint64_t> now{0};
  std::atomic<uint64_t> peak{0};
  std::atomic<int> running{0};
  std::atomic<int> most_running{0};

  void Enter(uint64_t bytes) {
    const uint64_t total = now.fetch_add(bytes) + bytes;
    uint64_t seen = peak.load();
    while (total > seen && !peak.compare_exchange_weak(seen, total)) {
    }
    const int count = running.fetch_add(1) + 1;
    int most = most_running.load();
    while (count > most && !most_running.compare_exchange_weak(most, count)) {
    }
  }
  void Leave(uint64_t bytes) {
    running.fetch_sub(1);
    now.fetch_sub(bytes);
  }
};

TEST(ExecutorTest, TasksHoldNoMoreThanTheCapAtOnce) {
  ThreadPool pool(4);
  Held held;
  std::atomic<int> ran{0};
  {
    Executor run(&pool, /*cap_bytes=*/100);
    for (int i = 0; i < 24; ++i) {
      const uint64_t bytes = 30;
      auto task = [&, bytes, i](char* buffer) {
        held.Enter(bytes);
        std::memset(buffer, i, bytes);  // the whole buffer is ours (ASan checks)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        held.Leave(bytes);
        ++ran;
        return OkStatus();
      };
      if (i % 2 == 0) {
        run.Run(bytes, task);
      } else {
        run.RunHolding(bytes, [task] { return task(std::vector<char>(30).data()); });
      }
    }
    TS_ASSERT_OK(run.Wait());
    EXPECT_LE(run.peak_bytes(), 100u);
    EXPECT_LE(run.peak_staging_bytes(), 100u);
  }
  EXPECT_EQ(ran.load(), 24);
  EXPECT_LE(held.peak.load(), 100u);
}

TEST(ExecutorTest, ATaskLargerThanTheCapRunsAlone) {
  ThreadPool pool(4);
  Held held;
  Executor run(&pool, /*cap_bytes=*/10);
  bool big_ran_alone = false;
  for (int i = 0; i < 9; ++i) {
    const uint64_t bytes = i == 4 ? 50 : 5;
    run.Run(bytes, [&, bytes](char* buffer) {
      held.Enter(bytes);
      if (bytes == 50) {
        std::memset(buffer, 1, 50);
        big_ran_alone = held.running.load() == 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      held.Leave(bytes);
      return OkStatus();
    });
  }
  TS_ASSERT_OK(run.Wait());
  EXPECT_TRUE(big_ran_alone);
  EXPECT_EQ(run.peak_bytes(), 50u);
}

TEST(ExecutorTest, NoBytesMeansNoBuffer) {
  ThreadPool pool(1);
  Executor run(&pool, 1);
  char* seen = reinterpret_cast<char*>(1);
  run.Run(0, [&](char* buffer) {
    seen = buffer;
    return OkStatus();
  });
  TS_ASSERT_OK(run.Wait());
  EXPECT_EQ(seen, nullptr);
}

TEST(ExecutorTest, EachBufferIsPreparedOnceBeforeItsTask) {
  ThreadPool pool(2);
  Executor run(&pool, /*cap_bytes=*/16);
  std::mutex mutex;
  std::vector<int> prepared;
  std::atomic<int> checked{0};
  for (int i = 0; i < 10; ++i) {
    run.RunPrepared(
        8,
        [&, i](char* buffer) {
          std::memset(buffer, 'a' + i, 8);
          std::lock_guard<std::mutex> lock(mutex);
          prepared.push_back(i);
          return OkStatus();
        },
        [&, i](char* buffer) {
          if (buffer[0] == 'a' + i && buffer[7] == 'a' + i) ++checked;
          return OkStatus();
        });
  }
  TS_ASSERT_OK(run.Wait());
  std::sort(prepared.begin(), prepared.end());
  EXPECT_EQ(prepared, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(checked.load(), 10);
  EXPECT_LE(run.peak_bytes(), 16u);
}

TEST(ExecutorTest, FinishPreparedCopiesEverythingAndStartsNoTask) {
  // Many preparations under a large cap: FinishPrepared returns once all are done (on this
  // thread and the pool's), and no task has started before Flush.
  ThreadPool pool(4);
  Executor run(&pool, /*cap_bytes=*/1 << 20);
  std::atomic<int> prepared{0};
  std::atomic<int> started{0};
  std::mutex mutex;
  std::set<std::thread::id> threads;
  for (int i = 0; i < 64; ++i) {
    run.RunPrepared(
        1024,
        [&](char* buffer) {
          std::memset(buffer, 1, 1024);
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          {
            std::lock_guard<std::mutex> lock(mutex);
            threads.insert(std::this_thread::get_id());
          }
          ++prepared;
          return OkStatus();
        },
        [&](char*) {
          ++started;
          return OkStatus();
        });
  }
  run.FinishPrepared();
  EXPECT_EQ(prepared.load(), 64);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(started.load(), 0);
  EXPECT_TRUE(threads.count(std::this_thread::get_id()) == 1) << "the caller copies too";
  if (std::thread::hardware_concurrency() > 1) {
    EXPECT_GE(threads.size(), 2u) << "the pool's threads copy beside the caller";
  }
  TS_ASSERT_OK(run.Wait());
  EXPECT_EQ(started.load(), 64);
}

TEST(ExecutorTest, PreparedTasksWaitUntilTheCapIsReachedOrFlush) {
  ThreadPool pool(2);
  Executor run(&pool, /*cap_bytes=*/32);
  std::atomic<int> started{0};
  auto prepared = [&](int n) {
    for (int i = 0; i < n; ++i) {
      run.RunPrepared(
          8, [](char*) { return OkStatus(); },
          [&](char*) {
            ++started;
            return OkStatus();
          });
    }
  };
  // 4 x 8 bytes fit under the cap: copied, none written yet.
  prepared(4);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(started.load(), 0);
  // A fifth does not fit: the waiting ones start, and it is admitted once one of them has
  // freed its staging.
  prepared(1);
  EXPECT_GE(started.load(), 1);
  run.Flush();
  TS_ASSERT_OK(run.Wait());
  EXPECT_EQ(started.load(), 5);
  EXPECT_LE(run.peak_bytes(), 32u);
}

TEST(ExecutorTest, ASharedStagingPoolKeepsItsBuffersForTheNextExecutor) {
  ThreadPool pool(2);
  StagingPool staging(1 << 20);
  for (int round = 0; round < 2; ++round) {
    Executor run(&pool, 1 << 20, /*max_pending=*/0, &staging);
    for (int i = 0; i < 4; ++i) {
      run.RunPrepared(
          64 << 10,
          [](char* buffer) {
            std::memset(buffer, 1, 64 << 10);
            return OkStatus();
          },
          [](char*) { return OkStatus(); });
    }
    TS_ASSERT_OK(run.Wait());
    // Every buffer came back to the pool and stays mapped for the next save; the second round
    // maps nothing new.
    EXPECT_EQ(staging.held_bytes(), 4u * (64 << 10)) << round;
  }
}

TEST(ExecutorTest, PreparedTasksNeverWaitForBuffersThatWaitingTasksHold) {
  // The shared pool keeps two 16-byte buffers from an earlier save; this save asks for 8 bytes
  // at a time. Each lease is a 16-byte buffer, so the pool is full after two leases while the
  // cap of bytes (8 each) still has room: the third copy must start the waiting tasks rather
  // than wait for buffers only they can return.
  ThreadPool pool(2);
  StagingPool staging(32);
  {
    Executor earlier(&pool, 32, /*max_pending=*/0, &staging);
    for (int i = 0; i < 2; ++i) {
      earlier.RunPrepared(
          16, [](char*) { return OkStatus(); }, [](char*) { return OkStatus(); });
    }
    TS_ASSERT_OK(earlier.Wait());
  }
  Executor run(&pool, 32, /*max_pending=*/0, &staging);
  std::atomic<int> written{0};
  for (int i = 0; i < 6; ++i) {
    run.RunPrepared(
        8,
        [](char* buffer) {
          std::memset(buffer, 7, 8);
          return OkStatus();
        },
        [&](char*) {
          ++written;
          return OkStatus();
        });
  }
  TS_ASSERT_OK(run.Wait());
  EXPECT_EQ(written.load(), 6);
}

TEST(ExecutorTest, TheFirstFailureStopsWhatHasNotStarted) {
  ThreadPool pool(1);
  Executor run(&pool, /*cap_bytes=*/1);
  std::atomic<int> ran{0};
  run.RunHolding(1, [&] {
    ++ran;
    return DataLossError("first");
  });
  // Admitting the next task waits for the failed one's byte: it is then skipped.
  run.RunHolding(1, [&] {
    ++ran;
    return OkStatus();
  });
  EXPECT_TRUE(run.failed());
  run.Run(1, [&](char*) {
    ++ran;
    return OkStatus();
  });
  Status status = run.Wait();
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_EQ(status.message(), "first");
  EXPECT_EQ(ran.load(), 1);
}

TEST(ExecutorTest, AFailedPreparationIsTheRunsError) {
  ThreadPool pool(2);
  Executor run(&pool, 64);
  bool task_ran = false;
  run.RunPrepared(
      8, [](char*) { return InvalidArgumentError("cannot copy"); },
      [&](char*) {
        task_ran = true;
        return OkStatus();
      });
  run.FinishPrepared();
  EXPECT_TRUE(run.failed());
  EXPECT_TRUE(absl::IsInvalidArgument(run.Wait()));
  EXPECT_FALSE(task_ran);
}

}  // namespace
}  // namespace tensorstash
