// Several processes (threads with an InProcessCoordinator) save one step together, each adding
// only the shards its devices hold; a reader restores the step onto another layout. And when one
// process fails or disagrees, every process gets an error, none hangs, and no step appears.
#include <chrono>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/testing/in_process_coordinator.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"

namespace tensorstash {
namespace {

using test::BytesEqual;
using test::HeldShards;
using test::MakeBoxData;
using test::Sharding;
using test::StoreKind;
using test::TestArray;
using ::testing::HasSubstr;

// Devices are spread over processes in contiguous blocks (as hosts own consecutive devices).
int OwnerOf(int device, int num_devices, int num_processes) {
  return device * num_processes / num_devices;
}

// Runs `body(coordinator)` as `n` processes at once and returns what each returned.
std::vector<Status> RunProcesses(int n, const std::function<Status(Coordinator*)>& body) {
  auto group = std::make_shared<InProcessCoordinatorGroup>(n);
  std::vector<Status> statuses(n);
  std::vector<std::thread> threads;
  for (int p = 0; p < n; ++p) {
    threads.emplace_back([&, p] {
      InProcessCoordinator coordinator(group, p);
      statuses[p] = body(&coordinator);
    });
  }
  for (std::thread& t : threads) t.join();
  return statuses;
}

// One process's part of a save: the shards of its own devices. `edit(i, &spec, &held)` may
// change what this process adds for array i (to make it fail or disagree).
using EditFn = std::function<void(size_t, ArraySpec*, HeldShards*)>;
Status SaveOwnShards(KvStore* kv, const std::string& dir, Coordinator* c,
                     const std::vector<TestArray>& arrays, const WriterOptions& options,
                     const EditFn& edit = nullptr, WriteStats* stats = nullptr) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                      CheckpointWriter::Create(kv, dir, options, c));
  std::vector<HeldShards> held;
  held.reserve(arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i) {
    const TestArray& a = arrays[i];
    const int devices = a.sharding.num_devices();
    ArraySpec spec = a.spec;
    held.push_back(test::HoldShards(a.spec, a.seed, a.sharding, [&](int d) {
      return OwnerOf(d, devices, c->process_count()) == c->process_index();
    }));
    if (edit) edit(i, &spec, &held.back());
    TS_RETURN_IF_ERROR(writer->AddArray(spec, held.back().shards));
  }
  return writer->Commit(stats);
}

// Arrays of a small model on 8 devices: uneven 2-d tiles, vectors replicated across processes,
// a scalar everyone holds, an array on 3 devices only (some processes hold none of it), zstd, and
// an empty array.
std::vector<TestArray> ModelArrays() {
  std::vector<TestArray> arrays = {
      {{"params/w", DType::kFloat32, {61, 37}}, 1, {{2, 4}, {0, 1}}},
      {{"params/b", DType::kBfloat16, {37}}, 2, {{2, 4}, {1}}},
      {{"opt/mu", DType::kInt64, {8, 3, 5}, Codec::kZstd}, 3, {{8}, {0, -1, -1}}},
      {{"step", DType::kInt32, {}}, 4, test::Replicated(0, 8)},
      {{"emb", DType::kUint8, {1000, 7}}, 5, {{3}, {0, -1}}},
      {{"empty", DType::kFloat16, {0, 4}}, 6, {{2}, {0, -1}}},
      {{"c", DType::kComplex64, {9, 2}}, 7, {{2, 2, 2}, {2, -1}}},
  };
  return arrays;
}

