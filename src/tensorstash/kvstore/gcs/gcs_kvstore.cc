// The gs:// store. Requests (JSON API; an object name is one percent-encoded path segment, so
// '/' goes as %2F):
//   read       GET  /storage/v1/b/B/o/NAME?alt=media  (+ Range; + ifGenerationMatch=G pinned)
//   stat       GET  /storage/v1/b/B/o/NAME            (size, generation, updated)
//   write      POST /upload/storage/v1/b/B/o?uploadType=multipart  (+ ifGenerationMatch=0)
//              multipart/related: {"name", "crc32c", "metadata": {"tensorstash-write": nonce}},
//              then the bytes. Not uploadType=media: multipart's crc32c is checked by the
//              server, and gcp-storage-emulator drops the connection on an empty media body.
//              From options.resumable_min_bytes on, a single-request resumable upload instead:
//              POST ...?uploadType=resumable with the same JSON (the server checks its crc32c
//              when the session completes), then one PUT of the bytes to the session's
//              Location. Both are checked by GCS alike; the multipart body costs the emulator
//              ~70 CPU s/GiB to parse (bench/README.md "gcs"), the PUT's raw body almost none.
//   list       GET  /storage/v1/b/B/o?prefix=&delimiter=/&pageToken=&maxResults=
//   delete     DELETE /storage/v1/b/B/o/NAME           (404 is NotFound directly)
//   compose    POST /storage/v1/b/B/o/NAME/compose     {"sourceObjects": [{name, generation}],
//                                                       "destination": {"contentType"}}
// A create-only write whose answer was lost and whose retry is answered 412 reads the object's
// metadata: our nonce there means the first attempt created it.
#include "tensorstash/kvstore/gcs/gcs_kvstore.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include <nlohmann/json.hpp>

#include "tensorstash/kvstore/gcs/gcs_json.h"
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
#include "tensorstash/util/base64.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

constexpr std::string_view kUploadsFolder = ".tensorstash-uploads";
constexpr std::string_view kPartSuffix = ".tensorstash-part";
constexpr std::string_view kNonceKey = "tensorstash-write";
constexpr int kMaxComposeSources = 32;
constexpr int kMaxComponents = 1024;

// Percent-encodes everything but RFC 3986's unreserved characters: an object name becomes one
// path segment, a query value one value.
std::string PercentEncode(std::string_view text) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if ((u >= 'A' && u <= 'Z') || (u >= 'a' && u <= 'z') || (u >= '0' && u <= '9') || u == '-' ||
        u == '.' || u == '_' || u == '~') {
      out += c;
    } else {
      out += '%';
      out += kHex[u >> 4];
      out += kHex[u & 15];
    }
  }
  return out;
}

// GCS's bucket naming rules, the part that keeps a name a safe path segment.
bool IsValidBucketName(std::string_view name) {
  if (name.size() < 3 || name.size() > 222) return false;
  for (char c : name) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '.' || c == '_')) {
      return false;
    }
  }
  const auto alnum = [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); };
  return alnum(name.front()) && alnum(name.back());
}

// Whether `name` has a segment ".tensorstash-uploads" (the hidden parts of uploads).
bool HasUploadsSegment(std::string_view name) {
  for (std::string_view segment : StrSplit(name, '/')) {
    if (segment == kUploadsFolder) return true;
  }
  return false;
}

// One JSON API request.
struct GcsCall {
  std::string method = "GET";
  std::string path;  // after the endpoint, already encoded ("/storage/v1/b/B/o/NAME")
  std::vector<std::pair<std::string, std::string>> query;  // not encoded
  std::vector<std::pair<std::string, std::string>> headers;
  std::string_view body;
  std::vector<std::string_view> body_pieces;  // HttpRequest::body_pieces
  char* dest = nullptr;
  size_t dest_size = 0;
  bool slow = false;  // answered only after server-side work (compose): Impl::slow_client
};

// What a part of a composed upload answered: "<generation>:<crc32c hex>:<size>".
struct PartToken {
  std::string generation;
  uint32_t crc = 0;
  uint64_t size = 0;

  std::string Encode() const { return StrCat(generation, ":", Hex32(crc), ":", size); }
  static std::optional<PartToken> Decode(std::string_view text) {
    std::vector<std::string_view> fields = StrSplit(text, ':');
    PartToken token;
    if (fields.size() != 3 || fields[0].empty() || fields[1].size() != 8 ||
        !ParseInt(fields[2], &token.size)) {
      return std::nullopt;
    }
    token.generation = std::string(fields[0]);
    uint32_t crc = 0;
    for (const char c : fields[1]) {
      int digit = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
      if (digit < 0) return std::nullopt;
      crc = (crc << 4) | static_cast<uint32_t>(digit);
    }
    token.crc = crc;
    return token;
  }
};

}  // namespace

struct GcsKvStore::Impl {
  GcsKvStoreOptions options;
  std::unique_ptr<HttpClient> client;
  // Part buffers reused across the files of a save (OpenForWrite); 4 kept at most.
  std::shared_ptr<PartBufferPool> part_buffers;
  // For compose: the server answers only once it has written the whole composite, which can
  // take longer than a stall timeout meant for moving bytes (gcp-storage-emulator takes seconds
  // per 256 MiB); abandoning it there makes each retry redo all of that work.
  std::unique_ptr<HttpClient> slow_client;
  std::string root;  // options.prefix + "/", or ""
  std::unique_ptr<RequestSlots> slots;
  RetryPolicy retry;
  // What the probe found (every write refused until a probe succeeded when options.probe).
  std::mutex probe_mu;
  bool probed = false;
  ProbeFindings findings;  // guarded by probe_mu
  // Whether a token may go to the endpoint (CheckGcsTokenTransport, decided at Open).
  Status token_transport;

  std::string Describe() const {
    return options.prefix.empty() ? StrCat("gs://", options.bucket)
                                  : StrCat("gs://", options.bucket, "/", options.prefix);
  }
  std::string Object(std::string_view key) const { return StrCat(root, key); }
  std::string Where(std::string_view key) const { return StrCat("'", key, "' in ", Describe()); }
  Status CheckKey(std::string_view key) const {
    TS_RETURN_IF_ERROR(ValidateKey(key));
    // GCS object names are UTF-8, and they travel in JSON bodies, whose encoder would throw.
    if (!IsValidUtf8(key)) {
      return InvalidArgumentError(StrCat("the key '", EscapeBytes(key), "' in ", Describe(),
                                         " is not valid UTF-8, which GCS object names must be"));
    }
    if (HasUploadsSegment(key)) {
      return InvalidArgumentError(StrCat("the key '", key, "' in ", Describe(), " has a '",
                                         kUploadsFolder, "' segment, which tensorstash keeps "
                                         "for the parts of uploads in progress"));
    }
    return OkStatus();
  }
  Status CheckPrefix(std::string_view prefix) const { return ValidatePrefix(prefix); }

