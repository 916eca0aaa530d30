// The S3 store's settings and credentials (aws_config.h): the INI parser of the AWS files, the
// precedence of options, environment, config file and defaults, and the credential chain with
// every source. Files are written to a temporary folder and the environment is a fake one
// (FixedEnv): nothing reads the real HOME or environment. The network sources (STS, the
// container endpoint, instance metadata) are served by a libmicrohttpd server on 127.0.0.1 that
// checks what the real services check (the IMDSv2 token, the Authorization header) and counts
// requests; nothing talks to any other address (instance metadata is turned off or pointed at
// the local server in every chain).
#include "tensorstash/kvstore/s3/aws_config.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/kvstore/http/http_client.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

// ---------------------------------------------------------------------------------------------
// Test helpers.

class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "aws_config_test_XXXXXX");
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

  // Writes `contents` to `name` under the folder (creating folders on the way); its path.
  std::string Write(const std::string& name, const std::string& contents) const {
    const std::filesystem::path file = std::filesystem::path(path_) / name;
    std::filesystem::create_directories(file.parent_path());
    std::ofstream(file, std::ios::binary) << contents;
    return file.string();
  }

 private:
  std::string path_;
};

// ISO 8601 for `from_now` from now, as AWS writes it.
std::string IsoIn(std::chrono::seconds from_now) {
  const std::time_t when =
      std::chrono::system_clock::to_time_t(std::chrono::system_clock::now() + from_now);
  std::tm utc{};
  ::gmtime_r(&when, &utc);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

struct SeenRequest {
  std::string method;
  std::string url;
  std::map<std::string, std::string> headers;  // names lowercased
  std::string body;

  std::string Header(const std::string& name) const {
    const auto it = headers.find(name);
    return it == headers.end() ? "" : it->second;
  }
};

struct Reply {
  unsigned int code = 200;
  std::string body;
};

// An HTTP server on 127.0.0.1 (a free port) that answers with `handler` and records requests.
class FakeServer {
 public:
  using Handler = std::function<Reply(const SeenRequest&)>;

  explicit FakeServer(Handler handler) : handler_(std::move(handler)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = 0;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    daemon_ = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG, 0, nullptr,
                               nullptr, &FakeServer::Handle, this, MHD_OPTION_SOCK_ADDR,
                               reinterpret_cast<sockaddr*>(&address), MHD_OPTION_NOTIFY_COMPLETED,
                               &FakeServer::Completed, nullptr, MHD_OPTION_END);
    if (daemon_ != nullptr) {
      const MHD_DaemonInfo* info = MHD_get_daemon_info(daemon_, MHD_DAEMON_INFO_BIND_PORT);
      if (info != nullptr) port_ = info->port;
    }
  }
  ~FakeServer() {
    if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
  }

  bool ok() const { return daemon_ != nullptr && port_ != 0; }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  size_t count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_.size();
  }
  std::vector<SeenRequest> requests() const {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }

 private:
  static MHD_Result CollectHeader(void* cls, MHD_ValueKind, const char* key, const char* value) {
    std::string name(key);
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    (*static_cast<std::map<std::string, std::string>*>(cls))[name] = value ? value : "";
    return MHD_YES;
  }

  static MHD_Result Handle(void* cls, MHD_Connection* connection, const char* url,
                           const char* method, const char* /*version*/, const char* upload_data,
                           size_t* upload_data_size, void** con_cls) {
    auto& self = *static_cast<FakeServer*>(cls);
    auto* pending = static_cast<SeenRequest*>(*con_cls);
    if (pending == nullptr) {  // the headers: start collecting the body
      pending = new SeenRequest{method, url, {}, ""};
      MHD_get_connection_values(connection, MHD_HEADER_KIND, &FakeServer::CollectHeader,
                                &pending->headers);
      *con_cls = pending;
      return MHD_YES;
    }
    if (*upload_data_size != 0) {
      pending->body.append(upload_data, *upload_data_size);
      *upload_data_size = 0;
      return MHD_YES;
    }
    {
      std::lock_guard<std::mutex> lock(self.mu_);
      self.requests_.push_back(*pending);
    }
    const Reply reply = self.handler_(*pending);
    MHD_Response* response = MHD_create_response_from_buffer(
        reply.body.size(), const_cast<char*>(reply.body.data()), MHD_RESPMEM_MUST_COPY);
    if (response == nullptr) return MHD_NO;
    const MHD_Result queued = MHD_queue_response(connection, reply.code, response);
    MHD_destroy_response(response);
    return queued;
  }

  static void Completed(void*, MHD_Connection*, void** con_cls, MHD_RequestTerminationCode) {
    delete static_cast<SeenRequest*>(*con_cls);
    *con_cls = nullptr;
  }

  Handler handler_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
  mutable std::mutex mu_;
  std::vector<SeenRequest> requests_;
};

std::string CredentialsJson(const std::string& id, const std::string& secret,
                            const std::string& token, const std::string& expiration) {
  return "{\"Code\": \"Success\", \"LastUpdated\": \"2024-01-01T00:00:00Z\", \"Type\": "
         "\"AWS-HMAC\", \"AccessKeyId\": \"" +
         id + "\", \"SecretAccessKey\": \"" + secret + "\", \"Token\": \"" + token +
         "\", \"Expiration\": \"" + expiration + "\"}";
}

// A fake instance metadata service (IMDSv2): 401 for any metadata request without the session
// token it gave out.
class FakeImds {
 public:
  static constexpr char kToken[] = "imds-session-token-1";

  // `role` "" answers 404 to the role listing (an instance without an instance profile).
  FakeImds(std::string role, std::chrono::seconds lifetime)
      : server_([this](const SeenRequest& request) { return Answer(request); }),
        role_(std::move(role)),
        lifetime_(lifetime) {}

