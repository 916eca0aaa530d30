#include "tensorstash/share/shared_read_plan.h"

#include <map>
#include <random>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

// An array of `shape` cut into chunks of `chunk` (cells = chunks), each chunk's stored bytes its
// element count times `item_size`.
SharedArray MakeArray(std::string path, std::vector<int64_t> shape, std::vector<int64_t> chunk,
                      uint64_t item_size = 4) {
  SharedArray array;
  array.path = std::move(path);
  array.grid = ChunkGrid{shape, chunk, chunk};
  for (int64_t c = 0; c < array.grid.NumChunks(); ++c) {
    array.chunk_bytes.push_back(static_cast<uint64_t>(array.grid.ChunkNumElements(c)) * item_size);
  }
  return array;
}

ProcessNeeds Needs(std::vector<std::vector<Box>> boxes) { return ProcessNeeds{std::move(boxes)}; }

TEST(SharedReadPlanTest, EncodedNeedsDecodeToTheSameBoxes) {
  const std::vector<SharedArray> arrays = {MakeArray("w", {100, 300}, {10, 30}),
                                           MakeArray("scalar", {}, {}),
                                           MakeArray("b", {5}, {5})};
  const ProcessNeeds needs = Needs({{Box({0, 0}, {100, 300}), Box({7, 290}, {200, 1u << 20})},
                                    {Box({}, {})},
                                    {}});
  const std::string encoded = EncodeNeeds(needs);
  auto decoded = DecodeNeeds(encoded, arrays, 3);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, needs);
  // Compact: a 2-d box in a few bytes, not a per-chunk list.
  EXPECT_LT(encoded.size(), 20u);
}

TEST(SharedReadPlanTest, DecodeNamesTheProcessOfABadList) {
  const std::vector<SharedArray> arrays = {MakeArray("w", {100, 300}, {10, 30})};
  const std::string good = EncodeNeeds(Needs({{Box({0, 0}, {4, 4})}}));
  struct Case {
    std::string bytes;
    std::string message;
  };
  // Coordinates of 3 bytes each, so that a cut inside the last box passes the count's check.
  const std::string wide = EncodeNeeds(
      Needs({{Box({20000, 20000}, {20000, 20000}), Box({20000, 20000}, {20000, 20000})}}));
  std::string huge_count = good.substr(0, 2) + std::string("\xff\xff\xff\xff\x0f", 5);
  const std::vector<Case> cases = {
      {"", "unknown version"},
      {std::string("\x02", 1) + good.substr(1), "unknown version"},
      {wide.substr(0, wide.size() - 4), "truncated"},
      {good + "x", "bytes after the last box"},
      {EncodeNeeds(Needs({{}, {}})), "name 2 arrays; the step has 1"},
      {huge_count, "box count"},
  };
  for (const Case& c : cases) {
    auto decoded = DecodeNeeds(c.bytes, arrays, 7);
    ASSERT_FALSE(decoded.ok()) << c.message;
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(decoded.status().message(), HasSubstr("process 7")) << decoded.status();
    EXPECT_THAT(decoded.status().message(), HasSubstr(c.message)) << decoded.status();
  }
}

// Two replicas of one array: the array is read once, half by each.
TEST(SharedReadPlanTest, ReplicasSplitTheReadsEvenly) {
  const std::vector<SharedArray> arrays = {MakeArray("w", {8, 4}, {2, 4})};  // 4 chunks of 32 B
  const JobNeeds job = GroupNeeds({Needs({{Box({0, 0}, {8, 4})}}), Needs({{Box({0, 0}, {8, 4})}})});
  ASSERT_EQ(job.distinct.size(), 1u);
  auto plan = PlanSharedReads(arrays, job);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->shared().size(), 4u);
  EXPECT_EQ(plan->storage_bytes(0), 64u);
  EXPECT_EQ(plan->storage_bytes(1), 64u);
  EXPECT_EQ(plan->total_storage_bytes(), 128u);
  EXPECT_EQ(plan->unshared_storage_bytes(), 256u);
  // Equal sizes: one group of two needers, cut into two runs of neighbouring chunks.
  std::vector<int> readers;
  for (const SharedChunk& c : plan->shared()) readers.push_back(c.reader);
  EXPECT_EQ(readers, (std::vector<int>{0, 0, 1, 1}));
  const ProcessShare p1 = plan->ForProcess(job, arrays, 1);
  EXPECT_EQ(p1.serves.size(), 2u);
  EXPECT_EQ(p1.receives.size(), 2u);
  EXPECT_TRUE(p1.alone.empty());
}

