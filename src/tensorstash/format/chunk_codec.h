// Chunk codecs: how a chunk's raw bytes become stored bytes ("none" or "zstd").
//
// Thread-safety: pure functions (zstd contexts are per call).
#ifndef TENSORSTASH_FORMAT_CHUNK_CODEC_H_
#define TENSORSTASH_FORMAT_CHUNK_CODEC_H_

#include <cstddef>
#include <string>
#include <string_view>

#include "tensorstash/format/tree.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// The most bytes EncodeChunk can produce for `raw_size` input bytes.
size_t MaxEncodedSize(Codec codec, size_t raw_size);

// Encodes `raw` into `out` (resized to the encoded size). kNone copies.
Status EncodeChunk(Codec codec, int level, std::string_view raw, std::string* out);

// Decodes `stored` into exactly `raw_size` bytes at `dest`. A frame that is malformed or does
// not decode to exactly raw_size bytes is DataLoss, prefixed with `what` (array and chunk).
Status DecodeChunk(Codec codec, std::string_view stored, void* dest, size_t raw_size,
                   std::string_view what);

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_CHUNK_CODEC_H_
