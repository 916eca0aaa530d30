// The exchange of every process's needed boxes through the job's coordinator, for the planner
// (shared_read_plan.h).
//
// Each process publishes its encoded box list (base64, as coordinator values are text) under
// "<prefix>boxes/<p>" and a 128-bit digest of it (XXH3) under "<prefix>digest/<p>". Every process
// gathers the N digests, and reads the lists of the first process of each distinct digest only:
// data-parallel replicas need the same boxes, so a job of R replicas of F processes moves F lists
// to each process, not N. (Digests of different lists that collide would merge them; at 128 bits
// that is not a concern for a job's few distinct lists.)
//
// Thread-safety: as Coordinator (one thread of each process at a time).
#ifndef TENSORSTASH_SHARE_NEEDS_EXCHANGE_H_
#define TENSORSTASH_SHARE_NEEDS_EXCHANGE_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/coordination/coordinator.h"
#include "tensorstash/share/shared_read_plan.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// 32 hex digits of the XXH3-128 of `encoded` (an EncodeNeeds result).
std::string NeedsDigest(std::string_view encoded);

// Coordinator bytes of one exchange, for this process.
struct NeedsExchangeStats {
  uint64_t bytes_sent = 0;      // values it published
  uint64_t bytes_received = 0;  // values it read
  int distinct_lists = 0;
};

// Every process's needs, grouped (GroupNeeds's order: lists by their first process). Every process
// of the job calls it with the same `key_prefix` (unique per restore). Waits at most `timeout` for
// the others' digests (DeadlineExceeded naming those that did not arrive); a list that does not
// decode against `arrays` is InvalidArgument naming its process.
Result<JobNeeds> ExchangeNeeds(Coordinator& coordinator, std::string_view key_prefix,
                               const ProcessNeeds& mine, const std::vector<SharedArray>& arrays,
                               std::chrono::milliseconds timeout,
                               NeedsExchangeStats* stats = nullptr);

}  // namespace tensorstash

#endif  // TENSORSTASH_SHARE_NEEDS_EXCHANGE_H_
