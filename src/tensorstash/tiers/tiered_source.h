// TieredStepSource: one step read from several holders of it at once, chunk by chunk, each
// chunk from the cheapest holder that has an intact copy (the multi-tier restore;
// docs/multitier.md).
//
// A holder is a native step folder (CheckpointReader) in some store: this process's node-local
// tier (a folder), a peer's node-local tier (HttpKvStore), or the persistent tier. A node-local
// step holds only the chunks its process saved (a "holding", WriterOptions::holding); the
// persistent step holds all of them. Holders are given cheapest first.
//
//   TieredStepSource::Open({{Tier::kLocal, local_kv, "p0/0000000120"},
//                           {Tier::kPeer, peer_kv, "p3/0000000120"},
//                           {Tier::kPersistent, persistent_kv, "0000000120"}})
//   source->ReadMany(requests, ...)   // then source->tier_stats(): bytes and seconds per tier
//
// ReadMany plans the chunks the requests need (engine/read_plan.h). A request whose chunks one
// holder has all of is read by that holder straight into its destination (the first such
// holder); the others are read piece by piece, each chunk from its first holder, through a
// buffer. Every chunk's CRC-32C is checked, whoever holds it: a holder whose copy is corrupt,
// missing or unreachable is recorded in tier_stats().failures and the chunk is read from the
// next holder. Only when no holder gives an intact copy does ReadMany fail (DataLoss naming the
// array and chunk, with each holder's error).
//
// Holders agree on the tree (array paths, dtypes, shapes); one that does not is left out, as is
// one that does not open (both recorded in open_errors()). For chunk routing the first holder's
// grid is the reference: a holder that cut an array into other chunks serves none of its chunks.
//
// Thread-safety: as StepSource; tier_stats() is updated by ReadMany (do not read it during one).
#ifndef TENSORSTASH_TIERS_TIERED_SOURCE_H_
#define TENSORSTASH_TIERS_TIERED_SOURCE_H_

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/engine/step_source.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

enum class Tier { kLocal = 0, kPeer = 1, kPersistent = 2 };
inline constexpr int kNumTiers = 3;
// "local", "peer", "persistent".
std::string_view TierName(Tier tier);

struct StepHolder {
  Tier tier = Tier::kLocal;
  std::unique_ptr<KvStore> kv;  // owned by the source
  std::string dir;              // the step folder in `kv`
  std::string name;             // for messages (default: kv's description and dir)
};

struct TierStats {
  std::array<uint64_t, kNumTiers> bytes{};  // bytes of the boxes each tier filled
  std::array<double, kNumTiers> seconds{};  // time spent reading from each tier
  // One line per chunk (or request) a holder failed to give: "<holder>: <error>".
  std::vector<std::string> failures;
  // Whether a local holder failed on a chunk (its copy is damaged or incomplete).
  bool local_failed = false;
};

class TieredStepSource final : public StepSource {
 public:
  // Opens the step in each holder (in the order given: cheapest first). NotFound when none
  // opens (the message lists each holder's error).
  static Result<std::unique_ptr<TieredStepSource>> Open(std::vector<StepHolder> holders,
                                                        ReaderOptions options = {});
  ~TieredStepSource() override;

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
  // Maps the requests that a local holder (this node's RAM tier) serves whole, from its files
  // (CheckpointReader::MapMany); Unimplemented for the others, and for a local copy that
  // fails its checks (recorded in tier_stats(): the read then goes to the next holder).
  // options.max_mappings is one budget for all the local holders.
  std::vector<Result<MappedBox>> MapMany(const std::vector<ReadRequest>& requests,
                                         const MapOptions& options) override;
  // From the first holder whose step has the file intact. NotFound when no holder has it;
  // DataLoss when some holder has it but none gives it intact (damaged, unreachable).
  Result<std::string> ReadFile(std::string_view name) const override;
  // Verifies every holder; the bad chunks of all of them (the chunk names say which holder).
  Result<std::vector<BadChunk>> Verify(
      const std::function<void(uint64_t, uint64_t)>& progress) override;
  uint64_t VerifyTotalBytes() const override;
  size_t VerifyTotalItems() const override;

  // Holders that were left out when opening, with why.
  const std::vector<std::string>& open_errors() const;
  // Cumulative over every ReadMany since Open (or ResetTierStats).
  const TierStats& tier_stats() const;
  void ResetTierStats();
  // The holders in use, cheapest first: (tier, name).
  std::vector<std::pair<Tier, std::string>> holders() const;
  // The chunks holder `holder` (of holders()) stores, per array (arrays() order), ascending;
  // empty for an array it cut into other chunks than the first holder.
  const std::vector<std::vector<int64_t>>& held_chunks(size_t holder) const;

 private:
  struct Impl;
  struct Routing;
  explicit TieredStepSource(std::unique_ptr<Impl> impl);
  Result<Routing> Route(const std::vector<ReadRequest>& requests) const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_TIERS_TIERED_SOURCE_H_
