// DcpReader: a PyTorch Distributed Checkpoint folder (what DCP's FileSystemWriter writes:
// `.metadata` and `__<rank>_<n>.distcp` files) as a StepSource, read without Python
// (format/dcp/: the pickled metadata through an allow-list, the torch.save archives located by
// their zip directories).
//
// The tree is a flat dict of the state_dict's '.'-joined names ("model.layers.0.weight"), as for
// safetensors. Tensors are arrays of their global shape; each DCP chunk (one rank's shard) is one
// stored chunk, read whole (its torch.save archive, every entry's CRC-32 checked when
// ReaderOptions::verify_checksums), so a restore onto any target reads only the chunks its boxes
// touch, each once per ReadMany however many boxes need it. A chunk of 1 MiB or more that one
// box needs whole, in its stored dtype, and holds as one run of its memory is read with its
// tensor's bytes straight into that box (ReadStats::direct_chunks): only the archive's first and
// last 64 KiB (its zip records, data.pkl) go through staging, and the tensor's CRC-32 is checked
// where it landed. Chunks are read side by side on
// ReaderOptions::io_threads threads, their archives held at once within
// ReaderOptions::max_inflight_bytes (a chunk larger than that is read alone). Bytes items (non-tensor values, torch.save'd) become tree leaves when they are plain
// values (None, bool, int, float, str, bytes, and lists, tuples and str-keyed dicts of them);
// others are Unimplemented at Open, naming the entry.
//
// Thread-safety: after Open, const methods, ReadMany and Verify may run on several threads.
#ifndef TENSORSTASH_CHECKPOINT_DCP_READER_H_
#define TENSORSTASH_CHECKPOINT_DCP_READER_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tensorstash/checkpoint/orbax_reader.h"
#include "tensorstash/engine/step_source.h"
#include "tensorstash/format/dcp/dcp_metadata.h"
#include "tensorstash/util/thread_pool.h"

namespace tensorstash {

class DcpReader final : public StepSource {
 public:
  // Opens the DCP folder `path` of `kv`. NotFound without `.metadata`; the errors of
  // ParseDcpMetadata; DataLoss naming the file for an item past the end of its file, and the
  // entry for a bytes item that does not decode; Unimplemented as described above.
  static Result<std::unique_ptr<DcpReader>> Open(KvStore* kv, std::string path,
                                                 ReaderOptions options = {});

  StepFormat format() const override { return StepFormat::kDcp; }
  const std::string& dir() const override { return path_; }
  const TreeNode& tree() const override { return tree_; }
  const std::vector<ArrayMetadata>& arrays() const override { return metadata_; }
  uint64_t StoredBytes(size_t id) const override;
  int64_t NumChunks(size_t id) const override {
    return static_cast<int64_t>(meta_.tensors[id].chunks.size());
  }
  std::string CodecDescription(size_t) const override { return "none (DCP torch.save)"; }
  int64_t created_unix_ms() const override { return 0; }
  int process_count() const override { return 0; }
  Status ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats,
                  const std::function<void(uint64_t, uint64_t)>& progress) override;
  // `.metadata` (the pickle) and the .distcp files are not offered: NotFound.
  Result<std::string> ReadFile(std::string_view name) const override;
  // Reads every chunk and checks its archive (CRC-32 of every entry, the tensor's description
  // against the metadata); one BadChunk per chunk that fails.
  Result<std::vector<BadChunk>> Verify(
      const std::function<void(uint64_t, uint64_t)>& progress) override;
  uint64_t VerifyTotalBytes() const override;
  size_t VerifyTotalItems() const override;

 private:
  DcpReader(KvStore* kv, std::string path, ReaderOptions options);
  // Reads chunk `c` of tensor `id` (its whole archive) into `archive`, of the chunk's
  // location.length bytes; returns where the tensor's bytes are in it.
  Result<uint64_t> ReadChunk(size_t id, size_t c, bool check_crc, char* archive);
  // Reads chunk `c` of tensor `id` with its tensor's bytes straight into `dest` (the chunk's
  // bytes, C order): only the archive's first and last bytes (its zip records, data.pkl) go
  // into `archive`. false, having written nothing into `dest`, where the archive is not laid
  // out for it (small, or the tensor is not its storage entry whole): read it whole then.
  Result<bool> ReadChunkInto(size_t id, size_t c, bool check_crc, char* archive, char* dest);
  // Reads `length` bytes at `at` of the item at `loc` into `dest` (DataLoss for an item past
  // the end of its file).
  Status ReadItem(const DcpItemLocation& loc, char* dest) {
    return ReadItemRange(loc, 0, loc.length, dest);
  }
  Status ReadItemRange(const DcpItemLocation& loc, uint64_t at, uint64_t length, char* dest);

  CountingKvStore kv_;
  const std::string path_;
  ReaderOptions options_;
  DcpMetadata meta_;
  std::map<std::string, uint64_t> file_sizes_;
  TreeNode tree_ = TreeNode::Dict();
  std::vector<ArrayMetadata> metadata_;  // one per meta_.tensors entry, same order
  std::map<std::string, size_t, std::less<>> by_path_;
  std::unique_ptr<ThreadPool> pool_;  // one task per chunk read or verified
};

}  // namespace tensorstash

#endif  // TENSORSTASH_CHECKPOINT_DCP_READER_H_
