#include "tensorstash/kvstore/s3/aws_config.h"

#include <arpa/inet.h>
#include <errno.h>
#include <expat.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "tensorstash/kvstore/http/http_client.h"
#include "tensorstash/kvstore/object_store/credentials.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

using Clock = std::chrono::system_clock;

// Temporary credentials are refreshed when less than this is left of them...
constexpr auto kRefreshMargin = std::chrono::minutes(5);
// ...and kept when the refresh fails while more than this is left.
constexpr auto kRefreshGrace = std::chrono::minutes(1);

constexpr char kDefaultImdsEndpoint[] = "http://169.254.169.254";
constexpr char kEcsEndpoint[] = "http://169.254.170.2";

bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\f' || c == '\v';
}

std::string_view Trim(std::string_view text) {
  while (!text.empty() && IsSpace(text.front())) text.remove_prefix(1);
  while (!text.empty() && IsSpace(text.back())) text.remove_suffix(1);
  return text;
}

std::string ToLower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// The first 200 bytes of an answer's body, for a message.
std::string Excerpt(std::string_view body) {
  body = Trim(body);
  if (body.empty()) return "(empty body)";
  if (body.size() <= 200) return StrCat("\"", EscapeBytes(body), "\"");
  return StrCat("\"", EscapeBytes(body.substr(0, 200)), "...\"");
}

// The variable's value; nullopt when unset or empty (or when there is no lookup).
std::optional<std::string> GetEnv(const EnvLookup& env, const std::string& name) {
  if (!env) return std::nullopt;
  std::optional<std::string> value = env(name);
  if (!value.has_value() || value->empty()) return std::nullopt;
  return value;
}

bool EnvIsTrue(const EnvLookup& env, const std::string& name) {
  const std::optional<std::string> value = GetEnv(env, name);
  return value.has_value() && ToLower(Trim(*value)) == "true";
}

// A leading "~" or "~/" of `path` replaced by $HOME.
std::string ExpandHome(const std::string& path, const EnvLookup& env) {
  if (path != "~" && !path.starts_with("~/")) return path;
  const std::optional<std::string> home = GetEnv(env, "HOME");
  if (!home.has_value()) return path;
  return StrCat(*home, path.substr(1));
}

std::string HomeFile(const EnvLookup& env, std::string_view relative) {
  std::optional<std::string> home = GetEnv(env, "HOME");
  if (!home.has_value()) return "";
  while (home->size() > 1 && home->back() == '/') home->pop_back();
  return StrCat(*home == "/" ? "" : *home, "/", relative);
}

// The contents of the file at `path`: nullopt when it does not exist; errno's status when it
// cannot be read; InvalidArgument when it is larger than `max_size`.
Result<std::optional<std::string>> ReadSmallFile(const std::string& path, size_t max_size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT || errno == ENOTDIR) return std::optional<std::string>();
    return ErrnoToStatus(errno, "opening", path);
  }
  std::string contents;
  char buffer[16384];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd);
      return ErrnoToStatus(error, "reading", path);
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
    if (contents.size() > max_size) {
      ::close(fd);
      return InvalidArgumentError(
          StrCat("'", path, "' is larger than ", max_size, " bytes: not a file of settings"));
    }
  }
  ::close(fd);
  return std::optional<std::string>(std::move(contents));
}

// Drops a comment that starts with '#' or ';' after whitespace ("value  # note" -> "value").
std::string_view StripInlineComment(std::string_view value) {
  for (size_t i = 1; i < value.size(); ++i) {
    if ((value[i] == '#' || value[i] == ';') && IsSpace(value[i - 1])) {
      return Trim(value.substr(0, i));
    }
  }
  return value;
}

// Runs of whitespace as one space ("profile   dev" -> "profile dev").
std::string CollapseSpaces(std::string_view text) {
  std::string out;
  bool space = false;
  for (const char c : text) {
    if (IsSpace(c)) {
      space = true;
      continue;
    }
    if (space && !out.empty()) out.push_back(' ');
    space = false;
    out.push_back(c);
  }
  return out;
}

bool IsAwsHost(std::string_view endpoint) {
  // endpoint is normalised: "scheme://host[:port]"
  std::string_view host = endpoint.substr(endpoint.find("://") + 3);
  if (!host.starts_with("[")) host = host.substr(0, host.find(':'));
  const std::string lower = ToLower(host);
  return lower.ends_with(".amazonaws.com") || lower.ends_with(".amazonaws.com.cn");
}

std::string AwsDomainFor(std::string_view region) {
  return region.starts_with("cn-") ? "amazonaws.com.cn" : "amazonaws.com";
}

// Whether `region` may go into a host name ("s3.<region>.amazonaws.com").
bool IsHostSafeRegion(std::string_view region) {
  if (region.empty() || region.front() == '-' || region.back() == '-') return false;
  return std::all_of(region.begin(), region.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
  });
}

Status CheckRegion(std::string_view region, std::string_view source) {
  if (region.empty()) return InvalidArgumentError(StrCat(source, ": the region is empty"));
  for (const char c : region) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte <= 0x20 || byte >= 0x7f || c == '/') {
      return InvalidArgumentError(StrCat(source, ": the region '", EscapeBytes(region),
                                         "' has a space, a '/' or a byte outside printable ASCII"));
    }
  }
  return OkStatus();
}

// ---------------------------------------------------------------------------------------------
// The config file's view for one profile, read on first need.

class ProfileConfig {
 public:
  ProfileConfig(const EnvLookup& env, std::string profile)
      : path_(AwsConfigFilePath(env)), profile_name_(std::move(profile)) {}

  // Reads the file once; OK with no profile when there is no file.
  Status Load() {
    if (loaded_) return OkStatus();
    loaded_ = true;
    if (path_.empty()) return OkStatus();
    TS_ASSIGN_OR_RETURN(file_, ReadAwsIniFile(path_));
    if (!file_.has_value()) return OkStatus();
    profile_ = FindConfigProfile(*file_, profile_name_);
    if (profile_ != nullptr) {
      if (const std::string* services = profile_->Find("services"); services != nullptr) {
        services_name_ = *services;
        services_ = file_->Find(StrCat("services ", *services));
      }
    }
    return OkStatus();
  }

  const AwsIniSection* profile() const { return profile_; }
  const AwsIniSection* services() const { return services_; }
  // "profile 'p' in /root/.aws/config" (for messages).
  std::string Where() const { return StrCat("profile '", profile_name_, "' in ", path_); }
  std::string WhereServices() const {
    return StrCat("[services ", services_name_, "] (of ", Where(), ")");
  }

