// The S3 store against real servers (tests/s3/s3_servers.py): SeaweedFS (signatures checked) and
// moto run the conformance suites and the tests below; rclone's "serve s3", which ignores
// conditional headers and answers ranges with 200, runs the S3DegradedServer tests. ctest starts each server
// (fixtures in CMakeLists.txt) and names its server.env in TS_S3_ENV_FILE; without it every
// test here fails (a missing server is an error, never a pass).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/manager/garbage.h"
#include "tensorstash/testing/kvstore_conformance.h"
#include "tensorstash/kvstore/s3/s3_kvstore.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/testing/status_test_macros.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

// The server's settings, from the file that s3_servers.py wrote.
std::map<std::string, std::string> ServerEnv() {
  std::map<std::string, std::string> env;
  const char* path = std::getenv("TS_S3_ENV_FILE");
  if (path == nullptr) return env;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return env;
}

// Options for a store on the test server under a fresh prefix.
S3KvStoreOptions TestOptions(std::string prefix = "") {
  std::map<std::string, std::string> env = ServerEnv();
  S3KvStoreOptions options;
  options.bucket = env["TS_S3_BUCKET"];
  options.prefix = prefix.empty() ? StrCat("t-", RandomHexId(12)) : prefix;
  options.settings.endpoint = env["TS_S3_ENDPOINT"];
  options.settings.region = env.count("TS_S3_REGION") ? env["TS_S3_REGION"] : "us-east-1";
  options.settings.path_style = true;
  options.credentials = StaticCredentials({.access_key_id = env["AWS_ACCESS_KEY_ID"],
                                           .secret_access_key = env["AWS_SECRET_ACCESS_KEY"],
                                           .session_token = ""});
  options.part_size = size_t{5} << 20;
  options.initial_backoff = std::chrono::milliseconds(5);
  return options;
}

std::unique_ptr<S3KvStore> OpenOrNull(S3KvStoreOptions options) {
  Result<std::unique_ptr<S3KvStore>> store = S3KvStore::Open(std::move(options));
  if (!store.ok()) {
    ADD_FAILURE() << store.status();
    return nullptr;
  }
  return std::move(*store);
}

class S3ServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(ServerEnv().empty())
        << "TS_S3_ENV_FILE does not name a server.env (run through ctest, which starts the server)";
  }
};

// --- The whole KvStore interface, on a fresh prefix per test. ---
TS_INSTANTIATE_KVSTORE_CONFORMANCE(
    S3, std::vector<KvStoreBackend>({{"Server", [](const std::string&) -> std::unique_ptr<KvStore> {
                                        S3KvStoreOptions options = TestOptions();
                                        options.probe = true;
                                        return OpenOrNull(std::move(options));
                                      }}}));

TS_INSTANTIATE_KVSTORE_READ_CONFORMANCE(
    S3, std::vector<ReadableKvStoreBackend>(
            {{"Server",
              [](const std::string&,
                 const std::map<std::string, std::string>& contents) -> std::unique_ptr<KvStore> {
                std::unique_ptr<S3KvStore> store = OpenOrNull(TestOptions());
                if (store == nullptr) return nullptr;
                for (const auto& [key, value] : contents) {
                  if (Status written = store->Write(key, value); !written.ok()) {
                    ADD_FAILURE() << written;
                    return nullptr;
                  }
                }
                return store;
              }}}));

using S3StoreTest = S3ServerTest;

TEST_F(S3StoreTest, KeysThatNeedEncodingRoundTrip) {
  std::unique_ptr<S3KvStore> store = OpenOrNull(TestOptions());
  ASSERT_NE(store, nullptr);
  const std::vector<std::string> keys = {"dir/a b.bin",   "dir/x+y",        "dir/p%2Fq",
                                         "dir/k=v&w",     "dir/ключ/ü.txt", "dir/~t(1)*",
                                         "dir/semi;colon"};
  for (const std::string& key : keys) TS_ASSERT_OK(store->Write(key, "v:" + key));
  for (const std::string& key : keys) {
    Result<std::string> value = store->Read(key);
    ASSERT_TRUE(value.ok()) << key << ": " << value.status();
    EXPECT_EQ(*value, "v:" + key);
  }
  Result<std::vector<std::string>> listed = store->List("dir/");
  ASSERT_TRUE(listed.ok()) << listed.status();
  std::vector<std::string> expected = keys;
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(*listed, expected);
  Result<ListedChildren> children = store->ListChildren("dir/");
  ASSERT_TRUE(children.ok()) << children.status();
  EXPECT_EQ(children->prefixes, std::vector<std::string>({"dir/ключ/"}));
  EXPECT_EQ(children->keys.size(), keys.size() - 1);
}

