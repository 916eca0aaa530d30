#include "tensorstash/kvstore/gcs/gcs_credentials.h"

#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tensorstash/kvstore/http/http_client.h"
#include "tensorstash/kvstore/object_store/credentials.h"
#include "tensorstash/util/base64.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

using nlohmann::json;

constexpr std::string_view kDefaultTokenUri = "https://oauth2.googleapis.com/token";
// read_write even for a store opened only to read: the store cannot know it will only read.
// create=false does not mean read-only: `tensorstash gc` opens its root with create=false and
// then deletes abandoned uploads and attempts, which a read_only token would fail with 403.
// (full_control is not needed: tensorstash changes no ACLs.)
constexpr std::string_view kScope = "https://www.googleapis.com/auth/devstorage.read_write";
constexpr std::string_view kMetadataHost = "metadata.google.internal";
constexpr std::string_view kMetadataTokenPath =
    "/computeMetadata/v1/instance/service-accounts/default/token";
constexpr std::string_view kHowToGive =
    "Give credentials with `gcloud auth application-default login`, or set "
    "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, or give the store option "
    "credentials_file or token (or configure_gcs(credentials_file=..., token=...)), or "
    "anonymous=true for a public bucket";

class AnonymousProvider final : public GcsCredentialProvider {
 public:
  Result<std::string> Token() override { return std::string(); }
  std::string Describe() const override { return "anonymous access (no credentials sent)"; }
};

class StaticTokenProvider final : public GcsCredentialProvider {
 public:
  StaticTokenProvider(std::string token, std::string source)
      : token_(std::move(token)), source_(std::move(source)) {}
  Result<std::string> Token() override { return token_; }
  std::string Describe() const override { return source_; }

 private:
  const std::string token_;
  const std::string source_;
};

// A token fetched from an OAuth 2 endpoint (or the metadata server), kept until shortly
// before it expires.
class FetchedTokenProvider final : public GcsCredentialProvider {
 public:
  FetchedTokenProvider(std::unique_ptr<CredentialFetcher<std::string>> fetcher,
                       std::string description)
      : cache_(std::move(fetcher)), description_(std::move(description)) {}
  Result<std::string> Token() override { return cache_.Get(); }
  std::string Describe() const override { return description_; }

 private:
  CachedCredential<std::string> cache_;
  const std::string description_;
};

// "scheme", "host" (no port, no brackets) of `url`; empty when it is not a URL.
std::pair<std::string, std::string> SchemeAndHost(std::string_view url) {
  const size_t colon = url.find("://");
  if (colon == std::string_view::npos) return {};
  std::string_view rest = url.substr(colon + 3);
  rest = rest.substr(0, rest.find_first_of("/?#"));
  if (const size_t at = rest.rfind('@'); at != std::string_view::npos) rest = rest.substr(at + 1);
  std::string_view host;
  if (rest.starts_with('[')) {
    host = rest.substr(1, rest.find(']') == std::string_view::npos ? 0 : rest.find(']') - 1);
  } else {
    host = rest.substr(0, rest.find(':'));
  }
  return {std::string(url.substr(0, colon)), std::string(host)};
}

bool IsLoopback(std::string_view host) {
  if (host == "localhost" || host == "::1") return true;
  // An IPv4 literal in 127.0.0.0/8 (not a name such as "127.example.com").
  return host.starts_with("127.") &&
         host.find_first_not_of("0123456789.") == std::string_view::npos;
}

// An https URL, or http to a loopback host (the test fakes): a token grant carries a secret.
Status CheckTokenUri(std::string_view uri, std::string_view where) {
  const auto [scheme, host] = SchemeAndHost(uri);
  if (scheme == "https" && !host.empty()) return OkStatus();
  if (scheme == "http" && IsLoopback(host)) return OkStatus();
  return InvalidArgumentError(StrCat("the token_uri '", uri, "' in ", where,
                                     " is not an https URL (plain http is allowed for a "
                                     "loopback host only)"));
}

}  // namespace

