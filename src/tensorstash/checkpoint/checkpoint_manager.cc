#include "tensorstash/checkpoint/checkpoint_manager.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "tensorstash/checkpoint/layout.h"
#include "tensorstash/format/commit_record.h"

namespace tensorstash {
namespace {

constexpr char kLockKey[] = "LOCK";
constexpr int kStepDigits = 10;

// The step of a folder name of exactly 10 digits; nullopt for any other name.
std::optional<int64_t> ParseStepName(std::string_view name) {
  if (name.size() != kStepDigits) return std::nullopt;
  int64_t step = 0;
  for (char c : name) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  if (!ParseInt(name, &step)) return std::nullopt;
  return step;
}

// Owned copies of the shards of one save (SaveAsync): the arrays point into `buffers`.
struct StagedSave {
  int64_t step = 0;
  std::string dir;
  std::vector<ArrayToSave> arrays;
  std::vector<std::unique_ptr<char[]>> buffers;
};

}  // namespace

struct CheckpointManager::Impl {
  KvStore* kv = nullptr;
  ManagerOptions options;
  std::unique_ptr<KvLock> lock;  // null once closed
  bool closed = false;

  // The complete steps. Cached rather than listed on every call: with the lock held, only this
  // manager adds or removes steps, and listing a root lists every data file of every step.
  mutable std::mutex mutex;
  std::set<int64_t> steps;  // Guarded by mutex.

  // The save in flight (SaveAsync) and the error of the last one not yet returned to the caller.
  std::thread worker;
  Status background_error;  // Written by the worker; read after joining it.