  std::string ObjectPath(std::string_view object) const {
    return StrCat("/storage/v1/b/", options.bucket, "/o/", PercentEncode(object));
  }
  std::string BucketPath() const { return StrCat("/storage/v1/b/", options.bucket, "/o"); }

  static bool Retryable(long status) {
    return status == 408 || status == 429 || status == 500 || status == 502 || status == 503 ||
           status == 504;
  }

  // Sends `call` with the credential's token, retrying 408, 429, 5xx and lost connections.
  // Any final HTTP status is returned for the caller to judge; `attempts` gets how many were made.
  Result<HttpResponse> Send(GcsCall call, std::string_view what, int* attempts = nullptr) {
    if (!options.user_project.empty()) call.query.emplace_back("userProject", options.user_project);
    std::string url = StrCat(options.endpoint, call.path);
    // A resumable session's path comes with its own query (upload_id=...).
    const bool has_query = call.path.find('?') != std::string::npos;
    for (size_t i = 0; i < call.query.size(); ++i) {
      url += i == 0 && !has_query ? '?' : '&';
      url += StrCat(PercentEncode(call.query[i].first), "=", PercentEncode(call.query[i].second));
    }
    Status fatal;  // a failure before sending (no credentials): never retried
    const std::function<Result<HttpResponse>()> once = [&]() -> Result<HttpResponse> {
      HttpRequest request;
      request.method = call.method;
      request.url = url;
      request.body = call.body;
      request.body_pieces = call.body_pieces;
      request.dest = call.dest;
      request.dest_size = call.dest_size;
      request.headers = call.headers;
      Result<std::string> token = options.credentials->Token();
      if (!token.ok()) return fatal = Annotate(token.status(), what);
      // A token with a control character would end the header early and inject others.
      if (std::any_of(token->begin(), token->end(),
                      [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; })) {
        return fatal = PermissionDeniedError(StrCat(
            what, ": the Google Cloud access token has a control character; it is not sent"));
      }
      if (!token->empty()) {
        if (!token_transport.ok()) return fatal = Annotate(token_transport, what);
        request.headers.emplace_back("authorization", StrCat("Bearer ", *token));
      }
      RequestSlot slot(*slots);
      return (call.slow ? slow_client : client)->Perform(request, what);
    };
    const RetryClassifier<HttpResponse> classify =
        [&](const Result<HttpResponse>& outcome) -> std::optional<Status> {
      if (!fatal.ok()) return std::nullopt;
      if (!outcome.ok()) {
        if (absl::IsUnavailable(outcome.status())) return outcome.status();
        return std::nullopt;
      }
      if (Retryable(outcome->status)) return UnavailableError(StrCat(what, ": HTTP ", outcome->status));
      return std::nullopt;
    };
    return RunWithRetries<HttpResponse>(retry, once, classify, attempts);
  }