// Reads every array onto `target(array)` and compares it bit for bit.
void ExpectRestoresOnto(CheckpointReader* reader, const std::vector<TestArray>& arrays,
                        const std::function<Sharding(const TestArray&)>& target) {
  ASSERT_EQ(reader->arrays().size(), arrays.size());
  for (const TestArray& a : arrays) {
    const Sharding layout = target(a);
    SCOPED_TRACE(StrCat("array '", a.spec.path, "' onto ", layout.ToString()));
    std::vector<test::DeviceShard> devices = test::ShardArray(a.spec.shape, layout);
    std::vector<std::vector<char>> buffers;
    std::vector<ReadRequest> requests;
    buffers.reserve(devices.size());
    for (const test::DeviceShard& d : devices) {
      buffers.emplace_back(static_cast<size_t>(d.box.num_elements()) * ItemSize(a.spec.dtype),
                           static_cast<char>(0x5a));
      requests.push_back({a.spec.path, d.box, a.spec.dtype, buffers.back().data()});
    }
    TS_ASSERT_OK(reader->ReadMany(requests));
    for (size_t d = 0; d < devices.size(); ++d) {
      EXPECT_TRUE(
          BytesEqual(MakeBoxData(a.spec.dtype, a.spec.shape, a.seed, devices[d].box), buffers[d]))
          << "device " << d << " " << devices[d].box.ToString();
    }
  }
}

// Every store key (a failed save must leave nothing behind).
std::vector<std::string> AllKeys(KvStore* kv) {
  Result<std::vector<std::string>> keys = kv->List("");
  EXPECT_TRUE(keys.ok()) << keys.status();
  return keys.value_or(std::vector<std::string>{});
}

void ExpectAllFailed(const std::vector<Status>& statuses) {
  for (size_t p = 0; p < statuses.size(); ++p) {
    EXPECT_FALSE(statuses[p].ok()) << "process " << p << " reported success";
  }
}

void ExpectNoStep(KvStore* kv, const std::string& dir) {
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv, dir);
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kNotFound) << reader.status();
}

struct MultiParam {
  StoreKind store;
  int processes;
  bool split;
};
void PrintTo(const MultiParam& param, std::ostream* out) {
  *out << test::StoreName(param.store) << ", " << param.processes << " processes, split "
       << param.split;
}

class CheckpointMultiWriterTest : public test::TempDirTest,
                                  public ::testing::WithParamInterface<MultiParam> {
 protected:
  void SetUp() override {
    test::TempDirTest::SetUp();
    Result<std::unique_ptr<KvStore>> store =
        test::MakeStore(GetParam().store, temp_dir() + "/root");
    TS_ASSERT_OK(store.status());
    kv_ = *std::move(store);
  }
  void TearDown() override {
    kv_.reset();
    test::TempDirTest::TearDown();
  }
  std::unique_ptr<KvStore> kv_;
};

