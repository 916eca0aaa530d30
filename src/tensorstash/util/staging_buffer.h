// StagingBuffer: an uninitialized byte buffer for chunk staging that returns its memory to the
// system when destroyed.
//
// Why not `new char[]`: glibc serves large blocks from per-thread arenas once its dynamic mmap
// threshold has grown, and keeps freed arena memory around, so a restore with N reader threads
// could hold N times the byte cap in freed staging memory. Big buffers are mapped and unmapped
// directly instead, which keeps the process's memory within what ByteLimiter admits.
//
// Thread-safety: a buffer is used by one thread at a time.
#ifndef TENSORSTASH_UTIL_STAGING_BUFFER_H_
#define TENSORSTASH_UTIL_STAGING_BUFFER_H_

#include <cstddef>

namespace tensorstash {

class StagingBuffer {
 public:
  StagingBuffer() = default;
  // Allocates `size` bytes (contents unspecified), at least 64-byte aligned. Throws
  // std::bad_alloc like operator new if memory runs out.
  explicit StagingBuffer(size_t size);
  ~StagingBuffer();
  StagingBuffer(StagingBuffer&& other) noexcept;
  StagingBuffer& operator=(StagingBuffer&& other) noexcept;
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void Release();
  char* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_UTIL_STAGING_BUFFER_H_
