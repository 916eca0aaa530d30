// The gs:// store against gcp-storage-emulator behind the enforcing proxy (tests/gcs/): the
// proxy (TS_GCS_ENDPOINT) enforces preconditions, generations, paging and 416, which the raw
// emulator (TS_GCS_RAW_ENDPOINT) ignores; the raw emulator is used only to check that writes to
// it are refused. ctest starts the servers (fixtures in CMakeLists.txt) and names their
// server.env in TS_GCS_ENV_FILE; without it every test here fails (a missing server is an
// error, never a pass).
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rsa.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/array/box.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/kvstore/gcs/gcs_kvstore.h"
#include "tensorstash/kvstore/http/http_client.h"
#include "tensorstash/kvstore/registry.h"
#include "tensorstash/testing/kvstore_conformance.h"
#include "tensorstash/testing/status_test_macros.h"
#include "tensorstash/util/crc32c.h"
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

// Sets the proxy's faults (tests/gcs/gcs_proxy.py: /__gcs_proxy__/config?...).
void ConfigureProxy(const std::string& query) {
  HttpClient client;
  HttpRequest request;
  request.url = StrCat(ServerEnv()["TS_GCS_ENDPOINT"], "/__gcs_proxy__/config?", query);
  Result<HttpResponse> response = client.Perform(request, "configuring the proxy");
  ASSERT_TRUE(response.ok()) << response.status();
  ASSERT_EQ(response->status, 200) << response->body;
}

TEST_F(GcsStoreTest, ALostAnswerToOurCreateIsOursAndAnotherWritersIsNot) {
  std::unique_ptr<GcsKvStore> store = OpenOrNull(TestOptions());
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("warm", "probe first"));  // the probe runs before the fault is set
  // The create goes through, its answer is cut; the retry gets 412; our nonce settles it.
  ConfigureProxy("fail_next=reset_after");
  TS_ASSERT_OK(store->WriteIfAbsent("COMMIT", "mine"));
  EXPECT_EQ(store->Read("COMMIT").value(), "mine");
  // Another writer's object is not ours, whatever happened to the answer.
  ConfigureProxy("fail_next=reset_after");
  Status again = store->WriteIfAbsent("COMMIT", "theirs");
  EXPECT_TRUE(absl::IsAlreadyExists(again)) << again;
  EXPECT_EQ(store->Read("COMMIT").value(), "mine");
}

// The server's answer to an upload is the only evidence that it stored our bytes: one without a
// CRC-32C is DataLoss naming the object, for a whole object as for a part of a large one.
TEST_F(GcsStoreTest, AnUploadAnswerWithoutACrc32cIsDataLossNamingTheObject) {
  GcsKvStoreOptions options = TestOptions();
  options.part_size = 1024;
  std::unique_ptr<GcsKvStore> store = OpenOrNull(options);
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("warm", "probe first"));  // the probe's uploads keep their crc32c
  ConfigureProxy("strip_upload_crc32c=1");
  Status whole = store->Write("small.bin", "0123456789");
  EXPECT_TRUE(absl::IsDataLoss(whole)) << whole;
  EXPECT_THAT(std::string(whole.message()), HasSubstr("small.bin"));
  EXPECT_THAT(std::string(whole.message()), HasSubstr("CRC-32C"));

  Result<std::unique_ptr<WritableFile>> file = store->OpenForWrite("big.bin");
  ASSERT_TRUE(file.ok()) << file.status();
  ConfigureProxy("strip_upload_crc32c=1");
  const std::string data(5000, 'x');  // 5 parts: the first one's answer loses its crc32c
  Status wrote = (*file)->WriteAt(0, data.data(), data.size());
  Status closed = wrote.ok() ? (*file)->Close() : wrote;
  EXPECT_TRUE(absl::IsDataLoss(closed)) << closed;
  EXPECT_THAT(std::string(closed.message()), HasSubstr("big.bin"));
  ConfigureProxy("strip_upload_crc32c=0");
  EXPECT_TRUE(absl::IsNotFound(store->Stat("big.bin").status()));
  // With the answers whole again, both go up.
  TS_ASSERT_OK(store->Write("small.bin", "0123456789"));
  EXPECT_EQ(store->Read("small.bin").value(), "0123456789");
}

