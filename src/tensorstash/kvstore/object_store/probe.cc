#include "tensorstash/kvstore/object_store/probe.h"

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>

namespace tensorstash {
namespace {

// One key's findings. `mu` is held through that key's probe so that stores opened at once on
// one bucket probe it once, while other keys' probes go on.
struct ProbeEntry {
  std::mutex mu;
  std::optional<ProbeFindings> findings;  // guarded by mu
};

}  // namespace

Result<ProbeFindings> ProbeOnce(const ProbeKey& key,
                                const std::function<Result<ProbeFindings>()>& probe) {
  using MapKey = std::tuple<std::string, std::string, std::string>;
  static std::mutex map_mu;
  // Entries are never removed (one per server and bucket a process uses), so a shared_ptr taken
  // under map_mu stays valid after it is released.
  static auto* entries = new std::map<MapKey, std::shared_ptr<ProbeEntry>>();  // guarded by map_mu
  std::shared_ptr<ProbeEntry> entry;
  {
    std::lock_guard<std::mutex> lock(map_mu);
    std::shared_ptr<ProbeEntry>& slot = (*entries)[MapKey(key.scheme, key.endpoint, key.bucket)];
    if (slot == nullptr) slot = std::make_shared<ProbeEntry>();
    entry = slot;
  }
  std::lock_guard<std::mutex> lock(entry->mu);
  if (!entry->findings.has_value()) {
    TS_ASSIGN_OR_RETURN(ProbeFindings found, probe());
    entry->findings = std::move(found);
  }
  return *entry->findings;
}

}  // namespace tensorstash
