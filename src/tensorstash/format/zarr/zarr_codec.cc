#include "tensorstash/format/zarr/zarr_codec.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>

#include <blosc.h>
#include <zlib.h>
#define ZSTD_STATIC_LINKING_ONLY  // ZSTD_d_stableOutBuffer (zstd >= 1.4.4)
#include <zstd.h>
#include <zstd_errors.h>

#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/endian.h"

namespace tensorstash {
namespace {

constexpr uint64_t kMissing = ~uint64_t{0};  // a shard index entry for an absent inner chunk

uint64_t SatAdd(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_add_overflow(a, b, &r) ? kMissing : r;
}
uint64_t SatMul(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_mul_overflow(a, b, &r) ? kMissing : r;
}

uint64_t NumElements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t e : shape) n = SatMul(n, static_cast<uint64_t>(e));
  return n;
}

// ---- transpose ----

// Copies between a buffer over `shape` (decoded) and one over the permuted shape (encoded,
// dimension k = decoded dimension order[k]), both C order. encode: decoded -> encoded.
void Permute(const char* src, char* dst, const std::vector<int64_t>& shape,
             const std::vector<int>& order, size_t item, bool encode) {
  const int rank = static_cast<int>(shape.size());
  const uint64_t n = NumElements(shape);
  if (n == 0) return;
  std::vector<int64_t> stride(rank, 1);  // decoded strides, in elements
  for (int d = rank - 2; d >= 0; --d) stride[d] = stride[d + 1] * shape[d + 1];
  std::vector<int64_t> tshape(rank), tstride(rank);
  for (int k = 0; k < rank; ++k) {
    tshape[k] = shape[order[k]];
    tstride[k] = stride[order[k]];
  }
  // Walk the encoded buffer in C order; `offset` follows the element in the decoded one.
  std::vector<int64_t> index(rank, 0);
  int64_t offset = 0;
  for (uint64_t j = 0; j < n; ++j) {
    if (encode) {
      std::memcpy(dst + j * item, src + offset * item, item);
    } else {
      std::memcpy(dst + offset * item, src + j * item, item);
    }
    for (int k = rank - 1; k >= 0; --k) {
      offset += tstride[k];
      if (++index[k] < tshape[k]) break;
      offset -= tstride[k] * tshape[k];
      index[k] = 0;
    }
  }
}

// Reverses byte order of each `part`-byte value (complex numbers swap each part).
void SwapBytes(std::string* data, size_t part) {
  if (part <= 1) return;
  for (size_t i = 0; i + part <= data->size(); i += part) {
    std::reverse(data->begin() + i, data->begin() + i + part);
  }
}

size_t SwapUnit(DType dtype) {
  return Kind(dtype) == DTypeKind::kComplex ? ItemSize(dtype) / 2 : ItemSize(dtype);
}

// ---- size bounds ----

uint64_t EncodedBound(const std::vector<ZarrCodec>& codecs, size_t upto, DType dtype,
                      std::vector<int64_t> shape);

// The most bytes the array-to-bytes codec can produce for an array of `shape`.
uint64_t ArrayToBytesBound(const ZarrCodec& ab, DType dtype, const std::vector<int64_t>& shape) {
  if (ab.kind == ZarrCodecKind::kBytes) return SatMul(NumElements(shape), ItemSize(dtype));
  std::vector<int64_t> per_shard(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) per_shard[d] = shape[d] / ab.inner_chunk_shape[d];
  const uint64_t inner =
      EncodedBound(*ab.inner_codecs, ab.inner_codecs->size(), dtype, ab.inner_chunk_shape);
  return SatAdd(ShardIndexBytes(ab, shape), SatMul(NumElements(per_shard), inner));
}

uint64_t BytesToBytesBound(const ZarrCodec& c, uint64_t in) {
  if (c.kind == ZarrCodecKind::kCrc32c) return SatAdd(in, 4);
  // zstd, gzip and blosc expand incompressible data by well under 1/64 plus a header.
  return SatAdd(in, in / 64 + 4096);
}

// Bound on the bytes after applying codecs[0, upto) to an array of `shape` (upto past the
// array-to-bytes codec).
uint64_t EncodedBound(const std::vector<ZarrCodec>& codecs, size_t upto, DType dtype,
                      std::vector<int64_t> shape) {
  uint64_t bound = 0;
  for (size_t i = 0; i < upto; ++i) {
    const ZarrCodec& c = codecs[i];
    if (c.kind == ZarrCodecKind::kTranspose) {
      std::vector<int64_t> t(shape.size());
      for (size_t k = 0; k < shape.size(); ++k) t[k] = shape[c.order[k]];
      shape = std::move(t);
    } else if (c.kind == ZarrCodecKind::kBytes || c.kind == ZarrCodecKind::kSharding) {
      bound = ArrayToBytesBound(c, dtype, shape);
    } else {
      bound = BytesToBytesBound(c, bound);
    }
  }
  return bound;
}

