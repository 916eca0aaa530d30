// SharedStepSource: a native step read by several processes of a job, each stored chunk that
// several of them need read from storage once (docs/proposals/shared-reads.md, issue 42).
//
//   auto source = SharedStepSource::Open(kv, "0000000120", reader_options, &coordinator, {...});
//   source->Share(requests)   // every process, with every box it will read: the agreement
//   source->ReadMany(...)     // as often as the restore likes, batched as it likes
//   source->Finish()          // waits (bounded) for its receivers, stops serving
//   source->share_stats()     // bytes and seconds from storage and from peers
//
// Share publishes this process's peer server (its URL and a secret of its own, through the
// coordinator), exchanges the boxes each process needs (ExchangeNeeds) and computes the plan
// (PlanSharedReads), which every process computes alike. Then a pump reads the chunks this
// process serves from storage (neighbouring chunks of a data file in one request of at most
// ReaderOptions::max_request_bytes), checks their CRC-32C and publishes them on its server
// (/v1/shared/<array>/<chunk>). Reads go through the ordinary CheckpointReader over a store
// that routes each chunk's bytes: a chunk it serves comes from the pump, a chunk another
// process serves from that process (polled: 503 until it is there, 1 to 20 ms apart), every
// other byte from storage. The reader checks every chunk's CRC-32C against the index as for
// any read, and the route checks a received chunk before handing it over: a chunk that is not
// received within the timeout, comes from a process that died or stalled, or fails its
// CRC-32C is read from storage by this process itself, and share_stats().fallbacks names the
// process. Nothing waits on all processes but the exchange of needs.
//
// Without sharing (a job of one process, Share never called) every read goes to storage, as
// with CheckpointReader. Chunks of other steps (incremental steps) are read from storage.
//
// Thread-safety: as StepSource; Share and Finish on one thread, not during a ReadMany.
#ifndef TENSORSTASH_SHARE_PEER_SHARED_SOURCE_H_
#define TENSORSTASH_SHARE_PEER_SHARED_SOURCE_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tensorstash/coordination/coordinator.h"
#include "tensorstash/engine/step_source.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct ShareOptions {
  // The coordination timeout: for the exchange of needs, and for each chunk from a peer.
  std::chrono::milliseconds timeout{60'000};
  // Unique per restore and the same on every process (e.g. "share/<step>/<n>/").
  std::string key_prefix;
  // The address this process's peer server listens on and publishes.
  std::string bind_address = "127.0.0.1";
  int pump_threads = 4;
  int server_threads = 4;
};

struct ShareStats {
  bool active = false;            // Share ran with more than one process
  uint64_t storage_bytes = 0;     // stored bytes this process read from storage
  double storage_seconds = 0;     // time its reads from storage took (summed over threads)
  uint64_t peer_bytes = 0;        // stored bytes it received from peers
  double peer_seconds = 0;        // time spent receiving them, waits included
  uint64_t served_chunks = 0;     // chunks it read for others
  uint64_t received_chunks = 0;   // chunks received intact
  uint64_t fallback_chunks = 0;   // chunks it should have received but read itself
  std::vector<std::string> fallbacks;  // why, one line per chunk, naming the process
};

class SharedStepSource final : public StepSource {
 public:
  // Opens native step `dir` of `kv` (which must outlive the source). The errors of
  // CheckpointReader::Open; InvalidArgument for a step in another format.
  static Result<std::unique_ptr<SharedStepSource>> Open(KvStore* kv, std::string dir,
                                                        ReaderOptions options,
                                                        Coordinator* coordinator,
                                                        ShareOptions share);
  ~SharedStepSource() override;

  // The agreement; every process calls it once with all the requests it will read. Errors:
  // the exchange's (DeadlineExceeded naming the processes that did not come), the server's.
  Status Share(const std::vector<ReadRequest>& requests);
  // Waits until the processes that receive chunks from this one have asked for each (or the
  // timeout), then stops serving. Returns the chunks never asked for, as a message (OK when
  // none).
  Status Finish();
  ShareStats share_stats() const;

  StepFormat format() const override { return StepFormat::kNative; }
  const std::string& dir() const override;
  const TreeNode& tree() const override;
  const std::vector<ArrayMetadata>& arrays() const override;
  uint64_t StoredBytes(size_t id) const override;
  int64_t NumChunks(size_t id) const override;
  std::string CodecDescription(size_t id) const override;
  int64_t created_unix_ms() const override;
  int process_count() const override;
  Status ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats,
                  const std::function<void(uint64_t, uint64_t)>& progress) override;
  Result<std::string> ReadFile(std::string_view name) const override;
  Result<std::vector<BadChunk>> Verify(
      const std::function<void(uint64_t, uint64_t)>& progress) override;
  uint64_t VerifyTotalBytes() const override;
  size_t VerifyTotalItems() const override;
  CheckpointReader* native() override;

 private:
  struct Impl;
  explicit SharedStepSource(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_SHARE_PEER_SHARED_SOURCE_H_
