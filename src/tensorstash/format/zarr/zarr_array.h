// ZarrArray and ZarrArrayWriter: zarr v2 and v3 arrays over a KvStore, as Orbax/TensorStore
// store parameters (one array folder per parameter, in plain folders or inside OCDBT).
//
// An array lives under a key prefix: `prefix/zarr.json` (v3) or `prefix/.zarray` (v2; `.zattrs`
// is ignored) and its chunks at `prefix/<chunk key>`. What is supported, and the limits, are in
// docs/foreign_formats.md ("## zarr"); metadata parsing is zarr_metadata.h, the codec pipeline
// zarr_codec.h. Every error names the array prefix and, for chunk data, the chunk key.
//
// Thread-safety: after Open / Create, Read and the writer's Write* calls may run on several
// threads at once (concurrent writes must touch different chunks).
#ifndef TENSORSTASH_FORMAT_ZARR_ZARR_ARRAY_H_
#define TENSORSTASH_FORMAT_ZARR_ZARR_ARRAY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/array/dtype.h"
#include "tensorstash/format/zarr/zarr_metadata.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/staging_pool.h"
#include "tensorstash/util/status.h"
#include "tensorstash/util/thread_pool.h"

namespace tensorstash {

// Compressed chunks read in place (ReadsInPlace) larger than this are read and decoded piece by
// piece, in pieces of this size.
inline constexpr uint64_t kInPlaceStreamPieceBytes = uint64_t{4} << 20;

class ZarrArray {
 public:
  // Reads `prefix/zarr.json`, else `prefix/.zarray` ("" = the store's root). NotFound naming the
  // prefix when neither exists; InvalidArgument for malformed or absurd metadata (bad JSON,
  // negative or overflowing shapes, rank > 32, chunks over kMaxZarrChunkBytes); Unimplemented
  // for data types, codecs, filters or grids this reader lacks. `kv` must outlive the array.
  static Result<std::unique_ptr<ZarrArray>> Open(KvStore* kv, std::string prefix);

  const std::string& prefix() const { return prefix_; }
  int zarr_format() const { return metadata_.zarr_format; }
  DType dtype() const { return metadata_.dtype; }
  const std::vector<int64_t>& shape() const { return metadata_.shape; }
  // The stored grid: for sharded v3 arrays, the shard shape.
  const std::vector<int64_t>& chunk_shape() const { return metadata_.chunk_shape; }
  // For sharded v3 arrays the inner chunk shape, else chunk_shape().
  const std::vector<int64_t>& inner_chunk_shape() const;
  bool sharded() const { return metadata_.sole_sharding() != nullptr; }
  // One element of dtype(), host byte order (zeros for v2's null).
  const std::string& fill_value() const { return metadata_.fill_value; }
  const ZarrMetadata& metadata() const { return metadata_; }
  // Whether every chunk (or shard) of the grid was written, so that a missing one is DataLoss
  // naming its key rather than fill_value(): set when the checkpoint's metadata says so (Orbax's
  // store_array_data_equal_to_fill_value). False by default (zarr's rule). A directory at a
  // chunk's key is DataLoss either way. Set before the first Read.
  void set_all_chunks_stored(bool all_chunks_stored) { all_chunks_stored_ = all_chunks_stored; }

  // Fills `dest` (box.num_elements() elements of `dest_dtype`, C order over `box`) with the
  // array's values over `box`: fill_value() where a chunk (or a shard's inner chunk) is
  // missing, zeros where the box reaches past the shape, converted as in convert.h when
  // dest_dtype differs. InvalidArgument for a rank mismatch, a negative origin or an
  // unsupported cast; DataLoss naming the chunk key for corrupt or inconsistent chunk data;
  // the KvStore's error otherwise. On error `dest` holds unspecified data. With `pool`, chunks
  // (or shards) are read in parallel on it; Read must then not run on one of its threads.
  // With `staging`, whole chunks that land as one run of `dest` (uncompressed or zstd, no
  // transpose or byte swap, no cast) are read into its reused buffers and decoded straight
  // into place, instead of through fresh chunk-sized buffers.
  Status Read(const Box& box, DType dest_dtype, void* dest, ThreadPool* pool = nullptr,
              StagingPool* staging = nullptr) const;

  // What Read does for one chunk, for callers that plan the chunks themselves: fills the part
  // `region` of chunk (shard) `grid` into `dest`, laid out in C order over `box`. `region` must
  // lie inside that chunk, the array's shape and `box`. Same errors as Read.
  Status ReadChunkRegion(const std::vector<int64_t>& grid, const Box& region, const Box& box,
                         DType dest_dtype, void* dest, StagingPool* staging = nullptr) const;

  // Whether ReadChunkRegion with a staging pool reads chunk `grid` straight into `dest`: then
  // it holds at most one staging lease of kInPlaceStreamPieceBytes and allocates nothing else,
  // whatever the chunk's size (uncompressed or zstd, no sharding, transpose, byte swap or cast,
  // the whole chunk as one run of `box`). Otherwise it may allocate the chunk's stored and
  // decoded bytes.
  bool ReadsInPlace(const std::vector<int64_t>& grid, const Box& region, const Box& box,
                    DType dest_dtype) const;

