// StagingBuffer: an uninitialized byte buffer for chunk staging that returns its memory to the
// system when destroyed.
//
// Why not `new char[]`: glibc serves large blocks from per-thread arenas once its dynamic mmap
// threshold has grown, and keeps freed arena memory around, so a restore with N reader threads
// could hold N times the byte cap in freed staging memory. Big buffers are mapped directly
// instead, which keeps the process's memory within what ByteLimiter admits.
//
// Freed buffers of 1 MiB and more are kept for reuse, up to 1 GiB in the process (the variable
// TENSORSTASH_KEEP_FREED_BYTES sets that cap; 0 unmaps them at once): memory the process
// already has costs a quarter of fresh memory to fill. A new mapped buffer is cut from the
// smallest kept one that holds it (the rest stays kept); when none does, kept ones of at least
// its size are unmapped before it is mapped, so kept plus live memory does not grow past what
// it would have been without keeping.
//
// Thread-safety: a buffer is used by one thread at a time.
#ifndef TENSORSTASH_UTIL_STAGING_BUFFER_H_
#define TENSORSTASH_UTIL_STAGING_BUFFER_H_

#include <cstddef>
#include <cstdint>

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
  size_t mapped_length_ = 0;  // of the mapping, when mapped_ (size_ rounded up)
  bool mapped_ = false;
};

// Bytes of freed buffers kept for reuse in this process now (for tests and statistics).
uint64_t StagingBufferKeptBytes();

// Unmaps every kept buffer now (memory back to the system; buffers in use are not affected).
void ReleaseKeptStagingBuffers();

}  // namespace tensorstash

#endif  // TENSORSTASH_UTIL_STAGING_BUFFER_H_
