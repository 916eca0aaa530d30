#include "tensorstash/util/prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace tensorstash {
namespace {

const size_t kPage = static_cast<size_t>(::sysconf(_SC_PAGESIZE));

// A fresh private anonymous mapping of `pages` pages, kept out of transparent huge pages so that
// residency is counted page by page.
class Mapping {
 public:
  explicit Mapping(size_t pages, int prot = PROT_READ | PROT_WRITE) : size_(pages * kPage) {
    void* p = ::mmap(nullptr, size_, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
    if (data_ != nullptr) ::madvise(data_, size_, MADV_NOHUGEPAGE);
  }
  ~Mapping() {
    if (data_ != nullptr) ::munmap(data_, size_);
  }
  char* data() const { return data_; }
  size_t size() const { return size_; }
  // Which pages are resident (mincore).
  std::vector<bool> Resident() const {
    std::vector<unsigned char> v(size_ / kPage);
    EXPECT_EQ(::mincore(data_, size_, v.data()), 0);
    std::vector<bool> out;
    for (unsigned char c : v) out.push_back((c & 1) != 0);
    return out;
  }

 private:
  size_t size_;
  char* data_;
};

// Whether this kernel has MADV_POPULATE_WRITE (Linux 5.14); PrefaultForWrite does nothing
// without it, so the tests of what it does would have nothing to check.
bool KernelCanPopulate() {
  Mapping probe(1);
  return probe.data() != nullptr && ::madvise(probe.data(), kPage, MADV_POPULATE_WRITE) == 0;
}

TEST(PrefaultTest, FaultsInExactlyThePagesWhollyInside) {
  if (!KernelCanPopulate()) GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE";
  Mapping m(128);  // 512 KiB with 4 KiB pages
  ASSERT_NE(m.data(), nullptr);
  for (bool r : m.Resident()) ASSERT_FALSE(r);
  // From the middle of page 1 to the middle of page 126: pages 2..125 are wholly inside.
  PrefaultForWrite(m.data() + kPage + kPage / 2, 125 * kPage);
  const std::vector<bool> resident = m.Resident();
  for (size_t i = 0; i < resident.size(); ++i) {
    EXPECT_EQ(resident[i], i >= 2 && i <= 125) << "page " << i;
  }
}

TEST(PrefaultTest, KeepsTheContents) {
  Mapping m(128);
  ASSERT_NE(m.data(), nullptr);
  // Some pages written before, the rest never touched (they must read as zeros afterwards).
  for (size_t i = 0; i < m.size(); i += 3 * kPage) std::memset(m.data() + i, 0x5A, kPage);
  PrefaultForWrite(m.data() + 100, m.size() - 200);
  for (size_t i = 0; i < m.size(); ++i) {
    const bool written = (i / kPage) % 3 == 0;
    ASSERT_EQ(static_cast<unsigned char>(m.data()[i]), written ? 0x5A : 0) << "byte " << i;
  }
}

TEST(PrefaultTest, SmallRangesAreLeftAlone) {
  if (!KernelCanPopulate()) GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE";
  Mapping m(128);
  ASSERT_NE(m.data(), nullptr);
  PrefaultForWrite(m.data(), 16 * kPage);  // 64 KiB: one system call would cost what it saves
  PrefaultForWrite(nullptr, m.size());
  for (bool r : m.Resident()) EXPECT_FALSE(r);
}

TEST(PrefaultTest, MemoryThatCannotBeWrittenIsNoError) {
  Mapping m(128, PROT_READ);
  ASSERT_NE(m.data(), nullptr);
  PrefaultForWrite(m.data(), m.size());  // the kernel refuses; advisory, so nothing happens
  for (size_t i = 0; i < m.size(); i += kPage) ASSERT_EQ(m.data()[i], 0);
}

}  // namespace
}  // namespace tensorstash
