#include "tensorstash/share/peer/shared_source.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>
#include <utility>

#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/http/http_client.h"
#include "tensorstash/kvstore/http/peer_server.h"
#include "tensorstash/share/needs_exchange.h"
#include "tensorstash/share/shared_read_plan.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// One shared chunk as this process meets it in a data file.
struct ChunkRoute {
  uint64_t offset = 0;
  uint64_t length = 0;
  uint32_t crc = 0;
  bool serve = false;  // this process reads it (the pump); else it receives it from `reader`
  int reader = -1;
  size_t slot = 0;   // of a served chunk: its place in the pump's results
  std::string name;  // "<array>/<chunk>": its key under /v1/shared/
  std::string what;  // for messages
};

struct Peer {
  std::string url;
  std::string secret;
};

// A data file's reads, routed by the source (ReadAt goes to SharedStepSource::Impl::Route).
using BaseRead = std::function<Status(uint64_t offset, size_t size, char* dest)>;

class ChunkRouter {
 public:
  virtual ~ChunkRouter() = default;
  // Reads [offset, offset + size) of data file `key` into `dest`; `read` reads from storage.
  virtual Status Route(std::string_view key, uint64_t offset, size_t size, char* dest,
                       const BaseRead& read) = 0;
};

}  // namespace

struct SharedStepSource::Impl final : public ChunkRouter {
  KvStore* base = nullptr;
  std::unique_ptr<KvStore> routing;  // declared before `reader`, which reads through it
  std::unique_ptr<CheckpointReader> reader;
  Coordinator* coordinator = nullptr;
  ShareOptions share;

  // Set by Share, read-only afterwards (but `gone`, the pump's results and the stats).
  bool active = false;
  std::unique_ptr<PeerServer> server;
  std::unique_ptr<HttpClient> client;
  std::map<std::string, std::vector<ChunkRoute>, std::less<>> routes;  // by file key, by offset
  std::map<int, Peer> peers;
  std::set<std::string, std::less<>> data_keys;  // every data file's key in `base`
  std::vector<std::pair<std::string, int>> wanted;  // served chunks, their receiver counts

  // The pump.
  struct Pumped {
    const ChunkRoute* route = nullptr;
    std::string key;  // the data file's
    std::shared_ptr<const std::string> bytes;
    Status status;
    bool done = false;
  };
  std::vector<Pumped> pumped;
  // The pump's requests: runs of served chunks that are neighbours in one data file (slots
  // [first, first + count) of `pumped`): no chunk another process serves between them, at most
  // `gap_bytes` between two (alignment padding, or a chunk no process shares), the span at
  // most `max_request_bytes`; each read in one request.
  struct PumpRun {
    std::string key;
    size_t first = 0;
    size_t count = 0;
    uint64_t offset = 0;
    uint64_t length = 0;       // of the span
    uint64_t chunk_bytes = 0;  // of its chunks (what the stats count)
  };
  std::vector<PumpRun> pump_runs;
  uint64_t max_request_bytes = 0;
  uint64_t gap_bytes = 0;
  std::mutex pump_mu;
  std::condition_variable pump_cv;
  std::atomic<size_t> pump_next{0};
  std::atomic<bool> stopping{false};
  std::vector<std::thread> pump_threads;

  mutable std::mutex mu;  // guards stats and gone
  ShareStats stats;
  std::map<int, std::string> gone;  // peers that died or stalled: why

  ~Impl() { StopPump(); }

  void StopPump() {
    stopping = true;
    for (std::thread& t : pump_threads) t.join();
    pump_threads.clear();
  }

  void AccountStorage(uint64_t bytes, double seconds) {
    std::lock_guard<std::mutex> lock(mu);
    stats.storage_bytes += bytes;
    stats.storage_seconds += seconds;
  }

  Status FromStorage(const BaseRead& read, uint64_t offset, size_t size, char* dest) {
    const auto start = Clock::now();
    Status status = read(offset, size, dest);
    AccountStorage(status.ok() ? size : 0, SecondsSince(start));
    return status;
  }

