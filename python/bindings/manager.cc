// tensorstash._ext.Manager: CheckpointManager on a store opened by URL (kvstore/registry.h), and
// with a `local_dir` the MultiTierManager (tiers/multi_tier_manager.h) over that store and the
// node-local tier: the package's CheckpointManager is a skin over it (pytrees, stats, logging).
// Restores read through the store the manager opened (open_step, open_restore), never by
// reopening the root's path; a multi-tier restore's write-back saves the host buffers the
// engine filled (KeptBoxes, WriteBackRequest), never a copy made back from device memory.
//
// Every call into the manager releases the GIL, the cheap step queries included: the background
// save thread takes the GIL for the commit callback and for a Python coordinator, and it may
// hold the manager's own locks meanwhile. save() with async_save blocks only while the shards
// are copied to host memory; the Python buffers are referenced until then and free afterwards.
// Stable shards (buffers that nothing else can change) are not copied: they are referenced until
// the save ends.
//
// The Manager takes part in garbage collection: its coordinator and commit callback are Python
// objects that can refer back to it (the package's CheckpointManager holds the Manager and
// hands it a callback), a cycle that runs through C++ members the collector cannot otherwise
// see. Destroying it (or clearing it) waits for a save in flight, with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/set.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "bindings.h"
#include "buffers.h"
#include "coordinator.h"
#include "errors.h"
#include "gc_slots.h"
#include "save_args.h"
#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/manager/checkpoint_manager.h"
#include "tensorstash/manager/retention.h"
#include "tensorstash/tiers/multi_tier_manager.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/kvstore/kvstore.h"

namespace nb = nanobind;

namespace tensorstash::python {
namespace {

nb::dict StatsDict(const SaveStats& stats) {
  nb::dict result;
  result["step"] = stats.step;
  result["async"] = stats.async;
  result["raw_bytes"] = stats.raw_bytes;
  result["stored_bytes"] = stats.stored_bytes;
  result["blocking_seconds"] = stats.blocking_seconds;
  result["total_seconds"] = stats.total_seconds;
  result["referenced_chunks"] = stats.referenced_chunks;
  result["unhashed_chunks"] = stats.unhashed_chunks;
  result["base_unreadable"] = stats.base_unreadable;
  return result;
}

nb::object BytesOrNone(const std::optional<std::string>& value) {
  if (!value.has_value()) return nb::none();
  return nb::bytes(value->data(), value->size());
}

// A step opened by Manager.open_restore: the C++ restore (its source shared with `reader`) and
// the boxes the reader's restore_to_host handed over, for the write-back.
struct PyTieredRestore {
  TieredRestore restore;
  nb::object reader;
  std::shared_ptr<KeptBoxes> kept;
  nb::object manager;  // the Manager whose store the reader reads: kept alive with it
};

class Manager {
 public:
  Manager(std::unique_ptr<KvStore> kv, std::unique_ptr<PyCoordinator> coordinator,
          nb::object on_commit, nb::object warn)
      : kv_(std::move(kv)),
        coordinator_(std::move(coordinator)),
        on_commit_(std::move(on_commit)),
        warn_(std::move(warn)) {}

  ~Manager() { Clear(); }

  // Set once by InitManager, after the callbacks that refer to this are in place: one of them.
  void set_manager(std::unique_ptr<CheckpointManager> manager) { manager_ = std::move(manager); }
  void set_tiers(std::unique_ptr<MultiTierManager> tiers) { tiers_ = std::move(tiers); }

  // The Python objects it holds, for the garbage collector (gc_slots.h).
  std::array<nb::handle, 3> python_objects() const {
    return {coordinator_ != nullptr ? coordinator_->object() : nb::handle(), on_commit_, warn_};
  }

  // Drops everything, for tp_clear and the destructor; the Manager is unusable afterwards. The
  // manager goes first (it uses the others), with the GIL released: it waits for a save in
  // flight, whose thread may need the GIL for the callback or the coordinator.
  void Clear() {
    if (manager_ != nullptr || tiers_ != nullptr) {
      nb::gil_scoped_release release;
      tiers_.reset();
      manager_.reset();
    }
    coordinator_.reset();
    on_commit_ = nb::object();
    warn_ = nb::object();
  }