// ---- bytes -> bytes ----

Status TooLarge(std::string_view what, std::string_view codec, uint64_t limit) {
  return DataLossError(StrCat(what, ": ", codec, " data decodes to more than the ", limit,
                              " bytes this chunk can hold"));
}

Status ZstdDecode(std::string_view in, uint64_t limit, std::string* out, std::string_view what) {
  const unsigned long long declared = ZSTD_getFrameContentSize(in.data(), in.size());
  if (declared == ZSTD_CONTENTSIZE_ERROR) {
    return DataLossError(StrCat(what, ": zstd data is malformed"));
  }
  // One frame that declares its size: decode in one call. Otherwise stream.
  if (declared != ZSTD_CONTENTSIZE_UNKNOWN &&
      ZSTD_findFrameCompressedSize(in.data(), in.size()) == in.size()) {
    if (declared > limit) return TooLarge(what, "zstd", limit);
    out->resize(declared);
    return ZstdDecodeInto(in, out->data(), out->size(), what);
  }
  // Frames without a declared size: stream into a buffer grown up to the limit.
  std::unique_ptr<ZSTD_DStream, size_t (*)(ZSTD_DStream*)> ds(ZSTD_createDStream(),
                                                              ZSTD_freeDStream);
  if (!ds) return InternalError("ZSTD_createDStream failed");
  ZSTD_initDStream(ds.get());
  out->resize(std::min<uint64_t>(limit, std::max<uint64_t>(in.size() * 4, 4096)));
  ZSTD_inBuffer input{in.data(), in.size(), 0};
  ZSTD_outBuffer output{out->data(), out->size(), 0};
  for (;;) {
    if (output.pos == output.size) {
      if (output.size >= limit) return TooLarge(what, "zstd", limit);
      out->resize(std::min<uint64_t>(limit, output.size * 2));
      output.dst = out->data();
      output.size = out->size();
    }
    const size_t ret = ZSTD_decompressStream(ds.get(), &output, &input);
    if (ZSTD_isError(ret)) {
      return DataLossError(StrCat(what, ": zstd decompression failed: ", ZSTD_getErrorName(ret)));
    }
    if (ret == 0 && input.pos == input.size) break;  // every frame decoded and flushed
    // Room left to write, no input left, frame unfinished: the data stops early.
    if (input.pos == input.size && output.pos < output.size) {
      return DataLossError(StrCat(what, ": zstd data is truncated"));
    }
  }
  out->resize(output.pos);
  return OkStatus();
}

// Inflates gzip or zlib framing (auto-detected), growing the output up to `limit`.
Status GzipDecode(std::string_view in, uint64_t limit, std::string* out, std::string_view what) {
  if (in.size() >= std::numeric_limits<uInt>::max()) {
    return DataLossError(StrCat(what, ": gzip data of ", in.size(), " bytes is too large"));
  }
  z_stream zs{};
  if (inflateInit2(&zs, 15 + 32) != Z_OK) return InternalError("inflateInit2 failed");
  std::unique_ptr<z_stream, int (*)(z_stream*)> cleanup(&zs, inflateEnd);
  out->resize(std::min<uint64_t>(limit, std::max<uint64_t>(in.size() * 4, 4096)));
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  zs.avail_in = static_cast<uInt>(in.size());
  size_t produced = 0;
  for (;;) {
    if (produced == out->size()) {
      if (produced >= limit) return TooLarge(what, "gzip", limit);
      out->resize(std::min<uint64_t>(limit, out->size() * 2));
    }
    const size_t room = std::min<size_t>(out->size() - produced, std::numeric_limits<uInt>::max());
    zs.next_out = reinterpret_cast<Bytef*>(out->data() + produced);
    zs.avail_out = static_cast<uInt>(room);
    const int ret = inflate(&zs, Z_NO_FLUSH);
    produced += room - zs.avail_out;
    if (ret == Z_STREAM_END) break;
    if (ret == Z_BUF_ERROR && zs.avail_in == 0) {
      return DataLossError(StrCat(what, ": gzip data is truncated"));
    }
    if (ret != Z_OK && ret != Z_BUF_ERROR) {
      return DataLossError(
          StrCat(what, ": gzip data is corrupt (", zs.msg ? zs.msg : "zlib error", ")"));
    }
  }
  if (zs.avail_in != 0) {
    return DataLossError(StrCat(what, ": ", zs.avail_in, " bytes of junk follow the gzip stream"));
  }
  out->resize(produced);
  return OkStatus();
}

