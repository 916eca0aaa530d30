#include "tensorstash/util/staging_buffer.h"

#include <sys/mman.h>

#include <new>
#include <utility>

namespace tensorstash {
namespace {

// Below this, malloc's own small-block handling is cheaper and holds little.
constexpr size_t kMapFrom = 256 * 1024;
// Small buffers come from the allocator, 64-byte aligned like the mapped ones (XLA's CPU client
// adopts host buffers at such addresses without a copy).
constexpr std::align_val_t kHeapAlignment{64};

}  // namespace

StagingBuffer::StagingBuffer(size_t size) : size_(size) {
  if (size == 0) return;
  if (size >= kMapFrom) {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();  // as operator new would
    data_ = static_cast<char*>(p);
    mapped_ = true;
  } else {
    data_ = static_cast<char*>(::operator new(size, kHeapAlignment));
  }
}

StagingBuffer::~StagingBuffer() { Release(); }

StagingBuffer::StagingBuffer(StagingBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, false)) {}

StagingBuffer& StagingBuffer::operator=(StagingBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, false);
  }
  return *this;
}

void StagingBuffer::Release() {
  if (data_ == nullptr) return;
  if (mapped_) {
    ::munmap(data_, size_);
  } else {
    ::operator delete(data_, kHeapAlignment);
  }
  data_ = nullptr;
}

}  // namespace tensorstash