// The proxy's counters (GET /__gcs_proxy__/stats).
nlohmann::json ProxyStats() {
  HttpClient client;
  HttpRequest request;
  request.url = StrCat(ServerEnv()["TS_GCS_ENDPOINT"], "/__gcs_proxy__/stats");
  Result<HttpResponse> response = client.Perform(request, "reading the proxy's stats");
  if (!response.ok() || response->status != 200) {
    ADD_FAILURE() << (response.ok() ? response->body : response.status().ToString());
    return {};
  }
  return nlohmann::json::parse(response->body);
}

int Ops(const nlohmann::json& stats, const std::string& op) {
  return stats.contains("ops") && stats["ops"].contains(op) ? stats["ops"][op].get<int>() : 0;
}

// From resumable_min_bytes on, objects and parts go up as a resumable session and one PUT
// (no multipart body), with the same checks: the CRC-32C in the answer, create-only, a lost
// answer settled by the nonce.
TEST_F(GcsStoreTest, LargeUploadsAreOneResumablePutWithTheSameChecks) {
  GcsKvStoreOptions options = TestOptions();
  options.part_size = 4096;
  options.resumable_min_bytes = 2048;
  std::unique_ptr<GcsKvStore> store = OpenOrNull(options);
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("warm", "probe first"));
  std::string big;
  for (int i = 0; i < 10000; ++i) big += static_cast<char>('a' + (i * 7) % 26);
  const nlohmann::json before = ProxyStats();
  TS_ASSERT_OK(store->Write("one.bin", big));
  Result<std::unique_ptr<WritableFile>> file = store->OpenForWrite("parts.bin");
  ASSERT_TRUE(file.ok()) << file.status();
  TS_ASSERT_OK((*file)->WriteAt(0, big.data(), big.size()));  // 4096 + 4096 + 1808 bytes
  TS_ASSERT_OK((*file)->Close());
  const nlohmann::json after = ProxyStats();
  // one.bin and the two full parts: resumable; the last part (1808 bytes): multipart.
  EXPECT_EQ(Ops(after, "resumable_start") - Ops(before, "resumable_start"), 3) << after;
  EXPECT_EQ(Ops(after, "session_put") - Ops(before, "session_put"), 3) << after;
  EXPECT_EQ(Ops(after, "multipart") - Ops(before, "multipart"), 1) << after;
  EXPECT_EQ(store->Read("one.bin").value(), big);
  EXPECT_EQ(store->Read("parts.bin").value(), big);

  Status again = store->WriteIfAbsent("one.bin", big);
  EXPECT_TRUE(absl::IsAlreadyExists(again)) << again;
  ConfigureProxy("strip_upload_crc32c=1");
  Status stripped = store->Write("two.bin", big);
  EXPECT_TRUE(absl::IsDataLoss(stripped)) << stripped;
  EXPECT_THAT(std::string(stripped.message()), HasSubstr("two.bin"));
  ConfigureProxy("strip_upload_crc32c=0");
  // The PUT goes through and its answer is cut: the retried PUT finds the session gone (the
  // emulator forgets completed sessions) and the nonce says the object is ours.
  ConfigureProxy("fail_next=pass,reset_after");
  TS_ASSERT_OK(store->WriteIfAbsent("three.bin", big));
  EXPECT_EQ(store->Read("three.bin").value(), big);
}

