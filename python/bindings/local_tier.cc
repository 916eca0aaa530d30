// tensorstash._ext.LocalTier: one process's part of the node-local tier
// (tiers/local_tier.h), under the package's CheckpointManager(local_dir=...). Every call
// releases the GIL: the collective ones wait on the coordinator, a Python object that takes
// the GIL itself, and on the other processes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "buffers.h"
#include "coordinator.h"
#include "errors.h"
#include "gc_slots.h"
#include "save_args.h"
#include "tensorstash/tiers/holdings.h"
#include "tensorstash/tiers/local_tier.h"
#include "tensorstash/kvstore/registry.h"

namespace nb = nanobind;

namespace tensorstash::python {
namespace {

nb::object BytesOrNone(const std::optional<std::string>& value) {
  if (!value.has_value()) return nb::none();
  return nb::bytes(value->data(), value->size());
}

// What LocalTier.gather found (JobHoldings), handed back to open_step.
struct PyJobHoldings {
  JobHoldings job;
};

// A step opened by LocalTier.open_step: its reader and what was read besides the arrays.
struct PyTieredRestore {
  int64_t step = 0;
  std::optional<SaveKey> save;
  nb::object reader;
  RestoredExtras extras;
};

class PyLocalTier {
 public:
  PyLocalTier(std::unique_ptr<PyCoordinator> coordinator, nb::object warn)
      : coordinator_(std::move(coordinator)), warn_(std::move(warn)) {}
  ~PyLocalTier() { Clear(); }

  void set_tier(std::unique_ptr<LocalTier> tier) { tier_ = std::move(tier); }

  std::array<nb::handle, 2> python_objects() const {
    return {coordinator_ != nullptr ? coordinator_->object() : nb::handle(), warn_};
  }

  // For tp_clear and the destructor: the tier first (it waits for a save in flight).
  void Clear() {
    if (tier_ != nullptr) {
      nb::gil_scoped_release release;
      tier_.reset();
    }
    coordinator_.reset();
    warn_ = nb::object();
  }

  // The warn callback of the C++ tier: any thread, takes the GIL.
  void Warn(const std::string& text) {
    nb::gil_scoped_acquire gil;
    if (!warn_.is_valid() || warn_.is_none()) return;
    try {
      warn_(text);
    } catch (nb::python_error& error) {
      error.discard_as_unraisable("tensorstash: the local tier's warn callback");
    }
  }

  bool ShouldSave(int64_t step) { return Get().ShouldSave(step); }

  bool Save(int64_t step, const std::vector<ArrayTuple>& arrays,
            const std::optional<std::string>& tree_json, const std::string& metadata_json,
            const std::optional<nb::bytes>& process_state, const std::string& codec, int zstd_level,
            bool async_save) {
    LocalTier& tier = Get();
    std::vector<ReadOnlyBytes> buffers;
    SaveRequest request = SaveRequestFromPython(arrays, tree_json, metadata_json, process_state, {},
                                                codec, zstd_level, &buffers);
    nb::gil_scoped_release release;
    return ValueOrThrowReleased(tier.Save(step, std::move(request), async_save));
  }

  bool SaveHolding(int64_t step, const std::vector<ArrayTuple>& arrays,
                   const std::optional<std::string>& tree_json, const std::string& metadata_json,
                   const std::string& save_id,
                   const std::map<int, std::optional<nb::bytes>>& values, const std::string& codec,
                   int zstd_level, bool async_save) {
    LocalTier& tier = Get();
    std::vector<ReadOnlyBytes> buffers;
    SaveRequest request = SaveRequestFromPython(arrays, tree_json, metadata_json, std::nullopt, {},
                                                codec, zstd_level, &buffers);
    ProcessValues packed;
    for (const auto& [index, value] : values) {
      packed[index] = value ? std::optional<std::string>(std::string(value->c_str(), value->size()))
                            : std::nullopt;
    }
    nb::gil_scoped_release release;
    return ValueOrThrowReleased(
        tier.SaveHolding(step, std::move(request), save_id, packed, async_save));
  }

