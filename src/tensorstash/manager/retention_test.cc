#include "tensorstash/manager/retention.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tensorstash {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(RetentionTest, KeepsAllWithoutALimitOrUnderIt) {
  EXPECT_THAT(StepsToDelete({1, 2, 3}, {}, {}), IsEmpty());
  EXPECT_THAT(StepsToDelete({1, 2, 3}, {}, {.max_to_keep = 3}), IsEmpty());
  EXPECT_THAT(StepsToDelete({}, {}, {.max_to_keep = 1}), IsEmpty());
}

TEST(RetentionTest, KeepsTheNewest) {
  EXPECT_THAT(StepsToDelete({10, 20, 30, 40}, {}, {.max_to_keep = 2}), ElementsAre(10, 20));
  EXPECT_THAT(StepsToDelete({10, 20, 30, 40}, {}, {.max_to_keep = 1}), ElementsAre(10, 20, 30));
}

TEST(RetentionTest, KeepPeriodStepsAreNeverDeleted) {
  EXPECT_THAT(StepsToDelete({50, 100, 150, 200, 250}, {}, {.max_to_keep = 1, .keep_period = 100}),
              ElementsAre(50, 150));
}

TEST(RetentionTest, ByMetricKeepsTheBestAndTheNewest) {
  const std::map<int64_t, double> loss = {{1, 0.5}, {2, 0.1}, {3, 0.3}, {4, 0.9}};
  RetentionPolicy policy{.max_to_keep = 2, .by_metric = true, .best_mode = BestMode::kMin};
  // Best two: 2 (0.1) and 3 (0.3); 4 is the newest and kept too.
  EXPECT_THAT(StepsToDelete({1, 2, 3, 4}, loss, policy), ElementsAre(1));
  policy.best_mode = BestMode::kMax;  // best two: 4 (0.9), 1 (0.5)
  EXPECT_THAT(StepsToDelete({1, 2, 3, 4}, loss, policy), ElementsAre(2, 3));
}

TEST(RetentionTest, StepsWithoutTheMetricRankLastNewerFirstAmongEquals) {
  const std::map<int64_t, double> loss = {{2, 0.5}};
  const RetentionPolicy policy{.max_to_keep = 2, .by_metric = true};
  // Ranked: 2 (has it), then 5, 4, 3, 1 (none, newer first): keep 2 and 5 (also the newest).
  EXPECT_THAT(StepsToDelete({1, 2, 3, 4, 5}, loss, policy), ElementsAre(1, 3, 4));
  const std::map<int64_t, double> ties = {{1, 1.0}, {2, 1.0}, {3, 1.0}};
  EXPECT_THAT(StepsToDelete({1, 2, 3}, ties, {.max_to_keep = 1, .by_metric = true}),
              ElementsAre(1, 2));
}

}  // namespace
}  // namespace tensorstash
