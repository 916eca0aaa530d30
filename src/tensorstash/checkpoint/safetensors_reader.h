// SafetensorsReader: a Hugging Face safetensors file, or a folder of them, as a StepSource.
//
// Three layouts open (DetectStepFormat finds them): one `.safetensors` file named directly; a
// folder with `model.safetensors.index.json` (its "weight_map" names the file of every tensor,
// as transformers' save_pretrained writes sharded weights); a folder with one
// `model.safetensors`. The step's tree is a flat dict of the tensor names as they are
// ("model.layers.0.self_attn.q_proj.weight"), what a torch state_dict holds. Each tensor is one
// whole chunk stored raw, so a read of a box fetches only the byte ranges of the box's rows
// (neighbouring ranges coalesced as ReaderOptions says).
//
// safetensors records no checksums: Verify checks what can be checked (the headers, at Open;
// every tensor's bytes readable), not the content.
//
// Thread-safety: after Open, const methods, ReadMany and Verify may run on several threads.
#ifndef TENSORSTASH_CHECKPOINT_SAFETENSORS_READER_H_
#define TENSORSTASH_CHECKPOINT_SAFETENSORS_READER_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tensorstash/checkpoint/orbax_reader.h"
#include "tensorstash/engine/step_source.h"
#include "tensorstash/util/thread_pool.h"

namespace tensorstash {

class SafetensorsReader final : public StepSource {
 public:
  // Opens `path` of `kv`: a safetensors file when `path` names one, else a folder holding
  // model.safetensors.index.json or model.safetensors. DataLoss naming the file (and the tensor)
  // for a malformed header or index (ParseSafetensorsHeader's checks; an index naming a file
  // outside the folder, a tensor missing from the file the index names, a tensor in two files),
  // NotFound for missing files, Unimplemented for dtypes this reader lacks.
  static Result<std::unique_ptr<SafetensorsReader>> Open(KvStore* kv, std::string path,
                                                         ReaderOptions options = {});

  StepFormat format() const override { return StepFormat::kSafetensors; }
  const std::string& dir() const override { return path_; }
  const TreeNode& tree() const override { return tree_; }
  const std::vector<ArrayMetadata>& arrays() const override { return metadata_; }
  uint64_t StoredBytes(size_t id) const override { return tensors_[id].end - tensors_[id].begin; }
  int64_t NumChunks(size_t) const override { return 1; }
  std::string CodecDescription(size_t) const override { return "none (safetensors)"; }
  int64_t created_unix_ms() const override { return 0; }
  int process_count() const override { return 0; }
  Status ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats,
                  const std::function<void(uint64_t, uint64_t)>& progress) override;
  // safetensors has no files besides the tensors': NotFound.
  Result<std::string> ReadFile(std::string_view name) const override;
  Result<std::vector<BadChunk>> Verify(
      const std::function<void(uint64_t, uint64_t)>& progress) override;
  uint64_t VerifyTotalBytes() const override;
  size_t VerifyTotalItems() const override { return tensors_.size(); }

  // The keys of the safetensors files, in the order their tensors appear in the tree.
  const std::vector<std::string>& files() const { return files_; }

 private:
  struct Tensor {
    size_t file = 0;  // index into files_
    uint64_t begin = 0;
    uint64_t end = 0;
  };
  SafetensorsReader(KvStore* kv, std::string path, ReaderOptions options);
  Status AddFile(const std::string& key, const std::vector<std::string>* expected_names);
  // Reads the stored bytes of `region` of array `id` (C order) as `dtype` into `dest`.
  Status ReadRegion(size_t id, const Box& region, DType dtype, char* dest, TaskGroup* group,
                    const std::function<void(uint64_t)>& done);

  CountingKvStore kv_;
  const std::string path_;
  ReaderOptions options_;
  std::vector<std::string> files_;
  TreeNode tree_ = TreeNode::Dict();
  std::vector<ArrayMetadata> metadata_;
  std::vector<Tensor> tensors_;
  std::map<std::string, size_t, std::less<>> by_path_;  // array path -> id
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_CHECKPOINT_SAFETENSORS_READER_H_
