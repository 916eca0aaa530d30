#include "tensorstash/kvstore/object_store/probe.h"

#include <map>
#include <mutex>

namespace tensorstash {

Result<ProbeFindings> ProbeOnce(const std::string& cache_key,
                                const std::function<Result<ProbeFindings>()>& probe) {
  static std::mutex mu;
  static auto* cache = new std::map<std::string, ProbeFindings>();  // guarded by mu
  // Held through the probe, so that stores opened at once on one bucket probe it once.
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(cache_key);
  if (it == cache->end()) {
    TS_ASSIGN_OR_RETURN(ProbeFindings found, probe());
    it = cache->emplace(cache_key, std::move(found)).first;
  }
  return it->second;
}

}  // namespace tensorstash
