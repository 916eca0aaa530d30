// The peer transport: HttpKvStore reading what a PeerServer serves passes the read conformance
// suite, and the server refuses what it must (no secret, a wrong one, keys outside its folder,
// keys its owner does not serve, writes). PeerServerAbuseTest: someone without the secret
// cannot starve it (issue 36 item 6): idle connections from one address take neither the slots
// nor the process's descriptors, connections that do not send authenticated headers in time are
// closed (also when they trickle bytes), and an authenticated transfer that stalls is not cut
// by that short timeout.
#include "tensorstash/kvstore/http/http_kvstore.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/http/peer_server.h"
#include "tensorstash/testing/kvstore_conformance.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kSecret[] = "0123456789abcdef-test-secret";

PeerServerOptions Options(std::string secret, std::string address = "127.0.0.1") {
  PeerServerOptions options;
  options.bind_address = std::move(address);
  options.secret = std::move(secret);
  return options;
}

// A store over HTTP that owns the server it reads from.
class ServedStore final : public ForwardingKvStore {
 public:
  ServedStore(std::unique_ptr<PeerServer> server, std::unique_ptr<HttpKvStore> store)
      : ForwardingKvStore(store.get()), server_(std::move(server)), store_(std::move(store)) {}

 private:
  std::unique_ptr<PeerServer> server_;
  std::unique_ptr<HttpKvStore> store_;
};

std::unique_ptr<KvStore> ServeContents(const std::string& scratch_dir,
                                       const std::map<std::string, std::string>& contents) {
  const std::string root = scratch_dir + "/served";
  std::unique_ptr<FileKvStore> files = FileKvStore::Open(root).value();
  for (const auto& [key, value] : contents) {
    if (Status written = files->Write(key, value); !written.ok()) {
      ADD_FAILURE() << written;
      return nullptr;
    }
  }
  Result<std::unique_ptr<PeerServer>> server = PeerServer::Start(root, Options(kSecret));
  if (!server.ok()) {
    ADD_FAILURE() << server.status();
    return nullptr;
  }
  std::unique_ptr<HttpKvStore> store = HttpKvStore::Open((*server)->url(), kSecret).value();
  return std::make_unique<ServedStore>(*std::move(server), std::move(store));
}

TS_INSTANTIATE_KVSTORE_READ_CONFORMANCE(
    Http, std::vector<ReadableKvStoreBackend>({{"Http", &ServeContents}}));

class PeerServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = ::testing::TempDir() + "peer_server_test_" + std::to_string(::getpid());
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_ + "/served/step1");
    std::filesystem::create_directories(root_ + "/served/step2");
    std::ofstream(root_ + "/served/step1/data") << "committed";
    std::ofstream(root_ + "/served/step2/data") << "in progress";
    std::ofstream(root_ + "/outside") << "private";
    std::filesystem::create_symlink(root_ + "/outside", root_ + "/served/step1/link");
    std::filesystem::create_directory_symlink(root_, root_ + "/served/step1/dirlink");
    server_ = PeerServer::Start(
                  root_ + "/served",
                  {.bind_address = "127.0.0.1",
                   .port = 0,
                   .secret = kSecret,
                   .may_serve = [](std::string_view key) { return key.starts_with("step1/"); }})
                  .value();
  }
  void TearDown() override {
    server_.reset();
    std::filesystem::remove_all(root_);
  }

  // The status code of a raw request, with `headers`.
  long RawGet(const std::string& path, const std::vector<std::string>& headers,
              const char* method = nullptr) {
    CURL* curl = curl_easy_init();
    curl_slist* list = nullptr;
    for (const std::string& h : headers) list = curl_slist_append(list, h.c_str());
    const std::string url = server_->url() + path;
    std::string body;
    curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, list);
    curl_easy_setopt(curl, CURLOPT_PATH_AS_IS, 1L);  // send "../" as it is
    if (method != nullptr) curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(
        curl, CURLOPT_WRITEFUNCTION, +[](char* data, size_t, size_t n, void* out) {
          static_cast<std::string*>(out)->append(data, n);
          return n;
        });
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &body);
    long code = 0;
    EXPECT_EQ(curl_easy_perform(curl), CURLE_OK);
    curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &code);
    curl_slist_free_all(list);
    curl_easy_cleanup(curl);
    return code;
  }

  std::string root_;
  std::unique_ptr<PeerServer> server_;
};

