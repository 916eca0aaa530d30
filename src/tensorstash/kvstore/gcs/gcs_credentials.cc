#include "tensorstash/kvstore/gcs/gcs_credentials.h"

#include <utility>

#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

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

// No credential was found: every request is refused before it is sent, saying so.
class MissingProvider final : public GcsCredentialProvider {
 public:
  Result<std::string> Token() override {
    return PermissionDeniedError(
        "no Google Cloud credentials: none were given (the store options token or anonymous) "
        "and STORAGE_EMULATOR_HOST is not set; tensorstash does not read "
        "GOOGLE_APPLICATION_CREDENTIALS, the gcloud application-default credentials or the "
        "metadata server yet. Give a token (the store option token, e.g. the output of "
        "`gcloud auth print-access-token`), or anonymous=true for a public bucket");
  }
  std::string Describe() const override { return "no credentials found"; }
};

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

Result<std::shared_ptr<GcsCredentialProvider>> ResolveGcsCredentials(
    const GcsCredentialOptions& explicit_options, const EnvLookup& env) {
  if (explicit_options.anonymous && explicit_options.token.has_value()) {
    return InvalidArgumentError(
        "Google Cloud credentials: give a token or anonymous access, not both");
  }
  if (explicit_options.anonymous) return AnonymousGcsCredentials();
  if (explicit_options.token.has_value()) {
    if (explicit_options.token->empty()) {
      return InvalidArgumentError("Google Cloud credentials: the token given is empty");
    }
    return StaticGcsToken(*explicit_options.token, "the token given as a store option");
  }
  if (GcsEmulatorEndpoint(env).has_value()) return AnonymousGcsCredentials();
  return std::shared_ptr<GcsCredentialProvider>(std::make_shared<MissingProvider>());
}

}  // namespace tensorstash