  Status CleanUpAndListSteps();
  Status RunSave(int64_t step, const std::string& dir, const std::vector<ArrayToSave>& arrays,
                 WriteStats* stats);
  Status ApplyRetention();
  Status DeleteStep(int64_t step);
  // Joins the worker and returns (and clears) its error.
  Status JoinWorker();
  Status CheckOpen() const {
    return closed ? FailedPreconditionError("the checkpoint manager is closed") : OkStatus();
  }
};

CheckpointManager::CheckpointManager(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CheckpointManager::~CheckpointManager() { impl_->JoinWorker().IgnoreError(); }

Result<std::unique_ptr<CheckpointManager>> CheckpointManager::Open(KvStore* kv,
                                                                   ManagerOptions options) {
  if (kv == nullptr) return InvalidArgumentError("CheckpointManager::Open: null store");
  if (options.max_to_keep < 0 || options.keep_period < 0 || options.save_interval_steps < 0) {
    return InvalidArgumentError(StrCat(
        "max_to_keep, keep_period and save_interval_steps must be >= 0 (got ",
        options.max_to_keep, ", ", options.keep_period, ", ", options.save_interval_steps, ")"));
  }
  auto impl = std::make_unique<Impl>();
  impl->kv = kv;
  impl->options = std::move(options);
  TS_ASSIGN_OR_RETURN(impl->lock, kv->TryLock(kLockKey));
  TS_RETURN_IF_ERROR(Annotate(impl->CleanUpAndListSteps(),
                              StrCat("opening the checkpoints in ", kv->Describe())));
  return std::unique_ptr<CheckpointManager>(new CheckpointManager(std::move(impl)));
}

Status CheckpointManager::Impl::CleanUpAndListSteps() {
  TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, kv->List(""));
  // Top-level folders, and whether each has a COMMIT.
  std::map<std::string, bool, std::less<>> folders;
  for (const std::string& key : keys) {
    const size_t slash = key.find('/');
    if (slash == std::string::npos) continue;  // LOCK, stray files
    const std::string name = key.substr(0, slash);
    bool& complete = folders[name];
    if (key.size() == slash + 1 + std::strlen(kCommitFileName) &&
        key.compare(slash + 1, std::string::npos, kCommitFileName) == 0) {
      complete = true;
    }
  }
  // An overwrite that crashed between its two renames left "<step>.old-<nonce>" complete and
  // <step> incomplete: the old step is the one to keep (rolled back as the writer does). Only
  // the first such folder by name, like the writer.
  std::set<std::string> restored;
  if (kv->SupportsRename()) {
    for (const auto& [name, complete] : folders) {
      const size_t old = name.find(kOldMarker);
      if (old == std::string::npos || !complete) continue;
      const std::string base = name.substr(0, old);
      auto base_it = folders.find(base);
      if ((base_it != folders.end() && base_it->second) || restored.count(base) > 0) continue;
      TS_RETURN_IF_ERROR(kv->DeletePrefix(base + "/"));
      TS_RETURN_IF_ERROR(kv->RenameDirectory(name, base));
      restored.insert(base);
      restored.insert(name);
    }
  }
  std::set<int64_t> complete_steps;
  for (const std::string& name : restored) {
    if (std::optional<int64_t> step = ParseStepName(name)) complete_steps.insert(*step);
  }
  for (const auto& [name, complete] : folders) {
    if (restored.count(name) > 0) continue;
    if (IsTemporaryStepName(name)) {
      TS_RETURN_IF_ERROR(kv->DeletePrefix(name + "/"));
      continue;
    }
    std::optional<int64_t> step = ParseStepName(name);
    if (!step) continue;  // not ours: left alone
    if (complete) {
      complete_steps.insert(*step);
    } else {
      // A step without COMMIT is a crashed save on a store without rename, or a crashed
      // deletion (COMMIT goes first): unreadable either way, and no save runs while we hold
      // the lock.
      TS_RETURN_IF_ERROR(kv->DeletePrefix(name + "/"));
    }
  }
  std::lock_guard<std::mutex> guard(mutex);
  steps = std::move(complete_steps);
  return OkStatus();
}

Result<std::string> CheckpointManager::StepDir(int64_t step) {
  if (step < 0) return InvalidArgumentError(StrCat("step ", step, " is negative"));
  std::string digits = std::to_string(step);
  if (digits.size() > static_cast<size_t>(kStepDigits)) {
    return InvalidArgumentError(
        StrCat("step ", step, " does not fit in a ", kStepDigits, "-digit folder name"));
  }
  return std::string(kStepDigits - digits.size(), '0') + digits;
}

std::vector<int64_t> CheckpointManager::AllSteps() const {
  std::lock_guard<std::mutex> guard(impl_->mutex);
  return std::vector<int64_t>(impl_->steps.begin(), impl_->steps.end());
}

std::optional<int64_t> CheckpointManager::LatestStep() const {
  std::lock_guard<std::mutex> guard(impl_->mutex);
  if (impl_->steps.empty()) return std::nullopt;
  return *impl_->steps.rbegin();
}

bool CheckpointManager::ShouldSave(int64_t step) const {
  const int64_t interval = impl_->options.save_interval_steps;
  return interval <= 1 || step % interval == 0;
}

Status CheckpointManager::Impl::RunSave(int64_t step, const std::string& dir,
                                        const std::vector<ArrayToSave>& arrays,
                                        WriteStats* stats) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                      CheckpointWriter::Create(kv, dir, options.writer));
  for (const ArrayToSave& array : arrays) {
    TS_RETURN_IF_ERROR(writer->AddArray(array.spec, array.shards));
  }
  WriteStats local;
  TS_RETURN_IF_ERROR(writer->Commit(&local));
  {
    std::lock_guard<std::mutex> guard(mutex);
    steps.insert(step);
  }
  if (stats != nullptr) *stats = local;
  TS_RETURN_IF_ERROR(
      Annotate(ApplyRetention(), StrCat("step ", step, " was saved, but retention failed")));
  if (options.on_commit) options.on_commit(step, local);
  return OkStatus();
}

Status CheckpointManager::Impl::ApplyRetention() {
  if (options.max_to_keep <= 0) return OkStatus();
  std::vector<int64_t> doomed;
  {
    std::lock_guard<std::mutex> guard(mutex);
    if (steps.size() <= static_cast<size_t>(options.max_to_keep)) return OkStatus();
    // Everything but the newest max_to_keep (so never the newest), except keep_period's steps.
    auto end = std::prev(steps.end(), options.max_to_keep);
    for (auto it = steps.begin(); it != end; ++it) {
      if (options.keep_period > 0 && *it % options.keep_period == 0) continue;
      doomed.push_back(*it);
    }
    // Unlisted first, so that no caller picks a step that is being deleted.
    for (int64_t step : doomed) steps.erase(step);
  }
  Status result;
  for (int64_t step : doomed) {
    Status deleted = DeleteStep(step);
    if (result.ok()) result = deleted;
  }
  return result;
}