// SeaweedFS stores a backslash as '/', so a key or prefix with one is refused before anything is
// sent, naming it and saying why (issue 36 item 10).
TEST_F(S3StoreTest, KeysAndPrefixesWithABackslashAreRefusedByName) {
  std::unique_ptr<S3KvStore> store = OpenOrNull(TestOptions());
  ASSERT_NE(store, nullptr);
  char byte[1];
  const std::vector<Status> refused = {
      store->Write("dir\\x", "v"), store->Read("dir\\x").status(),
      store->ReadRange("a/b\\c", 0, 1, byte), store->Size("dir\\x").status(),
      store->List("dir\\").status(), store->Delete("dir\\x"), store->DeletePrefix("dir\\/")};
  for (const Status& status : refused) {
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
    EXPECT_THAT(MessageOf(status), HasSubstr("\\"));
    EXPECT_THAT(MessageOf(status), HasSubstr("has a backslash"));
    EXPECT_THAT(MessageOf(status), HasSubstr(store->Describe()));
  }
  EXPECT_THAT(MessageOf(refused[0]), HasSubstr("'dir\\x'"));
  Result<std::vector<std::string>> listed = store->List("");
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty()) << "nothing was written: " << (*listed)[0];

  S3KvStoreOptions options = TestOptions("run\\1");
  const std::string bucket = options.bucket;
  const Status prefix = S3KvStore::Open(std::move(options)).status();
  EXPECT_TRUE(absl::IsInvalidArgument(prefix)) << prefix;
  EXPECT_THAT(MessageOf(prefix), HasSubstr("the prefix 'run\\1' in s3://" + bucket));
  EXPECT_THAT(MessageOf(prefix), HasSubstr("has a backslash"));
}

TEST_F(S3StoreTest, ListingGoesPastOnePage) {
  S3KvStoreOptions options = TestOptions();
  options.list_page_size = 7;
  std::unique_ptr<S3KvStore> store = OpenOrNull(std::move(options));
  ASSERT_NE(store, nullptr);
  std::vector<std::string> expected;
  for (int i = 0; i < 23; ++i) {
    expected.push_back(StrCat("many/", 100 + i));
    TS_ASSERT_OK(store->Write(expected.back(), "x"));
  }
  for (int i = 0; i < 9; ++i) TS_ASSERT_OK(store->Write(StrCat("many/sub", i, "/k"), "x"));
  Result<std::vector<std::string>> listed = store->List("many/");
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->size(), 32u);
  Result<ListedChildren> children = store->ListChildren("many/");
  ASSERT_TRUE(children.ok()) << children.status();
  EXPECT_EQ(children->keys, expected);
  EXPECT_EQ(children->prefixes.size(), 9u);
}

TEST_F(S3StoreTest, LargeFileGoesUpInPartsAndAppearsWhole) {
  std::unique_ptr<S3KvStore> store = OpenOrNull(TestOptions());
  ASSERT_NE(store, nullptr);
  const size_t size = (size_t{12} << 20) + 12345;  // two full 5 MiB parts and a short one
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>((i * 131) >> 7);
  Result<std::unique_ptr<WritableFile>> file = store->OpenForWrite("big/data");
  ASSERT_TRUE(file.ok()) << file.status();
  // Three threads, each writing every third 1 MiB block, the last first.
  std::vector<std::thread> threads;
  std::vector<Status> results(3);
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      const size_t block = size_t{1} << 20;
      const size_t blocks = (size + block - 1) / block;
      for (size_t b = blocks; b-- > 0;) {
        if (b % 3 != static_cast<size_t>(t)) continue;
        const size_t length = std::min(block, size - b * block);
        Status status = (*file)->WriteAt(b * block, bytes.data() + b * block, length);
        if (!status.ok()) results[t] = status;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const Status& status : results) TS_ASSERT_OK(status);
  EXPECT_TRUE(absl::IsNotFound(store->Size("big/data").status()))
      << "an object must not appear before its upload completes";
  TS_ASSERT_OK((*file)->Sync());
  TS_ASSERT_OK((*file)->Close());
  Result<std::string> back = store->Read("big/data");
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size(), size);
  EXPECT_TRUE(*back == bytes);
  std::string middle(1000, '\0');
  TS_ASSERT_OK(store->ReadRange("big/data", (size_t{5} << 20) - 500, 1000, middle.data()));
  EXPECT_EQ(middle, bytes.substr((size_t{5} << 20) - 500, 1000));
}