  FakeServer& server() { return server_; }

 private:
  Reply Answer(const SeenRequest& request) {
    if (request.url == "/latest/api/token") {
      if (request.method != "PUT") return {405, "token requests are PUT"};
      if (request.Header("x-aws-ec2-metadata-token-ttl-seconds") != "21600") {
        return {400, "missing or wrong TTL"};
      }
      return {200, kToken};
    }
    if (request.Header("x-aws-ec2-metadata-token") != kToken) return {401, "Unauthorized"};
    const std::string base = "/latest/meta-data/iam/security-credentials/";
    if (request.url == base) {
      if (role_.empty()) return {404, "Not Found"};
      return {200, role_ + "\n"};
    }
    if (!role_.empty() && request.url == base + role_) {
      return {200, CredentialsJson("ASIAIMDS", "imds-secret", "imds-token", IsoIn(lifetime_))};
    }
    return {404, "Not Found"};
  }

  FakeServer server_;
  std::string role_;
  std::chrono::seconds lifetime_;
};

// The base of every fake environment: HOME is an empty folder and instance metadata is off.
std::map<std::string, std::string> BaseEnv(const TempDir& home) {
  return {{"HOME", home.path()}, {"AWS_EC2_METADATA_DISABLED", "true"}};
}

Result<AwsCredentials> GetFromChain(const std::map<std::string, std::string>& env,
                                    const std::string& profile = "default",
                                    std::shared_ptr<AwsCredentialProvider>* keep = nullptr) {
  Result<std::shared_ptr<AwsCredentialProvider>> chain =
      DefaultCredentialChain(profile, "us-east-1", FixedEnv(env));
  if (!chain.ok()) return chain.status();
  if (keep != nullptr) *keep = *chain;
  return (*chain)->Get();
}

// ---------------------------------------------------------------------------------------------
// The INI parser.

TEST(AwsIniTest, SectionsCommentsAndNestedBlocks) {
  const std::string text =
      "# a comment\n"
      "; another comment\n"
      "[default]\n"
      "region = us-west-2   # after the value\n"
      "output=json\r\n"
      "secret = abc#def;ghi\n"
      "s3 =\n"
      "  addressing_style = path\n"
      "\n"
      "  # a comment inside the block\n"
      "  Endpoint_URL = http://minio:9000 ; its comment\n"
      "max_attempts = 3\n"
      "\n"
      "[profile   dev]  ; comment after the section\n"
      "Region = eu-west-1\n";
  Result<AwsIniFile> file = ParseAwsIni(text, "test.ini");
  ASSERT_TRUE(file.ok()) << file.status();
  const AwsIniSection* main = file->Find("default");
  ASSERT_NE(main, nullptr);
  ASSERT_NE(main->Find("region"), nullptr);
  EXPECT_EQ(*main->Find("region"), "us-west-2");
  EXPECT_EQ(*main->Find("output"), "json");
  EXPECT_EQ(*main->Find("secret"), "abc#def;ghi");  // no whitespace before '#': not a comment
  ASSERT_NE(main->Find("s3"), nullptr);
  EXPECT_EQ(*main->Find("s3"), "");
  ASSERT_NE(main->FindNested("s3", "addressing_style"), nullptr);
  EXPECT_EQ(*main->FindNested("s3", "addressing_style"), "path");
  ASSERT_NE(main->FindNested("s3", "endpoint_url"), nullptr);
  EXPECT_EQ(*main->FindNested("s3", "endpoint_url"), "http://minio:9000");
  // Not indented: back at the top level of the section.
  ASSERT_NE(main->Find("max_attempts"), nullptr);
  EXPECT_EQ(*main->Find("max_attempts"), "3");
  EXPECT_EQ(main->FindNested("s3", "max_attempts"), nullptr);
  EXPECT_EQ(main->Find("addressing_style"), nullptr);

  const AwsIniSection* dev = file->Find("profile dev");
  ASSERT_NE(dev, nullptr);
  ASSERT_NE(dev->Find("region"), nullptr);
  EXPECT_EQ(*dev->Find("region"), "eu-west-1");
  EXPECT_EQ(file->sections.size(), 2u);
}

