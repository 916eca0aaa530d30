#include "save_args.h"

#include <cmath>
#include <utility>

#include "errors.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/kvstore/registry.h"

namespace nb = nanobind;

namespace tensorstash::python {

Result<Codec> ParseCodec(std::string_view name) {
  if (name == CodecName(Codec::kNone)) return Codec::kNone;
  if (name == CodecName(Codec::kZstd)) return Codec::kZstd;
  return InvalidArgumentError(StrCat("unknown codec '", name, "' (expected 'none' or 'zstd')"));
}

Result<std::chrono::milliseconds> TimeoutFromSeconds(double seconds) {
  // Bounded so that the conversion cannot overflow; a billion seconds is 31 years.
  if (!std::isfinite(seconds) || seconds <= 0 || seconds > 1e9) {
    return InvalidArgumentError(
        StrCat("coordination_timeout_s must be a positive number of seconds, not ", seconds));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000)));
}

ArrayToSave ArrayToSaveFromPython(const std::string& path, const std::string& dtype,
                                  const std::vector<int64_t>& shape,
                                  const std::vector<ShardTuple>& shards, const std::string& codec,
                                  int zstd_level, int64_t target_chunk_bytes,
                                  std::vector<ReadOnlyBytes>* buffers, bool stable) {
  ArrayToSave array;
  array.spec.path = path;
  array.spec.dtype = ValueOrThrow(ParseDType(dtype));
  array.spec.shape = shape;
  array.spec.codec = ValueOrThrow(ParseCodec(codec));
  array.spec.zstd_level = zstd_level;
  array.spec.target_chunk_bytes = target_chunk_bytes;
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& [origin, shard_shape, object, replica_id, num_replicas] = shards[i];
    const std::string what = StrCat("array '", path, "' shard ", i);
    ReadOnlyBytes bytes = CastReadOnlyBytes(object, what);
    Box box(origin, shard_shape);
    ThrowIfError(CheckBufferSize(box, array.spec.dtype, bytes.nbytes(), what));
    array.shards.push_back({std::move(box), bytes.data(), replica_id, num_replicas, stable});
    buffers->push_back(std::move(bytes));
  }
  return array;
}

uint64_t InflightBytesFromPython(int64_t max_inflight_bytes) {
  if (max_inflight_bytes <= 0) {
    ThrowIfError(
        InvalidArgumentError(StrCat("max_inflight_bytes must be > 0, not ", max_inflight_bytes)));
  }
  return static_cast<uint64_t>(max_inflight_bytes);
}

WriterOptions WriterOptionsFromPython(int64_t target_chunk_bytes, int64_t target_data_file_bytes,
                                      int64_t max_inflight_bytes, int io_threads, bool sync,
                                      bool overwrite, double coordination_timeout_s) {
  WriterOptions options;
  options.max_inflight_bytes = InflightBytesFromPython(max_inflight_bytes);
  options.target_chunk_bytes = target_chunk_bytes;
  options.target_data_file_bytes = target_data_file_bytes;
  options.io_threads = io_threads;
  options.sync = sync;
  options.overwrite = overwrite;
  options.coordination_timeout = ValueOrThrow(TimeoutFromSeconds(coordination_timeout_s));
  return options;
}

SaveTarget OpenSaveTarget(const std::string& root, nb::object coordinator) {
  SaveTarget target;
  if (!coordinator.is_none()) {
    target.coordinator = ValueOrThrow(PyCoordinator::Create(std::move(coordinator)));
  }
  target.kv = ValueOrThrow([&] {
    nb::gil_scoped_release release;
    return OpenKvStore(root, {.create = true});
  }());
  return target;
}

namespace {

// References to the buffers of stable shards, held until the save that reads them ends. That
// may be on the manager's background thread, which holds no GIL: dropping them takes it.
struct StableBuffers {
  std::vector<ReadOnlyBytes> buffers;
  ~StableBuffers() {
    nb::gil_scoped_acquire gil;
    buffers.clear();
  }
};

}  // namespace

SaveRequest SaveRequestFromPython(const std::vector<ArrayTuple>& arrays,
                                  const std::optional<std::string>& tree_json,
                                  const std::string& metadata_json,
                                  const std::optional<nb::bytes>& process_state,
                                  const std::map<std::string, double>& metrics,
                                  const std::string& codec, int zstd_level,
                                  std::vector<ReadOnlyBytes>* buffers) {
  SaveRequest request;
  auto stable_buffers = std::make_shared<StableBuffers>();
  for (const auto& [path, dtype, shape, shards, stable] : arrays) {
    request.arrays.push_back(ArrayToSaveFromPython(
        path, dtype, shape, shards, codec, zstd_level,
        /*target_chunk_bytes=*/0, stable ? &stable_buffers->buffers : buffers, stable));
  }
  request.keep_alive = std::move(stable_buffers);
  if (tree_json.has_value()) request.tree = ValueOrThrow(TreeNodeFromJson(*tree_json));
  request.metadata_json = metadata_json;
  if (process_state.has_value()) {
    request.process_state = std::string(process_state->c_str(), process_state->size());
  }
  request.metrics = metrics;
  return request;
}

}  // namespace tensorstash::python
