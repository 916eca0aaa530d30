// The gs:// store against gcp-storage-emulator behind the enforcing proxy (tests/gcs/): the
// proxy (TS_GCS_ENDPOINT) enforces preconditions, generations, paging and 416, which the raw
// emulator (TS_GCS_RAW_ENDPOINT) ignores; the raw emulator is used only to check that writes to
// it are refused. ctest starts the servers (fixtures in CMakeLists.txt) and names their
// server.env in TS_GCS_ENV_FILE; without it every test here fails (a missing server is an
// error, never a pass).
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/kvstore/gcs/gcs_kvstore.h"
#include "tensorstash/testing/kvstore_conformance.h"
#include "tensorstash/testing/status_test_macros.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

std::map<std::string, std::string> ServerEnv() {
  std::map<std::string, std::string> env;
  const char* path = std::getenv("TS_GCS_ENV_FILE");
  if (path == nullptr) return env;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return env;
}

// A store on the enforcing proxy (or, with `raw`, the bare emulator) under a fresh prefix.
GcsKvStoreOptions TestOptions(bool raw = false) {
  std::map<std::string, std::string> env = ServerEnv();
  GcsKvStoreOptions options;
  options.bucket = env["TS_GCS_BUCKET"];
  options.prefix = StrCat("t-", RandomHexId(12));
  options.endpoint = raw ? env["TS_GCS_RAW_ENDPOINT"] : env["TS_GCS_ENDPOINT"];
  options.credentials = AnonymousGcsCredentials();
  options.part_size = size_t{1} << 20;
  options.list_page_size = 2;  // every listing pages
  options.initial_backoff = std::chrono::milliseconds(5);
  options.probe = true;
  return options;
}

std::unique_ptr<GcsKvStore> OpenOrNull(GcsKvStoreOptions options) {
  Result<std::unique_ptr<GcsKvStore>> store = GcsKvStore::Open(std::move(options));
  if (!store.ok()) {
    ADD_FAILURE() << store.status();
    return nullptr;
  }
  return std::move(*store);
}

class GcsServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(ServerEnv().empty()) << "TS_GCS_ENV_FILE does not name a server.env (run "
                                         "through ctest, which starts the servers)";
  }
};

TS_INSTANTIATE_KVSTORE_CONFORMANCE(
    GCS, std::vector<KvStoreBackend>({{"Proxy", [](const std::string&) -> std::unique_ptr<KvStore> {
                                         return OpenOrNull(TestOptions());
                                       }}}));

TS_INSTANTIATE_KVSTORE_READ_CONFORMANCE(
    GCS, std::vector<ReadableKvStoreBackend>(
             {{"Proxy",
               [](const std::string&,
                  const std::map<std::string, std::string>& contents) -> std::unique_ptr<KvStore> {
                 std::unique_ptr<GcsKvStore> store = OpenOrNull(TestOptions());
                 if (store == nullptr) return nullptr;
                 for (const auto& [key, value] : contents) {
                   if (Status written = store->Write(key, value); !written.ok()) {
                     ADD_FAILURE() << written;
                     return nullptr;
                   }
                 }
                 return store;
               }}}));

using GcsStoreTest = GcsServerTest;

TEST_F(GcsStoreTest, TheRawEmulatorIsRefusedWritesButServesReads) {
  std::unique_ptr<GcsKvStore> proxied = OpenOrNull(TestOptions());
  ASSERT_NE(proxied, nullptr);
  GcsKvStoreOptions raw_options = TestOptions(/*raw=*/true);
  // The same prefix, so that the raw store reads what the proxied one wrote.
  raw_options.prefix = proxied->Describe().substr(proxied->Describe().rfind('/') + 1);
  std::unique_ptr<GcsKvStore> raw = OpenOrNull(raw_options);
  ASSERT_NE(raw, nullptr);
  TS_ASSERT_OK(proxied->Write("k", "value"));
  for (const Status& refused :
       {raw->Write("a", "1"), raw->WriteIfAbsent("b", "2"), raw->OpenForWrite("c").status(),
        raw->TryLock("lock").status()}) {
    EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr("ignores ifGenerationMatch"));
    EXPECT_THAT(std::string(refused.message()), HasSubstr("enforcing proxy"));
  }
  Result<std::string> read = raw->Read("k");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "value");
  EXPECT_TRUE(absl::IsNotFound(proxied->Stat("a").status()));
}

TEST_F(GcsStoreTest, CreateOnlyWritesRaceAndOneWins) {
  std::unique_ptr<GcsKvStore> store = OpenOrNull(TestOptions());
  ASSERT_NE(store, nullptr);
  std::vector<Status> outcomes(8);
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] { outcomes[i] = store->WriteIfAbsent("COMMIT", StrCat("w", i)); });
  }
  for (std::thread& thread : threads) thread.join();
  int won = -1;
  for (int i = 0; i < 8; ++i) {
    if (outcomes[i].ok()) {
      EXPECT_EQ(won, -1) << "two writers won";
      won = i;
    } else {
      EXPECT_TRUE(absl::IsAlreadyExists(outcomes[i])) << outcomes[i];
    }
  }
  ASSERT_NE(won, -1);
  EXPECT_EQ(store->Read("COMMIT").value(), StrCat("w", won));
}

