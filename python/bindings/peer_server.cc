// tensorstash._ext.PeerServer: serves this process's committed node-local steps to the other
// processes of the job (kvstore/http/peer_server.h), read-only, to requests that carry the
// job's secret. Only keys inside a committed step are served: "<folder>/<step>/..." where
// "<root>/<folder>/<step>/COMMIT" exists and <step> is a step folder name (10 digits)
// (holdings.h, CommittedHoldingKeys).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <string>
#include <string_view>

#include "bindings.h"
#include "errors.h"
#include "tensorstash/tiers/holdings.h"
#include "tensorstash/kvstore/http/peer_server.h"

namespace nb = nanobind;

namespace tensorstash::python {
namespace {

class PyPeerServer {
 public:
  PyPeerServer(const std::string& root, const std::string& address, int port,
               const std::string& secret, int threads) {
    PeerServerOptions options;
    options.bind_address = address;
    options.port = port;
    options.secret = secret;
    options.threads = threads;
    options.may_serve = CommittedHoldingKeys(root);
    Result<std::unique_ptr<PeerServer>> server = [&] {
      nb::gil_scoped_release release;
      return PeerServer::Start(root, std::move(options));
    }();
    server_ = ValueOrThrow(std::move(server));
  }

  std::string url() const { return Server().url(); }
  int port() const { return Server().port(); }
  void Close() {
    nb::gil_scoped_release release;  // waits for the requests in flight
    server_.reset();
  }

 private:
  const PeerServer& Server() const {
    if (server_ == nullptr) ThrowIfError(FailedPreconditionError("the peer server is closed"));
    return *server_;
  }
  std::unique_ptr<PeerServer> server_;
};

}  // namespace

void DefinePeerServer(nb::module_& m) {
  nb::class_<PyPeerServer>(
      m, "PeerServer",
      "Serves the committed steps under `root` (\"<folder>/<step: 10 digits>/...\") "
      "read-only over HTTP to requests carrying `secret`.")
      .def(nb::init<const std::string&, const std::string&, int, const std::string&, int>(),
           nb::arg("root"), nb::kw_only(), nb::arg("address") = "127.0.0.1", nb::arg("port") = 0,
           nb::arg("secret"), nb::arg("threads") = 4,
           "Starts serving. ValueError for a bad address or a secret shorter than 16 "
           "characters, FileNotFoundError for a missing root, ConnectionError when the "
           "address cannot be bound.")
      .def_prop_ro("url", &PyPeerServer::url, "\"http://<address>:<port>\"")
      .def_prop_ro("port", &PyPeerServer::port)
      .def("close", &PyPeerServer::Close, "Stops serving (waits for the requests in flight).");
}

}  // namespace tensorstash::python