  // The status for an answer that is not a success.
  Status ErrorFor(const HttpResponse& response, std::string_view what, std::string_view key) const {
    const GcsError error = ParseGcsError(response.body);
    std::string detail = StrCat("HTTP ", response.status);
    if (!error.reason.empty()) detail += StrCat(" ", error.reason);
    if (!error.message.empty()) detail += StrCat(": ", error.message);
    switch (response.status) {
      case 404:
        // GCS: "The specified bucket does not exist." (a missing object: "No such object: ...").
        if (error.message.find("specified bucket does not exist") != std::string::npos) {
          return NotFoundError(StrCat(what, ": ", Describe(), " answered ", detail));
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
        if (response.status >= 500 || response.status == 429 || response.status == 408) {
          return UnavailableError(StrCat(what, ": ", Describe(), " answered ", detail));
        }
        return UnknownError(StrCat(what, ": ", Describe(), " answered ", detail));
    }
  }

  // A GET of `key`'s bytes (a range when `size` > 0), pinned to `generation` when not empty.
  Status Get(std::string_view key, uint64_t offset, size_t size, void* dest, std::string* text,
             std::string_view generation) {
    TS_RETURN_IF_ERROR(CheckKey(key));
    const std::string what = StrCat("reading ", Where(key));
    GcsCall call;
    call.path = ObjectPath(Object(key));
    call.query = {{"alt", "media"}};
    if (!generation.empty()) call.query.emplace_back("ifGenerationMatch", std::string(generation));
    if (size > 0) {
      call.headers.emplace_back("range", StrCat("bytes=", offset, "-", offset + size - 1));
      call.dest = static_cast<char*>(dest);
      call.dest_size = size;
    }
    TS_ASSIGN_OR_RETURN(HttpResponse response, Send(std::move(call), what));
    if (response.status == 200 || response.status == 206) {
      TS_RETURN_IF_ERROR(CheckRangedAnswer({.status = response.status,
                                            .content_range = response.Header("content-range"),
                                            .content_length = response.Header("content-length"),
                                            .received = response.received,
                                            .overflow = response.overflow},
                                           offset, size, what, Describe()));
      const std::string answered = response.Header("x-goog-generation");
      if (!generation.empty() && !answered.empty() && answered != generation) {
        return FailedPreconditionError(StrCat(what, ": the server answered generation ", answered,
                                              ", not ", generation, " (replaced after it was "
                                              "committed)"));
      }
    } else if (response.status == 412 && !generation.empty()) {
      return FailedPreconditionError(StrCat(what, ": the object was replaced after it was ",
                                            "committed (its generation is no longer ", generation,
                                            ")"));
    } else if (response.status == 416 && size > 0) {
      return DataLossError(StrCat(what, " is truncated: bytes ", offset, "-", offset + size - 1,
                                  " are past its end"));
    } else {
      return ErrorFor(response, what, key);
    }
    if (text != nullptr) *text = std::move(response.body);
    return OkStatus();
  }

  Result<std::string> ReadWhole(std::string_view key) {
    std::string text;
    TS_RETURN_IF_ERROR(Get(key, 0, 0, nullptr, &text, ""));
    return text;
  }

  // The object resource of the full object name `object` (`key` names it in errors).
  Result<GcsObject> StatObject(const std::string& object, std::string_view key) {
    const std::string what = StrCat("looking up ", Where(key));
    GcsCall call;
    call.path = ObjectPath(object);
    TS_ASSIGN_OR_RETURN(HttpResponse response, Send(std::move(call), what));
    if (response.status != 200) return ErrorFor(response, what, key);
    return ParseGcsObject(response.body, what);
  }

  Result<ObjectInfo> Head(std::string_view key) {
    TS_RETURN_IF_ERROR(CheckKey(key));
    TS_ASSIGN_OR_RETURN(GcsObject object, StatObject(Object(key), key));
    ObjectInfo info{object.size, object.generation, {}};
    if (Result<std::chrono::system_clock::time_point> when = ParseRfc3339(object.updated);
        when.ok()) {
      info.modified = *when;
    }
    return info;
  }

  // A multipart upload of the full object name `object` (`key` names it in errors): the object
  // resource it created. With `if_absent`, ifGenerationMatch=0: AlreadyExists when it exists
  // (unless a retried request finds our own nonce there).
  Result<GcsObject> Upload(const std::string& object, std::string_view key,
                           std::string_view value, bool if_absent) {
    return Upload(object, key, PartBytes{{value}, value.size(), Crc32c(value)}, if_absent);
  }
  // As above, for bytes in pieces whose CRC-32C is known (the part uploader's): the pieces go
  // out from where they are.
  Result<GcsObject> Upload(const std::string& object, std::string_view key,
                           const PartBytes& value, bool if_absent) {
    const std::string what = StrCat("writing ", Where(key));
    const uint32_t crc = value.crc32c;
    const std::string nonce = RandomHexId(32);
    nlohmann::json metadata = {{"name", object},
                               {"crc32c", Crc32cBase64(crc)},
                               {"contentType", "application/octet-stream"},
                               {"metadata", {{std::string(kNonceKey), nonce}}}};
    if (value.size >= options.resumable_min_bytes) {
      return UploadResumable(object, key, value, if_absent, crc, nonce, metadata.dump());
    }
    // A boundary that the bytes do not hold (a random one almost never collides; check anyway).
    std::string boundary;
    std::string body;
    do {
      boundary = StrCat("tensorstash-", RandomHexId(32));
      body = StrCat("--", boundary, "\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n",
                    metadata.dump(), "\r\n--", boundary,
                    "\r\nContent-Type: application/octet-stream\r\n\r\n");
      body.reserve(body.size() + value.size + boundary.size() + 8);
      for (std::string_view piece : value.pieces) body.append(piece);
    } while (std::string_view(body).substr(body.size() - value.size).find(boundary) !=
             std::string_view::npos);
    body += StrCat("\r\n--", boundary, "--\r\n");
    GcsCall call;
    call.method = "POST";
    call.path = StrCat("/upload/storage/v1/b/", options.bucket, "/o");
    call.query = {{"uploadType", "multipart"}};
    if (if_absent) call.query.emplace_back("ifGenerationMatch", "0");
    call.headers = {{"content-type", StrCat("multipart/related; boundary=", boundary)}};
    call.body = body;
    TS_ASSIGN_OR_RETURN(HttpResponse response, Send(std::move(call), what));
    if (response.status == 412 && if_absent) {
      // An earlier sending may have created it before its answer was lost.
      return SettleLostAnswer(response, object, key, what, nonce, value.size, crc);
    }
    if (response.status != 200) return ErrorFor(response, what, key);
    TS_ASSIGN_OR_RETURN(GcsObject created, ParseGcsObject(response.body, what));
    TS_RETURN_IF_ERROR(CheckStored(created, what, value.size, crc));
    return created;
  }

  // The object an upload answered `response` (412 or 404) may still have created: ours when an
  // earlier sending of it did before its answer was lost (our nonce is in its metadata), else
  // AlreadyExists (412) or the server's error. Asked whatever the retry count says: libcurl
  // itself resends a request whose reused connection was reset before any answer.
  Result<GcsObject> SettleLostAnswer(const HttpResponse& response, const std::string& object,
                                     std::string_view key, std::string_view what,
                                     const std::string& nonce, uint64_t size, uint32_t crc) {
    Result<GcsObject> there = StatObject(object, key);
    if (there.ok()) {
      auto it = there->metadata.find(std::string(kNonceKey));
      if (it != there->metadata.end() && it->second == nonce) {
        TS_RETURN_IF_ERROR(CheckStored(*there, what, size, crc));
        return *std::move(there);
      }
    }
    if (response.status == 412) return AlreadyExistsError(StrCat(what, ": it already exists"));
    return ErrorFor(response, what, key);
  }

  // A single-request resumable upload: a session started with the object's metadata (its
  // crc32c and our nonce, `metadata_json`), then one PUT of `value`. A PUT whose answer was lost
  // is sent again whole to the same session (GCS answers a completed session with the object;
  // gcp-storage-emulator forgets it, 404); a 404 or 412 is settled by the nonce.
  Result<GcsObject> UploadResumable(const std::string& object, std::string_view key,
                                    const PartBytes& value, bool if_absent, uint32_t crc,
                                    const std::string& nonce, const std::string& metadata_json) {
    const std::string what = StrCat("writing ", Where(key));
    GcsCall start;
    start.method = "POST";
    start.path = StrCat("/upload/storage/v1/b/", options.bucket, "/o");
    start.query = {{"uploadType", "resumable"}};
    if (if_absent) start.query.emplace_back("ifGenerationMatch", "0");
    start.headers = {{"content-type", "application/json; charset=UTF-8"},
                     {"x-upload-content-type", "application/octet-stream"},
                     {"x-upload-content-length", StrCat(value.size)}};
    start.body = metadata_json;
    TS_ASSIGN_OR_RETURN(HttpResponse started, Send(std::move(start), what));
    if (started.status == 412 && if_absent) {
      return AlreadyExistsError(StrCat(what, ": it already exists"));
    }
    if (started.status != 200 && started.status != 201) return ErrorFor(started, what, key);
    const std::string location = started.Header("location");
    // The session URL carries the right to write: it must be on our endpoint (a token goes
    // with the PUT, and the bytes must go where the session was opened).
    if (!location.starts_with(StrCat(options.endpoint, "/"))) {
      return DataLossError(StrCat(what, ": the server's resumable session URL '", location,
                                  "' is not on ", options.endpoint));
    }
    GcsCall put;
    put.method = "PUT";
    put.path = location.substr(options.endpoint.size());
    put.headers = {{"content-type", "application/octet-stream"}};
    put.body_pieces = value.pieces;
    TS_ASSIGN_OR_RETURN(HttpResponse response, Send(std::move(put), what));
    if (response.status == 412 || response.status == 404) {
      if (response.status == 412 && !if_absent) return ErrorFor(response, what, key);
      return SettleLostAnswer(response, object, key, what, nonce, value.size, crc);
    }
    if (response.status == 308) {
      return UnavailableError(StrCat(what, ": the server kept ",
                                     response.Header("range").empty() ? std::string("none")
                                                                      : response.Header("range"),
                                     " of the ", value.size, " bytes sent"));
    }
    if (response.status != 200 && response.status != 201) return ErrorFor(response, what, key);
    TS_ASSIGN_OR_RETURN(GcsObject created, ParseGcsObject(response.body, what));
    TS_RETURN_IF_ERROR(CheckStored(created, what, value.size, crc));
    return created;
  }

  // OK when the server's answer about an object it stored gives our size and CRC-32C. An answer
  // without a CRC-32C is DataLoss too: the commit relies on every object having been checked,
  // and a server (or something in between) that leaves it out cannot be told from one that
  // stored other bytes.
  static Status CheckStored(const GcsObject& stored, std::string_view what, uint64_t size,
                            uint32_t crc) {
    if (stored.crc32c.empty()) {
      return DataLossError(StrCat(what, ": the server's answer gives no CRC-32C to check the ",
                                  size, " bytes sent against"));
    }
    if (stored.size != size || stored.crc32c != Crc32cBase64(crc)) {
      return DataLossError(StrCat(what, ": the server stored ", stored.size,
                                  " bytes with CRC-32C '", stored.crc32c, "', not the ", size,
                                  " bytes sent ('", Crc32cBase64(crc), "')"));
    }
    return OkStatus();
  }

  Status Put(std::string_view key, std::string_view value, bool if_absent) {
    TS_RETURN_IF_ERROR(CheckKey(key));
    TS_RETURN_IF_ERROR(CheckWritable(key));
    return Upload(Object(key), key, value, if_absent).status();
  }
  Status Put(std::string_view key, const PartBytes& value, bool if_absent) {
    TS_RETURN_IF_ERROR(CheckKey(key));
    TS_RETURN_IF_ERROR(CheckWritable(key));
    return Upload(Object(key), key, value, if_absent).status();
  }

  Result<GcsListPage> ListPage(const std::string& full_prefix, bool delimiter,
                               const std::string& token) {
    GcsCall call;
    call.path = BucketPath();
    call.query = {{"prefix", full_prefix}};
    if (delimiter) call.query.emplace_back("delimiter", "/");
    if (options.list_page_size != 1000) {
      call.query.emplace_back("maxResults", std::to_string(options.list_page_size));
    }
    if (!token.empty()) call.query.emplace_back("pageToken", token);
    const std::string what = StrCat("listing '", full_prefix, "' in gs://", options.bucket);
    TS_ASSIGN_OR_RETURN(HttpResponse response, Send(std::move(call), what));
    if (response.status != 200) return ErrorFor(response, what, full_prefix);
    return ParseGcsListPage(response.body, what);
  }

  // Every object (and with `delimiter`, every "folder") under the full object name prefix
  // `full`, names relative to the root; with `hidden`, the uploads' parts too.
  Status ListAll(const std::string& full, bool delimiter, bool hidden,
                 std::vector<GcsObject>* objects, std::vector<std::string>* prefixes) {
    std::string token;
    do {
      TS_ASSIGN_OR_RETURN(GcsListPage page, ListPage(full, delimiter, token));
      for (GcsObject& object : page.items) {
        if (!object.name.starts_with(root)) continue;
        object.name.erase(0, root.size());
        if (!hidden && HasUploadsSegment(object.name)) continue;
        objects->push_back(std::move(object));
      }
      if (prefixes != nullptr) {
        for (std::string& p : page.prefixes) {
          if (!p.starts_with(root)) continue;
          std::string relative = p.substr(root.size());
          if (!hidden && HasUploadsSegment(relative)) continue;
          prefixes->push_back(std::move(relative));
        }
      }
      if (!page.next_page_token.empty() && page.next_page_token == token) {
        return DataLossError(StrCat("listing '", full, "' in gs://", options.bucket,
                                    ": the server answered the same page token twice"));
      }
      token = page.next_page_token;
    } while (!token.empty());
    return OkStatus();
  }

  // Deletes the full object name `object`; NotFound when absent.
  Status DeleteObject(const std::string& object, std::string_view key) {
    const std::string what = StrCat("deleting ", Where(key));
    GcsCall call;
    call.method = "DELETE";
    call.path = ObjectPath(object);
    TS_ASSIGN_OR_RETURN(HttpResponse response, Send(std::move(call), what));
    if (response.status == 204 || response.status == 200) return OkStatus();
    return ErrorFor(response, what, key);
  }
  // As DeleteObject, OK when absent.
  Status DeleteIfPresent(const std::string& object, std::string_view key) {
    Status deleted = DeleteObject(object, key);
    return absl::IsNotFound(deleted) ? OkStatus() : deleted;
  }

  // Checks what the server honours with one small object of its own (deleted after).
  Result<ProbeFindings> Probe() {
    ProbeFindings found;
    const std::string key = StrCat(".tensorstash-probe-", RandomHexId());
    const std::string object = Object(key);
    TS_ASSIGN_OR_RETURN(GcsObject created, Upload(object, key, "0123456789", /*if_absent=*/true));
    std::vector<std::string> ignored;
    Result<GcsObject> again = Upload(object, key, "again", /*if_absent=*/true);
    if (again.ok()) {
      ignored.push_back("ifGenerationMatch=0 on uploads (an existing object was replaced)");
    } else if (!absl::IsAlreadyExists(again.status())) {
      (void)DeleteIfPresent(object, key);
      return again.status();
    }
    // A generation that cannot be the object's: "1" (GCS generations are microsecond times).
    Status pinned = Get(key, 0, 0, nullptr, nullptr, "1");
    if (pinned.ok()) ignored.push_back("ifGenerationMatch on reads");
    char range[3] = {};
    Status ranged = Get(key, 2, 3, range, nullptr, "");
    const std::string_view expected = again.ok() ? std::string_view("ain") : "234";
    if (!ranged.ok() || std::string_view(range, 3) != expected) {
      ignored.push_back(StrCat("ranged reads (", ranged.ok() ? "other bytes came" : ranged.message(),
                               ")"));
    }
    TS_RETURN_IF_ERROR(DeleteIfPresent(object, key));
    if (!ignored.empty()) {
      found.conditional_write = false;
      found.generations = false;
      found.finding = StrCat("the server at ", options.endpoint, " (bucket '", options.bucket,
                             "') ignores ", StrJoin(ignored, ", "),
                             "; tensorstash does not save to it, since its commits rely on "
                             "them; put an enforcing proxy in front of it (probed once per "
                             "process)");
    }
    return found;
  }

  // OK when writes may go to the server: it was not to be probed, or the probe found it honours
  // preconditions. Else FailedPrecondition saying what it ignores.
  Status CheckWritable(std::string_view key) {
    if (!options.probe) return OkStatus();
    std::lock_guard<std::mutex> lock(probe_mu);
    if (!probed) {
      TS_ASSIGN_OR_RETURN(findings, ProbeOnce(ProbeKey{"gs", options.endpoint, options.bucket},
                                              [this] { return Probe(); }));
      probed = true;
    }
    if (findings.conditional_write && findings.generations) return OkStatus();
    return FailedPreconditionError(StrCat("writing ", Where(key), ": ", findings.finding));
  }

  // Composes `sources` (full object names with their tokens, in order) into the full object
  // name `object`; its token. With `if_absent`, ifGenerationMatch=0.
  Result<PartToken> Compose(const std::string& object, std::string_view key,
                            const std::vector<std::pair<std::string, PartToken>>& sources,
                            bool if_absent) {
    const std::string what = StrCat("composing the parts of ", Where(key));
    nlohmann::json list = nlohmann::json::array();
    PartToken expected;
    bool first = true;
    for (const auto& [name, token] : sources) {
      list.push_back({{"name", name}, {"generation", token.generation}});
      expected.crc = first ? token.crc : Crc32cCombine(expected.crc, token.crc, token.size);
      expected.size += token.size;
      first = false;
    }
    nlohmann::json request = {{"sourceObjects", list},
                              {"destination", {{"contentType", "application/octet-stream"}}}};
    const std::string body = request.dump();
    GcsCall call;
    call.method = "POST";
    call.path = StrCat(ObjectPath(object), "/compose");
    call.slow = true;
    if (if_absent) call.query = {{"ifGenerationMatch", "0"}};
    call.headers = {{"content-type", "application/json; charset=UTF-8"}};
    call.body = body;
    int attempts = 0;
    TS_ASSIGN_OR_RETURN(HttpResponse response, Send(std::move(call), what, &attempts));
    Result<GcsObject> composed = InternalError("unreachable");
    if (response.status == 412 && if_absent && attempts > 1) {
      // An earlier attempt may have composed it before its answer was lost: then it holds the
      // parts' bytes (same size and CRC-32C).
      composed = StatObject(object, key);
      if (!composed.ok()) return AlreadyExistsError(StrCat(what, ": it already exists"));
    } else if (response.status == 412 && if_absent) {
      return AlreadyExistsError(StrCat(what, ": it already exists"));
    } else if (response.status != 200) {
      return ErrorFor(response, what, key);
    } else {
      composed = ParseGcsObject(response.body, what);
    }
    TS_RETURN_IF_ERROR(composed.status());
    if (composed->size != expected.size || composed->crc32c != Crc32cBase64(expected.crc)) {
      return DataLossError(StrCat(what, ": the composed object has ", composed->size,
                                  " bytes with CRC-32C '", composed->crc32c, "', the parts ",
                                  expected.size, " bytes with CRC-32C '",
                                  Crc32cBase64(expected.crc), "'"));
    }
    expected.generation = composed->generation;
    return expected;
  }

  // The folder of one composed upload's parts (a full object name prefix, ending in '/').
  std::string UploadFolder(std::string_view key, std::string_view id) const {
    return StrCat(root, kUploadsFolder, "/", key, "/", id, "/");
  }

  // Deletes every part of the upload `id` of `key`; the first failure (others still tried).
  Status DeleteUpload(std::string_view key, std::string_view id) {
    std::vector<GcsObject> parts;
    TS_RETURN_IF_ERROR(ListAll(UploadFolder(key, id), false, true, &parts, nullptr));
    Status first;
    for (const GcsObject& part : parts) {
      Status deleted = DeleteIfPresent(Object(part.name), key);
      if (first.ok()) first = deleted;
    }
    return first;
  }
};

namespace {

// How one object goes up in parts: each part a hidden object, composed at Complete.
class GcsPartSink final : public PartSink {
 public:
  GcsPartSink(std::shared_ptr<GcsKvStore::Impl> impl, std::string key)
      : impl_(std::move(impl)), key_(std::move(key)) {}

