// The KvStore read conformance suite (kvstore_conformance.h): what reading a checkpoint relies
// on, for every store, read-only ones included. Each backend instantiates it from its own
// folder (file/, memory/, ocdbt/) with a store made to hold contents_.
#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/testing/kvstore_conformance.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {

void KvStoreReadConformanceTest::SetUp() {
  std::string big(300000, '\0');
  std::mt19937 random(7);
  for (char& c : big) c = static_cast<char>(random());
  contents_ = {
      {"a", "alpha"},
      {"dir/empty", ""},
      {"dir/binary", std::string("\0\xff\n\r", 4)},
      {"dir/sub/deep", "delta"},
      {"dirx", "x"},
      {"big", big},
  };
  std::string dir = ::testing::TempDir() + "kvstore_read_conformance_XXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr) << std::strerror(errno);
  scratch_dir_ = dir;
  store_ = GetParam().make(scratch_dir_, contents_);
  ASSERT_NE(store_, nullptr);
}

std::vector<int> ConcurrentReadMismatches(const ReadableFile& file, const std::string& value) {
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::string local(997, '\0');
      for (size_t offset = static_cast<size_t>(t) * 11; offset + local.size() <= value.size();
           offset += 3001) {
        if (!file.ReadAt(offset, local.size(), local.data()).ok() ||
            local != value.substr(offset, local.size())) {
          ++mismatches[t];
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  return mismatches;
}

void KvStoreReadConformanceTest::TearDown() {
  store_.reset();
  std::error_code ignored;
  std::filesystem::remove_all(scratch_dir_, ignored);
}

namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

TEST_P(KvStoreReadConformanceTest, ReadGivesEveryValueWhole) {
  for (const auto& [key, value] : contents_) {
    Result<std::string> read = store_->Read(key);
    TS_ASSERT_OK(read.status()) << key;
    EXPECT_EQ(*read, value) << key;
    Result<uint64_t> size = store_->Size(key);
    TS_ASSERT_OK(size.status()) << key;
    EXPECT_EQ(*size, value.size()) << key;
  }
}

TEST_P(KvStoreReadConformanceTest, ReadRangeInsideAndPastTheEnd) {
  char buffer[8] = {};
  TS_ASSERT_OK(store_->ReadRange("a", 1, 3, buffer));
  EXPECT_EQ(std::string_view(buffer, 3), "lph");
  TS_EXPECT_OK(store_->ReadRange("a", 5, 0, buffer));
  TS_EXPECT_OK(store_->ReadRange("dir/empty", 0, 0, nullptr));
  const std::string& big = contents_.at("big");
  std::string part(1000, '\0');
  TS_ASSERT_OK(store_->ReadRange("big", big.size() - 1000, 1000, part.data()));
  EXPECT_EQ(part, big.substr(big.size() - 1000));
  for (const auto& [offset, size] :
       std::vector<std::pair<uint64_t, size_t>>{{3, 3}, {6, 0}, {uint64_t{1} << 62, 1}}) {
    const Status status = store_->ReadRange("a", offset, size, buffer);
    EXPECT_TRUE(absl::IsDataLoss(status)) << offset << "+" << size << ": " << status;
    EXPECT_THAT(MessageOf(status), HasSubstr("a"));
  }
}

TEST_P(KvStoreReadConformanceTest, MissingKeysAndFoldersAreNotFound) {
  char buffer[1];
  for (std::string_view key : {"missing", "dir/missing", "dir", "dir/sub", "a/below"}) {
    SCOPED_TRACE(key);
    const Status status = store_->Read(key).status();
    EXPECT_TRUE(absl::IsNotFound(status)) << status;
    EXPECT_THAT(MessageOf(status), HasSubstr(key));
    EXPECT_TRUE(absl::IsNotFound(store_->ReadRange(key, 0, 1, buffer)));
    EXPECT_TRUE(absl::IsNotFound(store_->Size(key).status()));
    EXPECT_TRUE(absl::IsNotFound(store_->OpenForRead(key).status()));
  }
}

TEST_P(KvStoreReadConformanceTest, OpenForReadServesThreadsAtOnce) {
  const std::string& big = contents_.at("big");
  Result<std::unique_ptr<ReadableFile>> file = store_->OpenForRead("big");
  TS_ASSERT_OK(file.status());
  EXPECT_EQ((*file)->size(), big.size());
  std::string buffer(16, '\0');
  const Status past = (*file)->ReadAt(big.size() - 8, 16, buffer.data());
  EXPECT_TRUE(absl::IsDataLoss(past)) << past;
  const std::vector<int> mismatches = ConcurrentReadMismatches(**file, big);
  EXPECT_THAT(mismatches, ElementsAre(0, 0, 0, 0));
}

TEST_P(KvStoreReadConformanceTest, ListIsSortedAndTakesAnyPrefix) {
  auto list = [&](std::string_view prefix) {
    Result<std::vector<std::string>> keys = store_->List(prefix);
    EXPECT_EQ(absl::OkStatus(), keys.status()) << prefix;
    return keys.ok() ? *keys : std::vector<std::string>();
  };
  EXPECT_THAT(list(""), ElementsAre("a", "big", "dir/binary", "dir/empty", "dir/sub/deep", "dirx"));
  EXPECT_THAT(list("dir/"), ElementsAre("dir/binary", "dir/empty", "dir/sub/deep"));
  EXPECT_THAT(list("dir"), ElementsAre("dir/binary", "dir/empty", "dir/sub/deep", "dirx"));
  EXPECT_THAT(list("dir/sub/"), ElementsAre("dir/sub/deep"));
  EXPECT_THAT(list("zz/"), IsEmpty());
  EXPECT_THAT(list("a/"), IsEmpty());  // an object, not a folder
}

TEST_P(KvStoreReadConformanceTest, ListChildrenGivesOneLevel) {
  Result<ListedChildren> children = store_->ListChildren("");
  TS_ASSERT_OK(children.status());
  EXPECT_THAT(children->keys, ElementsAre("a", "big", "dirx"));
  EXPECT_THAT(children->prefixes, ElementsAre("dir/"));
  children = store_->ListChildren("dir/");
  TS_ASSERT_OK(children.status());
  EXPECT_THAT(children->keys, ElementsAre("dir/binary", "dir/empty"));
  EXPECT_THAT(children->prefixes, ElementsAre("dir/sub/"));
  EXPECT_THAT(store_->ListChildren("missing/").value().keys, IsEmpty());
}

TEST_P(KvStoreReadConformanceTest, StatIsStableWhileNothingChanges) {
  if (!store_->Capabilities().generations) {
    EXPECT_TRUE(absl::IsUnimplemented(store_->Stat("a").status()));
    return;
  }
  const ObjectInfo info = store_->Stat("a").value();
  EXPECT_EQ(info.size, 5u);
  EXPECT_EQ(store_->Stat("a").value().generation, info.generation);
  char buffer[2];
  TS_EXPECT_OK(store_->ReadRangeAtGeneration("a", info.generation, 3, 2, buffer));
  EXPECT_EQ(std::string_view(buffer, 2), "ha");
  EXPECT_TRUE(absl::IsNotFound(store_->Stat("missing").status()));
}

TEST_P(KvStoreReadConformanceTest, InvalidKeysAreInvalidArgument) {
  char buffer[1];
  for (const std::string& key :
       {std::string(), std::string("/abs"), std::string("a//b"), std::string("../x"),
        std::string("a/.."), std::string("a\0b", 3), std::string("dir/")}) {
    SCOPED_TRACE(testing::PrintToString(key));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->Read(key).status()));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->ReadRange(key, 0, 1, buffer)));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->Size(key).status()));
    EXPECT_TRUE(absl::IsInvalidArgument(store_->OpenForRead(key).status()));
  }
  for (std::string_view prefix : {"../", "/", "a//"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(store_->List(prefix).status())) << prefix;
  }
}

TEST_P(KvStoreReadConformanceTest, WhatTheStoreCannotDoIsRefusedAndChangesNothing) {
  const KvStoreCapabilities capabilities = store_->Capabilities();
  EXPECT_EQ(capabilities.rename, store_->SupportsRename());
  if (!capabilities.locks) {
    const Status lock = store_->TryLock("a.lock").status();
    EXPECT_FALSE(lock.ok());
  }
  if (!capabilities.rename) {
    EXPECT_FALSE(store_->RenameDirectory("dir", "moved").ok());
  }
  if (!capabilities.conditional_write) {
    EXPECT_FALSE(store_->WriteIfAbsent("new", "v").ok());
  }
  EXPECT_EQ(store_->Read("dir/sub/deep").value(), "delta");
  EXPECT_TRUE(absl::IsNotFound(store_->Read("moved/sub/deep").status()));
}

}  // namespace
}  // namespace tensorstash
