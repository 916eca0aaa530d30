#include "tensorstash/util/prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older C libraries lack the name
#endif

namespace tensorstash {
namespace {

// Below this, the system call costs about what the page faults it saves do.
constexpr size_t kMinPrefaultBytes = 256 * 1024;

}  // namespace

void PrefaultForWrite(void* data, size_t size) {
  if (data == nullptr || size < kMinPrefaultBytes) return;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + size) / page * page;
  if (end <= begin) return;
  // The result is ignored on purpose: see the header.
  (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE);
}

}  // namespace tensorstash
