// Where the S3 store's settings and credentials come from: explicit options first, then the
// places the AWS command-line tools and SDKs look (environment variables, the shared config file
// ~/.aws/config, the shared credentials file ~/.aws/credentials, web identity through STS, the
// container credentials endpoint, EC2 instance metadata), so that a machine set up for
// `aws s3` works unchanged.
//
//   TS_ASSIGN_OR_RETURN(S3Settings settings, ResolveS3Settings({}, ProcessEnv()));
//   TS_ASSIGN_OR_RETURN(auto credentials,
//                       DefaultCredentialChain(settings.profile, settings.region, ProcessEnv()));
//   TS_ASSIGN_OR_RETURN(AwsCredentials now, credentials->Get());  // empty key: anonymous
//
// The environment is read through an EnvLookup, so that tests give a fake one; a variable set to
// "" counts as unset. Nothing here throws.
//
// Thread-safety: the functions are safe to call from any thread (ProcessEnv's lookup reads the
// process environment with getenv, which must not race with setenv); AwsCredentialProvider::Get
// and Describe may be called from several threads at once.
#ifndef TENSORSTASH_KVSTORE_S3_AWS_CONFIG_H_
#define TENSORSTASH_KVSTORE_S3_AWS_CONFIG_H_

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "tensorstash/kvstore/object_store/env_lookup.h"
#include "tensorstash/kvstore/s3/sigv4.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// EnvLookup, ProcessEnv and FixedEnv are the kit's (object_store/env_lookup.h).

// ---------------------------------------------------------------------------------------------
// The AWS config and credentials files: INI as the AWS tools read it.
//
//   [profile dev]            ; a section (comments start with # or ;, on their own line or after
//   region = eu-west-1       # whitespace at the end of one)
//   s3 =                     a key with an empty value opens a nested block: the lines indented
//     addressing_style = path    deeper than it are its sub-keys
//
// Keys are lowercased; values and section names are trimmed (runs of whitespace inside a section
// name become one space: "[profile   dev]" is "profile dev"). A section or key given twice: the
// last value wins.

struct AwsIniSection {
  std::map<std::string, std::string> values;  // key -> value ("" for the key of a nested block)
  std::map<std::string, std::map<std::string, std::string>> nested;  // "s3" -> {sub-key: value}

  // The value of `key` (nullptr when absent), or of `sub_key` in the nested block `key`.
  const std::string* Find(const std::string& key) const;
  const std::string* FindNested(const std::string& key, const std::string& sub_key) const;
};

struct AwsIniFile {
  std::map<std::string, AwsIniSection> sections;  // by name: "default", "profile dev"

  const AwsIniSection* Find(const std::string& name) const;  // nullptr when absent
};

// Parses the text of a config or credentials file. InvalidArgument "<source>:<line>: ..." for a
// line that is neither a section, a "key = value", a comment nor blank; for a key before the
// first section; for an unterminated or empty section name.
Result<AwsIniFile> ParseAwsIni(std::string_view text, std::string_view source);

// Reads and parses the file at `path`: nullopt when it does not exist; PermissionDenied (or
// another errno status) when it cannot be read; ParseAwsIni's errors naming `path`.
Result<std::optional<AwsIniFile>> ReadAwsIniFile(const std::string& path);

// The section of `profile` in a config file: "[profile NAME]", and for "default" "[default]"
// (else "[profile default]"). nullptr when absent. (The credentials file names its sections
// after the profile alone: use AwsIniFile::Find.)
const AwsIniSection* FindConfigProfile(const AwsIniFile& config, const std::string& profile);

// The shared config file: AWS_CONFIG_FILE (a leading "~/" is $HOME), else $HOME/.aws/config;
// "" when neither is set.
std::string AwsConfigFilePath(const EnvLookup& env);
// The shared credentials file: AWS_SHARED_CREDENTIALS_FILE, else $HOME/.aws/credentials; "" when
// neither is set.
std::string AwsCredentialsFilePath(const EnvLookup& env);

// ---------------------------------------------------------------------------------------------
// Settings of the S3 store.

struct S3Settings {
  std::string endpoint;     // "http://127.0.0.1:8333" or "https://s3.us-west-2.amazonaws.com"
  std::string region;       // default "us-east-1"
  bool path_style = false;  // true: http://endpoint/bucket/key; false: http://bucket.endpoint/key
  std::string profile;      // "default" unless AWS_PROFILE
};

// Explicit options; each one set wins over every other source.
struct S3SettingsOverrides {
  std::optional<std::string> endpoint, region, profile;
  std::optional<bool> path_style;
};