TEST_F(S3StoreTest, VirtualHostedRequestsReachTheBucket) {
  S3KvStoreOptions options = TestOptions();
  // http://127.0.0.1:<port> as http://localhost:<port>: requests go to <bucket>.localhost.
  const std::string endpoint = options.settings.endpoint;
  options.settings.endpoint = "http://localhost" + endpoint.substr(endpoint.rfind(':'));
  options.settings.path_style = false;
  std::unique_ptr<S3KvStore> store = OpenOrNull(options);
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("virtual/k", "by host name"));
  EXPECT_EQ(store->Read("virtual/k").value_or(""), "by host name");
  // The same object, by path.
  options.settings.endpoint = endpoint;
  options.settings.path_style = true;
  std::unique_ptr<S3KvStore> by_path = OpenOrNull(options);
  ASSERT_NE(by_path, nullptr);
  EXPECT_EQ(by_path->Read("virtual/k").value_or(""), "by host name");
}

TEST_F(S3StoreTest, SignedPayloadsAreAcceptedToo) {
  S3KvStoreOptions options = TestOptions();
  options.sign_payload = true;
  std::unique_ptr<S3KvStore> store = OpenOrNull(std::move(options));
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("signed/k", "payload hashed into the signature"));
  EXPECT_EQ(store->Read("signed/k").value_or(""), "payload hashed into the signature");
}

TEST_F(S3StoreTest, ReadOfAReplacedObjectNamesIt) {
  std::unique_ptr<S3KvStore> store = OpenOrNull(TestOptions());
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("step/data", "original bytes"));
  Result<ObjectInfo> info = store->Stat("step/data");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->generation.empty());
  char buffer[8];
  TS_ASSERT_OK(store->ReadRangeAtGeneration("step/data", info->generation, 0, 8, buffer));
  Result<std::unique_ptr<ReadableFile>> file = store->OpenForRead("step/data");
  ASSERT_TRUE(file.ok()) << file.status();
  TS_ASSERT_OK(store->Write("step/data", "REPLACED bytes"));
  const Status stale = store->ReadRangeAtGeneration("step/data", info->generation, 0, 8, buffer);
  EXPECT_TRUE(absl::IsFailedPrecondition(stale)) << stale;
  EXPECT_NE(stale.message().find("step/data"), std::string_view::npos) << stale;
  const Status through_file = (*file)->ReadAt(0, 8, buffer);
  EXPECT_TRUE(absl::IsFailedPrecondition(through_file)) << through_file;
}

TEST_F(S3StoreTest, ProbeFindsConditionalWritesAndRanges) {
  S3KvStoreOptions options = TestOptions();
  options.probe = true;
  std::unique_ptr<S3KvStore> store = OpenOrNull(std::move(options));
  ASSERT_NE(store, nullptr);
  EXPECT_TRUE(store->Capabilities().conditional_write);
  EXPECT_TRUE(store->Capabilities().generations);
  Result<std::vector<std::string>> left = store->List("");
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_TRUE(left->empty()) << "the probe left " << left->front();
}

TEST_F(S3StoreTest, AnExpiredLeaseIsTakenOver) {
  S3KvStoreOptions options = TestOptions();
  std::unique_ptr<S3KvStore> store = OpenOrNull(options);
  ASSERT_NE(store, nullptr);
  // A holder that died an hour ago.
  TS_ASSERT_OK(
      store->Write("LOCK", R"({"holder":"dead","host":"gone","pid":1,"expires_unix_ms":1})"));
  Result<std::unique_ptr<KvLock>> lock = store->TryLock("LOCK");
  ASSERT_TRUE(lock.ok()) << lock.status();
  Result<std::unique_ptr<KvLock>> second = store->TryLock("LOCK");
  EXPECT_TRUE(absl::IsFailedPrecondition(second.status())) << second.status();
  EXPECT_NE(second.status().message().find("locked by another manager"), std::string_view::npos);
  lock->reset();
  EXPECT_TRUE(absl::IsNotFound(store->Size("LOCK").status())) << "a released lease is deleted";
}