  std::string Where() const override { return impl_->Where(key_); }

  Result<std::string> BeginUpload() override {
    // A local id: the time orders a key's uploads, the random part keeps them apart.
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
    return StrCat(ms, "-", RandomHexId(16));
  }

  Result<std::string> PutPart(const std::string& upload_id, int number,
                              std::string_view bytes) override {
    return PutPartPieces(upload_id, number, PartBytes{{bytes}, bytes.size(), Crc32c(bytes)});
  }

  // Parts and whole objects are sent from the writers' pieces, with the CRC-32C the uploader
  // combined from theirs (the server checks it).
  bool TakesPieces() const override { return true; }

  Result<std::string> PutPartPieces(const std::string& upload_id, int number,
                                    const PartBytes& bytes) override {
    char name[32];
    std::snprintf(name, sizeof(name), "%05d", number);
    const std::string object =
        StrCat(impl_->UploadFolder(key_, upload_id), name, kPartSuffix);
    TS_ASSIGN_OR_RETURN(GcsObject part, impl_->Upload(object, key_, bytes, /*if_absent=*/true));
    return PartToken{part.generation, bytes.crc32c, bytes.size}.Encode();
  }

  Status PutWholePieces(const PartBytes& bytes) override {
    return impl_->Put(key_, bytes, /*if_absent=*/false);
  }

