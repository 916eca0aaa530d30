// Export of any step (native, Orbax, safetensors) to a Hugging Face safetensors folder: what
// `tensorstash convert --to safetensors` and tensorstash.export_safetensors do.
//
// The tensors are named by their tree keys joined with '.' (list positions as numbers), the
// names a torch state_dict has; each is stored whole, in its stored dtype. They are packed in
// tree order into files `model-0000k-of-0000n.safetensors` of at most max_shard_bytes of tensor
// data each (a larger tensor gets a file of its own), each with the header metadata
// {"format": "pt"} that transformers expects, and a `model.safetensors.index.json` (total_size
// and weight_map) is always written, even for one file.
//
// A half export is never taken for a whole one: every file is written and synced before the
// index, which is written last; where the store renames folders (file://), the whole folder is
// written under a temporary name next to the destination and renamed into place at the end.
// Memory is bounded: tensors are read and written in row-major pieces of at most piece_bytes
// (cut at a deeper dimension where a row is larger; one element at least), with at most
// max_inflight_bytes held at once, by io_threads threads writing at known offsets. A piece that
// cannot be allocated is ResourceExhausted.
#ifndef TENSORSTASH_CHECKPOINT_SAFETENSORS_EXPORT_H_
#define TENSORSTASH_CHECKPOINT_SAFETENSORS_EXPORT_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tensorstash/engine/step_source.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct SafetensorsExportOptions {
  uint64_t max_shard_bytes = uint64_t{5} << 30;
  uint64_t max_inflight_bytes = uint64_t{1} << 30;
  uint64_t piece_bytes = uint64_t{64} << 20;
  int io_threads = 0;  // 0: DefaultIoThreads()
};

struct SafetensorsExportResult {
  std::vector<std::string> files;    // the data files' names in the folder, in order
  uint64_t total_bytes = 0;          // tensor bytes (the index's total_size)
  size_t tensors = 0;
  std::vector<std::string> skipped;  // paths of non-array leaves, which safetensors cannot hold
};

// The '.'-joined name of every array leaf of `tree`, in tree order, as (name, array id); paths
// of the other leaves (ints, strings, ...) into `skipped`. InvalidArgument naming both paths when
// two leaves join to the same name ({"a": {"b": x}, "a.b": y}).
Result<std::vector<std::pair<std::string, size_t>>> SafetensorsNames(
    const TreeNode& tree, std::vector<std::string>* skipped);

// Exports `source` to folder `dst` of `kv`, which must not exist or be empty (AlreadyExists
// otherwise). InvalidArgument for colliding names and for dtypes safetensors lacks (naming the
// tensor), before anything is written; read and write errors as the source and store give them.
// On failure the destination has no index (and, with rename, nothing at all). progress(done,
// total) in bytes.
Result<SafetensorsExportResult> ExportSafetensors(
    StepSource* source, KvStore* kv, const std::string& dst,
    const SafetensorsExportOptions& options = {},
    const std::function<void(uint64_t, uint64_t)>& progress = nullptr);

}  // namespace tensorstash

#endif  // TENSORSTASH_CHECKPOINT_SAFETENSORS_EXPORT_H_
