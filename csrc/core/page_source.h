// Page-aligned, pre-faulted anonymous memory: the host backend's chunks, the
// pageable spill area, and the pages the CUDA backend registers as pinned.
#pragma once

#include "arena.h"

namespace offcache {

class PageSource : public ChunkSource {
 public:
  // dont_fork: the pages are not copied into a forked child (pinned chunks:
  // a DataLoader worker must not duplicate the arena).
  explicit PageSource(bool dont_fork = false) : dont_fork_(dont_fork) {}
  void* allocate(size_t bytes, std::string* error) override;
  void release(void* ptr, size_t bytes) noexcept override;
  bool pinned() const override { return false; }

 private:
  bool dont_fork_;
};

}  // namespace offcache