 private:
  std::string path_;
  std::string profile_name_;
  bool loaded_ = false;
  std::optional<AwsIniFile> file_;
  const AwsIniSection* profile_ = nullptr;
  const AwsIniSection* services_ = nullptr;
  std::string services_name_;
};

// "path" -> true, "virtual" -> false, "auto" -> nullopt (the default decides).
Result<std::optional<bool>> ParseAddressingStyle(std::string_view value, std::string_view source) {
  const std::string style = ToLower(Trim(value));
  if (style == "path") return std::optional<bool>(true);
  if (style == "virtual") return std::optional<bool>(false);
  if (style == "auto") return std::optional<bool>();
  return InvalidArgumentError(StrCat(source, ": unknown addressing style '", EscapeBytes(value),
                                     "' (path, virtual or auto)"));
}

// ---------------------------------------------------------------------------------------------
// Parsing the answers of credential services.

// Credentials and when they expire (none: never), as the kit's credential cache keeps them.
using TimedCredentials = ExpiringCredential<AwsCredentials>;

// The text of each element of an XML document, by the path of local names from the root
// ("AssumeRoleWithWebIdentityResponse/AssumeRoleWithWebIdentityResult/Credentials/AccessKeyId").
// nullopt for malformed XML, a document type declaration or nesting deeper than 32.
class XmlLeaves {
 public:
  static std::optional<std::map<std::string, std::string>> Parse(std::string_view xml) {
    if (xml.size() > static_cast<size_t>(INT_MAX)) return std::nullopt;
    XML_Parser parser = XML_ParserCreate(nullptr);
    if (parser == nullptr) return std::nullopt;
    XmlLeaves state;
    state.parser_ = parser;
    XML_SetUserData(parser, &state);
    XML_SetElementHandler(parser, &XmlLeaves::OnStart, &XmlLeaves::OnEnd);
    XML_SetCharacterDataHandler(parser, &XmlLeaves::OnText);
    XML_SetStartDoctypeDeclHandler(parser, &XmlLeaves::OnDoctype);
    const bool ok =
        XML_Parse(parser, xml.data(), static_cast<int>(xml.size()), XML_TRUE) == XML_STATUS_OK &&
        !state.refused_;
    XML_ParserFree(parser);
    if (!ok) return std::nullopt;
    return std::move(state.leaves_);
  }

 private:
  static void OnStart(void* user, const XML_Char* name, const XML_Char** /*attributes*/) {
    auto& self = *static_cast<XmlLeaves*>(user);
    if (self.path_.size() >= 32) {
      self.refused_ = true;
      XML_StopParser(self.parser_, XML_FALSE);
      return;
    }
    std::string_view local(name);
    if (const size_t colon = local.rfind(':'); colon != std::string_view::npos) {
      local.remove_prefix(colon + 1);
    }
    self.path_.emplace_back(local);
    self.text_.clear();
  }
  static void OnEnd(void* user, const XML_Char* /*name*/) {
    auto& self = *static_cast<XmlLeaves*>(user);
    self.leaves_[StrJoin(self.path_, "/")] = self.text_;
    self.text_.clear();
    self.path_.pop_back();
  }
  static void OnText(void* user, const XML_Char* text, int length) {
    static_cast<XmlLeaves*>(user)->text_.append(text, static_cast<size_t>(length));
  }
  static void OnDoctype(void* user, const XML_Char*, const XML_Char*, const XML_Char*, int) {
    auto& self = *static_cast<XmlLeaves*>(user);
    self.refused_ = true;
    XML_StopParser(self.parser_, XML_FALSE);
  }

  XML_Parser parser_ = nullptr;
  std::vector<std::string> path_;
  std::string text_;
  std::map<std::string, std::string> leaves_;
  bool refused_ = false;
};

// The text of the element whose path ends with `suffix` ("Credentials/AccessKeyId"), or "".
std::string FindLeaf(const std::map<std::string, std::string>& leaves, std::string_view suffix) {
  for (const auto& [path, text] : leaves) {
    if (path == suffix ||
        (path.ends_with(suffix) && path[path.size() - suffix.size() - 1] == '/')) {
      return std::string(Trim(text));
    }
  }
  return "";
}

// The {AccessKeyId, SecretAccessKey, Token, Expiration} answer of the container endpoint and the
// instance metadata service. Unavailable naming `what` for anything else.
Result<TimedCredentials> CredentialsFromJson(std::string_view body, std::string_view what) {
  const nlohmann::json json = nlohmann::json::parse(body.begin(), body.end(), nullptr,
                                                    /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return UnavailableError(StrCat(what, ": the answer is not a JSON object: ", Excerpt(body)));
  }
  auto field = [&json](const char* name) -> std::string {
    const auto it = json.find(name);
    if (it == json.end() || !it->is_string()) return "";
    return it->get<std::string>();
  };
  if (const std::string code = field("Code"); !code.empty() && code != "Success") {
    return UnavailableError(
        StrCat(what, ": the answer says Code '", code, "': ", Excerpt(field("Message"))));
  }
  TimedCredentials out;
  out.value.access_key_id = field("AccessKeyId");
  out.value.secret_access_key = field("SecretAccessKey");
  out.value.session_token = field("Token");
  if (out.value.access_key_id.empty() || out.value.secret_access_key.empty()) {
    return UnavailableError(StrCat(what, ": the answer has no AccessKeyId or SecretAccessKey"));
  }
  if (const std::string expiration = field("Expiration"); !expiration.empty()) {
    Result<Clock::time_point> when = ParseAwsTimestamp(expiration);
    if (!when.ok())
      return UnavailableError(StrCat(what, ": bad Expiration: ", when.status().message()));
    out.expires = *when;
  }
  return out;
}

// The status of a non-2xx answer from a credential service: 4xx PermissionDenied (the service
// refuses), anything else Unavailable.
Status ServiceError(const HttpResponse& response, std::string_view what, std::string_view detail) {
  std::string message = StrCat(what, ": HTTP ", static_cast<int64_t>(response.status), ": ",
                               detail.empty() ? Excerpt(response.body) : std::string(detail));
  if (response.status >= 400 && response.status < 500) return PermissionDeniedError(message);
  return UnavailableError(message);
}

// ---------------------------------------------------------------------------------------------
// The sources of the chain.

// One place credentials may come from.
class CredentialSource {
 public:
  virtual ~CredentialSource() = default;
  // Fresh credentials. NotFound when this source has none here, its message saying why (the
  // chain goes on to the next); any other error when the source exists but failed.
  virtual Result<TimedCredentials> Fetch() = 0;
  virtual std::string Describe() const = 0;
};

