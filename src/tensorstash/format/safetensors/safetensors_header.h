// The safetensors file format (Hugging Face): an 8-byte little-endian header length N, N bytes
// of JSON, then the tensors' bytes. The JSON maps each tensor name to
// {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]} (offsets relative to the byte
// after the header), plus an optional "__metadata__" map of strings. docs/foreign_formats.md
// ("## Safetensors") gives the rules checked here and the dtype names.
//
// A header is checked as the safetensors library checks it, with checked arithmetic: N at most
// kSafetensorsMaxHeaderBytes and inside the file, valid JSON without repeated keys, known dtypes,
// sizes = prod(shape) * itemsize, and the tensors' ranges tiling the data section exactly (no
// overlap, no hole, nothing past the end, nothing after the last tensor).
//
// Thread-safety: pure functions and value types.
#ifndef TENSORSTASH_FORMAT_SAFETENSORS_SAFETENSORS_HEADER_H_
#define TENSORSTASH_FORMAT_SAFETENSORS_SAFETENSORS_HEADER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorstash/array/dtype.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// The safetensors library refuses longer headers; so does this reader (a hostile length must not
// make it allocate gigabytes).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;
inline constexpr std::string_view kSafetensorsIndexFileName = "model.safetensors.index.json";
inline constexpr std::string_view kSafetensorsSingleFileName = "model.safetensors";

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // absolute byte offsets in the file (header included)
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t data_start = 0;                  // 8 + N
  std::vector<SafetensorsTensor> tensors;  // in file order (by begin)
  std::vector<std::pair<std::string, std::string>> metadata;  // "__metadata__", in order
};

// The dtype of a safetensors dtype name ("F32", "BF16", "F8_E4M3", ...). DataLoss naming `where`
// for a name safetensors does not define; Unimplemented for the packed sub-byte types (F4,
// F6_E2M3, F6_E3M2), which tensorstash holds one element per byte.
Result<DType> SafetensorsDTypeFromName(std::string_view name, std::string_view where);
// The safetensors name of `dtype`; InvalidArgument naming `what` for dtypes safetensors lacks
// (complex128, the int2/int4 and the fnuz float8 types, ...).
Result<std::string_view> SafetensorsDTypeName(DType dtype, std::string_view what);

// The header length from the file's first 8 bytes (`prefix`, exactly 8 bytes) of a file of
// `file_size` bytes. DataLoss naming `file` when the file is shorter than 8 bytes, or the length
// is over the limit or past the end of the file.
Result<uint64_t> ParseSafetensorsHeaderLength(std::string_view prefix, uint64_t file_size,
                                              std::string_view file);

// Parses and checks the JSON header (`json`: the N bytes after the prefix) of a file of
// `file_size` bytes. DataLoss naming `file` (and the tensor) for anything malformed;
// Unimplemented for the unsupported dtypes above.
Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t file_size,
                                                 std::string_view file);

// The first bytes of a safetensors file holding `tensors` (their begin/end are ignored: the
// tensors are laid out in the given order from the start of the data section) with `metadata`:
// the 8-byte length, then the JSON padded with spaces to a multiple of 8 bytes, as the library
// writes it. The tensors' offsets are set into `tensors` (absolute). InvalidArgument for a
// name or metadata string that is not UTF-8, or sizes that overflow.
Result<std::string> EncodeSafetensorsHeader(
    std::vector<SafetensorsTensor>& tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata);

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_SAFETENSORS_SAFETENSORS_HEADER_H_