TEST(AwsIniTest, MalformedLinesNameTheSourceAndLine) {
  Result<AwsIniFile> before = ParseAwsIni("region = x\n[default]\n", "cfg");
  EXPECT_EQ(before.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(before.status().message(), HasSubstr("cfg:1"));

  Result<AwsIniFile> unterminated = ParseAwsIni("[default]\na = b\n[profile x\n", "cfg");
  EXPECT_EQ(unterminated.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unterminated.status().message(), HasSubstr("cfg:3"));

  Result<AwsIniFile> no_equals = ParseAwsIni("[default]\nnot a setting\n", "cfg");
  EXPECT_EQ(no_equals.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_equals.status().message(), HasSubstr("cfg:2"));

  EXPECT_FALSE(ParseAwsIni("[]\n", "cfg").ok());
  EXPECT_FALSE(ParseAwsIni("[default]\n = value\n", "cfg").ok());
  TS_EXPECT_OK(ParseAwsIni("", "cfg").status());
}

TEST(AwsIniTest, ConfigProfileSections) {
  Result<AwsIniFile> file = ParseAwsIni(
      "[profile default]\nregion = a\n[dev]\nregion = b\n[profile dev]\nregion = c\n", "cfg");
  ASSERT_TRUE(file.ok()) << file.status();
  const AwsIniSection* main = FindConfigProfile(*file, "default");
  ASSERT_NE(main, nullptr);
  EXPECT_EQ(*main->Find("region"), "a");
  const AwsIniSection* dev = FindConfigProfile(*file, "dev");
  ASSERT_NE(dev, nullptr);
  EXPECT_EQ(*dev->Find("region"), "c");  // "[dev]" is not a config file's profile section
  EXPECT_EQ(FindConfigProfile(*file, "other"), nullptr);
}

TEST(AwsIniTest, FilePaths) {
  EXPECT_EQ(AwsConfigFilePath(FixedEnv({{"HOME", "/home/u"}})), "/home/u/.aws/config");
  EXPECT_EQ(AwsCredentialsFilePath(FixedEnv({{"HOME", "/home/u/"}})), "/home/u/.aws/credentials");
  EXPECT_EQ(AwsConfigFilePath(FixedEnv({{"HOME", "/home/u"}, {"AWS_CONFIG_FILE", "~/cfg"}})),
            "/home/u/cfg");
  EXPECT_EQ(AwsCredentialsFilePath(FixedEnv({{"AWS_SHARED_CREDENTIALS_FILE", "/etc/creds"}})),
            "/etc/creds");
  EXPECT_EQ(AwsConfigFilePath(FixedEnv({})), "");
}

TEST(AwsIniTest, ReadMissingFileIsNullopt) {
  TempDir dir;
  Result<std::optional<AwsIniFile>> missing = ReadAwsIniFile(dir.path() + "/nope");
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_FALSE(missing->has_value());
  const std::string bad = dir.Write("bad", "[default]\nnonsense\n");
  Result<std::optional<AwsIniFile>> parsed = ReadAwsIniFile(bad);
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(parsed.status().message(), HasSubstr(bad + ":2"));
}

// ---------------------------------------------------------------------------------------------
// Settings.

TEST(S3SettingsTest, Defaults) {
  TempDir home;
  Result<S3Settings> settings = ResolveS3Settings({}, FixedEnv({{"HOME", home.path()}}));
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->endpoint, "https://s3.us-east-1.amazonaws.com");
  EXPECT_EQ(settings->region, "us-east-1");
  EXPECT_FALSE(settings->path_style);
  EXPECT_EQ(settings->profile, "default");

  Result<S3Settings> china = ResolveS3Settings({}, FixedEnv({{"AWS_REGION", "cn-north-1"}}));
  ASSERT_TRUE(china.ok()) << china.status();
  EXPECT_EQ(china->endpoint, "https://s3.cn-north-1.amazonaws.com.cn");
  EXPECT_FALSE(china->path_style);
}

TEST(S3SettingsTest, PrecedenceOverrideEnvConfigDefault) {
  TempDir home;
  const std::string config = home.Write("cfg",
                                        "[default]\n"
                                        "region = sa-east-1\n"
                                        "[profile p]\n"
                                        "region = ap-south-1\n"
                                        "endpoint_url = http://config-host:9000\n"
                                        "s3 =\n"
                                        "    addressing_style = virtual\n");
  std::map<std::string, std::string> env = {
      {"HOME", home.path()}, {"AWS_CONFIG_FILE", config}, {"AWS_PROFILE", "p"}};

  // The config file's profile.
  Result<S3Settings> settings = ResolveS3Settings({}, FixedEnv(env));
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->profile, "p");
  EXPECT_EQ(settings->region, "ap-south-1");
  EXPECT_EQ(settings->endpoint, "http://config-host:9000");
  EXPECT_FALSE(settings->path_style);  // addressing_style = virtual beats the custom default

  // The environment beats the file.
  env["AWS_DEFAULT_REGION"] = "eu-central-1";
  env["AWS_ENDPOINT_URL"] = "http://global-host:1";
  env["TENSORSTASH_S3_ADDRESSING_STYLE"] = "path";
  settings = ResolveS3Settings({}, FixedEnv(env));
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->region, "eu-central-1");
  EXPECT_EQ(settings->endpoint, "http://global-host:1");
  EXPECT_TRUE(settings->path_style);

  // AWS_REGION beats AWS_DEFAULT_REGION; AWS_ENDPOINT_URL_S3 beats AWS_ENDPOINT_URL.
  env["AWS_REGION"] = "eu-west-3";
  env["AWS_ENDPOINT_URL_S3"] = "http://s3-host:2/";
  settings = ResolveS3Settings({}, FixedEnv(env));
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->region, "eu-west-3");
  EXPECT_EQ(settings->endpoint, "http://s3-host:2");

  // The options beat everything.
  S3SettingsOverrides overrides;
  overrides.endpoint = "https://option-host";
  overrides.region = "us-west-1";
  overrides.path_style = false;
  overrides.profile = "default";
  settings = ResolveS3Settings(overrides, FixedEnv(env));
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->endpoint, "https://option-host");
  EXPECT_EQ(settings->region, "us-west-1");
  EXPECT_FALSE(settings->path_style);
  EXPECT_EQ(settings->profile, "default");

  // Another profile of the same file; a profile the file lacks gets the defaults.
  S3SettingsOverrides other;
  other.profile = "default";
  settings =
      ResolveS3Settings(other, FixedEnv({{"HOME", home.path()}, {"AWS_CONFIG_FILE", config}}));
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->region, "sa-east-1");
  EXPECT_EQ(settings->endpoint, "https://s3.sa-east-1.amazonaws.com");
  other.profile = "absent";
  settings =
      ResolveS3Settings(other, FixedEnv({{"HOME", home.path()}, {"AWS_CONFIG_FILE", config}}));
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->region, "us-east-1");
}

