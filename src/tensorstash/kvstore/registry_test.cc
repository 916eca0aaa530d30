// Stores opened by URL (registry.h).
#include "tensorstash/kvstore/registry.h"

#include <filesystem>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsSupersetOf;

TEST(KvStoreRegistryTest, BuiltinSchemesAreRegistered) {
  EXPECT_THAT(RegisteredKvStoreSchemes(), IsSupersetOf({"file", "memory", "s3", "gs"}));
}

// Issue 14: tensorstash.save("s3://bucket/run/1", tree) wrote a local folder named "s3:" (before
// there was an S3 store); any scheme without a store must still be an error.
TEST(KvStoreRegistryTest, AnUnknownSchemeIsAnErrorNamingTheSchemesThereAre) {
  Result<std::unique_ptr<KvStore>> store = OpenKvStore("az://bucket/run", {.create = true});
  EXPECT_TRUE(absl::IsInvalidArgument(store.status())) << store.status();
  EXPECT_THAT(store.status().message(), HasSubstr("'az://'"));
  EXPECT_THAT(store.status().message(), HasSubstr("file, gs, memory, s3"));
  EXPECT_FALSE(std::filesystem::exists("az:"));
  EXPECT_TRUE(absl::IsInvalidArgument(OpenKvStore("").status()));
}

TEST(KvStoreRegistryTest, PlainPathsAndFileUrlsAreLocalFolders) {
  const std::string dir = ::testing::TempDir() + "tensorstash_registry_test";
  std::filesystem::remove_all(dir);
  EXPECT_TRUE(absl::IsNotFound(OpenKvStore(dir).status()));
  Result<std::unique_ptr<KvStore>> created = OpenKvStore(dir, {.create = true});
  TS_ASSERT_OK(created.status());
  TS_ASSERT_OK((*created)->Write("a/b", "x"));
  Result<std::unique_ptr<KvStore>> by_url = OpenKvStore("file://" + dir);
  TS_ASSERT_OK(by_url.status());
  EXPECT_EQ((*by_url)->Read("a/b").value(), "x");
  EXPECT_TRUE(std::filesystem::exists(dir + "/a/b"));
  std::filesystem::remove_all(dir);
}

TEST(KvStoreRegistryTest, MemoryStoresAreSharedByName) {
  EXPECT_TRUE(absl::IsNotFound(OpenKvStore("memory://registry-test-missing").status()));
  auto first = OpenKvStore("memory://registry-test", {.create = true}).value();
  TS_ASSERT_OK(first->Write("k", "v"));
  auto second = OpenKvStore("memory://registry-test").value();
  EXPECT_EQ(second->Read("k").value(), "v");
  auto other = OpenKvStore("memory://registry-test-2", {.create = true}).value();
  EXPECT_TRUE(absl::IsNotFound(other->Read("k").status()));
}

TEST(KvStoreRegistryTest, AStoreOptionTheDriverDoesNotTakeIsAnErrorNamingIt) {
  OpenStoreOptions options;
  options.create = true;
  options.driver_options["colour"] = "blue";
  Result<std::unique_ptr<KvStore>> memory = OpenKvStore("memory://options-test", options);
  EXPECT_TRUE(absl::IsInvalidArgument(memory.status())) << memory.status();
  EXPECT_NE(memory.status().message().find("'colour'"), std::string_view::npos)
      << memory.status();
  options.driver_options.clear();
  Result<std::unique_ptr<KvStore>> plain = OpenKvStore("memory://options-test", options);
  EXPECT_TRUE(plain.ok()) << plain.status();
}

TEST(KvStoreRegistryTest, SplitStepUrl) {
  StepUrl split = SplitStepUrl("/ckpt/run/0000001000/").value();
  EXPECT_EQ(split.root, "/ckpt/run");
  EXPECT_EQ(split.step, "0000001000");
  split = SplitStepUrl("file:///ckpt/./run/../0000001000").value();
  EXPECT_EQ(split.root, "/ckpt");
  EXPECT_EQ(split.step, "0000001000");
  split = SplitStepUrl("memory://bucket/run/0000001000").value();
  EXPECT_EQ(split.root, "memory://bucket/run");
  EXPECT_EQ(split.step, "0000001000");
  split = SplitStepUrl("s3://bucket/0000001000").value();  // split, then refused when opened
  EXPECT_EQ(split.root, "s3://bucket");
  const std::string cwd = std::filesystem::current_path().string();
  // "." is the working directory: a step of its parent (joined as paths: from a top-level folder
  // such as /tmp the root is "/"); from "/" itself it is no step at all.
  Result<StepUrl> here = SplitStepUrl(".");
  if (cwd == "/") {
    EXPECT_TRUE(absl::IsInvalidArgument(here.status())) << here.status();
  } else {
    ASSERT_TRUE(here.ok()) << here.status();
    EXPECT_EQ((std::filesystem::path(here->root) / here->step).string(), cwd);
  }
  for (const char* bad : {"", "/", "memory://", "memory://bucket", "s3://bucket/"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(SplitStepUrl(bad).status())) << bad;
  }
}

TEST(KvStoreRegistryTest, HasUrlScheme) {
  EXPECT_TRUE(HasUrlScheme("s3://b"));
  EXPECT_TRUE(HasUrlScheme("memory://x"));
  EXPECT_TRUE(HasUrlScheme("gs+x.y-z://b"));
  EXPECT_FALSE(HasUrlScheme("/abs/path"));
  EXPECT_FALSE(HasUrlScheme("./weird://dir"));
  EXPECT_FALSE(HasUrlScheme("://x"));
  EXPECT_FALSE(HasUrlScheme("S3://b"));
}

}  // namespace
}  // namespace tensorstash
