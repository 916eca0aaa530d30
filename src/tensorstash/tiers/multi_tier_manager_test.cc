// The node-local tier in C++: the restore rule on fabricated holdings (holdings.h), and a job of
// 4 processes (threads with an InProcessCoordinator, each "node" a folder of its own) that loses
// one data-parallel slice's local copies, restarts in the reverse order and restores from the
// surviving peers over HTTP, without the persistent tier (multi_tier_manager.h, local_tier.h).
#include "tensorstash/tiers/multi_tier_manager.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/tiers/holdings.h"
#include "tensorstash/engine/host_restore.h"
#include "tensorstash/testing/in_process_coordinator.h"
#include "tensorstash/kvstore/registry.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;

// --- holdings.h -------------------------------------------------------------------------------

TEST(HoldingsTest, ValuesRoundTripAndMalformedOnesAreDataLoss) {
  ProcessValues values = {{0, std::string("a\0b", 3)}, {1, std::nullopt}, {3, std::string()}};
  const std::string packed = PackValues({"/root run-7", "id-1", values});
  Result<PackedValues> back = UnpackValues(packed, "here");
  TS_ASSERT_OK(back.status());
  EXPECT_EQ(back->run, "/root run-7");
  EXPECT_EQ(back->save_id, "id-1");
  EXPECT_EQ(back->values, values);
  for (size_t cut : {size_t{0}, size_t{10}, packed.size() - 1}) {
    Result<PackedValues> bad =
        UnpackValues(std::string_view(packed).substr(0, cut), "p0-of-2/0000000005");
    EXPECT_TRUE(absl::IsDataLoss(bad.status())) << cut;
    EXPECT_THAT(bad.status().message(), HasSubstr("p0-of-2/0000000005")) << cut;
  }
}

TEST(HoldingsTest, FolderNamesAndValueRing) {
  EXPECT_EQ(HoldingFolder(2, 4), "p2-of-4");
  EXPECT_EQ(ParseHoldingFolder("p2-of-4"), std::make_pair(2, 4));
  for (const char* bad :
       {"p4-of-4", "p-1-of-4", "p1-of-", "q1-of-2", "p1of2", "p+1-of-2", "LOCK"}) {
    EXPECT_EQ(ParseHoldingFolder(bad), std::nullopt) << bad;
  }
  EXPECT_THAT(ValueRing(2, 8), ElementsAre(2, 3, 4, 5));
  EXPECT_THAT(ValueRing(3, 4), ElementsAre(3, 0, 1, 2));
  EXPECT_THAT(ValueRing(1, 2), ElementsAre(1, 0));
  EXPECT_THAT(ValueRing(0, 1), ElementsAre(0));
}

// A holding of step `step` (save "s<save>") of one array "w" of 4 chunks.
Holding Held(int holder, int saved_by, int64_t step, std::vector<int64_t> chunks,
             std::vector<int> values, int save = 1, int count = 4) {
  Holding h;
  h.holder = holder;
  h.folder = HoldingFolder(saved_by, count);
  h.step = step;
  h.save_id = StrCat("s", save);
  h.digest = "d";
  h.num_chunks["w"] = 4;
  h.chunks["w"] = std::move(chunks);
  h.values = std::move(values);
  return h;
}

TEST(HoldingsTest, AStepIsRestorableWhenEveryChunkAndValueIsHeldByAnyone) {
  // No holding has everything; together they do.
  std::vector<Holding> holdings = {Held(0, 0, 7, {0, 1}, {0, 1}), Held(3, 3, 7, {2, 3}, {2, 3})};
  EXPECT_THAT(RestorableSteps(holdings, {}), ElementsAre(7));
  EXPECT_EQ(RestorableSaves(holdings).at(7).save_id, "s1");
  // A chunk held by nobody.
  EXPECT_THAT(RestorableSteps({Held(0, 0, 7, {0, 1}, {0, 1}), Held(3, 3, 7, {2}, {2, 3})}, {5}),
              ElementsAre(5));
  // A process's value held by nobody.
  EXPECT_THAT(RestorableSaves({Held(0, 0, 7, {0, 1}, {0, 1}), Held(3, 3, 7, {2, 3}, {3})}),
              IsEmpty());
  // Chunks out of range count for nothing.
  EXPECT_THAT(RestorableSaves({Held(0, 0, 7, {0, 1, 2, 9}, {0, 1, 2, 3})}), IsEmpty());
}