Status BloscDecode(std::string_view in, uint64_t limit, std::string* out, std::string_view what) {
  size_t nbytes = 0;
  if (in.size() < BLOSC_MIN_HEADER_LENGTH ||
      blosc_cbuffer_validate(in.data(), in.size(), &nbytes) != 0) {
    return DataLossError(StrCat(what, ": blosc data is malformed or truncated"));
  }
  size_t header_nbytes = 0, cbytes = 0, blocksize = 0;
  blosc_cbuffer_sizes(in.data(), &header_nbytes, &cbytes, &blocksize);
  if (cbytes != in.size()) {
    return DataLossError(StrCat(what, ": blosc header says ", cbytes,
                                " compressed bytes, the "
                                "chunk has ",
                                in.size()));
  }
  if (nbytes > limit) return TooLarge(what, "blosc", limit);
  out->resize(nbytes);
  if (nbytes == 0) return OkStatus();
  const int n = blosc_decompress_ctx(in.data(), out->data(), out->size(), 1);
  if (n < 0 || static_cast<size_t>(n) != nbytes) {
    return DataLossError(StrCat(what, ": blosc decompression failed (", n, ")"));
  }
  return OkStatus();
}

Status Crc32cDecode(std::string_view in, std::string* out, std::string_view what) {
  if (in.size() < 4) return DataLossError(StrCat(what, ": too short for its crc32c"));
  const std::string_view body = in.substr(0, in.size() - 4);
  const uint32_t stored = GetLE32(in.data() + body.size());
  const uint32_t actual = Crc32c(body);
  if (stored != actual) {
    return DataLossError(StrCat(what, ": crc32c mismatch (stored ", Hex32(stored), ", computed ",
                                Hex32(actual), ")"));
  }
  out->assign(body);
  return OkStatus();
}

Status BytesToBytesDecode(const ZarrCodec& c, std::string_view in, uint64_t limit, std::string* out,
                          std::string_view what) {
  switch (c.kind) {
    case ZarrCodecKind::kZstd:
      return ZstdDecode(in, limit, out, what);
    case ZarrCodecKind::kGzip:
      return GzipDecode(in, limit, out, what);
    case ZarrCodecKind::kBlosc:
      return BloscDecode(in, limit, out, what);
    case ZarrCodecKind::kCrc32c:
      return Crc32cDecode(in, out, what);
    default:
      return InternalError("not a bytes-to-bytes codec");
  }
}

Status BytesToBytesEncode(const ZarrCodec& c, DType dtype, std::string_view in, std::string* out,
                          std::string_view what) {
  switch (c.kind) {
    case ZarrCodecKind::kZstd: {
      std::unique_ptr<ZSTD_CCtx, size_t (*)(ZSTD_CCtx*)> cctx(ZSTD_createCCtx(), ZSTD_freeCCtx);
      if (!cctx) return InternalError("ZSTD_createCCtx failed");
      ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_compressionLevel, c.level);
      ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_checksumFlag, c.zstd_checksum ? 1 : 0);
      out->resize(ZSTD_compressBound(in.size()));
      const size_t n = ZSTD_compress2(cctx.get(), out->data(), out->size(), in.data(), in.size());
      if (ZSTD_isError(n)) {
        return InternalError(StrCat(what, ": zstd compression failed: ", ZSTD_getErrorName(n)));
      }
      out->resize(n);
      return OkStatus();
    }
    case ZarrCodecKind::kGzip: {
      z_stream zs{};
      if (deflateInit2(&zs, c.level, Z_DEFLATED, c.zlib_framing ? 15 : 15 + 16, 8,
                       Z_DEFAULT_STRATEGY) != Z_OK) {
        return InternalError("deflateInit2 failed");
      }
      if (in.size() > std::numeric_limits<uInt>::max() / 2) {
        deflateEnd(&zs);
        return InvalidArgumentError(StrCat(what, ": chunk too large for gzip"));
      }
      out->resize(deflateBound(&zs, in.size()) + 32);
      zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
      zs.avail_in = static_cast<uInt>(in.size());
      zs.next_out = reinterpret_cast<Bytef*>(out->data());
      zs.avail_out = static_cast<uInt>(out->size());
      const int ret = deflate(&zs, Z_FINISH);
      const size_t n = zs.total_out;
      deflateEnd(&zs);
      if (ret != Z_STREAM_END) return InternalError(StrCat(what, ": gzip compression failed"));
      out->resize(n);
      return OkStatus();
    }
    case ZarrCodecKind::kBlosc: {
      if (in.size() > static_cast<size_t>(BLOSC_MAX_BUFFERSIZE)) {
        return InvalidArgumentError(
            StrCat(what, ": chunk of ", in.size(), " bytes is too large for blosc"));
      }
      out->resize(in.size() + BLOSC_MAX_OVERHEAD);
      const int typesize =
          c.blosc_typesize > 0 ? c.blosc_typesize : static_cast<int>(ItemSize(dtype));
      const int n =
          blosc_compress_ctx(c.level, c.blosc_shuffle, static_cast<size_t>(typesize), in.size(),
                             in.data(), out->data(), out->size(), c.blosc_cname.c_str(),
                             static_cast<size_t>(c.blosc_blocksize), 1);
      if (n <= 0) {
        return InvalidArgumentError(StrCat(what, ": blosc compression failed (", n,
                                           "; compressor \"", c.blosc_cname, "\")"));
      }
      out->resize(static_cast<size_t>(n));
      return OkStatus();
    }
    case ZarrCodecKind::kCrc32c:
      out->assign(in);
      PutLE32(out, Crc32c(in));
      return OkStatus();
    default:
      return InternalError("not a bytes-to-bytes codec");
  }
}

