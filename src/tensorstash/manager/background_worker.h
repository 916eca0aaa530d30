// BackgroundWorker: one piece of background work at a time (an async save, the deletions that
// retention chose), with its error kept until the owner asks for it, and delivered once.
//
// Thread-safety: not thread-safe; its owner serializes Start and Join (CheckpointManager holds
// one mutex for every call that does either).
#ifndef TENSORSTASH_MANAGER_BACKGROUND_WORKER_H_
#define TENSORSTASH_MANAGER_BACKGROUND_WORKER_H_

#include <functional>
#include <thread>
#include <utility>

#include "tensorstash/util/status.h"

namespace tensorstash {

class BackgroundWorker {
 public:
  BackgroundWorker() = default;
  BackgroundWorker(const BackgroundWorker&) = delete;
  BackgroundWorker& operator=(const BackgroundWorker&) = delete;
  // Waits for the work in flight; its error is dropped.
  ~BackgroundWorker() { (void)Join(); }

  // Waits for the work in flight, if any, and returns its error (OK when it succeeded or there
  // was none); the error is cleared, so that it is returned once.
  Status Join() {
    if (thread_.joinable()) thread_.join();
    return std::exchange(error_, OkStatus());
  }

  // Runs `work` on a thread of its own. Requires no work in flight (Join first); its returned
  // status is what the next Join returns.
  void Start(std::function<Status()> work) {
    thread_ = std::thread([this, work = std::move(work)] { error_ = work(); });
  }

 private:
  std::thread thread_;
  Status error_;  // Written by the thread; read after joining it.
};

}  // namespace tensorstash

#endif  // TENSORSTASH_MANAGER_BACKGROUND_WORKER_H_