// The rule, step by step: groups of chunks with the same needers, largest first, each cut into
// runs of about equal bytes that go to the least loaded needers first (the bytes they read
// alone included), ties by process index.
TEST(SharedReadPlanTest, GroupsCutIntoRunsForTheLeastLoadedNeeders) {
  // One row per chunk: chunk sizes 10, 7, 5, 3, 8, 4, 6.
  SharedArray a;
  a.path = "a";
  a.grid = ChunkGrid{{7}, {1}, {1}};
  a.chunk_bytes = {10, 7, 5, 3, 8, 4, 6};
  const std::vector<SharedArray> arrays = {a};
  // p0 and p1 need chunks 0..3 (25 bytes, one group); p1 alone needs chunk 4 (8 bytes); p1 and
  // p2 need chunks 5..6 (10 bytes, another group).
  const JobNeeds job = GroupNeeds({Needs({{Box({0}, {4})}}), Needs({{Box({0}, {7})}}),
                                   Needs({{Box({5}, {2})}})});
  auto plan = PlanSharedReads(arrays, job);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->shared().size(), 6u);
  // Group {p0, p1} (25 bytes) first: loads 0 and 8, level (25 + 8) / 2 = 16.5, so p0's run
  // ends 16.5 bytes into the group. Chunk middles 5, 13.5 (p0), 19.5, 23.5 (p1).
  EXPECT_EQ(plan->Find(0, 0)->reader, 0);
  EXPECT_EQ(plan->Find(0, 1)->reader, 0);
  EXPECT_EQ(plan->Find(0, 2)->reader, 1);
  EXPECT_EQ(plan->Find(0, 3)->reader, 1);
  EXPECT_EQ(plan->Find(0, 4), nullptr);  // needed by one process only
  // Group {p1, p2} (10 bytes): loads 16 and 0; p1 is above the level (10 + 16) / 2 = 13, so
  // p2 takes the whole group.
  EXPECT_EQ(plan->Find(0, 5)->reader, 2);
  EXPECT_EQ(plan->Find(0, 6)->reader, 2);
  EXPECT_EQ(plan->storage_bytes(0), 17u);
  EXPECT_EQ(plan->storage_bytes(1), 16u);
  EXPECT_EQ(plan->storage_bytes(2), 10u);
  const ProcessShare p1 = plan->ForProcess(job, arrays, 1);
  ASSERT_EQ(p1.alone.size(), 1u);
  EXPECT_EQ(p1.alone[0], (std::pair<uint32_t, int64_t>(0, 4)));
}

// Replicas of several arrays: each reads one run of neighbouring chunks, the bytes even.
TEST(SharedReadPlanTest, ReplicasReadRunsOfNeighbouringChunks) {
  const std::vector<SharedArray> arrays = {MakeArray("a", {16, 4}, {2, 4}),
                                           MakeArray("b", {8, 4}, {2, 4})};  // 8 + 4 chunks
  const ProcessNeeds all = Needs({{Box({0, 0}, {16, 4})}, {Box({0, 0}, {8, 4})}});
  const JobNeeds job = GroupNeeds({all, all, all, all});
  auto plan = PlanSharedReads(arrays, job);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<int> readers;
  for (const SharedChunk& c : plan->shared()) readers.push_back(c.reader);
  EXPECT_EQ(readers, (std::vector<int>{0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3}));
  for (int p = 0; p < 4; ++p) EXPECT_EQ(plan->storage_bytes(p), 3 * 32u) << p;
}