TEST(HoldingsTest, SavesOfOneStepNeverMixAndTheLaterCompleteOneWins) {
  // Save 1 and save 2 of step 7 each hold half: neither is complete.
  EXPECT_THAT(RestorableSaves(
                  {Held(0, 0, 7, {0, 1}, {0, 1, 2, 3}, 1), Held(1, 1, 7, {2, 3}, {0, 1, 2, 3}, 2)}),
              IsEmpty());
  // Both complete: the later id wins.
  std::map<int64_t, SaveKey> saves = RestorableSaves(
      {Held(0, 0, 7, {0, 1, 2, 3}, {0, 1, 2, 3}, 2), Held(1, 1, 7, {0, 1, 2, 3}, {0, 1, 2, 3}, 1)});
  EXPECT_EQ(saves.at(7).save_id, "s2");
  // A job of another size never mixes either.
  EXPECT_THAT(RestorableSaves(
                  {Held(0, 0, 7, {0, 1}, {0, 1}, 1, 2), Held(1, 1, 7, {2, 3}, {0, 1, 2, 3}, 1, 4)}),
              IsEmpty());
}

TEST(HoldingsTest, HoldingsCrossAsJson) {
  std::vector<Holding> holdings = {Held(0, 1, 7, {0, 3}, {1, 2})};
  Result<std::vector<Holding>> back = HoldingsFromJson(HoldingsToJson(holdings));
  TS_ASSERT_OK(back.status());
  ASSERT_EQ(back->size(), 1u);
  EXPECT_EQ((*back)[0].save(), holdings[0].save());
  EXPECT_EQ((*back)[0].chunks, holdings[0].chunks);
  EXPECT_EQ((*back)[0].values, holdings[0].values);
  EXPECT_TRUE(absl::IsInvalidArgument(HoldingsFromJson("[{\"holder\": 1}]").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(HoldingsFromJson("not json").status()));
}

// --- a job of 4 processes ---------------------------------------------------------------------

const std::vector<int64_t> kShape = {8, 6};
constexpr uint64_t kSeed = 23;
constexpr int kProcesses = 4;

// Slices of 2 processes: process p holds rows 4 * (p % 2) .. + 4 (the other slice has replicas).
Box BoxOf(int process) { return Box({4 * (process % 2), 0}, {4, kShape[1]}); }

class MultiTierManagerTest : public test::TempDirTest {
 protected:
  std::string NodeDir(int node) const { return StrCat(temp_dir(), "/node", node); }
  std::string PersistentDir() const { return StrCat(temp_dir(), "/persistent"); }

  // Runs `body(process, coordinator)` in `processes` threads at once, in a job of `job_size`.
  template <typename Body>
  void RunJob(int processes, Body body, int job_size = kProcesses) {
    auto group = std::make_shared<InProcessCoordinatorGroup>(job_size);
    std::vector<std::thread> threads;
    for (int p = 0; p < processes; ++p) {
      threads.emplace_back([&, p] {
        InProcessCoordinator coordinator(group, p);
        body(p, coordinator);
      });
    }
    for (std::thread& t : threads) t.join();
  }

  MultiTierOptions Options(int node, Coordinator* coordinator) const {
    MultiTierOptions options;
    options.persistent.coordinator = coordinator;
    options.persistent.save_interval_steps = 100;
    options.local.dir = NodeDir(node);
    options.local.save_interval_steps = 1;
    options.local.max_to_keep = 1;
    options.local.timeout = std::chrono::seconds(20);
    options.local.warn = [](const std::string&) {};
    return options;
  }

  // This process's shard of array "w" at `step` (its data differs per step).
  static SaveRequest Request(int process, int64_t step, std::vector<char>* data,
                             std::optional<Box> box = std::nullopt) {
    if (!box) box = BoxOf(process);
    *data = test::MakeBoxData(DType::kFloat32, kShape, kSeed + step, *box);
    SaveRequest request;
    ArrayToSave array;
    array.spec.path = "w";
    array.spec.shape = kShape;
    array.spec.target_chunk_bytes = 2 * 6 * 4;  // chunks of 2 rows
    ShardData shard;
    shard.box = *box;
    shard.data = data->data();
    if (box->shape[0] < kShape[0]) {
      shard.replica_id = process / 2;
      shard.num_replicas = 2;
    }
    array.shards.push_back(shard);
    request.arrays.push_back(std::move(array));
    request.process_state = StrCat("iterator of process ", process, " at step ", step);
    request.metadata_json = StrCat("{\"step\": ", step, "}");
    return request;
  }
};

TEST_F(MultiTierManagerTest, ALostSliceIsRestoredFromPeersInAnyProcessOrder) {
  // A run: steps 1..3 go to the local tier only (persistent every 100 steps).
  RunJob(kProcesses, [&](int p, Coordinator& c) {
    Result<std::unique_ptr<KvStore>> kv = OpenKvStore(PersistentDir(), {.create = true});
    TS_ASSERT_OK(kv.status());
    Result<std::unique_ptr<MultiTierManager>> mgr =
        MultiTierManager::Open(kv->get(), Options(p, &c));
    TS_ASSERT_OK(mgr.status());
    for (int64_t step = 1; step <= 3; ++step) {
      std::vector<char> data;
      Result<bool> saved = (*mgr)->Save(step, Request(p, step, &data));
      TS_ASSERT_OK(saved.status());
      EXPECT_TRUE(*saved);
    }
    EXPECT_THAT((*mgr)->persistent().AllSteps(), IsEmpty());
    TS_EXPECT_OK((*mgr)->Close());
    EXPECT_THAT((*mgr)->local().LocalSteps(), ElementsAre(3));  // local_max_to_keep = 1
  });
  // Slice 0 (processes 0 and 1) loses its nodes' RAM; the persistent tier has nothing anyway.
  std::filesystem::remove_all(NodeDir(0));
  std::filesystem::remove_all(NodeDir(1));

  // The job comes back with the processes in reverse order: process p runs on node 3 - p.
  RunJob(kProcesses, [&](int p, Coordinator& c) {
    Result<std::unique_ptr<KvStore>> kv = OpenKvStore(PersistentDir(), {.create = true});
    TS_ASSERT_OK(kv.status());
    const int node = kProcesses - 1 - p;
    Result<std::unique_ptr<MultiTierManager>> mgr =
        MultiTierManager::Open(kv->get(), Options(node, &c));
    TS_ASSERT_OK(mgr.status());
    Result<std::optional<int64_t>> latest = (*mgr)->LatestStep();
    TS_ASSERT_OK(latest.status());
    ASSERT_EQ(*latest, std::optional<int64_t>(3));
    Result<TieredRestore> restore = (*mgr)->OpenRestore(3);
    TS_ASSERT_OK(restore.status());
    std::vector<char> got;
    std::vector<RestoredBox> kept;  // the host buffers the engine filled, for the write-back
    const HostBoxRequest request{"w", BoxOf(p), DType::kFloat32};
    TS_EXPECT_OK(RestoreToHost(*restore->source, {request}, {.map = false},
                               [&](HostBatch& batch) {
                                 got.assign(batch.buffers[0]->data(),
                                            batch.buffers[0]->data() + batch.buffers[0]->size());
                                 kept.push_back({request, batch.buffers[0]});
                                 return OkStatus();
                               }));
    ASSERT_EQ(kept.size(), 1u);
    EXPECT_TRUE(
        test::BytesEqual(test::MakeBoxData(DType::kFloat32, kShape, kSeed + 3, BoxOf(p)), got));
    // Its own value, saved by the process that had its index, wherever that is held now.
    EXPECT_EQ(restore->extras.per_process, StrCat("iterator of process ", p, " at step 3"));
    EXPECT_EQ(restore->extras.metadata, "{\"step\": 3}");
    const TierStats& stats = restore->source->tier_stats();
    EXPECT_EQ(stats.bytes[static_cast<int>(Tier::kPersistent)], 0u);
    // Nodes 3 and 2 kept their copies, but of the other box (the order is reversed); nodes 1
    // and 0 lost theirs: every process reads from the peers.
    const uint64_t box_bytes = 4 * 6 * 4;
    EXPECT_EQ(stats.bytes[static_cast<int>(Tier::kPeer)], box_bytes) << p;
    EXPECT_EQ(stats.bytes[static_cast<int>(Tier::kLocal)], 0u) << p;
    EXPECT_THAT(stats.failures, IsEmpty());
    // Boxes that are not the bytes as stored are no write-back: a cast, zeros past the shape.
    EXPECT_FALSE(WriteBackRequest(*restore->source,
                                  {{{"w", BoxOf(p), DType::kFloat64}, kept[0].buffer}},
                                  Codec::kNone, 3)
                     .has_value());
    EXPECT_FALSE(WriteBackRequest(*restore->source,
                                  {{{"w", Box({6, 0}, {4, kShape[1]}), DType::kFloat32},
                                    kept[0].buffer}},
                                  Codec::kNone, 3)
                     .has_value());
    // The write-back saves the engine's host buffer itself (no copy); a replica of the box (a
    // second device's request for it) is not a second shard.
    const char* restored = kept[0].buffer->data();
    kept.push_back(kept[0]);
    std::optional<SaveRequest> write_back =
        WriteBackRequest(*restore->source, std::move(kept), Codec::kNone, 3);
    ASSERT_TRUE(write_back.has_value());
    ASSERT_EQ(write_back->arrays.size(), 1u);
    ASSERT_EQ(write_back->arrays[0].shards.size(), 1u);
    EXPECT_EQ(write_back->arrays[0].shards[0].data, restored);
    EXPECT_EQ(write_back->arrays[0].shards[0].box, BoxOf(p));
    EXPECT_EQ(write_back->arrays[0].spec.shape, kShape);
    bool wrote_back = false;
    TS_EXPECT_OK((*mgr)->FinishRestore(&*restore, &*write_back, "", nullptr, &wrote_back));
    EXPECT_TRUE(wrote_back);
    TS_EXPECT_OK((*mgr)->Close());
    // Every node holds this process's part of step 3 again (the wiped ones included).
    EXPECT_THAT((*mgr)->local().LocalSteps(), ElementsAre(3));
    std::vector<Holding> held = DescribeHoldings(NodeDir(node), p);
    auto own = std::find_if(held.begin(), held.end(), [&](const Holding& h) {
      return h.folder == HoldingFolder(p, kProcesses);
    });
    ASSERT_NE(own, held.end());
    EXPECT_EQ(own->step, 3);
    EXPECT_EQ(own->chunks.at("w"), (std::vector<int64_t>{2 * (p % 2), 2 * (p % 2) + 1}));
    EXPECT_EQ(own->save_id, restore->save->save_id);  // it joins the restored save
  });
}

TEST_F(MultiTierManagerTest, ARestartWithMoreProcessesThanSavedGivesTheNewOnesNoValue) {
  // Two processes save step 3 to their nodes' RAM (each holds half of "w").
  RunJob(
      2,
      [&](int p, Coordinator& c) {
        Result<std::unique_ptr<KvStore>> kv = OpenKvStore(PersistentDir(), {.create = true});
        TS_ASSERT_OK(kv.status());
        Result<std::unique_ptr<MultiTierManager>> mgr =
            MultiTierManager::Open(kv->get(), Options(p, &c));
        TS_ASSERT_OK(mgr.status());
        std::vector<char> data;
        TS_ASSERT_OK((*mgr)->Save(3, Request(p, 3, &data)).status());
        TS_EXPECT_OK((*mgr)->Close());
      },
      2);
  // Four come back (nodes 0..3): step 3 restores everywhere; processes 2 and 3, which the
  // saving job did not have, get no per-process value (as from the persistent tier).
  RunJob(kProcesses, [&](int p, Coordinator& c) {
    Result<std::unique_ptr<KvStore>> kv = OpenKvStore(PersistentDir(), {.create = true});
    TS_ASSERT_OK(kv.status());
    Result<std::unique_ptr<MultiTierManager>> mgr =
        MultiTierManager::Open(kv->get(), Options(p, &c));
    TS_ASSERT_OK(mgr.status());
    Result<std::optional<int64_t>> latest = (*mgr)->LatestStep();
    TS_ASSERT_OK(latest.status());
    ASSERT_EQ(*latest, std::optional<int64_t>(3));
    Result<TieredRestore> restore = (*mgr)->OpenRestore(3);
    TS_EXPECT_OK(restore.status()) << "process " << p;
    if (restore.ok()) {
      if (p < 2) {
        EXPECT_EQ(restore->extras.per_process, StrCat("iterator of process ", p, " at step 3"));
      } else {
        EXPECT_EQ(restore->extras.per_process, std::nullopt) << p;
      }
      std::vector<char> got;
      TS_EXPECT_OK(RestoreToHost(*restore->source, {{"w", BoxOf(p), DType::kFloat32}},
                                 {.map = false}, [&](HostBatch& batch) {
                                   got.assign(batch.buffers[0]->data(),
                                              batch.buffers[0]->data() +
                                                  batch.buffers[0]->size());
                                   return OkStatus();
                                 }));
      EXPECT_TRUE(test::BytesEqual(
          test::MakeBoxData(DType::kFloat32, kShape, kSeed + 3, BoxOf(p)), got));
    }
    TS_EXPECT_OK((*mgr)->FinishRestore(restore.ok() ? &*restore : nullptr, nullptr));
    TS_EXPECT_OK((*mgr)->Close());
  });
}

TEST_F(MultiTierManagerTest, ValuesTheLocalSaveLacksComeFromThePersistentStep) {
  // Four processes save step 3 to both tiers; then every node loses its RAM.
  const auto open = [&](int p, Coordinator& c) {
    Result<std::unique_ptr<KvStore>> kv = OpenKvStore(PersistentDir(), {.create = true});
    EXPECT_TRUE(kv.ok());
    Result<std::unique_ptr<MultiTierManager>> mgr =
        MultiTierManager::Open(kv->get(), Options(p, &c));
    EXPECT_TRUE(mgr.ok()) << mgr.status();
    return std::make_pair(*std::move(kv), *std::move(mgr));
  };
  RunJob(kProcesses, [&](int p, Coordinator& c) {
    auto [kv, mgr] = open(p, c);
    std::vector<char> data;
    TS_ASSERT_OK(mgr->Save(3, Request(p, 3, &data), /*async=*/false, /*force=*/true).status());
    TS_EXPECT_OK(mgr->Close());
  });
  for (int node = 0; node < kProcesses; ++node) std::filesystem::remove_all(NodeDir(node));
  // Two processes restore it from the persistent tier and write their shards back: local
  // holdings of a job of 2, carrying the values of processes 0 and 1 only.
  RunJob(
      2,
      [&](int p, Coordinator& c) {
        auto [kv, mgr] = open(p, c);
        Result<TieredRestore> restore = mgr->OpenRestore(3);
        TS_ASSERT_OK(restore.status());
        TS_EXPECT_OK(RestoreToHost(*restore->source, {{"w", BoxOf(p), DType::kFloat32}},
                                   {.map = false}, [](HostBatch&) { return OkStatus(); }));
        std::vector<char> data;
        SaveRequest write_back = Request(p, 3, &data);
        TS_EXPECT_OK(mgr->FinishRestore(&*restore, &write_back));
        TS_EXPECT_OK(mgr->Close());
      },
      2);
  // Four again: the local save is chosen, and processes 2 and 3 get the values the persistent
  // step holds for them, not None.
  RunJob(kProcesses, [&](int p, Coordinator& c) {
    auto [kv, mgr] = open(p, c);
    Result<TieredRestore> restore = mgr->OpenRestore(3);
    TS_ASSERT_OK(restore.status());
    EXPECT_TRUE(restore->save.has_value());
    EXPECT_EQ(restore->extras.per_process, StrCat("iterator of process ", p, " at step 3")) << p;
    TS_EXPECT_OK(mgr->FinishRestore(&*restore, nullptr));
    TS_EXPECT_OK(mgr->Close());
  });
}

TEST_F(MultiTierManagerTest, AReusedLocalDirNeverRestoresAnotherRun) {
  // Run A saves step 5 into the nodes' RAM.
  RunJob(kProcesses, [&](int p, Coordinator& c) {
    Result<std::unique_ptr<KvStore>> kv = OpenKvStore(PersistentDir(), {.create = true});
    TS_ASSERT_OK(kv.status());
    Result<std::unique_ptr<MultiTierManager>> mgr =
        MultiTierManager::Open(kv->get(), Options(p, &c));
    TS_ASSERT_OK(mgr.status());
    std::vector<char> data;
    TS_ASSERT_OK((*mgr)->Save(5, Request(p, 5, &data)).status());
    TS_EXPECT_OK((*mgr)->Close());
  });
  // Run B: a new persistent root, the same local folders. A's step is not B's: nothing to
  // restore, B's own saves are kept by retention, and A's holdings are gone.
  RunJob(kProcesses, [&](int p, Coordinator& c) {
    Result<std::unique_ptr<KvStore>> kv =
        OpenKvStore(StrCat(temp_dir(), "/persistent-b"), {.create = true});
    TS_ASSERT_OK(kv.status());
    Result<std::unique_ptr<MultiTierManager>> mgr =
        MultiTierManager::Open(kv->get(), Options(p, &c));
    TS_ASSERT_OK(mgr.status());
    Result<std::optional<int64_t>> latest = (*mgr)->LatestStep();
    TS_ASSERT_OK(latest.status());
    EXPECT_EQ(*latest, std::nullopt);
    std::vector<char> data;
    TS_ASSERT_OK((*mgr)->Save(2, Request(p, 2, &data)).status());
    EXPECT_THAT((*mgr)->local().LocalSteps(), ElementsAre(2));
    latest = (*mgr)->LatestStep();
    TS_ASSERT_OK(latest.status());
    EXPECT_EQ(*latest, std::optional<int64_t>(2));
    TS_EXPECT_OK((*mgr)->Close());
    for (const Holding& h : DescribeHoldings(NodeDir(p), p)) EXPECT_NE(h.step, 5) << h.folder;
  });
}

TEST_F(MultiTierManagerTest, AProcessThatDoesNotComeBackIsNamedWithinTheDeadline) {
  // Processes 0..2 of 4 start; process 3 never does.
  RunJob(3, [&](int p, Coordinator& c) {
    Result<std::unique_ptr<KvStore>> kv = OpenKvStore(PersistentDir(), {.create = true});
    TS_ASSERT_OK(kv.status());
    MultiTierOptions options = Options(p, &c);
    options.local.timeout = std::chrono::milliseconds(500);
    const auto started = std::chrono::steady_clock::now();
    LocalTierOptions local = options.local;
    local.coordinator = &c;
    Result<std::unique_ptr<LocalTier>> tier = LocalTier::Open(local);
    EXPECT_TRUE(absl::IsDeadlineExceeded(tier.status())) << tier.status();
    EXPECT_THAT(tier.status().message(), HasSubstr("process 3 of 4 did not arrive"));
    EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(10));
  });
}

