#include "tensorstash/kvstore/s3/s3_kvstore.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include "tensorstash/kvstore/object_store/driver_options.h"
#include "tensorstash/kvstore/object_store/lease.h"
#include "tensorstash/kvstore/object_store/part_uploader.h"
#include "tensorstash/kvstore/object_store/pinned_file.h"
#include "tensorstash/kvstore/object_store/probe.h"
#include "tensorstash/kvstore/object_store/ranged_read.h"
#include "tensorstash/kvstore/object_store/request_slots.h"
#include "tensorstash/kvstore/object_store/retry.h"
#include "tensorstash/kvstore/object_store/scoped_defaults.h"
#include "tensorstash/kvstore/registry.h"
#include "tensorstash/kvstore/s3/aws_config.h"
#include "tensorstash/kvstore/s3/s3_xml.h"
#include "tensorstash/kvstore/s3/sigv4.h"
#include "tensorstash/util/base64.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

constexpr size_t kMinPartSize = size_t{5} << 20;
constexpr int kMaxParts = 10000;

// x-amz-checksum-crc32c: the big-endian CRC-32C of the body, in base64.
std::string Crc32cHeaderValue(std::string_view body) { return Crc32cBase64(Crc32c(body)); }

std::string Md5Hex(std::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(data.data(), data.size(), digest, &length, EVP_md5(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < length; ++i) {
    out += kHex[digest[i] >> 4];
    out += kHex[digest[i] & 15];
  }
  return out;
}

// S3's bucket naming rules, the part that keeps a name a safe host label and path segment.
bool IsValidBucketName(std::string_view name) {
  if (name.size() < 3 || name.size() > 63) return false;
  for (char c : name) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '.' || c == '_')) {
      return false;
    }
  }
  return name.front() != '-' && name.front() != '.' && name.back() != '-' && name.back() != '.';
}

// One S3 request, before signing.
struct S3Call {
  S3Call(std::string method_in, std::string object_in, std::string_view body_in = {})
      : method(std::move(method_in)), object(std::move(object_in)), body(body_in) {}
  std::string method;
  std::string object;  // the full object name in the bucket; "" for a request on the bucket
  std::vector<std::pair<std::string, std::string>> query;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string_view body;
  char* dest = nullptr;
  size_t dest_size = 0;
};

// S3 takes any UTF-8 in a key, but SeaweedFS stores a backslash as '/': an object written as
// "a\b" is read back, listed and deleted as "a/b", so a step written under such a name is found
// empty. Keys and prefixes with a backslash are therefore refused before anything is sent (AWS
// lists it among the characters to avoid in keys, too).
Status RefuseBackslash(std::string_view what, std::string_view name, std::string_view where) {
  if (name.find('\\') == std::string_view::npos) return OkStatus();
  return InvalidArgumentError(StrCat(
      "the ", what, " '", name, "' in ", where,
      " has a backslash, which tensorstash refuses in S3 keys: some S3 servers (SeaweedFS) "
      "store it as '/', so the object would be written, listed and read under another name"));
}

}  // namespace

struct S3KvStore::Impl {
  S3KvStoreOptions options;
  std::unique_ptr<HttpClient> client;
  // Part buffers reused across the files of a save (OpenForWrite); 4 kept at most.
  std::shared_ptr<PartBufferPool> part_buffers;
  std::string scheme;  // "http" or "https"
  std::string host;    // "host:port" of the endpoint
  std::string root;    // options.prefix + "/", or ""
  bool sign_payload = false;
  std::unique_ptr<RequestSlots> slots;
  RetryPolicy retry;
  // What the probe found (all true without a probe: the server is trusted). Guarded by probe_mu
  // until `probed`; the probe runs at most once per endpoint and bucket in the process
  // (EnsureProbed).
  std::mutex probe_mu;
  bool probed = false;
  bool probe_tried = false;  // by this store, successfully or not
  bool conditional_write = true;
  bool generations = true;
  std::string probe_finding;  // why a capability is off, for errors

  std::string Describe() const {
    return options.prefix.empty() ? StrCat("s3://", options.bucket)
                                  : StrCat("s3://", options.bucket, "/", options.prefix);
  }
  std::string Object(std::string_view key) const { return StrCat(root, key); }
  // ValidateKey / ValidatePrefix, and no backslash (RefuseBackslash).
  Status CheckKey(std::string_view key) const {
    TS_RETURN_IF_ERROR(ValidateKey(key));
    return RefuseBackslash("key", key, Describe());
  }
  Status CheckPrefix(std::string_view prefix) const {
    TS_RETURN_IF_ERROR(ValidatePrefix(prefix));
    return RefuseBackslash("prefix", prefix, Describe());
  }
  std::string Where(std::string_view key) const { return StrCat("'", key, "' in ", Describe()); }

