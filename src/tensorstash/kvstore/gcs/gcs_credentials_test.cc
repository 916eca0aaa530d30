// Where the gs:// store's credentials come from (no server).
#include "tensorstash/kvstore/gcs/gcs_credentials.h"

#include "gtest/gtest.h"

namespace tensorstash {
namespace {

TEST(GcsCredentialsTest, ExplicitCredentialsComeFirst) {
  const EnvLookup emulator = FixedEnv({{"STORAGE_EMULATOR_HOST", "127.0.0.1:9023"}});
  Result<std::shared_ptr<GcsCredentialProvider>> token =
      ResolveGcsCredentials({.anonymous = false, .token = "ya29.t"}, emulator);
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ((*token)->Token().value(), "ya29.t");
  EXPECT_NE((*token)->Describe().find("token"), std::string::npos);
  Result<std::shared_ptr<GcsCredentialProvider>> anonymous =
      ResolveGcsCredentials({.anonymous = true, .token = std::nullopt}, FixedEnv({}));
  ASSERT_TRUE(anonymous.ok()) << anonymous.status();
  EXPECT_EQ((*anonymous)->Token().value(), "");
  EXPECT_TRUE(absl::IsInvalidArgument(
      ResolveGcsCredentials({.anonymous = true, .token = "t"}, FixedEnv({})).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      ResolveGcsCredentials({.anonymous = false, .token = ""}, FixedEnv({})).status()));
}

TEST(GcsCredentialsTest, AnEmulatorHostMeansAnonymous) {
  Result<std::shared_ptr<GcsCredentialProvider>> got =
      ResolveGcsCredentials({}, FixedEnv({{"STORAGE_EMULATOR_HOST", "localhost:4443"}}));
  ASSERT_TRUE(got.ok()) << got.status();
  Result<std::string> token = (*got)->Token();
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(*token, "");
  EXPECT_EQ(GcsEmulatorEndpoint(FixedEnv({{"STORAGE_EMULATOR_HOST", "localhost:4443"}})),
            "http://localhost:4443");
  EXPECT_EQ(GcsEmulatorEndpoint(FixedEnv({{"STORAGE_EMULATOR_HOST", "https://e.test:1/"}})),
            "https://e.test:1");
  EXPECT_EQ(GcsEmulatorEndpoint(FixedEnv({{"STORAGE_EMULATOR_HOST", ""}})), std::nullopt);
  EXPECT_EQ(GcsEmulatorEndpoint(FixedEnv({})), std::nullopt);
}

TEST(GcsCredentialsTest, NoCredentialIsPermissionDeniedSayingWhereItLookedAndHowToGiveOne) {
  Result<std::shared_ptr<GcsCredentialProvider>> got = ResolveGcsCredentials({}, FixedEnv({}));
  ASSERT_TRUE(got.ok()) << got.status();
  Result<std::string> token = (*got)->Token();
  ASSERT_TRUE(absl::IsPermissionDenied(token.status())) << token.status();
  for (const char* part : {"STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS",
                           "metadata server", "token", "anonymous"}) {
    EXPECT_NE(token.status().message().find(part), std::string_view::npos) << part;
  }
}

}  // namespace
}  // namespace tensorstash