TEST(S3SettingsTest, ConfigFileUnderHomeAndServicesSection) {
  TempDir home;
  home.Write(".aws/config",
             "[default]\n"
             "services = local\n"
             "endpoint_url = http://general:1\n"
             "[services local]\n"
             "s3 =\n"
             "  endpoint_url = http://seaweed:8333\n");
  Result<S3Settings> settings = ResolveS3Settings({}, FixedEnv({{"HOME", home.path()}}));
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->endpoint, "http://seaweed:8333");
  EXPECT_TRUE(settings->path_style);

  // AWS_IGNORE_CONFIGURED_ENDPOINT_URLS: back to AWS.
  settings = ResolveS3Settings(
      {}, FixedEnv({{"HOME", home.path()}, {"AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true"}}));
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->endpoint, "https://s3.us-east-1.amazonaws.com");
}

TEST(S3SettingsTest, PathStyleByDefaultForCustomEndpointsOnly) {
  S3SettingsOverrides overrides;
  overrides.endpoint = "http://127.0.0.1:8333";
  Result<S3Settings> custom = ResolveS3Settings(overrides, FixedEnv({}));
  ASSERT_TRUE(custom.ok()) << custom.status();
  EXPECT_TRUE(custom->path_style);

  overrides.endpoint = "https://s3.eu-west-1.amazonaws.com";
  Result<S3Settings> aws = ResolveS3Settings(overrides, FixedEnv({}));
  ASSERT_TRUE(aws.ok()) << aws.status();
  EXPECT_FALSE(aws->path_style);

  // Explicit styles win both ways; "auto" keeps the default.
  Result<S3Settings> forced =
      ResolveS3Settings(overrides, FixedEnv({{"TENSORSTASH_S3_ADDRESSING_STYLE", "path"}}));
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_TRUE(forced->path_style);
  overrides.endpoint = "http://minio.local:9000";
  forced = ResolveS3Settings(overrides, FixedEnv({{"TENSORSTASH_S3_ADDRESSING_STYLE", "virtual"}}));
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_FALSE(forced->path_style);
  forced = ResolveS3Settings(overrides, FixedEnv({{"TENSORSTASH_S3_ADDRESSING_STYLE", "auto"}}));
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_TRUE(forced->path_style);
}

