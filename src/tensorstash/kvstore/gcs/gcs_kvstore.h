// GcsKvStore: a KvStore on Google Cloud Storage through its JSON API, the store under
// "gs://bucket/prefix" URLs.
//
//   GcsKvStoreOptions options;
//   options.bucket = "ckpt"; options.prefix = "run1";
//   TS_ASSIGN_OR_RETURN(options.credentials, ResolveGcsCredentials({}, ProcessEnv()));
//   TS_ASSIGN_OR_RETURN(auto store, GcsKvStore::Open(std::move(options)));
//
// Keys are object names under the prefix; a key with a ".tensorstash-uploads" segment is
// InvalidArgument (that folder holds the parts of uploads in progress, which listings skip).
// Requests carry a bearer token (gcs_credentials.h) and go over HttpClient, at most
// `max_concurrent_requests` at once; 408, 429, 5xx and lost connections are retried with
// exponential backoff and jitter (the kit's RunWithRetries), while 404 and 412 are answers.
// Every upload carries its CRC-32C, which the server checks (a multipart upload, or from
// `resumable_min_bytes` on a resumable session and one PUT); an answer
// that does not give back that size and CRC-32C (none at all included) is DataLoss naming the
// object.
//
// Guarantees (KvStoreCapabilities): no rename (a checkpoint commits with a create-only record);
// generations are GCS's generation numbers: ReadRangeAtGeneration sends ifGenerationMatch, and
// an object replaced since Stat is FailedPrecondition naming the key; WriteIfAbsent is an upload
// with ifGenerationMatch=0 (a 412 after a retried request is settled by the nonce the upload
// wrote in the object's metadata: ours means the lost answer was our own create);
// OpenForWrite uploads parts as hidden objects and composes them (below); TryLock is the kit's
// lease.
//
// No quiet degradation: GCS honours preconditions, but emulators may not
// (gcp-storage-emulator ignores ifGenerationMatch). For an endpoint other than Google's, the
// first write of a process to an endpoint and bucket probes the server (it creates one small
// object twice with ifGenerationMatch=0, reads it with ifGenerationMatch=1 and reads a range,
// then deletes it); when a precondition or range is ignored, every write of the store
// (Write, WriteIfAbsent, OpenForWrite, TryLock) is FailedPrecondition saying so, instead of a
// weaker commit. storage.googleapis.com is trusted and not probed. Reads never probe.
//
// Large objects (OpenForWrite): the kit's part uploader cuts the object on a grid of
// `part_size`; each part is uploaded as <prefix>/.tensorstash-uploads/<key>/<id>/<n>.tensorstash-part,
// and Close composes them (in a tree of 32-way composes beyond 32 parts) into the key, checks the
// result's size and CRC-32C against the parts' (Crc32cCombine) and deletes the parts. A crashed
// upload leaves its parts, which ListPendingWrites finds and AbortPendingWrite deletes (and which
// a bucket lifecycle rule on the suffix ".tensorstash-part" can expire). A composite holds at
// most 1024 components: max_parts x part_size bounds an object (32 GiB by default). Bytes
// written with WritableFile::WriteChunkAt go up with the CRC-32C combined from the ones given
// (the server checks it: a wrong one fails the upload) and, when borrowed, straight from the
// writer's memory, uncopied.
//
// Errors name the key and the store: 404 NotFound, 401/403 PermissionDenied (naming the
// credential), a range past the end DataLoss, a server that cannot be reached after the
// retries Unavailable.
//
// Thread-safety: every method may be called from several threads at once.
#ifndef TENSORSTASH_KVSTORE_GCS_GCS_KVSTORE_H_
#define TENSORSTASH_KVSTORE_GCS_GCS_KVSTORE_H_

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/kvstore/gcs/gcs_credentials.h"
#include "tensorstash/kvstore/http/http_client.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

inline constexpr std::string_view kGcsEndpoint = "https://storage.googleapis.com";