  // The commit callback given to the C++ manager: runs on the thread that committed, takes the
  // GIL. An exception from the Python callable cannot reach the training loop from there; it is
  // reported as unraisable (the package's callback catches and logs its own errors first).
  void OnCommit(const SaveStats& stats) {
    nb::gil_scoped_acquire gil;
    if (!on_commit_.is_valid() || on_commit_.is_none()) return;
    try {
      on_commit_(StatsDict(stats));
    } catch (nb::python_error& error) {
      error.discard_as_unraisable("tensorstash: the on_commit callback");
    }
  }

  // The local tier's warnings (a skipped or failed local save): any thread, takes the GIL.
  void Warn(const std::string& text) {
    nb::gil_scoped_acquire gil;
    if (!warn_.is_valid() || warn_.is_none()) return;
    try {
      warn_(text);
    } catch (nb::python_error& error) {
      error.discard_as_unraisable("tensorstash: the local tier's warn callback");
    }
  }

  // Saves `step` on the tiers it is due on (`force`: every tier; without a local tier the
  // persistent one whether due or not, as before). Returns the statistics of a synchronous
  // persistent save, else None.
  nb::object Save(int64_t step, const std::vector<ArrayTuple>& arrays,
                  const std::optional<std::string>& tree_json, const std::string& metadata_json,
                  const std::optional<nb::bytes>& process_state,
                  const std::map<std::string, double>& metrics, const std::string& codec,
                  int zstd_level, bool async_save, bool force,
                  const std::vector<std::string>& same_as_base,
                  std::optional<int64_t> same_as_step) {
    CheckpointManager& manager = Get();
    // References to the shard buffers, so that they outlive the copy (or the whole sync save)
    // even if another thread drops the caller's list while the GIL is released.
    std::vector<ReadOnlyBytes> buffers;
    SaveRequest request = SaveRequestFromPython(arrays, tree_json, metadata_json, process_state,
                                                metrics, codec, zstd_level, &buffers);
    if (same_as_step.has_value() && !same_as_base.empty()) {
      const std::set<std::string, std::less<>> unchanged(same_as_base.begin(),
                                                          same_as_base.end());
      for (ArrayToSave& array : request.arrays) {
        if (unchanged.count(array.spec.path) == 0) continue;
        for (ShardData& shard : array.shards) shard.same_as_base = true;
      }
      request.same_as_step = same_as_step;
    }
    SaveStats stats;
    stats.step = -1;
    Status status;
    {
      nb::gil_scoped_release release;
      if (tiers_ != nullptr) {
        status = tiers_->Save(step, std::move(request), async_save, force, &stats).status();
      } else {
        status = async_save ? manager.SaveAsync(step, std::move(request))
                            : manager.Save(step, std::move(request), &stats);
      }
    }
    ThrowIfError(status);
    return async_save || stats.step < 0 ? nb::none() : nb::object(StatsDict(stats));
  }

  std::vector<int64_t> AllSteps() {
    return WithoutGil([](CheckpointManager& manager) { return manager.AllSteps(); });
  }

  std::map<int64_t, std::string> DamagedSteps() {
    return WithoutGil([](CheckpointManager& manager) { return manager.DamagedSteps(); });
  }

  std::vector<int64_t> RetiredSteps() {
    return WithoutGil([](CheckpointManager& manager) { return manager.RetiredSteps(); });
  }

  // The persistent tier's newest complete step (not collective).
  std::optional<int64_t> LatestStep() {
    return WithoutGil([](CheckpointManager& manager) { return manager.LatestStep(); });
  }

  std::string RunId() {
    Result<std::string> id =
        WithoutGil([](CheckpointManager& manager) { return manager.RunId(); });
    return ValueOrThrow(std::move(id));
  }

  // Whether `step` is due on any tier.
  bool ShouldSave(int64_t step) {
    return WithoutGil([&](CheckpointManager& manager) {
      return tiers_ != nullptr ? tiers_->ShouldSave(step) : manager.ShouldSave(step);
    });
  }

  bool PersistentDue(int64_t step) {
    return WithoutGil([step](CheckpointManager& manager) { return manager.ShouldSave(step); });
  }

  bool ReachedPreemption(int64_t step) {
    return WithoutGil(
        [step](CheckpointManager& manager) { return manager.ReachedPreemption(step); });
  }