TEST_F(S3StoreTest, UploadsOfAKilledWriterAreListedAndAborted) {
  S3KvStoreOptions options = TestOptions();
  const std::string prefix = options.prefix;
  // A child writes one whole part (which starts a multipart upload) and dies without closing.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    Result<std::unique_ptr<S3KvStore>> store = S3KvStore::Open(options);
    if (!store.ok()) _exit(2);
    Result<std::unique_ptr<WritableFile>> file = (*store)->OpenForWrite("dying/data");
    if (!file.ok()) _exit(3);
    std::string part(size_t{5} << 20, 'x');
    _exit((*file)->WriteAt(0, part.data(), part.size()).ok() ? 0 : 4);
  }
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << wstatus;
  std::unique_ptr<S3KvStore> store = OpenOrNull(options);
  ASSERT_NE(store, nullptr);
  Result<std::vector<PendingWrite>> pending = store->ListPendingWrites("");
  ASSERT_TRUE(pending.ok()) << pending.status();
  ASSERT_EQ(pending->size(), 1u);
  EXPECT_EQ((*pending)[0].key, "dying/data");
  TS_ASSERT_OK(store->AbortPendingWrite((*pending)[0]));
  EXPECT_TRUE((*pending)[0].started.has_value());
  pending = store->ListPendingWrites("");
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_TRUE(pending->empty());
  EXPECT_TRUE(absl::IsNotFound(store->Size("dying/data").status()));
}

// Only for servers that check signatures (ctest leaves it out for moto).
TEST_F(S3StoreTest, AWrongSecretIsPermissionDenied) {
  S3KvStoreOptions options = TestOptions();
  std::map<std::string, std::string> env = ServerEnv();
  options.credentials = StaticCredentials({.access_key_id = env["AWS_ACCESS_KEY_ID"],
                                           .secret_access_key = "not-the-secret",
                                           .session_token = ""});
  std::unique_ptr<S3KvStore> store = OpenOrNull(std::move(options));
  ASSERT_NE(store, nullptr);
  const Status denied = store->Write("k", "v");
  EXPECT_TRUE(absl::IsPermissionDenied(denied)) << denied;
  EXPECT_NE(denied.message().find("credentials"), std::string_view::npos) << denied;
  const Status read = store->Read("k").status();
  EXPECT_TRUE(absl::IsPermissionDenied(read)) << read;
}

TEST_F(S3StoreTest, AMissingBucketIsNotFound) {
  S3KvStoreOptions options = TestOptions();
  options.bucket = "no-such-bucket-" + RandomHexId(8);
  options.probe = true;
  // Open sends nothing; the probe, at the first operation that needs it, finds no bucket.
  std::unique_ptr<S3KvStore> store = OpenOrNull(std::move(options));
  ASSERT_NE(store, nullptr);
  const Status created = store->WriteIfAbsent("k", "v");
  EXPECT_TRUE(absl::IsNotFound(created)) << created;
  EXPECT_NE(created.message().find("does not exist"), std::string_view::npos) << created;
}

// --- Checkpoints on the store: commit without rename (engine/object_store_commit.h). ---
using S3CheckpointTest = S3ServerTest;

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

TEST_F(S3CheckpointTest, OfWritersCommittingOneStepAtOnceExactlyOneWins) {
  S3KvStoreOptions options = TestOptions();
  options.probe = true;
  std::unique_ptr<S3KvStore> store = OpenOrNull(options);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Capabilities().conditional_write);
  constexpr int kWriters = 8;
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