class EnvSource final : public CredentialSource {
 public:
  explicit EnvSource(EnvLookup env) : env_(std::move(env)) {}

  Result<TimedCredentials> Fetch() override {
    const std::optional<std::string> id = GetEnv(env_, "AWS_ACCESS_KEY_ID");
    const std::optional<std::string> secret = GetEnv(env_, "AWS_SECRET_ACCESS_KEY");
    if (!id.has_value() && !secret.has_value()) {
      return NotFoundError("environment: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not set");
    }
    if (!id.has_value() || !secret.has_value()) {
      return InvalidArgumentError(
          StrCat("environment: ", id.has_value() ? "AWS_ACCESS_KEY_ID" : "AWS_SECRET_ACCESS_KEY",
                 " is set but ", id.has_value() ? "AWS_SECRET_ACCESS_KEY" : "AWS_ACCESS_KEY_ID",
                 " is not (both are needed)"));
    }
    TimedCredentials out;
    out.value = {*id, *secret, GetEnv(env_, "AWS_SESSION_TOKEN").value_or("")};
    return out;
  }
  std::string Describe() const override { return "environment"; }

 private:
  EnvLookup env_;
};

// Why a profile without keys has none, when it uses a way of getting them this chain lacks.
std::string UnsupportedProfileNote(const AwsIniSection& section, const std::string& profile) {
  std::string uses;
  if (section.Find("credential_process") != nullptr) {
    uses = "credential_process";
  } else if (section.Find("role_arn") != nullptr &&
             section.Find("web_identity_token_file") == nullptr) {
    uses = "role_arn (assuming a role from another profile)";
  } else if (section.Find("sso_session") != nullptr || section.Find("sso_start_url") != nullptr) {
    uses = "IAM Identity Center (sso_*)";
  } else if (section.Find("login_session") != nullptr) {
    uses = "login_session";
  }
  if (uses.empty()) return "";
  return StrCat(" (it uses ", uses,
                ", which tensorstash does not support: export its credentials with `aws configure "
                "export-credentials --profile ",
                profile, " --format env`)");
}

// The keys of a profile in the shared credentials file or the config file.
class ProfileFileSource final : public CredentialSource {
 public:
  enum class Kind { kCredentials, kConfig };
  ProfileFileSource(Kind kind, std::string path, std::string profile)
      : kind_(kind), path_(std::move(path)), profile_(std::move(profile)) {}

  Result<TimedCredentials> Fetch() override {
    const std::string label =
        kind_ == Kind::kCredentials ? "shared credentials file" : "config file";
    if (path_.empty()) {
      return NotFoundError(
          StrCat(label, ": HOME and ",
                 kind_ == Kind::kCredentials ? "AWS_SHARED_CREDENTIALS_FILE" : "AWS_CONFIG_FILE",
                 " are not set"));
    }
    TS_ASSIGN_OR_RETURN(std::optional<AwsIniFile> file, ReadAwsIniFile(path_));
    if (!file.has_value()) return NotFoundError(StrCat(label, " ", path_, " does not exist"));
    const AwsIniSection* section =
        kind_ == Kind::kCredentials ? file->Find(profile_) : FindConfigProfile(*file, profile_);
    if (section == nullptr) {
      return NotFoundError(StrCat(label, " ", path_, " has no profile '", profile_, "'"));
    }
    const std::string* id = section->Find("aws_access_key_id");
    const std::string* secret = section->Find("aws_secret_access_key");
    const bool has_id = id != nullptr && !id->empty();
    const bool has_secret = secret != nullptr && !secret->empty();
    if (!has_id && !has_secret) {
      return NotFoundError(StrCat(label, " ", path_, ": profile '", profile_,
                                  "' has no aws_access_key_id",
                                  UnsupportedProfileNote(*section, profile_)));
    }
    if (!has_id || !has_secret) {
      return InvalidArgumentError(StrCat(
          Describe(), ": ", has_id ? "aws_access_key_id" : "aws_secret_access_key", " is set but ",
          has_id ? "aws_secret_access_key" : "aws_access_key_id", " is not (both are needed)"));
    }
    TimedCredentials out;
    out.value.access_key_id = *id;
    out.value.secret_access_key = *secret;
    if (const std::string* token = section->Find("aws_session_token"); token != nullptr) {
      out.value.session_token = *token;
    }
    return out;
  }

  std::string Describe() const override {
    return StrCat(kind_ == Kind::kCredentials ? "shared credentials file " : "config file ", path_,
                  " [profile ", profile_, "]");
  }

 private:
  Kind kind_;
  std::string path_;
  std::string profile_;
};

// AssumeRoleWithWebIdentity at STS with a token from a file (EKS IRSA, GitHub OIDC, ...).
class WebIdentitySource final : public CredentialSource {
 public:
  WebIdentitySource(EnvLookup env, std::string profile, std::string region)
      : env_(std::move(env)), profile_(std::move(profile)), region_(std::move(region)) {}