TEST(S3SettingsTest, BadEndpointsNameTheirSource) {
  for (const char* bad : {"127.0.0.1:8333", "ftp://host", "http://host/bucket", "http://host:99999",
                          "http://host:0", "http://host:port", "http://", "http://user@host",
                          "http://host?x=1", "http://a:1:2", "http://ho st", ""}) {
    S3SettingsOverrides overrides;
    overrides.endpoint = bad;
    Result<S3Settings> settings = ResolveS3Settings(overrides, FixedEnv({}));
    EXPECT_EQ(settings.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(settings.status().message(), HasSubstr("the S3 option 'endpoint'")) << bad;
  }
  Result<S3Settings> from_env =
      ResolveS3Settings({}, FixedEnv({{"AWS_ENDPOINT_URL_S3", "http://h/path"}}));
  EXPECT_EQ(from_env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(from_env.status().message(), HasSubstr("AWS_ENDPOINT_URL_S3"));
  EXPECT_THAT(from_env.status().message(), HasSubstr("'http://h/path'"));
  EXPECT_THAT(from_env.status().message(), HasSubstr("a path is not allowed"));

  TempDir home;
  const std::string config = home.Write(".aws/config", "[default]\nendpoint_url = minio:9000\n");
  Result<S3Settings> from_file = ResolveS3Settings({}, FixedEnv({{"HOME", home.path()}}));
  EXPECT_EQ(from_file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(from_file.status().message(), HasSubstr(config));
  EXPECT_THAT(from_file.status().message(), HasSubstr("profile 'default'"));

  // Good ones, normalised.
  EXPECT_EQ(NormalizeEndpoint("HTTP://Host-1.example:8333/", "x").value_or("?"),
            "http://Host-1.example:8333");
  EXPECT_EQ(NormalizeEndpoint("http://[::1]:9000", "x").value_or("?"), "http://[::1]:9000");
  EXPECT_EQ(NormalizeEndpoint("https://s3.amazonaws.com", "x").value_or("?"),
            "https://s3.amazonaws.com");
}

TEST(S3SettingsTest, BadStyleRegionAndProfile) {
  Result<S3Settings> style =
      ResolveS3Settings({}, FixedEnv({{"TENSORSTASH_S3_ADDRESSING_STYLE", "sideways"}}));
  EXPECT_EQ(style.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(style.status().message(), HasSubstr("TENSORSTASH_S3_ADDRESSING_STYLE"));
  EXPECT_THAT(style.status().message(), HasSubstr("sideways"));

  TempDir home;
  const std::string config =
      home.Write(".aws/config", "[default]\nregion =\ns3 =\n  addressing_style = bogus\n");
  Result<S3Settings> from_file = ResolveS3Settings({}, FixedEnv({{"HOME", home.path()}}));
  EXPECT_EQ(from_file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(from_file.status().message(), HasSubstr("region"));
  EXPECT_THAT(from_file.status().message(), HasSubstr(config));
  Result<S3Settings> bad_style =
      ResolveS3Settings({}, FixedEnv({{"HOME", home.path()}, {"AWS_REGION", "us-east-2"}}));
  EXPECT_EQ(bad_style.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_style.status().message(), HasSubstr("bogus"));
  EXPECT_THAT(bad_style.status().message(), HasSubstr(config));

  S3SettingsOverrides overrides;
  overrides.region = "";
  Result<S3Settings> empty_region = ResolveS3Settings(overrides, FixedEnv({}));
  EXPECT_EQ(empty_region.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty_region.status().message(), HasSubstr("'region'"));

  overrides = {};
  overrides.profile = "";
  EXPECT_EQ(ResolveS3Settings(overrides, FixedEnv({})).status().code(),
            absl::StatusCode::kInvalidArgument);

  // A region that cannot form the default endpoint's host name.
  overrides = {};
  overrides.region = "My_Region";
  EXPECT_EQ(ResolveS3Settings(overrides, FixedEnv({})).status().code(),
            absl::StatusCode::kInvalidArgument);
  overrides.endpoint = "http://127.0.0.1:1";  // fine with an explicit endpoint
  TS_EXPECT_OK(ResolveS3Settings(overrides, FixedEnv({})).status());
}

TEST(AwsTimestampTest, Parses) {
  using namespace std::chrono;
  const system_clock::time_point expected = sys_days(year(2026) / 11 / 24) + hours(18);
  EXPECT_EQ(ParseAwsTimestamp("2026-11-24T18:00:00Z").value_or(system_clock::time_point{}),
            expected);
  EXPECT_EQ(ParseAwsTimestamp("2026-11-24T18:00:00.123Z").value_or(system_clock::time_point{}),
            expected);
  EXPECT_EQ(ParseAwsTimestamp("2026-11-24T19:30:00+01:30").value_or(system_clock::time_point{}),
            expected);
  EXPECT_EQ(ParseAwsTimestamp("2026-11-24T17:00:00-0100").value_or(system_clock::time_point{}),
            expected);
  for (const char* bad : {"", "2026-11-24", "2026-11-24T18:00:00", "2026-13-01T00:00:00Z",
                          "2026-02-30T00:00:00Z", "2026-11-24T25:00:00Z", "2026-11-24T18:00:00Zx",
                          "2026/11/24T18:00:00Z", "+026-11-24T18:00:00Z"}) {
    EXPECT_EQ(ParseAwsTimestamp(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

// ---------------------------------------------------------------------------------------------
// Credentials: fixed ones, the environment, the files.

TEST(AwsCredentialsTest, StaticAndAnonymous) {
  std::shared_ptr<AwsCredentialProvider> fixed = StaticCredentials({"AKID", "SECRET", "TOKEN"});
  Result<AwsCredentials> got = fixed->Get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->access_key_id, "AKID");
  EXPECT_EQ(got->secret_access_key, "SECRET");
  EXPECT_EQ(got->session_token, "TOKEN");
  EXPECT_EQ(StaticCredentials({"AKID", "", ""})->Get().status().code(),
            absl::StatusCode::kInvalidArgument);

  std::shared_ptr<AwsCredentialProvider> anonymous = AnonymousCredentials();
  got = anonymous->Get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->access_key_id.empty());
  EXPECT_THAT(anonymous->Describe(), HasSubstr("anonymous"));
}

TEST(AwsCredentialsTest, EnvironmentFirst) {
  TempDir home;
  home.Write(".aws/credentials",
             "[default]\naws_access_key_id = FILEKEY\naws_secret_access_key = FILESECRET\n");
  std::map<std::string, std::string> env = BaseEnv(home);
  env["AWS_ACCESS_KEY_ID"] = "ENVKEY";
  env["AWS_SECRET_ACCESS_KEY"] = "ENVSECRET";
  env["AWS_SESSION_TOKEN"] = "ENVTOKEN";
  std::shared_ptr<AwsCredentialProvider> chain;
  Result<AwsCredentials> got = GetFromChain(env, "default", &chain);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->access_key_id, "ENVKEY");
  EXPECT_EQ(got->secret_access_key, "ENVSECRET");
  EXPECT_EQ(got->session_token, "ENVTOKEN");
  EXPECT_EQ(chain->Describe(), "environment");

  // Without the environment's keys, the file's.
  env.erase("AWS_ACCESS_KEY_ID");
  env.erase("AWS_SECRET_ACCESS_KEY");
  env.erase("AWS_SESSION_TOKEN");
  got = GetFromChain(env, "default", &chain);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->access_key_id, "FILEKEY");
  EXPECT_EQ(got->session_token, "");
  EXPECT_EQ(chain->Describe(),
            "shared credentials file " + home.path() + "/.aws/credentials [profile default]");
}

TEST(AwsCredentialsTest, HalfGivenEnvironmentIsAnError) {
  TempDir home;
  std::map<std::string, std::string> env = BaseEnv(home);
  env["AWS_ACCESS_KEY_ID"] = "ENVKEY";
  Result<AwsCredentials> got = GetFromChain(env);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status().message(), HasSubstr("AWS_SECRET_ACCESS_KEY"));
}

TEST(AwsCredentialsTest, CredentialsFileWithTwoProfiles) {
  TempDir home;
  const std::string path = home.Write("creds",
                                      "[default]\n"
                                      "aws_access_key_id = DEFAULTKEY\n"
                                      "aws_secret_access_key = default/secret+1\n"
                                      "\n"
                                      "# the work account\n"
                                      "[work]\n"
                                      "aws_access_key_id = WORKKEY\n"
                                      "aws_secret_access_key = work/secret\n"
                                      "aws_session_token = worktoken==\n");
  std::map<std::string, std::string> env = BaseEnv(home);
  env["AWS_SHARED_CREDENTIALS_FILE"] = path;

  std::shared_ptr<AwsCredentialProvider> chain;
  Result<AwsCredentials> work = GetFromChain(env, "work", &chain);
  ASSERT_TRUE(work.ok()) << work.status();
  EXPECT_EQ(work->access_key_id, "WORKKEY");
  EXPECT_EQ(work->secret_access_key, "work/secret");
  EXPECT_EQ(work->session_token, "worktoken==");
  EXPECT_EQ(chain->Describe(), "shared credentials file " + path + " [profile work]");

  Result<AwsCredentials> main = GetFromChain(env, "default");
  ASSERT_TRUE(main.ok()) << main.status();
  EXPECT_EQ(main->access_key_id, "DEFAULTKEY");
  EXPECT_EQ(main->secret_access_key, "default/secret+1");
  EXPECT_EQ(main->session_token, "");

  // A profile in neither file.
  Result<AwsCredentials> none = GetFromChain(env, "absent");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(), HasSubstr(path + " has no profile 'absent'"));

  // Half a profile.
  env["AWS_SHARED_CREDENTIALS_FILE"] =
      home.Write("half", "[default]\naws_access_key_id = ONLYKEY\n");
  Result<AwsCredentials> half = GetFromChain(env);
  EXPECT_EQ(half.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(half.status().message(), HasSubstr("aws_secret_access_key"));
}

TEST(AwsCredentialsTest, ConfigFileFallback) {
  TempDir home;
  home.Write(".aws/credentials",
             "[other]\naws_access_key_id = OTHERKEY\naws_secret_access_key = x\n");
  const std::string config = home.Write(".aws/config",
                                        "[profile p]\n"
                                        "region = us-west-2\n"
                                        "aws_access_key_id = CONFIGKEY\n"
                                        "aws_secret_access_key = configsecret\n");
  std::shared_ptr<AwsCredentialProvider> chain;
  Result<AwsCredentials> got = GetFromChain(BaseEnv(home), "p", &chain);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->access_key_id, "CONFIGKEY");
  EXPECT_EQ(got->secret_access_key, "configsecret");
  EXPECT_EQ(chain->Describe(), "config file " + config + " [profile p]");
}

TEST(AwsCredentialsTest, NoSourceIsAHelpfulNotFound) {
  TempDir home;
  std::shared_ptr<AwsCredentialProvider> chain;
  Result<AwsCredentials> got = GetFromChain(BaseEnv(home), "default", &chain);
  ASSERT_EQ(got.status().code(), absl::StatusCode::kNotFound) << got.status();
  const std::string message = MessageOf(got.status());
  EXPECT_THAT(message, HasSubstr("no AWS credentials found for profile 'default'"));
  EXPECT_THAT(message, HasSubstr("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not set"));
  EXPECT_THAT(message, HasSubstr(home.path() + "/.aws/credentials does not exist"));
  EXPECT_THAT(message, HasSubstr(home.path() + "/.aws/config does not exist"));
  EXPECT_THAT(message, HasSubstr("AWS_WEB_IDENTITY_TOKEN_FILE"));
  EXPECT_THAT(message, HasSubstr("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"));
  EXPECT_THAT(message, HasSubstr("AWS_EC2_METADATA_DISABLED"));
  // How to fix it.
  EXPECT_THAT(message, HasSubstr("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"));
  EXPECT_THAT(message, HasSubstr("aws_access_key_id = ... and aws_secret_access_key = ..."));
  EXPECT_THAT(message, HasSubstr("AWS_PROFILE"));
  EXPECT_THAT(message, HasSubstr("anonymously"));
  EXPECT_THAT(chain->Describe(), HasSubstr("no credentials found"));
  // Kept.
  EXPECT_EQ(chain->Get().status(), got.status());

  // No HOME at all.
  Result<AwsCredentials> homeless = GetFromChain({{"AWS_EC2_METADATA_DISABLED", "TRUE"}});
  EXPECT_EQ(homeless.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(homeless.status().message(), HasSubstr("HOME and AWS_SHARED_CREDENTIALS_FILE"));
}

TEST(AwsCredentialsTest, UnsupportedProfileKindIsExplained) {
  TempDir home;
  home.Write(".aws/config", "[profile sso]\nsso_session = corp\nregion = us-east-1\n");
  Result<AwsCredentials> got = GetFromChain(BaseEnv(home), "sso");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(got.status().message(), HasSubstr("IAM Identity Center"));
  EXPECT_THAT(got.status().message(),
              HasSubstr("aws configure export-credentials --profile sso --format env"));
}

TEST(AwsCredentialsTest, BadArguments) {
  EXPECT_EQ(DefaultCredentialChain("", "us-east-1", FixedEnv({})).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DefaultCredentialChain("default", "", FixedEnv({})).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// Credentials over the network, from a server on 127.0.0.1.

TEST(AwsCredentialsTest, ContainerEndpoint) {
  FakeServer server([](const SeenRequest& request) -> Reply {
    if (request.Header("authorization") != "Bearer container-secret") return {401, "no"};
    if (request.method != "GET" || request.url != "/v2/credentials/abc") return {404, "?"};
    return {200, CredentialsJson("ASIACONTAINER", "container-secret-key", "container-token",
                                 IsoIn(std::chrono::hours(6)))};
  });
  ASSERT_TRUE(server.ok());
  TempDir home;
  std::map<std::string, std::string> env = BaseEnv(home);
  env["AWS_CONTAINER_CREDENTIALS_FULL_URI"] = server.url() + "/v2/credentials/abc";
  env["AWS_CONTAINER_AUTHORIZATION_TOKEN"] = "Bearer container-secret";

  std::shared_ptr<AwsCredentialProvider> chain;
  Result<AwsCredentials> got = GetFromChain(env, "default", &chain);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->access_key_id, "ASIACONTAINER");
  EXPECT_EQ(got->secret_access_key, "container-secret-key");
  EXPECT_EQ(got->session_token, "container-token");
  EXPECT_EQ(chain->Describe(), "container endpoint " + server.url() + "/v2/credentials/abc");
  EXPECT_EQ(server.count(), 1u);
  // Fresh: no new request.
  got = chain->Get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->access_key_id, "ASIACONTAINER");
  EXPECT_EQ(server.count(), 1u);

  // The token file wins over the variable.
  env["AWS_CONTAINER_AUTHORIZATION_TOKEN"] = "Bearer wrong";
  env["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"] = home.Write("token", "Bearer container-secret\n");
  got = GetFromChain(env);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->access_key_id, "ASIACONTAINER");

  // A refused token: PermissionDenied naming the endpoint.
  env.erase("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE");
  got = GetFromChain(env);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(got.status().message(), HasSubstr("container endpoint " + server.url()));
  EXPECT_THAT(got.status().message(), HasSubstr("401"));

  // Plain http to a host that is not local is refused before any request.
  const size_t before = server.count();
  env["AWS_CONTAINER_CREDENTIALS_FULL_URI"] = "http://credentials.example.com/creds";
  got = GetFromChain(env);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server.count(), before);
}

TEST(AwsCredentialsTest, ContainerEndpointAnsweringNonsenseIsUnavailable) {
  FakeServer server([](const SeenRequest&) -> Reply { return {200, "<html>not json</html>"}; });
  ASSERT_TRUE(server.ok());
  TempDir home;
  std::map<std::string, std::string> env = BaseEnv(home);
  env["AWS_CONTAINER_CREDENTIALS_FULL_URI"] = server.url() + "/creds";
  Result<AwsCredentials> got = GetFromChain(env);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(got.status().message(), HasSubstr("not a JSON object"));
}

TEST(AwsCredentialsTest, EnvironmentBeatsContainerWithoutARequest) {
  FakeServer server([](const SeenRequest&) -> Reply { return {500, "must not be asked"}; });
  ASSERT_TRUE(server.ok());
  TempDir home;
  std::map<std::string, std::string> env = BaseEnv(home);
  env["AWS_CONTAINER_CREDENTIALS_FULL_URI"] = server.url() + "/creds";
  env["AWS_ACCESS_KEY_ID"] = "ENVKEY";
  env["AWS_SECRET_ACCESS_KEY"] = "ENVSECRET";
  Result<AwsCredentials> got = GetFromChain(env);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->access_key_id, "ENVKEY");
  EXPECT_EQ(server.count(), 0u);
}

std::map<std::string, std::string> ImdsEnv(const TempDir& home, const FakeServer& server) {
  std::map<std::string, std::string> env = {{"HOME", home.path()}};
  env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = server.url();
  return env;
}

TEST(AwsCredentialsTest, FakeImdsRequiresTheToken) {
  FakeImds imds("my-role", std::chrono::hours(6));
  ASSERT_TRUE(imds.server().ok());
  HttpClient client;
  HttpRequest request;
  request.url = imds.server().url() + "/latest/meta-data/iam/security-credentials/";
  Result<HttpResponse> response = client.Perform(request, "test");
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->status, 401);
}

