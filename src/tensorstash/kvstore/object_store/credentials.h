// Credentials for object-store drivers: a provider interface (a credential and when it expires)
// and a cache over it that refreshes before expiry. AWS's provider chain (kvstore/s3/aws_config)
// fetches through it; a GCS bearer-token provider (metadata server, service account) is one more
// CredentialFetcher<BearerToken>.
//
//   CachedCredential<AwsCredentials> cache(std::move(fetcher));
//   TS_ASSIGN_OR_RETURN(AwsCredentials now, cache.Get());
//
// Get() returns the kept credential while more than `refresh_margin` of it is left (one that
// never expires is kept for good); otherwise it fetches a new one. A failed refresh returns the
// kept credential while more than `refresh_grace` is left, and the fetcher's error (annotated
// "refreshing credentials") after that; a failed first fetch returns the fetcher's error, and
// the next Get() tries again.
//
// Thread-safety: Get() may be called from several threads at once; one fetch runs at a time
// (the others wait for it and then use what it got).
#ifndef TENSORSTASH_KVSTORE_OBJECT_STORE_CREDENTIALS_H_
#define TENSORSTASH_KVSTORE_OBJECT_STORE_CREDENTIALS_H_

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "tensorstash/util/status.h"

namespace tensorstash {

template <typename Credential>
struct ExpiringCredential {
  Credential value;
  std::optional<std::chrono::system_clock::time_point> expires;  // none: never expires
};

// Fetches a fresh credential (a network call, a file read). Called under the cache's lock.
template <typename Credential>
class CredentialFetcher {
 public:
  virtual ~CredentialFetcher() = default;
  virtual Result<ExpiringCredential<Credential>> Fetch() = 0;
};

template <typename Credential>
class CachedCredential {
 public:
  using Clock = std::chrono::system_clock;
  struct Options {
    std::chrono::seconds refresh_margin = std::chrono::minutes(5);
    std::chrono::seconds refresh_grace = std::chrono::minutes(1);
    std::function<Clock::time_point()> now = [] { return Clock::now(); };  // tests fake it
  };

  explicit CachedCredential(std::unique_ptr<CredentialFetcher<Credential>> fetcher)
      : CachedCredential(std::move(fetcher), Options()) {}
  CachedCredential(std::unique_ptr<CredentialFetcher<Credential>> fetcher, Options options)
      : fetcher_(std::move(fetcher)), options_(std::move(options)) {}

  Result<Credential> Get() {
    std::lock_guard<std::mutex> lock(mu_);  // held through a fetch: one refresh at a time
    const Clock::time_point now = options_.now();
    if (cached_.has_value() &&
        (!cached_->expires.has_value() || *cached_->expires - now > options_.refresh_margin)) {
      return cached_->value;
    }
    Result<ExpiringCredential<Credential>> fresh = fetcher_->Fetch();
    if (fresh.ok()) {
      cached_ = *std::move(fresh);
      return cached_->value;
    }
    if (!cached_.has_value()) return fresh.status();
    if (*cached_->expires - now > options_.refresh_grace) return cached_->value;
    return Annotate(fresh.status(), "refreshing credentials");
  }

  // The fetcher (under no lock: its own methods must be thread-safe to be called here).
  CredentialFetcher<Credential>* fetcher() const { return fetcher_.get(); }

 private:
  const std::unique_ptr<CredentialFetcher<Credential>> fetcher_;
  const Options options_;
  std::mutex mu_;
  std::optional<ExpiringCredential<Credential>> cached_;  // guarded by mu_
};

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_OBJECT_STORE_CREDENTIALS_H_
