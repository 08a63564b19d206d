// Page-aligned, pre-faulted anonymous memory: the host backend's chunks, the
// pageable spill area, and the pages the CUDA backend registers as pinned.
#pragma once

#include "arena.h"

namespace offcache {

class PageSource : public ChunkSource {
 public:
  // wipe_on_fork: a forked child sees zero pages instead of copies (pinned
  // chunks: a DataLoader worker must not duplicate the arena; the range stays
  // mapped, so nothing else of the child's lands in it).
  explicit PageSource(bool wipe_on_fork = false) : wipe_on_fork_(wipe_on_fork) {}
  void* allocate(size_t bytes, std::string* error) override;
  void release(void* ptr, size_t bytes) noexcept override;
  bool pinned() const override { return false; }

 private:
  bool wipe_on_fork_;
};

}  // namespace offcache