// ---- sharding ----

std::vector<int64_t> ChunksPerShard(const ZarrCodec& sharding, const std::vector<int64_t>& shape) {
  std::vector<int64_t> out(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) out[d] = shape[d] / sharding.inner_chunk_shape[d];
  return out;
}

// Decodes and checks a shard index: offset/length pairs, one per inner chunk in C order.
Result<std::vector<uint64_t>> DecodeShardIndex(const ZarrCodec& sharding, uint64_t count,
                                               std::string_view bytes, uint64_t shard_size,
                                               std::string_view what) {
  const std::vector<ZarrCodec>& codecs = *sharding.index_codecs;
  std::string data(bytes);
  for (size_t i = codecs.size(); i-- > 1;) {  // the crc32c codecs
    std::string stripped;
    TS_RETURN_IF_ERROR(Crc32cDecode(data, &stripped, StrCat(what, ": shard index")));
    data = std::move(stripped);
  }
  if (data.size() != count * 16) {
    return DataLossError(
        StrCat(what, ": shard index has ", data.size(), " bytes, expected ", count * 16));
  }
  if (codecs[0].big_endian) SwapBytes(&data, 8);
  std::vector<uint64_t> entries(count * 2);
  std::memcpy(entries.data(), data.data(), data.size());
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t offset = entries[2 * i], length = entries[2 * i + 1];
    if (offset == kMissing && length == kMissing) continue;
    uint64_t end;
    if (offset == kMissing || length == kMissing || __builtin_add_overflow(offset, length, &end) ||
        end > shard_size) {
      return DataLossError(StrCat(what, ": shard index entry ", i, " (offset ", offset, ", length ",
                                  length, ") points outside the shard of ", shard_size, " bytes"));
    }
  }
  return entries;
}

std::string InnerName(const std::vector<int64_t>& grid) {
  return StrCat("inner chunk [", StrJoin(grid, ", "), "]");
}