TEST_F(GcsStoreTest, AReplacedObjectIsFailedPreconditionForPinnedReads) {
  std::unique_ptr<GcsKvStore> store = OpenOrNull(TestOptions());
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("data", "0123456789"));
  Result<ObjectInfo> info = store->Stat("data");
  ASSERT_TRUE(info.ok()) << info.status();
  Result<std::unique_ptr<ReadableFile>> file = store->OpenForRead("data");
  ASSERT_TRUE(file.ok()) << file.status();
  char bytes[4] = {};
  TS_ASSERT_OK(store->ReadRangeAtGeneration("data", info->generation, 2, 4, bytes));
  EXPECT_EQ(std::string_view(bytes, 4), "2345");
  TS_ASSERT_OK(store->Write("data", "abcdefghij"));
  Status pinned = store->ReadRangeAtGeneration("data", info->generation, 2, 4, bytes);
  EXPECT_TRUE(absl::IsFailedPrecondition(pinned)) << pinned;
  EXPECT_THAT(std::string(pinned.message()), HasSubstr("'data'"));
  Status through_file = (*file)->ReadAt(0, 4, bytes);
  EXPECT_TRUE(absl::IsFailedPrecondition(through_file)) << through_file;
  // A range from the end on is DataLoss (the proxy answers 416, as GCS does).
  Status past = store->ReadRange("data", 10, 4, bytes);
  EXPECT_TRUE(absl::IsDataLoss(past)) << past;
}

TEST_F(GcsStoreTest, LargeFilesAreComposedFromPartsInATree) {
  GcsKvStoreOptions options = TestOptions();
  options.part_size = 1024;  // 40 parts: one level of 32-way composes, then the object
  std::unique_ptr<GcsKvStore> store = OpenOrNull(options);
  ASSERT_NE(store, nullptr);
  std::string data;
  for (int i = 0; i < 40 * 1024 - 100; ++i) data += static_cast<char>('a' + (i * 7 + i / 1000) % 26);
  Result<std::unique_ptr<WritableFile>> file = store->OpenForWrite("big/data.bin");
  ASSERT_TRUE(file.ok()) << file.status();
  // Written back to front, so that the parts go up out of order.
  for (size_t offset = data.size(); offset > 0;) {
    const size_t size = std::min<size_t>(3000, offset);
    offset -= size;
    TS_ASSERT_OK((*file)->WriteAt(offset, data.data() + offset, size));
  }
  // Not visible before Close.
  EXPECT_TRUE(absl::IsNotFound(store->Stat("big/data.bin").status()));
  Result<std::vector<PendingWrite>> pending = store->ListPendingWrites("");
  ASSERT_TRUE(pending.ok()) << pending.status();
  ASSERT_EQ(pending->size(), 1u);
  EXPECT_EQ((*pending)[0].key, "big/data.bin");
  EXPECT_TRUE((*pending)[0].started.has_value());
  TS_ASSERT_OK((*file)->Close());
  EXPECT_EQ(store->Read("big/data.bin").value(), data);
  // The parts are gone and were never listed.
  EXPECT_EQ(store->List("").value(), std::vector<std::string>({"big/data.bin"}));
  EXPECT_TRUE(store->ListPendingWrites("").value().empty());
}

TEST_F(GcsStoreTest, AnAbandonedUploadIsListedAndAborted) {
  GcsKvStoreOptions options = TestOptions();
  options.part_size = 1024;
  std::unique_ptr<GcsKvStore> store = OpenOrNull(options);
  ASSERT_NE(store, nullptr);
  Result<std::unique_ptr<WritableFile>> file = store->OpenForWrite("run/7/data/0-0.dat");
  ASSERT_TRUE(file.ok()) << file.status();
  const std::string part(2048, 'x');
  TS_ASSERT_OK((*file)->WriteAt(0, part.data(), part.size()));  // two parts go up
  // A crash: the file is never closed (leaked), its parts stay.
  (void)file->release();
  Result<std::vector<PendingWrite>> pending = store->ListPendingWrites("run/");
  ASSERT_TRUE(pending.ok()) << pending.status();
  ASSERT_EQ(pending->size(), 1u);
  EXPECT_EQ((*pending)[0].key, "run/7/data/0-0.dat");
  EXPECT_TRUE(store->ListPendingWrites("other/").value().empty());
  TS_ASSERT_OK(store->AbortPendingWrite((*pending)[0]));
  EXPECT_TRUE(store->ListPendingWrites("").value().empty());
  EXPECT_TRUE(store->List("").value().empty());
}

TEST_F(GcsStoreTest, KeysThatNeedEncodingRoundTrip) {
  std::unique_ptr<GcsKvStore> store = OpenOrNull(TestOptions());
  ASSERT_NE(store, nullptr);
  const std::vector<std::string> keys = {"dir/a b.bin", "dir/x+y", "dir/p%2Fq", "dir/k=v&w",
                                         "dir/ключ/ü.txt", "dir/~t(1)*"};
  for (const std::string& key : keys) TS_ASSERT_OK(store->Write(key, "v:" + key));
  for (const std::string& key : keys) EXPECT_EQ(store->Read(key).value(), "v:" + key) << key;
  std::vector<std::string> sorted = keys;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(store->List("dir/").value(), sorted);
}

}  // namespace
}  // namespace tensorstash
