#include "tensorstash/kvstore/s3/s3_kvstore.h"

#include <openssl/evp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "tensorstash/kvstore/registry.h"
#include "tensorstash/kvstore/s3/aws_config.h"
#include "tensorstash/kvstore/s3/s3_xml.h"
#include "tensorstash/kvstore/s3/sigv4.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

constexpr size_t kMinPartSize = size_t{5} << 20;
constexpr int kMaxParts = 10000;

std::string Base64(const unsigned char* data, size_t size) {
  std::string out(4 * ((size + 2) / 3), '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()), data, size);
  out.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return out;
}

// x-amz-checksum-crc32c: the big-endian CRC-32C of the body, in base64.
std::string Crc32cHeaderValue(std::string_view body) {
  const uint32_t crc = Crc32c(body);
  const unsigned char bytes[4] = {
      static_cast<unsigned char>(crc >> 24), static_cast<unsigned char>(crc >> 16),
      static_cast<unsigned char>(crc >> 8), static_cast<unsigned char>(crc)};
  return Base64(bytes, 4);
}

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

// A counting semaphore: the cap on requests in flight.
class RequestSlots {
 public:
  explicit RequestSlots(int count) : free_(std::max(1, count)) {}
  void Acquire() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return free_ > 0; });
    --free_;
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++free_;
    }
    cv_.notify_one();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int free_;
};

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
  std::string scheme;  // "http" or "https"
  std::string host;    // "host:port" of the endpoint
  std::string root;    // options.prefix + "/", or ""
  bool sign_payload = false;
  std::unique_ptr<RequestSlots> slots;
  // What the probe found (all true without a probe: the server is trusted).
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

  std::chrono::milliseconds Backoff(int attempt) const {
    thread_local std::mt19937_64 rng(std::random_device{}());
    const int64_t cap = std::min<int64_t>(options.max_backoff.count(),
                                          options.initial_backoff.count() << std::min(attempt, 20));
    std::uniform_int_distribution<int64_t> jitter(cap / 2, std::max<int64_t>(cap / 2, cap));
    return std::chrono::milliseconds(jitter(rng));
  }

  // Sends `call`, signed, retrying what is worth retrying. `attempts` (optional) gets how many
  // were made. Any final HTTP status is returned for the caller to judge.
  Result<HttpResponse> Send(const S3Call& call, std::string_view what, int* attempts = nullptr) {
    std::string url;
    std::string path;
    std::string host_header;
    Locate(call.object, &url, &path, &host_header);
    if (!call.query.empty()) url += "?" + CanonicalQueryString(call.query);
    const std::string payload_hash = sign_payload ? Sha256Hex(call.body) : kUnsignedPayload;
    Status last = OkStatus();
    for (int attempt = 0; attempt < options.max_attempts; ++attempt) {
      if (attempts != nullptr) *attempts = attempt + 1;
      if (attempt > 0) std::this_thread::sleep_for(Backoff(attempt));
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
        return PermissionDeniedError(StrCat(what, ": ", got.status().message()));
      }
      TS_ASSIGN_OR_RETURN(AwsCredentials credentials, std::move(got));
      if (!credentials.access_key_id.empty()) {
        SigV4Request to_sign{.method = call.method,
                             .path = path,
                             .query = call.query,
                             .headers = request.headers,
                             .payload_sha256 = payload_hash};
        TS_ASSIGN_OR_RETURN(auto signature,
                            SignV4(to_sign, credentials, options.settings.region, AmzDateNow()));
        for (auto& header : signature) request.headers.push_back(std::move(header));
      }
      slots->Acquire();
      Result<HttpResponse> response = client->Perform(request, what);
      slots->Release();
      if (!response.ok()) {
        last = response.status();
        if (absl::IsUnavailable(last)) continue;  // a reset or refused connection: again
        return last;
      }
      if (Retryable(response->status, response->body) && attempt + 1 < options.max_attempts) {
        last = UnavailableError(StrCat(what, ": HTTP ", response->status));
        continue;
      }
      return response;
    }
    return UnavailableError(StrCat(last.message(), " (after ", options.max_attempts, " attempts)"));
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
    // A ranged GET answered 200 that is not the whole object asked for (more bytes than asked,
    // or any part but the start): the server ignored the Range header, or (rclone's "serve s3")
    // sent a part with 200 and a Content-Range, which HTTP gives no meaning to in a 200. Said as
    // what it is, and never FailedPrecondition or NotFound: a committed step's reader takes those
    // for an object replaced or removed after the commit.
    if (size > 0 && response.status == 200 && (response.overflow || offset > 0)) {
      const std::string asked = StrCat("bytes ", offset, "-", offset + size - 1);
      const std::string content_range = response.Header("content-range");
      if (!response.overflow && !content_range.empty()) {
        return UnimplementedError(StrCat(
            what, ": the server answered a request for ", asked, " with 200 and Content-Range '",
            content_range, "' instead of 206 (Partial Content); ", Describe(),
            " does not implement range requests as HTTP specifies them, which reading a "
            "checkpoint needs"));
      }
      const std::string length = response.Header("content-length");
      return UnimplementedError(StrCat(
          what, ": the server ignored the Range header and answered 200 with the whole object",
          length.empty() ? "" : StrCat(" (", length, " bytes)"), " to a request for ", asked, "; ",
          Describe(), " does not support range requests, which reading a checkpoint needs"));
    }
    if (response.overflow) {
      return DataLossError(StrCat(what, ": the server answered HTTP ", response.status,
                                  " with more than the ", size, " bytes asked for (bytes ",
                                  offset, "-", offset + size - 1, ")"));
    }
    if (response.status == 412 && !etag.empty()) {
      return FailedPreconditionError(StrCat(what, ": the object was replaced after it was ",
                                            "committed (its ETag is no longer ", etag, ")"));
    }
    if (response.status != 200 && response.status != 206) {
      return ErrorFor(response, what, key);
    }
    if (size > 0) {
      if (response.received != size) {
        return DataLossError(StrCat(what, " is truncated: ", response.received, " of the ", size,
                                    " bytes at offset ", offset, " exist"));
      }
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
  Status Probe() {
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
      generations = false;
      missing.push_back("Range (partial reads)");
    }
    Status again = Put(key, "again", /*if_absent=*/true);
    if (again.ok()) {
      conditional_write = false;
      missing.push_back("If-None-Match (create-only writes)");
    } else if (!absl::IsAlreadyExists(again)) {
      (void)DeleteObject(key);
      return again;
    }
    Status pinned = Get(key, 0, 0, nullptr, nullptr, "\"00000000000000000000000000000000\"");
    if (pinned.ok()) {
      generations = false;
      missing.push_back("If-Match (reads of one version)");
    }
    TS_RETURN_IF_ERROR(DeleteObject(key));
    if (!missing.empty()) {
      probe_finding =
          StrCat(Describe(), " does not honour ", StrJoin(missing, ", "), " (probed at open)");
    }
    return OkStatus();
  }
};

