// Retention: which steps of a series a checkpoint manager deletes. A pure policy, apart from any
// store, so that it is tested on its own and shared by every manager (one tier or several).
//
// Thread-safety: value types and a pure function.
#ifndef TENSORSTASH_MANAGER_RETENTION_H_
#define TENSORSTASH_MANAGER_RETENTION_H_

#include <cstdint>
#include <map>
#include <set>
#include <vector>

namespace tensorstash {

enum class BestMode { kMin, kMax };

struct RetentionPolicy {
  // Keep at most this many steps (besides those kept by keep_period): the newest ones, or with
  // by_metric the best ones and the newest; 0 keeps all.
  int max_to_keep = 0;
  // Steps divisible by this are never deleted; 0: none are kept that way.
  int64_t keep_period = 0;
  // Rank by a metric (lowest first for kMin, highest for kMax; a step without one ranks last,
  // and among equals the newer step first) instead of by age.
  bool by_metric = false;
  BestMode best_mode = BestMode::kMin;
};

// The steps of `steps` that `policy` deletes, ascending. `metrics` holds the metric of the steps
// that have one (used with by_metric). Deterministic: the same inputs give the same answer in
// every process.
std::vector<int64_t> StepsToDelete(const std::set<int64_t>& steps,
                                   const std::map<int64_t, double>& metrics,
                                   const RetentionPolicy& policy);

}  // namespace tensorstash

#endif  // TENSORSTASH_MANAGER_RETENTION_H_