Status CheckGcsTokenTransport(std::string_view endpoint, bool allow_http_token,
                              const EnvLookup& env) {
  const auto [scheme, host] = SchemeAndHost(endpoint);
  if (scheme == "https" || IsLoopback(host) || allow_http_token) return OkStatus();
  if (std::optional<std::string> emulator = GcsEmulatorEndpoint(env);
      emulator.has_value() && SchemeAndHost(*emulator).second == host) {
    return OkStatus();
  }
  return PermissionDeniedError(StrCat(
      "not sending a Google Cloud access token over plain http to ", endpoint,
      " (anyone on the way could read and reuse it): use https, or, for an emulator or proxy "
      "you trust, name its host in STORAGE_EMULATOR_HOST or give the store option "
      "allow_http_token=true"));
}

namespace {

// The access token of a grant's JSON answer.
Result<ExpiringCredential<std::string>> ParseTokenAnswer(const HttpResponse& response,
                                                         std::string_view what) {
  if (response.status == 400 || response.status == 401 || response.status == 403) {
    return PermissionDeniedError(StrCat(what, ": refused (HTTP ", response.status, "): ",
                                        response.body.substr(0, 500)));
  }
  if (response.status >= 500 || response.status == 429) {
    return UnavailableError(StrCat(what, ": HTTP ", response.status, ": ",
                                   response.body.substr(0, 200)));
  }
  if (response.status != 200) {
    return UnknownError(StrCat(what, ": unexpected HTTP ", response.status, ": ",
                               response.body.substr(0, 200)));
  }
  const json answer = json::parse(response.body, nullptr, /*allow_exceptions=*/false);
  if (!answer.is_object() || !answer.contains("access_token") ||
      !answer["access_token"].is_string() || answer["access_token"].get<std::string>().empty()) {
    return DataLossError(StrCat(what, ": the answer has no access_token"));
  }
  ExpiringCredential<std::string> token;
  token.value = answer["access_token"].get<std::string>();
  int64_t expires_in = 3600;
  if (answer.contains("expires_in")) {
    const json& e = answer["expires_in"];
    if (e.is_number_integer()) {
      expires_in = e.get<int64_t>();
    } else if (!e.is_string() || !ParseInt(e.get<std::string>(), &expires_in)) {
      return DataLossError(StrCat(what, ": the answer's expires_in is not a number"));
    }
  }
  token.expires = std::chrono::system_clock::now() + std::chrono::seconds(expires_in);
  return token;
}

// POSTs a form to a token endpoint.
class GrantFetcher final : public CredentialFetcher<std::string> {
 public:
  GrantFetcher(GcsCredentialsFile file, std::string description)
      : file_(std::move(file)), description_(std::move(description)) {}

  Result<ExpiringCredential<std::string>> Fetch() override {
    std::string body;
    if (file_.type == "service_account") {
      const int64_t now = std::chrono::duration_cast<std::chrono::seconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
      TS_ASSIGN_OR_RETURN(std::string jwt, MakeGcsServiceAccountJwt(file_, kScope, now));
      body = StrCat("grant_type=", UrlEscape("urn:ietf:params:oauth:grant-type:jwt-bearer"),
                    "&assertion=", UrlEscape(jwt));
    } else {
      body = StrCat("grant_type=refresh_token&client_id=", UrlEscape(file_.client_id),
                    "&client_secret=", UrlEscape(file_.client_secret),
                    "&refresh_token=", UrlEscape(file_.refresh_token));
    }
    HttpRequest request;
    request.method = "POST";
    request.url = file_.token_uri;
    request.headers.emplace_back("content-type", "application/x-www-form-urlencoded");
    request.body = body;
    const std::string what =
        StrCat("getting a Google Cloud token at ", file_.token_uri, " for ", description_);
    TS_ASSIGN_OR_RETURN(HttpResponse response, client_.Perform(request, what));
    return ParseTokenAnswer(response, what);
  }