namespace {

// A file whose reads all come from the version of the object seen at open (If-Match).
class S3ReadableFile final : public ReadableFile {
 public:
  S3ReadableFile(std::shared_ptr<S3KvStore::Impl> impl, std::string key, ObjectInfo info)
      : impl_(std::move(impl)), key_(std::move(key)), info_(std::move(info)) {}
  uint64_t size() const override { return info_.size; }
  Status ReadAt(uint64_t offset, size_t size, void* dest) const override {
    if (offset > info_.size || size > info_.size - offset) {
      return DataLossError(StrCat(impl_->Where(key_), " is truncated: it ends at ", info_.size,
                                  ", before ", offset + size));
    }
    if (size == 0) return OkStatus();
    return impl_->Get(key_, offset, size, dest, nullptr, info_.generation);
  }

 private:
  std::shared_ptr<S3KvStore::Impl> impl_;
  std::string key_;
  ObjectInfo info_;
};

// A file uploaded in parts on a fixed grid: a part goes up as soon as all its bytes are written
// (in any order, from any thread); the rest, and the completion, at Sync or Close. The object
// appears then, whole.
class S3WritableFile final : public WritableFile {
 public:
  S3WritableFile(std::shared_ptr<S3KvStore::Impl> impl, std::string key)
      : impl_(std::move(impl)), key_(std::move(key)), part_size_(impl_->options.part_size) {}
  ~S3WritableFile() override { (void)Close(); }

