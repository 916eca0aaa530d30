// S3KvStore: a KvStore on an S3-compatible object store (AWS S3, SeaweedFS, MinIO, ...), the
// store under "s3://bucket/prefix" URLs.
//
//   S3KvStoreOptions options;
//   options.bucket = "ckpt"; options.prefix = "run1";
//   TS_ASSIGN_OR_RETURN(options.settings, ResolveS3Settings({}, ProcessEnv()));
//   TS_ASSIGN_OR_RETURN(auto store, S3KvStore::Open(std::move(options)));
//
// Keys are object names under the prefix; a key or prefix with a backslash is InvalidArgument
// (SeaweedFS would store it as '/'). Requests are signed with AWS Signature V4 (sigv4.h)
// and sent over HttpClient (http/http_client.h), at most `max_concurrent_requests` at once;
// 5xx answers, SlowDown and lost connections are retried with exponential backoff and jitter,
// while 304 and 412 are answers and never retried. Every PUT and part carries its CRC-32C
// (x-amz-checksum-crc32c) and is sent as UNSIGNED-PAYLOAD: the bytes are not hashed with
// SHA-256 for the signature unless `sign_payload` (TENSORSTASH_S3_SIGN_PAYLOAD=1), which only
// adds protection against tampering on an unencrypted (http://) path.
//
// What differs from a file system (KvStoreCapabilities says it to the engine):
//  - no rename: a checkpoint commits with a create-only commit record instead;
//  - an object written through OpenForWrite appears whole when the file is synced or closed,
//    never before; it goes up in parts on a fixed grid of `part_size` bytes (multipart upload)
//    as soon as each part's range is written, so memory stays at a few parts per file and an
//    object may exceed 5 GB; a file smaller than one part is one PUT;
//  - generations are ETags: ReadRangeAtGeneration sends If-Match, and an object replaced since
//    Stat is FailedPrecondition naming the key;
//  - WriteIfAbsent is a PUT with If-None-Match: *;
//  - TryLock is a lease object renewed in the background (see TryLock below).
// With `probe` (OpenStoreOptions::create through the registry), the store checks that the server
// honours conditional writes and range requests, and reports what it found in Capabilities():
// a server that ignores them (rclone's "serve s3") is then refused conditional writes
// (FailedPrecondition saying why) instead of being trusted. The probe (it writes, reads and
// deletes one small object) is lazy and kept for the process: it runs at the first Capabilities(),
// WriteIfAbsent or TryLock of the first such store on an endpoint and bucket, and later stores
// on that endpoint and bucket use what it found. (The engine asks Capabilities() when a save
// starts, to choose its commit protocol, so the first save on a bucket probes; later saves do
// not.) Open sends nothing.
//
// Built from the object-store kit (kvstore/object_store/): its request slots, retry runner,
// part uploader and lease; the AWS credential chain caches through its CachedCredential.
//
// Errors name the key and the store: 404 NotFound, 403 PermissionDenied (with the server's
// code: InvalidAccessKeyId, SignatureDoesNotMatch, AccessDenied), a range past the end DataLoss,
// a server that cannot be reached after the retries Unavailable.
//
// Thread-safety: every method may be called from several threads at once.
#ifndef TENSORSTASH_KVSTORE_S3_S3_KVSTORE_H_
#define TENSORSTASH_KVSTORE_S3_S3_KVSTORE_H_

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/kvstore/http/http_client.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/kvstore/s3/aws_config.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct S3KvStoreOptions {
  std::string bucket;
  std::string prefix;  // the store's root in the bucket: "" or "a/b" (no leading or trailing '/')
  S3Settings settings;
  // Null: the standard chain (DefaultCredentialChain) for settings.profile.
  std::shared_ptr<AwsCredentialProvider> credentials;
  HttpClientOptions http;
  int max_concurrent_requests = 32;
  // Sign every body's SHA-256 (else UNSIGNED-PAYLOAD; the CRC-32C header is sent either way).
  bool sign_payload = false;
  // The multipart grid: parts of this size (at least 5 MiB, S3's minimum); 10,000 parts make
  // the largest object 10,000 x part_size.
  size_t part_size = size_t{16} << 20;
  int list_page_size = 1000;  // keys per listing request (S3's maximum is 1000)
  int max_attempts = 8;       // per request, the first included
  std::chrono::milliseconds initial_backoff{50};
  std::chrono::milliseconds max_backoff{5000};
  // Check that the server honours If-None-Match, If-Match and Range (writes and deletes one
  // small object under the prefix), once per endpoint and bucket in the process, when first needed.
  bool probe = false;
  // How long a lease (TryLock) lasts without renewal; renewed every third of it.
  std::chrono::milliseconds lease_duration = std::chrono::seconds(60);
};