  // The URL and the path to sign for `object` ("" = the bucket).
  void Locate(std::string_view object, std::string* url, std::string* path,
              std::string* host_header) const {
    if (options.settings.path_style) {
      *path =
          object.empty() ? StrCat("/", options.bucket) : StrCat("/", options.bucket, "/", object);
      *host_header = host;
    } else {
      *path = StrCat("/", object);
      *host_header = StrCat(options.bucket, ".", host);
    }
    *url = StrCat(scheme, "://", *host_header, AwsUriEncode(*path, false));
  }

  static bool Retryable(long status, const std::string& body) {
    if (status == 500 || status == 502 || status == 503 || status == 504 || status == 429) {
      return true;
    }
    // Two conditional writes of one key at once: AWS asks the loser to retry.
    return status == 409 && body.find("ConditionalRequestConflict") != std::string::npos;
  }

  // Sends `call`, signed, retrying what is worth retrying (Retryable, and a connection lost or
  // refused) with the kit's runner. `attempts` (optional) gets how many were made. Any final
  // HTTP status is returned for the caller to judge.
  Result<HttpResponse> Send(const S3Call& call, std::string_view what, int* attempts = nullptr) {
    std::string url;
    std::string path;
    std::string host_header;
    Locate(call.object, &url, &path, &host_header);
    if (!call.query.empty()) url += "?" + CanonicalQueryString(call.query);
    const std::string payload_hash = sign_payload ? Sha256Hex(call.body) : kUnsignedPayload;
    Status fatal;  // a failure before sending (credentials, signing): never retried
    const std::function<Result<HttpResponse>()> once = [&]() -> Result<HttpResponse> {
      HttpRequest request;
      request.method = call.method;
      request.url = url;
      request.body = call.body;
      request.dest = call.dest;
      request.dest_size = call.dest_size;
      request.headers = call.headers;
      request.headers.emplace_back("host", host_header);
      Result<AwsCredentials> got = options.credentials->Get();
      if (absl::IsNotFound(got.status())) {
        // No credentials anywhere: a refusal, never "no such checkpoint".
        return fatal = PermissionDeniedError(StrCat(what, ": ", got.status().message()));
      }
      if (!got.ok()) return fatal = got.status();
      if (!got->access_key_id.empty()) {
        SigV4Request to_sign{.method = call.method,
                             .path = path,
                             .query = call.query,
                             .headers = request.headers,
                             .payload_sha256 = payload_hash};
        Result<std::vector<std::pair<std::string, std::string>>> signature =
            SignV4(to_sign, *got, options.settings.region, AmzDateNow());
        if (!signature.ok()) return fatal = signature.status();
        for (auto& header : *signature) request.headers.push_back(std::move(header));
      }
      RequestSlot slot(*slots);
      return client->Perform(request, what);
    };
    const RetryClassifier<HttpResponse> classify =
        [&](const Result<HttpResponse>& outcome) -> std::optional<Status> {
      if (!fatal.ok()) return std::nullopt;
      if (!outcome.ok()) {
        // A reset or refused connection: again.
        if (absl::IsUnavailable(outcome.status())) return outcome.status();
        return std::nullopt;
      }
      if (Retryable(outcome->status, outcome->body)) {
        return UnavailableError(StrCat(what, ": HTTP ", outcome->status));
      }
      return std::nullopt;  // an answer, 304 and 412 included
    };
    return RunWithRetries<HttpResponse>(retry, once, classify, attempts);
  }

  // The status for an answer that is not a success.
  Status ErrorFor(const HttpResponse& response, std::string_view what, std::string_view key) const {
    const S3Error error = ParseS3Error(response.body);
    const std::string detail =
        error.code.empty() ? StrCat("HTTP ", response.status)
                           : StrCat(error.code, (error.message.empty() ? "" : ": "), error.message);
    switch (response.status) {
      case 404:
        if (error.code == "NoSuchBucket") {
          return NotFoundError(StrCat(what, ": the bucket '", options.bucket, "' does not exist"));
        }
        return NotFoundError(StrCat(what, ": ", Where(key), " does not exist"));
      case 401:
      case 403:
        return PermissionDeniedError(StrCat(what, ": ", Describe(), " refused the request (",
                                            detail, "); check the credentials (",
                                            options.credentials->Describe(), ")"));
      case 412:
        return FailedPreconditionError(StrCat(what, ": a condition failed on ", Where(key)));
      case 416:
        return DataLossError(StrCat(what, ": ", Where(key), " is truncated (", detail, ")"));
      case 400:
        return InvalidArgumentError(StrCat(what, ": ", Describe(), " refused it (", detail, ")"));
      default:
        if (response.status >= 500 || response.status == 429) {
          return UnavailableError(StrCat(what, ": ", Describe(), " answered ", detail));
        }
        return UnknownError(StrCat(what, ": ", Describe(), " answered ", detail));
    }
  }

  Result<std::string> ReadWhole(std::string_view key) {
    std::string text;
    TS_RETURN_IF_ERROR(Get(key, 0, 0, nullptr, &text, ""));
    return text;
  }