TEST(AwsCredentialsTest, InstanceMetadataV2) {
  FakeImds imds("my-role", std::chrono::hours(6));
  ASSERT_TRUE(imds.server().ok());
  TempDir home;
  std::shared_ptr<AwsCredentialProvider> chain;
  Result<AwsCredentials> got = GetFromChain(ImdsEnv(home, imds.server()), "default", &chain);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->access_key_id, "ASIAIMDS");
  EXPECT_EQ(got->secret_access_key, "imds-secret");
  EXPECT_EQ(got->session_token, "imds-token");
  EXPECT_EQ(chain->Describe(), "instance metadata " + imds.server().url() + " (role my-role)");

  const std::vector<SeenRequest> requests = imds.server().requests();
  ASSERT_EQ(requests.size(), 3u);
  EXPECT_EQ(requests[0].method, "PUT");
  EXPECT_EQ(requests[0].url, "/latest/api/token");
  EXPECT_EQ(requests[1].method, "GET");
  EXPECT_EQ(requests[1].url, "/latest/meta-data/iam/security-credentials/");
  EXPECT_EQ(requests[1].Header("x-aws-ec2-metadata-token"), FakeImds::kToken);
  EXPECT_EQ(requests[2].url, "/latest/meta-data/iam/security-credentials/my-role");
  EXPECT_EQ(requests[2].Header("x-aws-ec2-metadata-token"), FakeImds::kToken);

  // Fresh: kept, no new request, from any number of threads.
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      for (int j = 0; j < 20; ++j) {
        Result<AwsCredentials> again = chain->Get();
        if (!again.ok() || again->access_key_id != "ASIAIMDS") ++failures;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(imds.server().count(), 3u);
}