TEST_F(MultiTierManagerTest, ATierOpensAgainOnTheSameCoordinator) {
  // Each opening uses keys of its own in the coordinator's store (set-once keys).
  RunJob(kProcesses, [&](int p, Coordinator& c) {
    for (int round = 0; round < 2; ++round) {
      LocalTierOptions options = Options(p, &c).local;
      options.coordinator = &c;
      Result<std::unique_ptr<LocalTier>> tier = LocalTier::Open(options);
      ASSERT_TRUE(tier.ok()) << tier.status() << " (round " << round << ")";
      Result<JobHoldings> job = (*tier)->Gather({});
      TS_EXPECT_OK(job.status());
      TS_EXPECT_OK((*tier)->Close());
    }
  });
}

TEST_F(MultiTierManagerTest, ASingleProcessSkipsTheServerAndRestoresItsOwnCopy) {
  Result<std::unique_ptr<KvStore>> kv = OpenKvStore(PersistentDir(), {.create = true});
  TS_ASSERT_OK(kv.status());
  MultiTierOptions options = Options(0, nullptr);
  Result<std::unique_ptr<MultiTierManager>> mgr = MultiTierManager::Open(kv->get(), options);
  TS_ASSERT_OK(mgr.status());
  EXPECT_EQ((*mgr)->local().url(), "");
  // Step 100 goes to both tiers, step 101 to the local one only.
  std::vector<char> data;
  for (int64_t step : {100, 101}) {
    Result<bool> saved = (*mgr)->Save(step, Request(0, step, &data, Box::FromShape(kShape)));
    TS_ASSERT_OK(saved.status());
  }
  EXPECT_THAT((*mgr)->persistent().AllSteps(), ElementsAre(100));
  Result<std::optional<int64_t>> latest = (*mgr)->LatestStep();
  TS_ASSERT_OK(latest.status());
  EXPECT_EQ(*latest, std::optional<int64_t>(101));
  // Restoring the older step (from persistent storage) drops the newer local one, which
  // belongs to a run now abandoned.
  Result<TieredRestore> restore = (*mgr)->OpenRestore(100);
  TS_ASSERT_OK(restore.status());
  EXPECT_EQ(restore->save, std::nullopt);
  EXPECT_EQ(restore->extras.per_process, "iterator of process 0 at step 100");
  TS_EXPECT_OK((*mgr)->FinishRestore(&*restore, nullptr));
  EXPECT_THAT((*mgr)->local().LocalSteps(), IsEmpty());
  // Nothing can be restored of a step no tier holds.
  Result<TieredRestore> missing = (*mgr)->OpenRestore(7);
  EXPECT_TRUE(absl::IsNotFound(missing.status())) << missing.status();
  TS_EXPECT_OK((*mgr)->FinishRestore(nullptr, nullptr));
  TS_EXPECT_OK((*mgr)->Close());
}