  // A GET of `key` (a range when `size` > 0), with If-Match when `etag` is not empty.
  Status Get(std::string_view key, uint64_t offset, size_t size, void* dest, std::string* text,
             std::string_view etag) {
    TS_RETURN_IF_ERROR(CheckKey(key));
    const std::string what = StrCat("reading ", Where(key));
    S3Call call("GET", Object(key));
    if (size > 0) {
      call.headers.emplace_back("range", StrCat("bytes=", offset, "-", offset + size - 1));
      call.dest = static_cast<char*>(dest);
      call.dest_size = size;
    }
    if (!etag.empty()) call.headers.emplace_back("if-match", std::string(etag));
    TS_ASSIGN_OR_RETURN(HttpResponse response, Send(call, what));
    if (response.status == 200 || response.status == 206) {
      TS_RETURN_IF_ERROR(CheckRangedAnswer({.status = response.status,
                                            .content_range = response.Header("content-range"),
                                            .content_length = response.Header("content-length"),
                                            .received = response.received,
                                            .overflow = response.overflow},
                                           offset, size, what, Describe()));
    } else if (response.status == 412 && !etag.empty()) {
      return FailedPreconditionError(StrCat(what, ": the object was replaced after it was ",
                                            "committed (its ETag is no longer ", etag, ")"));
    } else {
      return ErrorFor(response, what, key);
    }
    if (text != nullptr) *text = std::move(response.body);
    return OkStatus();
  }

  Result<ObjectInfo> Head(std::string_view key) {
    TS_RETURN_IF_ERROR(CheckKey(key));
    const std::string what = StrCat("looking up ", Where(key));
    TS_ASSIGN_OR_RETURN(HttpResponse response, Send(S3Call("HEAD", Object(key)), what));
    if (response.status != 200) return ErrorFor(response, what, key);
    ObjectInfo info;
    if (!ParseInt(response.Header("content-length"), &info.size)) {
      return DataLossError(StrCat(what, ": the answer has no Content-Length"));
    }
    info.generation = response.Header("etag");
    return info;
  }

  // A PUT of a whole object; with `if_absent`, If-None-Match: * (AlreadyExists when it exists).
  Status Put(std::string_view key, std::string_view value, bool if_absent) {
    TS_RETURN_IF_ERROR(CheckKey(key));
    const std::string what = StrCat("writing ", Where(key));
    S3Call call("PUT", Object(key), value);
    call.headers.emplace_back("content-length", std::to_string(value.size()));
    call.headers.emplace_back("x-amz-checksum-crc32c", Crc32cHeaderValue(value));
    if (if_absent) call.headers.emplace_back("if-none-match", "*");
    int attempts = 0;
    TS_ASSIGN_OR_RETURN(HttpResponse response, Send(call, what, &attempts));
    if (response.status == 200) return OkStatus();
    if (if_absent && (response.status == 412 || response.status == 409)) {
      if (attempts > 1) {
        // An earlier attempt may have created it before its answer was lost: then it is ours,
        // byte for byte (a single PUT's ETag is the MD5 of its bytes).
        Result<ObjectInfo> info = Head(key);
        if (info.ok() && info->generation == StrCat("\"", Md5Hex(value), "\"")) return OkStatus();
      }
      return AlreadyExistsError(StrCat(what, ": it already exists"));
    }
    return ErrorFor(response, what, key);
  }

  Result<S3ListPage> ListPage(const std::string& full_prefix, bool delimiter,
                              const std::string& token) {
    S3Call call("GET", "");
    call.query = {{"list-type", "2"}, {"prefix", full_prefix}, {"encoding-type", "url"}};
    if (delimiter) call.query.emplace_back("delimiter", "/");
    if (options.list_page_size != 1000) {
      call.query.emplace_back("max-keys", std::to_string(options.list_page_size));
    }
    if (!token.empty()) call.query.emplace_back("continuation-token", token);
    const std::string what = StrCat("listing '", full_prefix, "' in s3://", options.bucket);
    TS_ASSIGN_OR_RETURN(HttpResponse response, Send(call, what));
    if (response.status != 200) return ErrorFor(response, what, full_prefix);
    return ParseListObjectsV2(response.body, what);
  }

  // Every object (and with `delimiter`, every common prefix) under `prefix` of this store.
  Status ListAll(std::string_view prefix, bool delimiter, std::vector<S3ListedObject>* objects,
                 std::vector<std::string>* prefixes) {
    TS_RETURN_IF_ERROR(CheckPrefix(prefix));
    const std::string full = Object(prefix);
    std::string token;
    do {
      TS_ASSIGN_OR_RETURN(S3ListPage page, ListPage(full, delimiter, token));
      for (S3ListedObject& object : page.objects) {
        if (!object.key.starts_with(root)) continue;
        object.key.erase(0, root.size());
        objects->push_back(std::move(object));
      }
      if (prefixes != nullptr) {
        for (std::string& p : page.common_prefixes) {
          if (p.starts_with(root)) prefixes->push_back(p.substr(root.size()));
        }
      }
      if (page.truncated && page.next_continuation_token.empty()) {
        return DataLossError(StrCat("listing '", full, "' in s3://", options.bucket,
                                    ": a truncated page without a continuation token"));
      }
      token = page.truncated ? page.next_continuation_token : "";
    } while (!token.empty());
    return OkStatus();
  }

