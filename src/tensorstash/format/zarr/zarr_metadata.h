// Zarr array metadata (v2 `.zarray` and v3 `zarr.json`), parsed into one form.
//
// Both versions become a ZarrMetadata whose codec chain uses the v3 vocabulary, so the chunk
// pipeline (zarr_codec.h) has one code path: a v2 array with order "F" becomes a `transpose`
// with reversed order, its byte order a `bytes` codec, and its compressor a bytes-to-bytes codec.
// docs/foreign_formats.md ("## zarr") lists what is supported and the limits enforced here.
//
// Thread-safety: value types and pure functions.
#ifndef TENSORSTASH_FORMAT_ZARR_ZARR_METADATA_H_
#define TENSORSTASH_FORMAT_ZARR_ZARR_METADATA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/array/dtype.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// The largest decoded chunk (or inner chunk) a reader or writer will hold in memory. Metadata
// that implies more is rejected before anything is allocated.
inline constexpr uint64_t kMaxZarrChunkBytes = uint64_t{4} << 30;
// Metadata documents larger than this are rejected unparsed.
inline constexpr size_t kMaxZarrMetadataBytes = size_t{16} << 20;

enum class ZarrCodecKind {
  kTranspose,  // array -> array
  kBytes,      // array -> bytes
  kSharding,   // array -> bytes (sharding_indexed)
  kZstd,       // bytes -> bytes
  kGzip,
  kBlosc,
  kCrc32c,
};

struct ZarrCodec {
  ZarrCodecKind kind = ZarrCodecKind::kBytes;
  // transpose: dimension k of the encoded array is dimension order[k] of the decoded one.
  std::vector<int> order;
  // bytes: multi-byte elements stored big-endian.
  bool big_endian = false;
  // zstd / gzip / blosc compression level.
  int level = 0;
  bool zstd_checksum = false;
  // gzip: zlib framing (v2 compressor "zlib") instead of gzip framing. Decoding accepts both.
  bool zlib_framing = false;
  // blosc: only used when encoding (the blosc header describes how a buffer was encoded).
  std::string blosc_cname = "lz4";
  int blosc_shuffle = 1;  // 0 none, 1 byte, 2 bit
  int blosc_typesize = 1;
  int blosc_blocksize = 0;
  // sharding_indexed.
  std::vector<int64_t> inner_chunk_shape;
  std::shared_ptr<const std::vector<ZarrCodec>> inner_codecs;
  std::shared_ptr<const std::vector<ZarrCodec>> index_codecs;
  bool index_at_end = true;
};

enum class ZarrKeyEncoding { kDefault, kV2 };

struct ZarrMetadata {
  int zarr_format = 3;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  // The stored grid: the shard shape when the chain is sharded.
  std::vector<int64_t> chunk_shape;
  // ItemSize(dtype) bytes in host order. v2's null fill value reads as zeros.
  std::string fill_value;
  // In encoding order: array->array codecs, one array->bytes codec, bytes->bytes codecs.
  std::vector<ZarrCodec> codecs;
  ZarrKeyEncoding key_encoding = ZarrKeyEncoding::kDefault;
  char separator = '/';

  int rank() const { return static_cast<int>(shape.size()); }
  // The sharding codec when the chain is exactly [sharding_indexed] (what TensorStore and Orbax
  // write); such shards are read piecewise. nullptr otherwise.
  const ZarrCodec* sole_sharding() const;
};

// Parses `zarr.json`. InvalidArgument (malformed JSON, wrong types, bad shapes, not an array),
// or Unimplemented (unknown data type, codec, chunk grid, storage transformer), each message
// prefixed with `what` (the array prefix).
Result<ZarrMetadata> ParseZarrV3Metadata(std::string_view json, std::string_view what);
// Parses `.zarray`, with the same errors (filters and structured dtypes are Unimplemented).
Result<ZarrMetadata> ParseZarrV2Metadata(std::string_view json, std::string_view what);

// Checks shapes, ranks and the codec chain of metadata built in code (the writer's), with the
// same errors as the parsers.
Status ValidateZarrMetadata(const ZarrMetadata& metadata, std::string_view what);

// The document for `metadata`: zarr.json (v3) or .zarray (v2). v2 can express only chains of
// the form [transpose reversed]? bytes [zstd | gzip | blosc]?; others are InvalidArgument.
Result<std::string> EncodeZarrMetadata(const ZarrMetadata& metadata);

// The key of chunk `grid` under the array folder ("c/1/0", "1.0", "0" for rank 0 in v2).
std::string ZarrChunkKey(const ZarrMetadata& metadata, const std::vector<int64_t>& grid);

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_ZARR_ZARR_METADATA_H_