  Result<TimedCredentials> Fetch() override {
    std::optional<std::string> token_file = GetEnv(env_, "AWS_WEB_IDENTITY_TOKEN_FILE");
    std::optional<std::string> role = GetEnv(env_, "AWS_ROLE_ARN");
    std::optional<std::string> session = GetEnv(env_, "AWS_ROLE_SESSION_NAME");
    std::string origin = "environment";
    if (!token_file.has_value() && !role.has_value()) {
      ProfileConfig config(env_, profile_);
      TS_RETURN_IF_ERROR(config.Load());
      const AwsIniSection* section = config.profile();
      const std::string* file_value =
          section != nullptr ? section->Find("web_identity_token_file") : nullptr;
      if (file_value == nullptr || file_value->empty()) {
        return NotFoundError(
            "web identity: AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN are not set");
      }
      origin = config.Where();
      token_file = ExpandHome(*file_value, env_);
      if (const std::string* value = section->Find("role_arn"); value && !value->empty()) {
        role = *value;
      }
      if (const std::string* value = section->Find("role_session_name"); value && !value->empty()) {
        session = *value;
      }
    }
    if (!token_file.has_value()) {
      return NotFoundError(
          StrCat("web identity: AWS_ROLE_ARN is set but AWS_WEB_IDENTITY_TOKEN_FILE is not"));
    }
    if (!role.has_value()) {
      return InvalidArgumentError(StrCat("web identity (", origin,
                                         "): a web identity token file is set but no role ARN "
                                         "(AWS_ROLE_ARN or role_arn)"));
    }
    role_ = *role;
    TS_ASSIGN_OR_RETURN(endpoint_, StsEndpoint());
    const std::string what =
        StrCat("web identity: AssumeRoleWithWebIdentity at ", endpoint_, " for role ", role_);

    Result<std::optional<std::string>> read = ReadSmallFile(*token_file, 1 << 20);
    if (!read.ok() || !read->has_value()) {
      return PermissionDeniedError(
          StrCat(what, ": cannot read the token file '", *token_file,
                 "': ", read.ok() ? "it does not exist" : MessageOf(read.status())));
    }
    const std::string token(Trim(**read));
    if (token.empty()) {
      return PermissionDeniedError(StrCat(what, ": the token file '", *token_file, "' is empty"));
    }
    const std::string session_name = session.value_or(StrCat(
        "tensorstash-",
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
            .count()));
    const std::string body = StrCat(
        "Action=AssumeRoleWithWebIdentity&Version=2011-06-15&RoleArn=", UrlEscape(role_),
        "&RoleSessionName=", UrlEscape(session_name), "&WebIdentityToken=", UrlEscape(token));
    HttpRequest request;
    request.method = "POST";
    request.url = StrCat(endpoint_, "/");
    request.headers = {{"Content-Type", "application/x-www-form-urlencoded; charset=utf-8"},
                       {"Accept", "application/xml"}};
    request.body = body;
    if (client_ == nullptr) {
      HttpClientOptions options;
      options.connect_timeout = std::chrono::seconds(5);
      options.total_timeout = std::chrono::seconds(30);
      client_ = std::make_unique<HttpClient>(options);
    }
    TS_ASSIGN_OR_RETURN(HttpResponse response, client_->Perform(request, what));
    const std::optional<std::map<std::string, std::string>> leaves =
        XmlLeaves::Parse(response.body);
    if (response.status < 200 || response.status >= 300) {
      std::string detail;
      if (leaves.has_value()) {
        const std::string code = FindLeaf(*leaves, "Error/Code");
        const std::string message = FindLeaf(*leaves, "Error/Message");
        if (!code.empty()) detail = StrCat(code, ": ", message);
      }
      return ServiceError(response, what, detail);
    }
    if (!leaves.has_value()) {
      return UnavailableError(StrCat(what, ": the answer is not XML: ", Excerpt(response.body)));
    }
    TimedCredentials out;
    out.value.access_key_id = FindLeaf(*leaves, "Credentials/AccessKeyId");
    out.value.secret_access_key = FindLeaf(*leaves, "Credentials/SecretAccessKey");
    out.value.session_token = FindLeaf(*leaves, "Credentials/SessionToken");
    if (out.value.access_key_id.empty() || out.value.secret_access_key.empty()) {
      return UnavailableError(
          StrCat(what, ": the answer has no <Credentials>: ", Excerpt(response.body)));
    }
    if (const std::string expiration = FindLeaf(*leaves, "Credentials/Expiration");
        !expiration.empty()) {
      Result<Clock::time_point> when = ParseAwsTimestamp(expiration);
      if (!when.ok()) {
        return UnavailableError(StrCat(what, ": bad Expiration: ", when.status().message()));
      }
      out.expires = *when;
    }
    return out;
  }

  std::string Describe() const override {
    return StrCat("web identity (role ", role_, " through STS ", endpoint_, ")");
  }

 private:
  Result<std::string> StsEndpoint() const {
    if (std::optional<std::string> url = GetEnv(env_, "AWS_ENDPOINT_URL_STS"); url.has_value()) {
      return NormalizeEndpoint(*url, "environment variable AWS_ENDPOINT_URL_STS");
    }
    if (!IsHostSafeRegion(region_)) {
      return InvalidArgumentError(
          StrCat("web identity: the region '", EscapeBytes(region_),
                 "' cannot name an STS endpoint; set AWS_ENDPOINT_URL_STS"));
    }
    return StrCat("https://sts.", region_, ".", AwsDomainFor(region_));
  }

  EnvLookup env_;
  std::string profile_;
  std::string region_;
  std::string role_;
  std::string endpoint_;
  std::unique_ptr<HttpClient> client_;
};

// Whether a container credentials URL over plain http goes to a host allowed for it: a loopback
// address or the ECS/EKS agents' link-local ones.
bool IsAllowedContainerHost(std::string_view url) {
  std::string_view rest = url.substr(url.find("://") + 3);
  rest = rest.substr(0, rest.find_first_of("/?#"));
  std::string host;
  if (rest.starts_with("[")) {
    host = ToLower(rest.substr(0, rest.find(']') + 1));
  } else {
    host = ToLower(rest.substr(0, rest.find(':')));
  }
  if (host == "localhost" || host == "[::1]" || host == "169.254.170.2" ||
      host == "169.254.170.23" || host == "[fd00:ec2::23]") {
    return true;
  }
  in_addr address{};
  return ::inet_pton(AF_INET, host.c_str(), &address) == 1 && (ntohl(address.s_addr) >> 24) == 127;
}

// The ECS task role / EKS pod identity endpoint.
class ContainerSource final : public CredentialSource {
 public:
  explicit ContainerSource(EnvLookup env) : env_(std::move(env)) {}

