// A host block holding one or more stored tensors. CPU tensors returned by
// store() are views of a Storage whose DataPtr owns the HostBlock; when the
// last view dies the block goes back to the engine, which frees it once
// every copy touching it (its fences) has completed.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Storage.h>

#include <atomic>
#include <memory>
#include <vector>

#include "core/arena.h"
#include "core/event.h"

namespace offcache {

class Engine;

struct HostBlock {
  Engine* engine = nullptr;
  Block block;                   // pageable blocks have chunk == kPageableChunk
  bool pinned = false;           // true: arena memory; false: spilled to pageable memory
  EventPtr stored;               // completion of the store that filled the block
  std::vector<EventPtr> fences;  // store and fetch events still touching it
  // Set when a source was modified in place while the store was copying it.
  std::shared_ptr<std::atomic<bool>> torn;
};

constexpr uint32_t kPageableChunk = UINT32_MAX;

// The storage whose DataPtr owns `block`; freeing it releases the block.
c10::Storage make_host_storage(HostBlock* block);
// The HostBlock behind a CPU tensor, or nullptr if offcache did not make it.
HostBlock* host_block_of(const at::Tensor& t);

}  // namespace offcache
