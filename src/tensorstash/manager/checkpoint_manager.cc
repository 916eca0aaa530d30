#include "tensorstash/manager/checkpoint_manager.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "nlohmann/json.hpp"
#include "tensorstash/manager/background_worker.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/manager/retention.h"
#include "tensorstash/manager/step_dependencies.h"
#include "tensorstash/manager/step_store.h"
#include "tensorstash/coordination/collectives.h"
#include "tensorstash/coordination/single_process_coordinator.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/staging_pool.h"

namespace tensorstash {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Counts SIGTERMs caught by the handler; process-wide, as signals are. Each manager compares it
// with its value at Open, so a signal seen by one manager does not preempt later ones.
std::atomic<uint64_t> g_sigterms{0};
extern "C" void OnSigterm(int) { g_sigterms.fetch_add(1); }

uint64_t DefaultStagingBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return uint64_t{4} << 30;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size) / 4;
}

std::string EncodeSteps(const std::vector<int64_t>& steps) { return StrJoin(steps, ","); }
Result<std::vector<int64_t>> DecodeSteps(std::string_view text) {
  std::vector<int64_t> steps;
  if (text.empty()) return steps;
  for (std::string_view part : StrSplit(text, ',')) {
    int64_t step = 0;
    if (!ParseInt(part, &step)) {
      return InternalError(StrCat("malformed step list from process 0: ", text));
    }
    steps.push_back(step);
  }
  return steps;
}

// The value of metric `name` in the step's metrics file, if it has one. A step whose metrics
// cannot be read (none saved, or damaged) simply has no metric: it ranks last, which must not
// stop the manager from opening.
std::optional<double> ReadMetric(const CheckpointReader& reader, const std::string& name) {
  // The reader checks the file's size before reading it, and its CRC-32C.
  Result<std::string> text = reader.ReadFile(kMetricsFileName);
  if (!text.ok()) return std::nullopt;
  json doc = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object() || !doc.contains(name)) return std::nullopt;
  const json& value = doc[name];
  if (!value.is_number()) return std::nullopt;
  return value.get<double>();
}

// A save that has been checked and set up, ready to commit.
struct SaveJob {
  int64_t step = 0;
  std::unique_ptr<CheckpointWriter> writer;
  std::optional<double> metric;  // best_metric's value, when given
  Clock::time_point start;
  std::shared_ptr<void> keep_alive;  // SaveRequest::keep_alive, dropped once Commit returns
};

}  // namespace

struct CheckpointManager::Impl {
  KvStore* kv = nullptr;
  ManagerOptions options;
  Coordinator* coordinator = nullptr;
  SingleProcessCoordinator own_coordinator;
  // The steps on the store: names, listing, cleanup, the root's lock (process 0), deletion.
  std::unique_ptr<StepStore> step_store;
  bool closed = false;
  bool sigterm_installed = false;
  struct sigaction previous_sigterm {};
  uint64_t preemption_checks = 0;
  uint64_t sigterms_at_open = 0;

  // The complete steps. Cached rather than listed on every call: with the lock held, only this
  // manager adds or removes steps, and listing a root lists every data file of every step.
  mutable std::mutex mutex;
  std::set<int64_t> steps;            // Guarded by mutex.
  std::map<int64_t, double> metrics;  // best_metric per step (process 0). Guarded by mutex.
  // Steps with a COMMIT that do not open, and why (process 0, at open). Guarded by mutex.
  std::map<int64_t, std::string> damaged;
  // Process 0: committed steps retention took off the list that are still on storage, each
  // with whether it is marked RETIRED there (a kept step refers to its data) rather than due
  // for deletion. Guarded by mutex.
  std::map<int64_t, bool> unlisted;
  // Whether retention must look at `unlisted` although no step was just dropped: retired steps
  // found at open, an overwrite (the step's references changed), a retention that failed.
  // Guarded by mutex.
  bool recheck_unlisted = false;
  // What the steps refer to (process 0). Used by Prepare and by retention, which never run at
  // once (every call joins the worker first).
  std::unique_ptr<StepDependencies> dependencies;
  // The last step this manager committed and its record's id (WriteStats::commit_id), for the
  // identity shortcut of the next save (SaveRequest::same_as_step). Guarded by mutex.
  std::optional<std::pair<int64_t, std::string>> last_commit;

  // The staging buffers of async saves, kept from one save to the next (under
  // max_staging_bytes): mapping them afresh for every save cost a page fault and a page
  // zeroing per 4 KiB, most of what a save's caller waited for. Declared before the worker,
  // so that a save in flight ends (and returns its leases) before the pool goes.
  std::unique_ptr<StagingPool> staging_pool;

