#include "tensorstash/format/zarr/zarr_array.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include <zstd.h>

#include "tensorstash/array/convert.h"
#include "tensorstash/format/zarr/zarr_codec.h"
#include "tensorstash/util/prefault.h"

namespace tensorstash {
namespace {

// The box of the chunk (shard) at grid position `grid` of a grid of `chunk_shape` chunks.
Box ChunkBoxAt(const std::vector<int64_t>& grid, const std::vector<int64_t>& chunk_shape) {
  Box chunk_box(std::vector<int64_t>(grid.size()), chunk_shape);
  for (size_t d = 0; d < grid.size(); ++d) chunk_box.origin[d] = grid[d] * chunk_shape[d];
  return chunk_box;
}

std::string JoinKey(const std::string& prefix, std::string_view name) {
  return prefix.empty() ? std::string(name) : StrCat(prefix, "/", name);
}

std::string ArrayWhat(const std::string& prefix) { return StrCat("zarr array '", prefix, "'"); }

// Calls fn(grid, chunk_box) for every chunk of `chunk_shape` meeting the non-empty `region`;
// chunk_box is the whole chunk, not clipped. Stops at the first error.
Status ForEachChunk(const std::vector<int64_t>& chunk_shape, const Box& region,
                    const std::function<Status(const std::vector<int64_t>&, const Box&)>& fn) {
  const int rank = region.rank();
  std::vector<int64_t> lo(rank), hi(rank);
  for (int d = 0; d < rank; ++d) {
    lo[d] = region.origin[d] / chunk_shape[d];
    hi[d] = (region.origin[d] + region.shape[d] - 1) / chunk_shape[d];
  }
  std::vector<int64_t> grid = lo;
  for (;;) {
    TS_RETURN_IF_ERROR(fn(grid, ChunkBoxAt(grid, chunk_shape)));
    int d = rank - 1;
    while (d >= 0) {
      if (++grid[d] <= hi[d]) break;
      grid[d] = lo[d];
      --d;
    }
    if (d < 0) return OkStatus();
  }
}

// Runs fn for every chunk meeting `region`, on `pool` when given (first error wins).
Status ForEachChunkMaybeParallel(
    const std::vector<int64_t>& chunk_shape, const Box& region, ThreadPool* pool,
    const std::function<Status(const std::vector<int64_t>&, const Box&)>& fn) {
  if (pool == nullptr) return ForEachChunk(chunk_shape, region, fn);
  // At most a few tasks per thread queued at once: a grid of millions of tiny chunks must not
  // hold a task for each of them in memory.
  constexpr int kMaxQueuedChunks = 256;
  TaskGroup group(pool, kMaxQueuedChunks);
  Status status = ForEachChunk(chunk_shape, region,
                               [&](const std::vector<int64_t>& grid, const Box& chunk_box) {
                                 if (group.failed()) return OkStatus();  // Wait() reports the error
                                 group.Run([&fn, grid, chunk_box] { return fn(grid, chunk_box); });
                                 return OkStatus();
                               });
  Status waited = group.Wait();
  return status.ok() ? waited : status;
}

}  // namespace

// ---- ZarrArray ----

namespace {

// A shard read whole, when no staging pool gives the byte cap, is at most this large; larger
// ones are read by ranges (their index, then the inner chunks wanted).
constexpr uint64_t kWholeShardReadBytes = uint64_t{64} << 20;

// A metadata document, its size checked against kMaxZarrMetadataBytes before it is read (a
// hostile 1 GiB zarr.json must not cost 1 GiB of memory).
Result<std::string> ReadMetadataFile(KvStore* kv, const std::string& key, const std::string& what) {
  TS_ASSIGN_OR_RETURN(uint64_t size, kv->Size(key));
  if (size > kMaxZarrMetadataBytes) {
    return InvalidArgumentError(StrCat(what, ": '", key, "' is ", size, " bytes, over the ",
                                       kMaxZarrMetadataBytes, "-byte limit"));
  }
  return kv->Read(key);
}

}  // namespace

ZarrArray::ZarrArray(KvStore* kv, std::string prefix, ZarrMetadata metadata)
    : kv_(kv), prefix_(std::move(prefix)), metadata_(std::move(metadata)) {}

Result<std::unique_ptr<ZarrArray>> ZarrArray::Open(KvStore* kv, std::string prefix) {
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  const std::string what = ArrayWhat(prefix);
  TS_RETURN_IF_ERROR(Annotate(ValidatePrefix(prefix), what));
  Result<std::string> v3 = ReadMetadataFile(kv, JoinKey(prefix, "zarr.json"), what);
  if (v3.ok()) {
    TS_ASSIGN_OR_RETURN(ZarrMetadata m, ParseZarrV3Metadata(*v3, what));
    return std::unique_ptr<ZarrArray>(new ZarrArray(kv, std::move(prefix), std::move(m)));
  }
  if (!absl::IsNotFound(v3.status())) return Annotate(v3.status(), what);
  Result<std::string> v2 = ReadMetadataFile(kv, JoinKey(prefix, ".zarray"), what);
  if (v2.ok()) {
    TS_ASSIGN_OR_RETURN(ZarrMetadata m, ParseZarrV2Metadata(*v2, what));
    return std::unique_ptr<ZarrArray>(new ZarrArray(kv, std::move(prefix), std::move(m)));
  }
  if (!absl::IsNotFound(v2.status())) return Annotate(v2.status(), what);
  return NotFoundError(StrCat(what, ": neither zarr.json nor .zarray exists in ", kv->Describe()));
}

const std::vector<int64_t>& ZarrArray::inner_chunk_shape() const {
  const ZarrCodec* sharding = metadata_.sole_sharding();
  return sharding ? sharding->inner_chunk_shape : metadata_.chunk_shape;
}

std::string ZarrArray::ChunkKey(const std::vector<int64_t>& grid) const {
  return JoinKey(prefix_, ZarrChunkKey(metadata_, grid));
}

Status ZarrArray::Read(const Box& box, DType dest_dtype, void* dest, ThreadPool* pool,
                       StagingPool* staging) const {
  const std::string what = StrCat("read of ", ArrayWhat(prefix_));
  if (box.rank() != metadata_.rank()) {
    return InvalidArgumentError(StrCat(what, ": box ", box.ToString(), " has rank ", box.rank(),
                                       " but the array has rank ", metadata_.rank()));
  }
  TS_RETURN_IF_ERROR(ValidateBox(box, ItemSize(dest_dtype), what));
  if (!CanConvert(metadata_.dtype, dest_dtype)) return CannotConvert(dest_dtype, what);
  if (box.empty()) return OkStatus();
  TS_ASSIGN_OR_RETURN(const std::string dest_fill, DestFill(dest_dtype, dest, what));
  const Box shape_box = Box::FromShape(metadata_.shape);
  if (!shape_box.Contains(box)) {
    // Zeros where the box reaches past the shape, as CheckpointReader does.
    std::memset(dest, 0, static_cast<size_t>(box.num_elements()) * ItemSize(dest_dtype));
  }
  const Box inside = Intersect(box, shape_box);
  if (inside.empty()) return OkStatus();
  return ForEachChunkMaybeParallel(metadata_.chunk_shape, inside, pool,
                                   [&](const std::vector<int64_t>& grid, const Box& chunk_box) {
                                     return ReadChunk(grid, Intersect(chunk_box, inside), box,
                                                      dest_dtype, dest, dest_fill, staging);
                                   });
}

Status ZarrArray::ReadChunkRegion(const std::vector<int64_t>& grid, const Box& region,
                                  const Box& box, DType dest_dtype, void* dest,
                                  StagingPool* staging) const {
  const std::string what = StrCat("read of ", ArrayWhat(prefix_));
  if (static_cast<int>(grid.size()) != metadata_.rank() || region.rank() != metadata_.rank() ||
      box.rank() != metadata_.rank()) {
    return InvalidArgumentError(StrCat(what, ": chunk ", StrJoin(grid, ", "), ", region ",
                                       region.ToString(), " or box ", box.ToString(),
                                       " does not have the array's rank ", metadata_.rank()));
  }
  if (region.empty()) return OkStatus();
  const Box chunk_box = ChunkBoxAt(grid, metadata_.chunk_shape);
  if (!Intersect(chunk_box, Box::FromShape(metadata_.shape)).Contains(region) ||
      !box.Contains(region)) {
    return InvalidArgumentError(StrCat(what, ": region ", region.ToString(),
                                       " is not inside chunk ", chunk_box.ToString(),
                                       ", the shape and the box ", box.ToString()));
  }
  if (!CanConvert(metadata_.dtype, dest_dtype)) return CannotConvert(dest_dtype, what);
  TS_ASSIGN_OR_RETURN(const std::string dest_fill, DestFill(dest_dtype, dest, what));
  return ReadChunk(grid, region, box, dest_dtype, dest, dest_fill, staging);
}

Status ZarrArray::CannotConvert(DType dest_dtype, const std::string& what) const {
  return InvalidArgumentError(StrCat(what, ": cannot convert stored ", DTypeName(metadata_.dtype),
                                     " to ", DTypeName(dest_dtype)));
}

Result<std::string> ZarrArray::DestFill(DType dest_dtype, const void* dest,
                                        const std::string& what) const {
  if (dest == nullptr) return InvalidArgumentError(StrCat(what, ": no destination"));
  std::string dest_fill(ItemSize(dest_dtype), '\0');
  TS_RETURN_IF_ERROR(ConvertElements(metadata_.dtype, metadata_.fill_value.data(), dest_dtype,
                                     dest_fill.data(), 1, StrCat(what, ": fill_value")));
  return dest_fill;
}

Status ZarrArray::ReadChunkInPlace(const std::string& key, const Box& chunk_box, const Box& region,
                                   const Box& box, DType dest_dtype, void* dest,
                                   const std::string& dest_fill, StagingPool* staging,
                                   bool* done) const {
  *done = false;
  if (staging == nullptr || !LandsInPlace(chunk_box, region, box, dest_dtype)) return OkStatus();
  *done = true;
  const std::vector<ZarrCodec>& codecs = metadata_.codecs;
  const size_t item = ItemSize(metadata_.dtype);
  const std::string what = StrCat(ArrayWhat(prefix_), ", chunk '", key, "'");
  const uint64_t bytes = static_cast<uint64_t>(chunk_box.num_elements()) * item;
  char* out = static_cast<char*>(dest) + ByteOffsetIn(chunk_box, box, item);
  Result<std::unique_ptr<ReadableFile>> file = kv_->OpenForRead(key);
  if (absl::IsNotFound(file.status())) {
    return MissingChunk(file.status(), what, region, dest_fill, dest, box);
  }
  if (!file.ok()) return Annotate(file.status(), what);
  const uint64_t size = (*file)->size();
  // The destination's pages made present in one call rather than one fault per page as the
  // read or the decoder writes them (profile of a restore of an Orbax checkpoint of 128 MiB
  // chunks: a sixth of the samples in page faults under the decoder's copy).
  PrefaultForWrite(out, bytes);
  if (codecs.size() == 1) {  // uncompressed: read into place
    if (size != bytes) {
      return DataLossError(StrCat(what, ": chunk holds ", size, " bytes, expected ", bytes));
    }
    return Annotate((*file)->ReadAt(0, size, out), what);
  }
  if (size <= kInPlaceStreamPieceBytes && size <= ZSTD_compressBound(bytes) + 4096) {
    StagingPool::Lease stored = staging->Acquire(size);
    TS_RETURN_IF_ERROR(Annotate((*file)->ReadAt(0, size, stored.data()), what));
    return ZstdDecodeInto(std::string_view(stored.data(), size), out, bytes, what);
  }
  // Refused before it is read: more stored bytes than any encoding of the chunk takes.
  TS_RETURN_IF_ERROR(CheckStoredSize(size, chunk_box, what));
  // A large chunk (or more stored bytes than zstd makes of it: skippable frames, say) is read
  // piece by piece into one small buffer and decoded straight into place: memory stays one
  // piece whatever the chunk's size, so that a restore decodes many large chunks at once under
  // its byte cap, instead of one or two at a time (profile of 8 chunks of 128 MiB on 16 cores:
  // one chunk after another, 1.4 s where Orbax took 0.8 s).
  StagingPool::Lease piece = staging->Acquire(kInPlaceStreamPieceBytes);
  uint64_t offset = 0;
  return ZstdDecodeStreamInto(
      [&]() -> Result<std::string_view> {
        const uint64_t n = std::min<uint64_t>(kInPlaceStreamPieceBytes, size - offset);
        if (n == 0) return std::string_view();
        TS_RETURN_IF_ERROR(Annotate((*file)->ReadAt(offset, n, piece.data()), what));
        offset += n;
        return std::string_view(piece.data(), n);
      },
      out, bytes, what);
}

bool ZarrArray::LandsInPlace(const Box& chunk_box, const Box& region, const Box& box,
                             DType dest_dtype) const {
  const std::vector<ZarrCodec>& codecs = metadata_.codecs;
  const bool plain_bytes = !codecs.empty() && IsNativeBytes(codecs[0], metadata_.dtype);
  const bool zstd = codecs.size() == 2 && codecs[1].kind == ZarrCodecKind::kZstd;
  return metadata_.sole_sharding() == nullptr && plain_bytes && (codecs.size() == 1 || zstd) &&
         dest_dtype == metadata_.dtype && region == chunk_box && IsContiguousIn(chunk_box, box);
}

bool ZarrArray::ReadsInPlace(const std::vector<int64_t>& grid, const Box& region, const Box& box,
                             DType dest_dtype) const {
  if (static_cast<int>(grid.size()) != metadata_.rank()) return false;
  return LandsInPlace(ChunkBoxAt(grid, metadata_.chunk_shape), region, box, dest_dtype);
}

Result<bool> ZarrArray::ChunkStored(const std::vector<int64_t>& grid) const {
  const std::string key = ChunkKey(grid);
  Result<uint64_t> size = kv_->Size(key);
  if (size.ok()) return true;
  if (IsNotAnObject(size.status())) {
    return DataLossError(StrCat(ArrayWhat(prefix_), ", chunk '", key, "': not a regular file (",
                                size.status().message(), ")"));
  }
  if (absl::IsNotFound(size.status())) return false;
  return Annotate(size.status(), StrCat(ArrayWhat(prefix_), ", chunk '", key, "'"));
}

Status ZarrArray::CheckStoredSize(uint64_t size, const Box& chunk_box,
                                  const std::string& what) const {
  // No codec zarr uses makes data much larger than it was: compressors add a few bytes per block
  // (zstd about 1/256, blosc 16 bytes, gzip 5 per 64 KiB), a shard's index 16 bytes per inner
  // chunk (at most one per element).
  const uint64_t elements = static_cast<uint64_t>(chunk_box.num_elements());
  const uint64_t raw = elements * ItemSize(metadata_.dtype);
  const uint64_t bound = 2 * raw + 16 * elements + (64 << 10);
  if (size <= bound) return OkStatus();
  return DataLossError(StrCat(what, ": holds ", size, " bytes, more than any encoding of its ", raw,
                              " bytes could take"));
}

Status ZarrArray::MissingChunk(const Status& status, const std::string& what, const Box& region,
                               const std::string& dest_fill, void* dest, const Box& box) const {
  // A directory where a chunk should be is never a chunk left out.
  if (IsNotAnObject(status)) {
    return DataLossError(StrCat(what, ": not a regular file (", status.message(), ")"));
  }
  if (all_chunks_stored_) {
    return DataLossError(StrCat(what,
                                ": missing, though the checkpoint's metadata says every "
                                "chunk was written (store_array_data_equal_to_fill_value)"));
  }
  FillBox(region, dest_fill, dest, box);  // zarr: a chunk left out holds the fill value
  return OkStatus();
}

Status ZarrArray::ReadChunk(const std::vector<int64_t>& grid, const Box& region, const Box& box,
                            DType dest_dtype, void* dest, const std::string& dest_fill,
                            StagingPool* staging) const {
  const std::string key = ChunkKey(grid);
  const std::string what = StrCat(ArrayWhat(prefix_), ", chunk '", key, "'");
  const Box chunk_box = ChunkBoxAt(grid, metadata_.chunk_shape);
  if (metadata_.sole_sharding() == nullptr) {
    bool done = false;
    TS_RETURN_IF_ERROR(
        ReadChunkInPlace(key, chunk_box, region, box, dest_dtype, dest, dest_fill, staging, &done));
    if (done) return OkStatus();
  }

  if (const ZarrCodec* sharding = metadata_.sole_sharding()) {
    // Read the whole shard in one request when all of it is wanted; else its index and the
    // inner chunks that meet the region, each by a ranged read.
    // The stored size is known before anything is read: a shard larger than any encoding of its
    // elements is damage, and one larger than the byte cap is read by ranges, never whole.
    Result<uint64_t> r = kv_->Size(key);
    if (absl::IsNotFound(r.status())) {
      return MissingChunk(r.status(), what, region, dest_fill, dest, box);
    }
    if (!r.ok()) return Annotate(r.status(), what);
    const uint64_t size = *r;
    TS_RETURN_IF_ERROR(CheckStoredSize(size, chunk_box, what));
    const uint64_t whole_limit = staging != nullptr ? staging->cap() : kWholeShardReadBytes;
    const bool whole =
        region == Intersect(chunk_box, Box::FromShape(metadata_.shape)) && size <= whole_limit;
    StagingPool::Lease leased;  // the whole shard, under the byte cap when there is one
    std::string own;            // the whole shard otherwise
    ShardByteReader reader;
    if (whole) {
      char* bytes = nullptr;
      if (staging != nullptr) {
        leased = staging->Acquire(size);
        bytes = leased.data();
      } else {
        own.resize(size);
        bytes = own.data();
      }
      TS_RETURN_IF_ERROR(Annotate(kv_->ReadRange(key, 0, size, bytes), what));
      // The index entries were checked against the size before `reader` is called.
      reader = [bytes](uint64_t offset, uint64_t length, std::string*) -> Result<std::string_view> {
        return std::string_view(bytes + offset, length);
      };
    } else {
      reader = [&](uint64_t offset, uint64_t length,
                   std::string* scratch) -> Result<std::string_view> {
        scratch->resize(length);
        TS_RETURN_IF_ERROR(Annotate(kv_->ReadRange(key, offset, length, scratch->data()), what));
        return std::string_view(*scratch);
      };
    }
    return ReadShardRegion(*sharding, metadata_.dtype, metadata_.fill_value, size, reader,
                           chunk_box, region, dest_dtype, dest, box, dest_fill, what);
  }

  // Sized before it is read: a chunk file larger than any encoding of its elements is damage.
  Result<uint64_t> stored_size = kv_->Size(key);
  if (absl::IsNotFound(stored_size.status())) {
    return MissingChunk(stored_size.status(), what, region, dest_fill, dest, box);
  }
  if (!stored_size.ok()) return Annotate(stored_size.status(), what);
  TS_RETURN_IF_ERROR(CheckStoredSize(*stored_size, chunk_box, what));
  Result<std::string> stored = kv_->Read(key);
  if (absl::IsNotFound(stored.status())) {
    return MissingChunk(stored.status(), what, region, dest_fill, dest, box);
  }
  if (!stored.ok()) return Annotate(stored.status(), what);
  std::string decoded;
  TS_RETURN_IF_ERROR(DecodeZarrChunk(metadata_.codecs, metadata_.dtype, metadata_.chunk_shape,
                                     metadata_.fill_value, *stored, &decoded, what));
  return CopyBox(region, metadata_.dtype, decoded.data(), chunk_box, dest_dtype, dest, box, what);
}

// ---- ZarrArrayWriter ----

ZarrArrayWriter::ZarrArrayWriter(KvStore* kv, std::string prefix, ZarrMetadata metadata)
    : kv_(kv), prefix_(std::move(prefix)), metadata_(std::move(metadata)) {}

Result<std::unique_ptr<ZarrArrayWriter>> ZarrArrayWriter::Create(KvStore* kv, std::string prefix,
                                                                 const ZarrArraySpec& spec) {
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  const std::string what = StrCat("creating ", ArrayWhat(prefix));
  TS_RETURN_IF_ERROR(Annotate(ValidatePrefix(prefix), what));
  if (spec.zarr_format != 2 && spec.zarr_format != 3) {
    return InvalidArgumentError(
        StrCat(what, ": zarr_format ", spec.zarr_format, " (2 or 3 are supported)"));
  }
  if (spec.shape.size() > static_cast<size_t>(kMaxRank)) {
    return InvalidArgumentError(StrCat(what, ": rank ", spec.shape.size(), " is above ", kMaxRank));
  }
  ZarrMetadata m;
  m.zarr_format = spec.zarr_format;
  m.dtype = spec.dtype;
  m.shape = spec.shape;
  m.chunk_shape = spec.chunk_shape;
  if (m.chunk_shape.empty()) {
    for (int64_t e : m.shape) m.chunk_shape.push_back(std::max<int64_t>(e, 1));
  }
  m.fill_value.assign(ItemSize(spec.dtype), '\0');

  std::vector<ZarrCodec> chain(1);  // bytes, little-endian
  if (spec.compressor != ZarrCompressor::kNone) {
    ZarrCodec c;
    c.level = spec.level;
    switch (spec.compressor) {
      case ZarrCompressor::kZstd:
        c.kind = ZarrCodecKind::kZstd;
        break;
      case ZarrCompressor::kGzip:
        c.kind = ZarrCodecKind::kGzip;
        break;
      default:
        c.kind = ZarrCodecKind::kBlosc;
        c.blosc_typesize = static_cast<int>(ItemSize(spec.dtype));
        break;
    }
    chain.push_back(std::move(c));
  }
  if (spec.zarr_format == 3 && spec.sharded) {
    ZarrCodec sharding;
    sharding.kind = ZarrCodecKind::kSharding;
    sharding.inner_chunk_shape =
        spec.inner_chunk_shape.empty() ? m.chunk_shape : spec.inner_chunk_shape;
    sharding.inner_codecs = std::make_shared<const std::vector<ZarrCodec>>(std::move(chain));
    std::vector<ZarrCodec> index(2);
    index[1].kind = ZarrCodecKind::kCrc32c;
    sharding.index_codecs = std::make_shared<const std::vector<ZarrCodec>>(std::move(index));
    m.codecs = {std::move(sharding)};
  } else {
    m.codecs = std::move(chain);
  }
  if (spec.zarr_format == 2) {
    m.key_encoding = ZarrKeyEncoding::kV2;
    m.separator = spec.dimension_separator;
  }
  TS_RETURN_IF_ERROR(ValidateZarrMetadata(m, what));
  TS_ASSIGN_OR_RETURN(std::string document, EncodeZarrMetadata(m));
  TS_RETURN_IF_ERROR(Annotate(
      kv->Write(JoinKey(prefix, spec.zarr_format == 3 ? "zarr.json" : ".zarray"), document), what));
  return std::unique_ptr<ZarrArrayWriter>(new ZarrArrayWriter(kv, std::move(prefix), std::move(m)));
}

Status ZarrArrayWriter::WriteChunk(const std::vector<int64_t>& grid, const void* data) const {
  const std::string what = StrCat("write of ", ArrayWhat(prefix_));
  if (static_cast<int>(grid.size()) != metadata_.rank()) {
    return InvalidArgumentError(StrCat(what, ": chunk position of rank ", grid.size(),
                                       " for an array of rank ", metadata_.rank()));
  }
  Box chunk_box(std::vector<int64_t>(grid.size()), metadata_.chunk_shape);
  for (size_t d = 0; d < grid.size(); ++d) {
    const int64_t c = metadata_.chunk_shape[d];
    if (grid[d] < 0 || grid[d] >= (metadata_.shape[d] + c - 1) / c) {
      return InvalidArgumentError(
          StrCat(what, ": chunk [", StrJoin(grid, ", "), "] is outside the array's grid"));
    }
    chunk_box.origin[d] = grid[d] * c;
  }
  return WriteChunkFrom(grid, data, Intersect(chunk_box, Box::FromShape(metadata_.shape)));
}

Status ZarrArrayWriter::WriteBox(const Box& box, const void* data, ThreadPool* pool) const {
  const std::string what = StrCat("write of ", ArrayWhat(prefix_));
  if (box.rank() != metadata_.rank()) {
    return InvalidArgumentError(StrCat(what, ": box ", box.ToString(), " has rank ", box.rank(),
                                       " but the array has rank ", metadata_.rank()));
  }
  TS_RETURN_IF_ERROR(ValidateBox(box, ItemSize(metadata_.dtype), what));
  if (!Box::FromShape(metadata_.shape).Contains(box)) {
    return InvalidArgumentError(StrCat(what, ": box ", box.ToString(), " reaches past the shape [",
                                       StrJoin(metadata_.shape, ", "), "]"));
  }
  for (int d = 0; d < box.rank(); ++d) {
    const int64_t c = metadata_.chunk_shape[d];
    const int64_t end = box.origin[d] + box.shape[d];
    if (box.origin[d] % c != 0 || (end % c != 0 && end != metadata_.shape[d])) {
      return InvalidArgumentError(StrCat(what, ": box ", box.ToString(),
                                         " does not cover whole chunks of shape [",
                                         StrJoin(metadata_.chunk_shape, ", "), "]"));
    }
  }
  if (box.empty()) return OkStatus();
  return ForEachChunkMaybeParallel(metadata_.chunk_shape, box, pool,
                                   [&](const std::vector<int64_t>& grid, const Box&) {
                                     return WriteChunkFrom(grid, data, box);
                                   });
}

Status ZarrArrayWriter::WriteChunkFrom(const std::vector<int64_t>& grid, const void* data,
                                       const Box& data_box) const {
  const std::string key = JoinKey(prefix_, ZarrChunkKey(metadata_, grid));
  const std::string what = StrCat(ArrayWhat(prefix_), ", chunk '", key, "'");
  const Box chunk_box = ChunkBoxAt(grid, metadata_.chunk_shape);
  const Box inside = Intersect(chunk_box, Box::FromShape(metadata_.shape));
  // Zarr chunks are always whole: the part past the shape holds the fill value.
  std::string raw(static_cast<size_t>(chunk_box.num_elements()) * ItemSize(metadata_.dtype), '\0');
  if (inside != chunk_box) FillBox(chunk_box, metadata_.fill_value, raw.data(), chunk_box);
  TS_RETURN_IF_ERROR(CopyBox(inside, metadata_.dtype, data, data_box, metadata_.dtype, raw.data(),
                             chunk_box, what));
  if (AllEqualTo(raw, metadata_.fill_value)) {
    // Reads give the fill value for a missing chunk; drop a stale one.
    Status deleted = kv_->Delete(key);
    if (!deleted.ok() && !absl::IsNotFound(deleted)) return Annotate(deleted, what);
    return OkStatus();
  }
  std::string encoded;
  TS_RETURN_IF_ERROR(EncodeZarrChunk(metadata_.codecs, metadata_.dtype, metadata_.chunk_shape,
                                     metadata_.fill_value, raw, &encoded, what));
  return Annotate(kv_->Write(key, encoded), what);
}

}  // namespace tensorstash
