#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tensorstash/testing/in_process_coordinator.h"
#include "tensorstash/coordination/single_process_coordinator.h"

namespace tensorstash {
namespace {

using std::chrono::milliseconds;

TEST(SingleProcessCoordinatorTest, KeyValueAndBarrier) {
  SingleProcessCoordinator c;
  EXPECT_EQ(c.process_count(), 1);
  EXPECT_TRUE(c.Barrier("b", milliseconds(1)).ok());
  EXPECT_TRUE(c.KeyValueSet("k", "v").ok());
  EXPECT_TRUE(absl::IsAlreadyExists(c.KeyValueSet("k", "w")));
  EXPECT_EQ(c.KeyValueGet("k", milliseconds(1)).value(), "v");
  EXPECT_TRUE(absl::IsNotFound(c.KeyValueGet("missing", milliseconds(1)).status()));
  EXPECT_EQ(c.KeyValueTryGet("k").value(), std::optional<std::string>("v"));
  EXPECT_EQ(c.KeyValueTryGet("missing").value(), std::nullopt);
  EXPECT_EQ(c.NextOperationId(), 0u);
  EXPECT_EQ(c.NextOperationId(), 1u);
}

TEST(InProcessCoordinatorTest, ProcessesExchangeValuesAndMeetAtBarriers) {
  constexpr int kProcesses = 4;
  auto group = std::make_shared<InProcessCoordinatorGroup>(kProcesses);
  std::vector<std::string> seen(kProcesses);
  std::vector<Status> results(kProcesses);
  std::vector<std::thread> threads;
  for (int p = 0; p < kProcesses; ++p) {
    threads.emplace_back([&, p] {
      InProcessCoordinator c(group, p);
      Status s = c.KeyValueSet(StrCat("from/", p), StrCat("v", p));
      if (s.ok()) s = c.Barrier("after-set", milliseconds(5000));
      for (int q = 0; q < kProcesses && s.ok(); ++q) {
        auto v = c.KeyValueGet(StrCat("from/", q), milliseconds(5000));
        if (!v.ok())
          s = v.status();
        else
          seen[p] += *v;
      }
      results[p] = s;
    });
  }
  for (auto& t : threads) t.join();
  for (int p = 0; p < kProcesses; ++p) {
    EXPECT_TRUE(results[p].ok()) << results[p];
    EXPECT_EQ(seen[p], "v0v1v2v3");
  }
}

// A try-get answers at once, before and after another process sets the key.
TEST(InProcessCoordinatorTest, TryGetDoesNotWait) {
  auto group = std::make_shared<InProcessCoordinatorGroup>(2);
  InProcessCoordinator reader(group, 0);
  InProcessCoordinator writer(group, 1);
  auto before = reader.KeyValueTryGet("address/1");
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(*before, std::nullopt);
  ASSERT_TRUE(writer.KeyValueSet("address/1", "127.0.0.1:4000").ok());
  auto after = reader.KeyValueTryGet("address/1");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*after, std::optional<std::string>("127.0.0.1:4000"));
}

TEST(InProcessCoordinatorTest, TimeoutsNameWhatWasAwaited) {
  auto group = std::make_shared<InProcessCoordinatorGroup>(2);
  InProcessCoordinator c(group, 0);
  Status barrier = c.Barrier("lonely", milliseconds(20));
  EXPECT_TRUE(absl::IsDeadlineExceeded(barrier));
  EXPECT_NE(std::string(barrier.message()).find("lonely"), std::string::npos);
  auto value = c.KeyValueGet("never", milliseconds(20));
  EXPECT_TRUE(absl::IsDeadlineExceeded(value.status()));
  EXPECT_NE(std::string(value.status().message()).find("never"), std::string::npos);
}

}  // namespace
}  // namespace tensorstash