// A brute-force model: every chunk any process needs is read from storage once in all, by a
// process that needs it; a process's part (served, received, alone) is exactly what it needs.
void CheckPlanAgainstBruteForce(const std::vector<SharedArray>& arrays,
                                const std::vector<ProcessNeeds>& per_process) {
  const JobNeeds job = GroupNeeds(per_process);
  auto plan = PlanSharedReads(arrays, job);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const int n = static_cast<int>(per_process.size());
  std::map<std::pair<uint32_t, int64_t>, std::set<int>> needers;
  for (int p = 0; p < n; ++p) {
    for (size_t a = 0; a < arrays.size(); ++a) {
      const Box whole = Box::FromShape(arrays[a].grid.shape);
      for (int64_t c = 0; c < arrays[a].grid.NumChunks(); ++c) {
        if (!arrays[a].grid.ChunkExists(c)) continue;
        const Box chunk = arrays[a].grid.ChunkBox(c);
        for (const Box& box : per_process[p].boxes[a]) {
          if (!Intersect(Intersect(box, whole), chunk).empty()) {
            needers[{static_cast<uint32_t>(a), c}].insert(p);
          }
        }
      }
    }
  }
  uint64_t union_bytes = 0;
  uint64_t unshared = 0;
  std::vector<uint64_t> reads(n, 0);
  std::vector<std::map<std::pair<uint32_t, int64_t>, int>> role(n);  // 0 alone, 1 serve, 2 receive
  for (const auto& [key, who] : needers) {
    const uint64_t bytes = arrays[key.first].chunk_bytes[key.second];
    union_bytes += bytes;
    unshared += bytes * who.size();
    const SharedChunk* shared = plan->Find(key.first, key.second);
    if (who.size() == 1) {
      ASSERT_EQ(shared, nullptr);
      reads[*who.begin()] += bytes;
      role[*who.begin()][key] = 0;
      continue;
    }
    ASSERT_NE(shared, nullptr);
    EXPECT_EQ(shared->needers, who.size());
    EXPECT_EQ(shared->bytes, bytes);
    ASSERT_TRUE(who.count(shared->reader)) << "reader " << shared->reader << " does not need it";
    reads[shared->reader] += bytes;
    for (int p : who) role[p][key] = p == shared->reader ? 1 : 2;
  }
  EXPECT_EQ(plan->shared().size(),
            static_cast<size_t>(std::count_if(needers.begin(), needers.end(),
                                              [](const auto& e) { return e.second.size() > 1; })));
  EXPECT_EQ(plan->total_storage_bytes(), union_bytes);
  EXPECT_EQ(plan->unshared_storage_bytes(), unshared);
  for (int p = 0; p < n; ++p) {
    EXPECT_EQ(plan->storage_bytes(p), reads[p]) << "process " << p;
    const ProcessShare share = plan->ForProcess(job, arrays, p);
    std::map<std::pair<uint32_t, int64_t>, int> got;
    for (const auto& key : share.alone) got[key] = 0;
    for (const SharedChunk& c : share.serves) {
      EXPECT_EQ(c.reader, p);
      got[{c.array, c.chunk}] = 1;
    }
    for (const SharedChunk& c : share.receives) {
      EXPECT_NE(c.reader, p);
      got[{c.array, c.chunk}] = 2;
    }
    EXPECT_EQ(got, role[p]) << "process " << p;
  }
}

// 3 processes whose boxes overlap unevenly (a reshard): chunks needed by 1, 2 or 3 of them.
TEST(SharedReadPlanTest, UnevenOverlapsOfThreeProcesses) {
  const std::vector<SharedArray> arrays = {MakeArray("w", {12, 10}, {4, 5}),
                                           MakeArray("b", {10}, {3}, 2)};
  CheckPlanAgainstBruteForce(
      arrays, {Needs({{Box({0, 0}, {7, 10})}, {Box({0}, {10})}}),
               Needs({{Box({3, 2}, {6, 6}), Box({11, 9}, {5, 5})}, {Box({2}, {3})}}),
               Needs({{Box({5, 0}, {7, 10})}, {}})});
}

