#include "tensorstash/kvstore/http/peer_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tensorstash/util/str_util.h"

namespace tensorstash {

bool IsSafeRelativeKey(std::string_view key) {
  if (key.empty() || key.front() == '/') return false;
  if (key.find('\0') != std::string_view::npos || key.find('\\') != std::string_view::npos) {
    return false;
  }
  size_t begin = 0;
  while (true) {
    const size_t end = std::min(key.find('/', begin), key.size());
    const std::string_view part = key.substr(begin, end - begin);
    if (part.empty() || part == "." || part == "..") return false;
    if (end == key.size()) return true;
    begin = end + 1;
  }
}

namespace {

constexpr char kObjectPath[] = "/v1/object/";
constexpr char kListPath[] = "/v1/list";
constexpr char kSharedPath[] = "/v1/shared/";

// The derived limits (peer_server.h, PeerServer::max_connections).
constexpr int kSpareConnections = 8;
constexpr int kConnectionsWhenJobSizeUnknown = 1024;

// A quarter of RLIMIT_NOFILE's soft limit: the most connections the server may hold, so that
// the process keeps the rest of its descriptors for its own files.
long long DescriptorShare() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
    return 1 << 20;
  }
  return static_cast<long long>(limit.rlim_cur) / 4;
}

// Fills in the limits the caller left at 0 and checks the others.
Status SizeLimits(PeerServerOptions& options) {
  if (options.max_connections < 0 || options.max_connections_per_address < 0 ||
      options.process_count < 0) {
    return InvalidArgumentError(StrCat(
        "the peer server's connection limits and process count must not be negative (got ",
        options.max_connections, ", ", options.max_connections_per_address, ", ",
        options.process_count, ")"));
  }
  if (options.header_timeout < std::chrono::seconds(1) ||
      options.idle_timeout < std::chrono::seconds(1)) {
    return InvalidArgumentError(StrCat("the peer server's timeouts must be at least 1 s (got ",
                                       options.header_timeout.count(), " s for the headers, ",
                                       options.idle_timeout.count(), " s idle)"));
  }
  options.threads = std::max(1, options.threads);
  const long long share = DescriptorShare();
  if (options.max_connections > share) {
    return InvalidArgumentError(
        StrCat("the peer server may hold at most ", share,
               " connections, a quarter of this process's RLIMIT_NOFILE soft limit (",
               options.max_connections, " asked)"));
  }
  if (options.max_connections == 0) {
    const long long wanted =
        options.process_count > 0
            ? static_cast<long long>(kPeerConnectionsPerProcess) *
                      std::max(1, options.process_count - 1) +
                  kSpareConnections
            : kConnectionsWhenJobSizeUnknown;
    options.max_connections = static_cast<int>(std::min(wanted, share));
  }
  // MHD divides the total among its threads; each needs one.
  if (options.max_connections < options.threads) {
    if (options.threads > share) {
      return InvalidArgumentError(StrCat("the peer server's ", options.threads,
                                         " threads need more connections than the ", share,
                                         " this process's RLIMIT_NOFILE allows it"));
    }
    options.max_connections = options.threads;
  }
  if (options.max_connections_per_address == 0) {
    options.max_connections_per_address =
        std::max(options.max_connections / 2, kPeerConnectionsPerProcess);
  }
  options.max_connections_per_address =
      std::min(options.max_connections_per_address, options.max_connections);
  return OkStatus();
}

// Compares in time that depends on the lengths only, so that the secret cannot be guessed a
// character at a time from the answers' timing.
bool SameSecret(std::string_view given, std::string_view secret) {
  if (given.size() != secret.size()) return false;
  unsigned char differ = 0;
  for (size_t i = 0; i < given.size(); ++i) differ |= given[i] ^ secret[i];
  return differ == 0;
}