  Status Complete(const std::string& upload_id, const std::vector<UploadedPart>& parts,
                  uint64_t size) override {
    if (parts.size() > static_cast<size_t>(kMaxComponents)) {
      return InvalidArgumentError(StrCat("writing ", Where(), ": ", parts.size(),
                                         " parts are more than a composed object may hold (",
                                         kMaxComponents, ")"));
    }
    const std::string folder = impl_->UploadFolder(key_, upload_id);
    std::vector<std::pair<std::string, PartToken>> sources;
    for (const UploadedPart& part : parts) {
      std::optional<PartToken> token = PartToken::Decode(part.token);
      if (!token.has_value()) {
        return InternalError(StrCat("writing ", Where(), ": part ", part.number,
                                    " has the token '", part.token, "'"));
      }
      char name[32];
      std::snprintf(name, sizeof(name), "%05d", part.number);
      sources.emplace_back(StrCat(folder, name, kPartSuffix), *token);
    }
    // Beyond 32 sources, a tree: each level composes groups of 32 into hidden objects.
    for (int level = 1; sources.size() > static_cast<size_t>(kMaxComposeSources); ++level) {
      std::vector<std::pair<std::string, PartToken>> next;
      for (size_t i = 0; i < sources.size(); i += kMaxComposeSources) {
        const size_t end = std::min(sources.size(), i + kMaxComposeSources);
        std::vector<std::pair<std::string, PartToken>> group(sources.begin() + i,
                                                             sources.begin() + end);
        const std::string name =
            StrCat(folder, "c", level, "-", i / kMaxComposeSources, kPartSuffix);
        TS_ASSIGN_OR_RETURN(PartToken token,
                            impl_->Compose(name, key_, group, /*if_absent=*/false));
        next.emplace_back(name, std::move(token));
      }
      sources = std::move(next);
    }
    TS_RETURN_IF_ERROR(impl_->CheckWritable(key_));
    TS_ASSIGN_OR_RETURN(PartToken whole,
                        impl_->Compose(impl_->Object(key_), key_, sources, /*if_absent=*/false));
    if (whole.size != size) {
      return DataLossError(StrCat("writing ", Where(), ": the composed object has ", whole.size,
                                  " bytes, not ", size));
    }
    (void)impl_->DeleteUpload(key_, upload_id);  // best effort: gc finds what is left
    return OkStatus();
  }

