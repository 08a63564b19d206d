#include "page_source.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

namespace offcache {
namespace {

// Touches every page now, so later copies never fault. Large chunks are
// touched by several threads: one thread faults in about 2-4 GiB/s.
void prefault(char* p, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  constexpr size_t kPerThread = size_t{64} << 20;
  const size_t hw = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = std::min<size_t>({hw, 8, (bytes + kPerThread - 1) / kPerThread});
  auto touch = [p, page](size_t lo, size_t hi) {
    for (size_t off = lo; off < hi; off += page) p[off] = 0;
  };
  if (threads <= 1) return touch(0, bytes);
  const size_t slice = (bytes / threads + page - 1) / page * page;
  std::vector<std::thread> workers;
  size_t t = 1;
  try {
    for (; t < threads; ++t) {
      workers.emplace_back(touch, std::min(bytes, t * slice), std::min(bytes, (t + 1) * slice));
    }
  } catch (const std::exception&) {  // no thread to be had: this one does the rest
    touch(std::min(bytes, t * slice), bytes);
  }
  touch(0, std::min(bytes, slice));
  for (auto& w : workers) w.join();
}

}  // namespace

void* PageSource::allocate(size_t bytes, std::string* error) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    if (error) {
      *error = "mmap of " + std::to_string(bytes) + " bytes failed: " + std::strerror(errno);
    }
    return nullptr;
  }
  // Transparent huge pages where the kernel allows them: fewer faults and TLB
  // misses; advice only, failures are harmless.
  (void)madvise(p, bytes, MADV_HUGEPAGE);
#ifdef MADV_WIPEONFORK
  if (wipe_on_fork_) (void)madvise(p, bytes, MADV_WIPEONFORK);
#endif
  prefault(static_cast<char*>(p), bytes);
  return p;
}

void PageSource::release(void* ptr, size_t bytes) noexcept { munmap(ptr, bytes); }

}  // namespace offcache
