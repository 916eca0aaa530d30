// Which steps of a root refer to the data of which others (incremental steps, docs/format.md
// 6.1), for what retention and gc do with steps that are no longer listed: a step that a kept
// step depends on is retired (kept on storage, unlisted); any other is deleted, each before the
// steps it depends on, so that a crash halfway never leaves a step whose COMMIT still stands on
// a base already gone.
//
//   StepDependencies deps(kv);
//   deps.Sort(/*kept=*/{12, 13}, /*also_protecting=*/{}, /*dropped=*/{10, 11}) -> {retire, remove}
//
// Thread-safety: one thread at a time.
#ifndef TENSORSTASH_MANAGER_STEP_DEPENDENCIES_H_
#define TENSORSTASH_MANAGER_STEP_DEPENDENCIES_H_

#include <cstdint>
#include <map>
#include <set>
#include <vector>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

class StepDependencies {
 public:
  // `kv` holds the steps at its root (10-digit folders); it must outlive this.
  explicit StepDependencies(KvStore* kv) : kv_(kv) {}

  // The steps whose data `step` refers to (its COMMIT's depends_on; names that are not 10-digit
  // steps are left out), read once and remembered: a committed record does not change unless
  // the step is overwritten or deleted (call Forget then). NotFound when the step has no
  // commit record, DataLoss for a damaged one, the store's other errors.
  Result<std::set<int64_t>> DependsOn(int64_t step);
  void Forget(int64_t step) { cache_.erase(step); }

  struct Sorted {
    std::vector<int64_t> retire;  // a kept step depends on them: they stay, unlisted
    std::vector<int64_t> remove;  // to delete, in this order: each before those it depends on
  };
  // Sorts `dropped` (steps no longer listed) by what the `kept` steps depend on. A kept step
  // whose record cannot be read makes it an error (nothing may be deleted without knowing what
  // it needs), except one that is gone (deleted by hand). The steps of `also_protecting`
  // (damaged steps, left for inspection) protect their bases when their record can be read.
  Result<Sorted> Sort(const std::set<int64_t>& kept, const std::set<int64_t>& also_protecting,
                      const std::set<int64_t>& dropped);

 private:
  KvStore* const kv_;
  std::map<int64_t, std::set<int64_t>> cache_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_MANAGER_STEP_DEPENDENCIES_H_