  void Pump() {
    for (size_t i = pump_next++; i < pump_runs.size() && !stopping; i = pump_next++) {
      const PumpRun& run = pump_runs[i];
      std::string span(run.length, '\0');
      const auto start = Clock::now();
      const Status status = base->ReadRange(run.key, run.offset, run.length, span.data());
      AccountStorage(status.ok() ? run.chunk_bytes : 0, SecondsSince(start));
      if (stopping) break;  // (Finish or the destructor: no one reads it any more)
      for (size_t slot = run.first; slot < run.first + run.count; ++slot) {
        Pumped& p = pumped[slot];
        const ChunkRoute& r = *p.route;
        std::shared_ptr<std::string> bytes;
        Status chunk_status = status;
        if (!status.ok()) {
          server->PublishFailure(r.name, StrCat("reading ", r.what, ": ", status.message()));
        } else {
          bytes = run.count == 1
                      ? std::make_shared<std::string>(std::move(span))
                      : std::make_shared<std::string>(span, r.offset - run.offset, r.length);
          if (Crc32c(bytes->data(), bytes->size()) != r.crc) {
            // The receivers then read it themselves, and meet the damage as any read would.
            server->PublishFailure(r.name, StrCat("CRC-32C mismatch in ", r.what, " as stored"));
          } else {
            server->Publish(r.name, bytes);
          }
        }
        {
          std::lock_guard<std::mutex> lock(mu);
          ++stats.served_chunks;
        }
        std::lock_guard<std::mutex> lock(pump_mu);
        p.bytes = std::move(bytes);
        p.status = std::move(chunk_status);
        p.done = true;
        pump_cv.notify_all();
      }
    }
  }

  // A chunk this process serves, for its own read: the pump's copy.
  Status FromPump(const ChunkRoute& r, char* dest) {
    std::unique_lock<std::mutex> lock(pump_mu);
    pump_cv.wait(lock, [&] { return pumped[r.slot].done; });
    const Pumped& p = pumped[r.slot];
    if (!p.status.ok()) return p.status;
    std::memcpy(dest, p.bytes->data(), r.length);
    return OkStatus();
  }

  std::string PeerName(int p) const {
    auto it = peers.find(p);
    return StrCat("process ", p, it == peers.end() ? "" : StrCat(" (", it->second.url, ")"));
  }

  void MarkGone(int p, const std::string& why) {
    std::lock_guard<std::mutex> lock(mu);
    gone.emplace(p, why);
  }