  Result<TimedCredentials> Fetch() override {
    if (std::optional<std::string> relative =
            GetEnv(env_, "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI");
        relative.has_value()) {
      url_ = StrCat(kEcsEndpoint, relative->starts_with("/") ? "" : "/", *relative);
    } else if (std::optional<std::string> full = GetEnv(env_, "AWS_CONTAINER_CREDENTIALS_FULL_URI");
               full.has_value()) {
      const std::string scheme = ToLower(full->substr(0, full->find("://")));
      if (full->find("://") == std::string::npos || (scheme != "http" && scheme != "https")) {
        return InvalidArgumentError(
            StrCat("container endpoint: AWS_CONTAINER_CREDENTIALS_FULL_URI '", EscapeBytes(*full),
                   "' is not an http:// or https:// URL"));
      }
      if (scheme == "http" && !IsAllowedContainerHost(*full)) {
        return InvalidArgumentError(
            StrCat("container endpoint: AWS_CONTAINER_CREDENTIALS_FULL_URI '", EscapeBytes(*full),
                   "' uses plain http to a host that is neither a loopback address nor the "
                   "ECS/EKS agent (169.254.170.2, 169.254.170.23); use https"));
      }
      url_ = *full;
    } else {
      return NotFoundError(
          "container endpoint: AWS_CONTAINER_CREDENTIALS_RELATIVE_URI and "
          "AWS_CONTAINER_CREDENTIALS_FULL_URI are not set");
    }
    const std::string what = StrCat("container endpoint ", url_);
    std::optional<std::string> authorization;
    if (std::optional<std::string> file = GetEnv(env_, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE");
        file.has_value()) {
      Result<std::optional<std::string>> read = ReadSmallFile(*file, 1 << 20);
      if (!read.ok() || !read->has_value()) {
        return PermissionDeniedError(
            StrCat(what, ": cannot read AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE '", *file,
                   "': ", read.ok() ? "it does not exist" : MessageOf(read.status())));
      }
      authorization = std::string(Trim(**read));
    } else {
      authorization = GetEnv(env_, "AWS_CONTAINER_AUTHORIZATION_TOKEN");
    }
    HttpRequest request;
    request.url = url_;
    if (authorization.has_value()) {
      if (authorization->find_first_of("\r\n") != std::string::npos) {
        return InvalidArgumentError(
            StrCat(what, ": the authorization token has a line break in it"));
      }
      request.headers.emplace_back("Authorization", *authorization);
    }
    if (client_ == nullptr) {
      HttpClientOptions options;
      options.connect_timeout = std::chrono::seconds(2);
      options.total_timeout = std::chrono::seconds(5);
      options.stall_timeout = std::chrono::seconds(5);
      client_ = std::make_unique<HttpClient>(options);
    }
    TS_ASSIGN_OR_RETURN(HttpResponse response, client_->Perform(request, what));
    if (response.status != 200) return ServiceError(response, what, "");
    return CredentialsFromJson(response.body, what);
  }

  std::string Describe() const override { return StrCat("container endpoint ", url_); }

 private:
  EnvLookup env_;
  std::string url_;
  std::unique_ptr<HttpClient> client_;
};

// EC2 instance metadata, IMDSv2 (a session token first, then the role and its credentials).
class ImdsSource final : public CredentialSource {
 public:
  explicit ImdsSource(EnvLookup env) : env_(std::move(env)) {}

  Result<TimedCredentials> Fetch() override {
    if (EnvIsTrue(env_, "AWS_EC2_METADATA_DISABLED")) {
      return NotFoundError("instance metadata: turned off by AWS_EC2_METADATA_DISABLED=true");
    }
    if (std::optional<std::string> url = GetEnv(env_, "AWS_EC2_METADATA_SERVICE_ENDPOINT");
        url.has_value()) {
      TS_ASSIGN_OR_RETURN(
          endpoint_,
          NormalizeEndpoint(*url, "environment variable AWS_EC2_METADATA_SERVICE_ENDPOINT"));
    } else {
      endpoint_ = kDefaultImdsEndpoint;
    }
    if (client_ == nullptr) {
      HttpClientOptions options;
      options.connect_timeout = std::chrono::seconds(1);
      options.total_timeout = std::chrono::seconds(2);
      options.stall_timeout = std::chrono::seconds(2);
      client_ = std::make_unique<HttpClient>(options);
    }
    const std::string what = StrCat("instance metadata ", endpoint_);

    // The session token. No answer, or an answer other than a token: no instance metadata here.
    HttpRequest token_request;
    token_request.method = "PUT";
    token_request.url = StrCat(endpoint_, "/latest/api/token");
    token_request.headers = {{"X-aws-ec2-metadata-token-ttl-seconds", "21600"}};
    Result<HttpResponse> token = client_->Perform(token_request, what);
    if (!token.ok()) {
      return NotFoundError(StrCat(what, ": no answer (not on EC2?): ", token.status().message()));
    }
    if (token->status == 403) {
      return NotFoundError(StrCat(what,
                                  ": refuses session tokens (instance metadata turned off for this "
                                  "instance)"));
    }
    if (token->status >= 500) return ServiceError(*token, StrCat(what, ": session token"), "");
    const std::string session(Trim(token->body));
    if (token->status != 200 || session.empty()) {
      return NotFoundError(StrCat(what, ": answered the session token request with HTTP ",
                                  static_cast<int64_t>(token->status),
                                  ": not an instance metadata service"));
    }
    if (session.find_first_of("\r\n") != std::string::npos) {
      return UnavailableError(StrCat(what, ": the session token has a line break in it"));
    }

    // The role of the instance profile.
    const std::string roles_url = StrCat(endpoint_, "/latest/meta-data/iam/security-credentials/");
    TS_ASSIGN_OR_RETURN(HttpResponse roles, Get(roles_url, session, what));
    if (roles.status == 404) {
      return NotFoundError(StrCat(what, ": this instance has no IAM role (instance profile)"));
    }
    if (roles.status != 200) return ServiceError(roles, StrCat(what, ": listing roles"), "");
    std::string_view first_line = roles.body;
    first_line = Trim(first_line.substr(0, first_line.find('\n')));
    if (first_line.empty()) {
      return NotFoundError(StrCat(what, ": this instance has no IAM role (instance profile)"));
    }
    role_ = std::string(first_line);

    // Its credentials.
    TS_ASSIGN_OR_RETURN(HttpResponse credentials,
                        Get(StrCat(roles_url, UrlEscape(role_)), session, what));
    if (credentials.status != 200) {
      return ServiceError(credentials, StrCat(what, ": credentials of role ", role_), "");
    }
    return CredentialsFromJson(credentials.body, StrCat(what, " (role ", role_, ")"));
  }

  std::string Describe() const override {
    return StrCat("instance metadata ", endpoint_, " (role ", role_, ")");
  }

 private:
  Result<HttpResponse> Get(const std::string& url, const std::string& session,
                           const std::string& what) {
    HttpRequest request;
    request.url = url;
    request.headers = {{"X-aws-ec2-metadata-token", session}};
    return client_->Perform(request, what);
  }

  EnvLookup env_;
  std::string endpoint_ = kDefaultImdsEndpoint;
  std::string role_;
  std::unique_ptr<HttpClient> client_;
};

// ---------------------------------------------------------------------------------------------
// The providers.

// The chain's choice of a source: the first Fetch that finds credentials chooses it, and later
// fetches (the refreshes) ask only it. The cache above (CachedCredential) decides when to fetch.
class ChainFetcher final : public CredentialFetcher<AwsCredentials> {
 public:
  ChainFetcher(std::string profile, std::string credentials_path,
               std::vector<std::unique_ptr<CredentialSource>> sources)
      : profile_(std::move(profile)),
        credentials_path_(std::move(credentials_path)),
        sources_(std::move(sources)),
        description_(
            StrCat("AWS credential chain for profile '", profile_, "' (no source chosen yet)")) {}

