#include "tensorstash/util/staging_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

namespace tensorstash {
namespace {

// Below this, malloc's own small-block handling is cheaper and holds little.
constexpr size_t kMapFrom = 256 * 1024;
// Small buffers come from the allocator, 64-byte aligned like the mapped ones (XLA's CPU client
// adopts host buffers at such addresses without a copy).
constexpr std::align_val_t kHeapAlignment{64};

// Freed mappings from this size on are kept for reuse (FreedMappings), their lengths rounded up
// to a multiple of kReuseGranule so that buffers of nearly the same size fit each other.
constexpr size_t kReuseFrom = size_t{1} << 20;
constexpr size_t kReuseGranule = size_t{64} << 10;
constexpr uint64_t kDefaultReuseCap = uint64_t{1} << 30;

// Why: on the VMs we measure on, the first write to fresh memory costs four times a copy of the
// same bytes (faulting in, zeroing and charging each page: 0.13 s for 288 MiB, against 0.04 s to
// write memory a process already has). A restore late in a job, after the process freed the
// buffers of earlier restores and saves, paid that again for every byte (issue 38, part 7).
// Freed mappings are kept, up to a cap, and handed out again before new memory is mapped.
//
// Bounded: at most the cap is held after buffers are freed, and a mapping that finds nothing to
// reuse first unmaps kept ones of at least its own length, so kept plus live memory never grows
// past what the process would have held without the cache. TENSORSTASH_KEEP_FREED_BYTES sets the
// cap (0: unmap at once).
class FreedMappings {
 public:
  static FreedMappings& Get() {
    static FreedMappings* const cache = new FreedMappings();  // never destroyed: used at exit
    return *cache;
  }

  static size_t Length(size_t size) {
    const size_t granule = size >= kReuseFrom ? kReuseGranule : Page();
    return (size + granule - 1) / granule * granule;
  }

  // Memory of `length` bytes cut from the smallest kept mapping that holds it (the rest stays
  // kept when it is of reuse size, else is unmapped); nullptr if every kept mapping is smaller.
  // Then kept mappings of at least `length` bytes in all are unmapped (the oldest first), for
  // the new mapping the caller makes.
  void* Take(size_t length) {
    std::vector<std::pair<void*, size_t>> drop;  // unmapped after the lock is dropped
    char* taken = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto best = kept_.end();
      for (auto it = kept_.begin(); it != kept_.end(); ++it) {
        if (it->second >= length && (best == kept_.end() || it->second < best->second)) best = it;
      }
      if (best != kept_.end()) {
        char* p = static_cast<char*>(best->first);
        const size_t rest = best->second - length;
        kept_bytes_ -= length;
        if (rest >= kReuseFrom) {
          *best = {p + length, rest};
        } else {
          kept_bytes_ -= rest;
          kept_.erase(best);
          if (rest > 0) drop.emplace_back(p + length, rest);
        }
        taken = p;
      } else {
        for (size_t freed = 0; freed < length && !kept_.empty(); kept_.pop_front()) {
          freed += kept_.front().second;
          kept_bytes_ -= kept_.front().second;
          drop.push_back(kept_.front());
        }
      }
    }
    for (const auto& [p, n] : drop) ::munmap(p, n);
    return taken;
  }

  void ReleaseAll() {
    std::deque<std::pair<void*, size_t>> drop;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      drop.swap(kept_);
      kept_bytes_ = 0;
    }
    for (const auto& [p, n] : drop) ::munmap(p, n);
  }

  uint64_t kept_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return kept_bytes_;
  }

  // Keeps the mapping [p, p + length), unmapping the oldest kept ones past the cap.
  void Put(void* p, size_t length) {
    if (length < kReuseFrom || length > cap_) {
      ::munmap(p, length);
      return;
    }
    std::vector<std::pair<void*, size_t>> drop;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      kept_.emplace_back(p, length);
      kept_bytes_ += length;
      while (kept_bytes_ > cap_) {
        drop.push_back(kept_.front());
        kept_bytes_ -= kept_.front().second;
        kept_.pop_front();
      }
    }
    for (const auto& [q, n] : drop) ::munmap(q, n);
  }

 private:
  FreedMappings() : cap_(CapFromEnvironment()) {}

  static size_t Page() {
    static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    return page;
  }

  static uint64_t CapFromEnvironment() {
    const char* text = std::getenv("TENSORSTASH_KEEP_FREED_BYTES");
    if (text == nullptr || *text == '\0') return kDefaultReuseCap;
    char* end = nullptr;
    const unsigned long long value = std::strtoull(text, &end, 10);
    return (end != nullptr && *end == '\0') ? value : kDefaultReuseCap;
  }

  const uint64_t cap_;
  std::mutex mutex_;
  std::deque<std::pair<void*, size_t>> kept_;  // oldest first
  uint64_t kept_bytes_ = 0;
};

}  // namespace

StagingBuffer::StagingBuffer(size_t size) : size_(size) {
  if (size == 0) return;
  if (size >= kMapFrom) {
    FreedMappings& freed = FreedMappings::Get();
    const size_t length = FreedMappings::Length(size);
    void* p = freed.Take(length);
    if (p == nullptr) {
      p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();  // as operator new would
    }
    data_ = static_cast<char*>(p);
    mapped_length_ = length;
    mapped_ = true;
  } else {
    data_ = static_cast<char*>(::operator new(size, kHeapAlignment));
  }
}

StagingBuffer::~StagingBuffer() { Release(); }

StagingBuffer::StagingBuffer(StagingBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_length_(std::exchange(other.mapped_length_, 0)),
      mapped_(std::exchange(other.mapped_, false)) {}

StagingBuffer& StagingBuffer::operator=(StagingBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_length_ = std::exchange(other.mapped_length_, 0);
    mapped_ = std::exchange(other.mapped_, false);
  }
  return *this;
}

void StagingBuffer::Release() {
  if (data_ == nullptr) return;
  if (mapped_) {
    FreedMappings::Get().Put(data_, mapped_length_);
  } else {
    ::operator delete(data_, kHeapAlignment);
  }
  data_ = nullptr;
}

uint64_t StagingBufferKeptBytes() { return FreedMappings::Get().kept_bytes(); }

void ReleaseKeptStagingBuffers() { FreedMappings::Get().ReleaseAll(); }

}  // namespace tensorstash
