#include "tensorstash/manager/background_worker.h"

#include <atomic>

#include "gtest/gtest.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

TEST(BackgroundWorkerTest, RunsWorkAndDeliversItsErrorOnce) {
  BackgroundWorker worker;
  TS_EXPECT_OK(worker.Join());  // nothing in flight
  std::atomic<int> runs{0};
  worker.Start([&] {
    ++runs;
    return DataLossError("the first");
  });
  const Status first = worker.Join();
  EXPECT_TRUE(absl::IsDataLoss(first)) << first;
  TS_EXPECT_OK(worker.Join());  // delivered once
  worker.Start([&] {
    ++runs;
    return OkStatus();
  });
  TS_EXPECT_OK(worker.Join());
  EXPECT_EQ(runs.load(), 2);
}

TEST(BackgroundWorkerTest, DestructionWaitsForTheWork) {
  std::atomic<bool> done{false};
  {
    BackgroundWorker worker;
    worker.Start([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      done = true;
      return OkStatus();
    });
  }
  EXPECT_TRUE(done.load());
}

}  // namespace
}  // namespace tensorstash