Status EncodeShard(const ZarrCodec& sharding, DType dtype, const std::vector<int64_t>& shape,
                   std::string_view fill, std::string_view raw, std::string* out,
                   std::string_view what) {
  const std::vector<int64_t> per_shard = ChunksPerShard(sharding, shape);
  const uint64_t count = NumElements(per_shard);
  const uint64_t index_bytes = ShardIndexBytes(sharding, shape);
  const int rank = static_cast<int>(shape.size());
  const Box shard_box = Box::FromShape(shape);
  std::vector<uint64_t> entries(count * 2, kMissing);
  std::string data;
  std::string inner_raw, encoded;
  std::vector<int64_t> grid(rank, 0);
  const size_t inner_bytes = NumElements(sharding.inner_chunk_shape) * ItemSize(dtype);
  for (uint64_t i = 0; i < count; ++i) {
    Box inner_box(std::vector<int64_t>(rank), sharding.inner_chunk_shape);
    for (int d = 0; d < rank; ++d) inner_box.origin[d] = grid[d] * sharding.inner_chunk_shape[d];
    inner_raw.resize(inner_bytes);
    TS_RETURN_IF_ERROR(
        CopyBox(inner_box, dtype, raw.data(), shard_box, dtype, inner_raw.data(), inner_box, what));
    if (!AllEqualTo(inner_raw, fill)) {
      TS_RETURN_IF_ERROR(EncodeZarrChunk(*sharding.inner_codecs, dtype, sharding.inner_chunk_shape,
                                         fill, inner_raw, &encoded,
                                         StrCat(what, ", ", InnerName(grid))));
      entries[2 * i] = (sharding.index_at_end ? 0 : index_bytes) + data.size();
      entries[2 * i + 1] = encoded.size();
      data += encoded;
    }
    for (int d = rank - 1; d >= 0; --d) {
      if (++grid[d] < per_shard[d]) break;
      grid[d] = 0;
    }
  }
  std::string index(reinterpret_cast<const char*>(entries.data()), entries.size() * 8);
  const std::vector<ZarrCodec>& index_codecs = *sharding.index_codecs;
  if (index_codecs[0].big_endian) SwapBytes(&index, 8);
  for (size_t j = 1; j < index_codecs.size(); ++j) PutLE32(&index, Crc32c(index));
  out->clear();
  out->reserve(index.size() + data.size());
  if (!sharding.index_at_end) *out += index;
  *out += data;
  if (sharding.index_at_end) *out += index;
  return OkStatus();
}

}  // namespace

bool IsNativeBytes(const ZarrCodec& codec, DType dtype) {
  return codec.kind == ZarrCodecKind::kBytes && (!codec.big_endian || ItemSize(dtype) == 1);
}

Status ZstdDecodeInto(std::string_view in, char* out, size_t size, std::string_view what) {
  const unsigned long long declared = ZSTD_getFrameContentSize(in.data(), in.size());
  if (declared == ZSTD_CONTENTSIZE_ERROR)
    return DataLossError(StrCat(what, ": zstd data is malformed"));
  if (declared != ZSTD_CONTENTSIZE_UNKNOWN && declared != size &&
      ZSTD_findFrameCompressedSize(in.data(), in.size()) == in.size()) {
    return DataLossError(StrCat(what, ": chunk decodes to ", declared, " bytes, expected ", size));
  }
  if (declared == size) {
    // The frame says how large it is (TensorStore writes it): one call decodes every frame
    // straight into `out`, with a context kept per thread. The streaming path below decodes
    // through a window buffer of the frame's size, allocated afresh for every chunk and copied
    // out of: profile of a restore of an Orbax checkpoint (1 GiB in 16 MiB chunks), a quarter
    // of the samples in page faults and clearing of those buffers, 12% in the copy.
    thread_local std::unique_ptr<ZSTD_DCtx, size_t (*)(ZSTD_DCtx*)> dctx(ZSTD_createDCtx(),
                                                                         ZSTD_freeDCtx);
    if (!dctx) return InternalError("ZSTD_createDCtx failed");
    const size_t got = ZSTD_decompressDCtx(dctx.get(), out, size, in.data(), in.size());
    if (ZSTD_getErrorCode(got) == ZSTD_error_dstSize_tooSmall) {
      return DataLossError(StrCat(what, ": chunk decodes to more than ", size, " bytes"));
    }
    if (ZSTD_isError(got)) {
      return DataLossError(StrCat(what, ": zstd decompression failed: ", ZSTD_getErrorName(got)));
    }
    if (got != size) {
      return DataLossError(StrCat(what, ": chunk decodes to ", got, " bytes, expected ", size));
    }
    return OkStatus();
  }
  bool given = false;
  return ZstdDecodeStreamInto(
      [&]() -> Result<std::string_view> {
        if (given) return std::string_view();
        given = true;
        return in;
      },
      out, size, what);
}

