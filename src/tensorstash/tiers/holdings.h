// Holdings: what the node-local tier holds, and which steps the holdings of a job restore
// (docs/multitier.md, "Which steps exist"). Pure functions, except DescribeHoldings, which reads
// a local folder.
//
// A holding is one process's committed local save of one step: a step folder
// "<local_dir>/p<index>-of-<count>/<step>" written with WriterOptions::holding, holding every
// chunk the process had a shard of, the step's metadata, and as "process/0" the per-process
// values of the process and of the next ones in process order (ValueRing), packed with the
// save's id (PackValues). The folder names the process that saved it (and the job's size then),
// so that after a restart in another order a process still finds the value saved with its index.
#ifndef TENSORSTASH_TIERS_HOLDINGS_H_
#define TENSORSTASH_TIERS_HOLDINGS_H_

#include <compare>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorstash/format/tree.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// How many other processes' per-process values a holding carries besides its own.
inline constexpr int kValueReplicas = 3;

// The processes whose per-process values the holding of process `index` carries: `index`, then
// the next kValueReplicas ones (mod `count`), without repeats.
std::vector<int> ValueRing(int index, int count);

// "p<index>-of-<count>", and its inverse (nullopt for any other name, or index >= count).
std::string HoldingFolder(int process_index, int process_count);
std::optional<std::pair<int, int>> ParseHoldingFolder(std::string_view name);

// A per-process value, or none (the process saved no value).
using ProcessValues = std::map<int, std::optional<std::string>>;

// What a holding's "process/0" holds: a magic line, the run it belongs to (LocalTierOptions::run),
// the save's id, then each process's value.
struct PackedValues {
  std::string run;
  std::string save_id;
  ProcessValues values;
};
std::string PackValues(const PackedValues& packed);
// The inverse. DataLoss naming `where` for anything else (a holding written by an older
// release, without a run, included).
Result<PackedValues> UnpackValues(std::string_view data, std::string_view where);

// An id for one local save of the job (drawn by process 0): the time first, so that of two saves
// of one step number (a step saved again after a rollback) the later sorts last.
std::string NewSaveId();

// A digest of the arrays' paths, dtypes, shapes and chunk grids: holdings of one save agree on it.
std::string ArraysDigest(const std::vector<ArrayMetadata>& arrays);

// What identifies one save of the job: holdings of different saves never mix in a restore.
struct SaveKey {
  int64_t step = 0;
  std::string save_id;
  std::string digest;
  int process_count = 0;
  auto operator<=>(const SaveKey&) const = default;
};

// One committed holding on one node, as its process publishes it to the others.
struct Holding {
  int holder = 0;      // the process (now) on whose node it is
  std::string folder;  // "p<saved by>-of-<count>"
  std::string run;     // the run it belongs to (LocalTierOptions::run)
  int64_t step = 0;
  std::string save_id;
  std::string digest;                                  // ArraysDigest
  std::map<std::string, int64_t> num_chunks;           // array path -> chunks the array has
  std::map<std::string, std::vector<int64_t>> chunks;  // array path -> chunks held here
  std::vector<int> values;                             // whose per-process values it carries

  // nullopt when `folder` is not a holding folder.
  std::optional<SaveKey> save() const;
};

// JSON text of a list of holdings, and its inverse (InvalidArgument for anything else).
std::string HoldingsToJson(const std::vector<Holding>& holdings);
Result<std::vector<Holding>> HoldingsFromJson(std::string_view text);

// For each step that the holdings alone restore, the save to restore: its holdings together store
// every chunk of every array and carry the per-process value of every process of the job that
// saved it. No single holding (no whole slice) needs to have everything. Holdings of different
// saves of a step never mix; of two complete saves of a step the later (greater SaveKey) wins.
std::map<int64_t, SaveKey> RestorableSaves(const std::vector<Holding>& holdings);

// Every step restorable from the holdings or present in `persistent_steps`, ascending.
std::vector<int64_t> RestorableSteps(const std::vector<Holding>& holdings,
                                     const std::vector<int64_t>& persistent_steps);

// The committed holdings under `local_dir` (every holding folder), each opened to list its chunks
// and values, all with `holder` as their holder. Folders that do not open (a crash left them
// half-written, a foreign or damaged file) are skipped: they hold nothing. Never fails; a
// missing `local_dir` holds nothing.
std::vector<Holding> DescribeHoldings(const std::string& local_dir, int holder);

// What a peer server of the local tier may serve (PeerServerOptions::may_serve): keys inside a
// committed holding under `local_dir`, "<folder>/<step>/...", whose step folder has its COMMIT.
std::function<bool(std::string_view key)> CommittedHoldingKeys(std::string local_dir);

}  // namespace tensorstash

#endif  // TENSORSTASH_TIERS_HOLDINGS_H_
