// Where the gs:// store's credentials come from (no server): the ADC chain's order, the
// credentials files, the service-account JWT (signed here, verified with the key's public half)
// and the error that lists where it looked.
#include "tensorstash/kvstore/gcs/gcs_credentials.h"

#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rsa.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "tensorstash/util/base64.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

using nlohmann::json;

// Explicit credentials (a helper: designated initializers would leave fields out).
GcsCredentialOptions Given(bool anonymous, std::optional<std::string> token = std::nullopt,
                           std::optional<std::string> credentials_file = std::nullopt) {
  GcsCredentialOptions options;
  options.anonymous = anonymous;
  options.token = std::move(token);
  options.credentials_file = std::move(credentials_file);
  return options;
}

bool Contains(const std::string& text, std::string_view part) {
  return text.find(part) != std::string::npos;
}
bool Contains(absl::string_view text, std::string_view part) {  // a Status's message
  return Contains(std::string(text.data(), text.size()), part);
}

// A fresh RSA-2048 key.
std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> NewRsaKey() {
  std::unique_ptr<EVP_PKEY_CTX, decltype(&EVP_PKEY_CTX_free)> ctx(
      EVP_PKEY_CTX_new_id(EVP_PKEY_RSA, nullptr), &EVP_PKEY_CTX_free);
  EVP_PKEY* key = nullptr;
  EXPECT_EQ(EVP_PKEY_keygen_init(ctx.get()), 1);
  EXPECT_EQ(EVP_PKEY_CTX_set_rsa_keygen_bits(ctx.get(), 2048), 1);
  EXPECT_EQ(EVP_PKEY_keygen(ctx.get(), &key), 1);
  return {key, &EVP_PKEY_free};
}

std::string PrivatePem(EVP_PKEY* key) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()), &BIO_free);
  EXPECT_EQ(PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr), 1);
  char* data = nullptr;
  const long size = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(size));
}

std::string Base64UrlDecode(std::string_view text) {
  std::string b64(text);
  for (char& c : b64) c = c == '-' ? '+' : c == '_' ? '/' : c;
  while (b64.size() % 4 != 0) b64.push_back('=');
  Result<std::string> decoded = Base64Decode(b64);
  EXPECT_TRUE(decoded.ok()) << decoded.status();
  return decoded.ok() ? *decoded : std::string();
}

bool Verify(EVP_PKEY* key, std::string_view input, std::string_view signature) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  return EVP_DigestVerifyInit(ctx.get(), nullptr, EVP_sha256(), nullptr, key) == 1 &&
         EVP_DigestVerify(ctx.get(), reinterpret_cast<const unsigned char*>(signature.data()),
                          signature.size(), reinterpret_cast<const unsigned char*>(input.data()),
                          input.size()) == 1;
}