  Status DeleteObject(std::string_view key) {
    const std::string what = StrCat("deleting ", Where(key));
    TS_ASSIGN_OR_RETURN(HttpResponse response, Send(S3Call("DELETE", Object(key)), what));
    if (response.status == 204 || response.status == 200 || response.status == 404) {
      return OkStatus();
    }
    return ErrorFor(response, what, key);
  }

  // Checks what the server honours, with one small object of its own (deleted after).
  Result<ProbeFindings> Probe() {
    ProbeFindings found;
    // Some servers create a missing bucket on the first PUT: ask first.
    const std::string what = StrCat("opening ", Describe());
    TS_ASSIGN_OR_RETURN(HttpResponse bucket, Send(S3Call("HEAD", ""), what));
    if (bucket.status == 404) {
      return NotFoundError(StrCat(what, ": the bucket '", options.bucket, "' does not exist"));
    }
    if (bucket.status != 200) return ErrorFor(bucket, what, "");
    const std::string key = StrCat(".tensorstash-probe-", RandomHexId());
    TS_RETURN_IF_ERROR(Put(key, "0123456789", /*if_absent=*/true));
    std::vector<std::string> missing;
    char range[3] = {};
    Status ranged = Get(key, 2, 3, range, nullptr, "");
    if (!ranged.ok() || std::string_view(range, 3) != "234") {
      found.generations = false;
      missing.push_back("Range (partial reads)");
    }
    Status again = Put(key, "again", /*if_absent=*/true);
    if (again.ok()) {
      found.conditional_write = false;
      missing.push_back("If-None-Match (create-only writes)");
    } else if (!absl::IsAlreadyExists(again)) {
      (void)DeleteObject(key);
      return again;
    }
    Status pinned = Get(key, 0, 0, nullptr, nullptr, "\"00000000000000000000000000000000\"");
    if (pinned.ok()) {
      found.generations = false;
      missing.push_back("If-Match (reads of one version)");
    }
    TS_RETURN_IF_ERROR(DeleteObject(key));
    if (!missing.empty()) {
      found.finding = StrCat("the server at ", options.settings.endpoint, " (bucket '",
                             options.bucket, "') does not honour ", StrJoin(missing, ", "),
                             " (probed once per process)");
    }
    return found;
  }

  // Runs the probe when the store was opened with `probe` and this process has not probed its
  // endpoint and bucket yet (the kit's ProbeOnce); else uses what the earlier probe found. A
  // failed probe is not kept (the next call probes again) and is returned.
  Status EnsureProbed() {
    if (!options.probe) return OkStatus();
    std::lock_guard<std::mutex> lock(probe_mu);
    if (probed) return OkStatus();
    probe_tried = true;
    TS_ASSIGN_OR_RETURN(ProbeFindings found,
                        ProbeOnce(ProbeKey{"s3", options.settings.endpoint, options.bucket},
                                  [this] { return Probe(); }));
    conditional_write = found.conditional_write;
    generations = found.generations;
    probe_finding = found.finding;
    probed = true;
    return OkStatus();
  }

  // A create-only PUT, refused on a server that the probe found ignores If-None-Match.
  Status WriteIfAbsent(std::string_view key, std::string_view value) {
    TS_RETURN_IF_ERROR(EnsureProbed());
    {
      std::lock_guard<std::mutex> lock(probe_mu);
      if (!conditional_write) {
        return FailedPreconditionError(StrCat("creating ", Where(key),
                                              " only if absent is not possible: ", probe_finding));
      }
    }
    return Put(key, value, /*if_absent=*/true);
  }

  // Drops a multipart upload and its parts; OK when the server no longer knows it.
  Status AbortUpload(std::string_view key, const std::string& upload_id) {
    const std::string what = StrCat("aborting the upload of ", Where(key));
    S3Call call("DELETE", Object(key));
    call.query = {{"uploadId", upload_id}};
    TS_ASSIGN_OR_RETURN(HttpResponse response, Send(call, what));
    if (response.status == 204 || response.status == 200 || response.status == 404) {
      return OkStatus();
    }
    return ErrorFor(response, what, key);
  }
};

namespace {

// How one object goes up in parts (the kit's part uploader cuts and schedules them): S3's
// multipart upload, or one PUT for an object no larger than a part.
class S3PartSink final : public PartSink {
 public:
  S3PartSink(std::shared_ptr<S3KvStore::Impl> impl, std::string key)
      : impl_(std::move(impl)), key_(std::move(key)) {}

  std::string Where() const override { return impl_->Where(key_); }

