// The KvStore conformance suites: behaviour tests that every backend runs, by instantiating
// them from its own folder's test file.
//
//   TS_INSTANTIATE_KVSTORE_CONFORMANCE(File, {{"File", [](const std::string& scratch_dir) {...}}});
//   TS_INSTANTIATE_KVSTORE_READ_CONFORMANCE(File, {{"File", [](scratch_dir, contents) {...}}});
//
// The first is the whole interface, for stores that are written through themselves. The second
// is what reading needs, for every store, read-only ones included (an OCDBT database is written
// by its own writer): the backend makes a store that holds the given contents.
//
// The tests themselves are in kvstore_conformance_test.cc. A backend declares what it cannot do
// through KvStore::Capabilities() (or SupportsRename), and the tests check the documented answer
// (Unimplemented) instead.
#ifndef TENSORSTASH_TESTING_KVSTORE_CONFORMANCE_H_
#define TENSORSTASH_TESTING_KVSTORE_CONFORMANCE_H_

#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"
#include "tensorstash/kvstore/kvstore.h"

namespace tensorstash {

struct KvStoreBackend {
  std::string name;
  // Makes a fresh, empty store; `scratch_dir` is an empty directory it may use.
  std::function<std::unique_ptr<KvStore>(const std::string& scratch_dir)> make;
};

class KvStoreConformanceTest : public ::testing::TestWithParam<KvStoreBackend> {
 protected:
  void SetUp() override {
    std::string dir = ::testing::TempDir() + "kvstore_conformance_XXXXXX";
    ASSERT_NE(::mkdtemp(dir.data()), nullptr) << std::strerror(errno);
    scratch_dir_ = dir;
    store_ = GetParam().make(scratch_dir_);
    ASSERT_NE(store_, nullptr);
  }

  void TearDown() override {
    store_.reset();
    std::error_code ignored;
    std::filesystem::remove_all(scratch_dir_, ignored);
  }

  void Put(std::string_view key, std::string_view value) {
    ASSERT_EQ(absl::OkStatus(), store_->Write(key, value)) << key;
  }

  std::string Get(std::string_view key) {
    Result<std::string> value = store_->Read(key);
    EXPECT_EQ(absl::OkStatus(), value.status()) << key;
    return value.ok() ? *value : std::string();
  }

  std::vector<std::string> ListOrDie(std::string_view prefix) {
    Result<std::vector<std::string>> keys = store_->List(prefix);
    EXPECT_EQ(absl::OkStatus(), keys.status()) << prefix;
    return keys.ok() ? *keys : std::vector<std::string>();
  }

  // Keys for the List and Delete tests, written out of order.
  void PutTree() {
    for (const char* key : {"b", "a/c", "ab", "a/b2/y/z", "a/b1", "a/b2/x"}) Put(key, key);
  }

  std::string scratch_dir_;
  std::unique_ptr<KvStore> store_;
};

// Reads `file` (holding `value`) from 4 threads at once, each at its own offsets; the reads
// per thread that failed or gave wrong bytes.
std::vector<int> ConcurrentReadMismatches(const ReadableFile& file, const std::string& value);

// A store holding a fixed set of objects, for the read suite.
struct ReadableKvStoreBackend {
  std::string name;
  // Makes a store holding exactly `contents` (key -> value); `scratch_dir` is an empty
  // directory it may use. Null on failure.
  std::function<std::unique_ptr<KvStore>(const std::string& scratch_dir,
                                         const std::map<std::string, std::string>& contents)>
      make;
};

class KvStoreReadConformanceTest : public ::testing::TestWithParam<ReadableKvStoreBackend> {
 protected:
  void SetUp() override;
  void TearDown() override;

  std::map<std::string, std::string> contents_;  // what the store holds
  std::string scratch_dir_;
  std::unique_ptr<KvStore> store_;
};

}  // namespace tensorstash

// Runs the suite against `backends` (a std::vector<KvStoreBackend>), tests named
// "<prefix>/KvStoreConformanceTest.<test>/<backend name>". Use it inside namespace tensorstash.
#define TS_INSTANTIATE_KVSTORE_CONFORMANCE(prefix, backends)                                \
  INSTANTIATE_TEST_SUITE_P(prefix, KvStoreConformanceTest, ::testing::ValuesIn(backends),   \
                           [](const ::testing::TestParamInfo<KvStoreBackend>& param_info) { \
                             return param_info.param.name;                                  \
                           })

// The read suite against `backends` (a std::vector<ReadableKvStoreBackend>).
#define TS_INSTANTIATE_KVSTORE_READ_CONFORMANCE(prefix, backends)              \
  INSTANTIATE_TEST_SUITE_P(                                                    \
      prefix, KvStoreReadConformanceTest, ::testing::ValuesIn(backends),       \
      [](const ::testing::TestParamInfo<ReadableKvStoreBackend>& param_info) { \
        return param_info.param.name;                                          \
      })

#endif  // TENSORSTASH_TESTING_KVSTORE_CONFORMANCE_H_