  Status WriteAt(uint64_t offset, const void* data, size_t size) override {
    const char* bytes = static_cast<const char*>(data);
    while (size > 0) {
      const uint64_t index = offset / part_size_;
      const size_t within = offset % part_size_;
      const size_t length = std::min(size, part_size_ - within);
      if (index >= static_cast<uint64_t>(kMaxParts)) {
        return InvalidArgumentError(StrCat("writing ", impl_->Where(key_), ": offset ", offset,
                                           " is past the largest object of ", kMaxParts,
                                           " parts of ", part_size_, " bytes"));
      }
      char* buffer = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (finished_) {
          return FailedPreconditionError(
              StrCat("writing ", impl_->Where(key_), ": the file was already synced or closed"));
        }
        if (!failed_.ok()) return failed_;
        if (uploaded_.count(index) > 0) {
          return FailedPreconditionError(
              StrCat("writing ", impl_->Where(key_), " at offset ", offset, ": part ", index + 1,
                     " was already uploaded (an object store cannot rewrite it)"));
        }
        Part& part = pending_[index];
        if (part.bytes == nullptr) part.bytes = std::make_unique<char[]>(part_size_);
        buffer = part.bytes.get();
        ++part.writers;
        end_ = std::max<uint64_t>(end_, offset + length);
      }
      std::memcpy(buffer + within, bytes, length);
      std::unique_ptr<char[]> full;
      {
        std::lock_guard<std::mutex> lock(mu_);
        Part& part = pending_[index];
        part.filled += length;
        --part.writers;
        if (part.filled >= part_size_ && part.writers == 0) {
          full = std::move(part.bytes);
          pending_.erase(index);
          uploaded_[index] = "";  // claimed
        }
      }
      if (full != nullptr) {
        Status status = UploadPart(index, std::string_view(full.get(), part_size_));
        if (!status.ok()) {
          std::lock_guard<std::mutex> lock(mu_);
          if (failed_.ok()) failed_ = status;
          return status;
        }
      }
      offset += length;
      bytes += length;
      size -= length;
    }
    return OkStatus();
  }

