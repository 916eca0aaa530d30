// Coordinator: what a multi-process save needs from the job's runtime, and nothing more.
//
// Every process of a job holds one Coordinator. All processes must call the collective methods
// (Barrier) in the same order. Keys of the key-value store are written once; values are small
// (kilobytes). The exchanges built on it (gather, broadcast, agreeing on a status, each with one
// timeout) are in collectives.h. Implementations: SingleProcessCoordinator (here),
// InProcessCoordinator (several "processes" as threads of one process, for tests), JAX's
// distributed runtime (from Python), and later MPI.
//
// Thread-safety: one thread of each process uses its Coordinator at a time.
#ifndef TENSORSTASH_COORDINATION_COORDINATOR_H_
#define TENSORSTASH_COORDINATION_COORDINATOR_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "tensorstash/util/status.h"

namespace tensorstash {

class Coordinator {
 public:
  virtual ~Coordinator() = default;

  virtual int process_index() const = 0;
  virtual int process_count() const = 0;

  // Blocks until every process has called Barrier with the same `name`. DeadlineExceeded after
  // `timeout` (naming the barrier), and the barrier is then unusable.
  virtual Status Barrier(std::string_view name, std::chrono::milliseconds timeout) = 0;

  // Publishes `value` under `key` for every process. AlreadyExists if the key was set before.
  virtual Status KeyValueSet(std::string_view key, std::string_view value) = 0;
  // Waits until `key` is set (by any process) and returns its value. DeadlineExceeded after
  // `timeout`, naming the key.
  virtual Result<std::string> KeyValueGet(std::string_view key,
                                          std::chrono::milliseconds timeout) = 0;
  // The value of `key` if some process has set it, std::nullopt if none has yet, without
  // waiting: for polls that must not block on a process that may never come (shared reads ask
  // for a peer's address this way). An error only when the runtime cannot be asked.
  virtual Result<std::optional<std::string>> KeyValueTryGet(std::string_view key) = 0;

  // A number that is the same in every process for the n-th collective operation each of them
  // starts (each process counts its own calls), so operations can name their keys uniquely.
  uint64_t NextOperationId() { return next_operation_id_++; }

 private:
  uint64_t next_operation_id_ = 0;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_COORDINATION_COORDINATOR_H_