TEST_F(PeerServerTest, ServesWhatItMayWithTheSecret) {
  std::unique_ptr<HttpKvStore> store = HttpKvStore::Open(server_->url(), kSecret).value();
  EXPECT_EQ(store->Read("step1/data").value(), "committed");
  EXPECT_THAT(store->List("").value(), ElementsAre("step1/data"));
  EXPECT_EQ(RawGet("/v1/object/step1/data", {std::string(kPeerSecretHeader) + ": " + kSecret}),
            200);
}

TEST_F(PeerServerTest, RefusesRequestsWithoutTheSecret) {
  EXPECT_EQ(RawGet("/v1/object/step1/data", {}), 403);
  EXPECT_EQ(RawGet("/v1/object/step1/data", {std::string(kPeerSecretHeader) + ": wrong"}), 403);
  EXPECT_EQ(RawGet("/v1/list", {}), 403);
  std::unique_ptr<HttpKvStore> wrong =
      HttpKvStore::Open(server_->url(), "another-secret-of-this-size").value();
  const Status status = wrong->Read("step1/data").status();
  EXPECT_TRUE(absl::IsPermissionDenied(status)) << status;
  EXPECT_THAT(MessageOf(status), HasSubstr("secret"));
}

TEST_F(PeerServerTest, RefusesKeysOutsideTheFolderAndWhatItDoesNotServe) {
  const std::vector<std::string> secret = {std::string(kPeerSecretHeader) + ": " + kSecret};
  EXPECT_EQ(RawGet("/v1/object/../outside", secret), 400);
  EXPECT_EQ(RawGet("/v1/object/step1/../../outside", secret), 400);
  EXPECT_EQ(RawGet("/v1/object/%2e%2e/outside", secret), 400);
  EXPECT_EQ(RawGet("/v1/object//etc/passwd", secret), 400);
  EXPECT_EQ(RawGet("/v1/object/step1/link", secret), 404);  // a symbolic link out
  EXPECT_EQ(RawGet("/v1/object/step2/data", secret), 404);  // not committed
  EXPECT_EQ(RawGet("/v1/list?prefix=../", secret), 400);
  EXPECT_EQ(RawGet("/v1/object/step1/data", secret, "PUT"), 405);
  EXPECT_EQ(RawGet("/v1/object/step1/data", secret, "DELETE"), 405);
  std::unique_ptr<HttpKvStore> store = HttpKvStore::Open(server_->url(), kSecret).value();
  EXPECT_TRUE(absl::IsNotFound(store->Read("step2/data").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(store->Read("../outside").status()));
  EXPECT_FALSE(store->Write("step1/new", "x").ok());
}

TEST(HttpKvStoreTest, APeerThatIsGoneIsUnavailable) {
  std::string root = ::testing::TempDir() + "peer_gone_" + std::to_string(::getpid());
  std::filesystem::create_directories(root);
  std::string url;
  {
    std::unique_ptr<PeerServer> server = PeerServer::Start(root, Options(kSecret)).value();
    url = server->url();
  }
  std::unique_ptr<HttpKvStore> store = HttpKvStore::Open(url, kSecret).value();
  const Status status = store->Read("x").status();
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_THAT(MessageOf(status), HasSubstr(url));
  std::filesystem::remove_all(root);
}

TEST(PeerServerStartTest, BadOptionsAreRefused) {
  EXPECT_TRUE(absl::IsInvalidArgument(PeerServer::Start("/tmp", Options("short")).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(PeerServer::Start("/tmp", Options(kSecret, "nowhere")).status()));
  EXPECT_TRUE(absl::IsNotFound(PeerServer::Start("/no/such/folder", Options(kSecret)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(HttpKvStore::Open("ftp://x", kSecret).status()));
}

// --- Denial of service without the secret (issue 36 item 6) ---

using Clock = std::chrono::steady_clock;

int OpenDescriptors() {
  int count = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    ++count;
  }
  return count;
}

// A TCP connection to 127.0.0.1:`port` from `source` (any address of the loopback), that sends
// nothing. -1 on failure.
int Connect(int port, const char* source) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in from{};
  from.sin_family = AF_INET;
  ::inet_pton(AF_INET, source, &from.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Whether the server has closed `fd` (recv gives 0, or the connection was reset), waiting for
// it up to `wait`; whatever the server sent before is read and dropped.
bool ClosedByServer(int fd, std::chrono::milliseconds wait) {
  pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
  if (::poll(&p, 1, static_cast<int>(wait.count())) <= 0) return false;
  while (true) {
    char buffer[4096];
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
    if (n < 0) return false;  // EAGAIN: all read, still open
  }
}

class PeerServerAbuseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = ::testing::TempDir() + "peer_server_abuse_" + std::to_string(::getpid());
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_ + "/step1");
    std::ofstream(root_ + "/step1/data") << "committed";
  }
  void TearDown() override {
    for (int fd : sockets_) ::close(fd);
    server_.reset();
    std::filesystem::remove_all(root_);
  }

  PeerServerOptions Options() const {
    PeerServerOptions options;
    options.bind_address = "127.0.0.1";
    options.secret = kSecret;
    return options;
  }

  std::string root_;
  std::vector<int> sockets_;
  std::unique_ptr<PeerServer> server_;
};

TEST_F(PeerServerAbuseTest, IdleConnectionsFromOneAddressNeitherStarveAPeerNorTakeDescriptors) {
  PeerServerOptions options = Options();
  options.max_connections = 32;
  options.max_connections_per_address = 8;
  options.header_timeout = std::chrono::seconds(60);  // the limits, not the timeout, at work
  server_ = PeerServer::Start(root_, options).value();
  EXPECT_EQ(server_->max_connections(), 32);
  EXPECT_EQ(server_->max_connections_per_address(), 8);
  const int before = OpenDescriptors();

  // Someone without the secret, on another address of the loopback, opens far more connections
  // than the server may hold, and sends nothing.
  constexpr int kIdle = 300;
  for (int i = 0; i < kIdle; ++i) {
    const int fd = Connect(server_->port(), "127.0.0.2");
    ASSERT_GE(fd, 0) << "connection " << i << ": " << std::strerror(errno);
    sockets_.push_back(fd);
  }
  // While they are open, a peer with the secret gets its answer (the connections are accepted in
  // order, so by then the server has taken or refused every idle one).
  std::unique_ptr<HttpKvStore> store = HttpKvStore::Open(server_->url(), kSecret).value();
  Result<std::string> read = store->Read("step1/data");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "committed");

  // The server holds at most its per-address limit of them, plus the peer's connection (a
  // descriptor on each side here) and a few spare: not one descriptor per idle connection.
  const int allowed = before + kIdle + 8 + 2 + 4;
  const Clock::time_point settle = Clock::now() + std::chrono::seconds(2);
  int held = OpenDescriptors();
  while (held <= allowed && Clock::now() < settle) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    held = OpenDescriptors();
  }
  EXPECT_LE(held, allowed) << "the server holds " << held - before - kIdle
                           << " descriptors for " << kIdle << " idle connections";
  // And it still answers.
  EXPECT_EQ(store->Read("step1/data").value(), "committed");
}