  Status Sync() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return FailedPreconditionError(StrCat(impl_->Where(key_), " is closed"));
    }
    return Finish();
  }

  Status Close() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return FailedPreconditionError(StrCat(impl_->Where(key_), " is closed"));
      closed_ = true;
    }
    return Finish();
  }

 private:
  struct Part {
    std::unique_ptr<char[]> bytes;
    size_t filled = 0;
    int writers = 0;  // copies into it in progress
  };

  Result<std::string> UploadId() {
    std::lock_guard<std::mutex> lock(upload_mu_);
    if (!upload_id_.empty()) return upload_id_;
    const std::string what = StrCat("starting the upload of ", impl_->Where(key_));
    S3Call call("POST", impl_->Object(key_));
    call.query = {{"uploads", ""}};
    TS_ASSIGN_OR_RETURN(HttpResponse response, impl_->Send(call, what));
    if (response.status != 200) return impl_->ErrorFor(response, what, key_);
    TS_ASSIGN_OR_RETURN(upload_id_, ParseInitiateMultipartUpload(response.body, what));
    return upload_id_;
  }

  Status UploadPart(uint64_t index, std::string_view bytes) {
    TS_ASSIGN_OR_RETURN(std::string upload_id, UploadId());
    const std::string what = StrCat("uploading part ", index + 1, " of ", impl_->Where(key_));
    S3Call call("PUT", impl_->Object(key_), bytes);
    call.query = {{"partNumber", std::to_string(index + 1)}, {"uploadId", upload_id}};
    call.headers.emplace_back("content-length", std::to_string(bytes.size()));
    call.headers.emplace_back("x-amz-checksum-crc32c", Crc32cHeaderValue(bytes));
    TS_ASSIGN_OR_RETURN(HttpResponse response, impl_->Send(call, what));
    if (response.status != 200) return impl_->ErrorFor(response, what, key_);
    const std::string etag = response.Header("etag");
    if (etag.empty()) return DataLossError(StrCat(what, ": the answer has no ETag"));
    std::lock_guard<std::mutex> lock(mu_);
    uploaded_[index] = etag;
    return OkStatus();
  }

  Status Finish() {
    // One finish at a time: a second Sync or Close waits for the first's outcome.
    std::lock_guard<std::mutex> finishing(finish_mu_);
    std::map<uint64_t, Part> rest;
    uint64_t end = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return finish_status_;
      finished_ = true;
      if (!failed_.ok()) return finish_status_ = failed_;
      rest = std::move(pending_);
      end = end_;
    }
    finish_status_ = Complete(std::move(rest), end);
    return finish_status_;
  }

  bool IsUploaded(uint64_t index) {
    std::lock_guard<std::mutex> lock(mu_);
    return uploaded_.count(index) > 0;
  }

  Status Complete(std::map<uint64_t, Part> rest, uint64_t end) {
    bool none_uploaded = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      none_uploaded = uploaded_.empty();
    }
    if (none_uploaded && end <= part_size_) {  // one PUT
      auto it = rest.find(0);
      const std::string_view bytes =
          it == rest.end() ? std::string_view() : std::string_view(it->second.bytes.get(), end);
      return impl_->Put(key_, bytes, /*if_absent=*/false);
    }
    const uint64_t parts = (end + part_size_ - 1) / part_size_;
    std::unique_ptr<char[]> zeros;
    for (uint64_t index = 0; index < parts; ++index) {
      if (IsUploaded(index)) continue;
      const size_t length = index + 1 == parts ? end - index * part_size_ : part_size_;
      auto it = rest.find(index);
      const char* bytes = nullptr;
      if (it != rest.end()) {
        bytes = it->second.bytes.get();
      } else {  // never written: zeros, as a file's gap reads
        if (zeros == nullptr) zeros = std::make_unique<char[]>(part_size_);
        bytes = zeros.get();
      }
      TS_RETURN_IF_ERROR(UploadPart(index, std::string_view(bytes, length)));
      if (it != rest.end()) it->second.bytes.reset();
    }
    std::vector<S3CompletedPart> completed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [index, etag] : uploaded_) {
        completed.push_back({static_cast<int>(index + 1), etag});
      }
    }
    const std::string body = CompleteMultipartUploadBody(completed);
    const std::string what = StrCat("completing the upload of ", impl_->Where(key_));
    S3Call call("POST", impl_->Object(key_), body);
    call.query = {{"uploadId", upload_id_}};
    call.headers.emplace_back("content-length", std::to_string(body.size()));
    int attempts = 0;
    TS_ASSIGN_OR_RETURN(HttpResponse response, impl_->Send(call, what, &attempts));
    if (response.status == 404 && attempts > 1) {
      // An earlier attempt completed it, its answer lost: the upload is gone, the object there.
      Result<ObjectInfo> info = impl_->Head(key_);
      if (info.ok() && info->size == end) return OkStatus();
    }
    if (response.status != 200) return impl_->ErrorFor(response, what, key_);
    return ParseCompleteMultipartUpload(response.body, what).status();
  }

  const std::shared_ptr<S3KvStore::Impl> impl_;
  const std::string key_;
  const size_t part_size_;
  std::mutex mu_;
  std::map<uint64_t, Part> pending_;          // parts being written; guarded by mu_
  std::map<uint64_t, std::string> uploaded_;  // part index -> ETag ("" while uploading); mu_
  uint64_t end_ = 0;                          // guarded by mu_
  bool finished_ = false;                     // guarded by mu_
  bool closed_ = false;                       // guarded by mu_
  Status failed_;                             // guarded by mu_
  std::mutex finish_mu_;
  Status finish_status_;  // guarded by finish_mu_
  std::mutex upload_mu_;
  std::string upload_id_;  // guarded by upload_mu_
};