// Flips one byte of `path` (a fault on the node, as the chaos test injects).
void FlipByte(const std::string& path, std::streamoff offset) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(file.good()) << path;
  file.seekg(offset);
  char byte = 0;
  ASSERT_TRUE(file.get(byte)) << path;
  file.seekp(offset);
  file.put(static_cast<char>(byte ^ 0x15));
  ASSERT_TRUE(file.good()) << path;
}

TEST_F(MultiTierManagerTest, ADamagedMetadataFileComesFromAnotherTierOrFailsTheStep) {
  // The chaos test flipped a byte of the metadata.json of the only holding of the latest step;
  // the restore went on as if the step had no metadata (the file's every copy damaged read as
  // NotFound), and the job failed its check instead of restoring the older step.
  Result<std::unique_ptr<KvStore>> kv = OpenKvStore(PersistentDir(), {.create = true});
  TS_ASSERT_OK(kv.status());
  const std::string holdings = StrCat(NodeDir(0), "/", HoldingFolder(0, 1));
  std::vector<char> data;
  {
    // Step 100 goes to both tiers; its local copy's metadata is damaged.
    Result<std::unique_ptr<MultiTierManager>> mgr =
        MultiTierManager::Open(kv->get(), Options(0, nullptr));
    TS_ASSERT_OK(mgr.status());
    TS_ASSERT_OK((*mgr)->Save(100, Request(0, 100, &data, Box::FromShape(kShape))).status());
    TS_ASSERT_OK((*mgr)->Close());
  }
  FlipByte(StrCat(holdings, "/0000000100/metadata.json"), 3);
  {
    // The persistent tier's copy is intact: it gives the metadata.
    Result<std::unique_ptr<MultiTierManager>> mgr =
        MultiTierManager::Open(kv->get(), Options(0, nullptr));
    TS_ASSERT_OK(mgr.status());
    Result<TieredRestore> restore = (*mgr)->OpenRestore(100);
    TS_ASSERT_OK(restore.status());
    EXPECT_TRUE(restore->save.has_value());  // the local save, with the persistent step behind
    EXPECT_EQ(restore->extras.metadata, "{\"step\": 100}");
    EXPECT_TRUE(restore->source->tier_stats().local_failed);
    TS_EXPECT_OK((*mgr)->FinishRestore(&*restore, nullptr));
    // Step 101 goes to the local tier only: its one copy of the metadata is then damaged.
    TS_ASSERT_OK((*mgr)->Save(101, Request(0, 101, &data, Box::FromShape(kShape))).status());
    TS_ASSERT_OK((*mgr)->Close());
  }
  FlipByte(StrCat(holdings, "/0000000101/metadata.json"), 3);
  Result<std::unique_ptr<MultiTierManager>> mgr =
      MultiTierManager::Open(kv->get(), Options(0, nullptr));
  TS_ASSERT_OK(mgr.status());
  Result<std::optional<int64_t>> latest = (*mgr)->LatestStep();
  TS_ASSERT_OK(latest.status());
  ASSERT_EQ(*latest, std::optional<int64_t>(101));
  // Not a step without metadata: lost data (an OSError in Python, which restores the older
  // step instead), naming the file.
  Result<TieredRestore> damaged = (*mgr)->OpenRestore(101);
  EXPECT_TRUE(absl::IsDataLoss(damaged.status())) << damaged.status();
  EXPECT_THAT(damaged.status().message(), HasSubstr("metadata.json"));
  std::vector<std::string> words;
  TS_EXPECT_OK((*mgr)->FinishRestore(nullptr, nullptr, "data", &words));
  // The older step restores whole, with its metadata.
  Result<TieredRestore> older = (*mgr)->OpenRestore(100);
  TS_ASSERT_OK(older.status());
  EXPECT_EQ(older->extras.metadata, "{\"step\": 100}");
  TS_EXPECT_OK((*mgr)->FinishRestore(&*older, nullptr));
  TS_EXPECT_OK((*mgr)->Close());
}

TEST_F(MultiTierManagerTest, ALocalDirOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown";
  std::filesystem::create_directories(NodeDir(0));
  ASSERT_EQ(::chown(NodeDir(0).c_str(), 12345, 12345), 0);
  LocalTierOptions options;
  options.dir = NodeDir(0);
  Result<std::unique_ptr<LocalTier>> tier = LocalTier::Open(options);
  EXPECT_TRUE(absl::IsPermissionDenied(tier.status())) << tier.status();
  EXPECT_THAT(tier.status().message(), HasSubstr("belongs to user 12345"));
}

}  // namespace
}  // namespace tensorstash