Status ZstdDecodeStreamInto(const std::function<Result<std::string_view>()>& next, char* out,
                            size_t size, std::string_view what) {
  std::unique_ptr<ZSTD_DCtx, size_t (*)(ZSTD_DCtx*)> ds(ZSTD_createDCtx(), ZSTD_freeDCtx);
  if (!ds) return InternalError("ZSTD_createDCtx failed");
  // `out` stays where it is from call to call: zstd then decodes straight into it, instead of
  // through a window buffer it allocates and copies out of. A library that refuses the
  // parameter decodes through the window buffer, with the same results.
  ZSTD_DCtx_setParameter(ds.get(), ZSTD_d_stableOutBuffer, 1);
  ZSTD_inBuffer input{nullptr, 0, 0};
  ZSTD_outBuffer output{out, size, 0};
  size_t ret = 1;  // 0 once a frame is decoded and flushed and no other has begun
  // The bytes taken since the last frame ended, while they are few: the decoder does not say
  // 0 after skippable frames, so that the end is checked to hold only whole skippable frames.
  constexpr size_t kMaxTail = size_t{64} << 10;
  std::string tail;
  bool long_tail = false;
  for (;;) {
    if (input.pos == input.size) {
      TS_ASSIGN_OR_RETURN(const std::string_view piece, next());
      if (piece.empty()) break;
      input = ZSTD_inBuffer{piece.data(), piece.size(), 0};
    }
    const size_t in_before = input.pos, out_before = output.pos;
    ret = ZSTD_decompressStream(ds.get(), &output, &input);
    // No room for what the data holds beyond `size` bytes: zstd says so, or stops moving.
    const bool stuck = !ZSTD_isError(ret) && input.pos == in_before && output.pos == out_before &&
                       input.pos < input.size;
    if (ZSTD_getErrorCode(ret) == ZSTD_error_dstSize_tooSmall ||
        (stuck && output.pos == output.size)) {
      return DataLossError(StrCat(what, ": chunk decodes to more than ", size, " bytes"));
    }
    // Input left, room left, and nothing moved: never for data zstd can decode; an error
    // rather than a loop that never ends.
    if (stuck) return DataLossError(StrCat(what, ": zstd decompression makes no progress"));
    if (ZSTD_isError(ret)) {
      return DataLossError(StrCat(what, ": zstd decompression failed: ", ZSTD_getErrorName(ret)));
    }
    if (ret == 0) {
      tail.clear();
      long_tail = false;
    } else if (!long_tail) {
      const size_t taken = input.pos - in_before;
      long_tail = tail.size() + taken > kMaxTail;
      if (!long_tail) tail.append(static_cast<const char*>(input.src) + in_before, taken);
    }
  }
  if (ret != 0) {
    bool skippable_only = !long_tail;
    for (std::string_view rest = tail; skippable_only && !rest.empty();) {
      const size_t frame = ZSTD_findFrameCompressedSize(rest.data(), rest.size());
      skippable_only = !ZSTD_isError(frame) && ZSTD_isSkippableFrame(rest.data(), rest.size());
      if (skippable_only) rest.remove_prefix(frame);
    }
    if (!skippable_only) return DataLossError(StrCat(what, ": zstd data is truncated"));
  }
  if (output.pos != size) {
    return DataLossError(
        StrCat(what, ": chunk decodes to ", output.pos, " bytes, expected ", size));
  }
  return OkStatus();
}

uint64_t ShardIndexBytes(const ZarrCodec& sharding, const std::vector<int64_t>& shard_shape) {
  const uint64_t count = NumElements(ChunksPerShard(sharding, shard_shape));
  return SatAdd(SatMul(count, 16), 4 * (sharding.index_codecs->size() - 1));
}

void FillBox(const Box& region, std::string_view item, void* dst, const Box& dst_box) {
  if (region.empty()) return;
  const size_t item_size = item.size();
  const int rank = region.rank();
  const int64_t run = rank == 0 ? 1 : region.shape[rank - 1];
  // One row of the pattern, copied to every row of the region.
  std::string row;
  row.reserve(run * item_size);
  for (int64_t i = 0; i < run; ++i) row += item;
  std::vector<int64_t> stride(rank, 1);
  for (int d = rank - 2; d >= 0; --d) stride[d] = stride[d + 1] * dst_box.shape[d + 1];
  char* base = static_cast<char*>(dst) + ByteOffsetIn(region, dst_box, item_size);
  const int outer = rank - 1;
  std::vector<int64_t> index(std::max(outer, 0), 0);
  for (;;) {
    int64_t off = 0;
    for (int d = 0; d < outer; ++d) off += index[d] * stride[d];
    std::memcpy(base + off * static_cast<int64_t>(item_size), row.data(), row.size());
    int d = outer - 1;
    while (d >= 0) {
      if (++index[d] < region.shape[d]) break;
      index[d] = 0;
      --d;
    }
    if (d < 0) break;
  }
}