// The lease behind TryLock.
class S3Lease final : public KvLock {
 public:
  S3Lease(std::shared_ptr<S3KvStore::Impl> impl, std::string key, std::string holder)
      : impl_(std::move(impl)), key_(std::move(key)), holder_(std::move(holder)) {
    renewer_ = std::thread([this] { RenewUntilReleased(); });
  }
  ~S3Lease() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      released_ = true;
    }
    cv_.notify_all();
    renewer_.join();
    if (HeldByUs()) (void)impl_->DeleteObject(key_);  // never a successor's lease
  }

  // Whether the lease object still names this holder (not a successor that took it over).
  bool HeldByUs() const {
    Result<std::string> current = impl_->ReadWhole(key_);
    if (!current.ok()) return false;
    const nlohmann::json parsed = nlohmann::json::parse(*current, nullptr, false);
    return parsed.is_object() && parsed.value("holder", std::string()) == holder_;
  }

  static std::string Record(const std::string& holder, std::chrono::milliseconds duration) {
    const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
    char host[256] = "";
    gethostname(host, sizeof(host) - 1);
    return nlohmann::json{{"holder", holder},
                          {"host", host},
                          {"pid", static_cast<int64_t>(getpid())},
                          {"expires_unix_ms", now + duration.count()}}
        .dump();
  }

 private:
  void RenewUntilReleased() {
    const auto period = impl_->options.lease_duration / 3;
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, period, [&] { return released_; })) {
      lock.unlock();
      // A holder that stalled past its lease may have been taken over: then it stops renewing,
      // rather than overwrite its successor's lease. (The read and the rewrite are two requests:
      // a takeover between them is not detected; docs: a lease, not a fence.)
      if (!HeldByUs()) return;
      (void)impl_->Put(key_, Record(holder_, impl_->options.lease_duration), false);
      lock.lock();
    }
  }

  std::shared_ptr<S3KvStore::Impl> impl_;
  std::string key_;
  std::string holder_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
  std::thread renewer_;
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
  impl->options = std::move(options);
  if (impl->options.probe) TS_RETURN_IF_ERROR(impl->Probe());
  return std::unique_ptr<S3KvStore>(new S3KvStore(std::move(impl)));
}

std::string S3KvStore::Describe() const { return impl_->Describe(); }

KvStoreCapabilities S3KvStore::Capabilities() const {
  KvStoreCapabilities caps;
  caps.conditional_write = impl_->conditional_write;
  caps.generations = impl_->generations;
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
  return std::unique_ptr<ReadableFile>(
      new S3ReadableFile(impl_, std::string(key), std::move(info)));
}

Status S3KvStore::Write(std::string_view key, std::string_view value) {
  return impl_->Put(key, value, /*if_absent=*/false);
}

Status S3KvStore::WriteIfAbsent(std::string_view key, std::string_view value) {
  if (!impl_->conditional_write) {
    return FailedPreconditionError(StrCat(
        "creating ", impl_->Where(key), " only if absent is not possible: ", impl_->probe_finding));
  }
  return impl_->Put(key, value, /*if_absent=*/true);
}

