// InProcessCoordinator: N "processes" simulated by N threads of one process, sharing a barrier
// and a key-value store. Used to test the multi-writer protocol without spawning processes.
//
//   auto group = std::make_shared<InProcessCoordinatorGroup>(4);
//   // in thread i: InProcessCoordinator coordinator(group, i);
//
// Thread-safety: the group is shared by all threads; each InProcessCoordinator by one.
#ifndef TENSORSTASH_TESTING_IN_PROCESS_COORDINATOR_H_
#define TENSORSTASH_TESTING_IN_PROCESS_COORDINATOR_H_

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "tensorstash/coordination/coordinator.h"

namespace tensorstash {

class InProcessCoordinatorGroup {
 public:
  explicit InProcessCoordinatorGroup(int process_count) : process_count_(process_count) {}
  int process_count() const { return process_count_; }

 private:
  friend class InProcessCoordinator;
  const int process_count_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::string, int, std::less<>> barrier_arrivals_;
  std::map<std::string, std::string, std::less<>> values_;
};

class InProcessCoordinator final : public Coordinator {
 public:
  InProcessCoordinator(std::shared_ptr<InProcessCoordinatorGroup> group, int process_index)
      : group_(std::move(group)), process_index_(process_index) {}

  int process_index() const override { return process_index_; }
  int process_count() const override { return group_->process_count(); }
  Status Barrier(std::string_view name, std::chrono::milliseconds timeout) override;
  Status KeyValueSet(std::string_view key, std::string_view value) override;
  Result<std::string> KeyValueGet(std::string_view key, std::chrono::milliseconds timeout) override;
  Result<std::optional<std::string>> KeyValueTryGet(std::string_view key) override;

 private:
  std::shared_ptr<InProcessCoordinatorGroup> group_;
  int process_index_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_TESTING_IN_PROCESS_COORDINATOR_H_