 private:
  const GcsCredentialsFile file_;
  const std::string description_;
  HttpClient client_;
};

// Metadata hosts that did not answer as a metadata server: not asked again by this process.
std::mutex& AbsentMetadataMutex() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::set<std::string>& AbsentMetadataHosts() {
  static auto* hosts = new std::set<std::string>();
  return *hosts;
}
bool MetadataKnownAbsent(const std::string& host) {
  std::lock_guard<std::mutex> lock(AbsentMetadataMutex());
  return AbsentMetadataHosts().contains(host);
}

class MetadataFetcher final : public CredentialFetcher<std::string> {
 public:
  explicit MetadataFetcher(std::string host)
      : host_(std::move(host)),
        client_(HttpClientOptions{.connect_timeout = std::chrono::milliseconds(500),
                                  .stall_timeout = std::chrono::seconds(2),
                                  .total_timeout = std::chrono::seconds(2),
                                  .allow_https = false}) {}

  // NotFound when no metadata server answers at the host (then remembered for the process).
  Result<ExpiringCredential<std::string>> Fetch() override {
    HttpRequest request;
    request.url = StrCat("http://", host_, kMetadataTokenPath);
    request.headers.emplace_back("metadata-flavor", "Google");
    const std::string what = StrCat("getting a token from the metadata server at ", host_);
    Result<HttpResponse> response = client_.Perform(request, what);
    std::string absent;
    if (!response.ok()) {
      absent = std::string(response.status().message());
    } else if (response->Header("metadata-flavor") != "Google") {
      absent = StrCat("the server at ", host_, " answered HTTP ", response->status,
                      " without Metadata-Flavor: Google");
    }
    if (!absent.empty()) {
      std::lock_guard<std::mutex> lock(AbsentMetadataMutex());
      AbsentMetadataHosts().insert(host_);
      return NotFoundError(absent);
    }
    return ParseTokenAnswer(*response, what);
  }

 private:
  const std::string host_;
  HttpClient client_;
};

// The end of the chain: the metadata server, asked at the first Token() (unless skipped), else
// PermissionDenied listing each place looked.
class MetadataOrMissingProvider final : public GcsCredentialProvider {
 public:
  MetadataOrMissingProvider(std::vector<std::string> looked, std::optional<std::string> host,
                            std::string skipped_why)
      : looked_(std::move(looked)), host_(std::move(host)), skipped_why_(std::move(skipped_why)) {
    if (host_.has_value()) {
      cache_ = std::make_unique<CachedCredential<std::string>>(
          std::make_unique<MetadataFetcher>(*host_));
    }
  }

  Result<std::string> Token() override {
    if (!host_.has_value()) return Missing(skipped_why_);
    if (MetadataKnownAbsent(*host_)) {
      return Missing(StrCat("the metadata server at ", *host_, ": no server answered"));
    }
    Result<std::string> token = cache_->Get();
    if (token.ok() || !absl::IsNotFound(token.status())) return token;
    return Missing(StrCat("the metadata server at ", *host_, ": no server answered (",
                          token.status().message(), ")"));
  }

  std::string Describe() const override {
    return host_.has_value() ? StrCat("the metadata server at ", *host_)
                             : std::string("no credentials found");
  }

 private:
  Status Missing(std::string_view metadata) const {
    return PermissionDeniedError(StrCat("no Google Cloud credentials found; looked at: ",
                                        StrJoin(looked_, "; "), "; ", metadata, ". ", kHowToGive));
  }

  const std::vector<std::string> looked_;
  const std::optional<std::string> host_;
  const std::string skipped_why_;
  std::unique_ptr<CachedCredential<std::string>> cache_;
};

std::string Field(const json& doc, std::string_view name) {
  const auto it = doc.find(std::string(name));
  return it != doc.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// The provider of the credentials file at `path`, named by `who` ("GOOGLE_APPLICATION_CREDENTIALS").
Result<std::shared_ptr<GcsCredentialProvider>> FromFile(const std::string& path,
                                                       std::string_view who) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return PermissionDeniedError(StrCat("the Google Cloud credentials file '", path, "' (", who,
                                        ") cannot be read. ", kHowToGive));
  }
  std::stringstream text;
  text << in.rdbuf();
  const std::string where = StrCat("the credentials file '", path, "' (", who, ")");
  TS_ASSIGN_OR_RETURN(GcsCredentialsFile file, ParseGcsCredentialsFile(text.str(), where));
  const std::string description =
      file.type == "service_account"
          ? StrCat("the service-account key '", path, "' (", file.client_email, ", from ", who,
                   ")")
          : StrCat("the authorized_user credentials '", path, "' (from ", who, ")");
  return std::shared_ptr<GcsCredentialProvider>(std::make_shared<FetchedTokenProvider>(
      std::make_unique<GrantFetcher>(std::move(file), description), description));
}

}  // namespace