// Bytes written with their CRC-32C (WriteChunkAt, as a save writes its chunks) go up from the
// writer's memory with the object's CRC-32C combined from theirs, in resumable, multipart and
// composed uploads alike; the server checks it, so a wrong CRC given fails the upload, naming
// the key, and nothing appears.
TEST_F(GcsStoreTest, ChunksWrittenWithTheirCrcsAreSentFromThereAndChecked) {
  GcsKvStoreOptions options = TestOptions();
  options.part_size = 4096;
  options.resumable_min_bytes = 2048;
  std::unique_ptr<GcsKvStore> store = OpenOrNull(options);
  ASSERT_NE(store, nullptr);
  std::string big;
  for (int i = 0; i < 10000; ++i) big += static_cast<char>('a' + (i * 11) % 26);
  const auto chunk = [&](WritableFile* file, size_t offset, size_t size) {
    return file->WriteChunkAt(offset, big.data() + offset, size, Crc32c(big.data() + offset, size),
                              /*borrowed=*/true);
  };
  // Composed: 3 parts, the chunk at 3000 spans all of them.
  Result<std::unique_ptr<WritableFile>> parts = store->OpenForWrite("chunks/parts.bin");
  ASSERT_TRUE(parts.ok()) << parts.status();
  TS_ASSERT_OK(chunk(parts->get(), 3000, 7000));
  TS_ASSERT_OK(chunk(parts->get(), 0, 3000));
  TS_ASSERT_OK((*parts)->Close());
  EXPECT_EQ(store->Read("chunks/parts.bin").value(), big);
  // One resumable PUT (3000 bytes), one multipart upload (1100 bytes, the first 100 zeros).
  Result<std::unique_ptr<WritableFile>> one = store->OpenForWrite("chunks/one.bin");
  ASSERT_TRUE(one.ok()) << one.status();
  TS_ASSERT_OK(chunk(one->get(), 0, 3000));
  TS_ASSERT_OK((*one)->Close());
  EXPECT_EQ(store->Read("chunks/one.bin").value(), big.substr(0, 3000));
  Result<std::unique_ptr<WritableFile>> small = store->OpenForWrite("chunks/small.bin");
  ASSERT_TRUE(small.ok()) << small.status();
  TS_ASSERT_OK(chunk(small->get(), 100, 1000));
  TS_ASSERT_OK((*small)->Close());
  EXPECT_EQ(store->Read("chunks/small.bin").value(), std::string(100, '\0') + big.substr(100, 1000));

  for (const size_t size : {size_t{3000}, size_t{1000}}) {  // resumable, multipart
    const std::string key = StrCat("chunks/bad-", size, ".bin");
    Result<std::unique_ptr<WritableFile>> bad = store->OpenForWrite(key);
    ASSERT_TRUE(bad.ok()) << bad.status();
    TS_ASSERT_OK((*bad)->WriteChunkAt(0, big.data(), size, Crc32c(big.data(), size) ^ 0x10,
                                      /*borrowed=*/true));
    Status closed = (*bad)->Close();
    EXPECT_FALSE(closed.ok()) << key;
    EXPECT_THAT(std::string(closed.message()), HasSubstr(key));
    EXPECT_TRUE(absl::IsNotFound(store->Size(key).status())) << key;
  }
}

// A compose answered after the stall timeout (the server writing a large composite) is waited
// for, not abandoned and sent again (each retry would redo all of the server's work).
TEST_F(GcsStoreTest, ASlowComposeIsWaitedForNotRetried) {
  GcsKvStoreOptions options = TestOptions();
  options.part_size = 1024;
  options.http.stall_timeout = std::chrono::seconds(1);
  std::unique_ptr<GcsKvStore> store = OpenOrNull(options);
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("warm", "probe first"));
  const std::string data(3000, 'c');
  Result<std::unique_ptr<WritableFile>> file = store->OpenForWrite("slow.bin");
  ASSERT_TRUE(file.ok()) << file.status();
  TS_ASSERT_OK((*file)->WriteAt(0, data.data(), data.size()));
  const nlohmann::json before = ProxyStats();
  ConfigureProxy("compose_delay_s=3");
  Status closed = (*file)->Close();
  ConfigureProxy("compose_delay_s=0");
  TS_ASSERT_OK(closed);
  EXPECT_EQ(Ops(ProxyStats(), "compose") - Ops(before, "compose"), 1);
  EXPECT_EQ(store->Read("slow.bin").value(), data);
}

