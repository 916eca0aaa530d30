// The arguments of a save as they cross the binding: the arrays with this process's shards
// (tuples built by the Python layer), codec names, timeouts, the writer's options, the
// coordinator and the root. Shared by the Writer (writer.cc) and the Manager (manager.cc).
//
// Thread-safety: every function here needs the GIL.
#ifndef TENSORSTASH_PYTHON_BINDINGS_SAVE_ARGS_H_
#define TENSORSTASH_PYTHON_BINDINGS_SAVE_ARGS_H_

#include <nanobind/nanobind.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "buffers.h"
#include "coordinator.h"
#include "tensorstash/coordination/collectives.h"
#include "tensorstash/manager/checkpoint_manager.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash::python {

// (origin, shape, data, replica_id, num_replicas); data is checked by CastReadOnlyBytes.
using ShardTuple =
    std::tuple<std::vector<int64_t>, std::vector<int64_t>, nanobind::object, int, int>;

// "none" or "zstd"; InvalidArgument otherwise.
Result<Codec> ParseCodec(std::string_view name);

// kDefaultCoordinationTimeout in seconds: the default of every coordination timeout of the
// binding, and defaults()["coordination_timeout_s"].
inline constexpr double kDefaultCoordinationTimeoutSeconds =
    std::chrono::duration<double>(kDefaultCoordinationTimeout).count();

// A timeout given in seconds (the `coordination_timeout_s` arguments); InvalidArgument unless
// it is a positive finite number of at most 1e9 seconds.
Result<std::chrono::milliseconds> TimeoutFromSeconds(double seconds);

// One array of a save: its spec and this process's shards, each shard's data pointing into the
// caller's buffer. The buffers are appended to `buffers`, which must be kept (and the data left
// unchanged) for as long as the engine reads the shards. Raises TypeError for a buffer that is
// not a C-contiguous CPU uint8 array, ValueError for a bad dtype or codec name or a buffer size
// that does not match its box. `stable` marks the shards ShardData::stable.
ArrayToSave ArrayToSaveFromPython(const std::string& path, const std::string& dtype,
                                  const std::vector<int64_t>& shape,
                                  const std::vector<ShardTuple>& shards, const std::string& codec,
                                  int zstd_level, int64_t target_chunk_bytes,
                                  std::vector<ReadOnlyBytes>* buffers, bool stable = false);

// (path, dtype name, shape, shards, stable) of one array of a save; `stable`: nothing else can
// change the shards' buffers (host copies of a jax.Array's device buffers, see the package's
// _arrays_to_save), so an async save writes them without a copy (ShardData::stable).
using ArrayTuple =
    std::tuple<std::string, std::string, std::vector<int64_t>, std::vector<ShardTuple>, bool>;

// The request of a manager's save (Manager.save, LocalTier.save): the arrays
// (ArrayToSaveFromPython), the tree, metadata, per-process value and metrics. The buffers of
// shards that are not stable are appended to `buffers` (keep them until the copy is done); those
// of stable shards are owned by request.keep_alive, which drops them with the GIL. Raises as
// ArrayToSaveFromPython, and ValueError for a bad tree.
SaveRequest SaveRequestFromPython(const std::vector<ArrayTuple>& arrays,
                                  const std::optional<std::string>& tree_json,
                                  const std::string& metadata_json,
                                  const std::optional<nanobind::bytes>& process_state,
                                  const std::map<std::string, double>& metrics,
                                  const std::string& codec, int zstd_level,
                                  std::vector<ReadOnlyBytes>* buffers);

// `max_inflight_bytes` as the engine takes it; raises ValueError when it is not positive. Every
// reading and writing call of the module checks its cap here.
uint64_t InflightBytesFromPython(int64_t max_inflight_bytes);

// The options both the Writer and the Manager take, the others left at their defaults. Raises
// ValueError when max_inflight_bytes is not positive or for a bad coordination_timeout_s
// (TimeoutFromSeconds), in that order.
WriterOptions WriterOptionsFromPython(int64_t target_chunk_bytes, int64_t target_data_file_bytes,
                                      int64_t max_inflight_bytes, int io_threads, bool sync,
                                      bool overwrite, double coordination_timeout_s);

// Where a save goes: the root's store and the job's coordinator (null for a single process).
struct SaveTarget {
  std::unique_ptr<KvStore> kv;
  std::unique_ptr<PyCoordinator> coordinator;
};

// Wraps `coordinator` unless it is None (PyCoordinator::Create), then opens `root`, creating it
// if needed, with the GIL released. Raises the error of either.
SaveTarget OpenSaveTarget(const std::string& root, nanobind::object coordinator);

}  // namespace tensorstash::python

#endif  // TENSORSTASH_PYTHON_BINDINGS_SAVE_ARGS_H_
