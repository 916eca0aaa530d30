#include "tensorstash/format/zarr/zarr_array.h"

#include <cstring>
#include <functional>

#include <zstd.h>

#include "tensorstash/array/convert.h"
#include "tensorstash/format/zarr/zarr_codec.h"

namespace tensorstash {
namespace {

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
    Box chunk_box(std::vector<int64_t>(rank), chunk_shape);
    for (int d = 0; d < rank; ++d) chunk_box.origin[d] = grid[d] * chunk_shape[d];
    TS_RETURN_IF_ERROR(fn(grid, chunk_box));
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
  TaskGroup group(pool);
  Status status = ForEachChunk(chunk_shape, region, [&](const std::vector<int64_t>& grid,
                                                        const Box& chunk_box) {
    if (group.failed()) return OkStatus();  // Wait() reports the error
    group.Run([&fn, grid, chunk_box] { return fn(grid, chunk_box); });
    return OkStatus();
  });
  Status waited = group.Wait();
  return status.ok() ? waited : status;
}

}  // namespace

// ---- ZarrArray ----

ZarrArray::ZarrArray(KvStore* kv, std::string prefix, ZarrMetadata metadata)
    : kv_(kv), prefix_(std::move(prefix)), metadata_(std::move(metadata)) {}

Result<std::unique_ptr<ZarrArray>> ZarrArray::Open(KvStore* kv, std::string prefix) {
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  const std::string what = ArrayWhat(prefix);
  TS_RETURN_IF_ERROR(Annotate(ValidatePrefix(prefix), what));
  Result<std::string> v3 = kv->Read(JoinKey(prefix, "zarr.json"));
  if (v3.ok()) {
    TS_ASSIGN_OR_RETURN(ZarrMetadata m, ParseZarrV3Metadata(*v3, what));
    return std::unique_ptr<ZarrArray>(new ZarrArray(kv, std::move(prefix), std::move(m)));
  }
  if (!absl::IsNotFound(v3.status())) return Annotate(v3.status(), what);
  Result<std::string> v2 = kv->Read(JoinKey(prefix, ".zarray"));
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
  if (!CanConvert(metadata_.dtype, dest_dtype)) {
    return InvalidArgumentError(StrCat(what, ": cannot convert stored ",
                                       DTypeName(metadata_.dtype), " to ", DTypeName(dest_dtype)));
  }
  if (box.empty()) return OkStatus();
  if (dest == nullptr) return InvalidArgumentError(StrCat(what, ": no destination"));
  std::string dest_fill(ItemSize(dest_dtype), '\0');
  TS_RETURN_IF_ERROR(ConvertElements(metadata_.dtype, metadata_.fill_value.data(), dest_dtype,
                                     dest_fill.data(), 1, StrCat(what, ": fill_value")));
  const Box shape_box = Box::FromShape(metadata_.shape);
  if (!shape_box.Contains(box)) {
    // Zeros where the box reaches past the shape, as CheckpointReader does.
    std::memset(dest, 0, static_cast<size_t>(box.num_elements()) * ItemSize(dest_dtype));
  }
  const Box inside = Intersect(box, shape_box);
  if (inside.empty()) return OkStatus();
  return ForEachChunkMaybeParallel(
      metadata_.chunk_shape, inside, pool,
      [&](const std::vector<int64_t>& grid, const Box& chunk_box) {
        return ReadChunk(grid, Intersect(chunk_box, inside), box, dest_dtype, dest, dest_fill,
                         staging);
      });
}

Status ZarrArray::ReadChunkInPlace(const std::string& key, const Box& chunk_box,
                                   const Box& region, const Box& box, DType dest_dtype,
                                   void* dest, const std::string& dest_fill,
                                   StagingPool* staging, bool* done) const {
  *done = false;
  const std::vector<ZarrCodec>& codecs = metadata_.codecs;
  const size_t item = ItemSize(metadata_.dtype);
  const bool plain_bytes = !codecs.empty() && codecs[0].kind == ZarrCodecKind::kBytes &&
                           (!codecs[0].big_endian || item == 1);
  const bool zstd = codecs.size() == 2 && codecs[1].kind == ZarrCodecKind::kZstd;
  if (staging == nullptr || !plain_bytes || !(codecs.size() == 1 || zstd) ||
      dest_dtype != metadata_.dtype || !(region == chunk_box) || !IsContiguousIn(chunk_box, box)) {
    return OkStatus();
  }
  *done = true;
  const std::string what = StrCat(ArrayWhat(prefix_), ", chunk '", key, "'");
  const uint64_t bytes = static_cast<uint64_t>(chunk_box.num_elements()) * item;
  char* out = static_cast<char*>(dest) + ByteOffsetIn(chunk_box, box, item);
  Result<std::unique_ptr<ReadableFile>> file = kv_->OpenForRead(key);
  if (absl::IsNotFound(file.status())) {
    FillBox(region, dest_fill, dest, box);
    return OkStatus();
  }
  if (!file.ok()) return Annotate(file.status(), what);
  const uint64_t size = (*file)->size();
  if (codecs.size() == 1) {  // uncompressed: read into place
    if (size != bytes) {
      return DataLossError(StrCat(what, ": chunk holds ", size, " bytes, expected ", bytes));
    }
    return Annotate((*file)->ReadAt(0, size, out), what);
  }
  // More stored bytes than the chunk can compress to (skippable frames, say, or a hostile
  // size): the general path, which bounds what it reads and decodes.
  if (size > ZSTD_compressBound(bytes) + 4096) {
    *done = false;
    return OkStatus();
  }
  StagingPool::Lease stored = staging->Acquire(size);
  TS_RETURN_IF_ERROR(Annotate((*file)->ReadAt(0, size, stored.data()), what));
  return ZstdDecodeInto(std::string_view(stored.data(), size), out, bytes, what);
}

