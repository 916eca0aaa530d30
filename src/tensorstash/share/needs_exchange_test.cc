#include "tensorstash/share/needs_exchange.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/in_process_coordinator.h"
#include "tensorstash/util/base64.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

std::vector<SharedArray> Arrays() {
  SharedArray w;
  w.path = "w";
  w.grid = ChunkGrid{{8, 4}, {2, 4}, {2, 4}};
  w.chunk_bytes.assign(4, 32);
  return {w};
}

// Runs ExchangeNeeds in `n` threads, process p needing needs[p].
std::vector<Result<JobNeeds>> RunExchange(const std::vector<ProcessNeeds>& needs,
                                          std::vector<NeedsExchangeStats>* stats) {
  const int n = static_cast<int>(needs.size());
  auto group = std::make_shared<InProcessCoordinatorGroup>(n);
  std::vector<Result<JobNeeds>> out(n, InternalError("not run"));
  stats->assign(n, {});
  std::vector<std::thread> threads;
  const std::vector<SharedArray> arrays = Arrays();
  for (int p = 0; p < n; ++p) {
    threads.emplace_back([&, p] {
      InProcessCoordinator coordinator(group, p);
      out[p] = ExchangeNeeds(coordinator, "restore/1/", needs[p], arrays, std::chrono::seconds(20),
                             &(*stats)[p]);
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

TEST(NeedsExchangeTest, EveryProcessGetsTheSameGroupedNeeds) {
  const ProcessNeeds top{{{Box({0, 0}, {4, 4})}}};
  const ProcessNeeds bottom{{{Box({4, 0}, {4, 4})}}};
  const std::vector<ProcessNeeds> needs = {top, bottom, top, bottom};
  std::vector<NeedsExchangeStats> stats;
  auto got = RunExchange(needs, &stats);
  const JobNeeds expected = GroupNeeds(needs);
  const uint64_t list_bytes = Base64Encode(EncodeNeeds(top)).size();
  for (int p = 0; p < 4; ++p) {
    ASSERT_TRUE(got[p].ok()) << got[p].status();
    EXPECT_EQ(got[p]->distinct, expected.distinct) << "process " << p;
    EXPECT_EQ(got[p]->list_of_process, expected.list_of_process) << "process " << p;
    EXPECT_EQ(stats[p].distinct_lists, 2);
    EXPECT_EQ(stats[p].bytes_sent, list_bytes + 32);
    // Three digests, and the one list of the other half (its own half's is not read).
    EXPECT_EQ(stats[p].bytes_received, 3 * 32 + list_bytes) << "process " << p;
  }
}

TEST(NeedsExchangeTest, OneProcessSendsNothing) {
  std::vector<NeedsExchangeStats> stats;
  auto got = RunExchange({ProcessNeeds{{{Box({0, 0}, {8, 4})}}}}, &stats);
  ASSERT_TRUE(got[0].ok());
  EXPECT_EQ(got[0]->process_count(), 1);
  EXPECT_EQ(stats[0].bytes_sent + stats[0].bytes_received, 0u);
}

TEST(NeedsExchangeTest, ABadListNamesItsProcess) {
  // Process 1 needs a box of the wrong rank.
  std::vector<NeedsExchangeStats> stats;
  auto got = RunExchange({ProcessNeeds{{{Box({0, 0}, {8, 4})}}}, ProcessNeeds{{{Box({0}, {8})}}}},
                         &stats);
  ASSERT_FALSE(got[0].ok());
  EXPECT_EQ(got[0].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got[0].status().message(), HasSubstr("process 1"));
}

TEST(NeedsExchangeTest, AMissingProcessIsNamedAfterTheTimeout) {
  auto group = std::make_shared<InProcessCoordinatorGroup>(3);
  InProcessCoordinator coordinator(group, 0);
  auto got = ExchangeNeeds(coordinator, "r/", ProcessNeeds{{{}}}, Arrays(),
                           std::chrono::milliseconds(50));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(got.status().message(), HasSubstr("processes 1, 2 of 3 did not arrive"));
}

}  // namespace
}  // namespace tensorstash