bool AllEqualTo(std::string_view data, std::string_view item) {
  const size_t n = item.size();
  if (n == 1) {
    return std::all_of(data.begin(), data.end(), [c = item[0]](char x) { return x == c; });
  }
  for (size_t i = 0; i + n <= data.size(); i += n) {
    if (std::memcmp(data.data() + i, item.data(), n) != 0) return false;
  }
  return true;
}

Status ReadShardRegion(const ZarrCodec& sharding, DType dtype, std::string_view fill_value,
                       uint64_t shard_size, const ShardByteReader& read, const Box& shard_box,
                       const Box& region, DType dst_dtype, void* dst, const Box& dst_box,
                       std::string_view dst_fill, std::string_view what) {
  if (region.empty()) return OkStatus();
  const std::vector<int64_t> per_shard = ChunksPerShard(sharding, shard_box.shape);
  const uint64_t count = NumElements(per_shard);
  const uint64_t index_bytes = ShardIndexBytes(sharding, shard_box.shape);
  if (shard_size < index_bytes) {
    return DataLossError(StrCat(what, ": shard of ", shard_size, " bytes is shorter than its ",
                                index_bytes, "-byte index"));
  }
  std::string index_scratch;
  TS_ASSIGN_OR_RETURN(
      const std::string_view index_data,
      read(sharding.index_at_end ? shard_size - index_bytes : 0, index_bytes, &index_scratch));
  TS_ASSIGN_OR_RETURN(std::vector<uint64_t> entries,
                      DecodeShardIndex(sharding, count, index_data, shard_size, what));
  // Inner chunks of native bytes under zstd (what Orbax writes) are decoded straight from the
  // shard's bytes, as ZarrArray reads unsharded ones: into the destination when one lands whole
  // and contiguous there, else into one buffer reused for every inner chunk. The general path
  // below copies the stored bytes twice and the decoded bytes once more before placing them
  // (the profile of unsharded Orbax chunks: a quarter of the samples faulting in such copies).
  const std::vector<ZarrCodec>& inner = *sharding.inner_codecs;
  const bool plain_zstd =
      inner.size() == 2 && IsNativeBytes(inner[0], dtype) &&
      inner[1].kind == ZarrCodecKind::kZstd &&
      NumElements(sharding.inner_chunk_shape) * ItemSize(dtype) <= kMaxZarrChunkBytes;

  // The inner chunks that meet `region`, as grid ranges.
  const int rank = region.rank();
  const std::vector<int64_t>& inner_shape = sharding.inner_chunk_shape;
  std::vector<int64_t> lo(rank), hi(rank);
  for (int d = 0; d < rank; ++d) {
    const int64_t start = region.origin[d] - shard_box.origin[d];
    lo[d] = start / inner_shape[d];
    hi[d] = (start + region.shape[d] - 1) / inner_shape[d];
  }
  std::vector<int64_t> grid = lo;
  std::string scratch, decoded;
  for (;;) {
    uint64_t linear = 0;
    Box inner_box(std::vector<int64_t>(rank), inner_shape);
    for (int d = 0; d < rank; ++d) {
      linear = linear * per_shard[d] + grid[d];
      inner_box.origin[d] = shard_box.origin[d] + grid[d] * inner_shape[d];
    }
    const Box part = Intersect(inner_box, region);
    const uint64_t offset = entries[2 * linear], length = entries[2 * linear + 1];
    if (offset == kMissing) {
      FillBox(part, dst_fill, dst, dst_box);
    } else {
      const std::string inner_what = StrCat(what, ", ", InnerName(grid));
      TS_ASSIGN_OR_RETURN(const std::string_view stored, read(offset, length, &scratch));
      const size_t item = ItemSize(dtype);
      const uint64_t inner_bytes = NumElements(inner_shape) * item;
      if (plain_zstd && dst_dtype == dtype && part == inner_box &&
          IsContiguousIn(inner_box, dst_box)) {
        char* out = static_cast<char*>(dst) + ByteOffsetIn(inner_box, dst_box, item);
        TS_RETURN_IF_ERROR(ZstdDecodeInto(stored, out, inner_bytes, inner_what));
      } else {
        if (plain_zstd) {
          decoded.resize(inner_bytes);
          TS_RETURN_IF_ERROR(ZstdDecodeInto(stored, decoded.data(), inner_bytes, inner_what));
        } else {
          TS_RETURN_IF_ERROR(
              DecodeZarrChunk(inner, dtype, inner_shape, fill_value, stored, &decoded, inner_what));
        }
        TS_RETURN_IF_ERROR(
            CopyBox(part, dtype, decoded.data(), inner_box, dst_dtype, dst, dst_box, inner_what));
      }
    }
    int d = rank - 1;
    while (d >= 0) {
      if (++grid[d] <= hi[d]) break;
      grid[d] = lo[d];
      --d;
    }
    if (d < 0) break;
  }
  return OkStatus();
}

