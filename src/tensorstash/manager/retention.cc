#include "tensorstash/manager/retention.h"

#include <algorithm>

namespace tensorstash {

std::vector<int64_t> StepsToDelete(const std::set<int64_t>& steps,
                                   const std::map<int64_t, double>& metrics,
                                   const RetentionPolicy& policy) {
  if (policy.max_to_keep <= 0 || steps.size() <= static_cast<size_t>(policy.max_to_keep)) {
    return {};
  }
  std::set<int64_t> kept;
  if (!policy.by_metric) {
    auto it = steps.rbegin();  // the newest max_to_keep
    for (int i = 0; i < policy.max_to_keep; ++i, ++it) kept.insert(*it);
  } else {
    // The best max_to_keep, and the newest step, which a restart resumes from.
    std::vector<int64_t> ranked(steps.rbegin(), steps.rend());
    const bool lower_is_better = policy.best_mode == BestMode::kMin;
    std::stable_sort(ranked.begin(), ranked.end(), [&](int64_t a, int64_t b) {
      auto ma = metrics.find(a), mb = metrics.find(b);
      if ((ma == metrics.end()) != (mb == metrics.end())) return mb == metrics.end();
      if (ma == metrics.end()) return false;
      return lower_is_better ? ma->second < mb->second : ma->second > mb->second;
    });
    for (int i = 0; i < policy.max_to_keep; ++i) kept.insert(ranked[i]);
    kept.insert(*steps.rbegin());
  }
  std::vector<int64_t> doomed;
  for (int64_t step : steps) {
    if (kept.count(step) > 0) continue;
    if (policy.keep_period > 0 && step % policy.keep_period == 0) continue;
    doomed.push_back(step);
  }
  return doomed;
}

}  // namespace tensorstash
