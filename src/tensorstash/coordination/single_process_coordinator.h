// SingleProcessCoordinator: a Coordinator for a job of one process.
#ifndef TENSORSTASH_COORDINATION_SINGLE_PROCESS_COORDINATOR_H_
#define TENSORSTASH_COORDINATION_SINGLE_PROCESS_COORDINATOR_H_

#include <map>
#include <string>

#include "tensorstash/coordination/coordinator.h"

namespace tensorstash {

class SingleProcessCoordinator final : public Coordinator {
 public:
  int process_index() const override { return 0; }
  int process_count() const override { return 1; }
  Status Barrier(std::string_view, std::chrono::milliseconds) override { return OkStatus(); }
  Status KeyValueSet(std::string_view key, std::string_view value) override;
  // NotFound at once when the key is absent: no other process could ever set it.
  Result<std::string> KeyValueGet(std::string_view key, std::chrono::milliseconds) override;
  Result<std::optional<std::string>> KeyValueTryGet(std::string_view key) override;

 private:
  std::map<std::string, std::string, std::less<>> values_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_COORDINATION_SINGLE_PROCESS_COORDINATOR_H_
