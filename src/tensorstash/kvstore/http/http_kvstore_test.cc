// The peer transport: HttpKvStore reading what a PeerServer serves passes the read conformance
// suite, and the server refuses what it must (no secret, a wrong one, keys outside its folder,
// keys its owner does not serve, writes).
#include "tensorstash/kvstore/http/http_kvstore.h"

#include <curl/curl.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/http/peer_server.h"
#include "tensorstash/kvstore/kvstore_conformance.h"
#include "tensorstash/util/status_test_macros.h"

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

}  // namespace
}  // namespace tensorstash