TEST_F(GcsStoreTest, ThrottlingAndResetsAreRetried) {
  std::unique_ptr<GcsKvStore> store = OpenOrNull(TestOptions());
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("k", "0123456789"));
  ConfigureProxy("fail_next=429,503,reset");
  EXPECT_EQ(store->Read("k").value(), "0123456789");
  ConfigureProxy("fail_next=503,reset_after");
  TS_ASSERT_OK(store->Write("k", "abc"));
  EXPECT_EQ(store->Read("k").value(), "abc");
}

// What the store can see for itself (bytes whose Content-Range is right but which are shifted or
// flipped are caught by the checkpoint's checksums: GcsCheckpointTest below).
TEST_F(GcsStoreTest, HostileRangedAnswersAreErrorsNeverShortReads) {
  std::unique_ptr<GcsKvStore> store = OpenOrNull(TestOptions());
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("k", "0123456789"));
  char bytes[4] = {};
  ConfigureProxy("hostile=ignore_range&hostile_count=1");
  Status ignored = store->ReadRange("k", 2, 4, bytes);
  EXPECT_TRUE(absl::IsUnimplemented(ignored)) << ignored;
  ConfigureProxy("hostile=truncate&hostile_count=1");
  // Cut short then reset: retried, and the retry gives the right bytes (or the error says so).
  Status truncated = store->ReadRange("k", 2, 4, bytes);
  if (truncated.ok()) {
    EXPECT_EQ(std::string_view(bytes, 4), "2345");
  } else {
    EXPECT_TRUE(absl::IsDataLoss(truncated) || absl::IsUnavailable(truncated)) << truncated;
  }
  ConfigureProxy("hostile=");
}

TEST_F(GcsStoreTest, AnUnknownTokenIsPermissionDeniedNamingTheCredential) {
  GcsKvStoreOptions options = TestOptions();
  options.endpoint = ServerEnv()["TS_GCS_AUTH_ENDPOINT"];
  options.credentials = StaticGcsToken("not-a-token", "the token of this test");
  options.probe = false;
  std::unique_ptr<GcsKvStore> store = OpenOrNull(options);
  ASSERT_NE(store, nullptr);
  Result<std::string> read = store->Read("k");
  EXPECT_TRUE(absl::IsPermissionDenied(read.status())) << read.status();
  EXPECT_THAT(std::string(read.status().message()), HasSubstr("the token of this test"));
}

TEST_F(GcsStoreTest, TheRegistryOpensGsUrlsWithDriverOptions) {
  std::map<std::string, std::string> env = ServerEnv();
  OpenStoreOptions open;
  open.create = true;
  open.driver_options = {{"endpoint", env["TS_GCS_ENDPOINT"]}, {"anonymous", "true"},
                         {"list_page_size", "2"}};
  const std::string url = StrCat("gs://", env["TS_GCS_BUCKET"], "/r-", RandomHexId(8));
  Result<std::unique_ptr<KvStore>> store = OpenKvStore(url, open);
  ASSERT_TRUE(store.ok()) << store.status();
  TS_ASSERT_OK((*store)->WriteIfAbsent("a", "1"));
  EXPECT_EQ((*store)->Read("a").value(), "1");
  // The raw emulator through the registry: refused too.
  open.driver_options["endpoint"] = env["TS_GCS_RAW_ENDPOINT"];
  Result<std::unique_ptr<KvStore>> raw = OpenKvStore(url, open);
  ASSERT_TRUE(raw.ok()) << raw.status();
  Status refused = (*raw)->WriteIfAbsent("b", "2");
  EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
}