MHD_Result Answer(MHD_Connection* connection, unsigned int code, std::string_view body,
                  const char* content_type = "text/plain") {
  MHD_Response* response = MHD_create_response_from_buffer(
      body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
  // Whoever lacks the secret does not keep the connection.
  if (code == MHD_HTTP_FORBIDDEN) {
    MHD_add_response_header(response, MHD_HTTP_HEADER_CONNECTION, "close");
  }
  const MHD_Result queued = MHD_queue_response(connection, code, response);
  MHD_destroy_response(response);
  return queued;
}

// Parses "bytes=a-b" or "bytes=a-" against a file of `size` bytes into [first, last]. Returns
// 0 when there is no range header, 206 for a satisfiable range, 416 for one past the end, 400
// for anything else (several ranges, suffix ranges).
unsigned int ParseRange(const char* header, uint64_t size, uint64_t* first, uint64_t* last) {
  if (header == nullptr) return 0;
  std::string_view range(header);
  if (!range.starts_with("bytes=")) return MHD_HTTP_BAD_REQUEST;
  range.remove_prefix(6);
  const size_t dash = range.find('-');
  if (dash == std::string_view::npos || dash == 0) return MHD_HTTP_BAD_REQUEST;
  const std::string_view a = range.substr(0, dash), b = range.substr(dash + 1);
  auto parse = [](std::string_view text, uint64_t* out) {
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), *out);
    return error == std::errc() && end == text.data() + text.size();
  };
  if (!parse(a, first)) return MHD_HTTP_BAD_REQUEST;
  if (b.empty()) {
    *last = size == 0 ? 0 : size - 1;
  } else if (!parse(b, last) || *last < *first) {
    return MHD_HTTP_BAD_REQUEST;
  }
  if (*first >= size) return MHD_HTTP_RANGE_NOT_SATISFIABLE;
  *last = std::min(*last, size - 1);
  return MHD_HTTP_PARTIAL_CONTENT;
}

// Opens `key` for reading inside the folder `root_fd`, following no symbolic link on the way
// (openat2 with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS), so that no link in any folder of the
// path leads out of it. -1 with errno set on failure.
int OpenBeneath(int root_fd, const std::string& key) {
  open_how how{};
  how.flags = O_RDONLY | O_CLOEXEC;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  return static_cast<int>(::syscall(SYS_openat2, root_fd, key.c_str(), &how, sizeof(how)));
}

}  // namespace

// The header deadline. MHD's own timeout is one of inactivity, which a client that sends a byte
// now and then never reaches; so every accepted connection is recorded (MHD's notification of a
// connection started) with the time its headers are due, the request handler forgets it once it
// has seen the secret, and a thread shuts down the socket of every one still recorded when its
// time comes: MHD then sees the end of the stream and closes it. MHD reports a connection closed
// before it closes the descriptor, and the record is dropped under the same mutex, so the thread
// never touches a descriptor that has been reused.
struct PeerServer::Impl {
  std::string root;
  int root_fd = -1;
  PeerServerOptions options;
  MHD_Daemon* daemon = nullptr;
  int port = 0;

  struct Unauthenticated {
    int fd;
    std::chrono::steady_clock::time_point deadline;
  };
  std::mutex mu;
  std::condition_variable wake;
  bool stopping = false;  // guarded by mu
  std::unordered_map<MHD_Connection*, Unauthenticated> unauthenticated;  // guarded by mu
  std::thread reaper;

  // Published bytes (shared reads), under their own mutex: answers never wait on the reaper.
  struct Published {
    std::shared_ptr<const std::string> bytes;  // null: failed, see `why`
    std::string why;
    int served = 0;
  };
  std::mutex published_mu;
  std::condition_variable served_cv;
  std::unordered_map<std::string, Published> published;  // guarded by published_mu

