// tensorstash._ext.Manager: CheckpointManager on a store opened by URL (kvstore/registry.h).
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
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "bindings.h"
#include "buffers.h"
#include "coordinator.h"
#include "errors.h"
#include "gc_slots.h"
#include "save_args.h"
#include "tensorstash/manager/checkpoint_manager.h"
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
  return result;
}

class Manager {
 public:
  Manager(std::unique_ptr<KvStore> kv, std::unique_ptr<PyCoordinator> coordinator,
          nb::object on_commit)
      : kv_(std::move(kv)),
        coordinator_(std::move(coordinator)),
        on_commit_(std::move(on_commit)) {}

  ~Manager() { Clear(); }

  // Set once by InitManager, after the callback that refers to on_commit_ is in place.
  void set_manager(std::unique_ptr<CheckpointManager> manager) { manager_ = std::move(manager); }

  // The Python objects it holds, for the garbage collector (gc_slots.h).
  std::array<nb::handle, 2> python_objects() const {
    return {coordinator_ != nullptr ? coordinator_->object() : nb::handle(), on_commit_};
  }

  // Drops everything, for tp_clear and the destructor; the Manager is unusable afterwards. The
  // manager goes first (it uses the others), with the GIL released: it waits for a save in
  // flight, whose thread may need the GIL for the callback or the coordinator.
  void Clear() {
    if (manager_ != nullptr) {
      nb::gil_scoped_release release;
      manager_.reset();
    }
    coordinator_.reset();
    on_commit_ = nb::object();
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

  nb::object Save(int64_t step, const std::vector<ArrayTuple>& arrays,
                  const std::optional<std::string>& tree_json, const std::string& metadata_json,
                  const std::optional<nb::bytes>& process_state,
                  const std::map<std::string, double>& metrics, const std::string& codec,
                  int zstd_level, bool async_save) {
    CheckpointManager& manager = Get();
    // References to the shard buffers, so that they outlive the copy (or the whole sync save)
    // even if another thread drops the caller's list while the GIL is released.
    std::vector<ReadOnlyBytes> buffers;
    SaveRequest request = SaveRequestFromPython(arrays, tree_json, metadata_json, process_state,
                                                metrics, codec, zstd_level, &buffers);
    SaveStats stats;
    Status status;
    {
      nb::gil_scoped_release release;
      status = async_save ? manager.SaveAsync(step, std::move(request))
                          : manager.Save(step, std::move(request), &stats);
    }
    ThrowIfError(status);
    return async_save ? nb::none() : nb::object(StatsDict(stats));
  }

  std::vector<int64_t> AllSteps() {
    return WithoutGil([](CheckpointManager& manager) { return manager.AllSteps(); });
  }

  std::map<int64_t, std::string> DamagedSteps() {
    return WithoutGil([](CheckpointManager& manager) { return manager.DamagedSteps(); });
  }

  std::optional<int64_t> LatestStep() {
    return WithoutGil([](CheckpointManager& manager) { return manager.LatestStep(); });
  }

  std::string RunId() {
    Result<std::string> id =
        WithoutGil([](CheckpointManager& manager) { return manager.RunId(); });
    return ValueOrThrow(std::move(id));
  }

  bool ShouldSave(int64_t step) {
    return WithoutGil([step](CheckpointManager& manager) { return manager.ShouldSave(step); });
  }

  bool ReachedPreemption(int64_t step) {
    return WithoutGil(
        [step](CheckpointManager& manager) { return manager.ReachedPreemption(step); });
  }

  void WaitUntilFinished() {
    ThrowIfError(
        WithoutGil([](CheckpointManager& manager) { return manager.WaitUntilFinished(); }));
  }

  void Close() {
    ThrowIfError(WithoutGil([](CheckpointManager& manager) { return manager.Close(); }));
  }

 private:
  CheckpointManager& Get() const {
    if (manager_ == nullptr) ThrowIfError(FailedPreconditionError("the manager was cleared"));
    return *manager_;
  }

  // `call(manager)` with the GIL released, once Get() found the manager usable; the result is
  // returned (and an error raised by the caller) with the GIL taken back.
  template <typename F>
  std::invoke_result_t<F&, CheckpointManager&> WithoutGil(F call) {
    CheckpointManager& manager = Get();
    nb::gil_scoped_release release;
    return call(manager);
  }

  // Declared before manager_, which uses them, so that they are destroyed after it (Clear
  // destroys the manager first in any case).
  std::unique_ptr<KvStore> kv_;
  std::unique_ptr<PyCoordinator> coordinator_;
  nb::object on_commit_;
  std::unique_ptr<CheckpointManager> manager_;
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
                 bool sync, bool overwrite, double coordination_timeout_s) {
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
  ManagerOptions options;
  options.max_to_keep = static_cast<int>(max_to_keep);
  options.keep_period = keep_period;
  options.save_interval_steps = save_interval_steps;
  options.best_metric = best_metric;
  options.best_mode = ValueOrThrow(ParseBestMode(best_mode));
  options.max_staging_bytes = static_cast<uint64_t>(max_staging_bytes);
  options.handle_sigterm = handle_sigterm;
  options.writer = writer_options;

  SaveTarget target = OpenSaveTarget(root, std::move(coordinator));
  options.coordinator = target.coordinator.get();
  KvStore* kv = target.kv.get();
  // Constructed before the C++ manager exists, so that the callback can point at it; a failed
  // Open leaves a Manager without one, which nanobind then destroys.
  new (self) Manager(std::move(target.kv), std::move(target.coordinator), std::move(on_commit));
  options.on_commit = [self](const SaveStats& stats) { self->OnCommit(stats); };
  Result<std::unique_ptr<CheckpointManager>> manager = [&] {
    nb::gil_scoped_release release;  // Open may wait for the other processes
    return CheckpointManager::Open(kv, std::move(options));
  }();
  if (!manager.ok()) {
    self->~Manager();
    ThrowIfError(manager.status());
  }
  self->set_manager(std::move(manager).value());
}

}  // namespace