// As Google's clients do: STORAGE_EMULATOR_HOST gives the endpoint and anonymous access to
// stores opened by URL without settings of their own.
TEST_F(GcsStoreTest, StorageEmulatorHostGivesTheEndpointAndAnonymousAccess) {
  std::map<std::string, std::string> env = ServerEnv();
  const std::string host = env["TS_GCS_ENDPOINT"].substr(env["TS_GCS_ENDPOINT"].find("://") + 3);
  ASSERT_EQ(setenv("STORAGE_EMULATOR_HOST", host.c_str(), 1), 0);
  OpenStoreOptions open;
  open.create = true;
  Result<std::unique_ptr<KvStore>> store =
      OpenKvStore(StrCat("gs://", env["TS_GCS_BUCKET"], "/e-", RandomHexId(8)), open);
  unsetenv("STORAGE_EMULATOR_HOST");
  ASSERT_TRUE(store.ok()) << store.status();
  TS_ASSERT_OK((*store)->WriteIfAbsent("k", "v"));
  EXPECT_EQ((*store)->Read("k").value(), "v");
}

// --- The credential chain end to end: tokens from the fakes (tests/gcs/gcs_fakes.py), checked
// by the proxy's listener that needs a bearer token the fakes issued (TS_GCS_AUTH_ENDPOINT). ---
using GcsCredentialTest = GcsServerTest;

// Explicit credentials (a helper: designated initializers would leave fields out).
GcsCredentialOptions Given(bool anonymous, std::optional<std::string> token = std::nullopt,
                           std::optional<std::string> credentials_file = std::nullopt) {
  GcsCredentialOptions options;
  options.anonymous = anonymous;
  options.token = std::move(token);
  options.credentials_file = std::move(credentials_file);
  return options;
}

// GETs a fake's /__fake__/config?query (`base` is "http://host:port") and returns its stats.
std::string FakeControl(const std::string& base, const std::string& query) {
  HttpClient client;
  HttpRequest request;
  request.url = StrCat(base, "/__fake__/config?", query);
  Result<HttpResponse> response = client.Perform(request, "asking a credentials fake");
  EXPECT_TRUE(response.ok()) << response.status();
  if (!response.ok()) return "";
  EXPECT_EQ(response->status, 200) << response->body;
  return response->body;
}

std::string TokenServerBase() {
  std::string uri = ServerEnv()["TS_GCS_TOKEN_URI"];
  return uri.substr(0, uri.rfind('/'));
}

// The count `kind` ("jwt", "refresh", "metadata") of the token server's grants.
int64_t Grants(const std::string& kind) {
  const nlohmann::json stats = nlohmann::json::parse(FakeControl(TokenServerBase(), ""),
                                                     nullptr, /*allow_exceptions=*/false);
  EXPECT_TRUE(stats.is_object() && stats.contains("grants")) << stats.dump();
  if (!stats.is_object() || !stats.contains("grants")) return -1;
  return stats["grants"].value(kind, int64_t{-1});
}

// A store on the listener that checks tokens, with the credentials `env` and `given` resolve to.
std::unique_ptr<GcsKvStore> OpenWithChain(const GcsCredentialOptions& given,
                                          std::map<std::string, std::string> env) {
  Result<std::shared_ptr<GcsCredentialProvider>> credentials =
      ResolveGcsCredentials(given, FixedEnv(std::move(env)));
  if (!credentials.ok()) {
    ADD_FAILURE() << credentials.status();
    return nullptr;
  }
  GcsKvStoreOptions options = TestOptions();
  options.endpoint = ServerEnv()["TS_GCS_AUTH_ENDPOINT"];
  options.credentials = *std::move(credentials);
  options.probe = false;  // so that each Write and Read below is one request (one Token())
  return OpenOrNull(std::move(options));
}

std::string EmptyHome() {
  const std::string home = StrCat(::testing::TempDir(), "/gcs-empty-home-", RandomHexId(6));
  std::filesystem::create_directories(home);
  return home;
}