  // A chunk another process serves: polled until it is there (503 before), then checked.
  Status FromPeer(const ChunkRoute& r, char* dest) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (auto it = gone.find(r.reader); it != gone.end()) {
        return UnavailableError(StrCat(PeerName(r.reader), " stopped serving earlier: ",
                                       it->second));
      }
    }
    const Peer& peer = peers.at(r.reader);
    HttpRequest request;
    request.url = StrCat(peer.url, "/v1/shared/", r.name);
    request.headers.emplace_back(kPeerSecretHeader, peer.secret);
    request.dest = dest;
    request.dest_size = r.length;
    const auto start = Clock::now();
    const auto deadline = start + share.timeout;
    auto backoff = std::chrono::milliseconds(1);
    const std::string what = StrCat("receiving ", r.what, " from ", PeerName(r.reader));
    while (true) {
      Result<HttpResponse> response = client->Perform(request, what);
      if (!response.ok()) {
        MarkGone(r.reader, std::string(response.status().message()));
        return response.status();
      }
      if (response->status == 200) {
        if (response->overflow || response->received != r.length) {
          return DataLossError(StrCat(what, ": ", response->received, " bytes, the index says ",
                                      r.length));
        }
        const uint32_t crc = Crc32c(dest, r.length);
        if (crc != r.crc) {
          return DataLossError(StrCat(what, ": CRC-32C mismatch: the index says ", Hex32(r.crc),
                                      ", received ", Hex32(crc)));
        }
        std::lock_guard<std::mutex> lock(mu);
        stats.peer_bytes += r.length;
        stats.peer_seconds += SecondsSince(start);
        ++stats.received_chunks;
        return OkStatus();
      }
      if (response->status != 503) {
        return UnavailableError(
            StrCat(what, ": HTTP ", response->status, ": ", response->body));
      }
      if (Clock::now() + backoff > deadline) {
        const std::string why = StrCat("did not serve ", r.what, " within ",
                                       share.timeout.count(), " ms");
        MarkGone(r.reader, why);
        return DeadlineExceededError(StrCat(PeerName(r.reader), " ", why));
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(20));
    }
  }

  // Reads [offset, offset + size) of data file `key` into `dest`, each shared chunk through its
  // route, the rest (and a chunk whose route failed) from storage.
  Status Route(std::string_view key, uint64_t offset, size_t size, char* dest,
               const BaseRead& read) override {
    if (!active) return read(offset, size, dest);
    auto found = routes.find(key);
    if (found == routes.end()) {
      // Data files count as storage reads; the step's other files (tree.json, the index,
      // read through the same calls on an object store) do not.
      if (data_keys.contains(key)) return FromStorage(read, offset, size, dest);
      return read(offset, size, dest);
    }
    const std::vector<ChunkRoute>& list = found->second;
    const uint64_t end = offset + size;
    auto r = std::lower_bound(list.begin(), list.end(), offset,
                              [](const ChunkRoute& x, uint64_t o) {
                                return x.offset + x.length <= o;
                              });
    uint64_t pos = offset;
    while (pos < end) {
      if (r == list.end() || r->offset >= end) {
        return FromStorage(read, pos, end - pos, dest + (pos - offset));
      }
      if (r->offset > pos) {
        TS_RETURN_IF_ERROR(FromStorage(read, pos, r->offset - pos, dest + (pos - offset)));
        pos = r->offset;
      }
      const uint64_t chunk_end = std::min(end, r->offset + r->length);
      if (r->offset < offset || r->offset + r->length > end) {
        // Part of a chunk (no reader asks for one): storage.
        TS_RETURN_IF_ERROR(FromStorage(read, pos, chunk_end - pos, dest + (pos - offset)));
      } else {
        char* at = dest + (pos - offset);
        Status status = r->serve ? FromPump(*r, at) : FromPeer(*r, at);
        if (!status.ok()) {
          if (!r->serve) {
            std::lock_guard<std::mutex> lock(mu);
            ++stats.fallback_chunks;
            stats.fallbacks.push_back(
                StrCat(status.message(), "; read from storage by process ",
                       coordinator->process_index(), " instead"));
          }
          TS_RETURN_IF_ERROR(FromStorage(read, pos, r->length, at));
        }
      }
      pos = chunk_end;
      ++r;
    }
    return OkStatus();
  }

  Status Share(const std::vector<ReadRequest>& requests);
  // The key in `base` of data file `file_id`: what the pump reads and the routes match.
  std::string StoreKey(uint32_t file_id) const;
};

namespace {

class RoutedFile final : public ReadableFile {
 public:
  RoutedFile(ChunkRouter* impl, std::string key, std::unique_ptr<ReadableFile> base)
      : impl_(impl), key_(std::move(key)), base_(std::move(base)) {}
  uint64_t size() const override { return base_->size(); }
  Status ReadAt(uint64_t offset, size_t size, void* dest) const override {
    return impl_->Route(key_, offset, size, static_cast<char*>(dest),
                        [this](uint64_t o, size_t n, char* d) { return base_->ReadAt(o, n, d); });
  }

