// The S3 store's per-store options through the registry (OpenStoreOptions::driver_options),
// without a server: opening sends nothing. The store against real servers is
// s3_kvstore_server_test.cc.
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "tensorstash/kvstore/registry.h"
#include "tensorstash/kvstore/s3/s3_kvstore.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

TEST(S3StoreOptionsTest, KnownOptionsOpenAndUnknownOnesAreErrorsNamingThem) {
  OpenStoreOptions options;
  options.create = true;  // the probe is lazy: still nothing is sent
  options.driver_options = {{"endpoint", "http://127.0.0.1:1"},
                            {"region", "eu-west-3"},
                            {"path_style", "true"},
                            {"anonymous", "true"}};
  Result<std::unique_ptr<KvStore>> store = OpenKvStore("s3://bucket-a/run", options);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->Describe(), "s3://bucket-a/run");

  options.driver_options["endpont"] = "http://127.0.0.1:1";
  Result<std::unique_ptr<KvStore>> typo = OpenKvStore("s3://bucket-a/run", options);
  EXPECT_TRUE(absl::IsInvalidArgument(typo.status())) << typo.status();
  EXPECT_NE(typo.status().message().find("'endpont'"), std::string_view::npos) << typo.status();
}

TEST(S3StoreOptionsTest, BadValuesAreErrorsNamingTheOption) {
  OpenStoreOptions flag;
  flag.driver_options = {{"endpoint", "http://127.0.0.1:1"}, {"path_style", "maybe"}};
  Result<std::unique_ptr<KvStore>> bad_flag = OpenKvStore("s3://bucket-a", flag);
  EXPECT_TRUE(absl::IsInvalidArgument(bad_flag.status())) << bad_flag.status();
  EXPECT_NE(bad_flag.status().message().find("path_style"), std::string_view::npos);

  OpenStoreOptions half;
  half.driver_options = {{"endpoint", "http://127.0.0.1:1"}, {"access_key_id", "AKIA"}};
  Result<std::unique_ptr<KvStore>> half_keys = OpenKvStore("s3://bucket-a", half);
  EXPECT_TRUE(absl::IsInvalidArgument(half_keys.status())) << half_keys.status();

  OpenStoreOptions endpoint;
  endpoint.driver_options = {{"endpoint", "ftp://127.0.0.1:1"}};
  Result<std::unique_ptr<KvStore>> bad_endpoint = OpenKvStore("s3://bucket-a", endpoint);
  EXPECT_TRUE(absl::IsInvalidArgument(bad_endpoint.status())) << bad_endpoint.status();
}

TEST(S3StoreOptionsTest, ADefaultsPrefixMustBeAnS3Url) {
  S3Defaults defaults;
  defaults.url_prefix = "gs://bucket";
  const Status refused = SetS3Defaults(defaults);
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
}

}  // namespace
}  // namespace tensorstash