TEST_P(CheckpointMultiWriterTest, EachProcessWritesItsShardsAndTheStepRestoresElsewhere) {
  const int n = GetParam().processes;
  const std::vector<TestArray> arrays = ModelArrays();
  WriterOptions options;
  options.sync = GetParam().store == StoreKind::kFile;
  options.split_replicated_writes = GetParam().split;
  options.target_chunk_bytes = 200;
  options.target_data_file_bytes = 2048;
  options.io_threads = 2;
  options.coordination_timeout = std::chrono::seconds(60);
  std::vector<WriteStats> stats(n);
  const std::vector<Status> statuses = RunProcesses(n, [&](Coordinator* c) {
    return SaveOwnShards(kv_.get(), "job/0000000100", c, arrays, options, nullptr,
                         &stats[c->process_index()]);
  });
  for (int p = 0; p < n; ++p) TS_EXPECT_OK(statuses[p]) << "process " << p;

  Result<std::unique_ptr<CheckpointReader>> reader =
      CheckpointReader::Open(kv_.get(), "job/0000000100");
  TS_ASSERT_OK(reader.status());
  EXPECT_EQ((*reader)->commit_record().process_count, n);

  // Who wrote: data files are named after their process. With split writes every process
  // writes (each holds chunks of some replica); without, only holders of replica 0 do.
  std::set<int> writers;
  for (const DataFileInfo& f : (*reader)->index().files) {
    writers.insert(std::stoi(f.name.substr(5, f.name.find('-') - 5)));
  }
  std::set<int> expected_writers;
  uint64_t chunks = 0, raw = 0;
  for (int p = 0; p < n; ++p) {
    if (stats[p].chunks > 0) expected_writers.insert(p);
    chunks += stats[p].chunks;
    raw += stats[p].raw_bytes;
  }
  EXPECT_EQ(writers, expected_writers);
  if (GetParam().split) {
    EXPECT_EQ(static_cast<int>(writers.size()), n);
  }
  EXPECT_EQ(chunks, (*reader)->index().entries.size()) << "every chunk written exactly once";
  uint64_t total = 0;
  for (const TestArray& a : arrays) {
    total +=
        static_cast<uint64_t>(Box::FromShape(a.spec.shape).num_elements()) * ItemSize(a.spec.dtype);
  }
  EXPECT_EQ(raw, total);

  // Restore onto other layouts: transposed meshes, a single device, everything replicated.
  ExpectRestoresOnto(reader->get(), arrays, [](const TestArray& a) {
    const int rank = static_cast<int>(a.spec.shape.size());
    Sharding s{{3, 2}, std::vector<int>(rank, -1)};
    if (rank >= 1) s.dim_axis[rank - 1] = 0;
    if (rank >= 2) s.dim_axis[0] = 1;
    return s;
  });
  ExpectRestoresOnto(reader->get(), arrays, [](const TestArray& a) {
    return test::Replicated(static_cast<int>(a.spec.shape.size()), 1);
  });
  std::mt19937_64 rng(42);
  ExpectRestoresOnto(reader->get(), arrays, [&](const TestArray& a) {
    return test::RandomSharding(static_cast<int>(a.spec.shape.size()), 8, rng);
  });
  Result<std::vector<BadChunk>> bad = (*reader)->Verify();
  TS_ASSERT_OK(bad.status());
  EXPECT_TRUE(bad->empty());
  for (const std::string& key : AllKeys(kv_.get())) {
    EXPECT_EQ(key.rfind("job/0000000100/", 0), 0u) << "leftover " << key;
    EXPECT_EQ(key.find("index.part"), std::string::npos) << "leftover " << key;
  }
}

// A process leaves out one of its shards: the chunks are not all covered.
TEST_P(CheckpointMultiWriterTest, MissingShardFailsEveryProcess) {
  const int n = GetParam().processes;
  const std::vector<TestArray> arrays = ModelArrays();
  WriterOptions options;
  options.sync = false;
  options.split_replicated_writes = GetParam().split;
  options.target_chunk_bytes = 200;
  options.coordination_timeout = std::chrono::seconds(60);
  const int culprit = n - 1;
  const std::vector<Status> statuses = RunProcesses(n, [&](Coordinator* c) {
    return SaveOwnShards(kv_.get(), "job/0000000200", c, arrays, options,
                         [&](size_t i, ArraySpec*, HeldShards* held) {
                           if (c->process_index() == culprit && i == 0) {
                             held->shards.pop_back();  // a tile of "params/w"
                           }
                         });
  });
  ExpectAllFailed(statuses);
  for (int p = 0; p < n; ++p) {
    EXPECT_EQ(statuses[p].code(), absl::StatusCode::kInvalidArgument) << statuses[p];
    EXPECT_THAT(statuses[p].message(), HasSubstr("params/w")) << "process " << p;
    EXPECT_THAT(statuses[p].message(), HasSubstr("cover")) << "process " << p;
  }
  ExpectNoStep(kv_.get(), "job/0000000200");
  EXPECT_THAT(AllKeys(kv_.get()), ::testing::IsEmpty());

  // The same step can then be saved normally.
  options.sync = GetParam().store == StoreKind::kFile;
  const std::vector<Status> retry = RunProcesses(n, [&](Coordinator* c) {
    return SaveOwnShards(kv_.get(), "job/0000000200", c, arrays, options);
  });
  for (int p = 0; p < n; ++p) TS_EXPECT_OK(retry[p]) << "process " << p;
  Result<std::unique_ptr<CheckpointReader>> reader =
      CheckpointReader::Open(kv_.get(), "job/0000000200");
  TS_ASSERT_OK(reader.status());
  ExpectRestoresOnto(reader->get(), arrays, [](const TestArray& a) { return a.sharding; });
}

