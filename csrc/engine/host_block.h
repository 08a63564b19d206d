// A host block holding one or more stored tensors. Each stored tensor has a
// Storage of its own bytes (so saving or copying it carries nothing of its
// neighbours), whose DataPtr holds a reference to the block; when the last
// one dies the block goes back to its owner (the engine), which frees it once
// every copy touching it (its fences) has completed.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Storage.h>

#include <atomic>
#include <vector>

#include "core/arena.h"
#include "core/event.h"

namespace offcache {

struct HostBlock;

// What a block goes back to when its last storage dies: the engine that made it.
class BlockOwner {
 public:
  // Takes `block` back (and deletes it); on any thread, the GIL held or not; never throws.
  virtual void release(HostBlock* block) noexcept = 0;
  // Whether a copy touching a block completed; throws when that cannot be known.
  virtual bool fence_done(const EventPtr& event) = 0;

 protected:
  ~BlockOwner() = default;
};

constexpr uint32_t kPageableChunk = UINT32_MAX;    // Block::chunk of a spilled block
constexpr uint32_t kBounceChunk = UINT32_MAX - 1;  // Block::chunk of a pooled disk I/O buffer
constexpr uint32_t kRingChunk = UINT32_MAX - 2;    // Block::chunk of fetch_file's pinned ring
constexpr uint32_t kDiskChunkBit = 1u << 30;  // Block::chunk of a disk block: its disk chunk | this
inline bool on_disk(const Block& b) { return b.chunk < kRingChunk && (b.chunk & kDiskChunkBit); }
constexpr uint32_t kBounceArenaBit =
    1u << 29;  // Block::chunk of a disk I/O buffer in the bounce arena
inline bool from_bounce_arena(const Block& b) {
  return b.chunk < kRingChunk && (b.chunk & kBounceArenaBit);
}
constexpr uint32_t kStagingArenaBit = 1u << 28;  // Block::chunk of host snapshot staging
inline bool from_staging_arena(const Block& b) {
  return b.chunk < kRingChunk && (b.chunk & kStagingArenaBit);
}
// A block of the pinned arena (the values' own), not of a tier or pool beside it.
inline bool in_value_arena(const Block& b) {
  return b.chunk < kRingChunk && !on_disk(b) && !from_bounce_arena(b) && !from_staging_arena(b);
}

struct HostBlock {
  BlockOwner* owner = nullptr;
  Block block;
  EventPtr stored;               // the last copy that wrote the block
  std::vector<EventPtr> fences;  // copies still touching it, one entry per event
  std::atomic<size_t> refs{0};   // storages viewing the block
  bool staging = false;          // a snapshot's transient buffer
  bool pinned() const { return in_value_arena(block); }
  bool disk() const { return on_disk(block); }
  // Adds `event` once; fences that completed are dropped now and then. Never
  // loses one: a query that throws while dropping keeps them all (needs mu_).
  void add_fence(const EventPtr& event);
};

// A storage of `bytes` bytes at `offset` in `block`, holding a reference to
// it; the block is released when its last storage dies.
c10::Storage make_host_storage(HostBlock* block, size_t offset, size_t bytes);
// The HostBlock behind a CPU tensor, or nullptr if offcache did not make it.
HostBlock* host_block_of(const at::Tensor& t);

}  // namespace offcache
