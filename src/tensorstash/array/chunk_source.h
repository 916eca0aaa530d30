// ChunkSource: a producer of an array's values over a box, called by a writer when it writes
// the chunk that box covers, so that an array need never be held whole in memory (the CLI's
// convert reads each chunk from the source checkpoint as it is written). Both writers take it:
// CheckpointWriter::AddArray and OrbaxWriter::AddArray.
#ifndef TENSORSTASH_ARRAY_CHUNK_SOURCE_H_
#define TENSORSTASH_ARRAY_CHUNK_SOURCE_H_

#include <functional>

#include "tensorstash/array/box.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// Fills `dest` (C order over `box`, in the array's dtype; `box` in the array's coordinates) with
// the array's values over `box`, or returns why it cannot (the writer fails with that error,
// annotated with the array). Called from several threads at once.
using ChunkSource = std::function<Status(const Box& box, void* dest)>;

}  // namespace tensorstash

#endif  // TENSORSTASH_ARRAY_CHUNK_SOURCE_H_