Result<std::unique_ptr<WritableFile>> S3KvStore::OpenForWrite(std::string_view key) {
  TS_RETURN_IF_ERROR(impl_->CheckKey(key));
  return std::unique_ptr<WritableFile>(new S3WritableFile(impl_, std::string(key)));
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
  const std::string holder = RandomHexId();
  const std::string record = S3Lease::Record(holder, impl_->options.lease_duration);
  Status created = WriteIfAbsent(key, record);
  if (absl::IsAlreadyExists(created)) {
    // Held, or left by a holder that died: an expired lease is taken over.
    Result<std::string> current = Read(key);
    if (current.ok()) {
      const nlohmann::json parsed = nlohmann::json::parse(*current, nullptr, false);
      const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
      const bool readable = parsed.is_object() && parsed.contains("expires_unix_ms") &&
                            parsed["expires_unix_ms"].is_number_integer();
      const int64_t expires = readable ? parsed["expires_unix_ms"].get<int64_t>() : 0;
      if (readable && expires > now) {
        return FailedPreconditionError(StrCat(
            impl_->Where(key), " is locked by another manager (host ",
            parsed.value("host", std::string("?")), ", pid ", parsed.value("pid", int64_t{0}),
            ", lease valid for ", (expires - now) / 1000, " s more)"));
      }
      TS_RETURN_IF_ERROR(impl_->DeleteObject(key));
      created = WriteIfAbsent(key, record);
    } else if (absl::IsNotFound(current.status())) {
      created = WriteIfAbsent(key, record);  // released meanwhile
    } else {
      return current.status();
    }
    if (absl::IsAlreadyExists(created)) {
      return FailedPreconditionError(
          StrCat(impl_->Where(key), " is locked by another manager (taken just now)"));
    }
  }
  TS_RETURN_IF_ERROR(created);
  auto lease = std::make_unique<S3Lease>(impl_, std::string(key), holder);
  // Two takers of one expired lease may each delete and create it; the one whose record is not
  // there afterwards lost.
  if (!lease->HeldByUs()) {
    return FailedPreconditionError(
        StrCat(impl_->Where(key), " is locked by another manager (taken just now)"));
  }
  return std::unique_ptr<KvLock>(std::move(lease));
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
  const std::string what = StrCat("aborting the upload of ", impl_->Where(upload.key));
  S3Call call("DELETE", impl_->Object(upload.key));
  call.query = {{"uploadId", upload.id}};
  TS_ASSIGN_OR_RETURN(HttpResponse response, impl_->Send(call, what));
  if (response.status == 204 || response.status == 200 || response.status == 404) {
    return OkStatus();
  }
  return impl_->ErrorFor(response, what, upload.key);
}

namespace {

std::mutex& DefaultsMutex() {
  static std::mutex mu;
  return mu;
}
S3Defaults& Defaults() {  // guarded by DefaultsMutex()
  static S3Defaults defaults;
  return defaults;
}

}  // namespace

Status SetS3Defaults(S3Defaults defaults) {
  TS_RETURN_IF_ERROR(ResolveS3Settings(defaults.settings, ProcessEnv()).status());
  std::lock_guard<std::mutex> lock(DefaultsMutex());
  Defaults() = std::move(defaults);
  return OkStatus();
}

Status RegisterS3KvStore() {
  return RegisterKvStoreScheme(
      "s3",
      [](std::string_view rest, const OpenStoreOptions& open) -> Result<std::unique_ptr<KvStore>> {
        const size_t slash = rest.find('/');
        S3KvStoreOptions options;
        options.bucket = std::string(rest.substr(0, slash));
        options.prefix = slash == std::string_view::npos ? "" : std::string(rest.substr(slash + 1));
        S3Defaults defaults;
        {
          std::lock_guard<std::mutex> lock(DefaultsMutex());
          defaults = Defaults();
        }
        options.credentials = defaults.credentials;
        TS_ASSIGN_OR_RETURN(options.settings, ResolveS3Settings(defaults.settings, ProcessEnv()));
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
