// HttpClient: HTTP requests over libcurl's multi interface: one thread of the client drives
// every transfer, on connections kept alive and reused between requests; each caller waits for
// its own. The transport under the peer store (http_kvstore.h) and the S3 store
// (s3/s3_kvstore.h); neither speaks to curl itself.
//
//   HttpClient client({});
//   HttpRequest request{.method = "GET", .url = "http://127.0.0.1:8333/bucket/key"};
//   Result<HttpResponse> response = client.Perform(request, "reading 'key'");
//
// Any HTTP status is an answer (OK, with `status` set): what it means is the caller's protocol.
// A request that gets no answer (refused or reset connection, timeout, a stall of more than
// `stall_timeout` without a byte) is Unavailable, naming `what` and curl's reason.
//
// Thread-safety: Perform may be called from any number of threads at once.
#ifndef TENSORSTASH_KVSTORE_HTTP_HTTP_CLIENT_H_
#define TENSORSTASH_KVSTORE_HTTP_HTTP_CLIENT_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorstash/util/status.h"

namespace tensorstash {

struct HttpClientOptions {
  std::chrono::milliseconds connect_timeout = std::chrono::seconds(5);
  // A transfer that moves no byte for this long is abandoned (Unavailable).
  std::chrono::milliseconds stall_timeout = std::chrono::seconds(10);
  // The whole request, 0 for no limit (the instance metadata service wants a short one).
  std::chrono::milliseconds total_timeout{0};
  // Schemes a request may use ("http", "https"); anything else is refused before sending.
  bool allow_https = true;
};

struct HttpRequest {
  std::string method = "GET";  // GET, HEAD, PUT, POST, DELETE
  std::string url;             // complete and already percent-encoded
  // Sent as given ("Name: value"); curl's own "Expect: 100-continue" is never sent.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string_view body;  // sent for PUT and POST (an empty one too); must outlive Perform
  // When not empty, the body is these pieces one after the other instead (`body` is ignored):
  // bytes gathered from where they lie, sent without being copied into one buffer first. They
  // too must outlive Perform.
  std::vector<std::string_view> body_pieces;
  // Where a 2xx answer's body goes: `dest` (exactly `dest_size` bytes expected; more is an
  // overflow, reported in the response) or, when `dest` is null, HttpResponse::body. The body of
  // any other answer always goes to HttpResponse::body (an error's explanation).
  char* dest = nullptr;
  size_t dest_size = 0;
};

struct HttpResponse {
  long status = 0;
  std::map<std::string, std::string> headers;  // names in lowercase; values trimmed
  std::string body;
  size_t received = 0;    // body bytes that arrived (into `dest` or `body`)
  bool overflow = false;  // a 2xx body longer than `dest_size`: the transfer was cut

  // The header's value, or "" when absent (`name` in lowercase).
  std::string Header(std::string_view name) const;
};

class HttpClient {
 public:
  explicit HttpClient(HttpClientOptions options = {});
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Sends `request` and waits for the whole answer. `what` ("reading 'a/b' from s3://bkt")
  // starts the message of a transport failure (Unavailable); InvalidArgument for a URL whose
  // scheme is not allowed.
  Result<HttpResponse> Perform(const HttpRequest& request, std::string_view what) const;

  const HttpClientOptions& options() const { return options_; }

 private:
  struct Pool;
  HttpClientOptions options_;
  std::unique_ptr<Pool> pool_;
};

// `text` percent-encoded as uppercase %XX, every byte but A-Z a-z 0-9 - _ . ~ (RFC 3986's
// unreserved characters), and '/' too unless `keep_slash` (a path of several segments).
std::string UrlEscape(std::string_view text, bool keep_slash = false);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_HTTP_HTTP_CLIENT_H_
