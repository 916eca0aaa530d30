#include "tensorstash/manager/step_dependencies.h"

#include <string>

#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/manager/step_store.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {

Result<std::set<int64_t>> StepDependencies::DependsOn(int64_t step) {
  if (auto it = cache_.find(step); it != cache_.end()) return it->second;
  TS_ASSIGN_OR_RETURN(std::string dir, StepStore::StepDir(step));
  TS_ASSIGN_OR_RETURN(CommitRecord record, ReadStepCommitRecord(kv_, dir));
  std::set<int64_t> steps;
  for (const std::string& name : record.depends_on) {
    if (std::optional<int64_t> base = StepStore::ParseStepName(name)) steps.insert(*base);
  }
  cache_[step] = steps;
  return steps;
}

Result<StepDependencies::Sorted> StepDependencies::Sort(const std::set<int64_t>& kept,
                                                       const std::set<int64_t>& also_protecting,
                                                       const std::set<int64_t>& dropped) {
  std::set<int64_t> needed;
  for (int64_t step : kept) {
    Result<std::set<int64_t>> bases = DependsOn(step);
    if (absl::IsNotFound(bases.status())) continue;  // deleted by hand meanwhile
    TS_RETURN_IF_ERROR(Annotate(bases.status(), StrCat("reading the commit record of kept step ",
                                                       step, " (no step was deleted)")));
    needed.insert(bases->begin(), bases->end());
  }
  for (int64_t step : also_protecting) {
    Result<std::set<int64_t>> bases = DependsOn(step);
    if (absl::IsNotFound(bases.status()) || absl::IsDataLoss(bases.status())) continue;
    TS_RETURN_IF_ERROR(Annotate(bases.status(),
                                StrCat("reading the commit record of step ", step,
                                       " (damaged; no step was deleted)")));
    needed.insert(bases->begin(), bases->end());
  }
  Sorted sorted;
  std::set<int64_t> remaining;
  for (int64_t step : dropped) {
    if (needed.count(step) > 0) {
      sorted.retire.push_back(step);
    } else {
      remaining.insert(step);
    }
  }
  // What each step to delete depends on among the others to delete. A record that cannot be
  // read names no base: the step goes whole anyway, COMMIT first.
  std::map<int64_t, std::set<int64_t>> edges;
  for (int64_t step : remaining) {
    Result<std::set<int64_t>> bases = DependsOn(step);
    if (!bases.ok()) continue;
    for (int64_t base : *bases) {
      if (base != step && remaining.count(base) > 0) edges[step].insert(base);
    }
  }
  // Newest first among those no remaining step depends on (a cycle, which only overwrites by
  // hand can make, is broken at its newest step).
  while (!remaining.empty()) {
    std::set<int64_t> depended;
    for (int64_t step : remaining) {
      for (int64_t base : edges[step]) {
        if (remaining.count(base) > 0) depended.insert(base);
      }
    }
    int64_t next = *remaining.rbegin();
    for (auto it = remaining.rbegin(); it != remaining.rend(); ++it) {
      if (depended.count(*it) == 0) {
        next = *it;
        break;
      }
    }
    sorted.remove.push_back(next);
    remaining.erase(next);
  }
  return sorted;
}

}  // namespace tensorstash
