// CopyBytes: memcpy for the large copies of saves and restores (staging an async save's arrays,
// filling a restore's destinations).
//
// Why not plain memcpy: glibc's memcpy writes with non-temporal stores (which do not first read
// each destination line into the cache) only above a threshold derived from the last-level
// cache size the CPU reports. A VM may report its host's cache (300 MiB on the 2-core machine
// this was measured on), and then every copy of a chunk or a shard, a few MiB each, takes the
// cached path: 1 GiB in 16 MiB pieces took 151-193 ms with memcpy, 89-94 ms with the streaming
// copy below (one 1 GiB memcpy, which glibc does stream, took 116 ms). Copies this large are not
// read again soon enough for the cache to help.
//
// Thread-safety: like memcpy; the stores are fenced before CopyBytes returns, so that whatever
// hands the destination to another thread afterwards (a mutex, a task queue) publishes them.
#ifndef TENSORSTASH_UTIL_COPY_BYTES_H_
#define TENSORSTASH_UTIL_COPY_BYTES_H_

#include <cstddef>

namespace tensorstash {

// Copies below this size go to memcpy: the cache may still hold them when they are used.
inline constexpr size_t kStreamingCopyBytes = size_t{256} << 10;

// Copies `size` bytes from `src` to `dst` (the ranges must not overlap), as memcpy does; from
// kStreamingCopyBytes on with non-temporal stores on x86-64 (AVX2 where the CPU has it, else
// SSE2), elsewhere with memcpy. Never fails.
void CopyBytes(void* dst, const void* src, size_t size);

// For tests: CopyBytes with the SSE2 stores even where the CPU has AVX2.
void CopyBytesWithoutAvx2(void* dst, const void* src, size_t size);

}  // namespace tensorstash

#endif  // TENSORSTASH_UTIL_COPY_BYTES_H_
