// Credentials of the gs:// store: where its bearer token comes from. The store asks a
// GcsCredentialProvider for a token before each request and names its Describe() when the
// server refuses it (401/403).
//
// In this version: anonymous access (no Authorization header: public buckets, emulators), an
// explicit token, and STORAGE_EMULATOR_HOST (an emulator: anonymous, as Google's clients do).
// Google's Application Default Credentials chain (a service-account key's signed JWT, the
// authorized_user file of `gcloud auth application-default login`, the metadata server) is to
// be added as more providers behind this interface (each a CredentialFetcher<GcsToken> in a
// CachedCredential, object_store/credentials.h); the store does not change then. Until it is,
// resolving credentials that are not given is a provider whose Token() is PermissionDenied
// saying where it looked and how to give them.
//
// Thread-safety: Token() and Describe() may be called from several threads at once.
#ifndef TENSORSTASH_KVSTORE_GCS_GCS_CREDENTIALS_H_
#define TENSORSTASH_KVSTORE_GCS_GCS_CREDENTIALS_H_

#include <memory>
#include <optional>
#include <string>

#include "tensorstash/kvstore/object_store/env_lookup.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

class GcsCredentialProvider {
 public:
  virtual ~GcsCredentialProvider() = default;
  // The OAuth 2 access token to send as "Authorization: Bearer <token>"; "" sends none
  // (anonymous). PermissionDenied when there is no credential, naming where it looked.
  virtual Result<std::string> Token() = 0;
  // What the credential is, for errors ("anonymous", "the token given as a store option").
  virtual std::string Describe() const = 0;
};

std::shared_ptr<GcsCredentialProvider> AnonymousGcsCredentials();
// `token` is sent as it is, never refreshed; `source` says where it came from, for Describe().
std::shared_ptr<GcsCredentialProvider> StaticGcsToken(std::string token, std::string source);

// Credentials given explicitly (driver options; later configure_gcs); at most one of them.
struct GcsCredentialOptions {
  bool anonymous = false;
  std::optional<std::string> token;
};

// The credentials of a store, the first that applies: the explicit ones; anonymous when
// STORAGE_EMULATOR_HOST is set (in `env`); else (the ADC chain not being built yet) a provider
// whose Token() is PermissionDenied listing where it looked. InvalidArgument for both anonymous
// and a token, or an empty token.
Result<std::shared_ptr<GcsCredentialProvider>> ResolveGcsCredentials(
    const GcsCredentialOptions& explicit_options, const EnvLookup& env);

// The endpoint STORAGE_EMULATOR_HOST names ("host:port" becomes "http://host:port"; a URL is
// kept, trailing '/' dropped), or nullopt when it is unset or empty.
std::optional<std::string> GcsEmulatorEndpoint(const EnvLookup& env);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_GCS_GCS_CREDENTIALS_H_