 private:
  ChunkRouter* impl_;
  std::string key_;
  std::unique_ptr<ReadableFile> base_;
};

// The store the reader reads through: data files routed, everything else as the base's.
// Mapping is off, so that every chunk's bytes pass through ReadAt.
class RoutingKvStore final : public ForwardingKvStore {
 public:
  RoutingKvStore(KvStore* base, ChunkRouter* impl)
      : ForwardingKvStore(base), impl_(impl) {}
  KvStoreCapabilities Capabilities() const override {
    KvStoreCapabilities capabilities = ForwardingKvStore::Capabilities();
    capabilities.mapping = false;
    return capabilities;
  }
  Result<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view key) override {
    TS_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, base()->OpenForRead(key));
    return std::unique_ptr<ReadableFile>(
        std::make_unique<RoutedFile>(impl_, std::string(key), std::move(file)));
  }
  Status ReadRangeAtGeneration(std::string_view key, std::string_view generation, uint64_t offset,
                               size_t size, void* dest) override {
    return impl_->Route(key, offset, size, static_cast<char*>(dest),
                        [&](uint64_t o, size_t n, char* d) {
                          return base()->ReadRangeAtGeneration(key, generation, o, n, d);
                        });
  }

 private:
  ChunkRouter* impl_;
};

}  // namespace

std::string SharedStepSource::Impl::StoreKey(uint32_t file_id) const {
  std::string key = reader->DataFileKey(file_id);
  // A step committed by record on an object store (engine/object_store_commit.h) keeps its own
  // files under its attempt's folder: the reader names them "<dir>/state/...", the store holds
  // them at "<dir>/<attempt>/state/...".
  const std::string& attempt = reader->commit_record().attempt;
  const std::string& dir = reader->dir();
  if (!attempt.empty() && reader->index().files[file_id].step.empty() &&
      key.starts_with(dir + "/")) {
    key = StrCat(dir, "/", attempt, key.substr(dir.size()));
  }
  return key;
}