TEST_F(S3CheckpointTest, AnOverwriteIsANewRecordAndTheOldAttemptGoes) {
  S3KvStoreOptions options = TestOptions();
  options.probe = true;
  std::unique_ptr<S3KvStore> store = OpenOrNull(options);
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(SaveFilled(store.get(), "0000000005", 1, false));
  const Status again = SaveFilled(store.get(), "0000000005", 2, false);
  EXPECT_TRUE(absl::IsAlreadyExists(again)) << again;
  TS_ASSERT_OK(SaveFilled(store.get(), "0000000005", 3, true));
  TS_ASSERT_OK(SaveFilled(store.get(), "0000000005", 4, true));
  Result<int64_t> restored = RestoreFilled(store.get(), "0000000005");
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(*restored, 4);
  Result<ListedChildren> children = store->ListChildren("0000000005/");
  ASSERT_TRUE(children.ok()) << children.status();
  // The step's mark, the newest record, and one attempt.
  EXPECT_EQ(children->keys,
            std::vector<std::string>({"0000000005/COMMIT", "0000000005/COMMIT.0000000003"}));
  // One attempt holds objects (SeaweedFS may still list the emptied folders of the others).
  Result<std::vector<std::string>> keys = store->List("0000000005/");
  ASSERT_TRUE(keys.ok()) << keys.status();
  std::set<std::string> attempts;
  for (const std::string& key : *keys) {
    const size_t slash = key.find('/', 11);
    if (slash != std::string::npos) attempts.insert(key.substr(11, slash - 11));
  }
  EXPECT_EQ(attempts.size(), 1u);
}

TEST_F(S3CheckpointTest, AnObjectReplacedAfterTheCommitIsNamedNeverRead) {
  std::unique_ptr<S3KvStore> store = OpenOrNull(TestOptions());
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
  // The same bytes, written again: a new ETag, so not the committed object any more.
  TS_ASSERT_OK(store->Write(data_key, *bytes + ""));
  std::string changed = *bytes;
  changed[changed.size() / 2] ^= 1;
  TS_ASSERT_OK(store->Write(data_key, changed));
  Result<int64_t> restored = RestoreFilled(store.get(), "0000000009");
  ASSERT_FALSE(restored.ok()) << "read " << *restored;
  EXPECT_NE(restored.status().message().find(data_key), std::string_view::npos)
      << restored.status();
}

TEST_F(S3CheckpointTest, GcRemovesWhatKilledSavesLeftAndNoCommittedStep) {
  S3KvStoreOptions options = TestOptions();
  options.probe = true;
  std::unique_ptr<S3KvStore> store = OpenOrNull(options);
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(SaveFilled(store.get(), "0000000001", 11, false));
  TS_ASSERT_OK(SaveFilled(store.get(), "0000000002", 22, false));
  // What killed saves leave: an attempt in a committed step (a killed overwrite), a step with
  // an attempt and no record (a killed first save), and an unfinished multipart upload.
  const std::string orphan = "0000000002/attempt-00000000000000aa/state/data/0-0.dat";
  TS_ASSERT_OK(store->Write(orphan, std::string(100, 'z')));
  TS_ASSERT_OK(store->Write("0000000003/attempt-00000000000000bb/state/index.part-1", "p"));
  TS_ASSERT_OK(store->Write("notes/keep.txt", "the user's"));
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    Result<std::unique_ptr<S3KvStore>> again = S3KvStore::Open(options);
    if (!again.ok()) _exit(2);
    Result<std::unique_ptr<WritableFile>> file =
        (*again)->OpenForWrite("0000000004/attempt-00000000000000cc/state/data/0-0.dat");
    std::string part(size_t{5} << 20, 'x');
    _exit(file.ok() && (*file)->WriteAt(0, part.data(), part.size()).ok() ? 0 : 3);
  }
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
  {  // A manager at work: gc refuses.
    Result<std::unique_ptr<KvLock>> lock = store->TryLock("LOCK");
    ASSERT_TRUE(lock.ok()) << lock.status();
    Result<GarbageReport> refused = CollectGarbage(store.get());
    EXPECT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
  }
  Result<GarbageReport> dry =
      CollectGarbage(store.get(), {.dry_run = true, .min_age = std::chrono::seconds(0)});
  ASSERT_TRUE(dry.ok()) << dry.status();
  EXPECT_EQ(dry->removed.size(), 2u);
  TS_ASSERT_OK(store->Size(orphan).status());  // a dry run removes nothing
  Result<GarbageReport> report =
      CollectGarbage(store.get(), {.dry_run = false, .min_age = std::chrono::seconds(0)});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->removed,
            std::vector<std::string>({"0000000002/attempt-00000000000000aa/", "0000000003/"}));
  EXPECT_EQ(report->aborted_uploads,
            std::vector<std::string>({"0000000004/attempt-00000000000000cc/state/data/0-0.dat"}));
  EXPECT_TRUE(absl::IsNotFound(store->Size(orphan).status()));
  EXPECT_EQ(store->Read("notes/keep.txt").value_or(""), "the user's");
  Result<int64_t> one = RestoreFilled(store.get(), "0000000001");
  Result<int64_t> two = RestoreFilled(store.get(), "0000000002");
  ASSERT_TRUE(one.ok() && two.ok()) << one.status() << two.status();
  EXPECT_EQ(*one, 11);
  EXPECT_EQ(*two, 22);
  Result<std::vector<PendingWrite>> pending = store->ListPendingWrites("");
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_TRUE(pending->empty());
}