TEST(AwsCredentialsTest, InstanceMetadataRefreshesCredentialsAboutToExpire) {
  FakeImds imds("my-role", std::chrono::minutes(2));  // less than the 5-minute margin
  ASSERT_TRUE(imds.server().ok());
  TempDir home;
  std::shared_ptr<AwsCredentialProvider> chain;
  Result<AwsCredentials> got = GetFromChain(ImdsEnv(home, imds.server()), "default", &chain);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(imds.server().count(), 3u);
  got = chain->Get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->access_key_id, "ASIAIMDS");
  EXPECT_EQ(imds.server().count(), 6u);
}

TEST(AwsCredentialsTest, InstanceWithoutRoleIsNotFoundAndKept) {
  FakeImds imds("", std::chrono::hours(6));
  ASSERT_TRUE(imds.server().ok());
  TempDir home;
  std::shared_ptr<AwsCredentialProvider> chain;
  Result<AwsCredentials> got = GetFromChain(ImdsEnv(home, imds.server()), "default", &chain);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(got.status().message(), HasSubstr("no IAM role"));
  EXPECT_EQ(imds.server().count(), 2u);
  EXPECT_EQ(chain->Get().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(imds.server().count(), 2u);
}

TEST(AwsCredentialsTest, NoInstanceMetadataHereIsNotFoundAndKept) {
  // Something that is not an instance metadata service.
  FakeServer server([](const SeenRequest&) -> Reply { return {404, "nothing here"}; });
  ASSERT_TRUE(server.ok());
  TempDir home;
  std::shared_ptr<AwsCredentialProvider> chain;
  Result<AwsCredentials> got = GetFromChain(ImdsEnv(home, server), "default", &chain);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(got.status().message(), HasSubstr("not an instance metadata service"));
  EXPECT_EQ(server.count(), 1u);
  EXPECT_EQ(chain->Get().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(server.count(), 1u);

  // Nothing listening at all (a port just freed).
  std::string closed_url;
  {
    FakeServer gone([](const SeenRequest&) -> Reply { return {200, ""}; });
    ASSERT_TRUE(gone.ok());
    closed_url = gone.url();
  }
  got = GetFromChain({{"HOME", home.path()}, {"AWS_EC2_METADATA_SERVICE_ENDPOINT", closed_url}});
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(got.status().message(), HasSubstr("no answer"));
}

// A fake STS: AssumeRoleWithWebIdentity for one role and token.
Reply StsAnswer(const SeenRequest& request) {
  const bool good =
      request.method == "POST" && request.url == "/" &&
      request.body.find("Action=AssumeRoleWithWebIdentity") != std::string::npos &&
      request.body.find("Version=2011-06-15") != std::string::npos &&
      request.body.find("RoleArn=arn%3Aaws%3Aiam%3A%3A123456789012%3Arole%2Ftrainer") !=
          std::string::npos &&
      request.body.find("RoleSessionName=job-7") != std::string::npos &&
      request.body.find("WebIdentityToken=eyJ.payload.sig") != std::string::npos;
  if (!good) {
    return {403,
            "<ErrorResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\"><Error>"
            "<Type>Sender</Type><Code>AccessDenied</Code><Message>Not authorized to perform "
            "sts:AssumeRoleWithWebIdentity</Message></Error><RequestId>r-1</RequestId>"
            "</ErrorResponse>"};
  }
  return {
      200,
      "<AssumeRoleWithWebIdentityResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\">\n"
      "  <AssumeRoleWithWebIdentityResult>\n"
      "    <SubjectFromWebIdentityToken>system:serviceaccount:ns:sa</SubjectFromWebIdentityToken>\n"
      "    <Credentials>\n"
      "      <SessionToken>sts-session/token+=</SessionToken>\n"
      "      <SecretAccessKey>sts-secret</SecretAccessKey>\n"
      "      <Expiration>" +
          IsoIn(std::chrono::hours(1)) +
          "</Expiration>\n"
          "      <AccessKeyId>ASIASTS</AccessKeyId>\n"
          "    </Credentials>\n"
          "  </AssumeRoleWithWebIdentityResult>\n"
          "</AssumeRoleWithWebIdentityResponse>\n"};
}

TEST(AwsCredentialsTest, WebIdentityThroughSts) {
  FakeServer server(&StsAnswer);
  ASSERT_TRUE(server.ok());
  TempDir home;
  std::map<std::string, std::string> env = BaseEnv(home);
  env["AWS_WEB_IDENTITY_TOKEN_FILE"] = home.Write("token", "eyJ.payload.sig\n");
  env["AWS_ROLE_ARN"] = "arn:aws:iam::123456789012:role/trainer";
  env["AWS_ROLE_SESSION_NAME"] = "job-7";
  env["AWS_ENDPOINT_URL_STS"] = server.url();

  std::shared_ptr<AwsCredentialProvider> chain;
  Result<AwsCredentials> got = GetFromChain(env, "default", &chain);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->access_key_id, "ASIASTS");
  EXPECT_EQ(got->secret_access_key, "sts-secret");
  EXPECT_EQ(got->session_token, "sts-session/token+=");
  EXPECT_THAT(chain->Describe(), HasSubstr("web identity"));
  EXPECT_THAT(chain->Describe(), HasSubstr("arn:aws:iam::123456789012:role/trainer"));
  ASSERT_EQ(server.count(), 1u);
  EXPECT_THAT(server.requests()[0].Header("content-type"),
              HasSubstr("application/x-www-form-urlencoded"));
  EXPECT_EQ(server.requests()[0].Header("authorization"), "");  // unsigned
  got = chain->Get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(server.count(), 1u);

  // A token STS refuses: PermissionDenied with STS's code and message.
  home.Write("token", "some.other.token");
  got = GetFromChain(env);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(got.status().message(), HasSubstr("web identity"));
  EXPECT_THAT(got.status().message(), HasSubstr("AccessDenied: Not authorized"));

  // A token file that is not there.
  env["AWS_WEB_IDENTITY_TOKEN_FILE"] = home.path() + "/missing-token";
  got = GetFromChain(env);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(got.status().message(), HasSubstr("missing-token"));

  // A token file without a role.
  env.erase("AWS_ROLE_ARN");
  got = GetFromChain(env);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AwsCredentialsTest, WebIdentityFromTheConfigFile) {
  FakeServer server(&StsAnswer);
  ASSERT_TRUE(server.ok());
  TempDir home;
  home.Write("token", "eyJ.payload.sig");
  home.Write(".aws/config",
             "[profile ci]\n"
             "role_arn = arn:aws:iam::123456789012:role/trainer\n"
             "web_identity_token_file = ~/token\n"
             "role_session_name = job-7\n");
  std::map<std::string, std::string> env = BaseEnv(home);
  env["AWS_ENDPOINT_URL_STS"] = server.url();
  Result<AwsCredentials> got = GetFromChain(env, "ci");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->access_key_id, "ASIASTS");
  EXPECT_EQ(server.count(), 1u);
}

}  // namespace
}  // namespace tensorstash