  // Held for the whole of every call that joins or starts the worker (Save, SaveAsync,
  // WaitUntilFinished, Close): calls from several threads at once run one after the other,
  // instead of joining and reassigning `worker` at the same time.
  std::mutex calls_mutex;
  // The background work in flight (an async save, or deletions) and the error of the last one
  // not yet returned to the caller. Guarded by calls_mutex.
  BackgroundWorker worker;

  bool is_leader() const { return coordinator->process_index() == 0; }
  Status OpenSteps();
  // Cleans up and lists the steps (process 0), and with best_metric reads each one's metric
  // from the reader the listing opened it with.
  Status CleanUpAndListSteps();
  Result<SaveJob> Prepare(int64_t step, SaveRequest request, bool async);
  // After a successful commit: lists the step, applies retention (unlisting the doomed steps,
  // which process 0 returns for deletion) and calls on_commit.
  Result<std::vector<int64_t>> Committed(const SaveJob& job, const SaveStats& stats);
  std::vector<int64_t> ChooseDoomed();  // with mutex held
  // Whether a retention pass is due after a commit that dropped `doomed`.
  bool RetentionDue(const std::vector<int64_t>& doomed);
  // Process 0, after a commit: retires the unlisted steps a kept step depends on and deletes
  // the others, each before the steps it depends on. Does nothing when !RetentionDue(doomed).
  Status DeleteSteps(const std::vector<int64_t>& doomed);
  // Process 0, before `step` is saved: a retired step of that number is deleted first when no
  // kept step refers to it any more; FailedPrecondition naming them when one does.
  Status ReclaimUnlisted(int64_t step);
  Status DeleteStep(int64_t step);
  // Joins the worker and returns (and clears) its error.
  Status JoinWorker();
  void RememberCommit(int64_t step, const WriteStats& written) {
    std::lock_guard<std::mutex> guard(mutex);
    if (written.commit_id.empty()) {
      last_commit.reset();
    } else {
      last_commit.emplace(step, written.commit_id);
    }
  }
  Status CheckOpen() const {
    return closed ? FailedPreconditionError("the checkpoint manager is closed") : OkStatus();
  }
  void RestoreSigterm() {
    if (sigterm_installed) sigaction(SIGTERM, &previous_sigterm, nullptr);
    sigterm_installed = false;
  }
};

