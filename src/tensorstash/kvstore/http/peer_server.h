// PeerServer: serves the files under one folder, read-only, over HTTP, to the other processes of
// a job (the node-local tier's peer transport; docs/multitier.md "Transport"). HttpKvStore
// (http_kvstore.h) is its client.
//
//   PeerServer::Start("/dev/shm/run1", {.bind_address = "10.0.0.7", .secret = s}) -> server
//   server->url()  -> "http://10.0.0.7:41234" (published to the peers through the coordinator)
//
// Requests (libmicrohttpd, a pool of threads):
//   GET|HEAD /v1/object/<key>     the file <root>/<key>; a `Range: bytes=a-b` gives 206
//   GET      /v1/list?prefix=<p>  the keys under the prefix, one per line, sorted
//   GET      /v1/shared/<key>     bytes held in memory under <key> (Publish, for shared reads:
//                                 docs/proposals/shared-reads.md): 200 once published, 503
//                                 "not yet" before (the client polls), 410 with the reason after
//                                 PublishFailure (the client reads from storage itself)
// Every request must carry the header `X-Tensorstash-Secret: <secret>`; without it, or with
// another value, the answer is 403 and nothing is read. Keys are checked before any file is
// touched: an absolute key, an empty component, "." or ".." (also percent-encoded), a NUL or a
// backslash is 400. `may_serve(key)` decides what is visible (e.g. only committed steps): a key
// it refuses is 404, as is a missing file or a symbolic link. Files are sent with sendfile().
//
// Connections cost descriptors, which the process needs for its own saves, so anyone who can
// reach the port could otherwise starve it without knowing the secret. The server therefore
// holds at most `max_connections` at once (never more than a quarter of RLIMIT_NOFILE's soft
// limit), at most `max_connections_per_address` from one address (a connection past either
// limit is closed when it is accepted, or waits in the kernel's queue), and closes every
// connection that has not sent complete headers with the secret within `header_timeout` of
// being accepted, whether or not it trickles bytes. A connection that has sent the secret is
// closed only after `idle_timeout` without a byte moving either way: a transfer is never cut.
//
// Thread-safety: Start and the destructor on one thread; may_serve is called from the server's
// threads at once and must be thread-safe.
#ifndef TENSORSTASH_KVSTORE_HTTP_PEER_SERVER_H_
#define TENSORSTASH_KVSTORE_HTTP_PEER_SERVER_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorstash/util/status.h"

namespace tensorstash {

// The header that carries the job's secret, sent by HttpKvStore.
inline constexpr char kPeerSecretHeader[] = "X-Tensorstash-Secret";

struct PeerServerOptions {
  // An IPv4 address of this host to listen on ("0.0.0.0": every interface).
  std::string bind_address = "127.0.0.1";
  int port = 0;  // 0: a free port, chosen by the kernel (see port())
  // Required; at least 16 characters.
  std::string secret;
  // Null: every file under the root.
  std::function<bool(std::string_view key)> may_serve;
  int threads = 4;
  // The job's number of processes, when the caller knows it (0: unknown). Sizes the default
  // limits: each other process may hold kPeerConnectionsPerProcess connections.
  int process_count = 0;
  // Connections held at once, in all and from one IPv4 address; 0: derived (see
  // PeerServer::max_connections). An explicit total above a quarter of RLIMIT_NOFILE's soft
  // limit is refused.
  int max_connections = 0;
  int max_connections_per_address = 0;
  // From accept to complete headers carrying the secret; at least 1 s.
  std::chrono::seconds header_timeout{5};
  // An authenticated connection with no byte moving either way; at least 1 s.
  std::chrono::seconds idle_timeout{120};
};

// The connections one reading process may open to a server at once: its reads run on at most
// DefaultIoThreads() (32) threads.
inline constexpr int kPeerConnectionsPerProcess = 32;

class PeerServer {
 public:
  // Starts serving `root` (a folder that must exist; "" serves no files, only what is
  // published). InvalidArgument for a bad address, a
  // short secret, a negative limit or a total above a quarter of RLIMIT_NOFILE, a timeout under
  // 1 s; NotFound for a missing root, Unavailable when the address cannot be bound.
  static Result<std::unique_ptr<PeerServer>> Start(std::string root, PeerServerOptions options);
  // Stops: closes the socket and waits for the requests in flight.
  ~PeerServer();
  PeerServer(const PeerServer&) = delete;
  PeerServer& operator=(const PeerServer&) = delete;

  int port() const;
  // "http://<bind address>:<port>".
  std::string url() const;

  // The limits in force. Derived when not given: the total is kPeerConnectionsPerProcess for
  // each other process plus a few spare (1,024 when the job's size is unknown), capped at a
  // quarter of RLIMIT_NOFILE's soft limit and at least `threads`; one address may take half of
  // it, at least kPeerConnectionsPerProcess (so one hostile host cannot take every slot, while a
  // node running several processes still gets in).
  int max_connections() const;
  int max_connections_per_address() const;

  // Shared reads. Publish makes `bytes` the answer to GET /v1/shared/<key> (any key; replaces an
  // earlier one); PublishFailure makes it 410 with `why` (the publisher could not read them).
  void Publish(const std::string& key, std::shared_ptr<const std::string> bytes);
  void PublishFailure(const std::string& key, const std::string& why);
  // Waits until each (key, n) of `wanted` has been sent whole n times (its
  // receivers have asked for it), or until `deadline`. Returns the keys still short.
  std::vector<std::string> WaitServed(const std::vector<std::pair<std::string, int>>& wanted,
                                      std::chrono::steady_clock::time_point deadline);

 private:
  struct Impl;
  explicit PeerServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Whether `key` is a relative path that stays inside the folder it names a file of: not empty,
// no leading '/', no empty, "." or ".." component, no NUL or backslash. Used by the server (and
// by the client, which refuses such keys before sending them).
bool IsSafeRelativeKey(std::string_view key);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_HTTP_PEER_SERVER_H_