// A fresh folder under the test temp dir.
std::string TempFolder(std::string_view name) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    StrCat("gcs-cred-", name, "-", ::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string AuthorizedUserJson(std::string_view client_id) {
  return json{{"type", "authorized_user"},
              {"client_id", client_id},
              {"client_secret", "s"},
              {"refresh_token", "r"},
              {"token_uri", "http://127.0.0.1:1/token"}}
      .dump();
}

TEST(GcsCredentialsTest, ExplicitCredentialsComeFirst) {
  const EnvLookup emulator = FixedEnv({{"STORAGE_EMULATOR_HOST", "127.0.0.1:9023"}});
  Result<std::shared_ptr<GcsCredentialProvider>> token =
      ResolveGcsCredentials(Given(false, "ya29.t"), emulator);
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ((*token)->Token().value(), "ya29.t");
  EXPECT_NE((*token)->Describe().find("token"), std::string::npos);
  Result<std::shared_ptr<GcsCredentialProvider>> anonymous =
      ResolveGcsCredentials(Given(true), FixedEnv({}));
  ASSERT_TRUE(anonymous.ok()) << anonymous.status();
  EXPECT_EQ((*anonymous)->Token().value(), "");
  EXPECT_TRUE(absl::IsInvalidArgument(
      ResolveGcsCredentials(Given(true, "t"), FixedEnv({})).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      ResolveGcsCredentials(Given(false, ""), FixedEnv({})).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      ResolveGcsCredentials(Given(false, "t", "/k.json"), FixedEnv({})).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      ResolveGcsCredentials(Given(false, std::nullopt, ""), FixedEnv({})).status()));
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
  const std::string home = TempFolder("empty-home");
  Result<std::shared_ptr<GcsCredentialProvider>> got =
      ResolveGcsCredentials({}, FixedEnv({{"HOME", home}, {"NO_GCE_CHECK", "true"}}));
  ASSERT_TRUE(got.ok()) << got.status();
  Result<std::string> token = (*got)->Token();
  ASSERT_TRUE(absl::IsPermissionDenied(token.status())) << token.status();
  for (const std::string& part :
       {std::string("STORAGE_EMULATOR_HOST"), std::string("GOOGLE_APPLICATION_CREDENTIALS"),
        StrCat(home, "/.config/gcloud/application_default_credentials.json"),
        std::string("metadata server"), std::string("NO_GCE_CHECK"),
        std::string("gcloud auth application-default login"), std::string("credentials_file"),
        std::string("token"), std::string("anonymous")}) {
    EXPECT_TRUE(Contains(token.status().message(), part)) << part << "\n" << token.status();
  }
}

TEST(GcsCredentialsTest, AMetadataHostThatDoesNotAnswerIsListedAndNotAskedAgain) {
  // Port 1 on loopback: nothing listens there, so the connection is refused at once.
  Result<std::shared_ptr<GcsCredentialProvider>> got = ResolveGcsCredentials(
      {}, FixedEnv({{"HOME", TempFolder("home-md")}, {"GCE_METADATA_HOST", "127.0.0.1:1"}}));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(Contains((*got)->Describe(), "127.0.0.1:1"));
  for (int attempt = 0; attempt < 2; ++attempt) {
    Result<std::string> token = (*got)->Token();
    ASSERT_TRUE(absl::IsPermissionDenied(token.status())) << token.status();
    EXPECT_TRUE(Contains(token.status().message(), "metadata server at 127.0.0.1:1"))
        << token.status();
    EXPECT_TRUE(Contains(token.status().message(), "no server answered")) << token.status();
  }
}

TEST(GcsCredentialsTest, TheChainTakesTheFirstCredentialsFileInGooglesOrder) {
  const std::string dir = TempFolder("chain");
  const std::string explicit_file = dir + "/explicit.json";
  const std::string gac_file = dir + "/gac.json";
  const std::string cloudsdk = dir + "/cloudsdk";
  const std::string home = dir + "/home";
  std::filesystem::create_directories(cloudsdk);
  std::filesystem::create_directories(home + "/.config/gcloud");
  WriteFile(explicit_file, AuthorizedUserJson("explicit"));
  WriteFile(gac_file, AuthorizedUserJson("gac"));
  WriteFile(cloudsdk + "/application_default_credentials.json", AuthorizedUserJson("sdk"));
  WriteFile(home + "/.config/gcloud/application_default_credentials.json",
            AuthorizedUserJson("home"));

  auto describe = [](const GcsCredentialOptions& options,
                     std::map<std::string, std::string> env) -> std::string {
    Result<std::shared_ptr<GcsCredentialProvider>> got =
        ResolveGcsCredentials(options, FixedEnv(std::move(env)));
    EXPECT_TRUE(got.ok()) << got.status();
    return got.ok() ? (*got)->Describe() : std::string();
  };
  std::map<std::string, std::string> env = {{"GOOGLE_APPLICATION_CREDENTIALS", gac_file},
                                            {"CLOUDSDK_CONFIG", cloudsdk},
                                            {"HOME", home},
                                            {"NO_GCE_CHECK", "true"}};
  EXPECT_TRUE(Contains(describe(Given(false, std::nullopt, explicit_file), env), explicit_file));
  EXPECT_TRUE(Contains(describe({}, env), gac_file));
  EXPECT_TRUE(Contains(describe({}, env), "GOOGLE_APPLICATION_CREDENTIALS"));
  env.erase("GOOGLE_APPLICATION_CREDENTIALS");
  EXPECT_TRUE(Contains(describe({}, env), cloudsdk + "/application_default_credentials.json"));
  env.erase("CLOUDSDK_CONFIG");
  EXPECT_TRUE(
      Contains(describe({}, env), home + "/.config/gcloud/application_default_credentials.json"));
  // An emulator host wins over every file, as in Google's clients; explicit options over it.
  env["GOOGLE_APPLICATION_CREDENTIALS"] = gac_file;
  env["STORAGE_EMULATOR_HOST"] = "127.0.0.1:9";
  EXPECT_TRUE(Contains(describe({}, env), "anonymous"));
  EXPECT_TRUE(Contains(describe(Given(false, std::nullopt, explicit_file), env), explicit_file));
}

TEST(GcsCredentialsTest, AMissingFileNamedByTheEnvironmentIsPermissionDeniedNamingIt) {
  const std::string missing = TempFolder("missing") + "/nope.json";
  Result<std::shared_ptr<GcsCredentialProvider>> got =
      ResolveGcsCredentials({}, FixedEnv({{"GOOGLE_APPLICATION_CREDENTIALS", missing}}));
  ASSERT_TRUE(absl::IsPermissionDenied(got.status())) << got.status();
  EXPECT_TRUE(Contains(got.status().message(), missing)) << got.status();
  EXPECT_TRUE(Contains(got.status().message(), "GOOGLE_APPLICATION_CREDENTIALS")) << got.status();
}

TEST(GcsCredentialsTest, CredentialsFilesAreParsedByType) {
  Result<GcsCredentialsFile> sa = ParseGcsCredentialsFile(
      R"({"type":"service_account","client_email":"a@p.iam.gserviceaccount.com",
          "private_key":"-----BEGIN PRIVATE KEY-----\n...","private_key_id":"k1"})",
      "key.json");
  ASSERT_TRUE(sa.ok()) << sa.status();
  EXPECT_EQ(sa->client_email, "a@p.iam.gserviceaccount.com");
  EXPECT_EQ(sa->private_key_id, "k1");
  EXPECT_EQ(sa->token_uri, "https://oauth2.googleapis.com/token");
  Result<GcsCredentialsFile> user = ParseGcsCredentialsFile(AuthorizedUserJson("c"), "adc.json");
  ASSERT_TRUE(user.ok()) << user.status();
  EXPECT_EQ(user->client_id, "c");
  EXPECT_EQ(user->refresh_token, "r");
  EXPECT_EQ(user->token_uri, "http://127.0.0.1:1/token");

  Result<GcsCredentialsFile> other =
      ParseGcsCredentialsFile(R"({"type":"external_account"})", "wif.json");
  ASSERT_TRUE(absl::IsUnimplemented(other.status())) << other.status();
  EXPECT_TRUE(Contains(other.status().message(), "external_account"));
  EXPECT_TRUE(Contains(other.status().message(), "wif.json"));

  Result<GcsCredentialsFile> no_key = ParseGcsCredentialsFile(
      R"({"type":"service_account","client_email":"a@b"})", "short.json");
  ASSERT_TRUE(absl::IsInvalidArgument(no_key.status())) << no_key.status();
  EXPECT_TRUE(Contains(no_key.status().message(), "private_key"));
  EXPECT_TRUE(Contains(no_key.status().message(), "short.json"));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseGcsCredentialsFile("{", "bad.json").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseGcsCredentialsFile("{}", "untyped.json").status()));

  // A token grant carries a secret: https, or plain http to a loopback host only.
  for (const char* uri : {"http://oauth2.example.com/token", "ftp://127.0.0.1/token",
                          "http://127.evil.com/token"}) {
    json doc = json::parse(AuthorizedUserJson("c"));
    doc["token_uri"] = uri;
    Result<GcsCredentialsFile> bad = ParseGcsCredentialsFile(doc.dump(), "u.json");
    EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << uri << ": " << bad.status();
  }
  for (const char* uri : {"http://localhost:8080/token", "http://[::1]:9/token",
                          "https://oauth2.googleapis.com/token"}) {
    json doc = json::parse(AuthorizedUserJson("c"));
    doc["token_uri"] = uri;
    EXPECT_TRUE(ParseGcsCredentialsFile(doc.dump(), "u.json").ok()) << uri;
  }
}