Status CheckpointManager::Impl::DeleteStep(int64_t step) {
  TS_ASSIGN_OR_RETURN(std::string dir, StepDir(step));
  // COMMIT goes first: a crash halfway leaves an incomplete folder (removed at the next Open),
  // never a step that claims to be complete with files missing.
  Status commit = kv->Delete(StrCat(dir, "/", kCommitFileName));
  if (!commit.ok() && !absl::IsNotFound(commit)) return commit;
  return kv->DeletePrefix(dir + "/");
}

Status CheckpointManager::Impl::JoinWorker() {
  if (worker.joinable()) worker.join();
  return std::exchange(background_error, OkStatus());
}

Status CheckpointManager::Save(int64_t step, const std::vector<ArrayToSave>& arrays,
                               WriteStats* stats) {
  TS_RETURN_IF_ERROR(impl_->CheckOpen());
  TS_RETURN_IF_ERROR(impl_->JoinWorker());
  TS_ASSIGN_OR_RETURN(std::string dir, StepDir(step));
  return impl_->RunSave(step, dir, arrays, stats);
}

Status CheckpointManager::SaveAsync(int64_t step, std::vector<ArrayToSave> arrays) {
  TS_RETURN_IF_ERROR(impl_->CheckOpen());
  TS_RETURN_IF_ERROR(impl_->JoinWorker());
  auto job = std::make_unique<StagedSave>();
  job->step = step;
  TS_ASSIGN_OR_RETURN(job->dir, StepDir(step));
  if (!impl_->options.writer.overwrite) {
    std::lock_guard<std::mutex> guard(impl_->mutex);
    if (impl_->steps.count(step) > 0) {
      return AlreadyExistsError(StrCat("step ", step, " (", job->dir, ") is already complete in ",
                                       impl_->kv->Describe()));
    }
  }
  // Invalid arrays are reported now rather than by the background thread, and before the
  // copy trusts the shard boxes for sizes: a writer that is never committed touches no storage.
  {
    TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> check,
                        CheckpointWriter::Create(impl_->kv, job->dir, impl_->options.writer));
    for (const ArrayToSave& array : arrays) {
      TS_RETURN_IF_ERROR(check->AddArray(array.spec, array.shards));
    }
  }
  // The only blocking part: a private copy of every shard, so that the caller may go on
  // changing its buffers while the background thread writes.
  for (ArrayToSave& array : arrays) {
    const size_t item = ItemSize(array.spec.dtype);
    // Replicas of one box hold the same bytes: one copy serves them all.
    std::map<std::string, const void*> copied;
    for (ShardData& shard : array.shards) {
      const int64_t elements = shard.box.num_elements();
      // Non-empty shards without data were refused above.
      if (shard.data == nullptr || elements <= 0) continue;
      std::string box_key;
      if (shard.num_replicas > 1) {
        box_key = shard.box.ToString();
        if (auto it = copied.find(box_key); it != copied.end()) {
          shard.data = it->second;
          continue;
        }
      }
      const size_t bytes = static_cast<size_t>(elements) * item;
      std::unique_ptr<char[]> copy(new (std::nothrow) char[bytes]);
      if (copy == nullptr) {
        return ResourceExhaustedError(StrCat("cannot allocate ", bytes,
                                             " bytes of host staging for array '",
                                             array.spec.path, "' of step ", step));
      }
      std::memcpy(copy.get(), shard.data, bytes);
      shard.data = copy.get();
      if (shard.num_replicas > 1) copied.emplace(std::move(box_key), copy.get());
      job->buffers.push_back(std::move(copy));
    }
  }
  job->arrays = std::move(arrays);
  Impl* impl = impl_.get();
  impl->worker = std::thread([impl, job = std::move(job)] {
    impl->background_error = impl->RunSave(job->step, job->dir, job->arrays, nullptr);
  });
  return OkStatus();
}

Status CheckpointManager::WaitUntilFinished() { return impl_->JoinWorker(); }

Status CheckpointManager::Close() {
  if (impl_->closed) return OkStatus();
  Status result = impl_->JoinWorker();
  impl_->lock.reset();
  impl_->closed = true;
  return result;
}

}  // namespace tensorstash