  Status Abort(const std::string& upload_id) override {
    return impl_->DeleteUpload(key_, upload_id);
  }

  Status PutWhole(std::string_view bytes) override {
    return impl_->Put(key_, bytes, /*if_absent=*/false);
  }

 private:
  const std::shared_ptr<GcsKvStore::Impl> impl_;
  const std::string key_;
};

// What the kit's lease needs, from GCS: a create-only upload, GET, upload and DELETE.
class GcsLeaseOps final : public LeaseOps {
 public:
  explicit GcsLeaseOps(std::shared_ptr<GcsKvStore::Impl> impl) : impl_(std::move(impl)) {}
  Status CreateIfAbsent(std::string_view key, std::string_view value) override {
    return impl_->Put(key, value, /*if_absent=*/true);
  }
  Result<std::string> Read(std::string_view key) override { return impl_->ReadWhole(key); }
  Status Replace(std::string_view key, std::string_view value) override {
    return impl_->Put(key, value, /*if_absent=*/false);
  }
  Status Delete(std::string_view key) override {
    return impl_->DeleteIfPresent(impl_->Object(key), key);
  }
  std::string Where(std::string_view key) const override { return impl_->Where(key); }

 private:
  const std::shared_ptr<GcsKvStore::Impl> impl_;
};

}  // namespace

GcsKvStore::GcsKvStore(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
GcsKvStore::~GcsKvStore() = default;

Result<std::unique_ptr<GcsKvStore>> GcsKvStore::Open(GcsKvStoreOptions options) {
  if (!IsValidBucketName(options.bucket)) {
    return InvalidArgumentError(StrCat("'", options.bucket,
                                       "' is not a GCS bucket name (3 to 222 of a-z 0-9 . - _, "
                                       "starting and ending with a letter or digit)"));
  }
  while (options.prefix.ends_with('/')) options.prefix.pop_back();
  if (!options.prefix.empty()) {
    if (!IsValidUtf8(options.prefix)) {
      return InvalidArgumentError(StrCat("the prefix of gs://", options.bucket, "/",
                                         EscapeBytes(options.prefix),
                                         " is not valid UTF-8, which GCS object names must be"));
    }
    Status valid = ValidateKey(options.prefix);
    if (!valid.ok()) {
      return InvalidArgumentError(StrCat("the prefix of gs://", options.bucket, "/",
                                         options.prefix, ": ", valid.message()));
    }
    if (HasUploadsSegment(options.prefix)) {
      return InvalidArgumentError(StrCat("the prefix of gs://", options.bucket, "/",
                                         options.prefix, " has a '", kUploadsFolder,
                                         "' segment, which tensorstash keeps for uploads"));
    }
  }
  while (options.endpoint.ends_with('/')) options.endpoint.pop_back();
  const size_t colon = options.endpoint.find("://");
  const std::string scheme = colon == std::string::npos ? "" : options.endpoint.substr(0, colon);
  if ((scheme != "http" && scheme != "https") || options.endpoint.size() == colon + 3) {
    return InvalidArgumentError(StrCat("'", options.endpoint,
                                       "' is not an endpoint (http(s)://host[:port])"));
  }
  if (options.part_size == 0 || options.max_parts < 1 || options.max_parts > kMaxComponents) {
    return InvalidArgumentError(StrCat("GCS uploads of ", options.max_parts, " parts of ",
                                       options.part_size, " bytes: a part holds at least a byte, ",
                                       "and a composed object at most ", kMaxComponents,
                                       " parts"));
  }
  if (options.list_page_size < 1 || options.list_page_size > 1000) {
    return InvalidArgumentError(StrCat("a GCS listing page of ", options.list_page_size,
                                       " objects: from 1 to 1000"));
  }
  auto impl = std::make_shared<Impl>();
  impl->root = options.prefix.empty() ? "" : options.prefix + "/";
  impl->token_transport =
      CheckGcsTokenTransport(options.endpoint, options.allow_http_token, ProcessEnv());
  if (options.credentials == nullptr) {
    TS_ASSIGN_OR_RETURN(options.credentials, ResolveGcsCredentials({}, ProcessEnv()));
  }
  impl->client = std::make_unique<HttpClient>(options.http);
  HttpClientOptions slow_http = options.http;
  slow_http.stall_timeout = std::max(slow_http.stall_timeout,
                                     std::chrono::milliseconds(std::chrono::minutes(5)));
  impl->slow_client = std::make_unique<HttpClient>(slow_http);
  impl->slots = std::make_unique<RequestSlots>(options.max_concurrent_requests);
  impl->retry = RetryPolicy{.max_attempts = options.max_attempts,
                            .initial_backoff = options.initial_backoff,
                            .max_backoff = options.max_backoff};
  impl->options = std::move(options);
  impl->part_buffers = std::make_shared<PartBufferPool>(impl->options.part_size, /*max_kept=*/4);
  return std::unique_ptr<GcsKvStore>(new GcsKvStore(std::move(impl)));
}

std::string GcsKvStore::Describe() const { return impl_->Describe(); }

KvStoreCapabilities GcsKvStore::Capabilities() const {
  // GCS honours preconditions; a server that does not is refused writes (CheckWritable), never
  // given a weaker commit protocol.
  KvStoreCapabilities caps;
  caps.conditional_write = true;
  caps.generations = true;
  caps.locks = true;
  caps.object_store = true;
  // The part uploader sends a file smaller than one part as one upload at Close.
  caps.one_request_below = impl_->options.part_size;
  return caps;
}

Result<std::string> GcsKvStore::Read(std::string_view key) { return impl_->ReadWhole(key); }

Status GcsKvStore::ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) {
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

Result<uint64_t> GcsKvStore::Size(std::string_view key) {
  TS_ASSIGN_OR_RETURN(ObjectInfo info, impl_->Head(key));
  return info.size;
}

Result<ObjectInfo> GcsKvStore::Stat(std::string_view key) { return impl_->Head(key); }

Status GcsKvStore::ReadRangeAtGeneration(std::string_view key, std::string_view generation,
                                         uint64_t offset, size_t size, void* dest) {
  if (size == 0) {
    TS_ASSIGN_OR_RETURN(ObjectInfo info, Stat(key));
    if (info.generation != generation) {
      return FailedPreconditionError(StrCat("reading ", impl_->Where(key),
                                            ": the object was replaced (its generation is no "
                                            "longer ", generation, ")"));
    }
    if (offset > info.size) {
      return DataLossError(StrCat(impl_->Where(key), " is truncated: it ends at ", info.size,
                                  ", before offset ", offset));
    }
    return OkStatus();
  }
  return impl_->Get(key, offset, size, dest, nullptr, generation);
}

Result<std::unique_ptr<ReadableFile>> GcsKvStore::OpenForRead(std::string_view key) {
  TS_ASSIGN_OR_RETURN(ObjectInfo info, Stat(key));
  return NewPinnedFile(std::move(info), impl_->Where(key),
                       [impl = impl_, key = std::string(key)](uint64_t offset, size_t size,
                                                              void* dest,
                                                              const std::string& generation) {
                         return impl->Get(key, offset, size, dest, nullptr, generation);
                       });
}

Status GcsKvStore::Write(std::string_view key, std::string_view value) {
  return impl_->Put(key, value, /*if_absent=*/false);
}

Status GcsKvStore::WriteIfAbsent(std::string_view key, std::string_view value) {
  return impl_->Put(key, value, /*if_absent=*/true);
}

Result<std::unique_ptr<WritableFile>> GcsKvStore::OpenForWrite(std::string_view key) {
  TS_RETURN_IF_ERROR(impl_->CheckKey(key));
  TS_RETURN_IF_ERROR(impl_->CheckWritable(key));
  return NewPartUploader(std::make_unique<GcsPartSink>(impl_, std::string(key)),
                         {.part_size = impl_->options.part_size,
                          .max_parts = impl_->options.max_parts,
                          .buffers = impl_->part_buffers});
}

Result<std::vector<std::string>> GcsKvStore::List(std::string_view prefix) {
  TS_RETURN_IF_ERROR(impl_->CheckPrefix(prefix));
  std::vector<GcsObject> objects;
  TS_RETURN_IF_ERROR(impl_->ListAll(impl_->Object(prefix), false, false, &objects, nullptr));
  std::vector<std::string> keys;
  keys.reserve(objects.size());
  for (GcsObject& object : objects) keys.push_back(std::move(object.name));
  std::sort(keys.begin(), keys.end());
  return keys;
}

Result<std::vector<ListedObject>> GcsKvStore::ListWithInfo(std::string_view prefix) {
  TS_RETURN_IF_ERROR(impl_->CheckPrefix(prefix));
  std::vector<GcsObject> objects;
  TS_RETURN_IF_ERROR(impl_->ListAll(impl_->Object(prefix), false, false, &objects, nullptr));
  std::vector<ListedObject> out;
  out.reserve(objects.size());
  for (GcsObject& object : objects) {
    ListedObject listed{std::move(object.name), {object.size, std::move(object.generation), {}}};
    if (Result<std::chrono::system_clock::time_point> when = ParseRfc3339(object.updated);
        when.ok()) {
      listed.info.modified = *when;
    }
    out.push_back(std::move(listed));
  }
  std::sort(out.begin(), out.end(),
            [](const ListedObject& a, const ListedObject& b) { return a.key < b.key; });
  return out;
}

Result<ListedChildren> GcsKvStore::ListChildren(std::string_view prefix) {
  TS_RETURN_IF_ERROR(impl_->CheckPrefix(prefix));
  std::vector<GcsObject> objects;
  ListedChildren children;
  TS_RETURN_IF_ERROR(
      impl_->ListAll(impl_->Object(prefix), true, false, &objects, &children.prefixes));
  for (GcsObject& object : objects) children.keys.push_back(std::move(object.name));
  std::sort(children.keys.begin(), children.keys.end());
  std::sort(children.prefixes.begin(), children.prefixes.end());
  return children;
}

Status GcsKvStore::Delete(std::string_view key) {
  TS_RETURN_IF_ERROR(impl_->CheckKey(key));
  return impl_->DeleteObject(impl_->Object(key), key);
}

Status GcsKvStore::DeletePrefix(std::string_view prefix) {
  TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, List(prefix));
  for (const std::string& key : keys) {
    TS_RETURN_IF_ERROR(impl_->DeleteIfPresent(impl_->Object(key), key));
  }
  return OkStatus();
}

Status GcsKvStore::RenameDirectory(std::string_view from, std::string_view to) {
  TS_RETURN_IF_ERROR(impl_->CheckKey(from));
  TS_RETURN_IF_ERROR(impl_->CheckKey(to));
  return UnimplementedError(StrCat("renaming '", from, "' to '", to, "' in ", Describe(),
                                   ": object stores cannot rename"));
}

Status GcsKvStore::Sync(std::string_view key) { return impl_->Head(key).status(); }

Status GcsKvStore::SyncDirectory(std::string_view dir) {
  TS_RETURN_IF_ERROR(impl_->CheckPrefix(dir));
  if (dir.empty()) return OkStatus();
  // Nothing to make durable; but a folder that holds nothing is NotFound, as on a file system.
  const std::string folder = dir.ends_with('/') ? std::string(dir) : StrCat(dir, "/");
  TS_ASSIGN_OR_RETURN(GcsListPage page, impl_->ListPage(impl_->Object(folder), false, ""));
  if (page.items.empty()) {
    return NotFoundError(
        StrCat("syncing the folder '", dir, "' in ", Describe(), ": it holds nothing"));
  }
  return OkStatus();
}

Result<std::unique_ptr<KvLock>> GcsKvStore::TryLock(std::string_view key) {
  TS_RETURN_IF_ERROR(impl_->CheckKey(key));
  TS_RETURN_IF_ERROR(impl_->CheckWritable(key));
  return TakeLease(std::make_shared<GcsLeaseOps>(impl_), key,
                   {.duration = impl_->options.lease_duration});
}

Result<std::vector<PendingWrite>> GcsKvStore::ListPendingWrites(std::string_view prefix) {
  TS_RETURN_IF_ERROR(impl_->CheckPrefix(prefix));
  std::vector<GcsObject> parts;
  const std::string uploads = StrCat(kUploadsFolder, "/");
  TS_RETURN_IF_ERROR(
      impl_->ListAll(impl_->Object(StrCat(uploads, prefix)), false, true, &parts, nullptr));
  // <uploads>/<key>/<id>/<part>: grouped by (key, id), started at the oldest part.
  std::map<std::pair<std::string, std::string>, std::optional<std::chrono::system_clock::time_point>>
      found;
  for (const GcsObject& part : parts) {
    if (!part.name.starts_with(uploads)) continue;
    const std::string_view rest = std::string_view(part.name).substr(uploads.size());
    const size_t last = rest.rfind('/');
    if (last == std::string_view::npos || last == 0) continue;
    const size_t before = rest.rfind('/', last - 1);
    if (before == std::string_view::npos || before == 0) continue;
    std::string key(rest.substr(0, before));
    std::string id(rest.substr(before + 1, last - before - 1));
    if (!ValidateKey(key).ok()) continue;
    auto& started = found[{std::move(key), std::move(id)}];
    Result<std::chrono::system_clock::time_point> created = ParseRfc3339(part.time_created);
    if (created.ok() && (!started.has_value() || *created < *started)) started = *created;
  }
  std::vector<PendingWrite> out;
  for (auto& [key_id, started] : found) out.push_back({key_id.first, key_id.second, started});
  return out;
}

Status GcsKvStore::AbortPendingWrite(const PendingWrite& upload) {
  TS_RETURN_IF_ERROR(ValidateKey(upload.key));
  if (upload.id.empty() || upload.id.find('/') != std::string::npos) {
    return InvalidArgumentError(StrCat("'", upload.id, "' is not an upload id of ", Describe()));
  }
  return impl_->DeleteUpload(upload.key, upload.id);
}

namespace {

// By URL prefix ("" for every URL).
ScopedDefaults<GcsDefaults>& Defaults() {
  static auto* defaults = new ScopedDefaults<GcsDefaults>();
  return *defaults;
}

}  // namespace

Status SetGcsDefaults(GcsDefaults defaults) {
  if (!defaults.url_prefix.empty() && !defaults.url_prefix.starts_with("gs://")) {
    return InvalidArgumentError(StrCat("GCS settings for '", defaults.url_prefix,
                                       "': a prefix is a gs:// URL (\"gs://bucket[/path]\")"));
  }
  TS_RETURN_IF_ERROR(ResolveGcsCredentials(defaults.credentials, FixedEnv({})).status());
  std::string prefix = defaults.url_prefix;
  Defaults().Set(std::move(prefix), std::move(defaults));
  return OkStatus();
}

Status RegisterGcsKvStore() {
  return RegisterKvStoreScheme(
      "gs",
      [](std::string_view rest, const OpenStoreOptions& open) -> Result<std::unique_ptr<KvStore>> {
        TS_RETURN_IF_ERROR(CheckDriverOptions(
            "gs", rest, open,
            {"endpoint", "credentials_file", "token", "anonymous", "user_project", "part_size",
             "list_page_size", "allow_http_token"}));
        const std::string url = StrCat("gs://", rest);
        const size_t slash = rest.find('/');
        GcsKvStoreOptions options;
        options.bucket = std::string(rest.substr(0, slash));
        options.prefix = slash == std::string_view::npos ? "" : std::string(rest.substr(slash + 1));
        GcsDefaults defaults = Defaults().For(url);
        options.allow_http_token = defaults.allow_http_token;
        const EnvLookup env = ProcessEnv();
        GcsCredentialOptions credentials = defaults.credentials;
        std::optional<std::string> token;
        std::optional<std::string> credentials_file;
        bool anonymous = false;
        for (const auto& [name, value] : open.driver_options) {
          if (name == "endpoint") {
            defaults.endpoint = value;
          } else if (name == "credentials_file") {
            credentials_file = value;
          } else if (name == "token") {
            token = value;
          } else if (name == "anonymous") {
            TS_ASSIGN_OR_RETURN(anonymous, ParseBoolOption(name, value, url));
          } else if (name == "allow_http_token") {
            TS_ASSIGN_OR_RETURN(options.allow_http_token, ParseBoolOption(name, value, url));
          } else if (name == "user_project") {
            defaults.user_project = value;
          } else if (name == "part_size") {
            TS_ASSIGN_OR_RETURN(uint64_t part_size,
                                ParseCountOption(name, value, 1, uint64_t{5} << 30, url));
            options.part_size = static_cast<size_t>(part_size);
          } else if (name == "list_page_size") {
            TS_ASSIGN_OR_RETURN(uint64_t page, ParseCountOption(name, value, 1, 1000, url));
            options.list_page_size = static_cast<int>(page);
          }
        }
        if (int{token.has_value()} + int{anonymous} + int{credentials_file.has_value()} > 1) {
          return InvalidArgumentError(StrCat("opening ", url,
                                             ": give one of the store options credentials_file, "
                                             "token and anonymous"));
        }
        if (token.has_value() || anonymous || credentials_file.has_value()) {
          credentials = GcsCredentialOptions();
          credentials.anonymous = anonymous;
          credentials.token = token;
          credentials.credentials_file = credentials_file;
        }
        if (!defaults.endpoint.empty()) {
          options.endpoint = defaults.endpoint;
        } else if (std::optional<std::string> emulator = GcsEmulatorEndpoint(env)) {
          options.endpoint = *emulator;
        }
        options.user_project = defaults.user_project;
        TS_ASSIGN_OR_RETURN(options.credentials, ResolveGcsCredentials(credentials, env));
        // Google's own endpoint honours preconditions; any other server is checked first.
        std::string endpoint = options.endpoint;
        while (endpoint.ends_with('/')) endpoint.pop_back();
        options.probe = endpoint != kGcsEndpoint;
        TS_ASSIGN_OR_RETURN(std::unique_ptr<GcsKvStore> store,
                            GcsKvStore::Open(std::move(options)));
        return std::unique_ptr<KvStore>(std::move(store));
      });
}

namespace {
const KvStoreDriverRegistration kRegistered(&RegisterGcsKvStore);
}  // namespace

}  // namespace tensorstash