TEST(GcsCredentialsTest, TheServiceAccountJwtIsSignedWithTheKeyAndVerifiesWithItsPublicHalf) {
  auto key = NewRsaKey();
  GcsCredentialsFile file;
  file.type = "service_account";
  file.client_email = "sa@p.iam.gserviceaccount.com";
  file.private_key = PrivatePem(key.get());
  file.private_key_id = "kid-1";
  file.token_uri = "http://127.0.0.1:5/token";
  Result<std::string> jwt = MakeGcsServiceAccountJwt(
      file, "https://www.googleapis.com/auth/devstorage.read_write", 1700000000);
  ASSERT_TRUE(jwt.ok()) << jwt.status();
  const std::vector<std::string_view> parts = StrSplit(*jwt, '.');
  ASSERT_EQ(parts.size(), 3u) << *jwt;
  const json header = json::parse(Base64UrlDecode(parts[0]));
  EXPECT_EQ(header["alg"], "RS256");
  EXPECT_EQ(header["typ"], "JWT");
  EXPECT_EQ(header["kid"], "kid-1");
  const json claims = json::parse(Base64UrlDecode(parts[1]));
  EXPECT_EQ(claims["iss"], "sa@p.iam.gserviceaccount.com");
  EXPECT_EQ(claims["aud"], "http://127.0.0.1:5/token");
  EXPECT_EQ(claims["scope"], "https://www.googleapis.com/auth/devstorage.read_write");
  EXPECT_EQ(claims["iat"], 1700000000);
  EXPECT_EQ(claims["exp"], 1700003600);
  const std::string input = StrCat(parts[0], ".", parts[1]);
  const std::string signature = Base64UrlDecode(parts[2]);
  EXPECT_EQ(signature.size(), 256u);
  EXPECT_TRUE(Verify(key.get(), input, signature));
  // The signature covers the claims, and another key does not verify it.
  EXPECT_FALSE(Verify(key.get(), StrCat(input, "x"), signature));
  auto other = NewRsaKey();
  EXPECT_FALSE(Verify(other.get(), input, signature));

  file.private_key = "not a key";
  Result<std::string> bad = MakeGcsServiceAccountJwt(file, "s", 1);
  ASSERT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  EXPECT_TRUE(Contains(bad.status().message(), "sa@p.iam.gserviceaccount.com"));
}