std::shared_ptr<GcsCredentialProvider> AnonymousGcsCredentials() {
  return std::make_shared<AnonymousProvider>();
}

std::shared_ptr<GcsCredentialProvider> StaticGcsToken(std::string token, std::string source) {
  return std::make_shared<StaticTokenProvider>(std::move(token), std::move(source));
}

std::optional<std::string> GcsEmulatorEndpoint(const EnvLookup& env) {
  std::optional<std::string> host = env("STORAGE_EMULATOR_HOST");
  if (!host.has_value() || host->empty()) return std::nullopt;
  std::string endpoint = host->find("://") == std::string::npos ? StrCat("http://", *host) : *host;
  while (endpoint.ends_with('/')) endpoint.pop_back();
  return endpoint;
}

Result<GcsCredentialsFile> ParseGcsCredentialsFile(std::string_view text, std::string_view where) {
  const json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object()) return InvalidArgumentError(StrCat(where, " is not a JSON object"));
  GcsCredentialsFile file;
  file.type = Field(doc, "type");
  std::vector<std::string_view> required;
  if (file.type == "service_account") {
    file.client_email = Field(doc, "client_email");
    file.private_key = Field(doc, "private_key");
    file.private_key_id = Field(doc, "private_key_id");
    required = {"client_email", "private_key"};
  } else if (file.type == "authorized_user") {
    file.client_id = Field(doc, "client_id");
    file.client_secret = Field(doc, "client_secret");
    file.refresh_token = Field(doc, "refresh_token");
    required = {"client_id", "client_secret", "refresh_token"};
  } else if (file.type.empty()) {
    return InvalidArgumentError(StrCat(where, " has no \"type\" (service_account or "
                                       "authorized_user)"));
  } else {
    return UnimplementedError(StrCat(where, " holds credentials of type '", file.type,
                                     "', which tensorstash does not support (it reads "
                                     "service_account and authorized_user)"));
  }
  for (std::string_view name : required) {
    if (Field(doc, name).empty()) {
      return InvalidArgumentError(StrCat(where, " (type ", file.type, ") has no \"", name, "\""));
    }
  }
  file.token_uri = Field(doc, "token_uri");
  if (file.token_uri.empty()) file.token_uri = std::string(kDefaultTokenUri);
  TS_RETURN_IF_ERROR(CheckTokenUri(file.token_uri, where));
  return file;
}

Result<std::string> MakeGcsServiceAccountJwt(const GcsCredentialsFile& key, std::string_view scope,
                                             int64_t issued_at) {
  json header = {{"alg", "RS256"}, {"typ", "JWT"}};
  if (!key.private_key_id.empty()) header["kid"] = key.private_key_id;
  const json claims = {{"iss", key.client_email}, {"scope", scope},
                       {"aud", key.token_uri},    {"iat", issued_at},
                       {"exp", issued_at + 3600}};
  const std::string input =
      StrCat(Base64UrlEncode(header.dump()), ".", Base64UrlEncode(claims.dump()));

  std::unique_ptr<BIO, decltype(&BIO_free)> bio(
      BIO_new_mem_buf(key.private_key.data(), static_cast<int>(key.private_key.size())),
      &BIO_free);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> pkey(
      bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr) : nullptr,
      &EVP_PKEY_free);
  if (pkey == nullptr) {
    return InvalidArgumentError(StrCat("the private_key of the service account ",
                                       key.client_email, " is not a PEM private key"));
  }
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  size_t size = 0;
  if (ctx == nullptr ||
      EVP_DigestSignInit(ctx.get(), nullptr, EVP_sha256(), nullptr, pkey.get()) != 1 ||
      EVP_DigestSign(ctx.get(), nullptr, &size,
                     reinterpret_cast<const unsigned char*>(input.data()), input.size()) != 1) {
    return InvalidArgumentError(StrCat("signing a JWT with the key of the service account ",
                                       key.client_email, " failed"));
  }
  std::string signature(size, '\0');
  if (EVP_DigestSign(ctx.get(), reinterpret_cast<unsigned char*>(signature.data()), &size,
                     reinterpret_cast<const unsigned char*>(input.data()), input.size()) != 1) {
    return InvalidArgumentError(StrCat("signing a JWT with the key of the service account ",
                                       key.client_email, " failed"));
  }
  signature.resize(size);
  return StrCat(input, ".", Base64UrlEncode(signature));
}