TEST_F(GcsCredentialTest, AServiceAccountKeyIsExchangedForATokenTheServerAccepts) {
  const int64_t before = Grants("jwt");
  std::unique_ptr<GcsKvStore> store =
      OpenWithChain(Given(false, std::nullopt, ServerEnv()["TS_GCS_SA_KEY"]), {});
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("k", "sa"));
  EXPECT_EQ(store->Read("k").value(), "sa");
  // One grant, kept for every request while it is fresh.
  EXPECT_EQ(Grants("jwt"), before + 1);
}

TEST_F(GcsCredentialTest, AuthorizedUserCredentialsFromTheEnvironmentAreRefreshed) {
  const int64_t before = Grants("refresh");
  std::unique_ptr<GcsKvStore> store = OpenWithChain(
      {}, {{"GOOGLE_APPLICATION_CREDENTIALS", ServerEnv()["TS_GCS_AUTHORIZED_USER"]},
           {"HOME", EmptyHome()}, {"NO_GCE_CHECK", "true"}});
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("k", "user"));
  EXPECT_EQ(store->Read("k").value(), "user");
  EXPECT_EQ(Grants("refresh"), before + 1);
}

TEST_F(GcsCredentialTest, GcloudsApplicationDefaultCredentialsAreFound) {
  const std::string config = EmptyHome();
  std::filesystem::copy_file(ServerEnv()["TS_GCS_AUTHORIZED_USER"],
                             config + "/application_default_credentials.json");
  std::unique_ptr<GcsKvStore> store =
      OpenWithChain({}, {{"CLOUDSDK_CONFIG", config}, {"NO_GCE_CHECK", "true"}});
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("k", "adc"));
  EXPECT_EQ(store->Read("k").value(), "adc");
}

TEST_F(GcsCredentialTest, TheMetadataServerGivesATokenWhenNothingElseDoes) {
  const int64_t before = Grants("metadata");
  std::unique_ptr<GcsKvStore> store = OpenWithChain(
      {}, {{"HOME", EmptyHome()}, {"GCE_METADATA_HOST", ServerEnv()["TS_GCS_METADATA_HOST"]}});
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("k", "gce"));
  EXPECT_EQ(store->Read("k").value(), "gce");
  EXPECT_EQ(Grants("metadata"), before + 1);
}

TEST_F(GcsCredentialTest, ATokenCloseToItsExpiryIsReplacedByASecondGrant) {
  // Tokens that live 200 s are within the 5 minute refresh margin at once: every request
  // fetches a new one. Tokens that live an hour are fetched once.
  FakeControl(TokenServerBase(), "expires_in=200");
  struct Restore {
    ~Restore() { FakeControl(TokenServerBase(), "expires_in=3600"); }
  } restore;  // the later tests get hour-long tokens even when this one fails
  std::unique_ptr<GcsKvStore> store =
      OpenWithChain(Given(false, std::nullopt, ServerEnv()["TS_GCS_SA_KEY"]), {});
  ASSERT_NE(store, nullptr);
  const int64_t before = Grants("jwt");
  TS_ASSERT_OK(store->Write("k", "1"));
  EXPECT_EQ(store->Read("k").value(), "1");
  EXPECT_GE(Grants("jwt"), before + 2);
  FakeControl(TokenServerBase(), "expires_in=3600");
  TS_ASSERT_OK(store->Write("k", "2"));  // the last 200 s token is due: one more grant
  const int64_t fresh = Grants("jwt");
  EXPECT_EQ(store->Read("k").value(), "2");
  TS_ASSERT_OK(store->Write("k", "3"));
  EXPECT_EQ(store->Read("k").value(), "3");
  EXPECT_EQ(Grants("jwt"), fresh);  // the hour-long token is kept
}