// Resolves the settings, each from the first source that has it:
//   profile:    override; AWS_PROFILE; "default".
//   region:     override; AWS_REGION; AWS_DEFAULT_REGION; "region" of the profile in the config
//               file; "us-east-1".
//   endpoint:   override; AWS_ENDPOINT_URL_S3; AWS_ENDPOINT_URL; in the config file the
//               profile's services section ("services = NAME" -> "[services NAME]" with
//               "s3 =\n  endpoint_url = ...") then the profile's "endpoint_url"; else
//               "https://s3.<region>.amazonaws.com" (".amazonaws.com.cn" for cn- regions).
//               AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true skips the environment and the file.
//   path_style: override; TENSORSTASH_S3_ADDRESSING_STYLE; the profile's
//               "s3 =\n  addressing_style = path|virtual|auto"; else virtual-hosted for an AWS
//               endpoint (*.amazonaws.com[.cn]) and path style for any other.
// The config file is read only when a setting is left to it. The endpoint comes back as
// "scheme://host[:port]" with the scheme lowercased and no trailing '/'.
// InvalidArgument naming the source (the option, the variable, or the file and profile) for an
// endpoint that is not http(s)://host[:port] (a path, query, user or bad port), an addressing
// style other than path, virtual or auto, an empty region or profile, or a region that cannot go
// into the default endpoint's host name; the errors of ReadAwsIniFile for the config file.
Result<S3Settings> ResolveS3Settings(const S3SettingsOverrides& overrides, const EnvLookup& env);

// `url` checked and normalised as an endpoint: "scheme://host[:port]" (scheme lowercased,
// trailing '/' dropped). InvalidArgument starting with `source` otherwise.
Result<std::string> NormalizeEndpoint(std::string_view url, std::string_view source);

// Parses an ISO 8601 time as AWS sends it: "2026-11-24T18:00:00Z", with optional fractional
// seconds and a "Z", "+HH:MM" or "+HHMM" offset. InvalidArgument for anything else.
Result<std::chrono::system_clock::time_point> ParseAwsTimestamp(std::string_view text);

// ---------------------------------------------------------------------------------------------
// Credentials.

class AwsCredentialProvider {
 public:
  virtual ~AwsCredentialProvider() = default;
  // Credentials valid for at least a few more minutes (temporary ones are refreshed when less
  // than 5 minutes remain, and kept between refreshes). An empty access_key_id means anonymous:
  // send requests unsigned. Errors: see DefaultCredentialChain. Thread-safe.
  virtual Result<AwsCredentials> Get() = 0;
  // Where they come from, e.g. "environment", "shared credentials file
  // /root/.aws/credentials [profile p]", "instance metadata http://169.254.169.254 (role r)".
  virtual std::string Describe() const = 0;
};

// The standard chain for `profile`; the first source that has credentials wins, decided on the
// first Get() that finds any and then kept:
//   a. environment: AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN);
//   b. the shared credentials file's section [profile] (aws_access_key_id,
//      aws_secret_access_key, aws_session_token), then the same keys in the config file's
//      profile section;
//   c. web identity: AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN (+ AWS_ROLE_SESSION_NAME), or
//      web_identity_token_file + role_arn (+ role_session_name) of the config file's profile:
//      AssumeRoleWithWebIdentity at STS (AWS_ENDPOINT_URL_STS, else
//      https://sts.<region>.amazonaws.com), the token file read again at each refresh;
//   d. container endpoint: http://169.254.170.2 + AWS_CONTAINER_CREDENTIALS_RELATIVE_URI, else
//      AWS_CONTAINER_CREDENTIALS_FULL_URI (over http only to a loopback or the ECS/EKS
//      addresses), with the Authorization header from AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE's
//      contents, else AWS_CONTAINER_AUTHORIZATION_TOKEN;
//   e. EC2 instance metadata (IMDSv2: a session token first), unless
//      AWS_EC2_METADATA_DISABLED=true, at AWS_EC2_METADATA_SERVICE_ENDPOINT or
//      http://169.254.169.254, with 1 s to connect and 2 s per request.
// The environment is read once, here. Get() fails with:
//   NotFound when no source has credentials: the message lists each source tried and why it had
//     none, and says how to give credentials. This outcome is kept (the chain is not probed
//     again, so that a machine without instance metadata does not wait at every request);
//   InvalidArgument for a source given half (an access key without its secret) or a malformed
//     file or variable, naming it;
//   PermissionDenied when a source refuses (STS, the container endpoint or the instance
//     metadata service answering 4xx; a token file that cannot be read), naming it;
//   Unavailable when a source exists but does not answer or answers 5xx or nonsense.
// Those errors are not kept: the next Get() tries again. When a refresh fails while the kept
// credentials have more than a minute left, they are returned.
// InvalidArgument here for an empty profile or region.
Result<std::shared_ptr<AwsCredentialProvider>> DefaultCredentialChain(const std::string& profile,
                                                                      const std::string& region,
                                                                      const EnvLookup& env);

// Fixed credentials (explicit options, tests). Get() returns them; InvalidArgument when an access
// key id comes without a secret access key. An empty access key id is anonymous.
std::shared_ptr<AwsCredentialProvider> StaticCredentials(AwsCredentials credentials);

// Anonymous: Get() returns empty credentials, and the S3 store sends requests unsigned.
std::shared_ptr<AwsCredentialProvider> AnonymousCredentials();

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_S3_AWS_CONFIG_H_
