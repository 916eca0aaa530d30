// Credentials of the gs:// store: where its bearer token comes from. The store asks a
// GcsCredentialProvider for a token before each request and names its Describe() when the
// server refuses it (401/403).
//
// ResolveGcsCredentials follows Google's Application Default Credentials order: explicit options
// (credentials_file, token, anonymous) → STORAGE_EMULATOR_HOST (anonymous, as Google's clients
// do) → GOOGLE_APPLICATION_CREDENTIALS → $CLOUDSDK_CONFIG/application_default_credentials.json
// or ~/.config/gcloud/application_default_credentials.json → the metadata server
// (GCE_METADATA_HOST or metadata.google.internal; skipped when NO_GCE_CHECK=true). A credentials
// file is a service-account key (an RS256-signed JWT exchanged at its token_uri) or the
// authorized_user file of `gcloud auth application-default login` (a refresh-token grant).
// Fetched tokens are kept in a CachedCredential (object_store/credentials.h): refreshed five
// minutes before they expire, one fetch at a time.
//
// Thread-safety: Token() and Describe() may be called from several threads at once.
#ifndef TENSORSTASH_KVSTORE_GCS_GCS_CREDENTIALS_H_
#define TENSORSTASH_KVSTORE_GCS_GCS_CREDENTIALS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "tensorstash/kvstore/object_store/env_lookup.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

class GcsCredentialProvider {
 public:
  virtual ~GcsCredentialProvider() = default;
  // The OAuth 2 access token to send as "Authorization: Bearer <token>"; "" sends none
  // (anonymous). PermissionDenied when there is no credential (naming where it looked) or the
  // token endpoint refuses it; Unavailable when the endpoint cannot be reached.
  virtual Result<std::string> Token() = 0;
  // What the credential is, for errors ("anonymous", "the service-account key /k.json").
  virtual std::string Describe() const = 0;
};

std::shared_ptr<GcsCredentialProvider> AnonymousGcsCredentials();
// `token` is sent as it is, never refreshed; `source` says where it came from, for Describe().
std::shared_ptr<GcsCredentialProvider> StaticGcsToken(std::string token, std::string source);

// Credentials given explicitly (driver options, configure_gcs); at most one of them.
struct GcsCredentialOptions {
  bool anonymous = false;
  std::optional<std::string> token;
  std::optional<std::string> credentials_file;  // a service-account key or authorized_user file
};

// The credentials of a store, the first that applies in the order above. The files are read
// here; the metadata server is asked at the first Token(). InvalidArgument for more than one
// explicit credential, an empty token or file name, or a malformed credentials file (naming it);
// PermissionDenied for a credentials file that cannot be read (naming it and who named it);
// Unimplemented for a credentials file of another type (naming the type); InvalidArgument for a
// token_uri that is not https (plain http is allowed for loopback hosts only).
Result<std::shared_ptr<GcsCredentialProvider>> ResolveGcsCredentials(
    const GcsCredentialOptions& explicit_options, const EnvLookup& env);

// The endpoint STORAGE_EMULATOR_HOST names ("host:port" becomes "http://host:port"; a URL is
// kept, trailing '/' dropped), or nullopt when it is unset or empty.
std::optional<std::string> GcsEmulatorEndpoint(const EnvLookup& env);

// OK when a bearer token may be sent to `endpoint`: over https; over plain http to a loopback
// host (127.0.0.0/8, ::1, localhost); to another plain-http host only with `allow_http_token`
// or when it is the host STORAGE_EMULATOR_HOST names in `env` (as Google's clients trust their
// emulator). Else PermissionDenied naming the endpoint and both ways to allow it: a token sent
// in the clear can be read and replayed by anyone on the path.
Status CheckGcsTokenTransport(std::string_view endpoint, bool allow_http_token,
                              const EnvLookup& env);

// --- Pieces of the chain, exposed for tests. ---

// A credentials file's fields (those of its `type` that tensorstash uses).
struct GcsCredentialsFile {
  std::string type;  // "service_account" or "authorized_user"
  std::string client_email, private_key, private_key_id;  // service_account
  std::string client_id, client_secret, refresh_token;    // authorized_user
  std::string token_uri;  // default https://oauth2.googleapis.com/token
};
// Parses `json` (the file `where`). InvalidArgument naming `where` and the field for bad JSON
// or a missing field; Unimplemented for another type; InvalidArgument for a non-https token_uri
// that is not loopback.
Result<GcsCredentialsFile> ParseGcsCredentialsFile(std::string_view json, std::string_view where);

// The signed JWT a service account exchanges for a token: header {alg RS256, typ JWT, kid},
// claims {iss, scope, aud = token_uri, iat, exp = iat + 3600}, signed with the PEM
// `key.private_key` (EVP_DigestSign, SHA-256). InvalidArgument when the key cannot be read.
Result<std::string> MakeGcsServiceAccountJwt(const GcsCredentialsFile& key, std::string_view scope,
                                             int64_t issued_at_unix_seconds);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_GCS_GCS_CREDENTIALS_H_
