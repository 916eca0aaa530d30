#include "tensorstash/kvstore/http/http_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

void GlobalInitOnce() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// The state of one transfer, shared with curl's callbacks.
struct Transfer {
  const HttpRequest* request = nullptr;
  HttpResponse* response = nullptr;
  CURL* curl = nullptr;
  size_t sent = 0;  // body bytes handed to curl
  // With HttpRequest::body_pieces: the piece `sent` lies in, and where in it.
  size_t piece = 0;
  size_t piece_offset = 0;
  bool status_known = false;
  bool success = false;  // a 2xx answer: its body goes to the request's destination
};

// Called for each header line of the answer (and the status line, and those of a 100 Continue).
size_t OnHeader(char* data, size_t, size_t n, void* user) {
  Transfer& t = *static_cast<Transfer*>(user);
  std::string_view line(data, n);
  if (line.starts_with("HTTP/")) {  // a new answer starts (after a 100, or a redirect)
    t.response->headers.clear();
    return n;
  }
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos) return n;
  std::string name(line.substr(0, colon));
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  std::string_view value = line.substr(colon + 1);
  while (!value.empty() && std::isspace(static_cast<unsigned char>(value.front()))) {
    value.remove_prefix(1);
  }
  while (!value.empty() && std::isspace(static_cast<unsigned char>(value.back()))) {
    value.remove_suffix(1);
  }
  t.response->headers[std::move(name)] = std::string(value);
  return n;
}

size_t OnBody(char* data, size_t, size_t n, void* user) {
  Transfer& t = *static_cast<Transfer*>(user);
  HttpResponse& r = *t.response;
  if (!t.status_known) {  // the status line has arrived before the first body byte
    t.status_known = true;
    curl_easy_getinfo(t.curl, CURLINFO_RESPONSE_CODE, &r.status);
    t.success = r.status >= 200 && r.status < 300;
  }
  if (t.success && t.request->dest != nullptr) {
    if (r.received + n > t.request->dest_size) {
      r.overflow = true;
      return 0;  // makes curl stop with CURLE_WRITE_ERROR
    }
    std::memcpy(t.request->dest + r.received, data, n);
  } else if (r.body.size() < (t.success ? SIZE_MAX : size_t{1} << 20)) {
    r.body.append(data, n);  // an error's explanation is kept up to 1 MiB
  }
  r.received += n;
  return n;
}

size_t BodySize(const HttpRequest& request) {
  if (request.body_pieces.empty()) return request.body.size();
  size_t size = 0;
  for (std::string_view piece : request.body_pieces) size += piece.size();
  return size;
}

// Hands curl the next bytes of the body: curl copies them into its send buffer here, straight
// from the caller's memory (the pieces too: no buffer of the whole body in between).
size_t OnSend(char* buffer, size_t size, size_t n, void* user) {
  Transfer& t = *static_cast<Transfer*>(user);
  const size_t room = size * n;
  if (t.request->body_pieces.empty()) {
    const std::string_view body = t.request->body;
    const size_t count = std::min(room, body.size() - t.sent);
    std::memcpy(buffer, body.data() + t.sent, count);
    t.sent += count;
    return count;
  }
  const std::vector<std::string_view>& pieces = t.request->body_pieces;
  size_t count = 0;
  while (count < room && t.piece < pieces.size()) {
    const std::string_view piece = pieces[t.piece];
    const size_t take = std::min(room - count, piece.size() - t.piece_offset);
    std::memcpy(buffer + count, piece.data() + t.piece_offset, take);
    count += take;
    t.piece_offset += take;
    if (t.piece_offset == piece.size()) {
      ++t.piece;
      t.piece_offset = 0;
    }
  }
  t.sent += count;
  return count;
}