  // Called under the cache's lock: one fetch at a time.
  Result<TimedCredentials> Fetch() override {
    if (chosen_ != nullptr) {
      Result<TimedCredentials> fresh = chosen_->Fetch();
      if (fresh.ok()) SetDescription(chosen_->Describe());
      return fresh;  // a failure is annotated by the cache ("refreshing credentials")
    }
    if (!not_found_.ok()) return not_found_;
    std::vector<std::string> tried;
    for (const std::unique_ptr<CredentialSource>& source : sources_) {
      Result<TimedCredentials> got = source->Fetch();
      if (got.ok()) {
        chosen_ = source.get();
        SetDescription(chosen_->Describe());
        return got;
      }
      if (!absl::IsNotFound(got.status())) return got.status();
      tried.push_back(MessageOf(got.status()));
    }
    not_found_ = NotFoundError(StrCat(
        "no AWS credentials found for profile '", profile_, "'. Looked in: ", StrJoin(tried, "; "),
        ". To give credentials, set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
        "AWS_SESSION_TOKEN for temporary ones) in the environment, or write them to ",
        credentials_path_.empty() ? "~/.aws/credentials" : credentials_path_, " under [", profile_,
        "] as aws_access_key_id = ... and aws_secret_access_key = ... (`aws configure` does "
        "this); AWS_PROFILE selects another profile. For a public bucket, open the store "
        "anonymously (requests unsigned)."));
    SetDescription(
        StrCat("AWS credential chain for profile '", profile_, "' (no credentials found)"));
    return not_found_;
  }

  std::string Describe() const {
    std::lock_guard<std::mutex> lock(description_mu_);
    return description_;
  }

 private:
  void SetDescription(std::string description) {
    std::lock_guard<std::mutex> lock(description_mu_);
    description_ = std::move(description);
  }

  const std::string profile_;
  const std::string credentials_path_;
  std::vector<std::unique_ptr<CredentialSource>> sources_;
  CredentialSource* chosen_ = nullptr;  // one of sources_, once one had credentials
  Status not_found_;  // the kept NotFound once every source had none
  mutable std::mutex description_mu_;
  std::string description_;
};

// The chain behind the kit's cache: refreshed when less than kRefreshMargin is left, the kept
// credentials returned when a refresh fails while more than kRefreshGrace is left.
class ChainProvider final : public AwsCredentialProvider {
 public:
  ChainProvider(std::string profile, std::string credentials_path,
                std::vector<std::unique_ptr<CredentialSource>> sources)
      : fetcher_(new ChainFetcher(std::move(profile), std::move(credentials_path),
                                  std::move(sources))),
        cache_(std::unique_ptr<CredentialFetcher<AwsCredentials>>(fetcher_), CacheOptions()) {}

  Result<AwsCredentials> Get() override { return cache_.Get(); }
  std::string Describe() const override { return fetcher_->Describe(); }

 private:
  static CachedCredential<AwsCredentials>::Options CacheOptions() {
    CachedCredential<AwsCredentials>::Options options;
    options.refresh_margin = kRefreshMargin;
    options.refresh_grace = kRefreshGrace;
    return options;
  }

  ChainFetcher* const fetcher_;  // owned by cache_
  CachedCredential<AwsCredentials> cache_;
};

class StaticProvider final : public AwsCredentialProvider {
 public:
  explicit StaticProvider(AwsCredentials credentials) : credentials_(std::move(credentials)) {}
  Result<AwsCredentials> Get() override {
    if (!credentials_.access_key_id.empty() && credentials_.secret_access_key.empty()) {
      return InvalidArgumentError(
          "explicit AWS credentials: an access key id without a secret access key");
    }
    return credentials_;
  }
  std::string Describe() const override {
    return credentials_.access_key_id.empty() ? "explicit credentials (empty: anonymous)"
                                              : "explicit credentials";
  }

 private:
  const AwsCredentials credentials_;
};

class AnonymousProvider final : public AwsCredentialProvider {
 public:
  Result<AwsCredentials> Get() override { return AwsCredentials{}; }
  std::string Describe() const override { return "anonymous (requests unsigned)"; }
};

// The variables the chain reads (copied when it is made).
constexpr const char* kChainVariables[] = {
    "HOME",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
    "AWS_ROLE_SESSION_NAME",
    "AWS_ENDPOINT_URL_STS",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
    "AWS_EC2_METADATA_DISABLED",
    "AWS_EC2_METADATA_SERVICE_ENDPOINT",
};

}  // namespace

// ---------------------------------------------------------------------------------------------

const std::string* AwsIniSection::Find(const std::string& key) const {
  const auto it = values.find(key);
  return it == values.end() ? nullptr : &it->second;
}

const std::string* AwsIniSection::FindNested(const std::string& key,
                                             const std::string& sub_key) const {
  const auto block = nested.find(key);
  if (block == nested.end()) return nullptr;
  const auto it = block->second.find(sub_key);
  return it == block->second.end() ? nullptr : &it->second;
}

const AwsIniSection* AwsIniFile::Find(const std::string& name) const {
  const auto it = sections.find(name);
  return it == sections.end() ? nullptr : &it->second;
}

Result<AwsIniFile> ParseAwsIni(std::string_view text, std::string_view source) {
  AwsIniFile file;
  AwsIniSection* section = nullptr;
  std::string block_key;  // the key of the open nested block ("s3"), "" when none
  size_t block_indent = 0;
  int line_number = 0;
  for (std::string_view line : StrSplit(text, '\n')) {
    ++line_number;
    auto error = [&](std::string_view why) {
      return InvalidArgumentError(StrCat(source, ":", line_number, ": ", why));
    };
    size_t indent = 0;
    while (indent < line.size() && (line[indent] == ' ' || line[indent] == '\t')) ++indent;
    const std::string_view content = Trim(line);
    if (content.empty() || content.front() == '#' || content.front() == ';') continue;
    const bool in_block = !block_key.empty() && indent > block_indent;

    if (content.front() == '[' && !in_block) {
      block_key.clear();
      const size_t close = content.find(']');
      if (close == std::string_view::npos) return error("a section name without its ']'");
      const std::string_view after = Trim(content.substr(close + 1));
      if (!after.empty() && after.front() != '#' && after.front() != ';') {
        return error(StrCat("text after the section name: '", EscapeBytes(after), "'"));
      }
      const std::string name = CollapseSpaces(content.substr(1, close - 1));
      if (name.empty()) return error("an empty section name");
      section = &file.sections[name];
      continue;
    }
    if (section == nullptr) return error("a setting before the first [section]");
    const size_t equals = content.find('=');
    if (equals == std::string_view::npos) {
      return error(StrCat("expected 'key = value', found '", EscapeBytes(content), "'"));
    }
    const std::string key = ToLower(Trim(content.substr(0, equals)));
    if (key.empty()) return error("a setting without a key");
    const std::string value(StripInlineComment(Trim(content.substr(equals + 1))));
    if (in_block) {
      section->nested[block_key][key] = value;
      continue;
    }
    block_key.clear();
    section->values[key] = value;
    if (value.empty()) {  // opens a nested block ("s3 =")
      section->nested.erase(key);
      block_key = key;
      block_indent = indent;
    }
  }
  return file;
}