  ~Impl() {
    if (reaper.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mu);
        stopping = true;
      }
      wake.notify_all();
      reaper.join();
    }
    if (daemon != nullptr) MHD_stop_daemon(daemon);
    if (root_fd >= 0) ::close(root_fd);
  }

  void Reap() {
    std::unique_lock<std::mutex> lock(mu);
    while (!stopping) {
      const auto now = std::chrono::steady_clock::now();
      auto next = now + std::chrono::hours(1);
      for (auto it = unauthenticated.begin(); it != unauthenticated.end();) {
        if (it->second.deadline <= now) {
          ::shutdown(it->second.fd, SHUT_RDWR);
          it = unauthenticated.erase(it);
        } else {
          next = std::min(next, it->second.deadline);
          ++it;
        }
      }
      wake.wait_until(lock, next);
    }
  }

  static void NotifyConnection(void* cls, MHD_Connection* connection, void** /*socket_context*/,
                               MHD_ConnectionNotificationCode event) {
    Impl& self = *static_cast<Impl*>(cls);
    std::lock_guard<std::mutex> lock(self.mu);
    if (event == MHD_CONNECTION_NOTIFY_CLOSED) {
      self.unauthenticated.erase(connection);
      return;
    }
    const MHD_ConnectionInfo* info =
        MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (info == nullptr) return;
    // Every deadline is the same time after its start, so only a first one moves the next wake.
    if (self.unauthenticated.empty()) self.wake.notify_one();
    self.unauthenticated[connection] = {
        info->connect_fd, std::chrono::steady_clock::now() + self.options.header_timeout};
  }

  // The connection has sent the secret: no header deadline, and only a long inactivity ends it.
  void Authenticated(MHD_Connection* connection) {
    {
      std::lock_guard<std::mutex> lock(mu);
      unauthenticated.erase(connection);
    }
    MHD_set_connection_option(connection, MHD_CONNECTION_OPTION_TIMEOUT,
                              static_cast<unsigned int>(options.idle_timeout.count()));
  }

  // For keys that passed IsSafeRelativeKey.
  bool MayServe(std::string_view key) const { return !options.may_serve || options.may_serve(key); }

  MHD_Result ServeObject(MHD_Connection* connection, std::string_view key) const {
    if (!IsSafeRelativeKey(key)) return Answer(connection, MHD_HTTP_BAD_REQUEST, "bad key\n");
    if (!MayServe(key)) return Answer(connection, MHD_HTTP_NOT_FOUND, "not served\n");
    const int fd = OpenBeneath(root_fd, std::string(key));
    struct stat info;
    if (fd < 0 || ::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
      if (fd >= 0) ::close(fd);
      return Answer(connection, MHD_HTTP_NOT_FOUND, "no such object\n");
    }
    const uint64_t size = static_cast<uint64_t>(info.st_size);
    uint64_t first = 0, last = size == 0 ? 0 : size - 1;
    const unsigned int code =
        ParseRange(MHD_lookup_connection_value(connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_RANGE),
                   size, &first, &last);
    if (code != 0 && code != MHD_HTTP_PARTIAL_CONTENT) {
      ::close(fd);
      return Answer(connection, code, "bad range\n");
    }
    const uint64_t length = size == 0 ? 0 : last - first + 1;
    // The response owns the descriptor from here on (closed when it is destroyed).
    MHD_Response* response = MHD_create_response_from_fd_at_offset64(length, fd, first);
    if (response == nullptr) {
      ::close(fd);
      return MHD_NO;
    }
    if (code == MHD_HTTP_PARTIAL_CONTENT) {
      const std::string content_range = StrCat("bytes ", first, "-", last, "/", size);
      MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_RANGE, content_range.c_str());
    }
    const MHD_Result queued =
        MHD_queue_response(connection, code == 0 ? MHD_HTTP_OK : code, response);
    MHD_destroy_response(response);
    return queued;
  }

  MHD_Result ServeShared(MHD_Connection* connection, std::string_view key, void** request) {
    std::shared_ptr<const std::string> bytes;
    std::string why;
    {
      std::lock_guard<std::mutex> lock(published_mu);
      auto it = published.find(std::string(key));
      if (it == published.end()) {
        // Not read yet by its publisher: the client polls (short polls, so that a slow chunk
        // never ties up one of the pool's threads).
        return Answer(connection, MHD_HTTP_SERVICE_UNAVAILABLE, "not yet\n");
      }
      bytes = it->second.bytes;
      why = it->second.why;
    }
    if (bytes == nullptr) return Answer(connection, MHD_HTTP_GONE, why);
    const MHD_Result queued = Answer(connection, MHD_HTTP_OK, *bytes, "application/octet-stream");
    // Served once the last byte has gone (Completed), not when queued: a publisher that stops
    // its server once everything is served must not cut a transfer still on the wire.
    if (queued == MHD_YES) *request = new std::string(key);
    return queued;
  }

  static void Completed(void* cls, MHD_Connection* /*connection*/, void** request,
                        MHD_RequestTerminationCode toe) {
    std::unique_ptr<std::string> key(static_cast<std::string*>(*request));
    *request = nullptr;
    if (key == nullptr || toe != MHD_REQUEST_TERMINATED_COMPLETED_OK) return;
    Impl& self = *static_cast<Impl*>(cls);
    std::lock_guard<std::mutex> lock(self.published_mu);
    ++self.published[*key].served;
    self.served_cv.notify_all();
  }

  MHD_Result ServeList(MHD_Connection* connection) const {
    const char* given = MHD_lookup_connection_value(connection, MHD_GET_ARGUMENT_KIND, "prefix");
    const std::string_view prefix = given == nullptr ? "" : given;
    const size_t slash = prefix.rfind('/');
    const std::string_view folder =
        slash == std::string_view::npos ? std::string_view() : prefix.substr(0, slash);
    if (!folder.empty() && !IsSafeRelativeKey(folder)) {
      return Answer(connection, MHD_HTTP_BAD_REQUEST, "bad prefix\n");
    }
    std::vector<std::string> keys;
    std::error_code error;
    const std::filesystem::path start =
        folder.empty() ? std::filesystem::path(root) : std::filesystem::path(root) / folder;
    for (auto it = std::filesystem::recursive_directory_iterator(start, error);
         !error && it != std::filesystem::recursive_directory_iterator(); it.increment(error)) {
      if (!it->is_regular_file(error) || it->is_symlink(error)) continue;
      std::string key = std::filesystem::relative(it->path(), root, error).generic_string();
      if (!error && key.starts_with(prefix) && key.find('\n') == std::string::npos &&
          IsSafeRelativeKey(key) && MayServe(key)) {
        keys.push_back(std::move(key));
      }
    }
    std::sort(keys.begin(), keys.end());
    std::string body;
    for (const std::string& key : keys) body += key + "\n";
    return Answer(connection, MHD_HTTP_OK, body);
  }

  static MHD_Result Handle(void* cls, MHD_Connection* connection, const char* url,
                           const char* method, const char* /*version*/, const char* /*upload_data*/,
                           size_t* upload_data_size, void** con_cls) {
    Impl& self = *static_cast<Impl*>(cls);
    const char* secret =
        MHD_lookup_connection_value(connection, MHD_HEADER_KIND, kPeerSecretHeader);
    if (secret == nullptr || !SameSecret(secret, self.options.secret)) {
      return Answer(connection, MHD_HTTP_FORBIDDEN, "a request without the job's secret\n");
    }
    self.Authenticated(connection);
    const std::string_view verb(method);
    if ((verb != "GET" && verb != "HEAD") || *upload_data_size != 0) {
      return Answer(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "read-only\n");
    }
    // `url` arrives percent-decoded, so "%2e%2e" is checked as "..".
    const std::string_view path(url);
    if (path.starts_with(kSharedPath)) {
      return self.ServeShared(connection, path.substr(std::strlen(kSharedPath)), con_cls);
    }
    if (self.root_fd < 0) return Answer(connection, MHD_HTTP_NOT_FOUND, "no files served\n");
    if (path.starts_with(kObjectPath)) {
      return self.ServeObject(connection, path.substr(std::strlen(kObjectPath)));
    }
    if (path == kListPath) return self.ServeList(connection);
    return Answer(connection, MHD_HTTP_NOT_FOUND, "unknown request\n");
  }
};

