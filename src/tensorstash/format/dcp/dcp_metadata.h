// The `.metadata` file of a PyTorch Distributed Checkpoint (DCP) written by its FileSystemWriter
// (torch 2.x, DCP version "1.0.0"), decoded without running Python: the pickle is read by
// DecodePickle with DcpPickleGlobals and then mapped onto plain structs.
//
// A DCP checkpoint is a folder: `.metadata` plus `__<rank>_<n>.distcp` files. For each
// state_dict entry (a '.'-joined name, "fqn") the metadata holds either a tensor (dtype, global
// shape, the chunks that tile it, each a box stored as one item) or a bytes item (any other
// value, torch.save'd). Each item is (relative file, offset, length) in the folder; with the
// default torch_save serialization the item is a whole torch.save zip archive (torch_zip.h).
//
// Thread-safety: pure functions and value types.
#ifndef TENSORSTASH_FORMAT_DCP_DCP_METADATA_H_
#define TENSORSTASH_FORMAT_DCP_DCP_METADATA_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/array/dtype.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

inline constexpr std::string_view kDcpMetadataFileName = ".metadata";

// Where an item's bytes are: `length` bytes at `offset` of `relative_path` (a file name in the
// checkpoint folder; never a path that leaves it).
struct DcpItemLocation {
  std::string relative_path;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct DcpChunk {
  std::vector<int64_t> offsets;  // in the global tensor
  std::vector<int64_t> sizes;
  DcpItemLocation location;
};

struct DcpTensor {
  std::string fqn;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<DcpChunk> chunks;  // disjoint, covering the shape exactly
  std::vector<std::string> path;  // planner_data: the keys of the nested state_dict, if given
};

struct DcpBytesItem {
  std::string fqn;
  DcpItemLocation location;
  std::vector<std::string> path;
};

struct DcpMetadata {
  std::string version;             // "1.0.0" for torch 2.4+; empty when absent (older torch)
  std::vector<DcpTensor> tensors;  // in the pickle's order
  std::vector<DcpBytesItem> bytes_items;
};

// The torch dtype named `name` ("float32", "bfloat16", "float8_e4m3fn", ...). Unimplemented for
// dtypes tensorstash lacks (complex32, the qint types, ...), naming `where`.
Result<DType> DTypeFromTorchName(std::string_view name, std::string_view where);

// Decodes and checks the `.metadata` bytes of the checkpoint `what` (for messages).
// InvalidArgument for a pickle that is malformed or names a class outside the allow-list (see
// pickle.h); DataLoss naming the entry (fqn) for a structure that is not DCP's: a wrong type, a
// negative or overflowing size, chunks outside the shape, overlapping or leaving holes, a chunk or
// bytes item with no storage entry, a relative path that is not a plain file name;
// Unimplemented for what DCP can write but this reader does not handle: storage transforms
// (compression extensions), an entry type other than a tensor or bytes, an unsupported dtype.
Result<DcpMetadata> ParseDcpMetadata(std::string_view bytes, std::string_view what);

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_DCP_DCP_METADATA_H_