Result<std::optional<AwsIniFile>> ReadAwsIniFile(const std::string& path) {
  TS_ASSIGN_OR_RETURN(std::optional<std::string> text, ReadSmallFile(path, size_t{16} << 20));
  if (!text.has_value()) return std::optional<AwsIniFile>();
  TS_ASSIGN_OR_RETURN(AwsIniFile file, ParseAwsIni(*text, path));
  return std::optional<AwsIniFile>(std::move(file));
}

const AwsIniSection* FindConfigProfile(const AwsIniFile& config, const std::string& profile) {
  if (profile == "default") {
    if (const AwsIniSection* section = config.Find("default"); section != nullptr) return section;
  }
  return config.Find(StrCat("profile ", profile));
}

std::string AwsConfigFilePath(const EnvLookup& env) {
  if (std::optional<std::string> path = GetEnv(env, "AWS_CONFIG_FILE"); path.has_value()) {
    return ExpandHome(*path, env);
  }
  return HomeFile(env, ".aws/config");
}

std::string AwsCredentialsFilePath(const EnvLookup& env) {
  if (std::optional<std::string> path = GetEnv(env, "AWS_SHARED_CREDENTIALS_FILE");
      path.has_value()) {
    return ExpandHome(*path, env);
  }
  return HomeFile(env, ".aws/credentials");
}

Result<std::string> NormalizeEndpoint(std::string_view url, std::string_view source) {
  auto bad = [&](std::string_view why) {
    return InvalidArgumentError(StrCat(source, ": '", EscapeBytes(url),
                                       "' is not an endpoint of the form http(s)://host[:port] (",
                                       why, ")"));
  };
  const size_t separator = url.find("://");
  if (separator == std::string_view::npos) return bad("no scheme");
  const std::string scheme = ToLower(url.substr(0, separator));
  if (scheme != "http" && scheme != "https") return bad("the scheme must be http or https");
  std::string_view rest = url.substr(separator + 3);
  while (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  if (rest.empty()) return bad("no host");
  if (rest.find('/') != std::string_view::npos) return bad("a path is not allowed");
  if (rest.find_first_of("?#") != std::string_view::npos) return bad("a query is not allowed");
  if (rest.find('@') != std::string_view::npos) return bad("a user name is not allowed");
  std::string_view host = rest;
  std::string_view port;
  bool has_port = false;
  if (rest.front() == '[') {
    const size_t close = rest.find(']');
    if (close == std::string_view::npos) return bad("an IPv6 address without its ']'");
    host = rest.substr(0, close + 1);
    const std::string_view after = rest.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') return bad("text after the IPv6 address");
      has_port = true;
      port = after.substr(1);
    }
    const std::string_view inside = host.substr(1, host.size() - 2);
    if (inside.empty() || !std::all_of(inside.begin(), inside.end(), [](char c) {
          return std::isxdigit(static_cast<unsigned char>(c)) || c == ':' || c == '.';
        })) {
      return bad("a malformed IPv6 address");
    }
  } else {
    const size_t colon = rest.find(':');
    if (colon != std::string_view::npos) {
      if (rest.find(':', colon + 1) != std::string_view::npos) {
        return bad("an IPv6 address must be in brackets");
      }
      host = rest.substr(0, colon);
      port = rest.substr(colon + 1);
      has_port = true;
    }
    if (host.empty()) return bad("no host");
    if (!std::all_of(host.begin(), host.end(), [](char c) {
          return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_';
        })) {
      return bad("the host name has a character other than letters, digits, '-', '.' and '_'");
    }
  }
  if (has_port) {
    int number = 0;
    if (!std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
        !ParseInt(port, &number) || number < 1 || number > 65535) {
      return bad("the port must be a number from 1 to 65535");
    }
  }
  return StrCat(scheme, "://", rest);
}