  Result<std::string> BeginUpload() override {
    const std::string what = StrCat("starting the upload of ", impl_->Where(key_));
    S3Call call("POST", impl_->Object(key_));
    call.query = {{"uploads", ""}};
    TS_ASSIGN_OR_RETURN(HttpResponse response, impl_->Send(call, what));
    if (response.status != 200) return impl_->ErrorFor(response, what, key_);
    return ParseInitiateMultipartUpload(response.body, what);
  }

  Result<std::string> PutPart(const std::string& upload_id, int number,
                              std::string_view bytes) override {
    const std::string what = StrCat("uploading part ", number, " of ", impl_->Where(key_));
    S3Call call("PUT", impl_->Object(key_), bytes);
    call.query = {{"partNumber", std::to_string(number)}, {"uploadId", upload_id}};
    call.headers.emplace_back("content-length", std::to_string(bytes.size()));
    call.headers.emplace_back("x-amz-checksum-crc32c", Crc32cHeaderValue(bytes));
    TS_ASSIGN_OR_RETURN(HttpResponse response, impl_->Send(call, what));
    if (response.status != 200) return impl_->ErrorFor(response, what, key_);
    std::string etag = response.Header("etag");
    if (etag.empty()) return DataLossError(StrCat(what, ": the answer has no ETag"));
    return etag;
  }

  Status Complete(const std::string& upload_id, const std::vector<UploadedPart>& parts,
                  uint64_t size) override {
    std::vector<S3CompletedPart> completed;
    completed.reserve(parts.size());
    for (const UploadedPart& part : parts) completed.push_back({part.number, part.token});
    const std::string body = CompleteMultipartUploadBody(completed);
    const std::string what = StrCat("completing the upload of ", impl_->Where(key_));
    S3Call call("POST", impl_->Object(key_), body);
    call.query = {{"uploadId", upload_id}};
    call.headers.emplace_back("content-length", std::to_string(body.size()));
    int attempts = 0;
    TS_ASSIGN_OR_RETURN(HttpResponse response, impl_->Send(call, what, &attempts));
    if (response.status == 404 && attempts > 1) {
      // An earlier attempt completed it, its answer lost: the upload is gone, the object there.
      Result<ObjectInfo> info = impl_->Head(key_);
      if (info.ok() && info->size == size) return OkStatus();
    }
    if (response.status != 200) return impl_->ErrorFor(response, what, key_);
    return ParseCompleteMultipartUpload(response.body, what).status();
  }

  Status Abort(const std::string& upload_id) override {
    return impl_->AbortUpload(key_, upload_id);
  }

  Status PutWhole(std::string_view bytes) override {
    return impl_->Put(key_, bytes, /*if_absent=*/false);
  }

 private:
  const std::shared_ptr<S3KvStore::Impl> impl_;
  const std::string key_;
};

// What the kit's lease needs, from S3: a create-only PUT, GET, PUT and DELETE.
class S3LeaseOps final : public LeaseOps {
 public:
  explicit S3LeaseOps(std::shared_ptr<S3KvStore::Impl> impl) : impl_(std::move(impl)) {}
  Status CreateIfAbsent(std::string_view key, std::string_view value) override {
    return impl_->WriteIfAbsent(key, value);
  }
  Result<std::string> Read(std::string_view key) override { return impl_->ReadWhole(key); }
  Status Replace(std::string_view key, std::string_view value) override {
    return impl_->Put(key, value, /*if_absent=*/false);
  }
  Status Delete(std::string_view key) override { return impl_->DeleteObject(key); }
  std::string Where(std::string_view key) const override { return impl_->Where(key); }

 private:
  const std::shared_ptr<S3KvStore::Impl> impl_;
};

}  // namespace