TEST_F(GcsCredentialTest, AKeyTheTokenEndpointDoesNotKnowIsPermissionDenied) {
  // The registered key's id and email, but another private key: the signature does not verify.
  std::ifstream in(ServerEnv()["TS_GCS_SA_KEY"]);
  nlohmann::json key = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(key.is_object());
  std::unique_ptr<EVP_PKEY_CTX, decltype(&EVP_PKEY_CTX_free)> ctx(
      EVP_PKEY_CTX_new_id(EVP_PKEY_RSA, nullptr), &EVP_PKEY_CTX_free);
  EVP_PKEY* raw_key = nullptr;
  ASSERT_EQ(EVP_PKEY_keygen_init(ctx.get()), 1);
  ASSERT_EQ(EVP_PKEY_CTX_set_rsa_keygen_bits(ctx.get(), 2048), 1);
  ASSERT_EQ(EVP_PKEY_keygen(ctx.get(), &raw_key), 1);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> other(raw_key, &EVP_PKEY_free);
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()), &BIO_free);
  ASSERT_EQ(PEM_write_bio_PrivateKey(bio.get(), other.get(), nullptr, nullptr, 0, nullptr, nullptr),
            1);
  char* pem = nullptr;
  const long pem_size = BIO_get_mem_data(bio.get(), &pem);
  key["private_key"] = std::string(pem, static_cast<size_t>(pem_size));
  const std::string path = StrCat(EmptyHome(), "/wrong-key.json");
  std::ofstream(path) << key.dump();

  const int64_t refused_before = Grants("jwt");
  std::unique_ptr<GcsKvStore> store = OpenWithChain(Given(false, std::nullopt, path), {});
  ASSERT_NE(store, nullptr);
  Result<std::string> read = store->Read("k");
  ASSERT_TRUE(absl::IsPermissionDenied(read.status())) << read.status();
  EXPECT_THAT(std::string(read.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(read.status().message()), HasSubstr("refused"));
  EXPECT_EQ(Grants("jwt"), refused_before);
}

TEST_F(GcsCredentialTest, NoCredentialAnywhereIsPermissionDeniedBeforeAnyRequest) {
  std::unique_ptr<GcsKvStore> store =
      OpenWithChain({}, {{"HOME", EmptyHome()}, {"NO_GCE_CHECK", "true"}});
  ASSERT_NE(store, nullptr);
  Status written = store->Write("k", "v");
  ASSERT_TRUE(absl::IsPermissionDenied(written)) << written;
  EXPECT_THAT(std::string(written.message()), HasSubstr("GOOGLE_APPLICATION_CREDENTIALS"));
  EXPECT_THAT(std::string(written.message()), HasSubstr("gcloud auth application-default login"));
}

TEST_F(GcsCredentialTest, TheRegistryTakesACredentialsFileDriverOption) {
  std::map<std::string, std::string> env = ServerEnv();
  OpenStoreOptions open;
  open.create = true;
  open.driver_options = {{"endpoint", env["TS_GCS_AUTH_ENDPOINT"]},
                         {"credentials_file", env["TS_GCS_SA_KEY"]}};
  const std::string url = StrCat("gs://", env["TS_GCS_BUCKET"], "/c-", RandomHexId(8));
  Result<std::unique_ptr<KvStore>> store = OpenKvStore(url, open);
  ASSERT_TRUE(store.ok()) << store.status();
  TS_ASSERT_OK((*store)->WriteIfAbsent("a", "1"));
  EXPECT_EQ((*store)->Read("a").value(), "1");
  open.driver_options["token"] = "t";
  EXPECT_TRUE(absl::IsInvalidArgument(OpenKvStore(url, open).status()));
}

// --- Checkpoints on the store: commit without rename, reads pinned to generations. ---
using GcsCheckpointTest = GcsServerTest;

// Saves step `dir` holding one int64 array of 1000 elements, all `value`.
Status SaveFilled(KvStore* kv, const std::string& dir, int64_t value, bool overwrite) {
  std::vector<int64_t> data(1000, value);
  WriterOptions options;
  options.overwrite = overwrite;
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                      CheckpointWriter::Create(kv, dir, options));
  TS_RETURN_IF_ERROR(writer->AddArray({.path = "x", .dtype = DType::kInt64, .shape = {1000}},
                                      {{.box = Box::FromShape({1000}), .data = data.data()}}));
  return writer->Commit();
}