class S3KvStore final : public KvStore {
 public:
  // InvalidArgument for an empty or malformed bucket name or prefix. Sends nothing; with `probe`,
  // the probe's failures (PermissionDenied for wrong credentials, NotFound for a missing bucket)
  // come from the first WriteIfAbsent or TryLock.
  static Result<std::unique_ptr<S3KvStore>> Open(S3KvStoreOptions options);
  ~S3KvStore() override;

  std::string Describe() const override;  // "s3://bucket/prefix"
  KvStoreCapabilities Capabilities() const override;

  Result<std::string> Read(std::string_view key) override;
  Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) override;
  Result<uint64_t> Size(std::string_view key) override;
  Result<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view key) override;
  Result<ObjectInfo> Stat(std::string_view key) override;
  Status ReadRangeAtGeneration(std::string_view key, std::string_view generation, uint64_t offset,
                               size_t size, void* dest) override;

  Status Write(std::string_view key, std::string_view value) override;
  Status WriteIfAbsent(std::string_view key, std::string_view value) override;
  Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view key) override;

  Result<std::vector<std::string>> List(std::string_view prefix) override;
  Result<ListedChildren> ListChildren(std::string_view prefix) override;
  // From the listing alone: <Size>, <ETag> (the generation, as HEAD gives it) and
  // <LastModified> (the epoch when a server sends none or one that does not parse).
  Result<std::vector<ListedObject>> ListWithInfo(std::string_view prefix) override;
  // NotFound when absent (a HEAD first: S3's DELETE answers 204 for a missing key too).
  Status Delete(std::string_view key) override;
  Status DeletePrefix(std::string_view prefix) override;

  bool SupportsRename() const override { return false; }
  Status RenameDirectory(std::string_view from, std::string_view to) override;

  // Objects are durable once their upload is answered: NotFound for a missing key, else OK.
  Status Sync(std::string_view key) override;
  Status SyncDirectory(std::string_view dir) override;

  // A lease: the object `key` is created with If-None-Match (holder, expiry) and rewritten
  // every third of `lease_duration` by a background thread; destroying the lock deletes it. A
  // lease whose holder stopped renewing it (a crashed process) is taken over once it expired.
  // FailedPrecondition ("... is locked by another manager ...") while another holds it.
  Result<std::unique_ptr<KvLock>> TryLock(std::string_view key) override;

  // The multipart uploads started under `prefix` (of this store): id, key and Initiated time.
  Result<std::vector<PendingWrite>> ListPendingWrites(std::string_view prefix) override;
  // Aborts one (its parts are deleted); OK when the server no longer knows it.
  Status AbortPendingWrite(const PendingWrite& upload) override;

  struct Impl;

 private:
  explicit S3KvStore(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

// Registers "s3://bucket/prefix" with the store registry. A store's settings, each from the
// first source that has it: OpenStoreOptions::driver_options (endpoint, region, path_style,
// profile, access_key_id + secret_access_key [+ session_token], anonymous; "true"/"false" for
// the flags; any other name is InvalidArgument naming it); the SetS3Defaults of the longest
// url_prefix the URL lies under; the environment and AWS config files (ResolveS3Settings).
// Credentials: the options' keys or anonymous, else the defaults', else the standard chain. A
// store opened with OpenStoreOptions::create probes the server (lazily, see above).
Status RegisterS3KvStore();

// Explicit settings for "s3://" URLs opened through the registry from now on
// (tensorstash.configure_s3 in Python): each set field wins over the environment and the AWS
// config files; `credentials`, when not null, replaces the standard chain. With `url_prefix`
// ("s3://bucket" or "s3://bucket/path"), they hold for the URLs at or under it only (the longest
// prefix wins; "s3://b" covers "s3://b/run", not "s3://bb"); without, for every other URL. A call
// replaces the settings of the same prefix. InvalidArgument for settings that do not resolve (a
// malformed endpoint) or a prefix that is not an s3:// URL, and nothing changes then.
struct S3Defaults {
  S3SettingsOverrides settings;
  std::shared_ptr<AwsCredentialProvider> credentials;
  std::string url_prefix;  // "" = every URL without settings of its own
};
Status SetS3Defaults(S3Defaults defaults);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_S3_S3_KVSTORE_H_