// Rewinds the body when curl must send it again (a redirect, a reused connection that closed).
int OnSeek(void* user, curl_off_t offset, int origin) {
  Transfer& t = *static_cast<Transfer*>(user);
  if (origin != SEEK_SET || offset < 0 || static_cast<size_t>(offset) > BodySize(*t.request)) {
    return CURL_SEEKFUNC_FAIL;
  }
  t.sent = static_cast<size_t>(offset);
  // The piece that holds byte `offset` (pieces of 0 bytes are stepped over).
  size_t left = t.sent;
  t.piece = 0;
  t.piece_offset = 0;
  const std::vector<std::string_view>& pieces = t.request->body_pieces;
  while (t.piece < pieces.size() && left >= pieces[t.piece].size()) {
    left -= pieces[t.piece].size();
    ++t.piece;
  }
  t.piece_offset = left;
  return CURL_SEEKFUNC_OK;
}

}  // namespace

std::string HttpResponse::Header(std::string_view name) const {
  auto it = headers.find(std::string(name));
  return it == headers.end() ? std::string() : it->second;
}

namespace {

// One curl multi handle, driven by a thread of its own, runs transfers handed to it; callers
// hand it a prepared easy handle and wait for it to finish. The multi handle keeps a cache of
// open connections for all of them; idle easy handles are kept for reuse.
struct MultiLoop {
  struct Job {
    CURL* curl = nullptr;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    CURLcode result = CURLE_OK;
  };

  CURLM* multi = nullptr;
  std::mutex mu;
  std::vector<Job*> queued;  // guarded by mu
  bool stopping = false;     // guarded by mu
  std::vector<CURL*> idle;   // guarded by mu
  std::thread loop;

  MultiLoop() : multi(curl_multi_init()) {
    loop = std::thread([this] { Loop(); });
  }
  ~MultiLoop() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
    }
    curl_multi_wakeup(multi);
    loop.join();
    for (CURL* curl : idle) curl_easy_cleanup(curl);
    curl_multi_cleanup(multi);
  }

  CURL* Take() {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!idle.empty()) {
        CURL* curl = idle.back();
        idle.pop_back();
        curl_easy_reset(curl);
        return curl;
      }
    }
    return curl_easy_init();
  }
  void Give(CURL* curl) {
    std::lock_guard<std::mutex> lock(mu);
    idle.push_back(curl);
  }

  // Runs the transfer `curl` (prepared) on the loop and waits for its end.
  CURLcode Run(CURL* curl) {
    Job job;
    job.curl = curl;
    curl_easy_setopt(curl, CURLOPT_PRIVATE, &job);
    {
      std::lock_guard<std::mutex> lock(mu);
      queued.push_back(&job);
    }
    curl_multi_wakeup(multi);
    std::unique_lock<std::mutex> lock(job.mu);
    job.cv.wait(lock, [&] { return job.done; });
    return job.result;
  }

  void Loop() {
    int running = 0;
    while (true) {
      std::vector<Job*> adds;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (stopping && queued.empty() && running == 0) break;
        adds.swap(queued);
      }
      for (Job* job : adds) {
        const CURLMcode added = curl_multi_add_handle(multi, job->curl);
        if (added != CURLM_OK) Finish(job, CURLE_FAILED_INIT);
      }
      curl_multi_perform(multi, &running);
      int left = 0;
      while (CURLMsg* message = curl_multi_info_read(multi, &left)) {
        if (message->msg != CURLMSG_DONE) continue;
        Job* job = nullptr;
        curl_easy_getinfo(message->easy_handle, CURLINFO_PRIVATE, &job);
        const CURLcode result = message->data.result;
        curl_multi_remove_handle(multi, message->easy_handle);
        Finish(job, result);
      }
      curl_multi_poll(multi, nullptr, 0, 1000, nullptr);
    }
  }

  static void Finish(Job* job, CURLcode result) {
    // Notified under the lock: the waiter owns the job and destroys it as soon as it can return.
    std::lock_guard<std::mutex> lock(job->mu);
    job->result = result;
    job->done = true;
    job->cv.notify_one();
  }
};

}  // namespace