PeerServer::PeerServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PeerServer::~PeerServer() = default;

Result<std::unique_ptr<PeerServer>> PeerServer::Start(std::string root, PeerServerOptions options) {
  if (options.secret.size() < 16) {
    return InvalidArgumentError("the peer server's secret must be at least 16 characters");
  }
  struct stat info;
  if (!root.empty() && (::stat(root.c_str(), &info) != 0 || !S_ISDIR(info.st_mode))) {
    return NotFoundError(StrCat("the folder to serve to peers, '", root, "', does not exist"));
  }
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(options.port));
  if (options.port < 0 || options.port > 65535 ||
      ::inet_pton(AF_INET, options.bind_address.c_str(), &address.sin_addr) != 1) {
    return InvalidArgumentError(StrCat("the peer server's address '", options.bind_address, ":",
                                       options.port, "' is not an IPv4 address and port"));
  }
  if (Status s = SizeLimits(options); !s.ok()) return s;
  auto impl = std::make_unique<Impl>();
  if (!root.empty()) {
    impl->root_fd = ::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (impl->root_fd < 0) {
      return ErrnoToStatus(errno, "opening the folder to serve", root);
    }
    // openat2 (Linux 5.6) keeps a symbolic link from leading a request out of the folder.
    if (const int probe = OpenBeneath(impl->root_fd, "."); probe >= 0) {
      ::close(probe);
    } else if (errno == ENOSYS) {
      return UnimplementedError("serving peers needs openat2 (Linux 5.6 or later)");
    }
  }
  impl->root = std::move(root);
  impl->options = std::move(options);
  impl->reaper = std::thread([self = impl.get()] { self->Reap(); });
  // Until a connection sends the secret, MHD closes it after header_timeout without a byte
  // (the reaper, after header_timeout in all).
  impl->daemon = MHD_start_daemon(
      MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL_LINUX_ONLY, 0, nullptr, nullptr,
      &Impl::Handle, impl.get(), MHD_OPTION_SOCK_ADDR, reinterpret_cast<sockaddr*>(&address),
      MHD_OPTION_THREAD_POOL_SIZE, static_cast<unsigned int>(impl->options.threads),
      MHD_OPTION_CONNECTION_LIMIT, static_cast<unsigned int>(impl->options.max_connections),
      MHD_OPTION_PER_IP_CONNECTION_LIMIT,
      static_cast<unsigned int>(impl->options.max_connections_per_address),
      MHD_OPTION_CONNECTION_TIMEOUT,
      static_cast<unsigned int>(impl->options.header_timeout.count()),
      MHD_OPTION_NOTIFY_CONNECTION, &Impl::NotifyConnection, impl.get(),
      MHD_OPTION_NOTIFY_COMPLETED, &Impl::Completed, impl.get(), MHD_OPTION_END);
  if (impl->daemon == nullptr) {
    return UnavailableError(StrCat("cannot serve peers on ", impl->options.bind_address, ":",
                                   impl->options.port, " (address in use or not of this host)"));
  }
  const MHD_DaemonInfo* bound = MHD_get_daemon_info(impl->daemon, MHD_DAEMON_INFO_BIND_PORT);
  impl->port = bound != nullptr ? bound->port : impl->options.port;
  return std::unique_ptr<PeerServer>(new PeerServer(std::move(impl)));
}

