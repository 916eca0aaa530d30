// HttpKvStore: a read-only KvStore over a PeerServer (peer_server.h): another process's
// committed local steps, read over the network with libcurl, so that a checkpoint reader opens
// a peer's copy exactly as it opens a folder.
//
//   HttpKvStore::Open("http://10.0.0.7:41234", secret) -> store
//   CheckpointReader::Open(store.get(), "p3/0000001000")
//
// Reads are ranged GETs on connections kept alive and reused (a pool of curl handles). Every
// request carries the secret. Errors name the peer and the key: 404 is NotFound, 403
// PermissionDenied (a wrong secret), a range past the end DataLoss ("truncated"), and a peer
// that cannot be reached, stops answering for `stall_timeout` or drops the connection is
// Unavailable, so that a caller can turn to another holder. Writes are FailedPrecondition.
//
// Thread-safety: every method may be called from several threads at once.
#ifndef TENSORSTASH_KVSTORE_HTTP_HTTP_KVSTORE_H_
#define TENSORSTASH_KVSTORE_HTTP_HTTP_KVSTORE_H_

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/kvstore/read_only_kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct HttpKvStoreOptions {
  std::chrono::milliseconds connect_timeout = std::chrono::seconds(5);
  // A transfer that moves no byte for this long is abandoned (Unavailable).
  std::chrono::milliseconds stall_timeout = std::chrono::seconds(10);
};

class HttpKvStore final : public ReadOnlyKvStore {
 public:
  // `url` is "http://host:port" (a PeerServer's url()). InvalidArgument for another scheme or
  // an empty secret; nothing is sent until the first call.
  static Result<std::unique_ptr<HttpKvStore>> Open(std::string url, std::string secret,
                                                   HttpKvStoreOptions options = {});
  ~HttpKvStore() override;

  std::string Describe() const override;  // "peer http://host:port"
  Result<std::string> Read(std::string_view key) override;
  Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) override;
  Result<uint64_t> Size(std::string_view key) override;
  Result<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view key) override;
  Result<std::vector<std::string>> List(std::string_view prefix) override;

 private:
  struct Impl;
  explicit HttpKvStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_HTTP_HTTP_KVSTORE_H_