CheckpointManager::CheckpointManager(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CheckpointManager::~CheckpointManager() {
  impl_->JoinWorker().IgnoreError();
  impl_->RestoreSigterm();
}

Result<std::unique_ptr<CheckpointManager>> CheckpointManager::Open(KvStore* kv,
                                                                   ManagerOptions options) {
  if (kv == nullptr) return InvalidArgumentError("CheckpointManager::Open: null store");
  if (options.max_to_keep < 0 || options.keep_period < 0 || options.save_interval_steps < 0) {
    return InvalidArgumentError(StrCat(
        "max_to_keep, keep_period and save_interval_steps must be >= 0 (got ", options.max_to_keep,
        ", ", options.keep_period, ", ", options.save_interval_steps, ")"));
  }
  auto impl = std::make_unique<Impl>();
  impl->kv = kv;
  impl->step_store = std::make_unique<StepStore>(kv);
  impl->dependencies = std::make_unique<StepDependencies>(kv);
  impl->options = std::move(options);
  impl->coordinator =
      impl->options.coordinator != nullptr ? impl->options.coordinator : &impl->own_coordinator;
  if (impl->options.incremental && impl->options.writer.holding) {
    return InvalidArgumentError("an incremental manager cannot save holdings (writer.holding)");
  }
  if (impl->options.max_staging_bytes == 0) impl->options.max_staging_bytes = DefaultStagingBytes();
  impl->staging_pool = std::make_unique<StagingPool>(impl->options.max_staging_bytes);
  TS_RETURN_IF_ERROR(impl->OpenSteps());
  if (impl->options.handle_sigterm) {
    struct sigaction action {};
    action.sa_handler = OnSigterm;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    if (sigaction(SIGTERM, &action, &impl->previous_sigterm) != 0) {
      return ErrnoToStatus(errno, "sigaction(SIGTERM)", "the SIGTERM handler");
    }
    impl->sigterm_installed = true;
    impl->sigterms_at_open = g_sigterms.load();
  }
  return std::unique_ptr<CheckpointManager>(new CheckpointManager(std::move(impl)));
}

Status CheckpointManager::Impl::OpenSteps() {
  Coordinator& c = *coordinator;
  if (c.process_count() == 1) {
    TS_RETURN_IF_ERROR(step_store->Lock());
    return Annotate(CleanUpAndListSteps(), StrCat("opening the checkpoints in ", kv->Describe()));
  }
  // Process 0 locks and cleans up, then tells the others the steps (or its error).
  const std::string key = StrCat("tensorstash-manager/", c.NextOperationId(), "/open");
  Result<std::string> opened = "";
  if (is_leader()) {
    Status status = step_store->Lock();
    if (status.ok()) {
      status =
          Annotate(CleanUpAndListSteps(), StrCat("opening the checkpoints in ", kv->Describe()));
    }
    std::lock_guard<std::mutex> guard(mutex);
    if (status.ok()) {
      opened = EncodeSteps(std::vector<int64_t>(steps.begin(), steps.end()));
    } else {
      opened = status;
    }
  }
  TS_ASSIGN_OR_RETURN(std::string value,
                      Broadcast(c, key, opened, /*root=*/0, options.writer.coordination_timeout,
                                "process 0 could not open the checkpoints"));
  if (is_leader()) return OkStatus();
  TS_ASSIGN_OR_RETURN(std::vector<int64_t> listed, DecodeSteps(value));
  std::lock_guard<std::mutex> guard(mutex);
  steps = std::set<int64_t>(listed.begin(), listed.end());
  return OkStatus();
}

Status CheckpointManager::Impl::CleanUpAndListSteps() {
  std::map<int64_t, double> loaded;
  StepStore::OpenedStep read_metric;
  if (!options.best_metric.empty()) {
    read_metric = [&](int64_t step, const CheckpointReader& reader) {
      if (std::optional<double> metric = ReadMetric(reader, options.best_metric)) {
        loaded[step] = *metric;
      }
    };
  }
  TS_ASSIGN_OR_RETURN(StepStore::StepListing listing, step_store->CleanUpAndList(read_metric));
  std::lock_guard<std::mutex> guard(mutex);
  steps = std::move(listing.complete);
  damaged = std::move(listing.damaged);
  metrics = std::move(loaded);
  unlisted.clear();
  for (int64_t step : listing.retired) unlisted[step] = true;
  recheck_unlisted = !unlisted.empty();
  return OkStatus();
}

Result<std::string> CheckpointManager::StepDir(int64_t step) { return StepStore::StepDir(step); }

Result<std::string> CheckpointManager::RunId() {
  Impl& m = *impl_;
  if (!m.is_leader()) return FailedPreconditionError("the run id is read by process 0");
  constexpr char kRunIdKey[] = "RUN_ID";
  Result<std::string> text = m.kv->Read(kRunIdKey);
  if (text.ok()) {
    std::string id(absl::StripAsciiWhitespace(*text));
    if (IsHexId(id)) return id;
  } else if (!absl::IsNotFound(text.status())) {
    return text.status();
  }
  // Missing (or not an id: replaced, as nothing else may live under this name).
  const std::string id = RandomHexId();
  TS_RETURN_IF_ERROR(m.kv->Write(kRunIdKey, id + "\n"));
  TS_RETURN_IF_ERROR(m.kv->Sync(kRunIdKey));
  return id;
}

std::vector<int64_t> CheckpointManager::AllSteps() const {
  std::lock_guard<std::mutex> guard(impl_->mutex);
  return std::vector<int64_t>(impl_->steps.begin(), impl_->steps.end());
}

std::map<int64_t, std::string> CheckpointManager::DamagedSteps() const {
  std::lock_guard<std::mutex> guard(impl_->mutex);
  return impl_->damaged;
}

std::vector<int64_t> CheckpointManager::RetiredSteps() const {
  std::lock_guard<std::mutex> guard(impl_->mutex);
  std::vector<int64_t> retired;
  for (const auto& [step, marked] : impl_->unlisted) {
    if (marked) retired.push_back(step);
  }
  return retired;
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

Result<SaveJob> CheckpointManager::Impl::Prepare(int64_t step, SaveRequest request, bool async) {
  SaveJob job;
  job.step = step;
  job.start = Clock::now();
  job.keep_alive = std::move(request.keep_alive);
  TS_ASSIGN_OR_RETURN(std::string dir, StepDir(step));
  if (!options.writer.overwrite) {
    std::lock_guard<std::mutex> guard(mutex);
    if (steps.count(step) > 0) {
      return AlreadyExistsError(
          StrCat("step ", step, " (", dir, ") is already complete in ", kv->Describe()));
    }
  }
  if (!request.metadata_json.empty() &&
      !json::accept(request.metadata_json.begin(), request.metadata_json.end())) {
    return InvalidArgumentError(StrCat("the metadata of step ", step, " is not valid JSON"));
  }
  json metrics_doc = json::object();
  for (const auto& [name, value] : request.metrics) {
    if (!std::isfinite(value)) {
      return InvalidArgumentError(
          StrCat("metric '", name, "' of step ", step, " is not a finite number"));
    }
    metrics_doc[name] = value;
  }
  if (auto it = request.metrics.find(options.best_metric);
      !options.best_metric.empty() && it != request.metrics.end()) {
    job.metric = it->second;
  }
  WriterOptions writer_options = options.writer;
  if (options.incremental) {
    // Against the newest listed step below this one: committed, and never one being deleted
    // (retention unlists a step before it deletes it, and every save joins the deletions).
    writer_options.record_digests = true;
    writer_options.full_save_if_base_unreadable = true;
    std::lock_guard<std::mutex> guard(mutex);
    if (auto below = steps.lower_bound(step); below != steps.begin()) {
      const int64_t base = *std::prev(below);
      TS_ASSIGN_OR_RETURN(writer_options.base, StepDir(base));
      if (request.same_as_step == base && last_commit.has_value() &&
          last_commit->first == base) {
        writer_options.base_commit_id = last_commit->second;
      }
    }
  }
  if (is_leader()) TS_RETURN_IF_ERROR(ReclaimUnlisted(step));
  if (async) {
    // The writer copies every chunk before writing it, under the staging cap.
    writer_options.copy_sources = true;
    writer_options.max_inflight_bytes = options.max_staging_bytes;
    writer_options.staging_pool = staging_pool.get();
  }
  // Everything the writer can refuse is refused here, before anything is copied or written.
  TS_ASSIGN_OR_RETURN(job.writer, CheckpointWriter::Create(kv, dir, writer_options, coordinator));
  for (ArrayToSave& array : request.arrays) {
    TS_RETURN_IF_ERROR(job.writer->AddArray(std::move(array.spec), std::move(array.shards)));
  }
  if (request.tree.has_value()) job.writer->SetTree(std::move(*request.tree));
  if (is_leader()) {
    if (!request.metadata_json.empty()) {
      TS_RETURN_IF_ERROR(job.writer->AddFile(kMetadataFileName, std::move(request.metadata_json)));
    }
    if (!request.metrics.empty()) {
      TS_RETURN_IF_ERROR(job.writer->AddFile(kMetricsFileName, metrics_doc.dump()));
    }
  }
  if (request.process_state.has_value()) {
    TS_RETURN_IF_ERROR(job.writer->AddFile(ProcessStateFileName(coordinator->process_index()),
                                           std::move(*request.process_state)));
  }
  return job;
}

Result<std::vector<int64_t>> CheckpointManager::Impl::Committed(const SaveJob& job,
                                                                const SaveStats& stats) {
  std::vector<int64_t> doomed;
  {
    std::lock_guard<std::mutex> guard(mutex);
    steps.insert(job.step);
    if (job.metric.has_value()) {
      metrics[job.step] = *job.metric;
    } else {
      metrics.erase(job.step);
    }
    if (is_leader()) {
      doomed = ChooseDoomed();
      // Unlisted at once, so that no caller (nor an incremental save, as its base) picks a step
      // that is being deleted.
      for (int64_t step : doomed) {
        steps.erase(step);
        metrics.erase(step);
        unlisted[step] = false;
      }
    }
  }
  Coordinator& c = *coordinator;
  if (c.process_count() > 1) {
    // Process 0 decides; the others follow its list, so that every process lists the same steps.
    const std::string key = StrCat("tensorstash-manager/", c.NextOperationId(), "/retained");
    std::string kept_by_leader;
    if (is_leader()) {
      std::lock_guard<std::mutex> guard(mutex);
      kept_by_leader = EncodeSteps(std::vector<int64_t>(steps.begin(), steps.end()));
    }
    TS_ASSIGN_OR_RETURN(std::string value, Broadcast(c, key, kept_by_leader, /*root=*/0,
                                                     options.writer.coordination_timeout));
    if (!is_leader()) {
      TS_ASSIGN_OR_RETURN(std::vector<int64_t> kept, DecodeSteps(value));
      std::lock_guard<std::mutex> guard(mutex);
      steps = std::set<int64_t>(kept.begin(), kept.end());
    }
  }
  if (options.on_commit) options.on_commit(stats);
  return doomed;
}

std::vector<int64_t> CheckpointManager::Impl::ChooseDoomed() {
  RetentionPolicy policy;
  policy.max_to_keep = options.max_to_keep;
  policy.keep_period = options.keep_period;
  policy.by_metric = !options.best_metric.empty();
  policy.best_mode = options.best_mode;
  return StepsToDelete(steps, metrics, policy);
}

bool CheckpointManager::Impl::RetentionDue(const std::vector<int64_t>& doomed) {
  std::lock_guard<std::mutex> guard(mutex);
  return is_leader() && !unlisted.empty() && (!doomed.empty() || recheck_unlisted);
}

Status CheckpointManager::Impl::DeleteSteps(const std::vector<int64_t>& doomed) {
  // A dropped step that a kept step depends on (an incremental step refers to its data,
  // docs/format.md 6.1) is retired: marked, unlisted for good, left on storage. Reachability
  // comes from the kept steps' COMMITs (and the damaged steps', which are never deleted); when
  // a kept step's record cannot be read, nothing is deleted. Every async save without a drop
  // and every process but 0 come here with nothing to do: no reads.
  if (!RetentionDue(doomed)) return OkStatus();
  std::set<int64_t> kept, damaged_steps, dropped;
  {
    std::lock_guard<std::mutex> guard(mutex);
    recheck_unlisted = false;
    kept = steps;
    for (const auto& entry : damaged) damaged_steps.insert(entry.first);
    for (const auto& entry : unlisted) dropped.insert(entry.first);
  }
  Result<StepDependencies::Sorted> sorted = dependencies->Sort(kept, damaged_steps, dropped);
  Status result = Annotate(sorted.status(), "retention");
  if (sorted.ok()) {
    for (int64_t step : sorted->retire) {
      {
        std::lock_guard<std::mutex> guard(mutex);
        if (unlisted[step]) continue;
      }
      result = Annotate(step_store->Retire(step),
                        StrCat("marking step ", step, " retired (retention)"));
      if (!result.ok()) break;
      std::lock_guard<std::mutex> guard(mutex);
      unlisted[step] = true;
    }
    // In the order given: a step goes (COMMIT first) before any step it depends on, so that a
    // crash halfway leaves no COMMIT whose references point at a deleted step.
    for (int64_t step : result.ok() ? sorted->remove : std::vector<int64_t>()) {
      result = Annotate(DeleteStep(step), StrCat("deleting step ", step, " (retention)"));
      if (!result.ok()) break;
      dependencies->Forget(step);
      std::lock_guard<std::mutex> guard(mutex);
      unlisted.erase(step);
    }
  }
  if (!result.ok()) {
    std::lock_guard<std::mutex> guard(mutex);
    recheck_unlisted = true;  // the next retention tries again
  }
  return result;
}

Status CheckpointManager::Impl::ReclaimUnlisted(int64_t step) {
  dependencies->Forget(step);  // an overwrite may change what it refers to
  std::set<int64_t> kept;
  {
    std::lock_guard<std::mutex> guard(mutex);
    if (options.writer.overwrite && steps.count(step) > 0) recheck_unlisted = true;
    if (unlisted.count(step) == 0) return OkStatus();
    kept = steps;
  }
  std::vector<int64_t> dependents;
  for (int64_t other : kept) {
    Result<std::set<int64_t>> bases = dependencies->DependsOn(other);
    if (absl::IsNotFound(bases.status())) continue;
    TS_RETURN_IF_ERROR(bases.status());
    if (bases->count(step) > 0) dependents.push_back(other);
  }
  if (!dependents.empty()) {
    // With several processes the writer refuses it for all of them alike.
    if (coordinator->process_count() > 1) return OkStatus();
    return FailedPreconditionError(StrCat(
        "step ", step, " was dropped by retention but stays on storage (retired) for the data of "
        "step(s) ", StrJoin(dependents, ", "), ", which refer to it: it cannot be saved again "
        "until they are gone"));
  }
  TS_RETURN_IF_ERROR(Annotate(DeleteStep(step),
                              StrCat("deleting retired step ", step, " before saving it again")));
  std::lock_guard<std::mutex> guard(mutex);
  unlisted.erase(step);
  return OkStatus();
}

Status CheckpointManager::Impl::DeleteStep(int64_t step) { return step_store->DeleteStep(step); }

Status CheckpointManager::Impl::JoinWorker() { return worker.Join(); }

Status CheckpointManager::Save(int64_t step, SaveRequest request, SaveStats* stats) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> call(s.calls_mutex);
  TS_RETURN_IF_ERROR(s.CheckOpen());
  TS_RETURN_IF_ERROR(s.JoinWorker());
  TS_ASSIGN_OR_RETURN(SaveJob job, s.Prepare(step, std::move(request), /*async=*/false));
  WriteStats written;
  TS_RETURN_IF_ERROR(job.writer->Commit(&written));
  SaveStats local{step, false, written.raw_bytes, written.stored_bytes, 0, 0,
                  written.referenced_chunks, written.unhashed_chunks, written.base_unreadable};
  s.RememberCommit(step, written);
  local.total_seconds = local.blocking_seconds = SecondsSince(job.start);
  if (stats != nullptr) *stats = local;
  TS_ASSIGN_OR_RETURN(std::vector<int64_t> doomed, s.Committed(job, local));
  if (s.RetentionDue(doomed)) {
    Impl* impl = impl_.get();
    s.worker.Start([impl, doomed = std::move(doomed)] { return impl->DeleteSteps(doomed); });
  }
  return OkStatus();
}

Status CheckpointManager::SaveAsync(int64_t step, SaveRequest request) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> call(s.calls_mutex);
  TS_RETURN_IF_ERROR(s.CheckOpen());
  TS_RETURN_IF_ERROR(s.JoinWorker());
  TS_ASSIGN_OR_RETURN(SaveJob job, s.Prepare(step, std::move(request), /*async=*/true));
  // The writer says when it has copied everything out of the caller's buffers; only then may
  // this return.
  auto released = std::make_shared<std::promise<void>>();
  std::future<void> copied = released->get_future();
  Impl* impl = impl_.get();
  auto shared_job = std::make_shared<SaveJob>(std::move(job));
  auto blocking = std::make_shared<std::atomic<double>>(0.0);
  s.worker.Start([impl, shared_job, released, blocking] {
    WriteStats written;
    Status status = shared_job->writer->Commit(&written, [&] {
      blocking->store(SecondsSince(shared_job->start));
      released->set_value();
    });
    shared_job->keep_alive.reset();  // no buffer of the caller's is read any more
    if (status.ok()) {
      SaveStats stats{shared_job->step,  true,
                      written.raw_bytes, written.stored_bytes,
                      blocking->load(),  SecondsSince(shared_job->start),
                      written.referenced_chunks, written.unhashed_chunks,
                      written.base_unreadable};
      impl->RememberCommit(shared_job->step, written);
      Result<std::vector<int64_t>> doomed = impl->Committed(*shared_job, stats);
      status = doomed.ok() ? impl->DeleteSteps(*doomed) : doomed.status();
    }
    shared_job->writer.reset();
    return Annotate(status, StrCat("background save of step ", shared_job->step));
  });
  copied.wait();
  return OkStatus();
}

