// Helpers shared by the CLI commands: opening a checkpoint from a path, sizes, progress.
#ifndef TENSORSTASH_CLI_COMMON_H_
#define TENSORSTASH_CLI_COMMON_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash::cli {

// A step folder given on the command line (a path or a store URL, kvstore/registry.h), split
// into the store holding it and the folder's key in it.
struct StepLocation {
  std::unique_ptr<KvStore> kv;
  std::string key;
};
Result<StepLocation> OpenStepPath(const std::string& path);

// "1.50 GiB", "512 B".
std::string HumanBytes(uint64_t bytes);
// "2026-11-22 08:30:05" in local time.
std::string HumanTime(int64_t unix_ms);

// Prints "error: <message>" to stderr and returns the exit code for a failed command.
int Fail(const Status& status);

// A one-line progress bar on stderr, drawn only when stderr is a terminal and the work is big
// enough to be worth it. Thread-safe Update.
class ProgressBar {
 public:
  ProgressBar(std::string label, uint64_t total);
  ~ProgressBar();
  void Update(uint64_t done);

 private:
  std::string label_;
  uint64_t total_;
  bool enabled_;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace tensorstash::cli

#endif  // TENSORSTASH_CLI_COMMON_H_