int PeerServer::port() const { return impl_->port; }

std::string PeerServer::url() const {
  return StrCat("http://", impl_->options.bind_address, ":", impl_->port);
}

int PeerServer::max_connections() const { return impl_->options.max_connections; }

void PeerServer::Publish(const std::string& key, std::shared_ptr<const std::string> bytes) {
  std::lock_guard<std::mutex> lock(impl_->published_mu);
  Impl::Published& entry = impl_->published[key];
  entry.bytes = std::move(bytes);
  entry.why.clear();
}

void PeerServer::PublishFailure(const std::string& key, const std::string& why) {
  std::lock_guard<std::mutex> lock(impl_->published_mu);
  Impl::Published& entry = impl_->published[key];
  entry.bytes = nullptr;
  entry.why = why;
}

std::vector<std::string> PeerServer::WaitServed(
    const std::vector<std::pair<std::string, int>>& wanted,
    std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(impl_->published_mu);
  std::vector<std::string> short_of;
  auto missing = [&] {
    short_of.clear();
    for (const auto& [key, count] : wanted) {
      auto it = impl_->published.find(key);
      if (it == impl_->published.end() || it->second.served < count) short_of.push_back(key);
    }
    return !short_of.empty();
  };
  while (missing() && impl_->served_cv.wait_until(lock, deadline) != std::cv_status::timeout) {
  }
  missing();
  return short_of;
}
int PeerServer::max_connections_per_address() const {
  return impl_->options.max_connections_per_address;
}

}  // namespace tensorstash