Status ZarrArray::ReadChunk(const std::vector<int64_t>& grid, const Box& region, const Box& box,
                            DType dest_dtype, void* dest, const std::string& dest_fill,
                            StagingPool* staging) const {
  const std::string key = ChunkKey(grid);
  const std::string what = StrCat(ArrayWhat(prefix_), ", chunk '", key, "'");
  Box chunk_box(std::vector<int64_t>(grid.size()), metadata_.chunk_shape);
  for (size_t d = 0; d < grid.size(); ++d) chunk_box.origin[d] = grid[d] * metadata_.chunk_shape[d];
  if (metadata_.sole_sharding() == nullptr) {
    bool done = false;
    TS_RETURN_IF_ERROR(ReadChunkInPlace(key, chunk_box, region, box, dest_dtype, dest, dest_fill,
                                        staging, &done));
    if (done) return OkStatus();
  }

  if (const ZarrCodec* sharding = metadata_.sole_sharding()) {
    // Read the whole shard in one request when all of it is wanted; else its index and the
    // inner chunks that meet the region, each by a ranged read.
    const bool whole = region == Intersect(chunk_box, Box::FromShape(metadata_.shape));
    std::string shard;
    uint64_t size = 0;
    ShardByteReader reader;
    if (whole) {
      Result<std::string> r = kv_->Read(key);
      if (absl::IsNotFound(r.status())) {
        FillBox(region, dest_fill, dest, box);
        return OkStatus();
      }
      if (!r.ok()) return Annotate(r.status(), what);
      shard = std::move(*r);
      size = shard.size();
      reader = [&shard](uint64_t offset, uint64_t length, std::string* out) {
        out->assign(shard, offset, length);  // the index entries were checked against the size
        return OkStatus();
      };
    } else {
      Result<uint64_t> r = kv_->Size(key);
      if (absl::IsNotFound(r.status())) {
        FillBox(region, dest_fill, dest, box);
        return OkStatus();
      }
      if (!r.ok()) return Annotate(r.status(), what);
      size = *r;
      reader = [&](uint64_t offset, uint64_t length, std::string* out) {
        out->resize(length);
        return Annotate(kv_->ReadRange(key, offset, length, out->data()), what);
      };
    }
    return ReadShardRegion(*sharding, metadata_.dtype, metadata_.fill_value, size, reader,
                           chunk_box, region, dest_dtype, dest, box, dest_fill, what);
  }

  Result<std::string> stored = kv_->Read(key);
  if (absl::IsNotFound(stored.status())) {
    FillBox(region, dest_fill, dest, box);
    return OkStatus();
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
    return InvalidArgumentError(StrCat(what, ": zarr_format ", spec.zarr_format,
                                       " (2 or 3 are supported)"));
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
      case ZarrCompressor::kZstd: c.kind = ZarrCodecKind::kZstd; break;
      case ZarrCompressor::kGzip: c.kind = ZarrCodecKind::kGzip; break;
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
      return InvalidArgumentError(StrCat(what, ": chunk [", StrJoin(grid, ", "),
                                         "] is outside the array's grid"));
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
  return ForEachChunkMaybeParallel(
      metadata_.chunk_shape, box, pool,
      [&](const std::vector<int64_t>& grid, const Box&) {
        return WriteChunkFrom(grid, data, box);
      });
}

Status ZarrArrayWriter::WriteChunkFrom(const std::vector<int64_t>& grid, const void* data,
                                       const Box& data_box) const {
  const std::string key = JoinKey(prefix_, ZarrChunkKey(metadata_, grid));
  const std::string what = StrCat(ArrayWhat(prefix_), ", chunk '", key, "'");
  Box chunk_box(std::vector<int64_t>(grid.size()), metadata_.chunk_shape);
  for (size_t d = 0; d < grid.size(); ++d) chunk_box.origin[d] = grid[d] * metadata_.chunk_shape[d];
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