bool CheckpointManager::ReachedPreemption(int64_t step) {
  Impl& s = *impl_;
  const bool local = s.options.handle_sigterm && g_sigterms.load() > s.sigterms_at_open;
  Coordinator& c = *s.coordinator;
  if (c.process_count() == 1) return local;
  // Collective: any process signalled makes every process save at the same step. Keys count
  // the calls (every process makes the same calls), so they never repeat.
  const std::string prefix =
      StrCat("tensorstash-manager/preemption/", s.preemption_checks++, "-", step, "/");
  Result<std::vector<std::string>> signalled =
      AllGather(c, prefix, local ? "1" : "0", s.options.writer.coordination_timeout);
  // Without every process's answer this one goes by its own (the save that follows, collective,
  // then fails on the process that is missing).
  if (!signalled.ok()) return local;
  return std::find(signalled->begin(), signalled->end(), "1") != signalled->end();
}

Status CheckpointManager::WaitUntilFinished() {
  std::lock_guard<std::mutex> call(impl_->calls_mutex);
  return impl_->JoinWorker();
}

Status CheckpointManager::Close() {
  std::lock_guard<std::mutex> call(impl_->calls_mutex);
  if (impl_->closed) return OkStatus();
  Status result = impl_->JoinWorker();
  impl_->step_store->ReleaseLock();
  impl_->RestoreSigterm();
  impl_->closed = true;
  return result;
}

}  // namespace tensorstash