Result<S3Settings> ResolveS3Settings(const S3SettingsOverrides& overrides, const EnvLookup& env) {
  S3Settings settings;
  if (overrides.profile.has_value()) {
    if (overrides.profile->empty()) return InvalidArgumentError("the S3 option 'profile' is empty");
    settings.profile = *overrides.profile;
  } else {
    settings.profile = GetEnv(env, "AWS_PROFILE").value_or("default");
  }
  ProfileConfig config(env, settings.profile);

  // The region.
  if (overrides.region.has_value()) {
    TS_RETURN_IF_ERROR(CheckRegion(*overrides.region, "the S3 option 'region'"));
    settings.region = *overrides.region;
  } else if (std::optional<std::string> region = GetEnv(env, "AWS_REGION"); region.has_value()) {
    TS_RETURN_IF_ERROR(CheckRegion(*region, "environment variable AWS_REGION"));
    settings.region = *region;
  } else if (region = GetEnv(env, "AWS_DEFAULT_REGION"); region.has_value()) {
    TS_RETURN_IF_ERROR(CheckRegion(*region, "environment variable AWS_DEFAULT_REGION"));
    settings.region = *region;
  } else {
    TS_RETURN_IF_ERROR(config.Load());
    const std::string* value = config.profile() ? config.profile()->Find("region") : nullptr;
    if (value != nullptr) {
      TS_RETURN_IF_ERROR(CheckRegion(*value, StrCat("region of ", config.Where())));
      settings.region = *value;
    } else {
      settings.region = "us-east-1";
    }
  }

  // The endpoint.
  const bool ignore_configured = EnvIsTrue(env, "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS");
  std::optional<std::string> endpoint;
  std::string endpoint_source;
  if (overrides.endpoint.has_value()) {
    endpoint = *overrides.endpoint;
    endpoint_source = "the S3 option 'endpoint'";
  } else if (!ignore_configured) {
    for (const char* name : {"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"}) {
      if (std::optional<std::string> value = GetEnv(env, name); value.has_value()) {
        endpoint = *value;
        endpoint_source = StrCat("environment variable ", name);
        break;
      }
    }
    if (!endpoint.has_value()) {
      TS_RETURN_IF_ERROR(config.Load());
      if (config.services() != nullptr) {
        if (const std::string* value = config.services()->FindNested("s3", "endpoint_url")) {
          endpoint = *value;
          endpoint_source = StrCat("s3 endpoint_url of ", config.WhereServices());
        }
      }
      if (!endpoint.has_value() && config.profile() != nullptr) {
        if (const std::string* value = config.profile()->Find("endpoint_url")) {
          endpoint = *value;
          endpoint_source = StrCat("endpoint_url of ", config.Where());
        }
      }
    }
  }
  if (endpoint.has_value()) {
    TS_ASSIGN_OR_RETURN(settings.endpoint, NormalizeEndpoint(*endpoint, endpoint_source));
  } else {
    if (!IsHostSafeRegion(settings.region)) {
      return InvalidArgumentError(StrCat("the region '", EscapeBytes(settings.region),
                                         "' cannot name an AWS endpoint (lowercase letters, "
                                         "digits and '-'); give the S3 endpoint explicitly"));
    }
    settings.endpoint = StrCat("https://s3.", settings.region, ".", AwsDomainFor(settings.region));
  }

  // The addressing style.
  std::optional<bool> path_style;
  if (overrides.path_style.has_value()) {
    path_style = overrides.path_style;
  } else if (std::optional<std::string> style = GetEnv(env, "TENSORSTASH_S3_ADDRESSING_STYLE");
             style.has_value()) {
    TS_ASSIGN_OR_RETURN(
        path_style,
        ParseAddressingStyle(*style, "environment variable TENSORSTASH_S3_ADDRESSING_STYLE"));
  } else {
    TS_RETURN_IF_ERROR(config.Load());
    const std::string* value =
        config.profile() ? config.profile()->FindNested("s3", "addressing_style") : nullptr;
    if (value != nullptr) {
      TS_ASSIGN_OR_RETURN(path_style, ParseAddressingStyle(*value, StrCat("s3 addressing_style of ",
                                                                          config.Where())));
    }
  }
  settings.path_style = path_style.value_or(!IsAwsHost(settings.endpoint));
  return settings;
}

Result<std::chrono::system_clock::time_point> ParseAwsTimestamp(std::string_view text) {
  auto bad = [&] {
    return InvalidArgumentError(
        StrCat("'", EscapeBytes(text), "' is not an ISO 8601 time such as 2026-11-24T18:00:00Z"));
  };
  auto number = [&](size_t pos, size_t length, int* out) {
    if (pos + length > text.size()) return false;
    const std::string_view digits = text.substr(pos, length);
    return std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
           ParseInt(digits, out);
  };
  int year = 0, month = 0, day = 0, hour = 0, minute = 0, second = 0;
  if (text.size() < 20 || !number(0, 4, &year) || text[4] != '-' || !number(5, 2, &month) ||
      text[7] != '-' || !number(8, 2, &day) || (text[10] != 'T' && text[10] != 't') ||
      !number(11, 2, &hour) || text[13] != ':' || !number(14, 2, &minute) || text[16] != ':' ||
      !number(17, 2, &second)) {
    return bad();
  }
  size_t pos = 19;
  if (text[pos] == '.') {
    const size_t start = ++pos;
    while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9') ++pos;
    if (pos == start) return bad();
  }
  int offset_minutes = 0;
  if (pos < text.size() && (text[pos] == 'Z' || text[pos] == 'z')) {
    ++pos;
  } else if (pos < text.size() && (text[pos] == '+' || text[pos] == '-')) {
    const int sign = text[pos] == '-' ? -1 : 1;
    int offset_hours = 0, offset_mins = 0;
    if (!number(pos + 1, 2, &offset_hours)) return bad();
    pos += 3;
    if (pos < text.size() && text[pos] == ':') ++pos;
    if (!number(pos, 2, &offset_mins)) return bad();
    pos += 2;
    if (offset_hours > 23 || offset_mins > 59) return bad();
    offset_minutes = sign * (offset_hours * 60 + offset_mins);
  } else {
    return bad();
  }
  if (pos != text.size()) return bad();
  const std::chrono::year_month_day date{std::chrono::year(year),
                                         std::chrono::month(static_cast<unsigned>(month)),
                                         std::chrono::day(static_cast<unsigned>(day))};
  if (!date.ok() || hour > 23 || minute > 59 || second > 60) return bad();
  return std::chrono::sys_days(date) + std::chrono::hours(hour) + std::chrono::minutes(minute) +
         std::chrono::seconds(second) - std::chrono::minutes(offset_minutes);
}

Result<std::shared_ptr<AwsCredentialProvider>> DefaultCredentialChain(const std::string& profile,
                                                                      const std::string& region,
                                                                      const EnvLookup& env) {
  if (profile.empty()) return InvalidArgumentError("the AWS profile for credentials is empty");
  TS_RETURN_IF_ERROR(CheckRegion(region, "the AWS region for credentials"));
  std::map<std::string, std::string> snapshot;
  for (const char* name : kChainVariables) {
    if (std::optional<std::string> value = GetEnv(env, name); value.has_value()) {
      snapshot[name] = *value;
    }
  }
  const EnvLookup fixed = FixedEnv(std::move(snapshot));
  const std::string credentials_path = AwsCredentialsFilePath(fixed);
  std::vector<std::unique_ptr<CredentialSource>> sources;
  sources.push_back(std::make_unique<EnvSource>(fixed));
  sources.push_back(std::make_unique<ProfileFileSource>(ProfileFileSource::Kind::kCredentials,
                                                        credentials_path, profile));
  sources.push_back(std::make_unique<ProfileFileSource>(ProfileFileSource::Kind::kConfig,
                                                        AwsConfigFilePath(fixed), profile));
  sources.push_back(std::make_unique<WebIdentitySource>(fixed, profile, region));
  sources.push_back(std::make_unique<ContainerSource>(fixed));
  sources.push_back(std::make_unique<ImdsSource>(fixed));
  return std::shared_ptr<AwsCredentialProvider>(
      std::make_shared<ChainProvider>(profile, credentials_path, std::move(sources)));
}

std::shared_ptr<AwsCredentialProvider> StaticCredentials(AwsCredentials credentials) {
  return std::make_shared<StaticProvider>(std::move(credentials));
}

std::shared_ptr<AwsCredentialProvider> AnonymousCredentials() {
  return std::make_shared<AnonymousProvider>();
}

}  // namespace tensorstash