Result<std::shared_ptr<GcsCredentialProvider>> ResolveGcsCredentials(
    const GcsCredentialOptions& explicit_options, const EnvLookup& env) {
  const int given = int{explicit_options.anonymous} + int{explicit_options.token.has_value()} +
                    int{explicit_options.credentials_file.has_value()};
  if (given > 1) {
    return InvalidArgumentError(
        "Google Cloud credentials: give one of credentials_file, token and anonymous access");
  }
  if (explicit_options.anonymous) return AnonymousGcsCredentials();
  if (explicit_options.token.has_value()) {
    if (explicit_options.token->empty()) {
      return InvalidArgumentError("Google Cloud credentials: the token given is empty");
    }
    return StaticGcsToken(*explicit_options.token, "the token given as a store option");
  }
  if (explicit_options.credentials_file.has_value()) {
    if (explicit_options.credentials_file->empty()) {
      return InvalidArgumentError("Google Cloud credentials: the credentials_file given is empty");
    }
    return FromFile(*explicit_options.credentials_file, "the option credentials_file");
  }
  if (GcsEmulatorEndpoint(env).has_value()) return AnonymousGcsCredentials();

  std::vector<std::string> looked = {"no credentials_file, token or anonymous given",
                                     "STORAGE_EMULATOR_HOST: not set"};
  const std::optional<std::string> gac = env("GOOGLE_APPLICATION_CREDENTIALS");
  if (gac.has_value() && !gac->empty()) return FromFile(*gac, "GOOGLE_APPLICATION_CREDENTIALS");
  looked.push_back("GOOGLE_APPLICATION_CREDENTIALS: not set");

  std::string adc;
  if (std::optional<std::string> config = env("CLOUDSDK_CONFIG");
      config.has_value() && !config->empty()) {
    adc = StrCat(*config, "/application_default_credentials.json");
  } else if (std::optional<std::string> home = env("HOME"); home.has_value() && !home->empty()) {
    adc = StrCat(*home, "/.config/gcloud/application_default_credentials.json");
  }
  if (adc.empty()) {
    looked.push_back("gcloud's application_default_credentials.json: neither CLOUDSDK_CONFIG "
                     "nor HOME is set");
  } else {
    std::error_code error;
    if (std::filesystem::exists(adc, error)) {
      return FromFile(adc, "gcloud's application default credentials");
    }
    looked.push_back(StrCat(adc, ": no such file"));
  }

  const std::optional<std::string> no_check = env("NO_GCE_CHECK");
  if (no_check.has_value() && (*no_check == "true" || *no_check == "True" || *no_check == "1")) {
    return std::shared_ptr<GcsCredentialProvider>(std::make_shared<MetadataOrMissingProvider>(
        std::move(looked), std::nullopt, "the metadata server: not asked (NO_GCE_CHECK=true)"));
  }
  std::string host(kMetadataHost);
  if (std::optional<std::string> h = env("GCE_METADATA_HOST"); h.has_value() && !h->empty()) {
    host = *h;
  }
  return std::shared_ptr<GcsCredentialProvider>(
      std::make_shared<MetadataOrMissingProvider>(std::move(looked), host, std::string()));
}

}  // namespace tensorstash
