#include "tensorstash/util/staging_buffer.h"

#include <sys/mman.h>

#include <new>
#include <utility>

namespace tensorstash {
namespace {

// Below this, malloc's own small-block handling is cheaper and holds little.
constexpr size_t kMapFrom = 256 * 1024;
// From this size a mapping asks for transparent huge pages (where the system's setting is
// "madvise", the common default, nothing else gives them): one page fault per 2 MiB instead of
// 512. Restores fill fresh buffers, and on a virtual machine a 4 KiB fault is dear: perf of a
// reshard restore (512 MiB into fresh 16 MiB boxes) showed a third of its samples in the
// kernel's fault path and page clearing; touching 512 MiB took 340-390 ms in 4 KiB pages and
// 55-75 ms in huge pages here.
constexpr size_t kHugePagesFrom = size_t{2} << 20;

}  // namespace

StagingBuffer::StagingBuffer(size_t size) : size_(size) {
  if (size == 0) return;
  if (size >= kMapFrom) {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();  // as operator new would
    data_ = static_cast<char*>(p);
    mapped_ = true;
    // Advice only: where huge pages are off or none are free, the mapping works as before.
    if (size >= kHugePagesFrom) (void)::madvise(p, size, MADV_HUGEPAGE);
  } else {
    data_ = new char[size];
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
    delete[] data_;
  }
  data_ = nullptr;
}

}  // namespace tensorstash
