#include "page_source.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

namespace offcache {

void* PageSource::allocate(size_t bytes, std::string* error) {
  // MAP_POPULATE touches every page now, so later copies never fault.
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                 -1, 0);
  if (p == MAP_FAILED) {
    if (error) {
      *error = "mmap of " + std::to_string(bytes) + " bytes failed: " + std::strerror(errno);
    }
    return nullptr;
  }
  return p;
}

void PageSource::release(void* ptr, size_t bytes) noexcept { munmap(ptr, bytes); }

}  // namespace offcache