TEST_F(PeerServerAbuseTest, ConnectionsWithoutAuthenticatedHeadersAreClosedAfterTheTimeout) {
  PeerServerOptions options = Options();
  options.header_timeout = std::chrono::seconds(1);
  server_ = PeerServer::Start(root_, options).value();

  const int idle = Connect(server_->port(), "127.0.0.1");
  ASSERT_GE(idle, 0);
  sockets_.push_back(idle);
  // Headers sent a byte at a time, each within the timeout: an inactivity timeout alone would
  // never close this one.
  const int trickle = Connect(server_->port(), "127.0.0.1");
  ASSERT_GE(trickle, 0);
  sockets_.push_back(trickle);
  const std::string start = "GET /v1/list HTTP/1.1\r\nHost: x\r\n";
  ASSERT_EQ(::send(trickle, start.data(), start.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(start.size()));
  // Complete headers with a wrong secret: answered 403, and not kept open.
  const int wrong = Connect(server_->port(), "127.0.0.1");
  ASSERT_GE(wrong, 0);
  sockets_.push_back(wrong);
  const std::string request = "GET /v1/list HTTP/1.1\r\nHost: x\r\n" +
                              std::string(kPeerSecretHeader) + ": not-the-secret\r\n\r\n";
  ASSERT_EQ(::send(wrong, request.data(), request.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(request.size()));

  // Until all three are closed (or a generous deadline), the trickle goes on.
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(30);
  bool idle_closed = false, trickle_closed = false, wrong_closed = false;
  while (!(idle_closed && trickle_closed && wrong_closed) && Clock::now() < deadline) {
    if (!trickle_closed) {
      trickle_closed = ::send(trickle, "X", 1, MSG_NOSIGNAL) != 1 ||
                       ClosedByServer(trickle, std::chrono::milliseconds(100));
    }
    idle_closed = idle_closed || ClosedByServer(idle, std::chrono::milliseconds(50));
    wrong_closed = wrong_closed || ClosedByServer(wrong, std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(trickle_closed) << "a connection trickling its headers was kept open";
  EXPECT_TRUE(idle_closed) << "an idle connection was kept open";
  EXPECT_TRUE(wrong_closed) << "a connection with a wrong secret was kept open";

  // The server still serves a peer with the secret.
  std::unique_ptr<HttpKvStore> store = HttpKvStore::Open(server_->url(), kSecret).value();
  EXPECT_EQ(store->Read("step1/data").value(), "committed");
}

TEST_F(PeerServerAbuseTest, AnAuthenticatedTransferThatStallsIsNotCutByTheHeaderTimeout) {
  // Larger than the loopback's socket buffers, so that the server waits while the reader pauses.
  constexpr size_t kSize = 48 << 20;
  {
    std::ofstream out(root_ + "/step1/big", std::ios::binary);
    const std::string block(1 << 20, 'z');
    for (size_t i = 0; i < kSize / block.size(); ++i) out << block;
  }
  PeerServerOptions options = Options();
  options.header_timeout = std::chrono::seconds(1);
  server_ = PeerServer::Start(root_, options).value();

  struct Reader {
    size_t received = 0;
    bool paused = false;
  } reader;
  CURL* curl = curl_easy_init();
  const std::string url = server_->url() + "/v1/object/step1/big";
  const std::string header = std::string(kPeerSecretHeader) + ": " + kSecret;
  curl_slist* headers = curl_slist_append(nullptr, header.c_str());
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(
      curl, CURLOPT_WRITEFUNCTION, +[](char*, size_t, size_t n, void* out) {
        Reader& r = *static_cast<Reader*>(out);
        r.received += n;
        // Three times the header timeout without reading, once the transfer is under way.
        if (!r.paused && r.received > (1 << 20)) {
          r.paused = true;
          std::this_thread::sleep_for(std::chrono::seconds(3));
        }
        return n;
      });
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &reader);
  const CURLcode result = curl_easy_perform(curl);
  long code = 0;
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &code);
  curl_slist_free_all(headers);
  curl_easy_cleanup(curl);
  EXPECT_EQ(result, CURLE_OK) << curl_easy_strerror(result);
  EXPECT_EQ(code, 200);
  EXPECT_TRUE(reader.paused);
  EXPECT_EQ(reader.received, kSize);
}

TEST_F(PeerServerAbuseTest, TheLimitsLeaveMostDescriptorsToTheProcess) {
  rlimit limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  const long long quarter =
      limit.rlim_cur == RLIM_INFINITY ? LLONG_MAX : static_cast<long long>(limit.rlim_cur) / 4;
  for (int processes : {0, 2, 64, 100000}) {
    PeerServerOptions options = Options();
    options.process_count = processes;
    std::unique_ptr<PeerServer> server = PeerServer::Start(root_, options).value();
    SCOPED_TRACE(processes);
    EXPECT_LE(server->max_connections(), quarter);
    EXPECT_LE(server->max_connections_per_address(), server->max_connections());
    EXPECT_GE(server->max_connections_per_address(),
              std::min<long long>(kPeerConnectionsPerProcess, server->max_connections()));
    if (processes == 2 && quarter >= 64) {
      // One other process, with all its reads at once.
      EXPECT_GE(server->max_connections_per_address(), kPeerConnectionsPerProcess);
    }
    if (processes == 100000) {
      // One hostile address cannot hold every slot.
      EXPECT_LT(server->max_connections_per_address(), server->max_connections());
    }
  }
  if (quarter < INT_MAX) {
    PeerServerOptions options = Options();
    options.max_connections = static_cast<int>(quarter) + 1;
    const Status status = PeerServer::Start(root_, options).status();
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
    EXPECT_THAT(MessageOf(status), HasSubstr("RLIMIT_NOFILE"));
  }
  PeerServerOptions options = Options();
  options.header_timeout = std::chrono::seconds(0);
  EXPECT_TRUE(absl::IsInvalidArgument(PeerServer::Start(root_, options).status()));
}

}  // namespace
}  // namespace tensorstash
