#include "tensorstash/kvstore/http/http_kvstore.h"

#include <curl/curl.h>

#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tensorstash/kvstore/http/peer_server.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

void GlobalInitOnce() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// Where a response body goes: a caller's buffer of known size, or a growing string.
struct Sink {
  char* dest = nullptr;
  size_t capacity = 0;
  std::string* text = nullptr;
  size_t received = 0;
  bool overflow = false;
  CURL* curl = nullptr;
};

size_t WriteBody(char* data, size_t, size_t n, void* user) {
  Sink& sink = *static_cast<Sink*>(user);
  long code = 0;
  curl_easy_getinfo(sink.curl, CURLINFO_RESPONSE_CODE, &code);
  if (code != 200 && code != 206) return n;  // an error's explanation: the code says it all
  if (sink.text != nullptr) {
    sink.text->append(data, n);
  } else {
    if (sink.received + n > sink.capacity) {
      sink.overflow = true;
      return 0;  // makes curl stop with CURLE_WRITE_ERROR
    }
    std::memcpy(sink.dest + sink.received, data, n);
  }
  sink.received += n;
  return n;
}

// `text` percent-encoded (curl_easy_escape ignores its handle since curl 7.82).
std::string Escape(std::string_view text) {
  if (text.empty()) return "";  // a length of 0 would make curl take strlen()
  char* escaped = curl_easy_escape(nullptr, text.data(), static_cast<int>(text.size()));
  std::string out = escaped != nullptr ? escaped : "";
  curl_free(escaped);
  return out;
}

// A key as a URL path: each component percent-encoded, joined by '/'.
std::string EscapePath(std::string_view key) {
  std::string path;
  size_t begin = 0;
  while (begin <= key.size()) {
    const size_t end = std::min(key.find('/', begin), key.size());
    if (begin > 0) path += '/';
    path += Escape(key.substr(begin, end - begin));
    begin = end + 1;
  }
  return path;
}

}  // namespace

struct HttpKvStore::Impl {
  std::string url;
  std::string secret_header;
  HttpKvStoreOptions options;
  std::mutex mu;
  std::vector<CURL*> idle;  // handles whose connections stay open for the next request

  ~Impl() {
    for (CURL* curl : idle) curl_easy_cleanup(curl);
  }

  CURL* Take() {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!idle.empty()) {
        CURL* curl = idle.back();
        idle.pop_back();
        curl_easy_reset(curl);  // keeps its connections
        return curl;
      }
    }
    return curl_easy_init();
  }
  void Give(CURL* curl) {
    std::lock_guard<std::mutex> lock(mu);
    idle.push_back(curl);
  }

  // One request for `key` (named in errors): a GET of `target` (a path and query after the
  // url), a HEAD when `head`, a range when `size` > 0. `length` gets the Content-Length.
  Status Perform(std::string_view key, const std::string& target, bool head, uint64_t offset,
                 size_t size, Sink& sink, uint64_t* length = nullptr) {
    CURL* curl = Take();
    if (curl == nullptr) return InternalError("curl_easy_init failed");
    const std::string address = url + target;
    curl_slist* headers = curl_slist_append(nullptr, secret_header.c_str());
    char error[CURL_ERROR_SIZE] = "";
    curl_easy_setopt(curl, CURLOPT_URL, address.c_str());
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error);
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, "http");
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS,
                     static_cast<long>(options.connect_timeout.count()));
    // A transfer slower than 1 byte/s for the stall timeout is a peer that is gone.
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME,
                     std::max(1L, static_cast<long>(options.stall_timeout.count() / 1000)));
    // A larger receive buffer than curl's 16 KiB: fewer reads and callbacks per chunk.
    curl_easy_setopt(curl, CURLOPT_BUFFERSIZE, 512L * 1024);
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, &WriteBody);
    sink.curl = curl;
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &sink);
    std::string range;
    if (head) curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
    if (size > 0) {
      range = StrCat(offset, "-", offset + size - 1);
      curl_easy_setopt(curl, CURLOPT_RANGE, range.c_str());
    }
    const CURLcode done = curl_easy_perform(curl);
    long code = 0;
    curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &code);
    curl_off_t content_length = -1;
    curl_easy_getinfo(curl, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &content_length);
    curl_slist_free_all(headers);
    curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, nullptr);
    if (done == CURLE_OK) {
      Give(curl);
    } else {
      curl_easy_cleanup(curl);  // its connection may be broken
    }
    if (sink.overflow) {
      return DataLossError(
          StrCat("peer ", url, " sent more than the ", size, " bytes asked for of '", key, "'"));
    }
    if (done != CURLE_OK) {
      return UnavailableError(StrCat("reading '", key, "' from peer ", url, " failed: ",
                                     error[0] != '\0' ? error : curl_easy_strerror(done)));
    }
    switch (code) {
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
        return UnavailableError(StrCat("peer ", url, " answered HTTP ", code, " for '", key, "'"));
    }
    if (length != nullptr) *length = content_length < 0 ? 0 : static_cast<uint64_t>(content_length);
    if (size > 0 && sink.received != size) {
      return DataLossError(StrCat("'", key, "' on peer ", url, " is truncated: ", sink.received,
                                  " of the ", size, " bytes at offset ", offset, " arrived"));
    }
    return OkStatus();
  }

  Result<std::string> ObjectTarget(std::string_view key) {
    if (!IsSafeRelativeKey(key)) {
      return InvalidArgumentError(StrCat("'", key, "' is not a key a peer serves"));
    }
    return "/v1/object/" + EscapePath(key);
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
  GlobalInitOnce();
  auto impl = std::make_unique<Impl>();
  impl->url = std::move(url);
  impl->secret_header = StrCat(kPeerSecretHeader, ": ", secret);
  impl->options = options;
  return std::unique_ptr<HttpKvStore>(new HttpKvStore(std::move(impl)));
}

std::string HttpKvStore::Describe() const { return "peer " + impl_->url; }

Result<std::string> HttpKvStore::Read(std::string_view key) {
  TS_ASSIGN_OR_RETURN(std::string target, impl_->ObjectTarget(key));
  std::string text;
  Sink sink{.text = &text};
  TS_RETURN_IF_ERROR(impl_->Perform(key, target, false, 0, 0, sink));
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
  Sink sink{.dest = static_cast<char*>(dest), .capacity = size};
  return impl_->Perform(key, target, false, offset, size, sink);
}

Result<uint64_t> HttpKvStore::Size(std::string_view key) {
  TS_ASSIGN_OR_RETURN(std::string target, impl_->ObjectTarget(key));
  Sink sink{.capacity = 0};
  uint64_t length = 0;
  TS_RETURN_IF_ERROR(impl_->Perform(key, target, true, 0, 0, sink, &length));
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
  const std::string target = StrCat("/v1/list?prefix=", Escape(prefix));
  std::string text;
  Sink sink{.text = &text};
  TS_RETURN_IF_ERROR(impl_->Perform(prefix, target, false, 0, 0, sink));
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