void DefineManager(nb::module_& m) {
  m.attr("METADATA_FILE") = kMetadataFileName;
  m.attr("METRICS_FILE") = kMetricsFileName;
  m.def("process_state_file_name", &ProcessStateFileName, nb::arg("process_index"),
        "The name of a process's own state file inside a step folder (Reader.read_file).");
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
           "Creates `root` if needed, takes its lock and removes the leftovers of crashed saves. "
           "ValueError when another manager holds the lock or for bad options. on_commit(stats: "
           "dict) is called after each commit, on the committing thread, with the GIL.")
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
           nb::sig("def save(self, step: int, arrays: list[tuple[str, str, "
                   "collections.abc.Sequence[int], list[tuple[collections.abc.Sequence[int], "
                   "collections.abc.Sequence[int], numpy.typing.NDArray[numpy.uint8], int, "
                   "int]], bool]], *, tree_json: str | None = None, metadata_json: str = '', "
                   "process_state: bytes | None = None, metrics: dict[str, float] = {}, "
                   "codec: str = 'none', zstd_level: int = 3, async_save: bool = True) "
                   "-> dict[str, int | float | bool] | None"),
           "Saves `step`: arrays as (path, dtype, shape, shards, stable) with shards as in "
           "Writer.add_array. With async_save, returns None once the shards that are not "
           "`stable` are copied to host memory (their buffers may change afterwards) and the "
           "rest runs in the background; `stable` shards (views of immutable jax.Arrays) are "
           "written from where they are and referenced until the save ends; "
           "otherwise returns the save's statistics once it is committed. Raises the error of "
           "an earlier background save first, if any (without saving), FileExistsError when "
           "the step is complete, ValueError for bad arrays, metadata or metrics.")
      .def("all_steps", &Manager::AllSteps, "Complete steps, ascending.")
      .def("latest_step", &Manager::LatestStep, "The newest complete step, or None.")
      .def("run_id", &Manager::RunId,
           "The id of the run writing into the root (its RUN_ID file, made by the first call); "
           "process 0 only.")
      .def("damaged_steps", &Manager::DamagedSteps,
           "Steps with a COMMIT that do not open (found by process 0 at open), and why.")
      .def("should_save", &Manager::ShouldSave, nb::arg("step"),
           "Whether `step` is due under save_interval_steps.")
      .def("reached_preemption", &Manager::ReachedPreemption, nb::arg("step"),
           "True once a SIGTERM arrived (handle_sigterm); collective with several processes.")
      .def("wait_until_finished", &Manager::WaitUntilFinished,
           "Waits for the save in flight; raises its error (once).")
      .def("close", &Manager::Close,
           "Waits for the save in flight (raising its error), restores the SIGTERM handler and "
           "releases the lock. Later calls other than the step queries raise ValueError.");
}

}  // namespace tensorstash::python