  void WaitUntilFinished() {
    LocalTier& tier = Get();
    Status status;
    {
      nb::gil_scoped_release release;
      status = tier.WaitUntilFinished();
    }
    ThrowIfError(status);
  }

  std::vector<int64_t> LocalSteps() {
    LocalTier& tier = Get();
    nb::gil_scoped_release release;
    return tier.LocalSteps();
  }

  PyJobHoldings Gather(const std::vector<int64_t>& persistent_steps) {
    LocalTier& tier = Get();
    Result<JobHoldings> job = [&] {
      nb::gil_scoped_release release;
      return tier.Gather(persistent_steps);
    }();
    return PyJobHoldings{ValueOrThrow(std::move(job))};
  }

  PyTieredRestore OpenStep(int64_t step, const PyJobHoldings& job,
                           const std::string& persistent_root, bool verify_checksums,
                           int64_t max_inflight_bytes, int io_threads) {
    LocalTier& tier = Get();
    ReaderOptions options;
    options.verify_checksums = verify_checksums;
    options.max_inflight_bytes = static_cast<uint64_t>(std::max<int64_t>(1, max_inflight_bytes));
    options.io_threads = io_threads;
    std::unique_ptr<KvStore> persistent;
    Result<TieredRestore> restore = [&]() -> Result<TieredRestore> {
      nb::gil_scoped_release release;
      Result<std::unique_ptr<KvStore>> kv = OpenKvStore(persistent_root, {.create = false});
      // A persistent root that is gone (moved away, unmounted) is no holder; the others may do.
      if (kv.ok()) persistent = *std::move(kv);
      return tier.OpenStep(step, job.job, persistent.get(), options);
    }();
    TieredRestore opened = ValueOrThrow(std::move(restore));
    PyTieredRestore out;
    out.step = step;
    out.save = opened.save;
    out.extras = std::move(opened.extras);
    out.reader = ReaderFromSource(std::move(persistent), std::move(opened.source));
    return out;
  }

  std::vector<std::string> FinishRestore(const PyTieredRestore* restore, std::string error) {
    LocalTier& tier = Get();
    TieredRestore done;
    if (restore != nullptr) {
      done.step = restore->step;
      done.save = restore->save;
    }
    Result<std::vector<std::string>> words = [&] {
      nb::gil_scoped_release release;
      return tier.FinishRestore(restore != nullptr ? &done : nullptr, std::move(error));
    }();
    return ValueOrThrow(std::move(words));
  }

  std::string Url() { return Get().url(); }

  void Close() {
    if (tier_ == nullptr) return;
    Status status;
    {
      nb::gil_scoped_release release;
      status = tier_->Close();
    }
    ThrowIfError(status);
  }

 private:
  LocalTier& Get() const {
    if (tier_ == nullptr) ThrowIfError(FailedPreconditionError("the local tier was cleared"));
    return *tier_;
  }

  // The value of `result`, called with the GIL released: raising needs it back.
  template <typename T>
  static T ValueOrThrowReleased(Result<T> result) {
    if (result.ok()) return *std::move(result);
    nb::gil_scoped_acquire gil;
    ThrowIfError(result.status());
    return T();
  }