TEST(GcsCredentialsTest, ATokenGoesInTheClearOnlyToLoopbackTheEmulatorOrWhenAllowed) {
  const EnvLookup none = FixedEnv({});
  for (const char* safe : {"https://storage.googleapis.com", "https://10.0.0.5:8443",
                           "http://127.0.0.1:4443", "http://127.8.9.10", "http://localhost:9000",
                           "http://[::1]:4443"}) {
    EXPECT_TRUE(CheckGcsTokenTransport(safe, false, none).ok()) << safe;
  }
  for (const char* clear : {"http://10.0.0.5:4443", "http://storage.example.com",
                            "http://127.example.com", "http://[2001:db8::1]:80"}) {
    Status refused = CheckGcsTokenTransport(clear, false, none);
    EXPECT_TRUE(absl::IsPermissionDenied(refused)) << clear << ": " << refused;
    EXPECT_NE(refused.message().find(clear), std::string_view::npos) << refused;
    EXPECT_NE(refused.message().find("allow_http_token=true"), std::string_view::npos) << refused;
    EXPECT_NE(refused.message().find("STORAGE_EMULATOR_HOST"), std::string_view::npos) << refused;
    EXPECT_TRUE(CheckGcsTokenTransport(clear, true, none).ok()) << clear;
  }
  // The emulator's host, with or without a scheme in the variable; another host is not.
  EXPECT_TRUE(CheckGcsTokenTransport("http://10.0.0.5:4443", false,
                                     FixedEnv({{"STORAGE_EMULATOR_HOST", "10.0.0.5:4443"}}))
                  .ok());
  EXPECT_TRUE(CheckGcsTokenTransport("http://gcs.test:80", false,
                                     FixedEnv({{"STORAGE_EMULATOR_HOST", "http://gcs.test"}}))
                  .ok());
  EXPECT_TRUE(absl::IsPermissionDenied(CheckGcsTokenTransport(
      "http://10.0.0.6:4443", false, FixedEnv({{"STORAGE_EMULATOR_HOST", "10.0.0.5:4443"}}))));
}

TEST(GcsCredentialsTest, AnUnsupportedTypeInGoogleApplicationCredentialsIsUnimplemented) {
  const std::string path = TempFolder("wif") + "/wif.json";
  WriteFile(path, R"({"type":"impersonated_service_account"})");
  Result<std::shared_ptr<GcsCredentialProvider>> got =
      ResolveGcsCredentials({}, FixedEnv({{"GOOGLE_APPLICATION_CREDENTIALS", path}}));
  ASSERT_TRUE(absl::IsUnimplemented(got.status())) << got.status();
  EXPECT_TRUE(Contains(got.status().message(), "impersonated_service_account"));
  EXPECT_TRUE(Contains(got.status().message(), path));
}

}  // namespace
}  // namespace tensorstash