// A KvStore that fails every write of one process's data files (say, a full disk on one host).
class FailingDataKvStore final : public ForwardingKvStore {
 public:
  FailingDataKvStore(KvStore* base, std::string marker)
      : ForwardingKvStore(base), marker_(std::move(marker)) {}
  Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view key) override {
    if (std::string_view(key).find(marker_) != std::string_view::npos) {
      return ResourceExhaustedError(StrCat("open for write '", key, "': no space left on device"));
    }
    return base()->OpenForWrite(key);
  }

 private:
  std::string marker_;
};

TEST_P(CheckpointMultiWriterTest, WriteErrorOnOneProcessFailsEveryProcess) {
  const int n = GetParam().processes;
  const int culprit = 1;
  FailingDataKvStore failing(kv_.get(), StrCat("/data/", culprit, "-"));
  const std::vector<TestArray> arrays = ModelArrays();
  WriterOptions options;
  options.sync = false;
  options.split_replicated_writes = true;  // so that the culprit has chunks to write
  options.coordination_timeout = std::chrono::seconds(60);
  const std::vector<Status> statuses = RunProcesses(n, [&](Coordinator* c) {
    return SaveOwnShards(&failing, "job/0000000300", c, arrays, options);
  });
  ExpectAllFailed(statuses);
  for (int p = 0; p < n; ++p) {
    EXPECT_EQ(statuses[p].code(), absl::StatusCode::kResourceExhausted) << statuses[p];
    EXPECT_THAT(statuses[p].message(), HasSubstr("no space left")) << "process " << p;
  }
  EXPECT_THAT(statuses[0].message(), HasSubstr(StrCat("process ", culprit)));
  ExpectNoStep(kv_.get(), "job/0000000300");
  EXPECT_THAT(AllKeys(kv_.get()), ::testing::IsEmpty());
}

