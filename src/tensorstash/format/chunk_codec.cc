#include "tensorstash/format/chunk_codec.h"

#include <cstring>

#include <zstd.h>

#include "tensorstash/util/copy_bytes.h"

namespace tensorstash {

size_t MaxEncodedSize(Codec codec, size_t raw_size) {
  return codec == Codec::kZstd ? ZSTD_compressBound(raw_size) : raw_size;
}

Status EncodeChunk(Codec codec, int level, std::string_view raw, std::string* out) {
  if (codec == Codec::kNone) {
    out->assign(raw);
    return OkStatus();
  }
  out->resize(ZSTD_compressBound(raw.size()));
  const size_t n = ZSTD_compress(out->data(), out->size(), raw.data(), raw.size(), level);
  if (ZSTD_isError(n)) {
    return InternalError(StrCat("zstd compression failed: ", ZSTD_getErrorName(n)));
  }
  out->resize(n);
  return OkStatus();
}

Status DecodeChunk(Codec codec, std::string_view stored, void* dest, size_t raw_size,
                   std::string_view what) {
  if (codec == Codec::kNone) {
    if (stored.size() != raw_size) {
      return DataLossError(
          StrCat(what, ": stored ", stored.size(), " bytes but the chunk holds ", raw_size));
    }
    CopyBytes(dest, stored.data(), raw_size);
    return OkStatus();
  }
  const unsigned long long declared = ZSTD_getFrameContentSize(stored.data(), stored.size());
  const size_t frame_size = ZSTD_findFrameCompressedSize(stored.data(), stored.size());
  if (declared == ZSTD_CONTENTSIZE_ERROR || declared != raw_size || ZSTD_isError(frame_size) ||
      frame_size != stored.size()) {
    return DataLossError(StrCat(what, ": zstd frame is malformed or of the wrong size"));
  }
  const size_t n = ZSTD_decompress(dest, raw_size, stored.data(), stored.size());
  if (ZSTD_isError(n) || n != raw_size) {
    return DataLossError(StrCat(what, ": zstd decompression failed: ",
                                ZSTD_isError(n) ? ZSTD_getErrorName(n) : "short output"));
  }
  return OkStatus();
}

}  // namespace tensorstash