  // The key of the chunk (shard) at grid position `grid`, with the prefix.
  std::string ChunkKey(const std::vector<int64_t>& grid) const;
  // Whether the chunk (shard) at `grid` is stored: true, false when it is absent (reads give the
  // fill value, or DataLoss with set_all_chunks_stored), DataLoss when a directory is there;
  // the store's error otherwise.
  Result<bool> ChunkStored(const std::vector<int64_t>& grid) const;

 private:
  ZarrArray(KvStore* kv, std::string prefix, ZarrMetadata metadata);
  // Reads the part `region` (inside the array's shape and `box`) of chunk `grid` into `dest`.
  Status ReadChunk(const std::vector<int64_t>& grid, const Box& region, const Box& box,
                   DType dest_dtype, void* dest, const std::string& dest_fill,
                   StagingPool* staging) const;
  // Read and ReadChunkRegion's common checks: InvalidArgument naming `what` for a dtype the
  // stored one cannot be converted to; the fill value in `dest_dtype` (InvalidArgument for a
  // null `dest`).
  Status CannotConvert(DType dest_dtype, const std::string& what) const;
  Result<std::string> DestFill(DType dest_dtype, const void* dest, const std::string& what) const;
  // DataLoss when a chunk (shard) of `chunk_box` stores more bytes than any encoding could make.
  Status CheckStoredSize(uint64_t size, const Box& chunk_box, const std::string& what) const;
  // What a missing chunk (NotFound `status`) means: fill `region`, or DataLoss (see
  // set_all_chunks_stored).
  Status MissingChunk(const Status& status, const std::string& what, const Box& region,
                      const std::string& dest_fill, void* dest, const Box& box) const;
  // ReadChunk's fast path (see Read): OK with *done false when it does not apply.
  Status ReadChunkInPlace(const std::string& key, const Box& chunk_box, const Box& region,
                          const Box& box, DType dest_dtype, void* dest,
                          const std::string& dest_fill, StagingPool* staging, bool* done) const;

  // ReadsInPlace for the chunk at `chunk_box`.
  bool LandsInPlace(const Box& chunk_box, const Box& region, const Box& box,
                    DType dest_dtype) const;

  KvStore* kv_;
  std::string prefix_;
  ZarrMetadata metadata_;
  bool all_chunks_stored_ = false;
};

enum class ZarrCompressor { kNone, kZstd, kGzip, kBlosc };

struct ZarrArraySpec {
  int zarr_format = 3;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  // The stored grid: shards for sharded v3, chunks otherwise. Empty = the whole shape (at least
  // 1 per dimension).
  std::vector<int64_t> chunk_shape;
  // v3: wrap the chunk codecs in sharding_indexed (index bytes+crc32c at the end), as Orbax
  // does. Ignored for v2.
  bool sharded = true;
  // Inner chunks of a shard; must divide chunk_shape. Empty = chunk_shape (Orbax's default).
  std::vector<int64_t> inner_chunk_shape;
  ZarrCompressor compressor = ZarrCompressor::kZstd;
  int level = 3;  // zstd (Orbax uses 3), gzip 0-9, blosc clevel 0-9 (lz4 with byte shuffle)
  // v2 dimension_separator; v3 uses the default key encoding ("c/0/0").
  char dimension_separator = '.';
};

// Writes one zarr array the way Orbax 0.12 / TensorStore do by default, so that TensorStore's
// zarr3 (or zarr) driver reads it back: fill value 0, C order, little-endian; chunks (or inner
// chunks) whose elements all equal the fill value are left out.
class ZarrArrayWriter {
 public:
  // Checks `spec` (InvalidArgument naming `prefix` for bad shapes, ranks or chunk sizes) and
  // writes the metadata document (zarr.json or .zarray) under `prefix`. `kv` must outlive the
  // writer.
  static Result<std::unique_ptr<ZarrArrayWriter>> Create(KvStore* kv, std::string prefix,
                                                         const ZarrArraySpec& spec);

  const ZarrMetadata& metadata() const { return metadata_; }

  // Writes chunk (shard) `grid` from `data`: its elements in C order over the chunk's box
  // clipped to the array's shape. InvalidArgument for a grid position outside the array; the
  // KvStore's error otherwise.
  Status WriteChunk(const std::vector<int64_t>& grid, const void* data) const;

  // Writes every chunk (shard) of `box` from `data` (C order over `box`). The box must cover
  // whole chunks: its origin on the chunk grid and its end on the grid or at the shape's end
  // (InvalidArgument otherwise). With `pool`, chunks are encoded and written in parallel.
  Status WriteBox(const Box& box, const void* data, ThreadPool* pool = nullptr) const;

 private:
  ZarrArrayWriter(KvStore* kv, std::string prefix, ZarrMetadata metadata);
  // Writes chunk `grid`, whose elements come from `data` over `data_box`.
  Status WriteChunkFrom(const std::vector<int64_t>& grid, const void* data,
                        const Box& data_box) const;

  // ReadsInPlace for the chunk at `chunk_box`.
  bool LandsInPlace(const Box& chunk_box, const Box& region, const Box& box,
                    DType dest_dtype) const;

  KvStore* kv_;
  std::string prefix_;
  ZarrMetadata metadata_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_ZARR_ZARR_ARRAY_H_