Status DecodeZarrChunk(const std::vector<ZarrCodec>& codecs, DType dtype,
                       const std::vector<int64_t>& shape, std::string_view fill_value,
                       std::string_view stored, std::string* out, std::string_view what) {
  size_t ab = 0;
  while (codecs[ab].kind == ZarrCodecKind::kTranspose) ++ab;
  // Bytes-to-bytes codecs, last first, each bounded by what the codecs before it can produce.
  std::string current(stored), next;
  for (size_t i = codecs.size(); i-- > ab + 1;) {
    const uint64_t limit = EncodedBound(codecs, i, dtype, shape);
    TS_RETURN_IF_ERROR(BytesToBytesDecode(codecs[i], current, limit, &next, what));
    current.swap(next);
  }
  std::vector<int64_t> encoded_shape = shape;  // after the transposes
  for (size_t i = 0; i < ab; ++i) {
    std::vector<int64_t> t(shape.size());
    for (size_t k = 0; k < shape.size(); ++k) t[k] = encoded_shape[codecs[i].order[k]];
    encoded_shape = std::move(t);
  }
  const uint64_t bytes = NumElements(shape) * ItemSize(dtype);
  if (bytes > kMaxZarrChunkBytes) {
    return InvalidArgumentError(StrCat(what, ": a chunk of ", bytes, " bytes exceeds the ",
                                       kMaxZarrChunkBytes, "-byte limit"));
  }
  const ZarrCodec& c = codecs[ab];
  if (c.kind == ZarrCodecKind::kBytes) {
    if (current.size() != bytes) {
      return DataLossError(
          StrCat(what, ": chunk decodes to ", current.size(), " bytes, expected ", bytes));
    }
    if (c.big_endian) SwapBytes(&current, SwapUnit(dtype));
  } else {
    std::string shard(bytes, '\0');
    const Box box = Box::FromShape(encoded_shape);
    const std::string_view src = current;
    ShardByteReader reader = [&](uint64_t offset, uint64_t length,
                                 std::string*) -> Result<std::string_view> {
      return src.substr(offset, length);  // DecodeShardIndex checked the range
    };
    TS_RETURN_IF_ERROR(ReadShardRegion(c, dtype, fill_value, current.size(), reader, box, box,
                                       dtype, shard.data(), box, fill_value, what));
    current.swap(shard);
  }
  // Undo the transposes, last first.
  for (size_t i = ab; i-- > 0;) {
    std::vector<int64_t> before = shape;  // shape before codec i
    for (size_t j = 0; j < i; ++j) {
      std::vector<int64_t> t(shape.size());
      for (size_t k = 0; k < shape.size(); ++k) t[k] = before[codecs[j].order[k]];
      before = std::move(t);
    }
    next.resize(current.size());
    Permute(current.data(), next.data(), before, codecs[i].order, ItemSize(dtype), false);
    current.swap(next);
  }
  *out = std::move(current);
  return OkStatus();
}

Status EncodeZarrChunk(const std::vector<ZarrCodec>& codecs, DType dtype,
                       const std::vector<int64_t>& shape, std::string_view fill_value,
                       std::string_view raw, std::string* out, std::string_view what) {
  std::string current(raw), next;
  std::vector<int64_t> cur_shape = shape;
  for (const ZarrCodec& c : codecs) {
    switch (c.kind) {
      case ZarrCodecKind::kTranspose: {
        next.resize(current.size());
        Permute(current.data(), next.data(), cur_shape, c.order, ItemSize(dtype), true);
        std::vector<int64_t> t(cur_shape.size());
        for (size_t k = 0; k < t.size(); ++k) t[k] = cur_shape[c.order[k]];
        cur_shape = std::move(t);
        break;
      }
      case ZarrCodecKind::kBytes:
        if (c.big_endian) SwapBytes(&current, SwapUnit(dtype));
        continue;
      case ZarrCodecKind::kSharding:
        TS_RETURN_IF_ERROR(EncodeShard(c, dtype, cur_shape, fill_value, current, &next, what));
        break;
      default:
        TS_RETURN_IF_ERROR(BytesToBytesEncode(c, dtype, current, &next, what));
        break;
    }
    current.swap(next);
  }
  *out = std::move(current);
  return OkStatus();
}

}  // namespace tensorstash