// 4 processes: two replicas of a 2-way sharding saved 3-way, boxes past the array's end.
TEST(SharedReadPlanTest, UnevenOverlapsOfFourProcesses) {
  const std::vector<SharedArray> arrays = {MakeArray("w", {9, 4}, {3, 4})};
  const ProcessNeeds low = Needs({{Box({0, 0}, {5, 4})}});
  const ProcessNeeds high = Needs({{Box({5, 0}, {5, 8})}});
  CheckPlanAgainstBruteForce(arrays, {low, high, low, high});
  auto plan = PlanSharedReads(arrays, GroupNeeds({low, high, low, high}));
  ASSERT_TRUE(plan.ok());
  // Chunk 1 (rows 3-5) is needed by all four; the array is read once: 9 rows of 16 B.
  EXPECT_EQ(plan->Find(0, 1)->needers, 4u);
  EXPECT_EQ(plan->total_storage_bytes(), 144u);
}

TEST(SharedReadPlanTest, RandomJobsMatchTheBruteForceModel) {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 60; ++trial) {
    std::vector<SharedArray> arrays;
    const int num_arrays = 1 + static_cast<int>(rng() % 3);
    for (int a = 0; a < num_arrays; ++a) {
      const int rank = static_cast<int>(rng() % 3);
      std::vector<int64_t> shape, cell, chunk;
      for (int d = 0; d < rank; ++d) {
        shape.push_back(rng() % 9);
        cell.push_back(1 + rng() % 5);
        chunk.push_back(1 + rng() % cell.back());
      }
      SharedArray array;
      array.path = "a" + std::to_string(a);
      array.grid = ChunkGrid{shape, cell, chunk};
      for (int64_t c = 0; c < array.grid.NumChunks(); ++c) {
        // Compressed sizes: not proportional to the elements.
        array.chunk_bytes.push_back(array.grid.ChunkExists(c) ? 1 + rng() % 50 : 0);
      }
      arrays.push_back(std::move(array));
    }
    const int n = 1 + static_cast<int>(rng() % 5);
    std::vector<ProcessNeeds> per_process;
    for (int p = 0; p < n; ++p) {
      if (p > 0 && rng() % 3 == 0) {  // a replica of an earlier process
        per_process.push_back(per_process[rng() % p]);
        continue;
      }
      ProcessNeeds needs;
      for (const SharedArray& array : arrays) {
        std::vector<Box> boxes;
        for (int b = static_cast<int>(rng() % 3); b > 0; --b) {
          Box box;
          for (int d = 0; d < array.grid.rank(); ++d) {
            box.origin.push_back(rng() % 10);
            box.shape.push_back(rng() % 10);
          }
          boxes.push_back(box);
        }
        needs.boxes.push_back(std::move(boxes));
      }
      per_process.push_back(std::move(needs));
    }
    SCOPED_TRACE("trial " + std::to_string(trial));
    CheckPlanAgainstBruteForce(arrays, per_process);
  }
}

TEST(SharedReadPlanTest, BadInputIsAnErrorNamingWhat) {
  std::vector<SharedArray> arrays = {MakeArray("w", {8, 4}, {2, 4})};
  JobNeeds job = GroupNeeds({Needs({{Box({0}, {8})}})});
  auto plan = PlanSharedReads(arrays, job);
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(), HasSubstr("rank 1 for 'w' of rank 2"));

  job = GroupNeeds({Needs({{Box({0, 0}, {8, 4})}})});
  job.list_of_process.push_back(3);
  plan = PlanSharedReads(arrays, job);
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(), HasSubstr("process 1 needs box list 3"));

  job.list_of_process.pop_back();
  arrays[0].chunk_bytes.pop_back();
  plan = PlanSharedReads(arrays, job);
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(), HasSubstr("'w' has 3 chunk sizes for 4 chunks"));
}

}  // namespace
}  // namespace tensorstash
