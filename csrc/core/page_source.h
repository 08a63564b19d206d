// Page-aligned, pre-touched anonymous memory: the host backend's chunks, the
// pageable spill area, and the pages the CUDA backend registers as pinned.
#pragma once

#include "arena.h"

namespace offcache {

class PageSource : public ChunkSource {
 public:
  void* allocate(size_t bytes, std::string* error) override;
  void release(void* ptr, size_t bytes) noexcept override;
  bool pinned() const override { return false; }
};

}  // namespace offcache