// The transport: a few multi loops (a single thread receiving every byte and copying it out
// was measured slower than the former thread per request on a 2-core machine), each request on
// the next loop in turn.
struct HttpClient::Pool {
  std::vector<std::unique_ptr<MultiLoop>> loops;
  std::atomic<size_t> next{0};

  Pool() {
    const size_t count = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 4);
    for (size_t i = 0; i < count; ++i) loops.push_back(std::make_unique<MultiLoop>());
  }
  MultiLoop& Pick() { return *loops[next.fetch_add(1) % loops.size()]; }
};

HttpClient::HttpClient(HttpClientOptions options)
    : options_(options), pool_(std::make_unique<Pool>()) {
  GlobalInitOnce();
}

HttpClient::~HttpClient() = default;

Result<HttpResponse> HttpClient::Perform(const HttpRequest& request, std::string_view what) const {
  const bool https = request.url.starts_with("https://");
  if (!request.url.starts_with("http://") && !(https && options_.allow_https)) {
    return InvalidArgumentError(StrCat(what, ": the URL '", request.url, "' is not ",
                                       options_.allow_https ? "http:// or https://" : "http://"));
  }
  MultiLoop& loop = pool_->Pick();
  CURL* curl = loop.Take();
  if (curl == nullptr) return InternalError("curl_easy_init failed");
  HttpResponse response;
  Transfer transfer{.request = &request, .response = &response, .curl = curl};
  curl_slist* headers = nullptr;
  for (const auto& [name, value] : request.headers) {
    headers = curl_slist_append(headers, StrCat(name, ": ", value).c_str());
  }
  headers = curl_slist_append(headers, "Expect:");  // no 100-continue round trip
  char error[CURL_ERROR_SIZE] = "";
  curl_easy_setopt(curl, CURLOPT_URL, request.url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error);
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, options_.allow_https ? "http,https" : "http");
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS,
                   static_cast<long>(options_.connect_timeout.count()));
  if (options_.total_timeout.count() > 0) {
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, static_cast<long>(options_.total_timeout.count()));
  }
  // A transfer slower than 1 byte/s for the stall timeout is a server that is gone.
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME,
                   std::max(1L, static_cast<long>(options_.stall_timeout.count() / 1000)));
  // A larger receive buffer than curl's 16 KiB: fewer reads and callbacks per chunk.
  curl_easy_setopt(curl, CURLOPT_BUFFERSIZE, 512L * 1024);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, &OnHeader);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &transfer);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, &OnBody);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &transfer);
  if (request.method == "HEAD") {
    curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
  } else if (request.method == "PUT" || request.method == "POST") {
    curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(curl, CURLOPT_READFUNCTION, &OnSend);
    curl_easy_setopt(curl, CURLOPT_READDATA, &transfer);
    curl_easy_setopt(curl, CURLOPT_SEEKFUNCTION, &OnSeek);
    curl_easy_setopt(curl, CURLOPT_SEEKDATA, &transfer);
    curl_easy_setopt(curl, CURLOPT_INFILESIZE_LARGE,
                     static_cast<curl_off_t>(BodySize(request)));
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, request.method.c_str());
  } else if (request.method != "GET") {
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, request.method.c_str());
  }
  const CURLcode done = loop.Run(curl);
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &response.status);
  curl_slist_free_all(headers);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, nullptr);
  if (done == CURLE_OK) {
    loop.Give(curl);
  } else {
    curl_easy_cleanup(curl);  // its connection may be broken
  }
  if (response.overflow) return response;  // the caller says what was too long
  if (done != CURLE_OK) {
    return UnavailableError(
        StrCat(what, ": ", error[0] != '\0' ? error : curl_easy_strerror(done)));
  }
  return response;
}

std::string UrlEscape(std::string_view text, bool keep_slash) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' ||
        (c == '/' && keep_slash)) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

}  // namespace tensorstash