  // Both tiers' saves in flight; the local tier's error first.
  void WaitUntilFinished() {
    ThrowIfError(WithoutGil([&](CheckpointManager& manager) {
      Status local = tiers_ != nullptr ? tiers_->local().WaitUntilFinished() : OkStatus();
      Status persistent = manager.WaitUntilFinished();
      return local.ok() ? persistent : local;
    }));
  }

  void Close() {
    ThrowIfError(WithoutGil([&](CheckpointManager& manager) {
      return tiers_ != nullptr ? tiers_->Close() : manager.Close();
    }));
  }

  // A Reader of `step` on the manager's own store (no reopening of the root by path).
  nb::object OpenStepReader(int64_t step, bool verify_checksums, int64_t max_inflight_bytes,
                            int io_threads, bool map_spans, nb::object share) {
    Get();
    const ReaderOptions options =
        ReadOptionsFromPython(verify_checksums, max_inflight_bytes, io_threads, map_spans);
    const std::string dir = ValueOrThrow(CheckpointManager::StepDir(step));
    if (!share.is_none()) {
      // (coordinator, key prefix, timeout in seconds)
      auto [coordinator, key_prefix, timeout_s] =
          nb::cast<std::tuple<nb::object, std::string, double>>(share);
      return SharedReader(nullptr, kv_.get(), dir, options, coordinator, key_prefix, timeout_s);
    }
    Result<std::unique_ptr<StepSource>> source = [&] {
      nb::gil_scoped_release release;
      return OpenStepSource(kv_.get(), dir, options);
    }();
    return ReaderFromSource(nullptr, ValueOrThrow(std::move(source)));
  }

  // --- with a local tier ---

  bool multi_tier() const { return tiers_ != nullptr; }

  std::vector<int64_t> LocalSteps() {
    MultiTierManager& tiers = Tiers();
    nb::gil_scoped_release release;
    return tiers.local().LocalSteps();
  }

  std::optional<int64_t> TieredLatestStep() {
    MultiTierManager& tiers = Tiers();
    Result<std::optional<int64_t>> latest = [&] {
      nb::gil_scoped_release release;
      return tiers.LatestStep();
    }();
    return ValueOrThrow(std::move(latest));
  }

  std::vector<int64_t> RestorableSteps() {
    MultiTierManager& tiers = Tiers();
    Result<std::vector<int64_t>> steps = [&] {
      nb::gil_scoped_release release;
      return tiers.RestorableSteps();
    }();
    return ValueOrThrow(std::move(steps));
  }

  PyTieredRestore OpenRestore(nb::handle self, int64_t step, bool verify_checksums,
                              int64_t max_inflight_bytes, int io_threads) {
    MultiTierManager& tiers = Tiers();
    const ReaderOptions options =
        ReadOptionsFromPython(verify_checksums, max_inflight_bytes, io_threads, true);
    Result<TieredRestore> restore = [&] {
      nb::gil_scoped_release release;
      return tiers.OpenRestore(step, options);
    }();
    PyTieredRestore out;
    out.restore = ValueOrThrow(std::move(restore));
    out.kept = std::make_shared<KeptBoxes>();
    out.reader = ReaderFromSource(nullptr, out.restore.source, out.kept);
    out.manager = nb::borrow(self);
    return out;
  }

  // Collective (MultiTierManager::FinishRestore): returns every process's word; writes back
  // this process's restored boxes when the tiers call for it and `as_stored` (the restore's
  // target was every array whole, in its stored dtype). Raises other errors.
  nb::tuple FinishRestore(PyTieredRestore* restore, std::string error, bool as_stored,
                          const std::string& codec, int zstd_level) {
    MultiTierManager& tiers = Tiers();
    const Codec parsed = ValueOrThrow(ParseCodec(codec));
    std::vector<std::string> words;
    bool wrote_back = false;
    Status status;
    {
      nb::gil_scoped_release release;
      std::optional<SaveRequest> write_back;
      if (restore != nullptr && as_stored && error.empty()) {
        std::vector<RestoredBox> boxes;
        {
          std::lock_guard<std::mutex> lock(restore->kept->mutex);
          boxes = std::move(restore->kept->boxes);
          restore->kept->boxes.clear();
        }
        write_back = WriteBackRequest(*restore->restore.source, std::move(boxes), parsed,
                                      zstd_level);
      }
      status = tiers.FinishRestore(restore != nullptr ? &restore->restore : nullptr,
                                   write_back ? &*write_back : nullptr, std::move(error), &words,
                                   &wrote_back);
      if (restore != nullptr) {
        std::lock_guard<std::mutex> lock(restore->kept->mutex);
        restore->kept->boxes.clear();  // the host buffers go with the write-back's end
        restore->restore.source.reset();  // closes the holders' files and connections
      }
    }
    if (restore != nullptr) restore->manager = nb::object();
    if (absl::IsAborted(status) && !words.empty()) return nb::make_tuple(words, false);
    ThrowIfError(status);
    return nb::make_tuple(words, wrote_back);
  }

