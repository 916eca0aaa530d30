#include "tensorstash/kvstore/http/http_kvstore.h"

#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tensorstash/kvstore/http/http_client.h"
#include "tensorstash/kvstore/http/peer_server.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {

struct HttpKvStore::Impl {
  std::string url;
  std::string secret;
  std::unique_ptr<HttpClient> client;

  // One request for `key` (named in errors): a GET of `target` (a path and query after the
  // url), a HEAD when `head`, a range of `size` bytes into `dest` when `size` > 0, the whole
  // body into `text` otherwise. `length` gets the Content-Length.
  Status Perform(std::string_view key, const std::string& target, bool head, uint64_t offset,
                 size_t size, void* dest, std::string* text, uint64_t* length = nullptr) {
    HttpRequest request;
    request.method = head ? "HEAD" : "GET";
    request.url = url + target;
    request.headers.emplace_back(kPeerSecretHeader, secret);
    if (size > 0) {
      request.headers.emplace_back("Range", StrCat("bytes=", offset, "-", offset + size - 1));
      request.dest = static_cast<char*>(dest);
      request.dest_size = size;
    }
    TS_ASSIGN_OR_RETURN(HttpResponse response,
                        client->Perform(request, StrCat("reading '", key, "' from peer ", url)));
    if (response.overflow) {
      return DataLossError(
          StrCat("peer ", url, " sent more than the ", size, " bytes asked for of '", key, "'"));
    }
    switch (response.status) {
      case 200:
      case 206:
        break;
      case 404:
        return NotFoundError(StrCat("'", key, "' is not held by peer ", url));
      case 403:
        return PermissionDeniedError(StrCat("peer ", url, " refused the request for '", key,
                                            "': a missing or wrong job secret"));
      case 416:
        return DataLossError(StrCat("'", key, "' on peer ", url, " is truncated: it ends before ",
                                    "byte ", offset + size));
      case 400:
        return InvalidArgumentError(StrCat("peer ", url, " refused the key '", key, "'"));
      default:
        return UnavailableError(
            StrCat("peer ", url, " answered HTTP ", response.status, " for '", key, "'"));
    }
    if (length != nullptr) {
      uint64_t content_length = 0;
      ParseInt(response.Header("content-length"), &content_length);
      *length = content_length;
    }
    if (text != nullptr) *text = std::move(response.body);
    if (size > 0 && response.received != size) {
      return DataLossError(StrCat("'", key, "' on peer ", url, " is truncated: ", response.received,
                                  " of the ", size, " bytes at offset ", offset, " arrived"));
    }
    return OkStatus();
  }

  Result<std::string> ObjectTarget(std::string_view key) {
    if (!IsSafeRelativeKey(key)) {
      return InvalidArgumentError(StrCat("'", key, "' is not a key a peer serves"));
    }
    return "/v1/object/" + UrlEscape(key, /*keep_slash=*/true);
  }
};

HttpKvStore::HttpKvStore(std::unique_ptr<Impl> impl)
    : ReadOnlyKvStore("a peer's store"), impl_(std::move(impl)) {}
HttpKvStore::~HttpKvStore() = default;

Result<std::unique_ptr<HttpKvStore>> HttpKvStore::Open(std::string url, std::string secret,
                                                       HttpKvStoreOptions options) {
  if (!url.starts_with("http://")) {
    return InvalidArgumentError(
        StrCat("a peer's address must start with http://, not '", url, "'"));
  }
  if (secret.empty()) return InvalidArgumentError("a peer's store needs the job's secret");
  while (url.ends_with('/')) url.pop_back();
  auto impl = std::make_unique<Impl>();
  impl->url = std::move(url);
  impl->secret = std::move(secret);
  HttpClientOptions client_options;
  client_options.connect_timeout = options.connect_timeout;
  client_options.stall_timeout = options.stall_timeout;
  client_options.allow_https = false;
  impl->client = std::make_unique<HttpClient>(client_options);
  return std::unique_ptr<HttpKvStore>(new HttpKvStore(std::move(impl)));
}

std::string HttpKvStore::Describe() const { return "peer " + impl_->url; }

Result<std::string> HttpKvStore::Read(std::string_view key) {
  TS_ASSIGN_OR_RETURN(std::string target, impl_->ObjectTarget(key));
  std::string text;
  TS_RETURN_IF_ERROR(impl_->Perform(key, target, false, 0, 0, nullptr, &text));
  return text;
}

Status HttpKvStore::ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) {
  TS_ASSIGN_OR_RETURN(std::string target, impl_->ObjectTarget(key));
  if (size == 0) {
    TS_ASSIGN_OR_RETURN(uint64_t length, Size(key));
    if (offset > length) {
      return DataLossError(StrCat("'", key, "' on ", Describe(), " is truncated: it ends at ",
                                  length, ", before offset ", offset));
    }
    return OkStatus();
  }
  return impl_->Perform(key, target, false, offset, size, dest, nullptr);
}

Result<uint64_t> HttpKvStore::Size(std::string_view key) {
  TS_ASSIGN_OR_RETURN(std::string target, impl_->ObjectTarget(key));
  uint64_t length = 0;
  TS_RETURN_IF_ERROR(impl_->Perform(key, target, true, 0, 0, nullptr, nullptr, &length));
  return length;
}

Result<std::unique_ptr<ReadableFile>> HttpKvStore::OpenForRead(std::string_view key) {
  TS_ASSIGN_OR_RETURN(uint64_t size, Size(key));
  return RangeReadableFile(this, std::string(key), size);
}

Result<std::vector<std::string>> HttpKvStore::List(std::string_view prefix) {
  const size_t slash = prefix.rfind('/');
  if (prefix.starts_with('/') || (slash != std::string_view::npos && slash > 0 &&
                                  !IsSafeRelativeKey(prefix.substr(0, slash)))) {
    return InvalidArgumentError(StrCat("'", prefix, "' is not a prefix a peer lists"));
  }
  const std::string target = StrCat("/v1/list?prefix=", UrlEscape(prefix));
  std::string text;
  TS_RETURN_IF_ERROR(impl_->Perform(prefix, target, false, 0, 0, nullptr, &text));
  std::vector<std::string> keys;
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t end = text.find('\n', begin);
    if (end == std::string::npos) {
      return DataLossError(
          StrCat("the listing of '", prefix, "' from ", Describe(), " is cut short"));
    }
    keys.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return keys;
}

}  // namespace tensorstash
