// MaterializeStep: a self-contained copy of a native step. An incremental step (docs/format.md
// 6.1) reads chunks from the steps it depends on; its copy holds every chunk itself, so that it
// restores once those steps are gone (or away from their root). What `tensorstash convert
// --materialize` writes, for callers of the library and the Python package.
//
// Thread-safety: a pure function of its arguments; the stores must not be written at the same
// keys meanwhile.
#ifndef TENSORSTASH_CHECKPOINT_MATERIALIZE_H_
#define TENSORSTASH_CHECKPOINT_MATERIALIZE_H_

#include <cstdint>
#include <functional>
#include <string>

#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// Copies step `src_dir` of `src` to step `dst_dir` of `dst` (a step of format 1.0: no
// references, no digests): the same tree, every array with its codec, zstd level and chunk
// size, and the step's committed files (metadata, metrics, per-process state). Each chunk is
// read (CRC-checked, wherever it lies) as the writer writes it, so memory stays at
// `options.max_inflight_bytes`. `progress`, when given, is called after each chunk is read (from
// the writer's threads, never two calls at once) with the bytes read so far and the total; an
// error it returns stops the copy with that error. On success `dst_dir` is committed. Errors: the reader's for
// `src_dir` (NotFound, DataLoss naming the bad chunk or the missing file and its step); the
// writer's for `dst_dir` (AlreadyExists unless options.overwrite); InvalidArgument when
// `options` asks for a base or a holding. On error nothing new is visible at `dst_dir`.
Status MaterializeStep(KvStore* src, const std::string& src_dir, KvStore* dst,
                       const std::string& dst_dir, WriterOptions options = {},
                       const std::function<Status(uint64_t done, uint64_t total)>& progress = {});

}  // namespace tensorstash

#endif  // TENSORSTASH_CHECKPOINT_MATERIALIZE_H_
