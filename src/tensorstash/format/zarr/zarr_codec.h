// The zarr chunk pipeline: a stored chunk's bytes <-> its elements, through a codec chain
// (zarr_metadata.h). Decoded elements are in C order over the chunk shape, host byte order.
//
// Every decode is bounded: a compressed stream may not inflate past what the chain can produce
// for the chunk shape, so hostile bytes cannot force an unbounded allocation. Corrupt or
// inconsistent bytes (bad frames, wrong decoded sizes, crc32c mismatches, shard indexes that
// point outside the shard) are DataLoss prefixed with `what` (array and chunk key).
//
// Thread-safety: pure functions; compression contexts are per call.
#ifndef TENSORSTASH_FORMAT_ZARR_ZARR_CODEC_H_
#define TENSORSTASH_FORMAT_ZARR_ZARR_CODEC_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/format/zarr/zarr_metadata.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// Whether `codec` is the bytes codec in this machine's (little-endian) order for `dtype`: its
// output is the array's native bytes, which can be decoded straight into a destination.
bool IsNativeBytes(const ZarrCodec& codec, DType dtype);

// Decodes one zstd stream (one or more frames) into exactly `size` bytes at `out`. DataLoss
// naming `what` when the data is malformed or decodes to more or fewer bytes.
Status ZstdDecodeInto(std::string_view in, char* out, size_t size, std::string_view what);
// The same for a stream handed over in pieces: next() returns the next piece, valid until the
// following call, and an empty one at the end (or an error, returned as it is). Memory: a
// decoding context (about 100 KiB), whatever the stream's size, so that a reader can decode a
// large chunk from a small buffer refilled piece by piece.
Status ZstdDecodeStreamInto(const std::function<Result<std::string_view>()>& next, char* out,
                            size_t size, std::string_view what);

// Decodes `stored` into `*out` (resized to the chunk's element bytes). `fill_value` (one element)
// fills inner chunks a shard leaves out.
Status DecodeZarrChunk(const std::vector<ZarrCodec>& codecs, DType dtype,
                       const std::vector<int64_t>& shape, std::string_view fill_value,
                       std::string_view stored, std::string* out, std::string_view what);

// Encodes `raw` (the chunk's elements) into `*out`. In a shard, inner chunks whose elements all
// equal `fill_value` are left out (index entry 2^64-1), as TensorStore does.
Status EncodeZarrChunk(const std::vector<ZarrCodec>& codecs, DType dtype,
                       const std::vector<int64_t>& shape, std::string_view fill_value,
                       std::string_view raw, std::string* out, std::string_view what);

// The `length` bytes at `offset` of one stored shard: in `*scratch`, or (no copy) in memory of
// the reader's own that stays valid while the shard is being read.
using ShardByteReader =
    std::function<Result<std::string_view>(uint64_t offset, uint64_t length, std::string* scratch)>;

// Bytes of the encoded index of a shard of `shard_shape` under `sharding`.
uint64_t ShardIndexBytes(const ZarrCodec& sharding, const std::vector<int64_t>& shard_shape);

// Reads the part `region` of one shard of `shard_size` bytes, fetching only its index and the
// inner chunks that meet `region`. `shard_box` places the shard in array coordinates; `region`
// (inside shard_box and dst_box) is written into `dst`, a buffer over `dst_box` of `dst_dtype`
// elements (converted as in CopyBox). Missing inner chunks get `dst_fill` (one dst_dtype
// element).
Status ReadShardRegion(const ZarrCodec& sharding, DType dtype, std::string_view fill_value,
                       uint64_t shard_size, const ShardByteReader& read, const Box& shard_box,
                       const Box& region, DType dst_dtype, void* dst, const Box& dst_box,
                       std::string_view dst_fill, std::string_view what);

// Sets every element of `region` (inside `dst_box`) of a buffer over `dst_box` to `item`.
void FillBox(const Box& region, std::string_view item, void* dst, const Box& dst_box);

// True when every `item.size()`-byte element of `data` equals `item`.
bool AllEqualTo(std::string_view data, std::string_view item);

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_ZARR_ZARR_CODEC_H_