struct GcsKvStoreOptions {
  std::string bucket;
  std::string prefix;  // the store's root in the bucket: "" or "a/b" (no leading or trailing '/')
  std::string endpoint = std::string(kGcsEndpoint);  // http(s)://host[:port]
  // Null: ResolveGcsCredentials({}, ProcessEnv()).
  std::shared_ptr<GcsCredentialProvider> credentials;
  std::string user_project;  // requester pays: billed to this project ("" = the bucket's owner)
  HttpClientOptions http;
  int max_concurrent_requests = 32;
  size_t part_size = size_t{32} << 20;  // compose has no minimum part size
  int max_parts = 1024;                 // a composite's component limit
  int list_page_size = 1000;            // objects per listing request (GCS's maximum is 1000)
  // Objects and parts of at least this many bytes go up as single-request resumable uploads
  // (2 requests), smaller ones as multipart uploads (1 request); both carry the CRC-32C.
  size_t resumable_min_bytes = size_t{8} << 20;
  int max_attempts = 8;                 // per request, the first included
  std::chrono::milliseconds initial_backoff{50};
  std::chrono::milliseconds max_backoff{5000};
  // Probe the server before the first write (see above). The registry sets it for every
  // endpoint but Google's.
  bool probe = false;
  // Send the bearer token over plain http to a host that is not loopback. Off, such requests
  // are PermissionDenied before anything is sent, unless the host is STORAGE_EMULATOR_HOST's
  // (CheckGcsTokenTransport). Anonymous stores send no token and are not affected.
  bool allow_http_token = false;
  // How long a lease (TryLock) lasts without renewal; renewed every third of it.
  std::chrono::milliseconds lease_duration = std::chrono::seconds(60);
};

class GcsKvStore final : public KvStore {
 public:
  // InvalidArgument for a malformed bucket name, prefix, endpoint, part size or part count.
  // Sends nothing.
  static Result<std::unique_ptr<GcsKvStore>> Open(GcsKvStoreOptions options);
  ~GcsKvStore() override;

  std::string Describe() const override;  // "gs://bucket/prefix"
  KvStoreCapabilities Capabilities() const override;

  Result<std::string> Read(std::string_view key) override;
  Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) override;
  Result<uint64_t> Size(std::string_view key) override;
  // A file whose reads are pinned to the generation seen at open.
  Result<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view key) override;
  Result<ObjectInfo> Stat(std::string_view key) override;
  Status ReadRangeAtGeneration(std::string_view key, std::string_view generation, uint64_t offset,
                               size_t size, void* dest) override;

  Status Write(std::string_view key, std::string_view value) override;
  // AlreadyExists when the object exists.
  Status WriteIfAbsent(std::string_view key, std::string_view value) override;
  Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view key) override;

  Result<std::vector<std::string>> List(std::string_view prefix) override;
  Result<ListedChildren> ListChildren(std::string_view prefix) override;
  Result<std::vector<ListedObject>> ListWithInfo(std::string_view prefix) override;
  // NotFound when absent.
  Status Delete(std::string_view key) override;
  Status DeletePrefix(std::string_view prefix) override;

  bool SupportsRename() const override { return false; }
  Status RenameDirectory(std::string_view from, std::string_view to) override;

  // Objects are durable once their upload is answered: NotFound for a missing key, else OK.
  Status Sync(std::string_view key) override;
  Status SyncDirectory(std::string_view dir) override;

  // The kit's lease (object_store/lease.h): created with ifGenerationMatch=0, renewed in the
  // background, taken over once expired. FailedPrecondition while another holds it.
  Result<std::unique_ptr<KvLock>> TryLock(std::string_view key) override;

  // The composed uploads under `prefix` that were never finished (their parts are left):
  // id, key and the time of the oldest part.
  Result<std::vector<PendingWrite>> ListPendingWrites(std::string_view prefix) override;
  // Deletes its parts; OK when none are left.
  Status AbortPendingWrite(const PendingWrite& upload) override;

  struct Impl;

 private:
  explicit GcsKvStore(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

// Registers "gs://bucket/prefix" with the store registry. Driver options (each wins over the
// SetGcsDefaults of the longest url_prefix the URL lies under, which win over the environment):
// endpoint, credentials_file (a service-account key or authorized_user file), token,
// anonymous ("true"/"false"), user_project, part_size (bytes), list_page_size; any other name
// is InvalidArgument naming it, and so is more than one of credentials_file, token, anonymous. The endpoint, when none is
// given: STORAGE_EMULATOR_HOST's, else Google's.
Status RegisterGcsKvStore();

// Explicit settings for "gs://" URLs opened through the registry from now on: each set field
// wins over the environment. With `url_prefix` ("gs://bucket" or "gs://bucket/path"), they hold
// for the URLs at or under it only (the longest prefix wins); without, for every other URL. A
// call replaces the settings of the same prefix. InvalidArgument for a prefix that is not a gs://
// URL or more than one credential; the errors of ResolveGcsCredentials for a credentials file
// (read here); nothing changes then.
struct GcsDefaults {
  std::string endpoint;  // "" = not set
  GcsCredentialOptions credentials;
  std::string user_project;
  bool allow_http_token = false;  // GcsKvStoreOptions::allow_http_token
  std::string url_prefix;  // "" = every URL without settings of its own
};
Status SetGcsDefaults(GcsDefaults defaults);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_GCS_GCS_KVSTORE_H_