 private:
  CheckpointManager& Get() const {
    if (tiers_ != nullptr) return tiers_->persistent();
    if (manager_ == nullptr) ThrowIfError(FailedPreconditionError("the manager was cleared"));
    return *manager_;
  }

  MultiTierManager& Tiers() const {
    Get();
    if (tiers_ == nullptr) ThrowIfError(FailedPreconditionError("the manager has no local tier"));
    return *tiers_;
  }

  // `call(manager)` with the GIL released, once Get() found the manager usable; the result is
  // returned (and an error raised by the caller) with the GIL taken back.
  template <typename F>
  std::invoke_result_t<F&, CheckpointManager&> WithoutGil(F call) {
    CheckpointManager& manager = Get();
    nb::gil_scoped_release release;
    return call(manager);
  }

  // Declared before the managers, which use them, so that they are destroyed after them (Clear
  // destroys the managers first in any case).
  std::unique_ptr<KvStore> kv_;
  std::unique_ptr<PyCoordinator> coordinator_;
  nb::object on_commit_;
  nb::object warn_;
  std::unique_ptr<CheckpointManager> manager_;  // without a local tier
  std::unique_ptr<MultiTierManager> tiers_;     // with one (it owns the persistent manager)
};

Result<BestMode> ParseBestMode(std::string_view mode) {
  if (mode == "min") return BestMode::kMin;
  if (mode == "max") return BestMode::kMax;
  return InvalidArgumentError(StrCat("best_mode must be 'min' or 'max', not '", mode, "'"));
}

Status CheckNotNegative(std::string_view name, int64_t value) {
  if (value >= 0) return OkStatus();
  return InvalidArgumentError(StrCat(name, " must be >= 0, not ", value));
}

void InitManager(Manager* self, const std::string& root, int64_t max_to_keep, int64_t keep_period,
                 int64_t save_interval_steps, const std::string& best_metric,
                 const std::string& best_mode, int64_t max_staging_bytes, bool handle_sigterm,
                 nb::object coordinator, nb::object on_commit, int64_t target_chunk_bytes,
                 int64_t target_data_file_bytes, int64_t max_inflight_bytes, int io_threads,
                 bool sync, bool overwrite, double coordination_timeout_s,
                 const std::optional<std::string>& local_dir, int64_t local_save_interval_steps,
                 int local_max_to_keep, const std::string& local_server_address,
                 int local_server_port, nb::object warn, bool incremental) {
  ThrowIfError(CheckNotNegative("max_to_keep", max_to_keep));
  ThrowIfError(CheckNotNegative("keep_period", keep_period));
  ThrowIfError(CheckNotNegative("save_interval_steps", save_interval_steps));
  ThrowIfError(CheckNotNegative("max_staging_bytes", max_staging_bytes));
  if (max_to_keep > INT32_MAX) {
    ThrowIfError(InvalidArgumentError(StrCat("max_to_keep ", max_to_keep, " is too large")));
  }
  WriterOptions writer_options =
      WriterOptionsFromPython(target_chunk_bytes, target_data_file_bytes, max_inflight_bytes,
                              io_threads, sync, overwrite, coordination_timeout_s);
  if (!on_commit.is_none() && !PyCallable_Check(on_commit.ptr())) {
    throw nb::type_error("on_commit must be callable or None");
  }
  if (!warn.is_none() && !PyCallable_Check(warn.ptr())) {
    throw nb::type_error("warn must be callable or None");
  }
  ManagerOptions options;
  options.max_to_keep = static_cast<int>(max_to_keep);
  options.keep_period = keep_period;
  options.save_interval_steps = save_interval_steps;
  options.best_metric = best_metric;
  options.best_mode = ValueOrThrow(ParseBestMode(best_mode));
  options.max_staging_bytes = static_cast<uint64_t>(max_staging_bytes);
  options.handle_sigterm = handle_sigterm;
  options.incremental = incremental;
  options.writer = writer_options;

  std::optional<LocalTierOptions> local;
  if (local_dir.has_value()) {
    local.emplace();
    local->dir = *local_dir;
    local->save_interval_steps = local_save_interval_steps;
    local->max_to_keep = local_max_to_keep;
    local->server_address = local_server_address;
    local->server_port = local_server_port;
    local->timeout = writer_options.coordination_timeout;  // one timeout for every wait
    local->peer_stall_timeout = std::min(local->timeout, std::chrono::milliseconds(30000));
    local->max_staging_bytes = options.max_staging_bytes;
    local->writer = WriterOptionsFromPython(target_chunk_bytes, target_data_file_bytes,
                                            max_inflight_bytes, io_threads, /*sync=*/false,
                                            /*overwrite=*/true, coordination_timeout_s);
  }

  SaveTarget target = OpenSaveTarget(root, std::move(coordinator));
  options.coordinator = target.coordinator.get();
  KvStore* kv = target.kv.get();
  // Constructed before the C++ manager exists, so that the callbacks can point at it; a failed
  // Open leaves a Manager without one, which nanobind then destroys.
  new (self) Manager(std::move(target.kv), std::move(target.coordinator), std::move(on_commit),
                     std::move(warn));
  options.on_commit = [self](const SaveStats& stats) { self->OnCommit(stats); };
  Status status;
  if (local.has_value()) {
    local->warn = [self](const std::string& text) { self->Warn(text); };
    Result<std::unique_ptr<MultiTierManager>> tiers = [&] {
      nb::gil_scoped_release release;  // Open waits for the other processes
      return MultiTierManager::Open(kv, {.persistent = std::move(options),
                                         .local = *std::move(local),
                                         .persistent_name = root});
    }();
    status = tiers.status();
    if (tiers.ok()) self->set_tiers(*std::move(tiers));
  } else {
    Result<std::unique_ptr<CheckpointManager>> manager = [&] {
      nb::gil_scoped_release release;  // Open may wait for the other processes
      return CheckpointManager::Open(kv, std::move(options));
    }();
    status = manager.status();
    if (manager.ok()) self->set_manager(*std::move(manager));
  }
  if (!status.ok()) {
    self->~Manager();
    ThrowIfError(status);
  }
}

}  // namespace

void DefineManager(nb::module_& m) {
  m.attr("METADATA_FILE") = kMetadataFileName;
  m.attr("METRICS_FILE") = kMetricsFileName;
  // The one retention policy (manager/retention.h), for a manager whose steps are not the
  // engine's (the Python manager of an Orbax root).
  m.def(
      "steps_to_delete",
      [](const std::set<int64_t>& steps, const std::map<int64_t, double>& metrics,
         int max_to_keep, int64_t keep_period, bool by_metric, const std::string& best_mode) {
        if (best_mode != "min" && best_mode != "max") {
          throw nb::value_error("best_mode must be 'min' or 'max'");
        }
        return StepsToDelete(steps, metrics,
                             {.max_to_keep = max_to_keep, .keep_period = keep_period,
                              .by_metric = by_metric,
                              .best_mode = best_mode == "min" ? BestMode::kMin : BestMode::kMax});
      },
      nb::arg("steps"), nb::arg("metrics"), nb::kw_only(), nb::arg("max_to_keep"),
      nb::arg("keep_period"), nb::arg("by_metric"), nb::arg("best_mode"),
      "The steps that retention deletes, ascending (manager/retention.h).");
  m.def("process_state_file_name", &ProcessStateFileName, nb::arg("process_index"),
        "The name of a process's own state file inside a step folder (Reader.read_file).");
  nb::class_<PyTieredRestore>(m, "TieredRestore", "A step opened by Manager.open_restore.")
      .def_prop_ro("step", [](const PyTieredRestore& r) { return r.restore.step; })
      .def_ro("reader", &PyTieredRestore::reader)
      .def_prop_ro("per_process",
                   [](const PyTieredRestore& r) { return BytesOrNone(r.restore.extras.per_process); })
      .def_prop_ro("metadata",
                   [](const PyTieredRestore& r) { return BytesOrNone(r.restore.extras.metadata); });
  nb::class_<Manager>(m, "Manager",
                      "The steps of one training run under `root`: saves (in the background with "
                      "async_save), retention, the newest complete step. Holds the root's lock "
                      "until close().",
                      nb::type_slots(GcSlots<Manager>()))
      .def("__init__", &InitManager, nb::arg("root"), nb::kw_only(), nb::arg("max_to_keep") = 0,
           nb::arg("keep_period") = 0, nb::arg("save_interval_steps") = 0,
           nb::arg("best_metric") = "", nb::arg("best_mode") = "min",
           nb::arg("max_staging_bytes") = 0, nb::arg("handle_sigterm") = false,
           nb::arg("coordinator").none() = nb::none(), nb::arg("on_commit").none() = nb::none(),
           nb::arg("target_chunk_bytes") = WriterOptions{}.target_chunk_bytes,
           nb::arg("target_data_file_bytes") = WriterOptions{}.target_data_file_bytes,
           nb::arg("max_inflight_bytes") = int64_t(WriterOptions{}.max_inflight_bytes),
           nb::arg("io_threads") = 0, nb::arg("sync") = true, nb::arg("overwrite") = false,
           nb::arg("coordination_timeout_s") = kDefaultCoordinationTimeoutSeconds,
           nb::arg("local_dir").none() = nb::none(), nb::arg("local_save_interval_steps") = 1,
           nb::arg("local_max_to_keep") = 1, nb::arg("local_server_address") = "127.0.0.1",
           nb::arg("local_server_port") = 0, nb::arg("warn").none() = nb::none(),
           nb::arg("incremental") = false,
           "Creates `root` if needed, takes its lock and removes the leftovers of crashed saves; "
           "with `local_dir`, opens the node-local tier there too (collective; "
           "tiers/multi_tier_manager.h). ValueError when another manager holds the lock or for "
           "bad options. on_commit(stats: dict) is called after each commit, on the committing "
           "thread, with the GIL; warn(text) with the local tier's warnings.")
      .def_static(
          "step_dir", [](int64_t step) { return ValueOrThrow(CheckpointManager::StepDir(step)); },
          nb::arg("step"),
          "The folder name of `step` (10 digits, zero-padded); ValueError when negative "
          "or longer.")
      .def("save", &Manager::Save, nb::arg("step"), nb::arg("arrays"), nb::kw_only(),
           nb::arg("tree_json").none() = nb::none(), nb::arg("metadata_json") = "",
           nb::arg("process_state").none() = nb::none(),
           nb::arg("metrics") = std::map<std::string, double>(), nb::arg("codec") = "none",
           nb::arg("zstd_level") = ArraySpec{}.zstd_level, nb::arg("async_save") = true,
           nb::arg("force") = false, nb::arg("same_as_base") = std::vector<std::string>(),
           nb::arg("same_as_step").none() = nb::none(),
           nb::sig("def save(self, step: int, arrays: list[tuple[str, str, "
                   "collections.abc.Sequence[int], list[tuple[collections.abc.Sequence[int], "
                   "collections.abc.Sequence[int], numpy.typing.NDArray[numpy.uint8], int, "
                   "int]], bool]], *, tree_json: str | None = None, metadata_json: str = '', "
                   "process_state: bytes | None = None, metrics: dict[str, float] = {}, "
                   "codec: str = 'none', zstd_level: int = 3, async_save: bool = True, "
                   "force: bool = False, same_as_base: list[str] = [], "
                   "same_as_step: int | None = None) "
                   "-> dict[str, int | float | bool] | None"),
           "Saves `step` on the tiers it is due on (every tier with `force`; without a local "
           "tier, on the persistent one in any case): arrays as (path, dtype, shape, shards, stable) with shards as in "
           "Writer.add_array. With async_save, returns None once the shards that are not "
           "`stable` are copied to host memory (their buffers may change afterwards) and the "
           "rest runs in the background; `stable` shards (views of immutable jax.Arrays) are "
           "written from where they are and referenced until the save ends; "
           "otherwise returns the save's statistics once it is committed. Raises the error of "
           "an earlier background save first, if any (without saving), FileExistsError when "
           "the step is complete, ValueError for bad arrays, metadata or metrics. "
           "Incremental managers: `same_as_base` names arrays whose shards are the very buffers "
           "(of immutable arrays, still alive) that this manager's save of `same_as_step` read; "
           "when that step is the base, their chunks are referenced without hashing "
           "(SaveRequest::same_as_step).")
      .def("all_steps", &Manager::AllSteps, "Complete steps, ascending.")
      .def("latest_step", &Manager::LatestStep, "The newest complete step, or None.")
      .def("run_id", &Manager::RunId,
           "The id of the run writing into the root (its RUN_ID file, made by the first call); "
           "process 0 only.")
      .def("damaged_steps", &Manager::DamagedSteps,
           "Steps with a COMMIT that do not open (found by process 0 at open), and why.")
      .def("retired_steps", &Manager::RetiredSteps,
           "Steps retention dropped that stay on storage, unlisted, because a listed step "
           "refers to their data (incremental steps); process 0 only.")
      .def("should_save", &Manager::ShouldSave, nb::arg("step"),
           "Whether `step` is due under save_interval_steps (or local_save_interval_steps).")
      .def("persistent_due", &Manager::PersistentDue, nb::arg("step"),
           "Whether `step` is due on the persistent tier.")
      .def("open_step", &Manager::OpenStepReader, nb::arg("step"), nb::kw_only(),
           nb::arg("verify_checksums") = true,
           nb::arg("max_inflight_bytes") = int64_t(ReaderOptions{}.max_inflight_bytes),
           nb::arg("io_threads") = 0, nb::arg("map_spans") = true,
           nb::arg("share").none() = nb::none(),
           "A Reader of `step` on the store the manager opened. FileNotFoundError when the "
           "step is absent. share: None, or (coordinator, key_prefix, timeout_s) "
           "for a shared reader (Reader.shared).")
      .def_prop_ro("multi_tier", &Manager::multi_tier, "Whether a local tier is open.")
      .def("local_steps", &Manager::LocalSteps,
           "Steps this node's local tier holds (any process's folder), ascending.")
      .def("tiered_latest_step", &Manager::TieredLatestStep,
           "Collective: the newest step the persistent tier or the local tiers together "
           "restore, or None.")
      .def("restorable_steps", &Manager::RestorableSteps,
           "Collective: every step the tiers together restore, ascending.")
      .def(
          "open_restore",
          [](nb::pointer_and_handle<Manager> self, int64_t step, bool verify_checksums,
             int64_t max_inflight_bytes, int io_threads) {
            return self.p->OpenRestore(self.h, step, verify_checksums, max_inflight_bytes,
                                       io_threads);
          },
          nb::arg("step"), nb::kw_only(), nb::arg("verify_checksums") = true,
          nb::arg("max_inflight_bytes") = int64_t(ReaderOptions{}.max_inflight_bytes),
          nb::arg("io_threads") = 0,
          "Collective: opens `step` over its holders, cheapest first (this node, the peers, "
          "the persistent store the manager opened), and reads the extras. FileNotFoundError "
          "when no tier holds all of it; call finish_restore afterwards either way.")
      .def("finish_restore", &Manager::FinishRestore, nb::arg("restore").none(),
           nb::arg("error") = "", nb::kw_only(), nb::arg("as_stored") = false,
           nb::arg("codec") = "none", nb::arg("zstd_level") = ArraySpec{}.zstd_level,
           "Collective: every process says how its restore ended (`error`, \"\" when it read "
           "everything; `restore` None after a failure); returns (every process's word, "
           "whether this node's copy was written back). Only when all words are empty are "
           "abandoned holdings dropped and, when the restore read from elsewhere than this "
           "node and `as_stored`, the host buffers the reader filled saved as this node's "
           "holding.")
      .def("reached_preemption", &Manager::ReachedPreemption, nb::arg("step"),
           "True once a SIGTERM arrived (handle_sigterm); collective with several processes.")
      .def("wait_until_finished", &Manager::WaitUntilFinished,
           "Waits for the save in flight; raises its error (once).")
      .def("close", &Manager::Close,
           "Waits for the save in flight (raising its error), restores the SIGTERM handler and "
           "releases the lock. Later calls other than the step queries raise ValueError.");
}

}  // namespace tensorstash::python
