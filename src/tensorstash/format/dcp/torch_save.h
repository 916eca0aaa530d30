// One tensor saved by torch.save (the archive of a DCP tensor item, torch_zip.h), located
// without Python: data.pkl is decoded (DecodePickle, DcpPickleGlobals) as the call
// torch._utils._rebuild_tensor_v2/v3(storage, storage_offset, size, stride, ...), where
// `storage` is a persistent id ("storage", storage type, key, location, numel) naming the
// archive entry data/<key> that holds the storage's raw little-endian bytes.
//
// Thread-safety: pure functions.
#ifndef TENSORSTASH_FORMAT_DCP_TORCH_SAVE_H_
#define TENSORSTASH_FORMAT_DCP_TORCH_SAVE_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "tensorstash/array/dtype.h"
#include "tensorstash/format/dcp/torch_zip.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct TorchSavedTensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  // The tensor's bytes, C order: `data_length` (= elements * item size) bytes at `data_offset`
  // from the archive's first byte.
  uint64_t data_offset = 0;
  uint64_t data_length = 0;
  // With a hole (ReadTorchSavedTensor): whether the tensor's bytes are its storage entry's,
  // all of them (then `data_crc32`, the entry's CRC-32, is to be checked against them).
  bool whole_entry = false;
  uint32_t data_crc32 = 0;
};

// Locates the tensor in the torch.save archive `archive` (its whole bytes; `what` names it in
// messages). Every entry's CRC-32 is checked when `check_crc`. On failure: the errors of
// ReadStoredZip and DecodePickle; DataLoss for an archive that is not one saved tensor (no
// data.pkl, a storage entry missing or shorter than the tensor needs, a malformed call);
// Unimplemented for a tensor that is not stored contiguously in C order, big-endian bytes, or a
// storage type or dtype tensorstash lacks. With a `hole` (ReadStoredZip's: bytes not read, which
// only the tensor's storage entry may cover; OutOfRange otherwise) the storage entry's CRC is not
// checked: the caller checks `data_crc32` once it has read the bytes.
Result<TorchSavedTensor> ReadTorchSavedTensor(std::string_view archive, std::string_view what,
                                              bool check_crc = true, ZipHole hole = {});

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_DCP_TORCH_SAVE_H_