Status SharedStepSource::Impl::Share(const std::vector<ReadRequest>& requests) {
  if (coordinator == nullptr || coordinator->process_count() <= 1) return OkStatus();
  if (server != nullptr) return FailedPreconditionError("Share was called twice");
  const int me = coordinator->process_index();
  const std::vector<ArrayMetadata>& arrays = reader->arrays();
  std::map<std::string_view, uint32_t> id_of;
  for (size_t a = 0; a < arrays.size(); ++a) id_of.emplace(arrays[a].path, a);
  ProcessNeeds mine;
  mine.boxes.resize(arrays.size());
  for (const ReadRequest& r : requests) {
    auto it = id_of.find(r.path);
    if (it == id_of.end()) {
      return NotFoundError(StrCat("no array '", r.path, "' in checkpoint '", reader->dir(), "'"));
    }
    const int rank = static_cast<int>(arrays[it->second].shape().size());
    if (r.box.rank() != rank) {
      return InvalidArgumentError(StrCat("a box of rank ", r.box.rank(), " for array '", r.path,
                                         "' of rank ", rank));
    }
    if (!r.box.empty()) mine.boxes[it->second].push_back(r.box);
  }
  std::vector<SharedArray> shared(arrays.size());
  for (size_t a = 0; a < arrays.size(); ++a) {
    shared[a].path = arrays[a].path;
    shared[a].grid = arrays[a].grid;
    shared[a].chunk_bytes.assign(static_cast<size_t>(arrays[a].grid.NumChunks()), 0);
  }
  const ChunkIndex& index = reader->index();
  for (const IndexEntry& e : index.entries) {
    if (e.chunk < shared[e.array_id].chunk_bytes.size()) {
      shared[e.array_id].chunk_bytes[e.chunk] = e.length;
    }
  }

  PeerServerOptions options;
  options.bind_address = share.bind_address;
  options.secret = RandomHexId(32);
  options.threads = share.server_threads;
  options.process_count = coordinator->process_count();
  TS_ASSIGN_OR_RETURN(server, PeerServer::Start("", options));
  // Before the needs: whoever has everyone's needs finds everyone's server.
  TS_RETURN_IF_ERROR(coordinator->KeyValueSet(StrCat(share.key_prefix, "peer/", me),
                                              StrCat(server->url(), " ", options.secret)));
  TS_ASSIGN_OR_RETURN(JobNeeds job, ExchangeNeeds(*coordinator, StrCat(share.key_prefix, "needs/"),
                                                  mine, shared, share.timeout));
  TS_ASSIGN_OR_RETURN(SharedReadPlan plan, PlanSharedReads(shared, job));
  const ProcessShare part = plan.ForProcess(job, shared, me);

  HttpClientOptions http;
  using std::chrono::milliseconds;
  http.stall_timeout = std::min<milliseconds>(share.timeout, std::chrono::seconds(10));
  http.connect_timeout = std::min<milliseconds>(share.timeout, std::chrono::seconds(5));
  http.allow_https = false;
  client = std::make_unique<HttpClient>(http);

  for (uint32_t f = 0; f < index.files.size(); ++f) data_keys.insert(StoreKey(f));
  auto add = [&](const SharedChunk& c, bool serve) -> Status {
    const auto begin = index.entries.begin();
    auto it = std::lower_bound(begin, index.entries.end(), std::make_pair(c.array, c.chunk),
                               [](const IndexEntry& e, std::pair<uint32_t, int64_t> k) {
                                 return std::make_pair(e.array_id, static_cast<int64_t>(e.chunk)) <
                                        k;
                               });
    if (it == index.entries.end() || it->array_id != c.array ||
        static_cast<int64_t>(it->chunk) != c.chunk) {
      return OkStatus();  // not stored: the reader reads nothing for it
    }
    ChunkRoute route;
    route.offset = it->offset;
    route.length = it->length;
    route.crc = it->crc32c;
    route.serve = serve;
    route.reader = c.reader;
    route.name = StrCat(c.array, "/", c.chunk);
    route.what = StrCat("chunk ", arrays[c.array].grid.ChunkName(c.chunk), " of array '",
                        arrays[c.array].path, "'");
    routes[StoreKey(it->file_id)].push_back(std::move(route));
    if (serve) wanted.emplace_back(StrCat(c.array, "/", c.chunk), static_cast<int>(c.needers) - 1);
    return OkStatus();
  };
  for (const SharedChunk& c : part.serves) TS_RETURN_IF_ERROR(add(c, true));
  for (const SharedChunk& c : part.receives) {
    if (!peers.contains(c.reader)) {
      TS_ASSIGN_OR_RETURN(std::string value,
                          coordinator->KeyValueGet(StrCat(share.key_prefix, "peer/", c.reader),
                                                   share.timeout));
      const size_t space = value.find(' ');
      if (space == std::string::npos) {
        return InvalidArgumentError(
            StrCat("process ", c.reader, " published no peer address: '", value, "'"));
      }
      peers[c.reader] = Peer{value.substr(0, space), value.substr(space + 1)};
    }
    TS_RETURN_IF_ERROR(add(c, false));
  }
  // The routes do not move from here on: the pump's slots point into them.
  for (auto& [key, list] : routes) {
    std::sort(list.begin(), list.end(),
              [](const ChunkRoute& a, const ChunkRoute& b) { return a.offset < b.offset; });
    bool extend = false;  // the route before this one was served, and in the last run
    for (ChunkRoute& r : list) {
      if (!r.serve) {
        extend = false;
        continue;
      }
      r.slot = pumped.size();
      pumped.push_back(Pumped{&r, key, nullptr, OkStatus(), false});
      PumpRun* last = extend ? &pump_runs.back() : nullptr;
      const uint64_t end = last == nullptr ? 0 : last->offset + last->length;
      if (last != nullptr && r.offset >= end && r.offset - end <= gap_bytes &&
          r.offset + r.length - last->offset <= max_request_bytes) {
        last->length = r.offset + r.length - last->offset;
        last->chunk_bytes += r.length;
        ++last->count;
      } else {
        pump_runs.push_back(PumpRun{key, r.slot, 1, r.offset, r.length, r.length});
      }
      extend = true;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    stats.active = true;
  }
  active = true;
  const int threads = std::max(1, std::min<int>(share.pump_threads, pump_runs.size()));
  for (int t = 0; t < threads && !pump_runs.empty(); ++t) {
    pump_threads.emplace_back([this] { Pump(); });
  }
  return OkStatus();
}

SharedStepSource::SharedStepSource(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SharedStepSource::~SharedStepSource() = default;

Result<std::unique_ptr<SharedStepSource>> SharedStepSource::Open(KvStore* kv, std::string dir,
                                                                 ReaderOptions options,
                                                                 Coordinator* coordinator,
                                                                 ShareOptions share) {
  auto impl = std::make_unique<Impl>();
  impl->base = kv;
  impl->coordinator = coordinator;
  impl->share = std::move(share);
  impl->routing = std::make_unique<RoutingKvStore>(kv, impl.get());
  impl->max_request_bytes = options.max_request_bytes;
  impl->gap_bytes = options.coalesce_gap_bytes;
  // Spans of neighbouring chunks only, no bytes between them: a span then holds nothing but
  // chunks the read needs, so that each shared chunk is fetched once, and no byte of a chunk
  // that another process reads is read from storage as a gap. (The pump, which knows which
  // chunks are whose, spans the gaps between its own.)
  options.coalesce_gap_bytes = 0;
  TS_ASSIGN_OR_RETURN(impl->reader,
                      CheckpointReader::Open(impl->routing.get(), std::move(dir), options));
  return std::unique_ptr<SharedStepSource>(new SharedStepSource(std::move(impl)));
}

Status SharedStepSource::Share(const std::vector<ReadRequest>& requests) {
  return impl_->Share(requests);
}

Status SharedStepSource::Finish() {
  Impl& s = *impl_;
  if (s.server == nullptr) return OkStatus();
  std::vector<std::string> short_of =
      s.server->WaitServed(s.wanted, Clock::now() + s.share.timeout);
  s.StopPump();
  s.server.reset();
  s.active = false;  // later reads go to storage
  if (short_of.empty()) return OkStatus();
  return DeadlineExceededError(
      StrCat("process ", s.coordinator->process_index(), ": ", short_of.size(),
             " chunk(s) it served were not fetched by every process that needs them within ",
             s.share.timeout.count(), " ms (first: ", short_of.front(), ")"));
}

ShareStats SharedStepSource::share_stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

const std::string& SharedStepSource::dir() const { return impl_->reader->dir(); }
const TreeNode& SharedStepSource::tree() const { return impl_->reader->tree(); }
const std::vector<ArrayMetadata>& SharedStepSource::arrays() const {
  return impl_->reader->arrays();
}
uint64_t SharedStepSource::StoredBytes(size_t id) const { return impl_->reader->StoredBytes(id); }
int64_t SharedStepSource::NumChunks(size_t id) const {
  return impl_->reader->arrays()[id].grid.NumStoredChunks();
}
std::string SharedStepSource::CodecDescription(size_t id) const {
  return std::string(CodecName(impl_->reader->arrays()[id].codec));
}
int64_t SharedStepSource::created_unix_ms() const {
  return impl_->reader->commit_record().created_unix_ms;
}
int SharedStepSource::process_count() const { return impl_->reader->commit_record().process_count; }
Status SharedStepSource::ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats,
                                  const std::function<void(uint64_t, uint64_t)>& progress) {
  return impl_->reader->ReadMany(requests, stats, progress);
}
Result<std::string> SharedStepSource::ReadFile(std::string_view name) const {
  return impl_->reader->ReadFile(name);
}
Result<std::vector<BadChunk>> SharedStepSource::Verify(
    const std::function<void(uint64_t, uint64_t)>& progress) {
  return impl_->reader->Verify(progress);
}
uint64_t SharedStepSource::VerifyTotalBytes() const {
  uint64_t total = 0;
  for (const IndexEntry& e : impl_->reader->index().entries) total += e.length;
  return total;
}
size_t SharedStepSource::VerifyTotalItems() const {
  return impl_->reader->index().entries.size() + impl_->reader->commit_record().files.size();
}
CheckpointReader* SharedStepSource::native() { return impl_->reader.get(); }

}  // namespace tensorstash
