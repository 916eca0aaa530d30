// The gs:// store without a server: options, URLs, the reserved uploads folder, and that
// nothing is sent before a request (the servers' tests are gcs_kvstore_server_test.cc).
#include "tensorstash/kvstore/gcs/gcs_kvstore.h"

#include "gtest/gtest.h"
#include "tensorstash/kvstore/registry.h"

namespace tensorstash {
namespace {

GcsKvStoreOptions Unreachable() {
  GcsKvStoreOptions options;
  options.bucket = "bkt";
  options.prefix = "run";
  options.endpoint = "http://127.0.0.1:1";  // nothing listens there
  options.credentials = AnonymousGcsCredentials();
  options.max_attempts = 1;
  return options;
}

TEST(GcsKvStoreTest, OpenChecksItsOptionsAndSendsNothing) {
  Result<std::unique_ptr<GcsKvStore>> store = GcsKvStore::Open(Unreachable());
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->Describe(), "gs://bkt/run");
  KvStoreCapabilities caps = (*store)->Capabilities();
  EXPECT_TRUE(caps.conditional_write && caps.generations && caps.locks && caps.object_store);
  EXPECT_FALSE(caps.rename);
  const auto refused = [](GcsKvStoreOptions options) {
    return absl::IsInvalidArgument(GcsKvStore::Open(std::move(options)).status());
  };
  GcsKvStoreOptions options = Unreachable();
  for (const char* bucket : {"", "ab", "Bkt", "-bkt", "bkt-", "b/k", "b k"}) {
    options.bucket = bucket;
    EXPECT_TRUE(refused(options)) << bucket;
  }
  options = Unreachable();
  options.prefix = "a/../b";
  EXPECT_TRUE(refused(options));
  options.prefix = "a/.tensorstash-uploads";
  EXPECT_TRUE(refused(options));
  options = Unreachable();
  for (const char* endpoint : {"", "127.0.0.1:1", "ftp://h", "http://"}) {
    options.endpoint = endpoint;
    EXPECT_TRUE(refused(options)) << endpoint;
  }
  options = Unreachable();
  options.max_parts = 1025;
  EXPECT_TRUE(refused(options));
  options = Unreachable();
  options.part_size = 0;
  EXPECT_TRUE(refused(options));
  options = Unreachable();
  options.list_page_size = 1001;
  EXPECT_TRUE(refused(options));
}

TEST(GcsKvStoreTest, RefusesKeysInTheUploadsFolderBeforeSending) {
  Result<std::unique_ptr<GcsKvStore>> store = GcsKvStore::Open(Unreachable());
  ASSERT_TRUE(store.ok()) << store.status();
  // Not UTF-8: GCS names must be, and the JSON bodies of writes could not carry it.
  for (const char* key : {".tensorstash-uploads/x", "a/.tensorstash-uploads/b/1/00001",
                          "a/\xff\xfe", "bad\xc3"}) {
    EXPECT_TRUE(absl::IsInvalidArgument((*store)->Read(key).status())) << key;
    EXPECT_TRUE(absl::IsInvalidArgument((*store)->Write(key, "v"))) << key;
    EXPECT_TRUE(absl::IsInvalidArgument((*store)->WriteIfAbsent(key, "v"))) << key;
    EXPECT_TRUE(absl::IsInvalidArgument((*store)->Delete(key))) << key;
  }
  // A server that is not there is Unavailable, naming the key.
  Result<std::string> read = (*store)->Read("a/b");
  EXPECT_TRUE(absl::IsUnavailable(read.status())) << read.status();
  EXPECT_NE(read.status().message().find("'a/b' in gs://bkt/run"), std::string_view::npos);
}

TEST(GcsKvStoreTest, MissingCredentialsArePermissionDeniedBeforeSending) {
  GcsKvStoreOptions options = Unreachable();
  // NO_GCE_CHECK: the metadata server is not asked (this test sends nothing).
  Result<std::shared_ptr<GcsCredentialProvider>> none =
      ResolveGcsCredentials({}, FixedEnv({{"NO_GCE_CHECK", "true"}}));
  ASSERT_TRUE(none.ok());
  options.credentials = *none;
  Result<std::unique_ptr<GcsKvStore>> store = GcsKvStore::Open(options);
  ASSERT_TRUE(store.ok()) << store.status();
  Result<std::string> read = (*store)->Read("k");
  EXPECT_TRUE(absl::IsPermissionDenied(read.status())) << read.status();
  EXPECT_NE(read.status().message().find("reading 'k' in gs://bkt/run"), std::string_view::npos);
}

// 192.0.2.1 (TEST-NET-1) is never reached: the refusal comes before a connection is tried.
TEST(GcsKvStoreTest, ATokenIsNotSentOverPlainHttpToARemoteHost) {
  GcsKvStoreOptions options = Unreachable();
  options.endpoint = "http://192.0.2.1:9";
  options.credentials = StaticGcsToken("secret-token", "the token of this test");
  Result<std::unique_ptr<GcsKvStore>> store = GcsKvStore::Open(options);
  ASSERT_TRUE(store.ok()) << store.status();
  Result<std::string> read = (*store)->Read("k");
  EXPECT_TRUE(absl::IsPermissionDenied(read.status())) << read.status();
  EXPECT_NE(read.status().message().find("reading 'k' in gs://bkt/run"), std::string_view::npos);
  EXPECT_NE(read.status().message().find("allow_http_token"), std::string_view::npos);
  EXPECT_EQ(read.status().message().find("secret-token"), std::string_view::npos);

  OpenStoreOptions open;
  open.driver_options = {{"endpoint", "http://192.0.2.1:9"}, {"token", "secret-token"}};
  Result<std::unique_ptr<KvStore>> opened = OpenKvStore("gs://bkt/run", open);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_TRUE(absl::IsPermissionDenied((*opened)->Read("k").status()));
  // The option is a bool, and it is known to the registry.
  open.driver_options["allow_http_token"] = "maybe";
  EXPECT_TRUE(absl::IsInvalidArgument(OpenKvStore("gs://bkt/run", open).status()));
  open.driver_options["allow_http_token"] = "true";
  EXPECT_TRUE(OpenKvStore("gs://bkt/run", open).ok());
}

TEST(GcsKvStoreTest, TheRegistryOpensGsUrlsAndChecksDriverOptions) {
  const auto open = [](std::string url, std::map<std::string, std::string> driver_options) {
    OpenStoreOptions options;
    options.driver_options = std::move(driver_options);
    return OpenKvStore(url, options);
  };
  Result<std::unique_ptr<KvStore>> store =
      open("gs://bkt/a/b", {{"endpoint", "http://127.0.0.1:1"}, {"anonymous", "true"},
                            {"part_size", "1048576"}, {"list_page_size", "2"},
                            {"user_project", "p"}});
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->Describe(), "gs://bkt/a/b");
  Result<std::unique_ptr<KvStore>> unknown = open("gs://bkt", {{"region", "x"}});
  EXPECT_TRUE(absl::IsInvalidArgument(unknown.status()));
  EXPECT_NE(unknown.status().message().find("region"), std::string_view::npos);
  EXPECT_TRUE(absl::IsInvalidArgument(open("gs://bkt", {{"anonymous", "maybe"}}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(open("gs://bkt", {{"part_size", "0"}}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      open("gs://bkt", {{"token", "t"}, {"anonymous", "true"}}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(open("gs://Bad_Bucket", {}).status()));
}

TEST(GcsKvStoreTest, DefaultsAreScopedByUrlPrefix) {
  GcsDefaults wrong_scheme;
  wrong_scheme.url_prefix = "s3://b";
  EXPECT_TRUE(absl::IsInvalidArgument(SetGcsDefaults(wrong_scheme)));
  GcsDefaults both;
  both.credentials.anonymous = true;
  both.credentials.token = "t";
  both.url_prefix = "gs://b";
  EXPECT_TRUE(absl::IsInvalidArgument(SetGcsDefaults(both)));
  // An endpoint that cannot be opened shows where the scoped settings apply, without a request.
  GcsDefaults scoped;
  scoped.endpoint = "ftp://scoped.test";
  scoped.credentials.anonymous = true;
  scoped.url_prefix = "gs://scoped-bkt/run";
  ASSERT_TRUE(SetGcsDefaults(scoped).ok());
  Result<std::unique_ptr<KvStore>> under = OpenKvStore("gs://scoped-bkt/run/7");
  EXPECT_TRUE(absl::IsInvalidArgument(under.status())) << under.status();
  EXPECT_NE(under.status().message().find("ftp://scoped.test"), std::string_view::npos)
      << under.status();
  EXPECT_TRUE(OpenKvStore("gs://scoped-bkt/runner").ok());
  EXPECT_TRUE(OpenKvStore("gs://scoped-bkt").ok());
  scoped.endpoint = "http://127.0.0.1:1";
  ASSERT_TRUE(SetGcsDefaults(scoped).ok());  // replaces the settings of the same prefix
  EXPECT_TRUE(OpenKvStore("gs://scoped-bkt/run/7").ok());
}

}  // namespace
}  // namespace tensorstash
