#include "tensorstash/coordination/collectives.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/coordination/single_process_coordinator.h"
#include "tensorstash/testing/in_process_coordinator.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

using std::chrono::milliseconds;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr milliseconds kLong(10000);  // a wait that must not time out

// Runs `fn` as processes 0 .. arrive-1 of a job of `count`, one thread each (the others never
// arrive); returns what each returned, by process index.
template <typename T>
std::vector<T> RunProcesses(int count, const std::function<T(Coordinator&)>& fn, int arrive = -1) {
  auto group = std::make_shared<InProcessCoordinatorGroup>(count);
  std::vector<T> out(count);
  std::vector<std::thread> threads;
  for (int p = 0; p < (arrive < 0 ? count : arrive); ++p) {
    threads.emplace_back([&, p] {
      InProcessCoordinator c(group, p);
      out[p] = fn(c);
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

TEST(StatusForPeersTest, RoundTripsAndRefusesGarbage) {
  for (const Status& s : {OkStatus(), NotFoundError("no 'x' | here"), DataLossError("")}) {
    EXPECT_EQ(DecodeStatusFromPeer(EncodeStatusForPeers(s)), s);
  }
  for (const char* garbage : {"", "oops", "x|y", "|message"}) {
    const Status decoded = DecodeStatusFromPeer(garbage);
    EXPECT_TRUE(absl::IsInternal(decoded)) << garbage;
    EXPECT_THAT(decoded.message(), HasSubstr("malformed status from another process"));
  }
}

TEST(CollectivesTest, AllGatherGivesEveryProcessEveryValue) {
  const auto results = RunProcesses<Result<std::vector<std::string>>>(4, [](Coordinator& c) {
    return AllGather(c, "test/gather/", StrCat("v", c.process_index()), kLong);
  });
  for (int p = 0; p < 4; ++p) {
    ASSERT_TRUE(results[p].ok()) << p << ": " << results[p].status();
    EXPECT_THAT(*results[p], ElementsAre("v0", "v1", "v2", "v3")) << p;
  }
}

TEST(CollectivesTest, CallsWithTheirOwnPrefixesDoNotMix) {
  auto run = [](Coordinator& c) -> Result<std::string> {
    std::string seen;
    for (int call = 0; call < 3; ++call) {
      const std::string prefix = StrCat("test/", c.NextOperationId(), "/");
      TS_ASSIGN_OR_RETURN(std::vector<std::string> values,
                          AllGather(c, prefix, StrCat(call, c.process_index()), kLong));
      seen += StrJoin(values, ",") + ";";
    }
    // A key is written once: the same prefix again is refused.
    Result<std::vector<std::string>> again = AllGather(c, "test/0/", "x", kLong);
    if (!absl::IsAlreadyExists(again.status())) return InternalError("prefix reused");
    return seen;
  };
  const auto results = RunProcesses<Result<std::string>>(3, run);
  for (int p = 0; p < 3; ++p) {
    ASSERT_TRUE(results[p].ok()) << results[p].status();
    EXPECT_EQ(*results[p], "00,01,02;10,11,12;20,21,22;") << p;
  }
}

TEST(CollectivesTest, BroadcastGivesEveryProcessTheRootsValueOrError) {
  const auto values = RunProcesses<Result<std::string>>(4, [](Coordinator& c) {
    return Broadcast(c, "test/bcast/value", c.process_index() == 2 ? "from 2" : "ignored",
                     /*root=*/2, kLong);
  });
  for (int p = 0; p < 4; ++p) {
    ASSERT_TRUE(values[p].ok()) << values[p].status();
    EXPECT_EQ(*values[p], "from 2") << p;
  }
  // An error of the root reaches every process, annotated; the root returns its own as it is.
  const auto errors = RunProcesses<Result<std::string>>(3, [](Coordinator& c) {
    Result<std::string> mine = "";
    if (c.process_index() == 0) mine = PermissionDeniedError("cannot lock 'root/LOCK'");
    return Broadcast(c, "test/bcast/error", mine, /*root=*/0, kLong, "process 0 could not open");
  });
  EXPECT_EQ(errors[0].status(), PermissionDeniedError("cannot lock 'root/LOCK'"));
  for (int p = 1; p < 3; ++p) {
    EXPECT_EQ(errors[p].status(),
              PermissionDeniedError("process 0 could not open: cannot lock 'root/LOCK'"));
  }
  // Without a phrase of the caller's, the root is named.
  const auto named = RunProcesses<Result<std::string>>(2, [](Coordinator& c) {
    Result<std::string> mine = "";
    if (c.process_index() == 1) mine = DataLossError("bad bytes");
    return Broadcast(c, "test/bcast/named", mine, /*root=*/1, kLong);
  });
  EXPECT_EQ(named[0].status(), DataLossError("process 1: bad bytes"));
}

TEST(CollectivesTest, AgreeOnStatusIsOkWhenEveryProcessIs) {
  const auto verdicts = RunProcesses<Status>(
      4, [](Coordinator& c) { return AgreeOnStatus(c, "test/agree/", OkStatus(), kLong); });
  for (int p = 0; p < 4; ++p) EXPECT_TRUE(verdicts[p].ok()) << p << ": " << verdicts[p];
}

TEST(CollectivesTest, AnErrorOfOneProcessReachesAllAndNamesIt) {
  const auto verdicts = RunProcesses<Status>(4, [](Coordinator& c) {
    Status mine;
    if (c.process_index() == 2) mine = ResourceExhaustedError("no space left on 'data/2-0.dat'");
    if (c.process_index() == 3) mine = UnavailableError("a later error");
    return AgreeOnStatus(c, "test/agree/", mine, kLong);
  });
  for (int p = 0; p < 4; ++p) {
    EXPECT_EQ(verdicts[p],
              ResourceExhaustedError("process 2: no space left on 'data/2-0.dat'"))
        << p;
  }
}

TEST(CollectivesTest, ProcessZeroDecidesTheVerdict) {
  std::atomic<int> decided{0};
  const auto verdicts = RunProcesses<Status>(3, [&](Coordinator& c) {
    return AgreeOnStatus(c, "test/decide/", OkStatus(), kLong, [&](const Status& gathered) {
      ++decided;
      return gathered.ok() ? FailedPreconditionError("the commit failed") : gathered;
    });
  });
  EXPECT_EQ(decided.load(), 1);
  for (int p = 0; p < 3; ++p) {
    EXPECT_EQ(verdicts[p], FailedPreconditionError("the commit failed")) << p;
  }
}

TEST(CollectivesTest, OneProcessPublishesOnlyItsStatus) {
  SingleProcessCoordinator c;
  Result<std::vector<std::string>> all = AllGather(c, "one/gather/", "mine", milliseconds(1));
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_THAT(*all, ElementsAre("mine"));
  EXPECT_EQ(Broadcast(c, "one/bcast", "v", 0, milliseconds(1)).value(), "v");
  EXPECT_EQ(AgreeOnStatus(c, "one/agree/", NotFoundError("x"), milliseconds(1)),
            NotFoundError("x"));  // its own error, as it is
  bool decided = false;
  EXPECT_EQ(AgreeOnStatus(c, "one/decide/", OkStatus(), milliseconds(1),
                          [&](const Status& s) {
                            decided = true;
                            return s;
                          }),
            OkStatus());
  EXPECT_TRUE(decided);
  for (const char* key : {"one/gather/0", "one/bcast", "one/agree/result"}) {
    EXPECT_TRUE(absl::IsNotFound(c.KeyValueGet(key, milliseconds(1)).status())) << key;
  }
  // Its status is there, where a coordinator of the caller's can follow the operation.
  Result<std::string> status = c.KeyValueGet("one/agree/status/0", milliseconds(1));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(DecodeStatusFromPeer(*status), NotFoundError("x"));
}

TEST(CollectivesTest, AProcessThatNeverArrivesIsNamedWithWhatWasAwaited) {
  constexpr milliseconds kTimeout(300);
  const auto start = std::chrono::steady_clock::now();
  // Processes 2 and 3 of 4 never come: one deadline for the whole gather, both named.
  const auto gathered = RunProcesses<Result<std::vector<std::string>>>(
      4, [&](Coordinator& c) { return AllGather(c, "test/lonely/", "v", kTimeout); },
      /*arrive=*/2);
  for (int p = 0; p < 2; ++p) {
    EXPECT_TRUE(absl::IsDeadlineExceeded(gathered[p].status())) << gathered[p].status();
    EXPECT_THAT(gathered[p].status().message(),
                HasSubstr("processes 2, 3 of 4 did not arrive at 'test/lonely/' within 0.3 s "
                          "(coordination_timeout)"));
  }
  EXPECT_LT(SecondsSince(start), 2.0);  // not a timeout per missing process
}

TEST(CollectivesTest, AMissingRootTimesTheOthersOut) {
  const auto values = RunProcesses<Result<std::string>>(
      3, [](Coordinator& c) { return Broadcast(c, "test/no-root", "", 2, milliseconds(100)); },
      /*arrive=*/2);
  for (int p = 0; p < 2; ++p) {
    EXPECT_TRUE(absl::IsDeadlineExceeded(values[p].status())) << values[p].status();
    EXPECT_THAT(values[p].status().message(),
                HasSubstr("process 2 of 3 did not arrive at 'test/no-root' within 0.1 s"));
  }
}

TEST(CollectivesTest, AgreeOnStatusNamesAProcessThatNeverArrives) {
  // Process 3 never arrives: process 0's verdict names it, and every process that came learns
  // it (process 0 publishes its verdict at its deadline, before theirs: they waited longer).
  const auto verdicts = RunProcesses<Status>(
      4,
      [](Coordinator& c) {
        const milliseconds timeout(c.process_index() == 0 ? 200 : 5000);
        return AgreeOnStatus(c, "test/agree-lonely/", OkStatus(), timeout);
      },
      /*arrive=*/3);
  for (int p = 0; p < 3; ++p) {
    EXPECT_TRUE(absl::IsDeadlineExceeded(verdicts[p])) << verdicts[p];
    EXPECT_THAT(verdicts[p].message(),
                HasSubstr("process 3 of 4 did not arrive at 'test/agree-lonely/status/'"))
        << p;
  }
  // An error reported by a process that came says more than a timeout: it wins.
  const auto with_error = RunProcesses<Status>(
      3,
      [](Coordinator& c) {
        const Status mine = c.process_index() == 1 ? AbortedError("gave up") : OkStatus();
        return AgreeOnStatus(c, "test/agree-error/", mine, milliseconds(200));
      },
      /*arrive=*/2);
  EXPECT_EQ(with_error[0], AbortedError("process 1: gave up"));
  // Without process 0, nobody learns a verdict.
  const auto no_root = RunProcesses<Status>(
      2,
      [](Coordinator& c) {
        if (c.process_index() == 0) return OkStatus();  // never takes part
        return AgreeOnStatus(c, "test/agree-no-root/", OkStatus(), milliseconds(100));
      });
  EXPECT_TRUE(absl::IsDeadlineExceeded(no_root[1])) << no_root[1];
  EXPECT_THAT(no_root[1].message(),
              HasSubstr("process 0 of 2 did not arrive at 'test/agree-no-root/result'"));
}

TEST(CollectivesTest, TheDefaultTimeoutIsWrittenOnce) {
  EXPECT_EQ(kDefaultCoordinationTimeout, std::chrono::minutes(30));
}

}  // namespace
}  // namespace tensorstash