// The value of every element of the step's array (-1 when they differ).
Result<int64_t> RestoreFilled(KvStore* kv, const std::string& dir) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(kv, dir));
  std::vector<int64_t> data(1000, -7);
  TS_RETURN_IF_ERROR(reader->Read(
      {.path = "x", .box = Box::FromShape({1000}), .dtype = DType::kInt64, .dest = data.data()}));
  for (int64_t v : data) {
    if (v != data[0]) return int64_t{-1};
  }
  return data[0];
}

TEST_F(GcsCheckpointTest, OfWritersCommittingOneStepAtOnceExactlyOneWins) {
  std::unique_ptr<GcsKvStore> store = OpenOrNull(TestOptions());
  ASSERT_NE(store, nullptr);
  constexpr int kWriters = 4;
  std::vector<Status> results(kWriters);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWriters; ++i) {
    threads.emplace_back(
        [&, i] { results[i] = SaveFilled(store.get(), "0000000001", 100 + i, false); });
  }
  for (std::thread& thread : threads) thread.join();
  int winner = -1;
  for (int i = 0; i < kWriters; ++i) {
    if (results[i].ok()) {
      EXPECT_EQ(winner, -1) << "two writers committed the step";
      winner = i;
    } else {
      EXPECT_TRUE(absl::IsAlreadyExists(results[i])) << results[i];
    }
  }
  ASSERT_NE(winner, -1) << results[0];
  Result<int64_t> restored = RestoreFilled(store.get(), "0000000001");
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(*restored, 100 + winner);
}

TEST_F(GcsCheckpointTest, AnObjectReplacedAfterTheCommitIsNamedNeverRead) {
  std::unique_ptr<GcsKvStore> store = OpenOrNull(TestOptions());
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(SaveFilled(store.get(), "0000000009", 5, false));
  Result<std::vector<std::string>> keys = store->List("0000000009/");
  ASSERT_TRUE(keys.ok()) << keys.status();
  std::string data_key;
  for (const std::string& key : *keys) {
    if (key.ends_with(".dat")) data_key = key;
  }
  ASSERT_FALSE(data_key.empty());
  Result<std::string> bytes = store->Read(data_key);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  // The same bytes, written again: a new generation, so not the committed object any more.
  TS_ASSERT_OK(store->Write(data_key, *bytes));
  Result<int64_t> restored = RestoreFilled(store.get(), "0000000009");
  ASSERT_FALSE(restored.ok()) << "read " << *restored;
  EXPECT_NE(restored.status().message().find(data_key), std::string_view::npos)
      << restored.status();
}

// A server that flips or shifts the bytes of media reads: the checkpoint's checksums catch it,
// every time, whichever read it hits; the restore never gives wrong values.
TEST_F(GcsCheckpointTest, HostileBytesAreErrorsNeverWrongValues) {
  std::unique_ptr<GcsKvStore> store = OpenOrNull(TestOptions());
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(SaveFilled(store.get(), "0000000003", 42, false));
  for (const char* mode : {"flip", "shift_range"}) {
    for (int count = 1; count <= 4; ++count) {
      ConfigureProxy(StrCat("hostile=", mode, "&hostile_count=", count));
      Result<int64_t> restored = RestoreFilled(store.get(), "0000000003");
      if (restored.ok()) {
        EXPECT_EQ(*restored, 42) << mode << " x" << count;
      } else {
        EXPECT_TRUE(absl::IsDataLoss(restored.status())) << mode << " x" << count << ": "
                                                         << restored.status();
      }
    }
  }
  ConfigureProxy("hostile=");
  Result<int64_t> restored = RestoreFilled(store.get(), "0000000003");
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(*restored, 42);
}

}  // namespace
}  // namespace tensorstash