S3KvStore::S3KvStore(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
S3KvStore::~S3KvStore() = default;

Result<std::unique_ptr<S3KvStore>> S3KvStore::Open(S3KvStoreOptions options) {
  if (!IsValidBucketName(options.bucket)) {
    return InvalidArgumentError(
        StrCat("'", options.bucket, "' is not a bucket name (3 to 63 of a-z 0-9 . - _)"));
  }
  while (options.prefix.ends_with('/')) options.prefix.pop_back();
  if (!options.prefix.empty()) {
    Status valid = ValidateKey(options.prefix);
    if (!valid.ok()) {
      return InvalidArgumentError(StrCat("the prefix of s3://", options.bucket, "/", options.prefix,
                                         ": ", valid.message()));
    }
    TS_RETURN_IF_ERROR(
        RefuseBackslash("prefix", options.prefix, StrCat("s3://", options.bucket)));
  }
  if (options.part_size < kMinPartSize) {
    return InvalidArgumentError(
        StrCat("an S3 part size of ", options.part_size, " bytes is below S3's minimum of 5 MiB"));
  }
  auto impl = std::make_shared<Impl>();
  const std::string& endpoint = options.settings.endpoint;
  const size_t colon = endpoint.find("://");
  if (colon == std::string::npos || endpoint.size() == colon + 3) {
    return InvalidArgumentError(
        StrCat("'", endpoint, "' is not an endpoint (http(s)://host[:port])"));
  }
  impl->scheme = endpoint.substr(0, colon);
  impl->host = endpoint.substr(colon + 3);
  while (impl->host.ends_with('/')) impl->host.pop_back();
  if (impl->scheme != "http" && impl->scheme != "https") {
    return InvalidArgumentError(StrCat("'", endpoint, "' is not an http:// or https:// endpoint"));
  }
  // The CRC-32C header guards every body against damage; hashing it for the signature too costs
  // ~0.6 CPU-s per GiB (bench/s3.py) and guards only against tampering, which TLS prevents.
  impl->sign_payload = options.sign_payload;
  impl->root = options.prefix.empty() ? "" : options.prefix + "/";
  if (options.credentials == nullptr) {
    TS_ASSIGN_OR_RETURN(
        options.credentials,
        DefaultCredentialChain(options.settings.profile, options.settings.region, ProcessEnv()));
  }
  impl->client = std::make_unique<HttpClient>(options.http);
  impl->slots = std::make_unique<RequestSlots>(options.max_concurrent_requests);
  impl->retry = RetryPolicy{.max_attempts = options.max_attempts,
                            .initial_backoff = options.initial_backoff,
                            .max_backoff = options.max_backoff};
  impl->options = std::move(options);
  impl->part_buffers = std::make_shared<PartBufferPool>(impl->options.part_size, /*max_kept=*/4);
  return std::unique_ptr<S3KvStore>(new S3KvStore(std::move(impl)));
}

std::string S3KvStore::Describe() const { return impl_->Describe(); }

KvStoreCapabilities S3KvStore::Capabilities() const {
  // With `probe`, what the server honours is known here, from this process's one probe of the
  // endpoint and bucket (EnsureProbed). A probe that fails (the server unreachable, the bucket
  // missing) leaves it trusted: the operations that follow report the server's error (and this
  // store does not probe again here, so that an unreachable server costs one round of retries).
  bool tried = false;
  {
    std::lock_guard<std::mutex> lock(impl_->probe_mu);
    tried = impl_->probe_tried;
  }
  if (!tried) (void)impl_->EnsureProbed();
  KvStoreCapabilities caps;
  {
    std::lock_guard<std::mutex> lock(impl_->probe_mu);
    caps.conditional_write = impl_->conditional_write;
    caps.generations = impl_->generations;
  }
  caps.locks = true;
  caps.object_store = true;
  return caps;
}

Result<std::string> S3KvStore::Read(std::string_view key) {
  std::string text;
  TS_RETURN_IF_ERROR(impl_->Get(key, 0, 0, nullptr, &text, ""));
  return text;
}

Status S3KvStore::ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) {
  if (size == 0) {
    TS_ASSIGN_OR_RETURN(uint64_t length, Size(key));
    if (offset > length) {
      return DataLossError(StrCat(impl_->Where(key), " is truncated: it ends at ", length,
                                  ", before offset ", offset));
    }
    return OkStatus();
  }
  return impl_->Get(key, offset, size, dest, nullptr, "");
}

Result<uint64_t> S3KvStore::Size(std::string_view key) {
  TS_ASSIGN_OR_RETURN(ObjectInfo info, impl_->Head(key));
  return info.size;
}

Result<ObjectInfo> S3KvStore::Stat(std::string_view key) { return impl_->Head(key); }

Status S3KvStore::ReadRangeAtGeneration(std::string_view key, std::string_view generation,
                                        uint64_t offset, size_t size, void* dest) {
  if (size == 0) {
    TS_ASSIGN_OR_RETURN(ObjectInfo info, Stat(key));
    if (info.generation != generation) {
      return FailedPreconditionError(StrCat("reading ", impl_->Where(key),
                                            ": the object was replaced (its ETag is no longer ",
                                            generation, ")"));
    }
    if (offset > info.size) {
      return DataLossError(StrCat(impl_->Where(key), " is truncated: it ends at ", info.size,
                                  ", before offset ", offset));
    }
    return OkStatus();
  }
  return impl_->Get(key, offset, size, dest, nullptr, generation);
}

Result<std::unique_ptr<ReadableFile>> S3KvStore::OpenForRead(std::string_view key) {
  TS_ASSIGN_OR_RETURN(ObjectInfo info, Stat(key));
  // Every read comes from the version seen here (If-Match its ETag).
  return NewPinnedFile(std::move(info), impl_->Where(key),
                       [impl = impl_, key = std::string(key)](uint64_t offset, size_t size,
                                                              void* dest,
                                                              const std::string& etag) {
                         return impl->Get(key, offset, size, dest, nullptr, etag);
                       });
}

Status S3KvStore::Write(std::string_view key, std::string_view value) {
  return impl_->Put(key, value, /*if_absent=*/false);
}

Status S3KvStore::WriteIfAbsent(std::string_view key, std::string_view value) {
  return impl_->WriteIfAbsent(key, value);
}