// --- rclone's "serve s3": ignores If-None-Match, and answers a Range with 200 (and a
// Content-Range) instead of 206. ---
using S3DegradedServerTest = S3ServerTest;

TEST_F(S3DegradedServerTest, ProbeRefusesCreateOnlyWritesAndSaysWhy) {
  S3KvStoreOptions options = TestOptions();
  options.probe = true;
  std::unique_ptr<S3KvStore> store = OpenOrNull(std::move(options));
  ASSERT_NE(store, nullptr);
  EXPECT_FALSE(store->Capabilities().conditional_write);
  EXPECT_FALSE(store->Capabilities().generations);
  const Status refused = store->WriteIfAbsent("COMMIT", "x");
  EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
  EXPECT_NE(refused.message().find("If-None-Match"), std::string_view::npos) << refused;
  EXPECT_TRUE(absl::IsNotFound(store->Size("COMMIT").status())) << "nothing was written";
}

// A range answered 200 (never wrong bytes) is an error that says what the server did, naming the
// key and the range, and is neither FailedPrecondition nor NotFound, which a committed step's
// reader reports as an object replaced or removed after the commit (issue 36 item 10).
TEST_F(S3DegradedServerTest, ARangeAnsweredWholeIsAnErrorNeverWrongBytes) {
  std::unique_ptr<S3KvStore> store = OpenOrNull(TestOptions());
  ASSERT_NE(store, nullptr);
  TS_ASSERT_OK(store->Write("k", "0123456789"));
  Result<ObjectInfo> info = store->Stat("k");
  ASSERT_TRUE(info.ok()) << info.status();
  struct Case {
    uint64_t offset;
    bool at_generation;
    std::string range;
  };
  for (const Case& c : {Case{4, false, "bytes 4-6"}, Case{0, false, "bytes 0-2"},
                        Case{4, true, "bytes 4-6"}, Case{0, true, "bytes 0-2"}}) {
    SCOPED_TRACE(c.range + (c.at_generation ? " at its generation" : ""));
    char buffer[3] = {};
    const Status ranged =
        c.at_generation ? store->ReadRangeAtGeneration("k", info->generation, c.offset, 3, buffer)
                        : store->ReadRange("k", c.offset, 3, buffer);
    if (ranged.ok()) {  // a server that honours ranges after all
      EXPECT_EQ(std::string(buffer, 3), std::string("0123456789").substr(c.offset, 3));
      continue;
    }
    // Either the whole object, or (this rclone) the part asked for with 200 and a Content-Range.
    EXPECT_TRUE(absl::IsUnimplemented(ranged)) << ranged;
    EXPECT_THAT(MessageOf(ranged),
                AnyOf(HasSubstr("ignored the Range header and answered 200 with the whole "
                                "object (10 bytes)"),
                      HasSubstr("with 200 and Content-Range 'bytes 4-6/10' instead of 206")));
    EXPECT_THAT(MessageOf(ranged), HasSubstr(c.range));
    EXPECT_THAT(MessageOf(ranged), HasSubstr("'k'"));
  }
  // The whole object asked as a range is its bytes, whoever answers.
  char whole[10] = {};
  TS_ASSERT_OK(store->ReadRange("k", 0, 10, whole));
  EXPECT_EQ(std::string(whole, 10), "0123456789");
}

}  // namespace
}  // namespace tensorstash