  std::unique_ptr<PyCoordinator> coordinator_;
  nb::object warn_;
  std::unique_ptr<LocalTier> tier_;
};

void InitLocalTier(PyLocalTier* self, const std::string& local_dir, const std::string& run,
                   nb::object coordinator, int64_t save_interval_steps, int max_to_keep, const std::string& address,
                   int port, double timeout_s, int64_t max_staging_bytes,
                   int64_t target_chunk_bytes, int64_t target_data_file_bytes,
                   int64_t max_inflight_bytes, int io_threads, nb::object warn) {
  LocalTierOptions options;
  options.dir = local_dir;
  options.run = run;
  options.save_interval_steps = save_interval_steps;
  options.max_to_keep = max_to_keep;
  options.server_address = address;
  options.server_port = port;
  options.timeout = ValueOrThrow(TimeoutFromSeconds(timeout_s));
  options.peer_stall_timeout = std::min(options.timeout, std::chrono::milliseconds(30000));
  if (max_staging_bytes < 0) {
    ThrowIfError(
        InvalidArgumentError(StrCat("max_staging_bytes must be >= 0, not ", max_staging_bytes)));
  }
  options.max_staging_bytes = static_cast<uint64_t>(max_staging_bytes);
  options.writer = WriterOptionsFromPython(target_chunk_bytes, target_data_file_bytes,
                                           max_inflight_bytes, io_threads, /*sync=*/false,
                                           /*overwrite=*/true, timeout_s);
  std::unique_ptr<PyCoordinator> py_coordinator;
  if (!coordinator.is_none()) py_coordinator = ValueOrThrow(PyCoordinator::Create(coordinator));
  options.coordinator = py_coordinator.get();
  if (!warn.is_none() && !PyCallable_Check(warn.ptr())) {
    throw nb::type_error("warn must be callable or None");
  }
  new (self) PyLocalTier(std::move(py_coordinator), std::move(warn));
  options.warn = [self](const std::string& text) { self->Warn(text); };
  Result<std::unique_ptr<LocalTier>> tier = [&] {
    nb::gil_scoped_release release;  // Open waits for the other processes
    return LocalTier::Open(std::move(options));
  }();
  if (!tier.ok()) {
    self->~PyLocalTier();
    ThrowIfError(tier.status());
  }
  self->set_tier(*std::move(tier));
}

}  // namespace

void DefineLocalTier(nb::module_& m) {
  m.def(
      "restorable_saves",
      [](const std::string& holdings_json) {
        std::map<int64_t, std::string> out;
        for (const auto& [step, save] :
             RestorableSaves(ValueOrThrow(HoldingsFromJson(holdings_json)))) {
          out[step] = save.save_id;
        }
        return out;
      },
      nb::arg("holdings_json"),
      "For each step the holdings (a JSON list, tiers/holdings.h) restore alone, the id of "
      "the save to restore. ValueError for a list that is not valid.");
  m.def("value_ring", &ValueRing, nb::arg("index"), nb::arg("count"),
        "The processes whose per-process values the holding of process `index` carries.");

  nb::class_<PyJobHoldings>(m, "JobHoldings", "What every process holds (LocalTier.gather).")
      .def(
          "restorable_steps", [](const PyJobHoldings& j) { return j.job.RestorableSteps(); },
          "Steps restorable from any tiers, ascending.")
      .def("latest_step", [](const PyJobHoldings& j) { return j.job.LatestStep(); })
      .def("in_persistent", [](const PyJobHoldings& j, int64_t step) {
        return std::count(j.job.persistent_steps.begin(), j.job.persistent_steps.end(), step) > 0;
      });

  nb::class_<PyTieredRestore>(m, "TieredRestore", "A step opened by LocalTier.open_step.")
      .def_ro("step", &PyTieredRestore::step)
      .def_ro("reader", &PyTieredRestore::reader)
      .def_prop_ro("per_process",
                   [](const PyTieredRestore& r) { return BytesOrNone(r.extras.per_process); })
      .def_prop_ro("metadata",
                   [](const PyTieredRestore& r) { return BytesOrNone(r.extras.metadata); })
      .def_prop_ro("ring_values",
                   [](const PyTieredRestore& r) {
                     nb::dict out;
                     for (const auto& [index, value] : r.extras.ring_values) {
                       out[nb::int_(index)] = BytesOrNone(value);
                     }
                     return out;
                   })
      .def_prop_ro("save_id", [](const PyTieredRestore& r) { return r.extras.save_id; });

  nb::class_<PyLocalTier>(m, "LocalTier",
                          "This process's part of the node-local tier (tiers/local_tier.h).",
                          nb::type_slots(GcSlots<PyLocalTier>()))
      .def("__init__", &InitLocalTier, nb::arg("local_dir"), nb::kw_only(), nb::arg("run") = "",
           nb::arg("coordinator").none() = nb::none(), nb::arg("save_interval_steps") = 1,
           nb::arg("max_to_keep") = 1, nb::arg("address") = "127.0.0.1", nb::arg("port") = 0,
           nb::arg("timeout_s") = kDefaultCoordinationTimeoutSeconds,
           nb::arg("max_staging_bytes") = 0,
           nb::arg("target_chunk_bytes") = WriterOptions{}.target_chunk_bytes,
           nb::arg("target_data_file_bytes") = WriterOptions{}.target_data_file_bytes,
           nb::arg("max_inflight_bytes") = int64_t(WriterOptions{}.max_inflight_bytes),
           nb::arg("io_threads") = 0, nb::arg("warn").none() = nb::none(),
           "Creates local_dir (0700), opens this process's holding folder and, with several "
           "processes, starts the peer server (collective). PermissionError for a folder of "
           "another user, TimeoutError naming the processes that did not arrive.")
      .def("should_save", &PyLocalTier::ShouldSave, nb::arg("step"))
      .def("save", &PyLocalTier::Save, nb::arg("step"), nb::arg("arrays"), nb::kw_only(),
           nb::arg("tree_json").none() = nb::none(), nb::arg("metadata_json") = "",
           nb::arg("process_state").none() = nb::none(), nb::arg("codec") = "none",
           nb::arg("zstd_level") = ArraySpec{}.zstd_level, nb::arg("async_save") = true,
           "Collective: saves this process's holding of `step`; False when skipped for lack "
           "of room (warned about).")
      .def("save_holding", &PyLocalTier::SaveHolding, nb::arg("step"), nb::arg("arrays"),
           nb::kw_only(), nb::arg("tree_json").none() = nb::none(), nb::arg("metadata_json") = "",
           nb::arg("save_id"), nb::arg("values"), nb::arg("codec") = "none",
           nb::arg("zstd_level") = ArraySpec{}.zstd_level, nb::arg("async_save") = false,
           "Saves this process's holding of `step` with the given save id and per-process "
           "values (a write-back). Not collective.")
      .def("wait_until_finished", &PyLocalTier::WaitUntilFinished)
      .def("local_steps", &PyLocalTier::LocalSteps,
           "Steps this node holds (any process's folder), ascending.")
      .def("gather", &PyLocalTier::Gather, nb::arg("persistent_steps"),
           "Collective: every process's holdings, and process 0's persistent steps.")
      .def("open_step", &PyLocalTier::OpenStep, nb::arg("step"), nb::arg("job"),
           nb::arg("persistent_root"), nb::kw_only(), nb::arg("verify_checksums") = true,
           nb::arg("max_inflight_bytes") = int64_t(ReaderOptions{}.max_inflight_bytes),
           nb::arg("io_threads") = 0,
           "Opens `step` over its holders, cheapest first, and reads the extras. "
           "FileNotFoundError when no tier holds all of it; call finish_restore afterwards "
           "either way.")
      .def("finish_restore", &PyLocalTier::FinishRestore, nb::arg("restore").none(),
           nb::arg("error") = "",
           "Collective: every process says how its restore ended (`error`, \"\" when it read "
           "everything; `restore` from open_step, None after a failure) and gets every "
           "process's word, by index; only when all are empty are abandoned holdings dropped.")
      .def_prop_ro("url", &PyLocalTier::Url, "The peer server's URL (\"\" for one process).")
      .def("close", &PyLocalTier::Close);
}

}  // namespace tensorstash::python