Result<std::unique_ptr<WritableFile>> S3KvStore::OpenForWrite(std::string_view key) {
  TS_RETURN_IF_ERROR(impl_->CheckKey(key));
  return NewPartUploader(std::make_unique<S3PartSink>(impl_, std::string(key)),
                         {.part_size = impl_->options.part_size,
                          .max_parts = kMaxParts,
                          .buffers = impl_->part_buffers});
}

Result<std::vector<std::string>> S3KvStore::List(std::string_view prefix) {
  std::vector<S3ListedObject> objects;
  TS_RETURN_IF_ERROR(impl_->ListAll(prefix, false, &objects, nullptr));
  std::vector<std::string> keys;
  keys.reserve(objects.size());
  for (S3ListedObject& object : objects) keys.push_back(std::move(object.key));
  std::sort(keys.begin(), keys.end());
  return keys;
}

Result<std::vector<ListedObject>> S3KvStore::ListWithInfo(std::string_view prefix) {
  std::vector<S3ListedObject> objects;
  TS_RETURN_IF_ERROR(impl_->ListAll(prefix, false, &objects, nullptr));
  std::vector<ListedObject> out;
  out.reserve(objects.size());
  for (S3ListedObject& object : objects) {
    ListedObject listed{std::move(object.key), {object.size, std::move(object.etag), {}}};
    if (Result<std::chrono::system_clock::time_point> when =
            ParseAwsTimestamp(object.last_modified);
        when.ok()) {
      listed.info.modified = *when;
    }
    out.push_back(std::move(listed));
  }
  std::sort(out.begin(), out.end(),
            [](const ListedObject& a, const ListedObject& b) { return a.key < b.key; });
  return out;
}

Result<ListedChildren> S3KvStore::ListChildren(std::string_view prefix) {
  std::vector<S3ListedObject> objects;
  ListedChildren children;
  TS_RETURN_IF_ERROR(impl_->ListAll(prefix, true, &objects, &children.prefixes));
  for (S3ListedObject& object : objects) children.keys.push_back(std::move(object.key));
  std::sort(children.keys.begin(), children.keys.end());
  std::sort(children.prefixes.begin(), children.prefixes.end());
  return children;
}

Status S3KvStore::Delete(std::string_view key) {
  TS_RETURN_IF_ERROR(impl_->Head(key).status());
  return impl_->DeleteObject(key);
}

Status S3KvStore::DeletePrefix(std::string_view prefix) {
  TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, List(prefix));
  for (const std::string& key : keys) TS_RETURN_IF_ERROR(impl_->DeleteObject(key));
  return OkStatus();
}

Status S3KvStore::RenameDirectory(std::string_view from, std::string_view to) {
  TS_RETURN_IF_ERROR(impl_->CheckKey(from));
  TS_RETURN_IF_ERROR(impl_->CheckKey(to));
  return UnimplementedError(StrCat("renaming '", from, "' to '", to, "' in ", Describe(),
                                   ": object stores cannot rename"));
}

Status S3KvStore::Sync(std::string_view key) { return impl_->Head(key).status(); }

Status S3KvStore::SyncDirectory(std::string_view dir) {
  TS_RETURN_IF_ERROR(impl_->CheckPrefix(dir));
  if (dir.empty()) return OkStatus();
  // Nothing to make durable; but a folder that holds nothing is NotFound, as on a file system.
  const std::string folder = dir.ends_with('/') ? std::string(dir) : StrCat(dir, "/");
  TS_ASSIGN_OR_RETURN(S3ListPage page, impl_->ListPage(impl_->Object(folder), false, ""));
  if (page.objects.empty()) {
    return NotFoundError(
        StrCat("syncing the folder '", dir, "' in ", Describe(), ": it holds nothing"));
  }
  return OkStatus();
}

Result<std::unique_ptr<KvLock>> S3KvStore::TryLock(std::string_view key) {
  TS_RETURN_IF_ERROR(impl_->CheckKey(key));
  return TakeLease(std::make_shared<S3LeaseOps>(impl_), key,
                   {.duration = impl_->options.lease_duration});
}

Result<std::vector<PendingWrite>> S3KvStore::ListPendingWrites(std::string_view prefix) {
  TS_RETURN_IF_ERROR(impl_->CheckPrefix(prefix));
  std::vector<PendingWrite> uploads;
  std::string key_marker;
  std::string id_marker;
  const std::string what =
      StrCat("listing the unfinished uploads under '", prefix, "' in ", Describe());
  while (true) {
    S3Call call("GET", "");
    call.query = {{"uploads", ""}, {"prefix", impl_->Object(prefix)}, {"encoding-type", "url"}};
    if (!key_marker.empty()) call.query.emplace_back("key-marker", key_marker);
    if (!id_marker.empty()) call.query.emplace_back("upload-id-marker", id_marker);
    TS_ASSIGN_OR_RETURN(HttpResponse response, impl_->Send(call, what));
    if (response.status != 200) return impl_->ErrorFor(response, what, prefix);
    TS_ASSIGN_OR_RETURN(S3UploadsPage page, ParseListMultipartUploads(response.body, what));
    for (S3Upload& upload : page.uploads) {
      if (!upload.key.starts_with(impl_->root)) continue;
      Result<std::chrono::system_clock::time_point> started = ParseAwsTimestamp(upload.initiated);
      uploads.push_back({upload.key.substr(impl_->root.size()), std::move(upload.upload_id),
                         started.ok() ? std::optional(*started) : std::nullopt});
    }
    if (!page.truncated || (page.next_key_marker.empty() && page.next_upload_id_marker.empty())) {
      break;
    }
    key_marker = page.next_key_marker;
    id_marker = page.next_upload_id_marker;
  }
  return uploads;
}