// One process cannot add an array (a shard outside the shape) and gives up without committing:
// the others time out instead of hanging, and nothing is visible.
TEST_P(CheckpointMultiWriterTest, ProcessThatGivesUpMakesOthersTimeOut) {
  const int n = GetParam().processes;
  const std::vector<TestArray> arrays = ModelArrays();
  WriterOptions options;
  options.sync = false;
  options.coordination_timeout = std::chrono::milliseconds(300);
  const auto start = std::chrono::steady_clock::now();
  Status culprit_add;
  const std::vector<Status> statuses = RunProcesses(n, [&](Coordinator* c) -> Status {
    if (c->process_index() != 1)
      return SaveOwnShards(kv_.get(), "job/0000000400", c, arrays, options);
    TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                        CheckpointWriter::Create(kv_.get(), "job/0000000400", options, c));
    std::vector<char> data(4096);
    culprit_add = writer->AddArray(arrays[0].spec, {{Box({60, 0}, {5, 5}), data.data()}});
    return culprit_add;  // never commits
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(culprit_add.code(), absl::StatusCode::kInvalidArgument) << culprit_add;
  EXPECT_THAT(culprit_add.message(), HasSubstr("params/w"));
  ExpectAllFailed(statuses);
  for (int p = 0; p < n; ++p) {
    if (p == 1) continue;
    EXPECT_EQ(statuses[p].code(), absl::StatusCode::kDeadlineExceeded) << statuses[p];
  }
  EXPECT_LT(seconds, 10.0);
  ExpectNoStep(kv_.get(), "job/0000000400");
}

// Processes that describe different arrays fail, quickly, and commit nothing.
TEST_P(CheckpointMultiWriterTest, ProcessesDescribingDifferentArraysFail) {
  const int n = GetParam().processes;
  const std::vector<TestArray> arrays = ModelArrays();
  struct Variant {
    std::string name;
    EditFn edit;      // applied by the last process
    bool drop_array;  // the last process adds one array fewer
  };
  std::vector<Variant> variants = {
      {"fewer arrays", nullptr, true},
      {"other path",
       [](size_t i, ArraySpec* spec, HeldShards*) {
         if (i == 1) spec->path = "params/bias";
       },
       false},
      {"other dtype of the same size",
       [](size_t i, ArraySpec* spec, HeldShards*) {
         if (i == 0) spec->dtype = DType::kInt32;
       },
       false},
      {"other dtype size",
       [](size_t i, ArraySpec* spec, HeldShards*) {
         if (i == 2) spec->dtype = DType::kInt32;  // int64 elsewhere
       },
       false},
      {"other shape, same rank",
       [](size_t i, ArraySpec* spec, HeldShards* held) {
         if (i == 4) {
           spec->shape = {1001, 7};
           held->shards.clear();
         }
       },
       false},
      {"other rank",
       [](size_t i, ArraySpec* spec, HeldShards* held) {
         if (i == 3) {
           spec->shape = {1};
           held->shards.clear();
         }
       },
       false},
      {"other codec",
       [](size_t i, ArraySpec* spec, HeldShards*) {
         if (i == 2) spec->codec = Codec::kNone;
       },
       false},
  };
  for (size_t v = 0; v < variants.size(); ++v) {
    SCOPED_TRACE(variants[v].name);
    WriterOptions options;
    options.sync = false;
    // Disagreement is found at once; the timeout only bounds a hang.
    options.coordination_timeout = std::chrono::seconds(2);
    const std::string dir = StrCat("job/00000005", v);
    const auto start = std::chrono::steady_clock::now();
    const std::vector<Status> statuses = RunProcesses(n, [&](Coordinator* c) {
      const bool odd_one = c->process_index() == n - 1;
      std::vector<TestArray> mine = arrays;
      if (odd_one && variants[v].drop_array) mine.pop_back();
      return SaveOwnShards(kv_.get(), dir, c, mine, options, odd_one ? variants[v].edit : EditFn());
    });
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ExpectAllFailed(statuses);
    for (int p = 0; p < n; ++p) {
      EXPECT_THAT(statuses[p].code(), ::testing::AnyOf(absl::StatusCode::kInvalidArgument,
                                                       absl::StatusCode::kDeadlineExceeded))
          << statuses[p];
    }
    // The disagreement is named, not just a timeout, by at least one process.
    bool named = false;
    for (const Status& s : statuses) {
      named = named || (s.code() == absl::StatusCode::kInvalidArgument &&
                        s.message().find("process") != absl::string_view::npos);
    }
    EXPECT_TRUE(named) << statuses[0];
    EXPECT_LT(seconds, 10.0);
    ExpectNoStep(kv_.get(), dir);
  }
  EXPECT_THAT(AllKeys(kv_.get()), ::testing::IsEmpty());
}

std::vector<MultiParam> MultiParams() {
  std::vector<MultiParam> params;
  for (StoreKind store : {StoreKind::kFile, StoreKind::kMemory, StoreKind::kMemoryNoRename}) {
    for (int processes : {2, 3, 4}) {
      for (bool split : {true, false}) params.push_back({store, processes, split});
    }
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(CheckpointProcesses, CheckpointMultiWriterTest,
                         ::testing::ValuesIn(MultiParams()),
                         [](const ::testing::TestParamInfo<MultiParam>& param_info) {
                           return StrCat(test::StoreName(param_info.param.store), "_",
                                         param_info.param.processes, "Processes_",
                                         param_info.param.split ? "Split" : "NoSplit");
                         });

}  // namespace
}  // namespace tensorstash