Status S3KvStore::AbortPendingWrite(const PendingWrite& upload) {
  return impl_->AbortUpload(upload.key, upload.id);
}

namespace {

// By URL prefix ("" for every URL).
ScopedDefaults<S3Defaults>& Defaults() {
  static auto* defaults = new ScopedDefaults<S3Defaults>();
  return *defaults;
}

// OpenStoreOptions::driver_options over `defaults` (each given option wins).
Status ApplyDriverOptions(const std::map<std::string, std::string>& given,
                          std::string_view where, S3Defaults* defaults) {
  std::optional<std::string> access_key_id, secret_access_key, session_token;
  bool anonymous = false;
  for (const auto& [name, value] : given) {
    if (name == "endpoint") {
      defaults->settings.endpoint = value;
    } else if (name == "region") {
      defaults->settings.region = value;
    } else if (name == "profile") {
      defaults->settings.profile = value;
    } else if (name == "path_style") {
      TS_ASSIGN_OR_RETURN(bool path_style, ParseBoolOption(name, value, where));
      defaults->settings.path_style = path_style;
    } else if (name == "anonymous") {
      TS_ASSIGN_OR_RETURN(anonymous, ParseBoolOption(name, value, where));
    } else if (name == "access_key_id") {
      access_key_id = value;
    } else if (name == "secret_access_key") {
      secret_access_key = value;
    } else if (name == "session_token") {
      session_token = value;
    }
  }
  if (anonymous) {
    defaults->credentials = AnonymousCredentials();
  } else if (access_key_id.has_value() || secret_access_key.has_value()) {
    if (!access_key_id.has_value() || !secret_access_key.has_value()) {
      return InvalidArgumentError(StrCat("opening ", where,
                                         ": give the store options access_key_id and "
                                         "secret_access_key together, or neither"));
    }
    defaults->credentials =
        StaticCredentials({*access_key_id, *secret_access_key, session_token.value_or("")});
  }
  return OkStatus();
}

}  // namespace

Status SetS3Defaults(S3Defaults defaults) {
  if (!defaults.url_prefix.empty() && !defaults.url_prefix.starts_with("s3://")) {
    return InvalidArgumentError(StrCat("S3 settings for '", defaults.url_prefix,
                                       "': a prefix is an s3:// URL (\"s3://bucket[/path]\")"));
  }
  TS_RETURN_IF_ERROR(ResolveS3Settings(defaults.settings, ProcessEnv()).status());
  while (defaults.url_prefix.ends_with('/')) defaults.url_prefix.pop_back();
  std::string prefix = defaults.url_prefix;
  Defaults().Set(std::move(prefix), std::move(defaults));
  return OkStatus();
}

Status RegisterS3KvStore() {
  return RegisterKvStoreScheme(
      "s3",
      [](std::string_view rest, const OpenStoreOptions& open) -> Result<std::unique_ptr<KvStore>> {
        TS_RETURN_IF_ERROR(CheckDriverOptions(
            "s3", rest, open,
            {"endpoint", "region", "path_style", "profile", "access_key_id", "secret_access_key",
             "session_token", "anonymous"}));
        const std::string url = StrCat("s3://", rest);
        const size_t slash = rest.find('/');
        S3KvStoreOptions options;
        options.bucket = std::string(rest.substr(0, slash));
        options.prefix = slash == std::string_view::npos ? "" : std::string(rest.substr(slash + 1));
        S3Defaults defaults = Defaults().For(url);
        TS_RETURN_IF_ERROR(ApplyDriverOptions(open.driver_options, url, &defaults));
        options.credentials = defaults.credentials;
        TS_ASSIGN_OR_RETURN(options.settings, ResolveS3Settings(defaults.settings, ProcessEnv()));
        // Known once, lazily: the first operation that needs it probes (EnsureProbed).
        options.probe = open.create;
        const char* sign = std::getenv("TENSORSTASH_S3_SIGN_PAYLOAD");
        options.sign_payload = sign != nullptr && std::string_view(sign) == "1";
        TS_ASSIGN_OR_RETURN(std::unique_ptr<S3KvStore> store, S3KvStore::Open(std::move(options)));
        return std::unique_ptr<KvStore>(std::move(store));
      });
}

namespace {
const KvStoreDriverRegistration kRegistered(&RegisterS3KvStore);
}  // namespace

}  // namespace tensorstash
